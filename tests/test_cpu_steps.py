"""The CPU steps (`litevlm.model.cpu_steps`), native (cpu_steps.cpp) and TorchScript alike: the same
logits, hidden states and cache contents as the eager path for a decode step, a tree verification and a
draft step, and out of the way wherever they do not apply."""

import shutil

import pytest
import torch
from test_spec import prompt, random_draft, tiny_vlm

from litevlm.model import cpu_steps, native
from litevlm.model.generate import decode_step, prefill
from litevlm.spec.tree import Tree, ancestor_mask, verify_tree

pytestmark = pytest.mark.skipif(cpu_steps.step_layers() is None, reason="this torch build has no TorchScript")


def backend_steps(name: str):
    """The four step functions of one backend, or a skip where it is unavailable here."""
    steps = cpu_steps._native_steps() if name == "native" else cpu_steps._scripted_steps()
    if steps is None:
        why = native.error() if name == "native" else "no TorchScript"
        pytest.skip(f"the {name} CPU steps are unavailable here ({why})")
    return steps


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler here")
def test_the_native_steps_build_where_a_compiler_is_present():
    """A machine with a compiler runs the native steps: a broken build fails here instead of quietly
    falling back to TorchScript."""
    if not native.enabled():
        pytest.skip("LITEVLM_NATIVE disables the native steps")
    assert native.ops() is not None, native.error()
    assert cpu_steps.backend() == "native"


@pytest.fixture(params=["native", "torchscript"])
def eager(request, monkeypatch):
    """Runs the step functions of one backend (native, TorchScript) and counts their calls until
    `use_eager()` (so a test knows that path ran), after which the eager path runs, as in a torch build
    with neither."""
    real, calls = backend_steps(request.param), []

    def counted(i, fn):
        return lambda *args: calls.append(i) or fn(*args)

    monkeypatch.setattr(cpu_steps, "_STEPS", [tuple(counted(i, fn) for i, fn in enumerate(real))])

    def use_eager():
        assert calls, "the CPU step path did not run"
        monkeypatch.setattr(cpu_steps, "_STEPS", [None])

    use_eager.calls = calls  # indices into the step tuple: 2 = draft_cycle, 3 = verify_chain, 4 = decode_logits
    return use_eager


def caches(model):
    return [
        (layer.self_attn.kv_cache.k.clone(), layer.self_attn.kv_cache.v.clone())
        for layer in model.language_model.layers
    ]


def both_paths(eager, run):
    """run() on the CPU step path, then on the eager one: (fast result, eager result)."""
    with torch.no_grad():
        fast = run()
        eager()
        return fast, run()


