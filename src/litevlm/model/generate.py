"""Generation over the static KV cache: the prefill stage, one decode step, and the decoding loop.

Prefill writes a prompt's K/V into slots 0..T-1 (positions may skip, as after token pruning).
`prefill_prompt` is the stage in one call: plain, compiled per length bucket (`BucketPrefill`, the GPU fast
path), pruned inside the decoder where a selection hook chooses the tokens to keep after layer K
(`pruned_prefill`: FastV, the TokenSelector sharing layer 0), and with an answer opening verified in the same
pass. `decode_step` appends one token attending over the live prefix only, which is fastest eagerly on the
CPU; `decode_step_static` is the same step with fixed shapes (mask over the whole cache, position and
slot as tensors), which `GraphedDecodeStep` captures once as a CUDA graph and replays for every token.
`stream_decode` yields each token as it is made (speculative decoding: `litevlm.spec.decode`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from litevlm.errors import LiteVLMError
from litevlm.model.lm import linear
from litevlm.select.tokens import fastv_pruning


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


class Prefilled(NamedTuple):
    """A prompt in the cache at slots 0..T'-1 (all of it, or the tokens kept where it was pruned inside the decoder):
    what decoding, plain or speculative, continues from."""

    logits: torch.Tensor | None  # (B, V) at the last prompt token; None where an opening gave the first tokens
    hidden: torch.Tensor  # (B, T', C) final hidden states of the cached prompt tokens
    embeds: torch.Tensor  # (B, T', C) their input embeddings
    positions: torch.Tensor  # (B, T') their RoPE positions (the last + 1 is the first generated token's)
    opened: Opened | None = None  # an answer opening verified with the prompt (greedy speculative decoding)


# ---------------------------------------------------------------------------------------------
# Answer openings verified inside the prefill (the tables: `litevlm.spec.openings`)
# ---------------------------------------------------------------------------------------------


def opening_inputs(opening, prompt_len: int, next_position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An opening trie (`litevlm.spec.openings.Opening`) appended to a prompt of `prompt_len` tokens (cache slots
    0..T-1, the nodes at T..T+N-1): the node positions (N,) and their rows of the attention mask (N, T + N): each
    node sees the prompt, itself and its ancestors (the prompt's own rows stay causal)."""
    t, n = prompt_len, len(opening)
    tail = torch.ones(n, t + n, dtype=torch.bool, device=device)
    tail[:, t:] = opening.mask.to(device)
    return next_position + opening.depth.to(device), tail


@dataclass
class Opened:
    """An opening verified with its prompt: the tokens emitted (the prompt's next token, then one after each accepted
    node) and the accepted nodes' post-norm hidden states (a, C), their K/V already moved to the slots after the
    prompt's."""

    emitted: list[int]
    hidden: torch.Tensor

    @property
    def accepted(self) -> int:
        return self.hidden.shape[0]


def verify_opening(model, opening, rows: torch.Tensor, prompt_len: int, eos_id: int | None, limit: int) -> Opened:
    """Greedy acceptance of a trie run with a prompt of `prompt_len` cached tokens: rows (1 + N, C) = the prompt's last
    post-norm hidden state, then the N nodes' (cache slots prompt_len..); the accepted nodes' K/V are moved to slots
    prompt_len, prompt_len + 1, ..."""
    logits = linear(rows, model.lm_head)  # (1 + N, V)
    path, emitted = accept_opening(opening, int(logits[0].argmax()), logits[1:], eos_id, limit)
    if path != list(range(len(path))):
        model.language_model.commit(torch.tensor(path, device=rows.device) + prompt_len, prompt_len)
    return Opened(emitted, rows[1 + torch.tensor(path, dtype=torch.long, device=rows.device)])


