"""The one-sequence CPU steps side by side: native (cpu_steps.cpp), the eager steps and the modules.

    python benchmarks/cpu_steps.py --model drive-tiny

On the model's decoder with a cache filled to --context slots (random K/V): a plain decode step (layers,
final norm, LM head), a chain verification of 6 and 17 tokens, a draft cycle (extend of 5 pairs, then a
6-step chain, no cut), and a prompt's prefill at 84 and 186 tokens (drive-tiny's LiteVLM and six-view
prompts). Each backend runs the same calls in turn; medians over --k calls. Where a backend has no such
call (the modules draft and verify through other functions; the eager steps prefill through the modules) the
cell is left empty. benchmarks/compile_vs_native.py compares the native steps with compiled ones. The last stdout
line is one JSON object.
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


def use(modules: list, layers: list, backend: str | None) -> list:
    """Run the CPU steps of these modules (a decoder, a draft head) on one backend, or with None keep them out (a
    no-op forward pre-hook on each of their decoder layers: the steps never run under hooks, so every call goes
    through the modules) -> the hooks' handles."""
    if backend == "native" and cpu_steps.backend() != "native":
        raise SystemExit("the native CPU steps are unavailable here")
    steps = cpu_steps.default_steps() if backend == "native" else cpu_steps.EagerSteps()
    for module in modules:
        cpu_steps.use(module, steps)
    return [] if backend else [layer.register_forward_pre_hook(lambda *args: None) for layer in layers]


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
    for backend in ("native", "eager", None):
        hooks = use([lm, draft], [*lm.layers, draft.layer], backend)
        draft.prepare(512, 600)
        plan = lm.step_plan()
        row = {
            "backend": backend or "modules",
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
        for hook in hooks:
            hook.remove()

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
