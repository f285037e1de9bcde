"""The training-free pruners (DART, DivPrune, CDPruner) and `--prune METHOD --keep R`, on CPU, fp32.

Each rule is checked on a small hand-made case whose right answer is known, its greedy loop against a brute-force
version of the same rule, the budgets (exactly keep_count(N, r) kept, r = 1 keeps all, at least one, per-camera
shares), DART's keys and features against an uncached forward, and every method end to end on drive-tiny.
"""

from __future__ import annotations

import argparse
import math
import time

import pytest
import torch
from test_tokens import tiny_vlm as tokens_tiny_vlm

from litevlm import LiteVLMError, Pipeline
from litevlm.model.generate import pruned_prefill
from litevlm.model.layers import rope_cos_sin
from litevlm.model.vlm import VLM
from litevlm.select.pruners import (
    METHODS,
    PruneConfig,
    apply_pruner,
    block_sizes,
    cdpruner_prune,
    cdpruner_select,
    dart_pivots,
    dart_pruning,
    dart_select,
    divprune_prune,
    divprune_select,
    dpp_greedy_map,
    instruction_relevance,
    random_prune,
)
from litevlm.select.tokens import Pruning, keep_count, select_by_scores, view_budgets, visual_index

SPANS = [("CAM_FRONT", 2, 18), ("CAM_BACK", 20, 36), ("CAM_BACK_LEFT", 38, 54)]  # 3 views of 16 tokens
T = 60  # the prompt: labels between the views, 6 text tokens after the last


def unit(*v: float) -> torch.Tensor:
    x = torch.tensor(v, dtype=torch.float32)
    return x / x.norm()


# ---------------------------------------------------------------------------------------------
# DivPrune
# ---------------------------------------------------------------------------------------------


def test_divprune_takes_the_farthest_points():
    # four near-copies of one direction, and two directions far from it and from each other
    angles = [0.0, 0.01, 0.02, 0.03, 2.0, 4.0]
    feats = torch.tensor([[math.cos(a), math.sin(a)] for a in angles]) * torch.tensor([[3.0], [1], [2], [1], [5], [1]])
    # 4.0 first (its nearest neighbour, 2.0, is farthest), then the copy farthest from it (0.03), then 2.0
    assert divprune_select(feats, 3).tolist() == [3, 4, 5]
    kept = divprune_select(feats, 4).tolist()
    assert {4, 5} <= set(kept) and len(set(kept) & {0, 1, 2, 3}) == 2  # a second copy only once the far ones are in


def brute_force_max_min(dist: torch.Tensor, k: int) -> list[int]:
    """The max-min greedy written directly: every step recomputes each candidate's distance to the chosen set."""
    n = dist.shape[0]
    off = dist + torch.diag(torch.full((n,), float("inf")))
    chosen = [int(off.min(1).values.argmax())]
    while len(chosen) < k:
        rest = [i for i in range(n) if i not in chosen]
        chosen.append(max(rest, key=lambda i: min(float(dist[i, j]) for j in chosen)))
    return sorted(chosen)


def test_divprune_equals_the_greedy_written_directly():
    torch.manual_seed(0)
    feats = torch.randn(30, 8)
    f = torch.nn.functional.normalize(feats, dim=-1)
    for k in (1, 2, 7, 15, 29):
        assert divprune_select(feats, k).tolist() == brute_force_max_min(1 - f @ f.T, k)


def test_divprune_keeps_distinct_tokens_among_exact_copies():
    feats = torch.ones(10, 4)
    kept = divprune_select(feats, 6)
    assert kept.tolist() == sorted(set(kept.tolist())) and kept.numel() == 6


# ---------------------------------------------------------------------------------------------
# DART
# ---------------------------------------------------------------------------------------------


def dart_case() -> torch.Tensor:
    e = torch.eye(4)
    torch.manual_seed(0)
    dups = e[0] + 0.05 * torch.randn(4, 4)
    return torch.stack([e[0], *dups, e[1] - 0.1 * e[0], e[2], -e[0]])  # pivot, 4 near-copies, 3 others


def test_dart_drops_the_near_duplicates_of_its_pivots():
    feats = dart_case()
    kept = dart_select(feats, 3, torch.tensor([0])).tolist()
    assert kept == [0, 5, 7]  # the pivot, then the two tokens least like it: never one of its copies 1..4
    kept = dart_select(feats, 4, torch.tensor([0])).tolist()
    assert kept == [0, 5, 6, 7]


