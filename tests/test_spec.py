"""EAGLE-2 speculative decoding: tree building, verification, commit, and losslessness, on tiny fp32 models."""

from __future__ import annotations

import itertools
import json
import types

import pytest
import torch

from litevlm.config import TextConfig, VisionConfig, VLMConfig
from litevlm.errors import LiteVLMError
from litevlm.model.backend import ModulesBackend
from litevlm.model.generate import generate, prefill
from litevlm.model.vlm import VLM
from litevlm.spec import (
    DraftConfig,
    DraftHead,
    TreeConfig,
    accept_greedy,
    accept_sampled,
    ancestor_mask,
    commit_path,
    draft_tree,
    speculative_generate,
    target_probs,
    tree_from_pool,
    verify_tree,
)

EOS = 2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread avoids thread wake-up costs (and contention on shared CPUs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_reordered_fp32(actual: torch.Tensor, expected: torch.Tensor, n: int) -> None:
    """`actual` equals `expected` up to the rounding of fp32 sums of length `n` run in another order: at most
    about n * eps times the magnitude summed (the worst case; typically sqrt(n) * eps). The scale is the largest
    |expected|, not each element's own: an element near zero is a cancellation of terms as large as the others
    and carries their rounding."""
    atol = n * torch.finfo(torch.float32).eps * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol)


