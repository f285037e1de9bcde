"""Choose the keep ratio r a TokenSelector stores, from a pruning benchmark run on validation data.

The rule: the smallest r whose final score is within --tolerance (default 0.005) of the unpruned one; when none
is, the largest r measured. The run must be the pruning benchmark's JSON (`benchmarks/token_pruning.py ...
--methods token-selector --selector DIR`) on data that is neither trained on nor held out, so that the held-out
figures stay untouched by the choice. The selector's config.json gets the chosen r as its `keep_ratio` and a
`keep_ratio_choice` record (the data, the scores at each r, the rule); nothing else in the folder changes.

    python benchmarks/token_pruning.py --model drive-hd --data .bench-data/val2 --timing-n 0 --n 200 \\
        --r 0.3,0.4,0.5 --methods token-selector --selector runs/sel/token_selector > runs/val.json
    python benchmarks/choose_keep_ratio.py runs/val.json runs/sel/token_selector

The last line of stdout is one JSON object: the choice as written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def last_json(path: Path) -> dict:
    """The last line of a file that parses as a JSON object."""
    for line in reversed(path.read_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise SystemExit(f"{path}: no JSON line from the pruning benchmark")


def choose(run: dict, tolerance: float) -> tuple[float, dict[str, float], float]:
    """(r chosen, final score at each r, unpruned final) from a pruning benchmark's JSON."""
    if run.get("benchmark") != "token_pruning":
        raise SystemExit("the run is not the pruning benchmark's JSON")
    unpruned = float(run["unpruned"]["final"])
    at = {
        key.split("@", 1)[1]: float(v["final"]) for key, v in run["scores"].items() if key.startswith("token-selector@")
    }
    if not at:
        raise SystemExit("the run has no token-selector scores: run it with --methods token-selector")
    ratios = sorted(at, key=float)
    within = [r for r in ratios if at[r] >= unpruned - tolerance]
    return float(within[0] if within else ratios[-1]), {r: at[r] for r in ratios}, unpruned


def write_json(path: Path, obj: dict) -> None:
    """Write beside the target and rename over it: a reader never sees half a file. The file keeps its permissions
    (a temporary file is made readable by its owner alone)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the pruning benchmark's output (its last JSON line is read)")
    ap.add_argument("selector", type=Path, help="the token_selector/ folder whose config.json gets the choice")
    ap.add_argument("--tolerance", type=float, default=0.005, help="how far below unpruned r may score")
    ap.add_argument("--dry-run", action="store_true", help="print the choice without writing it")
    ap.add_argument(
        "--data-made-by",
        default=None,
        metavar="CMD",
        help="the command that makes the run's data (e.g. `litevlm data synth --seed 2 --frames 100`), recorded in"
        " place of its folder, which names only where it lay on one machine",
    )
    args = ap.parse_args(argv)
    cfg_path = args.selector / "config.json"
    if not cfg_path.is_file():
        raise SystemExit(f"{args.selector}: no config.json (a token_selector/ folder holds one)")
    run = last_json(args.run)
    r, at, unpruned = choose(run, args.tolerance)
    cfg = json.loads(cfg_path.read_text())
    if run.get("selector", {}).get("reads", "layer0") != cfg["selector"].get("reads", "layer0"):
        raise SystemExit("the run measured a selector that reads another input than this one")
    record = {
        "data": f"{args.data_made_by or run.get('data')} ({run.get('n')} questions, the views"
        f" {run.get('views', 'needed')})",
        "commit": run.get("commit"),
        "unpruned_final": unpruned,
        "final_at_r": at,
        "rule": f"the smallest r within {args.tolerance} of the unpruned final score",
        "chosen": r,
    }
    if not args.dry_run:
        cfg["selector"]["keep_ratio"] = r
        cfg["keep_ratio_choice"] = record
        write_json(cfg_path, cfg)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
