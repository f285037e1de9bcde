"""FP8 post-training quantisation (litevlm.quant.fp8): numerics, the converter's filter and report,
calibration, checkpoints, and (gpu-marked) the fake-quant reference against the real FP8 GEMM."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

from litevlm.config import TextConfig, VisionConfig, VLMConfig
from litevlm.errors import LiteVLMError
from litevlm.model.lm import DecoderLayer
from litevlm.model.vlm import VLM
from litevlm.quant.fp8 import (
    E4M3,
    FP8Linear,
    FP8Recipe,
    QuantReport,
    calibrate,
    check_scaled_mm_args,
    fp8_mm,
    fp8_mm_reference,
    load_fp8,
    precision_of,
    quantize_fp8,
    quantize_model,
    read_fp8_meta,
    save_fp8,
    sqnr,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest gives ~31 dB on one operand, ~28 dB with both operands
# quantised (28.5 dB measured on an H200 and in the CPU emulation). 25 dB leaves
# room for heavy-tailed inputs; a wrong scale or a missing clamp lands far below it.
SQNR_BOUND_DB = 25.0
STATIC, DYNAMIC = FP8Recipe("fp8-static-per-tensor"), FP8Recipe("fp8-dynamic-per-row")
LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
VISION_LINEARS = (
    "attention.q_proj",
    "attention.k_proj",
    "attention.v_proj",
    "attention.projection_layer",
    "mlp.fc1",
    "mlp.fc2",
)


def tiny_cfg(intermediate: int = 128, tie: bool = False) -> VLMConfig:
    return VLMConfig(
        vision=VisionConfig(
            hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, image_size=56, patch_size=14
        ),
        text=TextConfig(
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=intermediate,
            tie_embeddings=tie,
        ),
        image_token_id=500,
        img_start_id=501,
        img_end_id=502,
        eos_token_id=503,
        pad_token_id=0,
        name="tiny-fp8",
    )


def tiny_inputs(seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 400, (batch, 24), generator=g)
    ids[:, 3:7] = 500  # one tile's 4 visual tokens per sample
    return ids, torch.randn(batch, 3, 56, 56, generator=g)


def tiny_vlm(seed: int = 0, **kw) -> VLM:
    torch.manual_seed(seed)
    return VLM(tiny_cfg(**kw)).eval()


def outlier_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian tokens with a few large channels, as LLM residual streams have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :4] *= 30.0
    return x


def make_linear(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


# ------------------------------------------------------------------------------------------------
# Numerics
# ------------------------------------------------------------------------------------------------
def test_quantize_clamps_before_the_cast():
    x = torch.tensor([1.0, 500.0, -1e4, float("inf"), float("-inf"), 1e38])
    q = quantize_fp8(x, torch.tensor(1.0))
    assert q.dtype == E4M3
    assert q.float().tolist() == [1.0, 448.0, -448.0, 448.0, -448.0, 448.0]


@pytest.mark.parametrize("recipe", [STATIC, DYNAMIC], ids=lambda r: r.name)
def test_sqnr_per_layer_on_outlier_activations(recipe):
    lin = make_linear(256, 512)
    calib, test = outlier_activations(64, 256, seed=1), outlier_activations(64, 256, seed=2)
    amax = float(calib.abs().max()) if recipe.static else None
    q = FP8Linear.from_linear(lin, recipe, amax)
    with torch.no_grad():
        db = sqnr(lin(test), q(test))
    assert db > SQNR_BOUND_DB, f"{recipe.name}: {db:.1f} dB"


@pytest.mark.parametrize("recipe", [STATIC, DYNAMIC], ids=lambda r: r.name)
def test_sqnr_per_layer_on_activations_of_a_vlm_forward(recipe):
    """Every quantised layer (decoder and vision) on the inputs it really sees, calibrated on other inputs."""
    model = tiny_vlm()
    ref = copy.deepcopy(model)
    calib_ids, calib_px = tiny_inputs(seed=1)
    recipe = FP8Recipe(recipe.name, include_vision=True)
    amax = calibrate(model, lambda: model(calib_ids, calib_px), recipe) if recipe.static else None
    report = quantize_model(model, recipe, amax)
    assert len(report.quantized) == 2 * 7 + 2 * 6 + 2

    seen: dict[str, torch.Tensor] = {}
    hooks = [
        ref.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: seen.setdefault(n, a[0]))
        for n in report.quantized
    ]
    ids, px = tiny_inputs(seed=2)
    with torch.no_grad():
        ref_logits = ref(ids, px)
        for h in hooks:
            h.remove()
        worst = min((sqnr(ref.get_submodule(n)(x), model.get_submodule(n)(x)), n) for n, x in seen.items())
        logits = model(ids, px)
    assert worst[0] > SQNR_BOUND_DB, f"{worst[1]}: {worst[0]:.1f} dB"
    assert sqnr(ref_logits, logits) > 20.0  # 28 layers' errors compound (about 30 dB measured)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("recipe", [STATIC, DYNAMIC], ids=lambda r: r.name)
def test_projections_reading_one_input_quantise_it_once_with_the_same_outputs(recipe, monkeypatch):
    """q/k/v and gate/up quantise their shared input once (4 quantisations a decoder layer, not 7); the logits are
    the bytes of quantising it for each of them."""
    model = tiny_vlm()
    ids, px = tiny_inputs(seed=2)
    amax = calibrate(model, lambda: model(*tiny_inputs(seed=1)), recipe) if recipe.static else None
    quantize_model(model, recipe, amax)
    calls = []
    quantize_input = FP8Linear.quantize_input
    monkeypatch.setattr(FP8Linear, "quantize_input", lambda self, x: calls.append(1) or quantize_input(self, x))
    with torch.no_grad():
        shared = model(ids, px)
        assert len(calls) == 4 * len(model.language_model.layers)
        monkeypatch.setattr(FP8Linear, "shared_input", lambda self, x, readers: x)  # each quantises on its own
        calls.clear()
        alone = model(ids, px)
        assert len(calls) == 7 * len(model.language_model.layers)
    assert torch.equal(shared, alone)


def test_overflow_is_clamped_never_nan():
    lin = make_linear(64, 32)
    q = FP8Linear.from_linear(lin, STATIC, input_amax=1.0)
    x = torch.randn(5, 64)
    x[0, 0], x[1, 3], x[2, 5], x[3, 7] = 1e4, -1e30, float("inf"), float("-inf")
    with torch.no_grad():
        y = q(x)
        assert torch.isfinite(y).all()
        # beyond the calibrated max a value saturates exactly as if it had been the max
        assert torch.equal(y, q(x.clamp(-1.0, 1.0)))
        assert torch.isfinite(q(x.bfloat16())).all()
        d = FP8Linear.from_linear(lin, DYNAMIC)
        assert torch.isfinite(d(torch.randn(4, 64) * 1e30)).all()


def test_static_and_dynamic_modes_differ_where_they_should():
    """A row far below the calibrated range underflows with one static scale; per-row scales keep it."""
    lin = make_linear(64, 64, bias=False)
    x = torch.randn(8, 64)
    x[0] *= 1e-5
    static = FP8Linear.from_linear(lin, STATIC, float(x.abs().max()))
    dynamic = FP8Linear.from_linear(lin, DYNAMIC)
    assert static.input_scale.shape == () and static.weight_scale.shape == ()
    assert dynamic.input_scale is None and dynamic.weight_scale.shape == (64, 1)
    with torch.no_grad():
        ref = lin(x)
        assert sqnr(ref[0], dynamic(x)[0]) > SQNR_BOUND_DB
        assert sqnr(ref[0], static(x)[0]) < 10.0
        assert sqnr(ref[1:], static(x)[1:]) > SQNR_BOUND_DB
        # dynamic scales follow each batch: the same row gives the same output whatever else is in it
        assert torch.allclose(dynamic(x[2:3]), dynamic(x)[2:3])


def test_reference_matches_torch_scaled_mm_semantics_on_cpu():
    """Our scale convention (dequantisation scales, per tensor and per row) is PyTorch's, at toy size."""
    a = quantize_fp8(torch.randn(4, 32), torch.tensor(0.01))
    b = quantize_fp8(torch.randn(48, 32), torch.tensor(0.02)).t()  # (K, N) column-major
    for sa, sb in [(torch.tensor(0.5), torch.tensor(2.0)), (torch.rand(4, 1), torch.rand(1, 48))]:
        try:
            expected = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"no CPU _scaled_mm in this build: {e}")
        # the same fp8 operands and scales, fp32 accumulation in two kernels (ours, torch._scaled_mm): reordered sums of
        # length 64, ~64 eps ~ 8e-6 of O(1) outputs.
        torch.testing.assert_close(
            fp8_mm_reference(a, b, sa, sb, out_dtype=torch.float32), expected, rtol=1e-5, atol=1e-5
        )


