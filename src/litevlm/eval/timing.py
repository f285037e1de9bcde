"""Wall-clock timing for the benchmark scripts: one median helper, so they all warm up and measure alike."""

from __future__ import annotations

import statistics
import time


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