def test_dart_text_pivots_claim_their_share():
    e = torch.eye(4)
    feats = torch.stack([e[0], e[0] + 0.01 * e[3], e[1], e[2] - 0.2 * e[1], -e[0]])
    # k = 3: the visual pivot 0 is kept and claims 4 (opposite it); the text pivot e1 claims 3 (unlike e1)
    assert dart_select(feats, 3, torch.tensor([0]), text_pivots=e[1:2]).tolist() == [0, 3, 4]


def test_dart_pivots_are_the_largest_key_norms_and_capped_by_the_budget():
    norms = torch.tensor([1.0, 9.0, 3.0, 7.0, 5.0])
    assert dart_pivots(norms, 2).tolist() == [1, 3]
    assert dart_pivots(norms, 9).numel() == 5
    feats = torch.randn(5, 3)
    assert dart_select(feats, 1, dart_pivots(norms, 4)).tolist() == [1]  # fewer tokens than pivots: the most salient


def tiny_vlm(layers: int = 3) -> VLM:
    """test_tokens' tiny decoder (seed 0, sharpened attention), with a 128-slot cache."""
    model = tokens_tiny_vlm(layers=layers)
    model.language_model.setup_cache(1, 128)
    return model


@pytest.mark.parametrize("per_view", [False, True])
def test_dart_hook_reads_layer_k_minus_1_keys_and_the_normed_layer_k_input(per_view):
    """What the hook chooses inside the pruned prefill equals DART's rule on an uncached forward: pivots by the L1
    norm of layer K-1's keys, duplicates on the final-normed input of layer K."""
    model, k, r = tiny_vlm(), 2, 0.3
    lm = model.language_model
    torch.manual_seed(1)
    embeds, positions = torch.randn(1, T, 48), torch.arange(T)[None]
    with torch.no_grad():
        x_in = lm(embeds, positions, end_layer=k - 1)  # input of layer K-1, no cache
        x = lm(embeds, positions, end_layer=k)  # input of layer K
        layer = lm.layers[k - 1]
        cos, sin = rope_cos_sin(positions, lm.cfg.head_dim, lm.cfg.rope_theta, embeds.dtype)
        keys = layer.self_attn.qkv(layer.input_layernorm(x_in), cos, sin)[1]  # (1, Hkv, T, D)
        norms = keys[0].transpose(0, 1).reshape(T, -1).abs().sum(-1)
        h = lm.norm(x[0])
        vis = visual_index(SPANS)
        text = h[54 + dart_pivots(norms[54:], 4)]
        if per_view:
            expected = torch.cat(
                [
                    s + dart_select(h[vis][s : s + 16], kv, dart_pivots(norms[vis][s : s + 16], 4), text)
                    for s, kv in zip((0, 16, 32), view_budgets([16, 16, 16], r))
                ]
            )
        else:
            expected = dart_select(h[vis], keep_count(48, r), dart_pivots(norms[vis], 4), text)
        hook = dart_pruning(model, SPANS, r, layer=k, per_view=per_view)
        seen = []
        watched = Pruning(hook.layer, lambda y: seen.append(hook.keep(y)) or seen[-1], hook.stage)
        out = pruned_prefill(model, embeds, positions, watched)
    assert hook.stage == "select_tokens" and hook.layer == 2
    kept_visual = torch.isin(vis, seen[0]).nonzero().squeeze(1)
    assert kept_visual.tolist() == sorted(expected.tolist())
    assert out.kept_count == T - 48 + keep_count(48, r)  # every text token kept


def test_dart_refuses_a_layer_the_decoder_does_not_have():
    with pytest.raises(LiteVLMError, match="3 layers"):
        dart_pruning(tiny_vlm(layers=3), SPANS, 0.5, layer=3)


# ---------------------------------------------------------------------------------------------
# CDPruner
# ---------------------------------------------------------------------------------------------


