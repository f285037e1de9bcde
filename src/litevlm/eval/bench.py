"""`litevlm bench`: the paper's Table 1 (arXiv 2506.07416) re-measured on any model and machine.

Every configuration answers the same questions on the same images in one run, interleaved question by question
so that machine noise hits all rows alike, in an order shuffled anew for each question so that no row always
follows the same one (a row after a similar one finds the caches warm); the first questions warm every row up
and are not counted.

A row reports means over the questions, as the paper's table does: each stage's mean (the pipeline's own times,
device synchronised at stage boundaries); `other_ms`, what an answer's end-to-end time holds outside the five stages
(input checks, building and embedding the prompt, detokenising, the steps between stages), so that the stages and
other add up to `total_ms`, the paper's measure; its p50 and p90 beside it. As in the pipeline's own total, the
images' decoding and resizing into tiles is not in it: it is reported apart as `preprocess_ms`. `speedup` is the
baseline's mean total over the row's; extend-one = decode time / tokens the decode stage made. What a user lives
with is `e2e_ms`: from the images as the caller hands them over (here the frames as a camera stack delivers them,
HxWx3 uint8 arrays) to the last token, preprocessing included, with `p50_e2e_ms`, `p90_e2e_ms` and `e2e_speedup`
(the baseline's mean e2e over the row's).

Frame mode (`questions_per_frame` K > 1, `litevlm bench --questions-per-frame K`) asks K questions of each frame (the
frame's first K, in the data's order: DriveLM's perception, prediction, planning, behaviour), each row twice on the
same questions, side by side: as strangers (`answer(question, images)`, one question a frame: Table 1's way) and
through one `Pipeline.frame` per frame (each view read and encoded once for its questions). The frame rows give the
mean e2e per question of both, their ratio, the views encoded and whether every answer was the same. A precision this
device only emulates (FP8 without FP8 kernels, as on a CPU) makes an accuracy row: its times are no speed figure
(`speed_figure` false, `speedup` null). The DriveLM score of each row comes from the answers of this same run.

The `transformers` rows run transformers' `generate` on the same weights, exported through `litevlm convert`, with
the dynamic ("eager") and the static cache, on the baseline's own prompt ids and tiles (the checkpoint's chat
template and tiling): both sides answer from identical inputs. Their e2e includes their own image processing, timed:
the same frames cut by PIL's bicubic resize, the bytes transformers' PIL image processor makes.
"""

from __future__ import annotations

import copy
import json
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.eval.timing import emulated_precision, mean_latency, percentile
from litevlm.model import cpu_steps
from litevlm.pipeline import STAGES
from litevlm.presets import BF16_CONFIGS, CONFIGS, GRAPH_BACKENDS, HF_ROWS

# The table's columns in the paper's order; `select_ms` is select_views + select_tokens (the paper's "sel" column),
# so that vit + prefill + decode + select + other = total, row by row.
COLUMNS = (
    "config",
    "views",
    "visual_tokens",
    "input_tokens",
    "vit_ms",
    "prefill_ms",
    "extend_one_ms",
    "decode_ms",
    "select_ms",
    "other_ms",
    "total_ms",
    "p50_total_ms",
    "p90_total_ms",
    "speedup",
    "score",
)
# What an accuracy row (an emulated precision) shows: no time.
ACCURACY_COLUMNS = ("config", "precision", "views", "visual_tokens", "input_tokens", "score", "tau")


