"""Scale-out of evaluation: `litevlm eval` as one process against two ranks under torchrun, one thread each.

Runs `torchrun --standalone --nproc-per-node W -m litevlm -- eval --data D --n N --json [--litevlm]` for W = 1
and W = 2 (after one small untimed run), alternating for --rounds rounds so that a change in the machine's load
falls on both, and times each run from outside (wall clock, process start and model load included: what a user
waits for). Reported per rank count: questions/s (best and median round) and the final score, which must be the
same for both.

    python benchmarks/dist_eval.py --model drive-tiny --data .bench-data/heldout --n 300

The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="drive-tiny", help="bundled model name or checkpoint directory")
    p.add_argument("--data", required=True, help="a synth folder or DriveLM JSON")
    p.add_argument("--n", type=int, default=100, help="questions evaluated per run")
    p.add_argument("--rounds", type=int, default=2, help="alternations of one and two ranks")
    p.add_argument("--baseline", action="store_true", help="the baseline configuration (default: --litevlm)")
    return p.parse_args(argv)


def run_eval(world: int, a: argparse.Namespace) -> tuple[float, dict]:
    """(wall seconds, the eval's JSON) of one torchrun job with `world` ranks of one thread each."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "litevlm", "--", "eval", "--model", a.model, "--data", a.data, "--n", str(a.n), "--json"]
    cmd += [] if a.baseline else ["--litevlm"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torch takes one thread per process
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    a = parse_args(argv)
    load_before = os.getloadavg()[0]
    run_eval(
        1, argparse.Namespace(**{**vars(a), "n": 2})
    )  # untimed: builds or finds the native CPU steps, warms the disk
    walls: dict[int, list[float]] = {1: [], 2: []}
    finals: dict[int, set] = {1: set(), 2: set()}
    for _ in range(a.rounds):
        for world in (1, 2):
            wall, res = run_eval(world, a)
            walls[world].append(wall)
            finals[world].add(res.get("final"))
            print(f"  {world} rank(s): {wall:.1f} s, final {res.get('final')}", file=sys.stderr)
    ranks = {
        str(w): {
            "wall_s": [round(x, 2) for x in walls[w]],
            "questions_per_s_best": round(a.n / min(walls[w]), 3),
            "questions_per_s_median": round(a.n / statistics.median(walls[w]), 3),
            "final": sorted(finals[w], key=str),
        }
        for w in (1, 2)
    }
    result = {
        "model": a.model,
        "data": a.data,
        "questions": a.n,
        "rounds": a.rounds,
        "config": "baseline" if a.baseline else "litevlm",
        "threads_per_rank": 1,
        "host": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "ranks": ranks,
        "speedup_best": round(min(walls[1]) / min(walls[2]), 3),
        "same_final": finals[1] == finals[2] and len(finals[1]) == 1,
    }
    print(f"eval of {a.n} questions ({result['config']}), one thread per rank, {result['host']}")
    for w, r in ranks.items():
        print(f"  {w} rank(s): {r['questions_per_s_best']:.2f} questions/s (best of {a.rounds}), final {r['final']}")
    print(f"  two ranks: {result['speedup_best']}x one; same final: {result['same_final']}")
    print(json.dumps(result))
    return 0 if result["same_final"] else 1


if __name__ == "__main__":
    sys.exit(main())
