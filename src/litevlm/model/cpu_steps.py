"""The native CPU steps' binding: a decoder's weights and caches as cpu_steps.cpp takes them.

A decode step of a small decoder is about a hundred tiny ops (norms, a few matmuls, RoPE, a cache write and
attention per layer); eagerly, each pays Python dispatch, which on a CPU costs more than its arithmetic. cpu_steps.cpp
(built on first use by `litevlm.model.native`) runs a decoder layer for one sequence of n tokens at contiguous cache
slots start..start+n-1 as ATen matmuls with one loop between them: a plain decode step (n = 1), a tree verification
(n nodes, ancestor mask), a draft step (one layer), a prompt, a draft head's whole chain, and each side of a greedy
chain's speculative cycle. `NativeSteps` calls them with named weights (`LayerWeights`); the backend that uses them,
chosen once per model, is `litevlm.model.backend.NativeBackend`. The layer's math exists twice: the modules
(`litevlm.model.lm`, the reference) and the C++.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from litevlm.model.modules import submodules


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the steps take them, row-major (in, out) products (`DecoderLayer.fused_weights`).
    qkv packs [q k | rot q rot k | v] (C, 2 nqk + Hkv D), nqk = (Hq + Hkv) D, rot = rotate_half per head."""

    input_norm: torch.Tensor  # (C,), or empty where the layer has no input norm (a draft head)
    qkv: torch.Tensor  # (C, 2 nqk + Hkv D)
    qkv_bias: torch.Tensor  # (2 nqk + Hkv D,), zeros where the projections have none
    o_proj: torch.Tensor  # (Hq D, C)
    post_norm: torch.Tensor  # (C,)
    gate_up: torch.Tensor  # (C, 2 I)
    down: torch.Tensor  # (I, C)


