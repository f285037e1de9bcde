"""ViewSelector: the lexical map on real DriveLM question forms, fusion and fallback, a small trained
selector, the checkpoint round trip and its errors, and the `views` / `train views` commands.

Question forms are DriveLM's own: c-tags (one, two, three),
direction phrases ("to the back left of the ego car"), "front view", multiple-choice options that
must not count as directions, and scene-wide questions that need every view.
"""

from __future__ import annotations

import json

import pytest
import torch

from litevlm.cameras import CAMERAS
from litevlm.cli import build_parser
from litevlm.errors import LiteVLMError
from litevlm.select.views import (
    ViewSelector,
    ViewSelectorConfig,
    keep_mask,
    lexical_views,
    question_words,
)

F, FL, FR, B, BL, BR = CAMERAS

EXPLICIT = [
    # DriveLM perception, per direction
    ("What are objects to the back left of the ego car?", [BL]),
    ("What are objects to the front right of the ego car?", [FR]),
    ("What are objects to the front of the ego car?", [F]),
    ("Are there parked trucks to the back left of the ego car?", [BL]),
    ("Are there moving pedestrians to the front right of the ego car?", [FR]),
    ("What is the status of the cars that are to the back of the ego car?", [B]),
    ("What is the status of the pedestrian that is to the back right of the ego car?", [BR]),
    # "front view"
    ("Is there any traffic element in the front view?", [F]),
    (
        "Identify all the traffic elements in the front view, categorize them, determine their status, and predict "
        "the bounding box around each one. The output should be a list formatted as (c, s, x1, y1, x2, y2), where c "
        "represents the category, s denotes the status, and x1, y1, x2, y2 are the offsets of the top-left and "
        "bottom-right corners of the box relative to the center point.",
        [F],
    ),
    # c-tags: one, two (different cameras), three
    ("Would <c1,CAM_BACK,1088.3,497.5> be in the moving direction of the ego vehicle?", [B]),
    (
        "Based on the observation of <c3,CAM_FRONT,1043.2,82.2>, what actions may <c1,CAM_BACK,1088.3,497.5> take?",
        [F, B],
    ),
    ("Will <c1,CAM_FRONT,812.4,470.0> be in the moving direction of <c2,CAM_FRONT_RIGHT,1210.8,520.2>?", [F, FR]),
    ("Will <c3,CAM_BACK_LEFT,640.1,502.3> change its motion state based on <c1,CAM_BACK,1088.3,497.5>?", [B, BL]),
    (
        "What is the priority of <c1,CAM_FRONT,812.4,470.0>, <c2,CAM_BACK_RIGHT,300.2,510.9> and "
        "<c3,CAM_FRONT_LEFT,402.0,455.5> for the ego vehicle?",
        [F, FL, BR],
    ),
    ("What is the observed status of object <c2,CAM_FRONT_LEFT,402.0,455.5>?", [FL]),
    ("What is the visual description of <c4,CAM_BACK_RIGHT,322.5,520.8>?", [BR]),
    ("Is <c2,CAM_FRONT_LEFT,402.0,455.5> a traffic sign or a road barrier?", [FL]),
    (
        "What actions could the ego vehicle take based on <c1,CAM_FRONT,812.4,470.0>? Why take this action and what's "
        "the probability?",
        [F],
    ),
    ("What actions taken by the ego vehicle can lead to a collision with <c2,CAM_FRONT_LEFT,402.0,455.5>?", [FL]),
    ("Is <c1,CAM_BACK,1088.3,497.5> an object that the ego vehicle should consider in the current scene?", [B]),
    # a motion ("turns left") and multiple-choice options ("Back up.") are not directions
    (
        "What is the probability of colliding with <c1,CAM_FRONT_RIGHT,1210.8,520.2> after the ego vehicle turns left?",
        [FR],
    ),
    (
        "What is the moving status of object <c1,CAM_FRONT,812.4,470.0>? Please select the correct answer from the "
        "following options: A. Back up. B. Turn left. C. Going ahead. D. Stopped.",
        [F],
    ),
    # our generator's other phrasings, and variants it never writes
    ("Is there a car behind us on the right?", [BR]),
    ("What objects are in the rear right camera?", [BR]),
    ("Is the truck in the front-left view moving?", [FL]),
    ("Are there cones on the left side ahead?", [FL]),
    ("Can you see barriers on the right side behind?", [BR]),
    ("What colour is the bus behind the ego vehicle?", [B]),
    ("Is there a pedestrian ahead of us?", [F]),
    ("Is a cyclist visible ahead on the left?", [FL]),
    ("What is the state of the traffic light in CAM_FRONT?", [F]),
    ("Is anything approaching from the left rear?", [BL]),
    ("What is visible in the back-right camera image?", [BR]),
    ("How many cars are on the left side of the ego car?", [FL, BL]),
    ("What can you see in all six cameras?", list(CAMERAS)),
]

