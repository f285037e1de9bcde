"""benchmarks/gpu_session.sh, the GPU session's one command, checked on the CPU: its dry run (drive-tiny, a question
and a few tokens a step: `GPU_SESSION_MINIMAL=1`) runs every step and writes every JSON file it promises, and the
real run's timeouts fit the session's device time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.once  # subprocesses: the same run in each of CI's thread passes
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
ROWS = ["baseline", "eagle", "litevlm", "litevlm fp8"]
STEPS = ["install", "env", "gpu_tests", "step_costs", "bench_2b_graphs", "bench_hd", "walkthrough"]
PLAN_LIMIT_S = 7 * 60  # of the session's 15 minutes of device time: the machine's start and the copies take the rest


def test_the_plan_with_its_kill_afters_fits_in_seven_minutes():
    text = SCRIPT.read_text()
    plan = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"^declare -A PLAN=\((.*)\)$", text, re.M).group(1)))
    assert sorted(plan) == sorted(STEPS)
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)$", text, re.M).group(1))
    assert sum(int(v) + kill_after for v in plan.values()) <= PLAN_LIMIT_S
    assert not re.findall(r"\btimeout \S+ ", re.sub(r"(?m)^\s*(#|echo).*$", "", text).replace('timeout -s "${', ""))
    assert re.search(r"^export LITEVLM_CUDA_COMPILE=0$", text, re.M)  # no compile: none fits a step's budget
    steps = re.findall(r"^\s*(?:if ! )?(?:STEP_SIGNAL=\w+ )?step (\w+) ", text, re.M)
    assert steps == STEPS  # every planned step runs, in this order
    assert re.search(r"^STEP_SIGNAL=INT step gpu_tests ", text, re.M)  # pytest writes its XML when stopped


# What the GPU image lacks (its pip list): pycocoevalcap, FastAPI, pydantic, uvicorn, Ray.
NO_EXTRAS = """
import importlib.abc, sys
class _NotOnTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"pycocoevalcap", "fastapi", "pydantic", "uvicorn", "ray"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NotOnTheImage())
"""


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# A stand-in for coreutils' `timeout`, first on the dry run's PATH: it writes down the limit a step is given and the
# command (its words shell-quoted, on one line), then runs the command with no limit. The GPU run's limits are its
# own; a loaded CPU running the dry run must not hit them, and what the dry run checks is that each step gets its
# planned limit and its small workload.
FAKE_TIMEOUT = r"""#!/usr/bin/env bash
opts=()
while [[ $# -gt 0 && $1 == -* ]]; do
    if [[ $1 == -s || $1 == --signal || $1 == -k || $1 == --kill-after ]]; then opts+=("$1" "$2"); shift 2
    else opts+=("$1"); shift; fi
done
opts+=("$1")
shift
printf '%s\t%s\n' "${opts[*]}" "$(printf '%q ' "$@")" >> "$TIMEOUT_LOG"
exec "$@"
"""


@pytest.fixture(scope="module", params=["installed", "source tree"])
def dry_run(tmp_path_factory, request):
    """The dry run, installing the package as the GPU run does, and with the install made to fail: every later step
    then runs the package from the source tree (PYTHONPATH=src). Its steps run under FAKE_TIMEOUT, whose record
    (one line a step: `timeout`'s options and limit, a tab, the command) is the fourth item."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    out = tmp_path_factory.mktemp("gpu_session")
    work = tmp_path_factory.mktemp("gpu_session_work")
    bin_dir = tmp_path_factory.mktemp("fake_timeout")
    (bin_dir / "timeout").write_text(FAKE_TIMEOUT)
    (bin_dir / "timeout").chmod(0o755)
    log = bin_dir / "timeouts.log"
    # As on the GPU image: none of the serve/eval extras. Every Python the script starts refuses them.
    site = tmp_path_factory.mktemp("no_extras")
    (site / "sitecustomize.py").write_text(NO_EXTRAS)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_SESSION_MINIMAL": "1", "PYTHONPATH": path}
    env["GPU_SESSION_WORK"] = str(work)
    env["PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    env["TIMEOUT_LOG"] = str(log)
    env.pop("GRAPH_FLAGS", None)
    if request.param == "source tree":
        env["GPU_SESSION_BREAK_INSTALL"] = "1"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    return proc, out, work, log


def test_the_dry_run_runs_every_step(dry_run):
    """Every step runs and succeeds, each under `timeout` with its plan's limit (the tests stopped by SIGINT), and
    each asked for the dry run's least work (not its wall time, which a loaded machine stretches): drive-tiny on the
    CPU, one question of four tokens a bench, one iteration of each step kind, the gpu-marked tests only (every one
    of them skips here), the walkthrough's syntax."""
    proc, _, out, log = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "FAILED.txt").exists()
    steps = json.loads((out / "steps.json").read_text())
    assert [s["step"] for s in steps] == STEPS
    fallback = (out / "install_fallback.txt").exists()
    assert fallback == (steps[0]["rc"] != 0)  # a failed install: the source tree, and the run goes on
    assert all(s["rc"] == 0 and not s["timed_out"] for s in steps[fallback:]), steps
    plan = json.loads((out / "plan.json").read_text())
    assert plan["planned_s"] <= plan["limit_s"] == 420 and "planned: 7 steps" in proc.stderr

    text = SCRIPT.read_text()
    limits = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"^declare -A PLAN=\((.*)\)$", text, re.M).group(1)))
    kill_after = re.search(r"^KILL_AFTER=(\d+)$", text, re.M).group(1)
    calls = [line.split("\t") for line in log.read_text().splitlines()]
    assert [opts for opts, _ in calls] == [
        f"-s {'INT' if s == 'gpu_tests' else 'TERM'} --kill-after={kill_after} {limits[s]}" for s in STEPS
    ]
    command = dict(zip(STEPS, (c for _, c in calls), strict=True))
    assert " -m gpu tests/" in command["gpu_tests"]
    assert "--dry-run-cpu --iters 1 --warmup 0 --no-compiled" in command["step_costs"]
    assert "--model drive-tiny --device cpu" in command["bench_2b_graphs"]
    for bench in ("bench_2b_graphs", "bench_hd"):
        assert "--n 1 --warmup 0 --max-new-tokens 4" in command[bench], bench
    assert command["walkthrough"].strip() == "bash -n benchmarks/your_model.sh"
    tests = json.loads((out / "gpu_tests.json").read_text())
    assert tests["counts"]["passed"] == tests["counts"]["failed"] == 0 < tests["counts"]["skipped"]


