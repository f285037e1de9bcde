"""One execution backend per model, chosen once when the pipeline is built.

Generation needs five operations of the decoder: a prompt's layers (plain, or the layers before and after the
pruning hook), one decode step, a tree verification, a draft head's steps (extend, tree level, chain, a whole greedy
cycle), and the commit of an accepted path. A backend offers them for one model (and its draft head), and the
route is fixed when the backend is made, never re-chosen per call:

- `ModulesBackend`: the nn.Module path, the reference. Any device and dtype, forward hooks (FP8 calibration),
  FP8 layers, training.
- `NativeBackend`: the one-sequence CPU steps of cpu_steps.cpp (`litevlm.model.native`), built and loaded, and the
  weights packed for it, when the backend is made: a decode step or a greedy chain cycle is one call.
- `CudaBackend`: the module path as shape-static steps, one per KV-length bucket, captured as CUDA graphs before
  any prompt and replayed (decode, and verification of trees of the configured size), with the prefill compiled
  per prompt-length bucket (gpt-fast's recipe; whole, either side of a pruning cut, or with answer openings under
  their trie mask), each step kind pinned to one fused attention kernel, never the math
  path (`litevlm.model.attention`). With `twin=True` it runs on the CPU: every mechanism of a capture except the
  CUDA calls (the warm-up with its side effects, the static buffers, replay on those buffers), so CI tests what a
  GPU runs.

`choose_backend` picks one. Whatever changes the weights afterwards (training, quantising, loading a module) makes
a new backend (`Pipeline.rebuild`): a native backend's packed weights and a CUDA backend's graphs belong to the
weights they were made from.
"""

from __future__ import annotations

import functools
import os
import time
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from litevlm.errors import LiteVLMError
from litevlm.model import cpu_steps
from litevlm.model.attention import KERNEL_NAMES, additive_bias, choose_kernel, fused_attention, fused_kernels
from litevlm.model.layers import linear, row_major, static_step
from litevlm.model.lm import RMSNorm, run_layer
from litevlm.presets import BACKENDS

