"""The VLM training recipe: the dense visual-token targets, batch packing, and a short run end to end."""

import json
import random

import pytest
import torch

from litevlm.cameras import CAMERAS
from litevlm.data.synthetic import STEERS, SceneObject, frame_from_objects
from litevlm.model.vlm import VLM
from litevlm.train.vlm import (
    AuxHeads,
    FrameBank,
    VLMRecipe,
    aux_fields,
    aux_targets,
    cells_of,
    drive_tiny_config,
    field_words,
    make_batch,
    train_vlm,
)

GRID, TPV = 4, 1  # drive-tiny: a 4 x 4 token raster per view, one tile


def field(name: str) -> int:
    return aux_fields().index(name)


def test_aux_targets_mark_the_cells_of_each_object_with_its_attributes():
    car = SceneObject("car", 12.0, 0.0, colour="red", motion="Turn left")
    light = SceneObject("traffic light", 14.0, -5.0, light="green")
    frame = frame_from_objects([car, light])
    t = aux_targets(frame, GRID, TPV)
    assert t.shape == (len(CAMERAS), GRID * GRID, len(aux_fields()))
    front = CAMERAS.index("CAM_FRONT")
    car_cells = cells_of(car.views["CAM_FRONT"].clipped(), GRID, TPV)
    assert car_cells
    for name in ("class:car", "colour:red", "moving", "motion:Turn left"):
        assert t[front, sorted(car_cells), field(name)].all(), name
    assert not t[front, :, field("colour:blue")].any() and not t[front, :, field("class:bus")].any()
    light_cells = cells_of(light.views["CAM_FRONT"].clipped(), GRID, TPV) if "CAM_FRONT" in light.views else set()
    for cam, box in light.views.items():
        cells = sorted(cells_of(box.clipped(), GRID, TPV))
        assert t[CAMERAS.index(cam), cells, field("light:green")].all()
    # Nothing anywhere else: each marked cell belongs to one of the two objects.
    marked = {(v, c) for v, c in (t.sum(-1) > 0).nonzero().tolist()}
    expected = {(front, c) for c in car_cells} | {
        (CAMERAS.index(cam), c) for cam, b in light.views.items() for c in cells_of(b.clipped(), GRID, TPV)
    }
    assert marked == expected and light_cells <= {c for v, c in marked if v == front}
    assert aux_targets(frame_from_objects([]), GRID, TPV).sum() == 0


def test_a_tiny_far_object_still_marks_the_cell_of_its_centre():
    # 40 x 30 px of a 1600 x 900 view: far under 2% of a 400 x 225 cell.
    assert cells_of((1210.0, 500.0, 1250.0, 530.0), GRID, TPV) == {2 * GRID + 3}
    assert cells_of((0.0, 0.0, 1600.0, 900.0), GRID, TPV) == set(range(GRID * GRID))


@pytest.fixture(scope="module")
def tiny_bank():
    from litevlm.data.synthetic import question_corpus
    from litevlm.data.tokenizer import train_default

    tok = train_default(question_corpus(n_frames=40, seed=0), vocab_size=400)
    cfg = drive_tiny_config(tok)
    recipe = VLMRecipe(frames=6, batch_frames=4, render_size=(200, 112))
    return tok, cfg, recipe, FrameBank(recipe, cfg, tok, progress=False)


def test_batches_line_up_tokens_targets_and_front_views(tiny_bank):
    tok, cfg, recipe, bank = tiny_bank
    rng = random.Random(0)
    for _ in range(8):
        b = make_batch(bank, tok, cfg, recipe, rng)
        n = b.pixels.shape[0] * cfg.tokens_per_tile
        assert b.aux.shape == (n, len(aux_fields())) and b.keep.shape == (n,)
        assert int((b.ids == tok.image_id).sum()) == int(b.keep.sum())
        assert len(b.front) == len(b.steer) and all(0 <= s < len(STEERS) for s in b.steer.tolist())
    # The front offsets point at CAM_FRONT's targets: with every view kept, frame i's front view starts at i * 96.
    recipe_all = VLMRecipe(frames=6, batch_frames=4, view_subset_prob=0.0, token_drop_prob=0.0)
    b = make_batch(bank, tok, cfg, recipe_all, random.Random(1))
    per_frame = len(CAMERAS) * cfg.tokens_per_tile
    assert b.front.tolist() == [i * per_frame for i in range(4)]
    frames = [
        f for f in range(6) if torch.equal(bank.aux[f].reshape(-1, bank.aux.shape[-1]).float(), b.aux[:per_frame])
    ]
    assert frames and int(bank.steer[frames[0]]) == int(b.steer[0])