def test_cuda_gemm_rules_are_checked_on_every_device():
    a = quantize_fp8(torch.randn(3, 32), torch.tensor(0.01))
    w = quantize_fp8(torch.randn(48, 32), torch.tensor(0.01))
    one = torch.tensor(1.0)
    check_scaled_mm_args(a, w.t(), one, one)  # M=3 is fine: only K and N must be multiples of 16
    check_scaled_mm_args(a, w.t(), torch.ones(3, 1), torch.ones(1, 48))
    bad = [
        (a[None], w.t(), one, one),  # 3-D
        (a, w.t().contiguous(), one, one),  # row-major B
        (a[:, :24], w[:, :24].t(), one, one),  # K = 24
        (a, w[:40].t(), one, one),  # N = 40
        (a, w.t(), one.bfloat16(), one),  # bf16 scale
        (a, w.t(), torch.ones(3), torch.ones(48)),  # 1-D row-wise scales
        (a, w.t(), torch.ones(3, 1), one),  # mixed granularity
        (a.float(), w.t(), one, one),  # not float8
    ]
    for args in bad:
        with pytest.raises(ValueError):
            check_scaled_mm_args(*args)


def test_dtype_casts_keep_float8_weights_and_fp32_scales():
    q = FP8Linear.from_linear(make_linear(64, 32), STATIC, 3.0)
    q.to(torch.bfloat16)
    assert q.weight.dtype == E4M3 and q.weight_scale.dtype == torch.float32 and q.input_scale.dtype == torch.float32
    assert q.bias.dtype == torch.bfloat16
    assert q(torch.randn(2, 3, 64, dtype=torch.bfloat16)).shape == (2, 3, 32)
    assert q(torch.randn(2, 3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert not q.use_kernel  # CPU: the reference path
    q.half().float()
    assert q.weight.dtype == E4M3 and q.bias.dtype == torch.float32


@pytest.mark.parametrize("recipe", [STATIC, DYNAMIC], ids=lambda r: r.name)
def test_fp8_linear_traces_as_one_graph(recipe):
    q = FP8Linear.from_linear(make_linear(64, 32), recipe, 3.0)
    x = torch.randn(2, 5, 64)
    compiled = torch.compile(q, fullgraph=True, backend="eager")  # tracing only: no graph breaks
    with torch.no_grad():
        # the eager backend traces and replays the same ops: equality.
        assert torch.equal(compiled(x), q(x))


# ------------------------------------------------------------------------------------------------
# Converter: the filter and its report
# ------------------------------------------------------------------------------------------------
def test_default_filter_quantises_decoder_linears_only():
    model = tiny_vlm()
    amax = calibrate(model, lambda: model(*tiny_inputs(1)), STATIC)
    report = quantize_model(model, STATIC, amax)
    expected = [f"language_model.layers.{i}.{p}" for i in range(2) for p in LAYER_LINEARS]
    assert sorted(report.quantized) == sorted(expected) and sorted(amax) == sorted(expected)
    assert all(isinstance(model.get_submodule(n), FP8Linear) for n in expected)
    assert report.unsupported == {}
    for name in (
        "lm_head",
        "language_model.embed_tokens",
        "language_model.norm",
        "language_model.layers.0.input_layernorm",
        "vision_tower.encoder.layer.0.attention.q_proj",
        "multi_modal_projector.linear_1",
        "vision_tower.embeddings.patch_embeddings.projection",
    ):
        assert name in report.kept, name
        assert type(model.get_submodule(name)) is not FP8Linear
    assert "include_vision" in report.kept["vision_tower.encoder.layer.0.mlp.fc1"]
    assert "LM head" in report.kept["lm_head"] and report.kept["language_model.embed_tokens"] == "embedding"
    # every module that owns parameters is accounted for
    owners = {n for n, m in tiny_vlm().named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert owners == set(report.quantized) | set(report.kept)
    assert report.summary().startswith("fp8-static-per-tensor: 14 linear layers quantised to FP8")
    with pytest.raises(LiteVLMError, match="already"):
        quantize_model(model, DYNAMIC)


def test_vision_is_a_separate_option():
    model = tiny_vlm()
    report = quantize_model(model, FP8Recipe("fp8-dynamic-per-row", include_vision=True))
    vision = [f"vision_tower.encoder.layer.{i}.{p}" for i in range(2) for p in VISION_LINEARS]
    assert set(vision + ["multi_modal_projector.linear_1", "multi_modal_projector.linear_2"]) <= set(report.quantized)
    assert "lm_head" in report.kept and "vision_tower.encoder.layer.0.layernorm_before" in report.kept


def test_selectors_draft_head_and_exclusions_are_kept():
    wrapper = nn.Module()
    wrapper.vlm = tiny_vlm()
    wrapper.token_selector = DecoderLayer(wrapper.vlm.cfg.text)  # a copy of decoder layer 0
    wrapper.draft_head = nn.Linear(64, 64)
    recipe = FP8Recipe("fp8-dynamic-per-row", exclude=("*.layers.1.mlp.down_proj",))
    report = quantize_model(wrapper, recipe)
    assert "vlm.language_model.layers.0.mlp.up_proj" in report.quantized
    assert "selector" in report.kept["token_selector.mlp.up_proj"] and "draft" in report.kept["draft_head"]
    assert "pattern" in report.kept["vlm.language_model.layers.1.mlp.down_proj"]
    assert len(report.quantized) == 13


def test_unsupported_shapes_are_reported_not_skipped_silently():
    model = tiny_vlm(intermediate=120)  # 120 is not a multiple of 16
    report = quantize_model(model, DYNAMIC)
    assert sorted(report.unsupported) == sorted(
        f"language_model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    )
    assert "out_features=120 is not a multiple of 16" in report.unsupported["language_model.layers.0.mlp.up_proj"]
    assert "in_features=120 is not a multiple of 16" in report.unsupported["language_model.layers.0.mlp.down_proj"]
    assert type(model.get_submodule("language_model.layers.0.mlp.up_proj")) is nn.Linear
    assert len(report.quantized) == 8 and "UNSUPPORTED" in report.summary()
    with torch.no_grad():
        assert torch.isfinite(model(*tiny_inputs(1))).all()
    with pytest.raises(LiteVLMError, match="unsupported shape"):
        quantize_model(tiny_vlm(intermediate=120), DYNAMIC, strict=True)


# ------------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------------
def test_calibration_keeps_the_running_max_and_removes_its_hooks():
    model = tiny_vlm()
    batches = [tiny_inputs(s, batch=1) for s in range(3)]
    per_batch = [calibrate(model, lambda b=b: model(*b), STATIC) for b in batches]
    together = calibrate(model, (lambda b=b: model(*b) for b in batches), STATIC, progress=False, total=3)
    assert together == {n: max(d[n] for d in per_batch) for n in together}
    assert all(not m._forward_pre_hooks for m in model.modules())

    def poisoned():
        ids, px = batches[0]
        model(ids, px * float("inf"))

    with pytest.raises(LiteVLMError, match="non-finite"):
        calibrate(model, poisoned, FP8Recipe(include_vision=True))
    with pytest.raises(LiteVLMError, match="calibrate"):
        quantize_model(tiny_vlm(), STATIC)  # static without amax
    with pytest.raises(LiteVLMError, match="no calibration data"):
        quantize_model(tiny_vlm(), FP8Recipe(include_vision=True), per_batch[0])  # vision layers not calibrated


def test_recipe_validation():
    with pytest.raises(ValueError, match="name"):
        FP8Recipe("fp8-magic")
    with pytest.raises(ValueError, match="format"):
        FP8Recipe(format="e5m2")
    r = FP8Recipe("fp8-dynamic-per-row", include_vision=True, exclude=("a*",))
    assert FP8Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_load_round_trip(tmp_path, tie):
    model = tiny_vlm(tie=tie)
    recipe = FP8Recipe(include_vision=True)
    amax = calibrate(model, lambda: model(*tiny_inputs(1)), recipe)
    report = quantize_model(model, recipe, amax)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    out = save_fp8(model, tmp_path / "ckpt", recipe, report, tmp_path / "src")
    assert (out / "tokenizer.json").is_file()
    meta = json.loads((out / "config.json").read_text())
    assert meta["fp8"]["recipe"]["name"] == "fp8-static-per-tensor" and meta["litevlm"]["name"] == "tiny-fp8"
    assert read_fp8_meta(out) == (recipe, report)

    loaded = load_fp8(out)
    for name in report.quantized:
        a, b = model.get_submodule(name), loaded.get_submodule(name)
        assert isinstance(b, FP8Linear) and b.weight.dtype == E4M3
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.input_scale, b.input_scale) and torch.equal(a.weight_scale, b.weight_scale)
    assert (loaded.lm_head.weight is loaded.language_model.embed_tokens.weight) == tie
    ids, px = tiny_inputs(2)
    with torch.no_grad():
        # the same weights and scales, bit for bit, through the same code: equality.
        assert torch.equal(model(ids, px), loaded(ids, px))
    assert precision_of(loaded) == "fp8-static-per-tensor+float32"
    bf16 = load_fp8(out, dtype=torch.bfloat16)
    assert precision_of(bf16) == "fp8-static-per-tensor+bfloat16"
    assert bf16.get_submodule(report.quantized[0]).weight.dtype == E4M3


def test_load_refuses_plain_and_mismatched_checkpoints(tmp_path):
    from litevlm.model.hf import save_native

    save_native(tiny_vlm(), tmp_path / "plain")
    assert read_fp8_meta(tmp_path / "plain") is None
    with pytest.raises(LiteVLMError, match="not an FP8 checkpoint"):
        load_fp8(tmp_path / "plain")
    model = tiny_vlm()
    report = quantize_model(model, DYNAMIC)
    bad = QuantReport(report.recipe, report.quantized[:-1], report.kept, report.unsupported)
    save_fp8(model, tmp_path / "bad", DYNAMIC, bad)
    with pytest.raises(LiteVLMError, match="does not match"):
        load_fp8(tmp_path / "bad")


# ------------------------------------------------------------------------------------------------
# The real FP8 GEMM (CUDA, compute capability >= 8.9)
# ------------------------------------------------------------------------------------------------
def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(_fp8_gpu(), reason="checks the no-GPU path of the benchmark")
def test_gpu_benchmark_skips_cleanly_without_a_capable_gpu(capsys, benchmark_script):
    bench = benchmark_script("fp8_gpu")
    assert bench.main([]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["skipped"] is True and record["measured"] is False and record["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("recipe", [STATIC, DYNAMIC], ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 200])
def test_reference_equals_scaled_mm_on_gpu(recipe, dtype, m):
    lin = make_linear(256, 512).cuda().to(dtype)
    x = outlier_activations(m, 256, seed=3).cuda().to(dtype)
    q = FP8Linear.from_linear(lin, recipe, float(x.abs().max()) if recipe.static else None)
    assert q.use_kernel
    with torch.no_grad():
        real = q(x)
        q.use_kernel = False
        ref = q(x)
    assert real.dtype == ref.dtype == dtype
    # Same float8 operands and scales: only the accumulation order (and the tensor cores' internal
    # accumulation width) and one output rounding differ. FP8 quantisation error itself is ~3 %.
    tight = 1e-2 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(real, ref, rtol=tight, atol=tight * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_mm_equals_reference_on_gpu(rowwise, out_dtype):
    dev = "cuda"
    a = quantize_fp8(torch.randn(200, 256, device=dev), torch.tensor(0.01, device=dev))  # (M, K) row-major
    b = quantize_fp8(torch.randn(512, 256, device=dev), torch.tensor(0.01, device=dev)).t()  # (K, N) column-major
    if rowwise:
        sa, sb = torch.rand(200, 1, device=dev) + 0.1, torch.rand(1, 512, device=dev) + 0.1
    else:
        sa, sb = torch.tensor(0.3, device=dev), torch.tensor(0.7, device=dev)
    for bias in (None, torch.randn(512, device=dev).to(out_dtype)):
        real = fp8_mm(a, b, sa, sb, bias, out_dtype)
        ref = fp8_mm_reference(a, b, sa, sb, bias, out_dtype)
        scale = float(ref.abs().max())
        tight = 1e-2 if out_dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(real, ref, rtol=tight, atol=tight * scale)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
def test_compiled_fp8_model_matches_eager_on_gpu():
    model = tiny_vlm().cuda().to(torch.bfloat16)
    ids, px = (t.cuda() for t in tiny_inputs(1))
    amax = calibrate(model, lambda: model(ids, px), STATIC)
    quantize_model(model, STATIC, amax)
    with torch.no_grad():
        eager = model(ids, px)
        compiled = torch.compile(model)(ids, px)  # embed() counts placeholders on the host: not one graph
    assert torch.isfinite(compiled).all()
    # inductor fuses past the bf16 roundings the modules make before each e4m3 cast (3 mantissa bits, steps of
    # 6-12 %), so a few values land on the neighbouring FP8 step: the outputs agree as a whole, not element by element
    err = (compiled.float() - eager.float()).norm() / eager.float().norm()
    assert err < 5e-2, f"compiled FP8 model off by {err:.3f} of the eager one's norm"