# ------------------------------------------------------------------------------------------------
# The binding: the native ops with named weights
# ------------------------------------------------------------------------------------------------
class NativeSteps:
    """The same steps as the native ops of cpu_steps.cpp, taking the same arguments: the weights become the flat list
    the C++ reads (`native_weights`) at this boundary only."""

    name = "native"

    def __init__(self, ops):
        self.ops = ops
        self.has_panels = bool(ops.panels_built())  # the build has the bf16 panel products (an AVX-512 machine)

    def layers(self, x, cos, sin, start, mask, weights, caches, hq, hkv, d, eps, last_only=False, head=None):
        """head: the decoder's LM head, where `weights` are a whole decoder's: its products then read fp32 panels."""
        panels = target_panels(weights, head, hq, hkv, d) if head is not None else []
        return self.ops.layers(
            x, cos, sin, start, mask, native_weights(weights, hq, hkv, d), _flat(caches), hq, hkv, d, eps, last_only,
            panels,
        )  # fmt: skip

    def chain(
        self,
        root_hidden,
        position,
        start,
        depth,
        log_min,
        eos,
        cos_table,
        sin_table,
        embed,
        fc_w,
        fc_b,
        head,
        vocab_map,
        weights,
        caches,
        hq,
        hkv,
        d,
        eps,
    ):
        flat = native_weights(weights, hq, hkv, d)
        panels = self._draft_panels(fc_w, head, weights, hq, hkv, d)
        return self.ops.chain(
            root_hidden,
            position,
            start,
            depth,
            log_min,
            eos,
            cos_table,
            sin_table,
            embed,
            fc_w,
            fc_b,
            head,
            vocab_map,
            flat,
            _flat(caches),
            hq,
            hkv,
            d,
            eps,
            panels,
        )

    def draft_cycle(
        self,
        feats,
        nxt,
        pair_pos,
        done,
        root,
        root_pos,
        depth,
        log_min,
        eos,
        cos_table,
        sin_table,
        embed,
        fc_w,
        fc_b,
        head,
        vocab_map,
        weights,
        caches,
        hq,
        hkv,
        d,
        eps,
    ):
        flat = native_weights(weights, hq, hkv, d)
        panels = self._draft_panels(fc_w, head, weights, hq, hkv, d)
        return self.ops.draft_cycle(
            feats,
            nxt,
            pair_pos,
            done,
            root,
            root_pos,
            depth,
            log_min,
            eos,
            cos_table,
            sin_table,
            embed,
            fc_w,
            fc_b,
            head,
            vocab_map,
            flat,
            _flat(caches),
            hq,
            hkv,
            d,
            eps,
            panels,
        )

    def verify_chain(
        self, tokens, start, root_pos, cos_table, sin_table, embed, weights, caches, hq, hkv, d, eps, norm_w, head
    ):
        flat = native_weights(weights, hq, hkv, d)
        return self.ops.verify_chain(
            tokens, start, root_pos, cos_table, sin_table, embed, flat, _flat(caches), hq, hkv, d, eps, norm_w, head,
            target_panels(weights, head, hq, hkv, d),
        )  # fmt: skip

    def decode(
        self, token, position, slot, cos_table, sin_table, embed, weights, caches, hq, hkv, d, eps, norm_w, head
    ):
        flat = native_weights(weights, hq, hkv, d)
        return self.ops.decode_logits(
            token, position, slot, cos_table, sin_table, embed, flat, _flat(caches), hq, hkv, d, eps, norm_w, head,
            target_panels(weights, head, hq, hkv, d),
        )  # fmt: skip

    # -- several sequences at once: their rows stacked into each product, each on its own caches ------------------
    def batch_decode(self, tokens, positions, slots, cos_table, sin_table, embed, weights, caches, hq, hkv, d, eps,
                     norm_w, head):  # fmt: skip
        """tokens, positions, slots (B,); caches: each sequence's per-layer [K, V] -> (logits (B, V), hidden (B, C))."""
        flat = native_weights(weights, hq, hkv, d)
        return self.ops.batch_decode(
            tokens, positions, slots, cos_table, sin_table, embed, flat, _flat_seqs(caches), hq, hkv, d, eps, norm_w,
            head, target_panels(weights, head, hq, hkv, d),
        )  # fmt: skip

    def batch_verify_chain(self, tokens, counts, starts, root_pos, cos_table, sin_table, embed, weights, caches, hq,
                           hkv, d, eps, norm_w, head):  # fmt: skip
        flat = native_weights(weights, hq, hkv, d)
        return self.ops.batch_verify_chain(
            tokens, counts, starts, root_pos, cos_table, sin_table, embed, flat, _flat_seqs(caches), hq, hkv, d, eps,
            norm_w, head, target_panels(weights, head, hq, hkv, d),
        )  # fmt: skip

    def batch_draft_cycle(self, feats, nxt, pair_pos, counts, dones, roots, root_pos, depths, log_min, eos, cos_table,
                          sin_table, embed, fc_w, fc_b, head, vocab_map, weights, caches, hq, hkv, d, eps):  # fmt: skip
        flat = native_weights(weights, hq, hkv, d)
        panels = self._draft_panels(fc_w, head, weights, hq, hkv, d)
        return self.ops.batch_draft_cycle(
            feats, nxt, pair_pos, counts, dones, roots, root_pos, depths, log_min, eos, cos_table, sin_table, embed,
            fc_w, fc_b, head, vocab_map, flat, _flat_seqs(caches), hq, hkv, d, eps, panels,
        )  # fmt: skip

    def prompt(self, x, cos, sin, weights, caches_, cfg, bf16: bool = False, tail_mask=None) -> torch.Tensor:
        """A prompt of one sequence, x (T, C) at cache slots 0..T-1 with cos / sin (T, 1, D) at its positions, causally
        through the layers of `weights` (their [K, V] `caches_`, of a decoder with TextConfig `cfg`) in one call ->
        (T, C) before any final norm. bf16: the four products of each layer in bf16 around an fp32 residual stream.
        tail_mask (m, T): the last m rows are a tree after the prompt (answer openings), each seeing where its row
        allows."""
        per_layer = [unrotated(w, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) for w in weights]
        products = bf16_products(per_layer) if bf16 else []
        return self.ops.prompt_layers(
            x,
            cos,
            sin,
            _flat_layers(per_layer),
            _flat(caches_),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.norm_eps,
            products,
            tail_mask,
        )

    def _draft_panels(self, fc_w, head, weights, hq, hkv, d) -> list[torch.Tensor]:
        """A draft head's products on bf16 panels (cpu_steps.cpp: the draft only proposes, and its weights read in
        half the bytes): [fc, head, then each layer's q|k|v, o, gate|up, down]; empty where the build has none. Made
        once per weights list."""
        if not self.has_panels:
            return []

        def make() -> list[torch.Tensor]:
            per_layer = [unrotated(w, hq, hkv, d) for w in weights]
            products = [p for w in per_layer for p in (w.qkv, w.o_proj, w.gate_up, w.down)]
            return [panels(fc_w), panels(head), *[panels(p) for p in products]]

        return _per_list(_DRAFT_PANELS, (weights, fc_w, head), make)


