"""Where a speculative cycle's drafting time goes on the CPU: the fixed part and the cost of each chain step.

    python research/draft_cost.py --model drive-tiny

Times the draft head's side of a greedy chain cycle (`DraftHead.draft_cycle`: the extend over the pairs
committed last cycle, then the chain) at chain depths 1, 2, 4, 8, 16 with no cut, after an extend of 1 and
of 5 pairs, and the parts of one chain step alone: the draft layer's CPU step (native or eager, as
`litevlm.model.cpu_steps.backend()` says) on one token and the head with
its log-softmax and top-1. The per-step cost is the slope over depth; the fixed part is the intercept.
Medians over --k calls; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from litevlm.eval.timing import median_ms
from litevlm.model import cpu_steps
from litevlm.pipeline import Pipeline

DEPTHS = (1, 2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--k", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    pipe = Pipeline.from_pretrained(args.model, speculative=True)
    model, draft = pipe.model, pipe.draft
    width = model.cfg.text.hidden_size
    draft.prepare(512, 600)
    if draft._plan is None:
        raise SystemExit("the CPU steps do not apply to this draft head: the one-call draft cycle cannot be timed")
    embed = model.language_model.embed_tokens.weight
    gen = torch.Generator().manual_seed(0)

    def cycle(pairs: int, depth: int):
        feats = torch.randn(pairs, width, generator=gen)
        nxt = embed[torch.randint(10, embed.shape[0], (pairs,), generator=gen)]
        pos = torch.arange(100, 100 + pairs)
        return lambda: draft.draft_cycle(feats, nxt, pos, 40, torch.tensor([7]), 100 + pairs, depth, 0.0, None)

    rows = []
    for pairs in (1, 5):
        for depth in DEPTHS:
            fn = cycle(pairs, depth)
            assert fn().numel() == depth + 1  # no cut: the whole chain is drafted
            rows.append({"extend_pairs": pairs, "depth": depth, "ms": round(median_ms(fn, args.k), 4)})
    # least-squares line over depth, per extend size
    fits = {}
    for pairs in (1, 5):
        xs = [r["depth"] for r in rows if r["extend_pairs"] == pairs]
        ys = [r["ms"] for r in rows if r["extend_pairs"] == pairs]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fits[pairs] = {"per_step_ms": round(slope, 4), "fixed_ms": round(my - slope * mx, 4)}

    layer, cfg = draft.steps.layers, draft.cfg
    x = torch.randn(1, width, generator=gen)
    cos, sin = draft._rope
    weights, caches = draft._plan.weights, cpu_steps.caches((draft.layer,))
    layer_ms = median_ms(
        lambda: layer(
            x,
            cos[50:51],
            sin[50:51],
            50,
            None,
            weights,
            caches,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.norm_eps,
        ),
        args.k,
    )
    head = draft._chain_args[3]
    head_ms = median_ms(lambda: torch.log_softmax(x @ head, -1).topk(1, -1), args.k)

    print(f"{'extend pairs':>12} {'depth':>6} {'ms':>8}")
    for r in rows:
        print(f"{r['extend_pairs']:>12} {r['depth']:>6} {r['ms']:>8.3f}")
    for pairs, f in fits.items():
        print(f"extend {pairs}: {f['fixed_ms']:.3f} ms fixed + {f['per_step_ms']:.3f} ms per chain step")
    print(f"one draft layer call, one token: {layer_ms:.3f} ms; head + log-softmax + top-1: {head_ms:.3f} ms")
    print(
        json.dumps(
            {
                "benchmark": "draft_cost",
                "model": args.model,
                "threads": args.threads,
                "cpu": platform.machine(),
                "cpu_steps": cpu_steps.backend(),
                "rows": rows,
                "fits": {str(k): v for k, v in fits.items()},
                "layer_ms": round(layer_ms, 4),
                "head_ms": round(head_ms, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
