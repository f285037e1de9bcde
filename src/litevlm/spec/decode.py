"""The speculative decoding loop: draft a tree, verify it in one target pass, commit, repeat.

EAGLE-2 (arXiv 2406.16858) around the static KV cache. Loop invariant at the top of a cycle: the
target cache holds the L committed tokens in slots 0..L-1; the root (the newest token, sampled
from the target) is not cached yet; the draft cache holds the pairs (f_j, x_{j+1}) for j < L once
the cycle's extend step has run. A cycle: extend the draft with the target's *true* features of
the tokens committed last cycle (its tree-step K/V are discarded, never reused), expand a tree,
verify root + tree at slots L..L+N-1, accept a path, move its K/V to slots L..L+a, and take the
bonus token as the next root. Greedy output equals plain greedy decoding token for token; sampled
output has the target's distribution.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from litevlm.errors import LiteVLMError
from litevlm.model.backend import Sampling
from litevlm.model.generate import (
    Generation,
    Opened,
    Prefilled,
    StageTimer,
    check_room,
    drain,
    prefill_prompt,
)
from litevlm.spec.openings import Opening
from litevlm.spec.tree import (
    TreeConfig,
    accept_sampled,
    chain_tree,
    commit_path,
    draft_tree,
    greedy_run,
    repeat_guess,
)


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    timer: StageTimer | None = None,
    tree: TreeConfig = TreeConfig(),
    prefilled: Prefilled | None = None,
    opening: Opening | None = None,
) -> Generation:
    """`litevlm.model.generate.generate` with EAGLE-2 speculation (batch 1): the prefill, then `stream_speculative`.

    target: a backend (`litevlm.model.backend`, made with this draft head) or a model, whose backend is then made
    here with `draft`. prefilled: the prompt is in the cache already (pruned inside the decoder, timed by the
    caller); embeds and positions are then ignored. opening: a trie of likely answer openings
    (`litevlm.spec.openings`) verified inside the prefill's forward pass (greedy decoding only; otherwise ignored);
    a `prefilled` prompt brings its own.
    """
    from litevlm.model.backend import ModulesBackend, choose_backend

    backend = target if isinstance(target, ModulesBackend) else choose_backend("auto", target, draft)
    if backend.drafter is None:
        raise LiteVLMError("speculative decoding needs a backend made with a draft head")
    timer = timer or StageTimer(embeds.device)
    sampling = Sampling(max_new_tokens, eos_id, temperature, top_p, generator)
    if prefilled is None:
        if embeds.shape[0] != 1:
            raise LiteVLMError(f"speculative decoding runs one sequence at a time; got a batch of {embeds.shape[0]}")
        check_room(backend.model, embeds.shape[1], max_new_tokens)
        opening = opening if sampling.greedy else None
        prefilled = prefill_prompt(
            backend, embeds, positions, timer, opening=opening, eos_id=eos_id, limit=max_new_tokens
        )
    return drain(stream_speculative(backend, prefilled, sampling, timer, tree))


@torch.no_grad()
def stream_speculative(
    backend,
    prefilled: Prefilled,
    sampling: Sampling,
    timer: StageTimer | None = None,
    tree: TreeConfig = TreeConfig(),
) -> Iterator[list[int]]:
    """EAGLE-2 speculative decoding after a prefill (batch 1) on `backend` and its draft head (`backend.drafter`):
    yields the tokens the prefill emits (its next token, and those an answer opening accepted with it,
    `prefilled.opened`, greedy only), then each cycle's accepted run; returns the `Generation`.

    Same stopping as `litevlm.model.generate.stream_decode` (after EOS, or at max_new_tokens), same timer stages
    ("prefill" for the first token, "decode"; plus "draft" and "verify" inside decode). `accept_lengths` holds the
    tokens emitted per target forward, bonus included (tau = their mean). A backend with `greedy_chain` runs a
    greedy chain's cycle as one call per side. Closing the stream stops it between cycles, where the caches are
    consistent.
    """
    embeds, positions = prefilled.embeds, prefilled.positions
    timer = timer or StageTimer(embeds.device)
    draft = backend.drafter
    lm = backend.lm
    b, t, _ = embeds.shape
    cap = lm.cache_len
    max_new_tokens, eos_id = sampling.max_new_tokens, sampling.eos_id
    if b != 1:
        raise LiteVLMError(f"speculative decoding runs one sequence at a time; got a batch of {b}")
    check_room(backend.model, t, max_new_tokens)
    n_tree = tree.total_tokens
    next_pos = int(positions[0, -1]) + 1  # RoPE position of the first generated token (slot t)
    with timer("prefill"):
        opened = first_tokens(prefilled, sampling)
        out = list(opened.emitted)
        root = torch.tensor(out[-1:], device=embeds.device)
    yield list(out)
    accept: list[int] = []

    def finished() -> bool:
        return len(out) >= max_new_tokens or sampling.ends(out[-1])

    with timer("decode"):
        if finished():  # the whole answer came with the prompt's pass
            return Generation(out, t, dict(timer.ms), accept, opened.accepted)
        draft.prepare(draft_slots(cap, tree), next_pos + max_new_tokens + tree.depth + 1)  # per generation: timed
        feats, nxt, pair_pos = first_pairs(lm, draft.cfg.context, prefilled, opened, next_pos)
        done, L = 0, t + opened.accepted  # pairs in the draft cache (its slots 0..done-1), tokens in the target cache
        # A greedy chain on the native backend runs each side of a cycle as one call (draft_cycle, verify_chain).
        chains = sampling.greedy and tree.top_k == 1 and n_tree == tree.depth + 1
        fused = backend.greedy_chain and chains
        lookup = tree.lookup if chains else 0
        looked, a = False, 1  # whether the last cycle verified a lookup chain; its accepted drafts
    while not finished():
        with timer("decode"):
            root_pos = next_pos + L - t
            # After a cycle that accepted no draft, or a lookup chain that was accepted, a chain from earlier in the
            # answer (`repeat_guess`), where there is one.
            guess = lookup_guess(out, lookup, tree.depth, L + n_tree <= cap, a, looked)
            looked = bool(guess)
            guessed = torch.tensor(out[-1:] + guess, device=embeds.device) if guess else None  # root, then the guess
            if L + n_tree > cap:  # no room for a tree: finish with plain steps (the cache is exact)
                logits, _ = backend.decode(root.view(1, 1), root_pos, L)
                root = sampling.sample(logits)
                new_list, a = [int(root)], 0
                new = root.view(1)
            elif fused:
                with timer("draft"):
                    if guess:  # the head takes in the new pairs all the same: its cache stays whole
                        draft.extend(feats, nxt, pair_pos, done, last_only=True)
                        chain = guessed
                    else:
                        chain = draft.draft_cycle(
                            feats, nxt, pair_pos, done, root, root_pos, tree.depth, tree.min_value, eos_id
                        )
                    done += feats.shape[0]
                with timer("verify"):  # a chain's accepted path is a prefix of it: nothing to commit
                    new, feats, nxt, pair_pos = backend.verify_chain(chain, L, root_pos)
                    new_list = new.tolist()  # the cycle's one host sync
                    a = len(new_list) - 1
            else:
                with timer("draft"):
                    h_root = draft.extend(feats, nxt, pair_pos, done, last_only=True)  # (1, C): predicted f_L
                    if guess:
                        tr = chain_tree(guessed)
                    else:
                        tr = draft_tree(draft, root, h_root, done + feats.shape[0], root_pos, tree, eos_id)  # scratch
                    done += feats.shape[0]
                with timer("verify"):
                    logits, hid = backend.verify(tr.tokens, tr.depth, tr.mask, L, root_pos)
                    if sampling.greedy:  # fixed shapes on the device: count, path and run read back together
                        count, path, new = greedy_run(tr, logits)
                        n = path.numel()
                        host = torch.cat([count.view(1), path, new]).tolist()  # the cycle's one host sync
                        a = host[0] - 1
                        path, new = path[: a + 1], new[: a + 1]
                        path_list, new_list = host[1 : a + 2], host[1 + n : 2 + n + a]
                    else:
                        path, bonus = accept_sampled(
                            tr, logits, sampling.temperature, sampling.top_p, sampling.generator
                        )
                        new = torch.cat([tr.tokens[path[1:]], bonus.view(1)])  # accepted drafts + bonus
                        host = torch.cat([path, new]).tolist()
                        a = path.numel() - 1
                        path_list, new_list = host[: a + 1], host[a + 1 :]
                    if path_list != list(range(a + 1)):  # a chain's path is already in place
                        commit_path(backend, path, L)
                    feats, nxt = hid[path], lm.embed_tokens(new)  # f_L..f_{L+a}, x_{L+1}..x_{L+a+1}
                    pair_pos = torch.arange(root_pos, root_pos + a + 1, device=embeds.device)
            emitted = emitted_of(new_list, len(out), sampling)
            out.extend(emitted)
            accept.append(len(emitted))
            L, root = L + a + 1, new[-1:]
        yield emitted
    return Generation(out, t, dict(timer.ms), accept, opened.accepted)


# ---------------------------------------------------------------------------------------------
# What a speculative answer's start and cycles share with a batch of them (`litevlm.batch`)
# ---------------------------------------------------------------------------------------------


def first_tokens(prefilled: Prefilled, sampling: Sampling) -> Opened:
    """What the prefill emits: the answer opening verified with it (greedy), else the token sampled from its logits,
    with no accepted node."""
    opened = prefilled.opened if sampling.greedy else None
    if opened is None:
        opened = Opened([int(sampling.sample(prefilled.logits))], prefilled.hidden[0, :0])
    return opened


def first_pairs(lm, context: int, prefilled: Prefilled, opened: Opened, next_pos: int):
    """The draft's first extend: the prompt's pairs (its last `context` when the draft is windowed, 0: all) and the
    opening tokens accepted with it; pair j = (f_j, what the target consumed at j+1), at the position of token j ->
    (features (m, C), next embeddings (m, C), positions (m,)). next_pos: the position after the prompt's last."""
    embeds, positions, hidden = prefilled.embeds, prefilled.positions, prefilled.hidden
    t, dev = embeds.shape[1], embeds.device
    c0 = max(0, t - context) if context else 0
    feats = torch.cat([hidden[0, c0:], opened.hidden])
    nxt = torch.cat([embeds[0, c0 + 1 :], lm.embed_tokens(torch.tensor(opened.emitted, device=dev))])
    pair_pos = torch.cat([positions[0, c0:], torch.arange(next_pos, next_pos + opened.accepted, device=dev)])
    return feats, nxt, pair_pos


def draft_slots(cache_len: int, tree: TreeConfig) -> int:
    """The draft cache an answer needs: a pair per committed token, then a tree's scratch entries."""
    return cache_len + (tree.depth - 1) * tree.top_k


def lookup_guess(out: list[int], lookup: int, depth: int, room: bool, accepted: int, looked: bool) -> list[int]:
    """The chain to verify instead of a drafted one (`repeat_guess`), where there is room for one and the last cycle
    accepted no draft, or accepted some of a lookup chain; else []."""
    ask = lookup and room and (accepted == 0 or (looked and accepted > 0))
    return repeat_guess(out, lookup, depth) if ask else []


def emitted_of(new: list[int], made: int, sampling: Sampling) -> list[int]:
    """A cycle's accepted run as emitted after `made` tokens: up to and including EOS, at most max_new_tokens in
    all."""
    emitted = []
    for tok in new:
        emitted.append(tok)
        if sampling.ends(tok) or made + len(emitted) >= sampling.max_new_tokens:
            break
    return emitted
