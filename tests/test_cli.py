"""The command table: every command reachable from `litevlm --help`, recipe flags generated from the recipe
dataclasses with their defaults, the names of the flags users already type, and what `--litevlm` means."""

import argparse
import dataclasses

import pytest

from litevlm.cli import COMMANDS, Group, build_parser, main
from litevlm.errors import LiteVLMError
from litevlm.options import pipeline_options, recipe_from_args
from litevlm.presets import LITEVLM
from litevlm.quant.fp8 import FP8Recipe
from litevlm.train.draft import DraftRecipe
from litevlm.train.tokens import TokenRecipe
from litevlm.train.views import ViewRecipe
from litevlm.train.vlm import VLMRecipe

# (command line before the recipe flags, recipe class)
RECIPES = [
    (["train", "vlm", "--out", "o"], VLMRecipe),
    (["train", "views", "--out", "o"], ViewRecipe),
    (["train", "tokens", "--model", "m"], TokenRecipe),
    (["train", "draft", "--model", "m"], DraftRecipe),
    (["quantize", "--out", "o"], FP8Recipe),
]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for name, cmd in COMMANDS.items():
        assert name in top
        if isinstance(cmd, Group):
            with pytest.raises(SystemExit):
                main([name, "--help"])
            out = capsys.readouterr().out
            assert all(sub in out for sub in cmd.commands)


@pytest.mark.parametrize("argv, recipe_cls", RECIPES, ids=lambda x: getattr(x, "__name__", None))
def test_recipe_flags_default_to_the_dataclass(argv, recipe_cls):
    """No flag given: the recipe is the dataclass's default, field for field; every help text is a flag."""
    args = build_parser().parse_args(argv)
    assert recipe_from_args(recipe_cls, args) == recipe_cls()
    flagged = [f for f in dataclasses.fields(recipe_cls) if "help" in f.metadata]
    assert flagged, recipe_cls
    sub = build_parser()._subparsers._group_actions[0]
    parser = sub.choices[argv[0]]
    if argv[0] == "train":
        parser = parser._subparsers._group_actions[0].choices[argv[1]]
    helps = {a.help for a in parser._actions}
    assert all(any(h and h.startswith(f.metadata["help"].replace("%", "%%")) for h in helps) for f in flagged)


def test_the_flags_users_type_keep_their_names_and_meaning():
    parse = build_parser().parse_args
    vlm = recipe_from_args(
        VLMRecipe,
        parse(
            ["train", "vlm", "--out", "o", "--batch-frames", "3", "--family-weight", "light_is=6"]
            + ["--family-weight", "sign_mc=0.5", "--grow-after", "1", "2", "--reinit-vision", "--store-dtype"]
            + ["float16", "--light-contrast", "--init", "ckpt", "--lr", "1e-3"]
        ),
    )
    assert (vlm.batch_frames, vlm.family_weights, vlm.grow_after) == (3, {"light_is": 6.0, "sign_mc": 0.5}, (1, 2))
    assert vlm.reinit_vision and vlm.light_contrast and not vlm.reinit_language
    assert (vlm.store_dtype, vlm.init, vlm.lr) == ("float16", "ckpt", 1e-3)
    tokens = recipe_from_args(TokenRecipe, parse(["train", "tokens", "--model", "m", "--own-layer", "--epochs", "2"]))
    assert tokens.shared_layer is False and tokens.epochs == 2  # --own-layer flips the default
    draft = recipe_from_args(
        DraftRecipe, parse(["train", "draft", "--model", "m", "--intermediate", "0", "--passes", "3"])
    )
    assert (draft.intermediate_size, draft.passes) == (0, 3)
    views = recipe_from_args(ViewRecipe, parse(["train", "views", "--out", "o", "--seed", "7", "--val-frames", "9"]))
    assert (views.torch_seed, views.seed, views.val_frames) == (7, ViewRecipe.seed, 9)  # --seed is the torch seed
    fp8 = recipe_from_args(FP8Recipe, parse(["quantize", "--out", "o", "--recipe", "fp8-dynamic-per-row", "--vision"]))
    assert fp8 == FP8Recipe("fp8-dynamic-per-row", include_vision=True)


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "vlm", "--out", "o", "--family-weight", "light_is"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--out", "o", "--recipe", "fp9"])
    args = build_parser().parse_args(["train", "views", "--out", "o", "--target-recall", "2"])
    with pytest.raises(LiteVLMError, match="target_recall"):
        recipe_from_args(ViewRecipe, args)
    assert main(["train", "views", "--out", "o", "--target-recall", "2"]) == 2  # refused before any training


