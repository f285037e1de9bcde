"""Training recipe for the EAGLE draft head of a trained target VLM.

The data are the target's own answers (EAGLE-1 Table 6 and EAGLE-3 regenerate answers with the
target: the draft should imitate what the target says, not what a dataset says): synthetic training
frames (seed 0, the frames the VLM itself trained on, never the held-out seed-1 split), each
question answered greedily by the target with its images, batched. Along prompt + answer the
target's final post-norm hidden states are recorded. The head is then trained teacher-forced
(EAGLE 3.2): pair j = (f_j + noise, embedding of x_{j+1}) predicts f_{j+1}, with a SmoothL1 loss on
the feature and 0.1 x the cross-entropy between the target's next-token distribution
softmax(LMHead(f_{j+1})) and the draft's LMHead(f^_{j+1}), on the answer's pairs. Uniform noise on
the input features (relative to their RMS) makes the head robust to its own errors when it drafts
several tokens ahead; optional training-time-test passes (EAGLE-3) train on them directly.

The head is sized for a small target on a CPU, where a draft step must cost a small fraction of a
target step: a narrow MLP, a draft vocabulary of the tokens the target's answers use, and a window
over the prompt's last pairs; all three are stored in the head's config and used alike in training
and inference.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.config import flag
from litevlm.errors import LiteVLMError
from litevlm.spec.draft import DRAFT_SUBDIR, DraftConfig, DraftHead


@dataclass
class DraftRecipe:
    frames: int = flag(
        150, "synthetic frames (seed, 0..frames-1) whose questions (~18 each) the model answers to make the data"
    )
    seed: int = flag(0, "frames (seed, 0..frames-1); the held-out split is seed 1")
    max_new_tokens: int = 96  # answer length cap while generating the data
    view_subset_prob: float = 0.5  # prompts with only the needed views (+ random extras), as view selection feeds
    render_size: tuple[int, int] = (400, 225)
    gen_batch: int = 16  # questions answered at once while generating the data
    # The head's shape. On a small target the draft must be much cheaper than a target step: a narrow
    # MLP, a draft vocabulary of the tokens answers actually use, and a window over the prompt (the
    # target's features already carry what it saw).
    intermediate_size: int = flag(
        128, "the draft layer's MLP width (0: the target's)", flag="--intermediate", metavar="N"
    )
    draft_vocab: int = 256  # > 0: the draft proposes only the most frequent answer tokens (cheaper LM head)
    context: int = 32  # > 0: the draft sees only the last `context` prompt pairs (train and inference alike)
    minutes: float = flag(12.0, "wall-clock training budget (data generation not included)")
    epochs: int = 60  # upper bound on passes over the data
    batch: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # by value, as EAGLE
    feature_noise: float = 0.1  # U(-a, a) x feature RMS added to input features
    passes: int = flag(
        1, "training-time test: 1 = teacher forcing only (EAGLE-2); s > 1 also trains on the head's own s-1 predictions"
    )
    ce_weight: float = 0.1
    val_fraction: float = 0.05
    threads: int = flag(2, "torch threads")


# ------------------------------------------------------------------------------------------------
# Data: the target's answers and features
# ------------------------------------------------------------------------------------------------
@dataclass
class Sequence:
    embeds: torch.Tensor  # (n, C) what the target consumed: prompt (with visual tokens) + answer
    features: torch.Tensor  # (n - 1, C) the target's final post-norm hidden states at tokens 0..n-2
    prompt_len: int
    answer: list[int] = field(default_factory=list)  # the answer's token ids (the last n - prompt_len tokens)
    offset: int = 0  # position of the first token (> 0 once the prompt is windowed)

    def window(self, context: int) -> Sequence:
        """Only the last `context` prompt tokens (what a windowed draft sees), positions kept."""
        start = max(0, self.prompt_len - context) if context else 0
        return Sequence(
            self.embeds[start:], self.features[start:], self.prompt_len - start, self.answer, self.offset + start
        )


@torch.no_grad()
def greedy_batch(
    model, prompts: list[torch.Tensor], max_new_tokens: int, eos_id: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers for several prompts at once (left-padded, one static cache).

    prompts: embeddings (T_r, C) each -> per prompt (answer tokens up to and including EOS,
    hidden states (T_r + len(answer) - 1, C) at every token but the last).
    """
    lm = model.language_model
    b = len(prompts)
    lengths = [p.shape[0] for p in prompts]
    t = max(lengths)
    dev = prompts[0].device
    offset = torch.tensor([t - n for n in lengths], device=dev)  # left padding per row
    x = torch.zeros(b, t, prompts[0].shape[1], dtype=prompts[0].dtype, device=dev)
    for r, p in enumerate(prompts):
        x[r, t - p.shape[0] :] = p
    cols = torch.arange(t + max_new_tokens, device=dev)
    valid = cols[None, :] >= offset[:, None]  # (B, S): real (non-pad) slots
    positions = (torch.arange(t, device=dev)[None] - offset[:, None]).clamp(min=0)  # (B, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    mask = (causal[None] & valid[:, None, :t]) | torch.eye(t, dtype=torch.bool, device=dev)[
        None
    ]  # pad rows see themselves
    lm.setup_cache(b, t + max_new_tokens)
    hidden = lm(x, positions, slots=torch.arange(t, device=dev), mask=mask[:, None], kv_len=t)  # (B, T, C)
    tok = model.lm_head(hidden[:, -1]).argmax(-1)  # (B,)
    answers, steps = [tok], []
    done = tok == eos_id
    for i in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        pos = (torch.tensor(lengths, device=dev) + i)[:, None]  # (B, 1)
        h = lm(
            lm.embed_tokens(tok[:, None]),
            pos,
            slots=torch.tensor([t + i], device=dev),
            mask=valid[:, None, None, : t + i + 1],
            kv_len=t + i + 1,
        )  # (B, 1, C)
        steps.append(h[:, 0])
        tok = model.lm_head(h[:, 0]).argmax(-1)
        answers.append(tok)
        done |= tok == eos_id
    ans = torch.stack(answers, 1).tolist()  # (B, steps)
    step_h = torch.stack(steps, 1) if steps else hidden.new_zeros(b, 0, hidden.shape[-1])
    out = []
    for r in range(b):
        a = ans[r]
        a = a[: a.index(eos_id) + 1] if eos_id in a else a
        feats = torch.cat([hidden[r, offset[r] :], step_h[r, : len(a) - 1]])  # features at prompt + answer[:-1]
        out.append((a, feats))
    return out