def test_the_dry_run_writes_every_promised_json(dry_run):
    _, _, out, _ = dry_run
    for name in ("env", "gpu_tests", "step_costs", "bench_2b_graphs", "bench_hd", "steps"):
        assert isinstance(json.loads((out / f"{name}.json").read_text()), (dict, list)), name
    env = json.loads((out / "env.json").read_text())
    assert env["cuda_available"] is False and "torch" in env
    tests = json.loads((out / "gpu_tests.json").read_text())
    assert tests["complete"] and tests["counts"]["failed"] == 0
    assert tests["counts"]["passed"] + tests["counts"]["skipped"] > 0  # the gpu-marked tests were collected
    costs = json.loads((out / "step_costs.json").read_text())
    assert costs["benchmark"] == "step_costs" and costs["skipped"] is False and costs["floor_ms"] > 0
    # the minimal run: every variant's steps eager inside their graphs, the compiled ones left out and said so
    assert [(r["variant"], r["steps"]) for r in costs["rows"]] == [("bf16", "eager"), ("fp8-dynamic-per-row", "eager")]
    assert all(r["decode_ms"] > 0 and r["verify_ms"] > 0 and r["kernels"]["decode"] for r in costs["rows"])
    assert costs["rows"][0]["draft_ms"] > 0 and costs["left_out"] == ["the compiled steps: --no-compiled"]
    assert set(costs["goals"]) == {"decode_vs_floor", "verify_vs_decode", "fp8_vs_bf16_decode"}
    assert [line["variant"] for line in _lines(out / "step_costs.jsonl")] == ["bf16", "bf16", "fp8-dynamic-per-row"]


