"""Token selection (TokenSelector, FastV, baselines) on tiny random VLMs, CPU, fp32.

The invariants: kept tokens keep their original positions and every text token survives; the
per-view quota and the exact budget hold; r = 1 is the unpruned computation bit for bit; FastV's
one attention row equals the row of the full attention matrix; and decoding after FastV's
compacted-cache prefill equals a no-cache forward of the same scheme written as attention masks.
"""

from __future__ import annotations

import pytest
import torch

from litevlm.config import TextConfig, VisionConfig, VLMConfig
from litevlm.errors import LiteVLMError
from litevlm.model.generate import fastv_generate, fastv_prefill, generate, prefill, selector_prefill
from litevlm.model.vlm import VLM
from litevlm.select.tokens import (
    SelectorConfig,
    TokenSelector,
    attention_rows,
    fastv_scores,
    keep_count,
    layer_rows,
    random_select,
    select_by_scores,
    uniform_select,
    visual_index,
)

TPV = 16  # tokens per view, as drive-tiny
VIEWS = ["CAM_FRONT", "CAM_BACK", "CAM_BACK_LEFT"]


def tiny_vlm(seed: int = 0, layers: int = 3) -> VLM:
    torch.manual_seed(seed)
    cfg = VLMConfig(
        vision=VisionConfig(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, image_size=28, patch_size=7
        ),
        text=TextConfig(
            vocab_size=96,
            hidden_size=48,
            num_layers=layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=96,
            rope_theta=10000.0,
            max_position_embeddings=512,
        ),
        image_token_id=95,
        img_start_id=93,
        img_end_id=94,
        eos_token_id=92,
        pad_token_id=0,
    )
    model = VLM(cfg).eval()
    for p in model.language_model.parameters():  # sharper attention than the default init gives
        if p.ndim == 2:
            p.data.normal_(0, 0.15)
    model.language_model.setup_cache(1, 256)
    return model


def tiny_prompt(model: VLM, seed: int = 0, views=VIEWS, question_len: int = 9):
    """embeds (1, T, C), positions (1, T), view_spans: a marker + <img> + TPV visual + </img> per view, then a
    question."""
    g = torch.Generator().manual_seed(seed)
    ids, spans = [1, 2], []
    for i, cam in enumerate(views):
        ids += [10 + i, model.cfg.img_start_id]
        spans.append((cam, len(ids), len(ids) + TPV))
        ids += [model.cfg.image_token_id] * TPV + [model.cfg.img_end_id, 3]
    ids += torch.randint(20, 90, (question_len,), generator=g).tolist() + [4, 5]
    ids = torch.tensor([ids])
    visual = torch.randn(len(views) * TPV, model.cfg.text.hidden_size, generator=g)
    with torch.no_grad():
        embeds = model.embed(ids, visual)
    positions = torch.arange(ids.shape[1])[None]
    return embeds, positions, spans


def full_attention_rows(layer, x, positions, rows):
    """Reference: the full causal T x T attention of `layer` (head mean), then the wanted rows."""
    attn = layer.self_attn
    cfg = attn.cfg
    from litevlm.model.layers import rope_cos_sin

    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    q, k, _ = attn.qkv(layer.input_layernorm(x), cos, sin)  # (B, H, T, D), (B, Hkv, T, D)
    k = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
    t = x.shape[1]
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim**0.5  # (B, H, T, T)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1).mean(1)[:, rows]  # (B, n, T)


def test_attention_rows_equal_full_attention():
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    positions = positions + 7  # positions need not start at 0
    lm = model.language_model
    with torch.no_grad():
        x = lm(embeds, positions, start_layer=0, end_layer=1)
        rows = torch.tensor([5, 30, embeds.shape[1] - 1])
        got = attention_rows(lm.layers[1], x, positions, rows)
        want = full_attention_rows(lm.layers[1], x, positions, rows)
    # attention probabilities (0..1) from two codes (the selected rows alone, the full T x T softmax): fp32 sums of
    # another length, ~T eps ~ 1e-5 relative; a wrong row, position or mask moves them by O(1/T).
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # softmax rows sum to 1 up to the rounding of a length-T fp32 sum.
    assert torch.allclose(got.sum(-1), torch.ones(1, 3))