SCENE_WIDE = [
    "What are the important objects in the current scene? Those objects will be considered for the future reasoning "
    "and driving decision.",
    "In this scenario, what are safe actions to take for the ego vehicle?",
    "In this scenario, what are dangerous actions to take for the ego vehicle?",
    "Predict the behavior of the ego vehicle.",
    "Predict the behavior of the ego vehicle. Please select the correct answer from the following options: A. The ego "
    "vehicle is steering to the left. The ego vehicle is driving fast. B. The ego vehicle is going straight. The ego "
    "vehicle is not moving. C. The ego vehicle is slightly steering to the right. The ego vehicle is driving slowly. "
    "D. The ego vehicle is steering to the right. The ego vehicle is driving with normal speed.",
    "What object should the ego vehicle notice first when the ego vehicle is getting to the next possible location? "
    "What is the state of the object that is first noticed by the ego vehicle and what action should the ego vehicle "
    "take? What object should the ego vehicle notice second when the ego vehicle is getting to the next possible "
    "location? What is the state of the object perceived by the ego vehicle as second and what action should the ego "
    "vehicle take? What object should the ego vehicle notice third? What is the state of the object perceived by the "
    "ego vehicle as third and what action should the ego vehicle take?",
    "Please describe the relative positioning of the important objects in the current scene.",
    "What is the target action of the ego vehicle?",
    "Describe the current scene.",
]


def named(scores: dict[str, float]) -> list[str]:
    return [c for c in CAMERAS if scores[c] > 0]


# ------------------------------------------------------------------------------------------------
# The lexical map
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("question,views", EXPLICIT)
def test_lexical_map_reads_explicit_questions(question, views):
    scores = lexical_views(question)
    assert list(scores) == list(CAMERAS) and set(scores.values()) <= {0.0, 1.0}
    assert named(scores) == [c for c in CAMERAS if c in views]


@pytest.mark.parametrize("question", SCENE_WIDE)
def test_lexical_map_is_silent_on_scene_wide_questions(question):
    assert named(lexical_views(question)) == []


def test_lexical_map_matches_the_generator_on_explicit_questions():
    from litevlm.data.synthetic import make_frame

    checked = 0
    for i in range(30):
        for qa in make_frame(3, i).qas:
            got = named(lexical_views(qa.question))
            if qa.family == "safe_turn":  # implicit ("turn right"): the learned module's job
                assert got == []
            elif qa.views == CAMERAS:
                assert got == [], qa.question
            else:
                assert got == list(qa.views), qa.question
                checked += 1
    assert checked > 200


def test_module_words_reduce_tags_and_options():
    words = question_words(
        "Based on <c3,CAM_FRONT,1043.2,82.2>, is 3.5 m far? Please select the correct answer from the "
        "following options: A. <c2,CAM_BACK_LEFT,1.0,2.0> B. Back up."
    )
    assert words[:5] == ["[q]", "based", "on", "[tag]", "cam_front"]
    assert "[num]" in words and "back" not in words and words[-3:] == ["[options]", "[tag]", "cam_back_left"]


# ------------------------------------------------------------------------------------------------
# Fusion and fallback, with a stub module
# ------------------------------------------------------------------------------------------------
class StubSelector(ViewSelector):
    """The module replaced by fixed probabilities."""

    def __init__(self, probs: list[float], weight: float, threshold: float):
        super().__init__(
            ViewSelectorConfig(width=8, layers=1, heads=1, ffn=8, buckets=16), weight=weight, threshold=threshold
        )
        self.fixed = torch.tensor(probs)

    def probabilities(self, questions, lexical=None, batch=256):
        return self.fixed.expand(len(questions), -1).clone()


def test_fused_score_is_the_weighted_sum():
    sel = StubSelector([0.2, 0.9, 0.0, 0.4, 0.0, 0.1], weight=0.6, threshold=0.3)
    scores = sel.score("What are objects to the back of the ego car?")
    expected = [0.4 * 0.2, 0.4 * 0.9, 0.0, 0.6 + 0.4 * 0.4, 0.0, 0.4 * 0.1]
    assert list(scores) == list(CAMERAS)
    assert [round(scores[c], 6) for c in CAMERAS] == pytest.approx(expected)
    views, _ = sel.select("What are objects to the back of the ego car?")
    assert views == [FL, B]  # the named camera by its lexical share, the front-left one by the module's


