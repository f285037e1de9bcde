"""The building blocks the vision tower and the decoder share: RMSNorm, CPU-friendly linear products
(row-major weights, bf16 products on the CPU library), and rotary position embeddings (RoPE, non-interleaved
halves as in transformers' Llama/Qwen2).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def linear(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """`lin(x)`, faster for a few rows at CPU inference: there a row-major (in, out) copy of the
    weight, kept until the weight changes, multiplies faster than the (out, in) one. A compiled step (inductor) gets
    `lin(x)`: the compiler picks its own layout, and the copy's cache cannot be traced."""
    if (
        not x.is_cpu
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and lin.weight.requires_grad)
        or not plain_linear(lin)
    ):
        return lin(x)
    w_t = row_major(lin)
    x2 = x.reshape(-1, x.shape[-1])
    y = x2 @ w_t if lin.bias is None else torch.addmm(lin.bias, x2, w_t)
    return y.view(*x.shape[:-1], -1)


def row_major(lin: nn.Linear) -> torch.Tensor:
    """lin's weight as a row-major (in, out) copy, kept on the module until the weight changes."""
    w = lin.weight
    key = (w.data_ptr(), w._version)
    hit = lin.__dict__.get("_row_major")  # (weight version, weight.t().contiguous())
    if hit is None or hit[0] != key:
        hit = (key, w.detach().t().contiguous())
        lin.__dict__["_row_major"] = hit
    return hit[1]


BF16_ROW_BUCKET = 16


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """A row-major (in, out) fp32 weight as the CPU library's bf16 linear takes it: bf16, in its blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(w.t().to(torch.bfloat16), 4 * BF16_ROW_BUCKET)


def bf16_matmul_supported() -> bool:
    """This CPU multiplies bf16 natively (AMX or AVX512-BF16), so `mm` with bf16 weights pays."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and ("amx_bf16" in flags or "avx512_bf16" in flags)
    )


def plain_linear(lin: nn.Module) -> bool:
    """An nn.Linear as built (not, say, an FP8Linear) that nobody observes through hooks."""
    return type(lin) is nn.Linear and not (lin._forward_hooks or lin._forward_pre_hooks)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, D) for integer positions (B, T), computed in fp32 like transformers."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rope_table(owner, head_dim: int, theta: float, top: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (P, 1, D) for positions 0..P-1, P > top (the same values as `rope_cos_sin` there), kept on
    `owner` between calls and grown when a position passes its end."""
    table = owner.__dict__.get("_rope_table")
    if table is None or table[0].shape[0] <= top or table[0].dtype != dtype or table[0].device != torch.device(device):
        size = max(top + 1, 4096)
        cos, sin = rope_cos_sin(torch.arange(size, device=device)[None], head_dim, theta, dtype)
        table = (cos[0, 0, :, None], sin[0, 0, :, None])
        owner.__dict__["_rope_table"] = table
    return table


class _StaticStep(threading.local):
    active = False


_STATIC_STEP = _StaticStep()


@contextlib.contextmanager
def static_step():
    """Code run as a captured device step runs: it reads no tensor's value on the host. The CUDA backend's CPU twin
    replays its steps under it, so that they take the paths a GPU's captured steps take."""
    before, _STATIC_STEP.active = _STATIC_STEP.active, True
    try:
        yield
    finally:
        _STATIC_STEP.active = before


def rope_at(owner, positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, T, D) at positions (B, T): on a CPU gathered from `owner`'s kept table (`rope_table`), else
    computed (`rope_cos_sin`), the same values. Reading the top position syncs a GPU, and a compiled or captured step
    (`static_step`) must not read a tensor's value at all."""
    if positions.is_cpu and not torch.compiler.is_compiling() and not _STATIC_STEP.active:
        cos, sin = rope_table(owner, head_dim, theta, int(positions.max()), dtype, positions.device)  # (P, 1, D)
        return cos[positions].transpose(1, 2), sin[positions].transpose(1, 2)
    return rope_cos_sin(positions, head_dim, theta, dtype)


def rotate_head_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A projection's output rows (weight or bias) re-ordered per head as [-second half, first half]:
    x @ rotate_head_rows(W, D).T == rotate_half(x @ W.T) per head, so RoPE's rotation folds into packed weights."""
    w = w.view(-1, head_dim, *w.shape[1:])  # (heads, D, ...)
    return torch.cat([-w[:, head_dim // 2 :], w[:, : head_dim // 2]], 1).reshape(-1, *w.shape[2:])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin
