"""The pruning benchmark: every token-selection method against r, the fraction of visual tokens KEPT, in one run.

Every method answers the same questions over the same views (by default the views each question needs: what view
selection hands the token stage) with greedy decoding, at each keep ratio r: the TokenSelector (where the model has
a token_selector/ folder), FastV at K=1 and K=2 (arXiv 2403.06764), DART, DivPrune, CDPruner, random and uniform
(`litevlm.select.pruners`), each spreading its budget as its authors do on multi-crop input (CDPruner over the tiles,
the others over all the visual tokens at once), and with `--per-view` the variants that split the budget over the
cameras (NAME-per-crop and NAME-global, asked for by name, are the other two splits). Asked for by
name, `token-selector-k2` is the TokenSelector's own choice (a selector that reads the prompt) applied before decoder
layer 2, as FastV K=2 and DART prune, instead of before the decoder; `fastv-k2-k0` is the other way round, FastV
K=2's choice (made with layers 0 and 1 run on the whole prompt) applied before the decoder, as the TokenSelector
prunes: a diagnostic that costs more than the unpruned prefill, and tells a worse choice from a worse place to
prune. Each method
is the pipeline's own token selection (`litevlm.select.selection.token_selection`) on one pipeline built from the
checkpoint, with its prompt format and execution backend; the answers are scored as `litevlm eval` scores the
synthetic benchmarks (DriveLM final without a judge, the other weights renormalised, no graph gate), with
closed-question accuracy beside it, against the unpruned model. Every other method is also paired with the
TokenSelector at the same r on the closed questions (`vs_selector`): how many only one of the two answers right,
and the exact sign test's p on that split, since a difference of one or two questions is not evidence.

Fidelity to the unpruned model, question by question: whether a pruning's answer is the unpruned answer token for
token, and the drop in the unpruned answer's mean log-likelihood per token when it is teacher-forced after the pruned
prompt instead of the whole one (`litevlm.eval.fidelity`; `--no-fidelity` skips it). The results keep every
question's scores under every configuration (`per_question`, with each question's frame), so that any two can be
compared question by question: each configuration's standard errors over frames, the mean fidelity drop with its
95% interval, and each method against the TokenSelector at the same r (`vs_selector_paired`) on the final, the
closed accuracy and the fidelity, a paired difference with its 95% interval from resampling the frames
(`litevlm.eval.intervals`), "level" where the interval holds zero.

Timing, side by side in the same process on the first --timing-n prompts: each configuration's select_tokens and
prefill stages (the pipeline's StageTimer; repeats interleaved over the configurations, the median per prompt,
then the median over prompts). A method that prunes inside the decoder (FastV, DART, the TokenSelector sharing
layer 0) runs its choice inside the prefill pass, timed under select_tokens as every method's choice is, exactly as
the pipeline reports it; `total_ms` (their sum) is the comparable figure.

    python benchmarks/token_pruning.py --n 40 --plot pruning.png                  # drive-tiny, held-out frames
    python benchmarks/token_pruning.py --model drive-hd --data .bench-data/heldout --n 200 --per-view
    python benchmarks/token_pruning.py --replot benchmarks/results/token_pruning_drive-hd.json   # its figure again

Progress goes to stderr; the last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from litevlm.select.selection import FastV

METHODS = ("token-selector", "fastv-k1", "fastv-k2", "dart", "divprune", "cdpruner", "random", "uniform")
SELECTOR_INSIDE = ("token-selector-k1", "token-selector-k2")  # by name only: the TokenSelector's choice inside
CHOICE_BEFORE = ("fastv-k2-k0",)  # by name only: FastV K=2's choice, applied before the decoder
PER_VIEW_SUFFIX = "-per-view"
SPLIT_SUFFIXES = {PER_VIEW_SUFFIX: "view", "-per-crop": "crop", "-global": "all"}  # a pruner's other budget splits
LABELS = {
    "token-selector": "TokenSelector",
    "token-selector-k1": "TokenSelector K=1",
    "token-selector-k2": "TokenSelector K=2",
    "fastv-k1": "FastV K=1",
    "fastv-k2": "FastV K=2",
    "fastv-k2-k0": "FastV K=2's choice before the decoder",
    "dart": "DART",
    "divprune": "DivPrune",
    "cdpruner": "CDPruner",
    "random": "random",
    "uniform": "uniform",
}
RATIOS = "0.1,0.2,0.3,0.5,0.7"
SCORING = "DriveLM final without a judge (other weights renormalised), no graph gate"


def split_of(method: str) -> tuple[str, str | None]:
    """A method name -> (the method, the budget split its suffix asks for; None: the method's own)."""
    for suffix, split in SPLIT_SUFFIXES.items():
        if method.endswith(suffix):
            return method.removesuffix(suffix), split
    return method, None


def split_name(method: str) -> str | None:
    """The budget split a method's row spends over ("all", "view", "crop"), None for a method without one."""
    from litevlm.select.pruners import DEFAULT_SPLIT, PER_VIEW

    base, split = split_of(method)
    if base not in PER_VIEW:
        return None
    return split or DEFAULT_SPLIT.get(base, "all")


def label(method: str) -> str:
    """A row's name: the method, and its budget split where it is not one ranking of all (its own or asked for)."""
    base, split = split_of(method)
    name = LABELS.get(base, base)
    if split == "all":
        return f"{name} global"
    split = split_name(method) if base != "uniform" else None
    return {"view": f"{name} per view", "crop": f"{name} per tile"}.get(split, name)


def parse_args(argv=None) -> argparse.Namespace:
    from litevlm.data.source import add_data_options
    from litevlm.options import add_model_options

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_model_options(p)
    add_data_options(p, default_help="held-out synthetic frames of --seed, made in memory")
    p.add_argument("--seed", type=int, default=1, help="synthetic frames' seed without --data (1: the held-out split)")
    p.add_argument(
        "--frames", type=int, default=100, help="synthetic frames the questions are spread over (without --data)"
    )
    p.add_argument("--selector", default=None, help="TokenSelector directory if not MODEL/token_selector")
    p.add_argument("--n", type=int, default=200, help="questions, spread evenly over the data (every len/N-th)")
    p.add_argument("--r", default=RATIOS, help="keep ratios r (fraction of visual tokens KEPT), comma-separated")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated, of: " + ", ".join((*METHODS, *SELECTOR_INSIDE, *CHOICE_BEFORE)),
    )
    p.add_argument(
        "--per-view",
        action="store_true",
        help="also run the per-camera-budget variants (about r of each camera's tokens) of the pruners that have one",
    )
    p.add_argument(
        "--views", choices=("needed", "all"), default="needed", help="the views each question needs, or all six"
    )
    p.add_argument("--max-new-tokens", type=int, default=160, help="as the pipeline and `litevlm eval`")
    p.add_argument(
        "--no-fidelity",
        dest="fidelity",
        action="store_false",
        help="skip the fidelity measure (the unpruned answer's log-likelihood under each pruned prompt)",
    )
    p.add_argument("--timing-n", type=int, default=10, help="prompts timed (0: no timing)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per prompt and configuration (median kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--plot", default=None, help="save score and prefill ms against r, score against ms, as this PNG")
    p.add_argument(
        "--replot", default=None, metavar="JSON", help="only redraw the figure of a run from its JSON (no model loaded)"
    )
    p.add_argument("--predictions", default=None, help="write every answer record to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Questions, methods, prompts
# ---------------------------------------------------------------------------------------------


def spread(items: list, n: int) -> list:
    """n items spread evenly over the list (every len/n-th), deterministically."""
    step = max(1.0, len(items) / n)
    return [items[int(i * step)] for i in range(min(n, len(items)))]


def load_questions(data, images_root, n: int, seed: int, frames: int) -> list:
    """n questions spread over `data` (a synth folder or DriveLM JSON), or over `frames` synthetic frames of `seed`
    made in memory (only the frames a chosen question belongs to are rendered)."""
    from litevlm.data.drivelm import samples_from_frame
    from litevlm.data.source import load_data
    from litevlm.data.synthetic import make_frame, render_views

    if data:
        return spread(load_data(data, images_root), n)
    made = [make_frame(seed, i) for i in range(frames)]
    chosen = spread([(f, i) for f in made for i in range(len(f.qas))], n)
    rendered: dict[str, list] = {}
    out = []
    for frame, i in chosen:
        if frame.frame_id not in rendered:
            rendered[frame.frame_id] = samples_from_frame(frame, render_views(frame))
        out.append(rendered[frame.frame_id][i])
    return out


def method_list(methods: str, per_view: bool) -> list[str]:
    """The methods asked for, each followed by its per-view variant where `per_view` asks and the pruner has one."""
    from litevlm.select.pruners import PER_VIEW

    out = []
    for m in (s.strip() for s in methods.split(",")):
        if not m:
            continue
        base, _ = split_of(m)
        if base not in (*METHODS, *SELECTOR_INSIDE, *CHOICE_BEFORE) or (m != base and base not in PER_VIEW[:-1]):
            known = ", ".join((*METHODS, *SELECTOR_INSIDE, *CHOICE_BEFORE))
            raise SystemExit(f"unknown method {m!r}; known: {known} (and NAME{'/NAME'.join(SPLIT_SUFFIXES)})")
        out.append(m)
        # uniform already splits its budget over the cameras: no variant
        if per_view and m == base and base in PER_VIEW[:-1]:
            out.append(base + PER_VIEW_SUFFIX)
    return list(dict.fromkeys(out))


def selection(pipe, method: str | None, r: float, selector, seed: int):
    """The pipeline's token selection for `method` at keep ratio r (None: keep every token), built and checked by the
    factory the pipeline itself uses."""
    from litevlm.select.pruners import PruneConfig
    from litevlm.select.selection import token_selection

    model, tok = pipe.model, pipe.tokenizer
    if method is None:
        return token_selection(model, None, None, 0, None, None, tok, seed)
    if method == "token-selector":
        return token_selection(model, selector, r, 0, None, None, tok, seed)
    if method in SELECTOR_INSIDE:
        layer = int(method.removeprefix("token-selector-k"))
        return token_selection(model, selector, r, 0, None, None, tok, seed, select_layer=layer)
    if method in CHOICE_BEFORE:
        return FastVChoiceBefore(int(method.removeprefix("fastv-k").removesuffix("-k0")), r)
    if method.startswith("fastv-k"):
        return token_selection(model, None, None, 0, (int(method.removeprefix("fastv-k")), r), None, tok, seed)
    base, split = split_of(method)
    return token_selection(model, None, None, 0, None, PruneConfig(base, r, split=split), tok, seed)


class FastVChoiceBefore(FastV):
    """FastV's choice for a cut before layer k (layers [0, k - 1) run on the whole prompt to make it, layer k - 1's
    attention ranks), applied to the prompt before the decoder, where the TokenSelector prunes: the same tokens
    FastV keeps, without layers [0, k) reading the rest."""

    @property
    def label(self) -> str:
        return f"{super().label}, applied before the decoder"

    def select(self, model, p, question: str, tiling, record: dict | None = None):
        from litevlm.select.tokens import fastv_scores, prune_prompt, select_by_scores, view_sizes

        x = model.language_model(p.embeds, p.positions, start_layer=0, end_layer=self.k - 1) if self.k > 1 else p.embeds
        scores = fastv_scores(model, x, p.positions, p.view_spans, self.k)
        kept = select_by_scores(scores, view_sizes(p.view_spans), self.keep_ratio, 0)
        embeds, positions, _ = prune_prompt(p.embeds, p.positions, p.view_spans, kept)
        return embeds, positions, None


class Prompts:
    """Each question's full prompt over its views, in the checkpoint's own format (`Pipeline.embed_prompt`); each
    frame's views go through the vision tower once."""

    def __init__(self, pipe, views_mode: str):
        self.pipe, self.views_mode = pipe, views_mode
        self.visual: dict[str, dict[str, torch.Tensor]] = {}  # frame -> camera -> (tiles, tokens_per_tile, C)

    def views(self, sample) -> list[str]:
        from litevlm.cameras import CAMERAS

        if self.views_mode == "all" or not sample.views:
            return list(CAMERAS)
        return [c for c in CAMERAS if c in sample.views]

    @torch.no_grad()
    def __call__(self, sample):
        from litevlm.model.generate import StageTimer

        pipe = self.pipe
        views = self.views(sample)
        cache = self.visual.setdefault(f"{sample.scene_id}/{sample.frame_id or sample.id}", {})
        missing = [c for c in views if c not in cache]
        if missing:
            visual, counts = pipe.vision(sample.images, missing, StageTimer(pipe.model.device))
            tiles = [c // pipe.cfg.tokens_per_tile for c in counts]
            cache.update(zip(missing, visual.split(tiles)))
        if len(self.visual) > 8:  # questions come frame by frame: keep the cache small
            self.visual.pop(next(iter(self.visual)))
        visual = torch.cat([cache[c] for c in views])
        counts = [cache[c].shape[0] * pipe.cfg.tokens_per_tile for c in views]
        return pipe.embed_prompt(sample.question, views, visual, counts)


# ---------------------------------------------------------------------------------------------
# Answering and timing
# ---------------------------------------------------------------------------------------------


class Answered(NamedTuple):
    text: str
    visual_tokens: int  # kept
    tokens: list[int]  # as generated, the end token included where there is one
    loglik: float | None  # the reference answer's mean log-likelihood per token under the same pruned prompt


@torch.no_grad()
def answer(pipe, sel, prompt, question: str, reference: list[int] | None = None, fidelity: bool = True) -> Answered:
    """One answer through the pipeline's own stages with `sel` as its token selection and, with `fidelity`, the
    teacher-forced mean log-likelihood of `reference` (the unpruned answer's tokens; None: this answer's own) under
    the same selection, the prompt prefilled again without an answer opening (`litevlm.eval.fidelity`)."""
    from litevlm.eval.fidelity import answer_loglik
    from litevlm.model.generate import StageTimer, drain, prefill_prompt

    pipe.selection = sel  # the pipeline's one token-selection object; nothing else in it depends on the choice
    timer = StageTimer(pipe.model.device)
    p, hook = pipe.select_tokens(prompt, question, timer)
    gen = drain(pipe.decode(pipe.prefill(p, hook, question, timer), timer))
    text = pipe.tokenizer.decode([t for t in gen.tokens if t != pipe.tokenizer.eos_id]).strip()
    kept = prompt.num_visual_tokens - (prompt.ids.shape[1] - gen.prompt_len)
    loglik = None
    if fidelity:  # the same kept tokens (the selection made once), prefilled again
        pre = prefill_prompt(pipe.backend, p.embeds, p.positions, pruning=hook)
        loglik = answer_loglik(pipe.backend, pre, gen.tokens if reference is None else reference)
    return Answered(text, kept, list(gen.tokens), loglik)


@torch.no_grad()
def prefill_ms(pipe, sel, prompt, question: str) -> tuple[float, float]:
    """One select_tokens + prefill with `sel` (no decoding): the two stages' wall ms, as the pipeline times them."""
    from litevlm.model.generate import StageTimer

    pipe.selection = sel
    timer = StageTimer(pipe.model.device)
    p, hook = pipe.select_tokens(prompt, question, timer)
    pipe.prefill(p, hook, question, timer)
    return timer.ms.get("select_tokens", 0.0), timer.ms.get("prefill", 0.0)


def seeded(sel, key: str):
    """A random pruner's generator seeded from the question and r, so its draw does not depend on the run's order."""
    if getattr(sel, "generator", None) is not None:
        sel.generator.manual_seed(zlib.crc32(key.encode()))
    return sel


def run_accuracy(pipe, samples, prompts: Prompts, configs: dict, progress: bool, fidelity: bool = True):
    """Every configuration's answers, question by question, the unpruned one first: records[key] -> DriveLM records,
    kept[key] -> kept visual tokens, same[key] -> whether the answer's tokens are the unpruned answer's, loglik[key]
    -> the unpruned answer's mean log-likelihood per token under the configuration's prompt (None without
    `fidelity`); and each prompt's visual share."""
    from tqdm import tqdm

    from litevlm.eval.score import record

    records: dict[str, list[dict]] = {key: [] for key in configs}
    kept: dict[str, list[int]] = {key: [] for key in configs}
    same: dict[str, list[bool]] = {key: [] for key in configs}
    loglik: dict[str, list[float | None]] = {key: [] for key in configs}
    shares = []
    for s in tqdm(samples, desc="answering", disable=not progress, file=sys.stderr):
        prompt = prompts(s)
        shares.append(prompt.num_visual_tokens / prompt.ids.shape[1])
        base = None  # the unpruned answer's tokens, once answered
        for key, sel in configs.items():
            got = answer(pipe, seeded(sel, f"{s.id}/{key}"), prompt, s.question, base, fidelity)
            base = got.tokens if base is None else base
            records[key].append({**record(s, got.text), "category": s.category})
            kept[key].append(got.visual_tokens)
            same[key].append(got.tokens == base)
            loglik[key].append(got.loglik)
    return records, kept, same, loglik, shares


def run_timing(pipe, samples, prompts: Prompts, configs: dict, repeats: int, progress: bool) -> dict:
    """Per configuration: median over prompts of the per-prompt median select_tokens, prefill and their sum (ms).
    Each prompt's repeats run round-robin over the configurations, after one untimed pass of each on the first."""
    from tqdm import tqdm

    inputs = [(prompts(s), s) for s in samples]
    for key, sel in configs.items():  # warm-up: what a first call pays once
        prefill_ms(pipe, seeded(sel, f"{inputs[0][1].id}/{key}"), inputs[0][0], inputs[0][1].question)
    per_prompt: dict[str, dict[str, list[float]]] = {key: {"select": [], "prefill": [], "total": []} for key in configs}
    for prompt, s in tqdm(inputs, desc="timing", disable=not progress, file=sys.stderr):
        runs: dict[str, list[tuple[float, float]]] = {key: [] for key in configs}
        for _ in range(repeats):
            for key, sel in configs.items():
                runs[key].append(prefill_ms(pipe, seeded(sel, f"{s.id}/{key}"), prompt, s.question))
        for key, ms in runs.items():
            per_prompt[key]["select"].append(statistics.median(a for a, _ in ms))
            per_prompt[key]["prefill"].append(statistics.median(b for _, b in ms))
            per_prompt[key]["total"].append(statistics.median(a + b for a, b in ms))
    return {
        key: {
            "select_tokens_ms": round(statistics.median(v["select"]), 3),
            "prefill_ms": round(statistics.median(v["prefill"]), 3),
            "total_ms": round(statistics.median(v["total"]), 3),
        }
        for key, v in per_prompt.items()
    }


# ---------------------------------------------------------------------------------------------
# Scores, provenance, the figure
# ---------------------------------------------------------------------------------------------


def summarise(records: list[dict], kept: list[int], base: list[dict] | None = None) -> dict:
    from litevlm.eval.metrics import closed_accuracy
    from litevlm.eval.score import drivelm_score

    s = drivelm_score(records, gate=False, renormalise=True)
    out = {k: None if s[k] is None else round(s[k], 6) for k in ("final", "accuracy", "language", "match")}
    closed = closed_accuracy(records)
    out["closed_accuracy"] = None if closed is None else round(closed, 6)
    out["visual_tokens"] = round(statistics.fmean(kept), 3)
    if base is not None:  # how much pruning perturbs the model: answers that differ from the unpruned model's
        out["changed"] = round(sum(r["answer"] != b["answer"] for r, b in zip(records, base)) / len(records), 4)
    return out


PER_QUESTION = {  # what each per-question list holds, written into the results beside them
    "final": "the question's linearised share of the DriveLM final (litevlm.eval.per_question): their mean is the"
    " final; null for a question without a metric tag",
    "correct": "1 or 0 on a closed question (answered right or not), null on an open one",
    "same": "1 where the answer's tokens are the unpruned answer's, token for token",
    "drop": "the unpruned answer's mean log-likelihood per token under the unpruned prompt less under this pruning's"
    " (teacher-forced; 0: the pruning left the model's answer as likely)",
    "loglik": "(unpruned only) the unpruned answer's mean log-likelihood per token under its own prompt",
}


def question_scores(records: list[dict], same=None, loglik=None, base_loglik=None) -> dict[str, list]:
    """One configuration's per-question lists (PER_QUESTION), in the questions' order: the unpruned one's with its own
    log-likelihoods (`base_loglik`), a pruning's with `same` and the drop from `base_loglik` to its `loglik`."""
    from litevlm.eval.metrics import answered_right
    from litevlm.eval.per_question import final_per_question

    out = {
        "final": [None if v is None else round(v, 6) for v in final_per_question(records)],
        "correct": [int(answered_right(r)) if r.get("closed") else None for r in records],
    }
    if same is not None:
        out["same"] = [int(x) for x in same]
    if loglik is not None and base_loglik is not None and None not in loglik and None not in base_loglik:
        if same is None:
            out["loglik"] = [round(v, 5) for v in base_loglik]
        else:  # (+ 0.0: a drop that rounds to zero from below is written 0.0, not -0.0)
            out["drop"] = [round(b - v, 5) + 0.0 for b, v in zip(base_loglik, loglik)]
    return out


def spreads(pq: dict, frames: list[str]) -> dict:
    """A configuration's standard errors over frames (`litevlm.eval.intervals.cluster_se`): the final's and the
    closed accuracy's; and, for a pruning with log-likelihoods, its fidelity: the share of answers the same as the
    unpruned one's, and the mean drop with its 95% interval over frames."""
    from litevlm.eval.intervals import both_scored, cluster_se, paired_difference

    out = {}
    for name, key in (("final_se", "final"), ("closed_se", "correct")):
        values, _, where = both_scored(pq[key], pq[key], frames)
        se = cluster_se(values, where) if values else math.nan
        out[name] = None if math.isnan(se) else round(se, 6)
    if "same" in pq:
        fid = {"same_answer": round(statistics.fmean(pq["same"]), 4)}
        if "drop" in pq:
            p = paired_difference(pq["drop"], [0.0] * len(frames), frames)
            fid |= {"drop": round(p.diff, 5), "low": round(p.low, 5), "high": round(p.high, 5)}
            fid["se"] = None if math.isnan(p.se_a) else round(p.se_a, 5)
        out["fidelity"] = fid
    return out


def versus_selector(method: str, pq: dict, selector_pq: dict, frames: list[str]) -> dict:
    """A method against the TokenSelector at the same r, question by question (`litevlm.eval.intervals`): on the
    final, on the closed accuracy and on the fidelity drop, each mean, its standard error, the difference (method
    less TokenSelector) with its 95% interval over frames, and the verdict: "level" where the interval holds zero,
    else the method ahead or "token-selector" (a lower drop is ahead)."""
    from litevlm.eval.intervals import both_scored, paired_difference

    out = {}
    measures = (("final", "final", True), ("closed_accuracy", "correct", True), ("fidelity", "drop", False))
    for name, key, higher in measures:
        if key not in pq or key not in selector_pq:
            continue
        a, b, where = both_scored(pq[key], selector_pq[key], frames)
        if not a:
            continue
        p = paired_difference(a, b, where, higher_is_better=higher)
        d = p.to_dict()
        out[name] = {
            "method": d["a"],
            "selector": d["b"],
            "se_method": d["se_a"],
            "se_selector": d["se_b"],
            **{k: d[k] for k in ("diff", "low", "high", "n", "frames")},
            "verdict": p.verdict(method, "token-selector"),
        }
    return out


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven if either side were equally likely."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_closed(selector: list[dict], other: list[dict]) -> dict:
    """The closed questions on which the TokenSelector and another method disagree, paired question by question:
    how many only the selector answers right, how many only the other, and the sign test's p on that split."""
    from litevlm.eval.metrics import answered_right

    pairs = [(answered_right(a), answered_right(b)) for a, b in zip(selector, other) if a.get("closed")]
    wins = sum(a and not b for a, b in pairs)
    losses = sum(b and not a for a, b in pairs)
    return {"selector_only": wins, "method_only": losses, "p": round(sign_test(wins, losses), 4)}


def git_commit() -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True
        )
    except OSError:
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def machine(device) -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(device),
    }


