"""The CUDA backend's steps at a real model's shapes, one at a time, against the floor a decode cannot beat.

A speculative decoder pays off on a GPU only if its steps cost what the hardware allows: a plain decode step reads
every decoder weight once, so its floor is those bytes (and the cache slots it attends over) at the device's memory
bandwidth; verifying a full draft tree reads the same weights once for all its nodes, so it should cost little more
than a decode; and FP8 weights are half the bytes, so an FP8 decode should cost less. This measures each, through
the product's own steps (`litevlm.model.backend.CudaBackend`, random weights at the preset's shapes, bf16, batch 1):

  bandwidth     the device's memory bandwidth, measured: the best of a 1 GiB read (a sum) and a 1 GiB copy
  floor_ms      the bytes a decode step must read (decoder layers, final norm, LM head, the KV bucket it attends
                over) at that bandwidth
  decode_ms     one decode step over a KV bucket of `--width` slots (the backend's `decode`: its static inputs
                written, the graph replayed, the device synchronised)
  verify_ms     one verification of a full draft tree (the 2B bench rows' fixed 17-node chain) over the same bucket
  draft_ms      one replayed draft chain of the tree's depth (the draft head's one layer per level, argmax on the
                device), bf16 only
  prefill_ms    a `--prompt`-token prompt through the backend's prefill (eager, pinned to a fused kernel)
  modules_ms    one decode step on the modules (eager, no graph): what the graphs save

Variants, in this order while the time budget lasts (`--budget-s`; a compile started before the deadline runs to its
end, so leave the caller's timeout a minute above it): bf16 and FP8 (the preset's dynamic per-row recipe) with the
steps eager inside their graphs, then the same compiled inside (inductor, one decoder layer that every layer reuses),
then bf16's draft chain compiled (the whole chain: its compile is the longest; `--no-compiled-draft` leaves it out).
Each row is printed to stderr and appended to `--jsonl` the moment it is measured; the last line of stdout is JSON,
with the GPU goals checked in `goals`: decode within 1.5x of the floor, a full tree's verification within 1.3x of a
decode, FP8's decode no slower than bf16's.

    python benchmarks/step_costs.py                          # on a GPU: every variant
    python benchmarks/step_costs.py --budget-s 40 --jsonl steps.jsonl
    python benchmarks/step_costs.py --dry-run-cpu            # the same code on the CPU twin, tiny shapes

Without a CUDA device (and without --dry-run-cpu) it prints a JSON line saying it was skipped and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time

import torch

from litevlm.config import preset
from litevlm.eval.timing import median_ms
from litevlm.model.backend import CudaBackend, ModulesBackend
from litevlm.model.kv_cache import KVCache
from litevlm.model.vlm import VLM
from litevlm.quant.fp8 import MIN_CAPABILITY, FP8Linear, FP8Recipe, quantize_model
from litevlm.spec.draft import DraftConfig, DraftHead
from litevlm.spec.tree import TreeConfig

GOALS = {"decode_vs_floor": 1.5, "verify_vs_decode": 1.3, "fp8_vs_bf16_decode": 1.0}
FP8_RECIPE = "fp8-dynamic-per-row"  # the "litevlm fp8" preset's


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bandwidth_gbs(device: torch.device, nbytes: int, iters: int) -> dict:
    """The memory bandwidth in GB/s: a read of `nbytes` (a sum over int32 words, read once) and a copy of them
    (read and written), each the median of `iters`."""
    src = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    read = median_ms(lambda: src.sum(), iters, 2, device=device)
    copy_ms = median_ms(lambda: dst.copy_(src), iters, 2, device=device)
    return {"read_gbs": round(nbytes / read / 1e6, 1), "copy_gbs": round(2 * nbytes / copy_ms / 1e6, 1)}


def step_bytes(model: VLM, width: int) -> dict:
    """The bytes one decode step must read: every decoder layer's weights (FP8 weights and scales included), the final
    norm, the LM head, and the K/V of the `width` cache slots it attends over (every layer's)."""
    lm = model.language_model

    def nbytes(module) -> int:
        cache = {id(t) for m in module.modules() if isinstance(m, KVCache) for t in m.buffers()}
        tensors = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in cache]
        return sum(t.numel() * t.element_size() for t in tensors)

    weights = nbytes(lm.layers) + nbytes(lm.norm) + nbytes(model.lm_head)
    cache = lm.layers[0].self_attn.kv_cache
    kv = 2 * len(lm.layers) * cache.k.shape[1] * width * cache.k.shape[3] * cache.k.element_size()
    return {"weights": weights, "kv": kv}


def tiny_config():
    from fp8_gpu import tiny_config as tiny  # the FP8 benchmark's dry-run shapes (this folder is on sys.path)

    return tiny()


