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
from litevlm.model.generate import (
    Generation,
    Opened,
    Prefilled,
    StageTimer,
    check_room,
    decode_step,
    drain,
    prefill_prompt,
    sample_token,
)
from litevlm.spec.openings import Opening
from litevlm.spec.tree import (
    TreeConfig,
    accept_greedy,
    accept_sampled,
    chain_tree,
    commit_path,
    draft_tree,
    verify_chain_greedy,
    verify_tree,
)


@torch.no_grad()
def speculative_generate(
    model,
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
    verify=None,
    opening: Opening | None = None,
) -> Generation:
    """`litevlm.model.generate.generate` with EAGLE-2 speculation (batch 1): the prefill, then `stream_speculative`.

    prefilled: the prompt is in the cache already (pruned inside the decoder, timed by the caller); embeds and
    positions are then ignored. opening: a trie of likely answer openings (`litevlm.spec.openings`) verified inside
    the prefill's forward pass (greedy decoding only; otherwise ignored); a `prefilled` prompt brings its own.
    """
    timer = timer or StageTimer(embeds.device)
    if prefilled is None:
        if embeds.shape[0] != 1:
            raise LiteVLMError(f"speculative decoding runs one sequence at a time; got a batch of {embeds.shape[0]}")
        check_room(model, embeds.shape[1], max_new_tokens)
        opening = opening if temperature <= 0 else None
        prefilled = prefill_prompt(
            model, embeds, positions, timer, opening=opening, eos_id=eos_id, limit=max_new_tokens
        )
    steps = stream_speculative(
        model, draft, prefilled, max_new_tokens, eos_id, temperature, top_p, generator, timer, tree, verify
    )
    return drain(steps)


