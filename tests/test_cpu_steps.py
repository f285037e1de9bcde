"""The native CPU steps (cpu_steps.cpp) through `litevlm.model.backend.NativeBackend`: the same logits, hidden
states and cache contents as the modules (`ModulesBackend`) for a decode step, a tree verification, a prompt, a
draft head's steps and a whole greedy chain cycle; and refused, with the reason, where they do not apply."""

import shutil

import pytest
import torch
from test_spec import prompt, random_draft, tiny_vlm

from litevlm.errors import LiteVLMError
from litevlm.model import cpu_steps, native
from litevlm.model.backend import ModulesBackend, NativeBackend, NativeDraft, choose_backend, native_refusal
from litevlm.spec.tree import Tree, ancestor_mask, verify_tree


def need_native():
    if native.ops() is None:
        pytest.skip(f"the native CPU steps are unavailable here ({native.error()})")


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler here")
def test_the_native_steps_build_where_a_compiler_is_present():
    """A machine with a compiler runs the native steps: a broken build fails here instead of quietly
    falling back to the modules."""
    if not native.enabled():
        pytest.skip("LITEVLM_NATIVE disables the native steps")
    assert native.ops() is not None, native.error()
    assert cpu_steps.backend() == "native"
    assert choose_backend("auto", tiny_vlm()).name == "native"


def test_the_native_build_folder_depends_on_the_cpu_and_the_flags():
    """A build cache shared between machines: another instruction set or other compile flags build elsewhere."""
    base = native.build_dir(cpu="fpu sse2 avx2 | AVX2", cflags=["-O3", "-march=native"])
    assert base == native.build_dir(cpu="fpu sse2 avx2 | AVX2", cflags=["-O3", "-march=native"])
    assert base != native.build_dir(cpu="fpu sse2 avx2 avx512f | AVX512", cflags=["-O3", "-march=native"])
    assert base != native.build_dir(cpu="fpu sse2 avx2 | AVX2", cflags=["-O2", "-march=native"])
    assert native.build_dir() == native.build_dir(cpu=native.cpu_features(), cflags=native.CFLAGS)


def caches(model):
    return [
        (layer.self_attn.kv_cache.k.clone(), layer.self_attn.kv_cache.v.clone())
        for layer in model.language_model.layers
    ]


def both_backends(model, run, draft=None):
    """run(backend) on the native backend, then on the modules: (native result, module result)."""
    need_native()
    with torch.no_grad():
        return run(NativeBackend(model, draft)), run(ModulesBackend(model, draft))


