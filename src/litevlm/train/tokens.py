"""Training recipe for the TokenSelector: distil the full model's own view of which visual tokens matter.

The paper (arXiv 2506.07416, section 3) builds "synthetic ground truth" from two parts, which we
make concrete:
  1. the served VLM's own attention to the visual tokens, teacher-forced on the ground-truth
     answer: the head-mean rows of the last prompt token (half the weight) and of the tokens that
     predict each answer token (the other half), over every decoder layer but the first, each row
     computed alone (q of that token against all keys, `litevlm.select.tokens.attention_rows`),
     never the full attention matrix. On a validation split (seed 2) this beat the answer rows
     alone over the upper layers: what the model itself reads at the end of the prompt is what
     keeps its answers unchanged;
  2. an object prior from the 2D boxes: the token cells that a box covers (the objects the
     question or answer names by c-tag, otherwise the objects seen in the views it needs).
The label is p = (1 - prior_weight) * attention + prior_weight * prior over the visual tokens;
the selector is trained by a listwise KL(p || softmax(scores)), which matches a distribution-valued
teacher at every budget r at once. With `answer_weight` > 0 the labels get a second objective beside them, what
they stand for (`answer_loss`): the KL from the full model's next-token distributions over the answer to those of the
same model reading only the selector's top-r visual tokens (r drawn from `answer_ratios`), its gradient reaching the
scores through a soft mask around the cut (straight-through: the forward pass is the hard top-r); `init` fine-tunes a
trained selector so. Frames come from the synthetic training stream (seed 0; the
held-out split is seed 1); view sets mix "the views the question needs (plus random extras)" with
"all six", as the pipeline feeds the selector.

On the user's data (`--data`) the attention is forced on the target's own greedy answer to the same prompt, not on
the reference answer: the selector's job is to keep what the served model says unchanged, so the tokens to keep
are the ones the model reads while writing its own answer (self-distillation, as the draft recipe does), and
questions without a reference (challenge val/test) get labels too; `--teacher-answer reference` forces the data's
answers instead. The prior is the cells the c-tag points <cK,CAM,x,y> of the question and its reference answer
fall in (in the tiles and the thumbnail, under the prompt format's tiling). Labels are cached on disk and a rerun
continues; the agreement is reported on the held-out scenes of the data (`scene_split`). Every prompt, synthetic
or real, is the target's own (`Pipeline.from_loaded`: its chat template and tiling), so the selector learns on the
prompts it will serve.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.config import flag
from litevlm.dist import Dist, all_reduce_mean, barrier, ddp, shard
from litevlm.errors import LiteVLMError
from litevlm.select.tokens import (
    C_TAG,
    READS,
    SelectorConfig,
    TokenSelector,
    ViewGrid,
    as_grid,
    attention_rows,
    box_cells,
    fastv_scores,
    keep_count,
    tag_cells,
    view_grids,
    visual_index,
)
from litevlm.train.lineage import recipe_sources


@dataclass
class TokenRecipe:
    frames: int = flag(1200, "synthetic frames (seed, 0..frames-1) whose prompts are labelled and trained on")
    seed: int = flag(0, "frames (seed, 0..frames-1); the held-out split is seed 1")
    questions_per_frame: int = 8
    val_frames: int = 60  # frames after the training ones, same seed, for the agreement report
    minutes: float = flag(10.0, "wall-clock budget for labelling and training (labelling takes at most 40%)")
    epochs: int = flag(4, "passes over the labelled prompts (the budget may stop it sooner)")
    batch: int = 16
    lr: float = flag(1e-3, "peak learning rate (cosine schedule); lower it to fine-tune a trained selector (--init)")
    weight_decay: float = 0.01
    band: tuple[int, int] | None = None  # teacher layers [a, b); None: every layer but the first, [1, L)
    last_row_weight: float = 0.5  # share of the last prompt token's row; the answer rows share the rest
    row_norm: bool = False  # normalise each teacher row over the visual tokens before averaging
    prior_weight: float = 0.15  # share of the box prior in the label
    all_views_prob: float = 0.5  # else: the question's views plus random extras
    extra_view_prob: float = 0.15
    render_size: tuple[int, int] = (400, 225)
    keep_ratio: float = flag(
        0.5,
        "the fraction r of visual tokens kept that the checkpoint stores as its own (what --litevlm keeps): "
        "choose it on validation data",
    )
    shared_layer: bool = flag(
        True,
        "train a copy of decoder layer 0 with the head and prune before the decoder (default: the head reads "
        "the model's own frozen layer 0, which then runs once and the rest of the decoder sees only the kept tokens)",
        flag="--own-layer",
    )
    reads: str = flag(
        "layer0",
        "what the selector's head reads: decoder layer 0's output over the whole prompt, the prompt itself with "
        "only its question through layer 0 (then the selector prunes before the decoder, which runs every layer on "
        "the kept tokens alone), or the embeddings alone (no decoder layer: the cheapest, pruning before it too)",
        choices=READS,
    )
    diversity: float = flag(
        0.0,
        "the diversity weight tau the checkpoint stores for selection (training does not read it): 0 keeps the top "
        "scores; tau > 0 keeps the set that maximises its total score plus tau times the log-volume its tokens span "
        "(a DPP; slower, 4-12 ms on one CPU thread for a few hundred tokens)",
    )
    min_per_view: int = 1
    mlp_hidden: int = 128
    use_tags: bool = True  # the selector's c-tag cell bonuses
    answer_weight: float = flag(
        0.0,
        "weight of the answer objective beside the attention labels: the KL from the full model's next-token "
        "distributions over the answer to the model's own reading only the selector's top-r visual tokens, r drawn "
        "from --answer-ratios, its gradient through a soft keep mask (0: the labels alone)",
    )
    answer_ratios: tuple[float, ...] = flag((0.2, 0.3, 0.4), "the keep ratios r the answer objective draws from")
    saliency_weight: float = flag(
        0.0,
        "share of the teacher label taken from what the answer needs rather than from attention: each visual "
        "token's |d log p(answer) / d b|, b a bias on that token's attention logits in every layer and head (the "
        "first-order effect on the answer's likelihood of reading the token less; pruning it is b -> -inf), "
        "normalised over the visual tokens (0: attention alone)",
    )
    answer_temperature: float = flag(
        0.2, "softness of the answer objective's keep mask: sigmoid((score - threshold) / (T * the scores' std))"
    )
    answer_tokens_max: int = flag(24, "the answer objective reads at most this many answer tokens")
    init: str | None = flag(
        None,
        "start from this TokenSelector (a folder holding token_selector/, or the folder itself) instead of the "
        "model's layers; its head shape and inputs are kept",
        metavar="DIR",
    )
    threads: int = flag(2, "torch threads")
    # --data only (the user's DriveLM data)
    val_fraction: float = flag(0.1, "with --data: share of the scenes held out for validation (scene_split, seed)")
    questions: int = flag(0, "with --data: at most this many training questions, in file order (0: all)")
    val_questions: int = flag(200, "with --data: at most this many held-out questions for the agreement report")
    teacher_answer: str = flag(
        "greedy",
        "with --data: the answer the teacher attention is forced on: the target's own greedy answer, or the "
        "data's reference answer",
        choices=("greedy", "reference"),
    )
    answer_tokens: int = flag(64, "with --data: the longest greedy answer the target writes for a label")


# ---------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------


def box_prior(
    boxes_by_view: dict[str, list[Sequence[float]]],
    views: Sequence[str],
    grid: int,
    layout: int | ViewGrid | Sequence[ViewGrid],
) -> torch.Tensor:
    """(N,) distribution over the visual tokens of `views` (prompt order) covered by the boxes; zeros if none.
    `layout`: one `ViewGrid` per view, or one layout for all (an int: tiles side by side)."""
    grids = _grids(layout, len(views))
    sizes = [g.tiles * grid * grid for g in grids]
    prior = torch.zeros(sum(sizes))
    off = 0
    for cam, g, size in zip(views, grids, sizes):
        for box in boxes_by_view.get(cam, []):
            for j in box_cells(box, grid, g):
                prior[off + j] = 1.0
        off += size
    return prior / prior.sum() if prior.sum() > 0 else prior


def point_prior(texts: Sequence[str], views: Sequence[str], grid: int, grids: Sequence[ViewGrid]) -> torch.Tensor:
    """(N,) distribution over the visual tokens of `views` at the cells the texts' c-tags <cK,CAM,x,y> point at (the
    tiles' cell and the thumbnail's, `tag_cells`); zeros if no tag names a view of the prompt."""
    sizes = [g.tiles * grid * grid for g in grids]
    start = dict(zip(views, [sum(sizes[:i]) for i in range(len(sizes))]))
    where = dict(zip(views, grids))
    prior = torch.zeros(sum(sizes))
    for text in texts:
        for tag in C_TAG.finditer(text or ""):
            cam = tag.group(1)
            if cam in where:
                for j in tag_cells(tag.group(0), grid, where[cam])[0][1]:
                    prior[start[cam] + j] = 1.0
    return prior / prior.sum() if prior.sum() > 0 else prior


def _grids(layout, n: int) -> list[ViewGrid]:
    if isinstance(layout, (list, tuple)) and not isinstance(layout, ViewGrid):
        return list(layout)
    return [as_grid(layout)] * n


def frame_boxes(frame, question: str, answer: str, needed: Sequence[str]) -> dict[str, list[tuple[float, ...]]]:
    """Boxes per camera of the objects the QA names by c-tag, else of every object seen in the needed views."""
    named = [o for o in frame.objects if o.tag and (o.tag in question or o.tag in answer)]
    objs = named or [o for o in frame.objects if any(c in o.views for c in needed)]
    out: dict[str, list] = {}
    for o in objs:
        for cam, b in o.views.items():
            if named or cam in needed:
                out.setdefault(cam, []).append(b.clipped())
    return out


@torch.no_grad()
def with_answer(lm, embeds: torch.Tensor, positions: torch.Tensor, answer_ids: Sequence[int]):
    """The prompt (1, T, C) with the answer's tokens appended, teacher-forced, at the positions after it:
    (embeds (1, T + A, C), positions (1, T + A))."""
    ans = torch.tensor([list(answer_ids)], device=embeds.device, dtype=torch.long)
    x = torch.cat([embeds, lm.embed_tokens(ans).to(embeds.dtype)], 1)
    after = positions[:, -1:] + 1 + torch.arange(ans.shape[1], device=embeds.device)[None]
    return x, torch.cat([positions, after], 1)


def teacher_attention(
    model,
    embeds,
    positions,
    view_spans,
    answer_ids: Sequence[int],
    band: tuple[int, int] | None,
    last_row_weight: float,
    row_norm: bool = False,
) -> torch.Tensor:
    """(N,) distribution: the full model's attention to the visual tokens from the last prompt token and the answer.

    The answer (with its end token) is appended teacher-forced; the rows are the tokens that
    predict each answer token. Each layer of the band contributes its head-mean rows (summed
    attention mass on the visual tokens, last row weighted `last_row_weight`, the answer rows the
    rest equally); the band average is normalised over the visual tokens. row_norm=True first
    normalises each row over the visual tokens (every row votes equally, however little it looks).
    """
    lm = model.language_model
    n_layers = len(lm.layers)
    a, b = band if band is not None else (1 if n_layers > 1 else 0, n_layers)
    if not 0 <= a < b <= n_layers:
        raise LiteVLMError(f"teacher band {band} must satisfy 0 <= a < b <= {n_layers}")
    t = embeds.shape[1]
    dev = embeds.device
    x, pos = with_answer(lm, embeds, positions, answer_ids)
    rows = torch.arange(t - 1, x.shape[1] - 1, device=dev)  # last prompt token, then the answer tokens
    w = torch.full((rows.numel(),), (1 - last_row_weight) / max(1, rows.numel() - 1), device=dev)
    w[0] = last_row_weight if rows.numel() > 1 else 1.0
    vis = visual_index(view_spans, dev)
    acc = torch.zeros(vis.numel(), device=dev)
    for layer_i in range(b):
        if layer_i >= a:
            a_rows = attention_rows(lm.layers[layer_i], x, pos, rows)[0][:, vis].float()  # (n, N)
            if row_norm:
                a_rows = a_rows / a_rows.sum(-1, keepdim=True).clamp_min(1e-12)
            acc += (w[:, None] * a_rows).sum(0)
        if layer_i < b - 1:
            x = lm(x, pos, start_layer=layer_i, end_layer=layer_i + 1)
    return acc / acc.sum()


def column_mask(n: int, view_spans, bias: torch.Tensor, dtype) -> torch.Tensor:
    """(1, 1, n, n) additive mask over n tokens: causal, with bias[i] (N,) added to every logit that reads visual
    token i (0 reads it as it is, a large negative number or -inf as pruning removes it)."""
    dev = bias.device
    columns = torch.zeros(n, device=dev, dtype=bias.dtype).index_put((visual_index(view_spans, dev),), bias)
    return (torch.full((n, n), float("-inf"), device=dev).triu(1) + columns[None, :]).to(dtype)[None, None]


def answer_loglik(model, embeds, positions, view_spans, answer_ids: Sequence[int], bias: torch.Tensor) -> torch.Tensor:
    """log p(answer | prompt), teacher-forced, with `bias` (N,) added to every attention logit that reads visual token
    i (every layer and head): 0 reads the prompt as it is, -inf removes the token as pruning does."""
    lm = model.language_model
    t, dev = embeds.shape[1], embeds.device
    answer_ids = list(answer_ids)
    x, pos = with_answer(lm, embeds, positions, answer_ids[:-1])  # the last answer token predicts nothing
    mask = column_mask(x.shape[1], view_spans, bias, embeds.dtype)
    logits = model.lm_head(lm(x, pos, mask=mask)[0, t - 1 :])  # the rows that predict each answer token
    logits = logits if logits.dtype == torch.float64 else logits.float()
    target = torch.tensor(answer_ids, device=dev)
    return F.log_softmax(logits, -1).gather(1, target[:, None]).sum()


def answer_saliency(model, embeds, positions, view_spans, answer_ids: Sequence[int]) -> torch.Tensor:
    """(N,) distribution: how much the answer's log-likelihood (`answer_loglik`, the model frozen) moves with each
    visual token's reading, |d log p(answer) / d b_i| at b = 0 (the first-order effect of reading token i less;
    pruning it is b_i -> -inf), normalised over the visual tokens. One forward and one backward pass."""
    n = int(visual_index(view_spans, embeds.device).numel())
    with torch.enable_grad():
        dtype = torch.float64 if embeds.dtype == torch.float64 else torch.float32
        b = torch.zeros(n, device=embeds.device, dtype=dtype, requires_grad=True)
        (grad,) = torch.autograd.grad(answer_loglik(model, embeds, positions, view_spans, answer_ids, b), b)
    s = grad.abs()
    total = s.sum()
    return s / total if total > 0 else torch.full_like(s, 1.0 / max(1, n))


def teacher_label(model, p, answer_ids: Sequence[int], recipe: TokenRecipe) -> torch.Tensor:
    """The teacher part of a label (before the box prior): the full model's attention (`teacher_attention`), mixed
    with `answer_saliency` at `recipe.saliency_weight`."""
    attn = teacher_attention(
        model, p.embeds, p.positions, p.view_spans, answer_ids, recipe.band, recipe.last_row_weight, recipe.row_norm
    )
    w = recipe.saliency_weight
    if w <= 0:
        return attn
    return (1 - w) * attn + w * answer_saliency(model, p.embeds, p.positions, p.view_spans, answer_ids)


def label(attn: torch.Tensor, prior: torch.Tensor, prior_weight: float) -> torch.Tensor:
    if prior.sum() <= 0:
        return attn
    return (1 - prior_weight) * attn + prior_weight * prior


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@dataclass
class Item:
    frame: int  # index into the visual-token bank
    views: tuple[str, ...]
    question: str
    ids: list[int]
    spans: list[tuple[str, int, int]]
    target: torch.Tensor  # (N,) label distribution
    attn: torch.Tensor = field(repr=False, default=None)  # teacher attention part
    prior: torch.Tensor = field(repr=False, default=None)
    answer: list[int] | None = None  # the answer ids (end token included) the answer objective is forced on


def pick_views(rng: random.Random, needed: Sequence[str], recipe: TokenRecipe) -> tuple[str, ...]:
    if rng.random() < recipe.all_views_prob or not needed:
        return tuple(CAMERAS)
    keep = set(needed) | {c for c in CAMERAS if rng.random() < recipe.extra_view_prob}
    return tuple(c for c in CAMERAS if c in keep)


def prompt_embeds(model, tokenizer, visual_by_cam: dict[str, torch.Tensor], question: str, views: Sequence[str]):
    """drive-tiny's prompt (the default format, fixed tiles) for `question` over `views`: (ids, embeds (1, T, C),
    positions (1, T), view_spans). The recipe itself prompts through the pipeline (`frame_prompt`)."""
    from litevlm.model.prompt import build_prompt

    tpv = model.cfg.tokens_per_tile * model.cfg.tiles_per_view
    layout = build_prompt(tokenizer, question, list(views), tpv)
    ids = torch.tensor([layout.ids], device=model.device)
    visual = torch.cat([visual_by_cam[c] for c in views])
    embeds = model.embed(ids, visual)
    return layout.ids, embeds, torch.arange(ids.shape[1], device=model.device)[None], layout.view_spans


def encode_frame(pipe, images) -> dict[str, torch.Tensor]:
    """Every camera's visual tokens (tiles, tokens_per_tile, C) of one frame, cut by the pipeline's tiling and
    encoded in one vision pass, kept on the CPU until a prompt needs them."""
    pixels, counts = pipe.tiles(images, list(CAMERAS))
    with torch.no_grad():
        visual = pipe.model.encode_tiles(pixels.to(pipe.model.device)).cpu()  # (tiles, tokens_per_tile, C)
    return dict(zip(CAMERAS, visual.split([n // pipe.cfg.tokens_per_tile for n in counts])))


def frame_prompt(pipe, visual_by_cam: dict[str, torch.Tensor], question: str, views: Sequence[str]):
    """The pipeline's own prompt (`Pipeline.embed_prompt`) for `question` over `views` of an encoded frame."""
    visual = torch.cat([visual_by_cam[c] for c in views]).to(pipe.model.device)
    counts = [visual_by_cam[c].shape[0] * visual_by_cam[c].shape[1] for c in views]
    return pipe.embed_prompt(question, list(views), visual, counts)


