"""The optional packages are imported only where they are used: the CLI runs in a subprocess in which pycocoevalcap
(DriveLM's language score), FastAPI, pydantic, uvicorn, prometheus_client and Ray (the server) cannot be imported,
as on a machine without them. Every command's parser, the demo's, ask's and bench's help and a real answer work
there without trying to import any of them, and the commands that need one stop with a message naming the package
and how to install it, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

OPTIONAL = ("pycocoevalcap", "fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "ray")

# A meta-path finder that refuses the optional packages (as a machine without them would: ModuleNotFoundError) and
# writes each name it refused to the file named by LITEVLM_BLOCKED_LOG; then the litevlm command line.
RUNNER = """
import importlib.abc, os, sys
BLOCKED = set(os.environ["LITEVLM_BLOCKED"].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            with open(os.environ["LITEVLM_BLOCKED_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from litevlm.cli import main
for argv in [a.split("\\x1f") for a in sys.argv[1:]]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code
    if code:
        sys.exit(code)
"""


def run_cli(tmp_path, *commands: list[str], timeout: int = 300) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run each litevlm command (a list of arguments) in one subprocess without the optional packages, stopping at
    the first that fails -> (the process, the optional modules it tried to import)."""
    log = tmp_path / f"blocked-{len(list(tmp_path.glob('blocked-*')))}.log"
    env = {
        **os.environ,
        "LITEVLM_BLOCKED": ",".join(OPTIONAL),
        "LITEVLM_BLOCKED_LOG": str(log),
        "LITEVLM_NATIVE": "0",  # the native CPU steps are beside the point here: no build
    }
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, *("\x1f".join(c) for c in commands)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tried = log.read_text().split() if log.exists() else []
    return proc, tried


@pytest.mark.parametrize("command", [["--help"], ["ask", "--help"], ["bench", "--help"], ["demo", "--help"]], ids=str)
def test_help_works_without_the_optional_packages(tmp_path, command):
    proc, tried = run_cli(tmp_path, command)
    assert proc.returncode == 0, proc.stderr
    assert "usage: litevlm" in proc.stdout
    assert tried == []


def test_every_command_s_parser_is_built_without_them(tmp_path):
    commands = [
        ["views", "--help"],
        ["data", "synth", "--help"],
        ["convert", "--help"],
        *(["train", recipe, "--help"] for recipe in ("vlm", "views", "tokens", "draft", "openings", "average")),
        ["eval", "--help"],
        ["score", "--help"],
        ["quantize", "--help"],
        ["serve", "--help"],
    ]
    proc, tried = run_cli(tmp_path, *commands)
    assert proc.returncode == 0, proc.stderr
    assert tried == []


def test_a_real_answer_and_view_selection_work_without_them(tmp_path):
    data = tmp_path / "synth"
    proc, tried = run_cli(
        tmp_path,
        ["data", "synth", "--out", str(data), "--frames", "1", "--width", "320", "--height", "180", "--json"],
        ["views", "--question", "What is behind the ego car?", "--json"],
    )
    assert proc.returncode == 0, proc.stderr
    frame = tmp_path / "frame"  # ask's layout: one CAM_X.png a camera (synth's: images/CAM_X/<frame>.png)
    frame.mkdir()
    for view in (data / "images").iterdir():
        shutil.copy(next(view.glob("*.png")), frame / f"{view.name}.png")
    proc, tried_ask = run_cli(
        tmp_path,
        ["ask", "--images", str(frame), "--question", "Is there a car?", "--max-new-tokens", "4", "--json"],
    )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "text" in answer and answer["views"]
    assert tried == tried_ask == []


@pytest.mark.parametrize(
    "command, package, extra",
    [
        (["eval", "--data", "nowhere"], "pycocoevalcap", "pip install 'pycocoevalcap"),
        (["score", "--predictions", "p.json", "--gt", "gt.json"], "pycocoevalcap", "pip install 'pycocoevalcap"),
        (["bench", "--n", "1", "--max-new-tokens", "4", "--json"], "pycocoevalcap", "pip install 'pycocoevalcap"),
        (["serve", "--port", "1"], "FastAPI", "pip install 'litevlm[serve]'"),
        (["serve", "--replicas", "2"], "ray", "pip install 'litevlm[ray]'"),
    ],
    ids=["eval", "score", "bench", "serve", "serve-replicas"],
)
def test_a_command_that_needs_one_says_which_and_how_to_install_it(tmp_path, command, package, extra):
    """Before any model is loaded or data read: the first thing such a command does is import what it needs."""
    proc, tried = run_cli(tmp_path, command)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and package in proc.stderr and extra in proc.stderr
    assert tried and tried[0].partition(".")[0] in OPTIONAL
