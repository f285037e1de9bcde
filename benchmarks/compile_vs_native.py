"""The native C++ steps against the module path compiled by torch.compile, side by side, through the backends.

    python benchmarks/compile_vs_native.py --model drive-tiny

Three backends of `litevlm.model.backend` run the same calls on the same inputs, on the model's decoder with a
cache filled to --context slots (random K/V): the modules eagerly (`ModulesBackend`, the reference), the native C++
steps (`NativeBackend`, cpu_steps.cpp), and the CUDA backend's shape-static steps compiled by torch.compile with
inductor on the CPU (`CudaBackend(..., twin=True, compile=True, compile_steps=True)`: the step of the KV-length bucket
the calls fall in, compiled once and replayed on its static buffers, as a GPU replays its graph). The steps:
(a) a plain decode step (layers, final norm, LM head); (b) the verification of the default draft tree (a chain of
depth + 1 tokens) with its greedy acceptance (the native backend's one-call `verify_chain`; the others `verify` then
`accept_greedy`); (c) the prefill of a --prompt-token prompt (the compiled path pads it to its length bucket, as a
generation does). The compiled steps take the slot and position as tensors, so one build serves every slot of its
bucket. The CUDA backend compiles no draft step, so the draft cycle is not compared here (benchmarks/cpu_steps.py
times it on every backend). Medians after warm-up, at 1 thread and at the machine's default count (--threads); the
compiled backend is built afresh at each count, and compile_s is the one-off cost of a step there (compilation and
capture, or the prefill bucket's compilation; shorter on a repeat run, from inductor's cache on disk). A compile
that fails is reported with its error. AOTInductor is not measured (aoti_ms is null): the backends build no
AOTInductor package. The rule: a library path replaces the C++ for a step where it is within 10% of it at every
thread count measured.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from litevlm.eval import timing
from litevlm.model.backend import KV_BUCKETS, CudaBackend, ModulesBackend, NativeBackend, native_refusal
from litevlm.pipeline import Pipeline
from litevlm.spec.tree import TreeConfig, accept_greedy, chain_tree

RULE = "a library path replaces the C++ where it is within 10% of it"
DECODE, VERIFY = "decode step", "tree verification"


def short(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:200]


def verify_greedy(backend, tree, at: int):
    """A chain as a tree at cache slot `at` (root position `at`), then its greedy acceptance -> (path, bonus)."""
    logits, _ = backend.verify(tree.tokens, tree.depth, tree.mask, at, at)
    return accept_greedy(tree, logits)


def build_compiled(model, nodes: int, prompt: int, prefill: str):
    """The compiled cuda-twin at the current thread count -> (the backend or None, compile seconds per step, errors
    per step). Where the whole build fails, the decode step alone says whether it or the verification failed; the
    prefill is then built on a backend whose steps run eagerly."""
    options = dict(twin=True, compile=True, compile_steps=True, kv_buckets=())  # one bucket: the cache's length
    errors = {}
    try:
        backend = CudaBackend(model, tree_nodes=nodes, **options)
    except Exception as err:  # reported in the table and the JSON, not hidden
        whole = short(err)
        try:
            backend = CudaBackend(model, **options)  # the decode step alone
            errors[VERIFY] = whole
        except Exception as err:
            backend = None
            errors[DECODE] = short(err)
            errors[VERIFY] = f"not built: the decode step failed first ({errors[DECODE]})"
    seconds = {}
    if backend is not None:
        (w,) = backend.decode_graphs
        seconds[DECODE] = backend.decode_graphs[w].capture_ms / 1e3
        if w in backend.verify_graphs:
            seconds[VERIFY] = backend.verify_graphs[w].capture_ms / 1e3
    try:
        if backend is None:  # its steps run eagerly: only its prefill is timed
            backend = CudaBackend(model, twin=True, compile=True, kv_buckets=())
        before = backend.setup_ms
        backend.ready_prefill(prompt)
        seconds[prefill] = (backend.setup_ms - before) / 1e3
    except Exception as err:
        errors[prefill] = short(err)
    return backend, seconds, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--context", type=int, default=120, help="cached slots before the timed steps")
    ap.add_argument("--prompt", type=int, default=186, help="prompt length of the prefill (drive-tiny's six views)")
    ap.add_argument("--k", type=int, default=200, help="timed calls per median")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and the default)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    default_threads = torch.get_num_threads()
    thread_counts = sorted({1, default_threads}) if args.threads is None else [int(t) for t in args.threads.split(",")]

    pipe = Pipeline.from_pretrained(args.model)
    model = pipe.model
    lm = model.language_model
    why = native_refusal(model)
    if why is not None:
        raise SystemExit(f"the native CPU steps cannot run this model here ({why}): nothing to compare")
    at, nodes = args.context, TreeConfig().depth + 1
    need = max(at + nodes, args.prompt)
    bucket = next((w for w in KV_BUCKETS if w >= need), None)
    if bucket is None:
        raise SystemExit(f"--context + {nodes} and --prompt must fit the largest KV bucket ({KV_BUCKETS[-1]})")
    lm.setup_cache(1, bucket, scratch=nodes)  # the cache is the bucket the steps fall in: one build per step
    gen = torch.Generator().manual_seed(0)
    for layer in lm.layers:
        layer.self_attn.kv_cache.k.normal_(generator=gen)
        layer.self_attn.kv_cache.v.normal_(generator=gen)
    cfg = lm.cfg
    token = torch.tensor([[7]])  # (1, 1)
    tree = chain_tree(torch.randint(10, cfg.vocab_size, (nodes,), generator=gen))
    embeds, positions = torch.randn(1, args.prompt, cfg.hidden_size, generator=gen), torch.arange(args.prompt)[None]
    prefill = f"prefill {args.prompt}"

    eager, native = ModulesBackend(model), NativeBackend(model)
    calls = {  # step -> its call on a backend
        DECODE: lambda b: b.decode(token, at, at),
        # the native backend verifies a greedy chain in one call, as its generation does
        VERIFY: lambda b: b.verify_chain(tree.tokens, at, at) if b.greedy_chain else verify_greedy(b, tree, at),
        prefill: lambda b: b.prefill(embeds, positions),
    }

    rows, errors = [], {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        compiled, compile_s, failed = build_compiled(model, nodes, args.prompt, prefill)
        for step, why in failed.items():
            errors[f"{step}, inductor, {threads} thread(s)"] = why
            print(f"{step}: inductor failed at {threads} thread(s): {why}", flush=True)
        for step, call in calls.items():
            n = args.k if step != prefill else max(10, args.k // 10)
            warm = max(3, n // 10)
            row = {
                "step": step,
                "threads": threads,
                "eager_ms": timing.median_ms(lambda: call(eager), n, warmup=warm),
                "native_ms": timing.median_ms(lambda: call(native), n, warmup=warm),
                "inductor_ms": None
                if step in failed or compiled is None
                else timing.median_ms(lambda: call(compiled), n, warmup=warm),
                "aoti_ms": None,
                "compile_s": {"inductor": _round(compile_s.get(step))},
            }
            rows.append({k: _round(v) for k, v in row.items()})
    torch.set_num_threads(default_threads)

    kept = {}
    for step in calls:
        mine = [r for r in rows if r["step"] == step]
        if all(r["inductor_ms"] is not None for r in mine):
            worst = max(r["inductor_ms"] / r["native_ms"] for r in mine)  # over the thread counts
            kept[step] = "inductor" if worst <= 1.10 else "native"
        else:
            kept[step] = "native"

    print(f"{'step':>20} {'thr':>4} {'eager':>9} {'native':>9} {'inductor':>9}   compile s")
    for r in rows:
        cells = [r["eager_ms"], r["native_ms"], r["inductor_ms"]]
        seconds = r["compile_s"]["inductor"]
        comp = "failed" if seconds is None else f"{seconds:.1f}"
        print(f"{r['step']:>20} {r['threads']:>4} " + " ".join(_cell(v) for v in cells) + f"   {comp}")
    for where, why in errors.items():
        print(f"{where} failed: {why}")
    print("kept: " + ", ".join(f"{k}: {v}" for k, v in kept.items()) + f" ({RULE})")
    print(
        json.dumps(
            {
                "benchmark": "compile_vs_native",
                "model": args.model,
                "context": at,
                "kv_bucket": bucket,
                "torch": torch.__version__,
                "rows": rows,
                "kept": kept,
                "rule": RULE,
                "errors": errors,
            }
        )
    )


def _round(v):
    return round(v, 4) if isinstance(v, float) else v


def _cell(v) -> str:
    return f"{'failed':>9}" if v is None else f"{v:>9.3f}"


if __name__ == "__main__":
    main()
