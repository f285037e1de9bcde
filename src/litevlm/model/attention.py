"""Attention in the form the fused SDPA kernels accept, and each step pinned to one such kernel.

`F.scaled_dot_product_attention` picks a kernel per call and, where no fused kernel accepts the inputs, silently
runs the math path (K/V repeated per query head, the scores materialised in fp32). On torch 2.11 CUDA flash
attention refuses any attn_mask and memory-efficient attention refuses enable_gqa, so a step that attends over a
KV bucket through a boolean mask with grouped-query heads (a decode over padded slots, a tree verification) runs
the math path, and so does an fp32 prompt (flash takes only half and bf16). `fused_attention` is the same attention
in the form the fused kernels accept: no grouped-query heads (the query heads that share a K/V head folded into its
query rows where a step has few rows, else the K/V heads expanded to the query heads), and the mask an additive bias (0
where visible, -inf where not) or, for a prompt over its own keys, none (causal). `choose_kernel` pins a step to the
first kernel of `FUSED_KERNELS` that runs it; the math path is never on the list, so a step no fused kernel accepts
raises instead of falling back.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from litevlm.errors import LiteVLMError

# The fused kernels a step may be pinned to, per device type, in order of preference; never the math path.
# CUDA: cuDNN, flash, memory-efficient, torch's own order on Hopper. cuDNN and flash take half and bf16 only, and
# flash no bias: a bf16 decode or verification runs cuDNN or memory-efficient, a bf16 prefill cuDNN or flash, and
# fp32 steps memory-efficient. CPU: torch's one fused CPU kernel, which takes a bias and fp32.
FUSED_KERNELS = {
    "cuda": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "cpu": (SDPBackend.FLASH_ATTENTION,),
}
KERNEL_NAMES = {
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
}


# cuDNN attention is first on torch's own list on Hopper only from cuDNN 9.15.1 (earlier releases mis-handle
# sequence lengths that are not multiples of 128, as a decode's one query is); before that it is not offered here.
CUDNN_FIRST = 91501


def fused_kernels(device: torch.device | str) -> tuple[SDPBackend, ...]:
    """`FUSED_KERNELS` of this device type as a step may be pinned to them here: on CUDA without cuDNN attention
    where the installed cuDNN is older than `CUDNN_FIRST` (or absent)."""
    kind = torch.device(device).type
    kernels = FUSED_KERNELS.get(kind, ())
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if kind == "cuda" and (version or 0) < CUDNN_FIRST:
        kernels = tuple(k for k in kernels if k != SDPBackend.CUDNN_ATTENTION)
    return kernels


def additive_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True where attention is allowed) -> an additive bias of its shape in `dtype`: 0 where
    visible, -inf where not."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """q (B, H, T, D), k / v (B, Hkv, S, D), bias (1, 1, T, S) additive in q's dtype -> (B, H, T, D).

    The attention of `F.scaled_dot_product_attention(q, k, v, attn_mask=<where bias is 0>, enable_gqa=True)`, query
    head h reading K/V head h // (H / Hkv). With a bias and few query rows (a decode, a verification, a draft step),
    the query heads that share a K/V head are folded into its query rows, (B, H, T, D) -> (B, Hkv, G T, D) with
    G = H / Hkv and the bias's rows repeated G times: the K/V are read where they lie, never copied (`_folded`).
    Otherwise the K/V heads are expanded to H heads. Without a bias: causal for a prompt over its own keys (T > 1 and
    S == T; flash's fast path), else every key."""
    groups = q.shape[1] // k.shape[1]
    b, h, t, d = q.shape
    if bias is not None and groups > 1 and groups * t < 2 * h * d:  # the bias copy is smaller than the K/V copies
        return _folded(q, k, v, bias, groups)
    if groups > 1:
        k = k.repeat_interleave(groups, 1)  # (B, Hkv, S, D) -> (B, H, S, D)
        v = v.repeat_interleave(groups, 1)
    if bias is None:
        causal = q.shape[2] > 1 and k.shape[2] == q.shape[2]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, groups: int) -> torch.Tensor:
    """`fused_attention` with a bias, the G query heads of each K/V head as G T query rows over it: head kv G + g, row
    t becomes row g T + t of head kv, whose bias row is the bias's row t. The same softmax over the same keys for each
    row, so the same attention; grouped-query heads then cost a kernel nothing, and no kernel needs enable_gqa."""
    b, h, t, d = q.shape
    out = F.scaled_dot_product_attention(
        q.reshape(b, k.shape[1], groups * t, d), k, v, attn_mask=bias.repeat(1, 1, groups, 1)
    )
    return out.reshape(b, h, t, d)


def choose_kernel(step: str, run, kernels, shapes: str) -> SDPBackend:
    """The first of `kernels` under which `run()` (the step on its own shapes) goes through, with that kernel alone
    allowed. None does: LiteVLMError naming the step, its `shapes` and each kernel's refusal (torch's warnings say
    why), since the math path is refused. The warnings of the run that goes through are passed on."""
    refusals = []
    for kernel in kernels:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([kernel]):
                    run()
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # "No available kernel": this one refuses the step's inputs
                why = [str(w.message) for w in caught] + [str(e).splitlines()[0]]
                why = " ".join(w.split(" (Triggered internally")[0].strip() for w in why)
                refusals.append(f"{KERNEL_NAMES[kernel]} refuses it ({why})")
                continue
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return kernel
    tried = "; ".join(refusals) or "no fused kernel is known on this device"
    raise LiteVLMError(
        f"no fused attention kernel runs the {step} step ({shapes}), and the math path is refused: {tried}. "
        "Give the model a dtype and head size one of these kernels takes, or run another backend (modules)"
    )
