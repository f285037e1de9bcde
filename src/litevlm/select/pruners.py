"""Training-free visual-token pruners beside FastV and the TokenSelector: DART, DivPrune and CDPruner.

Each keeps exactly keep_count(N, r) of the N visual tokens (r = fraction KEPT), every text token, and the kept
tokens' original position ids, so every method is compared at equal token counts. Each selection rule is a pure
function on tensors (`dart_select`, `divprune_select`, `cdpruner_select`); the adapters below feed it the features
its paper names and hand the pipeline what it already takes: a `Pruning` hook for a method that prunes inside the
decoder (FastV's path), or the pruned prompt for one that prunes the projector's output before the decoder (as
`random_select` and `uniform_select`). `per_view` splits the budget over the cameras instead (`view_budgets`:
about r of each camera's tokens): with six cameras in one prompt, one global ranking can spend the budget on a
camera or two. `PruneConfig` names a method and its budget (`--prune METHOD --keep R`); `apply_pruner` is what the
pipeline's select_tokens stage calls, so each method's own work is timed there, never in the prefill.

DART (Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters More",
arXiv 2502.11494) prunes inside the decoder before layer K = 2: layers 0 and 1 run on the whole prompt. Its
pivots are the 4 visual tokens and the 4 text tokens after the image (here: after the last view) with the largest
L1 norm of their keys at layer K - 1 (that layer's cache: RoPE applied, the KV heads side by side). Each pivot in
turn then claims its share of the budget: the visual tokens still unclaimed that are LEAST cosine-similar to it,
the similarity taken over the layer-K input after the decoder's final RMSNorm, as the reference implementation
does. The visual pivots are kept; the text pivots only steer. The reference gives each pivot floor(budget / 8)
tokens on top of the 4 pivots, a few more or fewer than asked; here the k - 4 left after the visual pivots are
split as evenly as possible over the 8 pivots (in prompt order), so exactly k are kept.

DivPrune (Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models", CVPR 2025,
arXiv 2503.02175) prunes the projector's output, the visual tokens as the decoder receives them, before the
decoder, ignoring the question. It casts selection as the Max-Min Diversity Problem over cosine distance
(1 - cosine similarity) and solves it greedily: first the token whose nearest other token is farthest, then, k - 1
times, the token whose smallest distance to those already chosen is largest. A running minimum makes this
O(k N) after the N x N distances; the reference recomputes that minimum from the chosen rows at every step.

CDPruner (Zhang et al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token Pruning in
MLLMs", NeurIPS 2025, arXiv 2506.10967) also prunes before the decoder. It keeps the maximum a posteriori subset
of a conditional determinantal point process whose kernel is L = diag(q) S diag(q): S the cosine similarity of
the projected visual tokens, q each token's relevance to the instruction (its mean cosine similarity to the
instruction's token embeddings, min-max normalised over the tokens), so a subset scores high when its tokens are
both relevant and unlike each other. For LLaVA the reference scores relevance with CLIP's own image and text
towers; for a model without an aligned text tower (Qwen2.5-VL in the paper; InternVL here) the projected visual
tokens serve both terms and the question's tokens are embedded by the decoder's own embedding table. The MAP subset is
found by the greedy algorithm of Chen, Zhang and Zhou (NeurIPS 2018): each step takes the token of largest
marginal gain d_j^2 and updates every gain with one new row of an incremental Cholesky factor, O(k N) a step.
Optional theta re-weights relevance as exp(theta / (2 (1 - theta)) q), a knob the reference code leaves off, as
it is here by default.

VisionZip (Yang et al., arXiv 2412.04467) is not offered, because InternVL's tokens do not fit it. It keeps the
patches the vision encoder's CLS token attends to most, at the layer whose features feed the projector, and
merges the rest into a few tokens by key similarity, all inside the encoder. InternVL drops the CLS token before
the pixel shuffle: the projector and the decoder never read it, so nothing in the VLM's training ties its
attention row to what the decoder needs. And one InternVL token is not a patch but four (a 2 x 2 block
concatenated channel-wise): keeping single patches breaks the shuffle (the conflict VisionZip's Qwen2-VL port
reports for its 2 x 2 merger), while pooling four CLS weights per block and averaging shuffled features for the
contextual tokens would be a new method under VisionZip's name with no published result to check it against.
It would also run in the vit stage, on attention rows the fused CPU encoder never forms, not on the tokens this
stage receives. DivPrune and CDPruner cover pruning before the decoder from the projector's output alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from litevlm.errors import LiteVLMError
from litevlm.select.dpp import budget, cosine_similarity_matrix, dpp_greedy_map, quality_kernel
from litevlm.select.tokens import (
    Pruning,
    Span,
    keep_count,
    kept_prompt_index,
    prune_prompt,
    select_by_scores,
    uniform_select,
    view_budgets,
    view_sizes,
    visual_index,
)

METHODS = ("token-selector", "fastv", "dart", "divprune", "cdpruner", "random", "uniform")
DECODER_LAYER = {"fastv": 2, "dart": 2}  # the layer K that each in-decoder method's paper prunes before
PER_VIEW = ("dart", "divprune", "cdpruner", "random", "uniform")  # uniform is per view by construction


@dataclass(frozen=True)
class PruneConfig:
    """A token-pruning method and its budget: `--prune METHOD --keep R` on the command line.

    method: one of METHODS; keep_ratio: r, the fraction of visual tokens KEPT, in (0, 1]. layer: for the in-decoder
    methods (fastv, dart), the decoder layer K they prune before (default: their paper's, `DECODER_LAYER`); for the
    token-selector, the layer its choice is applied before (default: where it reads, before the decoder).
    per_view: keep about r of each camera's tokens (`view_budgets`) instead of r of all of them.
    theta: CDPruner's relevance weight in [0, 1) (None: plain relevance).
    """

    method: str
    keep_ratio: float
    layer: int | None = None
    per_view: bool = False
    theta: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LiteVLMError(f"unknown token pruning method {self.method!r}: choose one of {', '.join(METHODS)}")
        r = self.keep_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r <= 1.0:
            raise LiteVLMError(f"--keep R is the fraction of visual tokens KEPT and must be in (0, 1]; got {r!r}")
        if self.layer is not None:
            if self.method not in (*DECODER_LAYER, "token-selector"):
                raise LiteVLMError(
                    f"{self.method} prunes before the decoder: a pruning layer applies to "
                    f"{', '.join(DECODER_LAYER)} and token-selector only"
                )
            if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 1:
                raise LiteVLMError(f"the pruning layer K must be an integer >= 1; got {self.layer!r}")
        if self.per_view and self.method not in PER_VIEW:
            raise LiteVLMError(
                f"per-camera budgets apply to {', '.join(PER_VIEW)}; {self.method} has its own per-view quota"
            )
        if self.theta is not None and (self.method != "cdpruner" or not 0.0 <= self.theta < 1.0):
            raise LiteVLMError(f"theta is CDPruner's relevance weight in [0, 1); got {self.theta!r} for {self.method}")

    @classmethod
    def from_options(
        cls, method: str | None, keep: float | None, layer: int | None = None, per_view: bool = False
    ) -> PruneConfig | None:
        """The config that `--prune`, `--keep`, `--prune-layer` and `--per-view` describe; None when none is given."""
        if method is None and keep is None:
            if layer is not None or per_view:
                raise LiteVLMError("--prune-layer and --per-view go with --prune METHOD --keep R")
            return None
        if method is None:
            raise LiteVLMError(f"--keep R needs --prune METHOD (one of {', '.join(METHODS)})")
        if keep is None:
            raise LiteVLMError(f"--prune {method} needs --keep R, the fraction of visual tokens kept, in (0, 1]")
        return cls(method, keep, layer, per_view)

    @property
    def decoder_layer(self) -> int | None:
        """The layer K an in-decoder method prunes before; None for a method that prunes before the decoder."""
        return self.layer if self.layer is not None else DECODER_LAYER.get(self.method)

    @property
    def name(self) -> str:
        k = f" K={self.decoder_layer}" if self.decoder_layer is not None else ""
        return f"{self.method}{k} r={self.keep_ratio}" + (" per view" if self.per_view else "")


# ---------------------------------------------------------------------------------------------
# The selection rules: pure functions of features -> kept indices (ascending)
# ---------------------------------------------------------------------------------------------


def divprune_select(features: torch.Tensor, k: int) -> torch.Tensor:
    """DivPrune: k of the N tokens (N, C), greedy max-min diverse under cosine distance -> indices (k,) ascending."""
    n = features.shape[0]
    k = budget(k, n)
    if k == n:
        return torch.arange(n, device=features.device)
    dist = 1.0 - cosine_similarity_matrix(features)  # (N, N)
    eye = torch.eye(n, dtype=torch.bool, device=dist.device)
    nearest = dist.masked_fill(eye, float("inf")).amin(1)  # each token's distance to its nearest other token
    chosen = torch.empty(k, dtype=torch.long, device=dist.device)
    j = nearest.argmax()
    chosen[0] = j
    gap = dist[j].masked_fill(eye[j], float("-inf"))  # (N,) distance to the chosen set; -inf: chosen
    for i in range(1, k):
        j = gap.argmax()
        chosen[i] = j
        gap = torch.minimum(gap, dist[j]).masked_fill(eye[j], float("-inf"))
    return chosen.sort().values


def dart_pivots(key_norms: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` tokens of largest key norm (N,), most salient first (fewer when there are fewer tokens)."""
    return key_norms.float().topk(min(n, key_norms.numel())).indices


def dart_select(
    features: torch.Tensor, k: int, pivots: torch.Tensor, text_pivots: torch.Tensor | None = None
) -> torch.Tensor:
    """DART: k of the N tokens (N, C): the visual pivots (p,) (indices, most salient first; the first k when k < p),
    then for each pivot in turn (visual ones in index order, then the text pivots' features (q, C)) its share of the
    remaining k - p, the unclaimed tokens least cosine-similar to it -> indices (k,) ascending."""
    n = features.shape[0]
    k = budget(k, n)
    if k == n:
        return torch.arange(n, device=features.device)
    piv = pivots[:k].sort().values
    f = F.normalize(features.float(), dim=-1)
    rows = f[piv]
    if text_pivots is not None and text_pivots.numel():
        rows = torch.cat([rows, F.normalize(text_pivots.float(), dim=-1)])
    sims = rows @ f.T  # (P, N) cosine similarity of each pivot to every visual token
    m, p = k - piv.numel(), rows.shape[0]
    shares = [m // p + (1 if i < m % p else 0) for i in range(p)]
    free = torch.ones(n, dtype=torch.bool, device=f.device)
    free[piv] = False
    kept = [piv]
    for row, share in zip(sims, shares):
        if share:
            take = row.masked_fill(~free, float("inf")).topk(share, largest=False).indices
            free[take] = False
            kept.append(take)
    return torch.cat(kept).sort().values


def instruction_relevance(features: torch.Tensor, instruction: torch.Tensor) -> torch.Tensor:
    """CDPruner's relevance (N,): each token's (N, C) mean cosine similarity to the instruction's token embeddings
    (M, C), min-max normalised over the tokens (least relevant 1e-6 / range, most 1 + that; 1 where all tie)."""
    if instruction.numel() == 0:
        return features.new_ones(features.shape[0], dtype=torch.float32)
    rel = (F.normalize(features.float(), dim=-1) @ F.normalize(instruction.float(), dim=-1).T).mean(1)  # (N,)
    lo, hi = rel.min(), rel.max()
    return (rel - lo + 1e-6) / (hi - lo).clamp_min(1e-6)


def cdpruner_select(
    features: torch.Tensor, relevance: torch.Tensor, k: int, theta: float | None = None
) -> torch.Tensor:
    """CDPruner: k of the N tokens (N, C) with relevance (N,): the greedy MAP subset of the DPP with kernel
    diag(q) S diag(q), S the cosine similarity (q = relevance, or exp(theta / (2 (1 - theta)) relevance))
    -> indices (k,) ascending."""
    n = features.shape[0]
    k = budget(k, n)
    if k == n:
        return torch.arange(n, device=features.device)
    q = relevance.float()
    if theta is not None:
        q = torch.exp(theta / (2.0 * (1.0 - theta)) * q)
    return dpp_greedy_map(quality_kernel(features, q), k).sort().values


def per_view_select(
    sizes: Sequence[int], keep_ratio: float, select: Callable[[int, int, int], torch.Tensor]
) -> torch.Tensor:
    """Indices (ascending, into the visual tokens) from `select(start, size, k)` run on each view with its share k of
    the budget (`view_budgets`); select returns indices within its view."""
    out, start = [], 0
    for size, k in zip(sizes, view_budgets(sizes, keep_ratio)):
        if k:
            out.append(select(start, size, k) + start)
        start += size
    return torch.cat(out)


def _select(
    sizes: Sequence[int], keep_ratio: float, per_view: bool, select: Callable[[int, int, int], torch.Tensor]
) -> torch.Tensor:
    """`select(start, size, k)` on all the visual tokens at once (budget keep_count(N, r)) or view by view."""
    if per_view:
        return per_view_select(sizes, keep_ratio, select)
    n = int(sum(sizes))
    return select(0, n, keep_count(n, keep_ratio))


# ---------------------------------------------------------------------------------------------
# Adapters: the features each paper names, in the pipeline's two shapes of pruning
# ---------------------------------------------------------------------------------------------


def divprune_prune(embeds, positions, view_spans: Sequence[Span], keep_ratio: float, per_view: bool = False):
    """DivPrune on a prompt (1, T, C) before the decoder, over its visual tokens as embedded (the projector's
    output): (embeds_kept, positions_kept, kept_index), like `random_select`."""
    vis = embeds[0, visual_index(view_spans, embeds.device)]  # (N, C)
    kept = _select(view_sizes(view_spans), keep_ratio, per_view, lambda s, n, k: divprune_select(vis[s : s + n], k))
    return prune_prompt(embeds, positions, view_spans, kept)


def cdpruner_prune(
    embeds,
    positions,
    view_spans: Sequence[Span],
    keep_ratio: float,
    instruction: torch.Tensor,
    per_view: bool = False,
    theta: float | None = None,
):
    """CDPruner on a prompt (1, T, C) before the decoder: relevance of its visual tokens (the projector's output) to
    the instruction's token embeddings (M, C), normalised over all of them, then the DPP's MAP subset (per view:
    on each view's block of the kernel)."""
    vis = embeds[0, visual_index(view_spans, embeds.device)]  # (N, C)
    rel = instruction_relevance(vis, instruction.to(vis.device))
    kept = _select(
        view_sizes(view_spans),
        keep_ratio,
        per_view,
        lambda s, n, k: cdpruner_select(vis[s : s + n], rel[s : s + n], k, theta),
    )
    return prune_prompt(embeds, positions, view_spans, kept)


def random_prune(
    embeds, positions, view_spans: Sequence[Span], keep_ratio: float, generator=None, per_view: bool = False
):
    """Baseline: a uniformly random subset of the visual tokens (per view: of each view's, at its share)."""
    sizes = view_sizes(view_spans)
    scores = torch.rand(int(sum(sizes)), generator=generator)
    if per_view:
        kept = per_view_select(sizes, keep_ratio, lambda s, n, k: scores[s : s + n].topk(k).indices.sort().values)
    else:
        kept = select_by_scores(scores, sizes, keep_ratio)
    return prune_prompt(embeds, positions, view_spans, kept)


def cached_keys(layer, t: int) -> torch.Tensor:
    """The keys (T, Hkv * D) that decoder `layer` wrote at cache slots 0..T-1 (RoPE applied, KV heads side by
    side): inside `pruned_prefill`'s hook, the whole prompt's, since the cache is compacted after it."""
    cache = layer.self_attn.kv_cache
    if cache is None or cache.max_len < t:
        raise LiteVLMError("DART reads the prompt's keys from the KV cache: set up a cache that holds the prompt")
    return cache.k[0, :, :t].transpose(0, 1).reshape(t, -1)  # (Hkv, T, D) -> (T, Hkv * D)


def dart_pruning(
    model,
    view_spans: Sequence[Span],
    keep_ratio: float,
    layer: int = DECODER_LAYER["dart"],
    per_view: bool = False,
    image_pivots: int = 4,
    text_pivots: int = 4,
) -> Pruning:
    """DART's choice before decoder `layer` K (batch 1): pivots by the L1 norm of layer K-1's keys, duplicates
    measured on the final-normed layer-K input (`dart_select`); timed as "select_tokens". Per view, each camera
    picks its own visual pivots and the text pivots are shared."""
    lm = model.language_model
    if not 1 <= layer < len(lm.layers):
        raise LiteVLMError(
            f"DART prunes before decoder layer {layer}, but this decoder has {len(lm.layers)} layers: "
            f"choose --prune-layer in 1..{len(lm.layers) - 1}"
        )
    sizes = view_sizes(view_spans)
    text_start = max(e for _, _, e in view_spans)  # the text after the last view

    def keep(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        vis = visual_index(view_spans, x.device)
        norms = cached_keys(lm.layers[layer - 1], t).float().abs().sum(-1)  # (T,) L1 key norms
        h = lm.norm(x[0])  # (T, C)
        text = h[text_start + dart_pivots(norms[text_start:], text_pivots)] if text_start < t else None
        hv, nv = h[vis], norms[vis]  # (N, C), (N,)

        def select(s: int, n: int, k: int) -> torch.Tensor:
            return dart_select(hv[s : s + n], k, dart_pivots(nv[s : s + n], image_pivots), text)

        return kept_prompt_index(t, view_spans, _select(sizes, keep_ratio, per_view, select))

    return Pruning(layer, keep, "select_tokens")


def apply_pruner(
    cfg: PruneConfig,
    model,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    view_spans: Sequence[Span],
    instruction_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Pruning | None]:
    """Prune a prompt (1, T, C) by `cfg` (dart, divprune, cdpruner, random, uniform): (embeds, positions, hook).

    A method before the decoder returns the pruned prompt and no hook; DART the prompt as it is and the `Pruning`
    hook that prefill calls. r = 1 returns the prompt as it is and no hook (plain prefill, bit for bit).
    instruction_ids (M,): the question's token ids, embedded by the decoder's table for CDPruner's relevance.
    """
    if cfg.method in ("token-selector", "fastv"):
        raise LiteVLMError(f"{cfg.method} is the pipeline's own stage: pass it as token_selector / fastv")
    if embeds.shape[0] != 1:
        raise LiteVLMError("token pruning runs one prompt at a time (batch 1)")
    r = cfg.keep_ratio
    if r >= 1.0:
        return embeds, positions, None
    if cfg.method == "dart":
        return embeds, positions, dart_pruning(model, view_spans, r, cfg.decoder_layer, cfg.per_view)
    if cfg.method == "divprune":
        out = divprune_prune(embeds, positions, view_spans, r, cfg.per_view)
    elif cfg.method == "cdpruner":
        if instruction_ids is None:
            raise LiteVLMError("CDPruner scores tokens against the question: pass its token ids")
        instruction = model.language_model.embed_tokens(instruction_ids.to(embeds.device).view(-1))  # (M, C)
        out = cdpruner_prune(embeds, positions, view_spans, r, instruction, cfg.per_view, cfg.theta)
    elif cfg.method == "random":
        out = random_prune(embeds, positions, view_spans, r, generator, cfg.per_view)
    else:
        out = uniform_select(embeds, positions, view_spans, r)
    return out[0], out[1], None
