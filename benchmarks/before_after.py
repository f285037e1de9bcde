"""`litevlm bench` on an earlier commit and on this tree, back to back: did a change move the CPU figures?

    python benchmarks/before_after.py --before 781ab23 --data .bench-data/heldout --n 100

The earlier commit is checked out into a temporary git worktree and run from there with this environment (its
package first on PYTHONPATH, so both runs share the interpreter, torch and the native build cache). The two runs
alternate at each thread count, pinned to one core at one thread, then at the machine's default threads:
before, after (--rounds pairs each). Every row is compared by the mean sum of its five stages (`mean_totals`); the
ratio after / before is within noise when it is near 1. The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def bench(src: Path, data: str, n: int, pinned: bool, configs: str | None, model: str = "drive-tiny") -> dict:
    """One `litevlm bench --json` run of the package under `src` -> its JSON."""
    cmd = [sys.executable, "-m", "litevlm", "bench", "--model", model, "--data", data, "--n", str(n), "--json"]
    cmd.append("--no-transformers")
    if configs:
        cmd += ["--configs", configs]
    env = dict(os.environ, PYTHONPATH=str(src))
    if pinned:
        env["OMP_NUM_THREADS"] = "1"
        cmd = ["taskset", "-c", "1", *cmd]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"bench failed under {src}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mean_totals(result: dict) -> dict[str, float]:
    """Each row's mean of the five stages' sum in ms, the one measure both codes report: the earlier code's total was
    that sum (`mean_total_ms`); today's `total_ms` adds what lies outside the stages (`other_ms`), taken back out
    here. Emulated precisions are left out."""
    out = {}
    for row in result["rows"]:
        if row.get("emulated") or (row.get("speed_figure") is False):
            continue
        if "other_ms" in row:
            out[row["config"]] = row["total_ms"] - (row["other_ms"] or 0.0)
        else:
            out[row["config"]] = row.get("mean_total_ms", row["total_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--data", default=".bench-data/heldout")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1, help="before/after pairs at each thread count")
    ap.add_argument("--configs", default=None, help="bench rows to run (default: every row)")
    ap.add_argument("--model", default="drive-tiny")
    args = ap.parse_args()
    before = git("rev-parse", "--short", args.before)
    after = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    t0 = time.time()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        git("worktree", "add", "--detach", str(tree), before)
        try:
            for pinned in (True, False):
                for _ in range(args.rounds):
                    for code, src in (("before", tree / "src"), ("after", ROOT / "src")):
                        print(f"{code} ({'1 pinned thread' if pinned else 'default threads'}) ...", file=sys.stderr)
                        result = bench(src, args.data, args.n, pinned, args.configs, args.model)
                        runs.append(
                            {"code": code, "pinned": pinned, "threads": result["threads"], "rows": mean_totals(result)}
                        )
        finally:
            git("worktree", "remove", "--force", str(tree))
    table = []
    for pinned in (True, False):
        mine = [r for r in runs if r["pinned"] == pinned]
        configs = [c for c in mine[0]["rows"] if all(c in r["rows"] for r in mine)]
        for c in configs:
            b = statistics.fmean(r["rows"][c] for r in mine if r["code"] == "before")
            a = statistics.fmean(r["rows"][c] for r in mine if r["code"] == "after")
            table.append(
                {
                    "config": c,
                    "threads": mine[0]["threads"],
                    "pinned": pinned,
                    "before_ms": round(b, 3),
                    "after_ms": round(a, 3),
                    "after_over_before": round(a / b, 3),
                }
            )
    print(
        json.dumps(
            {
                "benchmark": "before_after",
                "before": before,
                "after": after + ("+" if dirty else ""),
                "questions": args.n,
                "rounds": args.rounds,
                "rows": table,
                "runs": runs,
                "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "seconds": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
