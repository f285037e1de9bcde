"""Run a pipeline over a DriveLM-format dataset and score its answers with DriveLM's evaluation.

The questions are answered frame by frame (`Pipeline.frame`): each camera view is read and encoded once for all its
frame's questions, and a pipeline with a content cache (`litevlm.frame.ViewCache`) serves views seen before.

Under `torchrun` each rank answers its share of the questions (`litevlm.dist.shard`) and rank 0 gathers
the records back in the file's order and scores them, so the scores equal a single process's; with a
`ShardStore` every finished answer is kept on disk and a rerun answers only what is left.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from litevlm.batch import batch_refusal
from litevlm.dist import Dist, ShardStore, gather, shard
from litevlm.errors import LiteVLMError
from litevlm.eval.metrics import closed_accuracy
from litevlm.eval.score import drivelm_score, has_answers, record


def _frame_chunks(indices: list[int], samples, size: int) -> Iterator[list[int]]:
    """`indices` cut into runs of whole frames (the questions of one frame id in a row), each run holding at least
    `size` questions where the frames allow (the last may hold fewer)."""
    chunk: list[int] = []
    for i in indices:
        if len(chunk) >= size and samples[i].frame_id != samples[chunk[-1]].frame_id:
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk


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
    batch: int = 1,
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
    batch: B > 1 decodes up to B answers together (`Pipeline.answer_many`), a few frames' questions at a time; the
    answers are the ones batch 1 gives (greedy).
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
    if batch > 1 and not pipe.can_batch:
        raise LiteVLMError(f"--batch {batch}: {batch_refusal(pipe.backend)}")
    mine: dict[int, dict] = {}
    mine_order = shard(list(range(len(samples))), d)

    def keep(i: int, ans) -> None:
        s = samples[i]
        rec = {
            **record(s, ans.text),
            "category": s.category,
            "frame": s.frame_id,  # a paired difference resamples the frames (`litevlm.eval.intervals`)
            "views": ans.views,
            "needed_views": list(s.views),
            "visual_tokens": ans.num_visual_tokens,
            "timings_ms": ans.timings_ms,
            "cache": ans.cache,
        }
        if store is not None:
            store.put(str(i), rec)
        mine[i] = rec

    todo = []
    for i in mine_order:
        if str(i) in done:
            mine[i] = done[str(i)]
        else:
            todo.append(i)
    bar = tqdm(total=len(todo), desc="evaluating", disable=not (progress and d.is_main))
    # DriveLM's questions come frame by frame: each view read and encoded once a frame
    for chunk in _frame_chunks(todo, samples, 4 * batch if batch > 1 else 1):
        frames: dict = {}
        work = []
        for i in chunk:
            s = samples[i]
            if s.frame_id not in frames:
                frames[s.frame_id] = pipe.frame(empty if blank else s.images)
            work.append((s.question, frames[s.frame_id]))
        if batch > 1:
            for j, ans in pipe.answer_many(work, max_batch=batch):
                keep(chunk[j], ans)
                bar.update()
        else:
            for i, (q, frame) in zip(chunk, work):
                keep(i, frame.answer(q))
                bar.update()
    bar.close()
    mine = [mine[i] for i in mine_order]
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
