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
teacher at every budget r at once. Frames come from the synthetic training stream (seed 0; the
held-out split is seed 1); view sets mix "the views the question needs (plus random extras)" with
"all six", as the pipeline feeds the selector.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.config import flag
from litevlm.errors import LiteVLMError
from litevlm.select.tokens import (
    SelectorConfig,
    TokenSelector,
    attention_rows,
    box_cells,
    fastv_scores,
    keep_count,
    visual_index,
)


@dataclass
class TokenRecipe:
    frames: int = flag(1200, "synthetic frames (seed, 0..frames-1) whose prompts are labelled and trained on")
    seed: int = flag(0, "frames (seed, 0..frames-1); the held-out split is seed 1")
    questions_per_frame: int = 8
    val_frames: int = 60  # frames after the training ones, same seed, for the agreement report
    minutes: float = flag(10.0, "wall-clock budget for labelling and training (labelling takes at most 40%)")
    epochs: int = flag(4, "passes over the labelled prompts (the budget may stop it sooner)")
    batch: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    band: tuple[int, int] | None = None  # teacher layers [a, b); None: every layer but the first, [1, L)
    last_row_weight: float = 0.5  # share of the last prompt token's row; the answer rows share the rest
    row_norm: bool = False  # normalise each teacher row over the visual tokens before averaging
    prior_weight: float = 0.15  # share of the box prior in the label
    all_views_prob: float = 0.5  # else: the question's views plus random extras
    extra_view_prob: float = 0.15
    render_size: tuple[int, int] = (400, 225)
    keep_ratio: float = 0.5  # defaults stored in the checkpoint for select()
    shared_layer: bool = flag(
        True,
        "train a copy of decoder layer 0 with the head and prune before the decoder (default: the head reads "
        "the model's own frozen layer 0, which then runs once and the rest of the decoder sees only the kept tokens)",
        flag="--own-layer",
    )
    min_per_view: int = 1
    mlp_hidden: int = 128
    use_tags: bool = True  # the selector's c-tag cell bonuses
    threads: int = flag(2, "torch threads")


# ---------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------


def box_prior(
    boxes_by_view: dict[str, list[Sequence[float]]], views: Sequence[str], grid: int, tiles_per_view: int
) -> torch.Tensor:
    """(N,) distribution over the visual tokens of `views` (prompt order) covered by the boxes; zeros if none."""
    per_view = grid * grid * tiles_per_view
    prior = torch.zeros(len(views) * per_view)
    for i, cam in enumerate(views):
        for box in boxes_by_view.get(cam, []):
            for j in box_cells(box, grid, tiles_per_view):
                prior[i * per_view + j] = 1.0
    return prior / prior.sum() if prior.sum() > 0 else prior


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
    ans = torch.tensor([list(answer_ids)], device=dev)
    x = torch.cat([embeds, lm.embed_tokens(ans).to(embeds.dtype)], 1)
    pos = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(ans.shape[1], device=dev)[None]], 1)
    rows = torch.arange(t - 1, t + ans.shape[1] - 1, device=dev)  # last prompt token, then the answer tokens
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


def pick_views(rng: random.Random, needed: Sequence[str], recipe: TokenRecipe) -> tuple[str, ...]:
    if rng.random() < recipe.all_views_prob or not needed:
        return tuple(CAMERAS)
    keep = set(needed) | {c for c in CAMERAS if rng.random() < recipe.extra_view_prob}
    return tuple(c for c in CAMERAS if c in keep)


def prompt_embeds(model, tokenizer, visual_by_cam: dict[str, torch.Tensor], question: str, views: Sequence[str]):
    """The pipeline's prompt for `question` over `views`: (ids, embeds (1, T, C), positions (1, T), view_spans)."""
    from litevlm.model.prompt import build_prompt

    tpv = model.cfg.tokens_per_tile * model.cfg.tiles_per_view
    layout = build_prompt(tokenizer, question, list(views), tpv)
    ids = torch.tensor([layout.ids], device=model.device)
    visual = torch.cat([visual_by_cam[c] for c in views])
    embeds = model.embed(ids, visual)
    return layout.ids, embeds, torch.arange(ids.shape[1], device=model.device)[None], layout.view_spans


def build_items(
    model, tokenizer, recipe: TokenRecipe, frame_range: range, rng: random.Random, deadline: float, progress: bool
):
    """Render, encode and label frames: (visual bank [frames] of {cam: (tokens, C)}, items)."""
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.model.vlm import image_to_tiles

    cfg = model.cfg
    grid = cfg.vision.grid // 2
    bank, items = [], []
    for i in tqdm(frame_range, desc="labelling frames", disable=not progress):
        if time.time() > deadline:
            break
        frame = make_frame(recipe.seed, i)
        images = render_views(frame, size=tuple(recipe.render_size))
        pixels = torch.cat([image_to_tiles(images[c], cfg.vision.image_size, cfg.tiles_per_view) for c in CAMERAS]).to(
            model.device
        )
        with torch.no_grad():
            visual = model.encode_tiles(pixels).reshape(
                len(CAMERAS), -1, cfg.text.hidden_size
            )  # (6, tokens per view, C)
        bank.append({c: visual[j] for j, c in enumerate(CAMERAS)})
        qas = rng.sample(frame.qas, min(recipe.questions_per_frame, len(frame.qas)))
        for qa in qas:
            views = pick_views(rng, qa.views, recipe)
            ids, embeds, positions, spans = prompt_embeds(model, tokenizer, bank[-1], qa.question, views)
            answer = tokenizer.encode(qa.answer) + [tokenizer.eos_id]
            attn = teacher_attention(
                model, embeds, positions, spans, answer, recipe.band, recipe.last_row_weight, recipe.row_norm
            ).cpu()
            prior = box_prior(frame_boxes(frame, qa.question, qa.answer, qa.views), views, grid, cfg.tiles_per_view)
            items.append(
                Item(
                    len(bank) - 1, views, qa.question, ids, spans, label(attn, prior, recipe.prior_weight), attn, prior
                )
            )
    return bank, items


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def item_inputs(model, bank, item: Item):
    ids = torch.tensor([item.ids], device=model.device)
    visual = torch.cat([bank[item.frame][c] for c in item.views])
    with torch.no_grad():
        embeds = model.embed(ids, visual)
    return embeds, torch.arange(len(item.ids), device=model.device)[None]