@dataclass
class RowLog:
    """One configuration's measurements, question by question; `row` makes them the table's row (means)."""

    views: list[int] = field(default_factory=list)
    visual_tokens: list[int] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    total: list[float] = field(default_factory=list)  # end-to-end ms of each answer, preprocessing apart
    e2e: list[float] = field(default_factory=list)  # from the images as given to the last token (None: not timed)
    preprocess: list[float | None] = field(default_factory=list)  # images into tiles (None: not timed)
    new_tokens: list[int] = field(default_factory=list)
    opened: list[int] = field(default_factory=list)  # answer tokens accepted with the prompt (answer openings)
    records: list[dict] = field(default_factory=list)
    accept: list[int] = field(default_factory=list)
    precision: str = ""
    emulated: bool = False  # the precision is emulated on this device (`emulated_precision`): no speed figure

    def add(
        self,
        *,
        views: int,
        visual_tokens: int,
        input_tokens: int,
        stages: Mapping[str, float],
        new_tokens: int,
        opened: int = 0,
        total: float | None = None,
        preprocess: float | None = None,
        e2e: float | None = None,
    ) -> None:
        """One answer: its stage times in ms (a stage it did not run counts 0), its end-to-end time `total` less the
        images' preprocessing (default: the stages' sum, nothing outside them), that preprocessing's ms, and `e2e`,
        from the images as given to the last token (default: total + preprocess)."""
        unknown = set(stages) - set(STAGES)
        if unknown:
            raise ValueError(f"stages: {sorted(unknown)} are not among {STAGES}")
        for s in STAGES:
            self.stages[s].append(float(stages.get(s, 0.0)))
        self.total.append(sum(self.stages[s][-1] for s in STAGES) if total is None else float(total))
        self.preprocess.append(preprocess)
        self.e2e.append(self.total[-1] + (preprocess or 0.0) if e2e is None else float(e2e))
        self.views.append(views)
        self.visual_tokens.append(visual_tokens)
        self.input_tokens.append(input_tokens)
        self.new_tokens.append(new_tokens)
        self.opened.append(opened)

    def add_answer(self, ans, wall: float, record: dict) -> None:
        """A pipeline's Answer that took `wall` ms from the images as given (its e2e): its stages, its total less
        the images' preprocessing, as in the pipeline's own total, and its record for the score."""
        pre = ans.timings_ms.get("preprocess", 0.0)
        self.add(
            views=len(ans.views),
            visual_tokens=ans.num_visual_tokens,
            input_tokens=ans.input_tokens,
            stages={st: ans.timings_ms.get(st, 0.0) for st in STAGES},
            new_tokens=len(ans.tokens),
            opened=ans.opened_tokens,
            total=wall - pre,
            preprocess=pre,
            e2e=wall,
        )
        self.accept += ans.accept_lengths
        self.records.append(record)
        self.precision = ans.precision

    def mean_total(self) -> float:
        """The mean end-to-end ms, as `row` reports it (`total_ms`): what the speed-ups divide."""
        return mean_latency(self.stages, self.total)["total_ms"]

    def mean_e2e(self) -> float:
        """The mean e2e ms (`e2e_ms`): what `e2e_speedup` divides."""
        return round(statistics.fmean(self.e2e), 3)

    def row(self, name: str, baseline_total: float | None, score, baseline_e2e: float | None = None) -> dict:
        """The table's row: means over the questions (`mean_latency`); `speedup` = baseline_total (the baseline's
        `total_ms`) / this row's `total_ms`, `e2e_speedup` = baseline_e2e / this row's `e2e_ms`; None without a
        baseline or for an emulated precision."""
        lat = mean_latency(self.stages, self.total)
        e2e = self.mean_e2e()
        steps = sum(max(0, n - 1 - o) for n, o in zip(self.new_tokens, self.opened))  # the tokens the decode stage made
        speed = not self.emulated
        timed = speed and baseline_total and lat["total_ms"]
        return {
            "config": name,
            "views": round(statistics.fmean(self.views), 2),
            "visual_tokens": round(statistics.fmean(self.visual_tokens), 1),
            "input_tokens": round(statistics.fmean(self.input_tokens), 1),
            **{f"{s}_ms": lat[f"{s}_ms"] for s in STAGES},
            "select_ms": round(lat["select_views_ms"] + lat["select_tokens_ms"], 3),
            "other_ms": lat["other_ms"],
            "total_ms": lat["total_ms"],
            "p50_total_ms": lat["p50_total_ms"],
            "p90_total_ms": lat["p90_total_ms"],
            "preprocess_ms": (
                round(statistics.fmean(self.preprocess), 3) if all(p is not None for p in self.preprocess) else None
            ),
            "decode_tokens": round(steps / len(self.total), 3),
            "extend_one_ms": round(sum(self.stages["decode"]) / steps, 3) if steps else None,
            "speedup": round(baseline_total / lat["total_ms"], 2) if timed else None,
            "e2e_ms": e2e,
            "p50_e2e_ms": round(percentile(self.e2e, 50), 3),
            "p90_e2e_ms": round(percentile(self.e2e, 90), 3),
            "e2e_speedup": round(baseline_e2e / e2e, 2) if speed and baseline_e2e and e2e else None,
            "preprocess_share": round(statistics.fmean(self.preprocess) / e2e, 4)
            if e2e and all(p is not None for p in self.preprocess)
            else None,
            "speed_figure": speed,
            "emulated": self.emulated,
            "score": score,
            "tau": round(statistics.fmean(self.accept), 3) if self.accept else None,
            "opened_tokens": round(statistics.fmean(self.opened), 3) if self.opened else 0.0,
            "precision": self.precision,
            "mean_total_ms": lat["total_ms"],  # total_ms's name from when total_ms was a median
            "shares": self.shares(),
        }

    def shares(self) -> dict[str, float]:
        """Each stage's part of the end-to-end time summed over the questions (= its mean over the mean total), other
        included, so that they add up to 1; `select` is select_views + select_tokens."""
        total = sum(self.total)
        st = self.stages
        parts = {
            "vit": sum(st["vit"]),
            "select": sum(st["select_views"]) + sum(st["select_tokens"]),
            "prefill": sum(st["prefill"]),
            "decode": sum(st["decode"]),
        }
        parts["other"] = total - sum(parts.values())
        return {name: round(t / total, 4) if total else 0.0 for name, t in parts.items()}


def raw_frames(images: Mapping) -> dict:
    """A frame's images as a camera stack hands them over: HxWx3 uint8 arrays (decoded once, outside any timing)."""
    import numpy as np

    return {cam: np.asarray(im.convert("RGB") if im.mode != "RGB" else im) for cam, im in images.items()}


def _samples(data, n: int, seed: int, images_root=None):
    """Questions with their images as raw frames (`raw_frames`): the first of a DriveLM folder/file (every image
    file checked up front), or held-out synthetic frames made in memory."""
    from litevlm.data.drivelm import load_images, samples_from_frame
    from litevlm.data.source import load_data
    from litevlm.data.synthetic import make_frame, render_views

    if data:
        out = load_data(data, images_root)[:n]
        cache = {}
        for s in out:
            if s.frame_id not in cache:
                cache[s.frame_id] = raw_frames(load_images(s))
            s.images = cache[s.frame_id]
        return out
    out, i = [], 0
    while len(out) < n:
        frame = make_frame(seed, i)
        out += samples_from_frame(frame, raw_frames(render_views(frame, size=(800, 450))))
        i += 1
    return out[:n]


def _pipelines(
    model: str,
    configs: dict[str, dict],
    max_new_tokens: int,
    shape: str | None,
    backend: str = "auto",
    load: dict | None = None,
    compile_steps: bool | None = None,
):
    """One pipeline per row, each with its execution backend (`litevlm.model.backend`); `load` holds
    `Pipeline.from_pretrained`'s device, dtype and prompt format options."""
    from litevlm.pipeline import Pipeline

    if shape is None:
        return {
            name: Pipeline.from_pretrained(
                model,
                max_new_tokens=max_new_tokens,
                backend=backend,
                compile_steps=compile_steps,
                **(load or {}),
                **opts,
            )
            for name, opts in configs.items()
        }
    weights = {}  # one set of random weights for every row (a 2B model in fp32 is 9 GB): see random_pipeline
    return {
        name: random_pipeline(
            shape, model, max_new_tokens, backend=backend, weights=weights, compile_steps=compile_steps, **opts
        )
        for name, opts in configs.items()
    }


