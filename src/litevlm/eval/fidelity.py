"""Fidelity of a pruned prompt to the unpruned model: how likely the pruned prompt makes the answer the model gives
with every visual token.

A score can stay level while the answers move; fidelity asks the model itself. The unpruned answer's tokens are fed
after the pruned prompt by teacher forcing, each position seeing the prompt and the answer before it, and their mean
log-probability per token is read off; the drop from the unpruned prompt's own is how far the pruning moved the
model off its answer (0 where it did not; more where the answer became less likely).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def answer_loglik(backend, prefilled, tokens: list[int]) -> float:
    """The mean log-probability per token of `tokens` (an answer, its end token included where it has one)
    continuing a prompt already in the cache: `prefilled` from `litevlm.model.generate.prefill_prompt` without an
    answer opening (pruned inside the decoder or not). The first token's comes from the prefill's logits, the rest
    from one pass of the answer as a chain after the prompt (`backend.verify`, slots and positions as decoding would
    give them); the cache's slots after the prompt are overwritten."""
    if not tokens:
        raise ValueError("an answer to score needs at least one token")
    if prefilled.logits is None:
        raise ValueError("the prompt was prefilled with an answer opening: prefill it without one to score an answer")
    dev = prefilled.logits.device
    start = prefilled.embeds.shape[1]  # the cached prompt tokens: the answer's first slot
    root = int(prefilled.positions[0, -1]) + 1  # the answer's first RoPE position
    target = torch.tensor(tokens, dtype=torch.long, device=dev)
    logits = prefilled.logits[:1]  # (1, V): the first answer token
    if len(tokens) > 1:
        chain = target[:-1]  # each answer token but the last predicts the next
        m = chain.shape[0]
        depth = torch.arange(m, device=dev)
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()  # (m, m) a chain: every earlier token
        rest, _ = backend.verify(chain, depth, causal, start, root)  # (m, V)
        logits = torch.cat([logits, rest.reshape(m, -1)])
    logp = torch.log_softmax(logits.float(), dim=-1)  # (len(tokens), V)
    return float(logp.gather(1, target[:, None]).mean())
