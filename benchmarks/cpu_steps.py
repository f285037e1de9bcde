"""The execution backends side by side on one sequence's steps: native (cpu_steps.cpp), the modules and cuda-twin.

    python benchmarks/cpu_steps.py --model drive-tiny

Every backend of `litevlm.model.backend` that can serve the model here runs the same calls on the same inputs, on
the model's decoder with a cache filled to --context slots (random K/V, refilled before each backend): a plain
decode step (layers, final norm, LM head); the verification of a chain of 6 and of 17 tokens with its greedy
acceptance (`verify` + `accept_greedy` on every backend, and the native backend's one-call `verify_chain` beside
it); a draft cycle (the draft head's extend over 5 pairs, then a 6-step chain, uncut: one `draft_cycle` call where
the drafter has it, else `extend` and the `draft_tree` loop); and a prompt's prefill at --prompts tokens (84 and 186,
drive-tiny's LiteVLM and six-view prompts). "cuda-twin" is the CUDA backend's mechanisms on the CPU, eager: static
steps per KV-length bucket replayed on static buffers, a prompt padded to its length bucket, and one backend per
verified chain size (a backend captures the verification of one tree size, as a pipeline captures its own).
Medians over --k calls (prefills over max(20, k / 10)); `setup_ms` is the one-off cost of making the backend, and
`eager_steps` counts the cuda-twin calls that fell back to the modules (0: every step replayed its static step).
benchmarks/compile_vs_native.py compares the native steps with compiled ones. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from litevlm.eval import timing
from litevlm.model.backend import choose_backend, native_refusal
from litevlm.pipeline import Pipeline
from litevlm.spec.tree import TreeConfig, accept_greedy, chain_tree, draft_tree

BACKENDS = ("native", "modules", "cuda-twin")
CHAINS = (6, 17)  # verified chain lengths, root included (17: the default tree, a depth-16 chain)
PAIRS, DRAFTED, DRAFT_DEPTH = 5, 40, 6  # pairs the draft cycle's extend takes in, pairs already cached, chain steps
CACHE = 512  # live slots of the target's cache


def median_ms(fn, k: int) -> float:
    return timing.median_ms(fn, k, warmup=max(3, k // 10))


def fill_caches(lm, draft, seed: int) -> None:
    """The same random K/V in the target's and the draft's caches, whichever backend ran before."""
    gen = torch.Generator().manual_seed(seed)
    for cache in [layer.self_attn.kv_cache for layer in lm.layers] + [draft.layer.self_attn.kv_cache]:
        cache.k.normal_(generator=gen)
        cache.v.normal_(generator=gen)


def make_backends(kind: str, model, draft) -> dict[int, object]:
    """kind's backend for each verified chain size: one for all, except cuda-twin (one captured tree size each)."""
    if kind == "cuda-twin":
        return {n: choose_backend(kind, model, draft, tree_nodes=n) for n in CHAINS}
    backend = choose_backend(kind, model, draft)
    return dict.fromkeys(CHAINS, backend)


def verify_greedy(backend, tree, at: int):
    """A chain as a tree at cache slot `at` (root position `at`), then its greedy acceptance -> (path, bonus)."""
    logits, _ = backend.verify(tree.tokens, tree.depth, tree.mask, at, at)
    return accept_greedy(tree, logits)


def draft_cycle(drafter, feats, nxt, pair_pos, root, root_pos: int):
    """The draft's extend over the committed pairs, then an uncut chain: one call where the drafter has a greedy
    cycle, else `extend` and `draft_tree` -> the chain to verify (root first)."""
    if hasattr(drafter, "draft_cycle"):
        return drafter.draft_cycle(feats, nxt, pair_pos, DRAFTED, root, root_pos, DRAFT_DEPTH, 0.0, None)
    h_root = drafter.extend(feats, nxt, pair_pos, DRAFTED, last_only=True)  # (1, C)
    return draft_tree(drafter, root, h_root, DRAFTED + PAIRS, root_pos, TreeConfig.chain(DRAFT_DEPTH, 0.0)).tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--context", type=int, default=120, help="cached slots before the timed steps")
    ap.add_argument("--prompts", default="84,186", help="comma-separated prompt lengths to prefill")
    ap.add_argument("--k", type=int, default=200, help="timed calls per median")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    pipe = Pipeline.from_pretrained(args.model, speculative=True)
    model, draft = pipe.model, pipe.draft
    lm = model.language_model
    at = args.context
    lengths = [int(t) for t in args.prompts.split(",")]
    if max(lengths) > CACHE or at + max(CHAINS) > CACHE:
        raise SystemExit(f"the prompts and --context + {max(CHAINS)} must fit the {CACHE}-slot cache")
    lm.setup_cache(1, CACHE, scratch=max(CHAINS))  # scratch: where a cuda-twin capture writes
    draft.prepare(CACHE, 600)

    gen = torch.Generator().manual_seed(0)
    width, vocab = lm.cfg.hidden_size, lm.cfg.vocab_size
    token = torch.tensor([[7]])  # (1, 1)
    trees = {n: chain_tree(torch.randint(10, vocab, (n,), generator=gen)) for n in CHAINS}
    prompts = {t: (torch.randn(1, t, width, generator=gen), torch.arange(t)[None]) for t in lengths}
    feats = torch.randn(PAIRS, width, generator=gen)  # (PAIRS, C) target features
    nxt = lm.embed_tokens.weight[torch.randint(10, vocab, (PAIRS,), generator=gen)]  # (PAIRS, C) next embeddings
    pair_pos, root, root_pos = torch.arange(at, at + PAIRS), torch.tensor([7]), at + PAIRS

    rows, skipped = [], {}
    for kind in BACKENDS:
        why = native_refusal(model, draft) if kind == "native" else None
        if why is not None:
            skipped[kind] = why
            print(f"{kind}: skipped ({why})", flush=True)
            continue
        fill_caches(lm, draft, seed=1)
        backends = make_backends(kind, model, draft)
        backend = backends[max(CHAINS)]
        row = {
            "backend": kind,
            "decode_step_ms": median_ms(lambda: backend.decode(token, at, at), args.k),
        }
        for n, tree in trees.items():
            b = backends[n]
            row[f"verify_{n}_ms"] = median_ms(lambda: verify_greedy(b, tree, at), args.k)
            row[f"verify_chain_{n}_ms"] = (
                median_ms(lambda: b.verify_chain(tree.tokens, at, at), args.k) if b.greedy_chain else None
            )
        drafter = backend.drafter
        row[f"draft_cycle_{DRAFT_DEPTH}_ms"] = median_ms(
            lambda: draft_cycle(drafter, feats, nxt, pair_pos, root, root_pos), args.k
        )
        for t, (embeds, pos) in prompts.items():
            backend.ready_prefill(t)  # a cuda backend's length bucket, made before it is timed
            row[f"prefill_{t}_ms"] = median_ms(lambda: backend.prefill(embeds, pos), max(20, args.k // 10))
        distinct = {id(b): b for b in backends.values()}.values()
        row["setup_ms"] = sum(b.setup_ms for b in distinct)
        row["eager_steps"] = sum(b.stats["eager_steps"] for b in distinct) if kind == "cuda-twin" else None
        rows.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})

    if rows:
        print(f"{'':>20}" + "".join(f"{r['backend']:>13}" for r in rows))
        for key in [k for k in rows[0] if k != "backend"]:
            print(f"{key:>20}" + "".join(f"{'-' if r[key] is None else format(r[key], '.3f'):>13}" for r in rows))
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
                "skipped": skipped,
            }
        )
    )


if __name__ == "__main__":
    main()
