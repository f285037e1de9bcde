"""Determinantal point processes over visual tokens: the greedy MAP subset both CDPruner and a diverse
TokenSelector keep.

A DPP with kernel L = diag(q) S diag(q) (S the tokens' cosine similarity, q each token's quality) scores a subset
K by det(L_K) = prod_{i in K} q_i^2 det(S_K): high when its tokens are good and unlike each other. The greedy
algorithm of Chen, Zhang and Zhou (NeurIPS 2018) finds a near-MAP subset one token at a time, each the token of
largest marginal gain, the gains kept current with one row of an incremental Cholesky factor per step (O(k N)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from litevlm.errors import LiteVLMError


def budget(k: int, n: int) -> int:
    """k, checked and capped at the n tokens there are to choose from."""
    if n < 1:
        raise LiteVLMError("there are no visual tokens to select from")
    if k < 1:
        raise LiteVLMError(f"a selection keeps at least one token; asked for {k}")
    return min(int(k), n)


def cosine_similarity_matrix(features: torch.Tensor) -> torch.Tensor:
    """(N, C) -> (N, N) pairwise cosine similarity, fp32."""
    f = F.normalize(features.float(), dim=-1)
    return f @ f.T


def quality_kernel(features: torch.Tensor, quality: torch.Tensor) -> torch.Tensor:
    """The DPP kernel L = diag(q) S diag(q) (N, N) of tokens (N, C) with quality q (N,), S their cosine similarity."""
    q = quality.float()
    return q[:, None] * cosine_similarity_matrix(features) * q[None, :]


def dpp_greedy_map(kernel: torch.Tensor, k: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy MAP inference of a DPP with PSD kernel (N, N): k indices in the order chosen, each the token of largest
    marginal gain d_j^2 = det(L_{S+j}) / det(L_S), the gains updated with one new row of the incremental Cholesky
    factor per step. `first` (distinct indices) are taken before any gain is read, in their order: a subset the
    caller must keep, which the rest is then chosen to complement. Past the kernel's rank no token adds volume
    (every gain is ~0, within fp32 noise of the largest diagonal); the rest of the budget then goes by the diagonal
    (the quality), so exactly k distinct tokens are chosen."""
    n = kernel.shape[0]
    k = budget(k, n)
    forced = [] if first is None else [int(i) for i in first.tolist()]
    if len(forced) > k or len(set(forced)) != len(forced):
        raise LiteVLMError(f"the tokens a DPP must take first are {len(forced)}, not distinct or over its budget {k}")
    kernel = kernel.float()
    diag = kernel.diagonal().clone()  # (N,)
    eps = 1e-6 * diag.max().clamp_min(1e-30)  # a gain below this is rounding, not volume
    factor = kernel.new_zeros(k, n)  # row i: the i-th chosen token's Cholesky row against every token
    gain = diag.clone()  # (N,) d_j^2
    chosen = torch.empty(k, dtype=torch.long, device=kernel.device)
    taken = torch.zeros(n, dtype=torch.bool, device=kernel.device)
    for i in range(k):
        if i < len(forced):
            j = torch.tensor(forced[i], device=kernel.device)
        else:
            pick = torch.where(gain > eps, gain, diag * 1e-30).masked_fill(taken, float("-inf"))  # gains, then diag
            j = pick.argmax()
        chosen[i] = j
        g = gain[j]
        scale = torch.where(g > eps, g.clamp_min(eps).rsqrt(), torch.zeros_like(g))  # no update once rank is spent
        e = (kernel[j] - factor[:i, j] @ factor[:i]) * scale  # (N,) the new Cholesky row
        factor[i] = e
        taken[j] = True
        gain = gain - e * e
    return chosen


def score_quality(scores: torch.Tensor, diversity: float) -> torch.Tensor:
    """Quality q (N,) for a DPP over tokens ranked by log-scale scores (N,): q_i = exp((s_i - max s) / (2 tau)), so
    log det(L_K) = sum_{i in K} s_i / tau + log det(S_K) + const: the subset's total score traded against its
    diversity at weight tau. Exponents are floored at -30 (fp32 keeps q^2); such tokens add no volume and come
    last, in score order."""
    if not diversity > 0.0:
        raise LiteVLMError(f"the diversity weight tau must be > 0; got {diversity!r}")
    s = scores.float()
    return torch.exp(((s - s.max()) / (2.0 * diversity)).clamp_min(-30.0))