CACHE_MULTIPLE = 128  # cache lengths are rounded up to this (the fused attention kernels like 16-aligned keys)
KV_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # a static step attends over the smallest bucket that holds its slots
PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def round_up(n: int, multiple: int = CACHE_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen and when generation stops: greedy at temperature 0, else temperature + nucleus
    sampling from `generator`; at most `max_new_tokens`, ending after `eos_id` (None: never)."""

    max_new_tokens: int = 160
    eos_id: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = field(default=None, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def ends(self, token: int) -> bool:
        """Generation stops after this token (never without an eos_id)."""
        return token == self.eos_id

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) -> tokens (B,)."""
        if self.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, -1)
        if self.top_p < 1.0:
            sorted_p, idx = probs.sort(-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
            probs = probs / probs.sum(-1, keepdim=True)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def tree_mask_over(tree_mask: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """(1, 1, N, width) bool: node i sees the committed slots 0..start-1 and its ancestors at start.. (tree_mask
    (N, N): ancestor-or-self)."""
    n = tree_mask.shape[0]
    mask = torch.zeros(n, width, dtype=torch.bool, device=tree_mask.device)
    mask[:, :start] = True
    mask[:, start : start + n] = tree_mask
    return mask[None, None]


# ------------------------------------------------------------------------------------------------
# The modules: the reference
# ------------------------------------------------------------------------------------------------
class ModulesBackend:
    """The decoder's nn.Modules, called as they are (hooks fire, FP8 layers run, any device and dtype)."""

    name = "modules"
    greedy_chain = False  # a greedy chain cycle as one call per side (`NativeBackend`)
    kernels: dict[str, str] | None = None  # the SDPA kernel each step kind is pinned to (`CudaBackend`); None: per call

    def __init__(self, model, draft=None):
        self.model = model
        self.lm = model.language_model
        self.draft = draft
        self.drafter = draft  # what drafts: the head itself here
        self.setup_ms = 0.0  # one-off cost of making the backend (native build, packing, capture, compilation)
        self.stats = {"graph_replays": 0, "eager_steps": 0, "eager_prompts": 0}

    # -- the prompt -----------------------------------------------------------------------------
    def prompt(self, embeds, positions, start_layer: int = 0, end_layer: int | None = None, tree_tail=None):
        """A prompt of one sequence (1, T, C) at positions (1, T) into cache slots 0..T-1, causally, through layers
        [start_layer, end_layer) -> (1, T, C), post-norm when end_layer is None. tree_tail (m, T): the last m rows
        are a tree after the prompt (answer openings), row i seeing where tree_tail[i] is True."""
        t = embeds.shape[1]
        slots = torch.arange(t, device=embeds.device)
        return self.lm(
            embeds,
            positions,
            slots=slots,
            mask=None,
            kv_len=t,
            start_layer=start_layer,
            end_layer=end_layer,
            tree_tail=tree_tail,
        )

    def ready_prefill(self, t: int) -> None:
        """Make ready whatever a t-token prompt's prefill needs before it is timed (`CudaBackend`: its length
        bucket's compilation); nothing here."""

    def prefill(self, embeds, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt (1, T, C) into slots 0..T-1 -> (last logits (1, V), hidden (1, T, C))."""
        hidden = self.prompt(embeds, positions)
        return linear(hidden[:, -1], self.model.lm_head), hidden

    # -- one token, one tree --------------------------------------------------------------------
    def decode(self, token: torch.Tensor, position: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1, 1) at RoPE `position`, written at cache `slot`, attending over slots 0..slot -> (logits (1, V),
        post-norm hidden (1, 1, C))."""
        lm, dev = self.lm, token.device
        pos = torch.full_like(token, position)
        hidden = lm(lm.embed_tokens(token), pos, slots=torch.tensor([slot], device=dev), kv_len=slot + 1)
        return linear(hidden[:, -1], self.model.lm_head), hidden

    def verify(self, tokens, depth, tree_mask, start: int, root_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A flattened tree (tokens (N,), depth (N,), ancestor-or-self mask (N, N)) at slots start..start+N-1 and
        positions root_position + depth, over the committed slots 0..start-1 -> (logits (N, V), hidden (N, C))."""
        lm, n = self.lm, tokens.shape[0]
        positions = (depth + root_position)[None]  # (1, N)
        slots = torch.arange(start, start + n, device=tokens.device)
        mask = tree_mask_over(tree_mask, start, start + n)
        hidden = lm(lm.embed_tokens(tokens)[None], positions, slots=slots, mask=mask, kv_len=start + n)[0]
        return linear(hidden, self.model.lm_head), hidden

    def tree_rows(self, embeds, positions, slots, visible, end_layer: int) -> torch.Tensor:
        """Rows after the cached ones (embeds (1, m, C) at positions (1, m), written at slots (m,)) through layers
        [0, end_layer), row i seeing the slots where visible (m, S) is True, S = the last slot + 1 -> (1, m, C): a
        pruned prompt's answer openings through the layers before its cut."""
        return self.lm(
            embeds, positions, slots=slots, mask=visible[None, None], kv_len=visible.shape[1], end_layer=end_layer
        )

    def verify_chain(self, tokens, start: int, root_position: int):
        raise LiteVLMError(f"the {self.name} backend verifies chains as trees (greedy_chain is False)")

    def commit(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move the accepted entries at src_slots to dst_start.. in every layer."""
        self.lm.commit(src_slots, dst_start)


# ------------------------------------------------------------------------------------------------
# The native CPU steps
# ------------------------------------------------------------------------------------------------
def native_refusal(model, draft=None) -> str:
    """Why the native steps cannot serve this model (and draft), or "" where they can: they take one fp32 sequence
    on the CPU through plain, unhooked projections, an RMSNorm and a bias-free LM head."""
    from litevlm.model import native

    lm = model.language_model
    w = lm.embed_tokens.weight
    if w.device.type != "cpu":
        return f"the model is on {w.device}"
    if w.dtype != torch.float32:
        return f"the model is in {w.dtype}"
    cache = lm.layers[0].self_attn.kv_cache
    if cache is not None and cache.k.shape[0] != 1:
        return "the KV cache holds more than one sequence"
    if cpu_steps.hooked(lm.layers):
        return "forward hooks are set on the decoder (they would not fire in a native step)"
    if not all(layer.fusable() for layer in lm.layers):
        return "a decoder layer is not plain Linear projections (FP8 or another transform)"
    if type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None or type(lm.norm) is not RMSNorm:
        return "the LM head or the final norm is not a plain bias-free Linear and an RMSNorm"
    if draft and not (hasattr(draft, "chain_arguments") and draft.layer.fusable()):
        return "the draft is not a DraftHead of plain Linear projections"
    if native.ops() is None:
        return f"the native build is unavailable ({native.error()})"
    return ""


class NativeBackend(ModulesBackend):
    """The one-sequence CPU steps of cpu_steps.cpp, with the weights packed once when the backend is made."""

    name = "native"
    greedy_chain = True

    def __init__(self, model, draft=None):
        super().__init__(model, draft)
        t0 = time.perf_counter()
        why = native_refusal(model, draft)
        if why:
            raise LiteVLMError(f"the native CPU steps cannot run this model: {why}")
        from litevlm.model import native

        self.steps = cpu_steps.NativeSteps(native.ops())
        cfg = self.lm.cfg
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps)
        with torch.no_grad():
            self.weights = [cpu_steps.layer_weights(layer) for layer in self.lm.layers]
            self.embed = self.lm.embed_tokens.weight.detach()
            self.norm_w = self.lm.norm.weight.detach()
            self.head = row_major(model.lm_head)
            self.bf16_rows = self.lm.layers[0].bf16_min_rows  # prompts of this many rows multiply in bf16 (0: never)
            self.bf16 = bool(self.bf16_rows)
        self.drafter = NativeDraft(draft, self.steps) if draft else None
        self.setup_ms = (time.perf_counter() - t0) * 1e3

    def _caches(self):
        return cpu_steps.caches(self.lm.layers)

    def prompt(self, embeds, positions, start_layer: int = 0, end_layer: int | None = None, tree_tail=None):
        lm, cfg = self.lm, self.lm.cfg
        t, d = embeds.shape[1], cfg.head_dim
        layers = lm.layers[start_layer:end_layer]
        cos, sin = lm.rope_table(int(positions.max()), embeds.dtype, embeds.device)  # (P, 1, D)
        cos, sin = cos[positions[0]], sin[positions[0]]  # (T, 1, D)
        weights = self.weights[start_layer:end_layer]
        bf16 = self.bf16 and t >= self.bf16_rows
        out = self.steps.prompt(
            embeds[0],
            cos.reshape(t, 1, d),
            sin.reshape(t, 1, d),
            weights,
            cpu_steps.caches(layers),
            cfg,
            bf16,
            tree_tail,
        )
        return lm.norm(out[None]) if end_layer is None else out[None]

    def decode(self, token, position: int, slot: int):
        cos, sin = self.lm.rope_table(position, torch.float32, token.device)
        logits, hidden = self.steps.decode(
            token.view(1), position, slot, cos, sin, self.embed, self.weights, self._caches(), *self.shape,
            self.norm_w, self.head,
        )  # fmt: skip
        return logits, hidden[None]

    def verify(self, tokens, depth, tree_mask, start: int, root_position: int):
        n = tokens.shape[0]
        positions = depth + root_position
        cos, sin = self.lm.rope_table(int(positions.max()), torch.float32, tokens.device)
        mask = tree_mask_over(tree_mask, start, start + n)
        x = self.steps.layers(
            self.embed[tokens], cos[positions], sin[positions], start, mask, self.weights, self._caches(), *self.shape,
            head=self.head,
        )  # fmt: skip
        hidden = self.lm.norm(x)
        return hidden @ self.head, hidden

    def verify_chain(self, tokens, start: int, root_position: int):
        """`verify` + greedy acceptance for a chain (root + drafts, tokens (n,)) in one call -> (the emitted tokens
        (a+1,), the features (a+1, C) and next embeddings (a+1, C) of the pairs the draft extends with next, their
        positions (a+1,)). A chain's accepted path is a prefix of it: nothing to commit."""
        cos, sin = self.lm.rope_table(root_position + tokens.numel(), torch.float32, tokens.device)
        return self.steps.verify_chain(
            tokens, start, root_position, cos, sin, self.embed, self.weights, self._caches(), *self.shape,
            self.norm_w, self.head,
        )  # fmt: skip

    # -- several sequences at once (`litevlm.batch`) ------------------------------------------------------
    def batch_decode(self, tokens, positions, slots, caches):
        """One decode step of B sequences, each on its own caches (caches[b]: per layer [K, V]): tokens, positions,
        slots (B,) -> (logits (B, V), hidden (B, C)); the weights read once for all of them."""
        cos, sin = self.lm.rope_table(int(positions.max()), torch.float32, tokens.device)
        return self.steps.batch_decode(
            tokens, positions, slots, cos, sin, self.embed, self.weights, caches, *self.shape, self.norm_w, self.head
        )

    def batch_verify_chain(self, tokens, counts, starts, root_positions, caches):
        """`verify_chain` for B sequences' chains stacked in tokens (N,), counts (B,) each -> (the emitted runs
        stacked (N',), each run's length (B,), the N' pairs' features, next embeddings and positions)."""
        top = int((root_positions + counts).max())
        cos, sin = self.lm.rope_table(top, torch.float32, tokens.device)
        return self.steps.batch_verify_chain(
            tokens, counts, starts, root_positions, cos, sin, self.embed, self.weights, caches, *self.shape,
            self.norm_w, self.head,
        )  # fmt: skip


class DraftSteps:
    """What a backend's draft shares with its head: its config, openings, `prepare`, `topk` and `embed`; the
    subclasses run the layer their own way."""

    def __init__(self, draft):
        self.head_module = draft
        self.cfg = draft.cfg
        self.openings = getattr(draft, "openings", None)

    def prepare(self, cache_len: int, max_position: int) -> None:
        self.head_module.prepare(cache_len, max_position)

    def topk(self, hidden, k: int):
        return self.head_module.topk(hidden, k)

    def embed(self, tokens):
        return self.head_module.embed(tokens)


class NativeDraft(DraftSteps):
    """A draft head's steps as native calls (`cpu_steps.cpp`): the same `extend`, `step`, `topk`, `prepare` as the
    head, plus the chain and the greedy cycle in one call each. Its weights are packed once, here."""

    one_call_chain = True  # `litevlm.spec.tree.draft_tree` drafts a chain with one `draft_chain` call

    def __init__(self, draft, steps: cpu_steps.NativeSteps):
        super().__init__(draft)
        self.steps = steps
        cfg = draft.cfg
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps)
        with torch.no_grad():
            self.weights = [cpu_steps.layer_weights(draft.layer)]
            self.chain_args = draft.chain_arguments()

    def _layer(self, x, cos, sin, start: int, mask, last_only: bool = False):
        caches = cpu_steps.caches((self.head_module.layer,))
        return self.steps.layers(x, cos, sin, start, mask, self.weights, caches, *self.shape, last_only)

    def extend(self, features, next_embeds, positions, start: int, last_only: bool = False):
        h = self.head_module
        x, cos, sin, mask = h.extend_inputs(features, next_embeds, positions, start, last_only)
        return self._layer(x, cos, sin, start, mask, last_only)

    def step(self, tokens, hidden, position: int, start: int, mask):
        h = self.head_module
        cos, sin = h.cos_sin(position)
        x = h.fuse(hidden, h.embed(tokens))
        return self._layer(x, cos, sin, start, None if mask is None else mask[None, None])

    def _tail(self) -> tuple:
        caches = cpu_steps.caches((self.head_module.layer,))
        return (*self.chain_args, self.weights, caches, *self.shape)

    def draft_chain(self, root_hidden, position: int, start: int, depth: int, min_value: float, eos_id):
        cos, sin = self.head_module.rope
        return self.steps.chain(
            root_hidden, position, start, depth, _log_min(min_value), _eos(eos_id, min_value), cos, sin, *self._tail()
        )

    def draft_cycle(self, features, next_embeds, positions, start, root, root_position, depth, min_value, eos_id):
        """`extend(..., last_only=True)` then `draft_chain` from its output, in one call -> the chain to verify
        (1 + m,): the root, then the m drafted ids."""
        cos, sin = self.head_module.rope
        return self.steps.draft_cycle(
            features, next_embeds, positions, start, root.reshape(1), root_position, depth, _log_min(min_value),
            _eos(eos_id, min_value), cos, sin, *self._tail(),
        )  # fmt: skip

    def batch_cycle(
        self, feats, nxt, pair_pos, counts, dones, roots, root_positions, depths, min_value, eos_id, caches
    ):
        """`draft_cycle` for B sequences, each on its own draft cache (caches[b]: [[K, V]]): their new pairs stacked
        (counts (B,) each), chains of at most depths[b] drafts (0: none) -> (B, 1 + max depth), -1 past a chain."""
        cos, sin = self.head_module.rope
        return self.steps.batch_draft_cycle(
            feats, nxt, pair_pos, counts, dones, roots, root_positions, depths, _log_min(min_value),
            _eos(eos_id, min_value), cos, sin, *self.chain_args, self.weights, caches, *self.shape,
        )  # fmt: skip


def _log_min(min_value: float) -> float:
    import math

    return math.log(min_value) if min_value > 0 else -math.inf


def _eos(eos_id: int | None, min_value: float) -> int:
    """The EOS a chain stops at, as `litevlm.spec.tree.draft_tree` stops: only a chain cut by its value (min_value >
    0) watches for it; a fixed-depth chain drafts every level (-1: none)."""
    return -1 if eos_id is None or min_value <= 0 else eos_id


# ------------------------------------------------------------------------------------------------
# CUDA: shape-static steps per KV-length bucket, captured as graphs; and their CPU twin
# ------------------------------------------------------------------------------------------------
class StepGraph:
    """fn() over static input tensors, captured once and replayed: a CUDA graph, or its CPU twin.

    Capture: `warmup` eager runs of fn (on a side stream on CUDA, as capture requires; their side effects are real,
    so fn's static inputs must point at scratch cache slots while they run), then the capture, whose outputs are
    the static output tensors every replay rewrites. A capture records fn without running it, so until the first
    replay those outputs hold whatever their memory held. The twin does all of this except the CUDA calls: its
    "capture" runs fn once more for the output buffers and then fills them with garbage (NaN, or -1 for ids), as a
    capture leaves them, and a replay runs fn and copies its results into them, so a caller that held on to an output
    across replays, or read one before any replay, sees what it would see on a GPU."""

    def __init__(self, fn, device, twin: bool, warmup: int = 2, pool=None):
        self.fn, self.twin = fn, twin
        t0 = time.perf_counter()
        with torch.no_grad():
            if twin:
                with static_step():
                    for _ in range(warmup):
                        fn()
                    self.out = fn()
                for t in self.out:  # what a capture leaves in its outputs: nothing computed
                    t.fill_(float("nan") if t.is_floating_point() else -1)
            else:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        fn()
                torch.cuda.current_stream(device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool):
                    self.out = fn()
                torch.cuda.synchronize(device)
        self.capture_ms = (time.perf_counter() - t0) * 1e3

    def replay(self):
        if self.twin:
            with torch.no_grad(), static_step():
                for dst, src in zip(self.out, self.fn()):
                    dst.copy_(src)
        else:
            self.graph.replay()
        return self.out


def _distinct(fn, tag: str):
    """A copy of fn with its own code object, so that torch.compile keeps one cache (and recompile limit) per copy."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _decode_static(model, token, position, slot, width: int, layer_step=None):
    """One decode step with fixed shapes: token (1, 1), position (1, 1), slot (1,) tensors; attention over cache
    slots 0..width-1 where col <= slot, as an additive bias (the fused kernels' form) -> (logits (1, V), hidden
    (1, 1, C))."""
    lm = model.language_model
    x = lm.embed_tokens(token)  # (1, 1, C)
    visible = (torch.arange(width, device=token.device) <= slot)[None, None, None]  # (1, 1, 1, width)
    bias = additive_bias(visible, x.dtype)
    hidden = lm(x, position, slots=slot, mask=bias, kv_len=width, fused=True, layer_step=layer_step)
    return model.lm_head(hidden[:, -1]), hidden


def _verify_static(model, tokens, positions, slots, mask, width: int, layer_step=None):
    """A tree of fixed size with fixed shapes: tokens (B, N), positions (B, N), slots (N,), mask (B, 1, N, width)
    bool, attended as an additive bias (the fused kernels' form) -> (logits (B, N, V), hidden (B, N, C)); B is 1."""
    lm = model.language_model
    x = lm.embed_tokens(tokens)  # (B, N, C)
    bias = additive_bias(mask, x.dtype)
    hidden = lm(x, positions, slots=slots, mask=bias, kv_len=width, fused=True, layer_step=layer_step)
    return model.lm_head(hidden), hidden


def _prefill_static(
    model, embeds, positions, slots, length: int, start_layer: int = 0, end_layer: int | None = None, layer_step=None
):
    """A padded prompt of `length` rows from slot 0 through layers [start_layer, end_layer), causal without a mask
    (the fused kernels' fast path), K/V heads expanded (the form every fused kernel accepts) -> hidden (1, length,
    C), post-norm when end_layer is None."""
    lm = model.language_model
    return lm(
        embeds,
        positions,
        slots=slots,
        mask=None,
        kv_len=length,
        start_layer=start_layer,
        end_layer=end_layer,
        fused=True,
        layer_step=layer_step,
    )


def _draft_chain_static(draft, root_hidden, position, start, levels: int, width: int):
    """A fixed-depth greedy draft chain with fixed shapes, no host sync: root_hidden (B, C), position and start (1,)
    long tensors -> the drafted ids (B, levels); B is 1. Level i + 1 pairs the level-i token with its predicted
    feature at draft position `position` + i, writes its K/V at draft slot `start` + i and attends over slots
    0..width-1 where col <= that slot, as an additive bias (the fused kernels' form)."""
    cos_table, sin_table = draft.rope  # (P, 1, D)
    cache = draft.layer.self_attn.kv_cache
    cols = torch.arange(width, device=root_hidden.device)
    _, tok = draft.topk(root_hidden, 1)  # (B, 1)
    drafted, hidden = [tok], root_hidden
    for i in range(levels - 1):
        p, slot = position + i, start + i  # (1,)
        x = draft.fuse(hidden, draft.embed(drafted[-1][:, 0]))[:, None]  # (B, 1, C)
        q, k, v = draft._qkv(x, cos_table[p], sin_table[p])
        cache.write(slot, k, v)
        bias = additive_bias((cols <= slot)[None, None, None], q.dtype)  # (1, 1, 1, width)
        y = fused_attention(q, cache.k[:, :, :width], cache.v[:, :, :width], bias)
        hidden = draft._out(x, y)[:, 0]  # (B, C)
        _, tok = draft.topk(hidden, 1)
        drafted.append(tok)
    return (torch.cat(drafted, 1),)  # (B, levels)


class GraphDraft(DraftSteps):
    """A draft head whose fixed-depth greedy chain is one captured step per (depth, draft-cache width bucket),
    replayed with the root's feature, position and slot as static inputs: the chain's argmaxes stay on the device
    and a cycle's drafting is one replay (`litevlm.spec.tree.draft_tree` calls `draft_chain`). The rest (`extend`,
    `step`, `topk`, trees with top_k > 1) is the head's own. A chain cut by its draft probability (min_value > 0)
    reads it on the host at every step, so `draft_tree` drafts it through `step` and `topk` (the head's) instead.
    Graphs are made on the first chain of their bucket (setup, counted in the backend's setup_ms) and made again if
    `prepare` gives the head a new cache."""

    one_call_chain = True
    fixed_depth_only = True  # a chain with a probability cut drafts step by step (`draft_tree`), not here

    def __init__(self, draft, backend: CudaBackend):
        super().__init__(draft)
        self.backend = backend
        self.graphs: dict[tuple, StepGraph] = {}
        self.root = self.position = self.start = None

    def extend(self, features, next_embeds, positions, start: int, last_only: bool = False):
        return self.head_module.extend(features, next_embeds, positions, start, last_only)

    def step(self, tokens, hidden, position: int, start: int, mask):
        return self.head_module.step(tokens, hidden, position, start, mask)

    def draft_chain(self, root_hidden, position: int, start: int, depth: int, min_value: float, eos_id):
        """The ids (depth,) drafted greedily after the root (its feature root_hidden (1, C) at draft position
        `position`, its level-1 child written at draft slot `start`)."""
        head = self.head_module
        if min_value > 0:
            raise LiteVLMError(
                "a replayed draft chain has a fixed depth: a chain cut by its probability (min_value > 0) drafts"
                " through the head's own steps"
            )
        cache = head.layer.self_attn.kv_cache
        end = start + depth - 1  # slots start..end-1 written
        width = next((w for w in (*self.backend.widths, cache.max_len) if end <= w <= cache.max_len), None)
        if width is None:
            raise LiteVLMError(f"a draft chain to slot {end} is past the draft cache ({cache.max_len})")
        if self.root is None:
            dev = root_hidden.device
            self.root = torch.zeros_like(root_hidden)
            self.position = torch.zeros(1, dtype=torch.long, device=dev)
            self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.root.copy_(root_hidden)
        self.position.fill_(position)
        self.start.fill_(start)
        key = (depth, width, cache.k.data_ptr(), tuple(cache.k.shape), head.rope[0].data_ptr(), head.rope[0].shape[0])
        graph = self.graphs.get(key)
        if graph is None:  # the first chain of this bucket: captured (nothing computed), then replayed like the rest
            graph = self.graphs[key] = self._capture(depth, width)
        graph.replay()
        self.backend.stats["graph_replays"] += 1
        return graph.out[0][0]

    def _capture(self, depth: int, width: int) -> StepGraph:
        t0 = time.perf_counter()
        b, head = self.backend, self.head_module
        step = b._compiled(_draft_chain_static, f"draft_{depth}_{width}", b.compile_steps, regional=False)

        def run(fn=step):
            return fn(head, self.root, self.position, self.start, depth, width)

        if "draft" not in b.pinned:  # chosen on the eager step, as the target's are: a compile keeps its first kernel
            d = head.cfg
            shapes = f"1 query over {width} keys, {d.num_heads} heads of {d.head_dim}, {head.fc.weight.dtype}"
            with torch.no_grad():
                b.pinned["draft"] = choose_kernel("draft", lambda: run(_draft_chain_static), b.fused_kernels, shapes)
        graph = StepGraph(_pinned(run, b.pinned["draft"]), head.fc.weight.device, b.twin, pool=b.pool)
        b.setup_ms += (time.perf_counter() - t0) * 1e3
        return graph


def _pinned(fn, kernel: SDPBackend):
    """fn() run with `kernel` the only SDPA kernel allowed."""

    def run():
        with sdpa_kernel([kernel]):
            return fn()

    return run


def _prefill_tree_static(
    model,
    embeds,
    positions,
    slots,
    visible,
    length: int,
    start_layer: int = 0,
    end_layer: int | None = None,
    layer_step=None,
):
    """A padded prompt with a tree after it (answer openings) of `length` rows from slot 0 through layers
    [start_layer, end_layer): visible (1, 1, length, length) bool, row i seeing where it is True (the prompt's rows
    causal, the nodes' their trie rows), attended as an additive bias with the K/V heads expanded (the fused kernels'
    form) -> hidden (1, length, C), post-norm when end_layer is None."""
    lm = model.language_model
    return lm(
        embeds,
        positions,
        slots=slots,
        mask=additive_bias(visible, embeds.dtype),
        kv_len=length,
        start_layer=start_layer,
        end_layer=end_layer,
        fused=True,
        layer_step=layer_step,
    )


class CudaBackend(ModulesBackend):
    """The module path as shape-static steps per KV-length bucket, captured as CUDA graphs before any prompt.

    The cache holds `cache_len` live slots (a multiple of 128) and at least `tree_nodes` scratch slots past them
    (`TextModel.setup_cache(..., scratch=)`). A step for bucket W attends over slots 0..W-1: a decode at slot s
    replays the smallest bucket with s < W, a verification of N nodes at start the smallest with start + N <= W.
    Warm-up and capture run with the slot inputs pointing at the scratch slots, so they never touch a live slot:
    a capture made after a prompt leaves its cache as it was. Trees of another size than `tree_nodes` verify
    through the modules; `stats` counts replays and eager steps, so a benchmark can show which ran.

    The prefill pads a prompt to its length bucket and runs it causally from slot 0, compiled once per bucket
    (`compile`; each bucket with its own code object); a bucket's first call is setup time, never prefill time.
    compile_steps: the decode and verification steps compiled too (inductor) before capture. Every compile is of one
    decoder layer, which all the layers reuse (`_compiled`): its cost does not grow with the model's depth.
    twin: the same on the CPU, every CUDA call replaced by its eager equivalent (`StepGraph`).

    Attention runs on a fused kernel, never the math path. Left to choose, torch 2.11 runs a decode or a
    verification on the math path: flash attention refuses any mask and memory-efficient attention refuses
    grouped-query heads (enable_gqa). So the static steps attend in the form the fused kernels accept
    (`litevlm.model.attention`): the K/V heads expanded to the query heads, the mask of a decode or a verification
    an additive bias, the prefill causal without a mask (flash's fast path). Each step kind (decode, verify,
    prefill) runs, and is captured, with exactly one kernel allowed: the first of `FUSED_KERNELS[device]` that runs
    it at setup, on its own shapes (CUDA: cuDNN, then flash, then memory-efficient; the CPU twin: torch's CPU flash
    kernel); a step none of them runs raises LiteVLMError. `kernels` names them, e.g. {"decode": "efficient",
    "verify": "efficient", "prefill": "flash"} (the prefill's once a prompt has been prefilled).
    """

    name = "cuda"

    def __init__(
        self,
        model,
        draft=None,
        tree_nodes: int = 0,
        twin: bool = False,
        compile: bool | None = None,
        compile_steps: bool = False,
        kv_buckets=KV_BUCKETS,
        prefill_buckets=PREFILL_BUCKETS,
    ):
        super().__init__(model, draft)
        if twin:
            self.name = "cuda-twin"
        elif model.device.type != "cuda":
            raise LiteVLMError(f"the cuda backend needs the model on a CUDA device; it is on {model.device}")
        t0 = time.perf_counter()
        lm = self.lm
        self.twin = twin
        self.compile = compiles() if compile is None else compile
        self.compile_failures: list[str] = []  # steps whose compile failed and that run uncompiled
        if self.compile or compile_steps:
            keep_compiles_on_disk()
        cache = lm.layers[0].self_attn.kv_cache
        if cache is None:
            raise LiteVLMError("set up the KV cache (TextModel.setup_cache) before making a cuda backend")
        self.cache_len = lm.cache_len
        self.scratch = cache.max_len - self.cache_len  # slots past the live ones: warm-up and capture write there
        if self.scratch < max(1, tree_nodes):
            raise LiteVLMError(
                f"the cache has {self.scratch} scratch slots; capture needs {max(1, tree_nodes)}: "
                "setup_cache(..., scratch=) with at least the tree size"
            )
        self.widths = sorted({w for w in kv_buckets if w < self.cache_len} | {self.cache_len})
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b < self.cache_len)) + (self.cache_len,)
        self.tree_nodes = tree_nodes
        dev = model.device
        self.fused_kernels = fused_kernels(dev)
        self.pinned: dict[str, SDPBackend] = {}  # step kind -> the one SDPA kernel its steps run under
        self.pool = None if twin else torch.cuda.graph_pool_handle()
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.slot = torch.full((1,), self.cache_len, dtype=torch.long, device=dev)  # a scratch slot while capturing
        # Each step kind's kernel is chosen on its first bucket; the buckets differ only in their number of keys.
        w = self.widths[0]
        self._choose("decode", _decode_static, (model, self.token, self.position, self.slot, w), 1, w)
        self.decode_graphs = {w: self._capture_decode(w, compile_steps) for w in self.widths}
        self.verify_graphs = {}
        if tree_nodes > 0:
            n = tree_nodes
            self.tokens = torch.zeros(1, n, dtype=torch.long, device=dev)
            self.positions = torch.zeros(1, n, dtype=torch.long, device=dev)
            self.slots = torch.arange(self.cache_len, self.cache_len + n, device=dev)  # scratch while capturing
            self.masks = {w: torch.ones(1, 1, n, w, dtype=torch.bool, device=dev) for w in self.widths if w >= n}
            if self.masks:
                w = min(self.masks)
                self._choose(
                    "verify", _verify_static, (model, self.tokens, self.positions, self.slots, self.masks[w], w), n, w
                )
            self.verify_graphs = {w: self._capture_verify(w, compile_steps) for w in self.masks}
        self._prefill_fns: dict[tuple, object] = {}  # (bucket, start layer, end layer) -> its step
        self.compile_steps = compile_steps
        self.drafter = GraphDraft(draft, self) if draft is not None else None
        self.setup_ms = (time.perf_counter() - t0) * 1e3

    @property
    def kernels(self) -> dict[str, str]:
        """The SDPA kernel each step kind runs under, by name: {"decode": "efficient", ...}."""
        return {step: KERNEL_NAMES[kernel] for step, kernel in self.pinned.items()}

    def _choose(self, step: str, fn, args: tuple, queries: int, keys: int) -> None:
        """Pin the `step` kind to the first fused kernel under which fn(*args), one eager step on its own shapes,
        runs (`choose_kernel`). The step attends with `queries` rows over `keys` slots; it must write only scratch
        slots, or slots rewritten next."""
        cfg = self.lm.cfg
        dtype = self.lm.embed_tokens.weight.dtype
        shapes = f"{queries} queries over {keys} keys, {cfg.num_heads} heads of {cfg.head_dim}, {dtype}"
        with torch.no_grad():
            self.pinned[step] = choose_kernel(step, lambda: fn(*args), self.fused_kernels, shapes)

    def _compiled(self, fn, tag: str, compile_it: bool, regional: bool = True):
        """A step, compiled (inductor) if compile_it, each with its own code object (`tag`) and so its own compile
        cache and recompile limit. A target step (decode, verification, a prefill bucket) is compiled by regions: one
        compile of `run_layer` that every decoder layer reuses, its weights and cache buffers the graph's inputs.
        Inductor fuses within a layer (norms, RoPE, SwiGLU, an FP8 activation's quantisation) and the step's graph
        capture removes the launches between the layers, while a compile costs one layer's, not the whole model's.
        The draft chain (one layer) is compiled whole (`regional=False`)."""
        if not compile_it:
            return fn
        if not regional:
            return torch.compile(_distinct(fn, tag), dynamic=False, fullgraph=True)
        return functools.partial(fn, layer_step=torch.compile(_distinct(run_layer, tag), dynamic=False, fullgraph=True))

    def _captured(self, capture, tag: str, compile_it: bool) -> StepGraph:
        """capture(compile_it) -> its StepGraph; where compiling the step fails (an inductor or dynamo error on this
        machine's toolchain), a warning naming the error and the step captured uncompiled: the same results."""
        if not compile_it:
            return capture(False)
        try:
            return capture(True)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the uncompiled step is exact
            warnings.warn(f"litevlm: compiling the {tag} step failed ({type(e).__name__}: {e}); captured uncompiled")
            self.compile_failures.append(f"{tag}: {type(e).__name__}")
            return capture(False)

    def _capture_decode(self, width: int, compile_it: bool) -> StepGraph:
        def capture(compiled: bool) -> StepGraph:
            step = self._compiled(_decode_static, f"decode_{width}", compiled)
            model = self.model
            run = _pinned(lambda: step(model, self.token, self.position, self.slot, width), self.pinned["decode"])
            return StepGraph(run, model.device, self.twin, pool=self.pool)

        return self._captured(capture, f"decode_{width}", compile_it)

    def _capture_verify(self, width: int, compile_it: bool) -> StepGraph:
        def capture(compiled: bool) -> StepGraph:
            step = self._compiled(_verify_static, f"verify_{width}", compiled)
            model, mask = self.model, self.masks[width]
            run = _pinned(
                lambda: step(model, self.tokens, self.positions, self.slots, mask, width), self.pinned["verify"]
            )
            return StepGraph(run, model.device, self.twin, pool=self.pool)

        return self._captured(capture, f"verify_{width}", compile_it)

    def _width(self, end: int) -> int | None:
        """The smallest bucket whose steps see slots 0..end-1, or None past the live cache."""
        return next((w for w in self.widths if w >= end), None)

    # -- operations -----------------------------------------------------------------------------
    def _bucket(self, t: int) -> int | None:
        """The smallest prefill bucket that holds a t-token prompt, or None past the cache."""
        return next((b for b in self.prefill_buckets if b >= t), None) if t <= self.cache_len else None

    def prefill(self, embeds, positions):
        hidden = self.prompt(embeds, positions)
        return linear(hidden[:, -1], self.model.lm_head), hidden

    def prompt(self, embeds, positions, start_layer: int = 0, end_layer: int | None = None, tree_tail=None):
        """The prompt through layers [start_layer, end_layer) as a compiled step of its length bucket, one per
        (bucket, layers, openings or not): the whole prefill, the pruned prefill's two parts (the layers before its
        cut on the whole prompt, those after on the kept tokens), and a prompt with answer openings after it
        (tree_tail: causal rows, then the nodes' trie rows, as a mask of the bucket's size; its own step kind,
        "openings", pinned to a kernel that takes a mask). Only a batch of more than one goes through the modules;
        `stats` counts it."""
        t = embeds.shape[1]
        b = self._bucket(t)
        if b is None:
            raise LiteVLMError(f"the prompt has {t} tokens but the KV cache holds {self.cache_len}")
        if embeds.shape[0] != 1:
            self.stats["eager_prompts"] += 1
            return super().prompt(embeds, positions, start_layer, end_layer, tree_tail)
        padded = self._padded(embeds, positions, b)
        if tree_tail is None:
            kind, static, args = "prefill", _prefill_static, (*padded, start_layer, end_layer)
        else:
            kind, static = "openings", _prefill_tree_static
            args = (*padded[:3], self._tree_visible(tree_tail, t, b), b, start_layer, end_layer)
        key = (b, start_layer, end_layer) + (("openings",) if tree_tail is not None else ())
        fn = self._prefill_fns.get(key)
        if fn is None:  # a new bucket, layer range or kind: compile it here, on this prompt, and count it as setup
            sync_start = time.perf_counter()
            if kind not in self.pinned:  # the kind's first bucket pins its kernel: one eager run, rewritten next
                self._choose(kind, static, (self.model, *args), b, b)
            tag = f"{kind}_{b}" + (f"_{start_layer}_{end_layer}" if (start_layer, end_layer) != (0, None) else "")
            fn = self._prefill_fns[key] = self._compiled(static, tag, self.compile)
            with sdpa_kernel([self.pinned[kind]]):
                fn(self.model, *args)
            _sync(embeds.device)
            self.setup_ms += (time.perf_counter() - sync_start) * 1e3
        with sdpa_kernel([self.pinned[kind]]):
            return fn(self.model, *args)[:, :t]

    def tree_rows(self, embeds, positions, slots, visible, end_layer: int) -> torch.Tensor:
        """As the modules do it, in the fused kernels' form (K/V heads expanded, the mask an additive bias) under the
        "openings" step kind's kernel: a few rows, eager (one call a prompt, a handful of layers)."""
        if "openings" in self.pinned:
            bias = additive_bias(visible[None, None], embeds.dtype)
            try:
                with sdpa_kernel([self.pinned["openings"]]):
                    return self.lm(
                        embeds,
                        positions,
                        slots=slots,
                        mask=bias,
                        kv_len=visible.shape[1],
                        end_layer=end_layer,
                        fused=True,
                    )
            except RuntimeError:  # the kernel was pinned on a bucket's shapes; these rows are not one (counted)
                pass  # the rows rewrite the same slots below
        self.stats["eager_steps"] += 1
        return super().tree_rows(embeds, positions, slots, visible, end_layer)

    @staticmethod
    def _tree_visible(tree_tail: torch.Tensor, t: int, b: int) -> torch.Tensor:
        """(1, 1, b, b) bool for a t-row prompt whose last m rows are a tree (tree_tail (m, t)), padded to bucket b:
        every row causal, the tree's rows as tree_tail says (they see no padding row, and no padding row's keys
        reach a real row)."""
        visible = torch.ones(b, b, dtype=torch.bool, device=tree_tail.device).tril()
        m = tree_tail.shape[0]
        visible[t - m : t, :t] = tree_tail
        visible[t - m : t, t:] = False
        return visible[None, None]

    def ready_prefill(self, t: int) -> None:
        """Compile the prefill bucket of a t-token prompt now, as setup, on a zero prompt (the real prefill that
        follows rewrites every slot it wrote)."""
        lm, dev = self.lm, self.model.device
        b = self._bucket(t)
        if b is not None and (b, 0, None) not in self._prefill_fns:
            embeds = torch.zeros(1, t, lm.cfg.hidden_size, dtype=lm.embed_tokens.weight.dtype, device=dev)
            self.prefill(embeds, torch.arange(t, device=dev)[None])

    def _padded(self, embeds, positions, b: int) -> tuple:
        """A prompt (1, T, C) at positions (1, T) as the prefill of bucket b takes it: (embeds (1, b, C), positions
        (1, b), slots (b,), b), zero rows at the next positions after it."""
        pad = b - embeds.shape[1]
        padded = torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[2])], 1)
        padded_pos = torch.cat(
            [positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)[None]], 1
        )
        return padded, padded_pos, torch.arange(b, device=embeds.device), b

    def decode(self, token, position: int, slot: int):
        w = self._width(slot + 1)
        if w is None:
            raise LiteVLMError(f"decode slot {slot} is past the KV cache ({self.cache_len})")
        self.token.copy_(token.view(1, 1))
        self.position.fill_(position)
        self.slot.fill_(slot)
        logits, hidden = self.decode_graphs[w].replay()
        self.stats["graph_replays"] += 1
        return logits, hidden

    def verify(self, tokens, depth, tree_mask, start: int, root_position: int):
        """A tree of at most `tree_nodes` nodes replays the captured verification: a smaller one (a chain cut by its
        probability or at a drafted end of answer) is padded with nodes that see only themselves, whose rows are
        dropped (what the target says after any proposal is exact, so extra nodes cannot change what is accepted;
        their K/V land past the tree, in slots generation rewrites before it reads them)."""
        n, full = tokens.shape[0], self.tree_nodes
        w = self._width(start + full) if 0 < n <= full else None
        if w is None or w not in self.verify_graphs:
            self.stats["eager_steps"] += 1
            return super().verify(tokens, depth, tree_mask, start, root_position)
        if n < full:
            pad = full - n
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            depth = torch.cat([depth, depth.new_zeros(pad)])
            mask = torch.zeros(full, full, dtype=torch.bool, device=tree_mask.device)
            mask[:n, :n] = tree_mask
            mask[n:, n:] = torch.eye(pad, dtype=torch.bool, device=tree_mask.device)
            tree_mask = mask
        self.tokens.copy_(tokens[None])
        self.positions.copy_(depth[None] + root_position)
        self.slots.copy_(torch.arange(start, start + full, device=tokens.device))
        self.masks[w].copy_(tree_mask_over(tree_mask, start, w))
        self.stats["graph_replays"] += 1
        logits, hidden = self.verify_graphs[w].replay()
        return logits[0, :n], hidden[0, :n]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