def sharing_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose modules and buffers are its own (the KV cache, attributes, layers that quantising
    replaces) and whose weights are `model`'s tensors, with what its modules derived from them (the native steps'
    packing, the row-major copies of the CPU's projections, the vision blocks' packing): rows built on such copies
    hold the weights once."""
    memo = {id(p): p for p in model.parameters()}

    def derived(v) -> None:  # the tensors of a module's caches (packings, transposed copies, tables)
        if isinstance(v, torch.Tensor):
            memo[id(v)] = v
        elif isinstance(v, (tuple, list)):
            for x in v:
                derived(x)

    for m in model.modules():
        for name, v in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):  # buffers (the KV cache) stay each row's own
                derived(v)
    return copy.deepcopy(model, memo)


def random_pipeline(
    shape: str,
    tokenizer_model: str,
    max_new_tokens: int,
    *,
    select_views=False,
    select_tokens=None,
    min_select_tokens: int = 0,
    fastv_k=None,
    fastv_r=None,
    speculative=False,
    fp8=None,
    seed: int = 0,
    backend: str = "auto",
    openings: bool = True,
    weights: dict | None = None,
    compile_steps: bool | None = None,
):
    """A pipeline at a real model's shapes with random weights (latency only): `--shape 2b` etc.

    The text side borrows drive-tiny's tokenizer (its ids fit every real vocabulary); each camera is cut
    into two tiles as in the paper's 12-tile layout. Selectors and the draft head are random too, and the draft head has
    no answer openings (`openings` is accepted for the ablation rows and changes nothing here). The draft tree is
    a fixed-size chain (no probability cut): random drafts would cut every chain after a node or two, and a CUDA
    backend replays the verification graph of the tree size it captured, so the rows measure the graph that runs.
    """
    from litevlm.config import preset
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.vlm import VLM
    from litevlm.models import resolve_model_dir
    from litevlm.pipeline import Pipeline

    path = resolve_model_dir(tokenizer_model)
    tok = Tokenizer.from_dir(path)
    cfg = preset(shape)
    cfg.tiles_per_view = 2
    cfg.image_token_id, cfg.img_start_id, cfg.img_end_id = tok.image_id, tok.img_start_id, tok.img_end_id
    cfg.eos_token_id, cfg.pad_token_id = tok.eos_id, tok.pad_id
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    # `weights` (shared by the rows of one run) maps these shapes to (the model rows copy, whether it is a plain row's
    # after its warm-up); every row runs on a copy sharing its tensors (`sharing_weights`).
    key = (shape, seed, dev)
    source, warm = (weights or {}).get(key, (None, False))
    if source is None:
        torch.manual_seed(seed)
        with torch.device(dev):
            source = VLM(cfg).to(dtype).eval()
    model = sharing_weights(source)
    parts = {}
    if select_views:
        from litevlm.select.views import ViewSelector

        parts["view_selector"] = ViewSelector.load(path)
    if select_tokens is not None:
        from litevlm.select.tokens import SelectorConfig, TokenSelector

        sel = TokenSelector.from_model(model, SelectorConfig()).to(device=dev, dtype=dtype)
        parts["token_selector"] = sel
        parts["keep_ratio"] = sel.cfg.keep_ratio if select_tokens is True else select_tokens
        parts["min_select_tokens"] = min_select_tokens
    if fastv_k is not None:
        parts["fastv"] = (fastv_k, fastv_r)
    if speculative:
        from litevlm.spec.draft import DraftConfig, DraftHead
        from litevlm.spec.tree import TreeConfig

        parts["draft"] = DraftHead(DraftConfig.for_target(cfg.text), model).to(device=dev, dtype=dtype)
        parts["tree"] = TreeConfig(min_value=0.0)
    if fp8 is not None:
        from litevlm.quant.fp8 import FP8Recipe, quantize_model

        quantize_model(model, FP8Recipe(fp8))
    # Random weights never emit EOS reliably: every answer runs to max_new_tokens, the same for all rows.
    # (Only the stopping rule changes: the prompt keeps its end-of-turn token.)
    pipe = Pipeline(
        model,
        tok,
        max_new_tokens=max_new_tokens,
        name=f"random-{shape}",
        backend=backend,
        compile_steps=compile_steps,
        **parts,
    )
    pipe.stop_id = None
    if weights is not None and not warm:
        # a plain row's model, with what its warm-up derived from the weights: the later rows copy it and share that too
        plain = not (select_tokens or fastv_k or fp8)
        weights[key] = (model, True) if plain else (source, False)
    return pipe


def hf_inputs(pipe, s) -> tuple[torch.Tensor, torch.Tensor]:
    """What the transformers rows give `generate` for sample `s`: the pipeline's own prompt over all six views (its
    chat template, camera labels and tiling) as ids (1, T), and the views cut as transformers' PIL image processor
    cuts them (PIL's bicubic resize, `resample="pil"`) into tiles (tiles, 3, S, S): the baseline's inputs, its
    pixels within one level."""
    pixels, counts = pipe.tiles(s.images, list(CAMERAS), resample="pil")
    layout = pipe.format.build(pipe.tokenizer, s.question, list(CAMERAS), counts)
    dev = pipe.model.device
    return torch.tensor([layout.ids], device=dev), pixels.to(dev, pipe.model.dtype)


def _hf_runner(pipe, logs: dict[str, RowLog], max_new_tokens: int, share: bool = False):
    """transformers' generate on the same weights (exported through our converter and loaded back; with `share`, a
    view of the pipeline's own tensors, `litevlm.model.hf.transformers_view`), dynamic and static cache: a function
    (sample, counted) that answers one question in both rows (logged when counted, i.e. past the warm-up), so the
    run can interleave them with ours question by question."""
    from transformers import DynamicCache, InternVLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from litevlm.model.hf import save_hf, transformers_view

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    tok = pipe.tokenizer
    if share:
        hf = transformers_view(pipe.model)
    else:
        with tempfile.TemporaryDirectory() as d:
            save_hf(pipe.model, d, tokenizer=None)
            hf = InternVLForConditionalGeneration.from_pretrained(d, dtype=pipe.model.dtype)
        hf = hf.to(pipe.model.device).eval()
    dev = pipe.model.device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)

    def run(s, counted: bool) -> None:
        for name, cache_impl in zip(HF_ROWS, (None, "static")):
            sync()
            t_pre = time.perf_counter()
            ids, pix = hf_inputs(pipe, s)  # their own image processing, in their e2e
            sync()
            pre = (time.perf_counter() - t_pre) * 1e3
            with torch.inference_mode():
                sync()
                t0 = time.perf_counter()
                feats = hf.model.get_image_features(pixel_values=pix)
                sync()
                t1 = time.perf_counter()
                feats = getattr(feats, "pooler_output", feats)  # (tiles, tokens, C)
                embeds = hf.model.get_input_embeddings()(ids)
                embeds = embeds.masked_scatter((ids == hf.config.image_token_id)[..., None], feats.to(embeds.dtype))
                hf(inputs_embeds=embeds, cache=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1)
                sync()
                t2 = time.perf_counter()
                kw = {"cache_implementation": "static"} if cache_impl else {}
                if pipe.stop_id is None:  # random weights: every row runs to max_new_tokens (see random_pipeline)
                    kw["min_new_tokens"] = max_new_tokens
                out = hf.generate(
                    input_ids=ids,
                    pixel_values=pix,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tok.eos_id,
                    pad_token_id=tok.pad_id,
                    **kw,
                )
                sync()
                t3 = time.perf_counter()
            if not counted:
                continue
            new = out[0, ids.shape[1] :].tolist()
            # Vision and prefill (merge + language model) are timed apart; generate holds vision + prefill + decode.
            # The answer is generate's: its decode is what generate took beyond the vision and prefill timed apart,
            # and nothing lies outside the stages (other 0).
            vit, prefill, gen = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3
            logs[name].add(
                views=len(CAMERAS),
                visual_tokens=int((ids == hf.config.image_token_id).sum()),
                input_tokens=ids.shape[1],
                stages={"vit": vit, "prefill": prefill, "decode": max(0.0, gen - vit - prefill)},
                new_tokens=len(new),
                preprocess=pre,
            )
            text = tok.decode([t for t in new if t != tok.eos_id]).strip()
            logs[name].records.append(answer_record(s, text, len(CAMERAS)))
            logs[name].precision = str(pipe.model.dtype).removeprefix("torch.")

    return run


class JsonLines:
    """`litevlm bench --jsonl PATH`: the run's figures appended to PATH as JSON lines the moment each is known (the
    pipelines built, then each measured answer, then each finished row), so that a run cut short still leaves them.
    Every line has its `type` ("setup", "answer", "row") and `elapsed_s`, the seconds since the run began."""

    def __init__(self, path=None):
        self.path, self.t0 = (None if path is None else Path(path)), time.perf_counter()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields) -> None:
        if self.path is None:
            return
        line = {"type": kind, "elapsed_s": round(time.perf_counter() - self.t0, 3), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")

    def answer(self, config: str, log: RowLog, question: int, **extra) -> None:
        """The answer `log` holds last: its question's place among the measured ones, stage times, end-to-end time."""
        self.write(
            "answer",
            config=config,
            question=question,
            views=log.views[-1],
            input_tokens=log.input_tokens[-1],
            new_tokens=log.new_tokens[-1],
            stages_ms={st: round(times[-1], 3) for st, times in log.stages.items()},
            total_ms=round(log.total[-1], 3),
            precision=log.precision,
            **extra,
        )


