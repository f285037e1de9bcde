"""Many answers decoding at once: one object per answer in flight (`Sequence`), one scheduler stepping them together
(`BatchDecoder`).

A sequence owns its caches: the target's (a `KVCache` per decoder layer) and its draft head's. Its prompt is
prefilled as for a single answer (view and token selection, pruning inside the decoder, answer openings: all per
request), into the caches the model holds at that moment; `admit` then takes those caches for the sequence and
gives the model a free set for the next prompt, so nothing is copied. Each `step` runs one decode step, or one
speculative cycle, for every sequence in flight:

- On the native CPU steps (`NativeBackend`), the rows of every sequence go through each product together, so a
  step reads the decoder's weights once for all of them: a plain decode step of B sequences is one call
  (`batch_decode`), and a greedy chain's speculative cycle is two, the draft side (each sequence's new pairs, then
  its chain, level by level with every live chain's row in one product) and the verification (every chain, with
  its acceptance). The products there sum each row as it would be summed alone, so every answer is exactly the one
  it gets at batch 1, whatever else is in the batch.
- Elsewhere (the modules, a tree or sampled speculation), a sequence steps alone, its caches swapped into the
  model for its turn: the same answers, without the shared weight reads.

Sequences join between steps (`admit`) and leave when finished or cancelled (`cancel`), their caches returned to
a pool for the next. The CUDA backend's graphs are captured on the model's own caches and are not swapped:
`BatchDecoder` refuses it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from litevlm.errors import LiteVLMError
from litevlm.model.backend import ModulesBackend, NativeBackend, Sampling
from litevlm.model.generate import Generation, Prefilled, StageTimer, check_room, stream_decode
from litevlm.model.kv_cache import KVCache
from litevlm.spec.decode import (
    draft_slots,
    emitted_of,
    first_pairs,
    first_tokens,
    lookup_guess,
    stream_speculative,
)
from litevlm.spec.tree import TreeConfig


@dataclass(eq=False)
class Sequence:
    """One answer in flight: its caches, how far it has come, and what it has made.

    L: tokens in its target cache (slots 0..L-1); the newest token (`out[-1]`, the root) is not cached yet. Its RoPE
    position is `next_pos + L - prompt_len`. Speculative sequences also carry the draft's pending pairs (`feats`,
    `nxt`, `pair_pos`: what the next cycle's extend takes in) and `done`, the pairs already in its draft cache."""

    caches: list[KVCache]
    draft_cache: KVCache | None
    sampling: Sampling
    timer: StageTimer
    prompt_len: int
    next_pos: int
    L: int
    out: list[int]
    stacked: bool  # stepped with the others in the native batched calls; else alone (`stream`)
    opened: int = 0
    accept: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)  # what the last step emitted
    finished: bool = False
    generation: Generation | None = None
    stream: Iterator[list[int]] | None = None  # a sequence that steps alone: its own token stream
    feats: torch.Tensor | None = None
    nxt: torch.Tensor | None = None
    pair_pos: torch.Tensor | None = None
    done: int = 0
    a: int = 1  # drafts the last cycle accepted
    looked: bool = False  # whether the last cycle verified a lookup chain
    tag: object = None  # the caller's (a request, a question index)

    @property
    def position(self) -> int:
        """The RoPE position of its newest token (the one the next step writes at slot L)."""
        return self.next_pos + self.L - self.prompt_len

    def ends(self) -> bool:
        return len(self.out) >= self.sampling.max_new_tokens or self.sampling.ends(self.out[-1])


def batch_refusal(backend) -> str:
    """Why `backend` cannot decode a batch, or "" where it can: the modules and the native steps can (each sequence's
    caches swapped in, or handed to the batched calls); a CUDA backend's graphs are captured on the model's caches."""
    name = getattr(backend, "name", type(backend).__name__)
    if not isinstance(backend, ModulesBackend) or name not in ("modules", "native"):
        return f"batched decoding runs on the modules or native backend, not {name}"
    return ""


