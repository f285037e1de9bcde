"""llama.cpp beside litevlm: the engine a user would otherwise run on a CPU, on Table 1's frames and questions.

Every row answers the same held-out questions (the first N of Table 1's split, `.bench-data/heldout`: `litevlm data
synth --frames 100 --seed 1`, made on first use) from the same PNG files, greedy, timed from the image files to the
last token (e2e), in one run, the rows of each question in a freshly shuffled order, the first questions warming every
row up uncounted. Rows, per model and per thread count (one pinned thread, then the machine's default):

- litevlm baseline and LiteVLM (`Pipeline.answer` on the file paths): stages from the pipeline's own timings.
- llama.cpp f32, f16 and Q8_0: the model converted by `litevlm convert --to gguf`, run through llama-cpp-python's
  bindings of llama.cpp and mtmd (`litevlm.eval.llamacpp.LlamaCpp.answer_files`) the way llama.cpp's own mtmd CLI
  and server do: the files read by mtmd's helper (stb_image), each view tiled and normalised by mtmd, the prompt the
  checkpoint's own (its chat template, `CAM_X: ` labels) with mtmd's media marker where litevlm writes a view, the
  decoder on the CPU with llama.cpp's default f16 KV cache, as many threads as litevlm's row. Stages: preprocess
  (file decoding, then mtmd's tiling and normalisation), encode (mtmd's vision tower and projector), prompt (text and
  image embeddings through the decoder), generate (the greedy loop); llama.cpp's own counters beside them.
- "llama.cpp f32 / f16 / Q8_0, litevlm tiles" (left out with `--no-same-tiles`): litevlm reads and cuts the views
  (its preprocessing, timed), mtmd encodes each tile, and the embeddings go to litevlm's own prompt ids
  (`answer_tiles`): the same visual tokens and prompt as litevlm's baseline, so f32's answers equal the baseline's
  where the numerics agree, and the times compare engines on the same work.

The same visual tokens, and where mtmd differs (also in the JSON, `tiling`, from the run's own counts): litevlm's
baseline prompt gives each of the six views its fixed tiles (drive-hd two 112 px tiles, the view resized to 224x112
and cut left to right, 64 tokens each without pixel shuffle; drive-tiny one tile of 16 tokens), wrapped as
`CAM_X: <img>...</img>`. mtmd, with the tile limit the converter writes (the model's tiles per view), cuts a wide view
into the same grid (224x112, left and right, by its Pillow-style bicubic resize) and then always adds a thumbnail,
the whole view resized to one tile, after the tiles inside the same `<img>...</img>`: drive-hd 3 tiles (192 tokens) a
view where litevlm has 2 (128), drive-tiny 2 (the view twice, 32 tokens) where litevlm has 1 (16). mtmd cannot be
told to leave the thumbnail out; the "litevlm tiles" rows show llama.cpp without it.

Each row gives its score (DriveLM's final without a judge, the weights renormalised), closed-question accuracy with
the paired difference to the baseline (95% bootstrap over frames), and its answers' agreement with the baseline's (the
same text). The decode profile puts one litevlm plain decode step (the baseline's backend, torch's profiler over one
answer's decode steps, per step) beside llama.cpp's time per generated token (its own counter, and the loop's wall).

    python benchmarks/peers.py --n 100                         # both models, both thread counts (~hours)
    python benchmarks/peers.py --models drive-tiny --n 2 --warmup 0 --threads 1 --data /tmp/two --frames 1 \
        --max-new-tokens 16 --out /tmp/peers.json           # a smoke run: a one-frame split, 2 questions

The rows take turns in one process, never running at once. llama.cpp's threads (OpenMP here) wait for each other by
spinning, so its rows above one thread slow down sharply on a machine with other work on it: time on a quiet machine.
The last line of stdout is the result as JSON; it is also saved to `--out` with the command, versions, commit,
machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTTYPES = ("f32", "f16", "q8_0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="drive-hd,drive-tiny")
    p.add_argument("--data", default=".bench-data/heldout", help="Table 1's split (made on first use)")
    p.add_argument("--frames", type=int, default=100, help="frames of the split when it is made (seed 1)")
    p.add_argument("--n", type=int, default=100, help="questions counted (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", default="1,0", help="thread counts, 1 pinned to one core, 0 the machine's default")
    p.add_argument("--outtypes", default=",".join(OUTTYPES))
    p.add_argument(
        "--no-same-tiles", dest="same_tiles", action="store_false", help="leave out llama.cpp on litevlm's own tiles"
    )
    p.add_argument(
        "--lookup",
        type=int,
        default=10,
        help="llama-cpp-python's chat path with and without its prompt-lookup speculative decoding, drafting up to this"
        " many tokens a step (f32; 0 leaves both rows out)",
    )
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--gguf-dir", default=None, help="where the converted files go (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=1, help="the rows' shuffled order")
    p.add_argument("--out", default="benchmarks/results/peers.json")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# Questions and rows
# ------------------------------------------------------------------------------------------------
def questions(data: str, frames: int, n: int) -> list:
    """The first n questions of Table 1's split, made first where it is missing."""
    from litevlm.data.source import load_data
    from litevlm.data.synthetic import write_dataset

    if not Path(data).exists():
        write_dataset(data, frames=frames, seed=1, progress=False)
    return load_data(data)[:n]