def build_items(pipe, recipe: TokenRecipe, frame_range: range, rng: random.Random, deadline: float, progress: bool):
    """Render, encode and label synthetic frames: (visual bank [frames] of {cam: (tiles, tokens, C)}, items)."""
    from litevlm.data.synthetic import make_frame, render_views

    model, tokenizer = pipe.model, pipe.tokenizer
    grid = model.cfg.token_grid
    bank, items = [], []
    for i in tqdm(frame_range, desc="labelling frames", disable=not progress):
        if time.time() > deadline:
            break
        frame = make_frame(recipe.seed, i)
        bank.append(encode_frame(pipe, render_views(frame, size=tuple(recipe.render_size))))
        qas = rng.sample(frame.qas, min(recipe.questions_per_frame, len(frame.qas)))
        for qa in qas:
            views = pick_views(rng, qa.views, recipe)
            p = frame_prompt(pipe, bank[-1], qa.question, views)
            answer = tokenizer.encode(qa.answer) + [tokenizer.eos_id]
            attn = teacher_label(model, p, answer, recipe).cpu()
            grids = view_grids(pipe.format.tiling, p.view_spans, model.cfg.tokens_per_tile)
            prior = box_prior(frame_boxes(frame, qa.question, qa.answer, qa.views), views, grid, grids)
            target = label(attn, prior, recipe.prior_weight)
            items.append(
                Item(len(bank) - 1, views, qa.question, p.ids[0].tolist(), p.view_spans, target, attn, prior, answer)
            )
    return bank, items