def test_cdpruner_prefers_relevant_and_diverse_tokens():
    e = torch.eye(4)
    feats = torch.stack([e[0], e[0] + 0.02 * e[3], e[1], e[2]])
    relevance = torch.tensor([1.0, 1.0, 0.9, 0.05])  # 1 is a copy of 0; 3 is irrelevant

    def one_of_the_copies_and(kept: torch.Tensor, others: set[int]) -> bool:
        kept = set(kept.tolist())
        return len(kept & {0, 1}) == 1 and kept - {0, 1} == others

    assert one_of_the_copies_and(cdpruner_select(feats, relevance, 2), {2})  # not the copy, not the irrelevant one
    assert one_of_the_copies_and(cdpruner_select(feats, relevance, 3), {2, 3})  # diverse beats redundant while it can
    # relevance from the instruction's embeddings: a question about e0 and e1 makes 3 the least relevant
    rel = instruction_relevance(feats, torch.stack([e[0], e[1]]))
    assert int(rel.argmin()) == 3 and float(rel.max()) == pytest.approx(1.0, abs=1e-3)
    assert one_of_the_copies_and(cdpruner_select(feats, rel, 2), {2})


def test_dpp_greedy_map_equals_the_greedy_on_determinants():
    torch.manual_seed(0)
    f = torch.nn.functional.normalize(torch.randn(9, 12), dim=-1)
    q = torch.rand(9) + 0.1
    kernel = q[:, None] * (f @ f.T) * q[None, :]
    chosen: list[int] = []
    for _ in range(6):  # each step: the token whose addition maximises det(L_S)
        rest = [i for i in range(9) if i not in chosen]
        chosen.append(max(rest, key=lambda i: float(torch.det(kernel[chosen + [i]][:, chosen + [i]].double()))))
    assert dpp_greedy_map(kernel, 6).tolist() == chosen


def test_cdpruner_past_the_kernel_rank_keeps_distinct_tokens():
    feats = torch.eye(3).repeat(4, 1)  # 12 tokens of rank 3
    kept = cdpruner_select(feats, torch.ones(12), 7)
    assert len(set(kept.tolist())) == 7
    assert {int(i) % 3 for i in cdpruner_select(feats, torch.ones(12), 3)} == {0, 1, 2}


# ---------------------------------------------------------------------------------------------
# Budgets and edge cases
# ---------------------------------------------------------------------------------------------


def prompt(seed: int = 0):
    torch.manual_seed(seed)
    return torch.randn(1, T, 8), torch.arange(T)[None]


def prune_all(method: str, r: float, per_view: bool = False):
    embeds, positions = prompt()
    if method == "divprune":
        return divprune_prune(embeds, positions, SPANS, r, per_view)
    if method == "cdpruner":
        return cdpruner_prune(embeds, positions, SPANS, r, torch.randn(5, 8), per_view)
    return random_prune(embeds, positions, SPANS, r, torch.Generator().manual_seed(0), per_view)


@pytest.mark.parametrize("method", ["divprune", "cdpruner", "random"])
@pytest.mark.parametrize("r", [0.001, 0.3, 0.55, 1.0])
def test_exact_budget_text_kept_and_original_positions(method, r):
    embeds, positions = prompt()
    kept_embeds, kept_positions, kept = prune_all(method, r)
    vis = set(visual_index(SPANS).tolist())
    assert kept.numel() == T - 48 + keep_count(48, r)  # at least one visual token, exactly the budget
    assert set(range(T)) - vis <= set(kept.tolist())  # every text token
    assert torch.equal(kept_positions[0], kept) and torch.equal(kept_embeds[0], embeds[0, kept])


@pytest.mark.parametrize("method", ["divprune", "cdpruner", "random"])
def test_per_view_budgets_keep_r_of_each_camera(method):
    r = 0.3
    kept = set(prune_all(method, r, per_view=True)[2].tolist())
    per_view = [len(kept & set(range(s, e))) for _, s, e in SPANS]
    assert per_view == view_budgets([16, 16, 16], r) and sum(per_view) == keep_count(48, r)
    assert all(n >= 4 for n in per_view)  # about r of each camera (0.3 * 16 = 4.8)


def test_each_method_spreads_its_budget_as_its_authors_do_on_multi_crop_input():
    """CDPruner's default is per crop (its reference prunes every crop of a multi-crop image alike); DivPrune, DART
    and random rank all the visual tokens at once; uniform is per view; any of the pruners can be asked otherwise."""
    assert PruneConfig("cdpruner", 0.3).budget_split == "crop" and PruneConfig("cdpruner", 0.3).name.endswith(
        "per crop"
    )
    for m in ("divprune", "dart", "random"):
        assert PruneConfig(m, 0.3).budget_split == "all" and "per" not in PruneConfig(m, 0.3).name
    assert PruneConfig("uniform", 0.3).budget_split == "view"
    assert PruneConfig("cdpruner", 0.3, split="all").budget_split == "all"
    assert PruneConfig.from_options("divprune", 0.3, per_view=True).budget_split == "view"
    assert PruneConfig.from_options("divprune", 0.3, split="crop").budget_split == "crop"
    with pytest.raises(LiteVLMError, match="cannot go with --prune-split crop"):
        PruneConfig.from_options("divprune", 0.3, per_view=True, split="crop")


