"""Generation over the static KV cache: the prefill stage, one decode step, and the decoding loop.

Prefill writes a prompt's K/V into slots 0..T-1 (positions may skip, as after token pruning).
`prefill_prompt` is the stage in one call: plain, pruned inside the decoder where a selection hook chooses the
tokens to keep after layer K (`pruned_prefill`: FastV, the TokenSelector sharing layer 0), and with an answer
opening verified in the same pass. Every operation runs on the model's execution backend
(`litevlm.model.backend`: the modules, the native CPU steps, or CUDA graphs), chosen once by its caller.
`stream_decode` yields each token as it is made (speculative decoding: `litevlm.spec.decode`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from litevlm.errors import LiteVLMError
from litevlm.model.backend import Sampling
from litevlm.model.layers import linear
from litevlm.select.tokens import fastv_pruning


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class StageTimer:
    """Milliseconds per named stage (stages may nest: "draft" and "verify" inside "decode").

    On the CPU each boundary reads the wall clock. On a GPU each boundary records a CUDA event on the current stream,
    and nothing waits for the device: the events are read when `ms` is first asked for after a stage ended (at the
    end of an answer), one wait for the device then. The stages' times are the device's, between the points where
    the host queued each boundary.

    setup: a callable giving the backend's setup so far in ms (`setup_ms`): setup made inside a stage (a CUDA
    backend compiling a new prefill bucket, capturing a draft chain's first graph) is left out of the stage, and
    summed in `setup_ms` instead."""

    def __init__(self, device, setup=None):
        self.device = torch.device(device)
        self.setup = setup
        self.events = self.device.type == "cuda"
        self._ms: dict[str, float] = {}
        self._pending: list[tuple[str, object, object, float]] = []  # (stage, start, end, setup ms inside)
        self.setup_ms = 0.0
        self.depth = 0  # stages entered and not yet left

    def __call__(self, name: str):
        return _Stage(self, name)

    def mark(self):
        """A point in time on this timer's clock: an event recorded on the current CUDA stream, or the wall clock."""
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start, end, setup: float) -> None:
        if not self.depth:  # a nested stage's setup is its outer stage's too: counted once
            self.setup_ms += setup
        if self.events:
            self._pending.append((name, start, end, setup))
        else:
            self._ms[name] = self._ms.get(name, 0.0) + max(0.0, (end - start) * 1e3 - setup)

    @property
    def ms(self) -> dict[str, float]:
        """The stages' summed times so far (the device waited for once here, where events are pending)."""
        if self._pending:
            self._pending[-1][2].synchronize()  # the latest boundary: every earlier one has happened by then
            for name, start, end, setup in self._pending:
                self._ms[name] = self._ms.get(name, 0.0) + max(0.0, start.elapsed_time(end) - setup)
            self._pending.clear()
        return self._ms


class _Stage:
    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.setup0 = self.timer.setup() if self.timer.setup else 0.0
        self.timer.depth += 1
        self.start = self.timer.mark()

    def __exit__(self, *exc):
        end = self.timer.mark()
        self.timer.depth -= 1
        setup = (self.timer.setup() if self.timer.setup else 0.0) - self.setup0
        self.timer.add(self.name, self.start, end, setup)


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


def as_backend(target):
    """A backend for `target`: itself if it is one, else, for a library call on a bare model, the one
    `choose_backend("auto", model)` makes, except on a GPU: there the modules (a CUDA backend captures graphs into
    scratch slots of a cache made for it, work a pipeline does once, when it is built)."""
    from litevlm.model.backend import ModulesBackend, choose_backend

    if isinstance(target, ModulesBackend):
        return target
    return choose_backend("modules" if target.device.type == "cuda" else "auto", target)