@pytest.mark.parametrize("name, rows", [("bench_2b_graphs", ROWS), ("bench_hd", ["baseline", "litevlm"])])
def test_each_bench_writes_its_rows_as_json_and_each_answer_as_it_comes(dry_run, name, rows):
    _, _, out, _ = dry_run
    result = json.loads((out / f"{name}.json").read_text())
    assert result.get("complete", True), result
    assert result["questions"] == 1  # the dry run's least work: one question a row
    assert [r["config"] for r in result["rows"]] == rows
    assert set(result["backends"].values()) == {"cuda-twin"}  # every row on the CUDA backend (its twin here)
    lines = _lines(out / f"{name}.jsonl")
    kinds = [line["type"] for line in lines]
    assert kinds[0] == "setup" and kinds[-len(rows) :] == ["row"] * len(rows)
    answers = [line for line in lines if line["type"] == "answer"]
    assert sorted(a["config"] for a in answers) == sorted(rows * result["questions"])
    assert all(a["total_ms"] > 0 and "stages_ms" in a for a in answers)


def test_what_comes_back_is_at_most_eight_files_the_summaries_and_one_archive_of_everything(dry_run):
    """A device returns at most 8 files from $OUT, none deeper than two folders: $OUT holds the archive of the work
    folder (every file of it but model weights) and the summaries, copies of the work folder's."""
    _, out, work, _ = dry_run
    back = sorted(p.name for p in out.iterdir())
    assert len(back) <= 8 and all((out / name).is_file() for name in back)
    assert "gpu_session.tgz" in back and {"steps.json", "env.json", "gpu_tests.json", "step_costs.json"} <= set(back)
    for name in set(back) - {"gpu_session.tgz"}:
        assert (out / name).read_bytes() == (work / name).read_bytes(), name
    with tarfile.open(out / "gpu_session.tgz") as tar:
        packed = {Path(m.name).as_posix().removeprefix("./") for m in tar.getmembers() if m.isfile()}
    made = {p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file() and p.suffix != ".safetensors"}
    assert packed == made and {"plan.json", "gpu_tests.xml", "bench_hd.jsonl"} <= packed


def test_the_session_runs_every_file_that_holds_gpu_tests():
    """The gpu-marked tests run file by file (their order kept): a new file of them must be on the list."""
    listed = re.search(r"^GPU_TEST_FILES=\((.*)\)$", SCRIPT.read_text(), re.M).group(1).split()
    marked = sorted(
        f"tests/{p.name}"
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"^@pytest\.mark\.gpu$", p.read_text(), re.M)
    )
    assert sorted(listed) == marked and listed[0] == "tests/test_pipeline.py"


def test_the_step_goals_come_from_the_compiled_steps_where_measured(benchmark_script):
    """step_costs' goals: from the compiled bf16 steps where they were measured; FP8 against bf16 in the same
    mode, eager against eager when the compiled FP8 steps were left out."""
    goals = benchmark_script("step_costs").goals
    fp8 = "fp8-dynamic-per-row"
    rows = [
        {"variant": "bf16", "steps": "eager", "decode_ms": 3.0, "verify_ms": 4.5},
        {"variant": fp8, "steps": "eager", "decode_ms": 2.5, "verify_ms": 4.0},
        {"variant": "bf16", "steps": "compiled", "decode_ms": 1.5, "verify_ms": 1.8},
    ]
    got = goals(rows, floor_ms=1.2)
    assert got["decode_vs_floor"] == {"value": 1.25, "goal": 1.5, "met": True, "from": "bf16 compiled"}
    assert got["verify_vs_decode"]["value"] == 1.2 and got["verify_vs_decode"]["met"]
    assert got["fp8_vs_bf16_decode"] == {"value": 0.833, "goal": 1.0, "met": True, "from": f"{fp8} eager"}
    rows.append({"variant": fp8, "steps": "compiled", "decode_ms": 1.8, "verify_ms": 2.0})
    got = goals(rows, floor_ms=0.9)
    assert not got["decode_vs_floor"]["met"] and got["decode_vs_floor"]["value"] == 1.667
    assert got["fp8_vs_bf16_decode"] == {"value": 1.2, "goal": 1.0, "met": False, "from": f"{fp8} compiled"}
    assert goals(rows[1:2], floor_ms=1.0) == {}  # no bf16 row: nothing to check
