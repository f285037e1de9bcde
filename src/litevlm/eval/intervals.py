"""Paired differences with a frame bootstrap: whether two configurations answering the same questions differ by more
than the questions' noise.

Each question carries a score under each configuration (its share of the DriveLM final, 1 or 0 for a closed
question answered right, a log-likelihood). A frame's questions share its images, so they are not independent: the
interval resamples FRAMES, not questions (the cluster bootstrap, Davison and Hinkley 1997, section 3.8). Each
resample draws as many frames as there are, with replacement, and takes the mean difference over the questions they
hold; the 95% interval is the 2.5th and 97.5th percentiles of those means, and a difference whose interval holds zero
is "level". Each score's standard error is the cluster-robust one, from the spread of the frames' sums.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

RESAMPLES = 2000


@dataclass(frozen=True)
class Paired:
    """Two scores on the same questions: their means, the cluster-robust standard error of each, and the difference
    a - b with its bootstrap interval [low, high] over `frames` frames (`n` questions)."""

    a: float
    b: float
    se_a: float
    se_b: float
    diff: float
    low: float
    high: float
    n: int
    frames: int
    higher_is_better: bool = True

    @property
    def level(self) -> bool:
        """The interval holds zero: the data do not say which side is ahead."""
        return self.low <= 0.0 <= self.high

    @property
    def ahead(self) -> str | None:
        """ "a" or "b", the side ahead (the higher mean, or the lower where lower is better); None where level."""
        if self.level:
            return None
        return "a" if (self.diff > 0) == self.higher_is_better else "b"

    def verdict(self, a: str = "a", b: str = "b") -> str:
        """ "level", or the name of the side ahead."""
        return {None: "level", "a": a, "b": b}[self.ahead]

    def to_dict(self, digits: int = 6) -> dict:
        """The figures, rounded, for a results file (a standard error that cannot be computed is None)."""

        def r(v: float) -> float | None:
            return None if math.isnan(v) else round(v, digits)

        return {
            "a": r(self.a),
            "b": r(self.b),
            "se_a": r(self.se_a),
            "se_b": r(self.se_b),
            "diff": r(self.diff),
            "low": r(self.low),
            "high": r(self.high),
            "n": self.n,
            "frames": self.frames,
        }


def frame_index(frames: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """Each question's frame as an index 0..C-1 (in order of first appearance), and C."""
    ids: dict[Hashable, int] = {}
    index = np.fromiter((ids.setdefault(f, len(ids)) for f in frames), dtype=np.int64, count=len(frames))
    return index, len(ids)


def frame_sums(values: Sequence[float], frames: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """Per frame: the sum of its questions' values and their count, (C,) each."""
    if len(values) != len(frames):
        raise ValueError(f"{len(values)} values for {len(frames)} frame ids: one frame id per question")
    if not len(values):
        raise ValueError("no questions")
    index, c = frame_index(frames)
    x = np.asarray(values, dtype=np.float64)
    return np.bincount(index, weights=x, minlength=c), np.bincount(index, minlength=c).astype(np.float64)


def cluster_se(values: Sequence[float], frames: Sequence[Hashable]) -> float:
    """The standard error of the mean of `values` with each frame's questions taken together: sqrt(C / (C - 1) *
    sum over frames of (frame sum - mean * frame count)^2) / n. With one question a frame it is s / sqrt(n). NaN
    with fewer than two frames."""
    sums, counts = frame_sums(values, frames)
    c, n = len(sums), counts.sum()
    if c < 2:
        return math.nan
    resid = sums - sums.sum() / n * counts
    return float(math.sqrt(c / (c - 1) * float(resid @ resid)) / n)


@lru_cache(maxsize=16)
def _draws(c: int, resamples: int, seed: int) -> np.ndarray:
    """How often each of c frames is drawn in each resample, (resamples, c): c draws with replacement each."""
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(c, np.full(c, 1.0 / c), size=resamples).astype(np.float64)
    draws.setflags(write=False)
    return draws


def bootstrap_means(
    values: Sequence[float], frames: Sequence[Hashable], resamples: int = RESAMPLES, seed: int = 0
) -> np.ndarray:
    """The mean of `values` over the questions of each of `resamples` frame resamples, (resamples,); the same seed
    and frame count draw the same frames."""
    sums, counts = frame_sums(values, frames)
    draws = _draws(len(sums), resamples, seed)
    return (draws @ sums) / (draws @ counts)


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    frames: Sequence[Hashable],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
    higher_is_better: bool = True,
) -> Paired:
    """mean(a) - mean(b) over the same questions in the same order (a[i], b[i] and frames[i] are question i's), its
    `confidence` interval from `resamples` frame resamples (`seed` fixes them), and each mean's standard error."""
    if not len(a) == len(b) == len(frames):
        raise ValueError(f"paired scores need one of each per question: {len(a)}, {len(b)} and {len(frames)} frames")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1); got {confidence}")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("paired scores must be finite numbers (leave out the questions a score does not cover)")
    d = x - y
    means = bootstrap_means(d, frames, resamples, seed)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return Paired(
        a=float(x.mean()),
        b=float(y.mean()),
        se_a=cluster_se(x, frames),
        se_b=cluster_se(y, frames),
        diff=float(d.mean()),
        low=float(low),
        high=float(high),
        n=len(d),
        frames=frame_index(frames)[1],
        higher_is_better=higher_is_better,
    )


def both_scored(
    a: Sequence[float | None], b: Sequence[float | None], frames: Sequence[Hashable]
) -> tuple[list[float], list[float], list[Hashable]]:
    """The questions both `a` and `b` score, in order (None marks a question a score does not cover, such as an open
    question's closed accuracy): (a, b, frames) over those questions only."""
    if not len(a) == len(b) == len(frames):
        raise ValueError(f"paired scores need one of each per question: {len(a)}, {len(b)} and {len(frames)} frames")
    keep = [i for i in range(len(a)) if a[i] is not None and b[i] is not None]
    return [a[i] for i in keep], [b[i] for i in keep], [frames[i] for i in keep]
