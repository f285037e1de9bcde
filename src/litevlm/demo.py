"""`litevlm demo`: LiteVLM and the baseline on one fresh synthetic scene, side by side.

Both pipelines answer the same questions about a scene the model never saw: each answer beside the truth, the
views each pipeline encoded, the per-stage latency of both, and the speed-up (the ratio of their mean totals,
measured interleaved question by question so that machine load hits both alike).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.pipeline import STAGES, Pipeline

GRID = (("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT"), ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"))
LABELS = {"litevlm": "LiteVLM", "baseline": "baseline"}


def grid_path(out: str | Path) -> Path:
    """Where the picture goes: `out` itself (an image file name in an existing folder), or demo.png inside
    `out` when it is a folder; anything else is refused before any work is done."""
    from PIL import Image

    path = Path(out)
    if path.is_dir():
        path = path / "demo.png"
    if path.suffix.lower() not in Image.registered_extensions():
        raise LiteVLMError(f"--out {out}: not an image file name (.png, .jpg, ...) or a folder")
    if not path.parent.is_dir():
        raise LiteVLMError(f"--out {out}: the folder {path.parent} does not exist")
    return path


def save_grid(images: dict, path: str | Path, tile=(400, 225)) -> Path:
    """The six views in a labelled 2x3 grid, laid out as the cameras sit on the car (front row on top)."""
    from PIL import Image, ImageDraw

    w, h = tile
    canvas = Image.new("RGB", (3 * w, 2 * h), "black")
    draw = ImageDraw.Draw(canvas)
    for r, row in enumerate(GRID):
        for c, cam in enumerate(row):
            canvas.paste(images[cam].convert("RGB").resize(tile), (c * w, r * h))
            draw.rectangle([c * w, r * h, c * w + 8 * len(cam) + 8, r * h + 16], fill="black")
            draw.text((c * w + 4, r * h + 3), cam, fill="white")
    path = grid_path(path)
    canvas.save(path)
    return path


def pick_questions(qas, n: int):
    """Up to n questions, round-robin over the four categories so every kind shows."""
    by_cat: dict[str, list] = {}
    for qa in qas:
        by_cat.setdefault(qa.category, []).append(qa)
    picked = []
    while len(picked) < n and any(by_cat.values()):
        for cat in ("perception", "prediction", "planning", "behavior"):
            if by_cat.get(cat) and len(picked) < n:
                picked.append(by_cat[cat].pop(0))
    return picked


def pipelines(model: str, configs: tuple[str, ...]) -> dict[str, Pipeline]:
    """The pipelines shown: the baseline (six views, no pruning, plain decoding) and the full LiteVLM
    configuration (`--litevlm`: ViewSelector, TokenSelector, EAGLE-2), on the same weights."""
    from litevlm.presets import LITEVLM

    options = {"litevlm": LITEVLM, "baseline": {}}
    return {name: Pipeline.from_pretrained(model, **options[name]) for name in configs}


def measure(pipes: dict[str, Pipeline], questions, images, rounds: int) -> tuple[dict, dict]:
    """Each question answered by every pipeline, `rounds` times, interleaved (the pipeline that goes first
    alternates); the answers of the first round, and every answer's stage timings per pipeline."""
    answers: dict[str, list] = {name: [] for name in pipes}
    timings: dict[str, list] = {name: [] for name in pipes}
    names = list(pipes)
    for rnd in range(rounds):
        for i, qa in enumerate(questions):
            order = names if (rnd + i) % 2 == 0 else names[::-1]
            for name in order:
                ans = pipes[name].answer(qa.question, images)
                timings[name].append(ans.timings_ms)
                if rnd == 0:
                    answers[name].append(ans)
    return answers, timings


def mean_stages(timings: list[dict]) -> dict[str, float]:
    return {s: statistics.fmean(t.get(s, 0.0) for t in timings) for s in (*STAGES, "total")}


def run_demo(
    model: str = "drive-tiny",
    out: str = "demo.png",
    seed: int = 2026,
    n_questions: int = 6,
    as_json: bool = False,
    configs: tuple[str, ...] = ("litevlm", "baseline"),
    rounds: int = 3,
) -> dict:
    from litevlm.data.synthetic import make_frame, render_views

    unknown = [c for c in configs if c not in LABELS]
    if unknown or not configs:
        raise LiteVLMError(f"demo configurations {unknown or configs}: choose among {', '.join(LABELS)}")
    grid_path(out)  # a bad --out fails before the model loads
    pipes = pipelines(model, configs)
    frame = make_frame(seed, 0)
    images = render_views(frame, size=(800, 450))
    grid = save_grid(images, out)
    for pipe in pipes.values():  # the first call allocates caches; keep it out of the tables
        pipe.answer("Is there a car in front of the ego vehicle?", images)
    questions = pick_questions(frame.qas, n_questions)
    answers, timings = measure(pipes, questions, images, rounds)
    stages = {name: mean_stages(t) for name, t in timings.items()}
    rows = [
        {
            "category": qa.category,
            "question": qa.question,
            "truth": qa.answer,
            "answers": {name: {"answer": answers[name][i].text, "views": answers[name][i].views} for name in pipes},
        }
        for i, qa in enumerate(questions)
    ]
    exact = {name: sum(_same(r["answers"][name]["answer"], r["truth"]) for r in rows) for name in pipes}
    speedup = stages["baseline"]["total"] / stages["litevlm"]["total"] if len(pipes) == 2 else None
    result = {
        "model": next(iter(pipes.values())).name,
        "scene": {"seed": seed, "frame": 0},
        "picture": str(grid),
        "questions": rows,
        "exact": exact,
        "n": len(rows),
        "answers_timed": len(rows) * rounds,
        "mean_ms": stages,
        "speedup": speedup,
    }
    if as_json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        print_demo(result)
    return result


def _same(answer: str, truth: str) -> bool:
    return answer.strip() == truth.strip()


def _views(views: list[str]) -> str:
    return f"all {len(CAMERAS)} views" if len(views) == len(CAMERAS) else ", ".join(views)


def print_demo(result: dict) -> None:
    names = list(result["mean_ms"])
    width = max(len(LABELS[n]) for n in names) + 2
    print(f"A scene the model never saw (seed {result['scene']['seed']}); its six views: {result['picture']}\n")
    for r in result["questions"]:
        print(f"[{r['category']}] {r['question']}")
        print(f"  {'truth':<{width}}   {r['truth']}")
        for name in names:
            a = r["answers"][name]
            mark = "ok" if _same(a["answer"], r["truth"]) else ""
            print(f"  {LABELS[name]:<{width}}{mark:<3}{a['answer']}   [{_views(a['views'])}]")
        print()
    print("answers equal to the truth: " + ", ".join(f"{LABELS[n]} {result['exact'][n]}/{result['n']}" for n in names))
    print(f"\nstage latency, mean ms over {result['answers_timed']} answers each (this machine):")
    print(f"  {'stage':<14}" + "".join(f"{LABELS[n]:>12}{'share':>8}" for n in names))
    for s in (*STAGES, "total"):
        cells = ""
        for n in names:
            ms, total = result["mean_ms"][n][s], result["mean_ms"][n]["total"] or 1.0
            cells += f"{ms:12.2f}" + ("" if s == "total" else f"{100 * ms / total:7.1f}%")
        print(f"  {s:<14}{cells}")
    if result["speedup"] is not None:
        print(
            f"\nLiteVLM answered {result['speedup']:.2f}x as fast as the baseline "
            "(ratio of their mean totals, measured side by side)."
        )
