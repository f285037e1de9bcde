"""Why a verification costs more inside the speculative loop than alone: the target's weights cool off with time.

    python research/verify_decay.py --model drive-tiny --data /tmp/heldout

One chain verification (root + 5 drafts, the one CPU call the decode loop makes) is timed right
after each of several things: nothing (back to back), a busy wait on a few KB for 0.5 / 1.5 / 5 ms (time
passes, nothing of ours is evicted), a 1.5 ms sleep, a read of 2 MB and of 16 MB of unrelated data. If
the busy waits cost as much as the reads, the slowdown is the machine's caches dropping the target's
weights over time (other cores and tenants), not the draft head's own traffic. Medians over --k calls
each; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from litevlm.data.drivelm import load_images, load_samples
from litevlm.pipeline import Pipeline
from litevlm.spec.tree import verify_chain_greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--data", required=True)
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    pipe = Pipeline.from_pretrained(args.model)
    sample = load_samples(args.data)[0]
    pipe.answer(sample.question, load_images(sample))  # sizes the caches; its prompt stays in slots 0..
    model = pipe.model
    plan = model.language_model.step_plan()
    if plan is None:
        raise SystemExit("the one-call CPU step does not apply here (needs fp32 on the CPU)")
    chain = torch.arange(7, 13)
    tiny, mid, big = torch.randn(64, 64), torch.randn(724, 724), torch.randn(2048, 2048)  # 16 KB, 2 MB, 16 MB

    def spin(ms: float):
        def f():
            t = time.perf_counter()
            while time.perf_counter() - t < ms / 1e3:
                tiny.sum()

        return f

    before = {
        "back to back": lambda: None,
        "busy 0.5 ms": spin(0.5),
        "busy 1.5 ms": spin(1.5),
        "busy 5 ms": spin(5.0),
        "sleep 1.5 ms": lambda: time.sleep(0.0015),
        "read 2 MB": lambda: mid.sum(),
        "read 16 MB": lambda: big.sum(),
    }
    slot = 100
    result = {}
    for name, f in before.items():
        times = []
        for _ in range(args.k):
            f()
            t = time.perf_counter()
            verify_chain_greedy(model, chain, slot, slot, plan)
            times.append(time.perf_counter() - t)
        times.sort()
        result[name] = round(times[len(times) // 2] * 1e3, 3)
        print(f"{name:14s} {result[name]:6.2f} ms")
    print(
        json.dumps(
            {
                "verify_ms_after": result,
                "chain": int(chain.numel()),
                "k": args.k,
                "machine": f"{platform.machine()} {args.threads} threads",
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