def assert_greedy_up_to_a_near_tie(
    model, embeds, positions, got: list, want: list, margin: float, relative: bool = False
) -> None:
    """`got` (greedy tokens from another kernel path or precision) equals `want` (the modules' greedy tokens) up to
    the first place they part, and they part only where the modules' logits hold a near tie: the two tokens' logits
    within `margin` of each other there (teacher-forced on want's tokens before it; with `relative`, `margin` times
    the largest |logit| of that row). In bf16 two correct kernel paths round differently, and a compile fuses past
    roundings the modules make, so a near tie may go either way; anything else is a defect."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"one answer is a prefix of the other: {got} / {want}"
    backend = ModulesBackend(model)
    with torch.no_grad():
        logits, _ = backend.prefill(embeds, positions)
        t = embeds.shape[1]
        for k, tok in enumerate(want[:i]):
            logits, _ = backend.decode(torch.tensor([[tok]], device=embeds.device), t + k, t + k)
    row = logits[0].float()
    if relative:
        margin = margin * float(row.abs().max())
    gap = float(row[want[i]] - row[got[i]])
    assert gap <= margin, f"token {i}: {got[i]} instead of {want[i]}, whose logit leads by {gap:.4f} (> {margin})"


def tiny_vlm(vocab=64, hidden=32, layers=2, std=0.5, seed=0, cache=160) -> VLM:
    torch.manual_seed(seed)
    cfg = VLMConfig(
        vision=VisionConfig(
            hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, image_size=28, patch_size=14
        ),
        text=TextConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=2 * hidden,
            rope_theta=1e4,
        ),
        image_token_id=min(5, vocab - 1),
        img_start_id=min(6, vocab - 1),
        img_end_id=min(7, vocab - 1),
        eos_token_id=EOS,
        pad_token_id=0,
    )
    model = VLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, std)  # peaky next-token distributions: no near-ties in fp32
    model.language_model.setup_cache(1, cache)
    return model


def random_draft(model, seed=1, std=0.5) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftConfig.for_target(model.cfg.text), model).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim >= 2:
                p.normal_(0, std)
    return head


def prompt(model, seed, n=12, pruned=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, model.cfg.text.vocab_size, (1, n), generator=g)
    pos = torch.arange(n)[None]
    if pruned:  # token pruning keeps original positions: they skip
        pos = torch.cumsum(torch.randint(1, 4, (1, n), generator=g), 1) - 1
    return model.embed(ids), pos


class OracleDraft:
    """A stub draft that knows the target's greedy continuation `seq` (seq[0] = first generated token).

    Its "hidden state" is (index into seq of the token it predicts, still on the greedy path). On the
    path it ranks the right token first, except at indices in `demote` where it ranks it second (so
    a sibling, not the first child, is the accepted one) and in `drop` where it proposes it not at all.
    """

    cfg = types.SimpleNamespace(context=0)  # every prompt pair goes to the first extend

    def __init__(self, seq, prompt_len, vocab, demote=(), drop=()):
        self.seq, self.t, self.vocab = list(seq), prompt_len, vocab
        self.demote, self.drop = set(demote), set(drop)

    def prepare(self, cache_len, max_position):
        pass

    def extend(self, features, next_embeds, positions, start, last_only=False):
        n = features.shape[0]
        idx = torch.arange(start + 1, start + n + 1) - self.t + 1  # pair j predicts token j + 2 -> seq index j + 2 - t
        out = torch.stack([idx.float(), torch.ones(n)], 1)
        return out[-1:] if last_only else out

    def step(self, tokens, hidden, position, start, mask):
        idx, ok = hidden[:, 0].long(), hidden[:, 1] > 0
        right = torch.tensor([self.seq[i] if i < len(self.seq) else -1 for i in idx.tolist()])
        return torch.stack([(idx + 1).float(), (ok & (tokens == right)).float()], 1)

    def topk(self, hidden, k):
        rows = []
        for i, ok in zip(hidden[:, 0].long().tolist(), (hidden[:, 1] > 0).tolist()):
            g = torch.Generator().manual_seed(1000 + i)
            lp = torch.randn(self.vocab, generator=g) * 3
            if ok and i < len(self.seq):
                tok = self.seq[i]
                if i in self.drop:
                    lp[tok] = -1e9
                elif i in self.demote:
                    lp[tok] = lp.max() + 1
                    other = (tok + 1) % self.vocab
                    lp[other] = lp[tok] + 1
                else:
                    lp[tok] = lp.max() + 2
            rows.append(torch.log_softmax(lp, -1))
        return torch.stack(rows).topk(k, -1)


# ------------------------------------------------------------------------------------------------
# Tree building
# ------------------------------------------------------------------------------------------------
def test_tree_config_validation():
    assert TreeConfig.chain(3) == TreeConfig(1, 3, 4, 0.0) == TreeConfig(top_k=1, depth=3, min_value=0.0)
    assert TreeConfig(top_k=4, depth=6).total_tokens == 16 and TreeConfig(top_k=2, depth=2).total_tokens == 7
    assert TreeConfig().top_k == 1 and TreeConfig().total_tokens == TreeConfig().depth + 1
    assert TreeConfig(4, 6, 16).pool_size == 4 + 5 * 16
    for bad in [
        dict(top_k=0),
        dict(depth=0),
        dict(total_tokens=1),
        dict(top_k=1, depth=3, total_tokens=5),
        dict(top_k=2, depth=2, total_tokens=8),
    ]:
        with pytest.raises(LiteVLMError):
            TreeConfig(**{**dict(top_k=2, depth=2, total_tokens=4), **bad})
    with pytest.raises(LiteVLMError):
        TreeConfig(min_value=1.0)
    with pytest.raises(LiteVLMError, match="lookup"):
        TreeConfig(lookup=-1)


def test_a_repeat_guess_continues_the_answer_with_the_period_of_its_last_match():
    from litevlm.spec.tree import repeat_guess

    assert repeat_guess([1, 2, 1, 2, 1], 2, 5) == [2, 1, 2, 1, 2]  # "2 1" occurred 2 tokens back: period 2
    assert repeat_guess([7, 9, 9, 9], 2, 4) == [9, 9, 9, 9]  # overlapping matches: period 1
    assert repeat_guess([5, 1, 2, 3, 1, 2], 2, 4) == [3, 1, 2, 3]  # what followed "1 2", then again
    assert repeat_guess([4, 1, 2, 8, 1, 2, 6, 1, 2], 2, 2) == [6, 1]  # the latest match, not the first
    assert repeat_guess([1, 2, 3], 2, 3) == [] and repeat_guess([1, 1], 2, 3) == []  # no earlier occurrence
    assert repeat_guess([1, 1, 1], 0, 3) == []  # off


def test_rerank_worked_example():
    """EAGLE-2 spec 2.5: k=2, three levels, N=5 -> [root, a, b, c, g]."""
    a, b, c, d, e, f, g, h, i, j = range(10, 20)
    p = torch.tensor
    # pool: level 1 (a, b); level 2 children of a (c, d) and b (e, f); level 3 children of c (g, h) and e (i, j)
    scores = p([0.6, 0.3, 0.42, 0.12, 0.15, 0.12, 0.378, 0.021, 0.09, 0.045]).log()
    tokens = p([a, b, c, d, e, f, g, h, i, j])
    parents = p([-1, -1, 0, 0, 1, 1, 2, 2, 4, 4])
    levels = p([1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    tree = tree_from_pool(p(99), scores, tokens, parents, levels, 5)
    assert tree.tokens.tolist() == [99, a, b, c, g]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 3]
    rows = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4]]
    want = torch.zeros(5, 5, dtype=torch.bool)
    for r, cols in enumerate(rows):
        want[r, cols] = True
    assert torch.equal(tree.mask, want)


def test_rerank_ties_keep_the_tree_connected():
    # a child with log-prob exactly 0 ties its parent; tie-breaking by pool index keeps the parent
    scores = torch.tensor([-1.0, -0.5, -1.0, -1.0, -0.5, -3.0])
    parents = torch.tensor([-1, -1, 0, 2, 1, 4])
    levels = torch.tensor([1, 1, 2, 3, 2, 3])
    for n in range(2, 8):
        tree = tree_from_pool(torch.tensor(7), scores, torch.arange(6) + 10, parents, levels, n)
        assert (tree.parents[1:] < torch.arange(1, n)).all() and (tree.parents[1:] >= 0).all()
        assert torch.equal(tree.depth, tree.mask.sum(1) - 1)


class TableDraft:
    """A stub draft whose next-token log-probs depend on (token, level) through a fixed random table."""

    def __init__(self, vocab=12, seed=0, ties=False):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(vocab, 8, vocab, generator=g) * 2, -1)
        if ties:  # a token whose successor is certain: child value == parent value
            self.table[3, :, 5] = 0.0
        self.vocab = vocab

    def topk(self, hidden, k):
        return self.table[hidden[:, 0].long(), hidden[:, 1].long()].topk(k, -1)

    def step(self, tokens, hidden, position, start, mask):
        assert mask is None or mask.shape == (tokens.numel(), start + tokens.numel())
        return torch.stack([tokens.float(), hidden[:, 1] + 1], 1)


def naive_tree(table, root, k, depth, n):
    """Pure-Python EAGLE-2 expansion: the pool as (value, token, parent pool index, level)."""
    pool = []
    lp = table[root, 0]
    top = lp.topk(k)
    for v, tkn in zip(top.values.tolist(), top.indices.tolist()):
        pool.append((v, tkn, -1, 1))
    frontier = list(range(k))
    for lvl in range(1, depth):
        new = []
        for f in frontier:
            v0, tkn0, _, _ = pool[f]
            top = table[tkn0, lvl].topk(k)
            for v, tkn in zip(top.values.tolist(), top.indices.tolist()):
                new.append((v0 + v, tkn, f, lvl + 1))
        base = len(pool)
        pool += new
        order = sorted(range(len(new)), key=lambda i: -new[i][0])[:k]
        frontier = [base + i for i in order]
    keep = sorted(sorted(range(len(pool)), key=lambda i: (-pool[i][0], i))[: n - 1])
    return pool, keep


@pytest.mark.parametrize(
    "k,depth,n,ties", [(1, 4, 5, False), (2, 3, 6, False), (3, 4, 12, False), (4, 5, 16, True), (4, 3, 21, False)]
)
def test_draft_tree_invariants(k, depth, n, ties):
    stub = TableDraft(ties=ties, seed=k * 10 + depth)
    root = torch.tensor([3 if ties else 1])
    tree = draft_tree(
        stub, root, torch.tensor([[float(root), 0.0]]), start=9, position=40, cfg=TreeConfig(k, depth, n, min_value=0.0)
    )
    N = len(tree)
    assert N == n and tree.tokens[0] == root[0] and tree.parents[0] == -1
    par = tree.parents.tolist()
    assert all(0 <= par[i] < i for i in range(1, N))  # parents precede children
    # the mask is the ancestor closure
    for i in range(N):
        anc, j = {i}, i
        while j > 0:
            j = par[j]
            anc.add(j)
        assert set(tree.mask[i].nonzero().squeeze(1).tolist()) == anc
    assert torch.equal(tree.depth, tree.mask.sum(1) - 1)
    positions = tree.depth + 40  # verify_tree places node i at root position + depth
    assert positions[0] == 40 and all(positions[i] == positions[par[i]] + 1 for i in range(1, N))
    for i in range(N):  # siblings hold distinct tokens
        sib = [tree.tokens[j].item() for j in range(1, N) if par[j] == i]
        assert len(sib) == len(set(sib))
    # the node set equals a naive re-implementation's top-(N-1) by value
    pool, keep = naive_tree(stub.table, int(root), k, depth, n)
    assert tree.tokens[1:].tolist() == [pool[i][1] for i in keep]
    idx = {p: t for t, p in enumerate(keep, start=1)}
    assert tree.parents[1:].tolist() == [0 if pool[i][2] < 0 else idx[pool[i][2]] for i in keep]


def test_a_chain_cut_by_its_value_ends_at_a_drafted_eos():
    stub = TableDraft(ties=False, seed=0)
    root = torch.tensor([0])
    h = torch.tensor([[0.0, 0.0]])
    cut_by_value = TreeConfig.chain(5, min_value=1e-30)  # a cut that never bites here: the host reads every step
    full = draft_tree(stub, root, h, start=9, position=40, cfg=cut_by_value).tokens.tolist()
    eos = full[2]
    assert eos not in full[:2]  # this table drafts it second
    cut = draft_tree(stub, root, h, start=9, position=40, cfg=cut_by_value, eos_id=eos)
    assert cut.tokens.tolist() == full[:3] and cut.mask.shape == (3, 3)
    assert draft_tree(stub, root, h, start=9, position=40, cfg=cut_by_value, eos_id=-1).tokens.tolist() == full
    # a fixed-depth chain drafts past it: the answer's end is found on the committed tokens
    fixed = draft_tree(stub, root, h, start=9, position=40, cfg=TreeConfig.chain(5), eos_id=eos)
    assert fixed.tokens.tolist() == full


class HostSyncs:
    """Counts what reads a tensor's value on the host (int, float, bool, item, tolist) while it is entered; `seen`
    names each read in order."""

    NAMES = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")

    def __init__(self, monkeypatch):
        self.monkeypatch, self.count, self.seen = monkeypatch, 0, []

    def counting(self, owner, name: str, counts=lambda *a, **k: True) -> None:
        """owner.name counted (where counts(its arguments)) while entered."""
        original = getattr(owner, name)

        def counted(*a, _original=original, **k):
            if counts(*a, **k):
                self.count += 1
                self.seen.append(name)
            return _original(*a, **k)

        self.monkeypatch.setattr(owner, name, counted)

    def __enter__(self):
        for name in self.NAMES:
            self.counting(torch.Tensor, name)
        return self

    def __exit__(self, *exc):
        self.monkeypatch.undo()


@pytest.mark.parametrize("k,depth,n", [(1, 6, 7), (4, 5, 16)], ids=["chain", "tree"])
def test_a_fixed_depth_draft_makes_no_host_sync_between_its_steps(monkeypatch, k, depth, n):
    """A device's draft cycle: a fixed-depth chain or a tree (min_value 0) with an EOS to watch for reads nothing back
    to the host while it drafts; the cycle's one sync is the verification's."""
    stub = TableDraft(seed=3)
    root, h = torch.tensor([1]), torch.tensor([[1.0, 0.0]])
    cfg = TreeConfig(k, depth, n, min_value=0.0)
    with HostSyncs(monkeypatch) as syncs:
        tree = draft_tree(stub, root, h, start=9, position=40, cfg=cfg, eos_id=5)
    assert syncs.count == 0 and len(tree) == n
    with HostSyncs(monkeypatch) as syncs:  # the CPU's value cut reads every step on the host: the counter sees it
        draft_tree(stub, root, h, start=9, position=40, cfg=TreeConfig.chain(depth, min_value=1e-30), eos_id=5)
    assert syncs.count >= depth - 1


def test_ancestor_mask_of_a_chain():
    m = ancestor_mask(torch.tensor([-1, 0, 1, 2]), 3)
    assert torch.equal(m, torch.ones(4, 4, dtype=torch.bool).tril())


# ------------------------------------------------------------------------------------------------
# Verification and commit against sequential decoding
# ------------------------------------------------------------------------------------------------
def random_tree(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    pool = 3 + 2 * 9
    scores = -torch.rand(pool, generator=g).cumsum(0)  # decreasing: pool order is value order
    parents = torch.tensor([-1] * 3 + [i // 3 for i in range(9)] + [3 + i // 3 for i in range(9)])
    levels = torch.tensor([1] * 3 + [2] * 9 + [3] * 9)
    perm = torch.randperm(pool, generator=g)  # shuffle values, then repair parent <= child
    scores = scores[perm]
    for i in range(3, pool):
        scores[i] = min(scores[i], scores[parents[i]] - 1e-3)
    tokens = torch.randint(8, vocab, (pool,), generator=g)
    return tree_from_pool(torch.tensor(9), scores, tokens, parents, levels, n)


def path_to(tree, node):
    path = [node]
    while path[-1] > 0:
        path.append(tree.parents[path[-1]].item())
    return path[::-1]


@pytest.mark.parametrize("pruned", [False, True])
def test_verify_tree_matches_sequential_decoding(pruned):
    model = tiny_vlm()
    embeds, pos = prompt(model, 3, pruned=pruned)
    t = embeds.shape[1]
    prefill(model, embeds, pos)
    tree = random_tree(64, 12, seed=4)
    root_pos = int(pos[0, -1]) + 1
    logits, hidden = verify_tree(model, tree, t, root_pos)
    lm = model.language_model
    for node in range(len(tree)):
        toks = tree.tokens[path_to(tree, node)]
        x = torch.cat([embeds, lm.embed_tokens(toks)[None]], 1)
        p = torch.cat([pos, root_pos + torch.arange(len(toks))[None]], 1)
        with torch.no_grad():
            ref = lm(x, p)[0, -1]  # plain causal forward, no cache
        # tree verification (one pass over the tree under its mask) against a plain causal forward of each path: other
        # shapes and cache lengths, fp32 sums reordered through the layers; 1e-4 of O(1-10) values, ~1000 eps, while a
        # wrong mask, position or parent moves them by O(1).
        torch.testing.assert_close(hidden[node], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[node], model.lm_head(ref), rtol=1e-4, atol=1e-4)


def test_commit_matches_a_fresh_prefill():
    model = tiny_vlm()
    embeds, pos = prompt(model, 5, pruned=True)
    t = embeds.shape[1]
    lm = model.language_model
    prefill(model, embeds, pos)
    tree = random_tree(64, 16, seed=6)
    root_pos = int(pos[0, -1]) + 1
    verify_tree(model, tree, t, root_pos)
    deepest = int(tree.depth.argmax())
    deepest = max(i for i in range(len(tree)) if tree.depth[i] == tree.depth[deepest])  # the last branch
    path = torch.tensor(path_to(tree, deepest))
    assert path.tolist() != list(range(len(path)))  # a real move, not a no-op
    commit_path(ModulesBackend(model), path, t)
    got = [(layer.self_attn.kv_cache.k.clone(), layer.self_attn.kv_cache.v.clone()) for layer in lm.layers]
    n = t + len(path)
    x = torch.cat([embeds, lm.embed_tokens(tree.tokens[path])[None]], 1)
    p = torch.cat([pos, root_pos + torch.arange(len(path))[None]], 1)
    model.language_model.setup_cache(1, lm.cache_len)
    prefill(model, x, p)
    for (k, v), layer in zip(got, lm.layers):
        # K/V moved by commit_path against a fresh prefill of the accepted path: the same reordering bound as the
        # verification.
        torch.testing.assert_close(k[:, :, :n], layer.self_attn.kv_cache.k[:, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[:, :, :n], layer.self_attn.kv_cache.v[:, :, :n], rtol=1e-4, atol=1e-4)


def test_accept_greedy_handcrafted():
    # root -> a(1), b(2); a -> c(3); c -> d(4); b -> e(5)
    tree = tree_from_pool(
        torch.tensor(0),
        torch.tensor([-1.0, -2.0, -1.5, -2.5, -2.6]),
        torch.tensor([1, 2, 3, 5, 4]),
        torch.tensor([-1, -1, 0, 1, 2]),
        torch.tensor([1, 1, 2, 2, 3]),
        6,
    )
    assert tree.tokens.tolist() == [0, 1, 2, 3, 5, 4]  # nodes 0 root, 1 a, 2 b, 3 c, 4 e, 5 d
    V = 8

    def logits_for(argmaxes):
        z = torch.zeros(len(argmaxes), V)
        z[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
        return z

    # target: after root 1 (a), after a 3 (c), after c 7 (not d): accept a, c, bonus 7
    path, bonus = accept_greedy(tree, logits_for([1, 3, 0, 7, 0, 0]))
    assert path.tolist() == [0, 1, 3] and bonus.item() == 7
    # target picks the second child b, then e, then anything: accept b, e, bonus from e
    path, bonus = accept_greedy(tree, logits_for([2, 0, 5, 0, 6, 0]))
    assert path.tolist() == [0, 2, 4] and bonus.item() == 6
    # nothing matches: the root alone, bonus from the root
    path, bonus = accept_greedy(tree, logits_for([7, 3, 5, 4, 0, 0]))
    assert path.tolist() == [0] and bonus.item() == 7
    # the whole deepest path
    path, bonus = accept_greedy(tree, logits_for([1, 3, 0, 4, 0, 6]))
    assert path.tolist() == [0, 1, 3, 5] and bonus.item() == 6


# ------------------------------------------------------------------------------------------------
# End-to-end greedy losslessness
# ------------------------------------------------------------------------------------------------
CONFIGS = [
    TreeConfig.chain(1),
    TreeConfig.chain(4),
    TreeConfig.chain(6, min_value=0.6),
    TreeConfig.chain(10, 0.1),
    TreeConfig(2, 3, 6),
    TreeConfig(4, 5, 16),
    TreeConfig(3, 6, 24),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_greedy_lossless_with_an_oracle_draft(cfg):
    """Long accepted paths: EOS inside a path, max_new_tokens reached mid-path, siblings accepted."""
    model = tiny_vlm()
    accepted = []
    for seed, (max_new, eos) in enumerate([(40, None), (17, None), (40, "mid"), (9, None)]):
        embeds, pos = prompt(model, seed, pruned=seed % 2 == 1)
        ref = generate(model, embeds, pos, max_new, None)
        eos_id = ref.tokens[11] if eos == "mid" else None
        if eos_id is not None:
            ref = generate(model, embeds, pos, max_new, eos_id)
            assert ref.tokens[-1] == eos_id and len(ref.tokens) < max_new
        seq = generate(model, embeds, pos, max_new + 10, None).tokens
        oracle = OracleDraft(seq, embeds.shape[1], 64, demote={3, 4, 9}, drop={14})
        out = speculative_generate(model, oracle, embeds, pos, max_new, eos_id, tree=cfg)
        assert out.tokens == ref.tokens
        assert sum(out.accept_lengths) == len(out.tokens) - 1
        assert all(1 <= a <= cfg.depth + 1 for a in out.accept_lengths)
        assert set(out.timings_ms) >= {"prefill", "decode", "draft", "verify"}
        accepted += out.accept_lengths
    if cfg.min_value >= 0.5 and cfg.top_k == 1:
        assert 2 <= max(accepted) < cfg.depth + 1  # low-value tails were cut, long paths still accepted
    else:
        assert max(accepted) == cfg.depth + 1  # full paths were accepted


@pytest.mark.parametrize(
    "cfg", [TreeConfig(), TreeConfig.chain(3), TreeConfig(4, 5, 16), TreeConfig(8, 4, 32)], ids=lambda c: c.label()
)
def test_greedy_lossless_with_a_draft_head(cfg):
    model = tiny_vlm(vocab=24)  # a small vocabulary so that a random draft is sometimes right
    head = random_draft(model)
    accepted = []
    for seed in range(3):
        embeds, pos = prompt(model, seed, pruned=seed == 2)
        ref = generate(model, embeds, pos, 30, EOS)
        out = speculative_generate(model, head, embeds, pos, 30, EOS, tree=cfg)
        assert out.tokens == ref.tokens
        accepted += out.accept_lengths
    if cfg.top_k > 1:
        assert max(accepted) >= 2  # some drafts were accepted, so commits happened


def test_greedy_lossless_when_the_cache_has_no_room_for_a_tree():
    model = tiny_vlm(cache=64)
    embeds, pos = prompt(model, 1)
    ref = generate(model, embeds, pos, 20, None)
    seq = generate(model, embeds, pos, 30, None).tokens
    model.language_model.setup_cache(1, 12 + 20)  # just enough for plain decoding
    out = speculative_generate(model, OracleDraft(seq, 12, 64), embeds, pos, 20, None, tree=TreeConfig(4, 5, 16))
    assert out.tokens == ref.tokens and out.accept_lengths[-1] == 1


def test_a_looping_answer_is_drafted_from_itself_and_stays_lossless():
    """With `lookup`, chains looked up in the answer itself take over where the draft head's are all rejected: on a
    small model whose greedy answers fall into loops, far fewer cycles, and every answer the greedy one, on the native
    steps (one call a side) and on the modules alike."""
    model = tiny_vlm(vocab=24, std=0.2)
    head = random_draft(model, seed=3)
    cycles = {0: 0, 2: 0}
    for seed in (0, 1):
        embeds, pos = prompt(model, seed)
        ref = generate(model, embeds, pos, 60, None)
        for lookup in (0, 2):
            cfg = TreeConfig.chain(8, lookup=lookup)
            out = speculative_generate(model, head, embeds, pos, 60, None, tree=cfg)
            modules = speculative_generate(ModulesBackend(model, head), head, embeds, pos, 60, None, tree=cfg)
            assert out.tokens == modules.tokens == ref.tokens
            assert out.accept_lengths == modules.accept_lengths
            cycles[lookup] += len(out.accept_lengths)
    assert cycles[2] < 0.85 * cycles[0]  # 88 against 116 cycles when written


def test_prompt_too_long_raises():
    model = tiny_vlm(cache=20)
    embeds, pos = prompt(model, 1)
    with pytest.raises(LiteVLMError):
        speculative_generate(model, random_draft(model), embeds, pos, 10, None)


def test_draft_cache_is_rebuilt_from_target_features():
    """After a cycle the draft K/V of committed pairs equal a fresh draft pass over the target's true features."""
    model = tiny_vlm(vocab=24)
    head = random_draft(model)
    lm = model.language_model
    embeds, pos = prompt(model, 2)
    t = embeds.shape[1]
    cfg = TreeConfig(3, 3, 8)
    head.prepare(lm.cache_len + 10, 200)
    logits, hidden = prefill(model, embeds, pos)
    root = logits.argmax(-1)
    h = head.extend(hidden[0], torch.cat([embeds[0, 1:], lm.embed_tokens(root)]), pos[0], 0)[-1:]
    tree = draft_tree(head, root, h, t, t, cfg)
    z, hid = verify_tree(model, tree, t, t)
    path, bonus = accept_greedy(tree, z)
    commit_path(ModulesBackend(model), path, t)
    new = torch.cat([tree.tokens[path[1:]], bonus.view(1)])
    head.extend(hid[path], lm.embed_tokens(new), torch.arange(t, t + len(path)), t)  # overwrites the scratch
    n = t + len(path)
    committed = torch.cat([embeds[0], lm.embed_tokens(root), lm.embed_tokens(new)])  # x_0 .. x_n (x_t = root)
    with torch.no_grad():
        feats = lm(committed[None, :n], torch.arange(n)[None])[0]  # true features f_0 .. f_{n-1}
    got_k = head.layer.self_attn.kv_cache.k[:, :, :n].clone()
    head.setup_cache(lm.cache_len)
    head.extend(feats, committed[1 : n + 1], torch.arange(n), 0)
    # the draft's K/V built cycle by cycle against one extend over the true features: fp32 sums reordered.
    torch.testing.assert_close(got_k, head.layer.self_attn.kv_cache.k[:, :, :n], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# Sampling: the output distribution is the target's
# ------------------------------------------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([exp[~small], exp[small].sum().view(1)]) if small.any() else exp
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def test_sampled_acceptance_rule_is_lossless():
    """The first emitted token and the accepted path follow the target exactly, whatever the drafts."""
    V = 5
    # root -> {2, 0, 4}; node "2" -> {1, 3}; node "0" -> {2}
    tree = tree_from_pool(
        torch.tensor(1),
        torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]),
        torch.tensor([2, 0, 4, 1, 3, 2]),
        torch.tensor([-1, -1, -1, 0, 0, 1]),
        torch.tensor([1, 1, 1, 2, 2, 2]),
        7,
    )
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(tree), V, generator=g)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        p = target_probs(logits, temperature, top_p)
        assert ((p[:3] > 0).sum(1) >= 3).all()
        n = 3000
        first = torch.zeros(V)
        second = torch.zeros(V, V)
        for _ in range(n):
            path, bonus = accept_sampled(tree, logits, temperature, top_p, g)
            toks = tree.tokens[path[1:]].tolist() + [int(bonus)]
            first[toks[0]] += 1
            if len(toks) > 1:
                second[toks[0], toks[1]] += 1
        assert chi2_pvalue(first, p[0]) > 1e-3
        # given the first token is a child's, the second follows the target's distribution after that child
        for node in (1, 2, 3):
            tok = int(tree.tokens[node])
            if p[0, tok] > 0.05:
                assert chi2_pvalue(second[tok], p[node]) > 1e-3
    # the test has power: the same counts do not fit the untempered distribution
    assert chi2_pvalue(first, target_probs(logits, 1.0, 1.0)[0]) < 1e-3