def assert_all_close(a, b, ulps: float = 1.0):
    """Nested lists / tuples of tensors, equal in structure and shape, close in value: within fp32 rounding
    of the tensor's own scale (the random tiny models here reach hidden values near 60, where one ulp is
    4e-6 and summing in another order moves each value by a few), `ulps` times that for longer sums."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape
        scale = float(b.abs().max()) if b.is_floating_point() and b.numel() else 0.0
        torch.testing.assert_close(a, b, atol=ulps * (1e-5 + 2e-6 * scale), rtol=ulps * 1e-5)
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_all_close(x, y, ulps)


def test_a_native_decode_step_equals_the_modules():
    """The whole step (layers, final norm, LM head) in one call."""
    model = tiny_vlm(layers=3)
    embeds, pos = prompt(model, seed=3)
    t = embeds.shape[1]
    tokens = torch.tensor([[9], [17], [4]])

    def run(backend):
        backend.prefill(embeds, pos)
        out = [backend.decode(tok.view(1, 1), t + 2 + i, t + i) for i, tok in enumerate(tokens)]  # positions may skip
        return out, caches(model)

    assert_all_close(*both_backends(model, run))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_few_rows_product_sums_each_row_as_one_row_alone(threads):
    """The products of a decode step (one row) and of a verification (up to 24 rows, by blocks of four rows and of
    32, 16 and single columns): each row's outputs are those of the row alone, bit for bit, whatever the row count,
    the column count, the input width (one not a multiple of four) or the threads; and the product is x @ w + b."""
    need_native()
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for inp, out in ((256, 1280), (64, 49), (30, 17), (256, 854)):
            w = torch.randn(inp, out, generator=g)
            b = torch.randn(out, generator=g)
            x = torch.randn(24, inp, generator=g)
            alone = torch.cat([native.ops().product(b, x[i : i + 1], w) for i in range(24)])
            assert torch.allclose(alone, x @ w + b, atol=1e-3, rtol=1e-4)
            for n in (2, 3, 5, 7, 8, 17, 24):
                assert torch.equal(native.ops().product(b, x[:n], w), alone[:n]), (inp, out, n)
            assert torch.equal(native.ops().product(None, x[:6], w), native.ops().product(torch.zeros(out), x[:6], w))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_target_steps_on_fp32_panels_equal_the_row_major_weights_bit_for_bit(threads):
    """The target's products read its weights packed as 32-column panels (`pack_panels32`): a decode step and a
    greedy chain's verification give exactly the numbers they give on the row-major weights, on widths that are not
    multiples of 32 (the last panel padded) and whether or not the products split over the threads."""
    need_native()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = tiny_vlm(layers=2, vocab=45)
        embeds, pos = prompt(model, seed=6)
        t = embeds.shape[1]
        with torch.no_grad():
            b = NativeBackend(model)
            b.prefill(embeds, pos)
            cos, sin = b.lm.rope_table(t + 40, torch.float32, embeds.device)
            ops, shape = b.steps.ops, b.shape
            flat = cpu_steps.native_weights(b.weights, *shape[:3])
            panels = cpu_steps.target_panels(b.weights, b.head, *shape[:3])
            assert len(panels) == 4 * 2 + 1 and all(p.shape[-1] == 32 for p in panels)
            assert b.head.shape[1] % 32 != 0  # a padded last panel
            cache = cpu_steps._flat(b._caches())
            token = torch.tensor([7])
            plain = ops.decode_logits(token, t, t, cos, sin, b.embed, flat, cache, *shape, b.lm.norm.weight, b.head, [])
            paneled = ops.decode_logits(token, t, t, cos, sin, b.embed, flat, cache, *shape, b.lm.norm.weight, b.head,
                                        panels)  # fmt: skip
            assert all(torch.equal(x, y) for x, y in zip(plain, paneled))
            for i in (0, 3, 8):  # the panels are what the step reads: a spoilt one (q|k|v, down, the head) shows
                spoilt = [p.clone() if j == i else p for j, p in enumerate(panels)]
                spoilt[i][0] += 1.0
                got = ops.decode_logits(token, t, t, cos, sin, b.embed, flat, cache, *shape, b.lm.norm.weight, b.head,
                                        spoilt)  # fmt: skip
                assert not torch.equal(got[0], plain[0]), i
            chain = torch.tensor([7, 3, 9, 11, 2])
            args = (chain, t, t, cos, sin, b.embed, flat, cache, *shape, b.lm.norm.weight, b.head)
            assert all(torch.equal(x, y) for x, y in zip(ops.verify_chain(*args, []), ops.verify_chain(*args, panels)))
            w = torch.randn(30, 45)
            packed = ops.pack_panels32(w)
            assert packed.shape == (2, 30, 32) and torch.equal(packed[1, :, 13:], torch.zeros(30, 19))
            assert torch.equal(packed[1, :, :13], w[:, 32:])
    finally:
        torch.set_num_threads(before)


def test_native_steps_give_the_same_numbers_at_one_and_at_two_threads():
    """A decode step's and a verification's products large enough to be split over the threads by output columns
    (hidden 256, as drive-hd's) sum each column as one thread does: every output is equal bit for bit."""
    need_native()
    model = tiny_vlm(vocab=300, hidden=256, layers=2, std=0.05)
    embeds, pos = prompt(model, seed=7, n=40)
    t = embeds.shape[1]
    chain = torch.tensor([11, 12, 13, 14, 15])

    def run(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                backend = NativeBackend(model)
                backend.prefill(embeds, pos)
                step = backend.decode(torch.tensor([[9]]), t, t)
                return step, backend.verify_chain(chain, t + 1, t + 1)
        finally:
            torch.set_num_threads(before)

    def tensors(out):
        return [x for part in out for x in (part if isinstance(part, (tuple, list)) else [part])]

    one, two = tensors(run(1)), tensors(run(2))
    # the step's logits and hidden states; the chain's tokens, features, embeddings, positions
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_a_native_tree_verification_equals_the_modules():
    model = tiny_vlm(layers=2)
    embeds, pos = prompt(model, seed=4)
    t = embeds.shape[1]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 3])
    tree = Tree(torch.tensor([11, 12, 13, 14, 15, 16, 17]), parents, depth, ancestor_mask(parents, 3))

    def run(backend):
        backend.prefill(embeds, pos)
        return verify_tree(backend, tree, t, t), caches(model)

    assert_all_close(*both_backends(model, run))


