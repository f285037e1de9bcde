"""Training recipe for the EAGLE draft head of a target VLM: self-distillation, on any checkpoint and data.

The data are the target's own answers (EAGLE-1 Table 6, EAGLE-3, SpecForge and vLLM's speculators regenerate
answers with the target: the draft should imitate what the target says, not what a dataset says): each question of
the user's data (`--data`) or of synthetic training frames (seed 0, never the held-out seed-1 split) answered
greedily by the target with its images, batched, in the pipeline's own prompt format. Along prompt + answer the
target's final post-norm hidden states are recorded: in memory while training (online), or first cached to disk as
safetensors shards that a rerun resumes from (offline). The head is then trained teacher-forced (EAGLE 3.2):
pair j = (f_j + noise, embedding of x_{j+1}) predicts f_{j+1}, with a SmoothL1 loss on the feature and 0.1 x the
cross-entropy between the target's next-token distribution softmax(LMHead(f_{j+1})) and the draft's
LMHead(f^_{j+1}), on the answer's pairs. Uniform noise on the input features (relative to their RMS) makes the head
robust to its own errors when it drafts several tokens ahead; optional training-time-test passes (EAGLE-3) train on
them directly.

The head is sized for a small target on a CPU, where a draft step must cost a small fraction of a
target step: a narrow MLP, a draft vocabulary of the tokens the target's answers use, and a window
over the prompt's last pairs; all three are stored in the head's config and used alike in training
and inference.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.config import flag
from litevlm.data.drivelm import Sample
from litevlm.dist import Dist, barrier, ddp, gather, shard
from litevlm.errors import LiteVLMError
from litevlm.spec.draft import DRAFT_SUBDIR, DraftConfig, DraftHead
from litevlm.train.lineage import recipe_sources


@dataclass
class DraftRecipe:
    frames: int = flag(
        150,
        "without --data: synthetic frames (seed, 0..frames-1) whose questions (~18 each) the model answers to make "
        "the data",
    )
    seed: int = flag(0, "the seed of the frames (held-out split: seed 1), of the views and of the split by scene")
    max_new_tokens: int = flag(96, "the target's answers are cut at this many tokens")
    view_subset_prob: float = 0.5  # prompts with only the needed views (+ random extras), as view selection feeds
    prune_prob: float = flag(
        0.0,
        "this share of the prompts is pruned by the model's TokenSelector, at the keep ratio stored with it, before "
        "the target answers them, as LiteVLM feeds it (the head then learns the features of pruned prompts too)",
    )
    render_size: tuple[int, int] = (400, 225)
    gen_batch: int = flag(16, "questions the target answers at once (a shard holds 8 x this many or more)")
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
    val_fraction: float = flag(
        0.05, "held out for validation: this share of the scenes (--data), else of the synthetic questions"
    )
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
    question: str = ""
    held_out: bool = False  # a validation question
    positions: torch.Tensor | None = None  # (n,) RoPE positions where they skip (pruned prompts); None: offset + 0..

    def window(self, context: int) -> Sequence:
        """Only the last `context` prompt tokens (what a windowed draft sees), positions kept."""
        start = max(0, self.prompt_len - context) if context else 0
        return replace(
            self,
            embeds=self.embeds[start:],
            features=self.features[start:],
            prompt_len=self.prompt_len - start,
            offset=self.offset + start if self.positions is None else int(self.positions[start]),
            positions=None if self.positions is None else self.positions[start:],
        )

    def pair_positions(self, n: int) -> torch.Tensor:
        """The RoPE positions of the first n tokens (pair j sits at token j's), padded on from the last."""
        if self.positions is None:
            return torch.arange(n) + self.offset
        m = min(n, self.positions.shape[0])
        return torch.cat([self.positions[:m], self.positions[m - 1] + 1 + torch.arange(n - m)])


# A pipeline that lends the target's tiling, prompt and selection to batched answers, and never decodes itself.
LENT = {"backend": "modules", "warmup": False}


@torch.no_grad()
def greedy_batch(
    model,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    eos_id: int,
    prompt_positions: list[torch.Tensor | None] | None = None,
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers for several prompts at once (left-padded, one static cache).

    prompts: embeddings (T_r, C) each; prompt_positions: their RoPE positions (T_r,) where a prompt's skip (pruned
    at the input), None for 0..T_r-1 -> per prompt (answer tokens up to and including EOS, hidden states
    (T_r + len(answer) - 1, C) at every token but the last).
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
    for r, pos in enumerate(prompt_positions or []):
        if pos is not None:
            positions[r, t - pos.shape[0] :] = pos
    next_pos = positions[:, -1] + 1  # (B,) the first answer token's position
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
        pos = (next_pos + i)[:, None]  # (B, 1)
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


# ------------------------------------------------------------------------------------------------
# The questions, in the order the target answers them
# ------------------------------------------------------------------------------------------------
@dataclass
class Frame:
    """The questions asked about one set of camera images, and how to open those images."""

    samples: list[Sample]
    images: Callable[[], dict]  # () -> camera -> PIL image


@dataclass
class Item:
    """One question to answer: its sample, the views its prompt shows, and whether validation holds it out."""

    sample: Sample
    views: list[str]
    held_out: bool = False
    pruned: bool = False  # the TokenSelector prunes its prompt first


def synthetic_frames(recipe: DraftRecipe) -> list[Frame]:
    """Synthetic training frames (recipe.seed, 0..frames-1), rendered when their turn comes."""
    from litevlm.data.drivelm import samples_from_frame
    from litevlm.data.synthetic import make_frame, render_views

    frames = []
    for i in range(recipe.frames):
        frame = make_frame(recipe.seed, i)
        frames.append(Frame(samples_from_frame(frame), partial(render_views, frame, size=recipe.render_size)))
    return frames


def data_frames(samples: list[Sample]) -> list[Frame]:
    """The user's questions grouped by the images they are asked about (their key frame), in file order."""
    from litevlm.data.drivelm import load_images

    groups: dict[tuple[str, ...], list[Sample]] = {}
    for s in samples:
        groups.setdefault(tuple(str(s.images.get(c)) for c in CAMERAS), []).append(s)
    return [Frame(g, partial(load_images, g[0], list(CAMERAS))) for g in groups.values()]


def plan(frames: list[Frame], recipe: DraftRecipe, held_out: frozenset[str] = frozenset()) -> list[list[tuple]]:
    """Each question's views, as the pipeline feeds the target: all six, or (with probability view_subset_prob) the
    ones it needs plus random extras, as view selection does. Frames are grouped into shards of at least
    8 x gen_batch questions: the unit of batched generation and of the offline cache. -> shards of (frame, items)."""
    rng = random.Random(recipe.seed)
    pruning = random.Random(recipe.seed + 1)  # its own stream: the views drawn are those of a recipe without pruning
    shards, group, n = [], [], 0
    for frame in frames:
        items = []
        for s in frame.samples:
            cams = list(CAMERAS)
            if rng.random() < recipe.view_subset_prob:
                keep = set(s.views) | {c for c in CAMERAS if rng.random() < 0.15}
                cams = [c for c in CAMERAS if c in keep] or cams
            items.append(Item(s, cams, s.id in held_out, pruning.random() < recipe.prune_prob))
        group.append((frame, items))
        n += len(items)
        if n >= 8 * recipe.gen_batch:
            shards.append(group)
            group, n = [], 0
    if group:
        shards.append(group)
    return shards


@torch.no_grad()
def answer_shard(pipe, group: list[tuple], recipe: DraftRecipe, store_dtype: torch.dtype) -> list[Sequence]:
    """The target's greedy answers to one shard's questions, batched, and its features along prompt + answer,
    windowed to the head's context and kept on the CPU in `store_dtype`. Prompts are the pipeline's own
    (`Pipeline.tiles`, `encode_tiles`, `Pipeline.embed_prompt`), in the checkpoint's format; an item marked `pruned`
    is first pruned by the pipeline's token selection (`Pipeline.selection`), its tokens at their own positions."""
    model, tok = pipe.model, pipe.tokenizer
    pending = []  # (reference answer length, prompt embeddings (T, C), item, positions (T,) or None)
    for frame, items in group:
        pixels, counts = pipe.tiles(frame.images(), list(CAMERAS))
        visual = model.encode_tiles(pixels.to(model.device))  # (tiles, tokens per tile, C)
        per_view = visual.split([n // model.cfg.tokens_per_tile for n in counts])  # view -> (tiles, tokens, C)
        for item in items:
            idx = [CAMERAS.index(c) for c in item.views]
            vis = torch.cat([per_view[i] for i in idx])
            prompt = pipe.embed_prompt(item.sample.question, item.views, vis, [counts[i] for i in idx])
            embeds, positions = prompt.embeds[0], None
            if item.pruned:
                embeds, positions, _ = pipe.selection.select(model, prompt, item.sample.question, pipe.format.tiling)
                embeds, positions = embeds[0], positions[0]
            pending.append((len(tok.encode(item.sample.answer)), embeds, item, positions))
    # Batch prompts whose reference answers have similar lengths: a batch runs as long as its longest answer.
    pending.sort(key=lambda p: p[0])
    seqs = []
    for i in range(0, len(pending), recipe.gen_batch):
        chunk = pending[i : i + recipe.gen_batch]
        out = greedy_batch(
            model, [p[1] for p in chunk], recipe.max_new_tokens, tok.eos_id, prompt_positions=[p[3] for p in chunk]
        )
        for (_, emb, item, pos), (answer, feats) in zip(chunk, out):
            ans = model.language_model.embed_tokens(torch.tensor(answer, device=emb.device))
            whole = Sequence(
                torch.cat([emb, ans]).to(store_dtype).cpu(),
                feats.to(store_dtype).cpu(),
                emb.shape[0],
                answer,
                question=item.sample.question,
                held_out=item.held_out,
                positions=None if pos is None else pos.cpu(),
            ).window(recipe.context)
            seqs.append(replace(whole, embeds=whole.embeds.clone(), features=whole.features.clone()))  # own storage
    return seqs


# ------------------------------------------------------------------------------------------------
# Offline: the target's answers and features cached in safetensors shards
# ------------------------------------------------------------------------------------------------
FEATURES_FORMAT = "litevlm-draft-features"
INDEX_FILE = "index.json"


def shard_path(folder: Path, i: int) -> Path:
    return folder / f"shard-{i:05d}.safetensors"


def cache_key(loaded, recipe: DraftRecipe, data: str, samples: list[Sample]) -> dict:
    """What the cached answers and features depend on: the target (folder, weights, dtype, prompt format), the
    questions (their ids, text and images) and the settings of their generation."""
    weights = sum(f.stat().st_size for f in sorted(loaded.path.glob("*.safetensors")))
    digest = hashlib.sha256()
    for s in samples:
        digest.update(json.dumps([s.id, s.question, sorted((c, str(p)) for c, p in s.images.items())]).encode())
    key = {
        "model": str(loaded.path.resolve()),
        "weights_bytes": weights,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "format": loaded.format.to_dict(),
        "data": data or "synthetic",
        "questions": len(samples),
        "questions_sha256": digest.hexdigest(),
        "seed": recipe.seed,
        "max_new_tokens": recipe.max_new_tokens,
        "view_subset_prob": recipe.view_subset_prob,
        "gen_batch": recipe.gen_batch,
        "context": recipe.context,
    }
    if recipe.prune_prob:  # absent without pruning: caches made before the option read as they were made
        key["prune_prob"] = recipe.prune_prob
        key["token_selector_sha256"] = selector_digest(loaded.path)  # a retrained selector prunes other tokens
    if data:
        key["val_fraction"] = recipe.val_fraction
    else:
        key.update(frames=recipe.frames, render_size=list(recipe.render_size))
    return key


def selector_digest(model_dir: Path) -> str:
    """sha256 over the files of the checkpoint's TokenSelector (its weights and its config, the stored r with it)."""
    from litevlm.models import part_dir

    digest = hashlib.sha256()
    for f in sorted(p for p in part_dir(model_dir, "token_selector").iterdir() if p.is_file()):
        if f.name != "train_log.json":
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def save_shard(path: Path, seqs: list[Sequence]) -> None:
    """One shard, written whole or not at all (a temporary file renamed into place)."""
    from safetensors.torch import save_file

    tensors = {
        "embeds": torch.cat([s.embeds for s in seqs]).contiguous(),  # (sum n, C)
        "features": torch.cat([s.features for s in seqs]).contiguous(),  # (sum n - 1, C)
        "answers": torch.tensor([t for s in seqs for t in s.answer], dtype=torch.long),
        "lengths": torch.tensor([s.embeds.shape[0] for s in seqs], dtype=torch.long),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.long),
        "answer_lens": torch.tensor([len(s.answer) for s in seqs], dtype=torch.long),
        "offsets": torch.tensor([s.offset for s in seqs], dtype=torch.long),
        "positions": torch.cat([s.pair_positions(s.embeds.shape[0]) for s in seqs]),  # (sum n,)
        "held_out": torch.tensor([s.held_out for s in seqs], dtype=torch.bool),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"questions": json.dumps([s.question for s in seqs])})
    os.replace(tmp, path)


def load_shard(path: Path, features: bool = True) -> list[Sequence]:
    """A shard's sequences (without `features`: questions and answers only, empty tensors)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            questions = json.loads(f.metadata()["questions"])
            meta = {k: f.get_tensor(k).tolist() for k in ("lengths", "prompt_lens", "answer_lens", "offsets")}
            held = f.get_tensor("held_out").tolist()
            answers = f.get_tensor("answers").tolist()
            embeds = f.get_tensor("embeds") if features else None
            feats = f.get_tensor("features") if features else None
            positions = f.get_tensor("positions") if "positions" in f.keys() else None  # older shards: none skip
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise LiteVLMError(
            f"cannot read the feature shard {path}: {e}; delete it and run again to rewrite it"
        ) from None
    seqs, e0, f0, a0 = [], 0, 0, 0
    for i, n in enumerate(meta["lengths"]):
        a = meta["answer_lens"][i]
        emb = embeds[e0 : e0 + n] if features else torch.empty(0)
        fea = feats[f0 : f0 + n - 1] if features else torch.empty(0)
        pos = None if positions is None else positions[e0 : e0 + n]
        seqs.append(
            Sequence(
                emb, fea, meta["prompt_lens"][i], answers[a0 : a0 + a], meta["offsets"][i], questions[i], held[i], pos
            )
        )
        e0, f0, a0 = e0 + n, f0 + n - 1, a0 + a
    if len(questions) != len(seqs) or (features and (e0 != embeds.shape[0] or f0 != feats.shape[0])):
        raise LiteVLMError(f"the feature shard {path} is inconsistent; delete it and run again to rewrite it")
    return seqs


def read_index(folder: Path) -> dict | None:
    path = folder / INDEX_FILE
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LiteVLMError(f"{path} is not valid JSON ({e.msg}); delete the folder or pick another") from None
    if index.get("format") != FEATURES_FORMAT:
        raise LiteVLMError(f"{path} is not an index of draft features: pick an empty folder for --offline")
    return index


def check_index(index: dict, key: dict, folder: Path, fields=None) -> None:
    """An error naming what differs where the cache in `folder` was made for other questions or settings."""
    theirs = index.get("key", {})
    diff = [k for k in (fields or sorted(set(key) | set(theirs))) if key.get(k) != theirs.get(k)]
    if diff:
        changes = "; ".join(f"{k}: {theirs.get(k)!r} there, {key.get(k)!r} now" for k in diff)
        raise LiteVLMError(
            f"the draft features in {folder} were made for another target, data or settings ({changes}): "
            "pick another --offline folder, or delete this one"
        )


def disk_estimate(pipe, shards: list[list[tuple]], recipe: DraftRecipe, store_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per token, tokens expected): an embedding and a feature per token; each sequence is its prompt
    (the window, or the whole prompt at the most tiles a view can make) and its answer (as long as the reference
    answer and EOS, at most max_new_tokens)."""
    per_token = 2 * pipe.model.cfg.text.hidden_size * torch.empty(0, dtype=store_dtype).element_size()
    view_tokens = pipe.cfg.tokens_per_tile * pipe.format.tiling.most()
    tokens = 0
    for group in shards:
        for _, items in group:
            for it in items:
                if recipe.context:  # a prompt's visual tokens alone outnumber the window
                    prompt = recipe.context
                else:
                    prompt = len(pipe.format.build(pipe.tokenizer, it.sample.question, it.views, view_tokens).ids)
                answer = min(len(pipe.tokenizer.encode(it.sample.answer)) + 1, recipe.max_new_tokens)
                tokens += prompt + answer
    return per_token, tokens


def offline_sequences(
    pipe,
    shards,
    recipe: DraftRecipe,
    folder,
    key: dict,
    store_dtype: torch.dtype,
    progress: bool = True,
    d: Dist = Dist(),
) -> list[Sequence]:
    """Write the shards `folder` does not hold yet (the disk cost printed first), then read them. Under torchrun
    rank r writes and reads shards r, r + W, ... (`litevlm.dist.shard`); rank 0 alone prints and writes the index."""
    folder = Path(folder)
    index = read_index(folder)
    if index is not None:
        check_index(index, key, folder)
    per_token, tokens = disk_estimate(pipe, shards, recipe, store_dtype)
    done = sum(shard_path(folder, i).is_file() for i in range(len(shards)))
    questions = sum(len(items) for group in shards for _, items in group)
    if d.is_main:
        print(
            f"offline draft features in {folder}: {questions} questions in {len(shards)} shards, about {tokens:,} "
            f"tokens x {per_token:,} bytes/token = {per_token * tokens / 2**20:,.1f} MiB on disk"
            + (f"; {done} shards already written, resuming" if done else "")
        )
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": FEATURES_FORMAT, "version": 1, "key": key, "shards": len(shards), "questions": questions}
        meta.update(bytes_per_token=per_token, tokens_estimated=tokens, dtype=str(store_dtype).removeprefix("torch."))
        tmp = folder / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / INDEX_FILE)
    barrier(d)  # every rank has checked the key before rank 0 rewrites the index
    mine = shard(range(len(shards)), d)
    bar = tqdm(
        total=sum(len(items) for i in mine for _, items in shards[i]), desc="target answers", disable=not progress
    )
    for i in mine:
        if not shard_path(folder, i).is_file():
            save_shard(shard_path(folder, i), answer_shard(pipe, shards[i], recipe, store_dtype))
        bar.update(sum(len(items) for _, items in shards[i]))
    bar.close()
    return [s for i in mine for s in load_shard(shard_path(folder, i))]


