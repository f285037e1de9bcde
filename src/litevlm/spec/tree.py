"""The EAGLE-2 dynamic draft tree (Li et al., arXiv 2406.16858, section 4) and its verification.

The draft head expands the tree level by level: at every level the `top_k` frontier nodes of
highest *value* (the product of draft probabilities along the path, kept as a sum of log-probs)
are expanded by their `top_k` best children each (4.1, expansion); all candidates join a pool, and
the `total_tokens - 1` best of the pool, by value, become the tree (4.2, reranking). The target then
checks the whole tree in one forward pass: every node sees the committed prefix and its own
ancestors only (the tree mask), at RoPE position root + depth. Greedy acceptance keeps the longest
path whose every token is the target's argmax; sampled acceptance walks the tree with the
recursive point-mass rule, which reproduces the target's distribution exactly (EAGLE-1,
arXiv 2401.15077, appendix A.2). The accepted path's K/V entries are then moved into contiguous
cache slots.

Shapes are fixed by `TreeConfig` (the tree's contents are dynamic, its size never is), so a GPU
can replay verification as a CUDA graph (`litevlm.model.backend.CudaBackend`). Chain drafting is the
special case top_k = 1; a chain may also stop early where its value falls below `min_value` (variable shapes:
an option for the CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from litevlm.errors import LiteVLMError

LOOKUP = 2  # the default `TreeConfig.lookup`: the answer's last two tokens are looked up


@dataclass(frozen=True)
class TreeConfig:
    """The fixed envelope of a draft tree.

    depth: draft levels, i.e. the most draft tokens on one path (the paper's "tree depth"; the
        EAGLE code's `depth` is this minus one). The draft runs `depth` forwards per cycle and a
        cycle commits at most depth + 1 tokens (the bonus token included).
    top_k: nodes expanded per level, and children kept per expanded node; 1 = chain drafting.
    total_tokens: tree size verified by the target, root included; 0 = depth + 1 for a chain
        (all of it), 16 for a tree.

    min_value: chains only: stop drafting once the path's draft probability falls below it.
    lookup: chains only, greedy: after a cycle whose drafts were all rejected, where the answer's last `lookup`
        tokens occurred earlier in it, the chain verified is what followed them there, continued with the same
        period (`repeat_guess`: prompt lookup over the answer itself), and so on while such chains are accepted. A
        loop the draft head never saw in training (a small model repeating one word) then runs at up to depth + 1
        tokens a cycle instead of one; verification keeps every answer exactly the greedy one. 0: off.

    The default is a deep chain (16 drafts) cut at value 0.1: on a CPU a target pass costs more
    with every verified token, and drive-tiny's templated answers are predictable enough that depth
    beats width. The value cut, not the depth, ends most chains; a deep chain lets the long,
    predictable answers run further, and with the native CPU steps a draft step is much cheaper than
    a target step, so a low cut's longer chains pay (benchmarks/spec_sweep.py measures the cuts). On a
    GPU, where verifying a few dozen tokens costs about one step, a tree pays: e.g.
    TreeConfig(top_k=4, depth=6, total_tokens=16).
    """

    top_k: int = 1
    depth: int = 16
    total_tokens: int = 0
    min_value: float = 0.1
    lookup: int = LOOKUP

    def __post_init__(self) -> None:
        if self.total_tokens == 0 and self.top_k >= 1 and self.depth >= 1:  # frozen: set the derived size once
            object.__setattr__(self, "total_tokens", self.depth + 1 if self.top_k == 1 else min(16, 1 + self.pool_size))
        if self.top_k < 1:
            raise LiteVLMError(f"tree top_k must be >= 1, got {self.top_k}")
        if self.depth < 1:
            raise LiteVLMError(f"tree depth must be >= 1, got {self.depth}")
        if not 0.0 <= self.min_value < 1.0:
            raise LiteVLMError(f"tree min_value must lie in [0, 1), got {self.min_value}")
        if self.lookup < 0:
            raise LiteVLMError(f"tree lookup must be >= 0 (0: off), got {self.lookup}")
        if not 2 <= self.total_tokens <= 1 + self.pool_size:
            raise LiteVLMError(
                f"tree total_tokens={self.total_tokens} must lie in [2, {1 + self.pool_size}] for top_k={self.top_k}, "
                f"depth={self.depth} (root + at most top_k + (depth - 1) * top_k^2 candidates)"
            )

    @property
    def pool_size(self) -> int:
        """Candidates drafted per cycle: top_k at level 1, top_k^2 at every deeper level."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @classmethod
    def chain(cls, depth: int, min_value: float = 0.0, lookup: int = LOOKUP) -> TreeConfig:
        """A chain of `depth` draft tokens (top_k = 1), cut short where its draft probability < min_value."""
        return cls(top_k=1, depth=depth, total_tokens=depth + 1, min_value=min_value, lookup=lookup)

    def label(self) -> str:
        if self.top_k == 1:
            return (
                f"chain d{self.depth}"
                + ("" if self.total_tokens == self.depth + 1 else f" n{self.total_tokens}")
                + (f" v{self.min_value:g}" if self.min_value else "")
                + ("" if self.lookup == LOOKUP else f" lookup{self.lookup}")
            )
        return f"tree k{self.top_k} d{self.depth} n{self.total_tokens}"


@dataclass
class Tree:
    """A flattened draft tree, root first, every parent before its children."""

    tokens: torch.Tensor  # (N,) token ids; tokens[0] is the root (the last committed-but-uncached token)
    parents: torch.Tensor  # (N,) index of each node's parent; -1 for the root
    depth: torch.Tensor  # (N,) 0 for the root
    mask: torch.Tensor  # (N, N) bool: mask[i, j] = j is i or an ancestor of i

    def __len__(self) -> int:
        return self.tokens.numel()


# ------------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _pool_levels(top_k: int, depth: int, device: torch.device) -> torch.Tensor:
    """Tree level (1..depth) of every pool entry, in pool order: a constant of the config."""
    levels = [1] * top_k + [2 + i // top_k**2 for i in range((depth - 1) * top_k**2)]
    return torch.tensor(levels, device=device)


@lru_cache(maxsize=64)
def _eye(n: int, device: torch.device) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


@lru_cache(maxsize=64)
def _chain(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, depth and mask of a chain of n nodes."""
    idx = torch.arange(n, device=device)
    return idx - 1, idx, torch.ones(n, n, dtype=torch.bool, device=device).tril()


def chain_tree(tokens: torch.Tensor) -> Tree:
    """A chain as a Tree: tokens (n,), the root first, each node the child of the one before."""
    return Tree(tokens, *_chain(tokens.numel(), tokens.device))


def repeat_guess(tokens: list[int], n: int, depth: int) -> list[int]:
    """Where the last n of `tokens` occurred before (the latest such place, overlaps allowed), the `depth` tokens that
    would follow if the stretch from there repeated with the same period; [] where they did not occur (or n = 0).

    [a, b, a, b, a] with n = 2 -> [b, a, b, ...]: the last "b a" sits 2 tokens after an earlier one, so each next
    token is the one 2 before it."""
    end = len(tokens)
    if n <= 0 or end <= n:
        return []
    tail = tokens[-n:]
    for i in range(end - n - 1, -1, -1):
        if tokens[i : i + n] == tail:
            period = end - n - i
            ext = tokens[-period:]  # a new list: the stretch that repeats
            for _ in range(depth):
                ext.append(ext[-period])
            return ext[period:]
    return []


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(N,) parent indices (a root -1, parents before children) -> (N, N) ancestor-or-self mask. A forest (several
    roots, as answer openings) works alike.

    Walks every node up `max_depth` times at once (one gather per level, no loop over nodes).
    """
    n = parents.numel()
    idx = torch.arange(n, device=parents.device)
    up = torch.where(parents >= 0, parents, idx)  # a root is its own parent: walking past it stays on it
    hops = [idx]
    for _ in range(max_depth):
        hops.append(up[hops[-1]])
    cols = torch.stack(hops, 1)  # (N, max_depth + 1): self, parent, grandparent, ...
    return torch.zeros(n, n, dtype=torch.bool, device=parents.device).scatter_(1, cols, True)


def tree_from_pool(
    root_token: torch.Tensor,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    levels: torch.Tensor,
    total_tokens: int,
    max_depth: int | None = None,
) -> Tree:
    """Rerank a pool of drafted candidates into a tree of `total_tokens` nodes (EAGLE-2 4.2).

    scores (P,): cumulative draft log-probs; tokens (P,); parents (P,): pool index of the parent,
    -1 for children of the root, always lower than the child's own index; levels (P,): depth
    (max_depth: their maximum, when the caller knows it without a device sync).
    Keeps the total_tokens - 1 best candidates. Ties go to the lower pool index, and a child never
    scores above its parent (log-probs are <= 0), so every kept node's parent is kept too.
    """
    n = total_tokens - 1
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    keep = order.sort().values  # (n,) ascending pool order: parents precede children
    tree_index = torch.full_like(parents, -1)
    tree_index[keep] = torch.arange(1, n + 1, device=keep.device)
    par = parents[keep]
    node_parents = torch.where(par < 0, 0, tree_index[par.clamp(min=0)])
    node_parents = torch.cat([node_parents.new_full((1,), -1), node_parents])  # (N,)
    node_tokens = torch.cat([root_token.reshape(1).to(tokens.dtype), tokens[keep]])
    depth = torch.cat([levels.new_zeros(1), levels[keep]])
    max_depth = int(levels.max()) if max_depth is None else max_depth
    return Tree(node_tokens, node_parents, depth, ancestor_mask(node_parents, min(max_depth, n)))


def draft_tree(
    draft,
    root_token: torch.Tensor,
    root_hidden: torch.Tensor,
    start: int,
    position: int,
    cfg: TreeConfig,
    eos_id: int | None = None,
) -> Tree:
    """Expand a draft tree below `root_token` (EAGLE-2 4.1) and rerank it.

    `draft` provides `topk(hidden (n, C), k) -> (log-probs (n, k), token ids (n, k))` and
    `step(tokens (k,), hidden (k, C), position, start, mask (k, S)) -> hidden (k, C)`, which runs k
    pairs at one draft position, writes their K/V at draft-cache slots start..start+k-1 and lets
    them attend where `mask` (over slots 0..S-1) allows. root_hidden (1, C) is the draft's output
    at the root pair, i.e. its prediction of the target feature after the root. The committed
    context fills draft slots 0..start-1; level-d nodes sit at draft position `position` + d - 1
    (the position of the feature they pair with). One batched forward per level, no host syncs.
    A chain cut by its draft probability (`cfg.min_value` > 0) reads that value on the host at every step, and then
    also ends at a drafted `eos_id` (nothing after the end of the answer is worth verifying); a fixed-depth chain
    (min_value 0, as a device's replayed steps want it) drafts every level without a host sync, the end of the answer
    found on the committed tokens.
    """
    k, levels = cfg.top_k, cfg.depth
    dev = root_hidden.device
    if k == 1 and cfg.total_tokens == levels + 1:  # a chain: no reranking, no tree mask to track
        one_call = getattr(draft, "one_call_chain", False)  # the whole chain in one call (`NativeDraft`, `GraphDraft`)
        if one_call and not (cfg.min_value > 0 and getattr(draft, "fixed_depth_only", False)):
            drafted = draft.draft_chain(root_hidden, position, start, levels, cfg.min_value, eos_id)
            return chain_tree(torch.cat([root_token.reshape(1).to(drafted.dtype), drafted]))
        value, tok = draft.topk(root_hidden, 1)
        drafted = [tok[:, 0]]  # (1,)
        hidden = root_hidden
        for i in range(levels - 1):
            if cfg.min_value > 0:  # host syncs: the CPU's early exits, where a sync costs nothing
                if float(value) < math.log(cfg.min_value):
                    break  # the path's draft probability is too low to be worth a step
                if int(drafted[-1]) == eos_id:  # (no eos_id: never equal)
                    break
            hidden = draft.step(drafted[-1], hidden, position + i, start + i, None)  # sees everything before it
            lp, tok = draft.topk(hidden, 1)
            value = value + lp
            drafted.append(tok[:, 0])
        return chain_tree(torch.cat([root_token.reshape(1).to(drafted[0].dtype), *drafted]))
    scores, tokens = (x[0] for x in draft.topk(root_hidden, k))  # (k,) level 1
    pool_scores, pool_tokens, pool_parents = [scores], [tokens], [torch.full((k,), -1, device=dev)]
    frontier = torch.arange(k, device=dev)  # pool indices of the nodes expanded next
    hidden = root_hidden.expand(k, -1)
    eye = _eye(k, dev)
    prefix = torch.ones(k, start, dtype=torch.bool, device=dev)
    tmask = eye  # (k, k * (level)): which scratch entries each frontier node may see
    for i in range(levels - 1):
        out = draft.step(tokens, hidden, position + i, start + i * k, torch.cat([prefix, tmask], 1))  # (k, C)
        child_lp, child_tok = draft.topk(out, k)  # (k, k)
        cum = (scores[:, None] + child_lp).flatten()  # (k*k,) value of every child
        child_tok = child_tok.flatten()
        pool_scores.append(cum)
        pool_tokens.append(child_tok)
        pool_parents.append(frontier.repeat_interleave(k))
        if i == levels - 2:
            break
        scores, pick = cum.topk(k)
        tokens = child_tok[pick]
        frontier = k + i * k * k + pick
        row = pick // k  # the frontier node each pick descends from
        hidden = out[row]
        tmask = torch.cat([tmask[row], eye], 1)  # inherit the parent's ancestors, add self
    return tree_from_pool(
        root_token,
        torch.cat(pool_scores),
        torch.cat(pool_tokens),
        torch.cat(pool_parents),
        _pool_levels(k, levels, dev),
        cfg.total_tokens,
        levels,
    )


# ------------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def verify_tree(target, tree: Tree, start: int, root_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the flattened tree -> (logits (N, V), hidden (N, C)), on a backend
    (`litevlm.model.backend`) or a model's.

    Node i is written at cache slot start + i, at RoPE position root_position + depth[i], and sees
    cache slots 0..start-1 (the committed prefix) plus its own ancestors.
    """
    from litevlm.model.generate import as_backend

    return as_backend(target).verify(tree.tokens, tree.depth, tree.mask, start, root_position)


def greedy_run(tree: Tree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance on the device, in fixed shapes (nothing read back to the host) -> (count (): accepted nodes,
    root included; path (N,): their indices from the root down, then N's as padding; run (N,): the target's token
    after each node of the path, i.e. the accepted drafts then the bonus token, then padding).

    A node is accepted when its token is the target's argmax after its parent and its parent is accepted. Siblings
    hold distinct tokens, so at most one child per node can match: the accepted nodes form one chain, the longest
    correct path. The bonus token is the target's argmax after the chain's last node."""
    pred = logits.argmax(-1)  # (N,) the target's next token after each node
    ok = tree.tokens == pred[tree.parents.clamp(min=0)]
    ok[0] = True  # the root is already committed
    on_path = ~(tree.mask & ~ok).any(1)  # (N,) every ancestor-or-self matches
    n = on_path.numel()
    idx = torch.arange(n, device=on_path.device)
    path = torch.where(on_path, idx, n).sort().values  # ascending index = ascending depth along one chain
    return on_path.sum(), path, pred[path.clamp(max=n - 1)]


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance (`greedy_run`) -> (accepted node indices (a+1,) from the root down, bonus token ())."""
    count, path, run = greedy_run(tree, logits)
    a1 = int(count)
    return path[:a1], run[a1 - 1]


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution `litevlm.model.generate.sample_token` draws from (temperature, then nucleus)."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_sampled(
    tree: Tree, logits: torch.Tensor, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless sampled acceptance (recursive rejection with point-mass drafts).

    From the root: with P the target's distribution after the current node, try its children in
    draft-rank order; child c is accepted with probability P(c), else P(c) is zeroed and P
    renormalised. On acceptance descend to c; when every child is rejected, or the node is a leaf,
    the bonus token is drawn from (the remaining) P. This is drawing y ~ P and following y when
    a child holds it, so every emitted token has exactly the target's distribution.
    """
    probs = target_probs(logits, temperature, top_p)  # (N, V)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)  # ascending index = draft rank among siblings
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    node, path = 0, [0]
    while True:
        if not children[node]:  # a leaf: the bonus comes from the fresh distribution
            bonus = torch.multinomial(probs[node], 1, generator=generator)[0]
            break
        row = probs[node].double().tolist()
        total = sum(row)
        for c in children[node]:
            u = float(torch.rand((), generator=generator, device=gen_dev))
            if u * total < row[tokens[c]]:  # accept with probability P(c) / (remaining mass)
                path.append(c)
                node = c
                break
            total -= row[tokens[c]]
            row[tokens[c]] = 0.0
        else:  # every child rejected: the bonus comes from the residual
            bonus = torch.multinomial(torch.tensor(row, device=probs.device), 1, generator=generator)[0]
            break
    return torch.tensor(path, device=logits.device), bonus.to(logits.device)


def commit_path(backend, path: torch.Tensor, start: int) -> None:
    """Move the accepted nodes' K/V (tree slots start + path) to the contiguous slots start.. ."""
    backend.commit(path + start, start)