def _ask(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["ask", "--images", "x", "--question", "q", *flags])


def test_litevlm_means_the_preset_and_explicit_options_win():
    plain = pipeline_options(_ask())
    assert (plain["select_views"], plain["speculative"], plain["select_tokens"], plain["min_select_tokens"]) == (
        False,
        False,
        None,
        0,
    )
    full = pipeline_options(_ask("--litevlm"))
    assert {k: full[k] for k in LITEVLM} == LITEVLM
    mine = pipeline_options(_ask("--litevlm", "--select-tokens", "0.8", "--select-min-tokens", "0"))
    assert (mine["select_tokens"], mine["min_select_tokens"], mine["select_views"]) == (0.8, 0, True)


def test_serve_checks_its_flags_before_loading_a_model():
    args = build_parser().parse_args(["serve", "--max-queue", "-1", "--model", "no-such-model"])
    with pytest.raises(LiteVLMError, match="max_queue"):
        args.func(args)


def test_ask_streams_the_answer_through_pipeline_stream(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """`ask --stream` prints the pieces the frame's stream (`Pipeline.stream_frame`) yields as they come, then the
    summary; the pieces join to the answer `ask` prints without it, and the JSON line is the same answer."""
    import json

    import numpy as np
    from PIL import Image

    from litevlm.cameras import CAMERAS
    from litevlm.frame import Frame
    from litevlm.pipeline import Delta, Pipeline

    rng = np.random.default_rng(0)
    for cam in CAMERAS:
        Image.fromarray(rng.integers(0, 255, (90, 160, 3), dtype=np.uint8)).save(tmp_path / f"{cam}.png")
    argv = ["ask", "--model", str(tiny_model_dir), "--images", str(tmp_path), "--question", "Anything ahead?"]
    argv += ["--max-new-tokens", "12"]
    assert main(argv) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert plain  # a random tiny model still says something in 12 tokens

    pieces, stream = [], Pipeline.stream_frame

    def recorded(self, question, frame):
        for item in stream(self, question, frame):
            if isinstance(item, Delta) and question == "Anything ahead?":  # not the pipeline's warm-up answer
                pieces.append(item.text)
            yield item

    monkeypatch.setattr(Pipeline, "stream_frame", recorded)
    monkeypatch.setattr(Frame, "answer", lambda *a, **k: pytest.fail("--stream answers through Frame.stream"))
    assert main([*argv, "--stream"]) == 0
    out = capsys.readouterr().out
    assert len(pieces) > 1 and out.startswith("".join(pieces) + "\n")
    assert out.splitlines()[0] == plain and out.splitlines()[1].startswith("views:")
    assert main([*argv, "--stream", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == plain and json.loads(lines[-1])["text"] == plain


def test_eval_no_score_answers_and_times_without_pycocoevalcap(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """On a machine without pycocoevalcap (the GPU image), `eval --no-score` still answers every question and reports
    the closed questions' accuracy and the timings; without the flag the missing scorer is a clear error first."""
    import builtins
    import json

    from litevlm.data.synthetic import write_dataset

    data = write_dataset(tmp_path / "synth", frames=1, seed=3, size=(112, 63), progress=False).parent
    real_import = builtins.__import__

    def no_coco(name, *args, **kwargs):
        if name.partition(".")[0] == "pycocoevalcap":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_coco)
    base = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--n", "3", "--max-new-tokens", "4", "--json"]
    assert main(base) == 2
    assert "pycocoevalcap" in capsys.readouterr().err
    assert main([*base, "--no-score"]) == 0
    res = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert res["n"] == 3 and res["scored"] is False and res["final"] is None
    assert "closed_accuracy" in res and res["total_ms_median"] > 0 and "--no-score" in res["final_note"]