def litevlm_row(pipe):
    """A function (sample) -> one measured answer of the pipeline, from the image files."""

    def run(s) -> dict:
        t0 = time.perf_counter()
        ans = pipe.answer(s.question, s.images)
        e2e = (time.perf_counter() - t0) * 1e3
        ms = ans.timings_ms
        return {
            "text": ans.text,
            "input_tokens": ans.input_tokens,
            "visual_tokens": ans.num_visual_tokens,
            "new_tokens": len(ans.tokens),
            "decoded": len(ans.tokens) - 1 - ans.opened_tokens,
            "ms": {
                "preprocess": ms.get("preprocess", 0.0),
                "encode": ms.get("vit", 0.0),
                "select": ms.get("select_views", 0.0) + ms.get("select_tokens", 0.0),
                "prompt": ms.get("prefill", 0.0),
                "generate": ms.get("decode", 0.0),
                "e2e": e2e,
            },
        }

    return run


def llama_row(lc, pipe, max_new_tokens: int, same_tiles: bool = False):
    """A function (sample) -> one measured answer of llama.cpp: mtmd from the files, or on litevlm's tiles."""
    from litevlm.cameras import CAMERAS
    from litevlm.eval.llamacpp import MARKER, answer_on_tiles
    from litevlm.model.prompt import IMAGE_MARK

    tok, cams = pipe.tokenizer, list(CAMERAS)

    def run(s) -> dict:
        paths = [s.images[c] for c in cams]
        if same_tiles:
            _, a = answer_on_tiles(lc, pipe, s.question, s.images, max_new_tokens)
            pre = a.ms["preprocess"]
        else:
            pre = None
            a = lc.answer_files(pipe.format.render(s.question, cams).replace(IMAGE_MARK, MARKER), paths, max_new_tokens)
        ms = a.ms
        return {
            "text": tok.decode([t for t in a.tokens if t != tok.eos_id]).strip(),
            "input_tokens": a.input_tokens,
            "visual_tokens": a.visual_tokens,
            "new_tokens": len(a.tokens),
            "decoded": len(a.tokens) - 1,
            "ms": {
                "preprocess": pre if pre is not None else ms["load"] + ms["tokenize"],
                "encode": ms["encode"],
                "select": 0.0,
                "prompt": ms["prompt"],
                "generate": ms["generate"],
                "e2e": ms["e2e"],
            },
            "perf": a.perf,
        }

    return run


def chat_row(chat):
    """A function (sample) -> one answer through llama-cpp-python's chat path (`LlamaChat`: its chat handler reads
    and tiles the files, with or without prompt-lookup drafting): e2e only, the path times no stages."""
    from litevlm.cameras import CAMERAS

    def run(s) -> dict:
        labelled = [(f"{c}: ", s.images[c]) for c in CAMERAS]
        text, ms, new, prompt = chat.answer(labelled, s.question, chat.max_new_tokens)
        return {"text": text, "input_tokens": prompt, "visual_tokens": None, "new_tokens": new, "decoded": 0,
                "ms": {"e2e": ms}}  # fmt: skip

    return run


