"""`litevlm bench`: the paper's Table 1 (arXiv 2506.07416) re-measured on any model and machine.

Every configuration answers the same questions on the same images in one run, interleaved question by question
so that machine noise hits all rows alike, in an order shuffled anew for each question so that no row always
follows the same one (a row after a similar one finds the caches warm); the first questions warm every row up
and are not counted. Stage times are the pipeline's own (device synchronised at stage boundaries), medians
over questions; extend-one = decode time / tokens generated after the first. The DriveLM score of each row
comes from the answers of this same run. The `transformers` rows run transformers' `generate` on the same
weights, exported through `litevlm convert`, with the dynamic ("eager") and the static cache, on the baseline's own
prompt ids and tiles (the checkpoint's chat template and tiling): both sides answer from identical inputs.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.model import cpu_steps
from litevlm.presets import BF16_CONFIGS, CONFIGS, HF_ROWS

COLUMNS = (
    "config",
    "views",
    "vit_ms",
    "input_tokens",
    "prefill_ms",
    "extend_one_ms",
    "decode_ms",
    "select_ms",
    "total_ms",
    "speedup",
    "score",
)


@dataclass
class RowLog:
    views: list[int] = field(default_factory=list)
    vit: list[float] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    select: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    opened: list[int] = field(default_factory=list)  # answer tokens accepted with the prompt (answer openings)
    records: list[dict] = field(default_factory=list)
    accept: list[int] = field(default_factory=list)
    precision: str = ""

    def add(self, views, vit, input_tokens, prefill, decode, select, new_tokens, opened=0):
        self.views.append(views)
        self.vit.append(vit)
        self.input_tokens.append(input_tokens)
        self.prefill.append(prefill)
        self.decode.append(decode)
        self.select.append(select)
        self.total.append(vit + prefill + decode + select)
        self.new_tokens.append(new_tokens)
        self.opened.append(opened)

    def row(self, name: str, baseline_total: float | None, score) -> dict:
        med = statistics.median
        steps = sum(max(0, n - 1 - o) for n, o in zip(self.new_tokens, self.opened))  # the tokens the decode stage made
        return {
            "config": name,
            "views": round(statistics.fmean(self.views), 2),
            "vit_ms": round(med(self.vit), 3),
            "input_tokens": round(statistics.fmean(self.input_tokens), 1),
            "prefill_ms": round(med(self.prefill), 3),
            "extend_one_ms": round(sum(self.decode) / steps, 3) if steps else None,
            "decode_ms": round(med(self.decode), 3),
            "select_ms": round(med(self.select), 3),
            "total_ms": round(med(self.total), 3),
            "speedup": round(baseline_total / med(self.total), 2) if baseline_total else None,
            "score": score,
            "tau": round(statistics.fmean(self.accept), 3) if self.accept else None,
            "opened_tokens": round(statistics.fmean(self.opened), 3) if self.opened else 0.0,
            "precision": self.precision,
            "mean_total_ms": round(statistics.fmean(self.total), 3),
            "shares": self.shares(),
        }

    def shares(self) -> dict[str, float]:
        """Each stage's part of the end-to-end time summed over the questions (the paper's Table 1 gives means, whose
        ratios these are); the medians above, taken stage by stage, need not add up to the median total."""
        total = sum(self.total)
        stages = {"vit": self.vit, "select": self.select, "prefill": self.prefill, "decode": self.decode}
        return {name: round(sum(times) / total, 4) if total else 0.0 for name, times in stages.items()}


def _samples(data, n: int, seed: int, images_root=None):
    """Questions with their images: the first of a DriveLM folder/file (every image file checked up front), or
    held-out synthetic frames made in memory."""
    from litevlm.data.drivelm import load_images, samples_from_frame
    from litevlm.data.source import load_data
    from litevlm.data.synthetic import make_frame, render_views

    if data:
        out = load_data(data, images_root)[:n]
        cache = {}
        for s in out:
            if s.frame_id not in cache:
                cache[s.frame_id] = load_images(s)
            s.images = cache[s.frame_id]
        return out
    out, i = [], 0
    while len(out) < n:
        frame = make_frame(seed, i)
        out += samples_from_frame(frame, render_views(frame, size=(800, 450)))
        i += 1
    return out[:n]


def _pipelines(
    model: str,
    configs: dict[str, dict],
    max_new_tokens: int,
    shape: str | None,
    cuda_graphs: bool = False,
    load: dict | None = None,
):
    """One pipeline per row; `load` holds `Pipeline.from_pretrained`'s device, dtype and prompt format options."""
    from litevlm.pipeline import Pipeline

    if shape is None:
        return {
            name: Pipeline.from_pretrained(model, max_new_tokens=max_new_tokens, **(load or {}), **opts)
            for name, opts in configs.items()
        }
    return {
        name: random_pipeline(shape, model, max_new_tokens, cuda_graphs=cuda_graphs, **opts)
        for name, opts in configs.items()
    }


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
    cuda_graphs: bool = False,
    openings: bool = True,
):
    """A pipeline at a real model's shapes with random weights (latency only): `--shape 2b` etc.

    The text side borrows drive-tiny's tokenizer (its ids fit every real vocabulary); each camera is cut
    into two tiles as in the paper's 12-tile layout. Selectors and the draft head are random too, and the draft head has
    no answer openings (`openings` is accepted for the ablation rows and changes nothing here).
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
    torch.manual_seed(seed)
    with torch.device(dev):
        model = VLM(cfg).to(dtype)
    parts = {}
    if select_views:
        from litevlm.select.views import ViewSelector

        parts["view_selector"] = ViewSelector.load(path)
    if select_tokens is not None:
        from litevlm.select.tokens import SelectorConfig, TokenSelector

        parts["token_selector"] = TokenSelector.from_model(model, SelectorConfig()).to(device=dev, dtype=dtype)
        parts["keep_ratio"] = select_tokens
        parts["min_select_tokens"] = min_select_tokens
    if fastv_k is not None:
        parts["fastv"] = (fastv_k, fastv_r)
    if speculative:
        from litevlm.spec.draft import DraftConfig, DraftHead
        from litevlm.spec.tree import TreeConfig

        parts["draft"] = DraftHead(DraftConfig.for_target(cfg.text), model).to(device=dev, dtype=dtype)
        parts["tree"] = TreeConfig()
    if fp8 is not None:
        from litevlm.quant.fp8 import FP8Recipe, quantize_model

        quantize_model(model, FP8Recipe(fp8))
    # Random weights never emit EOS reliably: every answer runs to max_new_tokens, the same for all rows.
    # (Only the stopping rule changes: the prompt keeps its end-of-turn token.)
    pipe = Pipeline(model, tok, max_new_tokens=max_new_tokens, name=f"random-{shape}", cuda_graphs=cuda_graphs, **parts)
    pipe.stop_id = None
    return pipe


def hf_inputs(pipe, s) -> tuple[torch.Tensor, torch.Tensor]:
    """What the transformers rows give `generate` for sample `s`: the pipeline's own prompt over all six views (its
    chat template, camera labels and tiling) as ids (1, T), and its tiles (tiles, 3, S, S), so that transformers and
    the pipeline's baseline answer from identical inputs."""
    pixels, counts = pipe.tiles(s.images, list(CAMERAS))
    layout = pipe.format.build(pipe.tokenizer, s.question, list(CAMERAS), counts)
    dev = pipe.model.device
    return torch.tensor([layout.ids], device=dev), pixels.to(dev, pipe.model.dtype)


