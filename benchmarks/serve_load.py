"""Load on `litevlm serve`: streamed requests from 1, 2, 4 and 8 concurrent clients over loopback, one server
answering one request at a time (--max-batch 1) beside one batching them (--max-batch 8), in one run.

Starts `litevlm serve` on a free 127.0.0.1 port, asks each distinct question once, one at a time
and not streamed (the reference answers), then for each client count sends --requests streamed
requests from that many threads. A 429 is retried after its Retry-After (retry-after-ms, capped);
any other non-200 is counted and not retried. Reported per client count: status counts, p50/p99
latency of answered requests, p50/p99 time to first token (the first content chunk), throughput,
and whether every streamed answer equals the one-at-a-time answer.

    python benchmarks/serve_load.py --model drive-tiny --clients 1,2,4,8 --max-batch 1,8 --requests 64

Each --max-batch value gets a server of its own, started in turn (never two at once), with the same requests. Its
levels are under `by_max_batch`; `clients` holds the last value's (the batched server's). --view-cache-mb 0 (the
default here) makes every request read and encode its views.

Traffic goes to 127.0.0.1 only. The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
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
    p.add_argument("--requests", type=int, default=64, help="requests per client count")
    p.add_argument("--clients", default="1,2,4,8", help="comma-separated concurrent client counts")
    p.add_argument("--max-batch", default="1,8", help="comma-separated server --max-batch values, each its own server")
    p.add_argument(
        "--config", choices=("litevlm", "baseline"), default="litevlm", help="the served pipeline (default: LiteVLM)"
    )
    p.add_argument("--view-cache-mb", type=int, default=0, help="the server's --view-cache-mb (0: every view encoded)")
    p.add_argument("--max-queue", type=int, default=16, help="the server's --max-queue")
    p.add_argument("--timeout", type=float, default=120.0, help="the server's per-request --timeout (s)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--frames", type=int, default=5, help="distinct synthetic frames")
    p.add_argument(
        "--questions", type=int, default=4, help="questions per frame (frames x questions distinct requests)"
    )
    p.add_argument(
        "--image-format",
        choices=("jpeg", "png"),
        default="jpeg",
        help="how the client encodes each camera image (a car's cameras, and nuScenes', deliver JPEG)",
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
        views = render_views(frame, size=(a.width, a.height))
        urls = {c: image_data_url(im, a.image_format.upper()) for c, im in views.items()}
        for qa in frame.qas[: a.questions]:
            bodies.append(json.dumps({"model": "bench", "messages": [user_message(qa.question, urls)]}).encode())
    return bodies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, port: int, log, max_batch: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from litevlm.cli import main; sys.exit(main())",
        "serve",
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
        "--max-batch",
        str(max_batch),
        "--view-cache-mb",
        str(a.view_cache_mb),
        "--log-level",
        "warning",
        *(["--litevlm"] if a.config == "litevlm" else []),
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


def stream_one(http, url: str, body: bytes) -> tuple[int | str, float, float, str]:
    """(status, ms to the first content chunk, ms to the end, text) of one streamed request."""
    import httpx

    t = time.perf_counter()
    first, parts = float("nan"), []
    try:
        with http.stream("POST", url + "/v1/chat/completions", content=body, headers=HEADERS) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, first, (time.perf_counter() - t) * 1000, r.headers.get("retry-after-ms", "")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[len("data: ") :])["choices"]
                piece = choices[0]["delta"].get("content") if choices else None
                if piece:
                    if not parts:
                        first = (time.perf_counter() - t) * 1000
                    parts.append(piece)
    except httpx.TransportError as e:
        return f"transport:{type(e).__name__}", first, (time.perf_counter() - t) * 1000, ""
    return 200, first, (time.perf_counter() - t) * 1000, "".join(parts)


def run_load(a, url: str, bodies: list[bytes], clients: int) -> dict:
    import httpx

    statuses: Counter = Counter()
    latency_ms: list[float] = []  # answered requests, from their (last) attempt's start
    ttft_ms: list[float] = []
    answers: dict[int, str] = {}
    lock = threading.Lock()
    todo = iter(range(a.requests))
    barrier = threading.Barrier(clients + 1)

    def client():
        with httpx.Client(timeout=a.timeout + 30) as http:
            barrier.wait()
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                while True:
                    status, first, total, text = stream_one(http, url, bodies[i % len(bodies)])
                    with lock:
                        statuses[status] += 1
                    if status != 429:
                        break
                    time.sleep(min(int(text or 1000) / 1000, a.max_retry_sleep))
                if status == 200:
                    with lock:
                        latency_ms.append(total)
                        ttft_ms.append(first)
                        answers[i] = text

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return dict(
        wall_s=time.perf_counter() - t0, statuses=statuses, latency_ms=latency_ms, ttft_ms=ttft_ms, answers=answers
    )


HEADERS = {"content-type": "application/json"}


def summary(a, load: dict, reference: list[str], n_bodies: int) -> dict:
    answered = len(load["answers"])
    mismatches = sum(1 for i, text in load["answers"].items() if text != reference[i % n_bodies])
    pct = lambda xs, q: round(percentile(xs, q), 1)  # noqa: E731
    return {
        "statuses": {str(k): v for k, v in sorted(load["statuses"].items(), key=lambda kv: str(kv[0]))},
        "answered": answered,
        "five_xx": sum(n for s, n in load["statuses"].items() if isinstance(s, int) and s >= 500),
        "mismatches_vs_one_at_a_time": mismatches,
        "wall_s": round(load["wall_s"], 3),
        "throughput_rps": round(answered / load["wall_s"], 3),
        "latency_ms": {"p50": pct(load["latency_ms"], 50), "p99": pct(load["latency_ms"], 99)},
        "ttft_ms": {"p50": pct(load["ttft_ms"], 50), "p99": pct(load["ttft_ms"], 99)},
    }


def main(argv=None) -> int:
    import httpx

    a = parse_args(argv)
    from litevlm.models import resolve_model_dir

    levels = [int(c) for c in a.clients.split(",")]
    model_dir = resolve_model_dir(a.model)
    bodies = make_cases(a)
    streamed = [json.dumps({**json.loads(b), "stream": True}).encode() for b in bodies]
    by_batch, reference = {}, None
    for max_batch in [int(b) for b in a.max_batch.split(",")]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryFile(mode="w+") as log, httpx.Client(timeout=a.timeout + 30) as http:
            proc = start_server(a, port, log, max_batch)
            try:
                wait_healthy(http, url, proc, a.startup_timeout)
                http.post(url + "/v1/chat/completions", content=bodies[0], headers=HEADERS)  # warm-up
                if reference is None:  # the first server, one request at a time, not streamed: the reference answers
                    reference = []
                    for body in bodies:
                        r = http.post(url + "/v1/chat/completions", content=body, headers=HEADERS)
                        r.raise_for_status()
                        reference.append(r.json()["choices"][0]["message"]["content"])
                by_batch[str(max_batch)] = {
                    str(c): summary(a, run_load(a, url, streamed, c), reference, len(bodies)) for c in levels
                }
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
    results = by_batch[list(by_batch)[-1]]

    result = {
        "model": str(model_dir),
        "requests_per_level": a.requests,
        "max_queue": a.max_queue,
        "image_size": [a.width, a.height],
        "image_format": a.image_format,
        "distinct_requests": len(bodies),
        "max_new_tokens": a.max_new_tokens,
        "host": f"{platform.machine()} {os.cpu_count()} cpus",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "view_cache_mb": a.view_cache_mb,
        "config": a.config,
        "clients": results,
        "by_max_batch": by_batch,
    }
    print(
        f"litevlm serve under load: {a.requests} streamed requests per level, queue {a.max_queue}, "
        f"{a.width}x{a.height} {a.image_format} images, model {model_dir.name}, {result['host']}"
    )
    print(
        f"  {'batch':>5}  {'clients':>7}  {'p50 ms':>9}  {'p99 ms':>9}  {'TTFT p50':>9}  {'TTFT p99':>9}  "
        f"{'answers/s':>9}  statuses"
    )
    for b, lv in by_batch.items():
        for c, r in lv.items():
            lat, ttft = r["latency_ms"], r["ttft_ms"]
            print(
                f"  {b:>5}  {c:>7}  {lat['p50']:>9.1f}  {lat['p99']:>9.1f}  {ttft['p50']:>9.1f}  {ttft['p99']:>9.1f}  "
                f"{r['throughput_rps']:>9.2f}  {r['statuses']}  ({r['mismatches_vs_one_at_a_time']} differ)"
            )
    print(json.dumps(result))
    ok = all(
        r["five_xx"] == 0 and r["mismatches_vs_one_at_a_time"] == 0 and r["answered"] == a.requests
        for lv in by_batch.values()
        for r in lv.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
