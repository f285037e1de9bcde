"""Why an answer is as fast as it is: the six views with what the pipeline kept of them, drawn on the images.

LiteVLM saves time by not looking at everything: the ViewSelector encodes only the cameras a question needs, and
the TokenSelector keeps a fraction of each view's visual tokens for the prefill. The token-pruning papers (FastV,
DART, DivPrune, LiteVLM) show the kept tokens on the image, because a number ("r = 0.5") says nothing about *which*
half survived: whether the tokens kept sit on the car the question asks about, or on the sky. This module draws that
figure for one `litevlm.pipeline.Answer`:

    CAM_FRONT_LEFT | CAM_FRONT | CAM_FRONT_RIGHT      (nuScenes layout, as the cameras sit on the car)
    CAM_BACK_LEFT  | CAM_BACK  | CAM_BACK_RIGHT

A view the question did not need is greyed out; a camera with no image is an empty "missing" panel. On a view that
was encoded, each kept token is a rectangle over the patch of the image it was made from, shaded by the
TokenSelector's log-score where the answer has scores (else one colour); the pruned patches are dimmed. An answer
that pruned nothing (`kept_tokens` None) marks every token of its views as kept. The title holds the question, the
answer and both latency measures: the paper's (the five stages) and what a user waits (images to answer, e2e).

Where a token sits: a view's tokens are laid out tile by tile (`litevlm.model.prompt.Tiling`), and within a tile as
a g x g grid, row-major (g = sqrt(tokens_per_tile), after the pixel shuffle). A tile of the grid covers its cell of
the original image (tiles are cut from the image resized to the grid, so cells map back proportionally); a
thumbnail tile (the whole image again, last) overlaps every other tile, so its tokens are counted in the panel's
title but not drawn.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.model.prompt import Tiling

GRID = (("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT"), ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"))
FIGSIZE = (12.0, 7.2)  # inches; with DPI, a PNG of exactly 1200 x 720 pixels whatever the images' sizes
DPI = 100
PIXELS = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))  # (width, height) of the saved PNG
KEPT_COLOUR = "#ffb000"  # kept tokens where the answer has no scores
DIM = 0.6  # opacity of the black veil over pruned patches
DISPLAY_WIDTH = 480  # images are drawn at this width at most: the figure is ~400 px a panel anyway

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1) in the original image's pixels, x1/y1 exclusive


@dataclass
class Explanation:
    """The saved figure and, per camera drawn with tokens, the kept-token rectangles as drawn (read back from the
    figure's patches), so that a test can check the figure marks exactly the kept tokens."""

    path: Path
    boxes: dict[str, list[Box]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# Where a token sits on its image
# ------------------------------------------------------------------------------------------------
def token_grid(tokens_per_tile: int) -> int:
    """g, the tokens along a tile's side: tokens_per_tile = g * g."""
    g = math.isqrt(tokens_per_tile)
    if g * g != tokens_per_tile or g < 1:
        raise LiteVLMError(f"{tokens_per_tile} tokens per tile is no square grid of tokens")
    return g


def view_tokens(width: int, height: int, tiling: Tiling, image_size: int, tokens_per_tile: int) -> int:
    """The visual tokens an image of this size makes, the thumbnail tile's included."""
    return tiling.count(width, height, image_size) * tokens_per_tile


def token_box(index: int, width: int, height: int, tiling: Tiling, image_size: int, tokens_per_tile: int) -> Box | None:
    """The patch of a width x height image that visual token `index` of its view was made from; None for a token of
    the thumbnail tile (the whole image again)."""
    g = token_grid(tokens_per_tile)
    cols, rows = tiling.grid(width, height, image_size)  # fixed tiling: (tiles, 1)
    tile, cell = divmod(index, tokens_per_tile)
    if not 0 <= index < view_tokens(width, height, tiling, image_size, tokens_per_tile):
        raise LiteVLMError(
            f"visual token {index} is out of range: a {width}x{height} image makes "
            f"{view_tokens(width, height, tiling, image_size, tokens_per_tile)} tokens with this tiling"
        )
    if tile >= cols * rows:
        return None  # the thumbnail
    tr, tc = divmod(tile, cols)  # tiles row by row, left to right
    r, c = divmod(cell, g)  # tokens row-major within the tile
    # the token's column and row in the whole image's (cols*g) x (rows*g) token grid, mapped back to pixels
    x, y = tc * g + c, tr * g + r
    sx, sy = width / (cols * g), height / (rows * g)
    return (x * sx, y * sy, (x + 1) * sx, (y + 1) * sy)


def token_boxes(
    width: int,
    height: int,
    kept: Iterable[int] | None,
    tiling: Tiling,
    image_size: int,
    tokens_per_tile: int,
) -> list[Box]:
    """The patches of a view's kept tokens (indices into the view's tokens; None: every token), in `kept`'s order,
    thumbnail tokens left out."""
    if kept is None:
        kept = range(view_tokens(width, height, tiling, image_size, tokens_per_tile))
    boxes = (token_box(i, width, height, tiling, image_size, tokens_per_tile) for i in kept)
    return [b for b in boxes if b is not None]


# ------------------------------------------------------------------------------------------------
# The figure
# ------------------------------------------------------------------------------------------------
def explain(pipe, images: Mapping, answer, question: str, out: str | Path) -> Explanation:
    """`draw_explanation` with the tiling and sizes of the pipeline that made `answer`."""
    return draw_explanation(
        images,
        answer,
        question,
        out,
        tiling=pipe.format.tiling,
        image_size=pipe.cfg.vision.image_size,
        tokens_per_tile=pipe.cfg.tokens_per_tile,
    )


def check_out(out: str | Path) -> Path:
    """A PNG path in an existing folder, checked before any work is done."""
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise LiteVLMError(f"{out}: the explanation is a PNG; give a file name ending in .png")
    if not path.parent.is_dir():
        raise LiteVLMError(f"{out}: the folder {path.parent} does not exist")
    return path


def draw_explanation(
    images: Mapping,
    answer,
    question: str,
    out: str | Path,
    *,
    tiling: Tiling,
    image_size: int,
    tokens_per_tile: int,
) -> Explanation:
    """Draw `answer` over `images` (camera -> path, bytes, PIL image, array or tensor; cameras may be missing) and
    save it as a PNG of `PIXELS`; the pipeline's `tiling`, vision `image_size` and `tokens_per_tile` place the tokens
    (`explain` takes them from the pipeline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import Normalize
    from matplotlib.patches import Rectangle

    from litevlm.model.vlm import load_image

    path = check_out(out)
    kept_all = answer.kept_tokens  # None: nothing pruned
    scores = answer.kept_scores if kept_all is not None else None
    norm, cmap = None, plt.get_cmap("viridis")
    if scores:
        flat = [s for v in scores.values() for s in v]
        if flat:
            lo, hi = min(flat), max(flat)
            norm = Normalize(lo, hi if hi > lo else lo + 1e-6)

    fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
    grid = fig.add_gridspec(2, 3, left=0.01, right=0.9 if norm else 0.99, bottom=0.02, top=0.78, wspace=0.03)
    drawn: dict[str, list[Box]] = {}
    n_kept = n_all = 0
    for r, row in enumerate(GRID):
        for c, cam in enumerate(row):
            ax = fig.add_subplot(grid[r, c])
            ax.set_xticks([])
            ax.set_yticks([])
            if cam not in images:
                _empty(ax, cam, "missing")
                continue
            try:
                img = load_image(images[cam])
            except LiteVLMError:
                _empty(ax, cam, "unreadable")
                continue
            w, h = img.size
            shown = img.resize((min(w, DISPLAY_WIDTH), max(1, round(h * min(w, DISPLAY_WIDTH) / w))))
            if cam not in answer.views:  # not needed by the question: never encoded
                ax.imshow(np.asarray(shown.convert("L")), cmap="gray", alpha=0.3, extent=(0, w, h, 0), vmin=0, vmax=255)
                ax.set_title(f"{cam}: not selected", fontsize=9, color="0.5")
                continue
            n = view_tokens(w, h, tiling, image_size, tokens_per_tile)
            made = answer.tokens_per_view.get(cam, n)
            if made != n:
                raise LiteVLMError(
                    f"{cam}: the answer has {made} visual tokens for this view but its {w}x{h} image makes {n} with "
                    "this tiling: draw the answer over the images and pipeline it came from"
                )
            kept = None if kept_all is None else kept_all.get(cam, [])
            boxes = token_boxes(w, h, kept, tiling, image_size, tokens_per_tile)
            ax.imshow(np.asarray(shown), extent=(0, w, h, 0))
            if kept is not None:  # dim everything, then lift the veil over the kept patches
                ax.imshow(_veil(shown.size, (w, h), boxes), extent=(0, w, h, 0))
            if norm is not None and cam in scores:
                # the scores of the tokens drawn: those of the thumbnail tile are not
                pairs = zip(kept, scores[cam], strict=True)
                drawn_scores = [
                    s for i, s in pairs if token_box(i, w, h, tiling, image_size, tokens_per_tile) is not None
                ]
                colours = cmap(norm(np.asarray(drawn_scores, dtype=float)))  # (boxes, 4)
            else:
                colours = np.tile(matplotlib.colors.to_rgba(KEPT_COLOUR), (len(boxes), 1))
            rects = [Rectangle((x0, y0), x1 - x0, y1 - y0) for x0, y0, x1, y1 in boxes]
            coll = PatchCollection(
                rects, facecolors=_alpha(colours, 0.2), edgecolors=_alpha(colours, 0.9), linewidths=0.6
            )
            ax.add_collection(coll)
            ax.set_xlim(0, w)
            ax.set_ylim(h, 0)
            # what was drawn, read back from the figure's own patches (data coordinates)
            drawn[cam] = [_bbox(p.vertices) for p in coll.get_paths()]
            count = n if kept is None else len(kept)
            thumb = count - len(boxes)
            n_kept, n_all = n_kept + count, n_all + n
            note = f" (+{thumb} on the thumbnail)" if thumb else ""
            label = f"all {n} tokens" if kept is None else f"kept {count} of {n} tokens"
            ax.set_title(f"{cam}: {label}{note}", fontsize=9)
    if norm is not None:
        cax = fig.add_axes((0.915, 0.1, 0.015, 0.6))
        fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), cax=cax).set_label(
            "TokenSelector log-score of a kept token", fontsize=8
        )
    fig.text(
        0.01, 0.985, _title(question, answer, n_kept, n_all), va="top", ha="left", fontsize=9.5, family="monospace"
    )
    fig.savefig(path, dpi=DPI)  # no tight bbox: the PNG is always PIXELS
    plt.close(fig)
    return Explanation(path, drawn)


def _empty(ax, cam: str, why: str) -> None:
    ax.set_facecolor("0.93")
    ax.set_box_aspect(9 / 16)  # a nuScenes frame's shape, as the panels beside it
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="0.45")
    ax.set_title(f"{cam}: {why}", fontsize=9, color="0.5")


def _veil(shown: tuple[int, int], full: tuple[int, int], boxes: list[Box]) -> np.ndarray:
    """(h, w, 4) RGBA at the displayed size: black at opacity DIM, clear over the kept boxes (full-size pixels)."""
    dw, dh = shown
    fx, fy = dw / full[0], dh / full[1]
    veil = np.zeros((dh, dw, 4), dtype=np.float32)
    veil[..., 3] = DIM
    for x0, y0, x1, y1 in boxes:
        veil[round(y0 * fy) : round(y1 * fy), round(x0 * fx) : round(x1 * fx), 3] = 0.0
    return veil


def _alpha(colours: np.ndarray, a: float) -> np.ndarray:
    out = np.array(colours, dtype=float).reshape(-1, 4)
    out[:, 3] = a
    return out


def _bbox(vertices: np.ndarray) -> Box:
    (x0, y0), (x1, y1) = vertices.min(axis=0), vertices.max(axis=0)
    return (float(x0), float(y0), float(x1), float(y1))


def _title(question: str, answer, kept: int, total: int) -> str:
    def lines(prefix: str, text: str) -> str:
        wrapped = textwrap.wrap(text, 140 - len(prefix)) or [""]
        if len(wrapped) > 2:  # the title has room for two lines each: the figure's size is fixed
            wrapped = [wrapped[0], textwrap.shorten(" ".join(wrapped[1:]), 140 - len(prefix), placeholder=" ...")]
        return "\n".join(p + t for p, t in zip([prefix] + [" " * len(prefix)] * 2, wrapped))

    ms = answer.timings_ms
    pruned = "no token pruning" if answer.kept_tokens is None else f"{kept} of {total} visual tokens kept"
    times = (
        f"paper's measure (stages) {ms.get('total', 0.0):.1f} ms   images to answer (e2e) {ms.get('e2e', 0.0):.1f} ms"
    )
    return "\n".join(
        [
            lines("Q: ", question),
            lines("A: ", answer.text),
            f"{len(answer.views)} of {len(CAMERAS)} views encoded, {pruned}",
            times,
        ]
    )
