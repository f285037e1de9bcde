"""litevlm.eval.intervals: paired differences with a bootstrap over frames, checked on cases whose answer is known;
litevlm.eval.per_question: each question's share of the DriveLM final, whose mean is the final."""

import math
import statistics

import numpy as np
import pytest

from litevlm.eval.intervals import both_scored, cluster_se, paired_difference


def test_identical_scores_are_level_with_a_zero_interval():
    rng = np.random.default_rng(0)
    a = rng.random(60).tolist()
    frames = [i // 6 for i in range(60)]
    p = paired_difference(a, a, frames)
    assert (p.diff, p.low, p.high) == (0.0, 0.0, 0.0)
    assert p.level and p.ahead is None and p.verdict("DART", "TokenSelector") == "level"
    assert p.a == p.b and p.se_a == p.se_b > 0 and (p.n, p.frames) == (60, 10)


def test_a_constant_shift_is_the_exact_difference_with_a_zero_width_interval():
    rng = np.random.default_rng(1)
    b = rng.random(48)
    frames = [f"scene_{i % 8}" for i in range(48)]  # a frame's questions need not be next to each other
    p = paired_difference((b + 0.25).tolist(), b.tolist(), frames)
    assert p.diff == pytest.approx(0.25, abs=1e-12)
    assert p.low == pytest.approx(0.25, abs=1e-12) and p.high == pytest.approx(0.25, abs=1e-12)
    assert not p.level and p.ahead == "a" and p.verdict("DART", "TokenSelector") == "DART"
    # lower is better (a log-likelihood drop): the same shift puts the other side ahead
    lower = paired_difference((b + 0.25).tolist(), b.tolist(), frames, higher_is_better=False)
    assert lower.verdict("DART", "TokenSelector") == "TokenSelector"


def test_the_interval_is_deterministic_given_the_seed():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=80).tolist(), rng.normal(size=80).tolist()
    frames = [i // 4 for i in range(80)]
    one, two = paired_difference(a, b, frames, seed=3), paired_difference(a, b, frames, seed=3)
    assert one == two
    other = paired_difference(a, b, frames, seed=4)
    assert other.diff == one.diff and (other.low, other.high) != (one.low, one.high)


def test_questions_of_one_frame_are_not_counted_as_independent():
    """Each frame's question asked five times over: resampling questions would see 200 independent ones and a
    narrower interval; resampling frames sees the 40 there are, about sqrt(5) times wider."""
    rng = np.random.default_rng(5)
    per_frame = rng.normal(0.0, 1.0, size=40)
    d = np.repeat(per_frame, 5).tolist()
    zeros = [0.0] * len(d)
    clustered = paired_difference(d, zeros, [i // 5 for i in range(200)])
    independent = paired_difference(d, zeros, list(range(200)))
    ratio = (clustered.high - clustered.low) / (independent.high - independent.low)
    assert 1.8 < ratio < 2.8
    # 5 sqrt(40 / 39) / sqrt(5 * 200 / 199): five times the frame sums' spread over 40 frames, against 200 questions
    assert clustered.se_a / independent.se_a == pytest.approx(math.sqrt(199 / 39), rel=1e-9)
    # the clustered standard error is that of the 40 frames' own means
    assert clustered.se_a == pytest.approx(statistics.stdev(per_frame) / math.sqrt(40), rel=1e-9)


def test_on_normal_differences_the_interval_is_close_to_the_analytic_one_and_covers_as_it_says():
    rng = np.random.default_rng(6)
    n = 400
    a, b = rng.normal(0.6, 1.0, size=n), rng.normal(0.5, 0.5, size=n)
    p = paired_difference(a.tolist(), b.tolist(), list(range(n)))
    d = a - b
    se = d.std(ddof=1) / math.sqrt(n)
    assert p.diff == pytest.approx(d.mean())
    assert p.low == pytest.approx(d.mean() - 1.96 * se, abs=0.25 * se)
    assert p.high == pytest.approx(d.mean() + 1.96 * se, abs=0.25 * se)
    assert p.se_a == pytest.approx(a.std(ddof=1) / math.sqrt(n), rel=1e-9)
    # coverage: of 200 samples of 100 questions (25 frames of 4, frames independent), about 95% of the intervals hold
    # the true difference 0.1
    covered = 0
    for _ in range(200):
        x = np.repeat(rng.normal(0.1, 1.0, size=25), 4) + rng.normal(0, 0.5, size=100)
        q = paired_difference(x.tolist(), [0.0] * 100, [i // 4 for i in range(100)], resamples=1000)
        covered += q.low <= 0.1 <= q.high
    assert 0.88 <= covered / 200 <= 0.99


def test_bad_inputs_are_refused_and_unscored_questions_left_out():
    with pytest.raises(ValueError, match="one of each per question"):
        paired_difference([1.0, 2.0], [1.0], [0, 1])
    with pytest.raises(ValueError, match="finite"):
        paired_difference([1.0, math.nan], [1.0, 2.0], [0, 1])
    with pytest.raises(ValueError, match="no questions"):
        cluster_se([], [])
    assert math.isnan(cluster_se([1.0, 2.0], ["f", "f"]))  # one frame: no spread to measure
    a, b, frames = both_scored([1, None, 0, 1], [0, 1, None, 1], ["x", "x", "y", "z"])
    assert (a, b, frames) == ([1, 1], [0, 1], ["x", "z"])
    assert paired_difference(a, b, frames).to_dict()["diff"] == 0.5


def test_each_questions_share_of_the_final_averages_to_the_final():
    """The linearised per-question final (DriveLM without a judge, no gate), on answers right, wrong, empty and
    partly right over every bucket: its mean is drivelm_score's final, renormalised or not; an untagged question
    has none."""
    from litevlm.data.synthetic import make_frame
    from litevlm.eval.per_question import bleu_per_item, final_per_question
    from litevlm.eval.score import drivelm_score

    rng = np.random.default_rng(7)
    records = []
    for f in range(12):
        frame = make_frame(1, f)
        for qa in frame.qas:
            k = rng.random()
            words = qa.answer.split()
            answer = (
                qa.answer
                if k < 0.3
                else " ".join(w for w in words if rng.random() < 0.7)
                if k < 0.6
                else ""
                if k < 0.75
                else "the car ahead at 812.3, 402.1 is moving"
            )
            records.append(
                {"id": str(len(records)), "question": qa.question, "answer": answer, "gt": qa.answer}
                | {"tag": [qa.tag], "closed": qa.closed, "frame": frame.frame_id}
            )
    assert {t for r in records for t in r["tag"]} >= {0, 2, 3}  # accuracy, language and match items
    records.append({"id": "x", "question": "?", "answer": "a", "gt": "b", "tag": [], "closed": False, "frame": "z"})
    for renormalise in (True, False):
        shares = final_per_question(records, renormalise=renormalise)
        assert shares[-1] is None and None not in shares[:-1]
        final = drivelm_score(records, gate=False, renormalise=renormalise)["final"]
        assert statistics.fmean(shares[:-1]) == pytest.approx(final, abs=1e-9)
    # BLEU's linearised shares average to pycocoevalcap's corpus BLEU-1..4
    from litevlm.eval.metrics import language_scores, ptb_tokenize

    lang = [r for r in records if 2 in r["tag"]]
    corpus = language_scores([r["answer"] for r in lang], [r["gt"] for r in lang])
    items = bleu_per_item([ptb_tokenize(r["answer"]) for r in lang], [ptb_tokenize(r["gt"]) for r in lang])
    assert items.mean(0) == pytest.approx([corpus[f"Bleu_{k}"] for k in range(1, 5)], abs=1e-9)
    assert final_per_question([records[-1]]) == [None]