def accept_opening(
    opening, first: int, node_logits: torch.Tensor, eos_id: int | None, limit: int
) -> tuple[list[int], list[int]]:
    """Greedy acceptance of a trie verified with the prompt: first = the prompt's own next token (its argmax),
    node_logits (N, V) the target's logits at the nodes -> (the accepted nodes in order, the emitted tokens: `first`,
    then the argmax after each accepted node; at most `limit` tokens, stopping at EOS). A node is accepted when its
    token is the token emitted before it and its parent was accepted (the roots: its first token)."""
    emitted, path = [first], []
    children = [i for i in range(len(opening)) if int(opening.parents[i]) < 0]
    predicted = node_logits.argmax(-1).tolist()
    tokens = opening.tokens.tolist()
    parents = opening.parents.tolist()
    while len(emitted) < limit and (eos_id is None or emitted[-1] != eos_id):
        match = next((i for i in children if tokens[i] == emitted[-1]), None)
        if match is None:
            break
        path.append(match)
        emitted.append(predicted[match])
        children = [i for i in range(len(opening)) if parents[i] == match]
    return path, emitted


def prefill_with_opening(
    model, embeds: torch.Tensor, positions: torch.Tensor, opening, eos_id: int | None, limit: int
) -> Prefilled:
    """The prompt (1, T, C) and the opening trie's N nodes in one target pass (prompt at cache slots 0..T-1, nodes
    at T..T+N-1 under the trie mask), then greedy acceptance (`verify_opening`) of at most `limit` tokens."""
    lm = model.language_model
    t, n, dev = embeds.shape[1], len(opening), embeds.device
    node_pos, tail = opening_inputs(opening, t, int(positions[0, -1]) + 1, dev)
    x = torch.cat([embeds, lm.embed_tokens(opening.tokens.to(dev))[None]], 1)
    pos = torch.cat([positions[0], node_pos])[None]
    h = lm(x, pos, slots=torch.arange(t + n, device=dev), kv_len=t + n, tree_tail=tail)[0]  # (T + N, C)
    opened = verify_opening(model, opening, h[t - 1 :], t, eos_id, limit)
    return Prefilled(None, h[None, :t], embeds, positions, opened)


# ---------------------------------------------------------------------------------------------
# Pruning inside the decoder: FastV, the TokenSelector sharing decoder layer 0
# ---------------------------------------------------------------------------------------------


class PrunedPrefill(NamedTuple):
    logits: torch.Tensor  # (B, V) at the last prompt token
    kept_count: int  # T': every layer's cache holds slots 0..T'-1; decoding writes slot T' + i
    kept_index: torch.Tensor  # (T',) prompt indices kept
    next_position: int  # RoPE position of the first generated token: the unpruned prompt length
    hidden: torch.Tensor  # (B, T', C) final hidden states of the kept tokens
    opened: Opened | None = None  # where an answer opening was verified with the prompt

    def prefilled(self, embeds: torch.Tensor, positions: torch.Tensor) -> Prefilled:
        """What decoding continues from, given the unpruned embeds and positions."""
        return Prefilled(
            self.logits, self.hidden, embeds[:, self.kept_index], positions[:, self.kept_index], self.opened
        )


