"""Training-free visual-token pruners beside FastV and the TokenSelector: DART, DivPrune and CDPruner.

Each keeps exactly keep_count(N, r) of the N visual tokens (r = fraction KEPT), every text token, and the kept
tokens' original position ids, so every method is compared at equal token counts. Each selection rule is a pure
function on tensors (`dart_select`, `divprune_select`, `cdpruner_select`); the adapters below feed it the features
its paper names and hand the pipeline what it already takes: a `Pruning` hook for a method that prunes inside the
decoder (FastV's path), or the pruned prompt for one that prunes the projector's output before the decoder (as
`random_select` and `uniform_select`). The budget is spent over one of three `SPLITS`: "all", one ranking of
every visual token (with six cameras in one prompt it can spend the budget on a camera or two); "view", about r of
each camera's tokens (`view_budgets`); "crop", about r of each tile's. Each method's default is the split its
authors use on a multi-crop input (`DEFAULT_SPLIT`): CDPruner's reference code runs its DPP on every crop of a
LLaVA-NeXT image separately, the same number of tokens from each, with the relevance normalised over all of them,
so CDPruner splits per crop (a tile here); DivPrune's ranks the whole image's tokens at once after the crops are
merged, and DART and FastV rank the whole sequence inside the decoder, so they take "all". `PruneConfig` names a
method and its budget (`--prune METHOD --keep R`, `--prune-split`); `apply_pruner` is what the pipeline's
select_tokens stage calls, so each method's own work is timed there, never in the prefill.

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
SPLITS = ("all", "view", "crop")  # the blocks a budget is spread over: none, each camera, each tile
DEFAULT_SPLIT = {"cdpruner": "crop", "uniform": "view"}  # the authors' own split on multi-crop input; else "all"


@dataclass(frozen=True)
class PruneConfig:
    """A token-pruning method and its budget: `--prune METHOD --keep R` on the command line.

    method: one of METHODS; keep_ratio: r, the fraction of visual tokens KEPT, in (0, 1]. layer: for the in-decoder
    methods (fastv, dart), the decoder layer K they prune before (default: their paper's, `DECODER_LAYER`); for the
    token-selector, the layer its choice is applied before (default: where it reads, before the decoder).
    split: the blocks the budget is spread over (`SPLITS`: "all", "view" about r of each camera's tokens, "crop"
    about r of each tile's); None: the method's own (`DEFAULT_SPLIT`, the one its authors use on multi-crop input).
    theta: CDPruner's relevance weight in [0, 1) (None: plain relevance).
    """

    method: str
    keep_ratio: float
    layer: int | None = None
    split: str | None = None
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
        if self.split is not None and self.split not in SPLITS:
            raise LiteVLMError(f"unknown budget split {self.split!r}: choose one of {', '.join(SPLITS)}")
        if self.split not in (None, self.default_split) and self.method not in PER_VIEW[:-1]:
            raise LiteVLMError(
                f"per-camera budgets (and per-tile ones) apply to {', '.join(PER_VIEW[:-1])}; "
                f"{self.method} has its own ({self.default_split})"
                if self.method != "token-selector"
                else "per-camera budgets apply to the training-free pruners; the TokenSelector has its own quota"
            )
        if self.theta is not None and (self.method != "cdpruner" or not 0.0 <= self.theta < 1.0):
            raise LiteVLMError(f"theta is CDPruner's relevance weight in [0, 1); got {self.theta!r} for {self.method}")

    @classmethod
    def from_options(
        cls,
        method: str | None,
        keep: float | None,
        layer: int | None = None,
        per_view: bool = False,
        split: str | None = None,
    ) -> PruneConfig | None:
        """The config that `--prune`, `--keep`, `--prune-layer`, `--per-view` (= `--prune-split view`) and
        `--prune-split` describe; None when none is given."""
        if method is None and keep is None:
            if layer is not None or per_view or split is not None:
                raise LiteVLMError("--prune-layer, --per-view and --prune-split go with --prune METHOD --keep R")
            return None
        if per_view:
            if split not in (None, "view"):
                raise LiteVLMError(f"--per-view is --prune-split view; it cannot go with --prune-split {split}")
            split = "view"
        if method is None:
            raise LiteVLMError(f"--keep R needs --prune METHOD (one of {', '.join(METHODS)})")
        if keep is None:
            raise LiteVLMError(f"--prune {method} needs --keep R, the fraction of visual tokens kept, in (0, 1]")
        return cls(method, keep, layer, split)

    @property
    def decoder_layer(self) -> int | None:
        """The layer K an in-decoder method prunes before; None for a method that prunes before the decoder."""
        return self.layer if self.layer is not None else DECODER_LAYER.get(self.method)

    @property
    def default_split(self) -> str:
        return DEFAULT_SPLIT.get(self.method, "all")

    @property
    def budget_split(self) -> str:
        """The split this config spends its budget over: its own, or the method's default."""
        return self.split or self.default_split

    @property
    def name(self) -> str:
        k = f" K={self.decoder_layer}" if self.decoder_layer is not None else ""
        split = {"all": "", "view": " per view", "crop": " per crop"}[self.budget_split]
        return f"{self.method}{k} r={self.keep_ratio}{split}"


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


def block_sizes(view_spans: Sequence[Span], split: str, tokens_per_tile: int) -> list[int] | None:
    """The consecutive blocks of the visual tokens a budget is spread over: None for "all"; each view's size for
    "view"; for "crop", each view cut into its tiles of `tokens_per_tile` (a view's tokens are tile after tile)."""
    if split not in SPLITS:
        raise LiteVLMError(f"unknown budget split {split!r}: choose one of {', '.join(SPLITS)}")
    if split == "all":
        return None
    sizes = view_sizes(view_spans)
    if split == "view":
        return list(sizes)
    if tokens_per_tile < 1:
        raise LiteVLMError(f"a per-tile budget needs the tokens a tile makes; got {tokens_per_tile}")
    out = []
    for size in sizes:
        out += [tokens_per_tile] * (size // tokens_per_tile) + (
            [size % tokens_per_tile] if size % tokens_per_tile else []
        )
    return out


def per_view_select(
    sizes: Sequence[int], keep_ratio: float, select: Callable[[int, int, int], torch.Tensor]
) -> torch.Tensor:
    """Indices (ascending, into the visual tokens) from `select(start, size, k)` run on each block (a view, or a tile)
    with its share k of the budget (`view_budgets`); select returns indices within its block."""
    out, start = [], 0
    for size, k in zip(sizes, view_budgets(sizes, keep_ratio)):
        if k:
            out.append(select(start, size, k) + start)
        start += size
    return torch.cat(out)


def _blocks(view_spans: Sequence[Span], per_view) -> list[int] | None:
    """An adapter's `per_view`: False / None (one block), True (each view), or the block sizes themselves."""
    if per_view is True:
        return list(view_sizes(view_spans))
    return list(per_view) if per_view else None


def _select(
    sizes: Sequence[int],
    keep_ratio: float,
    blocks: Sequence[int] | None,
    select: Callable[[int, int, int], torch.Tensor],
) -> torch.Tensor:
    """`select(start, size, k)` on all the visual tokens at once (budget keep_count(N, r)) or block by block."""
    n = int(sum(sizes))
    if blocks:
        if sum(blocks) != n:
            raise LiteVLMError(f"the budget's blocks cover {sum(blocks)} visual tokens, the prompt holds {n}")
        return per_view_select(blocks, keep_ratio, select)
    return select(0, n, keep_count(n, keep_ratio))


# ---------------------------------------------------------------------------------------------
# Adapters: the features each paper names, in the pipeline's two shapes of pruning
# ---------------------------------------------------------------------------------------------


def divprune_prune(embeds, positions, view_spans: Sequence[Span], keep_ratio: float, per_view=False):
    """DivPrune on a prompt (1, T, C) before the decoder, over its visual tokens as embedded (the projector's
    output): (embeds_kept, positions_kept, kept_index), like `random_select`. per_view, here and in the other
    adapters: False, one ranking of them all (DivPrune's own); True, each view's share; or the blocks' sizes
    (`block_sizes`)."""
    vis = embeds[0, visual_index(view_spans, embeds.device)]  # (N, C)
    kept = _select(
        view_sizes(view_spans),
        keep_ratio,
        _blocks(view_spans, per_view),
        lambda s, n, k: divprune_select(vis[s : s + n], k),
    )
    return prune_prompt(embeds, positions, view_spans, kept)


def cdpruner_prune(
    embeds,
    positions,
    view_spans: Sequence[Span],
    keep_ratio: float,
    instruction: torch.Tensor,
    per_view=False,
    theta: float | None = None,
):
    """CDPruner on a prompt (1, T, C) before the decoder: relevance of its visual tokens (the projector's output) to
    the instruction's token embeddings (M, C), normalised over all of them, then the DPP's MAP subset (per view or
    per tile: on each block of the kernel, as its authors prune each crop). `apply_pruner` passes the tiles."""
    vis = embeds[0, visual_index(view_spans, embeds.device)]  # (N, C)
    rel = instruction_relevance(vis, instruction.to(vis.device))
    kept = _select(
        view_sizes(view_spans),
        keep_ratio,
        _blocks(view_spans, per_view),
        lambda s, n, k: cdpruner_select(vis[s : s + n], rel[s : s + n], k, theta),
    )
    return prune_prompt(embeds, positions, view_spans, kept)


def random_prune(embeds, positions, view_spans: Sequence[Span], keep_ratio: float, generator=None, per_view=False):
    """Baseline: a uniformly random subset of the visual tokens (per view: of each view's, at its share)."""
    sizes = view_sizes(view_spans)
    scores = torch.rand(int(sum(sizes)), generator=generator)
    if per_view:
        blocks = _blocks(view_spans, per_view)
        kept = per_view_select(blocks, keep_ratio, lambda s, n, k: scores[s : s + n].topk(k).indices.sort().values)
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
    per_view=False,
    image_pivots: int = 4,
    text_pivots: int = 4,
) -> Pruning:
    """DART's choice before decoder `layer` K (batch 1): pivots by the L1 norm of layer K-1's keys, duplicates
    measured on the final-normed layer-K input (`dart_select`); timed as "select_tokens". Per view (or tile), each
    block picks its own visual pivots and the text pivots are shared; DART's own is one ranking of them all."""
    lm = model.language_model
    if not 1 <= layer < len(lm.layers):
        raise LiteVLMError(
            f"DART prunes before decoder layer {layer}, but this decoder has {len(lm.layers)} layers: "
            f"choose --prune-layer in 1..{len(lm.layers) - 1}"
        )
    sizes, blocks = view_sizes(view_spans), _blocks(view_spans, per_view)
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

        return kept_prompt_index(t, view_spans, _select(sizes, keep_ratio, blocks, select))

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
    blocks = block_sizes(view_spans, cfg.budget_split, model.cfg.tokens_per_tile)
    if cfg.method == "dart":
        return embeds, positions, dart_pruning(model, view_spans, r, cfg.decoder_layer, blocks)
    if cfg.method == "divprune":
        out = divprune_prune(embeds, positions, view_spans, r, blocks)
    elif cfg.method == "cdpruner":
        if instruction_ids is None:
            raise LiteVLMError("CDPruner scores tokens against the question: pass its token ids")
        instruction = model.language_model.embed_tokens(instruction_ids.to(embeds.device).view(-1))  # (M, C)
        out = cdpruner_prune(embeds, positions, view_spans, r, instruction, blocks, cfg.theta)
    elif cfg.method == "random":
        out = random_prune(embeds, positions, view_spans, r, generator, blocks)
    else:
        out = uniform_select(embeds, positions, view_spans, r)
    return out[0], out[1], None
