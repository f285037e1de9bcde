"""The language model: a Qwen2 / Llama / InternLM2-style decoder over a static KV cache.

RMSNorm, rotary position embeddings (non-interleaved halves, as transformers), grouped-query
attention, a SwiGLU MLP, and an optional q/k/v bias. One `forward` serves training (no cache,
causal), prefill and single-token decode (cache, causal), tree verification and pruned prompts
(cache, explicit positions, slots and a boolean mask over the cache). Parameter names follow
transformers' Qwen2/Llama so checkpoints map one to one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from litevlm.config import TextConfig
from litevlm.model.kv_cache import KVCache
from litevlm.model.vision import RMSNorm


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, D) for integer positions (B, T), computed in fp32 like transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim))
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, slots=None, mask=None, kv_len=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if slots is None:  # training / no cache: plain causal attention over the given tokens
            y = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask, enable_gqa=True)
        else:
            self.kv_cache.write(slots, k, v)
            k, v = self.kv_cache.k, self.kv_cache.v
            if kv_len is not None:  # attend over the live prefix only (eager CPU path)
                k, v = k[:, :, :kv_len], v[:, :, :kv_len]
            # A prompt written from slot 0 with no mask is plain causal: the fused kernel's fast path.
            causal = mask is None and t > 1 and k.shape[2] == t
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, H*D) -> (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = SwiGLU(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, cos, sin, slots=None, mask=None, kv_len=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Embeddings + decoder layers + final norm; `forward` returns post-norm hidden states."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        p = self.embed_tokens.weight
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(
                batch, self.cfg.num_kv_heads, max_len, self.cfg.head_dim, dtype or p.dtype, device or p.device
            )

    @property
    def cache_len(self) -> int:
        cache = self.layers[0].self_attn.kv_cache
        return 0 if cache is None else cache.max_len

    def forward(self, embeds, positions, slots=None, mask=None, kv_len=None, start_layer: int = 0, end_layer: int | None = None):
        """embeds (B, T, C), positions (B, T) -> hidden (B, T, C) after the final norm.

        slots (T,) are the cache slots to write; mask (B or 1, 1, T, S) is True where attention is
        allowed, S = kv_len or the cache length. Without slots, attention is causal over `embeds`.
        """
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        x = embeds
        for layer in self.layers[start_layer:end_layer]:
            x = layer(x, cos, sin, slots, mask, kv_len)
        return self.norm(x) if end_layer is None else x

    def commit(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move cache entries at src_slots to dst_start.. in every layer (accepting a speculative path)."""
        for layer in self.layers:
            layer.self_attn.kv_cache.commit(src_slots, dst_start)