@torch.no_grad()
def pruned_prefill(
    model,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    pruning,
    timer: StageTimer | None = None,
    opening=None,
    eos_id: int | None = None,
    limit: int = 0,
) -> PrunedPrefill:
    """Prefill that prunes the prompt inside the decoder (batch 1): layers [0, K) on the whole prompt, the selection
    hook chooses from their output which prompt tokens to keep, layers [K, L) run on the kept tokens.

    pruning: the hook (`litevlm.select.tokens.Pruning`): `layer` K, `keep(x)` -> the kept prompt indices (T',)
    ascending, from x (1, T, C), the input of layer K; its choice is timed as `stage`, the decoder layers as
    "prefill". The cache of layers [0, K) is then COMPACTED to the kept tokens (`litevlm.select.tokens` explains
    why), so decoding continues with `decode_step(model, tok, result.next_position + i, result.kept_count + i)`.
    opening: an answer-opening trie verified with the kept prompt, greedily, emitting at most `limit` tokens (until
    `eos_id`): its nodes run layers [0, K) over the kept tokens once the cache is compacted, then join the kept tokens
    in layers [K, L) under the trie mask; `opened` holds the outcome.
    """
    lm = model.language_model
    n_layers, k = len(lm.layers), pruning.layer
    if not 1 <= k < n_layers:
        raise LiteVLMError(f"FastV K must be in 1..{n_layers - 1} for a {n_layers}-layer decoder; got {k}")
    if embeds.shape[0] != 1:
        raise LiteVLMError("pruned prefill runs one prompt at a time (batch 1)")
    t = embeds.shape[1]
    check_prompt_fits(lm, t)
    timer = timer or StageTimer(embeds.device)
    dev = embeds.device
    next_position = int(positions[0, -1]) + 1
    with timer("prefill"):
        # mask=None from slot 0 is plain causal attention: the fused kernel's fast path
        x = lm(embeds, positions, slots=torch.arange(t, device=dev), mask=None, kv_len=t, end_layer=k)
    with timer(pruning.stage):
        kept = pruning.keep(x)
    with timer("prefill"):
        n = kept.numel()
        for layer in lm.layers[:k]:  # compact layers < k to the kept tokens, slots 0..n-1
            layer.self_attn.kv_cache.commit(kept, 0)
        if opening is None or n + len(opening) > lm.cache_len:  # an opening is verified only where the cache has room
            hidden = lm(
                x[:, kept], positions[:, kept], slots=torch.arange(n, device=dev), mask=None, kv_len=n, start_layer=k
            )
            return PrunedPrefill(linear(hidden[:, -1], model.lm_head), n, kept, next_position, hidden)
        m = len(opening)
        node_pos, tail = opening_inputs(opening, n, next_position, dev)
        slots = torch.arange(n + m, device=dev)
        nodes = lm(
            lm.embed_tokens(opening.tokens.to(dev))[None],
            node_pos[None],
            slots=slots[n:],
            mask=tail[None, None],
            kv_len=n + m,
            end_layer=k,
        )  # layers [0, k) for the nodes, over the compacted prompt
        hidden = lm(
            torch.cat([x[:, kept], nodes], 1),
            torch.cat([positions[:, kept], node_pos[None]], 1),
            slots=slots,
            kv_len=n + m,
            start_layer=k,
            tree_tail=tail,
        )
        opened = verify_opening(model, opening, hidden[0, n - 1 :], n, eos_id, limit)
        return PrunedPrefill(linear(hidden[:, n - 1], model.lm_head), n, kept, next_position, hidden[:, :n], opened)


def fastv_prefill(
    model, embeds, positions, view_spans, k: int, keep_ratio: float, min_per_view: int = 0, timer=None
) -> PrunedPrefill:
    """FastV prefill (batch 1): rank at layer k by the last prompt token's attention (`fastv_pruning`). min_per_view=0
    is FastV's own global top-k; keep_ratio=1 reproduces plain prefill."""
    return pruned_prefill(
        model, embeds, positions, fastv_pruning(model, positions, view_spans, k, keep_ratio, min_per_view), timer
    )


def selector_prefill(
    model,
    selector,
    embeds,
    positions,
    view_spans,
    keep_ratio: float | None = None,
    min_per_view: int | None = None,
    question: str | None = None,
    timer: StageTimer | None = None,
    opening=None,
    eos_id: int | None = None,
    limit: int = 0,
) -> PrunedPrefill:
    """The TokenSelector sharing decoder layer 0 selecting inside the decoder (batch 1): layer 0 runs once on the
    whole prompt, the selector's head ranks from its output (timed as "select_tokens"), layers 1.. run on the kept
    tokens, which are those `TokenSelector.select` keeps. opening, eos_id, limit: as in `pruned_prefill`."""
    pruning = selector.pruning(model, positions, view_spans, keep_ratio, min_per_view, question)
    return pruned_prefill(model, embeds, positions, pruning, timer, opening, eos_id, limit)