def answer_record(s, text: str, views: int | None = None) -> dict:
    """The scoring record of a sample answered with `text` (and the number of views it read, where given)."""
    out = {
        "id": s.id,
        "question": s.question,
        "answer": text,
        "gt": s.answer,
        "tag": s.tag,
        "closed": s.closed,
        "frame": s.frame_id,
    }
    return out if views is None else out | {"views": views}


def default_configs(shape: str | None, load: dict | None) -> dict[str, dict]:
    """The paper's rows, and their bf16-matmul twins where they apply: a real model in fp32 on a CPU whose
    instructions multiply bf16 (on a GPU, or in bf16, a pipeline refuses `matmul="bf16"`)."""
    from litevlm.model.layers import bf16_matmul_supported

    on = {"device": "cpu", "dtype": "float32", **{k: v for k, v in (load or {}).items() if v is not None}}
    cpu_fp32 = shape is None and on["device"] == "cpu" and on["dtype"] == "float32"
    return {**CONFIGS, **(BF16_CONFIGS if cpu_fp32 and bf16_matmul_supported() else {})}


def run_bench(
    model: str = "drive-tiny",
    data=None,
    n: int = 60,
    shape: str | None = None,
    configs=None,
    hf: bool = True,
    max_new_tokens: int = 160,
    warmup: int = 3,
    seed: int = 1,
    progress: bool = True,
    cuda_graphs: bool = False,
    images_root=None,
    backend: str = "auto",
    load: dict | None = None,
    jsonl=None,
    scored: bool = True,
    questions_per_frame: int = 1,
    compile_steps: bool | None = None,
) -> dict:
    """Every row of `configs` (default: the paper's table) on the first `n` questions of `data` after `warmup`
    (default: held-out synthetic frames of `seed`), plus transformers' generate rows with `hf`. A real model's rows
    carry DriveLM's score unless `scored` is False (then no language metrics are needed: latency and closed-question
    accuracy only); random weights at a preset's shapes are never scored.

    jsonl: a file the figures are appended to as they come, one JSON line each (`JsonLines`).
    questions_per_frame: K > 1 is frame mode (module docstring): n questions in frames of K, `warmup` frames first.

    images_root: where a DriveLM JSON's images live. load: `Pipeline.from_pretrained` options shared by every row
    (device, dtype, and the prompt format of a checkpoint without prompt.json: system, camera_label, tiles,
    max_tiles, thumbnail); the transformers rows get the baseline's prompt ids and tiles (`hf_inputs`).
    """
    from litevlm.eval.metrics import closed_accuracy, score
    from litevlm.model.generate import sync
    from litevlm.quant.fp8 import FP8Linear

    if configs is None:
        configs = default_configs(shape, load)
    if cuda_graphs:
        backend = "cuda"
    if backend == "cuda" and not torch.cuda.is_available():
        raise LiteVLMError(
            "--backend cuda (--cuda-graphs) measures a CUDA device and this machine has none; --backend cuda-twin runs"
            " the same steps' CPU twin"
        )
    if backend == "cuda" and shape is None and (load or {}).get("device", "cpu") == "cpu":
        raise LiteVLMError("--backend cuda (--cuda-graphs) runs a checkpoint on the GPU: add --device cuda")
    if shape is not None and any(v is not None for v in (load or {}).values()):
        raise LiteVLMError("--shape measures random weights at a preset's shapes: it takes no model or format options")
    if questions_per_frame < 1:
        raise LiteVLMError(f"--questions-per-frame must be >= 1; got {questions_per_frame}")
    if questions_per_frame > 1 and shape is not None:
        raise LiteVLMError("frame mode asks a real model's questions: it takes no --shape")
    lines = JsonLines(jsonl)
    if questions_per_frame > 1:
        frames = _frames(data, n, warmup, questions_per_frame, seed, images_root)
        pipes = _pipelines(model, configs, max_new_tokens, shape, backend, load, compile_steps)
        return _run_frames(pipes, frames, warmup, progress, lines, seed, model, scored), None
    samples = _samples(data, n + warmup, seed, images_root)
    pipes = _pipelines(model, configs, max_new_tokens, shape, backend, load, compile_steps)
    lines.write(
        "setup",
        configs=list(pipes),
        backends={k: p.backend.name for k, p in pipes.items()},
        setup_ms={k: round(p.setup_ms, 1) for k, p in pipes.items()},
    )
    logs = {name: RowLog() for name in (*configs, *(HF_ROWS if hf else ()))}
    hf_run = None
    if hf:
        hf_pipe = pipes["baseline"] if "baseline" in pipes else next(iter(pipes.values()))
        if any(isinstance(m, FP8Linear) for m in hf_pipe.model.modules()):
            raise LiteVLMError(
                "the transformers rows would run FP8 weights (an FP8 checkpoint, or an fp8 row and no baseline row), "
                "which transformers cannot load: add --no-transformers"
            )
        hf_run = _hf_runner(hf_pipe, logs, max_new_tokens, share=shape is not None)
    # Each question's rows run in a freshly shuffled order (seeded; the transformers pair counts as one row): a row
    # run right after a similar one finds its weights and images warm in the caches, and a fixed order would hand
    # that to the same rows every time (LiteVLM right after "views + eagle", say).
    order = [*pipes.items(), *((("transformers", None),) if hf_run is not None else ())]
    shuffler = random.Random(seed)
    for i, s in enumerate(tqdm(samples, desc="bench", disable=not progress)):
        shuffler.shuffle(order)
        for name, pipe in order:
            if pipe is None:  # the transformers rows answer each question beside ours: the same moment of the machine
                hf_run(s, counted=i >= warmup)
                for h in HF_ROWS if i >= warmup else ():
                    lines.answer(h, logs[h], i - warmup)
                continue
            sync(pipe.model.device)
            t0 = time.perf_counter()
            ans = pipe.answer(s.question, s.images)
            sync(pipe.model.device)
            wall = (time.perf_counter() - t0) * 1e3  # the whole answer, from the images as given: e2e
            if i < warmup:
                continue
            log = logs[name]
            log.add_answer(ans, wall, answer_record(s, ans.text, len(ans.views)))
            lines.answer(name, log, i - warmup, accept_lengths=list(ans.accept_lengths))
    for name, pipe in pipes.items():  # FP8 without FP8 kernels here: an accuracy row
        logs[name].emulated = emulated_precision(pipe.model)
    # Speed-ups divide the baseline's mean total; an emulated baseline gives none.
    base = logs.get("baseline")
    base_total = base.mean_total() if base is not None and base.total and not base.emulated else None
    base_e2e = base.mean_e2e() if base_total else None
    rows = []
    for name, log in logs.items():
        sc = None
        if shape is None and scored:
            res = score(log.records)
            sc = round(res["final"], 4) if res["final"] is not None else None
        row = log.row(name, base_total, sc, base_e2e)
        if shape is None:
            row["closed_accuracy"] = closed_accuracy(log.records)
        rows.append(row)
        lines.write("row", **row)
    if shape is None and scored and "baseline" in logs and logs["baseline"].records:
        paired, pairs = vs_baseline(logs), vs_pairs(logs)
        for r in rows:
            if r["config"] in paired:
                r["vs_baseline"] = paired[r["config"]]
            if r["config"] in pairs:
                r["vs_pair"] = pairs[r["config"]]
    dev = next(iter(pipes.values())).model.device.type  # every row runs on one device
    per_question = {
        name: {"views": log.views, "vit": log.stages["vit"], "input_tokens": log.input_tokens}
        | {"prefill": log.stages["prefill"], "emulated": log.emulated}
        for name, log in logs.items()
    }
    return {
        "model": model if shape is None else f"random weights, {shape} shapes",
        "device": dev,
        "threads": torch.get_num_threads(),
        "cpu_steps": cpu_steps.backend(),
        "questions": len(samples) - warmup,
        "rows": rows,
        "cuda_graphs": any(p.backend.name in GRAPH_BACKENDS for p in pipes.values()),  # "auto" on a GPU too
        "backends": {name: p.backend.name for name, p in pipes.items()},
        "setup_ms": {name: round(p.setup_ms, 1) for name, p in pipes.items()},
        "capture_ms": {name: round(p.setup_ms, 1) for name, p in pipes.items()},  # setup_ms's older name
        "graph_replays": {name: dict(p.backend.stats) for name, p in pipes.items()},
        # the SDPA kernel each static step ran under, e.g. {"decode": "efficient", ...}; None off the CUDA backend
        "attention_kernels": {name: p.backend.kernels for name, p in pipes.items()},
        # whether each row's prefill ran compiled steps (CUDA backend) and its decode steps compiled ones too
        "compiled": {
            name: {"prefill": getattr(p.backend, "compile", False), "steps": getattr(p.backend, "compile_steps", False)}
            for name, p in pipes.items()
        },
        "peak_memory_mb": peak_memory_mb(dev),
    }, per_question


