"""Each question's share of the DriveLM final score, so that two configurations can be compared question by question
(`litevlm.eval.intervals`).

The final is not a mean over questions: its parts are means over their own buckets, and the language part is
corpus-level (BLEU pools n-gram counts over every answer; CIDEr-D weighs n-grams by the references' document
frequencies). Each question gets the first-order (influence-function, or delta-method) linearisation of the final
at the answers given: the final plus the change one question makes to it, scaled to one question's weight. The
mean of these values over the questions is the final itself (to rounding), and a mean over a resample of them is the
final of that resample to first order, so a bootstrap over frames of these values is the linearisation bootstrap of
the final (Davison and Hinkley 1997, section 2.7). ROUGE-L and CIDEr-D are already means of per-answer scores
(CIDEr-D's document frequencies held at the corpus's); BLEU-n is a ratio of pooled counts, linearised in them.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

import numpy as np

from litevlm.eval.metrics import (
    BUCKET_TAGS,
    WEIGHTS,
    _tags,
    final_weights,
    language_scorers,
    match_f1,
    ptb_tokenize,
)


def bleu_per_item(predictions: Sequence[str], references: Sequence[str], n: int = 4) -> np.ndarray:
    """(items, n): item i's linearised share of corpus BLEU-1..n as pycocoevalcap computes it (one reference each,
    "closest" reference length, its 1e-15 / 1e-9 guards); each column's mean is that corpus BLEU. Inputs are
    PTB-tokenised text."""
    from pycocoevalcap.bleu.bleu_scorer import cook_refs, cook_test

    tiny, small = 1e-15, 1e-9
    items = len(predictions)
    correct, guess = np.zeros((items, n)), np.zeros((items, n))
    test_len, ref_len = np.zeros(items), np.zeros(items)
    for i, (pred, ref) in enumerate(zip(predictions, references)):
        comps = cook_test(pred, cook_refs([ref], n=n), n=n)
        correct[i], guess[i] = comps["correct"], comps["guess"]
        test_len[i], ref_len[i] = comps["testlen"], comps["reflen"][0]
    c, g, t, r = correct.sum(0), guess.sum(0), test_len.sum(), ref_len.sum()
    ratio = (t + tiny) / (r + small)
    short = ratio < 1  # the brevity penalty exp(1 - r / t) applies
    out = np.zeros((items, n))
    if t == 0:  # every answer empty: BLEU is 0 and so is every share
        return out
    # d log(precision_j) per item: its correct and guessed j-grams against the pooled counts
    dlog_p = correct / (c + tiny) - guess / (g + small)  # (items, n)
    dlog_bp = (r * test_len / t**2 - ref_len / t) if short else np.zeros(items)
    for k in range(1, n + 1):
        score = np.prod((c[:k] + tiny) / (g[:k] + small)) ** (1.0 / k) * (np.exp(1 - 1 / ratio) if short else 1.0)
        grad = dlog_p[:, :k].sum(1) / k + dlog_bp  # d log BLEU-k, per item
        out[:, k - 1] = score * (1.0 + items * (grad - grad.mean()))
    return out


def language_per_item(predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """(items,): each item's linearised share of DriveLM's language score (mean(BLEU-1..4)/3 + ROUGE-L/3 +
    CIDEr/30, as `litevlm.eval.metrics.language_score`); its mean is that corpus score."""
    _, Rouge, Cider = language_scorers()
    gts = {i: [ptb_tokenize(ref)] for i, ref in enumerate(references)}
    res = {i: [ptb_tokenize(pred)] for i, pred in enumerate(predictions)}
    with contextlib.redirect_stdout(io.StringIO()):
        _, rouge = Rouge().compute_score(gts, res)
        if any(ref[0] for ref in gts.values()):
            _, cider = Cider().compute_score(gts, res)
        else:  # no reference n-grams: CIDEr is 0 (as `language_scores`)
            cider = np.zeros(len(gts))
    bleu = bleu_per_item([res[i][0] for i in res], [gts[i][0] for i in gts])
    return bleu.mean(1) / 3.0 + np.asarray(rouge, dtype=np.float64) / 3.0 + np.asarray(cider, dtype=np.float64) / 30.0


def final_per_question(records: Sequence[dict], renormalise: bool = True) -> list[float | None]:
    """Each record's linearised share of the DriveLM final without a judge and without the graph gate
    (`litevlm.eval.score.drivelm_score(records, gate=False, renormalise=...)`): their mean over the records with a
    metric tag is that final. A record without a tag is not part of the final: None.

    A part's share for record i: the part's value S, plus (i's own value - S) / (the share of records in its bucket)
    where i is in the bucket (the linearisation of a bucket mean); the final's is the weighted sum of its parts'."""
    routed = [i for i, r in enumerate(records) if r["tag"] not in ((), [], None)]
    out: list[float | None] = [None] * len(records)
    if not routed:
        return out
    tags = [_tags(records[i], f"record {i}") for i in routed]
    values: dict[str, tuple[list[int], np.ndarray]] = {}  # bucket -> (its positions among `routed`, their values)
    for name, tag in BUCKET_TAGS.items():
        where = [j for j, t in enumerate(tags) if tag in t]
        if not where or name == "judge":
            continue
        items = [records[routed[j]] for j in where]
        if name == "accuracy":  # raw string equality, as DriveLM
            v = np.array([float(r["answer"] == r["gt"]) for r in items])
        elif name == "match":  # without a judge: the coordinate F1 (halved where the judge's half counts as 0)
            v = np.array([match_f1(r["answer"], r["gt"]) for r in items]) / (1.0 if renormalise else 2.0)
        else:
            v = language_per_item([r["answer"] for r in items], [r["gt"] for r in items])
        values[name] = (where, v)
    weights = final_weights(values) if renormalise else {name: WEIGHTS[name] for name in values}
    n = len(routed)
    share = np.zeros(n)
    for name, (where, v) in values.items():
        part = v.mean()
        own = np.full(n, part)
        own[where] += (v - part) * n / len(where)
        share += weights[name] * own
    for j, i in enumerate(routed):
        out[i] = float(share[j])
    return out