# ---------------------------------------------------------------------------------------------
# The user's data: teacher labels cached on disk
# ---------------------------------------------------------------------------------------------


MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")  # with the weights: what a label depends on


class LabelCache:
    """Teacher attention per question, on disk as safetensors shards (FOLDER/labels-*.safetensors, tensor name = the
    question's index in the data), each written whole beside its name and renamed, so a run stopped at any point
    leaves only whole shards and the rerun labels just what is missing. Ranks of a torchrun job write their own
    shards into one folder (`rank` in the name); every rank reads all of them (`reload`)."""

    def __init__(self, folder: Path, every: int = 32, rank: int = 0):
        self.folder, self.every, self.rank = folder, every, rank
        folder.mkdir(parents=True, exist_ok=True)
        self.done: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.reload()
        self.cached = len(self.done)  # labels that were on disk when the run began

    def reload(self) -> None:
        """Read every shard in the folder (those other ranks wrote meanwhile too)."""
        from safetensors.torch import load_file

        for f in sorted(self.folder.glob("labels-*.safetensors")):
            self.done.update({int(k): v for k, v in load_file(str(f)).items()})

    def get(self, index: int) -> torch.Tensor | None:
        return self.done.get(index)

    def put(self, index: int, attn: torch.Tensor) -> None:
        self.done[index] = self.pending[index] = attn.float().contiguous()
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.folder / f"labels-{time.time_ns()}-r{self.rank}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file({str(k): v for k, v in self.pending.items()}, str(tmp))
        os.replace(tmp, path)
        self.pending.clear()