@pytest.mark.parametrize("k", [1, 2])
def test_fastv_row_equals_row_of_full_attention(k):
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    lm = model.language_model
    t = embeds.shape[1]
    with torch.no_grad():
        x = lm(embeds, positions, start_layer=0, end_layer=k - 1) if k > 1 else embeds  # layer k-1's input
        got = fastv_scores(model, x, positions, spans, k)
        want = full_attention_rows(lm.layers[k - 1], x, positions, torch.tensor([t - 1]))[0, 0, visual_index(spans)]
    # attention probabilities (0..1) from two codes (the selected rows alone, the full T x T softmax): fp32 sums of
    # another length, ~T eps ~ 1e-5 relative; a wrong row, position or mask moves them by O(1/T).
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("r", [0.05, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("quota", [0, 1, 3, 20])
def test_budget_and_quota_per_view(r, quota):
    sizes = [16, 16, 16, 16]
    g = torch.Generator().manual_seed(int(r * 100) + quota)
    scores = torch.rand(64, generator=g)
    scores[:16] += 5.0  # one view dominates: the quota must still feed the others
    kept = select_by_scores(scores, sizes, r, quota)
    k = keep_count(64, r)
    assert kept.numel() == k and torch.equal(kept, kept.sort().values) and kept.unique().numel() == k
    per_view = torch.bincount(kept // 16, minlength=4)
    assert (per_view >= min(quota, k // 4)).all()
    if quota == 0:
        assert set(kept.tolist()) == set(scores.topk(k).indices.tolist())


def test_keep_ratio_is_validated():
    with pytest.raises(LiteVLMError):
        keep_count(10, 0.0)
    with pytest.raises(LiteVLMError):
        keep_count(10, 1.5)


@pytest.mark.parametrize("method", ["selector", "random", "uniform"])
def test_kept_tokens_keep_original_positions(method):
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    positions = positions + 3
    sel = TokenSelector.from_model(model)
    r = 0.3
    if method == "selector":
        e, p, kept = sel.select(model, embeds, positions, spans, keep_ratio=r, min_per_view=2)
    elif method == "random":
        e, p, kept = random_select(embeds, positions, spans, r, 2, torch.Generator().manual_seed(0))
    else:
        e, p, kept = uniform_select(embeds, positions, spans, r)
    vis = visual_index(spans)
    text = torch.tensor([i for i in range(embeds.shape[1]) if i not in set(vis.tolist())])
    assert torch.equal(kept, kept.sort().values)
    assert set(text.tolist()) <= set(kept.tolist())  # every text token survives
    kept_vis = sorted(set(kept.tolist()) & set(vis.tolist()))
    assert len(kept_vis) == keep_count(vis.numel(), r)
    assert torch.equal(p, positions[:, kept]) and torch.equal(e, embeds[:, kept])  # original RoPE positions
    per_view = [sum(s <= i < e_ for i in kept_vis) for _, s, e_ in spans]
    assert min(per_view) >= (2 if method != "uniform" else 1)


def masked_reference(model, embeds, positions, keep_cols_by_layer):
    """No-cache forward over embeds with per-layer boolean key masks (S, S); returns logits (S, V)."""
    lm = model.language_model
    x = embeds
    n = len(lm.layers)
    for layer_i in range(n):
        mask = keep_cols_by_layer(layer_i)[None, None]
        x = lm(x, positions, mask=mask, start_layer=layer_i, end_layer=None if layer_i == n - 1 else layer_i + 1)
    return model.lm_head(x)[0]


def test_pruning_at_the_input_equals_masking_the_pruned_tokens():
    """A pruned prompt at its original positions computes what the full prompt computes with the pruned keys masked."""
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = TokenSelector.from_model(model)
    e, p, kept = sel.select(model, embeds, positions, spans, keep_ratio=0.4)
    with torch.no_grad():
        logits, _ = prefill(model, e, p)
        t = embeds.shape[1]
        allowed = torch.zeros(t, t, dtype=torch.bool)
        allowed[:, kept] = True
        allowed &= torch.ones(t, t, dtype=torch.bool).tril()
        allowed |= torch.eye(t, dtype=torch.bool)
        ref = masked_reference(model, embeds, positions, lambda _: allowed)
    # pruned prefill against a masked full forward: other shapes, fp32 sums reordered, ~eps x width of O(1) logits.
    torch.testing.assert_close(logits[0], ref[-1], atol=1e-5, rtol=1e-5)


def test_keep_ratio_one_is_the_unpruned_output():
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = TokenSelector.from_model(model)
    e, p, kept = sel.select(model, embeds, positions, spans, keep_ratio=1.0)
    assert torch.equal(e, embeds) and torch.equal(p, positions) and kept.numel() == embeds.shape[1]
    full = generate(model, embeds, positions, 12, eos_id=None)
    pruned = generate(model, e, p, 12, eos_id=None)
    assert pruned.tokens == full.tokens
    with torch.no_grad():
        want, _ = prefill(model, embeds, positions)
        for k in (1, 2):
            got = fastv_prefill(model, embeds, positions, spans, k, 1.0)
            assert got.kept_count == embeds.shape[1]
            assert torch.equal(got.logits, want)
        assert fastv_generate(model, embeds, positions, spans, 2, 1.0, 12, eos_id=None).tokens == full.tokens


def trained_looking_selector(model, shared_layer: bool = True, reads: str = "layer0") -> TokenSelector:
    """A selector whose head is not at its FastV-like init (MLP output and tag weights non-zero)."""
    torch.manual_seed(5)
    sel = TokenSelector.from_model(model, SelectorConfig(shared_layer=shared_layer, reads=reads))
    with torch.no_grad():
        sel.mlp[2].weight.normal_(0, 0.5)
        sel.query_gate.weight.normal_(0, 0.2)
    return sel


@pytest.mark.parametrize("method", ["fastv k=1", "fastv k=2", "selector"])
def test_pruned_decode_is_exact_for_the_compacted_cache(method):
    """Pruning inside the decoder (FastV at layer k, or the TokenSelector sharing layer 0, k = 1) + decode_step
    equals a no-cache forward of the same scheme written as attention masks:
    layers < k: prompt tokens see the whole prompt, generated tokens see the kept prompt tokens;
    layers >= k: everything sees only the kept prompt tokens (and the generated ones)."""
    model = tiny_vlm(seed=1)
    embeds, positions, spans = tiny_prompt(model, seed=1)
    t, n_new = embeds.shape[1], 6
    if method == "selector":
        k, sel = 1, trained_looking_selector(model)
        pre = selector_prefill(model, sel, embeds, positions, spans, 0.3)
        gen = generate(
            model,
            embeds,
            positions,
            n_new,
            None,
            prefilled=selector_prefill(model, sel, embeds, positions, spans, 0.3).prefilled(embeds, positions),
        )
        # it keeps what the same selector keeps when it prunes at the input
        assert torch.equal(pre.kept_index, sel.select(model, embeds, positions, spans, keep_ratio=0.3)[2])
    else:
        k = int(method[-1])
        gen = fastv_generate(model, embeds, positions, spans, k, 0.3, n_new, eos_id=None)
        pre = fastv_prefill(model, embeds, positions, spans, k, 0.3)
    assert gen.prompt_len == pre.kept_count == t - (len(spans) * TPV - keep_count(len(spans) * TPV, 0.3))
    step_logits = [pre.logits[0]]
    from litevlm.model.generate import decode_step

    with torch.no_grad():
        for i, tok in enumerate(gen.tokens[:-1]):
            logits, _ = decode_step(model, torch.tensor([[tok]]), pre.next_position + i, pre.kept_count + i)
            step_logits.append(logits[0])
        s = t + len(gen.tokens) - 1
        ids = torch.tensor([gen.tokens[:-1]])
        all_embeds = torch.cat([embeds, model.language_model.embed_tokens(ids)], 1)
        all_pos = torch.cat([positions, torch.arange(t, s)[None]], 1)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        kept_cols = torch.zeros(s, dtype=torch.bool)
        kept_cols[pre.kept_index] = True
        kept_cols[t:] = True
        late = causal & kept_cols[None, :] | torch.eye(s, dtype=torch.bool)
        early = late.clone()
        early[:t, :t] = causal[:t, :t]
        ref = masked_reference(model, all_embeds, all_pos, lambda layer_i: early if layer_i < k else late)
    got = torch.stack(step_logits)
    # FastV decoding step by step against one masked forward: other shapes, fp32 sums reordered.
    torch.testing.assert_close(got, ref[t - 1 :], atol=1e-5, rtol=1e-5)
    assert [int(x) for x in got.argmax(-1)] == gen.tokens


def test_untrained_selector_ranks_like_fastv_k2():
    """At init (all pooling on the last token, MLP zero) the selector's score is layer 1's attention row on layer 0's
    output: FastV K=2's ranking."""
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = TokenSelector.from_model(model, SelectorConfig(last_bonus=1e4))
    with torch.no_grad():
        got = sel.scores(embeds, positions, spans)[0].exp()
        x = model.language_model(embeds, positions, start_layer=0, end_layer=1)
        want = fastv_scores(model, x, positions, spans, 2)
    # exp(log-softmax) against softmax rows: the log and exp round-trip costs ~1e-6 relative per value, the two codes
    # sum in another order; 1e-4 of probabilities of O(1/T).
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_shared_layer_selector_scores_like_one_owning_a_copy_of_layer0():
    """The shared-layer selector reads the model's own layer 0 (not stored); with a copy of it and the same head,
    an owning selector scores the same."""
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    shared = trained_looking_selector(model)
    own = TokenSelector.from_model(model, SelectorConfig(shared_layer=False))
    assert not any(k.startswith("layer.") for k in shared.state_dict())
    assert any(k.startswith("layer.") for k in own.state_dict())
    missing, unexpected = own.load_state_dict(shared.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("layer.") for k in missing)
    with torch.no_grad():
        # the model's layer 0 and a copy of it: identical weights, but the model's layer may run fused and the copy as
        # modules: reordered fp32 sums.
        torch.testing.assert_close(
            shared.scores(embeds, positions, spans), own.scores(embeds, positions, spans), atol=1e-5, rtol=1e-5
        )
        # and the model's layer 0 is what it reads: change it, the shared scores move
        before = shared.scores(embeds, positions, spans)
        model.language_model.layers[0].mlp.down_proj.weight.mul_(3.0)
        assert not torch.allclose(shared.scores(embeds, positions, spans), before)
    with pytest.raises(LiteVLMError, match="use select"):
        selector_prefill(model, own, embeds, positions, spans, 0.5)
    with pytest.raises(LiteVLMError, match="another model"):
        selector_prefill(tiny_vlm(seed=3), shared, embeds, positions, spans, 0.5)
    with pytest.raises(LiteVLMError, match="bind"):
        TokenSelector(model.language_model.cfg).scores(embeds, positions, spans)


def test_layer_rows_are_the_layers_output_at_those_rows():
    """A decoder layer run only at some query rows (over every key) gives the rows of the whole layer's output."""
    from litevlm.model.layers import rope_cos_sin

    model = tiny_vlm()
    embeds, positions, _ = tiny_prompt(model)
    layer = model.language_model.layers[0]
    cfg = model.language_model.cfg
    rows = torch.tensor([0, 7, embeds.shape[1] - 3, embeds.shape[1] - 1])
    with torch.no_grad():
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, embeds.dtype)
        want = layer(embeds, cos, sin)[:, rows]
        torch.testing.assert_close(layer_rows(layer, embeds, positions, rows), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("question_len", [9, 70])
def test_native_prompt_scores_equal_the_head_on_the_prompt_view(question_len, monkeypatch):
    """A prompt-reading selector at inference scores in one native call (the rows before the question through one
    product with the norms folded in, the question rows alone through layer 0, then the head) exactly what its
    differentiable form scores, tags included, for a short question and for one long enough that its rows attend
    by blocks; and a change to layer 0 reaches the native scores (its packing is not kept stale)."""
    from litevlm.model import cpu_steps, native
    from litevlm.select import tokens

    if cpu_steps.backend() != "native":
        pytest.skip(f"the native CPU code is unavailable here ({native.error()})")
    calls = []
    real = native.ops()
    monkeypatch.setattr(tokens.native, "ops", lambda: calls.append(1) or real)
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model, question_len=question_len)
    sel = trained_looking_selector(model, reads="prompt")
    with torch.no_grad():
        sel.norm.weight.uniform_(0.5, 1.5)  # the head's norm unlike layer 0's: both are folded apart
        sel.tag_weight.copy_(torch.tensor([1.5, 0.5]))
    tags = torch.zeros(2, len(spans) * TPV)
    tags[0, 3], tags[1, 4] = 1.0, 1.0
    assert embeds.shape[1] - max(e for _, _, e in spans) >= (64 if question_len == 70 else 1)
    slow = sel.scores(embeds, positions, spans, tags)  # with grad: the modules
    with torch.no_grad():
        fast = sel.scores(embeds, positions, spans, tags)
    assert calls  # the native op ran
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.language_model.layers[0].input_layernorm.weight.mul_(1.5)
        moved = sel.scores(embeds, positions, spans, tags)
    torch.testing.assert_close(moved, sel.scores(embeds, positions, spans, tags).detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(moved, fast)


def test_an_embedding_reading_selector_runs_no_decoder_layer():
    """reads="embeds": the head reads the prompt's embeddings alone, the question's rows too (its queries and keys start
    from layer 0's, the projections that read those embeddings): no decoder layer runs, none is stored, a change to
    layer 0 leaves the scores as they are; it prunes before the decoder and its fast head equals the differentiable
    one."""
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = TokenSelector.from_model(model, SelectorConfig(reads="embeds", shared_layer=False))
    attn0 = model.language_model.layers[0].self_attn
    assert sel.layer is None and not any(n.startswith("layer.") for n, _ in sel.named_parameters())
    assert torch.equal(sel.q_proj.weight, attn0.q_proj.weight) and torch.equal(sel.k_proj.weight, attn0.k_proj.weight)
    with torch.no_grad():
        sel.mlp[2].weight.normal_(0, 0.5)
        sel.query_gate.weight.normal_(0, 0.2)
    assert not sel.prunes_inside
    with torch.no_grad():
        fast = sel.scores(embeds, positions, spans)
    slow = sel.scores(embeds, positions, spans)
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, sel.head_scores(embeds, positions, spans).detach(), atol=1e-5, rtol=1e-5)
    first = max(e for _, _, e in spans)
    kept_embeds, kept_pos, kept = sel.select(model, embeds, positions, spans, keep_ratio=0.3)
    assert kept_embeds.shape[1] == kept.numel() == embeds.shape[1] - (3 * TPV - keep_count(3 * TPV, 0.3))
    assert torch.equal(kept[kept >= first], torch.arange(first, embeds.shape[1]))  # the question is kept whole
    with torch.no_grad():
        model.language_model.layers[0].mlp.down_proj.weight.mul_(3.0)
        torch.testing.assert_close(sel.scores(embeds, positions, spans), fast)


def test_prompt_reading_selector_prunes_before_the_decoder_and_never_runs_layer0_on_the_views():
    """reads="prompt": the head reads the views as they enter the decoder and the question's rows as layer 0 leaves
    them (so a change to layer 0 moves its scores); it prunes the prompt before the decoder (no hook), keeping the
    question whole, and its fast inference head equals the differentiable one."""
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = TokenSelector.from_model(model, SelectorConfig(reads="prompt"))
    with torch.no_grad():
        sel.mlp[2].weight.normal_(0, 0.5)
        sel.query_gate.weight.normal_(0, 0.2)
    assert not sel.prunes_inside
    with pytest.raises(LiteVLMError, match="use select"):
        selector_prefill(model, sel, embeds, positions, spans, 0.5)
    first = max(e for _, _, e in spans)
    view = sel.prompt_view(embeds, positions, spans)
    assert torch.equal(view[:, :first], embeds[:, :first])  # the views are read as they enter the decoder
    x0 = model.language_model(embeds, positions, start_layer=0, end_layer=1)
    torch.testing.assert_close(view[:, first:], x0[:, first:], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        fast = sel.scores(embeds, positions, spans)
    slow = sel.scores(embeds, positions, spans)  # with grad: the differentiable path
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)
    kept_embeds, kept_pos, kept = sel.select(model, embeds, positions, spans, keep_ratio=0.3)
    assert kept_embeds.shape[1] == kept.numel() == embeds.shape[1] - (3 * TPV - keep_count(3 * TPV, 0.3))
    assert torch.equal(kept_pos[0], positions[0, kept])
    assert torch.equal(kept[kept >= first], torch.arange(first, embeds.shape[1]))  # the question is kept whole
    with torch.no_grad():
        model.language_model.layers[0].mlp.down_proj.weight.mul_(3.0)  # layer 0 moves: the question rows move
        assert not torch.allclose(sel.scores(embeds, positions, spans), fast)


@pytest.mark.parametrize("shared_layer,reads", [(True, "layer0"), (False, "layer0"), (True, "prompt")])
def test_selector_save_load_roundtrip(tmp_path, shared_layer, reads):
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = TokenSelector.from_model(
        model, SelectorConfig(keep_ratio=0.3, min_per_view=2, shared_layer=shared_layer, reads=reads)
    )
    with torch.no_grad():
        sel.mlp[2].weight.normal_()  # make the head non-trivial
    sel.save(tmp_path, recipe={"note": "test"})
    assert (tmp_path / "token_selector" / "selector.safetensors").is_file()
    back = TokenSelector.load(tmp_path, model)
    assert back.cfg == sel.cfg and back.meta["recipe"] == {"note": "test"}
    a = sel.select(model, embeds, positions, spans)[2]
    b = back.select(model, embeds, positions, spans)[2]
    assert torch.equal(a, b)
    other = tiny_vlm()
    other.language_model.cfg = TextConfig(vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2)
    with pytest.raises(LiteVLMError, match="hidden_size"):
        TokenSelector.load(tmp_path, other)
    with pytest.raises(LiteVLMError, match="no TokenSelector"):
        TokenSelector.load(tmp_path / "nowhere", model)
    if not shared_layer:  # written before the field existed: a selector owning its copy of layer 0
        import json

        meta_path = tmp_path / "token_selector" / "config.json"
        meta = json.loads(meta_path.read_text())
        del meta["selector"]["shared_layer"]
        meta_path.write_text(json.dumps(meta))
        assert not TokenSelector.load(tmp_path, model).cfg.shared_layer


@pytest.mark.parametrize("k", [1, 2])
def test_fastv_ranks_by_the_attention_of_the_layer_before_the_cut(k):
    """FastV as published: a cut before layer k keeps the visual tokens the last prompt token attends to most at
    layer k - 1. Layer k is made to attend elsewhere (its keys and queries reversed in sign on one head pair), so
    the two layers' top tokens differ, and the prefill keeps layer k - 1's."""
    model = tiny_vlm(seed=3)
    lm = model.language_model
    with torch.no_grad():
        lm.layers[k].self_attn.k_proj.weight.neg_()
        lm.layers[k].self_attn.k_proj.bias.neg_()
    embeds, positions, spans = tiny_prompt(model, seed=3)
    t, vis = embeds.shape[1], visual_index(spans)
    n_keep = keep_count(vis.numel(), 0.25)
    with torch.no_grad():
        before = lm(embeds, positions, start_layer=0, end_layer=k - 1) if k > 1 else embeds
        after = lm(embeds, positions, start_layer=0, end_layer=k)
        last = torch.tensor([t - 1])
        rank_before = full_attention_rows(lm.layers[k - 1], before, positions, last)[0, 0, vis]
        rank_after = full_attention_rows(lm.layers[k], after, positions, last)[0, 0, vis]
        want = set(vis[rank_before.topk(n_keep).indices].tolist())
        other = set(vis[rank_after.topk(n_keep).indices].tolist())
        assert want != other  # the hand-made case: layers k - 1 and k rank differently
        pre = fastv_prefill(model, embeds, positions, spans, k, 0.25)
    kept_visual = set(pre.kept_index.tolist()) & set(vis.tolist())
    assert kept_visual == want


def test_fastv_rejects_bad_k():
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    for k in (0, 3):
        with pytest.raises(LiteVLMError, match="FastV K"):
            fastv_prefill(model, embeds, positions, spans, k, 0.5)


def test_box_cells_and_tag_features_follow_the_token_grid():
    from litevlm.select.tokens import box_cells, tag_features

    # 1600x900 view -> 4x4 tokens of 400x225 px, row-major; with 2 tiles per view, 2 tiles of 4x4 side by side.
    assert box_cells((0, 0, 399, 224), 4, 1) == [0]
    assert box_cells((410, 460, 790, 670), 4, 1) == [9]
    assert box_cells((-50, 800, 1700, 950), 4, 1) == [12, 13, 14, 15]
    assert box_cells((820, 0, 990, 100), 4, 2) == [16]  # second tile, top-left cell
    spans = [("CAM_FRONT", 10, 26), ("CAM_BACK", 30, 46)]
    f = tag_features("What is <c4,CAM_BACK,520.5,495.3> doing? And <c9,CAM_FRONT_LEFT,10.0,10.0>?", spans, 4, 1)
    assert f.shape == (2, 32)
    assert f[0].nonzero().flatten().tolist() == [16 + 9]  # CAM_BACK starts at visual index 16; cell (row 2, col 1)
    assert sorted(f[1].nonzero().flatten().tolist()) == [16 + j for j in (4, 5, 6, 8, 10, 12, 13, 14)]
    assert tag_features("no tags here", spans, 4, 1).sum() == 0


def test_teacher_attention_equals_rows_of_the_full_attention():
    from litevlm.train.tokens import teacher_attention

    model = tiny_vlm(layers=4)
    embeds, positions, spans = tiny_prompt(model)
    answer = [30, 31, 32, 92]
    got = teacher_attention(model, embeds, positions, spans, answer, band=(1, 3), last_row_weight=0.25)
    lm = model.language_model
    t = embeds.shape[1]
    with torch.no_grad():
        x = torch.cat([embeds, lm.embed_tokens(torch.tensor([answer]))], 1)
        pos = torch.arange(x.shape[1])[None]
        want = torch.zeros(len(spans) * TPV)
        for layer_i in range(3):
            if layer_i >= 1:
                rows = full_attention_rows(lm.layers[layer_i], x, pos, torch.arange(t - 1, t + 3))[0][
                    :, visual_index(spans)
                ]
                want += 0.25 * rows[0] + 0.75 / 3 * rows[1:].sum(0)
            x = lm(x, pos, start_layer=layer_i, end_layer=layer_i + 1)
    # the label against its definition recomputed row by row: fp32 sums of another order and length.
    torch.testing.assert_close(got, want / want.sum(), atol=1e-6, rtol=1e-5)


def test_answer_saliency_is_the_loglik_gradient_of_each_tokens_attention_column():
    """The saliency label against finite differences of the answer's log-likelihood, each visual token's attention
    column biased by +-eps alone; and pruning the most salient tokens moves the answer's likelihood more than pruning
    as many of the least salient (the label ranks what the answer needs)."""
    from litevlm.train.tokens import answer_loglik, answer_saliency

    model = tiny_vlm(layers=3).double()
    embeds, positions, spans = tiny_prompt(model)
    embeds = embeds.double()
    answer = [30, 31, 32, 92]
    n = len(spans) * TPV
    got = answer_saliency(model, embeds, positions, spans, answer)
    assert got.shape == (n,) and abs(float(got.sum()) - 1.0) < 1e-9 and bool((got >= 0).all())
    eps = 1e-3  # the norms compute in fp32: a smaller step drowns in their rounding

    def ll(bias):
        with torch.no_grad():
            return float(answer_loglik(model, embeds, positions, spans, answer, bias))

    fd = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        step = torch.zeros(n, dtype=torch.float64)
        step[i] = eps
        fd[i] = (ll(step) - ll(-step)) / (2 * eps)
    torch.testing.assert_close(got, fd.abs() / fd.abs().sum(), atol=2e-4, rtol=0.02)
    base, k = ll(torch.zeros(n, dtype=torch.float64)), n // 4
    order = got.argsort(descending=True)

    def pruned(idx):
        bias = torch.zeros(n, dtype=torch.float64)
        bias[idx] = float("-inf")
        return abs(ll(bias) - base)

    assert pruned(order[:k]) > pruned(order[-k:])


def test_a_label_mixes_attention_and_saliency_by_the_recipes_share():
    from types import SimpleNamespace

    from litevlm.train.tokens import TokenRecipe, answer_saliency, teacher_attention, teacher_label

    model = tiny_vlm(layers=3)
    embeds, positions, spans = tiny_prompt(model)
    p = SimpleNamespace(embeds=embeds, positions=positions, view_spans=spans)
    answer = [30, 31, 92]
    attn = teacher_attention(model, embeds, positions, spans, answer, None, 0.5)
    sal = answer_saliency(model, embeds, positions, spans, answer)
    assert not torch.allclose(attn, sal)
    torch.testing.assert_close(teacher_label(model, p, answer, TokenRecipe()), attn)
    mixed = teacher_label(model, p, answer, TokenRecipe(saliency_weight=0.25))
    torch.testing.assert_close(mixed, 0.75 * attn + 0.25 * sal)


def test_box_prior_marks_the_boxed_cells():
    from litevlm.train.tokens import box_prior

    p = box_prior(
        {"CAM_BACK": [(410, 460, 790, 670)], "CAM_FRONT": [(0, 0, 399, 224), (0, 0, 10, 10)]},
        ["CAM_FRONT", "CAM_BACK"],
        4,
        1,
    )
    assert p.nonzero().flatten().tolist() == [0, 16 + 9] and torch.isclose(p.sum(), torch.tensor(1.0))
    assert box_prior({}, ["CAM_FRONT"], 4, 1).sum() == 0


def test_train_token_selector_smoke(tmp_path):
    """`litevlm train tokens` end to end on a tiny random model: labels, a few steps, a loadable checkpoint."""
    from litevlm.data.tokenizer import default_tokenizer
    from litevlm.model.hf import save_native
    from litevlm.train.tokens import TokenRecipe, train_token_selector

    tok = default_tokenizer(vocab_size=300, n_frames=4)
    torch.manual_seed(0)
    cfg = VLMConfig(
        vision=VisionConfig(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, image_size=56, patch_size=14
        ),
        text=TextConfig(
            vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
        image_token_id=tok.image_id,
        img_start_id=tok.img_start_id,
        img_end_id=tok.img_end_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    save_native(VLM(cfg), tmp_path / "m")
    tok.save(tmp_path / "m")
    recipe = TokenRecipe(
        frames=2, val_frames=1, questions_per_frame=3, epochs=2, batch=2, minutes=1, render_size=(160, 90)
    )
    out = train_token_selector(tmp_path / "m", recipe, progress=False)
    assert out == tmp_path / "m" / "token_selector"
    from litevlm.model.hf import load_native

    model = load_native(tmp_path / "m")
    sel = TokenSelector.load(tmp_path / "m", model)
    assert sel.meta["recipe"]["frames"] == 2 and sel.meta["training"]["steps"] == 6
    # by default the head reads the model's own frozen layer 0: the checkpoint stores no copy of it
    from safetensors.torch import load_file

    assert sel.cfg.shared_layer and sel.decoder_layer() is model.language_model.layers[0]
    stored = load_file(str(out / "selector.safetensors"))
    assert stored and not any(k.startswith("layer.") for k in stored)
    assert "fastv_k1" in sel.meta["training"]["validation"]
    # fine-tuned from it with the answer objective: the same head and inputs, a measured answer KL
    ft = TokenRecipe(
        frames=2,
        val_frames=1,
        questions_per_frame=3,
        epochs=1,
        batch=2,
        minutes=1,
        render_size=(160, 90),
        init=str(out),
        answer_weight=1.0,
        reads="layer0" if sel.cfg.reads == "prompt" else "prompt",  # the init's inputs win over the recipe's
    )
    out2 = train_token_selector(tmp_path / "m", ft, progress=False, out_dir=tmp_path / "ft")
    tuned = TokenSelector.load(out2.parent, model)
    assert tuned.cfg.reads == sel.cfg.reads and tuned.meta["recipe"]["reads"] == sel.cfg.reads
    assert tuned.meta["recipe"]["init"] == str(out) and tuned.meta["training"]["final_answer_kl"] >= 0.0
    assert not torch.equal(tuned.mlp[0].weight, sel.mlp[0].weight)


@pytest.mark.parametrize("path", ["native", "eager"])
def test_the_inference_head_equals_the_training_head(path, monkeypatch):
    """`head_scores` at inference (one prompt, no grad: one native call, or `_head_ops` eagerly where the native
    build is unavailable) equals its differentiable form."""
    from litevlm.model import cpu_steps, native
    from litevlm.select import tokens

    if path == "native":
        if cpu_steps.backend() != "native":
            pytest.skip(f"the native CPU code is unavailable here ({native.error()})")
        calls = []
        real = native.ops()
        monkeypatch.setattr(tokens.native, "ops", lambda: calls.append(1) or real)
    else:
        monkeypatch.setattr(tokens.cpu_steps, "backend", lambda: "eager")
    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    sel = trained_looking_selector(model)
    with torch.no_grad():
        sel.tag_weight.copy_(torch.tensor([1.5, 0.5]))
        sel.mlp[0].bias.normal_()
        sel.head_logits.copy_(torch.tensor([2.0, -1.0, 0.5, 0.0]))  # heads weighted unequally: their order matters
        x = model.language_model(embeds, positions, end_layer=1)
        tags = torch.zeros(2, len(spans) * TPV)
        tags[0, 3], tags[1, 4] = 1.0, 1.0
        fast = sel.head_scores(x, positions, spans, tags)
    with torch.enable_grad():
        slow = sel.head_scores(x, positions, spans, tags)
    assert slow.requires_grad and not fast.requires_grad
    # inference path against the autograd path: fp32 sums in another order, ~eps x width of O(1) scores.
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)
    if path == "native":
        assert calls  # the native head ran


def test_a_hard_keep_mask_makes_the_answer_objective_the_kl_to_the_pruned_prompt():
    """At a near-zero temperature the soft mask is the hard top-k: the answer objective is then the KL from the full
    prompt's answer distributions to those of the prompt pruned to the top-r tokens (at their original positions)."""
    from litevlm.train.tokens import answer_loss, soft_keep_bias

    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    n = len(spans) * TPV
    scores = torch.randn(n, generator=torch.Generator().manual_seed(3))
    bias = soft_keep_bias(scores, 0.25, 1e-4)
    kept = scores.topk(keep_count(n, 0.25)).indices
    assert (bias[kept] > -1e-3).all() and (bias.index_fill(0, kept, -1e9) < -100).all()
    answer = [30, 31, 32, 92]
    got = answer_loss(model, embeds, positions, spans, answer, scores, 0.25, 1e-4)
    with torch.no_grad():
        lm = model.language_model
        x = torch.cat([embeds, lm.embed_tokens(torch.tensor([answer[:-1]]))], 1)
        pos = torch.arange(x.shape[1])[None]
        t = embeds.shape[1]
        full = model.lm_head(lm(x, pos))[0, t - 1 :].log_softmax(-1)
        keep = torch.ones(x.shape[1], dtype=torch.bool)
        keep[visual_index(spans)] = False
        keep[visual_index(spans)[kept]] = True
        pruned = model.lm_head(lm(x[:, keep], pos[:, keep]))[0, -len(answer) :].log_softmax(-1)
    want = (full.exp() * (full - pruned)).sum(-1).mean()
    assert want > 1e-4  # pruning changes this tiny model's answer distributions
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_answer_objective_reaches_the_scores_near_the_cut_only():
    from litevlm.train.tokens import answer_loss

    model = tiny_vlm()
    embeds, positions, spans = tiny_prompt(model)
    n = len(spans) * TPV
    scores = torch.linspace(-3, 3, n)[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    scores.requires_grad_(True)
    with torch.no_grad():  # r = 1 keeps every token: nothing to lose
        assert float(answer_loss(model, embeds, positions, spans, [30, 92], scores.detach(), 1.0, 0.2)) < 1e-6
    answer_loss(model, embeds, positions, spans, [30, 31, 92], scores, 0.5, 0.05).backward()
    g = scores.grad.abs()
    cut = scores.detach().sort().values[n // 2 - 1 : n // 2 + 1].mean()  # midway between the kept and the dropped
    far = (scores.detach() - cut).abs() > 1.0  # over 11 spreads (0.05 x std 1.75) from it
    assert g[~far].max() > 0 and g[far].max() < 1e-3 * g[~far].max()
