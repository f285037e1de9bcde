"""Training recipe for the ViewSelector: BCE summed over views, then (weight, threshold) calibration.

Labels are hybrid, as in the paper (arXiv 2506.07416, section 3): the synthetic generator's own per-question
views (seed 0 frames), plus any JSONL of `{"question", "views"}` lines, such as `litevlm label-views` writes
from a language model for implicit questions. Single-tag questions are augmented by moving the tag to every
camera (the view comes from the tag, not from the phrase around it: the generator only asks "in the moving
direction" about front objects, real DriveLM asks it about any). Identical questions (tags reduced to their
camera, numbers to one token) are merged and drawn with probability proportional to the square root of their
count: rare phrasings are seen often, frequent ones do not drown the rest. Word salads (training words with
every direction, side, camera and turn word removed) teach the module DriveLM's two rules for words it never
saw: a question naming no view needs every view (salads labelled all six), and a question naming views needs
those (salads with one direction phrase or c-tag inserted, labelled by the lexical map). And a word the module
never saw hashes to embeddings training never touched; so that such words carry no view, a share of the
training questions get one to four random letter strings inserted, their labels unchanged.

Calibration runs on a validation split that training never sees (seed 2 frames, and one extra
label line in ten): a grid over the lexical weight and the threshold, keeping the pair that reaches
the target recall (needed views kept / needed views) with the fewest views per question, subject
to weight >= threshold (a camera the question names is always kept); ties go to the pair whose
bar for a view the map did not name, threshold / (1 - weight), is nearest the module's own 0.5.
The held-out test split is seed 1 and is never touched here.

On the user's own data (`data_examples`, `litevlm train views --data D`) each question is labelled
by the cameras its c-tags name, else by the lexical map, else by a `label-views` answer, else with all
six views: a question that names no camera and that no labeller answered is treated as DriveLM treats
a scene-wide one, which costs views but never an answer (leaving it out would teach the module nothing
about such questions). Training takes the scenes the seeded split keeps, calibration the scenes it holds
out, so no scene is in both.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS, check_camera
from litevlm.config import flag
from litevlm.errors import LiteVLMError
from litevlm.select.views import (
    TAG_RE,
    ViewSelector,
    ViewSelectorConfig,
    fuse,
    keep_mask,
    lexical_views,
    question_words,
)

HELD_OUT_SEED = 1  # the synthetic test split


@dataclass
class ViewRecipe:
    frames: int = flag(3000, "synthetic training frames (seed `seed`, 0..frames-1)")
    seed: int = 0
    val_frames: int = flag(500, "calibration frames (seed `val_seed`, 0..val-frames-1)")
    val_seed: int = 2
    steps: int = flag(1000, "optimisation steps")
    batch: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 100
    minutes: float = flag(10.0, "wall-clock cap on the optimisation")
    tag_augment: bool = True
    salads: int = 800  # word-salad examples, half without a cue (all six), half with one (0: none)
    noise_words: float = 0.3  # share of training questions given 1-4 random unseen words
    target_recall: float = flag(0.995, "camera recall the threshold is calibrated to, on the calibration frames")
    val_fraction: float = flag(
        0.1, "with --data: share of its scenes held out to calibrate on (split seeded by --seed)"
    )
    torch_seed: int = flag(0, "torch / sampling seed", flag="--seed")
    threads: int = flag(1, "torch threads")
    width: int = 64
    layers: int = 4
    heads: int = 4
    ffn: int = 128
    buckets: int = 4096
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if HELD_OUT_SEED in (self.seed, self.val_seed):
            raise ValueError(
                f"recipe field {'seed' if self.seed == HELD_OUT_SEED else 'val_seed'!r}: seed "
                f"{HELD_OUT_SEED} is the held-out test split; train and calibrate on other seeds"
            )
        if self.seed == self.val_seed:
            raise ValueError(
                "recipe field 'val_seed': must differ from 'seed' (calibration frames are held out from training)"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"recipe field 'val_fraction': must be in (0, 1); got {self.val_fraction}")
        if not 0.0 < self.target_recall <= 1.0:
            raise ValueError(f"recipe field 'target_recall': must be in (0, 1]; got {self.target_recall}")
        for name in ("frames", "val_frames", "steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"recipe field {name!r}: must be positive; got {getattr(self, name)}")

    def selector_config(self) -> ViewSelectorConfig:
        return ViewSelectorConfig(
            width=self.width,
            layers=self.layers,
            heads=self.heads,
            ffn=self.ffn,
            buckets=self.buckets,
            dropout=self.dropout,
        )


Example = tuple[str, tuple[str, ...]]  # (question, needed views in CAMERAS order)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def generator_examples(seed: int, frames: int, progress: bool = False) -> list[Example]:
    """Every question of synthetic frames 0..frames-1 of `seed` with the views it needs."""
    from litevlm.data.synthetic import make_frame

    out: list[Example] = []
    for i in tqdm(range(frames), desc=f"questions (seed {seed})", unit="frame", disable=not progress, leave=False):
        out += [(qa.question, tuple(qa.views)) for qa in make_frame(seed, i).qas]
    return out


def read_labels(path: str | Path) -> list[Example]:
    """`{"question": str, "views": [camera, ...]}` lines (label-views output); a bad line names itself."""
    p = Path(path)
    if not p.is_file():
        raise LiteVLMError(f"no view labels at {p}: pass a JSONL file written by `litevlm label-views`")
    out: list[Example] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            q, views = item["question"], item["views"]
            if not isinstance(q, str) or not isinstance(views, list) or not views:
                raise TypeError
            named = {check_camera(str(v)) for v in views}
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LiteVLMError(
                f'{p}:{n}: expected {{"question": str, "views": [camera, ...]}} ({type(e).__name__})'
            ) from None
        except LiteVLMError as e:
            raise LiteVLMError(f"{p}:{n}: {e}") from None
        out.append((q, tuple(c for c in CAMERAS if c in named)))
    return out


def augment_tags(examples: Sequence[Example]) -> list[Example]:
    """For each question with one c-tag whose views are that tag's camera: the same question with
    the tag on each of the six cameras."""
    out: list[Example] = []
    for q, views in examples:
        tags = TAG_RE.findall(q)
        if len(tags) == 1 and views == (tags[0].upper(),):
            m = TAG_RE.search(q)
            for cam in CAMERAS:
                tag = m.group(0)[: m.start(1) - m.start()] + cam + m.group(0)[m.end(1) - m.start() :]
                out.append((q[: m.start()] + tag + q[m.end() :], (cam,)))
        else:
            out.append((q, views))
    return out


def dedupe_counts(examples: Sequence[Example]) -> tuple[list[Example], list[int]]:
    """One example per (module words, views), with how often it occurred: coordinates and numbers do
    not make a new question."""
    seen: dict[tuple, list] = {}
    for q, views in examples:
        seen.setdefault((tuple(question_words(q)), views), [(q, views), 0])[1] += 1
    return [e for e, _ in seen.values()], [n for _, n in seen.values()]


def dedupe(examples: Sequence[Example]) -> list[Example]:
    return dedupe_counts(examples)[0]


CUE_WORDS = {
    "front",
    "back",
    "rear",
    "left",
    "right",
    "ahead",
    "behind",
    "forward",
    "forwards",
    "backward",
    "backwards",
    "rearward",
    "side",
    "sides",
    "view",
    "views",
    "camera",
    "cameras",
    "cam",
    "turn",
    "turns",
    "turning",
    "turned",
    "lane",
    "lanes",
    "all",
    "every",
    "each",
    "six",
    "surround",
    "around",
    "direction",
    "directions",
}


def salad_examples(questions: Sequence[str], n: int, rng: random.Random) -> list[Example]:
    """`n` word salads of the questions' words without any view cue: half labelled all six views,
    half with one direction phrase or c-tag inserted and labelled with the views it names."""
    from litevlm.data.synthetic import DIR_PHRASES

    vocab = sorted({w for q in questions for w in question_words(q) if w.isalpha() and w not in CUE_WORDS})
    out: list[Example] = []
    while vocab and len(out) < n:
        words = [rng.choice(vocab) for _ in range(rng.randint(3, 40))]
        if len(out) % 2:
            cam = rng.choice(CAMERAS)
            cue = rng.choice(
                DIR_PHRASES[cam]
                + (f"<c{rng.randint(1, 6)},{cam},{rng.uniform(0, 1600):.1f},{rng.uniform(0, 900):.1f}>",)
            )
            words.insert(rng.randint(0, len(words)), cue)
        text = " ".join(words) + "?"
        named = tuple(c for c, v in lexical_views(text).items() if v)
        if bool(named) == bool(len(out) % 2):  # a stray cue from two adjacent words: draw again
            out.append((text, named or CAMERAS))
    return out


def with_unseen_words(question: str, rng: random.Random) -> str:
    """The question with 1-4 random lower-case letter strings inserted between its words."""
    words = question.split(" ")
    for _ in range(rng.randint(1, 4)):
        junk = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))
        words.insert(rng.randint(0, len(words)), junk)
    return " ".join(words)


def is_validation_label(question: str) -> bool:
    """One extra-label line in ten (by a hash of its text) is kept for calibration."""
    return zlib.crc32(question.encode("utf-8")) % 10 == 0


def label_matrix(examples: Sequence[Example]) -> torch.Tensor:
    """(M, N) float: 1 where a view is needed."""
    return torch.tensor([[1.0 if c in views else 0.0 for c in CAMERAS] for _, views in examples]).reshape(
        -1, len(CAMERAS)
    )


# ------------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------------
def selection_metrics(keep: torch.Tensor, labels: torch.Tensor) -> dict:
    """View recall (needed kept / needed), views per question, needed views per question, exact-set rate."""
    needed = labels.sum()
    return {
        "recall": float((keep.float() * labels).sum() / needed) if needed > 0 else 1.0,
        "views_per_question": float(keep.float().sum(1).mean()),
        "needed_per_question": float(labels.sum(1).mean()),
        "exact": float((keep.float() == labels).all(1).float().mean()),
        "questions": int(labels.shape[0]),
    }


def calibrate(
    lexical: torch.Tensor,
    probs: torch.Tensor,
    labels: torch.Tensor,
    target_recall: float,
    weights: Sequence[float] | None = None,
    thresholds: Sequence[float] | None = None,
) -> dict:
    """The (weight, threshold) reaching `target_recall` with the fewest views per question.

    Only pairs with weight >= threshold are considered, so a camera the lexical map names always
    passes. Among pairs within 0.005 views of the best: the highest recall, then the module bar
    threshold / (1 - weight) nearest 0.5, then the weight nearest 0.5. If no pair reaches the
    target, the pair with the highest recall is returned with "reached": False.
    """
    weights = [round(0.05 * i, 2) for i in range(21)] if weights is None else list(weights)
    thresholds = [round(0.02 * i, 2) for i in range(1, 50)] if thresholds is None else list(thresholds)
    rows = []
    for w in weights:
        s = fuse(lexical, probs, w)
        for t in thresholds:
            if w < t:
                continue
            m = selection_metrics(keep_mask(s, t), labels)
            rows.append((w, t, m))
    if not rows:
        raise LiteVLMError("calibration grid is empty: some weight must be >= some threshold")
    ok = [r for r in rows if r[2]["recall"] >= target_recall]
    if not ok:
        w, t, m = max(rows, key=lambda r: (r[2]["recall"], -r[2]["views_per_question"]))
        return {"weight": w, "threshold": t, "reached": False, **m}
    best = min(r[2]["views_per_question"] for r in ok)
    near = [r for r in ok if r[2]["views_per_question"] <= best + 0.005]

    def bar(w: float, t: float) -> float:  # what the module alone must reach to add a view
        return t / (1.0 - w) if w < 1.0 else math.inf

    w, t, m = max(near, key=lambda r: (r[2]["recall"], -abs(bar(r[0], r[1]) - 0.5), -abs(r[0] - 0.5)))
    return {"weight": w, "threshold": t, "reached": True, **m}


# ------------------------------------------------------------------------------------------------
# The user's data
# ------------------------------------------------------------------------------------------------
SOURCES = ("c-tag", "lexical", "label-views", "all six")  # where a question's label came from, in order of trust


@dataclass
class DataExamples:
    """The questions of a DriveLM file labelled with the views they need, split by scene."""

    path: str
    train: list[Example]
    val: list[Example]
    extra: list[Example]  # label lines whose question is not in the data: trained on as they are
    sources: dict[str, int]  # how many of the data's questions took their label from each of SOURCES
    train_scenes: int
    val_scenes: int
    seed: int
    fraction: float

    def summary(self) -> dict:
        return {
            "path": self.path,
            "train_questions": len(self.train),
            "val_questions": len(self.val),
            "train_scenes": self.train_scenes,
            "val_scenes": self.val_scenes,
            "split_seed": self.seed,
            "val_fraction": self.fraction,
            "labels": dict(self.sources),
            "extra_train": len(self.extra),
        }


def label_question(question: str, answers: dict[str, tuple[str, ...]]) -> tuple[tuple[str, ...], str]:
    """(views, source) of one question: the cameras its c-tags name, else the lexical map's, else a label-views
    answer, else all six (a question naming no view needs every view, DriveLM's rule for scene-wide questions)."""
    tagged = {m.group(1).upper() for m in TAG_RE.finditer(question)}
    if tagged:
        return tuple(c for c in CAMERAS if c in tagged), "c-tag"
    named = tuple(c for c, v in lexical_views(question).items() if v)
    if named:
        return named, "lexical"
    if question in answers:
        return answers[question], "label-views"
    return CAMERAS, "all six"


def _labels_key(answers: dict[str, tuple[str, ...]]) -> str:
    """What a cached label depends on: the lexical map's code and the label-views answers."""
    import litevlm.select.views as views_module

    h = hashlib.sha256(Path(views_module.__file__).read_bytes())
    h.update(json.dumps(sorted(answers.items())).encode("utf-8"))
    return h.hexdigest()[:16]


def label_questions(
    questions: Sequence[str],
    answers: dict[str, tuple[str, ...]],
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> dict[str, tuple[tuple[str, ...], str]]:
    """`label_question` for each distinct question; with `cache_dir`, labels already in its cache file are
    reused and the file is rewritten (tmp + rename) with the new ones."""
    cache = Path(cache_dir) / f"labels-{_labels_key(answers)}.json" if cache_dir is not None else None
    known: dict[str, tuple[tuple[str, ...], str]] = {}
    if cache is not None and cache.is_file():
        try:
            known = {q: (tuple(v), src) for q, (v, src) in json.loads(cache.read_text(encoding="utf-8")).items()}
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise LiteVLMError(f"{cache} is not a view-label cache ({e}); delete it and rerun") from None
    todo = [q for q in dict.fromkeys(questions) if q not in known]
    for q in tqdm(todo, desc="view labels", unit="q", disable=not progress, leave=False):
        known[q] = label_question(q, answers)
    if cache is not None and todo:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({q: [list(v), src] for q, (v, src) in known.items()}), encoding="utf-8")
        os.replace(tmp, cache)
    return known


def data_examples(
    path: str | Path,
    images_root: str | Path | None = None,
    label_files: Sequence[str | Path] = (),
    recipe: ViewRecipe | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> DataExamples:
    """Every question of a DriveLM file (or synth folder) with the views it needs, split by scene.

    Questions only: images are never opened, so missing image files do not matter. The validation split
    holds whole scenes out (`litevlm.data.source.scene_split`, fraction `recipe.val_fraction`, seed
    `recipe.torch_seed`). A file's own "views" key, which real DriveLM does not have, is not read.
    Label-views lines whose question is not in the data become extra training examples.
    """
    from litevlm.data.source import load_data, scene_split

    recipe = recipe or ViewRecipe()
    samples = load_data(path, images_root, require_images=False)
    answers: dict[str, tuple[str, ...]] = {}
    for f in label_files:
        answers.update(read_labels(f))  # a later line for the same question wins
    kept, held = scene_split(samples, recipe.val_fraction, seed=recipe.torch_seed)
    if not held:
        raise LiteVLMError(
            f"{path} holds one scene: calibrating the ViewSelector needs a validation split of whole scenes, "
            "so the data must have at least two"
        )
    labels = label_questions([s.question for s in samples], answers, cache_dir, progress)
    sources = dict.fromkeys(SOURCES, 0)
    for s in samples:
        sources[labels[s.question][1]] += 1
    asked = {s.question for s in samples}
    return DataExamples(
        path=str(path),
        train=[(s.question, labels[s.question][0]) for s in kept],
        val=[(s.question, labels[s.question][0]) for s in held],
        extra=[(q, v) for q, v in answers.items() if q not in asked],
        sources=sources,
        train_scenes=len({s.scene_id for s in kept}),
        val_scenes=len({s.scene_id for s in held}),
        seed=recipe.torch_seed,
        fraction=recipe.val_fraction,
    )


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def _lr(step: int, recipe: ViewRecipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def fit(
    train: Sequence[Example], extra: Sequence[Example], recipe: ViewRecipe, rng: random.Random, progress: bool
) -> tuple[ViewSelector, dict]:
    """A ViewSelector trained on `train` (tag-augmented) + `extra` + word salads; (selector, training facts)."""
    train_set, counts = dedupe_counts((augment_tags(train) if recipe.tag_augment else list(train)) + list(extra))
    salad = salad_examples([q for q, _ in train_set], recipe.salads, rng)
    train_set, counts = train_set + salad, counts + [1] * len(salad)
    cum_weights = list(itertools.accumulate(math.sqrt(n) for n in counts))

    sel = ViewSelector(recipe.selector_config(), target_recall=recipe.target_recall)
    labels = label_matrix(train_set)
    lexical = sel.lexical([q for q, _ in train_set])
    opt = torch.optim.AdamW(sel.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sel.train()
    deadline = time.monotonic() + 60.0 * recipe.minutes
    bar = tqdm(range(recipe.steps), desc="train views", unit="step", disable=not progress)
    ema = None
    steps_done = 0
    for step in bar:
        idx = rng.choices(range(len(train_set)), cum_weights=cum_weights, k=recipe.batch)
        texts = [train_set[i][0] for i in idx]
        texts = [with_unseen_words(q, rng) if rng.random() < recipe.noise_words else q for q in texts]
        ids, mask = sel.cfg.features(texts)
        logits = sel(ids, mask, lexical[idx])  # (B, N)
        loss = (
            F.binary_cross_entropy_with_logits(logits, labels[idx], reduction="none").sum(1).mean()
        )  # summed over views
        for group in opt.param_groups:
            group["lr"] = _lr(step, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sel.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.4f}")
        if time.monotonic() > deadline:
            break
    bar.close()
    sel.eval()
    return sel, {"train_unique": len(train_set), "steps_done": steps_done, "final_loss": ema}


def calibrate_selector(sel: ViewSelector, val: Sequence[Example], target_recall: float) -> tuple[dict, dict]:
    """Set the selector's (weight, threshold) on `val`; (its calibration, the lexical map alone at 0.5)."""
    questions = [q for q, _ in val]
    lex = sel.lexical(questions)
    probs = sel.probabilities(questions, lex)
    val_labels = label_matrix(val)
    cal = calibrate(lex, probs, val_labels, target_recall)
    sel.weight, sel.threshold = cal["weight"], cal["threshold"]
    return cal, selection_metrics(keep_mask(lex, 0.5), val_labels)


def train_view_selector(
    out_dir: str | Path,
    recipe: ViewRecipe | None = None,
    extra_labels: Sequence[str | Path] = (),
    progress: bool = True,
    data: DataExamples | None = None,
) -> Path:
    """Train, calibrate and save a ViewSelector to `out_dir/view_selector/`; returns that folder.

    Without `data` it learns from the synthetic generator's frames plus `extra_labels`; with `data`
    (`data_examples`, which has read its label files already) from the user's questions, calibrated on
    their validation scenes.
    """
    recipe = recipe or ViewRecipe()
    if data is not None and extra_labels:
        raise LiteVLMError("with data, pass the label files to data_examples, which matches them to its questions")
    torch.manual_seed(recipe.torch_seed)
    rng = random.Random(recipe.torch_seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        if data is None:
            train = generator_examples(recipe.seed, recipe.frames, progress)
            val = generator_examples(recipe.val_seed, recipe.val_frames, progress)
            extra_train, extra_val = [], []
            for path in extra_labels:
                for ex in read_labels(path):
                    (extra_val if is_validation_label(ex[0]) else extra_train).append(ex)
            val += extra_val
        else:
            train, val, extra_train = data.train, data.val, data.extra
        sel, facts = fit(train, extra_train, recipe, rng, progress)
        cal, lexical_alone = calibrate_selector(sel, val, recipe.target_recall)
        if data is None:
            source = {
                "train_questions": len(train),
                "train_unique": facts["train_unique"],
                "extra_train": len(extra_train),
                "val_questions": len(val),
                "extra_val": len(extra_val),
                "extra_labels": [str(p) for p in extra_labels],
            }
        else:
            source = {**data.summary(), "train_unique": facts["train_unique"]}
        extra = {
            "validation": cal,
            "validation_lexical_only": lexical_alone,
            "data": source,
            "steps_done": facts["steps_done"],
            "final_loss": facts["final_loss"],
        }
        out = sel.save(out_dir, recipe=asdict(recipe), extra=extra)
    finally:
        torch.set_num_threads(threads)
    if progress:
        print(
            f"validation{' (held-out scenes)' if data is not None else ''}: recall {cal['recall']:.4f} with "
            f"{cal['views_per_question']:.3f} views/question (needed {cal['needed_per_question']:.3f}); "
            f"weight {cal['weight']}, threshold {cal['threshold']}"
            + ("" if cal["reached"] else f"  [target recall {recipe.target_recall} NOT reached]")
        )
    return out
