"""The FP8 GEMM's output dtype per compute capability: torch's row-wise `_scaled_mm` writes fp32 only where it runs
in cuBLAS (Hopper, CUDA >= 12.9); on Ada (8.9) its CUTLASS kernel writes bf16 only, so the product is made in bf16
and cast. The decision is a pure function, tested here for both GPUs on the CPU."""

from __future__ import annotations

import pytest
import torch

from litevlm.quant import fp8
from litevlm.quant.fp8 import fp8_mm, fp8_mm_reference, kernel_out_dtype, quantize_fp8

ADA, HOPPER, BLACKWELL = (8, 9), (9, 0), (10, 0)
CUDA_13, CUDA_12_6 = (13, 0), (12, 6)


@pytest.mark.parametrize("want", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_ada_rowwise_products_are_made_in_bf16(want):
    assert kernel_out_dtype(want, rowwise=True, capability=ADA, cuda=CUDA_13) == torch.bfloat16


@pytest.mark.parametrize("want", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_hopper_rowwise_products_keep_their_dtype_with_cuda_12_9_or_later(want):
    assert kernel_out_dtype(want, rowwise=True, capability=HOPPER, cuda=CUDA_13) == want
    assert kernel_out_dtype(want, rowwise=True, capability=HOPPER, cuda=(12, 9)) == want
    # before CUDA 12.9 torch runs Hopper's row-wise product in CUTLASS too: bf16 only
    assert kernel_out_dtype(want, rowwise=True, capability=HOPPER, cuda=CUDA_12_6) == torch.bfloat16


@pytest.mark.parametrize("capability", [ADA, HOPPER, BLACKWELL], ids=str)
@pytest.mark.parametrize("want", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_tensorwise_products_keep_their_dtype_everywhere(capability, want):
    assert kernel_out_dtype(want, rowwise=False, capability=capability, cuda=CUDA_12_6) == want


def test_blackwell_rowwise_products_are_made_in_bf16():
    assert kernel_out_dtype(torch.float32, rowwise=True, capability=BLACKWELL, cuda=CUDA_13) == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("capability, asked", [(ADA, torch.bfloat16), (HOPPER, torch.float32)], ids=["8.9", "9.0"])
def test_fp8_mm_asks_the_kernel_for_the_chosen_dtype_and_returns_the_wanted_one(monkeypatch, capability, asked, bias):
    """`torch._scaled_mm` replaced by the exact product in the dtype it is asked for: an fp32 row-wise product is
    asked in bf16 on Ada and in fp32 on Hopper, and comes back in fp32 with the bias added either way."""
    monkeypatch.setattr(fp8, "CUDA_BUILD", CUDA_13)
    calls = []

    def scaled_mm(a, b, *, scale_a, scale_b, bias, out_dtype, use_fast_accum):
        calls.append((out_dtype, bias is not None))
        return fp8_mm_reference(a, b, scale_a, scale_b, bias, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(0)
    a = quantize_fp8(torch.randn(8, 64, generator=g), torch.tensor(0.01))  # (M, K) row-major
    b = quantize_fp8(torch.randn(32, 64, generator=g), torch.tensor(0.01)).t()  # (K, N) column-major
    sa, sb = torch.rand(8, 1, generator=g) + 0.1, torch.rand(1, 32, generator=g) + 0.1  # row-wise
    bi = torch.randn(32, generator=g) if bias else None
    y = fp8_mm(a, b, sa, sb, bi, torch.float32, capability=capability)
    assert calls == [(asked, False)]  # the bias is fused only into a bf16 product wanted in bf16
    assert y.dtype == torch.float32
    exact = fp8_mm_reference(a, b, sa, sb, None, torch.float32).to(asked).float()
    torch.testing.assert_close(y, exact + (bi if bias else 0.0))