@torch.no_grad()
def build_sequences(model, tokenizer, recipe: DraftRecipe, frames: range, progress: bool = True) -> list[Sequence]:
    """Answer every question of `frames` with the target; keep embeddings and features (fp16 on the CPU)."""
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.model.prompt import build_prompt
    from litevlm.model.vlm import image_to_tiles

    cfg = model.cfg
    rng = random.Random(recipe.seed)
    tpv = cfg.tokens_per_tile * cfg.tiles_per_view
    pending: list[tuple[int, torch.Tensor]] = []  # (expected answer length, prompt embeddings)
    seqs: list[Sequence] = []

    def flush():
        # Batch prompts whose reference answers have similar lengths: a batch runs as long as its longest answer.
        pending.sort(key=lambda p: p[0])
        for i in range(0, len(pending), recipe.gen_batch):
            chunk = [emb for _, emb in pending[i : i + recipe.gen_batch]]
            for emb, (answer, feats) in zip(chunk, greedy_batch(model, chunk, recipe.max_new_tokens, tokenizer.eos_id)):
                ans = model.language_model.embed_tokens(torch.tensor(answer, device=emb.device))
                seqs.append(Sequence(torch.cat([emb, ans]).half().cpu(), feats.half().cpu(), emb.shape[0], answer))
        pending.clear()

    for i in tqdm(frames, desc="target answers", disable=not progress):
        frame = make_frame(recipe.seed, i)
        views = render_views(frame, size=recipe.render_size)
        pixels = torch.cat([image_to_tiles(views[c], cfg.vision.image_size, cfg.tiles_per_view) for c in CAMERAS])
        visual = model.encode_tiles(pixels.to(model.device))  # (6 * tiles, tokens, C)
        visual = visual.view(len(CAMERAS), -1, visual.shape[-1])  # (view, tokens per view, C)
        for qa in frame.qas:
            cams = list(CAMERAS)
            if rng.random() < recipe.view_subset_prob:
                keep = set(qa.views) | {c for c in CAMERAS if rng.random() < 0.15}
                cams = [c for c in CAMERAS if c in keep]
            ids = build_prompt(tokenizer, qa.question, cams, tpv).ids
            vis = visual[[CAMERAS.index(c) for c in cams]]
            pending.append(
                (len(tokenizer.encode(qa.answer)), model.embed(torch.tensor([ids], device=model.device), vis)[0])
            )
        if len(pending) >= 8 * recipe.gen_batch:
            flush()
    if pending:
        flush()
    return seqs


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def collate(seqs: list[Sequence], device) -> dict[str, torch.Tensor]:
    """Right-padded pairs: features f_j, next embeddings x_{j+1}, targets f_{j+1}, loss mask on answer pairs."""
    n = max(s.features.shape[0] for s in seqs)  # pairs j = 0..n_r-2 per sequence, n_r - 1 = features
    c = seqs[0].features.shape[1]
    b = len(seqs)
    feats = torch.zeros(b, n, c)
    nxt = torch.zeros(b, n, c)
    target = torch.zeros(b, n, c)
    mask = torch.zeros(b, n, dtype=torch.bool)
    for r, s in enumerate(seqs):
        m = s.features.shape[0]  # = n_r - 1 pairs
        feats[r, :m] = s.features.float()
        nxt[r, :m] = s.embeds[1 : m + 1].float()
        target[r, : m - 1] = s.features[1:].float()
        # pair j predicts f_{j+1}, whose LM head gives x_{j+2}: answer pairs are j = T-1 .. n_r-3
        mask[r, s.prompt_len - 1 : m - 1] = True
    positions = torch.arange(n)[None] + torch.tensor([s.offset for s in seqs])[:, None]  # (B, T)
    return {
        k: v.to(device) for k, v in dict(feats=feats, nxt=nxt, target=target, mask=mask, positions=positions).items()
    }


