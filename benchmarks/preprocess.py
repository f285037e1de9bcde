"""Reading and cutting one camera view: the reference path against the fast one, side by side, and what it costs the
score. Last stdout line is JSON.

    python benchmarks/preprocess.py --threads 1 [--score-n 400 --data .bench-data/heldout]

The view is a 1600x900 synthetic camera frame (the bench's own scenes) with sensor-like noise and a slight blur, so
that its JPEG holds about as much detail per pixel as a camera's, written as a JPEG (quality 90, nuScenes' format)
and a PNG, and handed over as a raw frame (an HxWx3 uint8 array). Each case is cut into the paper's two 448 px tiles
and into drive-hd's two 112 px tiles by:

- today's path (`resample="pil"`): PIL decodes in full, PIL's bicubic resize from full size;
- the fast path (`resample="fast"`, the default): a JPEG decoded by libjpeg-turbo straight into an array at the
  smallest DCT scale that covers the tiles, torch's antialiased bicubic resize on uint8, no PIL round trip for a raw
  frame.

Times are medians of interleaved repetitions (the two paths alternate); the pixel differences are of the fast tiles
against today's, in levels of a byte (0-255), and each path's mean difference from the tiles of the camera's own
pixels (the frame before encoding, cut PIL's way): what a file's encoding and its decoding lose together. With
--score-n, drive-hd's DriveLM score (LiteVLM and the baseline) on held-out questions with both paths; with
--score-jpeg, also on a copy of the split with every image a JPEG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter

from litevlm.model.prompt import Tiling
from litevlm.model.vlm import cut_view

CASES = (  # name, source kind, tile size
    ("JPEG 1600x900 -> 2 x 448", "jpeg", 448),
    ("JPEG 1600x900 -> 2 x 112", "jpeg", 112),
    ("PNG 1600x900 -> 2 x 112", "png", 112),
    ("array 1600x900 -> 2 x 448", "array", 448),
    ("array 1600x900 -> 2 x 112", "array", 112),
)


def camera_frame(seed: int = 0) -> Image.Image:
    """A bench scene's front camera at 1600x900, with sensor noise (sigma 8 levels) and a 0.7 px blur."""
    from litevlm.data.synthetic import make_frame, render_views

    im = render_views(make_frame(1, 0), size=(1600, 900))["CAM_FRONT"]
    noisy = np.asarray(im).astype(np.float32) + np.random.default_rng(seed).normal(0, 8, (900, 1600, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(0.7))


def time_pair(a, b, reps: int) -> tuple[float, float]:
    """Median ms of a() and b(), alternating, after one warm-up each."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for f, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def decode_ms(src, tiling: Tiling, size: int, reps: int) -> float:
    """Median ms of the fast path's decode alone (at the scale the tiles need, as `cut_view` reads it), no resize:
    the part of reading a file that a faster resize cannot remove."""
    from litevlm.model.images import read_image

    def once():
        read_image(src, lambda w, h: tiling.target(w, h, size), "fast")

    once()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def score_both(model: str, data: str, n: int) -> dict:
    """drive-hd's DriveLM final with each path, LiteVLM and the baseline, and each configuration's paired difference
    (the new path less PIL's, over the same questions, its interval from resampling frames)."""
    from litevlm.eval.bench import paired_rows
    from litevlm.eval.run import evaluate
    from litevlm.pipeline import Pipeline
    from litevlm.presets import LITEVLM

    out = {"model": model, "questions": n}
    for config, opts in (("litevlm", LITEVLM), ("baseline", {})):
        records = {}
        for resample in ("fast", "pil"):
            pipe = Pipeline.from_pretrained(model, resample=resample, **opts)
            res = evaluate(pipe, data, limit=n, progress=False, gate=False, renormalise=True)
            out[f"{config}_{resample}"] = round(res["final"], 4)
            records[resample] = res["records"]
        out[f"{config}_diff"] = round(out[f"{config}_fast"] - out[f"{config}_pil"], 4)
        out[f"{config}_paired"] = paired_rows(records["fast"], records["pil"])
    return out


def jpeg_copy(data: str, out: Path, quality: int = 90) -> Path:
    """The split at `data` with every camera image re-encoded as a JPEG (nuScenes' format), in `out`."""
    from tqdm import tqdm

    spec = json.loads(Path(data, "drivelm.json").read_text())
    paths = {p for scene in spec.values() for kf in scene["key_frames"].values() for p in kf["image_paths"].values()}
    for rel in tqdm(sorted(paths), desc="JPEG copy", unit="image"):
        dst = out / Path(rel).with_suffix(".jpg")
        dst.parent.mkdir(parents=True, exist_ok=True)
        Image.open(Path(data, rel)).convert("RGB").save(dst, quality=quality)
    for scene in spec.values():
        for kf in scene["key_frames"].values():
            kf["image_paths"] = {cam: str(Path(rel).with_suffix(".jpg")) for cam, rel in kf["image_paths"].items()}
    (out / "drivelm.json").write_text(json.dumps(spec))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--score-n", type=int, default=0, help="held-out questions to score drive-hd on with both paths")
    ap.add_argument("--data", default=".bench-data/heldout")
    ap.add_argument("--score-jpeg", action="store_true", help="score a JPEG copy of the split too (quality 90)")
    ap.add_argument("--model", default="drive-hd")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    frame = camera_frame()
    tiling = Tiling(tiles=2)
    cases = []
    with tempfile.TemporaryDirectory() as d:
        sources = {"jpeg": Path(d, "view.jpg"), "png": Path(d, "view.png"), "array": np.asarray(frame).copy()}
        frame.save(sources["jpeg"], quality=90)
        frame.save(sources["png"])
        for name, kind, size in CASES:
            src = sources[kind]
            today, fast = time_pair(
                lambda: cut_view(src, tiling, size, "pil"), lambda: cut_view(src, tiling, size, "fast"), args.reps
            )
            diff = np.abs(cut_view(src, tiling, size, "pil").astype(int) - cut_view(src, tiling, size, "fast"))
            # each path's tiles against those cut (PIL's way) from the camera's own pixels, before any encoding
            own = cut_view(sources["array"], tiling, size, "pil").astype(int)
            err = {p: float(np.abs(cut_view(src, tiling, size, p) - own).mean()) for p in ("pil", "fast")}
            decode = decode_ms(src, tiling, size, args.reps) if kind != "array" else None
            cases.append(
                {
                    "name": name,
                    "source": kind,
                    "tiles": f"2 x {size}",
                    "today_ms": round(today, 3),
                    "new_ms": round(fast, 3),
                    "speedup": round(today / fast, 2),
                    "max_pixel_diff": int(diff.max()),
                    "mean_pixel_diff": round(float(diff.mean()), 4),
                    "today_err": round(err["pil"], 3),
                    "new_err": round(err["fast"], 3),
                    # the fast path's decode alone (no resize): what no resize can take away
                    "decode_ms": None if decode is None else round(decode, 3),
                    "best_speedup": None if decode is None else round(today / decode, 2),
                }
            )
            print(
                f"{name:<28} today {today:7.2f} ms   fast {fast:6.2f} ms   x{today / fast:4.1f}   "
                f"max diff {diff.max()} (mean {diff.mean():.3f})"
            )
        jpeg_kb = round(sources["jpeg"].stat().st_size / 1024, 1)
    result = {"threads": torch.get_num_threads(), "reps": args.reps, "jpeg_kb": jpeg_kb, "cases": cases}
    if args.score_n:
        result["score"] = score_both(args.model, args.data, args.score_n)
        print("score", result["score"])
        if args.score_jpeg:
            with tempfile.TemporaryDirectory() as d:
                result["score_jpeg"] = score_both(args.model, str(jpeg_copy(args.data, Path(d))), args.score_n)
            print("score on the JPEG copy", result["score_jpeg"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
