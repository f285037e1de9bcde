"""`litevlm demo`: a fresh synthetic scene, a handful of questions, answers beside the truth, the stage table."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.pipeline import STAGES, Pipeline

GRID = (("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT"), ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"))


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


def run_demo(
    model: str = "drive-tiny",
    out: str = "demo.png",
    seed: int = 2026,
    n_questions: int = 6,
    as_json: bool = False,
    select_views: bool = False,
) -> dict:
    from litevlm.data.synthetic import make_frame, render_views

    grid_path(out)  # a bad --out fails before the model loads
    pipe = Pipeline.from_pretrained(model, select_views=select_views)
    frame = make_frame(seed, 0)
    images = render_views(frame, size=(800, 450))
    grid = save_grid(images, out)
    pipe.answer("Warm-up question?", images)  # first call allocates; keep it out of the table
    rows = []
    for qa in pick_questions(frame.qas, n_questions):
        ans = pipe.answer(qa.question, images)
        rows.append(
            {
                "category": qa.category,
                "question": qa.question,
                "answer": ans.text,
                "truth": qa.answer,
                "views": ans.views,
                "timings_ms": ans.timings_ms,
            }
        )
        if not as_json:
            mark = "ok " if ans.text.strip() == qa.answer.strip() else "   "
            print(f"[{qa.category}] {qa.question}")
            print(f"  {mark}model: {ans.text}")
            print(f"     truth: {qa.answer}")
    med = {s: statistics.median(r["timings_ms"].get(s, 0.0) for r in rows) for s in (*STAGES, "total", "preprocess")}
    result = {
        "model": pipe.name,
        "picture": str(grid),
        "questions": rows,
        "median_ms": med,
        "exact": sum(r["answer"].strip() == r["truth"].strip() for r in rows),
        "n": len(rows),
    }
    if as_json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        views = statistics.fmean(len(r["views"]) for r in rows)
        print(
            f"\n{result['exact']}/{len(rows)} answers exactly equal to the ground truth; {views:.1f} of {len(CAMERAS)} views per question"
        )
        print(f"picture of the six views: {grid}\n")
        print("stage latency (median over questions, ms, this machine):")
        total = med["total"] or 1.0
        for s in (*STAGES, "total"):
            share = "" if s == "total" else f"  {100 * med[s] / total:5.1f}%"
            print(f"  {s:>14} {med[s]:9.2f}{share}")
        print(f"  {'(preprocess)':>14} {med['preprocess']:9.2f}  image decode + resize, not in total")
    return result
