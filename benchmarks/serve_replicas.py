"""Scale-out: one Ray Serve replica against two, one torch thread each, side by side on the same requests.

Starts a local Ray instance and deploys `litevlm serve`'s app twice through `litevlm.serve.replicas`: one
replica at /one and two replicas at /two, both alive for the whole run. It asks each distinct question
once, one at a time (the reference answers), then sends --requests streamed requests from --clients
threads to one deployment, then to the other, alternating for --rounds rounds so that a change in the
machine's load falls on both. The load generator is benchmarks/serve_load.py's. Reported per replica
count: answers/s, p50/p99 latency and time to first token, status counts, answers that differ from the
reference; and the throughput of two replicas over one.

    python benchmarks/serve_replicas.py --model drive-tiny --requests 64 --clients 8

Traffic goes to 127.0.0.1 only. The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import Counter

from serve_load import HEADERS, free_port, make_cases, run_load, summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="drive-tiny", help="bundled model name or checkpoint directory")
    p.add_argument("--requests", type=int, default=64, help="requests per replica count and round")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--rounds", type=int, default=2, help="alternations of one and two replicas")
    p.add_argument("--max-queue", type=int, default=16, help="each replica's --max-queue")
    p.add_argument("--timeout", type=float, default=120.0, help="the server's per-request --timeout (s)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--frames", type=int, default=5, help="distinct synthetic frames")
    p.add_argument("--questions", type=int, default=4, help="questions per frame")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=900)
    p.add_argument("--seed", type=int, default=11, help="synthetic stream seed")
    p.add_argument("--max-retry-sleep", type=float, default=1.0, help="cap on one Retry-After sleep (s)")
    return p.parse_args(argv)


def pooled(loads: list[dict], stride: int) -> dict:
    """The rounds of one replica count as one load: statuses and latencies pooled, wall times added. Round k's
    request i becomes request k * stride + i: with stride a multiple of the distinct requests, it asked the
    same question."""
    out = {"wall_s": 0.0, "statuses": Counter(), "latency_ms": [], "ttft_ms": [], "answers": {}}
    for k, load in enumerate(loads):
        out["wall_s"] += load["wall_s"]
        out["statuses"].update(load["statuses"])
        out["latency_ms"] += load["latency_ms"]
        out["ttft_ms"] += load["ttft_ms"]
        out["answers"].update({k * stride + i: text for i, text in load["answers"].items()})
    return out


def main(argv=None) -> int:
    import httpx
    import ray

    from litevlm.models import resolve_model_dir
    from litevlm.serve import replicas

    a = parse_args(argv)
    model_dir = resolve_model_dir(a.model)
    bodies = make_cases(a)
    streamed = [json.dumps({**json.loads(b), "stream": True}).encode() for b in bodies]
    counts = (1, 2)
    load_before = os.getloadavg()[0]
    # logical CPUs: one per replica of both deployments (the idle one uses none while the other is measured)
    ray.init(
        address="local", num_cpus=sum(counts), include_dashboard=False, log_to_driver=False, logging_level="warning"
    )
    try:
        port = free_port()
        app = {"model_name": "bench", "max_queue": a.max_queue, "timeout_s": a.timeout}
        urls = {
            n: replicas.deploy(
                str(model_dir),
                {"max_new_tokens": a.max_new_tokens},
                app,
                replicas=n,
                cpus_per_replica=1,
                port=port,
                name=f"replicas{n}",
                route_prefix=f"/{n}",
            )
            for n in counts
        }
        with httpx.Client(timeout=a.timeout + 30) as http:
            reference = []
            for body in bodies:  # one at a time, not streamed: the reference answers
                r = http.post(urls[1] + "/v1/chat/completions", content=body, headers=HEADERS)
                r.raise_for_status()
                reference.append(r.json()["choices"][0]["message"]["content"])
            for n in counts:  # warm-up: every replica has answered before the clock runs
                for body in bodies[: 2 * n]:
                    http.post(urls[n] + "/v1/chat/completions", content=body, headers=HEADERS).raise_for_status()
        loads = {n: [] for n in counts}
        for _ in range(a.rounds):
            for n in counts:
                loads[n].append(run_load(a, urls[n], streamed, a.clients))
    finally:
        replicas.shutdown(names=tuple(f"replicas{n}" for n in counts))
        ray.shutdown()
    results = {str(n): summary(a, pooled(loads[n], a.requests * len(bodies)), reference, len(bodies)) for n in counts}
    one, two = results["1"]["throughput_rps"], results["2"]["throughput_rps"]
    result = {
        "model": str(model_dir),
        "requests_per_round": a.requests,
        "rounds": a.rounds,
        "clients": a.clients,
        "max_queue": a.max_queue,
        "image_size": [a.width, a.height],
        "distinct_requests": len(bodies),
        "max_new_tokens": a.max_new_tokens,
        "threads_per_replica": 1,
        "host": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "replicas": results,
        "throughput_ratio": round(two / one, 3) if one else None,
    }
    print(
        f"Ray Serve replicas of {model_dir.name}, one thread each: {a.rounds} rounds of {a.requests} streamed "
        f"requests from {a.clients} clients, {a.width}x{a.height} images, {result['host']}, load average "
        f"{result['load_average']['before']} before, {result['load_average']['after']} after"
    )
    print(
        f"  {'replicas':>8}  {'p50 ms':>9}  {'p99 ms':>9}  {'TTFT p50':>9}  {'TTFT p99':>9}  {'answers/s':>9}  statuses"
    )
    for n, r in results.items():
        lat, ttft = r["latency_ms"], r["ttft_ms"]
        print(
            f"  {n:>8}  {lat['p50']:>9.1f}  {lat['p99']:>9.1f}  {ttft['p50']:>9.1f}  {ttft['p99']:>9.1f}  "
            f"{r['throughput_rps']:>9.2f}  {r['statuses']}  ({r['mismatches_vs_one_at_a_time']} differ)"
        )
    print(f"  two replicas: {result['throughput_ratio']}x the answers/s of one")
    print(json.dumps(result))
    expected = a.requests * a.rounds
    ok = all(
        r["five_xx"] == 0 and r["mismatches_vs_one_at_a_time"] == 0 and r["answered"] == expected
        for r in results.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
