"""FP8 against bf16 at the paper's 2B shapes, on one CUDA GPU, in one run.

Stages, each timed eager and compiled (wall ms, device synchronised, median after warm-up):
  vision   InternViT-300M + pixel shuffle + projector on 12 448-px tiles (encode_tiles)
  prefill  the InternLM2.5-1.8B-shaped decoder over 858 tokens (LiteVLM) and 3214 tokens (baseline), causal from
           cache slot 0 without a mask (SDPA's is_causal kernel, as the pipeline's prefill runs)
  decode   one token after a 3214-token prompt; compiled with mode="reduce-overhead" (a CUDA graph)
Weights are random (bf16); the static recipe is calibrated on the benchmark's own inputs. FP8 rows
use litevlm.quant.fp8 with include_vision=True (decoder linears always; vision linears for the vision
row). The SQNR column compares each FP8 stage's output with bf16's.

Needs CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell). Without one it prints a JSON
line saying it was skipped and why, and exits 0. `--dry-run-cpu` runs the same code on the CPU with a
tiny config and the "eager" compile backend, to check the script itself (its timings mean nothing).
The last line of stdout is JSON.

Every variant (bf16, then each recipe) is timed eager first; then compiled, stage by stage (decode first), every
variant of a stage in turn (each compile takes tens of seconds at these shapes). `--budget-s S` keeps the run inside
about S seconds: a stage not started when the budget is spent is left out and listed in the JSON (`left_out`). A
compile started before the deadline runs to its end: leave the caller's timeout a minute above S. `--jsonl PATH`
appends each stage to PATH as one JSON line the moment it is measured, so a run cut short keeps what it measured.

    python benchmarks/fp8_gpu.py                       # everything (allow ~10 min for the compiles)
    python benchmarks/fp8_gpu.py --stages decode --recipes fp8-dynamic-per-row
    python benchmarks/fp8_gpu.py --recipes fp8-dynamic-per-row --budget-s 100 --jsonl fp8.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time

import torch

from litevlm.config import TextConfig, VisionConfig, VLMConfig, preset
from litevlm.model.vlm import VLM
from litevlm.quant.fp8 import MIN_CAPABILITY, RECIPES, FP8Recipe, calibrate, quantize_model, sqnr


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name()} has compute capability {cap[0]}.{cap[1]}; FP8 GEMMs need >= 8.9"
    return None


def tiny_config() -> VLMConfig:
    return VLMConfig(
        vision=VisionConfig(
            hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, image_size=56, patch_size=14
        ),
        text=TextConfig(
            vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
        ),
        image_token_id=500,
        img_start_id=501,
        img_end_id=502,
        eos_token_id=503,
        pad_token_id=0,
        name="tiny",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup: int, iters: int, graphs: bool = False) -> tuple[float, float]:
    """(first call incl. compile ms, median ms of `iters` calls after `warmup` more)."""

    def call():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn()

    sync(device)
    t0 = time.perf_counter()
    call()
    sync(device)
    first = (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        call()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times)


class Stages:
    """The three stages of one model as zero-argument callables over fixed inputs."""

    def __init__(self, model: VLM, tiles: int, prefill_lens: list[int], device: torch.device):
        cfg = model.cfg
        self.model, self.device = model, device
        g = torch.Generator(device="cpu").manual_seed(0)
        s = cfg.vision.image_size
        self.pixels = torch.randn(tiles, 3, s, s, generator=g).to(device, torch.bfloat16)
        self.max_prefill = max(prefill_lens)
        self.cache_len = self.max_prefill + 16
        ids = torch.randint(0, cfg.text.vocab_size, (1, self.max_prefill), generator=g).to(device)
        with torch.no_grad():
            self.embeds = model.language_model.embed_tokens(ids)  # (1, T, C) bf16
        self.prefill_lens = prefill_lens
        # decode: a fixed-shape step (tensor slot, mask over the whole cache), as a CUDA graph wants it
        slot = self.max_prefill
        self.tok = torch.tensor([[7]], device=device)
        self.pos = torch.tensor([[slot]], device=device)
        self.slot = torch.tensor([slot], device=device)
        self.mask = (torch.arange(self.cache_len, device=device) <= slot)[None, None, None]  # (1, 1, 1, S)

    def setup(self, model: VLM) -> None:
        model.language_model.setup_cache(1, self.cache_len, dtype=torch.bfloat16, device=self.device)

    def fns(self, model: VLM, compile_kw: dict | None, decode_kw: dict | None) -> dict:
        lm = model.language_model

        def vision():
            return model.encode_tiles(self.pixels)

        def prefill(t: int):
            pos = torch.arange(t, device=self.device)[None]  # (1, T)
            # no mask, kv_len = T from slot 0: attention is SDPA's is_causal path (an explicit (T, T) mask would push
            # it off the fused causal kernels)
            hidden = lm(self.embeds[:, :t], pos, slots=pos[0], kv_len=t)
            return model.lm_head(hidden[:, -1])

        def decode():
            hidden = lm(lm.embed_tokens(self.tok), self.pos, slots=self.slot, mask=self.mask)
            return model.lm_head(hidden[:, -1])

        v, p, d = vision, prefill, decode
        if compile_kw is not None:
            v, p = torch.compile(vision, **compile_kw), torch.compile(prefill, dynamic=True, **compile_kw)
            d = torch.compile(decode, **(decode_kw or compile_kw))
        out = {"vision": v, "decode": d}
        for t in self.prefill_lens:
            out[f"prefill_{t}"] = lambda t=t: p(t)
        return out


def stage_order(fns: dict) -> list[str]:
    """Decode first (the one stage where FP8 can pay at batch 1: a token's step reads every weight once), then the
    prefills, the longest first, then vision. A decode step's time does not depend on what its cache holds."""
    return ["decode"] + [k for k in fns if k.startswith("prefill")] + ["vision"]


@torch.no_grad()
def measure(name: str, fns: dict, stage: str, mode: str, st: Stages, args, decode_kw, rows: dict, out) -> None:
    """One stage of one variant in one mode ("eager" or "compiled") into rows[stage], emitted at once (`out.stage`);
    left out (`out.left_out`) when the budget's deadline has passed."""
    if stage.split("_")[0] not in args.stages:
        return
    if time.perf_counter() > out.deadline:
        out.left_out.append(f"{name} {stage} {mode}: the time budget was spent")
        log(f"  {name:<24} {stage:<13} {mode:<9} left out (the time budget was spent)")
        return
    graphs = mode == "compiled" and stage == "decode" and (decode_kw or {}).get("mode") == "reduce-overhead"
    first, ms = time_ms(fns[stage], st.device, args.warmup, args.iters, graphs)
    row = rows.setdefault(stage, {})
    row[f"{mode}_ms"] = round(ms, 4)
    row[f"{mode}_first_call_ms"] = round(first, 1)
    if mode == "eager":  # accuracy from the eager outputs (a CUDA graph's outputs are reused buffers)
        y = fns[stage]().float()
        if name == "bf16":
            out.refs[stage] = y
        elif stage in out.refs:
            row["sqnr_db_vs_bf16"] = round(sqnr(out.refs[stage], y), 2)
    log(f"  {name:<24} {stage:<13} {mode:<9} {ms:9.3f} ms   (first call {first / 1e3:.1f} s)")
    out.stage(name, mode, stage, row)


class Output:
    """What the run has measured so far: the bf16 references for the SQNR, what the budget left out, and each
    stage appended to `--jsonl` as one JSON line the moment it is measured."""

    def __init__(self, jsonl: str | None, budget_s: float | None):
        self.jsonl, self.t0 = jsonl, time.perf_counter()
        self.deadline = self.t0 + (math.inf if budget_s is None else budget_s)
        self.refs: dict[str, torch.Tensor] = {}
        self.left_out: list[str] = []

    def stage(self, variant: str, mode: str, stage: str, row: dict) -> None:
        if self.jsonl:
            line = {"variant": variant, "mode": mode, "stage": stage, **row}
            line["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(line) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated FP8 recipes")
    ap.add_argument("--stages", default="vision,prefill,decode")
    ap.add_argument("--tiles", type=int, default=12)
    ap.add_argument("--prefill", default="858,3214", help="comma-separated prompt lengths")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-eager", dest="eager", action="store_false", help="time compiled runs only")
    ap.add_argument(
        "--no-compiled",
        dest="compiled",
        action="store_false",
        help="time eager runs only (no compile: a 2B decode's compile outlasts a short session's budget)",
    )
    ap.add_argument("--fast-accum", action="store_true", help="cuBLAS fast accumulation in the FP8 GEMM")
    ap.add_argument("--dry-run-cpu", action="store_true", help="check the script on the CPU with a tiny config")
    ap.add_argument("--budget-s", type=float, default=None, help="finish within this many seconds (default: no limit)")
    ap.add_argument("--jsonl", default=None, help="append each stage measured to this file as one JSON line")
    args = ap.parse_args(argv)
    args.stages = set(args.stages.split(","))
    recipes = [r for r in args.recipes.split(",") if r]
    prefill_lens = [int(t) for t in args.prefill.split(",")]

    reason = None if args.dry_run_cpu else skip_reason()
    if reason is not None:
        print(json.dumps({"benchmark": "fp8_gpu", "skipped": True, "reason": reason, "measured": False}))
        return 0
    device = torch.device("cpu" if args.dry_run_cpu else "cuda")
    if args.dry_run_cpu:
        # the CPU decoder reads its RoPE table up to the positions' max (data-dependent): graph breaks allowed here
        cfg, compile_kw, decode_kw = tiny_config(), {"backend": "eager"}, {"backend": "eager"}
        prefill_lens = [min(t, 24 + 8 * i) for i, t in enumerate(prefill_lens)]
        args.tiles = min(args.tiles, 2)
    else:
        cfg, compile_kw, decode_kw = preset("2b"), {}, {"mode": "reduce-overhead", "fullgraph": True}

    t_start = time.perf_counter()
    out = Output(args.jsonl, args.budget_s)
    torch.manual_seed(0)
    with torch.device(device):
        model = VLM(cfg)
    model = model.to(torch.bfloat16).eval()
    st = Stages(model, args.tiles, prefill_lens, device)
    st.setup(model)
    log(f"{cfg.name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters on {device}")

    # Every variant made up front (quantising takes seconds, no compile), so that the cheap eager figures of all of
    # them come first and the compiles spend what is left of the budget.
    variants = {"bf16": model}
    results: dict[str, dict] = {"bf16": {}}
    for name in recipes:
        recipe = FP8Recipe(name, include_vision=True, fast_accum=args.fast_accum)
        q = copy.deepcopy(model)
        amax = None
        if recipe.static:  # max calibration on the benchmark's inputs (eager, with the bf16 weights)
            fns = st.fns(q, None, None)
            order = sorted(fns, key=lambda k: not k.startswith("prefill"))  # prefill fills the cache decode reads
            amax = calibrate(q, [fns[k] for k in order], recipe, progress=False)
        report = quantize_model(q, recipe, amax)
        log(report.summary().splitlines()[0])
        variants[name] = q
        results[name] = {"_layers": {"quantized": len(report.quantized), "unsupported": sorted(report.unsupported)}}
    for m in variants.values():
        st.setup(m)  # each variant its own cache
    if args.eager:  # 1. eager, every variant: FP8 against bf16, and the SQNR against bf16's outputs
        for name, m in variants.items():
            fns = st.fns(m, None, decode_kw)
            for stage in stage_order(fns):
                measure(name, fns, stage, "eager", st, args, decode_kw, results[name], out)
    # 2. compiled, stage by stage and every variant of a stage in turn, while the budget lasts: each stage's
    # compiled ratio comes as soon as it can, and the compiles the budget cannot hold are the last stages'
    if args.compiled:
        compiled = {name: st.fns(m, compile_kw, decode_kw) for name, m in variants.items()}
        for stage in stage_order(compiled["bf16"]):
            for name in variants:
                measure(name, compiled[name], stage, "compiled", st, args, decode_kw, results[name], out)
    else:
        out.left_out.append("every compiled stage: --no-compiled")
    del variants

    # table: stage | bf16 eager/compiled | per recipe eager/compiled, speed-up (compiled), SQNR; nan where skipped
    nan = float("nan")
    stages = [k for k in results["bf16"] if not k.startswith("_")]
    measured = recipes
    head = f"{'stage':<13} {'bf16 eager':>11} {'bf16 comp.':>11}"
    for name in measured:
        head += f" | {name + ' eager':>28} {'comp.':>9} {'x bf16':>7} {'SQNR dB':>8}"
    print(head)
    for stage in stages:
        b = results["bf16"][stage]
        line = f"{stage:<13} {b.get('eager_ms', nan):>11.3f} {b.get('compiled_ms', nan):>11.3f}"
        for name in measured:
            r = results[name].get(stage, {})
            ratio = b.get("compiled_ms", nan) / r.get("compiled_ms", nan)
            line += (
                f" | {r.get('eager_ms', nan):>28.3f} {r.get('compiled_ms', nan):>9.3f} "
                f"{ratio:>7.2f} {r.get('sqnr_db_vs_bf16', nan):>8.1f}"
            )
        print(line)
    record = {
        "benchmark": "fp8_gpu",
        "skipped": False,
        "measured": not args.dry_run_cpu,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability()) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "config": cfg.name,
        "tiles": args.tiles,
        "prefill_tokens": prefill_lens,
        "decode_position": st.max_prefill,
        "fast_accum": args.fast_accum,
        "compile": {"vision_prefill": compile_kw or "default", "decode": decode_kw},
        "iters": args.iters,
        "budget_s": args.budget_s,
        "left_out": out.left_out,
        "results": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(record, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
