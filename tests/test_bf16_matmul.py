"""bf16 matmuls for the many-row stages (vision, prefill) on CPUs with AMX / AVX512-BF16: close to fp32,
off for the few-row steps (decode, verification), refused where the CPU lacks them."""

import pytest
import torch
from test_spec import prompt, tiny_vlm

from litevlm.errors import LiteVLMError
from litevlm.model import layers as layers_module
from litevlm.model.generate import decode_step, prefill
from litevlm.model.layers import bf16_matmul_supported

needs_bf16 = pytest.mark.skipif(not bf16_matmul_supported(), reason="this CPU has no AMX / AVX512-BF16")


@needs_bf16
@pytest.mark.parametrize("cpu_steps_apply", [True, False])
def test_bf16_vision_and_prefill_stay_close_and_steps_stay_fp32(cpu_steps_apply, monkeypatch):
    """Decode steps and tree verifications (any number of rows: a 20-node chain here, over the 8-row
    threshold) stay fp32, so speculative decoding stays lossless against plain decoding in bf16 mode too;
    on the native steps (whose prompts multiply in bf16) and on the modules (whose decoder stays fp32) alike."""
    from litevlm.model.backend import choose_backend
    from litevlm.spec.tree import chain_tree, verify_tree

    model = tiny_vlm(layers=2)

    def be():  # a backend made afresh after each change of the matmul mode, as Pipeline.rebuild does
        return choose_backend("native" if cpu_steps_apply else "modules", model)

    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    embeds, pos = prompt(model, seed=2, n=40)
    with torch.no_grad():
        vis32 = model.encode_tiles(pixels)
        logits32, hidden32 = prefill(be(), embeds, pos)
        step32 = decode_step(be(), torch.tensor([[9]]), 40, 40)[0]
        chain = chain_tree(torch.arange(7, 27))
        verify32 = verify_tree(be(), chain, 40, 40)
        model.set_bf16_matmul(8)
        assert model.matmul_precision == "bf16"
        vis16 = model.encode_tiles(pixels)
        logits16, hidden16 = prefill(be(), embeds, pos)
        # the decode step reads the (now bf16-made) prompt cache, but itself multiplies in fp32
        model.set_bf16_matmul(0)
        prefill(be(), embeds, pos)
        model.set_bf16_matmul(8)
        step16 = decode_step(be(), torch.tensor([[9]]), 40, 40)[0]
        model.set_bf16_matmul(0)
        prefill(be(), embeds, pos)
        model.set_bf16_matmul(8)
        verify16 = verify_tree(be(), chain, 40, 40)
    assert not torch.equal(vis16, vis32)  # the tower's bf16 path ran
    # the decoder's prompt multiplies in bf16 on the native steps; the modules keep it fp32
    assert torch.equal(hidden16, hidden32) != cpu_steps_apply
    assert all(
        block._packed16 is not None for block in model.vision_tower.encoder.layer
    )  # the tower ran in bf16 blocks
    # bf16 rounding (~3e-3 a product, as above) compounded through the tower's blocks and its layer norms.
    assert ((vis16 - vis32).norm() / vis32.norm()) < 2e-2
    assert (
        (hidden16 - hidden32).norm() / hidden32.norm()
    ) < 6e-2  # a random decoder with large weights amplifies rounding
    # one decode row is below the bf16 threshold (8 rows): both steps multiply in fp32, on caches written by two fp32
    # prefills whose kernels may block the sums differently; 1e-5 ~ 80 eps of these O(1) logits.
    torch.testing.assert_close(step16, step32, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(verify16, verify32, atol=1e-5, rtol=1e-5)


def test_bf16_matmul_is_refused_where_the_cpu_lacks_it(monkeypatch):
    model = tiny_vlm()
    monkeypatch.setattr(layers_module, "bf16_matmul_supported", lambda: False)
    with pytest.raises(LiteVLMError, match="AMX"):
        model.set_bf16_matmul(32)
    model.set_bf16_matmul(0)  # turning it off always works
    assert model.matmul_precision == "float32"


@needs_bf16
def test_speculative_decoding_stays_lossless_with_bf16_prefill(full_model_dir):
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.pipeline import Pipeline

    images = render_views(make_frame(1, 0), size=(160, 90))
    plain = Pipeline.from_pretrained(full_model_dir, select_tokens=0.5, max_new_tokens=10, matmul="bf16")
    spec = Pipeline.from_pretrained(
        full_model_dir, select_tokens=0.5, speculative=True, max_new_tokens=10, matmul="bf16"
    )
    for pipe in (plain, spec):  # the tiny model's prompts are short: lower the row threshold so the prefill runs bf16
        pipe.model.set_bf16_matmul(16)
    for q in ("Is there a red car to the front of the ego car?", "What is behind us on the left?"):
        a, b = plain.answer(q, images), spec.answer(q, images)
        assert a.tokens == b.tokens and a.precision == b.precision == "bf16-matmul+float32"
    with pytest.raises(LiteVLMError, match="matmul"):
        Pipeline.from_pretrained(full_model_dir, matmul="int4")


@needs_bf16
def test_bf16_mode_leaves_fp8_decoder_layers_alone(full_model_dir):
    """FP8 quantises the decoder's linears; bf16 mode then runs the vision tower in bf16 and leaves those
    layers to their FP8 path (it used to try packing their FP8 weights and fail)."""
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.pipeline import Pipeline

    images = render_views(make_frame(1, 0), size=(160, 90))
    pipe = Pipeline.from_pretrained(full_model_dir, fp8="fp8-dynamic-per-row", matmul="bf16", max_new_tokens=6)
    ans = pipe.answer("Is there a red car to the front of the ego car?", images)
    assert ans.tokens and ans.precision.startswith("fp8")