def prefill(target, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompt (1, T, C) into cache slots 0..T-1; return (last logits (1, V), hidden (1, T, C)).
    target: a backend (`litevlm.model.backend`) or a model."""
    backend = as_backend(target)
    check_prompt_fits(backend.lm, embeds.shape[1])
    return backend.prefill(embeds, positions)


@torch.no_grad()
def decode_step(target, token: torch.Tensor, position: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (1, 1) at RoPE `position`, written at cache `slot`; returns (logits (1, V), hidden (1, 1, C))."""
    return as_backend(target).decode(token, position, slot)


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


def verify_opening(backend, opening, rows: torch.Tensor, prompt_len: int, eos_id: int | None, limit: int) -> Opened:
    """Greedy acceptance of a trie run with a prompt of `prompt_len` cached tokens: rows (1 + N, C) = the prompt's last
    post-norm hidden state, then the N nodes' (cache slots prompt_len..); the accepted nodes' K/V are moved to slots
    prompt_len, prompt_len + 1, ..."""
    logits = linear(rows, backend.model.lm_head)  # (1 + N, V)
    path, emitted = accept_opening(opening, int(logits[0].argmax()), logits[1:], eos_id, limit)
    if path != list(range(len(path))):
        backend.commit(torch.tensor(path, device=rows.device) + prompt_len, prompt_len)
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
    while len(emitted) < limit and emitted[-1] != eos_id:  # (no eos_id: never equal)
        match = next((i for i in children if tokens[i] == emitted[-1]), None)
        if match is None:
            break
        path.append(match)
        emitted.append(predicted[match])
        children = [i for i in range(len(opening)) if parents[i] == match]
    return path, emitted


def prefill_with_opening(
    backend, embeds: torch.Tensor, positions: torch.Tensor, opening, eos_id: int | None, limit: int
) -> Prefilled:
    """The prompt (1, T, C) and the opening trie's N nodes in one target pass (prompt at cache slots 0..T-1, nodes
    at T..T+N-1 under the trie mask), then greedy acceptance (`verify_opening`) of at most `limit` tokens."""
    lm = backend.lm
    t, dev = embeds.shape[1], embeds.device
    node_pos, tail = opening_inputs(opening, t, int(positions[0, -1]) + 1, dev)
    x = torch.cat([embeds, lm.embed_tokens(opening.tokens.to(dev))[None]], 1)
    pos = torch.cat([positions[0], node_pos])[None]
    h = backend.prompt(x, pos, tree_tail=tail)[0]  # (T + N, C)
    opened = verify_opening(backend, opening, h[t - 1 :], t, eos_id, limit)
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
    target,
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
    ascending, from x (1, T, C), the input of layer `reads` (K unless it says otherwise: FastV reads layer K - 1's);
    its choice is timed as `stage`, the decoder layers as "prefill". The cache of layers [0, K) is then COMPACTED to
    the kept tokens (`litevlm.select.tokens` explains why), so decoding continues with
    `decode_step(model, tok, result.next_position + i, result.kept_count + i)`.
    opening: an answer-opening trie verified with the kept prompt, greedily, emitting at most `limit` tokens (until
    `eos_id`): its nodes run layers [0, K) over the kept tokens once the cache is compacted, then join the kept tokens
    in layers [K, L) under the trie mask; `opened` holds the outcome.
    """
    backend = as_backend(target)
    model, lm = backend.model, backend.lm
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
    reads = k if pruning.reads is None else pruning.reads
    if not 0 <= reads <= k:
        raise LiteVLMError(f"a pruning before decoder layer {k} reads the input of a layer in 0..{k}; got {reads}")
    with timer("prefill"):  # causal from slot 0: the fused kernels' fast path
        x = backend.prompt(embeds, positions, end_layer=reads) if reads else embeds
    with timer(pruning.stage):
        kept = pruning.keep(x)
    if reads < k:
        with timer("prefill"):
            x = backend.prompt(x, positions, start_layer=reads, end_layer=k)
    with timer("prefill"):
        n = kept.numel()
        for layer in lm.layers[:k]:  # compact layers < k to the kept tokens, slots 0..n-1
            layer.self_attn.kv_cache.commit(kept, 0)
        if opening is None or n + len(opening) > lm.cache_len:  # an opening is verified only where the cache has room
            hidden = backend.prompt(x[:, kept], positions[:, kept], start_layer=k)
            return PrunedPrefill(linear(hidden[:, -1], model.lm_head), n, kept, next_position, hidden)
        m = len(opening)
        node_pos, tail = opening_inputs(opening, n, next_position, dev)
        node_embeds = lm.embed_tokens(opening.tokens.to(dev))[None]
        slots = torch.arange(n, n + m, device=dev)
        nodes = backend.tree_rows(node_embeds, node_pos[None], slots, tail, k)  # layers [0, k), over the kept prompt
        hidden = backend.prompt(
            torch.cat([x[:, kept], nodes], 1),
            torch.cat([positions[:, kept], node_pos[None]], 1),
            start_layer=k,
            tree_tail=tail,
        )
        opened = verify_opening(backend, opening, hidden[0, n - 1 :], n, eos_id, limit)
        return PrunedPrefill(linear(hidden[:, n - 1], model.lm_head), n, kept, next_position, hidden[:, :n], opened)


def fastv_prefill(
    target, embeds, positions, view_spans, k: int, keep_ratio: float, min_per_view: int = 0, timer=None
) -> PrunedPrefill:
    """FastV prefill (batch 1): cut before layer k, ranked by the last prompt token's attention at layer k - 1
    (`fastv_pruning`). min_per_view=0 is FastV's own global top-k; keep_ratio=1 reproduces plain prefill."""
    backend = as_backend(target)
    pruning = fastv_pruning(backend.model, positions, view_spans, k, keep_ratio, min_per_view)
    return pruned_prefill(backend, embeds, positions, pruning, timer)


def selector_prefill(
    target,
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
    backend = as_backend(target)
    pruning = selector.pruning(backend.model, positions, view_spans, keep_ratio, min_per_view, question)
    return pruned_prefill(backend, embeds, positions, pruning, timer, opening, eos_id, limit)


@torch.no_grad()
def prefill_prompt(
    target,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    timer: StageTimer | None = None,
    *,
    pruning=None,
    opening=None,
    eos_id: int | None = None,
    limit: int = 0,
) -> Prefilled:
    """The prefill stage in one call: the prompt (1, T, C) into the cache, timed as "prefill", on the backend
    `target` (or a model's, `as_backend`).

    pruning: prune inside the decoder with this selection hook (`pruned_prefill`), an opening verified with the kept
    tokens. opening: else, an answer-opening trie verified in the prompt's pass (`prefill_with_opening`, greedy),
    emitting at most `limit` tokens. Else the backend's prefill (compiled per length bucket on CUDA, a new bucket
    compiled first, outside the timer: `backend.setup_ms`).
    """
    backend = as_backend(target)
    timer = timer or StageTimer(embeds.device)
    if pruning is not None:
        pre = pruned_prefill(backend, embeds, positions, pruning, timer, opening, eos_id, limit)
        return pre.prefilled(embeds, positions)
    t = embeds.shape[1]
    check_prompt_fits(backend.lm, t)
    if opening is not None and 0 < len(opening) <= backend.lm.cache_len - t:
        with timer("prefill"):
            return prefill_with_opening(backend, embeds, positions, opening, eos_id, limit)
    backend.ready_prefill(t)  # a CUDA backend's new length bucket compiles here, outside the stage
    with timer("prefill"):
        logits, hidden = backend.prefill(embeds, positions)
        return Prefilled(logits, hidden, embeds, positions)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> torch.Tensor:
    """Greedy when temperature == 0, else temperature + nucleus sampling. logits (B, V) -> (B,)."""
    return Sampling(temperature=temperature, top_p=top_p, generator=generator).sample(logits)


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
    target,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator=None,
    timer: StageTimer | None = None,
    prefilled: Prefilled | None = None,
) -> Generation:
    """Plain autoregressive decoding for batch 1 on a backend (or a model's, `as_backend`): prefill, then one token
    per step until EOS (`stream_decode`). prefilled: the prompt is in the cache already (its prefill timed by the
    caller); embeds and positions are then ignored."""
    backend = as_backend(target)
    timer = timer or StageTimer(embeds.device)
    sampling = Sampling(max_new_tokens, eos_id, temperature, top_p, generator)
    if prefilled is None:
        check_room(backend.model, embeds.shape[1], max_new_tokens)
        prefilled = prefill_prompt(backend, embeds, positions, timer)
    return drain(stream_decode(backend, prefilled, sampling, timer))


@torch.no_grad()
def stream_decode(
    backend, prefilled: Prefilled, sampling: Sampling, timer: StageTimer | None = None
) -> Iterator[list[int]]:
    """Plain autoregressive decoding after a prefill (batch 1) on `backend`: one token per step until EOS, each
    yielded (as a one-token list) as soon as it is made; returns the `Generation`.

    The first token is sampled from the prefill's logits (timed as "prefill"), each next one by a decode step
    ("decode"). Stages are timed between yields only: what the consumer does with a token is not decode time.
    Closing the stream stops it before the next step.
    """
    embeds, positions = prefilled.embeds, prefilled.positions
    timer = timer or StageTimer(embeds.device)
    t = embeds.shape[1]
    n = sampling.max_new_tokens
    check_room(backend.model, t, n)
    with timer("prefill"):
        tok = sampling.sample(prefilled.logits)
    out = [int(tok)]
    yield out[-1:]
    next_pos = int(positions[0, -1]) + 1
    for i in range(n - 1):
        if sampling.ends(out[-1]):
            break
        with timer("decode"):
            logits, _ = backend.decode(tok.view(1, 1), next_pos + i, t + i)
            tok = sampling.sample(logits)
            out.append(int(tok))
        yield out[-1:]
    return Generation(out, t, dict(timer.ms))


@torch.no_grad()
def fastv_generate(
    target,
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
    backend = as_backend(target)
    timer = timer or StageTimer(embeds.device)
    check_room(backend.model, embeds.shape[1], max_new_tokens)
    pre = fastv_prefill(backend, embeds, positions, view_spans, k, keep_ratio, min_per_view, timer)
    sampling = Sampling(max_new_tokens, eos_id, temperature, top_p, generator)
    return drain(stream_decode(backend, pre.prefilled(embeds, positions), sampling, timer))
