"""View selection on a held-out split: recall, views per question against the views needed, and the
vision stage with all six views against the selected views, side by side on the same questions.

    litevlm data synth --out /tmp/heldout_views --frames 60 --seed 1 --width 320 --height 180
    python benchmarks/view_selection.py --model src/litevlm/weights/drive-tiny --data /tmp/heldout_views

View recall = needed views kept / needed views (the generator writes the views each question needs);
the ratio is views kept per question over views needed per question. The lexical map alone
(weight 1) is reported beside the calibrated selector. Vision timing: the model's `encode_tiles` on
the same questions' tiles, all six views and then the selected ones, alternating, after warm-up;
per-question medians of --repeats runs (image decoding and tiling excluded, as the pipeline's `vit`
stage). The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="drive-tiny", help="model directory (with view_selector/) or bundled name")
    p.add_argument("--selector", default=None, help="ViewSelector directory if not MODEL/view_selector")
    p.add_argument(
        "--data", required=True, help="folder from `litevlm data synth` (held-out: seed 1) or a DriveLM JSON file"
    )
    p.add_argument("--n", type=int, default=None, help="questions (the first N; default all)")
    p.add_argument("--timing-n", type=int, default=40, help="questions timed through the vision encoder (0: no timing)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def metrics(kept: list[list[str]], needed: list[tuple[str, ...]]) -> dict:
    n_needed = sum(len(v) for v in needed)
    hit = sum(len(set(k) & set(v)) for k, v in zip(kept, needed))
    views = sum(len(k) for k in kept) / max(1, len(kept))
    per_q_needed = n_needed / max(1, len(needed))
    return {
        "questions": len(kept),
        "recall": hit / max(1, n_needed),
        "views_per_question": views,
        "needed_per_question": per_q_needed,
        "ratio_to_needed": views / per_q_needed if per_q_needed else None,
        "exact": sum(set(k) == set(v) for k, v in zip(kept, needed)) / max(1, len(kept)),
        "questions_missing_a_view": sum(not set(v) <= set(k) for k, v in zip(kept, needed)),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_vision(model_name: str, samples, kept: list[list[str]], args) -> dict:
    """encode_tiles on all six views vs the selected ones, same questions, alternating, median ms."""
    from litevlm.cameras import CAMERAS
    from litevlm.data.drivelm import load_images
    from litevlm.model.vlm import image_to_tiles
    from litevlm.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(model_name, device=args.device, dtype=args.dtype)
    cfg, model = pipe.cfg, pipe.model
    cache: dict[str, dict] = {}  # frame -> camera -> tiles (each frame's images tiled once)

    def tiles(sample, cams):
        per_cam = cache.setdefault(sample.frame_id, {})
        images = None
        for c in cams:
            if c not in per_cam:
                images = images or load_images(sample)
                per_cam[c] = image_to_tiles(images[c], cfg.vision.image_size, cfg.tiles_per_view)
        return torch.cat([per_cam[c] for c in cams]).to(args.device)

    def run(pixels) -> float:
        _sync(args.device)
        t0 = time.perf_counter()
        model.encode_tiles(pixels)
        _sync(args.device)
        return 1000.0 * (time.perf_counter() - t0)

    rows = list(zip(samples, kept))[: args.timing_n]
    with torch.inference_mode():
        warm = tiles(rows[0][0], list(CAMERAS))
        for _ in range(3):
            run(warm)
        all_ms, sel_ms, n_tiles = [], [], []
        for sample, views in rows:
            full, part = tiles(sample, list(CAMERAS)), tiles(sample, views)
            a, s = [], []
            for _ in range(args.repeats):  # alternate so drift hits both alike
                a.append(run(full))
                s.append(run(part))
            all_ms.append(statistics.median(a))
            sel_ms.append(statistics.median(s))
            n_tiles.append(part.shape[0])
    return {
        "questions": len(rows),
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "tiles_all": len(CAMERAS) * cfg.tiles_per_view,
        "tiles_selected_mean": statistics.mean(n_tiles),
        "vit_ms_all_median": statistics.median(all_ms),
        "vit_ms_selected_median": statistics.median(sel_ms),
        "vit_ms_all_mean": statistics.mean(all_ms),
        "vit_ms_selected_mean": statistics.mean(sel_ms),
        "speedup": sum(all_ms) / sum(sel_ms),
    }


def no_vlm_reason(model: str) -> str | None:
    """Why --model cannot be timed through a vision encoder, or None when it can."""
    from litevlm.errors import LiteVLMError
    from litevlm.models import resolve_model_dir
    from litevlm.select.views import SELECTOR_FORMAT

    try:
        path = resolve_model_dir(model)
    except LiteVLMError as e:
        return str(e)
    if json.loads((path / "config.json").read_text()).get("format") == SELECTOR_FORMAT:
        return f"{path} is a ViewSelector folder, not a VLM: pass the model directory as --model"
    return None


def main(argv=None) -> dict:
    from litevlm.data.drivelm import load_samples
    from litevlm.select.views import ViewSelector, load_for_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    selector = ViewSelector.load(args.selector) if args.selector else load_for_model(args.model)
    samples = load_samples(args.data, require_images=False)[: args.n]
    needed = [tuple(s.views) for s in samples]
    kept, select_ms = [], []
    for s in samples:
        t0 = time.perf_counter()
        views, _ = selector.select(s.question)
        select_ms.append(1000.0 * (time.perf_counter() - t0))
        kept.append(views)
    lexical = ViewSelector.lexical_only()
    kept_lexical = [lexical.select(s.question)[0] for s in samples]

    result = {
        "model": str(args.model),
        "selector": str(args.selector or "MODEL/view_selector"),
        "data": str(args.data),
        "weight": selector.weight,
        "threshold": selector.threshold,
        "target_recall": selector.target_recall,
        **metrics(kept, needed),
        "lexical_only": metrics(kept_lexical, needed),
        "select_ms_median": statistics.median(select_ms),
        "select_ms_p90": sorted(select_ms)[int(0.9 * (len(select_ms) - 1))],
    }
    by_family = defaultdict(list)
    for i, s in enumerate(samples):
        by_family[s.family or s.category or "?"].append(i)
    result["per_family"] = {
        f: {
            k: v
            for k, v in metrics([kept[i] for i in idx], [needed[i] for i in idx]).items()
            if k in ("questions", "recall", "views_per_question", "needed_per_question")
        }
        for f, idx in sorted(by_family.items())
    }
    result["misses"] = [
        {"question": s.question, "needed": list(v), "kept": k}
        for s, k, v in zip(samples, kept, needed)
        if not set(v) <= set(k)
    ][:10]

    print(f"{len(samples)} questions from {args.data}; weight {selector.weight}, threshold {selector.threshold}")
    print(f"{'':22}{'recall':>8}{'views/q':>9}{'needed/q':>10}{'ratio':>7}{'exact':>7}")
    for name, m in (("ViewSelector", result), ("lexical map alone", result["lexical_only"])):
        print(
            f"{name:22}{m['recall']:8.4f}{m['views_per_question']:9.3f}{m['needed_per_question']:10.3f}"
            f"{m['ratio_to_needed']:7.3f}{m['exact']:7.3f}"
        )
    print(f"select: median {result['select_ms_median']:.2f} ms, p90 {result['select_ms_p90']:.2f} ms per question")
    print(f"{'family':22}{'n':>6}{'recall':>8}{'views/q':>9}{'needed/q':>10}")
    for f, m in result["per_family"].items():
        print(
            f"{f:22}{m['questions']:6d}{m['recall']:8.4f}{m['views_per_question']:9.3f}{m['needed_per_question']:10.3f}"
        )

    if args.timing_n > 0:
        reason = no_vlm_reason(args.model)
        if reason:
            result["vision"] = {"skipped": reason}
            print(f"vision timing skipped: {reason}")
        else:
            v = time_vision(args.model, samples, kept, args)
            result["vision"] = v
            print(
                f"vision ({v['questions']} questions, {v['device']} {v['dtype']}): all six views "
                f"{v['vit_ms_all_median']:.2f} ms ({v['tiles_all']} tiles), selected {v['vit_ms_selected_median']:.2f} ms "
                f"({v['tiles_selected_mean']:.2f} tiles on average): {v['speedup']:.2f}x"
            )
    print(json.dumps(result, separators=(",", ":")))
    return result


if __name__ == "__main__":
    main()