def test_a_native_tree_of_64_rows_and_more_under_its_mask_equals_the_modules():
    """From 64 rows on a step under a mask (a tree's verification) is ATen's fused attention: a 70-node tree whose
    nodes hang off random earlier ones gives the same verification and cache contents as the modules."""
    model = tiny_vlm(layers=2)
    embeds, pos = prompt(model, seed=5)
    t = embeds.shape[1]
    g = torch.Generator().manual_seed(2)
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 70)])
    depth = torch.zeros(70, dtype=torch.long)
    for i in range(1, 70):
        depth[i] = depth[parents[i]] + 1
    tokens = torch.randint(8, model.cfg.text.vocab_size, (70,), generator=g)
    tree = Tree(tokens, parents, depth, ancestor_mask(parents, int(depth.max())))

    def run(backend):
        backend.prefill(embeds, pos)
        return verify_tree(backend, tree, t, t), caches(model)

    assert_all_close(*both_backends(model, run), ulps=4)  # sums over up to 82 slots in another order


@pytest.mark.parametrize("input_norm", [True, False])
def test_a_native_draft_step_equals_the_modules(input_norm):
    model = tiny_vlm()
    head = random_draft(model)
    if not input_norm:
        head.layer.input_layernorm = torch.nn.Identity()
    g = torch.Generator().manual_seed(2)
    feats, nxt = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    hid = torch.randn(3, 32, generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6] = mask[2, 7] = False  # tree nodes that may not see every scratch entry

    def run(backend):
        drafter = backend.drafter
        drafter.prepare(32, 64)
        last = drafter.extend(feats[:4], nxt[:4], torch.arange(4), 0, last_only=True)  # a draft cycle's extend
        drafter.extend(feats, nxt, torch.arange(6), 0)
        chain = drafter.step(torch.tensor([5]), hid[:1], 6, 6, None)
        tree = drafter.step(torch.tensor([5, 8, 9]), hid, 7, 6, mask)
        return last, chain, tree, head.layer.self_attn.kv_cache.k[:, :, :9].clone()

    assert_all_close(*both_backends(model, run, head))


def test_the_native_backend_is_refused_where_it_does_not_apply():
    """Another dtype, a hooked projection, an FP8 layer, a cache of two sequences: `native_refusal` names the reason,
    NativeBackend raises it and "auto" takes the modules."""
    need_native()
    model = tiny_vlm()
    lm = model.language_model
    assert native_refusal(model) == ""
    handle = lm.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
    assert "hooks" in native_refusal(model)
    with pytest.raises(LiteVLMError, match="hooks"):
        NativeBackend(model)
    assert choose_backend("auto", model).name == "modules"
    handle.remove()
    lm.setup_cache(2, 32)
    assert "more than one sequence" in native_refusal(model)
    lm.setup_cache(1, 32)
    assert "float64" in native_refusal(tiny_vlm().double())
    from litevlm.quant.fp8 import FP8Recipe, quantize_model

    quantize_model(model, FP8Recipe("fp8-dynamic-per-row"))
    assert "not plain Linear" in native_refusal(model)


