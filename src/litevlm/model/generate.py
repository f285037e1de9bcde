"""Prefill, one decode step and the generation loop over the static KV cache.

Prefill writes a prompt's K/V into slots 0..T-1 (positions may skip, as after token pruning);
`decode_step` appends one token attending over the live prefix only, which is fastest eagerly on the
CPU; `decode_step_static` is the same step with fixed shapes (mask over the whole cache, position and
slot as tensors), which `GraphedDecodeStep` captures once as a CUDA graph and replays for every token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from litevlm.errors import LiteVLMError
from litevlm.model.lm import linear


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class StageTimer:
    """Wall milliseconds per named stage, with the device synchronised at both boundaries."""

    def __init__(self, device):
        self.device = device
        self.ms: dict[str, float] = {}

    def __call__(self, name: str):
        return _Stage(self, name)


class _Stage:
    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        sync(self.timer.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        sync(self.timer.device)
        self.timer.ms[self.name] = self.timer.ms.get(self.name, 0.0) + (time.perf_counter() - self.t0) * 1e3


def causal_mask(kv_len: int, start: int, n: int, device) -> torch.Tensor:
    """(1, 1, n, kv_len) boolean: new tokens at slots start..start+n-1 see every slot up to their own."""
    rows = torch.arange(start, start + n, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None]


@torch.no_grad()
def check_prompt_fits(lm, t: int) -> None:
    """A clear error where a prompt of t tokens does not fit the decoder's KV cache."""
    if t > lm.cache_len:
        raise LiteVLMError(
            f"the prompt has {t} tokens but the KV cache holds {lm.cache_len}; shorten the prompt or raise max_len"
        )


def check_room(model, t: int, max_new_tokens: int) -> None:
    """A clear error where a prompt of t tokens and an answer of max_new_tokens do not fit the KV cache."""
    cap = model.language_model.cache_len
    if t + max_new_tokens > cap:
        raise LiteVLMError(f"prompt ({t} tokens) + max_new_tokens ({max_new_tokens}) exceeds the KV cache ({cap})")


def prefill(model, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompt (B, T, C) into cache slots 0..T-1; return (last logits (B, V), hidden (B, T, C))."""
    lm = model.language_model
    t = embeds.shape[1]
    check_prompt_fits(lm, t)
    slots = torch.arange(t, device=embeds.device)
    hidden = lm(embeds, positions, slots=slots, mask=None, kv_len=t)  # causal over slots 0..t-1
    return linear(hidden[:, -1], model.lm_head), hidden


PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def _bucket_forward(
    model, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, length: int
) -> torch.Tensor:
    return model.language_model(embeds, positions, slots=slots, mask=None, kv_len=length)


class BucketPrefill:
    """Prefill at a few fixed prompt lengths, each compiled once (`torch.compile`, the GPU fast path).

    A prompt of T tokens is padded to the smallest bucket B >= T (or to the cache's length, the last bucket). The
    padding rows come after the prompt, so causal attention keeps them out of every prompt row; their K/V land in
    cache slots T..B-1, which decoding overwrites slot by slot and never attends to before writing them (every
    decode and verification attends only up to its own slots). One compiled graph per bucket instead of one per
    prompt length. `compile_ms` sums the first call of each bucket (its compilation), reported apart.
    compile=False runs the same padded forward eagerly (what the CPU tests check).
    """

    def __init__(self, model, buckets=PREFILL_BUCKETS, compile: bool = True):
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self.fn = torch.compile(_bucket_forward, dynamic=False) if compile else _bucket_forward
        self.compiled: set[int] = set()
        self.compile_ms = 0.0

    def bucket(self, t: int) -> int:
        lm = self.model.language_model
        check_prompt_fits(lm, t)
        return min(next((b for b in self.buckets if b >= t), lm.cache_len), lm.cache_len)

    @torch.no_grad()
    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill(model, embeds, positions)` for one prompt (1, T, C): (last logits (1, V), hidden (1, T, C))."""
        if embeds.shape[0] != 1:
            raise LiteVLMError(f"bucketed prefill runs one prompt at a time; got a batch of {embeds.shape[0]}")
        t = embeds.shape[1]
        b = self.bucket(t)
        pad = b - t
        padded = torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[2])], 1)
        padded_pos = torch.cat(
            [positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)[None]], 1
        )
        slots = torch.arange(b, device=embeds.device)
        first = b not in self.compiled
        t0 = time.perf_counter()
        hidden = self.fn(self.model, padded, padded_pos, slots, b)[:, :t]
        if first:
            sync(embeds.device)
            self.compile_ms += (time.perf_counter() - t0) * 1e3
            self.compiled.add(b)
        return linear(hidden[:, -1], self.model.lm_head), hidden