def draft_loss(
    head: DraftHead, batch: dict, noise: float = 0.0, ce_weight: float = 0.1, passes: int = 1
) -> tuple[torch.Tensor, dict]:
    """SmoothL1 on the predicted feature + ce_weight x soft cross-entropy through the frozen LM head.

    passes > 1 adds the training-time-test passes (`DraftHead.forward_unrolled`), weighted 0.8^(s-1);
    pass s is scored where its whole drafted path lies in the answer. Stats are pass 1's.
    """
    feats = batch["feats"]
    if noise > 0:
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand_like(feats) * 2 - 1) * noise * rms
    if passes == 1:
        preds = [head(feats, batch["nxt"], batch["positions"])]  # (B, T, C)
    else:
        preds = head.forward_unrolled(feats, batch["nxt"], batch["positions"], passes)
    total, stats = 0.0, {}
    for s, pred in enumerate(preds):
        m = batch["mask"].clone()
        if s:
            m[:, :s] = False
            m[:, s:] &= batch["mask"][:, :-s]  # the pass's first pair (its root) is an answer pair too
        p, t = pred[m], batch["target"][m]  # (M, C)
        reg = F.smooth_l1_loss(p, t)
        with torch.no_grad():
            target_p = torch.softmax(head.logits(t).float(), -1)
        logp = torch.log_softmax(head.logits(p).float(), -1)
        ce = -(target_p * logp).sum(-1).mean()
        total = total + 0.8**s * (reg + ce_weight * ce)
        if s == 0:
            acc = (logp.argmax(-1) == target_p.argmax(-1)).float().mean()
            stats = {"reg": reg.item(), "ce": ce.item(), "acc": acc.item()}
        else:
            stats[f"acc{s + 1}"] = (logp.argmax(-1) == target_p.argmax(-1)).float().mean().item()
    return total, stats