def test_a_backend_keeps_the_weights_it_was_made_from_and_a_new_one_sees_changes():
    """The native backend packs the weights once, when it is made: a weight changed afterwards reaches the next
    backend (`Pipeline.rebuild`), not this one."""
    need_native()
    model = tiny_vlm()
    embeds, pos = prompt(model, seed=2)
    with torch.no_grad():
        before = NativeBackend(model)
        old = before.prefill(embeds, pos)[0]
        model.language_model.layers[0].self_attn.q_proj.bias.add_(1.0)
        assert torch.equal(before.prefill(embeds, pos)[0], old)  # this backend's packed weights
        new = NativeBackend(model).prefill(embeds, pos)[0]
        assert not torch.allclose(new, old)
        assert_all_close(new, ModulesBackend(model).prefill(embeds, pos)[0])


@pytest.mark.parametrize("min_value,eos", [(0.0, None), (0.3, None), (1e-30, "drafted"), (0.0, "drafted")])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_a_native_draft_chain_equals_the_module_loop(min_value, eos, draft_vocab):
    """One native call drafts the chain the Python loop over the head's modules drafts: same tokens, same draft
    cache. (The native chain's one-row products read the draft's weights rounded to bf16, `cpu_steps.panels`;
    weights that bf16 holds exactly make the two paths comparable, the target's embedding and head included.)"""
    from litevlm.spec.draft import DraftConfig, DraftHead
    from litevlm.spec.tree import TreeConfig, draft_tree

    model = tiny_vlm()
    torch.manual_seed(1)
    head = DraftHead(DraftConfig.for_target(model.cfg.text, draft_vocab=draft_vocab), model).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.3)
        for p in [*head.parameters(), *model.parameters()]:  # values bf16 holds exactly
            p.copy_(p.bfloat16().float())
        if draft_vocab:
            head.set_draft_vocab(torch.randperm(model.cfg.text.vocab_size)[:draft_vocab])
    g = torch.Generator().manual_seed(3)
    feats, nxt = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    cfg = TreeConfig.chain(8, min_value)

    def run(backend):
        drafter = backend.drafter
        drafter.prepare(32, 64)
        h_root = drafter.extend(feats, nxt, torch.arange(6), 0, last_only=True)
        eos_id = None
        if eos == "drafted":  # the second drafted token, as EOS: the chain must stop right after it
            probe = draft_tree(head, torch.tensor([3]), h_root, 6, 6, TreeConfig.chain(3, 0.0))
            eos_id = int(probe.tokens[2])
        tree = draft_tree(drafter, torch.tensor([3]), h_root, 6, 6, cfg, eos_id)
        return tree.tokens, tree.parents, head.layer.self_attn.kv_cache.k[:, :, : 6 + len(tree)].clone()

    (ta, pa, ka), (tb, pb, kb) = both_backends(model, run, head)
    assert torch.equal(ta, tb) and torch.equal(pa, pb)
    assert_all_close(ka, kb)
    if eos == "drafted" and min_value > 0:
        assert len(ta) == 3  # root + two drafts, the second one EOS: a chain cut by its value watches for it
    if min_value == 0.0:
        assert len(ta) == 9  # a fixed-depth chain: the full depth, EOS or not


def test_the_vision_blocks_on_packed_weights_equal_the_modules():
    """CPU inference runs the InternViT blocks as plain ops on packed weights: the modules' output, and a
    weight changed in place is picked up."""
    model = tiny_vlm()
    tower = model.vision_tower
    with torch.no_grad():
        for p in tower.parameters():  # layer scales and norms away from their init: every weight matters
            p.add_(torch.randn_like(p) * 0.1)
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fast = tower(pixels)
        assert tower.encoder.layer[0]._packed is not None  # the packed path ran
    slow = tower(pixels)  # gradients on: the modules
    assert slow.requires_grad
    # fp32, two codes (packed native blocks, torch modules): sums in another order through a 2-layer tower of width <=
    # 64: ~64 eps ~ 8e-6 of O(1) features, under 1e-5; a wrong weight or bias moves them by O(1).
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        tower.encoder.layer[0].mlp.fc2.bias.add_(0.5)
        changed = tower(pixels)
    # as above: the packed path against the modules after an in-place bias change.
    torch.testing.assert_close(changed, tower(pixels).detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, fast)


