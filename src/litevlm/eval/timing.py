"""Wall-clock timing for the benchmarks: one median helper, so that the scripts all warm up and measure alike, and
Table 1's measure over a set of questions (arXiv 2506.07416 averages its stage times: means, not medians)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence


def median_ms(fn, k: int, warmup: int = 10, setup=None, device=None) -> float:
    """Median wall milliseconds of fn() over k timed calls, after `warmup` untimed ones. setup(), when given,
    runs untimed before every call (warm-up included); with a device, it is synchronised around each timed call."""
    from litevlm.model.generate import sync

    times = []
    for i in range(warmup + k):
        if setup is not None:
            setup()
        if device is not None:
            sync(device)
        t0 = time.perf_counter()
        fn()
        if device is not None:
            sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 to 100) of `values`, interpolated linearly between the closest ranks (numpy's default):
    percentile(v, 50) is the median."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile: no values")
    k = (len(xs) - 1) * q / 100  # fractional rank
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean_latency(stages: Mapping[str, Sequence[float]], totals: Sequence[float], digits: int = 3) -> dict[str, float]:
    """Table 1's figures for one configuration over its questions: each stage's mean as `<stage>_ms`, `total_ms` the
    mean end-to-end time, `other_ms` what the total holds outside the stages (total less the stages, so that the
    stages and other add up to the total as rounded: other takes the rounding), and `p50_total_ms` and
    `p90_total_ms`, the total's median and 90th percentile, beside them. `stages` maps a stage to its time per
    question (ms), in the order of `totals`."""
    if not totals or any(len(v) != len(totals) for v in stages.values()):
        raise ValueError("mean_latency: every stage needs one time per question, and there must be questions")
    out = {f"{s}_ms": round(statistics.fmean(v), digits) for s, v in stages.items()}
    total = round(statistics.fmean(totals), digits)
    out["other_ms"] = round(total - sum(out.values()), digits)
    out["total_ms"] = total
    out["p50_total_ms"] = round(percentile(totals, 50), digits)
    out["p90_total_ms"] = round(percentile(totals, 90), digits)
    return out


def emulated_precision(model) -> bool:
    """True where the model holds FP8 layers that this device has no FP8 kernel for (a CPU, or a GPU below compute
    capability 8.9): they run the fake-quant reference, whose times say nothing about FP8's speed, so a row of such
    a model is an accuracy row, never a speed figure."""
    from litevlm.quant.fp8 import FP8Linear

    return any(isinstance(m, FP8Linear) and not m.use_kernel for m in model.modules())