def _stat(files) -> list:
    """What identifies files' content cheaply: name, size and modification time of each."""
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(files) if f.is_file()]


def cache_key(loaded, data, images_root, recipe: TokenRecipe) -> str:
    """sha256 of what the teacher labels depend on: the checkpoint (its files), its prompt format and dtype, the data
    (its files), and the recipe settings that change a label."""
    settings = {
        k: getattr(recipe, k)
        for k in (
            "seed",
            "band",
            "last_row_weight",
            "row_norm",
            "all_views_prob",
            "extra_view_prob",
            "teacher_answer",
            "answer_tokens",
            "saliency_weight",
        )
    }
    model, data = Path(loaded.path).resolve(), Path(data).resolve()
    key = {
        "model": _stat(p for p in model.iterdir() if p.suffix == ".safetensors" or p.name in MODEL_FILES),
        "format": loaded.format.to_dict(),
        "dtype": str(loaded.model.dtype),
        "data": _stat(data.rglob("*.json") if data.is_dir() else [data]),
        "images": str(Path(images_root).resolve()) if images_root is not None else None,
        "recipe": settings,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def answer_ids(pipe, p, sample, recipe: TokenRecipe) -> list[int]:
    """The answer the teacher attention is forced on: the target's own greedy answer to this very prompt (default),
    or the data's reference answer (a question without one gets the greedy answer)."""
    from litevlm.model.generate import StageTimer, drain

    if recipe.teacher_answer == "reference" and sample.answer.strip():
        return pipe.tokenizer.encode(sample.answer) + [pipe.tokenizer.eos_id]
    timer = StageTimer(pipe.model.device)
    return list(drain(pipe.decode(pipe.prefill(p, None, sample.question, timer), timer)).tokens)


def real_grid(tiling, image, size: int) -> ViewGrid:
    """The `ViewGrid` `tiling` cuts this image into (its real size decides a dynamic grid)."""
    cols, rows = tiling.grid(*image.size, size)
    return ViewGrid(cols, rows, bool(tiling.thumbnail) and cols * rows > 1)


def frame_groups(indexed) -> list[list]:
    """The user's questions (`indexed`: (index in the data, Sample)) grouped by the frame whose images they share, in
    file order: each frame is encoded once for all its questions."""
    frames: dict[tuple, list] = {}
    for i, s in indexed:
        frames.setdefault((s.scene_id, s.frame_id, tuple(sorted(map(str, s.images.values())))), []).append((i, s))
    return list(frames.values())


def label_questions(pipe, groups, recipe: TokenRecipe, cache: LabelCache, deadline: float, progress: bool) -> int:
    """Compute the teacher labels the cache lacks for these frame groups (a frame whose questions are all cached is
    not even encoded); returns how many questions the deadline left unlabelled."""
    from litevlm.data.drivelm import load_images

    left = 0
    for group in tqdm(groups, desc="teacher labels", disable=not progress):
        todo = [(i, s) for i, s in group if cache.get(i) is None]
        if not todo:
            continue
        if time.time() > deadline:
            left += len(todo)
            continue
        visual = encode_frame(pipe, load_images(todo[0][1], CAMERAS))
        for i, s in todo:
            p = frame_prompt(pipe, visual, s.question, question_views(s, recipe))
            cache.put(i, teacher_label(pipe.model, p, answer_ids(pipe, p, s, recipe), recipe).cpu())
    cache.flush()
    return left


def question_views(sample, recipe: TokenRecipe) -> tuple[str, ...]:
    """The views a question's prompt holds: drawn by `pick_views` from a generator seeded by the question's id, so
    the labels, the items and every rank agree on them."""
    return pick_views(random.Random(f"{recipe.seed}:{sample.id}"), sample.views, recipe)


def data_items(pipe, groups, recipe: TokenRecipe, cache: LabelCache, progress: bool, desc: str):
    """The training items of the labelled questions of these frame groups: (visual bank, items). Each label is the
    cached teacher attention mixed with the question's c-tag prior."""
    from litevlm.data.drivelm import load_images

    model = pipe.model
    grid, size = model.cfg.token_grid, model.cfg.vision.image_size
    bank, items = [], []
    for group in tqdm(groups, desc=desc, disable=not progress):
        done = [(i, s) for i, s in group if cache.get(i) is not None]
        if not done:
            continue
        images = load_images(done[0][1], CAMERAS)
        bank.append(encode_frame(pipe, images))
        for i, s in done:
            views = question_views(s, recipe)
            p = frame_prompt(pipe, bank[-1], s.question, views)
            attn = cache.get(i)
            grids = [real_grid(pipe.format.tiling, images[c], size) for c in views]
            prior = point_prior([s.question, s.answer], views, grid, grids)
            if prior.numel() != attn.numel():
                raise LiteVLMError(f"the cached label of {s.id} does not fit its prompt: delete {cache.folder}")
            target = label(attn, prior, recipe.prior_weight)
            answer = pipe.tokenizer.encode(s.answer) + [pipe.tokenizer.eos_id] if s.answer.strip() else None
            items.append(
                Item(len(bank) - 1, views, s.question, p.ids[0].tolist(), p.view_spans, target, attn, prior, answer)
            )
    return bank, items


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def item_inputs(model, bank, item: Item):
    ids = torch.tensor([item.ids], device=model.device)
    visual = torch.cat([bank[item.frame][c] for c in item.views]).to(model.device)
    with torch.no_grad():
        embeds = model.embed(ids, visual)
    return embeds, torch.arange(len(item.ids), device=model.device)[None]


def item_scores(selector: TokenSelector, model, bank, item: Item, tiling=None, module=None) -> torch.Tensor:
    """The selector's (N,) scores for an item, c-tag features included (placed by the prompt format's tiling).

    `module`: the selector wrapped for data parallelism (`litevlm.dist.ddp`), called instead; a question without
    c-tags then gets all-zero tag features, so that every parameter takes part in every step, as DDP requires.
    """
    embeds, positions = item_inputs(model, bank, item)
    tags = selector.tag_features(model, item.question, item.spans, tiling)
    if module is None or module is selector:
        return selector.scores(embeds, positions, item.spans, tags)[0]
    if tags is None:
        tags = torch.zeros(2, sum(e - b for _, b, e in item.spans), device=model.device)
    return module(embeds, positions, item.spans, tags)[0]


def kl_loss(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) over the visual tokens, (N,) each."""
    logq = F.log_softmax(scores.float(), -1)
    return (target * (torch.log(target.clamp_min(1e-12)) - logq)).sum()


def soft_keep_bias(scores: torch.Tensor, keep_ratio: float, temperature: float) -> torch.Tensor:
    """log m (N,) of a soft keep mask over the visual tokens, m = sigmoid((s - threshold) / (temperature * std(s))),
    the threshold midway between the k-th and the (k+1)-th score (k = keep_count(N, r)), threshold and spread held
    fixed: near 0 for the tokens a hard top-k keeps, very negative for the ones it drops, and differentiable in the
    scores near the cut."""
    n = scores.numel()
    k = keep_count(n, keep_ratio)
    s = scores.float()
    if k == n:  # everything is kept
        return s * 0.0
    top = s.detach().topk(k + 1).values
    spread = temperature * s.detach().std().clamp_min(1e-6)
    return F.logsigmoid((s - 0.5 * (top[k - 1] + top[k])) / spread)


def hard_keep_bias(scores: torch.Tensor, keep_ratio: float, temperature: float, floor: float = -30.0) -> torch.Tensor:
    """The top-k keep mask itself in the forward pass (0 for a kept token, `floor` for a dropped one: read by no
    one), with the gradient of `soft_keep_bias` (a straight-through estimate). A soft mask alone in the forward pass
    lets training crowd scores at the cut, where every token is half kept; at inference each is kept or not."""
    soft = soft_keep_bias(scores, keep_ratio, temperature)
    n = scores.numel()
    hard = torch.full_like(soft, floor).index_fill(0, scores.detach().topk(keep_count(n, keep_ratio)).indices, 0.0)
    return hard + (soft - soft.detach())


def answer_loss(
    model, embeds, positions, view_spans, answer: Sequence[int], scores: torch.Tensor, keep_ratio: float, temperature
) -> torch.Tensor:
    """The answer objective: KL(full || pruned) of the model's next-token distributions over the answer, teacher-forced.

    "full" reads the whole prompt; "pruned" the same prompt with the top-r tokens alone (`hard_keep_bias` added to
    the attention logits in every layer: a dropped token is read by no one, as when pruning removes it). The
    gradient reaches the scores alone (the model is frozen), through the soft mask's tokens near the cut: those
    whose keeping changes what the model says."""
    lm = model.language_model
    t, dev = embeds.shape[1], embeds.device
    x, pos = with_answer(lm, embeds, positions, list(answer)[:-1])  # the last answer token predicts nothing
    n = x.shape[1]
    rows = torch.arange(t - 1, n, device=dev)  # the rows that predict each answer token
    with torch.no_grad():
        full = F.log_softmax(model.lm_head(lm(x, pos)[:, rows]).float(), -1)
    mask = column_mask(n, view_spans, hard_keep_bias(scores, keep_ratio, temperature), embeds.dtype)
    pruned = F.log_softmax(model.lm_head(lm(x, pos, mask=mask)[:, rows]).float(), -1)
    return (full.exp() * (full - pruned)).sum(-1).mean()


def topk_recall(scores: torch.Tensor, target: torch.Tensor, sizes: Sequence[int], r: float) -> float:
    """Share of the target's mass that the top-r of `scores` keeps (1.0 = keeps everything that matters)."""
    k = keep_count(int(sum(sizes)), r)
    return float(target[scores.topk(k).indices].sum())


@torch.no_grad()
def agreement(model, selector: TokenSelector | None, bank, items: list[Item], ratios=(0.2, 0.5), tiling=None) -> dict:
    """Label mass kept at each r by the selector (or FastV K=1 when selector is None), mean over items."""
    if not items:
        return {}
    out = {r: [] for r in ratios}
    kl = []
    for it in items:
        embeds, positions = item_inputs(model, bank, it)
        with _autocast(model):
            if selector is None:
                s = fastv_scores(model, embeds, positions, it.spans, 1).float().clamp_min(1e-12).log()  # layer 0's
            else:
                s = item_scores(selector, model, bank, it, tiling).float()
        kl.append(float(kl_loss(s, it.target.to(s.device))))
        sizes = [e - b for _, b, e in it.spans]
        for r in ratios:
            out[r].append(topk_recall(s.cpu(), it.target, sizes, r))
    res = {f"kept_label_mass@{r}": round(sum(v) / len(v), 4) for r, v in out.items()}
    res["kl"] = round(sum(kl) / len(kl), 4)
    return res


def _autocast(model):
    """On a GPU, autocast to the dtype of a bf16 / fp16 target (the selector's weights stay fp32); else nothing."""
    low = model.dtype in (torch.bfloat16, torch.float16) and model.device.type == "cuda"
    return torch.autocast(model.device.type, dtype=model.dtype if low else torch.bfloat16, enabled=low)


def train_token_selector(
    model_dir="drive-tiny",
    recipe: TokenRecipe | None = None,
    progress: bool = True,
    out_dir: str | Path | None = None,
    data: str | Path | None = None,
    images_root: str | Path | None = None,
    d: Dist | None = None,
) -> Path | None:
    """Train and save a TokenSelector for a checkpoint (a name or folder, or a `litevlm.models.Loaded`) into
    `modules_dir(loaded, out_dir)`/token_selector: on synthetic frames, or with `data` on the user's DriveLM data,
    validated on its held-out scenes (`scene_split(..., recipe.val_fraction, seed=recipe.seed)`).

    Under torchrun (`d`, `litevlm.dist.init_dist`; `data` only) each rank labels its share of the frames into the
    shared cache, every rank then reads all labels, trains its share of each batch under DDP, and rank 0 validates
    and saves; the other ranks return None.
    """
    from litevlm.data.source import load_data, scene_split
    from litevlm.models import Loaded, load_model, modules_dir
    from litevlm.pipeline import Pipeline

    d = d or Dist()
    recipe = recipe or TokenRecipe()
    if recipe.teacher_answer not in ("greedy", "reference"):
        raise LiteVLMError(f"teacher_answer must be greedy or reference; got {recipe.teacher_answer!r}")
    if not 0.0 <= recipe.saliency_weight <= 1.0:
        raise LiteVLMError(f"saliency_weight is a share of the label, within [0, 1]; got {recipe.saliency_weight}")
    if data is None and d.world_size > 1:
        raise LiteVLMError("under torchrun the recipe needs --data: synthetic frames are labelled in one process")
    samples = load_data(data, images_root) if data is not None else None  # checked before anything runs
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    loaded = model_dir if isinstance(model_dir, Loaded) else load_model(model_dir)
    sources = recipe_sources(model=loaded.path, init=recipe.init)  # before the selector is saved beside the model
    model = loaded.model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    pipe = Pipeline.from_loaded(loaded, max_new_tokens=recipe.answer_tokens)
    # The budget starts after setup (loading the target, making its backend: a native build can take a minute).
    t_start = time.time()
    deadline = t_start + recipe.minutes * 60
    tiling = pipe.format.tiling
    rng = random.Random(recipe.seed)
    shown = progress and d.is_main

    # Labels take about a third of the budget at most; training gets the rest.
    label_deadline = t_start + recipe.minutes * 60 * 0.4
    if samples is None:
        bank, items = build_items(pipe, recipe, range(recipe.frames), rng, label_deadline, progress)
        vbank, val = build_items(
            pipe, recipe, range(recipe.frames, recipe.frames + recipe.val_frames), rng, math.inf, progress
        )
        source = {"data": "synthetic", "seed": recipe.seed, "frames": len(bank), "val_frames": len(vbank)}
    else:
        kept, held = scene_split(samples, recipe.val_fraction, seed=recipe.seed)
        index = {id(s): i for i, s in enumerate(samples)}
        kept, held = kept[: recipe.questions or None], held[: recipe.val_questions]
        base = Path(out_dir) if out_dir is not None else loaded.path
        cache = LabelCache(base / ".cache" / "tokens" / cache_key(loaded, data, images_root, recipe), rank=d.rank)
        train_q, val_q = [(index[id(s)], s) for s in kept], [(index[id(s)], s) for s in held]
        # each rank labels every W-th question (a frame shared by two ranks is encoded by both)
        left = label_questions(pipe, frame_groups(shard(train_q, d)), recipe, cache, label_deadline, shown)
        label_questions(pipe, frame_groups(shard(val_q, d)), recipe, cache, math.inf, shown)
        barrier(d)
        cache.reload()  # every rank's labels
        bank, items = data_items(pipe, frame_groups(train_q), recipe, cache, shown, "training prompts")
        if d.is_main:
            vbank, val = data_items(pipe, frame_groups(val_q), recipe, cache, shown, "held-out prompts")
        else:
            vbank, val = [], []
        source = {
            "data": str(data),
            "questions": len(items),
            "unlabelled_by_the_deadline": round(all_reduce_mean(float(left), d) * d.world_size),
            "val_questions": len(val),
            "val_scenes": len({s.scene_id for s in held}),
            "split": f"scene_split(fraction={recipe.val_fraction}, seed={recipe.seed})",
            "labels_from_cache": cache.cached,
            "cache": str(cache.folder),
            "ranks": d.world_size,
        }
    if not items:
        raise LiteVLMError("no training items were labelled within the time budget; raise --minutes")
    if recipe.init is not None:  # fine-tune a trained selector: the recipe takes its shape and inputs
        selector = TokenSelector.load(recipe.init, model).float()
        selector.cfg = replace(selector.cfg, keep_ratio=recipe.keep_ratio, diversity=recipe.diversity)
        c = selector.cfg
        recipe = replace(
            recipe,
            min_per_view=c.min_per_view,
            mlp_hidden=c.mlp_hidden,
            use_tags=c.use_tags,
            shared_layer=c.shared_layer,
            reads=c.reads,
        )
    else:
        selector = TokenSelector.from_model(
            model,
            SelectorConfig(
                recipe.keep_ratio,
                recipe.min_per_view,
                recipe.mlp_hidden,
                use_tags=recipe.use_tags,
                shared_layer=recipe.shared_layer,
                reads=recipe.reads,
                diversity=recipe.diversity,
            ),
        ).float()
    before = {}
    if d.is_main:
        before = {
            "fastv_k1": agreement(model, None, vbank, val, tiling=tiling),
            "selector_init": agreement(model, selector, vbank, val, tiling=tiling),
        }
    module = ddp(selector, d)  # rank 0's initial weights on every rank; gradients averaged over the ranks

    params = [p for p in selector.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps_per_epoch = math.ceil(len(items) / recipe.batch)
    total = steps_per_epoch * recipe.epochs
    bar = tqdm(total=total, desc="training token selector", disable=not shown)
    losses, kls, answer_losses, step, t_loop = [], [], [], 0, time.time()
    draw = random.Random(recipe.seed + 1)  # the answer objective's keep ratios
    selector.train()
    for epoch in range(recipe.epochs):
        order = list(range(len(items)))
        rng.shuffle(order)
        for s in range(steps_per_epoch):
            stop = time.time() > deadline or step >= total
            if all_reduce_mean(float(stop), d) > 0:  # every rank stops at the same step
                break
            lr = recipe.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            for g in opt.param_groups:
                g["lr"] = lr
            batch = [items[i] for i in order[s * recipe.batch : (s + 1) * recipe.batch]]
            opt.zero_grad(set_to_none=True)
            loss_sum = kl_sum = 0.0
            for it, share in batch_share(batch, d):
                with _autocast(model):
                    scores = item_scores(selector, model, bank, it, tiling, module)
                    loss = kl_loss(scores, it.target.to(model.device))
                    kl_sum += float(loss.detach()) / len(batch)
                    if recipe.answer_weight > 0 and it.answer:
                        embeds, positions = item_inputs(model, bank, it)
                        r = draw.choice(recipe.answer_ratios)
                        answer = it.answer[: recipe.answer_tokens_max + 1]
                        temp = recipe.answer_temperature
                        a = answer_loss(model, embeds, positions, it.spans, answer, scores, r, temp)
                        answer_losses.append(float(a.detach()))
                        loss = loss + recipe.answer_weight * a
                loss = loss / len(batch)
                if d.world_size > 1:  # DDP averages over the ranks: each rank's sum counts W times
                    loss = loss * share
                loss.backward()
                loss_sum += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss_sum)
            kls.append(kl_sum)
            step += 1
            if step == 20:  # re-plan the cosine schedule to what the time budget allows
                per_step = all_reduce_mean((time.time() - t_loop) / 20, d)
                left_s = all_reduce_mean(deadline - time.time(), d)
                total = max(step + 1, min(total, int(step + left_s / per_step)))
                bar.total = total
            bar.update(1)
            if step % 10 == 0:
                shown_loss = {"loss": f"{sum(losses[-20:]) / len(losses[-20:]):.3f}"}
                if answer_losses:
                    shown_loss["answer_kl"] = f"{sum(answer_losses[-200:]) / len(answer_losses[-200:]):.4f}"
                bar.set_postfix(shown_loss)
    bar.close()
    selector.eval()
    if not d.is_main:
        barrier(d)
        return None
    after = agreement(model, selector, vbank, val, tiling=tiling)
    meta = {
        "steps": step,
        "items": len(items),
        "frames_labelled": len(bank),
        "train_seconds": round(time.time() - t_start, 1),
        "final_kl": round(sum(kls[-20:]) / max(1, len(kls[-20:])), 4) if kls else None,
        "final_answer_kl": round(sum(answer_losses[-200:]) / len(answer_losses[-200:]), 5) if answer_losses else None,
        "source": source,
        "validation": {**before, "selector": after},
    }
    out = modules_dir(loaded, out_dir)
    selector.save(out, recipe={**asdict(recipe), "sources": sources}, extra={"training": meta})
    (out / "token_selector" / "train_log.json").write_text(json.dumps({"loss": losses, **meta}, indent=1))
    barrier(d)
    return out / "token_selector"


def batch_share(batch: list[Item], d: Dist) -> list[tuple[Item, float]]:
    """This rank's items of a batch, (item, weight): items r, r + W, ... weighted W, padded with weight-0 items to
    ceil(len / W), so that every rank runs as many forward and backward passes (DDP's collectives pair them up).
    A world of one: the whole batch."""
    if d.world_size == 1:
        return [(it, 1.0) for it in batch]
    mine = [(it, float(d.world_size)) for it in batch[d.rank :: d.world_size]]
    return mine + [(batch[0], 0.0)] * (math.ceil(len(batch) / d.world_size) - len(mine))