def test_the_probe_heads_learn_what_the_cells_hold(tiny_bank):
    tok, cfg, recipe, bank = tiny_bank
    from litevlm.model.vlm import VLM
    from litevlm.train.vlm import init_vision, init_weights

    torch.manual_seed(0)
    model = VLM(cfg)
    init_weights(model, 0)
    init_vision(model, 0)
    heads = AuxHeads(cfg.text.hidden_size, field_words(tok), len(STEERS), cfg.tokens_per_tile)
    b = make_batch(bank, tok, cfg, recipe, random.Random(0))
    opt = torch.optim.AdamW(
        [*model.vision_tower.parameters(), *model.multi_modal_projector.parameters(), *heads.parameters()], lr=2e-3
    )
    losses = []
    for _ in range(25):
        loss = heads.loss(
            model.encode_tiles(b.pixels).reshape(-1, cfg.text.hidden_size), b, model.language_model.embed_tokens
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_train_vlm_end_to_end(tmp_path):
    """A few steps of the whole recipe: vision warm-up, answers + dense objective, the looks-probe, a loadable
    checkpoint."""
    from litevlm.model.hf import load_native

    recipe = VLMRecipe(
        frames=4,
        steps=4,
        batch_frames=2,
        questions_per_frame=2,
        vision_warmup=2,
        probe_frames=1,
        render_size=(200, 112),
        vocab_size=400,
        warmup=2,
        tokenizer_frames=40,
    )
    out = train_vlm(tmp_path / "m", recipe, progress=False)
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 4 and len(log["aux"]) == 1 and log["final_loss"] > 0
    probe = log["probe"][-1]
    assert probe["step"] == 4
    assert set(probe) == {"step", "images", "empty", "images_needed", "empty_needed"}
    assert all(0 <= probe[k] <= 1 for k in probe if k != "step")
    model = load_native(out)
    assert model.cfg.name == "drive-tiny" and (out / "tokenizer.json").exists()


def test_answer_weights_make_every_answer_count_once(tiny_bank):
    tok, cfg, recipe, bank = tiny_bank
    from litevlm.train.vlm import IGNORE, answer_weights

    b = make_batch(bank, tok, cfg, recipe, random.Random(3))
    sel = b.labels != IGNORE
    assert torch.all(b.weight[~sel] == 0) and torch.all(b.weight[sel] > 0)
    # Each answer is one contiguous run of labels (its tokens and the end token).
    starts = sel[:, 1:] & ~sel[:, :-1]
    n_answers = int(starts.sum() + sel[:, 0].sum())
    assert n_answers >= len(b.ids) and b.weight.sum().item() == pytest.approx(n_answers)
    # Hand-made: answers of 1 and 3 tokens in one row, one of 2 in the other.
    labels = torch.tensor([[IGNORE, 5, IGNORE, 6, 7, 8], [IGNORE, IGNORE, 9, 9, IGNORE, IGNORE]])
    block = torch.tensor([[0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, -1]])
    expected = torch.tensor([[0, 1, 0, 1 / 3, 1 / 3, 1 / 3], [0, 0, 0.5, 0.5, 0, 0]])
    # 1/3 and 1/2 in fp32: one rounding each, assert_close's fp32 defaults.
    torch.testing.assert_close(answer_weights(labels, block), expected)


def test_rescale_visual_caps_the_token_norm(tiny_bank):
    tok, cfg, recipe, bank = tiny_bank
    from litevlm.model.vlm import VLM
    from litevlm.train.vlm import init_weights, rescale_visual

    model = VLM(cfg)
    init_weights(model, 0)
    model.multi_modal_projector.linear_2.weight.data.mul_(500.0)  # tokens far above the cap
    pixels = bank.pixels(0, list(CAMERAS))
    assert model.encode_tiles(pixels).norm(dim=-1).mean() > 8.0
    rescale_visual(model, bank, 4.0)
    with torch.no_grad():
        norms = torch.cat([model.encode_tiles(bank.pixels(f, list(CAMERAS))) for f in range(6)]).norm(dim=-1)
    assert float(norms.mean()) == pytest.approx(4.0, rel=0.25)


def test_continued_training_records_its_lineage(tmp_path):
    from dataclasses import replace

    first = VLMRecipe(
        frames=3,
        steps=2,
        batch_frames=2,
        questions_per_frame=2,
        probe_frames=0,
        render_size=(200, 112),
        vocab_size=400,
        warmup=1,
        tokenizer_frames=40,
    )
    a = train_vlm(tmp_path / "a", first, progress=False)
    b = train_vlm(tmp_path / "b", replace(first, steps=3, init=str(a), reinit_language=True), progress=False)
    meta = json.loads((b / "config.json").read_text())
    assert meta["steps"] == 3 and [s["steps"] for s in meta["lineage"]] == [2]
    assert meta["lineage"][0]["recipe"]["init"] is None and meta["recipe"]["reinit_language"] is True


def test_family_weights_steer_which_questions_a_batch_holds(tiny_bank):
    tok, cfg, _, bank = tiny_bank
    wanted = [qa[0] for qas in bank.qas for qa in qas if qa[4] == "behavior_mc"]
    assert wanted

    def count(recipe) -> int:
        rng, n = random.Random(3), 0
        for _ in range(6):
            rows = make_batch(bank, tok, cfg, recipe, rng).ids.tolist()
            n += sum(any(row[i : i + len(q)] == q for i in range(len(row))) for row in rows for q in wanted)
        return n

    base = dict(frames=6, batch_frames=4, questions_per_frame=2, view_subset_prob=0.0, token_drop_prob=0.0)
    plain = count(VLMRecipe(**base))
    boosted = count(VLMRecipe(**base, family_weights={"behavior_mc": 100.0}))
    assert boosted >= 22 and boosted > 2 * plain  # 24 frames drawn; almost each now asks its behavior_mc question


def test_an_unknown_family_weight_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="unknown QA family 'behaviour_mc'"):
        train_vlm(tmp_path / "m", VLMRecipe(frames=2, steps=1, family_weights={"behaviour_mc": 2.0}), progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("min_keep", [0.1, 0.3])
def test_thinned_frames_keep_a_share_from_min_keep_and_a_token_of_every_view(min_keep):
    from litevlm.train.vlm import drop_visual_tokens

    image, per_view, views = 5, 64, 3
    text = [7, 8, 9]
    ids = text + [image] * (views * per_view) + text
    seq = (ids, [-100] * len(ids), list(range(len(ids))), [0] * len(ids))
    rng = random.Random(0)
    shares = []
    for _ in range(200):
        (out_ids, _, pos, _), keep = drop_visual_tokens(seq, image, views, per_view, rng, min_keep)
        assert out_ids.count(image) == int(keep.sum()) and out_ids[:3] == text and out_ids[-3:] == text
        assert pos == sorted(set(pos)) and [ids[p] for p in pos] == out_ids  # each kept token at its own position
        assert all(keep[v * per_view : (v + 1) * per_view].any() for v in range(views))
        shares.append(keep.float().mean().item())
    assert min(shares) >= min_keep - 0.08 and max(shares) <= 0.95 + 0.08  # the draw, give or take the sampling
    assert min(shares) < min_keep + 0.1  # the low end is reached
    with pytest.raises(ValueError, match="token_drop_min_keep"):
        train_vlm("/nonexistent", VLMRecipe(frames=2, token_drop_min_keep=0.0), progress=False)


def test_tag_targets_point_at_the_tagged_cells_and_the_answer_row(tiny_bank):
    from litevlm.train.vlm import IGNORE, tag_attention_loss, tag_cells

    tok, cfg, _, bank = tiny_bank
    assert tag_cells("Is <c2,CAM_BACK,1065.5,450.0> moving? And <c1,CAM_FRONT,10,890>?", GRID, TPV) == (
        ("CAM_BACK", 2 * GRID + 2),
        ("CAM_FRONT", 3 * GRID + 0),
    )
    recipe = VLMRecipe(frames=6, batch_frames=4, view_subset_prob=0.0, token_drop_prob=0.0, questions_per_frame=6)
    b = make_batch(bank, tok, cfg, recipe, random.Random(0))
    assert b.looks  # synthetic frames ask about tagged objects
    per_view = cfg.tokens_per_tile
    for row, ans_row, visual, cells in b.looks:
        assert len(visual) == len(CAMERAS) * per_view and all(int(b.ids[row, i]) == tok.image_id for i in visual)
        assert (
            set(cells) <= set(visual)
            and int(b.labels[row, ans_row]) != IGNORE
            and int(b.labels[row, ans_row - 1]) == IGNORE
        )
    model = VLM(cfg)
    with torch.no_grad():
        embeds = model.embed(b.ids, model.encode_tiles(b.pixels).reshape(-1, cfg.text.hidden_size)[b.keep])
        loss, hit = tag_attention_loss(model, embeds, b, 0)
    # An untrained head spreads its attention: about log(N / tagged) nats, hits about tagged / N.
    assert 0.5 < float(loss) < 6.0 and 0.0 <= hit <= 1.0


def test_the_tag_attention_objective_trains_end_to_end(tmp_path):
    recipe = VLMRecipe(
        frames=4,
        steps=3,
        batch_frames=2,
        threads=1,
        tokenizer_frames=30,
        vocab_size=400,
        render_size=(200, 112),
        probe_frames=0,
        attn_weight=0.5,
        attn_layer=1,
        token_drop_prob=0.0,
    )
    out = train_vlm(tmp_path / "m", recipe, progress=False)
    log = json.loads((out / "train_log.json").read_text())
    assert log["attn"] and all(v > 0 for v in log["attn"]) and log["recipe"]["attn_weight"] == 0.5
    with pytest.raises(ValueError, match="attn_layer"):
        train_vlm(
            tmp_path / "n",
            VLMRecipe(frames=2, steps=1, tokenizer_frames=30, vocab_size=400, attn_weight=0.5, attn_layer=9),
            progress=False,
        )


def test_option_spans_find_each_option_text(tiny_bank):
    from litevlm.train.vlm import option_spans, right_option

    tok = tiny_bank[0]
    q = (
        "What is <c1,CAM_FRONT,800,450> doing? Please select the correct answer from the following options: "
        "A. Turn left. B. Stopped. C. Going ahead. D. Back up."
    )
    ids = tok.encode(q)
    spans = option_spans(q, tok)
    first = spans[0][0]
    _, lo, hi = spans[right_option("C")]
    assert tok.decode(ids[lo:hi]).strip() == "Going ahead" and tok.decode(ids[first : first + 2]).strip() == "A."
    _, lo, hi = spans[right_option("D")]
    assert tok.decode(ids[lo:hi]).strip() == "Back up" and hi == len(ids) - 1  # the closing full stop is left out
    assert right_option("Yes.") is None  # not a letter
    assert option_spans("Is <c1,CAM_FRONT,800,450> moving?", tok) is None  # no options


def test_option_targets_point_at_the_right_option_from_the_answer_row(tiny_bank):
    from litevlm.train.vlm import IGNORE, tag_attention_loss

    tok, cfg, _, bank = tiny_bank
    recipe = VLMRecipe(frames=6, batch_frames=6, view_subset_prob=0.0, token_drop_prob=0.0, questions_per_frame=20)
    b = make_batch(bank, tok, cfg, recipe, random.Random(0))
    assert b.options  # every frame asks the behavior multiple-choice question
    for row, ans_row, domain, target in b.options:
        letter = tok.decode([int(b.labels[row, ans_row])]).strip()
        assert letter in "ABCD" and int(b.labels[row, ans_row - 1]) == IGNORE
        assert set(target) < set(domain) and max(domain) < ans_row
        options = tok.decode(b.ids[row, domain].tolist())
        right = tok.decode(b.ids[row, sorted(target)].tolist()).strip()
        assert f"{letter}. {right}." in options  # the attended text is the option the letter names
    model = VLM(cfg)
    with torch.no_grad():
        embeds = model.embed(b.ids, model.encode_tiles(b.pixels).reshape(-1, cfg.text.hidden_size)[b.keep])
        loss, hit = tag_attention_loss(model, embeds, b, 0, b.options)
    assert 0.3 < float(loss) < 6.0 and 0.0 <= hit <= 1.0


def test_letter_targets_point_from_each_option_text_at_its_letter(tiny_bank):
    tok, cfg, _, bank = tiny_bank
    recipe = VLMRecipe(frames=6, batch_frames=6, view_subset_prob=0.0, token_drop_prob=0.0, questions_per_frame=20)
    b = make_batch(bank, tok, cfg, recipe, random.Random(0))
    assert len(b.letters) >= 4 * len(b.options)  # every option of every multiple-choice question
    letters_seen = set()
    for row, text_row, domain, (letter,) in b.letters:
        assert domain[-1] == text_row and letter in domain and letter < text_row - 1
        said = tok.decode(b.ids[row, letter:text_row].tolist()).strip()
        assert said[0] in "ABCD" and said[1] == "."  # the letter, its full stop, then the option's text
        letters_seen.add(said[0])
    assert letters_seen == set("ABCD")


def test_the_option_attention_objective_trains_end_to_end(tmp_path):
    recipe = VLMRecipe(
        frames=4,
        steps=3,
        batch_frames=2,
        threads=1,
        tokenizer_frames=30,
        vocab_size=400,
        render_size=(200, 112),
        probe_frames=0,
        attn_weight=0.5,
        attn_layer=2,
        option_weight=0.5,
        option_layer=1,
        letter_weight=0.5,
        letter_layer=1,
        readout_weight=0.5,
        readout_layer=3,
        token_drop_prob=0.0,
    )
    out = train_vlm(tmp_path / "m", recipe, progress=False)
    log = json.loads((out / "train_log.json").read_text())
    assert log["option"] and log["attn"] and log["letter"] and log["readout"]
    assert all(v > 0 for v in log["option"] + log["letter"] + log["readout"])
    assert log["recipe"]["option_layer"] == 1 and log["recipe"]["letter_weight"] == 0.5
    with pytest.raises(ValueError, match="option_layer"):
        train_vlm(
            tmp_path / "n",
            VLMRecipe(frames=2, steps=1, tokenizer_frames=30, vocab_size=400, option_weight=0.5, option_layer=4),
            progress=False,
        )


def test_the_step_plan_follows_the_pace_so_far():
    from litevlm.train.vlm import replan

    assert replan(100000, 20, 40.0, 600.0, 20) == 320  # 2 s a step, 10 minutes left
    assert replan(100000, 1000, 1000.0, 600.0, 1000) == 1600  # the machine got faster: the plan grows
    assert replan(500, 20, 1.0, 600.0, 20) == 500  # capped by --steps
    assert replan(100000, 900, 1800.0, -5.0, 900) == 900  # past the deadline: stop where it is


def test_grown_decoder_computes_what_the_original_did(tiny_tokenizer):
    from conftest import tiny_config

    from litevlm.train.vlm import grow_decoder, init_weights

    cfg = tiny_config(tiny_tokenizer)
    model = VLM(cfg).eval()
    init_weights(model, 0)
    grown = grow_decoder(model, (0, 1)).eval()
    assert grown.cfg.text.num_layers == 4 and model.cfg.text.num_layers == 2
    layers = grown.language_model.layers
    # Order: original 0, its copy, original 1, its copy; the copies add nothing until trained.
    torch.testing.assert_close(
        layers[1].self_attn.q_proj.weight, model.language_model.layers[0].self_attn.q_proj.weight
    )
    assert layers[1].self_attn.o_proj.weight.abs().sum() == 0 and layers[3].mlp.down_proj.weight.abs().sum() == 0
    # a copied tensor: fp32 defaults, i.e. equal to the bit.
    torch.testing.assert_close(layers[2].mlp.up_proj.weight, model.language_model.layers[1].mlp.up_proj.weight)
    ids = torch.randint(6, cfg.text.vocab_size, (2, 11))
    pos = torch.arange(11).expand(2, -1)
    with torch.no_grad():
        a = model.lm_head(model.language_model(model.language_model.embed_tokens(ids), pos))
        b = grown.lm_head(grown.language_model(grown.language_model.embed_tokens(ids), pos))
    # zeroed output projections add exactly 0.0 to the residual stream: equality.
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A grown copy trains: its zeroed projections get gradients.
    grown.train()
    loss = grown.lm_head(grown.language_model(grown.language_model.embed_tokens(ids), pos)).logsumexp(-1).mean()
    loss.backward()
    assert layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    for bad in ((2,), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="grow_after"):
            grow_decoder(model, bad)


def test_a_grown_run_saves_half_precision_weights_that_load_as_the_grown_model(tmp_path):
    from dataclasses import replace

    from safetensors import safe_open

    from litevlm.model.hf import load_native

    first = VLMRecipe(
        frames=3,
        steps=1,
        batch_frames=2,
        questions_per_frame=2,
        probe_frames=0,
        render_size=(200, 112),
        vocab_size=400,
        warmup=1,
        tokenizer_frames=40,
    )
    a = train_vlm(tmp_path / "a", first, progress=False)
    b = train_vlm(
        tmp_path / "b",
        replace(first, init=str(a), grow_after=(1, 3), store_dtype="float16", attn_weight=0.3, attn_layer=5),
        progress=False,
    )
    with safe_open(str(b / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    assert (b / "model.safetensors").stat().st_size < 0.6 * (a / "model.safetensors").stat().st_size * 6 / 4
    model = load_native(b)
    assert model.cfg.text.num_layers == 6 and next(model.parameters()).dtype == torch.float16
    assert json.loads((b / "config.json").read_text())["recipe"]["grow_after"] == [1, 3]
    with pytest.raises(ValueError, match="needs a checkpoint"):
        train_vlm(tmp_path / "c", replace(first, grow_after=(0,)), progress=False)
    with pytest.raises(ValueError, match="store_dtype"):  # refused before any work, not at the first save
        train_vlm(tmp_path / "d", replace(first, store_dtype="half"), progress=False)
    assert not (tmp_path / "d").exists()


def test_patch_objective_targets_line_up_and_train_the_vision_tower(tiny_bank):
    """The patch objective: one target row per vision patch, and its loss alone moves the tower's weights."""
    from dataclasses import replace

    from litevlm.model.vlm import VLM
    from litevlm.train.vlm import aux_fields, aux_targets, patch_loss

    tok, cfg, _, _ = tiny_bank
    recipe = VLMRecipe(frames=3, batch_frames=2, render_size=(200, 112), patch_aux_weight=1.0)
    bank = FrameBank(recipe, cfg, tok, progress=False)
    assert bank.patch_aux.shape == (3, 6, cfg.vision.grid**2 * cfg.tiles_per_view, len(aux_fields()))
    b = make_batch(bank, tok, cfg, recipe, random.Random(0))
    assert b.patch_aux.shape == (b.pixels.shape[0] * cfg.vision.grid**2, len(aux_fields()))
    assert b.patch_aux.sum() > 0  # objects cover some patches
    # patch resolution is the token grid's, twice as fine: a token cell's contents are its four patches'
    from litevlm.data.synthetic import make_frame

    frame = make_frame(recipe.seed, recipe.first_frame)
    fine, coarse = aux_targets(frame, cfg.vision.grid, 1), aux_targets(frame, cfg.vision.grid // 2, 1)
    assert torch.equal(fine.amax(1) > 0, coarse.amax(1) > 0)  # the same fields occur in each camera
    # without the bank: no targets and no cost
    assert (
        make_batch(
            FrameBank(replace(recipe, patch_aux_weight=0.0), cfg, tok, progress=False),
            tok,
            cfg,
            replace(recipe, patch_aux_weight=0.0),
            random.Random(0),
        ).patch_aux
        is None
    )

    torch.manual_seed(0)
    model = VLM(cfg)
    head = torch.nn.Linear(cfg.vision.hidden_size, len(aux_fields()))
    loss = patch_loss(head, model.vision_tower(b.pixels), b.patch_aux)
    loss.backward()
    grads = [p.grad for p in model.vision_tower.parameters() if p.grad is not None]
    assert loss.item() > 0 and grads and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in model.language_model.parameters())  # the decoder is not involved


def test_train_vlm_with_the_patch_objective_logs_it(tmp_path):
    recipe = VLMRecipe(
        frames=3,
        steps=3,
        batch_frames=2,
        questions_per_frame=2,
        probe_frames=0,
        render_size=(200, 112),
        vocab_size=400,
        warmup=1,
        tokenizer_frames=40,
        patch_aux_weight=2.0,
    )
    out = train_vlm(tmp_path / "m", recipe, progress=False)
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 3 and len(log["patch"]) == 1 and log["patch"][0] > 0
    assert log["recipe"]["patch_aux_weight"] == 2.0


def test_trail_boxes_cover_the_pixels_a_moving_object_adds_beside_itself():
    """`trail_boxes` is where the renderer draws the trail: a moving car's image differs from the same car
    standing inside those boxes, and a standing car has none."""
    import numpy as np

    from litevlm.data.synthetic import render_view, trail_boxes

    def scene(motion):
        return frame_from_objects([SceneObject("car", 14.0, 0.5, heading=1.2, colour="red", motion=motion)])

    moving, standing = scene("Going ahead"), scene("Stopped")
    car = moving.objects[0]
    box = car.views["CAM_FRONT"]
    boxes = trail_boxes(car, box, "CAM_FRONT")
    assert (
        len(boxes) == 2 and trail_boxes(standing.objects[0], standing.objects[0].views["CAM_FRONT"], "CAM_FRONT") == []
    )
    diff = np.abs(
        np.asarray(render_view(moving, "CAM_FRONT"), dtype=int)
        - np.asarray(render_view(standing, "CAM_FRONT"), dtype=int)
    ).sum(-1)
    u0, v0, u1, v1 = boxes[0]  # the farther copy: mostly outside the car's own box
    outside = [u for u in range(int(u0) + 1, int(u1)) if not box.u0 <= u <= box.u1]
    assert outside, "the trail must reach beyond the object's box"
    assert (diff[int(v0) + 1 : int(v1), outside] > 0).mean() > 0.9
    assert diff[:, : int(min(u0, box.u0)) - 2].sum() == 0 and diff[:, int(max(u1, box.u1)) + 2 :].sum() == 0


def test_trail_targets_mark_motion_fields_only_on_the_trail_cells():
    from litevlm.data.synthetic import trail_boxes
    from litevlm.select.tokens import box_cells

    car = SceneObject("car", 14.0, 0.5, heading=1.2, colour="red", motion="Going ahead")
    frame = frame_from_objects([car])
    plain, trails = aux_targets(frame, 8, TPV), aux_targets(frame, 8, TPV, trails=True)
    front = CAMERAS.index("CAM_FRONT")
    own = cells_of(car.views["CAM_FRONT"].clipped(), 8, TPV)
    trail = set().union(*(box_cells(b, 8, TPV) for b in trail_boxes(car, car.views["CAM_FRONT"], "CAM_FRONT"))) - own
    assert trail, "the trail lies partly outside the car's cells"
    # the car's own cells are marked alike; the trail's hold its motion, not its class or colour
    assert torch.equal(plain[front, sorted(own)], trails[front, sorted(own)])
    cells = sorted(trail)
    assert trails[front, cells, field("moving")].all() and trails[front, cells, field("motion:Going ahead")].all()
    assert not trails[front, cells, field("class:car")].any() and not trails[front, cells, field("colour:red")].any()
    assert not plain[front, cells].any()
    assert torch.equal(trails - plain, trails * (trails > plain))  # trails only add marks
    standing = frame_from_objects([SceneObject("car", 14.0, 0.5, heading=1.2, colour="red", motion="Stopped")])
    assert torch.equal(aux_targets(standing, 8, TPV), aux_targets(standing, 8, TPV, trails=True))


def test_the_token_probe_lines_up_with_the_visual_tokens_and_trains(tiny_bank, tmp_path):
    from dataclasses import replace

    from litevlm.train.vlm import patch_loss

    tok, cfg, _, _ = tiny_bank
    recipe = VLMRecipe(frames=3, batch_frames=2, render_size=(200, 112), token_probe_weight=1.0)
    bank = FrameBank(recipe, cfg, tok, progress=False)
    b = make_batch(bank, tok, cfg, recipe, random.Random(0))
    assert b.token_aux.shape == b.aux.shape  # one row per visual token, like the dense objective's
    assert (b.token_aux >= b.aux).all() and b.token_aux.sum() > 0  # its targets add the trails
    assert (
        make_batch(
            FrameBank(replace(recipe, token_probe_weight=0.0), cfg, tok, progress=False),
            tok,
            cfg,
            replace(recipe, token_probe_weight=0.0),
            random.Random(0),
        ).token_aux
        is None
    )
    torch.manual_seed(0)
    model = VLM(cfg)
    head = torch.nn.Linear(cfg.text.hidden_size, len(aux_fields()))
    patch_loss(head, model.encode_tiles(b.pixels), b.token_aux).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.multi_modal_projector.parameters())
    assert all(p.grad is None for p in model.language_model.parameters())

    run = VLMRecipe(
        frames=3,
        steps=3,
        batch_frames=2,
        questions_per_frame=2,
        probe_frames=0,
        render_size=(200, 112),
        vocab_size=400,
        warmup=1,
        tokenizer_frames=40,
        token_probe_weight=1.0,
        vision_warmup=2,
    )
    log = json.loads((train_vlm(tmp_path / "m", run, progress=False) / "train_log.json").read_text())
    assert log["steps"] == 3 and len(log["token_probe"]) == 1 and log["token_probe"][0] > 0
    assert len(log["loss"]) == 1  # two vision-only steps, then one with the answers


def test_averaging_two_stages_from_one_checkpoint_keeps_the_shared_lineage(tmp_path):
    from dataclasses import replace

    from litevlm.cli import main
    from litevlm.errors import LiteVLMError
    from litevlm.model.hf import load_native, save_native
    from litevlm.train.vlm import average_checkpoints

    first = VLMRecipe(
        frames=3,
        steps=2,
        batch_frames=2,
        questions_per_frame=2,
        probe_frames=0,
        render_size=(200, 112),
        vocab_size=400,
        warmup=1,
        tokenizer_frames=40,
    )
    a = train_vlm(tmp_path / "a", first, progress=False)
    b = train_vlm(tmp_path / "b", replace(first, steps=2, init=str(a), lr=1e-3), progress=False)
    c = train_vlm(tmp_path / "c", replace(first, steps=3, init=str(a), lr=2e-3, seed=5), progress=False)
    assert main(["train", "average", str(b), str(c), "--out", str(tmp_path / "s")]) == 0
    soup = load_native(tmp_path / "s")
    wb, wc = load_native(b).state_dict(), load_native(c).state_dict()
    for k, v in soup.state_dict().items():
        # the soup's mean is this same fp32 expression (or its float16 store): fp32 defaults.
        torch.testing.assert_close(v, (wb[k] + wc[k]) / 2)
    assert not torch.equal(wb["language_model.norm.weight"], wc["language_model.norm.weight"])  # the two stages differ
    meta = json.loads((tmp_path / "s" / "config.json").read_text())
    assert [s["steps"] for s in meta["lineage"]] == [2]  # stage a, shared
    assert [s["checkpoint"] for s in meta["averaged"]] == [str(b), str(c)] and meta["steps"] == 5
    assert (tmp_path / "s" / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()

    d = train_vlm(
        tmp_path / "d", replace(first, steps=1, init=str(tmp_path / "s")), progress=False
    )  # continued from the mean
    lineage = json.loads((d / "config.json").read_text())["lineage"]
    assert [s["steps"] for s in lineage] == [2, 5] and [s["steps"] for s in lineage[-1]["averaged"]] == [2, 3]

    (tmp_path / "c2").mkdir()
    for f in c.iterdir():
        (tmp_path / "c2" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "c2" / "tokenizer.json").write_text("{}")
    with pytest.raises(LiteVLMError, match="tokenizer"):
        average_checkpoints(tmp_path / "bad", [b, tmp_path / "c2"])

    other = load_native(b)
    other.cfg.text.num_layers -= 1
    other.language_model.layers = other.language_model.layers[:-1]
    save_native(other, tmp_path / "other")
    with pytest.raises(LiteVLMError, match="another model config.*num_layers|another model config.*text"):
        average_checkpoints(tmp_path / "bad", [b, tmp_path / "other"])
    assert not (tmp_path / "bad").exists()


def test_the_model_card_lists_an_averaged_checkpoints_stages(tmp_path, benchmark_script):
    card = benchmark_script("drive_tiny_eval")

    def stage(steps, lr, init):
        return {
            "checkpoint": f"/runs/{steps}",
            "steps": steps,
            "train_seconds": 60.0 * steps,
            "recipe": {"lr": lr, "init": init, "frames": 10, "seed": 0, "closed_weight": 3.0},
            "looks_probe": None,
        }

    meta = {
        "litevlm": {"name": "x"},
        "format": "litevlm",
        "lineage": [stage(7, 3e-4, None)],
        "averaged": [stage(2, 1.2e-4, "/runs/7"), stage(3, 8e-5, "/runs/7")],
        "steps": 5,
        "train_seconds": 300.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(meta))
    scores = {"n": 4, "final": 0.5, "accuracy": 0.75, "language": 0.6, "match": 0.0, "closed_accuracy": 0.75}
    result = {
        "full": scores,
        "blank": {**scores, "closed_accuracy": 0.25},
        "data": "d",
        "pipeline": "views",
        "final_note": "no judge",
        "per_family_closed": {"is_moving": 1.0},
        "per_family_closed_blank": {"is_moving": 0.5},
        "machine": "m",
        "latency_ms": {**{s: 1.0 for s in card.STAGES}, "total": 5.0, "share": {s: 0.2 for s in card.STAGES}},
    }
    card.write_card(tmp_path, result)
    text = (tmp_path / "MODEL.md").read_text()
    assert "element-wise mean of 2 stages" in text
    assert "--lr 0.00012" in text and "--lr 8e-05" in text  # each averaged stage's own command
    rows = [line for line in text.splitlines() if line.startswith("| ") and "mean of" in line]
    assert [r.split(" | ")[1] for r in rows] == ["2", "3"]  # steps of the two averaged stages, after the shared stage 1
    assert "| 1 | 7 |" in text
    # a stage continued from the mean: the averaged stages stay in its lineage, one row each
    averaged = meta.pop("averaged")
    continued = {
        **meta,
        "lineage": [stage(7, 3e-4, None), {**stage(5, None, None), "averaged": averaged}],
        "recipe": {"lr": 5e-5, "init": "/runs/soup"},
        "steps": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(continued))
    card.write_card(tmp_path, result)
    rows = [line.split(" | ")[:2] for line in (tmp_path / "MODEL.md").read_text().splitlines() if line[2:3].isdigit()]
    assert rows == [["| 1", "7"], ["| 2 (mean of)", "2"], ["| 3 (mean of)", "3"], ["| 4", "4"]]


def test_light_contrasts_ask_the_other_colours_of_the_same_light():
    """Each sibling of a light_is question names another colour of the same light, answered from its state,
    and the generator's own answer follows the same rule (so the siblings are consistent with the data)."""
    from litevlm.data.synthetic import LIGHT_STATES, _visible, make_frame
    from litevlm.train.vlm import light_contrasts

    seen = 0
    for i in range(120):
        frame = make_frame(0, i)
        for qa in frame.qas:
            if qa.family != "light_is":
                continue
            seen += 1
            light = _visible(frame, qa.views[0], lambda o: o.cls == "traffic light")[0].light
            asked = next(s for s in LIGHT_STATES if qa.question.endswith(f" {s}?"))
            assert qa.answer == ("Yes." if asked == light else "No.")
            siblings = light_contrasts(frame, qa)
            assert sorted(q.rsplit(" ", 1)[1] for q, _ in siblings) == sorted(
                f"{s}?" for s in LIGHT_STATES if s != asked
            )
            for q, a in siblings:
                assert q.rsplit(" ", 1)[0] == qa.question.rsplit(" ", 1)[0]
                assert a == ("Yes." if q.endswith(f" {light}?") else "No.")
    assert seen >= 10


def test_the_model_cards_command_line_covers_every_recipe_flag(benchmark_script):
    """Each `litevlm train vlm` option that sets a recipe field reaches the card's command line, so the card
    reproduces the stage (the token probe and the light contrast were once left out)."""
    import argparse
    import dataclasses

    from litevlm.cli import build_parser
    from litevlm.train.vlm import VLMRecipe

    card = benchmark_script("drive_tiny_eval")
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    vlm = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices["vlm"]
    fields = {f.name for f in dataclasses.fields(VLMRecipe)}
    options = {a.dest for a in vlm._actions if a.dest in fields}
    assert options - set(card.FLAGS) - {"steps"} == set()
    line = card.train_command({"light_contrast": True, "token_probe_weight": 1.0, "family_weights": {"light_is": 6.0}})
    assert "--light-contrast" in line and "--token-probe-weight 1.0" in line and "--family-weight light_is=6" in line
    # A tuple field as JSON holds it (a list) comes back as the flag's own words, parsed by the command again.
    line = card.train_command({"token_drop_selector": "hd", "token_drop_ratios": [0.1, 0.2], "grow_after": [1, 3]})
    assert "--token-drop-selector hd --token-drop-ratios 0.1 0.2" in line and "--grow-after 1 3" in line
    args = parser.parse_args(line.split()[1:] + ["--out", "x"])
    assert args.token_drop_ratios == [0.1, 0.2] and args.grow_after == [1, 3]


def test_unshuffle_folds_the_projector_exactly():
    """Without the pixel shuffle (downsample ratio 1.0) each ViT patch is a visual token; the folded projector maps a
    2x2 block of equal patches to the token the shuffled one made from it, and the model keeps everything else."""
    from litevlm.model.hf import load_native
    from litevlm.model.vision import pixel_shuffle
    from litevlm.models import resolve_model_dir
    from litevlm.train.vlm import unshuffle_projector

    model = load_native(resolve_model_dir("drive-tiny")).float()
    hd = unshuffle_projector(model, tiles_per_view=2, name="drive-hd")
    g, c = model.cfg.vision.grid, model.cfg.vision.hidden_size
    assert hd.cfg.downsample_ratio == 1.0 and hd.cfg.tokens_per_tile == g * g == 4 * model.cfg.tokens_per_tile
    assert hd.cfg.tiles_per_view == 2 and hd.cfg.name == "drive-hd" and hd.cfg.projector_in == c
    blocks = torch.randn(3, g // 2, g // 2, c, generator=torch.Generator().manual_seed(0))
    feats = blocks.repeat_interleave(2, 1).repeat_interleave(2, 2).reshape(3, g * g, c)  # each block uniform
    with torch.no_grad():
        old = model.multi_modal_projector(pixel_shuffle(feats, g))  # (3, g*g/4, C_llm)
        new = hd.multi_modal_projector(feats).reshape(3, g, g, -1)[:, ::2, ::2].reshape(old.shape)
    # LayerNorm over four copies has the copies' mean and variance, and the folded product sums the four column
    # blocks: the same arithmetic in another order, fp32 rounding of O(1) values.
    torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    same = {k for k in model.state_dict() if not k.startswith("multi_modal_projector.")}
    assert all(torch.equal(model.state_dict()[k], hd.state_dict()[k]) for k in same)
    with pytest.raises(ValueError, match="pixel shuffle 0.5"):
        unshuffle_projector(hd)


def _tiny_model(cfg):
    from litevlm.train.vlm import init_vision, init_weights

    torch.manual_seed(0)
    model = VLM(cfg)
    init_weights(model, 0)
    init_vision(model, 0)
    return model.float().eval()


def test_a_selector_thinned_frame_carries_one_question_and_exactly_the_tokens_chosen_for_it(tiny_bank):
    tok, cfg, _, bank = tiny_bank
    recipe = VLMRecipe(frames=6, batch_frames=4, view_subset_prob=0.5, token_drop_prob=1.0, token_drop_ratios=(0.25,))
    calls = []

    def thin(pixels, views, question_ids, r):  # every other visual token, first one kept
        assert pixels.shape[0] == len(views) * cfg.tiles_per_view
        calls.append((pixels, list(views), list(question_ids), r))
        return torch.arange(len(views) * cfg.tokens_per_tile * cfg.tiles_per_view) % 2 == 0

    b = make_batch(bank, tok, cfg, recipe, random.Random(0), thin)
    assert len(calls) == recipe.batch_frames and all(r == 0.25 for *_, r in calls)
    assert int(b.keep.sum()) == int((b.ids == tok.image_id).sum()) == int(b.keep.numel() // 2)
    for i, (pixels, views, question_ids, _) in enumerate(calls):
        row = b.ids[i][b.ids[i] != tok.pad_id].tolist()
        assert row.count(tok.im_start_id) == 2  # one user turn, one answer
        assert [row[j : j + len(question_ids)] == question_ids for j in range(len(row))].count(True) == 1
        image = [j for j, t in enumerate(row) if t == tok.image_id]
        gaps = b.pos[i][image].diff().tolist()  # every other placeholder, at its own position
        assert gaps.count(2) == len(image) - len(views) and min(gaps) >= 2
        frame = next(f for f in range(len(bank.qas)) if torch.equal(bank.pixels(f, views), pixels))
        assert any(question_ids == list(qa[0]) for qa in bank.qas[frame])


def test_selector_thinning_keeps_the_selectors_top_r_of_the_question_prompt(tiny_bank, tmp_path):
    from litevlm.model.prompt import build_prompt
    from litevlm.select.tokens import SelectorConfig, TokenSelector, keep_count, visual_index
    from litevlm.train.vlm import SelectorThinning

    tok, cfg, _, bank = tiny_bank
    model = _tiny_model(cfg)
    TokenSelector.from_model(model, SelectorConfig(reads="embeds", shared_layer=False)).save(tmp_path)
    thin = SelectorThinning(tmp_path, model, tok)
    views = ["CAM_FRONT", "CAM_BACK", "CAM_BACK_LEFT"]
    question = bank.qas[2][0][0]
    n = len(views) * cfg.tokens_per_tile * cfg.tiles_per_view
    small, large = thin(bank.pixels(2, views), views, question, 0.2), thin(bank.pixels(2, views), views, question, 0.5)
    assert small.shape == (n,) and int(small.sum()) == keep_count(n, 0.2) and int(large.sum()) == keep_count(n, 0.5)
    # The same scores rank both budgets: the smaller kept set lies inside the larger.
    assert bool((large | ~small).all())
    # What the selector's own inference path keeps on the same prompt, scored independently here.
    with torch.no_grad():
        visual = model.encode_tiles(bank.pixels(2, views))
        layout = build_prompt(tok, tok.decode(question), views, cfg.tokens_per_tile * cfg.tiles_per_view)
        embeds = model.embed(torch.tensor([layout.ids]), visual.reshape(-1, visual.shape[-1]))
        scores = thin.selector.scores(embeds, torch.arange(embeds.shape[1])[None], layout.view_spans)[0]
    assert scores.shape == (n,) and visual_index(layout.view_spans).numel() == n
    top = scores.topk(keep_count(n, 0.5)).indices
    assert bool(large[top].float().mean() > 0.8)  # the per-view quota may swap a few


def test_selector_thinning_refuses_a_selector_that_prunes_inside_the_decoder(tiny_bank, tmp_path):
    from litevlm.select.tokens import SelectorConfig, TokenSelector
    from litevlm.train.vlm import SelectorThinning

    tok, cfg, _, bank = tiny_bank
    model = _tiny_model(cfg)
    TokenSelector.from_model(model, SelectorConfig(reads="layer0")).save(tmp_path)
    with pytest.raises(ValueError, match="prunes inside the decoder"):
        SelectorThinning(tmp_path, model, tok)
    with pytest.raises(ValueError, match="token_drop_ratios"):
        train_vlm("/nonexistent", VLMRecipe(frames=2, token_drop_ratios=(0.0,)), progress=False)