def test_a_native_greedy_chain_cycle_equals_the_modules():
    """Each side of a greedy chain cycle in one native call (`NativeDraft.draft_cycle`, `NativeBackend.verify_chain`):
    the same tokens, the same accepted lengths, the same target and draft caches as the modules' cycle."""
    from litevlm.spec import speculative_generate
    from litevlm.spec.tree import TreeConfig

    model = tiny_vlm(vocab=24)  # a small vocabulary so that a random draft is often right
    head = random_draft(model)
    embeds, pos = prompt(model, seed=5)
    cfg = TreeConfig.chain(6, 0.05)
    calls = []

    def run(backend):
        if backend.greedy_chain:  # record that the one-call sides ran
            for obj, name in ((backend.drafter, "draft_cycle"), (backend, "verify_chain")):
                fn = getattr(obj, name)
                setattr(obj, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
        out = speculative_generate(backend, head, embeds, pos, 30, None, tree=cfg)
        return out.tokens, out.accept_lengths, caches(model), head.layer.self_attn.kv_cache.k.clone()

    (tok_a, acc_a, *rest_a), (tok_b, acc_b, *rest_b) = both_backends(model, run, head)
    assert {"draft_cycle", "verify_chain"} <= set(calls)  # both one-call sides ran
    assert tok_a == tok_b and acc_a == acc_b
    assert max(acc_a) >= 2  # drafts were accepted
    n = embeds.shape[1] + 30
    assert_all_close(
        [[k[:, :, :n], v[:, :, :n]] for k, v in rest_a[0]], [[k[:, :, :n], v[:, :, :n]] for k, v in rest_b[0]]
    )


def test_a_native_prompt_equals_the_modules():
    """A prompt from slot 0 (a prefill, and a pruned prefill's two halves at skipping positions) runs as one
    native call: the same hidden states and cache contents as the modules."""
    model = tiny_vlm(layers=3)
    embeds, pos = prompt(model, seed=5, n=20, pruned=True)
    kept = torch.tensor([0, 1, 4, 5, 9, 12, 13, 17, 19])

    def run(backend):
        full = backend.prompt(embeds, pos)
        first = backend.prompt(embeds, pos, end_layer=1)
        rest = backend.prompt(first[:, kept], pos[:, kept], start_layer=1)
        return full, first, rest, caches(model)

    assert_all_close(*both_backends(model, run))


@pytest.mark.parametrize("tail_rows", [0, 9])
def test_a_long_native_prompt_through_the_blocked_attention_equals_the_modules(tail_rows):
    """From 64 rows on a causal prompt's attention goes by blocks of rows, each over the slots up to its last row (a
    tree after it by its mask): a long prompt over three blocks, its pruned halves and a tree after it (answer
    openings) give the same hidden states and cache contents as the modules."""
    model = tiny_vlm(layers=3)
    n = 110
    embeds, pos = prompt(model, seed=6, n=n, pruned=True)
    kept = torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(1))[:80]).values
    tail = None
    if tail_rows:  # a chain of tree rows after the first n - tail_rows, each seeing the prompt and its ancestors
        first = n - tail_rows
        tail = torch.zeros(tail_rows, n, dtype=torch.bool)
        tail[:, :first] = True
        tail[:, first:] = torch.tril(torch.ones(tail_rows, tail_rows, dtype=torch.bool))
        tail[1::2, first] = False  # every other row leaves out the first tree node (another branch)

    def run(backend):
        full = backend.prompt(embeds, pos, tree_tail=tail)
        if tail is not None:
            return full, caches(model)
        first = backend.prompt(embeds, pos, end_layer=1)
        rest = backend.prompt(first[:, kept], pos[:, kept], start_layer=1)
        return full, first, rest, caches(model)

    assert_all_close(*both_backends(model, run), ulps=4)  # sums over 110 slots in another order