# The comparisons a bench run pairs besides each row against the baseline: (row, the row it is read against, what
# the pair measures). Each is the row's one technique or precision alone: the same pipeline with and without it.
PAIRS = (
    ("views + eagle", "eagle", "view selection against all views"),
    ("litevlm fp8", "litevlm", "FP8 against full precision"),
    ("litevlm bf16", "litevlm", "bf16 against fp32"),
)


def paired_rows(a: list[dict], b: list[dict]) -> dict:
    """Row a's records against row b's on the same questions (the same order): the paired difference of the DriveLM
    final (each question's share of it, `litevlm.eval.per_question`) and of the closed-question accuracy, with 95%
    intervals from resampling the frames (`litevlm.eval.intervals`); {} where the questions span fewer than two
    frames."""
    from litevlm.eval.intervals import both_scored, paired_difference
    from litevlm.eval.per_question import final_per_question

    frames = [r["frame"] for r in b]
    if len(a) != len(b) or len(set(frames)) < 2:
        return {}
    out = {}
    for key, score in (("final", final_per_question), ("closed", _closed_right)):
        x, y, f = both_scored(score(a), score(b), frames)
        if x:
            out[key] = paired_difference(x, y, f).to_dict()
    return out


def _closed_right(records: list[dict]) -> list[float | None]:
    from litevlm.eval.metrics import answered_right

    return [float(answered_right(r)) if r.get("closed") else None for r in records]


