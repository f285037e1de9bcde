"""Training recipe for the VLM itself: an InternVL-architecture model from scratch on synthetic frames.

Frames come from `litevlm.data.synthetic` (seeded, never repeated across splits). A frame's views
are encoded once per step and several of its questions are trained on them: the frame's prompt
prefix (user turn with the view blocks) is followed by K question/answer blocks packed into one
sequence, each block attending to the prefix and to itself only, with positions restarting after
the prefix, which is exactly what K separate prompts would compute, at a fraction of the cost.
Half the frames keep only the views some of their questions need (plus random extras), so the
model learns to answer from a selected subset of views, each with its camera marker, as the
pipeline's view selection later feeds it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.config import TextConfig, VisionConfig, VLMConfig
from litevlm.model.vlm import VLM, normalize_tiles

IGNORE = -100


def drive_tiny_config(tokenizer) -> VLMConfig:
    """The embedded default model's shapes: a few million parameters, 16 visual tokens per 112 px tile."""
    return VLMConfig(
        vision=VisionConfig(hidden_size=192, num_layers=4, num_heads=6, intermediate_size=576, image_size=112, patch_size=14),
        text=TextConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
            intermediate_size=640, rope_theta=10000.0, qkv_bias=True, tie_embeddings=True, max_position_embeddings=4096,
        ),
        image_token_id=tokenizer.image_id, img_start_id=tokenizer.img_start_id, img_end_id=tokenizer.img_end_id,
        eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, tiles_per_view=1, name="drive-tiny",
    )


@dataclass
class VLMRecipe:
    frames: int = 6000  # distinct training frames (seed, 0..frames-1)
    seed: int = 0
    minutes: float = 40.0  # wall-clock budget; training stops at the budget or at `steps`
    steps: int = 100000
    batch_frames: int = 8
    questions_per_frame: int = 6
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.05
    warmup: int = 200
    weight_decay: float = 0.05
    view_subset_prob: float = 0.5
    token_drop_prob: float = 0.35  # frames whose visual tokens are randomly thinned (keep 30-95%)
    render_size: tuple[int, int] = (400, 225)
    vocab_size: int = 1024
    threads: int = 2
    first_frame: int = 0  # training frames are (seed, first_frame .. first_frame + frames - 1)
    closed_weight: float = 1.0  # sampling weight of closed (yes/no, multiple choice) questions vs open ones
    init: str | None = None  # continue from this checkpoint (its tokenizer and weights)


class FrameBank:
    """Rendered, tiled views of the training frames as uint8, plus their QA, prepared once."""

    def __init__(self, recipe: VLMRecipe, cfg: VLMConfig, tokenizer, progress: bool = True):
        from litevlm.data.synthetic import make_frame, render_views
        from litevlm.model.vlm import image_to_uint8_tiles

        s, tpv = cfg.vision.image_size, cfg.tiles_per_view
        self.tiles = torch.empty(recipe.frames, len(CAMERAS) * tpv, 3, s, s, dtype=torch.uint8)
        self.qas: list[list[tuple[list[int], list[int], tuple[str, ...]]]] = []
        for i in tqdm(range(recipe.frames), desc="rendering frames", disable=not progress):
            frame = make_frame(recipe.seed, recipe.first_frame + i)
            views = render_views(frame, size=recipe.render_size)
            self.tiles[i] = torch.from_numpy(np.concatenate([image_to_uint8_tiles(views[c], s, tpv) for c in CAMERAS]))
            self.qas.append([(tokenizer.encode(q.question), tokenizer.encode(q.answer), tuple(q.views), q.closed) for q in frame.qas])
        self.tpv = tpv

    def pixels(self, frame: int, views: list[str]) -> torch.Tensor:
        idx = [CAMERAS.index(c) * self.tpv + j for c in views for j in range(self.tpv)]
        return normalize_tiles(self.tiles[frame, idx])


