"""Run a pipeline over a DriveLM-format dataset and score its answers with the DriveLM metrics."""

from __future__ import annotations

import statistics
from pathlib import Path

from tqdm import tqdm

from litevlm.eval.metrics import closed_accuracy, score


def evaluate(
    pipe,
    data: str | Path,
    images_root=None,
    limit: int | None = None,
    blank: bool = False,
    progress: bool = True,
    judge=None,
) -> dict:
    """Answer every question of `data` with `pipe`; return the DriveLM scores, per-question records included.

    blank=True replaces every camera image by the same empty road: a model that really looks at
    the images must then lose most of its closed-question accuracy.
    """
    from litevlm.data.drivelm import load_samples

    samples = load_samples(data, images_root=images_root)
    if limit:
        samples = samples[:limit]
    empty = None
    if blank:
        from litevlm.data.synthetic import render_empty_road

        empty = render_empty_road()
    records, views, vtok, totals = [], [], [], []
    for s in tqdm(samples, desc="evaluating", disable=not progress):
        images = empty if blank else s.images
        ans = pipe.answer(s.question, images)
        records.append(
            {
                "id": s.id,
                "question": s.question,
                "answer": ans.text,
                "gt": s.answer,
                "tag": s.tag,
                "closed": s.closed,
                "category": s.category,
                "frame": s.frame_id,
                "views": ans.views,
                "needed_views": list(s.views),
                "visual_tokens": ans.num_visual_tokens,
            }
        )
        views.append(len(ans.views))
        vtok.append(ans.num_visual_tokens)
        totals.append(ans.timings_ms["total"])
    result = score(records, judge=judge)
    result["closed_accuracy"] = closed_accuracy(records)
    result["views_per_question"] = statistics.fmean(views) if views else 0.0
    result["visual_tokens"] = statistics.fmean(vtok) if vtok else 0.0
    result["total_ms_median"] = statistics.median(totals) if totals else 0.0
    result["blank_images"] = blank
    result["records"] = records
    return result