class Run:
    """What the run has measured so far: each row appended to `--jsonl` as it comes, and what the budget left out."""

    def __init__(self, jsonl: str | None, budget_s: float | None):
        self.jsonl, self.t0 = jsonl, time.perf_counter()
        self.deadline = self.t0 + (math.inf if budget_s is None else budget_s)
        self.rows: list[dict] = []
        self.left_out: list[str] = []

    def spent(self, what: str) -> bool:
        if time.perf_counter() <= self.deadline:
            return False
        self.left_out.append(f"{what}: the time budget was spent")
        log(f"  {what}: left out (the time budget was spent)")
        return True

    def emit(self, row: dict) -> None:
        """The row measured so far (again when a later item adds to it: the last line of a row is the whole row)."""
        row["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        if not any(r is row for r in self.rows):
            self.rows.append(row)
        log("  " + json.dumps(row))
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")


@torch.no_grad()
def measure_target(name: str, model: VLM, draft, compiled: bool, args, device: torch.device) -> tuple:
    """One variant's target steps: a backend over a one-bucket cache of `args.width` live slots, its decode and a full
    tree's verification replayed; the prefill and the modules' decode too where the steps are eager inside their
    graphs. A decode at slot `prompt` (after the prompt), the tree's root there too: what a step costs does not
    depend on what the cache holds."""
    n, width, p = args.tree.total_tokens, args.width, args.prompt
    lm = model.language_model
    lm.setup_cache(1, width, scratch=n)
    t0 = time.perf_counter()
    backend = CudaBackend(
        model,
        draft,
        tree_nodes=n,
        twin=device.type != "cuda",
        compile=False,
        compile_steps=compiled,
        kv_buckets=(),
        prefill_buckets=(),
    )
    row = {"variant": name, "steps": "compiled" if compiled else "eager", "setup_s": round(time.perf_counter() - t0, 1)}
    token = torch.tensor([[7]], device=device)
    row["decode_ms"] = median_ms(lambda: backend.decode(token, p, p), args.iters, args.warmup, device=device)
    tokens = torch.full((n,), 7, dtype=torch.long, device=device)
    depth = torch.arange(n, device=device)
    chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    row["verify_ms"] = median_ms(
        lambda: backend.verify(tokens, depth, chain, p, p), args.iters, args.warmup, device=device
    )
    if not compiled:
        few = max(2, args.iters // 5)  # a prompt, or an eager step, is slow: fewer of them
        g = torch.Generator(device="cpu").manual_seed(0)
        embeds = (torch.randn(1, p, lm.cfg.hidden_size, generator=g) * 0.02).to(device, lm.embed_tokens.weight.dtype)
        positions = torch.arange(p, device=device)[None]
        row["prefill_ms"] = median_ms(lambda: backend.prefill(embeds, positions), few, 1, device=device)
        modules = ModulesBackend(model)
        row["modules_ms"] = median_ms(lambda: modules.decode(token, p, p), few, 1, device=device)
    if backend.stats.get("eager_steps", 0):
        raise RuntimeError(f"{name}: {backend.stats['eager_steps']} steps ran outside the captured graphs")
    row["kernels"] = backend.kernels
    return row, backend


@torch.no_grad()
def measure_draft(backend: CudaBackend, args, device: torch.device) -> float:
    """One replayed draft chain of the tree's depth, its root at the prompt's end (ms; its capture, and compile with
    compiled steps, on the first call)."""
    drafter, lm, p, depth = backend.drafter, backend.lm, args.prompt, args.tree.depth
    drafter.prepare(args.width + depth, p + depth + 1)
    root = lm.norm(lm.embed_tokens(torch.tensor([[7]], device=device)))[:, 0]  # (1, C): any feature will do
    return median_ms(lambda: drafter.draft_chain(root, p, p, depth, 0.0, None), args.iters, args.warmup, device=device)


STEP_KEYS = ("decode_ms", "verify_ms", "draft_ms", "prefill_ms", "modules_ms")


def goals(rows: list[dict], floor_ms: float) -> dict:
    """The GPU goals from the rows: each from the compiled steps where measured, else the eager ones."""
    by = {(r["variant"], r["steps"]): r for r in rows}
    out: dict = {}

    def best(variant: str) -> dict | None:
        return by.get((variant, "compiled")) or by.get((variant, "eager"))

    def goal(key: str, value: float, source: str) -> None:
        out[key] = {"value": round(value, 3), "goal": GOALS[key], "met": value <= GOALS[key], "from": source}

    bf16 = best("bf16")
    if bf16 is not None:
        src = f"bf16 {bf16['steps']}"
        goal("decode_vs_floor", bf16["decode_ms"] / floor_ms, src)
        goal("verify_vs_decode", bf16["verify_ms"] / bf16["decode_ms"], src)
        fp8 = by.get((FP8_RECIPE, bf16["steps"]))
        if fp8 is None and bf16["steps"] == "compiled":  # the compiled FP8 row was left out: compare eager with eager
            bf16, fp8 = by.get(("bf16", "eager")), by.get((FP8_RECIPE, "eager"))
        if fp8 is not None and bf16 is not None:
            goal("fp8_vs_bf16_decode", fp8["decode_ms"] / bf16["decode_ms"], f"{FP8_RECIPE} {fp8['steps']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2b", help="the preset whose shapes the weights take (random weights)")
    ap.add_argument("--width", type=int, default=1024, help="the KV bucket a step attends over (slots)")
    ap.add_argument("--prompt", type=int, default=858, help="prompt tokens (LiteVLM's at the 2B shapes); < width")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="bf16 only")
    ap.add_argument("--no-compiled", dest="compiled", action="store_false", help="steps eager inside their graphs only")
    ap.add_argument(
        "--no-compiled-draft",
        dest="compiled_draft",
        action="store_false",
        help="leave out the compiled draft chain (the whole chain's compile: a minute and more at depth 16)",
    )
    ap.add_argument("--dry-run-cpu", action="store_true", help="check the script on the CPU twin with a tiny config")
    ap.add_argument("--budget-s", type=float, default=None, help="start nothing new after this many seconds")
    ap.add_argument("--jsonl", default=None, help="append each row to this file as one JSON line as it is measured")
    args = ap.parse_args(argv)

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "step_costs", "skipped": True, "reason": "no CUDA device", "measured": False}))
        return 0
    device = torch.device("cpu" if args.dry_run_cpu else "cuda")
    cfg = tiny_config() if args.dry_run_cpu else preset(args.shape)
    if args.dry_run_cpu:
        args.width, args.prompt = 128, min(args.prompt, 40)
    if not 0 < args.prompt < args.width:
        raise SystemExit(f"--prompt ({args.prompt}) must be between 0 and --width ({args.width})")
    args.tree = TreeConfig(min_value=0.0)  # the fixed-size chain the 2B bench rows verify
    fp8 = args.fp8 and (device.type != "cuda" or torch.cuda.get_device_capability() >= MIN_CAPABILITY)

    run = Run(args.jsonl, args.budget_s)
    torch.manual_seed(0)
    with torch.device(device):
        model = VLM(cfg).to(torch.bfloat16).eval()
        draft = DraftHead(DraftConfig.for_target(cfg.text), model).to(torch.bfloat16).eval()
    model.language_model.setup_cache(1, args.width)
    need = step_bytes(model, args.width)
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    bw = bandwidth_gbs(device, nbytes, 10)
    floor_ms = (need["weights"] + need["kv"]) / max(bw.values()) / 1e6
    log(f"{cfg.name}: {need['weights'] / 1e9:.2f} GB of decoder weights, {need['kv'] / 1e6:.0f} MB of K/V at width")
    log(f"  {args.width}; bandwidth {bw} GB/s: floor {floor_ms:.3f} ms a decode step")

    variants = [("bf16", model, draft)]
    if fp8:
        q = copy.deepcopy(model)
        report = quantize_model(q, FP8Recipe(FP8_RECIPE))
        variants.append((FP8_RECIPE, q, None))
        log(report.summary().splitlines()[0])
    # the eager steps of every variant first (captures only, seconds), then the compiled ones (a compile each of one
    # decoder layer for the decode and the verification), the compiled draft chain (a whole chain's compile) last
    plan = [("target", v, False) for v in variants]
    if args.compiled:
        plan += [("target", v, True) for v in variants]
        if args.compiled_draft:
            plan.append(("draft", variants[0], True))
        else:
            run.left_out.append("the compiled draft chain: --no-compiled-draft")
    else:
        run.left_out.append("the compiled steps: --no-compiled")
    rows: dict[tuple, dict] = {}
    backends: dict[tuple, CudaBackend] = {}
    for kind, (name, m, d), compiled in plan:
        key = (name, compiled)
        what = f"{name} {'compiled' if compiled else 'eager'}" + (" draft chain" if kind == "draft" else "")
        if run.spent(what):
            continue
        log(f"== {what}")
        if kind == "target":
            row, backends[key] = measure_target(name, m, d, compiled, args, device)
            row["decode_vs_floor"] = round(row["decode_ms"] / floor_ms, 3)
            row["verify_vs_decode"] = round(row["verify_ms"] / row["decode_ms"], 3)
            row["fp8_layers"] = sum(isinstance(x, FP8Linear) for x in m.modules())
            rows[key] = row
            run.emit(row)
        if key not in rows or d is None or (compiled and kind == "target"):
            continue  # a draft chain after its own target steps; the compiled one last of all
        row = rows[key]
        row["draft_ms"] = measure_draft(backends[key], args, device)
        # a cycle (draft, then verify) over a decode: the tokens a cycle must commit for EAGLE to break even
        row["break_even_tau"] = round((row["draft_ms"] + row["verify_ms"]) / row["decode_ms"], 2)
        run.emit(row)
    for row in rows.values():
        for k in STEP_KEYS:
            if k in row:
                row[k] = round(row[k], 4)

    record = {
        "benchmark": "step_costs",
        "skipped": False,
        "measured": device.type == "cuda",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability()) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "config": cfg.name,
        "width": args.width,
        "prompt_tokens": args.prompt,
        "tree_nodes": args.tree.total_tokens,
        "draft_depth": args.tree.depth,
        "weight_bytes": need["weights"],
        "kv_bytes": need["kv"],
        "bandwidth_gbs": bw,
        "floor_ms": round(floor_ms, 4),
        "rows": run.rows,
        "goals": goals(run.rows, floor_ms),
        "left_out": run.left_out,
        "wall_s": round(time.perf_counter() - run.t0, 1),
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