def test_no_view_passes_keeps_all_six():
    sel = StubSelector([0.1] * 6, weight=0.5, threshold=0.4)
    views, scores = sel.select("Predict the behavior of the ego vehicle.")
    assert views == list(CAMERAS) and max(scores.values()) < 0.4
    keep = keep_mask(torch.tensor([[0.1, 0.9, 0, 0, 0, 0], [0.1] * 6]), 0.5)
    assert keep.tolist() == [[False, True, False, False, False, False], [True] * 6]


def test_lexical_only_selector():
    sel = ViewSelector.lexical_only()
    assert sel.select("What are objects to the back left of the ego car?")[0] == [BL]
    assert sel.select("What are the important objects in the current scene?")[0] == list(CAMERAS)


# ------------------------------------------------------------------------------------------------
# A small trained selector
# ------------------------------------------------------------------------------------------------
# Implicit questions as `litevlm label-views` would label them with a language model (hybrid labels).
LLM_LABELS = [
    (f"{lead} {verb} {side}{tail}", [FL, BL] if side == "left" else [FR, BR])
    for lead in ("Is it safe to", "Can we", "Should the ego vehicle", "Is it a good idea to")
    for verb in ("turn", "change lanes to the")
    for side in ("left", "right")
    for tail in ("?", " now?", " at this moment?")
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from litevlm.train.views import ViewRecipe, train_view_selector

    out = tmp_path_factory.mktemp("selector")
    labels = out / "llm_labels.jsonl"
    labels.write_text("".join(json.dumps({"question": q, "views": v, "source": "llm"}) + "\n" for q, v in LLM_LABELS))
    # Small and quick (two layers instead of four); the shipped recipe is ViewRecipe().
    recipe = ViewRecipe(
        frames=100,
        val_frames=40,
        steps=250,
        batch=32,
        lr=5e-3,
        warmup=20,
        width=32,
        layers=2,
        heads=4,
        ffn=64,
        buckets=1024,
        dropout=0.0,
        salads=300,
        minutes=1.0,
    )
    path = train_view_selector(out, recipe, extra_labels=[labels], progress=False)
    return out, path


def test_trained_selector_gives_the_right_views(trained):
    model_dir, path = trained
    sel = ViewSelector.load(model_dir)
    meta = json.loads((path / "config.json").read_text())
    assert meta["validation"]["recall"] >= 0.995 and meta["validation"]["reached"]
    assert sel.weight >= sel.threshold  # a named camera always passes
    for question, views in EXPLICIT:
        assert sel.select(question)[0] == [c for c in CAMERAS if c in views], question
    for question in SCENE_WIDE:
        assert sel.select(question)[0] == list(CAMERAS), question


def test_trained_selector_learns_implicit_questions(trained):
    sel = ViewSelector.load(trained[0])
    assert sel.meta["data"]["extra_train"] + sel.meta["data"]["extra_val"] == len(LLM_LABELS)
    assert sel.select("Is it safe for the ego vehicle to turn left?")[0] == [FL, BL]  # the generator's phrasing
    assert sel.select("Would turning right be safe for the ego car?")[0] == [FR, BR]
    assert sel.select("Can the ego vehicle change lanes to the right safely?")[0] == [FR, BR]


def test_save_load_round_trip_and_mismatch(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir, path = trained
    a = ViewSelector.load(model_dir)
    b = ViewSelector.load(path)  # the folder itself works too
    q = "Can the ego vehicle safely turn right now?"
    assert a.score(q) == b.score(q)
    assert (a.weight, a.threshold, a.target_recall) == (b.weight, b.threshold, 0.995)
    assert a.meta["recipe"]["frames"] == 100 and a.cfg.layers == 2

    state = load_file(str(path / "selector.safetensors"))
    state["latents"] = torch.zeros(6, 16)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(state, str(bad / "selector.safetensors"))
    (bad / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(LiteVLMError, match="latents"):
        ViewSelector.load(bad)
    del state["latents"]
    save_file(state, str(bad / "selector.safetensors"))
    with pytest.raises(LiteVLMError, match="lacks tensor 'latents'"):
        ViewSelector.load(bad)
    with pytest.raises(LiteVLMError, match="train one"):
        ViewSelector.load(tmp_path / "nothing")


def test_views_command_prints_json_last(trained, capsys):
    args = build_parser().parse_args(
        [
            "views",
            "--model",
            str(trained[0]),
            "--question",
            "Would <c1,CAM_BACK,1088.3,497.5> be in the moving direction of the ego vehicle?",
            "--json",
        ]
    )
    args.func(args)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["views"] == [B] and list(out["scores"]) == list(CAMERAS)
    assert set(out) == {"views", "scores"}


def test_recipe_guards_the_held_out_split():
    from litevlm.train.views import ViewRecipe

    with pytest.raises(ValueError, match="held-out"):
        ViewRecipe(val_seed=1)
    with pytest.raises(ValueError, match="held-out"):
        ViewRecipe(seed=1)
    args = build_parser().parse_args(["train", "views", "--out", "x", "--labels", "a.jsonl", "b.jsonl", "--steps", "5"])
    assert args.labels == ["a.jsonl", "b.jsonl"] and args.steps == 5 and callable(args.func)


def test_tag_augmentation_moves_single_tags():
    from litevlm.train.views import augment_tags, dedupe

    q = "Would <c1,CAM_FRONT,547.9,493.5> be in the moving direction of the ego vehicle?"
    out = augment_tags([(q, (F,)), ("Predict the behavior of the ego vehicle.", CAMERAS)])
    assert len(out) == 7 and {v for _, v in out[:6]} == {(c,) for c in CAMERAS}
    assert out[3][0] == q.replace("CAM_FRONT", "CAM_BACK")
    assert len(dedupe(out + [(q.replace("547.9", "12.0"), (F,))])) == 7  # coordinates do not make a new question


def train_without_dropout(sel: ViewSelector) -> None:
    """Training mode (the module path) with every dropout off, so it must give the inference path's logits."""
    sel.train()
    for m in sel.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0


def test_inference_path_equals_the_module_path(trained):
    """The eval-mode inference (one call of `_logits_ops` on raw weights) gives the training modules' logits, padded
    batches included (dropout is the only difference, and it is off in eval)."""
    sel = ViewSelector.load(trained[0])
    with torch.no_grad():
        assert sel._packed_logits() is not None
    questions = [q for q, _ in EXPLICIT[:3]] + SCENE_WIDE[:2] + ["Is <c1,CAM_BACK,700.0,500.0> moving?"]
    ids, mask = sel.cfg.features(questions)
    lex = sel.lexical(questions)
    assert not mask.all()  # questions of different lengths: padding is exercised
    with torch.no_grad():
        fast = sel(ids, mask, lex)
        sel.head[3].bias.add_(1.0)  # an in-place weight change reaches the inference path
        # the inference path's fp32 logits, shifted by exactly 1.0 through the bias: one rounding of values of O(1-10),
        # 1e-5 ~ a few ulp at 10.
        assert torch.allclose(sel(ids, mask, lex), fast + 1.0, atol=1e-5)
        sel.head[3].bias.sub_(1.0)
        train_without_dropout(sel)
        slow = sel(ids, mask, lex)
    # two codes (scripted/fused inference, the modules in training mode): fp32 sums over the 64-wide encoder in another
    # order, ~64 eps x O(10) logits ~ 8e-5 worst case, typically 1e-6; a dropped mask or layer is O(1).
    assert torch.allclose(fast, slow, atol=1e-5), (fast - slow).abs().max()


def test_the_native_inference_equals_the_module_path(trained, monkeypatch):
    """One question at a time (no padding), the native `view_logits` runs and gives the training modules'
    logits; an in-place weight change reaches it too."""
    from litevlm.select import views

    ops = views.native_ops()
    if ops is None:
        pytest.skip("the native CPU code is unavailable here")
    calls = []
    monkeypatch.setattr(views, "native_ops", lambda: calls.append(1) or ops)
    sel = ViewSelector.load(trained[0])
    questions = [q for q, _ in EXPLICIT[:3]] + SCENE_WIDE[:2] + ["Is <c1,CAM_BACK,700.0,500.0> moving?"]
    with torch.no_grad():
        fast = torch.cat([sel(*sel.cfg.features([q]), sel.lexical([q])) for q in questions])
        assert len(calls) == len(questions)
        sel.head[3].bias.add_(1.0)
        moved = torch.cat([sel(*sel.cfg.features([q]), sel.lexical([q])) for q in questions])
        sel.head[3].bias.sub_(1.0)
        train_without_dropout(sel)
        slow = torch.cat([sel(*sel.cfg.features([q]), sel.lexical([q])) for q in questions])
    assert len(calls) == 2 * len(questions)  # training mode runs the modules
    # one question at a time against the padded batch, plus the exact 1.0 bias: fp32 sums of another length.
    assert torch.allclose(moved, fast + 1.0, atol=1e-5)
    # two codes (scripted/fused inference, the modules in training mode): fp32 sums over the 64-wide encoder in another
    # order, ~64 eps x O(10) logits ~ 8e-5 worst case, typically 1e-6; a dropped mask or layer is O(1).
    assert torch.allclose(fast, slow, atol=1e-5), (fast - slow).abs().max()