class Prefilled(NamedTuple):
    """A prompt already in the cache at slots 0..T'-1, e.g. one pruned inside the decoder (FastV, the
    TokenSelector sharing decoder layer 0): what `generate` and speculative decoding continue from."""

    logits: torch.Tensor  # (B, V) at the last prompt token
    hidden: torch.Tensor  # (B, T', C) final hidden states of the cached prompt tokens
    embeds: torch.Tensor  # (B, T', C) their input embeddings
    positions: torch.Tensor  # (B, T') their RoPE positions (the last + 1 is the first generated token's)
    opened: object = (
        None  # `litevlm.spec.openings.Opened`: an answer opening verified with the prompt (greedy speculative)
    )


@torch.no_grad()
def decode_step(model, token: torch.Tensor, position: int, slot: int, plan=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (B, 1) at RoPE `position`, written at cache `slot`; returns (logits (B, V), hidden (B, 1, C)).
    plan: `model.language_model.step_plan()`, made once per generation (the CPU step)."""
    lm = model.language_model
    dev = token.device
    if token.shape[0] == 1 and plan is not None:  # one sequence on the CPU: the whole step in one call
        fused = lm.fast_decode(token.view(1), position, slot, model.lm_head, plan)
        if fused is not None:
            return fused[0], fused[1][None]
    if token.shape[0] == 1:  # the CPU step's layers (None where they do not apply)
        h = lm.fast_forward(lm.embed_tokens(token[0]), torch.tensor([position], device=dev), slot, plan=plan)
        if h is not None:
            return linear(h, model.lm_head), h[None]
    pos = torch.full_like(token, position)
    hidden = lm(lm.embed_tokens(token), pos, slots=torch.tensor([slot], device=dev), kv_len=slot + 1)
    return linear(hidden[:, -1], model.lm_head), hidden


@torch.no_grad()
def decode_step_static(model, token: torch.Tensor, position: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`decode_step` with fixed shapes and no host values: token (1, 1), position (1, 1) and slot (1,) are
    tensors and attention covers the whole cache under a mask, so `torch.compile(mode="reduce-overhead")`
    captures one graph for every step (a CUDA graph on a GPU). Returns logits (1, V)."""
    lm = model.language_model
    mask = (torch.arange(lm.cache_len, device=token.device) <= slot)[None, None, None]  # (1, 1, 1, S)
    hidden = lm(lm.embed_tokens(token), position, slots=slot, mask=mask, kv_len=None)
    return model.lm_head(hidden[:, -1])


def capture_cuda_graph(fn, device, warmup: int = 3) -> tuple:
    """fn() run `warmup` times off the default stream (as capture requires), then captured as one CUDA graph, all
    without autograd -> (the graph, fn's outputs: the tensors each replay rewrites, capture milliseconds)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    torch.cuda.synchronize(device)
    return graph, out, (time.perf_counter() - t0) * 1e3


class GraphedDecodeStep:
    """`decode_step_static` captured as one CUDA graph over the model's KV cache, replayed per token.

    A decode step of a small model on a GPU is a few hundred kernel launches whose launch cost
    exceeds their work; replaying them as one graph removes that. The graph reads its inputs from
    static tensors and the cache in place, so it stays valid until the cache is re-allocated
    (`setup_cache`), which `valid_for` detects. Capturing writes scratch K/V at slot 0, which the next
    prefill overwrites. `capture_ms` is the one-off cost, reported apart from measurements.
    """

    def __init__(self, model, warmup: int = 3):
        if model.device.type != "cuda":
            raise LiteVLMError("CUDA graphs need the model on a CUDA device")
        self.model = model
        self.cache = model.language_model.layers[0].self_attn.kv_cache.k
        dev = model.device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph, self.logits, self.capture_ms = capture_cuda_graph(
            lambda: decode_step_static(model, self.token, self.position, self.slot), dev, warmup
        )

    def valid_for(self, model) -> bool:
        return model is self.model and model.language_model.layers[0].self_attn.kv_cache.k is self.cache

    def __call__(self, token: torch.Tensor, position: int, slot: int) -> torch.Tensor:
        """Same contract as `decode_step`'s logits: token (1, 1) -> logits (1, V), a view into the graph's output."""
        self.token.copy_(token.view(1, 1))
        self.position.fill_(position)
        self.slot.fill_(slot)
        self.graph.replay()
        return self.logits


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> torch.Tensor:
    """Greedy when temperature == 0, else temperature + nucleus sampling. logits (B, V) -> (B,)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: list[int]
    prompt_len: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    accept_lengths: list[int] = field(default_factory=list)  # tokens per decode-stage target pass (speculative)
    opened: int = 0  # tokens accepted from an answer opening inside the prefill (speculative), before any cycle


def drain(steps):
    """Run a token stream (`stream_generate`, `stream_speculative`) to its end -> the `Generation` it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


@torch.no_grad()
def generate(
    model,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator=None,
    timer: StageTimer | None = None,
    step=None,
    prefilled: Prefilled | None = None,
) -> Generation:
    """Plain autoregressive decoding for batch 1 (`stream_generate` run to its end)."""
    return drain(
        stream_generate(
            model, embeds, positions, max_new_tokens, eos_id, temperature, top_p, generator, timer, step, prefilled
        )
    )


@torch.no_grad()
def stream_generate(
    model,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator=None,
    timer: StageTimer | None = None,
    step=None,
    prefilled: Prefilled | None = None,
) -> Iterator[list[int]]:
    """Plain autoregressive decoding for batch 1: prefill, then one token per step until EOS, each token yielded
    (as a one-token list) as soon as it is made; returns the `Generation`.

    step: a `GraphedDecodeStep` (or any callable (token (1, 1), position, slot) -> logits (1, V)) to
    run each decode step instead of the eager `decode_step`.
    prefilled: the prompt is in the cache already (its prefill timed by the caller); embeds and
    positions are then ignored. The stages are timed between yields only: what the consumer does with a token
    is not decode time. Closing the stream stops it before the next step.
    """
    timer = timer or StageTimer(embeds.device)
    if prefilled is not None:
        embeds, positions = prefilled.embeds, prefilled.positions
    t = embeds.shape[1]
    check_room(model, t, max_new_tokens)
    with timer("prefill"):
        logits = prefill(model, embeds, positions)[0] if prefilled is None else prefilled.logits
        tok = sample_token(logits, temperature, top_p, generator)
    out = [int(tok)]
    yield out[-1:]
    next_pos = int(positions[0, -1]) + 1
    with timer("decode"):
        plan = model.language_model.step_plan() if step is None and embeds.shape[0] == 1 else None
    for i in range(max_new_tokens - 1):
        if eos_id is not None and out[-1] == eos_id:
            break
        with timer("decode"):
            if step is None:
                logits, _ = decode_step(model, tok.view(1, 1), next_pos + i, t + i, plan)
            else:
                logits = step(tok.view(1, 1), next_pos + i, t + i)
            tok = sample_token(logits, temperature, top_p, generator)
            out.append(int(tok))
        yield out[-1:]
    return Generation(out, t, dict(timer.ms))