def vs_baseline(logs: dict) -> dict[str, dict]:
    """Each row against the baseline on the same questions (`paired_rows`)."""
    base = logs["baseline"].records
    out = {}
    for name, log in logs.items():
        if name != "baseline":
            both = paired_rows(log.records, base)
            if both:
                out[name] = both
    return out


def vs_pairs(logs: dict) -> dict[str, dict]:
    """`PAIRS` where the run has both rows: {row: {"against": its other row, "measures": what, "final": ...,
    "closed": ...}}."""
    out = {}
    for name, other, what in PAIRS:
        if name in logs and other in logs:
            both = paired_rows(logs[name].records, logs[other].records)
            if both:
                out[name] = {"against": other, "measures": what, **both}
    return out


def run_batch_bench(
    model: str = "drive-tiny",
    data=None,
    n: int = 60,
    configs=None,
    batch: int = 8,
    max_new_tokens: int = 160,
    warmup: int = 3,
    seed: int = 1,
    progress: bool = True,
    images_root=None,
    backend: str = "auto",
    load: dict | None = None,
    jsonl=None,
    scored: bool = True,
) -> dict:
    """Batch mode (`litevlm bench --batch B`): each row answers the same `n` questions twice, one at a time and with
    up to `batch` decoding together (`Pipeline.answer_many`: each question prefilled alone as it is admitted, a
    question joining as one leaves), side by side in a shuffled order. Every question reads and encodes its own
    views (a fresh frame each, as Table 1's strangers). Per row and batch size: questions/s over the whole run
    (prefills included), decode tokens/s (the tokens the decode steps made / the time spent in them), the mean
    sequences in flight per step, the mean and p50 e2e per question, and how many answers equal batch 1's.
    Default rows: the baseline and LiteVLM (Table 1 itself stays at batch 1, the paper's measure)."""
    from litevlm.eval.metrics import closed_accuracy, score

    if batch < 2:
        raise LiteVLMError(f"--batch compares batch 1 with a larger batch: give 2 or more; got {batch}")
    if configs is None:
        configs = {k: v for k, v in default_configs(None, load).items() if k in ("baseline", "litevlm")}
    samples = _samples(data, n + warmup, seed, images_root)
    pipes = _pipelines(model, configs, max_new_tokens, None, backend, load)
    for name, pipe in pipes.items():
        if not pipe.can_batch:
            from litevlm.batch import batch_refusal

            raise LiteVLMError(f"--batch: the {name} row cannot batch: {batch_refusal(pipe.backend)}")
    lines = JsonLines(jsonl)
    sizes = (1, batch)
    for name, pipe in pipes.items():  # warm-up: every row at both sizes, not counted
        for b in sizes:
            list(pipe.answer_many([(s.question, pipe.frame(s.images)) for s in samples[:warmup]], max_batch=b))
    measured = samples[warmup:]
    runs: dict = {}
    order = [(name, b) for name in pipes for b in sizes]
    random.Random(seed).shuffle(order)
    for name, b in tqdm(order, desc="bench batch", disable=not progress):
        pipe = pipes[name]
        decoder = pipe.batch_decoder(b)
        work = [(s.question, pipe.frame(s.images)) for s in measured]  # fresh frames: every view encoded anew
        answers: list = [None] * len(work)
        t0 = time.perf_counter()
        for i, ans in pipe.answer_many(work, max_batch=b, decoder=decoder):
            answers[i] = ans
        wall = time.perf_counter() - t0
        e2e = [a.timings_ms["e2e"] for a in answers]
        run = {
            "questions_per_s": round(len(work) / wall, 3),
            "decode_tokens": decoder.decoded,
            "decode_s": round(decoder.seconds, 4),
            "decode_tokens_per_s": round(decoder.decoded / decoder.seconds, 1) if decoder.seconds else None,
            "mean_in_flight": round(decoder.occupancy, 2),
            "e2e_ms": round(statistics.fmean(e2e), 2),
            "p50_e2e_ms": round(percentile(e2e, 50), 2),
            "wall_s": round(wall, 3),
        }
        records = [answer_record(s, a.text, len(a.views)) for s, a in zip(measured, answers)]
        run["closed_accuracy"] = closed_accuracy(records)
        if scored:
            run["score"] = round(score(records)["final"] or 0.0, 4)
        runs[(name, b)] = (run, [a.tokens for a in answers])
        lines.write("batch_run", config=name, batch=b, **run)
    rows = []
    for name in pipes:
        one, one_tokens = runs[(name, 1)]
        many, many_tokens = runs[(name, batch)]
        same = sum(x == y for x, y in zip(one_tokens, many_tokens))
        rows.append(
            {
                "config": name,
                "batch_1": one,
                f"batch_{batch}": many,
                "decode_tokens_per_s_ratio": round(many["decode_tokens_per_s"] / one["decode_tokens_per_s"], 3)
                if one["decode_tokens_per_s"] and many["decode_tokens_per_s"]
                else None,
                "questions_per_s_ratio": round(many["questions_per_s"] / one["questions_per_s"], 3),
                "identical_to_batch_1": f"{same}/{len(one_tokens)}",
            }
        )
        lines.write("row", **rows[-1])
    return {
        "model": model,
        "mode": "batch",
        "batch": batch,
        "device": next(iter(pipes.values())).model.device.type,
        "threads": torch.get_num_threads(),
        "cpu_steps": cpu_steps.backend(),
        "questions": len(measured),
        "backends": {name: p.backend.name for name, p in pipes.items()},
        "batch_rows": rows,
        "rows": [],
    }


