"""Decoder steps over a few tokens on the CPU, outside the eager interpreter.

A decode step of a small decoder is about a hundred tiny ops (norms, a few matmuls, RoPE, a cache
write and attention per layer). Eagerly, each pays Python dispatch, which on a CPU costs several
times its arithmetic: drive-tiny's 12 MB of decoder weights multiply in about 0.75 ms, while an eager
step takes 2-2.5 ms. `layers` is the fused `DecoderLayer` path (`litevlm.model.lm`) written for one
sequence of n tokens at contiguous cache slots start..start+n-1, which covers a plain decode step
(n = 1), a tree verification (n nodes, ancestor mask) and a draft step (one layer). `chain` drafts a
whole chain in one call; a greedy chain's speculative cycle is two calls, one per side (`draft_cycle`:
the draft's extend and chain; `verify_chain`: the target's verification and acceptance).

Two implementations run them, chosen once per process (`backend()`):
- "native": the same four functions in C++ (cpu_steps.cpp, built on first use by
  `litevlm.model.native`): the matmuls go to ATen and everything between them is one loop each, so a
  step is its matmuls plus about 20 us a layer (drive-tiny on one core: a plain decode step 0.92 ms
  against 1.44 ms in TorchScript, a 6-step draft cycle 0.51 against 1.22 ms, a 6-token verification
  1.20 against 1.91 ms; a 186-token prefill about 2.6 ms faster than the eager layers).
- "torchscript": the Python functions below, run by TorchScript's interpreter, where the native
  build is unavailable or disabled (LITEVLM_NATIVE=0).
Where neither is available, the accessors return None and callers keep the eager path. Tests pin both
to the eager path.
"""

from __future__ import annotations

import functools
import threading
import warnings
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from litevlm.model.modules import submodules


def layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    weights: list[list[torch.Tensor]],
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
    allowed, or None when each token may see every slot up to start + n (one token). Per layer,
    weights = [input norm (C,) or empty for none, packed [q k | rot q rot k | v] (C, 2 nqk + Hkv D),
    its bias, o_proj (Hq D, C), post-attention norm (C,), [gate | up] (C, 2 I), down (I, C)], all
    row-major as `DecoderLayer.fused_weights`; caches = [K, V] (1, Hkv, S, D) per layer, written in
    place.
    """
    if last_only and len(weights) != 1:
        raise RuntimeError("last_only runs one layer: the next layer would need every row")
    n = x.shape[0]
    c = x.shape[1]
    nqk = (hq + hkv) * d
    end = start + n
    for i in range(len(weights)):
        w = weights[i]
        xn = torch.rms_norm(x, [c], w[0], eps) if w[0].numel() > 0 else x
        qkv = torch.addmm(w[2], xn, w[1])
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
        x = torch.addmm(x, y[0].transpose(0, 1).reshape(n, hq * d), w[3])
        gu = torch.rms_norm(x, [c], w[4], eps) @ w[5]
        half = gu.shape[1] // 2
        x = torch.addmm(x, F.silu(gu[:, :half]) * gu[:, half:], w[6])
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
    weights: list[list[torch.Tensor]],
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
    weights: list[list[torch.Tensor]],
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
    weights: list[list[torch.Tensor]],
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
    weights: list[list[torch.Tensor]],
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


_STEPS: list = []  # [(layers, chain, draft_cycle, verify_chain, decode_logits) or None], filled on first use by `_load`
_BACKEND: list = []  # ["native" | "torchscript" | None], beside it


def _scripted_steps() -> tuple | None:
    """The five functions above compiled by TorchScript, or None where that is unavailable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (
                torch.jit.script(layers),
                torch.jit.script(chain),
                torch.jit.script(draft_cycle),
                torch.jit.script(verify_chain),
                torch.jit.script(decode_logits),
            )
    except Exception:  # a build without TorchScript: the eager path serves
        return None


def _flat(groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for group in groups for t in group]


def _kept(t: torch.Tensor, name: str, make) -> torch.Tensor:
    """make(t), made once per packed weight and kept on it under `name` (packings are rebuilt, never changed in place)."""
    derived = t.__dict__.get(name)
    if derived is None:
        derived = t.__dict__[name] = make(t)
    return derived


def _without_rotation(t: torch.Tensor, nqk: int) -> torch.Tensor:
    """A packed q|k|v projection (C, 2 nqk + Hkv D) or its bias, [q k | rot q rot k | v], as [q k | v] for the native
    steps (which rotate in a loop)."""
    return _kept(t, "_litevlm_unrotated", lambda w: torch.cat([w[..., :nqk], w[..., 2 * nqk :]], -1).contiguous())