# ------------------------------------------------------------------------------------------------
# Summaries
# ------------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarise(name: str, log: list[dict], samples: list, base: list[dict] | None) -> dict:
    """A row: means of each stage and of e2e (p50, p90 beside it), tokens, score, agreement with the baseline."""
    from litevlm.eval.bench import answer_record
    from litevlm.eval.intervals import paired_difference
    from litevlm.eval.metrics import answered_right, closed_accuracy, score

    records = [answer_record(s, a["text"]) for s, a in zip(samples, log)]
    e2e = [a["ms"]["e2e"] for a in log]
    decoded = sum(a["decoded"] for a in log)
    row = {
        "config": name,
        "questions": len(log),
        "visual_tokens": statistics.mean(a["visual_tokens"] for a in log) if log[0]["visual_tokens"] else None,
        "input_tokens": statistics.mean(a["input_tokens"] for a in log),
        "new_tokens": statistics.mean(a["new_tokens"] for a in log),
        **{f"{k}_ms": round(statistics.mean(a["ms"][k] for a in log), 3) for k in log[0]["ms"]},
        "p50_e2e_ms": round(percentile(e2e, 50), 3),
        "p90_e2e_ms": round(percentile(e2e, 90), 3),
        "per_token_ms": round(sum(a["ms"]["generate"] for a in log) / decoded, 3) if decoded else None,
        "score": None,
        "closed_accuracy": closed_accuracy(records),
    }
    try:
        row["score"] = score(records)["final"]
    except ImportError:  # pycocoevalcap missing: no language metrics
        pass
    if "perf" in log[0]:  # llama.cpp's own counters, summed over the questions
        ev, n_ev = sum(a["perf"]["eval_ms"] for a in log), sum(a["perf"]["eval_tokens"] for a in log)
        pe, n_pe = sum(a["perf"]["prompt_eval_ms"] for a in log), sum(a["perf"]["prompt_eval_tokens"] for a in log)
        row["llama_cpp"] = {
            "eval_ms_per_token": round(ev / n_ev, 3) if n_ev else None,
            "prompt_eval_ms_per_token": round(pe / n_pe, 3) if n_pe else None,
        }
    if base is not None:
        row["agreement"] = sum(a["text"] == b["text"] for a, b in zip(log, base)) / len(log)
        closed = [i for i, s in enumerate(samples) if s.closed]
        frames = [samples[i].frame_id for i in closed]
        if len(set(frames)) >= 2:
            right = [float(answered_right(records[i])) for i in closed]
            base_right = [float(answered_right(answer_record(samples[i], base[i]["text"]))) for i in closed]
            row["closed_vs_baseline"] = paired_difference(right, base_right, frames).to_dict()
    return row


def decode_profile(pipe, sample, top: int = 8) -> dict:
    """One litevlm plain decode step: the decode stage of one answer, per step, timed alone and profiled by torch (the
    ops with the most time of their own, per step)."""
    import torch

    from litevlm.model.generate import drain

    st = pipe.start_answer(sample.question, pipe.frame(sample.images))
    t0 = time.perf_counter()
    gen = drain(pipe.decode(st.prefilled, st.timer))
    steps = max(1, len(gen.tokens) - 1)
    wall = (time.perf_counter() - t0) * 1e3 / steps
    st = pipe.start_answer(sample.question, pipe.frame(sample.images))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        drain(pipe.decode(st.prefilled, st.timer))
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "backend": pipe.backend.name,
        "steps": steps,
        "step_ms": round(wall, 3),
        "top_ops_per_step": [
            {"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 4), "calls": e.count / steps}
            for e in ops
        ],
    }


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
class Threads:
    """torch's thread count (and, for one thread, the process pinned to one core) for a block of rows."""

    def __init__(self, n: int, default: int):
        self.n = n or default
        self.pin = n == 1 and hasattr(os, "sched_getaffinity")

    def __enter__(self):
        import torch

        self.saved = (torch.get_num_threads(), os.sched_getaffinity(0) if self.pin else None)
        torch.set_num_threads(self.n)
        if self.pin:  # core 1 where there is one, as the results page's pinned runs (taskset -c 1)
            os.sched_setaffinity(0, {1 if 1 in self.saved[1] else min(self.saved[1])})
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.saved[0])
        if self.pin:
            os.sched_setaffinity(0, self.saved[1])