def cached_answers(folder, key: dict) -> list[Sequence] | None:
    """The target's answers (no features) in a complete offline cache made for the same target, questions and
    generation settings,
    None where `folder` holds no cache; an error where it holds one for another target or data, or an incomplete
    one."""
    folder = Path(folder)
    index = read_index(folder)
    if index is None:
        return None
    check_index(index, key, folder, fields=sorted(k for k in key if k != "context"))  # the window: no answer changes
    missing = [i for i in range(index["shards"]) if not shard_path(folder, i).is_file()]
    if missing:
        raise LiteVLMError(
            f"the draft features in {folder} are incomplete ({len(missing)} of {index['shards']} shards missing): "
            "finish them with `litevlm train draft --offline` first"
        )
    return [s for i in range(index["shards"]) for s in load_shard(shard_path(folder, i), features=False)]


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
    positions = torch.stack([s.pair_positions(n) for s in seqs])  # (B, T)
    return {
        k: v.to(device) for k, v in dict(feats=feats, nxt=nxt, target=target, mask=mask, positions=positions).items()
    }


def draft_loss(
    head: DraftHead, batch: dict, noise: float = 0.0, ce_weight: float = 0.1, passes: int = 1, forward=None
) -> tuple[torch.Tensor, dict]:
    """SmoothL1 on the predicted feature + ce_weight x soft cross-entropy through the frozen LM head.

    passes > 1 adds the training-time-test passes (`DraftHead.forward_unrolled`), weighted 0.8^(s-1);
    pass s is scored where its whole drafted path lies in the answer. Stats are pass 1's. `forward`: the
    `Unrolled` head, DDP-wrapped under torchrun.
    """
    feats = batch["feats"]
    if noise > 0:
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand_like(feats) * 2 - 1) * noise * rms
    preds = (forward or Unrolled(head))(feats, batch["nxt"], batch["positions"], passes)  # passes x (B, T, C)
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