def exact_sequence_probs(model, embeds, pos, n_tokens, temperature):
    """Probability of every token sequence of length n_tokens under the target (enumerated)."""
    V = model.cfg.text.vocab_size
    lm = model.language_model
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n_tokens)))  # (V^n, n)
    x = torch.cat([embeds.expand(len(seqs), -1, -1), lm.embed_tokens(seqs)], 1)
    t = embeds.shape[1]
    p = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(n_tokens)[None]], 1).expand(len(seqs), -1)
    with torch.no_grad():
        logp = torch.log_softmax(model.lm_head(lm(x, p))[:, t - 1 : -1].float() / temperature, -1)  # (S, n, V)
    return logp.gather(-1, seqs[..., None]).squeeze(-1).sum(1).exp()


def test_temperature_one_output_distribution_equals_the_target():
    """Sampled speculative decoding of a 4-token-vocabulary target: the joint law of 3 tokens is exact."""
    V, n_tok = 4, 3
    model = tiny_vlm(vocab=V, hidden=16, layers=1, std=0.4, cache=24)
    head = random_draft(model, std=0.8)
    with torch.no_grad():
        embeds = model.language_model.embed_tokens(torch.tensor([[1, 3, 0, 2]]))
    pos = torch.arange(4)[None]
    exact = exact_sequence_probs(model, embeds, pos, n_tok, 1.0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V**n_tok)
    accepted = 0
    for _ in range(500):
        out = speculative_generate(
            model, head, embeds, pos, n_tok, None, temperature=1.0, generator=g, tree=TreeConfig(2, 2, 5)
        )
        counts[sum(tok * V ** (n_tok - 1 - i) for i, tok in enumerate(out.tokens))] += 1
        accepted += max(out.accept_lengths) > 1
    assert accepted > 250  # drafts were accepted often: the rule, not plain sampling, produced these
    assert chi2_pvalue(counts, exact) > 1e-3
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.13  # total variation
    # power: the same samples reject the target at another temperature
    assert chi2_pvalue(counts, exact_sequence_probs(model, embeds, pos, n_tok, 1.3)) < 1e-3