def pack_frame(tokenizer, views: list[str], tokens_per_view: int, blocks: list[tuple[list[int], list[int]]]):
    """One frame's prefix + K question/answer blocks -> ids, labels, positions, block id per token."""
    from litevlm.model.prompt import question_suffix, view_prefix

    prefix = view_prefix(tokenizer, views, tokens_per_view).ids
    ids, labels, pos, block = list(prefix), [IGNORE] * len(prefix), list(range(len(prefix))), [0] * len(prefix)
    for b, (q, a) in enumerate(blocks, start=1):
        seg = question_suffix(tokenizer, q)
        ans = a + [tokenizer.eos_id]
        ids += seg + ans
        labels += [IGNORE] * (len(seg) - 1) + ans + [IGNORE]
        pos += list(range(len(prefix), len(prefix) + len(seg) + len(ans)))
        block += [b] * (len(seg) + len(ans))
    return ids, labels, pos, block


def block_mask(block: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) block ids -> (B, 1, T, T) bool: causal, and a block sees the prefix (0) and itself only."""
    t = block.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    same = (block[:, :, None] == block[:, None, :]) | (block[:, None, :] == 0)
    m = causal & same & valid[:, None, :]
    m |= torch.eye(t, dtype=torch.bool)  # padding rows attend to themselves (no empty softmax rows)
    return m[:, None]


def make_batch(bank: FrameBank, tokenizer, cfg: VLMConfig, recipe: VLMRecipe, rng: random.Random):
    frames = rng.sample(range(len(bank.qas)), recipe.batch_frames)
    tpv_tokens = cfg.tokens_per_tile * cfg.tiles_per_view
    seqs, pixels, keeps = [], [], []
    for f in frames:
        qas = bank.qas[f]
        views = list(CAMERAS)
        pool = qas
        if rng.random() < recipe.view_subset_prob:
            anchor = rng.choice(qas)
            keep = set(anchor[2]) | {c for c in CAMERAS if rng.random() < 0.15}
            views = [c for c in CAMERAS if c in keep]
            pool = [qa for qa in qas if set(qa[2]) <= keep]
        weights = [recipe.closed_weight if qa[3] else 1.0 for qa in pool]
        chosen = _weighted_sample(pool, weights, min(recipe.questions_per_frame, len(pool)), rng)
        seq = pack_frame(tokenizer, views, tpv_tokens, [(q, a) for q, a, _, _ in chosen])
        keep = torch.ones(len(views) * tpv_tokens, dtype=torch.bool)
        if rng.random() < recipe.token_drop_prob:
            seq, keep = drop_visual_tokens(seq, tokenizer.image_id, len(views), tpv_tokens, rng)
        seqs.append(seq)
        keeps.append(keep)
        pixels.append(bank.pixels(f, views))
    t = max(len(s[0]) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, t), tokenizer.pad_id)
    labels = torch.full((b, t), IGNORE)
    pos = torch.zeros((b, t), dtype=torch.long)
    block = torch.full((b, t), -1)
    valid = torch.zeros((b, t), dtype=torch.bool)
    for i, (a, l, p, bl) in enumerate(seqs):
        n = len(a)
        ids[i, :n], labels[i, :n], pos[i, :n], block[i, :n] = torch.tensor(a), torch.tensor(l), torch.tensor(p), torch.tensor(bl)
        valid[i, :n] = True
    return ids, labels, pos, block_mask(block, valid), torch.cat(pixels), torch.cat(keeps)


def _weighted_sample(items: list, weights: list[float], k: int, rng: random.Random) -> list:
    """k distinct items, drawn with probability proportional to weight (without replacement)."""
    keys = [rng.random() ** (1.0 / w) for w in weights]  # Efraimidis-Spirakis
    order = sorted(range(len(items)), key=lambda i: -keys[i])
    return [items[i] for i in order[:k]]


def drop_visual_tokens(seq, image_id: int, n_views: int, per_view: int, rng: random.Random):
    """Remove a random fraction of a frame's visual tokens (at least one per view); the rest keep
    their positions, as token selection at inference leaves them. Teaches the model pruned inputs."""
    ratio = rng.uniform(0.3, 0.95)
    keep = torch.rand(n_views * per_view, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < ratio
    for v in range(n_views):
        keep[v * per_view + rng.randrange(per_view)] = True
    ids, labels, pos, block = seq
    out, k = ([], [], [], []), 0
    for i, tok in enumerate(ids):
        if tok == image_id:
            k += 1
            if not keep[k - 1]:
                continue
        for lst, src in zip(out, (ids, labels, pos, block)):
            lst.append(src[i])
    return out, keep


def lr_at(step: int, total: int, recipe: VLMRecipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = min(1.0, (step - recipe.warmup) / max(1, total - recipe.warmup))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def init_weights(model: VLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("lambda_1") or name.endswith("lambda_2"):
            p.data.fill_(0.1)
        elif p.ndim >= 2:
            p.data.normal_(0, 0.02, generator=g)
        elif "norm" in name and name.endswith("weight"):
            p.data.fill_(1.0)
        else:
            p.data.zero_()


def train_vlm(out_dir: str | Path, recipe: VLMRecipe, progress: bool = True) -> Path:
    from litevlm.data.synthetic import question_corpus
    from litevlm.data.tokenizer import train_default

    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    out = Path(out_dir)
    t_start = time.time()
    if recipe.init:
        from litevlm.data.tokenizer import Tokenizer
        from litevlm.model.hf import load_native

        tokenizer = Tokenizer.from_dir(recipe.init)
        model = load_native(recipe.init)
        cfg = model.cfg
    else:
        tokenizer = train_default(question_corpus(n_frames=2000, seed=recipe.seed), vocab_size=recipe.vocab_size)
        cfg = drive_tiny_config(tokenizer)
        model = VLM(cfg)
        init_weights(model, recipe.seed)
    bank = FrameBank(recipe, cfg, tokenizer, progress)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    rng = random.Random(recipe.seed)
    deadline = time.time() + recipe.minutes * 60
    # Estimate the total number of steps the budget allows after a short timing, for the LR schedule.
    total = recipe.steps
    bar = tqdm(total=recipe.steps, desc="training vlm", disable=not progress)
    losses, step, t_loop, last_save = [], 0, time.time(), time.time()
    model.train()
    while step < total and time.time() < deadline:
        ids, labels, pos, mask, pixels, keep = make_batch(bank, tokenizer, cfg, recipe, rng)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, recipe)
        visual = model.encode_tiles(pixels).reshape(-1, cfg.text.hidden_size)[keep]
        x = model.embed(ids, visual)
        hidden = model.language_model(x, pos, mask=mask)
        sel = labels != IGNORE
        loss = F.cross_entropy(model.lm_head(hidden[sel]), labels[sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step == 20:  # re-plan the schedule to the time budget
            per_step = (time.time() - t_loop) / 20
            total = min(recipe.steps, int(step + (deadline - time.time()) / per_step))
            bar.total = total
        bar.update(1)
        if time.time() - last_save > 600:  # a usable checkpoint survives an interrupted run
            _save(model, tokenizer, out, recipe, step, losses, t_start)
            model.train()
            last_save = time.time()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    bar.close()
    return _save(model, tokenizer, out, recipe, step, losses, t_start)


def _save(model, tokenizer, out: Path, recipe: VLMRecipe, step: int, losses: list[float], t_start: float) -> Path:
    from litevlm.model.hf import save_native

    model.eval()
    meta = {"recipe": asdict(recipe), "steps": step, "train_seconds": round(time.time() - t_start, 1),
            "final_loss": float(np.mean(losses[-100:])) if losses else None}
    save_native(model, out, extra_meta=meta)
    tokenizer.save(out)
    (out / "train_log.json").write_text(json.dumps({"loss": losses[::10], **meta}, indent=1))
    return out