def test_block_sizes_cut_each_view_into_its_tiles():
    spans = [("CAM_FRONT", 3, 35), ("CAM_BACK", 40, 56), ("CAM_LEFT", 60, 80)]  # 32, 16 and 20 tokens
    assert block_sizes(spans, "all", 16) is None
    assert block_sizes(spans, "view", 16) == [32, 16, 20]
    assert block_sizes(spans, "crop", 16) == [16, 16, 16, 16, 4]  # a view's tokens are tile after tile


@pytest.mark.parametrize("method", ["divprune", "cdpruner", "random"])
def test_per_crop_budgets_keep_r_of_each_tile(method):
    """Two 8-token tiles a view: with the tiles' sizes as blocks, each tile keeps its share of the budget."""
    r = 0.3
    kept = set(prune_all(method, r, per_view=[8] * 6)[2].tolist())
    tiles = [(s + o, s + o + 8) for _, s, _ in SPANS for o in (0, 8)]
    per_tile = [len(kept & set(range(a, b))) for a, b in tiles]
    assert per_tile == view_budgets([8] * 6, r) and sum(per_tile) == keep_count(48, r)


def test_cdpruner_prunes_each_tile_of_a_drive_tiny_prompt_by_default(images):
    """Through the pipeline: CDPruner's default keeps about r of every tile; asked for "all", one DPP over them all."""
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=2, prune="cdpruner", keep=0.25)
    tpt = pipe.model.cfg.tokens_per_tile
    ans = pipe.answer(QUESTION, images)
    for cam, kept in ans.kept_tokens.items():
        tiles = ans.tokens_per_view[cam] // tpt
        counts = torch.bincount(torch.tensor(kept) // tpt, minlength=tiles).tolist()
        assert all(c >= int(0.25 * tpt) for c in counts), (cam, counts)
    assert pipe.pruner.name == "cdpruner r=0.25 per crop"


def test_selections_cover_every_budget_from_one_to_all():
    torch.manual_seed(0)
    feats = torch.randn(16, 6)
    for k in range(1, 17):
        for kept in (
            divprune_select(feats, k),
            dart_select(feats, k, dart_pivots(feats.norm(dim=1), 4), feats[:2]),
            cdpruner_select(feats, torch.rand(16), k),
        ):
            assert kept.tolist() == sorted(set(kept.tolist())) and kept.numel() == k
    assert divprune_select(feats, 40).tolist() == list(range(16))  # k >= N keeps all
    with pytest.raises(LiteVLMError, match="at least one"):
        divprune_select(feats, 0)


def test_r_one_returns_the_prompt_as_it_is():
    model, embeds, positions = tiny_vlm(), torch.randn(1, T, 48), torch.arange(T)[None]
    for method in ("dart", "divprune", "cdpruner", "random", "uniform"):
        out = apply_pruner(PruneConfig(method, 1.0), model, embeds, positions, SPANS, torch.tensor([1, 2]))
        assert out[0] is embeds and out[1] is positions and out[2] is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="visionzip", keep_ratio=0.5), "unknown token pruning method 'visionzip'"),
        (dict(method="dart", keep_ratio=0.0), r"in \(0, 1\]"),
        (dict(method="divprune", keep_ratio=1.5), r"in \(0, 1\]"),
        (dict(method="divprune", keep_ratio=0.5, layer=2), "prunes before the decoder"),
        (dict(method="dart", keep_ratio=0.5, layer=0), ">= 1"),
        (dict(method="fastv", keep_ratio=0.5, split="view"), "per-camera budgets"),
        (dict(method="uniform", keep_ratio=0.5, split="all"), "per-camera budgets"),
        (dict(method="divprune", keep_ratio=0.5, split="camera"), "unknown budget split 'camera'"),
        (dict(method="random", keep_ratio=0.5, theta=0.5), "theta"),
    ],
)
def test_bad_configs_say_what_is_wrong(kwargs, message):
    with pytest.raises(LiteVLMError, match=message):
        PruneConfig(**kwargs)