# ------------------------------------------------------------------------------------------------
# The draft head
# ------------------------------------------------------------------------------------------------
def test_draft_layer_matches_the_decoder_layer_and_the_cached_path():
    model = tiny_vlm()
    head = random_draft(model, std=0.2)
    g = torch.Generator().manual_seed(0)
    feats, nxt = torch.randn(1, 9, 32, generator=g), torch.randn(1, 9, 32, generator=g)
    pos = torch.tensor([[0, 1, 2, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        got = head(feats, nxt, pos)
        from litevlm.model.layers import rope_cos_sin

        cos, sin = rope_cos_sin(pos, head.cfg.head_dim, head.cfg.rope_theta, torch.float32)
        ref = head.layer(head.fc(torch.cat([nxt, feats], -1)), cos, sin)  # the target's own layer code
    # the draft head against the target's own layer code on its fc output: other shapes, reordered fp32 sums of length
    # <= 64, ~8e-6 of O(1).
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    head.prepare(32, 64)
    a = head.extend(feats[0, :5], nxt[0, :5], pos[0, :5], 0)
    b = head.extend(feats[0, 5:], nxt[0, 5:], pos[0, 5:], 5)
    # two cached extends against one forward: reordered fp32 sums, as above.
    torch.testing.assert_close(torch.cat([a, b]), got[0], rtol=1e-5, atol=1e-5)
    # last_only (what a draft cycle uses): the last prediction alone, and the same K/V in the cache
    cache = head.layer.self_attn.kv_cache
    k_full, v_full = cache.k[:, :, :9].clone(), cache.v[:, :, :9].clone()
    cache.k.zero_(), cache.v.zero_()
    a1 = head.extend(feats[0, :5], nxt[0, :5], pos[0, :5], 0, last_only=True)
    b1 = head.extend(feats[0, 5:], nxt[0, 5:], pos[0, 5:], 5, last_only=True)
    assert a1.shape == b1.shape == (1, 32)
    # last_only computes the same rows with smaller shapes: reordered fp32 sums.
    torch.testing.assert_close(torch.cat([a1, b1]), got[0, [4, 8]], rtol=1e-5, atol=1e-5)
    # K/V come from the same rows through the same projections whether or not only the last output is kept: equality.
    torch.testing.assert_close(cache.k[:, :, :9], k_full, rtol=0, atol=0)
    torch.testing.assert_close(cache.v[:, :, :9], v_full, rtol=0, atol=0)


def test_draft_head_save_load_roundtrip(tmp_path):
    model = tiny_vlm()
    head = random_draft(model)
    head.recipe = {"steps": 3, "lr": 1e-3}
    head.save(tmp_path / "m" / "draft")
    loaded = DraftHead.load(tmp_path / "m", model)  # a model folder holding draft/ works too
    assert loaded.recipe == head.recipe and loaded.cfg == head.cfg
    for (k, v), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert sorted(p.name for p in (tmp_path / "m" / "draft").iterdir()) == ["config.json", "model.safetensors"]
    embeds, pos = prompt(model, 0)
    a = speculative_generate(model, head, embeds, pos, 10, None)
    b = speculative_generate(model, loaded, embeds, pos, 10, None)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths


def test_draft_checkpoint_mismatches_raise(tmp_path):
    model = tiny_vlm()
    random_draft(model).save(tmp_path / "d")
    other = tiny_vlm(hidden=48)
    with pytest.raises(LiteVLMError, match="hidden_size"):
        DraftHead.load(tmp_path / "d", other)
    # tensors whose shapes disagree with the stored config
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    meta["config"]["intermediate_size"] = 40
    (tmp_path / "d" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(LiteVLMError, match="shape"):
        DraftHead.load(tmp_path / "d", model)
    with pytest.raises(LiteVLMError, match="no draft head"):
        DraftHead.load(tmp_path / "missing", model)
    with pytest.raises(LiteVLMError):
        DraftHead(DraftConfig.for_target(other.cfg.text), model)


def test_a_reduced_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(tmp_path):
    model = tiny_vlm(vocab=24)
    torch.manual_seed(1)
    head = DraftHead(DraftConfig.for_target(model.cfg.text, draft_vocab=10), model).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.5)
    allowed = [2, 3, 5, 8, 9, 11, 13, 17, 19, 23]
    head.set_draft_vocab(allowed)
    lp, tok = head.topk(torch.randn(5, 32), 4)
    assert set(tok.flatten().tolist()) <= set(allowed) and torch.all(lp <= 0)
    embeds, pos = prompt(model, 0)
    out = speculative_generate(model, head, embeds, pos, 30, EOS, tree=TreeConfig(4, 4, 12))
    assert out.tokens == generate(model, embeds, pos, 30, EOS).tokens
    head.save(tmp_path / "d")
    assert DraftHead.load(tmp_path / "d", model).vocab_map.tolist() == allowed
    with pytest.raises(LiteVLMError):
        head.set_draft_vocab([1, 2])


def test_a_full_precision_draft_drafts_for_a_bf16_target():
    model = tiny_vlm(vocab=24)
    head = random_draft(model)
    model.to(torch.bfloat16)  # the head stays in fp32, as the pipeline keeps its small modules
    embeds, pos = prompt(model, 0)
    out = speculative_generate(model, head, embeds, pos, 12, None, tree=TreeConfig(4, 4, 12))
    assert len(out.tokens) == 12 and sum(out.accept_lengths) == 11


def test_a_windowed_draft_is_lossless_and_sees_only_the_prompt_tail():
    model = tiny_vlm(vocab=24)
    torch.manual_seed(1)
    head = DraftHead(DraftConfig.for_target(model.cfg.text, context=5), model).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.5)
            p.copy_(p.bfloat16().float())  # values bf16 holds: the native draft steps read them as bf16 panels
    for seed, cfg in [(0, TreeConfig(4, 4, 12)), (2, TreeConfig.chain(3))]:
        embeds, pos = prompt(model, seed, pruned=seed == 2)
        out = speculative_generate(model, head, embeds, pos, 30, EOS, tree=cfg)
        assert out.tokens == generate(model, embeds, pos, 30, EOS).tokens
    # the first extend filled draft slots 0..4 with the last 5 prompt pairs, at their own positions
    got = head.layer.self_attn.kv_cache.k[:, :, :5].clone()
    model.language_model.setup_cache(1, 160)
    logits, hidden = prefill(model, embeds, pos)
    head.setup_cache(64)
    head.extend(
        hidden[0, 7:], torch.cat([embeds[0, 8:], model.language_model.embed_tokens(logits.argmax(-1))]), pos[0, 7:], 0
    )
    # the draft's K/V after a prefill against an extend over the prefill's own states: reordered fp32 sums.
    torch.testing.assert_close(got, head.layer.self_attn.kv_cache.k[:, :, :5], rtol=1e-4, atol=1e-4)
