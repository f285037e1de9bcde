"""Where the TokenSelector pays: its scoring against the prefill it saves, by prompt size, side by side.

    python benchmarks/select_threshold.py --model drive-tiny --data /tmp/heldout --n 200

Every question is answered twice, alternately, with the ViewSelector and EAGLE on: once with the
TokenSelector pruning every prompt (`min_select_tokens=0`), once without it. Grouped by how many visual
tokens the selected views hold, the table gives the median milliseconds of token selection + prefill
for each, and the smallest visual-token count from which pruning is the faster (LiteVLM's
`LITEVLM_MIN_SELECT_TOKENS` is set from it). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections import defaultdict

import torch

from litevlm.data.drivelm import load_images, load_samples
from litevlm.pipeline import Pipeline
from litevlm.presets import LITEVLM_KEEP_RATIO


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--data", required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    common = dict(select_views=True, speculative=True)
    prune = Pipeline.from_pretrained(args.model, select_tokens=LITEVLM_KEEP_RATIO, min_select_tokens=0, **common)
    whole = Pipeline.from_pretrained(args.model, **common)
    samples = load_samples(args.data)[: args.n]
    cost = {"pruned": defaultdict(list), "whole": defaultdict(list)}
    totals = {"pruned": [], "whole": []}
    for i, s in enumerate(samples):
        imgs = load_images(s)
        order = (("pruned", prune), ("whole", whole)) if i % 2 == 0 else (("whole", whole), ("pruned", prune))
        for name, pipe in order:
            a = pipe.answer(s.question, imgs)
            if i < 5:  # warm-up
                continue
            n_visual = len(a.views) * pipe.tokens_per_view
            cost[name][n_visual].append(a.timings_ms["select_tokens"] + a.timings_ms["prefill"])
            totals[name].append(a.timings_ms["total"])
        print(f"\r{i + 1}/{len(samples)} questions", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    rows, threshold = [], None
    for n_visual in sorted(cost["whole"]):
        p, w = statistics.median(cost["pruned"][n_visual]), statistics.median(cost["whole"][n_visual])
        rows.append(
            {
                "visual_tokens": n_visual,
                "questions": len(cost["whole"][n_visual]),
                "pruned_ms": round(p, 3),
                "whole_ms": round(w, 3),
                "saved_ms": round(w - p, 3),
            }
        )
        if p < w and threshold is None:
            threshold = n_visual
        elif p >= w:
            threshold = None  # pruning must pay at every size from the threshold up
    print(f"{'visual tokens':>14}{'questions':>11}{'select+prefill pruned':>23}{'unpruned':>10}{'saved':>8}")
    for r in rows:
        print(
            f"{r['visual_tokens']:>14}{r['questions']:>11}{r['pruned_ms']:>23.2f}{r['whole_ms']:>10.2f}{r['saved_ms']:>8.2f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "select_threshold",
                "model": args.model,
                "data": args.data,
                "questions": len(totals["whole"]),
                "keep_ratio": LITEVLM_KEEP_RATIO,
                "threads": args.threads,
                "cpu": platform.processor() or platform.machine(),
                "rows": rows,
                "pays_from_visual_tokens": threshold,
                "median_total_ms": {k: round(statistics.median(v), 3) for k, v in totals.items()},
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
