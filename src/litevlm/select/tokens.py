"""Visual-token selection: LiteVLM's Token Selection Module (`TokenSelector`) and its baselines.

After view selection the visual tokens are still most of the prompt. The paper (arXiv 2506.07416,
section 3, "Token Selection Module") copies the fine-tuned LLM's first decoder layer out as a
standalone module, fine-tunes it to score visual tokens, and feeds the LLM only the top fraction r
(r = fraction KEPT); the LLM graph is untouched and simply sees a shorter prompt. Kept tokens keep
their ORIGINAL RoPE position ids at contiguous cache slots 0..T'-1 (`litevlm.model.generate.prefill`
accepts such positions), and generation continues at position T (the unpruned prompt length).

That copy costs one decoder layer over the whole prompt on top of the prefill it shortens. Our
default (`SelectorConfig.shared_layer`) keeps the layer frozen, so it IS the served model's layer 0:
the head is trained on that layer's output, and a pipeline runs layer 0 once on the whole prompt,
ranks from its output, and runs layers 1.. on the kept tokens (`TokenSelector.pruning`, the hook
generation calls after layer 0: the same in-decoder path as FastV at K = 1 with a trained ranking).
The selection then costs the head alone.

FastV (arXiv 2403.06764) is the in-LLM baseline, as published: layers [0, K) run on the whole prompt, the last
prompt token's head-mean attention over the visual tokens at layer K - 1 (the layer before the cut, what its
reference code reads from that layer's returned probabilities) ranks them, and layers [K, L) run on the kept
tokens only, which keep their original positions. Its ranking is timed as "select_tokens", like every other
method's choice. Every attention-scored step here computes just the query rows it needs (q of a few tokens against
all keys, fp32 softmax, head mean); the decoder itself stays on fused SDPA and no T x T attention matrix is formed.
Selection here only chooses; the prefill that prunes lives in generation (`litevlm.model.generate.pruned_prefill`).

FastV cache handling (our choice): after the ranking, the cache of layers [0, K) is COMPACTED to
the kept tokens, so every layer holds the same T' entries at slots 0..T'-1 and decoding is the
ordinary `decode_step(model, token, position=T + i, slot=T' + i)`, exactly like a prompt pruned at
the input (EAGLE, CUDA graphs and the pipeline's decode stage need no special case). Generated
tokens therefore do not see pruned tokens in layers < K either, as in FastV implementations that
prune the KV cache; `tests/test_tokens.py` checks decoding against a no-cache masked forward of
exactly this scheme.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from litevlm.cameras import IMAGE_HEIGHT, IMAGE_WIDTH
from litevlm.config import TextConfig
from litevlm.errors import LiteVLMError
from litevlm.model import cpu_steps, native
from litevlm.model.layers import RMSNorm, apply_rope, rope_at, rope_cos_sin, rope_table, rotate_head_rows
from litevlm.model.lm import DecoderLayer
from litevlm.model.prompt import Tiling, closest_grid
from litevlm.select.dpp import dpp_greedy_map, quality_kernel, score_quality

SELECTOR_DIR = "token_selector"
SELECTOR_FORMAT = "litevlm-token-selector"
Span = tuple[str, int, int]  # (camera, first placeholder index, one past the last), as PromptLayout.view_spans
C_TAG = re.compile(r"<c\d+,(CAM_[A-Z_]+),(-?[\d.]+),(-?[\d.]+)>")  # DriveLM object tag <c1,CAM_BACK,x,y>


# ---------------------------------------------------------------------------------------------
# Budgets and bookkeeping
# ---------------------------------------------------------------------------------------------


def keep_count(n_visual: int, keep_ratio: float) -> int:
    """How many of `n_visual` tokens a keep ratio r keeps: round(r * n), at least 1."""
    if not 0.0 < keep_ratio <= 1.0:
        raise LiteVLMError(f"keep_ratio must be in (0, 1] (the fraction of visual tokens KEPT); got {keep_ratio}")
    return max(1, min(n_visual, math.floor(keep_ratio * n_visual + 0.5)))


def visual_index(view_spans: Sequence[Span], device=None) -> torch.Tensor:
    """Prompt indices of every visual token, view after view, (N,)."""
    if not view_spans:
        raise LiteVLMError("the prompt has no image views: there are no visual tokens to select")
    return torch.cat([torch.arange(s, e, device=device) for _, s, e in view_spans])


def view_sizes(view_spans: Sequence[Span]) -> list[int]:
    return [e - s for _, s, e in view_spans]


def select_by_scores(
    scores: torch.Tensor,
    sizes: Sequence[int],
    keep_ratio: float,
    min_per_view: int = 0,
    features: torch.Tensor | None = None,
    diversity: float = 0.0,
) -> torch.Tensor:
    """Indices (ascending, into the visual tokens) of the kept ones: a quota per view, then global top score.

    Exactly keep_count(N, r) tokens are kept, so methods compare at equal token counts; the quota
    per view is min(min_per_view, budget // views, view size) and never exceeds the budget.
    With `diversity` tau > 0 and the tokens' `features` (N, C), the tokens after the quota are not the top scores
    but the greedy MAP subset of a DPP whose quality comes from the scores (`litevlm.select.dpp.score_quality`):
    the kept set maximises its total score plus tau times the log-volume its tokens span.
    """
    n = int(sum(sizes))
    if scores.shape != (n,):
        raise LiteVLMError(f"expected {n} visual-token scores, got shape {tuple(scores.shape)}")
    k = keep_count(n, keep_ratio)
    scores = scores.float()
    chosen = torch.zeros(n, dtype=torch.bool, device=scores.device)
    quota = min(int(min_per_view), k // len(sizes))
    off = 0
    for size in sizes:
        q = min(quota, size)
        if q > 0:
            chosen[scores[off : off + size].topk(q).indices + off] = True
        off += size
    rest = k - int(chosen.sum())
    if rest > 0 and diversity > 0.0:
        if features is None or features.shape[0] != n:
            raise LiteVLMError(f"a diverse selection needs the {n} visual tokens' features")
        kernel = quality_kernel(features, score_quality(scores, diversity))
        chosen[dpp_greedy_map(kernel, k, chosen.nonzero().squeeze(1))] = True
    elif rest > 0:
        chosen[scores.masked_fill(chosen, float("-inf")).topk(rest).indices] = True
    return chosen.nonzero().squeeze(1)


def kept_prompt_index(t: int, view_spans: Sequence[Span], kept_visual: torch.Tensor) -> torch.Tensor:
    """Prompt indices (ascending) of every text token plus the kept visual tokens, (T',)."""
    vis = visual_index(view_spans, kept_visual.device)
    keep = torch.ones(t, dtype=torch.bool, device=kept_visual.device)
    keep[vis] = False
    keep[vis[kept_visual]] = True
    return keep.nonzero().squeeze(1)


def prune_prompt(embeds: torch.Tensor, positions: torch.Tensor, view_spans: Sequence[Span], kept_visual: torch.Tensor):
    """(embeds (B, T', C), positions (B, T') with their ORIGINAL values, kept prompt indices (T',))."""
    kept = kept_prompt_index(embeds.shape[1], view_spans, kept_visual.to(embeds.device))
    return embeds[:, kept], positions[:, kept], kept


def random_select(
    embeds, positions, view_spans, keep_ratio: float, min_per_view: int = 0, generator: torch.Generator | None = None
):
    """Baseline: a uniformly random subset of the visual tokens (with the same per-view quota rule)."""
    n = int(sum(view_sizes(view_spans)))
    scores = torch.rand(n, generator=generator)
    return prune_prompt(
        embeds, positions, view_spans, select_by_scores(scores, view_sizes(view_spans), keep_ratio, min_per_view)
    )


def view_budgets(sizes: Sequence[int], keep_ratio: float) -> list[int]:
    """Each view's share of keep_count(N, r) (largest remainder): about r of every view, exactly the global budget."""
    k = keep_count(sum(sizes), keep_ratio)
    exact = [k * s / sum(sizes) for s in sizes]
    share = [int(x) for x in exact]
    for i in sorted(range(len(sizes)), key=lambda i: exact[i] - share[i], reverse=True)[: k - sum(share)]:
        share[i] += 1
    return share


def uniform_select(embeds, positions, view_spans, keep_ratio: float):
    """Baseline: each view gets its proportional share (`view_budgets`), evenly strided in raster order."""
    sizes = view_sizes(view_spans)
    share = view_budgets(sizes, keep_ratio)
    kept, off = [], 0
    for size, m in zip(sizes, share):
        kept += [off + int((j + 0.5) * size / m) for j in range(m)]
        off += size
    return prune_prompt(embeds, positions, view_spans, torch.tensor(kept, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Token-grid geometry: which visual token sees which pixels
# ---------------------------------------------------------------------------------------------


class ViewGrid(NamedTuple):
    """How one view's visual tokens lie over its image: `cols` x `rows` tiles (row-major, each a grid x grid token
    raster, row-major, as pixel shuffle leaves it), then the whole image as one more grid x grid raster when it has
    a thumbnail. Fixed tiling is one row of tiles; InternVL's dynamic tiling any grid."""

    cols: int
    rows: int = 1
    thumbnail: bool = False

    @property
    def tiles(self) -> int:
        return self.cols * self.rows + int(self.thumbnail)


def as_grid(layout: int | ViewGrid) -> ViewGrid:
    """A view's `ViewGrid`; a bare int is that many tiles side by side, no thumbnail (drive-tiny's layout)."""
    return layout if isinstance(layout, ViewGrid) else ViewGrid(int(layout))


def view_grid(tiling: Tiling, n_tiles: int) -> ViewGrid:
    """The grid of a view that `tiling` cut into `n_tiles` tiles (thumbnail included), from the count alone.

    A dynamic grid is the one of exactly that many tiles whose aspect is closest to the DriveLM frame's (1600x900,
    the nuScenes cameras', in which c-tags give their points): what InternVL's dynamic tiling cuts such an image
    into. The pipeline and the recipe both read a view's geometry through here, so training and inference agree.
    """
    thumb = bool(tiling.thumbnail) and n_tiles > 1
    m = n_tiles - int(thumb)
    if not tiling.max_tiles:
        if m != tiling.tiles:
            raise LiteVLMError(f"a view of {n_tiles} tiles does not fit the tiling ({tiling.tiles} tiles per view)")
        return ViewGrid(tiling.tiles, 1, thumb)
    if not 1 <= m <= tiling.max_tiles:
        raise LiteVLMError(f"a view of {n_tiles} tiles does not fit dynamic tiling of at most {tiling.max_tiles}")
    cols, rows = closest_grid(IMAGE_WIDTH, IMAGE_HEIGHT, 1, m, min_tiles=m)
    return ViewGrid(cols, rows, thumb)


def view_grids(tiling: Tiling, view_spans: Sequence[Span], tokens_per_tile: int) -> list[ViewGrid]:
    """`view_grid` of every view of a prompt, from its token count."""
    out = []
    for cam, s, e in view_spans:
        n, rest = divmod(e - s, tokens_per_tile)
        if rest:
            raise LiteVLMError(f"{cam} has {e - s} visual tokens, not a whole number of {tokens_per_tile}-token tiles")
        out.append(view_grid(tiling, n))
    return out


def cell_index(column: int, row: int, grid: int, tile_cols: int | None = None) -> int:
    """Token index within a view of the cell at (column, row) of its tiled raster (tile_cols * grid columns; tiles
    row-major, each a row-major grid x grid raster). tile_cols may be left out for one row of tiles."""
    tile_row, r = divmod(row, grid)
    tile_col, c = divmod(column, grid)
    if tile_row and tile_cols is None:
        raise ValueError("cell_index: a cell below the first row of tiles needs tile_cols")
    tile = tile_row * (tile_cols or 0) + tile_col
    return tile * grid * grid + r * grid + c


def _rasters(g: ViewGrid, grid: int) -> list[tuple[int, int, int, int]]:
    """(first token, columns, rows, tile columns) of each raster a view's image is seen through: the tiles, then the
    thumbnail."""
    out = [(0, g.cols * grid, g.rows * grid, g.cols)]
    if g.thumbnail:
        out.append((g.cols * g.rows * grid * grid, grid, grid, 1))
    return out


def box_cells(box: Sequence[float], grid: int, layout: int | ViewGrid, min_cover: float = 0.02) -> list[int]:
    """Token indices (within one view) whose cell a (u0, v0, u1, v1) box in 1600x900 pixels covers.

    The view is seen through its tiles' raster (`ViewGrid`; an int: that many square tiles side by side) and,
    with a thumbnail, through the thumbnail's grid x grid raster too; a cell counts when the box covers
    >= min_cover of it.
    """
    u0, v0, u1, v1 = (float(c) for c in box)
    u0, v0, u1, v1 = max(u0, 0.0), max(v0, 0.0), min(u1, IMAGE_WIDTH), min(v1, IMAGE_HEIGHT)
    if u1 <= u0 or v1 <= v0:
        return []
    out = []
    for first, cols, rows, tile_cols in _rasters(as_grid(layout), grid):
        cw, ch = IMAGE_WIDTH / cols, IMAGE_HEIGHT / rows
        for gc in range(cols):
            ox = min(u1, (gc + 1) * cw) - max(u0, gc * cw)
            if ox <= 0:
                continue
            for r in range(rows):
                oy = min(v1, (r + 1) * ch) - max(v0, r * ch)
                if oy > 0 and ox * oy >= min_cover * cw * ch:
                    out.append(first + cell_index(gc, r, grid, tile_cols))
    return sorted(out)


def _point_cell(xs: str, ys: str, cols: int, rows: int) -> tuple[int, int]:
    """(column, row) of the cell of a cols x rows raster over the 1600x900 frame that holds the point (x, y)."""
    return (
        min(cols - 1, max(0, int(float(xs) * cols / IMAGE_WIDTH))),
        min(rows - 1, max(0, int(float(ys) * rows / IMAGE_HEIGHT))),
    )


def tag_points(question: str | None, grid: int, layout: int | ViewGrid) -> list[tuple[str, int, int]]:
    """(camera, column, row) of the cell of the view's tiled raster that each DriveLM c-tag <cK,CAM,x,y> points at
    (x, y in 1600x900 pixels; cols * grid columns, rows * grid rows)."""
    g = as_grid(layout)
    cols, rows = grid * g.cols, grid * g.rows
    return [(cam, *_point_cell(xs, ys, cols, rows)) for cam, xs, ys in C_TAG.findall(question or "")]


def tag_cells(question: str | None, grid: int, layout: int | ViewGrid) -> list[tuple[str, list[int]]]:
    """(camera, token indices within its view) of each c-tag's point: its cell of the tiled raster and, with a
    thumbnail, its cell of the thumbnail."""
    g = as_grid(layout)
    out = []
    for cam, xs, ys in C_TAG.findall(question or ""):
        cells = []
        for first, cols, rows, tile_cols in _rasters(g, grid):
            cells.append(first + cell_index(*_point_cell(xs, ys, cols, rows), grid, tile_cols))
        out.append((cam, cells))
    return out


def tag_features(
    question: str, view_spans: Sequence[Span], grid: int, layout: int | ViewGrid | Sequence[ViewGrid]
) -> torch.Tensor:
    """(2, N) features of the visual tokens from the question's c-tags <cK,CAM,x,y> (x, y in 1600x900 pixels).

    Row 0 marks the token whose cell holds a tagged point, row 1 its 8 neighbours (a point is an object's centre,
    objects span cells), in the tiles' raster and in the thumbnail's. `layout`: one `ViewGrid` per view (prompt
    order), or one layout for all. Tags of cameras that are not in the prompt are ignored.
    """
    n = int(sum(view_sizes(view_spans)))
    grids = list(layout) if isinstance(layout, (list, tuple)) and not isinstance(layout, ViewGrid) else None
    grids = grids or [as_grid(layout)] * len(view_spans)
    if len(grids) != len(view_spans):
        raise LiteVLMError(f"{len(view_spans)} views but {len(grids)} view grids")
    feats = torch.zeros(2, n)
    where, off = {}, 0
    for (cam, s, e), g in zip(view_spans, grids):
        where[cam] = (off, g)
        off += e - s
    for cam, xs, ys in C_TAG.findall(question or ""):
        if cam not in where:
            continue
        start, g = where[cam]
        for first, cols, rows, tile_cols in _rasters(g, grid):
            gc, gr = _point_cell(xs, ys, cols, rows)
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    r, c = gr + dr, gc + dc
                    if 0 <= r < rows and 0 <= c < cols:
                        feats[0 if dr == dc == 0 else 1, start + first + cell_index(c, r, grid, tile_cols)] = 1.0
    feats[1] *= 1 - feats[0]  # a tagged cell is not also a neighbour
    return feats


# ---------------------------------------------------------------------------------------------
# Attention rows without the attention matrix
# ---------------------------------------------------------------------------------------------


def row_logits(
    q_proj: nn.Linear, k_proj: nn.Linear, xn: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cfg: TextConfig
) -> torch.Tensor:
    """Attention logits (B, H, n, T), fp32, of the query tokens `rows` (n,) against every key, causal by index.

    xn is the normed layer input (B, T, C). q and k get RoPE at their own positions; the GQA
    groups are folded into the query axis, so keys are never repeated and no T x T matrix exists.
    """
    b, t, _ = xn.shape
    d, h, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = rows.numel()
    cos, sin = rope_cos_sin(positions, d, cfg.rope_theta, xn.dtype)  # (B, 1, T, D)
    q = q_proj(xn[:, rows]).view(b, n, h, d).transpose(1, 2)  # (B, H, n, D)
    q = apply_rope(q, cos[:, :, rows], sin[:, :, rows])
    k = k_proj(xn).view(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)
    k = apply_rope(k, cos, sin)
    q = q.float().reshape(b, hkv, (h // hkv) * n, d)  # (B, Hkv, G*n, D): head = kv * G + g, as enable_gqa
    logits = (q @ k.float().transpose(-1, -2)) * d**-0.5  # (B, Hkv, G*n, T)
    logits = logits.view(b, h, n, t)  # (B, H, n, T)
    future = torch.arange(t, device=xn.device)[None, :] > rows[:, None]  # (n, T)
    return logits.masked_fill(future, float("-inf"))


def attention_rows(layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Softmax attention of `layer` from the query tokens `rows` over all keys, averaged over heads: (B, n, T).

    x is the layer's input (B, T, C), before its input norm. Equal to the matching rows of the
    layer's full causal attention matrix (a test), at O(n * T) memory.
    """
    attn = layer.self_attn
    logits = row_logits(attn.q_proj, attn.k_proj, layer.input_layernorm(x), positions, rows, attn.cfg)
    return logits.softmax(-1).mean(1)


# ---------------------------------------------------------------------------------------------
# FastV (in-LLM pruning at layer K), the baseline
# ---------------------------------------------------------------------------------------------


def _head_ops(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    first_row: int,
    vis: torch.Tensor,
    tags: torch.Tensor,
    w: list[torch.Tensor],
    hq: int,
    hkv: int,
    d: int,
    eps: float,
) -> torch.Tensor:
    """The TokenSelector's head on one prompt x (T, C) -> log-scores (N,) of the visual tokens `vis`.

    The question rows are the contiguous tail from `first_row`. One matmul gives their [q | rot(q) | gate]
    (RoPE as a*cos + rot(a)*sin, the rotation folded into the packed weights, `TokenSelector._packed`), one gives
    every token's k, rotated after (the keys are most of the rows: half the multiply-adds); the MLP's first layer
    is split into its per-token and context halves, so the (N, 2C) feature matrix is never built. w = [norm, W_q,
    b_q, W_k, b_k, last bonus, head logits, W1 token half (C, hidden), b1, W1 context half (hidden, C), w2 (hidden,),
    b2, tag weights]; tags (2, N) or empty. cos / sin (T, 1, D).
    """
    t, c = x.shape
    n, g = t - first_row, hq // hkv
    h = torch.rms_norm(x, [c], w[0], eps)  # (T, C)
    qg = torch.addmm(w[2], h[first_row:], w[1])  # (n, 2 Hq D + 1)
    q = torch.addcmul(
        qg[:, : hq * d].view(n, hq, d) * cos[first_row:], qg[:, hq * d : 2 * hq * d].view(n, hq, d), sin[first_row:]
    )
    k = torch.addmm(w[4], h, w[3]).view(t, hkv, d)  # (T, Hkv, D)
    k = torch.addcmul(k * cos, torch.cat([-k[..., d // 2 :], k[..., : d // 2]], -1), sin)  # RoPE, rotated here
    q = q.view(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)  # (Hkv, n G, D): row = i G + g
    logits = torch.bmm(q, k.permute(1, 2, 0)) * (1.0 / math.sqrt(d))  # (Hkv, n G, T)
    future = torch.arange(t, device=x.device)[None, :] > torch.arange(first_row, t, device=x.device)[:, None]  # (n, T)
    logits = logits.view(hkv, n, g, t).masked_fill(future[None, :, None], float("-inf"))
    attn = logits.softmax(-1).index_select(3, vis)  # (Hkv, n, G, N); head = kv * G + g
    gate = qg[:, -1]  # (n,)
    gate = torch.cat([gate[:-1], gate[-1:] + w[5]])
    beta = gate.softmax(-1)  # (n,)
    coef = w[6].softmax(-1).view(hkv, 1, g) * beta[None, :, None]  # (Hkv, n, G): head weight x row pooling
    mix = coef.reshape(-1) @ attn.reshape(-1, vis.numel())  # (N,)
    ctx = beta @ h[first_row:]  # (C,)
    pre = torch.addmm(torch.addmv(w[8], w[9], ctx), h.index_select(0, vis), w[7])  # (N, hidden)
    s = torch.log(mix + 1e-9) + (torch.nn.functional.gelu(pre) @ w[10] + w[11])
    if tags.numel() > 0:
        s = s + (w[12][:, None] * tags).sum(0)
    return s


class Pruning(NamedTuple):
    """Selection inside the decoder, the hook generation calls where it prunes
    (`litevlm.model.generate.pruned_prefill`): decoder layers [0, layer) run on the whole prompt, and `keep(x)`
    chooses the prompt indices (T',) that layers [layer, L) run on, timed as `stage`. x (1, T, C) is the input of
    decoder layer `reads` (None: of `layer`, the output of the layers before the cut; 0: the prompt's embeddings)."""

    layer: int
    keep: Callable[[torch.Tensor], torch.Tensor]
    stage: str = "select_tokens"
    reads: int | None = None


@torch.no_grad()
def fastv_scores(model, x: torch.Tensor, positions: torch.Tensor, view_spans: Sequence[Span], k: int) -> torch.Tensor:
    """FastV's ranking for a cut before layer k (N,): the last prompt token's head-mean attention over the visual
    tokens at layer k - 1, given x (1, T, C), that layer's input (the prompt's embeddings for k = 1)."""
    t = x.shape[1]
    row = attention_rows(model.language_model.layers[k - 1], x, positions, torch.tensor([t - 1], device=x.device))
    return row[0, 0, visual_index(view_spans, x.device)]


def fastv_pruning(
    model, positions: torch.Tensor, view_spans: Sequence[Span], k: int, keep_ratio: float, min_per_view: int = 0
) -> Pruning:
    """FastV's choice before layer k: the visual tokens the last prompt token attends to most at layer k - 1, a
    fraction r of them (min_per_view=0: FastV's own global top-k), and every text token; timed as "select_tokens"."""

    def keep(x: torch.Tensor) -> torch.Tensor:
        scores = fastv_scores(model, x, positions, view_spans, k)
        kept_visual = select_by_scores(scores, view_sizes(view_spans), keep_ratio, min_per_view)
        return kept_prompt_index(x.shape[1], view_spans, kept_visual)

    return Pruning(k, keep, "select_tokens", reads=k - 1)


# ---------------------------------------------------------------------------------------------
# TokenSelector (the paper's Token Selection Module)
# ---------------------------------------------------------------------------------------------


READS = ("layer0", "prompt", "embeds")  # what a TokenSelector's head reads (SelectorConfig.reads)


def question_start(view_spans: Sequence[Span], t: int) -> int:
    """The first prompt index after the last view, where the question's rows (the selector's queries) begin."""
    first = max(e for _, _, e in view_spans)
    if first >= t:
        raise LiteVLMError("the prompt ends inside an image block: a question must follow the views")
    return first


def layer_rows(layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Decoder `layer`'s output (B, n, C) at the query tokens `rows` (n,) of x (B, T, C), each attending causally
    over the whole of x: equal to the matching rows of `layer(x)` (a test), without running the layer on the others
    (their keys and values alone are projected). One fused attention call (SDPA, GQA unexpanded). Differentiable."""
    attn, cfg = layer.self_attn, layer.self_attn.cfg
    b, t, _ = x.shape
    n, d = rows.numel(), cfg.head_dim
    cos, sin = rope_at(layer, positions, d, cfg.rope_theta, x.dtype)  # (B, 1, T, D)
    xn = layer.input_layernorm(x)
    q = apply_rope(attn.q_proj(xn[:, rows]).view(b, n, -1, d).transpose(1, 2), cos[:, :, rows], sin[:, :, rows])
    k = apply_rope(attn.k_proj(xn).view(b, t, -1, d).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
    v = attn.v_proj(xn).view(b, t, -1, d).transpose(1, 2)
    allowed = torch.arange(t, device=x.device)[None, :] <= rows[:, None]  # (n, T): causal by index
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # (B, H, n, D)
    h = x[:, rows] + attn.o_proj(y.transpose(1, 2).reshape(b, n, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class SelectorConfig:
    """The scoring head's shape and the selection defaults a checkpoint carries."""

    keep_ratio: float = 0.5  # default r (fraction KEPT) when select() is not given one
    min_per_view: int = 1  # default quota of kept tokens per view
    mlp_hidden: int = 128  # width of the per-token content MLP
    last_bonus: float = 2.0  # initial extra pooling weight (logit) of the last prompt token
    use_tags: bool = True  # add learned bonuses for the cells the question's c-tags point at
    # The scoring head reads the served model's own decoder layer 0 (frozen, not stored), so a pipeline
    # runs that layer once: on the whole prompt, ranks, and runs layers 1.. on the kept tokens only.
    # False: the selector owns a trainable copy of layer 0 and prunes before the decoder.
    shared_layer: bool = True
    # What the head reads. "layer0": decoder layer 0's output over the whole prompt (above). "prompt": the prompt's
    # own embeddings, its question rows replaced by layer 0's output at those rows alone (they attend over the
    # whole prompt): layer 0 is never run on the visual tokens, and the selector prunes BEFORE the decoder, which
    # then runs every layer on the kept tokens only. "embeds": the prompt's embeddings alone, the question's rows too
    # (no decoder layer at all: the cheapest; it prunes before the decoder as "prompt" does).
    reads: str = "layer0"
    # 0: keep the top scores. tau > 0: keep the subset that maximises its total score plus tau times the log-volume
    # its tokens span (a DPP over the tokens the head reads, quality from the scores: `select_by_scores`), so near
    # duplicates of a kept token give way to other evidence. Selection only: training does not read it.
    diversity: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ValueError(f"config field 'keep_ratio': must be in (0, 1]; got {self.keep_ratio}")
        if self.min_per_view < 0:
            raise ValueError(f"config field 'min_per_view': must be >= 0; got {self.min_per_view}")
        if self.mlp_hidden < 1:
            raise ValueError(f"config field 'mlp_hidden': must be positive; got {self.mlp_hidden}")
        if not self.diversity >= 0.0:
            raise ValueError(f"config field 'diversity': must be >= 0; got {self.diversity}")
        if self.reads not in READS:
            raise ValueError(f"config field 'reads': must be one of {', '.join(READS)}; got {self.reads!r}")


class TokenSelector(nn.Module):
    """The served LLM's decoder layer 0 (shared and frozen, or an owned trainable copy) plus a small
    scoring head over its output.

    Score of visual token j (the question's point of view, all from the layer-0 output h):
        s_j = log sum_{heads m, query tokens i} w_m * beta_i * softmax_keys(q_i^m . k^m / sqrt(d))_j
              + MLP([norm(h_j), sum_i beta_i norm(h_i)])
    with query tokens i = every text token after the last view (question and chat template), w a
    learned softmax over heads, beta a learned softmax pooling over the query tokens (plus a bonus
    for the last token), and q/k projections initialised from decoder layer 1: before training,
    with all pooling on the last token, the first term is FastV K=2's ranking (layer 1's attention). The MLP (zero at
    init) adds query-conditioned content evidence (is an object in this cell?). With `use_tags`, the
    cells that the question's DriveLM c-tags <cK,CAM,x,y> point at (and their neighbours) get a
    learned bonus: the question gives object coordinates outright, and a one-layer scorer cannot
    read digit strings into grid cells reliably.
    """

    def __init__(self, text_cfg: TextConfig, cfg: SelectorConfig | None = None):
        super().__init__()
        self.text_cfg = text_cfg
        self.cfg = cfg or SelectorConfig()
        c = text_cfg.hidden_size
        # decoder layer 0: a trainable copy, or (shared_layer) the served model's own, bound by `bind`; none where
        # the head reads the embeddings alone
        own = not self.cfg.shared_layer and self.cfg.reads != "embeds"
        self.layer = DecoderLayer(text_cfg) if own else None
        self._shared: list[DecoderLayer] = []  # a plain list: the shared layer is not this module's parameter
        self.norm = RMSNorm(c, text_cfg.norm_eps)
        self.q_proj = nn.Linear(c, text_cfg.num_heads * text_cfg.head_dim, bias=text_cfg.qkv_bias)
        self.k_proj = nn.Linear(c, text_cfg.num_kv_heads * text_cfg.head_dim, bias=text_cfg.qkv_bias)
        self.head_logits = nn.Parameter(torch.zeros(text_cfg.num_heads))
        self.query_gate = nn.Linear(c, 1)
        self.last_bonus = nn.Parameter(torch.tensor(float(self.cfg.last_bonus)))
        self.mlp = nn.Sequential(nn.Linear(2 * c, self.cfg.mlp_hidden), nn.GELU(), nn.Linear(self.cfg.mlp_hidden, 1))
        self.tag_weight = nn.Parameter(torch.zeros(2))  # tagged cell, its neighbours
        nn.init.zeros_(self.query_gate.weight)
        nn.init.zeros_(self.query_gate.bias)
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    @classmethod
    def from_model(cls, model, cfg: SelectorConfig | None = None) -> TokenSelector:
        """Initialised from `model`: layer 0 copied, the scoring q/k and norm from layer 1 (or 0 for a 1-layer LLM),
        the input of layer 1; reading the prompt, the keys (and norm) from layer 0, whose input the visual tokens
        are; reading the embeddings alone, the queries from layer 0 too."""
        lm = model.language_model
        sel = cls(lm.cfg, cfg)
        if sel.layer is None:
            sel.bind(model)
        else:
            sel.layer.load_state_dict(lm.layers[0].state_dict())
        src = lm.layers[1 if len(lm.layers) > 1 else 0]
        keys = lm.layers[0] if sel.cfg.reads in ("prompt", "embeds") else src
        queries = lm.layers[0] if sel.cfg.reads == "embeds" else src  # the question's rows as they enter the decoder
        sel.norm.load_state_dict(keys.input_layernorm.state_dict())
        sel.q_proj.load_state_dict(queries.self_attn.q_proj.state_dict())
        sel.k_proj.load_state_dict(keys.self_attn.k_proj.state_dict())
        return sel.to(device=model.device, dtype=model.dtype)

    @property
    def prunes_inside(self) -> bool:
        """Whether the selector ranks from the served decoder's own layer-0 output, a hook inside the prefill
        (`pruning`); else it prunes the prompt before the decoder (`select`)."""
        return self.cfg.shared_layer and self.cfg.reads == "layer0"

    def bind(self, model) -> TokenSelector:
        """Read `model`'s own decoder layer 0 (shared_layer); a no-op for a selector with its own copy."""
        if self.cfg.shared_layer:
            self._shared = [model.language_model.layers[0]]
        return self

    def decoder_layer(self) -> DecoderLayer:
        if self.layer is not None:
            return self.layer
        if not self._shared:
            raise LiteVLMError("this TokenSelector reads the served model's decoder layer 0: bind(model) first")
        return self._shared[0]

    def _check(self, model) -> None:
        mine, theirs = self.text_cfg, model.language_model.cfg
        for f in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "rope_theta",
            "qkv_bias",
        ):
            if getattr(mine, f) != getattr(theirs, f):
                raise LiteVLMError(
                    f"this TokenSelector was made for a decoder with {f}={getattr(mine, f)}, "
                    f"the model has {getattr(theirs, f)}: "
                    "train a selector for this model (`litevlm train tokens`)"
                )

    def tag_features(
        self, model, question: str | None, view_spans: Sequence[Span], tiling: Tiling | None = None
    ) -> torch.Tensor | None:
        """(2, N) c-tag features for `scores`, or None when the question has none or tags are off. `tiling`: the
        prompt format's (`litevlm.model.prompt.Tiling`); None: the model's fixed tiles per view."""
        if not self.cfg.use_tags or not question or not C_TAG.search(question):
            return None
        if tiling is None:
            grids = model.cfg.tiles_per_view
        else:
            grids = view_grids(tiling, view_spans, model.cfg.tokens_per_tile)
        return tag_features(question, view_spans, model.cfg.token_grid, grids).to(model.device)

    def forward(self, embeds, positions, view_spans: Sequence[Span], tags: torch.Tensor | None = None) -> torch.Tensor:
        """`scores`: what a data-parallel wrapper (DDP) calls in training."""
        return self.scores(embeds, positions, view_spans, tags)

    def scores(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        view_spans: Sequence[Span],
        tags: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log-scores (B, N) of the visual tokens, view after view; differentiable (training). tags: (2, N) or None."""
        if self.cfg.reads == "embeds":
            return self.head_scores(embeds, positions, view_spans, tags)
        if self.cfg.reads == "prompt":
            if self._native_prompt(embeds):
                return self._prompt_scores_native(embeds, positions, view_spans, tags)[None]
            return self.head_scores(self.prompt_view(embeds, positions, view_spans), positions, view_spans, tags)
        cfg = self.text_cfg
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, embeds.dtype)
        return self.head_scores(
            self.decoder_layer()(embeds, cos, sin), positions, view_spans, tags
        )  # causal SDPA, no cache

    def prompt_view(self, embeds: torch.Tensor, positions: torch.Tensor, view_spans: Sequence[Span]) -> torch.Tensor:
        """What the head reads with reads="prompt": the embeddings (B, T, C), the question's rows (every token after
        the last view) replaced by decoder layer 0's output there (`layer_rows`, over the whole prompt)."""
        first = question_start(view_spans, embeds.shape[1])
        rows = torch.arange(first, embeds.shape[1], device=embeds.device)
        return torch.cat([embeds[:, :first], layer_rows(self.decoder_layer(), embeds, positions, rows)], 1)

    def head_scores(
        self, x: torch.Tensor, positions: torch.Tensor, view_spans: Sequence[Span], tags: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The scoring head alone: log-scores (B, N) from decoder layer 0's output x (B, T, C)."""
        cfg = self.text_cfg
        b, t, _ = x.shape
        last_visual = question_start(view_spans, t)
        if b == 1 and not torch.is_grad_enabled() and x.dtype == torch.float32:
            return self._head_scores_one(x[0], positions, view_spans, last_visual, tags)[None]
        h = self.norm(x)
        vis = visual_index(view_spans, x.device)
        rows = torch.arange(last_visual, t, device=x.device)  # the question's tokens
        logits = row_logits(self.q_proj, self.k_proj, h, positions, rows, cfg)  # (B, H, n, T)
        attn = logits.softmax(-1)[..., vis]  # (B, H, n, N)
        gate = self.query_gate(h[:, rows]).squeeze(-1).float()  # (B, n)
        gate = torch.cat([gate[:, :-1], gate[:, -1:] + self.last_bonus], dim=1)
        beta = gate.softmax(-1)  # (B, n)
        w = self.head_logits.float().softmax(-1)  # (H,)
        mix = torch.einsum("bhqn,h,bq->bn", attn, w, beta)  # (B, N)
        ctx = torch.einsum("bq,bqc->bc", beta.to(h.dtype), h[:, rows])  # (B, C)
        feat = torch.cat([h[:, vis], ctx[:, None].expand(-1, vis.numel(), -1)], dim=-1)  # (B, N, 2C)
        s = torch.log(mix + 1e-9) + self.mlp(feat).squeeze(-1).float()
        if tags is not None:
            s = s + (self.tag_weight.float()[:, None] * tags.float()).sum(0)
        return s

    def _head_scores_one(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        view_spans: Sequence[Span],
        first_row: int,
        tags: torch.Tensor | None,
    ) -> torch.Tensor:
        """`head_scores` for one fp32 prompt x (T, C) at inference: `_head_ops` on packed weights in one call, native
        (cpu_steps.cpp) where the native steps serve, else eagerly (equal to the differentiable head, a test)."""
        cfg = self.text_cfg
        cos, sin = self._rope(positions[0], x.dtype)  # (T, 1, D)
        vis = visual_index(view_spans, x.device)
        tags = x.new_empty(0) if tags is None else tags.float()
        ops = native.ops() if x.is_cpu and cpu_steps.backend() == "native" else None
        if ops is not None:  # the same head as native loops (cpu_steps.cpp), one call
            return ops.token_scores(
                x,
                cos[:, 0],
                sin[:, 0],
                first_row,
                vis,
                tags,
                self._head_weights(),
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                self.norm.eps,
            )
        return _head_ops(
            x,
            cos,
            sin,
            first_row,
            vis,
            tags,
            self._head_weights(),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.norm.eps,
        )

    def _native_prompt(self, embeds: torch.Tensor) -> bool:
        """Whether a prompt-reading selector scores these embeddings (B, T, C) in one native call (`prompt_scores` of
        cpu_steps.cpp): inference on one fp32 prompt on the CPU where the native steps serve, through a plain,
        unhooked layer 0 whose norm shares the head's epsilon."""
        if torch.is_grad_enabled() or embeds.shape[0] != 1 or embeds.dtype != torch.float32:
            return False
        if not embeds.is_cpu or cpu_steps.backend() != "native":
            return False
        layer = self.decoder_layer()
        norm = layer.input_layernorm
        return (
            layer.fusable()
            and not cpu_steps.hooked([layer])
            and getattr(norm, "eps", None) == self.norm.eps
            and getattr(norm, "weight", None) is not None
        )

    def _prompt_scores_native(
        self, embeds: torch.Tensor, positions: torch.Tensor, view_spans: Sequence[Span], tags: torch.Tensor | None
    ) -> torch.Tensor:
        """`scores` of a prompt-reading selector (batch 1, no grad) in one native call: the rows before the question
        meet one product (layer 0's keys and values, the head's keys and its MLP's token half, `_fused_products`), the
        question rows alone run through layer 0 (equal to `head_scores(prompt_view(...))`, a test) -> (N,)."""
        cfg = self.text_cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = embeds.shape[1]
        cos, sin = self._rope(positions[0], embeds.dtype)  # (T, 1, D)
        layer = list(cpu_steps.unrotated(cpu_steps.layer_weights(self.decoder_layer()), hq, hkv, d))  # [q k | v]
        head = self._head_weights()
        fused, fused_bias = self._fused_products(layer, head)
        scratch = [embeds.new_empty(1, hkv, t, d) for _ in range(2)]  # layer 0's K and V of this prompt
        return native.ops().prompt_scores(
            embeds[0],
            cos[:, 0],
            sin[:, 0],
            question_start(view_spans, t),
            visual_index(view_spans, embeds.device),
            embeds.new_empty(0) if tags is None else tags.float(),
            layer,
            scratch,
            head,
            fused,
            fused_bias,
            hq,
            hkv,
            d,
            self.norm.eps,
        )

    def _fused_products(self, layer: list, head: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, 3 Hkv D + hidden) and its bias: decoder layer 0's k | v, the head's k and its MLP's token half, each
        with its RMSNorm's weight folded into its rows (norm(x) @ W = (x / rms(x)) @ (diag(w) W)); made again when a
        weight of either changes (the layer's packing is new then, the head's list too)."""
        hq_d = self.text_cfg.num_heads * self.text_cfg.head_dim
        norm0, qkv, qkv_bias = layer[0], layer[1], layer[2]
        key = (head, qkv, norm0, norm0._version)
        cache = self.__dict__.get("_fused_cache")
        if cache is not None and all(a is b for a, b in zip(cache[0][:3], key[:3])) and cache[0][3] == key[3]:
            return cache[1]
        with torch.no_grad():
            ws = head[0][:, None]
            fused = torch.cat([norm0.detach()[:, None] * qkv[:, hq_d:], ws * head[3], ws * head[7]], 1).contiguous()
            bias = torch.cat([qkv_bias[hq_d:], head[4], head[8].new_zeros(head[7].shape[1])]).contiguous()
        self.__dict__["_fused_cache"] = (key, (fused, bias))
        return fused, bias

    def _head_weights(self) -> list:
        """`_head_ops`' weight list, contiguous (`_packed` projections, the MLP's first layer split into its token half,
        transposed, and its context half); rebuilt when a weight of the head changes."""
        params = [p for name, p in self.named_parameters() if not name.startswith("layer.")]
        key = tuple((p.data_ptr(), p._version) for p in params)
        cache = self.__dict__.get("_head_cache")
        if cache is not None and cache[0] == key:
            return cache[1]
        wq, bq, wk, bk = self._packed()
        c = self.text_cfg.hidden_size
        w1, b1, w2, b2 = (
            t.detach() for t in (self.mlp[0].weight, self.mlp[0].bias, self.mlp[2].weight, self.mlp[2].bias)
        )
        weights = [
            self.norm.weight.detach(),
            wq,
            bq,
            wk,
            bk,
            self.last_bonus.detach().reshape(1),
            self.head_logits.detach(),
            w1[:, :c].t().contiguous(),
            b1,
            w1[:, c:].contiguous(),
            w2[0].contiguous(),
            b2,
            self.tag_weight.detach(),
        ]
        self.__dict__["_head_cache"] = (key, weights)
        return weights

    def _packed(self) -> tuple:
        """(W_q (C, 2 Hq D + 1), b_q, W_k (C, Hkv D), b_k), row-major: [q | rot(q) | gate], rot = rotate_half folded
        into the weights, and k (built by `_head_weights`, which keeps them until a weight changes)."""
        d = self.text_cfg.head_dim

        def bias(lin: nn.Linear, rows: int) -> torch.Tensor:
            return lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(rows)

        wq, wk = self.q_proj.weight.detach(), self.k_proj.weight.detach()
        bq, bk = bias(self.q_proj, wq.shape[0]), bias(self.k_proj, wk.shape[0])
        return (
            torch.cat([wq, rotate_head_rows(wq, d), self.query_gate.weight.detach()]).t().contiguous(),
            torch.cat([bq, rotate_head_rows(bq, d), self.query_gate.bias.detach()]),
            wk.t().contiguous(),
            bk.contiguous(),
        )

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, D) for positions (T,), from a table kept between prompts."""
        cfg = self.text_cfg
        cos, sin = rope_table(self, cfg.head_dim, cfg.rope_theta, int(positions.max()), dtype, positions.device)
        return cos[positions], sin[positions]

    @torch.no_grad()
    def select(
        self,
        model,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        view_spans: Sequence[Span],
        keep_ratio: float | None = None,
        min_per_view: int | None = None,
        question: str | None = None,
        tiling: Tiling | None = None,
        record: dict | None = None,
    ):
        """Keep a fraction r of the visual tokens (batch 1): (embeds_kept, positions_kept, kept_index).

        `question` (the raw text) lets the selector use the c-tags it contains, placed on the views' cells by
        `tiling` (the prompt format's); without it the selector scores from the embeddings alone.

        positions_kept are the ORIGINAL positions of the kept tokens; every text token is kept;
        kept_index (T',) are the prompt indices kept, ascending. keep_ratio=1 returns the prompt as
        it is (bit for bit the unpruned output). Defaults come from the checkpoint's config. record: a dict that
        receives the visual tokens' log-scores (N,) under "scores" (what the explain figure shades by).
        """
        r = self.cfg.keep_ratio if keep_ratio is None else keep_ratio
        quota = self.cfg.min_per_view if min_per_view is None else min_per_view
        keep_count(1, r)  # validates r
        if embeds.shape[0] != 1:
            raise LiteVLMError("TokenSelector.select runs one prompt at a time (batch 1)")
        self._check(model)
        if r >= 1.0:
            return embeds, positions, torch.arange(embeds.shape[1], device=embeds.device)
        s = self.scores(embeds, positions, view_spans, self.tag_features(model, question, view_spans, tiling))[0]
        if record is not None:
            record["scores"] = s
        kept = self._keep(s, embeds[0], view_spans, r, quota)
        return prune_prompt(embeds, positions, view_spans, kept)

    def _keep(self, s: torch.Tensor, x: torch.Tensor, view_spans: Sequence[Span], r: float, quota: int) -> torch.Tensor:
        """The kept visual tokens from their scores s (N,): the top ones, or with `diversity` a DPP over the visual
        rows of x (T, C), the prompt as the head reads it (the embeddings, or layer 0's output inside the decoder)."""
        tau = self.cfg.diversity
        feats = x[visual_index(view_spans, x.device)] if tau > 0.0 else None
        return select_by_scores(s, view_sizes(view_spans), r, quota, feats, tau)

    def pruning(
        self,
        model,
        positions: torch.Tensor,
        view_spans: Sequence[Span],
        keep_ratio: float | None = None,
        min_per_view: int | None = None,
        question: str | None = None,
        tiling: Tiling | None = None,
        record: dict | None = None,
    ) -> Pruning:
        """Selection inside the decoder (shared_layer, batch 1), the hook generation calls after decoder layer 0: the
        head ranks from that layer's output and keeps what `select` keeps (timed as "select_tokens", the c-tags read
        included). Generation then runs layers 1.. on the kept tokens only (`litevlm.model.generate.pruned_prefill`).
        record: a dict that receives the visual tokens' log-scores (N,) under "scores" when the hook runs.
        """
        if not self.prunes_inside:
            raise LiteVLMError("this TokenSelector prunes the prompt before the decoder: use select()")
        self._check(model)
        if self.decoder_layer() is not model.language_model.layers[0]:
            raise LiteVLMError("this TokenSelector is bound to another model's decoder layer 0")
        r = self.cfg.keep_ratio if keep_ratio is None else keep_ratio
        quota = self.cfg.min_per_view if min_per_view is None else min_per_view

        def keep(x: torch.Tensor) -> torch.Tensor:
            s = self.head_scores(x, positions, view_spans, self.tag_features(model, question, view_spans, tiling))[0]
            if record is not None:
                record["scores"] = s
            return kept_prompt_index(x.shape[1], view_spans, self._keep(s, x[0], view_spans, r, quota))

        return Pruning(1, keep, "select_tokens")

    # -- checkpoint -----------------------------------------------------------------------------
    def save(self, model_dir: str | Path, recipe: dict | None = None, extra: dict | None = None) -> Path:
        """Write `model_dir/token_selector/` (selector.safetensors + config.json with shapes and recipe).

        Each file is written beside its target and renamed over it, so a reader never sees half a file.
        """
        import os

        from safetensors.torch import save_file

        d = Path(model_dir) / SELECTOR_DIR
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": SELECTOR_FORMAT,
            "text": asdict(self.text_cfg),
            "selector": asdict(self.cfg),
            "recipe": recipe or {},
            **(extra or {}),
        }
        text = json.dumps(meta, indent=2)  # fails before anything is written if the recipe is not JSON
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(d / "selector.safetensors.tmp"), metadata={"format": SELECTOR_FORMAT})
        (d / "config.json.tmp").write_text(text + "\n", encoding="utf-8")
        os.replace(d / "selector.safetensors.tmp", d / "selector.safetensors")
        os.replace(d / "config.json.tmp", d / "config.json")
        return d

    @classmethod
    def load(cls, model_dir: str | Path, model) -> TokenSelector:
        """Load from `model_dir/token_selector/` (or that folder itself), checked against `model`'s decoder."""
        from safetensors.torch import load_file

        d = Path(model_dir)
        if not (d / "config.json").is_file() or not (d / "selector.safetensors").is_file():
            d = d / SELECTOR_DIR
        if not (d / "config.json").is_file() or not (d / "selector.safetensors").is_file():
            raise LiteVLMError(
                f"no TokenSelector at {model_dir}: expected {SELECTOR_DIR}/config.json and selector.safetensors; "
                "train one with `litevlm train tokens`"
            )
        meta = json.loads((d / "config.json").read_text())
        if meta.get("format") != SELECTOR_FORMAT:
            raise LiteVLMError(f"{d}/config.json is not a TokenSelector checkpoint (format {meta.get('format')!r})")
        try:
            text_cfg = TextConfig(**meta["text"])
            known = {f.name for f in fields(SelectorConfig)}
            # checkpoints written before shared_layer existed own their copy of layer 0
            cfg = SelectorConfig(**{"shared_layer": False, **{k: v for k, v in meta["selector"].items() if k in known}})
        except (TypeError, ValueError, KeyError) as e:
            raise LiteVLMError(f"{d}/config.json holds an invalid TokenSelector config: {e}") from None
        sel = cls(text_cfg, cfg)
        sel._check(model)
        state = load_file(str(d / "selector.safetensors"))
        missing = set(sel.state_dict()) - set(state)
        extra = set(state) - set(sel.state_dict())
        if missing or extra:
            raise LiteVLMError(
                f"{d}/selector.safetensors does not match the TokenSelector: missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        sel.load_state_dict(state)
        sel.meta = meta
        return sel.bind(model).to(device=model.device, dtype=model.dtype).eval()