def frequent_tokens(answers: list[list[int]], n: int, eos_id: int) -> list[int]:
    """The n most frequent answer tokens (EOS always among them), as ascending ids; when the answers
    use fewer than n distinct tokens, the lowest unused ids fill the rest."""
    counts = Counter(t for a in answers for t in a)
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


# ------------------------------------------------------------------------------------------------
# The recipe
# ------------------------------------------------------------------------------------------------
def target_sequences(
    loaded,
    recipe: DraftRecipe,
    samples: list[Sample] | None,
    data: str,
    offline=None,
    progress: bool = True,
    d: Dist = Dist(),
) -> list[Sequence]:
    """The target's greedy answers and features for the questions of `samples` (those of scenes held out for
    validation marked `held_out`, split by `scene_split` with the recipe's seed) or, without samples, of the
    synthetic frames; cached in `offline` shards when given. Under torchrun, this rank's shards only."""
    from litevlm.data.source import scene_split
    from litevlm.pipeline import Pipeline

    if samples is None:
        frames, held = synthetic_frames(recipe), frozenset()
    else:
        frames = data_frames(samples)
        held = frozenset(s.id for s in scene_split(samples, recipe.val_fraction, recipe.seed)[1])
    shards = plan(frames, recipe, held)
    # The answers are batched through the model itself (`greedy_batch`): the pipeline lends its tiling, prompt and
    # selection only, so it makes no execution backend of its own (a CUDA one would capture graphs for nothing).
    pipe = pruning_pipeline(loaded) if recipe.prune_prob > 0 else Pipeline.from_loaded(loaded, **LENT)
    model = loaded.model
    store = torch.float16 if model.dtype == torch.float32 else model.dtype  # bf16 targets keep their own dtype
    if offline is not None:
        key = cache_key(loaded, recipe, data, [s for f in frames for s in f.samples])
        return offline_sequences(pipe, shards, recipe, offline, key, store, progress, d)
    mine = shard(shards, d)
    seqs = []
    with tqdm(total=sum(len(it) for s in mine for _, it in s), desc="target answers", disable=not progress) as bar:
        for items in mine:
            seqs += answer_shard(pipe, items, recipe, store)
            bar.update(sum(len(it) for _, it in items))
    return seqs


