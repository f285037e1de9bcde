"""`litevlm quantize --data` and `litevlm eval` on a transformers InternVL checkpoint that brings its own tokenizer
and a chat template with a system turn, cut with InternVL's dynamic tiling, on a small DriveLM train-v1_1 JSON with
images: calibration reads only held-out scenes, and the FP8 checkpoint is complete (tokenizer, chat template,
prompt.json, trained modules), loads with `Pipeline.from_pretrained` and answers in the source's prompt."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from litevlm.cli import main
from litevlm.data.source import load_data, scene_split
from litevlm.data.synthetic import write_dataset
from litevlm.errors import LiteVLMError
from litevlm.model.prompt import read_format
from litevlm.pipeline import Pipeline
from litevlm.quant.fp8 import FP8Linear, calibration_set, read_fp8_meta

transformers = pytest.importorskip("transformers")

# A system turn the template writes when the prompt brings none: the pipeline's prompt must carry it.
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou drive carefully.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TILING = dict(max_tiles=2, thumbnail=True)  # 16:9 views -> a 2x1 grid + thumbnail: 3 tiles, 12 visual tokens a view
NEW_TOKENS = ["--max-new-tokens", "4"]


def write_hf_checkpoint(out, tokenizer, seed: int = 0):
    """A tiny random InternVLForConditionalGeneration (Qwen2 text side, untied head) saved with `save_pretrained`,
    with drive-tiny-like tokenizer files and the chat template in tokenizer_config.json, as a real -hf folder."""
    from conftest import user_model_script

    model = user_model_script().tiny_hf_internvl(tokenizer.vocab_size, tokenizer.image_id, seed)
    model.save_pretrained(out)
    tokenizer.save(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return out


def add_modules(model_dir) -> None:
    """A ViewSelector (lexical), a TokenSelector and a draft head beside the checkpoint, saved through
    `modules_dir` with the dynamic tiling they are made for (prompt.json)."""
    from litevlm.models import load_model, modules_dir
    from litevlm.select.tokens import TokenSelector
    from litevlm.select.views import ViewSelector
    from litevlm.spec.draft import DraftConfig, DraftHead

    loaded = load_model(model_dir, **TILING)
    d = modules_dir(loaded)
    torch.manual_seed(0)
    ViewSelector.lexical_only().save(d)
    TokenSelector.from_model(loaded.model).save(d)
    DraftHead(DraftConfig.for_target(loaded.model.cfg.text), loaded.model).save(d / "draft")


def write_drivelm(out):
    """Three scenes of four frames (train-v1_1 layout, 16:9 PNGs): the data and its image root."""
    return write_dataset(out, frames=12, seed=5, size=(112, 63), progress=False), out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tokenizer):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-hf", tiny_tokenizer)


@pytest.fixture(scope="module")
def hf_full(hf_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-full") / "tiny-hf"
    shutil.copytree(hf_dir, d)
    add_modules(d)
    return d


@pytest.fixture(scope="module")
def drivelm(tmp_path_factory):
    return write_drivelm(tmp_path_factory.mktemp("drivelm"))


def run_bounded(cmd: list[str], env: dict, timeout: float):
    """Run `cmd` in its own process group; past `timeout` seconds the whole group (torchrun and its ranks) is
    killed and the test fails, so no rank outlives it."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(cmd[:8])} ... ran past {timeout} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cli(capsys, *argv) -> dict:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_quantize_on_held_out_scenes_writes_a_checkpoint_that_loads_and_answers(
    hf_full, drivelm, tmp_path, capsys, monkeypatch
):
    data, images = drivelm
    asked = []
    answer = Pipeline.answer

    def recording(self, question, imgs):
        asked.append((question, imgs["CAM_FRONT"]))
        return answer(self, question, imgs)

    monkeypatch.setattr(Pipeline, "answer", recording)
    out = tmp_path / "fp8"
    # --select-views: calibrate what the deployed pipeline's layers see
    argv = ["quantize", "--model", str(hf_full), "--data", str(data), "--images", str(images), "--calib", "5"]
    result = run_cli(
        capsys, *argv, "--calib-fraction", "0.5", "--out", str(out), "--select-views", *NEW_TOKENS, "--json"
    )
    monkeypatch.undo()

    # Calibration asked exactly 5 questions, every one of a scene the seeded split holds out, spread over those scenes.
    kept, held = scene_split(load_data(data, images), 0.5, seed=0)
    held_frames = {s.images["CAM_FRONT"] for s in held}
    assert len(asked) == 5 and all(frame in held_frames for _, frame in asked)
    assert not {frame for _, frame in asked} & {s.images["CAM_FRONT"] for s in kept}
    assert (
        sorted({s.scene_id for s in held}) == result["calibration"]["scenes"]
        and len(result["calibration"]["scenes"]) == 2
    )
    assert result["calibration"]["questions"] == 5 and "fraction=0.5, seed=0" in result["calibration"]["split"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["fp8"]["calibration"] == result["calibration"]
    assert [s.question for s in calibration_set(5, data, images, 0.5, 0).samples] == [q for q, _ in asked]

    # Everything Pipeline.from_pretrained needs travelled with the weights.
    for name in ("tokenizer.json", "tokenizer_config.json", "prompt.json", "view_selector", "token_selector", "draft"):
        assert (out / name).exists(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert read_format(out) == read_format(hf_full) and read_format(out).tiling.max_tiles == 2
    recipe, report = read_fp8_meta(out)
    assert recipe.static and len(report.quantized) == 14  # 2 layers x (q, k, v, o, gate, up, down)

    source = Pipeline.from_pretrained(hf_full, max_new_tokens=6)
    plain = Pipeline.from_pretrained(out, select_views=True, select_tokens=0.5, max_new_tokens=6)
    spec = Pipeline.from_pretrained(out, select_views=True, select_tokens=0.5, speculative=True, max_new_tokens=6)
    assert isinstance(plain.model.get_submodule(report.quantized[0]), FP8Linear)
    assert spec.format == source.format and spec.draft is not None and spec.token_selector is not None
    s = held[0]
    # The same prompt as the source checkpoint's: its chat template with the system turn, its tiling.
    ids = source.prompt(s.question, s.images).ids
    assert torch.equal(Pipeline.from_pretrained(out).prompt(s.question, s.images).ids, ids)
    assert "You drive carefully." in source.tokenizer.decode(ids[0].tolist(), skip_special=False)
    a, b = plain.answer(s.question, s.images), spec.answer(s.question, s.images)
    assert a.precision.startswith("fp8-static-per-tensor") and len(a.tokens) > 0
    assert b.tokens == a.tokens  # greedy speculative decoding on the FP8 model is lossless


def test_quantize_refuses_bad_input_before_writing_anything(hf_full, drivelm, tmp_path, capsys):
    data, images = drivelm
    base = ["quantize", "--model", str(hf_full), "--calib", "2", *NEW_TOKENS]
    out = tmp_path / "fp8"

    broken = tmp_path / "broken"
    shutil.copytree(images, broken)
    next((broken / "images" / "CAM_BACK").iterdir()).unlink()
    assert main([*base, "--data", str(broken / "drivelm.json"), "--images", str(broken), "--out", str(out)]) == 2
    assert "missing" in capsys.readouterr().err and not out.exists()

    one_scene = tmp_path / "one"
    write_dataset(one_scene, frames=2, seed=5, size=(112, 63), progress=False)
    assert main([*base, "--data", str(one_scene), "--images", str(one_scene), "--out", str(out)]) == 2
    assert "single scene" in capsys.readouterr().err and not out.exists()

    assert main([*base, "--data", str(data), "--images", str(images), "--out", str(hf_full)]) == 2
    assert "holds the checkpoint being quantised" in capsys.readouterr().err
    assert (hf_full / "model.safetensors").is_file() and not (hf_full / "config.json").read_text().count('"fp8"')

    assert main([*base, "--images", str(images), "--out", str(out)]) == 2
    assert "pass --data too" in capsys.readouterr().err and not out.exists()

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert main([*base, "--out", str(notes)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err and (notes / "todo.txt").read_text() == "mine"


def test_a_failure_while_saving_leaves_no_checkpoint(hf_full, tmp_path, capsys, monkeypatch):
    """The FP8 folder is assembled beside --out and renamed into place: a copy that fails leaves nothing behind."""

    def failing_copytree(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copytree", failing_copytree)
    out = tmp_path / "fp8"
    with pytest.raises(OSError, match="disk full"):
        main(["quantize", "--model", str(hf_full), "--calib", "1", *NEW_TOKENS, "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


def test_calibration_set_without_data_is_the_synthetic_seed_2_frames():
    from litevlm.data.drivelm import samples_from_frame
    from litevlm.data.synthetic import make_frame

    cal = calibration_set(3)
    assert [s.question for s in cal.samples] == [s.question for s in samples_from_frame(make_frame(2, 0))[:3]]
    assert cal.source == {"data": "synthetic frames of seed 2", "questions": 3}
    with pytest.raises(LiteVLMError, match="at least 1"):
        calibration_set(0)


def test_eval_runs_on_the_hf_checkpoint_in_its_own_prompt(hf_dir, hf_full, drivelm, capsys):
    """eval on the -hf folder with format flags (no prompt.json) and with its modules (--litevlm)."""
    data, images = drivelm
    argv = ["eval", "--data", str(data), "--images", str(images), "--n", "3", *NEW_TOKENS, "--json"]
    flags = ["--max-tiles", "2", "--thumbnail"]
    baseline = run_cli(capsys, *argv, "--model", str(hf_dir), *flags)
    litevlm = run_cli(capsys, *argv, "--model", str(hf_full), "--litevlm")
    assert baseline["n"] == litevlm["n"] == 3 and baseline["scored"]
    assert baseline["visual_tokens"] == 6 * 12  # six views of 3 tiles x 4 tokens: the dynamic tiling was applied
    assert litevlm["views_per_question"] <= 6


def test_calibration_under_torchrun_on_two_ranks_gives_the_scales_of_one_process(hf_full, drivelm, tmp_path, capsys):
    """`torchrun --nproc-per-node 2 -m litevlm quantize`: each rank answers half the questions, the per-layer maxima
    are reduced with all_reduce(MAX), rank 0 alone writes; the checkpoint equals the one a single process writes."""
    import os
    import sys
    from pathlib import Path

    from litevlm.quant.fp8 import calibrate, load_fp8

    data, images = drivelm
    argv = ["quantize", "--model", str(hf_full), "--data", str(data), "--images", str(images), "--calib", "4"]
    argv += ["--calib-fraction", "0.5", *NEW_TOKENS]
    torch.set_num_threads(1)  # as each torchrun rank (OMP_NUM_THREADS=1): the same kernels, the same bits
    run_cli(capsys, *argv, "--out", str(tmp_path / "one"), "--json")
    src = str(Path(__import__("litevlm").__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    # Calibration's hooks keep every decoder layer on the module path, so the native CPU steps never run in this
    # command: the ranks skip building them.
    env["LITEVLM_NATIVE"] = "0"
    # `--` ends torchrun's own options, which it would otherwise match against abbreviations of ours
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "litevlm",
        "--",
    ]
    done = run_bounded([*cmd, *argv, "--out", str(tmp_path / "two"), "--json"], env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1  # rank 0 alone reports
    one, two = load_fp8(tmp_path / "one"), load_fp8(tmp_path / "two")
    _, report = read_fp8_meta(tmp_path / "two")
    for name in report.quantized:
        assert torch.equal(one.get_submodule(name).input_scale, two.get_submodule(name).input_scale), name
    assert json.loads((tmp_path / "two" / "config.json").read_text())["fp8"]["calibration"]["questions"] == 4

    # Rank 0's own share (questions 0 and 2) alone stays below the reduced maximum somewhere: the reduction mattered.
    pipe = Pipeline.from_pretrained(hf_full, max_new_tokens=4, backend="modules")  # hooks fire in the modules
    share = calibration_set(4, data, images, 0.5, 0).samples[::2]
    own = calibrate(pipe.model, [(lambda s=s: pipe.answer(s.question, s.images)) for s in share], progress=False)
    reduced = {n: float(two.get_submodule(n).input_scale) * 448.0 for n in report.quantized}
    assert all(own[n] <= reduced[n] * (1 + 1e-6) for n in report.quantized)  # scale = amax / 448 in fp32
    assert any(own[n] < reduced[n] * (1 - 1e-3) for n in report.quantized)