def _hf_runner(pipe, logs: dict[str, RowLog], max_new_tokens: int):
    """transformers' generate on the same weights (exported through our converter), dynamic and static cache:
    a function (sample, counted) that answers one question in both rows (logged when counted, i.e. past
    the warm-up), so the run can interleave them with ours question by question."""
    from transformers import DynamicCache, InternVLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from litevlm.model.hf import save_hf

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    tok = pipe.tokenizer
    with tempfile.TemporaryDirectory() as d:
        save_hf(pipe.model, d, tokenizer=None)
        hf = InternVLForConditionalGeneration.from_pretrained(d, dtype=pipe.model.dtype).to(pipe.model.device).eval()
    dev = pipe.model.device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)

    def run(s, counted: bool) -> None:
        ids, pix = hf_inputs(pipe, s)
        for name, cache_impl in zip(HF_ROWS, (None, "static")):
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
            vit, prefill, gen = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3
            logs[name].add(len(CAMERAS), vit, ids.shape[1], prefill, max(0.0, gen - vit - prefill), 0.0, len(new))
            text = tok.decode([t for t in new if t != tok.eos_id]).strip()
            logs[name].records.append(_record(s, text, len(CAMERAS)))
            logs[name].precision = str(pipe.model.dtype).removeprefix("torch.")

    return run


