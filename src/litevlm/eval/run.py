"""Run a pipeline over a DriveLM-format dataset and score its answers with DriveLM's evaluation.

The questions are answered frame by frame (`Pipeline.frame`): each camera view is read and encoded once for all its
frame's questions, and a pipeline with a content cache (`litevlm.frame.ViewCache`) serves views seen before.

Under `torchrun` each rank answers its share of the questions (`litevlm.dist.shard`) and rank 0 gathers
the records back in the file's order and scores them, so the scores equal a single process's; with a
`ShardStore` every finished answer is kept on disk and a rerun answers only what is left.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tqdm import tqdm

from litevlm.dist import Dist, ShardStore, gather, shard
from litevlm.eval.metrics import closed_accuracy
from litevlm.eval.score import drivelm_score, has_answers, record


def evaluate(
    pipe,
    data: str | Path,
    images_root=None,
    limit: int | None = None,
    blank: bool = False,
    progress: bool = True,
    judge=None,
    gate: bool = True,
    renormalise: bool = False,
    d: Dist | None = None,
    store: ShardStore | None = None,
    samples: list | None = None,
    score: bool = True,
) -> dict | None:
    """Answer every question of `data` with `pipe`; return the DriveLM scores, per-question records included.

    Scoring is `litevlm.eval.score.drivelm_score`: the official evaluation by default (gate on, official
    weights); gate=False, renormalise=True is the older mix the synthetic benchmarks report. A file without
    answers (the released challenge questions) is answered and not scored: `scored` is False.
    blank=True replaces every camera image by the same empty road: a model that really looks at
    the images must then lose most of its closed-question accuracy.
    d: this process's rank (`litevlm.dist.init_dist`); it answers its share only, and only rank 0 returns
    the result (None elsewhere). store: skip the questions it holds, keep each new answer in it.
    samples: `data`'s questions when already loaded (`litevlm.data.source.load_data`, every image checked).
    score=False: answers, timings and the closed questions' accuracy, without the DriveLM score (no pycocoevalcap
    needed); `scored` is False.
    """
    from litevlm.data.source import load_data

    if samples is None:
        samples = load_data(data, images_root=images_root, require_images=not blank)
    if limit:
        samples = samples[:limit]
    empty = None
    if blank:
        from litevlm.data.synthetic import render_empty_road

        empty = render_empty_road()
    d = d or Dist()
    done = store.done() if store is not None else {}
    mine = []
    frame, frame_of = None, None  # DriveLM's questions come frame by frame: each view read and encoded once a frame
    for i in tqdm(shard(list(range(len(samples))), d), desc="evaluating", disable=not (progress and d.is_main)):
        if str(i) in done:
            mine.append(done[str(i)])
            continue
        s = samples[i]
        if frame is None or frame_of != s.frame_id:
            frame, frame_of = pipe.frame(empty if blank else s.images), s.frame_id
        ans = frame.answer(s.question)
        rec = {
            **record(s, ans.text),
            "category": s.category,
            "views": ans.views,
            "needed_views": list(s.views),
            "visual_tokens": ans.num_visual_tokens,
            "timings_ms": ans.timings_ms,
            "cache": ans.cache,
        }
        if store is not None:
            store.put(str(i), rec)
        mine.append(rec)
    if store is not None:
        store.flush()
    records = gather(mine, d)
    if records is None:
        return None
    views = [len(r["views"]) for r in records]
    vtok = [r["visual_tokens"] for r in records]
    totals = [r["timings_ms"]["total"] for r in records]
    if has_answers(samples) and score:
        result = drivelm_score(records, judge=judge, gate=gate, renormalise=renormalise)
        result["scored"] = True
        result["closed_accuracy"] = closed_accuracy(records)
    elif has_answers(samples):
        result = {
            "n": len(records),
            "scored": False,
            "final": None,
            "closed_accuracy": closed_accuracy(records),
            "final_note": "not scored (--no-score): answers, timings and closed-question accuracy only",
        }
    else:
        result = {
            "n": len(records),
            "scored": False,
            "final": None,
            "final_note": f"{data} holds no answers (the released challenge questions have none): "
            "answers made, nothing scored",
        }
    result["views_per_question"] = statistics.fmean(views) if views else 0.0
    result["visual_tokens"] = statistics.fmean(vtok) if vtok else 0.0
    result["total_ms_median"] = statistics.median(totals) if totals else 0.0
    e2e = [r["timings_ms"].get("e2e", 0.0) for r in records]
    result["e2e_ms_median"] = statistics.median(e2e) if e2e else 0.0
    result["views_encoded"] = sum(r.get("cache", {}).get("encoded", 0) for r in records)
    result["blank_images"] = blank
    result["records"] = records
    return result