STYLES = {  # colour, marker
    "token-selector": ("C3", "o"),
    "token-selector-k1": ("C6", "o"),
    "token-selector-k2": ("C6", "*"),
    "fastv-k1": ("C0", "s"),
    "fastv-k2": ("C9", "^"),
    "dart": ("C1", "v"),
    "divprune": ("C2", "D"),
    "cdpruner": ("C4", "P"),
    "random": ("0.6", "x"),
    "uniform": ("0.35", "d"),
}


def plot(path, result: dict) -> None:
    """Score against r per method (unpruned dotted), select_tokens + prefill ms against r (unpruned prefill dotted),
    and, where the run was timed, score against those ms: the trade-off each method offers, one point per r. A
    per-view variant is dashed in its method's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios, scores, timing = result["ratios"], result["scores"], result["timing_ms"]
    panels = 3 if timing else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.9), dpi=120)
    acc, ms = axes[0], axes[1]
    for m in result["methods"]:
        base, _ = split_of(m)
        colour, marker = STYLES.get(base, ("C5", "."))
        kw = dict(color=colour, marker=marker, ms=5, lw=2.4 if m == "token-selector" else 1.4)
        kw["ls"] = "--" if m != base else "-"
        finals = [scores[f"{m}@{r}"]["final"] for r in ratios]
        acc.plot(ratios, finals, label=label(m), **kw)
        if timing:
            totals = [timing[f"{m}@{r}"]["total_ms"] for r in ratios]
            ms.plot(ratios, totals, label=label(m), **kw)
            axes[2].plot(totals, finals, label=label(m), **kw)
    un = result["unpruned"]
    acc.axhline(un["final"], color="k", ls=":", lw=1.2, label="unpruned")
    acc.set_xlabel("keep ratio r (fraction of visual tokens kept)")
    acc.set_ylabel(f"DriveLM final score (no judge), {result['n']} questions")
    acc.set_title("Accuracy against kept visual tokens", fontsize=10)
    if timing:
        unpruned_ms = timing["unpruned"]["prefill_ms"]
        ms.axhline(unpruned_ms, color="k", ls=":", lw=1.2, label="unpruned")
        ms.set_ylabel(f"select_tokens + prefill ms (median of {result['timing']['prompts']} prompts)")
        trade = axes[2]
        trade.plot([unpruned_ms], [un["final"]], "k*", ms=11)
        trade.annotate("unpruned", (unpruned_ms, un["final"]), textcoords="offset points", xytext=(-8, -14), ha="right")
        trade.set_xlabel("select_tokens + prefill ms (one point per r; up and left is better)")
        trade.set_ylabel("DriveLM final score (no judge)")
        trade.set_title("Accuracy against selection + prefill time", fontsize=10)
        trade.grid(alpha=0.3)
    else:
        ms.text(0.5, 0.5, "not timed (--timing-n 0)", ha="center", va="center", transform=ms.transAxes)
    ms.set_xlabel("keep ratio r (fraction of visual tokens kept)")
    ms.set_title("Prefill against kept visual tokens (selection included)", fontsize=10)
    for ax in (acc, ms):
        ax.set_xticks(ratios)
        ax.grid(alpha=0.3)
    handles, labels = acc.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False, bbox_to_anchor=(0.995, 0.5))
    mach = result["machine"]
    fig.suptitle(
        f"{result['model']}, views: {result['views']}, {result['visual_tokens']:.0f} visual tokens a prompt"
        f" ({100 * result['visual_share']:.0f}% of its tokens); {mach['device']}, {mach['threads']} thread(s),"
        f" torch {mach['torch']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / (6.2 * panels), 1))
    fig.savefig(path)
    plt.close(fig)


def replot(run_json: str, path: str | None) -> str:
    """Redraw a run's figure from its JSON (the script's last line, or a results file that holds it under
    "result"), to `path` or the run's own plot path; no model is loaded and nothing is measured."""
    text = Path(run_json).read_text().strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = json.loads(text.splitlines()[-1])
    result = data.get("result", data)
    if result.get("benchmark") != "token_pruning":
        raise SystemExit(f"{run_json}: not a run of the pruning benchmark")
    path = path or result.get("plot")
    if not path:
        raise SystemExit(f"{run_json}: the run saved no plot; say where with --plot")
    plot(path, result)
    return path