def _native_layer(w: list[torch.Tensor], nqk: int) -> list[torch.Tensor]:
    """One layer's weights (`layer_weights`) for the native ops: the q|k|v projection and bias without the rotated copies."""
    return [w[0], _without_rotation(w[1], nqk), _without_rotation(w[2], nqk), *w[3:]]


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


_NATIVE_FLAT: dict = {}  # id(weights list) -> ((that list,), its `_native_flat`)


def _native_flat(weights: list[list[torch.Tensor]], hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    """`_flat` of the layers' weights for the native ops: each q|k|v projection and bias without its rotated copies
    (made once per weights list: a generation's plan passes the same list to every step)."""
    return _per_list(_NATIVE_FLAT, (weights,), lambda: [t for w in weights for t in _native_layer(w, (hq + hkv) * d)])


@functools.cache
def panels_built() -> bool:
    """The native build has the panel products (an AVX-512 machine)."""
    from litevlm.model import native

    return native.ops() is not None and bool(native.ops().panels_built())


def panels(w: torch.Tensor) -> torch.Tensor:
    """A row-major (in, out) product weight as the native ops' bf16 panels (`pack_panels` in cpu_steps.cpp), made once
    per weight."""
    from litevlm.model import native

    return _kept(w, "_litevlm_panels", native.ops().pack_panels)


_DRAFT_PANELS: dict = {}  # id(weights list) -> ((that list, fc, head), its `_draft_panels`)


def _draft_panels(
    fc_w: torch.Tensor, head: torch.Tensor, weights: list[list[torch.Tensor]], hq: int, hkv: int, d: int
) -> list[torch.Tensor]:
    """A draft head's products in its native steps, on bf16 panels (cpu_steps.cpp: the draft only proposes, and its
    weights read in half the bytes): [fc, head, then each layer's q|k|v, o, gate|up, down]; empty where the build has
    none. Made once per weights list."""
    if not panels_built():
        return []

    def make() -> list[torch.Tensor]:
        layers = [_native_layer(w, (hq + hkv) * d) for w in weights]
        return [panels(fc_w), panels(head), *[panels(w[i]) for w in layers for i in (1, 3, 5, 6)]]

    return _per_list(_DRAFT_PANELS, (weights, fc_w, head), make)


def _native_steps() -> tuple | None:
    """The five functions as the native ops of cpu_steps.cpp (`litevlm.model.native`), taking the same
    arguments, or None where they cannot be built here."""
    from litevlm.model import native

    ops = native.ops()
    if ops is None:
        return None

    def native_layers(x, cos, sin, start, mask, weights, caches, hq, hkv, d, eps, last_only=False):
        return ops.layers(
            x, cos, sin, start, mask, _native_flat(weights, hq, hkv, d), _flat(caches), hq, hkv, d, eps, last_only
        )

    def native_chain(
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
        return ops.chain(
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
            _native_flat(weights, hq, hkv, d),
            _flat(caches),
            hq,
            hkv,
            d,
            eps,
            _draft_panels(fc_w, head, weights, hq, hkv, d),
        )

    def native_cycle(
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
        return ops.draft_cycle(
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
            _native_flat(weights, hq, hkv, d),
            _flat(caches),
            hq,
            hkv,
            d,
            eps,
            _draft_panels(fc_w, head, weights, hq, hkv, d),
        )

    def native_verify(
        tokens, start, root_pos, cos_table, sin_table, embed, weights, caches, hq, hkv, d, eps, norm_w, head
    ):
        return ops.verify_chain(
            tokens,
            start,
            root_pos,
            cos_table,
            sin_table,
            embed,
            _native_flat(weights, hq, hkv, d),
            _flat(caches),
            hq,
            hkv,
            d,
            eps,
            norm_w,
            head,
        )

    def native_decode(
        token, position, slot, cos_table, sin_table, embed, weights, caches, hq, hkv, d, eps, norm_w, head
    ):
        return ops.decode_logits(
            token,
            position,
            slot,
            cos_table,
            sin_table,
            embed,
            _native_flat(weights, hq, hkv, d),
            _flat(caches),
            hq,
            hkv,
            d,
            eps,
            norm_w,
            head,
        )

    return native_layers, native_chain, native_cycle, native_verify, native_decode


def _load() -> None:
    if not _STEPS:
        steps, name = _native_steps(), "native"
        if steps is None:
            steps, name = _scripted_steps(), "torchscript"
        _STEPS.append(steps)
        _BACKEND.append(name if steps is not None else None)


def backend() -> str | None:
    """Which implementation runs the CPU steps: "native" (cpu_steps.cpp), "torchscript", or None (eager)."""
    _load()
    return _BACKEND[0]


def step_layers():
    """`layers` as run here (native or TorchScript, once per process), or None where neither is available."""
    _load()
    return None if _STEPS[0] is None else _STEPS[0][0]


def step_chain():
    """`chain` as run here, or None."""
    _load()
    return None if _STEPS[0] is None else _STEPS[0][1]


def step_cycle():
    """(`draft_cycle`, `verify_chain`) as run here, or None."""
    _load()
    return None if _STEPS[0] is None else _STEPS[0][2:4]


def step_decode():
    """`decode_logits` as run here, or None."""
    _load()
    return None if _STEPS[0] is None else _STEPS[0][4]


def _native_layers(decoder_layers, cfg) -> list[list[torch.Tensor]]:
    """`_native_layer` of each layer's weights, for a decoder with TextConfig `cfg`."""
    nqk = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    return [_native_layer(layer_weights(layer), nqk) for layer in decoder_layers]


def prompt_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    decoder_layers,
    cfg,
    bf16: bool = False,
    tail_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A prompt of one sequence, x (T, C) at cache slots 0..T-1 with cos / sin (T, 1, D) at its positions,
    causally through `decoder_layers` (of a decoder with TextConfig `cfg`) in one native call -> (T, C) before any final norm; None where that
    does not apply (the native build is missing, or `usable` says no): the caller runs the layers eagerly.
    tail_mask (m, T): the last m rows are a tree after the prompt (answer openings), each seeing where its row allows.
    The eager prompt path costs about 0.4 ms a layer more on drive-tiny (its norms, RoPE, cache writes and
    attention dispatched op by op)."""
    if backend() != "native" or not usable(x, decoder_layers):
        return None
    from litevlm.model import native

    per_layer = _native_layers(decoder_layers, cfg)
    products = bf16_products(per_layer) if bf16 else []
    return native.ops().prompt_layers(
        x,
        cos,
        sin,
        _flat(per_layer),
        _flat(caches(decoder_layers)),
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.norm_eps,
        products,
        tail_mask,
    )


def bf16_products(per_layer: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The bf16 copies of each layer's four product weights (q|k|v, o, gate|up, down) from `_native_layer` lists: what
    a native prompt multiplies in the CPU library's bf16 GEMM in bf16 mode."""
    return [
        _kept(w[i], "_litevlm_bf16", lambda t: t.to(torch.bfloat16).contiguous())
        for w in per_layer
        for i in (1, 3, 5, 6)
    ]


def native_bf16_products(decoder_layers, cfg) -> list[torch.Tensor]:
    """`bf16_products` of these layers, for warming the CPU library's kernels (`VLM.set_bf16_matmul`); empty where the
    native steps do not serve."""
    if backend() != "native":
        return []
    return bf16_products(_native_layers([layer for layer in decoder_layers if layer.fusable()], cfg))


def layer_weights(layer) -> list[torch.Tensor]:
    """One `DecoderLayer`'s weights in `layers`' order (the fused, cached packing; once per `frozen()` scope)."""
    return remembered(("weights", id(layer)), lambda: _layer_weights(layer))


def _layer_weights(layer) -> list[torch.Tensor]:
    qkv_w, qkv_b, gate_up, o_t, down_t = layer.fused_weights()
    if qkv_b is None:
        qkv_b = qkv_w.new_zeros(qkv_w.shape[1])
    norm = layer.input_layernorm
    in_norm = norm.weight if hasattr(norm, "weight") else qkv_w.new_empty(0)
    return [in_norm, qkv_w, qkv_b, o_t, layer.post_attention_layernorm.weight, gate_up, down_t]


class Plan(NamedTuple):
    """`layers`' weight arguments for some decoder layers, gathered once: a generation builds one at its
    start and reuses it for every step (nothing changes the weights meanwhile). The caches are read at
    each call (`caches`): `setup_cache` may replace them."""

    weights: list[list[torch.Tensor]]


def plan(x: torch.Tensor, decoder_layers) -> Plan | None:
    """The arguments for running `decoder_layers` as CPU steps on inputs like x, or None where the eager
    path must run (see `usable`)."""
    if not usable(x, decoder_layers):
        return None
    return Plan([layer_weights(layer) for layer in decoder_layers])


def caches(decoder_layers) -> list[list[torch.Tensor]]:
    """`layers`' cache arguments: each layer's current [K, V] (read through the module dicts: this runs
    every step, and nn.Module attribute lookups would cost about 20 us here)."""
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
    `Module.modules()` would cost about 70 us for drive-tiny's decoder)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in submodules(module))


def _hooked(decoder_layers) -> bool:
    """Forward hooks would see nothing of a step run outside the modules: such layers keep the eager path."""
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
    return step_layers() is not None
