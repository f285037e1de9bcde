"""Load on `litevlm serve`: N requests from C concurrent clients over loopback, one server process.

Starts `python -m litevlm.serve` on a free 127.0.0.1 port, asks each distinct question once, one
at a time (the reference answers and the unloaded latency), then sends --requests requests from
--clients threads. A 429 is retried after its Retry-After (retry-after-ms, capped); any other
non-200 is counted and not retried. Reported: status counts, p50/p99 latency of answered attempts
and of whole requests (retries included), throughput, server-side stage medians, and whether every
answer under load equals the one-at-a-time answer.

    python benchmarks/serve_load.py --model drive-tiny --requests 200 --clients 16

Traffic goes to 127.0.0.1 only. The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="drive-tiny", help="bundled model name or checkpoint directory")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue")
    p.add_argument("--timeout", type=float, default=120.0, help="the server's per-request --timeout (s)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--frames", type=int, default=5, help="distinct synthetic frames")
    p.add_argument(
        "--questions", type=int, default=4, help="questions per frame (frames x questions distinct requests)"
    )
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=900)
    p.add_argument("--seed", type=int, default=11, help="synthetic stream seed")
    p.add_argument("--max-retry-sleep", type=float, default=1.0, help="cap on one Retry-After sleep (s)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p.parse_args(argv)


def make_cases(a) -> list[bytes]:
    """frames x questions chat-completion bodies, serialised once."""
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.serve import image_data_url, user_message

    bodies = []
    for f in range(a.frames):
        frame = make_frame(a.seed, f)
        urls = {c: image_data_url(im) for c, im in render_views(frame, size=(a.width, a.height)).items()}
        for qa in frame.qas[: a.questions]:
            bodies.append(json.dumps({"model": "bench", "messages": [user_message(qa.question, urls)]}).encode())
    return bodies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, port: int, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "litevlm.serve",
        "--model",
        a.model,
        "--model-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-queue",
        str(a.max_queue),
        "--timeout",
        str(a.timeout),
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--log-level",
        "warning",
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(http, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if http.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout_s:g} s")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_load(a, url: str, bodies: list[bytes]) -> dict:
    import httpx

    statuses: Counter = Counter()
    attempt_ms: list[float] = []  # answered (200) attempts
    request_ms: list[float] = []  # whole requests, 429 retries and their sleeps included
    answers: dict[int, tuple[int, str, dict]] = {}
    lock = threading.Lock()
    todo = iter(range(a.requests))
    barrier = threading.Barrier(a.clients + 1)
    headers = {"content-type": "application/json"}

    def client():
        with httpx.Client(timeout=a.timeout + 30) as http:
            barrier.wait()
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                t_req = time.perf_counter()
                while True:
                    t = time.perf_counter()
                    try:
                        r = http.post(url + "/v1/chat/completions", content=bodies[i % len(bodies)], headers=headers)
                        status = r.status_code
                    except httpx.TransportError as e:
                        status, r = f"transport:{type(e).__name__}", None
                    dt = (time.perf_counter() - t) * 1000
                    with lock:
                        statuses[status] += 1
                    if status != 429:
                        break
                    time.sleep(min(int(r.headers.get("retry-after-ms", 1000)) / 1000, a.max_retry_sleep))
                with lock:
                    request_ms.append((time.perf_counter() - t_req) * 1000)
                    if status == 200:
                        body = r.json()
                        attempt_ms.append(dt)
                        answers[i] = (200, body["choices"][0]["message"]["content"], body["litevlm"])
                    else:
                        answers[i] = (status, "", {})

    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return dict(
        wall_s=time.perf_counter() - t0,
        statuses=statuses,
        attempt_ms=attempt_ms,
        request_ms=request_ms,
        answers=answers,
    )


def main(argv=None) -> int:
    import httpx

    a = parse_args(argv)
    from litevlm.models import resolve_model_dir

    model_dir = resolve_model_dir(a.model)
    bodies = make_cases(a)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log, httpx.Client(timeout=a.timeout + 30) as http:
        proc = start_server(a, port, log)
        try:
            wait_healthy(http, url, proc, a.startup_timeout)
            http.post(
                url + "/v1/chat/completions", content=bodies[0], headers={"content-type": "application/json"}
            )  # warm-up
            alone_ms, reference = [], []
            for body in bodies:  # one at a time: the reference answers and the unloaded latency
                t = time.perf_counter()
                r = http.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                alone_ms.append((time.perf_counter() - t) * 1000)
                r.raise_for_status()
                reference.append(r.json()["choices"][0]["message"]["content"])
            load = run_load(a, url, bodies)
            metrics = http.get(url + "/metrics").text
        except Exception:
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    answers = load["answers"]
    mismatches = sum(1 for i, (s, text, _) in answers.items() if s == 200 and text != reference[i % len(bodies)])
    answered = sum(1 for s, _, _ in answers.values() if s == 200)
    five_xx = sum(n for s, n in load["statuses"].items() if isinstance(s, int) and s >= 500)
    stage_ms = {}
    exts = [ext for s, _, ext in answers.values() if s == 200]
    for stage in ("select_views", "vit", "select_tokens", "prefill", "decode", "total"):
        vals = [e["timings_ms"][stage] for e in exts if stage in e["timings_ms"]]
        if vals:
            stage_ms[stage] = round(statistics.median(vals), 2)
    gen_tokens = [e["generated_tokens"] for e in exts]
    result = {
        "model": str(model_dir),
        "requests": a.requests,
        "clients": a.clients,
        "max_queue": a.max_queue,
        "image_size": [a.width, a.height],
        "distinct_requests": len(bodies),
        "max_new_tokens": a.max_new_tokens,
        "host": f"{platform.machine()} {os.cpu_count()} cpus",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "statuses": {str(k): v for k, v in sorted(load["statuses"].items(), key=lambda kv: str(kv[0]))},
        "answered": answered,
        "five_xx": five_xx,
        "mismatches_vs_one_at_a_time": mismatches,
        "wall_s": round(load["wall_s"], 3),
        "throughput_rps": round(answered / load["wall_s"], 3),
        "latency_ms": {
            "p50": round(percentile(load["attempt_ms"], 50), 1),
            "p99": round(percentile(load["attempt_ms"], 99), 1),
        },
        "request_latency_ms": {
            "p50": round(percentile(load["request_ms"], 50), 1),
            "p99": round(percentile(load["request_ms"], 99), 1),
        },
        "alone_latency_ms": {"p50": round(percentile(alone_ms, 50), 1), "p99": round(percentile(alone_ms, 99), 1)},
        "server_stage_median_ms": stage_ms,
        "queue_wait_median_ms": round(statistics.median([e["queue_ms"] for e in exts]), 1) if exts else None,
        "generated_tokens_median": statistics.median(gen_tokens) if gen_tokens else None,
        "metrics_lines": len(metrics.splitlines()),
    }
    print(
        f"litevlm serve under load: {a.requests} requests, {a.clients} clients, queue {a.max_queue}, "
        f"{a.width}x{a.height} images, model {model_dir.name}, {result['host']}"
    )
    print(f"  statuses          {result['statuses']}   (5xx: {five_xx}, answered {answered}/{a.requests})")
    print(f"  throughput        {result['throughput_rps']:.2f} answers/s over {result['wall_s']:.1f} s")
    print(f"  latency (200s)    p50 {result['latency_ms']['p50']:.1f} ms   p99 {result['latency_ms']['p99']:.1f} ms")
    print(
        f"  per request       p50 {result['request_latency_ms']['p50']:.1f} ms   p99 {result['request_latency_ms']['p99']:.1f} ms (429 retries included)"
    )
    print(
        f"  one at a time     p50 {result['alone_latency_ms']['p50']:.1f} ms   p99 {result['alone_latency_ms']['p99']:.1f} ms"
    )
    print(f"  server stages     {stage_ms} (median ms), queue wait median {result['queue_wait_median_ms']} ms")
    print(f"  answers identical to one-at-a-time: {mismatches == 0} ({mismatches} differ)")
    print(json.dumps(result))
    return 0 if (five_xx == 0 and mismatches == 0 and answered == a.requests) else 1


if __name__ == "__main__":
    sys.exit(main())