def format_batch(result: dict) -> str:
    """Batch mode's table: each row one at a time and batched, side by side, with the two ratios."""
    b = result["batch"]
    head = (
        f"| config | decode tok/s B=1 | decode tok/s B={b} | ratio | in flight B={b} | questions/s B=1 | "
        f"questions/s B={b} | ratio | p50 e2e ms B=1 | p50 e2e ms B={b} | same answers |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in result["batch_rows"]:
        one, many = r["batch_1"], r[f"batch_{b}"]
        lines.append(
            f"| {r['config']} | {one['decode_tokens_per_s']} | {many['decode_tokens_per_s']} | "
            f"{r['decode_tokens_per_s_ratio']}x | {many['mean_in_flight']} | {one['questions_per_s']} | "
            f"{many['questions_per_s']} | {r['questions_per_s_ratio']}x | {one['p50_e2e_ms']} | "
            f"{many['p50_e2e_ms']} | {r['identical_to_batch_1']} |"
        )
    return "\n".join(lines)


FAMILIES = ("perception", "prediction", "planning", "behavior")  # DriveLM's order of a frame's questions


def frame_questions(questions: list, k: int) -> list:
    """k of a frame's questions across DriveLM's families: one of each in turn (perception, prediction, planning,
    behaviour, then again), each family's in the data's order, the chosen ones in the data's order."""
    queues = [[s for s in questions if s.category == f] for f in FAMILIES]
    queues.append([s for s in questions if s.category not in FAMILIES])
    chosen: list = []
    while len(chosen) < k and any(queues):
        for q in queues:
            if q and len(chosen) < k:
                chosen.append(q.pop(0))
    return sorted(chosen, key=questions.index)


def _frames(data, n: int, warmup: int, k: int, seed: int, images_root=None) -> list[list]:
    """warmup + ceil(n / k) frames, each k of its questions (`frame_questions`; frames with fewer are skipped), with
    their images as raw frames, in the data's order."""
    from litevlm.data.drivelm import load_images
    from litevlm.data.source import load_data

    need = warmup + -(-n // k)
    if data:
        grouped: dict[str, list] = {}
        for s in load_data(data, images_root):
            grouped.setdefault(s.frame_id, []).append(s)
        frames = [frame_questions(qs, k) for qs in grouped.values() if len(qs) >= k][:need]
        for qs in frames:  # images decoded for the frames asked only
            images = raw_frames(load_images(qs[0]))
            for s in qs:
                s.images = images
    else:
        grouped = {}
        for s in _samples(None, need * 40, seed):
            grouped.setdefault(s.frame_id, []).append(s)
        frames = [frame_questions(qs, k) for qs in grouped.values() if len(qs) >= k][:need]
    if len(frames) < need:
        raise LiteVLMError(f"frame mode needs {need} frames of {k} questions or more; the data has {len(frames)}")
    return frames


def _run_frames(pipes: dict, frames: list[list], warmup: int, progress: bool, lines, seed: int, model, scored) -> dict:
    """Frame mode (module docstring): each row answers each frame's questions as strangers and through one frame,
    side by side in a shuffled order; e2e per question of both, the views each encoded, the cache's counts."""
    from litevlm.eval.metrics import closed_accuracy, score
    from litevlm.model.generate import sync

    k = len(frames[0])
    logs = {name: {"strangers": RowLog(), "frame": RowLog()} for name in pipes}
    encoded = {name: {"strangers": 0, "frame": 0} for name in pipes}
    reused = {name: {"strangers": 0, "frame": 0} for name in pipes}  # views served by the frame, not encoded again
    equal = {name: True for name in pipes}
    order = [(name, mode) for name in pipes for mode in ("strangers", "frame")]
    shuffler = random.Random(seed)
    for i, questions in enumerate(tqdm(frames, desc="bench frames", disable=not progress)):
        shuffler.shuffle(order)
        answers: dict = {}
        for name, mode in order:
            pipe = pipes[name]
            frame = pipe.frame(questions[0].images) if mode == "frame" else None
            for s in questions:
                sync(pipe.model.device)
                t0 = time.perf_counter()
                ans = frame.answer(s.question) if frame is not None else pipe.answer(s.question, s.images)
                sync(pipe.model.device)
                wall = (time.perf_counter() - t0) * 1e3
                answers.setdefault((name, s.id), {})[mode] = ans.tokens
                if i < warmup:
                    continue
                log = logs[name][mode]
                log.add_answer(ans, wall, answer_record(s, ans.text, len(ans.views)))
                encoded[name][mode] += ans.cache.get("encoded", 0)
                reused[name][mode] += ans.cache.get("reused", 0)
                lines.answer(f"{name} ({mode})", log, len(log.total) - 1)
        for (name, _), got in answers.items():
            equal[name] &= got["strangers"] == got["frame"]
    rows = []
    for name, modes in logs.items():
        for mode, log in modes.items():
            row = log.row(name, None, None)
            n_q = len(log.total)
            row.update(
                mode=mode,
                questions_per_frame=1 if mode == "strangers" else k,
                views_encoded_per_question=round(encoded[name][mode] / n_q, 3),
                views_reused_per_question=round(reused[name][mode] / n_q, 3),  # the frame's hits
                e2e_vs_strangers=round(row["e2e_ms"] / modes["strangers"].mean_e2e(), 3),
                answers_equal=equal[name],
            )
            if scored:
                row["score"] = round(score(log.records)["final"] or 0.0, 4)
                if mode == "frame":  # the same questions answered as strangers: paired over the frames
                    row["vs_strangers"] = paired_rows(log.records, modes["strangers"].records)
            row["closed_accuracy"] = closed_accuracy(log.records)
            rows.append(row)
            lines.write("row", **row)
    return {
        "model": model,
        "device": next(iter(pipes.values())).model.device.type,
        "threads": torch.get_num_threads(),
        "cpu_steps": cpu_steps.backend(),
        "questions": len(logs[next(iter(logs))]["frame"].total),
        "questions_per_frame": k,
        "frames": len(frames) - warmup,
        "frame_rows": rows,
        "rows": [],
        "backends": {name: p.backend.name for name, p in pipes.items()},
    }


def peak_memory_mb(device: str) -> float:
    """The process's peak memory so far, in MiB: resident set on the CPU, allocated tensors on a GPU."""
    if device == "cuda":
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def speed_figure(row: dict) -> bool:
    """Whether a row's times are speed figures: not where its precision is emulated on the device. A row written
    before the flag existed says nothing: an FP8 row of such a run counts as emulated."""
    return row.get("speed_figure", "fp8" not in (row.get("precision") or ""))


def _markdown(cols, rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("n/a" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return lines


def format_table(result: dict) -> str:
    """Table 1: the rows timed (means over the questions; `speedup` = the baseline's mean total / the row's), then
    the accuracy rows of a precision the device only emulates, without times."""
    lines = _markdown((*COLUMNS, "tau"), [r for r in result["rows"] if speed_figure(r)])
    accuracy = [r for r in result["rows"] if not speed_figure(r)]
    if accuracy:
        lines += ["", "accuracy rows (a precision emulated on this device: its times are no speed figure):"]
        lines += _markdown(ACCURACY_COLUMNS, accuracy)
    return "\n".join(lines)


FRAME_COLUMNS = (
    "config",
    "mode",
    "questions_per_frame",
    "views",
    "views_encoded_per_question",
    "views_reused_per_question",
    "preprocess_ms",
    "vit_ms",
    "total_ms",
    "e2e_ms",
    "p50_e2e_ms",
    "p90_e2e_ms",
    "e2e_vs_strangers",
    "answers_equal",
    "score",
)


def format_frames(result: dict) -> str:
    """Frame mode's table: each row as strangers and through one frame, mean e2e per question side by side."""
    return "\n".join(_markdown(FRAME_COLUMNS, result["frame_rows"]))


SHARES = (("vit", "vision"), ("select", "selection"), ("prefill", "prefill"), ("decode", "decode"), ("other", "other"))


def format_shares(result: dict) -> str:
    """The mean end-to-end time of each timed configuration and each stage's share of it (`RowLog.shares`)."""
    lines = [
        "| config | mean total ms | " + " | ".join(label for _, label in SHARES) + " |",
        "|" + "---|" * (len(SHARES) + 2),
    ]
    for r in result["rows"]:
        if speed_figure(r):
            sh = r["shares"]
            cells = ("n/a" if sh.get(k) is None else f"{100 * sh[k]:.1f}%" for k, _ in SHARES)
            lines.append(f"| {r['config']} | {r['total_ms']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The stacked bars of the plot: the five stages and other, which add up to the mean total.
BARS = (
    ("select_views_ms", "view selection"),
    ("vit_ms", "vision"),
    ("select_tokens_ms", "token selection"),
    ("prefill_ms", "prefill"),
    ("decode_ms", "decode"),
    ("other_ms", "other"),
)


def plot(result: dict, path: str, per_question: dict | None = None) -> None:
    """Figures 2 and 3 of the paper, as one PNG: each timed configuration's mean stages stacked to its mean total
    (p50 and p90 of the total marked), extend-one per configuration, vision ms against views, prefill ms against
    input tokens. Rows of an emulated precision are left out: their times are no speed figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if speed_figure(r)]
    left_out = [r["config"] for r in result["rows"] if not speed_figure(r)]
    names = [r["config"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    bottom = [0.0] * len(rows)
    for key, label in BARS:
        vals = [r.get(key) or 0.0 for r in rows]
        ax[0, 0].bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for key, marker, label in (("p50_total_ms", "_", "p50 total"), ("p90_total_ms", "x", "p90 total")):
        ax[0, 0].scatter(names, [r.get(key) for r in rows], marker=marker, color="black", s=60, label=label, zorder=3)
    ax[0, 0].set_ylabel("ms: means over the questions (stages + other = mean total)")
    ax[0, 0].set_title("end-to-end latency by stage (speed-up = ratio of mean totals)")
    ax[0, 0].legend(fontsize=7)
    ax[0, 0].tick_params(axis="x", rotation=35)
    ax[0, 1].bar(names, [r["extend_one_ms"] or 0.0 for r in rows], color="tab:purple")
    ax[0, 1].set_title("extend-one (decode ms per token the decode stage made)")
    ax[0, 1].tick_params(axis="x", rotation=35)
    pq = {name: d for name, d in (per_question or {}).items() if not d.get("emulated")}
    for name, d in pq.items():
        ax[1, 0].scatter(d["views"], d["vit"], s=10, label=name, alpha=0.6)
        ax[1, 1].scatter(d["input_tokens"], d["prefill"], s=10, label=name, alpha=0.6)
    ax[1, 0].set_xlabel("views encoded")
    ax[1, 0].set_ylabel("vision ms")
    ax[1, 0].set_title("vision stage against views")
    ax[1, 1].set_xlabel("input tokens")
    ax[1, 1].set_ylabel("prefill ms")
    ax[1, 1].set_title("prefill against input tokens")
    if pq:
        ax[1, 1].legend(fontsize=7)
    title = f"litevlm bench: {result['model']} on {result['device']}, {result['questions']} questions"
    if left_out:
        title += f"\n(emulated precision, an accuracy row only, not drawn: {', '.join(left_out)})"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
