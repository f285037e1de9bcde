"""Decoder steps over a few tokens of one sequence on the CPU, outside the module tree.

A decode step of a small decoder is about a hundred tiny ops (norms, a few matmuls, RoPE, a cache write and
attention per layer); eagerly, each pays Python dispatch, which on a CPU costs more than its arithmetic. `layers` is
the fused `DecoderLayer` path (`litevlm.model.lm`) written for one sequence of n tokens at contiguous cache slots
start..start+n-1, which covers a plain decode step (n = 1), a tree verification (n nodes, ancestor mask) and a draft
step (one layer). `chain` drafts a whole chain in one call; a greedy chain's speculative cycle is two calls, one per
side (`draft_cycle`: the draft's extend and chain; `verify_chain`: the target's verification and acceptance).

A model's steps run on one backend object, chosen once per model (`steps_for`) with the same methods:
- `NativeSteps`: the same functions in C++ (cpu_steps.cpp, built on first use by `litevlm.model.native`): the
  matmuls go to ATen and everything between them is one loop each.
- `EagerSteps`: the Python functions below, op by op, where the native build is unavailable or disabled
  (LITEVLM_NATIVE=0).
Where the steps do not apply (another device or dtype, gradients, hooks, a quantised layer: `usable`), `plan` is None
and the callers run the modules, the reference path. benchmarks/compile_vs_native.py measures these steps against
`torch.compile` and AOTInductor builds of the same functions.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

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


def layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    weights: list[LayerWeights],
    caches: list[list[torch.Tensor]],
    hq: int,
    hkv: int,
    d: int,
    eps: float,
    last_only: bool = False,
) -> torch.Tensor:
    """x (n, C) at cache slots start..start+n-1 through the layers -> (n, C), before any final norm.

    last_only (one layer, mask None): every row writes its K/V, only the last goes on through attention,
    the output projection and the MLP -> (1, C); a draft head's extend needs no more.

    cos / sin (n, 1, D) at the tokens' positions; mask (1, 1, n, start + n) where attention is
    allowed, or None when each token may see every slot up to start + n (one token). weights: one
    `LayerWeights` per layer; caches = [K, V] (1, Hkv, S, D) per layer, written in place.
    """
    if last_only and len(weights) != 1:
        raise RuntimeError("last_only runs one layer: the next layer would need every row")
    n = x.shape[0]
    c = x.shape[1]
    nqk = (hq + hkv) * d
    end = start + n
    for i in range(len(weights)):
        w = weights[i]
        xn = torch.rms_norm(x, [c], w.input_norm, eps) if w.input_norm.numel() > 0 else x
        qkv = torch.addmm(w.qkv_bias, xn, w.qkv)
        qk = torch.addcmul(qkv[:, :nqk].view(n, hq + hkv, d) * cos, qkv[:, nqk : 2 * nqk].view(n, hq + hkv, d), sin)
        k_cache = caches[i][0]
        v_cache = caches[i][1]
        k_cache[0, :, start:end] = qk[:, hq:].transpose(0, 1)
        v_cache[0, :, start:end] = qkv[:, 2 * nqk :].view(n, hkv, d).transpose(0, 1)
        if last_only:
            qk = qk[n - 1 :]
            x = x[n - 1 :]
            n = 1
        q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        y = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask, enable_gqa=True)
        x = torch.addmm(x, y[0].transpose(0, 1).reshape(n, hq * d), w.o_proj)
        gu = torch.rms_norm(x, [c], w.post_norm, eps) @ w.gate_up
        half = gu.shape[1] // 2
        x = torch.addmm(x, F.silu(gu[:, :half]) * gu[:, half:], w.down)
    return x


def chain(
    root_hidden: torch.Tensor,
    position: int,
    start: int,
    depth: int,
    log_min: float,
    eos: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    embed: torch.Tensor,
    fc_w: torch.Tensor,
    fc_b: torch.Tensor,
    head: torch.Tensor,
    vocab_map: torch.Tensor,
    weights: list[LayerWeights],
    caches: list[list[torch.Tensor]],
    hq: int,
    hkv: int,
    d: int,
    eps: float,
) -> torch.Tensor:
    """A draft head's whole chain in one call -> the drafted token ids (m,), 1 <= m <= depth.

    From the root's predicted feature (1, C): take the most likely token; while the chain's summed
    log-probability stays >= log_min and the last token is not `eos`, feed [embedding ; feature]
    through fc (2C, C) and the draft layer (`layers`, slots start, start + 1, ... at positions
    position, position + 1, ...) and take the next most likely token. head (C, V') scores the draft
    vocabulary; vocab_map (V') maps it to target ids (empty: V' is the target's vocabulary).
    """
    lp = torch.log_softmax(root_hidden @ head, -1)
    value, idx = lp.topk(1, -1)
    tok = vocab_map[idx[0]] if vocab_map.numel() > 0 else idx[0]
    drafted = [tok]
    hidden = root_hidden
    for i in range(depth - 1):
        if bool(value[0, 0] < log_min) or int(tok[0]) == eos:
            break
        x = torch.addmm(fc_b, torch.cat([embed[tok], hidden], -1), fc_w)
        hidden = layers(
            x,
            cos_table[position + i : position + i + 1],
            sin_table[position + i : position + i + 1],
            start + i,
            None,
            weights,
            caches,
            hq,
            hkv,
            d,
            eps,
        )
        lp = torch.log_softmax(hidden @ head, -1)
        step_value, idx = lp.topk(1, -1)
        value = value + step_value
        tok = vocab_map[idx[0]] if vocab_map.numel() > 0 else idx[0]
        drafted.append(tok)
    return torch.cat(drafted)


def draft_cycle(
    feats: torch.Tensor,
    nxt: torch.Tensor,
    pair_pos: torch.Tensor,
    done: int,
    root: torch.Tensor,
    root_pos: int,
    depth: int,
    log_min: float,
    eos: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    embed: torch.Tensor,
    fc_w: torch.Tensor,
    fc_b: torch.Tensor,
    head: torch.Tensor,
    vocab_map: torch.Tensor,
    weights: list[LayerWeights],
    caches: list[list[torch.Tensor]],
    hq: int,
    hkv: int,
    d: int,
    eps: float,
) -> torch.Tensor:
    """A draft head's side of a speculative cycle in one call -> the chain to verify (1 + m,): the root (1,)
    (the newest token, not cached yet) and the m tokens drafted after it.

    The extend first: the m pairs committed since the last cycle, the target's true features feats (m, C)
    with the embeddings of the tokens that followed them nxt (m, C) at RoPE positions pair_pos (m,), go
    through fc and the draft layer into draft slots done..done+m-1 (only the last pair's output is kept:
    the predicted feature after the root). Then `chain` from it, its steps at slots done+m, ... and
    positions root_pos, root_pos + 1, ...
    """
    x = torch.addmm(fc_b, torch.cat([nxt, feats], -1), fc_w)
    h_root = layers(x, cos_table[pair_pos], sin_table[pair_pos], done, None, weights, caches, hq, hkv, d, eps, True)
    drafted = chain(
        h_root,
        root_pos,
        done + feats.shape[0],
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
    )
    return torch.cat([root.to(drafted.dtype), drafted])


def verify_chain(
    tokens: torch.Tensor,
    start: int,
    root_pos: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    embed: torch.Tensor,
    weights: list[LayerWeights],
    caches: list[list[torch.Tensor]],
    hq: int,
    hkv: int,
    d: int,
    eps: float,
    norm_w: torch.Tensor,
    head: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's side of a greedy chain cycle in one call: verify root + drafts, accept the longest
    matching prefix -> (the emitted tokens (a+1,): the a accepted drafts and the bonus; the pairs the
    draft's next extend takes in: the features (a+1, C) (the post-norm hidden states of the root and the
    accepted drafts), the embeddings of the tokens after them (a+1, C), their positions (a+1,)).

    tokens (n,): the root (committed, not cached yet) and the chain drafted after it, written at cache
    slots start..start+n-1 at positions root_pos.. and attending causally over everything before them
    (a chain's tree mask); norm_w: the final norm; head (C, V): the LM head, row-major. A chain's
    accepted path is a prefix of it, so its K/V already sit where they belong.
    """
    n = tokens.shape[0]
    rows = torch.arange(n, device=tokens.device)
    cols = torch.arange(start + n, device=tokens.device)
    mask = (cols[None, :] <= rows[:, None] + start)[None, None]
    pos = rows + root_pos
    x = layers(embed[tokens], cos_table[pos], sin_table[pos], start, mask, weights, caches, hq, hkv, d, eps)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w  # the final RMSNorm
    pred = (x @ head).argmax(-1)  # (n,) the target's next token after each node
    a = int((tokens[1:] == pred[:-1]).long().cumprod(0).sum())
    new = torch.cat([tokens[1 : a + 1], pred[a : a + 1]])
    return new, x[: a + 1], embed[new], pos[: a + 1]


def decode_logits(
    token: torch.Tensor,
    position: int,
    slot: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    embed: torch.Tensor,
    weights: list[LayerWeights],
    caches: list[list[torch.Tensor]],
    hq: int,
    hkv: int,
    d: int,
    eps: float,
    norm_w: torch.Tensor,
    head: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain decode step in one call: token (1,) at RoPE `position`, written at cache `slot` -> (logits (1, V),
    the post-norm hidden state (1, C)). norm_w: the final norm; head (C, V): the LM head, row-major."""
    x = layers(
        embed[token],
        cos_table[position : position + 1],
        sin_table[position : position + 1],
        slot,
        None,
        weights,
        caches,
        hq,
        hkv,
        d,
        eps,
    )
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w  # the final RMSNorm
    return x @ head, x


# ------------------------------------------------------------------------------------------------
# The backends: one object per model, chosen once (`steps_for`)
# ------------------------------------------------------------------------------------------------
class EagerSteps:
    """The step functions of this module, op by op: the fallback where the native build is unavailable."""

    name = "eager"
    layers = staticmethod(layers)
    chain = staticmethod(chain)
    draft_cycle = staticmethod(draft_cycle)
    verify_chain = staticmethod(verify_chain)
    decode = staticmethod(decode_logits)

    def prompt(self, x, cos, sin, decoder_layers, cfg, bf16: bool = False, tail_mask=None) -> None:
        """A prompt runs through the modules here (their bf16 mode and batched attention): None, always."""
        return None


class NativeSteps:
    """The same steps as the native ops of cpu_steps.cpp, taking the same arguments: the weights become the flat list
    the C++ reads (`native_weights`) at this boundary only."""

    name = "native"

    def __init__(self, ops):
        self.ops = ops
        self.has_panels = bool(ops.panels_built())  # the build has the bf16 panel products (an AVX-512 machine)

    def layers(self, x, cos, sin, start, mask, weights, caches, hq, hkv, d, eps, last_only=False):
        return self.ops.layers(
            x, cos, sin, start, mask, native_weights(weights, hq, hkv, d), _flat(caches), hq, hkv, d, eps, last_only
        )

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
            tokens, start, root_pos, cos_table, sin_table, embed, flat, _flat(caches), hq, hkv, d, eps, norm_w, head
        )

    def decode(
        self, token, position, slot, cos_table, sin_table, embed, weights, caches, hq, hkv, d, eps, norm_w, head
    ):
        flat = native_weights(weights, hq, hkv, d)
        return self.ops.decode_logits(
            token, position, slot, cos_table, sin_table, embed, flat, _flat(caches), hq, hkv, d, eps, norm_w, head
        )

    def prompt(self, x, cos, sin, decoder_layers, cfg, bf16: bool = False, tail_mask=None) -> torch.Tensor | None:
        """A prompt of one sequence, x (T, C) at cache slots 0..T-1 with cos / sin (T, 1, D) at its positions, causally
        through `decoder_layers` (of a decoder with TextConfig `cfg`) in one call -> (T, C) before any final norm; None
        where `usable` says no (the caller runs the modules). bf16: the four products of each layer in bf16 around an
        fp32 residual stream. tail_mask (m, T): the last m rows are a tree after the prompt (answer openings), each
        seeing where its row allows."""
        if not usable(x, decoder_layers):
            return None
        per_layer = [
            unrotated(layer_weights(layer), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) for layer in decoder_layers
        ]
        products = bf16_products(per_layer) if bf16 else []
        caches_ = _flat(caches(decoder_layers))
        return self.ops.prompt_layers(
            x,
            cos,
            sin,
            _flat_layers(per_layer),
            caches_,
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
def default_steps() -> NativeSteps | EagerSteps:
    """The backend a model gets: native where cpu_steps.cpp builds and loads here, else eager (decided once)."""
    from litevlm.model import native

    ops = native.ops()
    return EagerSteps() if ops is None else NativeSteps(ops)


def steps_for(module) -> NativeSteps | EagerSteps:
    """module's backend (a decoder or a draft head): `default_steps()` on first use, kept on the module; `use` sets
    another."""
    chosen = module.__dict__.get("_cpu_steps")
    if chosen is None:
        chosen = module.__dict__["_cpu_steps"] = default_steps()
    return chosen


def use(module, steps: NativeSteps | EagerSteps) -> None:
    """Run module's CPU steps on `steps` from now on (tests pin a backend this way)."""
    module.__dict__["_cpu_steps"] = steps


def backend() -> str:
    """The backend models get here: "native" (cpu_steps.cpp) or "eager"."""
    return default_steps().name


# ------------------------------------------------------------------------------------------------
# The native boundary: named weights -> the flat lists cpu_steps.cpp reads
# ------------------------------------------------------------------------------------------------
def _flat(groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for group in groups for t in group]


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


def native_weights(weights: list[LayerWeights], hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    """The layers' weights as the flat list the native ops read, q|k|v `unrotated` (made once per weights list: a
    generation's plan passes the same list to every step)."""
    return _per_list(_NATIVE_FLAT, (weights,), lambda: _flat_layers([unrotated(w, hq, hkv, d) for w in weights]))


def panels_built() -> bool:
    """The native build has the panel products (an AVX-512 machine)."""
    steps = default_steps()
    return steps.name == "native" and steps.has_panels


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
# Plans: a generation's weight arguments, gathered once
# ------------------------------------------------------------------------------------------------
def layer_weights(layer) -> LayerWeights:
    """One `DecoderLayer`'s weights for the steps (the fused, cached packing; once per `frozen()` scope)."""
    return remembered(("weights", id(layer)), lambda: _layer_weights(layer))


def _layer_weights(layer) -> LayerWeights:
    w = layer.fused_weights()
    qkv_bias = w.qkv_bias if w.qkv_bias is not None else w.qkv.new_zeros(w.qkv.shape[1])
    norm = layer.input_layernorm
    input_norm = norm.weight if hasattr(norm, "weight") else w.qkv.new_empty(0)
    return LayerWeights(input_norm, w.qkv, qkv_bias, w.o_proj, layer.post_attention_layernorm.weight, w.gate_up, w.down)


class Plan(NamedTuple):
    """`layers`' weight arguments for some decoder layers, gathered once: a generation builds one at its
    start and reuses it for every step (nothing changes the weights meanwhile). The caches are read at
    each call (`caches`): `setup_cache` may replace them."""

    weights: list[LayerWeights]


def plan(x: torch.Tensor, decoder_layers) -> Plan | None:
    """The arguments for running `decoder_layers` as CPU steps on inputs like x, or None where the modules
    must run (see `usable`)."""
    if not usable(x, decoder_layers):
        return None
    return Plan([layer_weights(layer) for layer in decoder_layers])


def caches(decoder_layers) -> list[list[torch.Tensor]]:
    """`layers`' cache arguments: each layer's current [K, V] (read through the module dicts: this runs
    every step, and nn.Module attribute lookups cost more than the rest of its bookkeeping)."""
    out = []
    for layer in decoder_layers:
        buffers = layer._modules["self_attn"]._modules["kv_cache"]._buffers
        out.append([buffers["k"], buffers["v"]])
    return out


_SCOPES = threading.local()  # .stack: the memo dicts of this thread's open `frozen()` scopes, innermost last


@contextmanager
def frozen():
    """A scope (one answer of the pipeline) within which the modules' weights and hooks are taken to stay as
    they are: the checks that run before each CPU step (`usable`'s walk for hooks, `DecoderLayer.fused_weights`'
    weight versions) run once in it and are remembered until it closes."""
    stack = _SCOPES.__dict__.setdefault("stack", [])
    stack.append({})
    try:
        yield
    finally:
        stack.pop()


def remembered(key, compute):
    """compute(), remembered under key for the innermost open `frozen()` scope (computed each time outside one)."""
    stack = _SCOPES.__dict__.get("stack")
    if not stack:
        return compute()
    memo = stack[-1]
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _hooks_in(module: torch.nn.Module) -> bool:
    """A forward (pre-)hook on module or below it (`submodules`: this runs at every generation, where
    `Module.modules()` is slower)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in submodules(module))


def _hooked(decoder_layers) -> bool:
    """Forward hooks would see nothing of a step run outside the modules: such layers run the modules."""
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        return True
    return any(remembered(("hooked", id(layer)), lambda layer=layer: _hooks_in(layer)) for layer in decoder_layers)


def usable(x: torch.Tensor, decoder_layers) -> bool:
    """The CPU steps apply: CPU, fp32, inference, plain projections, caches for one sequence, no hooks."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled() or _hooked(decoder_layers):
        return False
    for layer in decoder_layers:
        cache = layer._modules["self_attn"]._modules.get("kv_cache")
        if cache is None:
            return False
        k = cache._buffers["k"]
        if k.shape[0] != 1 or k.dtype != torch.float32 or not layer.fusable():
            return False
    return True
