"""The LiteVLM inference pipeline: stages wired together and timed.

    select_views -> vit -> select_tokens -> prefill -> decode

A question walks the stages once, one call each (`Pipeline.stream`): views, vision, prompt, token selection
(which chooses; pruning inside the decoder is a hook the prefill calls), prefill and decode (generation, plain or
speculative), the tokens streamed as they are made.
Each stage is switchable, so the paper's ablation rows (arXiv 2506.07416, Table 1) are
configurations of one `Pipeline`. Stage times are wall milliseconds with the device synchronised
at stage boundaries; `total` = select_views + vit + select_tokens + prefill + decode, the paper's measure (image
decoding and resizing are reported apart as `preprocess`); `e2e` is what a user lives with, from the images as given
to the last token: preprocessing, the stages and what lies between them.

A question is asked of a `litevlm.frame.Frame` (`Pipeline.frame(images)`), which reads, cuts and encodes each view
the first time a question needs it; `answer(question, images)` is a frame of one question.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from litevlm.batch import BatchDecoder, batch_refusal
from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.frame import Frame, ViewCache
from litevlm.model.backend import CACHE_MULTIPLE, Sampling, auto_kind, choose_backend, compiles, round_up
from litevlm.model.generate import (
    Generation,
    Prefilled,
    StageTimer,
    prefill_prompt,
    stream_decode,
)
from litevlm.model.prompt import SPECIAL_STRINGS, PromptFormat, Tiling
from litevlm.model.vlm import VLM, cut_images, normalize_tiles
from litevlm.models import load_model, part_dir
from litevlm.presets import GRAPH_BACKENDS
from litevlm.quant.fp8 import precision_of
from litevlm.select.selection import token_selection
from litevlm.select.tokens import Pruning
from litevlm.spec.decode import stream_speculative

STAGES = ("select_views", "vit", "select_tokens", "prefill", "decode")
WARMUP_QUESTION = "Is there a car in front of the ego vehicle?"  # the blank scene's question (`Pipeline.warmup`)


@dataclass
class Started:
    """A question up to its prefill (`Pipeline.start_answer`): what its answer is made from once decoded."""

    question: str
    views: list[str]
    full: Prompt
    p: Prompt
    record: dict
    prefilled: Prefilled
    timer: StageTimer
    t0: float
    made: dict
    setup0: float


@dataclass
class Answer:
    text: str
    views: list[str]
    num_visual_tokens: int
    timings_ms: dict[str, float]
    accept_lengths: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    input_tokens: int = 0
    precision: str = "fp32"
    opened_tokens: int = 0  # answer tokens accepted from an opening inside the prefill (speculative decoding)
    # The visual tokens the prefill kept, per view: indices into that view's tokens (tile by tile, row-major within a
    # tile), None where every token was kept; and their selector scores where the selector gives them.
    kept_tokens: dict[str, list[int]] | None = None
    kept_scores: dict[str, list[float]] | None = None
    tokens_per_view: dict[str, int] = field(default_factory=dict)  # each view's visual tokens before selection
    # this answer's views: encoded for it, reused from its frame's earlier questions, content cache hits and misses
    cache: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "views": self.views,
            "num_visual_tokens": self.num_visual_tokens,
            "input_tokens": self.input_tokens,
            "generated_tokens": len(self.tokens),
            "timings_ms": {k: round(v, 3) for k, v in self.timings_ms.items()},
            "accept_lengths": self.accept_lengths,
            "opened_tokens": self.opened_tokens,
            "precision": self.precision,
            "tokens_per_view": self.tokens_per_view,
            "kept_tokens": self.kept_tokens,
            "cache": self.cache,
        }


@dataclass
class Delta:
    """A piece of an answer as it is made: its new text (possibly empty while a character or trailing space waits
    for the next token) and the token ids it came from (EOS included)."""

    text: str
    tokens: list[int]


class TextStream:
    """Token ids in, answer text out as it becomes final: the pieces join to `decode(ids).strip()` exactly.

    The text is decoded whole each time (an answer is short), so a multi-byte character split across tokens decodes
    to U+FFFD until its last byte comes and is held back until then; leading space is dropped, trailing space is
    held back until more text follows it (and dropped at the end)."""

    def __init__(self, tokenizer, eos_id: int | None):
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.ids: list[int] = []
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        """The text that `tokens` make final."""
        self.ids += [t for t in tokens if t != self.eos_id]
        return self._advance(self.tokenizer.decode(self.ids).lstrip().rstrip("\ufffd").rstrip())

    def finish(self) -> str:
        """The text still held back once every token is in (a trailing U+FFFD the model really made)."""
        return self._advance(self.tokenizer.decode(self.ids).strip())

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece


@dataclass
class Prompt:
    views: list[str]
    view_spans: list[tuple[str, int, int]]  # (camera, start, end) of each view's visual tokens in ids
    ids: torch.Tensor  # (1, T)
    embeds: torch.Tensor  # (1, T, C): token embeddings with the visual tokens in place
    num_visual_tokens: int
    positions: torch.Tensor  # (1, T) RoPE positions; a prompt pruned at the input keeps its tokens' own


class Pipeline:
    """Question + six camera images -> Answer, through the switchable LiteVLM stages.

    view_selector: ViewSelector or None (all six views are encoded).
    token_selector + keep_ratio: TokenSelector keeping a fraction r of the visual tokens, or None.
    min_select_tokens: the TokenSelector runs only on prompts with at least this many visual tokens;
        below, its scoring costs more than the tokens it prunes save (0: always).
    select_layer: 0, the TokenSelector prunes where it reads; K >= 1, a prompt-reading selector's choice is applied
        before decoder layer K, layers [0, K) running on the whole prompt (`litevlm.select.selection.TokenSelector`).
    fastv: (K, r) for FastV pruning inside the LLM (the baseline), or None.
    pruner: a training-free pruner (`litevlm.select.pruners.PruneConfig`: DART, DivPrune, CDPruner, random, uniform)
        keeping its fraction r of the visual tokens, or None; its selection is timed as "select_tokens".
    draft + tree: EAGLE-2 speculative decoding with this draft head and tree envelope, or None.
    openings: with a draft head that has answer openings (`litevlm.spec.openings`, built by `litevlm train openings`),
        greedy decoding verifies the question's likely answer openings inside the prefill's pass.
    prompt_format: the checkpoint's chat template, system message, camera labels and tiling
        (`litevlm.model.prompt.PromptFormat`; default: ChatML, `{camera}: ` labels, the config's tiles per view).
    backend: the model's execution backend (`litevlm.model.backend`), made once here and again by `rebuild`:
        "auto" (CUDA graphs on a CUDA device, else the native CPU steps where they serve the model, else the
        modules), "modules", "native", "cuda" or "cuda-twin" (the CUDA backend's mechanisms on the CPU). Making it
        (the native build, packing, graph capture, compilation) and `warmup` are setup, reported as `setup_ms`,
        never inside a stage. cuda_graphs=True is backend="cuda".
    resample: how images become tiles (`litevlm.model.images`): "fast" (reduced-size JPEG decoding, torch's
        antialiased bicubic on uint8) or "pil" (PIL's full decode and bicubic resize, transformers' bytes).
    compile_steps: the CUDA backend's decode, verification and draft-chain steps compiled by inductor before they
        are captured (the norms, RoPE, SwiGLU and FP8's activation quantisation fused): one compile of one decoder
        layer, which every layer reuses, per KV-length bucket and step kind at setup; no effect on the other backends.
        None (the default): compiled on a GPU's cuda backend unless LITEVLM_CUDA_COMPILE=0, not on its CPU twin.
    view_cache: a `litevlm.frame.ViewCache` (or its bound in bytes) that keeps encoded views across questions,
        keyed by content (`litevlm serve`, `litevlm eval`); None: each `answer` reads its views afresh.
    """

    def __init__(
        self,
        model: VLM,
        tokenizer,
        *,
        view_selector=None,
        token_selector=None,
        keep_ratio: float | None = None,
        min_select_tokens: int = 0,
        select_layer: int = 0,
        fastv: tuple[int, float] | None = None,
        pruner=None,
        draft=None,
        tree=None,
        max_new_tokens: int = 160,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        max_question_tokens: int = 256,
        name: str = "custom",
        cuda_graphs: bool = False,
        openings: bool = True,
        prompt_format: PromptFormat | None = None,
        backend: str = "auto",
        compile_steps: bool | None = None,
        warmup: bool = True,
        resample: str = "fast",
        view_cache: ViewCache | int | None = None,
    ):
        self.selection = token_selection(
            model, token_selector, keep_ratio, min_select_tokens, fastv, pruner, tokenizer, seed, select_layer
        )  # the one token selection, checked
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.cfg = model.cfg
        self.view_selector = view_selector
        self.token_selector = token_selector
        self.keep_ratio = keep_ratio
        self.min_select_tokens = min_select_tokens
        self.fastv = fastv
        self.pruner = pruner
        self.draft = draft
        self.tree = tree
        self.openings = openings
        self.drafting = draft is not None and not self.selection.plain_decoding  # EAGLE-2 decodes the answers
        self.max_new_tokens = max_new_tokens
        self.stop_id = tokenizer.eos_id  # generation ends after this token; None: always max_new_tokens (latency runs)
        self.temperature = temperature
        self.top_p = top_p
        self.max_question_tokens = max_question_tokens
        self.name = name
        if cuda_graphs:
            backend = "cuda"
        if backend == "cuda" and model.device.type != "cuda":
            raise LiteVLMError(
                f"the cuda backend (cuda_graphs) needs the model on a CUDA device; it is on {model.device}"
            )
        self.backend_kind = backend
        self.compile_steps = compile_steps
        from litevlm.model.images import check_resample

        self.resample = check_resample(resample)
        self.view_cache = ViewCache(view_cache) if isinstance(view_cache, int) else view_cache
        self.weights_version = 0  # what the content cache's keys hold of the weights: `rebuild` moves it on
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.format = prompt_format or PromptFormat(tiling=Tiling(tiles=self.cfg.tiles_per_view))
        self.tokens_per_view = self.cfg.tokens_per_tile * self.format.tiling.most()  # the most one view can take
        # Room for the longest prompt (the template, all views, longest question) plus the answer and a draft tree.
        template = len(self.format.build(tokenizer, "?", [], []).ids)
        self.max_len = round_up(
            96 + template + len(CAMERAS) * (self.tokens_per_view + 16) + max_question_tokens + max_new_tokens,
            CACHE_MULTIPLE,
        )
        self.setup_ms = 0.0
        self.rebuild(warmup)

    # -- the execution backend ------------------------------------------------------------------
    def rebuild(self, warmup: bool = True) -> None:
        """Make the model's execution backend afresh (`litevlm.model.backend.choose_backend`): after anything that
        changes the weights (training, quantising, loading or replacing a module), whose packed weights and captured
        graphs it holds; then, with `warmup`, one answer to a blank scene (`warmup`). Its cost is setup (`setup_ms`),
        never part of an answer; a setup that takes seconds says so on stderr."""
        t0 = time.perf_counter()
        self.weights_version += 1
        if self.view_cache is not None:  # encoded by the weights before: never served again
            self.view_cache.clear()
        lm = self.model.language_model
        nodes = self.tree.total_tokens if self.drafting else 0
        # "auto" is settled before the cache is made: on a GPU it builds the CUDA backend, whose captures write into
        # scratch slots past the live ones
        kind = auto_kind(self.model, self.draft) if self.backend_kind == "auto" else self.backend_kind
        scratch = max(1, nodes) if kind in GRAPH_BACKENDS else 0
        lm.setup_cache(1, self.max_len, scratch=scratch)
        compile_steps = self.compile_steps if self.compile_steps is not None else kind == "cuda" and compiles()
        graphs = {"compile_steps": True} if compile_steps and kind in GRAPH_BACKENDS else {}
        self.backend = choose_backend(kind, self.model, self.draft, tree_nodes=nodes, **graphs)
        self.precision = precision_of(self.model)  # what every answer reports, read once per set of weights
        self.warmed = False
        self.setup_ms += (time.perf_counter() - t0) * 1e3
        if warmup:
            self.warmup()
        ms = (time.perf_counter() - t0) * 1e3
        if ms > 2000:
            print(
                f"litevlm: {self.name} set up on the {self.backend.name} backend in {ms / 1e3:.1f} s", file=sys.stderr
            )

    @torch.no_grad()
    def warmup(self) -> None:
        """One answer to a blank scene, before any real one, so that what a first answer pays once (lazily packed
        weights, the allocator's first growth, a CUDA backend's first prefill bucket) is paid here. The pipeline's own
        sampling generator is left as it was."""
        from PIL import Image

        blank = {cam: Image.new("RGB", (448, 252), (96, 96, 96)) for cam in CAMERAS}
        saved = self.generator, self.max_new_tokens
        self.generator = torch.Generator(device=self.model.device).manual_seed(0)
        self.max_new_tokens = min(self.max_new_tokens, 8)  # every stage and a few decode steps or cycles
        t0 = time.perf_counter()
        try:
            for _ in Frame(self, blank).stream(WARMUP_QUESTION):
                pass
        finally:
            self.generator, self.max_new_tokens = saved
        self.warmed = True
        self.setup_ms += (time.perf_counter() - t0) * 1e3

    @property
    def capture_ms(self) -> float:
        """Setup time (`setup_ms`), under its older name."""
        return self.setup_ms

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.stop_id, self.temperature, self.top_p, self.generator)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path = "drive-tiny",
        *,
        device: str = "cpu",
        dtype: str = "float32",
        select_views: bool = False,
        select_tokens: float | bool | None = None,
        fastv_k: int | None = None,
        fastv_r: float | None = None,
        prune: str | None = None,
        keep: float | None = None,
        prune_layer: int | None = None,
        prune_per_view: bool = False,
        prune_split: str | None = None,
        speculative: bool = False,
        tree_top_k: int | None = None,
        tree_depth: int | None = None,
        tree_total: int | None = None,
        tree_min_value: float | None = None,
        fp8: str | None = None,
        matmul: str = "fp32",
        system: str | None = None,
        camera_label: str | None = None,
        tiles: int | None = None,
        max_tiles: int | None = None,
        thumbnail: bool | None = None,
        **options,
    ) -> Pipeline:
        """A pipeline over a bundled model ("drive-tiny") or a checkpoint directory: ours, a transformers InternVL
        (`-hf`) folder or the original InternVL layout, with the modules trained for it in its subfolders and the
        prompt format they were trained with (its prompt.json; else the checkpoint's chat template).

        select_views: use the model's ViewSelector (model_dir/view_selector).
        select_tokens=r: use its TokenSelector (model_dir/token_selector), keeping a fraction r; True: keeping the r
            stored with it (`litevlm train tokens --keep-ratio`, chosen for that model on validation data).
        fastv_k, fastv_r: FastV at layer K keeping r (the comparison baseline).
        prune, keep: token pruning by name (`litevlm.select.pruners.METHODS`) keeping a fraction r: "token-selector"
            is select_tokens=r (with prune_layer K, its choice applied before decoder layer K: `select_layer`), "fastv"
            is FastV at prune_layer (default 2, FastV's own), "dart" prunes before decoder layer prune_layer (default
            2), "divprune", "cdpruner", "random" and "uniform" the projector's output.
            prune_per_view: about r of each camera's tokens instead of r of all (dart, divprune, cdpruner, random).
            prune_split: "all", "view" or "crop", the blocks the budget is spread over (None: the method's own,
                `litevlm.select.pruners.DEFAULT_SPLIT`); prune_per_view is "view".
        speculative: EAGLE-2 with its draft head (model_dir/draft), tree_* override the default tree
            (tree_min_value: a chain ends where its draft probability falls below it).
        fp8: "fp8-dynamic-per-row" quantises the decoder linears at load; a checkpoint written by
            `litevlm quantize` is FP8 already (static scales) and needs no option.
        matmul: "bf16" runs the vision tower and a prompt's prefill in bf16 (from 32 rows) on CPUs with AMX or
            AVX512-BF16, the CPU's counterpart of the paper's low-precision step; decode stays fp32.
        system, camera_label, tiles, max_tiles, thumbnail: the prompt format of a checkpoint that has no prompt.json
            yet (`litevlm.models.load_model`).
        """
        from litevlm.select.pruners import PruneConfig

        pruner = PruneConfig.from_options(
            prune, keep, prune_layer, prune_per_view, prune_split
        )  # checked before loading
        if pruner is not None:
            if select_tokens is not None or fastv_k is not None or fastv_r is not None:
                raise LiteVLMError("--prune METHOD --keep R replaces --select-tokens and --fastv-k/--fastv-r: give one")
            if pruner.method == "token-selector":
                select_tokens, options["select_layer"], pruner = pruner.keep_ratio, pruner.layer or 0, None
            elif pruner.method == "fastv":
                fastv_k, fastv_r, pruner = pruner.decoder_layer, pruner.keep_ratio, None
        loaded = load_model(
            name_or_path,
            device=device,
            dtype=torch_dtype(dtype),
            system=system,
            camera_label=camera_label,
            tiles=tiles,
            max_tiles=max_tiles,
            thumbnail=thumbnail,
        )
        model, path = loaded.model, loaded.path
        if fp8 is not None:
            from litevlm.quant.fp8 import FP8Recipe, quantize_model

            if fp8 != "fp8-dynamic-per-row":
                raise LiteVLMError(
                    f"fp8={fp8!r}: only fp8-dynamic-per-row applies at load; static scales come from `litevlm quantize`"
                )
            quantize_model(model, FP8Recipe(fp8))
        if matmul not in ("fp32", "bf16"):
            raise LiteVLMError(f"matmul={matmul!r}: use fp32 or bf16")
        if matmul == "bf16":
            model.set_bf16_matmul()
        parts = {}
        if select_views:
            from litevlm.select.views import ViewSelector

            parts["view_selector"] = ViewSelector.load(part_dir(path, "view_selector"), device=device)
        if pruner is not None:
            parts["pruner"] = pruner
        if select_tokens is not None:
            from litevlm.select.tokens import TokenSelector

            sel = TokenSelector.load(part_dir(path, "token_selector"), model).to(device)
            parts["token_selector"] = sel
            parts["keep_ratio"] = sel.cfg.keep_ratio if select_tokens is True else select_tokens
        if (fastv_k is None) != (fastv_r is None):
            raise LiteVLMError("FastV needs both K (layer) and r (fraction kept)")
        if fastv_k is not None:
            parts["fastv"] = (fastv_k, fastv_r)
        if speculative:
            from litevlm.spec.draft import DraftHead
            from litevlm.spec.tree import TreeConfig

            parts["draft"] = DraftHead.load(part_dir(path, "draft"), model).to(device=device)
            default = TreeConfig()
            # on a GPU a chain drafts its whole depth with no host sync (its steps replayed on the device); on the
            # CPU, where a sync costs nothing, it stops where its draft probability falls below the default
            on_gpu = torch.device(device).type == "cuda"
            parts["tree"] = TreeConfig(
                top_k=tree_top_k or default.top_k,
                depth=tree_depth or default.depth,
                total_tokens=tree_total or 0,  # 0: derived
                min_value=(0.0 if on_gpu else default.min_value) if tree_min_value is None else tree_min_value,
            )
        return cls(model, loaded.tokenizer, name=path.name, prompt_format=loaded.format, **parts, **options)

    @classmethod
    def from_loaded(cls, loaded, **options) -> Pipeline:
        """A pipeline (baseline unless `options` add stages) over a `litevlm.models.Loaded` checkpoint, in its own
        prompt format: what the recipes prompt their target with."""
        return cls(loaded.model, loaded.tokenizer, name=loaded.path.name, prompt_format=loaded.format, **options)

    @classmethod
    def from_hf(cls, path: str | Path, **options) -> Pipeline:
        """`from_pretrained` on a transformers InternVL checkpoint folder."""
        return cls.from_pretrained(path, **options)

    @property
    def config_name(self) -> str:
        parts = ["views"] if self.view_selector is not None else []
        parts += [self.selection.label] if self.selection.label else []
        if self.drafting:
            parts.append(f"eagle {self.tree.top_k}/{self.tree.depth}/{self.tree.total_tokens}")
        return " + ".join(parts) or "baseline"

    # -- inputs ---------------------------------------------------------------------------------
    def check_question(self, question: str) -> list[int]:
        if not isinstance(question, str) or not question.strip():
            raise LiteVLMError("the question is empty: ask something about the scene")
        ids = self.tokenizer.encode(question)
        if len(ids) > self.max_question_tokens:
            raise LiteVLMError(f"the question is {len(ids)} tokens long; the limit is {self.max_question_tokens}")
        marks = [m for m in SPECIAL_STRINGS if m in question]
        if marks:
            raise LiteVLMError(f"the question contains the prompt's special token(s) {', '.join(marks)}")
        return ids

    @staticmethod
    def check_images(images: Mapping) -> None:
        """The images' camera names: known ones only. A missing camera fails only the questions that need its view
        (`litevlm.frame.Frame.check_views`)."""
        if not isinstance(images, Mapping):
            raise LiteVLMError("images must map camera names to images, e.g. {'CAM_FRONT': 'front.png', ...}")
        unknown = [c for c in images if c not in CAMERAS]
        if unknown:
            raise LiteVLMError(f"unknown camera name(s) {unknown}; expected {', '.join(CAMERAS)}")
        if not images:
            raise LiteVLMError(f"no camera images given; expected {', '.join(CAMERAS)}")

    # -- the stages ---------------------------------------------------------------------------
    def select_views(self, question: str) -> list[str]:
        if self.view_selector is None:
            return list(CAMERAS)
        return self.view_selector.select(question)[0]

    def tiles(self, images: Mapping, views: list[str], resample: str | None = None) -> tuple[torch.Tensor, list[int]]:
        """The chosen views' images cut into normalised tiles (the prompt format's tiling): (tiles, 3, S, S) and the
        number of visual tokens each view gives. The views are read and resized side by side (`cut_images`), by the
        pipeline's own resample path unless `resample` names another."""
        size, resample = self.cfg.vision.image_size, resample or self.resample
        cut = [torch.from_numpy(a) for a in cut_images([images[c] for c in views], self.format.tiling, size, resample)]
        return normalize_tiles(torch.cat(cut)), [t.shape[0] * self.cfg.tokens_per_tile for t in cut]

    def frame(self, images: Mapping) -> Frame:
        """The cameras of one moment, to ask several questions of: each view read, cut and encoded once for all of
        them (`litevlm.frame.Frame`; the pipeline's content cache, where it has one, across frames too)."""
        return Frame(self, images, self.view_cache)

    @torch.no_grad()
    def vision(self, images: Mapping, views: list[str], timer: StageTimer) -> tuple[torch.Tensor, list[int]]:
        """The chosen views' visual tokens (tiles, tokens_per_tile, C) and each view's token count: images to tiles
        ("preprocess"), then the vision tower and projector ("vit"), in one batch (`litevlm.frame.Frame`)."""
        return Frame(self, images).visual(views, timer)

    @torch.no_grad()
    def embed_prompt(self, question: str, views: list[str], visual: torch.Tensor, counts: list[int]) -> Prompt:
        """The question's prompt in the checkpoint's format, embedded with the visual tokens (`counts` per view) in
        place."""
        layout = self.format.build(self.tokenizer, question, views, counts)
        ids = torch.from_numpy(np.asarray(layout.ids, dtype=np.int64))[None].to(self.model.device)
        positions = torch.arange(ids.shape[1], device=self.model.device)[None]
        n_visual = int(visual.shape[0] * visual.shape[1])
        return Prompt(views, layout.view_spans, ids, self.model.embed(ids, visual), n_visual, positions)

    @torch.no_grad()
    def prompt(self, question: str, images: Mapping, timer: StageTimer | None = None) -> Prompt:
        """The chosen views and the question's prompt, embedded with its visual tokens (stages timed on `timer`)."""
        timer = timer or StageTimer(self.model.device)
        with timer("select_views"):
            views = self.select_views(question)
        return self.embed_prompt(question, views, *self.vision(images, views, timer))

    @torch.no_grad()
    def select_tokens(
        self, p: Prompt, question: str, timer: StageTimer, record: dict | None = None
    ) -> tuple[Prompt, Pruning | None]:
        """Token selection, timed as "select_tokens": a TokenSelector with its own copy of layer 0 prunes the prompt
        here; one sharing the decoder's layer 0 (or FastV at layer K) gives the hook that prunes inside the prefill.
        A pruner (`litevlm.select.pruners`) prunes the projector's output here or, DART, gives the hook; either way
        its choice is timed here (a hook's inside the prefill, under this stage's name)."""
        with timer("select_tokens"):
            embeds, positions, hook = self.selection.select(self.model, p, question, self.format.tiling, record)
            return replace(p, embeds=embeds, positions=positions), hook

    def prefill(self, p: Prompt, pruning: Pruning | None, question: str, timer: StageTimer) -> Prefilled:
        """The prompt into the cache (`litevlm.model.generate.prefill_prompt`), pruned inside the decoder by `pruning`,
        with the question's answer openings verified in the same pass where speculative decoding has them."""
        opening = None if self.selection.plain_decoding else self._opening(question)
        return prefill_prompt(
            self.backend,
            p.embeds,
            p.positions,
            timer,
            pruning=pruning,
            opening=opening,
            eos_id=self.stop_id,
            limit=self.max_new_tokens,
        )

    def decode(self, prefilled: Prefilled, timer: StageTimer) -> Iterator[list[int]]:
        """The decoding stream from a prefilled prompt: token runs as they are made, then the `Generation`. FastV, the
        in-LLM pruning baseline, decodes plainly."""
        if self.drafting:
            return stream_speculative(self.backend, prefilled, self.sampling, timer, self.tree)
        return stream_decode(self.backend, prefilled, self.sampling, timer)

    # -- one answer -----------------------------------------------------------------------------
    def answer(self, question: str, images: Mapping) -> Answer:
        """The whole answer at once: `stream` run to its end."""
        for item in self.stream(question, images):
            pass
        return item

    def stream(self, question: str, images: Mapping) -> Iterator[Delta | Answer]:
        """The answer as it is made: a `Delta` (new text, new token ids) as tokens come, then the finished `Answer`.

        The inputs are checked at once (a `LiteVLMError` here, before any token is made), the views the question
        needs included: their images are read and encoded here. The Delta texts join to exactly `Answer.text` and
        their tokens to `Answer.tokens`. Closing the stream (`close()`) stops the work before the next decode step or
        speculative cycle; the pipeline is then ready for the next question."""
        return self.stream_frame(question, self.frame(images))

    def stream_frame(self, question: str, frame: Frame) -> Iterator[Delta | Answer]:
        """`stream` of a question about `frame` (`Frame.stream`): e2e starts here."""
        return self._stream(self.start_answer(question, frame))

    def start_answer(self, question: str, frame: Frame, views: list[str] | None = None) -> Started:
        """A question about `frame` up to its prefill: checked, its views selected and encoded, its prompt made,
        its visual tokens selected and the prompt in the model's cache (e2e starts here). views: the question's views
        where the caller has selected them already (`answer_many`: the selection is then timed where it was made)."""
        t0 = time.perf_counter()
        self.check_question(question)
        timer = StageTimer(self.model.device, setup=lambda: self.backend.setup_ms)  # setup left out of the stages
        setup0 = self.backend.setup_ms
        before = (frame.encoded, frame.hits, frame.misses)
        if views is None:
            with timer("select_views"):
                views = self.select_views(question)
        reused = sum(c in frame.views for c in views)  # made for an earlier question of this frame
        with torch.no_grad():
            visual, counts = frame.visual(views, timer)
            made = {
                "encoded": frame.encoded - before[0],
                "reused": reused,
                "hits": frame.hits - before[1],
                "misses": frame.misses - before[2],
            }
            full = self.embed_prompt(question, views, visual, counts)
            record: dict = {}
            p, pruning = self.select_tokens(full, question, timer, record)
            if pruning is not None:  # the hook's choice, kept for the Answer
                pruning = pruning._replace(keep=_recording(pruning.keep, record))
            prefilled = self.prefill(p, pruning, question, timer)
        return Started(question, views, full, p, record, prefilled, timer, t0, made, setup0)

    @torch.no_grad()
    def _stream(self, st: Started) -> Iterator[Delta | Answer]:
        text = TextStream(self.tokenizer, self.tokenizer.eos_id)
        with closing(self.decode(st.prefilled, st.timer)) as steps:
            while True:
                try:
                    new = next(steps)
                except StopIteration as stop:
                    gen = stop.value
                    break
                yield Delta(text.push(new), new)
        rest = text.finish()
        if rest:
            yield Delta(rest, [])
        yield self.finish_answer(st, gen)

    def finish_answer(self, st: Started, gen: Generation) -> Answer:
        """The finished answer of a started question, from its generation (e2e ends here)."""
        answer_text = self.tokenizer.decode([t for t in gen.tokens if t != self.tokenizer.eos_id]).strip()
        full, p, record, timer = st.full, st.p, st.record, st.timer
        kept = record.get("kept", p.positions[0] if p.positions.shape[1] < full.positions.shape[1] else None)
        kept_tokens, kept_scores = _kept_by_view(full.view_spans, kept, record.get("scores"))
        ms = dict(timer.ms)
        ms["total"] = sum(ms.get(s, 0.0) for s in STAGES)
        setup = self.backend.setup_ms - st.setup0  # made during this answer (a new bucket's compile): setup, not e2e
        ms["e2e"] = (time.perf_counter() - st.t0) * 1e3 - setup
        self.setup_ms += setup
        return Answer(
            text=answer_text,
            views=st.views,
            num_visual_tokens=full.num_visual_tokens - (full.ids.shape[1] - gen.prompt_len),
            timings_ms=ms,
            accept_lengths=list(gen.accept_lengths),
            tokens=gen.tokens,
            input_tokens=gen.prompt_len,
            opened_tokens=gen.opened,
            precision=self.precision,
            kept_tokens=kept_tokens,
            kept_scores=kept_scores,
            tokens_per_view={cam: e - s for cam, s, e in full.view_spans},
            cache=st.made,
        )

    # -- many answers at once -------------------------------------------------------------------
    @property
    def can_batch(self) -> bool:
        """Whether its backend decodes batches (`litevlm.batch.batch_refusal`): the modules and the native steps."""
        return not batch_refusal(self.backend)

    def batch_decoder(self, max_batch: int = 8) -> BatchDecoder:
        """A scheduler that decodes up to `max_batch` of this pipeline's answers together (`litevlm.batch`)."""
        return BatchDecoder(self.backend, drafting=self.drafting, tree=self.tree, max_batch=max_batch)

    def answer_all(self, questions: list[str], frame: Frame, max_batch: int = 8) -> list[Answer]:
        """Every question about `frame` answered as one batch: each prefilled on its own (the frame's views encoded
        once), then decoded together, up to `max_batch` at a time, a question joining as one leaves. Each answer
        is the one `frame.answer(question)` gives (greedy); its e2e runs from the batch's start to its own last
        token. Every question is checked (its text, the cameras it needs) before any is answered."""
        answers: list[Answer | None] = [None] * len(questions)
        for i, ans in self.answer_many([(q, frame) for q in questions], max_batch, e2e_from_start=True):
            answers[i] = ans
        return answers

    def answer_many(
        self,
        work: list[tuple[str, Frame]],
        max_batch: int = 8,
        e2e_from_start: bool = False,
        decoder: BatchDecoder | None = None,
    ) -> Iterator[tuple[int, Answer]]:
        """(question, frame) pairs answered with up to `max_batch` decoding together, in order of admission, a pair
        joining as one leaves -> (index into `work`, Answer) as each answer finishes. Every question and the cameras
        it needs are checked before any is answered. A question's e2e runs from its own admission (its prefill's
        start) to its last token, or with `e2e_from_start` from the first admission. decoder: one made by
        `batch_decoder` to run on (its counters then tell the run's decode time and occupancy)."""
        chosen = []  # each question's views, selected (and timed) once, here
        for q, frame in work:
            self.check_question(q)
            t0 = time.perf_counter()
            views = self.select_views(q)
            chosen.append((views, (time.perf_counter() - t0) * 1e3))
            frame.check_views(views)
        decoder = decoder or self.batch_decoder(max_batch)
        waiting = list(enumerate(work))
        t0 = time.perf_counter()
        try:
            while waiting or decoder.live:
                while waiting and not decoder.full:
                    i, (q, frame) = waiting.pop(0)
                    views, select_ms = chosen[i]
                    st = self.start_answer(q, frame, views)
                    st.timer.ms["select_views"] = select_ms
                    if e2e_from_start:
                        st.t0 = t0
                    seq = decoder.admit(st.prefilled, self.sampling, st.timer, tag=(i, st))
                    if seq.finished:
                        yield i, self.finish_answer(st, seq.generation)
                for seq in decoder.step():
                    if seq.finished:
                        i, st = seq.tag
                        yield i, self.finish_answer(st, seq.generation)
        finally:
            for seq in list(decoder.seqs):
                decoder.cancel(seq)

    def _opening(self, question: str):
        """The answer openings to verify with this question's prompt (`litevlm.spec.openings`): speculative greedy
        decoding with a draft head that has them, unless turned off; else None."""
        table = getattr(self.draft, "openings", None)  # a head may have none
        if not self.openings or table is None or self.temperature > 0:
            return None
        return table.for_question(question)


def torch_dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise LiteVLMError(f"unknown dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def _recording(keep, record: dict):
    """A pruning hook's `keep` that also puts the prompt indices it keeps in record["kept"]."""

    def recorded(x: torch.Tensor) -> torch.Tensor:
        kept = keep(x)
        record["kept"] = kept
        return kept

    return recorded


def _kept_by_view(view_spans, kept: torch.Tensor | None, scores: torch.Tensor | None):
    """The kept prompt indices (None: all) as each view's kept token indices, and the selector's scores of those
    tokens (scores: (N,) over every visual token, view after view, or None)."""
    if kept is None:
        return None, None
    kept = kept.tolist()
    by_view, by_score, off = {}, ({} if scores is not None else None), 0
    flat = scores.float().tolist() if scores is not None else None
    for cam, s, e in view_spans:
        idx = [i - s for i in kept if s <= i < e]
        by_view[cam] = idx
        if flat is not None:
            by_score[cam] = [round(flat[off + i], 4) for i in idx]
        off += e - s
    return by_view, by_score