def run_model(model: str, samples: list, a, gguf_dir: Path, default_threads: int) -> dict:
    from litevlm import Pipeline
    from litevlm.eval.llamacpp import LlamaCpp
    from litevlm.model.gguf import write_gguf
    from litevlm.presets import LITEVLM

    outtypes = [t for t in a.outtypes.split(",") if t]
    files = {t: write_gguf(model, gguf_dir / model, t) for t in outtypes}
    pipes = {
        "litevlm baseline": Pipeline.from_pretrained(model, max_new_tokens=a.max_new_tokens),
        "litevlm": Pipeline.from_pretrained(model, max_new_tokens=a.max_new_tokens, **LITEVLM),
    }
    base = pipes["litevlm baseline"]
    counted = samples[a.warmup :]
    out = {"gguf": {t: [f.text.name, f.mmproj.name] for t, f in files.items()}, "threads": {}}
    for n in [int(t) for t in a.threads.split(",")]:
        with Threads(n, default_threads) as th:
            engines = {f"llama.cpp {t}": LlamaCpp(files[t], threads=th.n) for t in outtypes}
            rows = {name: litevlm_row(p) for name, p in pipes.items()}
            rows |= {name: llama_row(lc, base, a.max_new_tokens) for name, lc in engines.items()}
            if a.same_tiles:
                rows |= {
                    f"{name}, litevlm tiles": llama_row(lc, base, a.max_new_tokens, True)
                    for name, lc in engines.items()
                }
            chats = {}
            if a.lookup > 0 and "f32" in files:
                from litevlm.eval.llamacpp import LlamaChat

                chats = {
                    "llama.cpp f32, chat": LlamaChat(files["f32"], threads=th.n),
                    f"llama.cpp f32, chat + lookup {a.lookup}": LlamaChat(files["f32"], threads=th.n, lookup=a.lookup),
                }
                for chat in chats.values():
                    chat.max_new_tokens = a.max_new_tokens
                rows |= {name: chat_row(chat) for name, chat in chats.items()}
            logs = {name: [] for name in rows}
            order, shuffler = list(rows), random.Random(a.seed)
            for i, s in enumerate(samples):
                shuffler.shuffle(order)
                for name in order:
                    answer = rows[name](s)
                    if i >= a.warmup:
                        logs[name].append(answer)
                print(f"{model} {th.n} thread(s): question {i + 1}/{len(samples)}", file=sys.stderr)
            table = [
                summarise(name, logs[name], counted, None if name == "litevlm baseline" else logs["litevlm baseline"])
                for name in rows
            ]
            profile = decode_profile(base, counted[0]) if counted else None
            for lc in [*engines.values(), *chats.values()]:
                lc.close()
        out["threads"][str(th.n)] = {"pinned": th.pin, "rows": table, "decode_profile": profile}
    out["tiling"] = tiling(base, table)
    return out


def tiling(pipe, table: list[dict]) -> dict:
    """How many tiles and visual tokens a question's six views give litevlm and mtmd, from the run's own counts."""
    per_tile = pipe.cfg.tokens_per_tile
    by = {r["config"]: r for r in table}
    mtmd = next((r for name, r in by.items() if name.startswith("llama.cpp") and "tiles" not in name), None)
    out = {
        "tokens_per_tile": per_tile,
        "litevlm": {
            "tiles_per_view": pipe.format.tiling.most(),
            "thumbnail": pipe.format.tiling.thumbnail,
            "visual_tokens": by["litevlm baseline"]["visual_tokens"],
        },
        "markers": "both: each view as `CAM_X: <img>` + its tiles' tokens + `</img>`, nothing between its tiles",
    }
    if mtmd is not None:
        out["llama.cpp"] = {
            "tiles_per_view": mtmd["visual_tokens"] / per_tile / 6,
            "thumbnail": True,
            "visual_tokens": mtmd["visual_tokens"],
            "why": "mtmd's InternVL preprocessing always appends a thumbnail (the whole view as one tile) to a view "
            "larger than one tile, after the tiles it cuts (the same grid as litevlm's)",
        }
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("litevlm", "torch", "numpy", "gguf", "llama-cpp-python"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    try:
        import llama_cpp

        out["llama.cpp system"] = llama_cpp.llama_print_system_info().decode().strip()
    except ImportError:
        pass
    return out


def machine(threads: int) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():  # as the results page names a CPU: its model and vector unit
        lines = info.read_text().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
        cpu = (names[0] if names else cpu) + (f" ({isa})" if isa else "")
    return {"cpu": cpu, "cores": os.cpu_count(), "default_threads": threads, "torch": torch.__version__, "gpu": None}


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


def main(argv=None) -> int:
    import torch

    a = parse_args(argv)
    t0 = time.time()
    default_threads = torch.get_num_threads()
    samples = questions(a.data, a.frames, a.n + a.warmup)
    result = {
        "data": a.data,
        "questions": len(samples) - a.warmup,
        "warmup": a.warmup,
        "max_new_tokens": a.max_new_tokens,
        "versions": versions(),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        gguf_dir = Path(a.gguf_dir or tmp)
        for model in [m for m in a.models.split(",") if m]:
            result["models"][model] = run_model(model, samples, a, gguf_dir, default_threads)
    for model, r in result["models"].items():
        for n, block in r["threads"].items():
            print(f"{model}, {n} thread(s){' pinned' if block['pinned'] else ''}:")
            for row in block["rows"]:
                print(
                    f"  {row['config']:<36} e2e {row['e2e_ms']:>9.1f} ms  encode {row.get('encode_ms') or 0:>8.1f}  "
                    f"prompt {row.get('prompt_ms') or 0:>8.1f}  per token {row['per_token_ms'] or 0:>7.2f}  "
                    f"visual {row['visual_tokens'] or 0:>6.0f}  score {row['score']}  agree {row.get('agreement', '-')}"
                )
    saved = {
        "benchmark": "peers",
        "command": "python benchmarks/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(default_threads),
        "versions": result["versions"],
        "seconds": round(time.time() - t0, 1),
        "result": result,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
