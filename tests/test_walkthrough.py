"""The README's walkthrough "LiteVLM for your own InternVL", end to end as a user types it (benchmarks/your_model.sh):
a tiny random transformers InternVL checkpoint with its own tokenizer and chat template, a small DriveLM train-v1_1
JSON with images, every recipe, `eval --litevlm`, `bench` and FP8 `quantize`; then each module is loaded back by
`Pipeline.from_pretrained` from the checkpoint's folder and used, and speculative decoding on it is lossless."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from litevlm.data.drivelm import load_images
from litevlm.data.source import load_data
from litevlm.model.prompt import read_format
from litevlm.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")
pytestmark = pytest.mark.once  # subprocesses: the same run in each of CI's thread passes


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    work = tmp_path_factory.mktemp("walkthrough")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "your_model.sh"), str(work)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return work, done.stdout


def test_every_step_ran_and_the_fp8_checkpoint_scores(walkthrough):
    work, stdout = walkthrough
    result = json.loads(stdout.strip().splitlines()[-1])  # the last step: eval of the FP8 checkpoint, --json
    assert result["scored"] and result["n"] == 8
    assert 0.0 <= result["final"] <= 1.0
    ck = work / "InternVL-tiny-hf"
    for part in ("view_selector", "token_selector", "draft"):
        assert (ck / part).is_dir() and (ck.parent / "InternVL-tiny-hf-fp8" / part).is_dir(), part
    assert (ck / "draft" / "openings.json").is_file()
    assert read_format(ck.parent / "InternVL-tiny-hf-fp8") == read_format(ck)  # the prompt travels with FP8


def test_the_modules_are_loaded_back_and_used_and_speculation_is_lossless(walkthrough):
    work, _ = walkthrough
    ck = work / "InternVL-tiny-hf"
    samples = load_data(work / "drivelm" / "drivelm.json")[:6]
    opts = dict(select_views=True, select_tokens=0.5, max_new_tokens=16)
    lite = Pipeline.from_pretrained(ck, speculative=True, **opts)
    plain = Pipeline.from_pretrained(ck, **opts)
    base = Pipeline.from_pretrained(ck, max_new_tokens=16)
    assert lite.view_selector is not None and lite.token_selector is not None and lite.draft is not None
    assert lite.format.chat_template is not None  # the checkpoint's own template, not ChatML
    drafted = 0
    for s in samples:
        images = load_images(s)
        a, b, full = lite.answer(s.question, images), plain.answer(s.question, images), base.answer(s.question, images)
        assert a.tokens == b.tokens  # greedy speculative decoding is lossless
        assert a.views == b.views and set(a.views) <= set(full.views)
        assert a.num_visual_tokens < full.num_visual_tokens  # the TokenSelector (and views) pruned
        drafted += len(a.accept_lengths)
    assert drafted > 0  # the draft head was used
    fp8 = Pipeline.from_pretrained(work / "InternVL-tiny-hf-fp8", speculative=True, **opts)
    ans = fp8.answer(samples[0].question, load_images(samples[0]))
    assert ans.precision.startswith("fp8")