def test_from_options_needs_both_method_and_ratio():
    assert PruneConfig.from_options(None, None) is None
    assert PruneConfig.from_options("dart", 0.3).decoder_layer == 2
    assert PruneConfig.from_options("fastv", 0.3, 1).decoder_layer == 1
    assert PruneConfig.from_options("cdpruner", 0.3).decoder_layer is None
    assert PruneConfig.from_options("token-selector", 0.3, 2).decoder_layer == 2
    assert PruneConfig.from_options("token-selector", 0.3).decoder_layer is None
    for args, message in [
        (("dart", None), "needs --keep"),
        ((None, 0.3), "needs --prune"),
        ((None, None, 2), "go with --prune"),
        ((None, None, None, True), "go with --prune"),
    ]:
        with pytest.raises(LiteVLMError, match=message):
            PruneConfig.from_options(*args)


# ---------------------------------------------------------------------------------------------
# End to end on drive-tiny
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def images():
    from litevlm.data.synthetic import make_frame, render_views

    return render_views(make_frame(1, 0), size=(160, 90))


QUESTION = "Is there a red car to the front of the ego car?"


@pytest.fixture(scope="module")
def baseline(images):
    return Pipeline.from_pretrained("drive-tiny", max_new_tokens=8).answer(QUESTION, images)


@pytest.mark.parametrize(
    "method, per_view",
    [(m, False) for m in METHODS] + [(m, True) for m in ("dart", "divprune", "cdpruner", "random")],
)
def test_every_method_answers_within_its_budget_on_drive_tiny(method, per_view, images, baseline):
    r = 0.3
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=8, prune=method, keep=r, prune_per_view=per_view)
    if method == "fastv":
        assert pipe.fastv == (2, r) and pipe.pruner is None  # the FastV path of --fastv-k 2 --fastv-r R
    elif method == "token-selector":
        assert pipe.token_selector is not None and pipe.keep_ratio == r and pipe.pruner is None
    else:
        assert pipe.pruner == PruneConfig(method, r, split="view" if per_view else None)
    ans = pipe.answer(QUESTION, images)
    n = baseline.num_visual_tokens
    assert n == 96 and ans.text and 1 <= len(ans.tokens) <= 8
    assert ans.num_visual_tokens == keep_count(n, r)
    assert ans.input_tokens == baseline.input_tokens - n + keep_count(n, r)  # every text token kept
    assert "select_tokens" in ans.timings_ms and "prefill" in ans.timings_ms


@pytest.mark.parametrize(
    "method, module, rule",
    [
        ("token-selector", "litevlm.select.tokens.TokenSelector", "head_scores"),
        ("fastv", "litevlm.select.tokens", "fastv_scores"),
        ("dart", "litevlm.select.pruners", "dart_select"),
        ("divprune", "litevlm.select.pruners", "divprune_select"),
        ("cdpruner", "litevlm.select.pruners", "cdpruner_select"),
        ("random", "litevlm.select.pruners", "random_prune"),
        ("uniform", "litevlm.select.pruners", "uniform_select"),
    ],
)
def test_every_methods_selection_is_timed_as_select_tokens_not_prefill(method, module, rule, images, monkeypatch):
    """Each method's own ranking, made an hour slower on the clock the stages read (moved on, not waited for), shows
    up in select_tokens and nowhere in the prefill: FastV's attention row and DART's duplicates inside the decoder
    too. The prefill must come out within the real wall time around the answer, which holds no hour."""
    import importlib

    owner_path, _, attr = module.rpartition(".") if module.endswith("TokenSelector") else (module, "", "")
    owner = getattr(importlib.import_module(owner_path), attr) if attr else importlib.import_module(module)
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=2, prune=method, keep=0.5)
    pipe.answer(QUESTION, images)  # warm
    real_clock, jumped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jumped[0])
    t0 = real_clock()
    plain = pipe.answer(QUESTION, images).timings_ms
    plain_wall = (real_clock() - t0) * 1e3
    real = getattr(owner, rule)
    calls = []
    hour = 3600.0

    def slow(*args, **kwargs):
        calls.append(rule)
        jumped[0] += hour
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, rule, slow)
    t0 = real_clock()
    timed = pipe.answer(QUESTION, images).timings_ms
    wall = (real_clock() - t0) * 1e3
    assert calls, f"{method}'s ranking {rule} was not called"
    assert timed["select_tokens"] >= 1000 * hour * len(calls)
    assert timed["prefill"] <= wall and plain["prefill"] <= plain_wall  # the hours are not in the prefill