def pruning_pipeline(loaded):
    """The checkpoint's pipeline with its TokenSelector at its stored keep ratio, as LiteVLM prunes; an error where it
    has none, or where its selector prunes inside the decoder (the target's batched answers take a pruned prompt)."""
    from litevlm.models import part_dir
    from litevlm.pipeline import Pipeline
    from litevlm.select.tokens import TokenSelector

    try:
        folder = part_dir(loaded.path, "token_selector")
    except LiteVLMError as e:
        raise LiteVLMError(f"--prune-prob needs the model's TokenSelector: {e}") from None
    sel = TokenSelector.load(folder, loaded.model).to(loaded.model.device)
    if sel.prunes_inside:
        raise LiteVLMError(
            f"--prune-prob needs a TokenSelector that prunes the prompt before the decoder (`litevlm train tokens "
            f"--reads prompt` or `--reads embeds`): the one in {folder} ranks from inside the decoder"
        )
    return Pipeline.from_loaded(loaded, token_selector=sel, keep_ratio=sel.cfg.keep_ratio, **LENT)


def train_draft(
    model,
    out: str | Path | None = None,
    recipe: DraftRecipe | None = None,
    *,
    samples: list[Sample] | None = None,
    data: str = "",
    offline: str | Path | None = None,
    progress: bool = True,
    d: Dist = Dist(),
) -> Path:
    """Train a draft head for `model` (a `litevlm.models.Loaded` checkpoint, or a name or folder to load) on the
    target's own answers to the questions of `samples` (the user's data, named by `data`; validation on scenes held
    out) or, without samples, of synthetic frames. Saved in `modules_dir(loaded, out)/draft`, where
    `Pipeline.from_pretrained(..., speculative=True)` finds it. `offline`: a folder where the answers and features
    are cached as safetensors shards first (a rerun resumes), then read for training.

    d: this process's rank under torchrun (`litevlm.dist.init_dist`): each rank answers its share of the shards and
    trains on it, the head wrapped in DDP (gradients averaged, every rank the same steps); rank 0 validates and
    saves."""
    from litevlm.models import Loaded, load_model, modules_dir

    recipe = recipe or DraftRecipe()
    if recipe.passes < 1:
        raise ValueError(f"passes must be at least 1 (1 = teacher forcing only), got {recipe.passes}")
    loaded = model if isinstance(model, Loaded) else load_model(model)
    check_out(loaded, out)
    sources = recipe_sources(target=loaded.path)  # before the head is saved beside the model
    progress = progress and d.is_main
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    target = loaded.model.eval()
    target.requires_grad_(False)
    t0 = time.time()
    seqs = target_sequences(loaded, recipe, samples, data, offline, progress, d)
    gen_s = time.time() - t0
    rng = random.Random(recipe.seed)
    train, val = split(seqs, samples is not None, recipe, rng, d)
    dev = target.device
    draft_vocab = min(recipe.draft_vocab, target.cfg.text.vocab_size)
    cfg = DraftConfig.for_target(target.cfg.text, recipe.intermediate_size or None, draft_vocab, recipe.context)
    head = DraftHead(cfg, target).to(dev)  # fp32 weights whatever the target's dtype: it loads in the target's
    _init(head, recipe.seed)
    if draft_vocab:
        answers = [a for part in everyone([s.answer for s in train], d) for a in part]  # every rank's
        head.set_draft_vocab(frequent_tokens(answers, draft_vocab, loaded.tokenizer.eos_id))
    steps, hist = fit(head, train, recipe, rng, progress, d)
    n_train = sum(everyone(len(train), d))
    if not d.is_main:
        barrier(d)  # rank 0 validates and saves
        return (Path(out) if out is not None else loaded.path) / DRAFT_SUBDIR
    head.eval()
    metrics = evaluate(head, val, recipe.batch, dev) if val else {"top1": None, "chain_accept": None}
    metrics.update(
        steps=steps,
        train_sequences=n_train,
        ranks=d.world_size,
        val_sequences=len(val),
        validation="scenes held out" if samples is not None else "random share of the synthetic questions",
        data_seconds=round(gen_s, 1),
        train_seconds=round(time.time() - t0 - gen_s, 1),
        parameters=head.num_parameters(),
    )
    head.recipe = {
        **asdict(recipe),
        "target": loaded.path.name,
        "data": data or "synthetic",
        "answers": "target",
        "sources": sources,
    }
    head.metrics = metrics
    metrics["loss_curve"] = [
        round(sum(h["reg"] + recipe.ce_weight * h["ce"] for h in hist[i : i + 50]) / len(hist[i : i + 50]), 4)
        for i in range(0, len(hist), max(50, len(hist) // 20))
    ]
    path = head.save(modules_dir(loaded, out) / DRAFT_SUBDIR)
    barrier(d)
    return path


def split(
    seqs: list[Sequence], by_scene: bool, recipe: DraftRecipe, rng: random.Random, d: Dist = Dist()
) -> tuple[list[Sequence], list[Sequence]]:
    """(this rank's training sequences, shuffled; every rank's validation sequences on rank 0). By scene: those
    marked `held_out` validate; else a random `val_fraction` of the (rank's) sequences."""
    if by_scene:
        val, train = [s for s in seqs if s.held_out], [s for s in seqs if not s.held_out]
        rng.shuffle(train)
    else:
        rng.shuffle(seqs)
        n_val = max(1, int(len(seqs) * recipe.val_fraction))
        val, train = seqs[:n_val], seqs[n_val:]
    if d.world_size > 1 and min(everyone(len(train), d)) == 0:  # fewer shards than ranks: share the sequences
        train = shard([s for part in everyone(train, d) for s in part], d)
    if min(everyone(len(train), d)) == 0:
        raise LiteVLMError("no training questions are left once the validation questions are held out")
    return train, [s for part in gather([val], d) or [] for s in part]


def check_out(loaded, out) -> None:
    """Refuse, before any work, an `out` folder whose prompt.json holds another format than the target's."""
    from litevlm.model.prompt import PROMPT_FILE, read_format

    if out is not None and (Path(out) / PROMPT_FILE).is_file() and read_format(Path(out)) != loaded.format:
        raise LiteVLMError(
            f"{Path(out) / PROMPT_FILE} holds another prompt format than {loaded.path.name}'s: the draft head would "
            "not match the modules already there; pick another --out"
        )


class Unrolled(nn.Module):
    """The head's training forward, every training-time-test pass in one module call (what DDP wraps: it averages
    the gradients of the parameters its forward used)."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head

    def forward(self, feats, nxt, positions, passes: int = 1) -> list[torch.Tensor]:
        if passes == 1:
            return [self.head(feats, nxt, positions)]  # (B, T, C)
        return self.head.forward_unrolled(feats, nxt, positions, passes)


def everyone(obj, d: Dist) -> list:
    """`obj` of every rank, on every rank, in rank order (`[obj]` in a world of one)."""
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def fit(
    head: DraftHead,
    train: list[Sequence],
    recipe: DraftRecipe,
    rng: random.Random,
    progress: bool = True,
    d: Dist = Dist(),
):
    """AdamW on the teacher-forced pairs within the time budget (cosine schedule, re-planned to the budget).
    Under torchrun every rank trains on its own sequences through DDP and takes the same number of steps (the
    fewest any rank's data and time allow). -> (steps, per-step stats)."""
    dev = head.fc.weight.device
    forward = ddp(Unrolled(head), d)
    decay = [p for p in head.parameters() if p.ndim >= 2]
    rest = [p for p in head.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    head.train()
    steps_per_epoch = min(everyone(math.ceil(len(train) / recipe.batch), d))
    total = recipe.epochs * steps_per_epoch
    deadline = time.time() + recipe.minutes * 60
    bar = tqdm(total=total, desc="training draft", disable=not progress)
    step, t_loop, hist = 0, time.time(), []
    # Sequences of similar length batch together (less padding); batches are shuffled.
    order = sorted(range(len(train)), key=lambda i: train[i].features.shape[0])
    batches = [order[i : i + recipe.batch] for i in range(0, len(order), recipe.batch)]
    alone = d.world_size == 1  # several ranks stop together, at the step count they agree on
    while step < total and (time.time() < deadline or not alone):
        rng.shuffle(batches)
        for idx in batches:
            if step >= total or (alone and time.time() >= deadline):
                break
            for g in opt.param_groups:
                g["lr"] = _lr(step, total, recipe)
            batch = collate([train[i] for i in idx], dev)
            loss, stats = draft_loss(head, batch, recipe.feature_noise, recipe.ce_weight, recipe.passes, forward)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(head.parameters(), recipe.grad_clip)
            opt.step()
            hist.append(stats)
            step += 1
            if step == 20 or step % 200 == 0:  # re-plan the schedule to the time budget
                per_step = (time.time() - t_loop) / step
                total = min(recipe.epochs * steps_per_epoch, int(step + (deadline - time.time()) / per_step))
                total = min(everyone(max(total, step), d))
                bar.total = total
            bar.update(1)
            if step % 10 == 0:
                last = hist[-20:]
                bar.set_postfix(
                    reg=f"{sum(h['reg'] for h in last) / len(last):.3f}",
                    acc=f"{sum(h['acc'] for h in last) / len(last):.3f}",
                )
    bar.close()
    return step, hist


def _init(head: DraftHead, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.ndim >= 2:  # drawn on the CPU: the same head on every device (a CUDA tensor takes no CPU generator)
                p.copy_(torch.empty(p.shape).normal_(0, 0.02, generator=g))
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