@functools.cache
def native_steps() -> NativeSteps | None:
    """The native steps, where cpu_steps.cpp builds and loads here (decided once), else None."""
    from litevlm.model import native

    ops = native.ops()
    return None if ops is None else NativeSteps(ops)


def backend() -> str:
    """What the CPU steps run on here: "native" (cpu_steps.cpp) or "modules" (no native build)."""
    return "modules" if native_steps() is None else "native"


# ------------------------------------------------------------------------------------------------
# The native boundary: named weights -> the flat lists cpu_steps.cpp reads
# ------------------------------------------------------------------------------------------------
def _flat(groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for group in groups for t in group]


def _flat_seqs(per_seq: list[list[list[torch.Tensor]]]) -> list[torch.Tensor]:
    """Each sequence's per-layer [K, V], sequence after sequence, as the batched ops take them."""
    return [t for seq in per_seq for pair in seq for t in pair]


def _flat_layers(weights: list[LayerWeights]) -> list[torch.Tensor]:
    """The flat per-layer list cpu_steps.cpp reads (kWeightsPerLayer a layer, in `LayerWeights`' field order)."""
    return [t for w in weights for t in w]


def _kept(t: torch.Tensor, name: str, make) -> torch.Tensor:
    """make(t), made once per packed weight and kept on it under `name` (packings are rebuilt, never changed in
    place)."""
    derived = t.__dict__.get(name)
    if derived is None:
        derived = t.__dict__[name] = make(t)
    return derived


def unrotated(w: LayerWeights, hq: int, hkv: int, d: int) -> LayerWeights:
    """w with its q|k|v projection and bias as [q k | v], without the rotated copies (the native steps rotate in a
    loop); each made once per packed weight."""
    nqk = (hq + hkv) * d

    def drop(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[..., :nqk], t[..., 2 * nqk :]], -1).contiguous()

    return w._replace(
        qkv=_kept(w.qkv, "_litevlm_unrotated", drop), qkv_bias=_kept(w.qkv_bias, "_litevlm_unrotated", drop)
    )


def _per_list(cache: dict, owners: tuple, make):
    """make(), kept in `cache` for these exact objects (the first a generation's weights list, passed at every step);
    only the lists of the live generations are worth keeping (the target's and the draft's plans)."""
    hit = cache.get(id(owners[0]))
    if hit is not None and all(a is b for a, b in zip(hit[0], owners)):
        return hit[1]
    out = make()
    if len(cache) >= 4:  # lists of past generations
        cache.clear()
    cache[id(owners[0])] = (owners, out)
    return out


_NATIVE_FLAT: dict = {}  # id(weights list) -> ((that list,), its `native_weights`)
_DRAFT_PANELS: dict = {}  # id(weights list) -> ((that list, fc, head), its draft panels)
_TARGET_PANELS: dict = {}  # id(weights list) -> ((that list, head), its fp32 panels)