def test_the_pipeline_refuses_mixed_or_impossible_pruning():
    with pytest.raises(LiteVLMError, match="replaces --select-tokens"):
        Pipeline.from_pretrained("drive-tiny", prune="dart", keep=0.3, select_tokens=0.5)
    with pytest.raises(LiteVLMError, match="needs --keep"):
        Pipeline.from_pretrained("drive-tiny", prune="dart")
    with pytest.raises(LiteVLMError, match="6 layers"):
        Pipeline.from_pretrained("drive-tiny", prune="dart", keep=0.3, prune_layer=6)


def test_a_prompt_reading_selectors_choice_applies_inside_the_decoder(full_model_dir, tmp_path, images):
    """--prune token-selector --prune-layer K: the choice a prompt-reading TokenSelector makes before the decoder is
    applied before decoder layer K instead, layers [0, K) reading the whole prompt: the same tokens kept, the choice
    timed as select_tokens, the answers lossless under speculation. A selector that reads layer 0's output, a layer
    outside the decoder, or a layer without a selector are refused."""
    import shutil

    from litevlm.models import load_model
    from litevlm.select.tokens import SelectorConfig, TokenSelector

    d = tmp_path / "model"
    shutil.copytree(full_model_dir, d)
    torch.manual_seed(3)
    sel = TokenSelector.from_model(load_model(d).model, SelectorConfig(reads="prompt"))
    with torch.no_grad():
        sel.mlp[2].weight.normal_(0, 0.5)  # a head whose choice is not the untrained one's
    sel.save(d)
    before = Pipeline.from_pretrained(d, select_tokens=0.5, max_new_tokens=10)
    inside = Pipeline.from_pretrained(d, prune="token-selector", keep=0.5, prune_layer=1, max_new_tokens=10)
    spec = Pipeline.from_pretrained(
        d, prune="token-selector", keep=0.5, prune_layer=1, speculative=True, max_new_tokens=10
    )
    assert inside.config_name == "tokens r=0.5 K=1" and before.config_name == "tokens r=0.5"
    for q in (QUESTION, "What is the moving status of <c1,CAM_BACK,800.0,500.0>?"):
        p = before.prompt(q, images)
        pruned, pruned_pos, none = before.selection.select(before.model, p, q, before.format.tiling)
        embeds, positions, hook = inside.selection.select(inside.model, p, q, inside.format.tiling)
        assert none is None and embeds is p.embeds and positions is p.positions
        assert (hook.layer, hook.stage) == (1, "select_tokens")
        kept = hook.keep(None)
        assert torch.equal(pruned, p.embeds[:, kept]) and torch.equal(pruned_pos, p.positions[:, kept])
        a, b, c = inside.answer(q, images), spec.answer(q, images), before.answer(q, images)
        assert a.tokens == b.tokens
        assert a.num_visual_tokens == c.num_visual_tokens < p.num_visual_tokens
        assert a.input_tokens == c.input_tokens == kept.numel()
        assert a.timings_ms["select_tokens"] > 0
    with pytest.raises(LiteVLMError, match="layer 0's output"):
        Pipeline.from_pretrained("drive-tiny", prune="token-selector", keep=0.3, prune_layer=1)
    with pytest.raises(LiteVLMError, match=r"pruning layer in 1\.\.1"):
        Pipeline.from_pretrained(d, prune="token-selector", keep=0.3, prune_layer=2)
    with pytest.raises(LiteVLMError, match="needs the TokenSelector"):
        Pipeline(before.model, before.tokenizer, select_layer=1)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def _ask(*flags: str) -> argparse.Namespace:
    from litevlm.cli import build_parser

    return build_parser().parse_args(["ask", "--images", "x", "--question", "q", *flags])