def test_a_native_bf16_prompt_multiplies_in_bf16_around_an_fp32_stream():
    """In bf16 mode (`set_bf16_matmul`, then a new backend) a prompt still runs as one native call, its four products
    per layer in bf16: close to fp32, and not equal to it."""
    from litevlm.model.layers import bf16_matmul_supported

    need_native()
    if not bf16_matmul_supported():
        pytest.skip("this CPU multiplies bf16 neither with AMX nor with AVX512-BF16")
    model = tiny_vlm(layers=3)
    embeds, pos = prompt(model, seed=5, n=40)
    with torch.no_grad():
        fp32 = NativeBackend(model).prompt(embeds, pos)
        model.set_bf16_matmul(8)
        backend = NativeBackend(model)
        assert backend.bf16
        bf16 = backend.prompt(embeds, pos)
    assert not torch.equal(bf16, fp32)
    # bf16 products (~3e-3 relative each) compounded through a random decoder whose large weights amplify them.
    assert ((bf16 - fp32).norm() / fp32.norm()) < 6e-2  # a random decoder with large weights amplifies rounding


def test_a_failed_native_build_leaves_the_modules_and_says_why(monkeypatch, capsys):
    """No compiler (or a broken build): `native.ops()` is None with the reason on stderr and in `error()`, "auto"
    gives the modules and an explicit native backend names the reason."""

    def broken(verbose=False):
        raise RuntimeError("ninja: build stopped\nfoo.cpp:1:1: error: no compiler here")

    monkeypatch.setattr(native, "build", broken)
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setattr(native, "_ERROR", [])
    assert native.ops() is None
    assert "error: no compiler here" in native.error()
    assert "native CPU steps unavailable" in capsys.readouterr().err
    model = tiny_vlm()
    assert choose_backend("auto", model).name == "modules"
    with pytest.raises(LiteVLMError, match="no compiler here"):
        choose_backend("native", model)


def test_litevlm_native_0_turns_the_native_steps_off(monkeypatch):
    monkeypatch.setenv("LITEVLM_NATIVE", "0")
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setattr(native, "_ERROR", [])
    assert native.ops() is None
    assert native.error() == "disabled by LITEVLM_NATIVE"


def test_a_draft_steps_bf16_panels_multiply_like_its_fp32_weights_rounded():
    """The native draft's one-row products run on bf16 panels of its weights (`cpu_steps.panels`): the same products
    as fp32 weights rounded to bf16, any width (the last panel padded), and the target's own steps never use them."""
    if cpu_steps.backend() != "native" or not cpu_steps.panels_built():
        pytest.skip("the native build here has no panel products (they need AVX-512)")
    from litevlm.spec.draft import DraftConfig, DraftHead

    model = tiny_vlm()
    head = DraftHead(DraftConfig.for_target(model.cfg.text), model).eval()
    gen = torch.Generator().manual_seed(0)
    for out in (32, 64, 100, 854):
        w = torch.randn(48, out, generator=gen)
        packed = cpu_steps.panels(w)
        assert packed.dtype == torch.bfloat16 and packed.shape == ((out + 63) // 64, 48, 64)
        assert cpu_steps.panels(w) is packed  # made once per weight
        rounded = w.bfloat16().float()
        unpacked = packed.float().permute(1, 0, 2).reshape(48, -1)[:, :out]
        # packing only moves the bf16-rounded values: equality.
        assert torch.equal(unpacked, rounded)
    steps = cpu_steps.native_steps()
    with torch.no_grad():
        drafter = NativeDraft(head, steps)
    weights, args = drafter.weights, drafter.chain_args
    listed = steps._draft_panels(args[1], args[3], weights, 4, 2, 8)
    assert len(listed) == 2 + 4 * len(weights)
    assert steps._draft_panels(args[1], args[3], weights, 4, 2, 8) is listed