def assert_all_close(a, b):
    """Nested lists / tuples of tensors, equal in structure and shape, close in value: within fp32 rounding
    of the tensor's own scale (the random tiny models here reach hidden values near 60, where one ulp is
    4e-6 and summing in another order moves each value by a few)."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape
        scale = float(b.abs().max()) if b.is_floating_point() and b.numel() else 0.0
        torch.testing.assert_close(a, b, atol=1e-5 + 2e-6 * scale, rtol=1e-5)
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_all_close(x, y)


@pytest.mark.parametrize("with_plan", [True, False])
def test_a_cpu_step_decode_step_equals_the_eager_one(eager, with_plan):
    """With a generation's plan the whole step (layers, final norm, LM head) is one call (`decode_logits`);
    without one, the layers are (`layers`) and the head runs in Python."""
    model = tiny_vlm(layers=3)
    embeds, pos = prompt(model, seed=3)
    t = embeds.shape[1]
    tokens = torch.tensor([[9], [17], [4]])

    def run():
        prefill(model, embeds, pos)
        plan = model.language_model.step_plan() if with_plan else None
        out = [
            decode_step(model, tok.view(1, 1), t + 2 + i, t + i, plan) for i, tok in enumerate(tokens)
        ]  # positions may skip
        return out, caches(model)

    assert_all_close(*both_paths(eager, run))
    assert (4 in eager.calls) == with_plan  # 4 = decode_logits


def test_a_cpu_step_tree_verification_equals_the_eager_one(eager):
    model = tiny_vlm(layers=2)
    embeds, pos = prompt(model, seed=4)
    t = embeds.shape[1]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 3])
    tree = Tree(torch.tensor([11, 12, 13, 14, 15, 16, 17]), parents, depth, ancestor_mask(parents, 3))

    def run():
        prefill(model, embeds, pos)
        return verify_tree(model, tree, t, t), caches(model)

    assert_all_close(*both_paths(eager, run))


@pytest.mark.parametrize("input_norm", [True, False])
def test_a_cpu_step_draft_step_equals_the_eager_one(eager, input_norm):
    model = tiny_vlm()
    head = random_draft(model)
    if not input_norm:
        head.layer.input_layernorm = torch.nn.Identity()
    g = torch.Generator().manual_seed(2)
    feats, nxt = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    hid = torch.randn(3, 32, generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6] = mask[2, 7] = False  # tree nodes that may not see every scratch entry

    def run():
        head.prepare(32, 64)
        last = head.extend(feats[:4], nxt[:4], torch.arange(4), 0, last_only=True)  # a draft cycle's extend
        head.extend(feats, nxt, torch.arange(6), 0)
        chain = head.step(torch.tensor([5]), hid[:1], 6, 6, None)
        tree = head.step(torch.tensor([5, 8, 9]), hid, 7, 6, mask)
        return last, chain, tree, head.layer.self_attn.kv_cache.k[:, :, :9].clone()

    assert_all_close(*both_paths(eager, run))


def test_the_cpu_step_stays_out_of_the_way():
    """Training (gradients), another dtype, a batch of sequences, a hooked projection: the eager path runs."""
    model = tiny_vlm()
    layers = model.language_model.layers
    x = torch.randn(1, 32)
    with torch.no_grad():
        assert cpu_steps.usable(x, layers)
        assert not cpu_steps.usable(x.double(), layers)
        handle = layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
        assert not cpu_steps.usable(x, layers)
        handle.remove()
        model.language_model.setup_cache(2, 32)
        assert not cpu_steps.usable(x, layers)
    model.language_model.setup_cache(1, 32)
    assert not cpu_steps.usable(x, layers)  # gradients enabled


def test_a_frozen_scope_checks_once_and_the_next_scope_sees_changes():
    """Inside `cpu_steps.frozen()` (one answer) the hook walk and the weight check run once and are remembered;
    a hook or a weight changed between two scopes reaches the next one."""
    model = tiny_vlm()
    layers = model.language_model.layers
    x = torch.randn(1, 32)
    calls = []
    with torch.no_grad():
        with cpu_steps.frozen():
            assert cpu_steps.remembered("k", lambda: calls.append(1) or 5) == 5
            assert cpu_steps.remembered("k", lambda: calls.append(1) or 6) == 5
            assert cpu_steps.usable(x, layers)
            w = cpu_steps.layer_weights(layers[0])
            assert cpu_steps.layer_weights(layers[0]) is w
        assert calls == [1]
        handle = layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
        with cpu_steps.frozen():
            assert not cpu_steps.usable(x, layers)
        handle.remove()
        layers[0].self_attn.q_proj.bias.add_(1.0)
        with cpu_steps.frozen():
            assert cpu_steps.usable(x, layers)
            changed = cpu_steps.layer_weights(layers[0])
        assert not torch.equal(changed[2], w[2])  # the packed qkv bias follows the change
    assert cpu_steps.remembered("k", lambda: 7) == 7  # outside any scope: computed each time


@pytest.mark.parametrize("min_value,eos", [(0.0, None), (0.3, None), (0.0, "drafted")])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_a_cpu_step_draft_chain_equals_the_eager_loop(eager, min_value, eos, draft_vocab):
    """One CPU call drafts the chain the Python loop drafts: same tokens, same draft cache. (The native chain's
    one-row products read the draft's weights rounded to bf16, `cpu_steps.panels`; weights that bf16 holds exactly
    make the two paths comparable, the target's embedding and head included.)"""
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

    def run():
        head.prepare(32, 64)
        h_root = head.extend(feats, nxt, torch.arange(6), 0, last_only=True)
        eos_id = None
        if eos == "drafted":  # the second drafted token, as EOS: the chain must stop right after it
            probe = draft_tree(head, torch.tensor([3]), h_root, 6, 6, TreeConfig.chain(3, 0.0))
            eos_id = int(probe.tokens[2])
        tree = draft_tree(head, torch.tensor([3]), h_root, 6, 6, cfg, eos_id)
        return tree.tokens, tree.parents, head.layer.self_attn.kv_cache.k[:, :, : 6 + len(tree)].clone()

    (ta, pa, ka), (tb, pb, kb) = both_paths(eager, run)
    assert torch.equal(ta, tb) and torch.equal(pa, pb)
    assert_all_close(ka, kb)
    if eos == "drafted":
        assert len(ta) == 3  # root + two drafts, the second one EOS
    if min_value == 0.0 and eos is None:
        assert len(ta) == 9  # no cut: the full depth


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


def test_a_cpu_step_greedy_chain_cycle_equals_the_eager_one(eager):
    """Each side of a greedy chain cycle in one CPU call (`draft_cycle`, `verify_chain_greedy`): the
    same tokens, the same accepted lengths, the same target and draft caches as the eager cycle."""
    from litevlm.spec import speculative_generate
    from litevlm.spec.tree import TreeConfig

    model = tiny_vlm(vocab=24)  # a small vocabulary so that a random draft is often right
    head = random_draft(model)
    embeds, pos = prompt(model, seed=5)
    cfg = TreeConfig.chain(6, 0.05)

    def run():
        out = speculative_generate(model, head, embeds, pos, 30, None, tree=cfg)
        return out.tokens, out.accept_lengths, caches(model), head.layer.self_attn.kv_cache.k.clone()

    (tok_a, acc_a, *rest_a), (tok_b, acc_b, *rest_b) = both_paths(eager, run)
    assert {2, 3} <= set(eager.calls)  # both fused calls ran
    assert tok_a == tok_b and acc_a == acc_b
    assert max(acc_a) >= 2  # drafts were accepted
    n = embeds.shape[1] + 30
    assert_all_close(
        [[k[:, :, :n], v[:, :, :n]] for k, v in rest_a[0]], [[k[:, :, :n], v[:, :, :n]] for k, v in rest_b[0]]
    )


def test_a_native_prompt_equals_the_eager_one(monkeypatch):
    """A prompt from slot 0 (a prefill, and a pruned prefill's two halves at skipping positions) runs as one
    native call: the same hidden states and cache contents as the eager layers; hooked layers stay eager."""
    backend_steps("native")
    model = tiny_vlm(layers=3)
    lm = model.language_model
    embeds, pos = prompt(model, seed=5, n=20, pruned=True)
    t = embeds.shape[1]
    kept = torch.tensor([0, 1, 4, 5, 9, 12, 13, 17, 19])
    calls = []
    real = cpu_steps.prompt_layers
    monkeypatch.setattr(
        cpu_steps, "prompt_layers", lambda *a, **k: (lambda r: calls.append(r is not None) or r)(real(*a, **k))
    )

    def run():
        with torch.no_grad():
            full = lm(embeds, pos, slots=torch.arange(t), mask=None, kv_len=t)
            first = lm(embeds, pos, slots=torch.arange(t), mask=None, kv_len=t, end_layer=1)
            rest = lm(
                first[:, kept],
                pos[:, kept],
                slots=torch.arange(kept.numel()),
                mask=None,
                kv_len=kept.numel(),
                start_layer=1,
            )
            return full, first, rest, caches(model)

    fast = run()
    assert calls == [True, True, True]  # each of the three prompts ran natively
    monkeypatch.setattr(cpu_steps, "_BACKEND", ["torchscript"])  # prompt_layers now declines: the eager layers run
    assert_all_close(fast, run())
    monkeypatch.setattr(cpu_steps, "_BACKEND", ["native"])
    hook = lm.layers[1].mlp.register_forward_hook(lambda *a: None)
    try:
        assert cpu_steps.prompt_layers(embeds[0], *lm.rope_table(t, torch.float32, "cpu"), lm.layers, lm.cfg) is None
    finally:
        hook.remove()


def test_a_native_bf16_prompt_multiplies_in_bf16_around_an_fp32_stream(monkeypatch):
    """In bf16 mode (`set_bf16_matmul`) a prompt still runs as one native call, its four products per layer in bf16:
    close to fp32, and not equal to it."""
    from litevlm.model.lm import bf16_matmul_supported

    backend_steps("native")
    if not bf16_matmul_supported():
        pytest.skip("this CPU multiplies bf16 neither with AMX nor with AVX512-BF16")
    model = tiny_vlm(layers=3)
    lm = model.language_model
    embeds, pos = prompt(model, seed=5, n=40)
    t = embeds.shape[1]
    modes = []
    real = cpu_steps.prompt_layers
    monkeypatch.setattr(
        cpu_steps,
        "prompt_layers",
        lambda *a, **k: (lambda r: modes.append((k.get("bf16"), r is not None)) or r)(real(*a, **k)),
    )
    with torch.no_grad():
        fp32 = lm(embeds, pos, slots=torch.arange(t), mask=None, kv_len=t)
        model.set_bf16_matmul(8)
        bf16 = lm(embeds, pos, slots=torch.arange(t), mask=None, kv_len=t)
    assert modes == [(False, True), (True, True)]  # both ran natively, the second with bf16 products
    assert not torch.equal(bf16, fp32)
    # bf16 products (~3e-3 relative each) compounded through a random decoder whose large weights amplify them.
    assert ((bf16 - fp32).norm() / fp32.norm()) < 6e-2  # a random decoder with large weights amplifies rounding


def test_a_failed_native_build_falls_back_to_torchscript_and_says_why(monkeypatch, capsys):
    """No compiler (or a broken build): `native.ops()` is None with the reason on stderr and in `error()`, and
    the CPU steps run in TorchScript, still equal to the eager path."""

    def broken(verbose=False):
        raise RuntimeError("ninja: build stopped\nfoo.cpp:1:1: error: no compiler here")

    monkeypatch.setattr(native, "build", broken)
    monkeypatch.setattr(native, "_LOADED", [])
    monkeypatch.setattr(native, "_ERROR", [])
    monkeypatch.setattr(cpu_steps, "_STEPS", [])
    monkeypatch.setattr(cpu_steps, "_BACKEND", [])
    assert native.ops() is None
    assert "error: no compiler here" in native.error()
    assert "native CPU steps unavailable" in capsys.readouterr().err
    if cpu_steps._scripted_steps() is None:
        pytest.skip("no TorchScript either")
    assert cpu_steps.backend() == "torchscript"
    model = tiny_vlm(layers=2)
    embeds, pos = prompt(model, seed=6)
    t = embeds.shape[1]
    with torch.no_grad():
        prefill(model, embeds, pos)
        plan = model.language_model.step_plan()
        fast = decode_step(model, torch.tensor([[9]]), t, t, plan)
        monkeypatch.setattr(cpu_steps, "_STEPS", [None])  # the eager path
        prefill(model, embeds, pos)
        assert model.language_model.step_plan() is None
        assert_all_close(fast, decode_step(model, torch.tensor([[9]]), t, t, None))


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
    with torch.no_grad():
        head.prepare(32, 64)
    weights = head._plan.weights
    listed = cpu_steps._draft_panels(head._chain_args[1], head._chain_args[3], weights, 4, 2, 8)
    assert len(listed) == 2 + 4 * len(weights)
    assert cpu_steps._draft_panels(head._chain_args[1], head._chain_args[3], weights, 4, 2, 8) is listed