def item_scores(selector: TokenSelector, model, bank, item: Item) -> torch.Tensor:
    """The selector's (N,) scores for an item, c-tag features included."""
    embeds, positions = item_inputs(model, bank, item)
    return selector.scores(embeds, positions, item.spans, selector.tag_features(model, item.question, item.spans))[0]


def kl_loss(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) over the visual tokens, (N,) each."""
    logq = F.log_softmax(scores.float(), -1)
    return (target * (torch.log(target.clamp_min(1e-12)) - logq)).sum()


def topk_recall(scores: torch.Tensor, target: torch.Tensor, sizes: Sequence[int], r: float) -> float:
    """Share of the target's mass that the top-r of `scores` keeps (1.0 = keeps everything that matters)."""
    k = keep_count(int(sum(sizes)), r)
    return float(target[scores.topk(k).indices].sum())


@torch.no_grad()
def agreement(model, selector: TokenSelector | None, bank, items: list[Item], ratios=(0.2, 0.5)) -> dict:
    """Label mass kept at each r by the selector (or FastV K=1 when selector is None), mean over items."""
    out = {r: [] for r in ratios}
    kl = []
    for it in items:
        embeds, positions = item_inputs(model, bank, it)
        if selector is None:
            x = model.language_model(embeds, positions, end_layer=1)
            s = fastv_scores(model, x, positions, it.spans, 1).clamp_min(1e-12).log()
        else:
            s = item_scores(selector, model, bank, it)
        kl.append(float(kl_loss(s, it.target.to(s.device))))
        sizes = [e - b for _, b, e in it.spans]
        for r in ratios:
            out[r].append(topk_recall(s.cpu(), it.target, sizes, r))
    res = {f"kept_label_mass@{r}": round(sum(v) / len(v), 4) for r, v in out.items()}
    res["kl"] = round(sum(kl) / len(kl), 4)
    return res


def train_token_selector(
    model_dir: str | Path, recipe: TokenRecipe | None = None, progress: bool = True, out_dir: str | Path | None = None
) -> Path:
    """Train and save a TokenSelector for the model at `model_dir` (into `out_dir or model_dir`/token_selector)."""
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.hf import load_native
    from litevlm.models import resolve_model_dir

    recipe = recipe or TokenRecipe()
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    t_start = time.time()
    deadline = t_start + recipe.minutes * 60
    path = resolve_model_dir(model_dir)
    model = load_native(path).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = Tokenizer.from_dir(path)
    rng = random.Random(recipe.seed)

    # Labels take about a third of the budget at most; training gets the rest.
    label_deadline = t_start + recipe.minutes * 60 * 0.4
    bank, items = build_items(model, tokenizer, recipe, range(recipe.frames), rng, label_deadline, progress)
    vbank, val = build_items(
        model, tokenizer, recipe, range(recipe.frames, recipe.frames + recipe.val_frames), rng, math.inf, progress
    )
    if not items:
        raise LiteVLMError("no training items were labelled within the time budget; raise --minutes")
    selector = TokenSelector.from_model(
        model,
        SelectorConfig(
            recipe.keep_ratio,
            recipe.min_per_view,
            recipe.mlp_hidden,
            use_tags=recipe.use_tags,
            shared_layer=recipe.shared_layer,
        ),
    ).float()
    before = {"fastv_k1": agreement(model, None, vbank, val), "selector_init": agreement(model, selector, vbank, val)}

    params = [p for p in selector.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps_per_epoch = math.ceil(len(items) / recipe.batch)
    total = steps_per_epoch * recipe.epochs
    bar = tqdm(total=total, desc="training token selector", disable=not progress)
    losses, step, t_loop = [], 0, time.time()
    selector.train()
    for epoch in range(recipe.epochs):
        order = list(range(len(items)))
        rng.shuffle(order)
        for s in range(steps_per_epoch):
            if time.time() > deadline or step >= total:
                break
            lr = recipe.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            for g in opt.param_groups:
                g["lr"] = lr
            batch = [items[i] for i in order[s * recipe.batch : (s + 1) * recipe.batch]]
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for it in batch:
                loss = kl_loss(item_scores(selector, model, bank, it), it.target.to(model.device)) / len(batch)
                loss.backward()
                loss_sum += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss_sum)
            step += 1
            if step == 20:  # re-plan the cosine schedule to what the time budget allows
                per_step = (time.time() - t_loop) / 20
                total = max(step + 1, min(total, int(step + (deadline - time.time()) / per_step)))
                bar.total = total
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    bar.close()
    selector.eval()
    after = agreement(model, selector, vbank, val)
    meta = {
        "steps": step,
        "items": len(items),
        "frames_labelled": len(bank),
        "train_seconds": round(time.time() - t_start, 1),
        "final_kl": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4) if losses else None,
        "validation": {**before, "selector": after},
    }
    out = Path(out_dir) if out_dir is not None else path
    selector.save(out, recipe=asdict(recipe), extra={"training": meta})
    (out / "token_selector" / "train_log.json").write_text(json.dumps({"loss": losses, **meta}, indent=1))
    return out / "token_selector"