def _record(s, text: str, views: int) -> dict:
    return {
        "id": s.id,
        "question": s.question,
        "answer": text,
        "gt": s.answer,
        "tag": s.tag,
        "closed": s.closed,
        "frame": s.frame_id,
        "views": views,
    }


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
    load: dict | None = None,
) -> dict:
    """Every row of `configs` (default: the paper's table) on the first `n` questions of `data` after `warmup`
    (default: held-out synthetic frames of `seed`), plus transformers' generate rows with `hf`.

    images_root: where a DriveLM JSON's images live. load: `Pipeline.from_pretrained` options shared by every row
    (device, dtype, and the prompt format of a checkpoint without prompt.json: system, camera_label, tiles,
    max_tiles, thumbnail); the transformers rows get the baseline's prompt ids and tiles (`hf_inputs`).
    """
    from litevlm.eval.metrics import closed_accuracy, score
    from litevlm.quant.fp8 import FP8Linear

    if configs is None:
        from litevlm.model.layers import bf16_matmul_supported

        configs = {**CONFIGS, **(BF16_CONFIGS if shape is None and bf16_matmul_supported() else {})}
    if cuda_graphs and not (shape and torch.cuda.is_available()):
        raise LiteVLMError("--cuda-graphs measures a CUDA device: it needs --shape and a GPU")
    if shape is not None and any(v is not None for v in (load or {}).values()):
        raise LiteVLMError("--shape measures random weights at a preset's shapes: it takes no model or format options")
    samples = _samples(data, n + warmup, seed, images_root)
    pipes = _pipelines(model, configs, max_new_tokens, shape, cuda_graphs, load)
    logs = {name: RowLog() for name in (*configs, *(HF_ROWS if hf and shape is None else ()))}
    hf_run = None
    if hf and shape is None:
        hf_pipe = pipes["baseline"] if "baseline" in pipes else next(iter(pipes.values()))
        if any(isinstance(m, FP8Linear) for m in hf_pipe.model.modules()):
            raise LiteVLMError(
                "the transformers rows would run FP8 weights (an FP8 checkpoint, or an fp8 row and no baseline row), "
                "which transformers cannot load: add --no-transformers"
            )
        hf_run = _hf_runner(hf_pipe, logs, max_new_tokens)
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
                continue
            ans = pipe.answer(s.question, s.images)
            if i < warmup:
                continue
            t = ans.timings_ms
            log = logs[name]
            log.add(
                len(ans.views),
                t["vit"],
                ans.input_tokens,
                t["prefill"],
                t["decode"],
                t["select_views"] + t["select_tokens"],
                len(ans.tokens),
                ans.opened_tokens,
            )
            log.accept += ans.accept_lengths
            log.records.append(_record(s, ans.text, len(ans.views)))
            log.precision = ans.precision
    base_total = statistics.median(logs["baseline"].total) if "baseline" in logs else None
    rows = []
    for name, log in logs.items():
        sc = None
        if shape is None:
            res = score(log.records)
            sc = round(res["final"], 4) if res["final"] is not None else None
        row = log.row(name, base_total, sc)
        if shape is None:
            row["closed_accuracy"] = closed_accuracy(log.records)
        rows.append(row)
    dev = next(iter(pipes.values())).model.device.type  # every row runs on one device
    per_question = {
        name: {"views": log.views, "vit": log.vit, "input_tokens": log.input_tokens, "prefill": log.prefill}
        for name, log in logs.items()
    }
    return {
        "model": model if shape is None else f"random weights, {shape} shapes",
        "device": dev,
        "threads": torch.get_num_threads(),
        "cpu_steps": cpu_steps.backend(),
        "questions": len(samples) - warmup,
        "rows": rows,
        "cuda_graphs": cuda_graphs,
        "capture_ms": {name: round(p.capture_ms, 1) for name, p in pipes.items()},
    }, per_question


def format_table(result: dict) -> str:
    cols = (*COLUMNS, "tau")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append("| " + " | ".join("n/a" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def format_shares(result: dict) -> str:
    """Mean end-to-end time per configuration and each stage's share of it (`RowLog.shares`)."""
    lines = ["| config | mean total ms | vision | selection | prefill | decode |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        sh = r["shares"]
        lines.append(
            f"| {r['config']} | {r['mean_total_ms']} | "
            + " | ".join(f"{100 * sh[k]:.1f}%" for k in ("vit", "select", "prefill", "decode"))
            + " |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str, per_question: dict | None = None) -> None:
    """Figures 2 and 3 of the paper, as one PNG: stacked stages per configuration, extend-one per configuration,
    vision ms against views, prefill ms against input tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["config"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    bottom = [0.0] * len(rows)
    for key, label in (
        ("vit_ms", "vision"),
        ("select_ms", "selection"),
        ("prefill_ms", "prefill"),
        ("decode_ms", "decode"),
    ):
        vals = [r[key] or 0.0 for r in rows]
        ax[0, 0].bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[0, 0].set_ylabel("ms (medians per stage)")
    ax[0, 0].set_title("end-to-end latency by stage")
    ax[0, 0].legend()
    ax[0, 0].tick_params(axis="x", rotation=35)
    ax[0, 1].bar(names, [r["extend_one_ms"] or 0.0 for r in rows], color="tab:purple")
    ax[0, 1].set_title("extend-one (decode ms per generated token)")
    ax[0, 1].tick_params(axis="x", rotation=35)
    pq = per_question or {}
    for name, d in pq.items():
        ax[1, 0].scatter(d["views"], d["vit"], s=10, label=name, alpha=0.6)
        ax[1, 1].scatter(d["input_tokens"], d["prefill"], s=10, label=name, alpha=0.6)
    ax[1, 0].set_xlabel("views encoded")
    ax[1, 0].set_ylabel("vision ms")
    ax[1, 0].set_title("vision stage against views")
    ax[1, 1].set_xlabel("input tokens")
    ax[1, 1].set_ylabel("prefill ms")
    ax[1, 1].set_title("prefill against input tokens")
    ax[1, 1].legend(fontsize=7)
    fig.suptitle(f"litevlm bench: {result['model']} on {result['device']}, {result['questions']} questions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