def fmt3(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def print_tables(result: dict) -> None:
    ratios, scores, timing = result["ratios"], result["scores"], result["timing_ms"]
    un = result["unpruned"]
    print(
        f"\n{result['model']}: {result['n']} questions, views={result['views']}, greedy, max "
        f"{result['max_new_tokens']} new tokens; {result['visual_tokens']:.1f} visual tokens a prompt "
        f"({100 * result['visual_share']:.1f}% of it)"
    )
    print(f"unpruned: final {un['final']:.4f}  closed acc {fmt3(un['closed_accuracy'])}")
    for m, why in result["absent"].items():
        print(f"{label(m)}: absent ({why})")
    head = "| method | " + " | ".join(f"r={r}" for r in ratios) + " |"
    rule = "|" + "---|" * (len(ratios) + 1)
    print("\nDriveLM final score (closed-question accuracy)\n\n" + head + "\n" + rule)
    for m in result["methods"]:
        cells = [
            f"{fmt3(scores[f'{m}@{r}']['final'], 4)} ({fmt3(scores[f'{m}@{r}']['closed_accuracy'])})" for r in ratios
        ]
        print(f"| {label(m)} | " + " | ".join(cells) + " |")
    if any("fidelity" in s for s in scores.values()):
        print(
            "\nFidelity to the unpruned model: the mean drop in the unpruned answer's log-likelihood per token under"
            " the pruned prompt [95% interval over frames] (answers token for token the same)\n\n" + head + "\n" + rule
        )
        for m in result["methods"]:
            cells = []
            for r in ratios:
                f = scores[f"{m}@{r}"].get("fidelity") or {}
                drop = f"{fmt3(f.get('drop'))} [{fmt3(f.get('low'))}, {fmt3(f.get('high'))}] " if "drop" in f else ""
                cells.append(f"{drop}({100 * f.get('same_answer', math.nan):.0f}%)")
            print(f"| {label(m)} | " + " | ".join(cells) + " |")
    if timing:
        t = result["timing"]
        print(
            f"\nselect_tokens + prefill ms (median of {t['prompts']} prompts, {t['repeats']} repeats each); "
            f"unpruned prefill {timing['unpruned']['prefill_ms']:.3f} ms\n\n" + head + "\n" + rule
        )
        for m in result["methods"]:
            cells = [
                f"{timing[f'{m}@{r}']['select_tokens_ms']:.3f} + {timing[f'{m}@{r}']['prefill_ms']:.3f}" for r in ratios
            ]
            print(f"| {label(m)} | " + " | ".join(cells) + " |")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        path = replot(args.replot, args.plot)
        print(f"plot saved to {path}")
        return {"plot": path}
    from litevlm.data.source import check_data_options
    from litevlm.eval.intervals import RESAMPLES
    from litevlm.models import resolve_model_dir
    from litevlm.options import format_options
    from litevlm.pipeline import Pipeline
    from litevlm.select.tokens import TokenSelector

    check_data_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.r.split(",") if r.strip()]
    methods = method_list(args.methods, args.per_view)
    progress = not args.no_progress
    t_start = time.time()
    pipe = Pipeline.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens, **format_options(args)
    )
    absent: dict[str, str] = {}
    selector = None
    folder = Path(args.selector) if args.selector else resolve_model_dir(args.model) / "token_selector"
    wanted = [m for m in methods if m.startswith("token-selector")]
    if wanted and (args.selector or folder.is_dir()):  # one asked for must load
        selector = TokenSelector.load(folder, pipe.model)
    for m in wanted:  # a model whose TokenSelector is not trained yet, or cannot prune there: reported, not an error
        if selector is None:
            absent[m] = f"{pipe.name} has no token_selector/ folder"
        elif m in SELECTOR_INSIDE and selector.prunes_inside:
            absent[m] = "its TokenSelector reads decoder layer 0's output and prunes after that layer"
        if m in absent:
            methods.remove(m)
    samples = load_questions(args.data, args.images, args.n, args.seed, args.frames)
    if not samples:
        raise SystemExit("no questions to answer")
    prompts = Prompts(pipe, args.views)
    configs = {"unpruned": selection(pipe, None, 1.0, None, 0)}
    configs |= {f"{m}@{r}": selection(pipe, m, r, selector, 0) for m in methods for r in ratios}

    t0 = time.time()
    records, kept, same, loglik, shares = run_accuracy(pipe, samples, prompts, configs, progress, args.fidelity)
    answer_s = time.time() - t0
    base = records["unpruned"]
    frames = [r["frame"] for r in base]  # the bootstrap's clusters: a frame's questions share its images
    per_question = {
        key: question_scores(recs, None if key == "unpruned" else same[key], loglik[key], loglik["unpruned"])
        for key, recs in records.items()
    }
    unpruned = summarise(base, kept["unpruned"]) | spreads(per_question["unpruned"], frames)
    if "loglik" in per_question["unpruned"]:
        unpruned["loglik"] = round(statistics.fmean(per_question["unpruned"]["loglik"]), 5)
    scores = {
        key: summarise(recs, kept[key], base) | spreads(per_question[key], frames)
        for key, recs in records.items()
        if key != "unpruned"
    }
    if "token-selector" in methods:  # every other method against the TokenSelector at the same r, question by question
        for key, score in scores.items():
            method, r = key.split("@")
            if method != "token-selector":
                score["vs_selector"] = paired_closed(records[f"token-selector@{r}"], records[key])
                sel = per_question[f"token-selector@{r}"]
                score["vs_selector_paired"] = versus_selector(method, per_question[key], sel, frames)
    t0 = time.time()
    timing = (
        run_timing(pipe, samples[: args.timing_n], prompts, configs, args.repeats, progress) if args.timing_n else {}
    )
    timing_s = time.time() - t0
    data = (
        str(args.data)
        if args.data
        else f"synthetic held-out frames, seed {args.seed}, {args.frames} frames (in memory)"
    )
    result = {
        "benchmark": "token_pruning",
        "schema": 3,
        "model": pipe.name,
        "data": data,
        "n": len(samples),
        "n_closed": sum(1 for r in base if r["closed"]),
        "views": args.views,
        "ratios": ratios,
        "methods": methods,
        "labels": {m: label(m) for m in [*methods, *absent]},
        "absent": absent,
        "selector": None if selector is None else dataclasses.asdict(selector.cfg),
        "per_view": args.per_view,
        # how this code runs the methods (runs before these keys ranked FastV by layer K, timed it in the prefill,
        # and spread CDPruner's budget over all the tokens at once)
        "fastv_ranks_by": "layer K-1",
        "selection_timed_as": "select_tokens",
        "splits": {m: split_name(m) for m in methods},
        "max_new_tokens": args.max_new_tokens,
        "scoring": SCORING,
        "visual_tokens": round(statistics.fmean(kept["unpruned"]), 3),
        "visual_share": round(statistics.fmean(shares), 4),
        "unpruned": unpruned,
        "scores": scores,
        "intervals": f"95% bootstrap over frames (a frame's questions together), {RESAMPLES} resamples, seed 0",
        "questions": {"id": [r["id"] for r in base], "frame": frames, "closed": [int(bool(r["closed"])) for r in base]},
        "per_question_fields": {k: v for k, v in PER_QUESTION.items() if args.fidelity or k not in ("drop", "loglik")},
        "per_question": per_question,
        "timing": {"prompts": min(args.timing_n, len(samples)), "repeats": args.repeats, "backend": pipe.backend.name},
        "timing_ms": timing,
        "answer_seconds": round(answer_s, 1),
        "timing_seconds": round(timing_s, 1),
        "seconds": round(time.time() - t_start, 1),
        "machine": machine(pipe.model.device),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "plot": args.plot,
    }
    print_tables(result)
    if args.plot:
        plot(args.plot, result)
        print(f"\nplot saved to {args.plot}")
    if args.predictions:
        Path(args.predictions).write_text(json.dumps(records, indent=1))
    print(json.dumps(result, separators=(",", ":")))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