def native_weights(weights: list[LayerWeights], hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    """The layers' weights as the flat list the native ops read, q|k|v `unrotated` (made once per weights list: a
    generation's plan passes the same list to every step)."""
    return _per_list(_NATIVE_FLAT, (weights,), lambda: _flat_layers([unrotated(w, hq, hkv, d) for w in weights]))


def target_panels(weights: list[LayerWeights], head: torch.Tensor, hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    """The target decoder's products as fp32 panels of 32 columns (`pack_panels32` in cpu_steps.cpp: read in storage
    order, the same sums as the row-major weights): each layer's q|k|v, o, gate|up, down, then the LM head (in, out).
    Made once per weights list and head."""
    from litevlm.model import native

    ops = native.ops()

    def pack(t: torch.Tensor) -> torch.Tensor:
        return _kept(t, "_litevlm_panels32", lambda w: ops.pack_panels32(w.contiguous()))

    def make() -> list[torch.Tensor]:
        per_layer = [unrotated(w, hq, hkv, d) for w in weights]
        return [pack(p) for w in per_layer for p in (w.qkv, w.o_proj, w.gate_up, w.down)] + [pack(head)]

    return _per_list(_TARGET_PANELS, (weights, head), make)


def panels_built() -> bool:
    """The native build has the panel products (an AVX-512 machine)."""
    steps = native_steps()
    return steps is not None and steps.has_panels


def panels(w: torch.Tensor) -> torch.Tensor:
    """A row-major (in, out) product weight as the native ops' bf16 panels (`pack_panels` in cpu_steps.cpp), made once
    per weight."""
    from litevlm.model import native

    return _kept(w, "_litevlm_panels", native.ops().pack_panels)


def bf16_products(per_layer: list[LayerWeights]) -> list[torch.Tensor]:
    """The bf16 copies of each layer's four products (q|k|v, o, gate|up, down) from `unrotated` weights: what a native
    prompt multiplies in the CPU library's bf16 GEMM in bf16 mode."""
    return [
        _kept(p, "_litevlm_bf16", lambda t: t.to(torch.bfloat16).contiguous())
        for w in per_layer
        for p in (w.qkv, w.o_proj, w.gate_up, w.down)
    ]


def native_bf16_products(decoder_layers, cfg) -> list[torch.Tensor]:
    """`bf16_products` of these layers, for warming the CPU library's kernels (`VLM.set_bf16_matmul`); empty where the
    native steps do not serve."""
    if backend() != "native":
        return []
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return bf16_products([unrotated(layer_weights(layer), hq, hkv, d) for layer in decoder_layers if layer.fusable()])


# ------------------------------------------------------------------------------------------------
# Weights and caches as the steps take them
# ------------------------------------------------------------------------------------------------
def layer_weights(layer) -> LayerWeights:
    """One `DecoderLayer`'s weights for the steps (its fused, cached packing), gathered when a backend is made."""
    w = layer.fused_weights()
    qkv_bias = w.qkv_bias if w.qkv_bias is not None else w.qkv.new_zeros(w.qkv.shape[1])
    norm = layer.input_layernorm
    input_norm = norm.weight if hasattr(norm, "weight") else w.qkv.new_empty(0)
    return LayerWeights(input_norm, w.qkv, qkv_bias, w.o_proj, layer.post_attention_layernorm.weight, w.gate_up, w.down)


def caches(decoder_layers) -> list[list[torch.Tensor]]:
    """The steps' cache arguments: each layer's current [K, V] (read through the module dicts: this runs every
    step, and nn.Module attribute lookups cost more than the rest of its bookkeeping)."""
    out = []
    for layer in decoder_layers:
        buffers = layer._modules["self_attn"]._modules["kv_cache"]._buffers
        out.append([buffers["k"], buffers["v"]])
    return out


def hooked(decoder_layers) -> bool:
    """A forward (pre-)hook on these layers or below them, or a global one: a step run outside the modules would
    not fire it."""
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for layer in decoder_layers for m in submodules(layer))
