"""`torchrun --nproc-per-node 2 -m litevlm -- eval ...` scores exactly as one process does, and resumes.

Timings differ from run to run, so "the same" means: the same JSON apart from `total_ms_median`, the same
records apart from their `timings_ms`. Each rank runs one thread, as does the single process, so every
answer comes from the same kernels in the same order.
"""

import json
import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from litevlm.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("synth"), frames=1, seed=3, size=(112, 63), progress=False).parent


def _torchrun(args: list[str]) -> tuple[dict, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*TWO_RANKS, "eval", *args, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    return json.loads(lines[-1]), lines


def _single(args: list[str], capsys) -> dict:
    """One process, here (one thread, as each rank)."""
    from litevlm.cli import main

    torch.set_num_threads(1)
    capsys.readouterr()
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


# `--` ends torchrun's own options: its parser would otherwise read eval's `--n` as an abbreviation of its own
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TWO_RANKS = [*TORCHRUN, "-m", "litevlm", "--"]


def _untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("timings_ms", "cache")} for r in records]  # times and work


def test_two_ranks_give_the_single_process_result_and_resume(tiny_model_dir, synth, tmp_path, capsys):
    base = ["--data", str(synth), "--model", str(tiny_model_dir), "--max-new-tokens", "4", "--n", "7"]
    one = _single([*base, "--records", str(tmp_path / "one.json")], capsys)
    resume = tmp_path / "resume"
    two, lines = _torchrun([*base, "--records", str(tmp_path / "two.json"), "--resume-dir", str(resume)])
    assert len(lines) == 1  # rank 1 prints nothing; rank 0 prints the one JSON line
    assert one["n"] == two["n"] and one["scored"]
    timed = ("total_ms_median", "e2e_ms_median", "views_encoded")  # work, not results: each rank reads its frames
    assert {k: v for k, v in one.items() if k not in timed} == {k: v for k, v in two.items() if k not in timed}
    records_one = json.loads((tmp_path / "one.json").read_text())
    records_two = json.loads((tmp_path / "two.json").read_text())
    assert len(records_one) == 7
    assert _untimed(records_one) == _untimed(records_two)  # the same answers, in the file's order

    # each rank kept its own answers: rank 0 questions 0, 2, 4, 6; rank 1 questions 1, 3, 5
    files = {p.name: json.loads(p.read_text())["results"] for p in resume.glob("eval.*.json")}
    assert sorted(files) == ["eval.rank0-of2.json", "eval.rank1-of2.json"]
    assert sorted(files["eval.rank0-of2.json"]) == ["0", "2", "4", "6"]
    assert sorted(files["eval.rank1-of2.json"]) == ["1", "3", "5"]

    # a rerun (here on one process) takes finished answers from the store instead of answering again:
    # an answer planted in the store comes back in the records
    path = resume / "eval.rank1-of2.json"
    stored = json.loads(path.read_text())
    stored["results"]["3"]["answer"] = "planted"
    path.write_text(json.dumps(stored))
    _single([*base, "--records", str(tmp_path / "three.json"), "--resume-dir", str(resume)], capsys)
    records_three = json.loads((tmp_path / "three.json").read_text())
    assert [r["answer"] for r in records_three] == [
        "planted" if i == 3 else r["answer"] for i, r in enumerate(records_one)
    ]


def test_resume_dir_of_another_configuration_is_refused(tiny_model_dir, synth, tmp_path):
    from litevlm.cli import main

    base = ["eval", "--data", str(synth), "--model", str(tiny_model_dir), "--n", "1", "--json"]
    assert main([*base, "--max-new-tokens", "2", "--resume-dir", str(tmp_path)]) == 0
    assert main([*base, "--max-new-tokens", "3", "--resume-dir", str(tmp_path)]) == 2  # LiteVLMError: exit 2
