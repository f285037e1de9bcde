"""The decoder layer's fused CPU inference path: same outputs as the module path, never stale, never
in the way of training, hooks or quantised projections."""

import pytest
import torch
import torch.nn as nn

from litevlm.config import TextConfig
from litevlm.model.lm import DecoderLayer, linear, rope_cos_sin

CFG = TextConfig(
    vocab_size=64,
    hidden_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=96,
    rope_theta=1e4,
    qkv_bias=True,
)


@pytest.fixture
def layer():
    torch.manual_seed(0)
    layer = DecoderLayer(CFG).eval()
    for p in layer.parameters():  # norms away from 1, biases away from 0: every packed part matters
        nn.init.normal_(p, mean=0.5 if p.ndim == 1 else 0.0, std=0.2)
    return layer


def inputs(t: int = 5):
    x = torch.randn(1, t, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(torch.arange(10, 10 + t)[None], CFG.head_dim, CFG.rope_theta, x.dtype)
    return x, cos, sin


def module_path(layer: DecoderLayer, x, cos, sin) -> torch.Tensor:
    """The layer as its modules compute it (the training path)."""
    h = x + layer.self_attn(layer.input_layernorm(x), cos, sin)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def test_fused_inference_equals_the_module_path(layer):
    x, cos, sin = inputs()
    with torch.no_grad():
        ref = module_path(layer, x, cos, sin)
        out = layer(x, cos, sin)
    assert layer._fused is not None  # the fused path ran
    # fp32, two codes for one layer (fused weights, modules): sums of up to the MLP's width in another order, ~eps x
    # width ~ 1e-5 of O(1) activations; a missed bias or a stale weight is O(1).
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fused_weights_follow_an_in_place_update(layer):
    x, cos, sin = inputs()
    with torch.no_grad():
        layer(x, cos, sin)
        layer.mlp.down_proj.weight.mul_(-1.0)  # what an optimizer step or load_state_dict does
        layer.self_attn.q_proj.bias.add_(1.0)
        # fused against module path after an in-place change: the same reordering bound as above.
        torch.testing.assert_close(layer(x, cos, sin), module_path(layer, x, cos, sin), atol=1e-5, rtol=1e-5)
        fresh = nn.Linear(CFG.intermediate_size, CFG.hidden_size, bias=False)  # a new plain module, new weights
        layer.mlp.down_proj = fresh
        # fused against module path after an in-place change: the same reordering bound as above.
        torch.testing.assert_close(layer(x, cos, sin), module_path(layer, x, cos, sin), atol=1e-5, rtol=1e-5)


def test_training_keeps_gradients_and_hooks_see_every_projection(layer):
    x, cos, sin = inputs()
    layer.train()
    layer(x, cos, sin).sum().backward()
    assert layer.self_attn.q_proj.weight.grad is not None and layer.mlp.down_proj.weight.grad is not None
    layer.eval()
    seen = []
    handle = layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        layer(x, cos, sin)
    handle.remove()
    assert seen == [(1, 5, CFG.num_kv_heads * CFG.head_dim)]  # a hooked layer runs through its modules


def test_a_replaced_projection_disables_fusion(layer):
    class Scaled(nn.Module):  # stands in for a quantised linear
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return 2.0 * self.lin(x)

    layer.mlp.up_proj = Scaled(layer.mlp.up_proj)
    assert not layer.fusable()
    x, cos, sin = inputs()
    with torch.no_grad():
        # not fusable: both run the modules, so assert_close's fp32 defaults (1.3e-6 relative) are equality up to a bit.
        torch.testing.assert_close(layer(x, cos, sin), module_path(layer, x, cos, sin))


def test_linear_helper_equals_the_module_and_refreshes():
    lin = nn.Linear(16, 24)
    x = torch.randn(3, 2, 16)
    with torch.no_grad():
        # F.linear with the module's own tensors: fp32 defaults, one rounding at most.
        torch.testing.assert_close(linear(x, lin), lin(x))
        lin.weight.mul_(3.0)
        # F.linear with the module's own tensors: fp32 defaults, one rounding at most.
        torch.testing.assert_close(linear(x, lin), lin(x))
    y = linear(x, lin)  # grad enabled: the module itself, so gradients reach the weight
    y.sum().backward()
    assert lin.weight.grad is not None