def test_cli_parses_prune_and_keep():
    from litevlm.options import pipeline_options

    opts = pipeline_options(_ask("--prune", "dart", "--keep", "0.3"))
    assert (opts["prune"], opts["keep"], opts["prune_layer"], opts["prune_per_view"]) == ("dart", 0.3, None, False)
    opts = pipeline_options(_ask("--prune", "fastv", "--keep", "0.7", "--prune-layer", "1"))
    assert (opts["prune"], opts["keep"], opts["prune_layer"]) == ("fastv", 0.7, 1)
    assert pipeline_options(_ask("--prune", "cdpruner", "--keep", "0.5", "--per-view"))["prune_per_view"] is True
    assert (
        pipeline_options(_ask("--prune", "cdpruner", "--keep", "0.5", "--prune-split", "all"))["prune_split"] == "all"
    )
    with pytest.raises(LiteVLMError, match="go with --prune"):
        pipeline_options(_ask("--prune-split", "crop"))
    # --litevlm's TokenSelector gives way to the pruning asked for; its other stages stay on
    full = pipeline_options(_ask("--litevlm", "--prune", "divprune", "--keep", "0.4"))
    assert (full["select_tokens"], full["prune"], full["select_views"], full["speculative"]) == (
        None,
        "divprune",
        True,
        True,
    )
    old = pipeline_options(_ask("--select-tokens", "0.8", "--fastv-k", "1", "--fastv-r", "0.3"))
    assert (old["select_tokens"], old["fastv_k"], old["fastv_r"], old["prune"]) == (0.8, 1, 0.3, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prune", "visionzip", "--keep", "0.3"], "unknown token pruning method"),
        (["--prune", "dart", "--keep", "1.5"], r"\(0, 1\]"),
        (["--prune", "dart"], "needs --keep"),
        (["--keep", "0.3"], "needs --prune"),
        (["--per-view"], "go with --prune"),
    ],
)
def test_cli_refuses_bad_pruning_before_loading_a_model(flags, message, capsys):
    from litevlm.cli import main
    from litevlm.options import pipeline_options

    with pytest.raises(LiteVLMError, match=message):
        pipeline_options(_ask(*flags))
    assert main(["ask", "--images", "x", "--question", "q", "--model", "no-such-model", *flags]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_help_names_every_method():
    from litevlm.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("ask", "eval", "serve", "quantize"):  # every command that builds a pipeline
        flags = {f: a for a in commands[name]._actions for f in a.option_strings}
        assert {"--prune", "--keep", "--prune-layer", "--per-view"} <= set(flags)
    assert all(m in flags["--prune"].help for m in METHODS)


def test_dpp_greedy_map_takes_its_first_tokens_then_the_greedy_on_determinants():
    torch.manual_seed(1)
    f = torch.nn.functional.normalize(torch.randn(9, 12), dim=-1)
    q = torch.rand(9) + 0.1
    kernel = q[:, None] * (f @ f.T) * q[None, :]
    chosen: list[int] = [7, 2]
    for _ in range(3):
        rest = [i for i in range(9) if i not in chosen]
        chosen.append(max(rest, key=lambda i: float(torch.det(kernel[chosen + [i]][:, chosen + [i]].double()))))
    assert dpp_greedy_map(kernel, 5, torch.tensor([7, 2])).tolist() == chosen
    with pytest.raises(LiteVLMError, match="take first"):
        dpp_greedy_map(kernel, 1, torch.tensor([7, 2]))


def test_a_diverse_selection_gives_up_a_near_duplicate_for_other_evidence():
    e = torch.eye(4)
    feats = torch.stack([e[0], e[0] + 0.01 * e[1], e[2], e[3]])  # tokens 0 and 1 are near copies
    scores = torch.tensor([3.0, 2.9, 2.5, -12.0])  # log-scores: 3 is irrelevant
    assert select_by_scores(scores, [4], 0.5).tolist() == [0, 1]  # top scores: the copy
    assert select_by_scores(scores, [4], 0.5, features=feats, diversity=1.0).tolist() == [0, 2]
    assert select_by_scores(scores, [4], 0.75, features=feats, diversity=1.0).tolist() == [0, 1, 2]  # not 3
    assert select_by_scores(scores, [4], 0.5, features=feats, diversity=1e-3).tolist() == [0, 1]  # tau -> 0: top-k
    # the per-view quota still holds: one token of the second view, then the DPP over the rest
    assert select_by_scores(scores, [3, 1], 0.75, 1, features=feats, diversity=1.0).tolist() == [0, 2, 3]
    with pytest.raises(LiteVLMError, match="features"):
        select_by_scores(scores, [4], 0.5, diversity=1.0)