@torch.no_grad()
def stream_speculative(
    model,
    draft,
    prefilled: Prefilled,
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    timer: StageTimer | None = None,
    tree: TreeConfig = TreeConfig(),
    verify=None,
) -> Iterator[list[int]]:
    """EAGLE-2 speculative decoding after a prefill (batch 1): yields the tokens the prefill emits (its next token,
    and those an answer opening accepted with it, `prefilled.opened`, greedy only), then each cycle's accepted run;
    returns the `Generation`.

    Same stopping as `litevlm.model.generate.stream_decode` (after EOS, or at max_new_tokens), same timer stages
    ("prefill" for the first token, "decode"; plus "draft" and "verify" inside decode). `accept_lengths` holds the
    tokens emitted per target forward, bonus included (tau = their mean). verify: a `GraphedVerify` (GPU), used for
    the trees of its size (fixed-size trees; chains without a cut); other trees verify eagerly. Closing the stream
    stops it between cycles, where the caches are consistent.
    """
    embeds, positions, hidden = prefilled.embeds, prefilled.positions, prefilled.hidden
    timer = timer or StageTimer(embeds.device)
    lm = model.language_model
    b, t, _ = embeds.shape
    cap = lm.cache_len
    if b != 1:
        raise LiteVLMError(f"speculative decoding runs one sequence at a time; got a batch of {b}")
    check_room(model, t, max_new_tokens)
    n_tree = tree.total_tokens
    live = embeds.device.type != "cuda"  # eager CPU: attend over the live prefix; GPU: fixed shapes
    next_pos = int(positions[0, -1]) + 1  # RoPE position of the first generated token (slot t)
    context = getattr(getattr(draft, "cfg", None), "context", 0)
    c0 = max(0, t - context) if context else 0
    opened = prefilled.opened if temperature <= 0 else None
    with timer("prefill"):
        if opened is None:
            opened = Opened([int(sample_token(prefilled.logits, temperature, top_p, generator))], hidden[0, :0])
        out = list(opened.emitted)
        root = torch.tensor(out[-1:], device=embeds.device)
    yield list(out)
    accept: list[int] = []

    def finished() -> bool:
        return len(out) >= max_new_tokens or (eos_id is not None and out[-1] == eos_id)

    with timer("decode"):
        if finished():  # the whole answer came with the prompt's pass
            return Generation(out, t, dict(timer.ms), accept, opened.accepted)
        draft.prepare(
            cap + (tree.depth - 1) * tree.top_k, next_pos + max_new_tokens + tree.depth + 1
        )  # per generation: timed
        # The first extend covers the prompt (its last `context` pairs when the draft is windowed) and the opening
        # tokens accepted with it: pair j = (f_j, what the target consumed at j+1), at the position of token j.
        a = opened.accepted
        feats = torch.cat([hidden[0, c0:], opened.hidden])  # (t - c0 + a, C)
        nxt = torch.cat(
            [embeds[0, c0 + 1 :], lm.embed_tokens(torch.tensor(out, device=embeds.device))]
        )  # (t - c0 + a, C)
        pair_pos = torch.cat([positions[0, c0:], torch.arange(next_pos, next_pos + a, device=embeds.device)])
        done, L = 0, t + a  # pairs in the draft cache (its slots 0..done-1), tokens in the target cache
        plan = lm.step_plan() if live else None  # the CPU steps' arguments, gathered once
        # A greedy chain on the CPU runs each side of a cycle as one CPU call (draft_cycle, verify_chain_greedy).
        fused = (
            plan is not None
            and temperature <= 0
            and tree.top_k == 1
            and tree.total_tokens == tree.depth + 1
            and hasattr(draft, "draft_cycle")
        )
    while not finished():
        with timer("decode"):
            root_pos = next_pos + L - t
            if L + n_tree > cap:  # no room for a tree: finish with plain steps (the cache is exact)
                logits, _ = decode_step(model, root.view(1, 1), root_pos, L, plan)
                root = sample_token(logits, temperature, top_p, generator)
                new_list, a = [int(root)], 0
                new = root.view(1)
            else:
                with timer("draft"):
                    chain = (
                        draft.draft_cycle(
                            feats, nxt, pair_pos, done, root, root_pos, tree.depth, tree.min_value, eos_id
                        )
                        if fused
                        else None
                    )
                    if chain is None:
                        h_root = draft.extend(feats, nxt, pair_pos, done, last_only=True)  # (1, C): predicted f_L
                        tr = draft_tree(
                            draft, root, h_root, done + feats.shape[0], root_pos, tree, eos_id
                        )  # scratch from there
                    done += feats.shape[0]
                with timer("verify"):
                    fast = verify_chain_greedy(model, chain, L, root_pos, plan) if chain is not None else None
                    if fast is not None:  # a chain's accepted path is a prefix of it: nothing to commit
                        new, feats, nxt, pair_pos = fast
                        new_list = new.tolist()  # the cycle's one host sync
                        a = len(new_list) - 1
                    else:
                        if chain is not None:
                            tr = chain_tree(chain)
                        if verify is not None and len(tr) == verify.n:  # one replayed CUDA graph
                            logits, hid = verify(tr, L, root_pos)
                        else:
                            logits, hid = verify_tree(model, tr, L, root_pos, live, plan)
                        if temperature <= 0:
                            path, bonus = accept_greedy(tr, logits)
                        else:
                            path, bonus = accept_sampled(tr, logits, temperature, top_p, generator)
                        new = torch.cat([tr.tokens[path[1:]], bonus.view(1)])  # accepted drafts + bonus
                        host = torch.cat([path, new]).tolist()  # the cycle's one host sync
                        a = path.numel() - 1
                        path_list, new_list = host[: a + 1], host[a + 1 :]
                        if path_list != list(range(a + 1)):  # a chain's path is already in place
                            commit_path(model, path, L)
                        feats, nxt = hid[path], lm.embed_tokens(new)  # f_L..f_{L+a}, x_{L+1}..x_{L+a+1}
                        pair_pos = torch.arange(root_pos, root_pos + a + 1, device=embeds.device)
            emitted = []
            for tok in new_list:
                emitted.append(tok)
                if (eos_id is not None and tok == eos_id) or len(out) + len(emitted) >= max_new_tokens:
                    break
            out.extend(emitted)
            accept.append(len(emitted))
            L, root = L + a + 1, new[-1:]
        yield emitted
    return Generation(out, t, dict(timer.ms), accept, opened.accepted)