# Choosing
# ------------------------------------------------------------------------------------------------
# "auto" leaves decoders larger than this to the modules: the native steps pack two copies of the decoder's weights
# (row-major for the prompt's BLAS products, 32-column panels for the steps': three times its memory; a 2B model's
# fp32 decoder is 7 GB), and what they save, per-step overhead, is nothing beside the matmuls of a step at such sizes,
# which both paths hand to the same kernels.
NATIVE_AUTO_MAX_PARAMS = 500_000_000


def auto_kind(model, draft=None) -> str:
    """What "auto" builds for this model: cuda on a CUDA device, else native where it can serve the model and the
    decoder is at most NATIVE_AUTO_MAX_PARAMS, else the modules."""
    if model.device.type == "cuda":
        return "cuda"
    if native_refusal(model, draft):
        return "modules"
    decoder = sum(p.numel() for layer in model.language_model.layers for p in layer.parameters())
    return "native" if decoder <= NATIVE_AUTO_MAX_PARAMS else "modules"


def choose_backend(kind: str, model, draft=None, tree_nodes: int = 0, **cuda_options) -> ModulesBackend:
    """The backend `kind` names for this model: "modules", "native", "cuda", "cuda-twin", or "auto" (`auto_kind`)."""
    if kind not in BACKENDS:
        raise LiteVLMError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")
    if kind == "auto":
        kind = auto_kind(model, draft)
    if kind == "modules":
        return ModulesBackend(model, draft)
    if kind == "native":
        return NativeBackend(model, draft)
    twin = kind == "cuda-twin"  # on the CPU the prefill buckets run eagerly unless asked to compile
    return CudaBackend(model, draft, tree_nodes, twin=twin, **{"compile": not twin and compiles(), **cuda_options})


def keep_compiles_on_disk() -> Path:
    """Inductor's compiled graphs kept between processes (its FX graph cache), in LITEVLM_COMPILE_CACHE, or
    TORCHINDUCTOR_CACHE_DIR where that is set, or ~/.cache/litevlm/inductor: a second start with the same model,
    shapes and torch loads its steps instead of compiling them again."""
    where = os.environ.get("LITEVLM_COMPILE_CACHE") or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = Path(where) if where else Path.home() / ".cache" / "litevlm" / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    return path


def compiles() -> bool:
    """Whether a CUDA backend compiles its prefill steps (one compile of one decoder layer per length bucket and
    layer range, paid as setup): yes, unless LITEVLM_CUDA_COMPILE=0, which runs them eagerly (still pinned to a fused
    kernel; the decode, verification and draft steps are replayed graphs either way)."""
    return os.environ.get("LITEVLM_CUDA_COMPILE", "1") not in ("0", "false", "no", "off")
