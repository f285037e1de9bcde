"""The one-sequence CPU steps side by side: native (cpu_steps.cpp), TorchScript and the eager modules.

    python benchmarks/cpu_steps.py --model drive-tiny

On the model's decoder with a cache filled to --context slots (random K/V): a plain decode step (layers,
final norm, LM head), a chain verification of 6 and 17 tokens, a draft cycle (extend of 5 pairs, then a
6-step chain, no cut), and a prompt's prefill at 84 and 186 tokens (drive-tiny's LiteVLM and six-view
prompts). Each backend runs the same calls in turn; medians over --k calls. Where a backend has no such
call (the eager path drafts and verifies through other functions; TorchScript prefills eagerly) the cell
is left empty. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from litevlm.eval import timing
from litevlm.model import cpu_steps
from litevlm.model.generate import decode_step, prefill
from litevlm.pipeline import Pipeline
from litevlm.spec.tree import verify_chain_greedy


def median_ms(fn, k: int) -> float:
    return timing.median_ms(fn, k, warmup=max(3, k // 10))


def use(backend: str | None) -> None:
    """Route the CPU steps through one backend (None: the eager path)."""
    steps = (
        {"native": cpu_steps._native_steps, "torchscript": cpu_steps._scripted_steps}[backend]() if backend else None
    )
    if backend and steps is None:
        raise SystemExit(f"the {backend} CPU steps are unavailable here")
    cpu_steps._STEPS[:] = [steps]
    cpu_steps._BACKEND[:] = [backend]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--context", type=int, default=120, help="cached slots before the timed steps")
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    pipe = Pipeline.from_pretrained(args.model, speculative=True)
    model, draft = pipe.model, pipe.draft
    lm = model.language_model
    lm.setup_cache(1, 512)
    gen = torch.Generator().manual_seed(0)
    for layer in lm.layers:
        layer.self_attn.kv_cache.k.normal_(generator=gen)
        layer.self_attn.kv_cache.v.normal_(generator=gen)
    width, vocab, at = lm.cfg.hidden_size, lm.cfg.vocab_size, args.context
    token = torch.tensor([[7]])
    chains = {n: torch.randint(10, vocab, (n,), generator=gen) for n in (6, 17)}
    prompts = {t: (torch.randn(1, t, width, generator=gen), torch.arange(t)[None]) for t in (84, 186)}
    feats, nxt = (
        torch.randn(5, width, generator=gen),
        lm.embed_tokens.weight[torch.randint(10, vocab, (5,), generator=gen)],
    )
    draft.prepare(512, 600)

    rows = []
    for backend in ("native", "torchscript", None):
        use(backend)
        plan = lm.step_plan()
        row = {
            "backend": backend or "eager",
            "decode_step_ms": median_ms(lambda: decode_step(model, token, at, at, plan), args.k),
        }
        for n, chain in chains.items():
            row[f"verify_{n}_ms"] = (
                median_ms(lambda: verify_chain_greedy(model, chain, at, at, plan), args.k) if backend else None
            )
        row["draft_cycle_6_ms"] = (
            median_ms(
                lambda: draft.draft_cycle(
                    feats, nxt, torch.arange(at, at + 5), 40, torch.tensor([7]), at + 5, 6, 0.0, None
                ),
                args.k,
            )
            if backend
            else None
        )
        for t, (embeds, pos) in prompts.items():
            row[f"prefill_{t}_ms"] = median_ms(lambda: prefill(model, embeds, pos), max(20, args.k // 10))
        rows.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    use(None)
    cpu_steps._STEPS.clear()
    cpu_steps._BACKEND.clear()

    keys = [k for k in rows[0] if k != "backend"]
    print(f"{'':>20}" + "".join(f"{r['backend']:>13}" for r in rows))
    for k in keys:
        print(f"{k:>20}" + "".join(f"{'-' if r[k] is None else format(r[k], '.3f'):>13}" for r in rows))
    print(
        json.dumps(
            {
                "benchmark": "cpu_steps",
                "model": args.model,
                "context": at,
                "threads": args.threads,
                "cpu": platform.machine(),
                "torch": torch.__version__,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