class BatchDecoder:
    """Steps every admitted sequence together (see the module's docstring). backend: the pipeline's (modules or
    native); drafting: speculative decoding with the backend's draft head, on `tree`; max_batch: the most sequences
    in flight (`admit` refuses one more)."""

    def __init__(self, backend, *, drafting: bool, tree: TreeConfig = TreeConfig(), max_batch: int = 8):
        why = batch_refusal(backend)
        if why:
            raise LiteVLMError(why)
        if max_batch < 1:
            raise LiteVLMError(f"max_batch must be at least 1; got {max_batch}")
        if drafting and backend.drafter is None:
            raise LiteVLMError("speculative batched decoding needs a backend made with a draft head")
        self.backend, self.drafting, self.tree, self.max_batch = backend, drafting, tree, max_batch
        self.lm = backend.lm
        self.native = isinstance(backend, NativeBackend)
        self.seqs: list[Sequence] = []
        self._free: list[list[KVCache]] = []
        self._free_draft: list[KVCache] = []
        self.max_position = 0
        self.steps = 0  # steps run
        self.rows = 0  # sequences stepped, summed over the steps (occupancy = rows / steps)
        self.seconds = 0.0  # wall time inside `step`
        self.decoded = 0  # tokens the steps emitted (a prefill's first token and accepted openings are not counted)

    # -- sequences in and out ------------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self.seqs)

    @property
    def full(self) -> bool:
        return len(self.seqs) >= self.max_batch

    def _chain(self, sampling: Sampling) -> bool:
        t = self.tree
        return sampling.greedy and t.top_k == 1 and t.total_tokens == t.depth + 1

    def admit(self, prefilled: Prefilled, sampling: Sampling, timer: StageTimer | None = None, tag=None) -> Sequence:
        """A sequence for the prompt just prefilled into the model's caches: it takes those caches (the model gets a
        free set) and emits its first tokens (`Sequence.new`: the prefill's next token, and an accepted opening's)."""
        if self.full:
            raise LiteVLMError(f"the batch is full ({self.max_batch} sequences in flight)")
        embeds, positions = prefilled.embeds, prefilled.positions
        if embeds.shape[0] != 1:
            raise LiteVLMError(f"a sequence is one prompt; got a batch of {embeds.shape[0]}")
        t = embeds.shape[1]
        check_room(self.backend.model, t, sampling.max_new_tokens)
        timer = timer or StageTimer(embeds.device)
        caches = self._take_caches()
        next_pos = int(positions[0, -1]) + 1
        stacked = self.native and (not self.drafting or self._chain(sampling))
        seq = Sequence(caches, None, sampling, timer, t, next_pos, t, [], stacked, tag=tag)
        if self.drafting:
            seq.draft_cache = self._take_draft_cache(next_pos + sampling.max_new_tokens)
        if not stacked:
            seq.stream = self._alone(prefilled, sampling, timer)
            self._turn(seq)
            self.seqs.append(seq)
            return seq
        with timer("prefill"):
            opened = first_tokens(prefilled, sampling)
        seq.out = list(opened.emitted)
        seq.new = list(seq.out)
        seq.opened = opened.accepted
        if self.drafting:
            seq.feats, seq.nxt, seq.pair_pos = first_pairs(
                self.lm, self.backend.drafter.cfg.context, prefilled, opened, next_pos
            )
            seq.L = t + opened.accepted
        self.seqs.append(seq)
        if seq.ends():
            self._finish(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence now (cancelled, disconnected, past its deadline): its caches go back to the pool, and
        the others go on as they were."""
        if seq in self.seqs:
            self.seqs.remove(seq)
            self._release(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        if seq.generation is None:
            seq.generation = Generation(list(seq.out), seq.prompt_len, dict(seq.timer.ms), list(seq.accept), seq.opened)
        self.cancel(seq)

    # -- the caches ----------------------------------------------------------------------------
    def _take_caches(self) -> list[KVCache]:
        """The model's current caches (where the prompt was just written), replaced in the model by a free set."""
        mine = [layer.self_attn.kv_cache for layer in self.lm.layers]
        spare = self._free.pop() if self._free else [self._like(c) for c in mine]
        self._install(spare)
        return mine

    @staticmethod
    def _like(cache: KVCache, slots: int | None = None) -> KVCache:
        """A cache of one sequence shaped as `cache` (with `slots` slots where given)."""
        _, h, s, d = cache.k.shape
        return KVCache(1, h, slots or s, d, cache.k.dtype, cache.k.device)

    def _install(self, caches: list[KVCache]) -> None:
        for layer, cache in zip(self.lm.layers, caches):
            layer.self_attn.kv_cache = cache

    def _take_draft_cache(self, max_position: int) -> KVCache:
        need = draft_slots(self.lm.cache_len, self.tree)
        self.max_position = max(self.max_position, max_position + self.tree.depth + 1)
        # RoPE tables for every sequence in flight (and the head's own cache, which a sequence's is shaped as)
        self.backend.drafter.prepare(need, self.max_position)
        head = self._draft_attention().kv_cache
        while self._free_draft:
            cache = self._free_draft.pop()
            if cache.max_len >= need and cache.k.dtype == head.k.dtype:
                return cache
        return self._like(head, need)

    def _draft_attention(self):
        """The draft head's attention module, whose `kv_cache` is the sequence's in its turn."""
        drafter = self.backend.drafter
        return getattr(drafter, "head_module", drafter).layer.self_attn

    def _release(self, seq: Sequence) -> None:
        if seq.caches is not None:
            self._free.append(seq.caches)
            seq.caches = None
        if seq.draft_cache is not None:
            self._free_draft.append(seq.draft_cache)
            seq.draft_cache = None
        if seq.stream is not None:
            seq.stream.close()
            seq.stream = None

    # -- a sequence that steps alone: its stream, its caches swapped in for its turn ------------------------
    def _alone(self, prefilled: Prefilled, sampling: Sampling, timer: StageTimer) -> Iterator[list[int]]:
        if self.drafting:
            return stream_speculative(self.backend, prefilled, sampling, timer, self.tree)
        return stream_decode(self.backend, prefilled, sampling, timer)

    def _turn(self, seq: Sequence) -> None:
        """One step of a sequence that steps alone: its caches in the model (and its draft cache in the head) while
        its stream makes its next tokens."""
        staged = [layer.self_attn.kv_cache for layer in self.lm.layers]
        head = self._draft_attention() if self.drafting else None
        staged_draft = head.kv_cache if head is not None else None
        self._install(seq.caches)
        if head is not None:
            head.kv_cache = seq.draft_cache
        try:
            seq.new = next(seq.stream)
            seq.out.extend(seq.new)
        except StopIteration as stop:
            seq.new = []
            seq.generation = stop.value
            seq.out = list(stop.value.tokens)
            seq.accept, seq.opened = list(stop.value.accept_lengths), stop.value.opened
            seq.finished = True
        finally:
            if head is not None:
                seq.draft_cache = head.kv_cache  # `prepare` may have made it a larger one
                head.kv_cache = staged_draft
            self._install(staged)

    # -- one step for every sequence ------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One decode step or speculative cycle for every sequence in flight -> the sequences stepped, each with
        what it emitted (`new`); the finished ones have their `generation` and have left the batch."""
        seqs = list(self.seqs)
        if not seqs:
            return []
        start = time.perf_counter()
        self.steps += 1
        self.rows += len(seqs)
        stacked = [s for s in seqs if s.stacked]
        for s in seqs:
            s.new = []
        if stacked:
            t0 = time.perf_counter()
            if self.drafting:
                self._cycle(stacked)
            else:
                self._decode(stacked)
            ms = (time.perf_counter() - t0) * 1e3
            for s in stacked:  # each sequence waited the whole step
                s.timer.ms["decode"] = s.timer.ms.get("decode", 0.0) + ms
        for s in seqs:
            if not s.stacked:
                self._turn(s)
                if s.finished:
                    self.cancel(s)
            elif s.ends():
                self._finish(s)
        self.seconds += time.perf_counter() - start
        self.decoded += sum(len(s.new) for s in seqs)
        return seqs

    @property
    def occupancy(self) -> float:
        """Sequences in flight per step, on average over the steps run."""
        return self.rows / max(1, self.steps)

    def run(self) -> None:
        """Step until every sequence has finished."""
        while self.seqs:
            self.step()

    def _decode(self, seqs: list[Sequence]) -> None:
        """A plain decode step of every sequence, its newest token at slot L, in one native call."""
        dev = self.lm.embed_tokens.weight.device
        tokens = torch.tensor([s.out[-1] for s in seqs], device=dev)
        positions = torch.tensor([s.position for s in seqs], device=dev)
        slots = torch.tensor([s.L for s in seqs], device=dev)
        logits, _ = self.backend.batch_decode(tokens, positions, slots, [_kv(s.caches) for s in seqs])
        for i, s in enumerate(seqs):
            tok = int(s.sampling.sample(logits[i : i + 1]))
            s.out.append(tok)
            s.new = [tok]
            s.L += 1

    def _cycle(self, seqs: list[Sequence]) -> None:
        """A greedy chain's speculative cycle of every sequence: the draft side in one native call, the verification
        (with acceptance) in another. A sequence whose answer repeats itself verifies its lookup chain instead of a
        drafted one (`repeat_guess`), one with no room left for a chain verifies its root alone (a plain step)."""
        tree, cap = self.tree, self.lm.cache_len
        n_tree = tree.depth + 1
        dev = self.lm.embed_tokens.weight.device
        guesses, depths = [], []
        for s in seqs:
            guess = lookup_guess(s.out, tree.lookup, tree.depth, s.L + n_tree <= cap, s.a, s.looked)
            s.looked = bool(guess)
            guesses.append(guess)
            depths.append(0 if guess or s.L + n_tree > cap else tree.depth)
        counts = [s.feats.shape[0] for s in seqs]
        chains = self.backend.drafter.batch_cycle(
            torch.cat([s.feats for s in seqs]),
            torch.cat([s.nxt for s in seqs]),
            torch.cat([s.pair_pos for s in seqs]),
            torch.tensor(counts),
            torch.tensor([s.done for s in seqs]),
            torch.tensor([s.out[-1] for s in seqs]),
            torch.tensor([s.position for s in seqs]),
            torch.tensor(depths),
            tree.min_value,
            seqs[0].sampling.eos_id,
            [[[s.draft_cache.k, s.draft_cache.v]] for s in seqs],
        ).tolist()
        tokens = []
        for s, guess, chain, n in zip(seqs, guesses, chains, counts):
            s.done += n
            tokens.append([s.out[-1], *guess] if guess else [t for t in chain if t >= 0])
        runs, lengths, feats, nxt, pos = self.backend.batch_verify_chain(
            torch.tensor([t for chain in tokens for t in chain], device=dev),
            torch.tensor([len(c) for c in tokens]),
            torch.tensor([s.L for s in seqs]),
            torch.tensor([s.position for s in seqs]),
            [_kv(s.caches) for s in seqs],
        )
        runs, lengths = runs.tolist(), lengths.tolist()
        at = 0
        for s, n in zip(seqs, lengths):
            new = runs[at : at + n]
            s.feats, s.nxt, s.pair_pos = feats[at : at + n], nxt[at : at + n], pos[at : at + n]
            at += n
            emitted = emitted_of(new, len(s.out), s.sampling)
            s.out.extend(emitted)
            s.new = emitted
            s.accept.append(len(emitted))
            s.a = n - 1
            s.L += n


def _kv(caches: list[KVCache]) -> list[list[torch.Tensor]]:
    return [[c.k, c.v] for c in caches]
