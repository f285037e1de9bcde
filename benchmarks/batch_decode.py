"""Many answers at once: decode tokens/s against the batch size, and a frame's questions answered as one batch.

For LiteVLM and the baseline on one model, from the same frames and questions in one run:

1. Decode throughput. B prompts are prefilled (each alone, as a server admits them), then decoded together by one
   `BatchDecoder` until all are done; tokens/s = the tokens decoded after the prefill's first / the decode wall
   time. B = 1, 2, 4, 8 over the same questions (the batch-1 figure runs each question alone). Whether every answer
   at batch B equals its batch-1 answer is counted.
2. What a step costs: one plain batched decode step at each B, over the prompts' own caches and as if each held 16
   tokens (the baseline's native steps): the products share their weight reads across the rows, the attention over
   each row's cache does not.
3. Frame mode. K questions about one frame: one at a time (`frame.answer`) against `frame.answer_all` (one batch),
   each on a fresh frame (views encoded anew), mean wall ms per question, and whether the answers are equal.

    python benchmarks/batch_decode.py --model drive-hd --frames 4 --threads 1

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="drive-hd")
    p.add_argument("--frames", type=int, default=4, help="synthetic frames (6 questions each)")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the machine's default)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args(argv)


def questions_of(frame_seed: int, index: int) -> list[str]:
    from litevlm.data.synthetic import make_frame

    return [qa.question for qa in make_frame(frame_seed, index).qas[:6]]


def decode_rate(pipe, frames, batch: int) -> dict:
    """Every question of every frame decoded with up to `batch` in flight, a question joining as one leaves (as the
    server runs) -> tokens decoded after each prefill's first, the seconds spent in decode steps, the answers in
    order. Prefills are not timed."""
    tokens, seconds = 0, 0.0
    work = [(i, f, q) for i, (f, q) in enumerate((f, q) for f, qs in frames for q in qs)]
    answers: list = [None] * len(work)
    decoder = pipe.batch_decoder(batch)
    while work or decoder.live:
        while work and not decoder.full:
            i, f, q = work.pop(0)
            seq = decoder.admit(pipe.start_answer(q, f).prefilled, pipe.sampling, tag=i)
            if seq.finished:
                answers[i] = seq.generation
        t0 = time.perf_counter()
        stepped = decoder.step()
        seconds += time.perf_counter() - t0
        for s in stepped:
            if s.finished:
                answers[s.tag] = s.generation
    for g in answers:
        tokens += len(g.tokens) - 1 - g.opened  # the prefill's first token (and an opening's) are not decoded
    return {
        "tokens": tokens,
        "seconds": seconds,
        "answers": [g.tokens for g in answers],
        "occupancy": decoder.rows / max(1, decoder.steps),
    }


def step_costs(pipe, frames, sizes: list[int], reps: int = 60) -> dict:
    """What one plain batched decode step costs at each batch size (the median of `reps` calls of the native
    `batch_decode`), on B prompts' real caches and again as if each held only 16 tokens: the difference is the
    attention over each row's own cache, which batching cannot share; the rest is the products, whose weights are
    read once for all the rows."""
    import statistics

    from litevlm.batch import _kv

    if pipe.backend.name != "native":
        return {}
    prompts = [(f, q) for f, qs in frames for q in qs][: max(sizes)]
    decoder = pipe.batch_decoder(max(sizes))
    seqs = [decoder.admit(pipe.start_answer(q, f).prefilled, pipe.sampling) for f, q in prompts]
    out = {}
    for b in sizes:
        rows = seqs[:b]
        row = {}
        for label, at in (("cached", None), ("short", 16)):
            tokens = torch.tensor([s.out[-1] for s in rows])
            positions = torch.tensor([at or s.position for s in rows])
            slots = torch.tensor([at or s.L for s in rows])
            caches = [_kv(s.caches) for s in rows]
            times = []
            for i in range(reps + 10):
                t0 = time.perf_counter()
                pipe.backend.batch_decode(tokens, positions, slots, caches)
                if i >= 10:
                    times.append(time.perf_counter() - t0)
            row[f"{label}_ms"] = round(statistics.median(times) * 1e3, 3)
        row["cached_tokens"] = round(sum(s.L for s in rows) / b, 1)
        out[str(b)] = row
    for s in list(decoder.seqs):
        decoder.cancel(s)
    return out


def main(argv=None) -> int:
    from litevlm import Pipeline
    from litevlm.cameras import CAMERAS
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.model.generate import StageTimer
    from litevlm.presets import LITEVLM

    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = [int(b) for b in a.batches.split(",")]
    scenes = [(render_views(make_frame(a.seed, i), size=(1600, 900)), questions_of(a.seed, i)) for i in range(a.frames)]
    out = {"configs": {}}
    for name, options in (("litevlm", LITEVLM), ("baseline", {})):
        pipe = Pipeline.from_pretrained(a.model, max_new_tokens=a.max_new_tokens, **options)
        frames = [(pipe.frame(images), qs) for images, qs in scenes]
        with torch.no_grad():  # encode every view once: the decode rates time decoding only
            for f, _ in frames:
                f.visual(list(CAMERAS), StageTimer("cpu"))
        rates, base_answers = {}, None
        for b in sizes:
            r = decode_rate(pipe, frames, b)
            base_answers = base_answers or r["answers"]
            same = sum(x == y for x, y in zip(r["answers"], base_answers))
            rates[str(b)] = {
                "tokens": r["tokens"],
                "decode_s": round(r["seconds"], 4),
                "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                "identical_to_batch_1": f"{same}/{len(base_answers)}",
                "mean_in_flight": round(r["occupancy"], 2),
            }
        one = rates[str(sizes[0])]["tokens_per_s"]
        for r in rates.values():
            r["vs_batch_1"] = round(r["tokens_per_s"] / one, 3)
        # frame mode: K questions one at a time against one batch, a fresh frame (views encoded anew) each
        alone_ms, batch_ms, equal, k = 0.0, 0.0, 0, 0
        for images, qs in scenes:
            frame = pipe.frame(images)
            t0 = time.perf_counter()
            one_by_one = [frame.answer(q) for q in qs]
            alone_ms += (time.perf_counter() - t0) * 1e3
            frame = pipe.frame(images)
            t0 = time.perf_counter()
            together = frame.answer_all(qs)
            batch_ms += (time.perf_counter() - t0) * 1e3
            equal += sum(x.tokens == y.tokens for x, y in zip(one_by_one, together))
            k += len(qs)
        with torch.no_grad():
            steps = step_costs(pipe, frames, sizes) if name == "baseline" else {}
        out["configs"][name] = {
            "decode": rates,
            "step_ms": steps,
            "frame": {
                "questions": k,
                "one_at_a_time_ms_per_question": round(alone_ms / k, 2),
                "answer_all_ms_per_question": round(batch_ms / k, 2),
                "ratio": round(batch_ms / alone_ms, 3),
                "equal_answers": f"{equal}/{k}",
            },
        }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out.update(
        model=a.model,
        frames=a.frames,
        threads=torch.get_num_threads(),
        pinned=bool(a.threads),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        commit=commit,
        date=date.today().isoformat(),
        command="python benchmarks/batch_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    for name, c in out["configs"].items():
        print(f"{name}: decode tokens/s by batch size")
        for b, r in c["decode"].items():
            print(
                f"  B={b:>2}  {r['tokens_per_s']:>8.1f} tok/s  x{r['vs_batch_1']:<6}  "
                f"same as B=1: {r['identical_to_batch_1']}"
            )
        for b, r in c["step_ms"].items():
            print(f"  one plain step at B={b:>2}: {r['cached_ms']} ms over {r['cached_tokens']} cached tokens a row, "
                  f"{r['short_ms']} ms over 16")  # fmt: skip
        f = c["frame"]
        print(
            f"  frame mode, {f['questions']} questions: one at a time "
            f"{f['one_at_a_time_ms_per_question']} ms/question, "
            f"answer_all {f['answer_all_ms_per_question']} ms/question (x{f['ratio']}), equal {f['equal_answers']}"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