def frequent_tokens(seqs: list[Sequence], n: int, eos_id: int) -> list[int]:
    """The n most frequent answer tokens (EOS always among them), as ascending ids; when the answers
    use fewer than n distinct tokens, the lowest unused ids fill the rest."""
    counts = Counter(t for s in seqs for t in s.answer)
    counts[eos_id] = max(counts.values(), default=0) + 1
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:n]
    chosen = set(ranked)
    filler = (i for i in range(n * 2 + max(chosen) + 1) if i not in chosen)
    while len(chosen) < n:
        chosen.add(next(filler))
    return sorted(chosen)


def _lr(step: int, total: int, recipe: DraftRecipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = min(1.0, (step - recipe.warmup) / max(1, total - recipe.warmup))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(head: DraftHead, seqs: list[Sequence], batch: int, device, chain: int = 5) -> dict:
    """Teacher-forced top-1 agreement with the target, and a chain proxy of tau: how many of the next
    `chain` tokens the head gets right in a row when it feeds on its own features (EAGLE's k-acc)."""
    head.eval()
    hits, total, run_len, runs = 0, 0, 0.0, 0
    for i in range(0, len(seqs), batch):
        b = collate(seqs[i : i + batch], device)
        _, stats = draft_loss(head, b)
        n = int(b["mask"].sum())
        hits += stats["acc"] * n
        total += n
        # chain proxy: from each answer pair, unroll on predicted features (no cache: small, exact)
        for r, s in enumerate(seqs[i : i + batch]):
            m = s.features.shape[0]
            tok = s.embeds  # (n, C)
            for start in range(s.prompt_len - 1, m - 1, 3):
                feats, nxt, pos = (
                    b["feats"][r : r + 1, : start + 1],
                    b["nxt"][r : r + 1, : start + 1],
                    b["positions"][r : r + 1, : start + 1],
                )
                ok = 0
                for d in range(chain):
                    j = start + d  # the pair predicting f_{j+1} and x_{j+2}
                    if j + 2 >= tok.shape[0]:
                        break
                    pred = head(feats, nxt, pos)[:, -1:]  # (1, 1, C)
                    want = head.logits(s.features[j + 1].float().to(device)).argmax(-1)
                    if head.logits(pred[0, 0]).argmax(-1) != want:
                        break
                    ok += 1
                    feats = torch.cat([feats, pred], 1)
                    nxt = torch.cat([nxt, tok[j + 2].float().to(device)[None, None]], 1)
                    pos = torch.cat([pos, pos[:, -1:] + 1], 1)
                run_len += ok
                runs += 1
    head.train()
    return {"top1": hits / max(1, total), "chain_accept": run_len / max(1, runs)}


def train_draft(
    model_dir: str | Path, out_dir: str | Path | None = None, recipe: DraftRecipe | None = None, progress: bool = True
) -> Path:
    """Train a draft head for the model in `model_dir`; saved to out_dir (default model_dir/draft)."""
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.hf import load_native

    recipe = recipe or DraftRecipe()
    if recipe.passes < 1:
        raise ValueError(f"passes must be at least 1 (1 = teacher forcing only), got {recipe.passes}")
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise LiteVLMError(f"no model at {model_dir}: train one with `litevlm train vlm` first")
    out = Path(out_dir) if out_dir is not None else model_dir / DRAFT_SUBDIR
    model = load_native(model_dir).float().eval()
    model.requires_grad_(False)
    tokenizer = Tokenizer.from_dir(model_dir)
    return train_draft_for(model, tokenizer, out, recipe, progress, source=model_dir.name)


def train_draft_for(
    model, tokenizer, out: str | Path, recipe: DraftRecipe, progress: bool = True, source: str = ""
) -> Path:
    """The recipe on an already-loaded target (fp32, frozen) and its tokenizer."""
    t0 = time.time()
    torch.manual_seed(recipe.seed)
    dev = model.device
    seqs = [s.window(recipe.context) for s in build_sequences(model, tokenizer, recipe, range(recipe.frames), progress)]
    gen_s = time.time() - t0
    rng = random.Random(recipe.seed)
    rng.shuffle(seqs)
    n_val = max(1, int(len(seqs) * recipe.val_fraction))
    val, train = seqs[:n_val], seqs[n_val:]

    draft_vocab = min(recipe.draft_vocab, model.cfg.text.vocab_size)
    cfg = DraftConfig.for_target(model.cfg.text, recipe.intermediate_size or None, draft_vocab, recipe.context)
    head = DraftHead(cfg, model).to(dev)
    _init(head, recipe.seed)
    if draft_vocab:
        head.set_draft_vocab(frequent_tokens(train, draft_vocab, tokenizer.eos_id))
    head.train()
    decay = [p for p in head.parameters() if p.ndim >= 2]
    rest = [p for p in head.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    steps_per_epoch = math.ceil(len(train) / recipe.batch)
    total = recipe.epochs * steps_per_epoch
    deadline = time.time() + recipe.minutes * 60
    bar = tqdm(total=total, desc="training draft", disable=not progress)
    step, t_loop, hist = 0, time.time(), []
    # Sequences of similar length batch together (less padding); batches are shuffled.
    order = sorted(range(len(train)), key=lambda i: train[i].features.shape[0])
    batches = [order[i : i + recipe.batch] for i in range(0, len(order), recipe.batch)]
    while step < total and time.time() < deadline:
        rng.shuffle(batches)
        for idx in batches:
            if step >= total or time.time() >= deadline:
                break
            for g in opt.param_groups:
                g["lr"] = _lr(step, total, recipe)
            loss, stats = draft_loss(
                head, collate([train[i] for i in idx], dev), recipe.feature_noise, recipe.ce_weight, recipe.passes
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(head.parameters(), recipe.grad_clip)
            opt.step()
            hist.append(stats)
            step += 1
            if step == 20 or step % 200 == 0:  # re-plan the schedule to the time budget
                per_step = (time.time() - t_loop) / step
                total = min(recipe.epochs * steps_per_epoch, int(step + (deadline - time.time()) / per_step))
                bar.total = total
            bar.update(1)
            if step % 10 == 0:
                last = hist[-20:]
                bar.set_postfix(
                    reg=f"{sum(h['reg'] for h in last) / len(last):.3f}",
                    acc=f"{sum(h['acc'] for h in last) / len(last):.3f}",
                )
    bar.close()
    head.eval()
    metrics = evaluate(head, val, recipe.batch, dev)
    metrics.update(
        steps=step,
        train_sequences=len(train),
        val_sequences=len(val),
        data_seconds=round(gen_s, 1),
        train_seconds=round(time.time() - t0 - gen_s, 1),
        parameters=head.num_parameters(),
    )
    head.recipe = {**asdict(recipe), "target": source}
    head.metrics = metrics
    metrics["loss_curve"] = [
        round(sum(h["reg"] + recipe.ce_weight * h["ce"] for h in hist[i : i + 50]) / len(hist[i : i + 50]), 4)
        for i in range(0, len(hist), max(50, len(hist) // 20))
    ]
    return head.save(out)


def _init(head: DraftHead, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.02, generator=g)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