@torch.no_grad()
def prefill_prompt(
    model,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    timer: StageTimer | None = None,
    *,
    pruning=None,
    opening=None,
    eos_id: int | None = None,
    limit: int = 0,
    buckets: BucketPrefill | None = None,
) -> Prefilled:
    """The prefill stage in one call: the prompt (1, T, C) into the cache, timed as "prefill".

    pruning: prune inside the decoder with this selection hook (`pruned_prefill`), an opening verified with the kept
    tokens. buckets: else, on the GPU fast path, the compiled prefill of the prompt's length bucket (a new bucket is
    compiled first, outside the timer, its time in `buckets.compile_ms`). opening: else, an answer-opening trie
    verified in the prompt's pass (`prefill_with_opening`, greedy), emitting at most `limit` tokens.
    """
    timer = timer or StageTimer(embeds.device)
    if pruning is not None:
        pre = pruned_prefill(model, embeds, positions, pruning, timer, opening, eos_id, limit)
        return pre.prefilled(embeds, positions)
    t = embeds.shape[1]
    if buckets is not None and embeds.shape[0] == 1:
        if buckets.bucket(t) not in buckets.compiled:
            buckets(embeds, positions)
        with timer("prefill"):
            logits, hidden = buckets(embeds, positions)
        return Prefilled(logits, hidden, embeds, positions)
    with timer("prefill"):
        if opening is not None and 0 < len(opening) <= model.language_model.cache_len - t:
            return prefill_with_opening(model, embeds, positions, opening, eos_id, limit)
        logits, hidden = prefill(model, embeds, positions)
        return Prefilled(logits, hidden, embeds, positions)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


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
    """Run a token stream (`stream_decode`, `litevlm.spec.decode.stream_speculative`) to its end -> its `Generation`."""
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
    """Plain autoregressive decoding for batch 1: prefill, then one token per step until EOS (`stream_decode`).

    step: a `GraphedDecodeStep` (or any callable (token (1, 1), position, slot) -> logits (1, V)) to
    run each decode step instead of the eager `decode_step`.
    prefilled: the prompt is in the cache already (its prefill timed by the caller); embeds and
    positions are then ignored.
    """
    timer = timer or StageTimer(embeds.device)
    if prefilled is None:
        check_room(model, embeds.shape[1], max_new_tokens)
        prefilled = prefill_prompt(model, embeds, positions, timer)
    return drain(stream_decode(model, prefilled, max_new_tokens, eos_id, temperature, top_p, generator, timer, step))


@torch.no_grad()
def stream_decode(
    model,
    prefilled: Prefilled,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator=None,
    timer: StageTimer | None = None,
    step=None,
) -> Iterator[list[int]]:
    """Plain autoregressive decoding after a prefill (batch 1): one token per step until EOS, each yielded (as a
    one-token list) as soon as it is made; returns the `Generation`.

    The first token is sampled from the prefill's logits (timed as "prefill"), each next one by a decode step
    ("decode"; `step` as in `generate`). Stages are timed between yields only: what the consumer does with a token
    is not decode time. Closing the stream stops it before the next step.
    """
    embeds, positions = prefilled.embeds, prefilled.positions
    timer = timer or StageTimer(embeds.device)
    t = embeds.shape[1]
    check_room(model, t, max_new_tokens)
    with timer("prefill"):
        tok = sample_token(prefilled.logits, temperature, top_p, generator)
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


@torch.no_grad()
def fastv_generate(
    model,
    embeds,
    positions,
    view_spans,
    k: int,
    keep_ratio: float,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator=None,
    timer: StageTimer | None = None,
    min_per_view: int = 0,
) -> Generation:
    """`generate` with FastV's prefill: same decoding, `prompt_len` = kept tokens."""
    timer = timer or StageTimer(embeds.device)
    check_room(model, embeds.shape[1], max_new_tokens)
    pre = fastv_prefill(model, embeds, positions, view_spans, k, keep_ratio, min_per_view, timer)
    return drain(
        stream_decode(
            model, pre.prefilled(embeds, positions), max_new_tokens, eos_id, temperature, top_p, generator, timer
        )
    )
