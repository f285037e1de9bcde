"""A static KV cache: allocated once, written at explicit slots, committed in place.

Slots (where a token's K/V live in the cache) and positions (its RoPE index) are separate on
purpose: pruned visual tokens keep their original positions in contiguous slots, and the nodes of
a speculative tree share positions (depth) while occupying distinct slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class KVCache(nn.Module):
    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape (B, Hkv, T, D) at cache slots (T,)."""
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))

    def commit(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move the entries at `src_slots` to the contiguous slots dst_start.. (an accepted path)."""
        n = src_slots.numel()
        dst = torch.arange(dst_start, dst_start + n, device=src_slots.device)
        k = self.k.index_select(2, src_slots)  # gathered first: source and target may overlap
        v = self.v.index_select(2, src_slots)
        self.k.index_copy_(2, dst, k)
        self.v.index_copy_(2, dst, v)
