"""The language model: a Qwen2 / Llama / InternLM2-style decoder over a static KV cache.

RMSNorm, rotary position embeddings (non-interleaved halves, as transformers), grouped-query
attention, a SwiGLU MLP, and an optional q/k/v bias. One `forward` serves training (no cache,
causal), prefill and single-token decode (cache, causal), tree verification and pruned prompts
(cache, explicit positions, slots and a boolean mask over the cache). `fused=True` attends in the
form the fused attention kernels accept (`litevlm.model.attention`: K/V heads expanded, the mask an
additive bias), as the CUDA backend's static steps do. Parameter names follow transformers'
Qwen2/Llama so checkpoints map one to one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from litevlm.config import TextConfig
from litevlm.errors import LiteVLMError
from litevlm.model.attention import fused_attention
from litevlm.model.kv_cache import KVCache
from litevlm.model.layers import (
    RMSNorm,
    apply_rope,
    plain_linear,
    rope_at,
    rope_table,
    rotate_head_rows,
)


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
        xs = shared_input(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_proj(xs).view(b, t, -1, d).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(xs).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(xs).view(b, t, -1, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, slots=None, mask=None, kv_len=None, fused: bool = False):
        b, t, _ = x.shape
        y = self.attend(*self.qkv(x, cos, sin), slots, mask, kv_len, fused)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, H*D) -> (B, T, C)

    def attend(self, q, k, v, slots=None, mask=None, kv_len=None, fused: bool = False) -> torch.Tensor:
        """q (B, H, T, D), k / v (B, Hkv, T, D) -> attention output (B, H, T, D), through the cache if slots;
        with fused, in the form the fused kernels accept (`litevlm.model.attention.fused_attention`)."""
        if slots is None:  # training / no cache: plain causal attention over the given tokens
            return F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask, enable_gqa=True)
        t = q.shape[2]
        self.kv_cache.write(slots, k, v)
        if mask is None and kv_len == t:  # a prompt from slot 0 sees exactly its own keys (in its own dtype)
            if fused:
                return fused_attention(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        k, v = self.kv_cache.k, self.kv_cache.v
        if kv_len is not None:  # attend over the live prefix only (eager CPU path)
            k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        if fused:
            return fused_attention(q, k, v, mask)
        # A prompt written from slot 0 with no mask is plain causal: the fused kernel's fast path.
        causal = mask is None and t > 1 and k.shape[2] == t
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


class SwiGLU(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        xs = shared_input(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(self.gate_proj(xs)) * self.up_proj(xs))


def shared_input(x: torch.Tensor, *linears: nn.Module):
    """x as every projection in `linears` reads it: quantised once where they are FP8 layers that quantise it alike
    (`litevlm.quant.fp8.FP8Linear.shared_input`: q/k/v, gate/up), else x itself."""
    share = getattr(linears[0], "shared_input", None)
    return x if share is None else share(x, linears)


class FusedWeights(NamedTuple):
    """A decoder layer's projections packed for few, large kernels (`DecoderLayer.fused_weights`), row-major (in, out).
    qkv is [q k | rot q rot k | v] (C, 2 nqk + Hkv D), nqk = (Hq + Hkv) D, rot = rotate_half per head."""

    qkv: torch.Tensor  # (C, 2 nqk + Hkv D)
    qkv_bias: torch.Tensor | None  # (2 nqk + Hkv D,), None without q/k/v biases
    gate_up: torch.Tensor  # (C, 2 I)
    o_proj: torch.Tensor  # (Hq D, C)
    down: torch.Tensor  # (I, C)


_FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = SwiGLU(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self._fused: tuple | None = None  # (weight versions, packed weights): see fused_weights
        # A native prompt of at least this many rows multiplies in bf16 (0: never; `VLM.set_bf16_matmul`).
        self.bf16_min_rows = 0

    def forward(self, x, cos, sin, slots=None, mask=None, kv_len=None, fused: bool = False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask, kv_len, fused)
        return x + self.mlp(self.post_attention_layernorm(x))

    # -- the layer's weights packed for the native steps -------------------------------------------
    def fusable(self) -> bool:
        """Every projection a plain, unhooked nn.Linear (not, say, an FP8Linear or one being
        calibrated) and the MLP a SwiGLU."""
        m = self._modules["mlp"]
        mods = self._modules["self_attn"]._modules, m._modules  # direct dict reads: this runs every prefill
        return isinstance(m, SwiGLU) and all(
            plain_linear(ms[name]) for ms, names in zip(mods, _FUSED_PROJECTIONS) for name in names
        )

    def fused_weights(self) -> FusedWeights:
        """The projections packed, pre-transposed (in, out), as the native steps read them
        (`litevlm.model.cpu_steps.layer_weights`); cached until a weight changes (in place or replaced).

        [q k | rot(q) rot(k) | v], where rot(x) = rotate_half(x): rotating is a signed permutation of output
        rows, so it folds into the weights (the native steps keep [q k | v] and rotate in their loop). gate and up
        share a matmul. On the CPU a row-major (in, out) weight multiplies a few rows faster than nn.Linear's transposed
        (out, in) one.
        """
        training = self.training and torch.is_grad_enabled()
        if training or self._fused is None:
            return self._pack_fused(None if training else self._fused_key(), training)
        return self._fused_current()

    def _fused_key(self) -> tuple:
        # Reads the projections' parameter dicts directly: nn.Module attribute lookups would cost
        # more than the rest of a CPU decode step's bookkeeping (this runs every step).
        mods = self.self_attn._modules, self.mlp._modules
        return tuple(
            (p.data_ptr(), p._version)
            for ms, names in zip(mods, _FUSED_PROJECTIONS)
            for name in names
            for p in ms[name]._parameters.values()
            if p is not None
        )

    def _fused_current(self) -> FusedWeights:
        """The cached packing if no projection changed since it was made, else a new one."""
        key = self._fused_key()
        return self._fused[1] if self._fused[0] == key else self._pack_fused(key, False)

    def _pack_fused(self, key: tuple | None, training: bool) -> FusedWeights:
        attn, mlp = self.self_attn, self.mlp
        d = attn.cfg.head_dim

        with torch.set_grad_enabled(training):
            qk_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight])
            qkv_w = torch.cat([qk_w, rotate_head_rows(qk_w, d), attn.v_proj.weight])
            qkv_b = None
            if attn.q_proj.bias is not None:
                qk_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias])
                qkv_b = torch.cat([qk_b, rotate_head_rows(qk_b, d), attn.v_proj.bias])
            w = FusedWeights(
                qkv=qkv_w.t(),
                qkv_bias=qkv_b,
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t(),
                o_proj=attn.o_proj.weight.t(),
                down=mlp.down_proj.weight.t(),
            )
        if training:
            return w
        w = FusedWeights(*(None if t is None else t.detach().contiguous() for t in w))
        self._fused = (key, w)
        return w


def run_layer(layer: DecoderLayer, x, cos, sin, slots, mask, kv_len, fused: bool):
    """One decoder layer as a function of the layer: compiled once (`torch.compile`), the same code serves every
    layer of a model, whose parameters and cache buffers are the compiled graph's inputs, so the compile costs one
    layer's, not the model's (regional compilation)."""
    return layer(x, cos, sin, slots, mask, kv_len, fused)


class TextModel(nn.Module):
    """Embeddings + decoder layers + final norm; `forward` returns post-norm hidden states."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None, scratch: int = 0) -> None:
        """A static cache of `max_len` live slots per layer, and `scratch` more past them that only graph capture
        writes (`litevlm.model.backend.CudaBackend`): generation never uses them."""
        p = self.embed_tokens.weight
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(
                batch, self.cfg.num_kv_heads, max_len + scratch, self.cfg.head_dim, dtype or p.dtype, device or p.device
            )
        self._live_len = max_len

    @property
    def cache_len(self) -> int:
        """The live slots of the cache (what a prompt and its answer may use)."""
        cache = self.layers[0].self_attn.kv_cache
        return 0 if cache is None else min(cache.max_len, self.__dict__.get("_live_len", cache.max_len))

    def forward(
        self,
        embeds,
        positions,
        slots=None,
        mask=None,
        kv_len=None,
        start_layer: int = 0,
        end_layer: int | None = None,
        tree_tail: torch.Tensor | None = None,
        fused: bool = False,
        layer_step=None,
    ):
        """embeds (B, T, C), positions (B, T) -> hidden (B, T, C) after the final norm.

        slots (T,) are the cache slots to write; mask (B or 1, 1, T, S) is True where attention is
        allowed, S = kv_len or the cache length. Without slots, attention is causal over `embeds`.
        fused (with slots): attention in the form the fused kernels accept, the K/V heads expanded to the
        query heads and the mask an additive bias in the embeddings' dtype (0 where allowed, -inf where
        not), or none for a prompt from slot 0 (causal): `litevlm.model.attention`, the CUDA backend's steps.
        tree_tail (m, T) bool, for a prompt from slot 0 without a mask: its last m rows are a tree after the prompt
        (answer openings), row i seeing the slots where tree_tail[i] is True; the other rows stay causal.
        layer_step: what runs each layer, `run_layer` or a compiled copy of it (one compile that every layer reuses,
        its weights and cache its inputs: `litevlm.model.backend.CudaBackend`); None runs the layers directly.
        """
        cos, sin = rope_at(self, positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        layers = self.layers[start_layer:end_layer]
        x = embeds
        if tree_tail is not None:
            if mask is not None or slots is None:
                raise LiteVLMError("tree_tail applies to a prompt written from slot 0 without a mask")
            t = embeds.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()
            mask[t - tree_tail.shape[0] :] = tree_tail.to(mask.device)
            mask = mask[None, None]
        step = run_layer if layer_step is None else layer_step
        for layer in layers:
            x = step(layer, x, cos, sin, slots, mask, kv_len, fused)
        return self.norm(x) if end_layer is None else x

    def rope_table(self, top: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_table(self, self.cfg.head_dim, self.cfg.rope_theta, top, dtype, device)

    def commit(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move cache entries at src_slots to dst_start.. in every layer (accepting a speculative path)."""
        for layer in self.layers:
            layer.self_attn.kv_cache.commit(src_slots, dst_start)
