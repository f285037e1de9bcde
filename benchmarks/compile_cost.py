"""What compiling a CUDA-backend step costs: one decoder layer that every layer reuses (the backend's way,
`litevlm.model.backend.CudaBackend._compiled`) against the whole step, measured with inductor on this CPU.

A decode step of drive-hd's decoder (256 wide, 4 / 2 heads) over a 512-slot KV bucket, at its own depth (6 layers)
and at the 2B model's (24 layers: its layers repeated), each form in a fresh process with an empty inductor cache, so
every compile is a cold one: `compile_s` is the first call (trace, compile, run); `graphs` the graphs dynamo made
(a recompile per layer would make one a layer); `ops` the operations captured in them (one layer's, or every layer's);
`step_ms` a later call's mean (eager between the compiled layers on the CPU; inside a captured CUDA graph that Python
runs only at capture); `max_diff` the largest difference from the eager step's logits. The last line is JSON.

    python benchmarks/compile_cost.py [--depths 6,24] [--width 512] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ("layer", "whole")


def one(depth: int, mode: str, width: int, threads: int) -> dict:
    """One cold compile of the decode step in `mode`, in this process."""
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from litevlm.model.backend import _decode_static
    from litevlm.model.lm import run_layer
    from litevlm.models import load_model

    torch.set_num_threads(threads)
    model = load_model("drive-hd").model.eval()
    lm = model.language_model
    base = len(lm.layers)
    while len(lm.layers) < depth:  # the 2B model's depth: drive-hd's layers again (the cost is in the shapes)
        lm.layers.append(copy.deepcopy(lm.layers[len(lm.layers) % base]))
    del lm.layers[depth:]
    lm.setup_cache(1, width, scratch=8)
    token, position = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    slot = torch.tensor([width])  # a scratch slot, as a capture writes
    if mode == "layer":
        step = functools.partial(_decode_static, layer_step=torch.compile(run_layer, dynamic=False, fullgraph=True))
    else:
        step = torch.compile(_decode_static, dynamic=False, fullgraph=True)
    with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        want, _ = _decode_static(model, token, position, slot, width)
        t0 = time.perf_counter()
        got, _ = step(model, token, position, slot, width)
        compile_s = time.perf_counter() - t0
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            step(model, token, position, slot, width)
        step_ms = (time.perf_counter() - t0) / n * 1e3
    return {
        "depth": depth,
        "mode": mode,
        "compile_s": round(compile_s, 2),
        "graphs": counters["stats"]["unique_graphs"],
        "ops": counters["stats"]["calls_captured"],
        "step_ms": round(step_ms, 3),
        "max_diff": float((got - want).abs().max()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="6,24")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", nargs=2, metavar=("DEPTH", "MODE"), help=argparse.SUPPRESS)  # a child's single run
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.width, args.threads)))
        return
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as cache:  # a cold inductor cache for each run
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                cmd = [sys.executable, __file__, "--one", str(depth), mode, "--width", str(args.width)]
                cmd += ["--threads", str(args.threads)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{depth} layers, {mode}: {out.stderr[-2000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{depth} layers, {mode}: {rows[-1]['compile_s']} s to compile", file=sys.stderr)
    print(json.dumps({"benchmark": "compile_cost", "width": args.width, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
