"""InternViT vision encoder, pixel shuffle and the MLP projector (InternVL, arXiv 2404.16821).

Each 448 px tile (or smaller, in tiny configs) is cut into patches, a CLS token is prepended and
absolute position embeddings added; pre-norm blocks with per-channel layer scale follow. The last
layer's features, CLS dropped, are pixel-shuffled 2x2 -> 1 token (4x the channels) and projected
into the language model's width. Parameter names follow transformers' InternVL so checkpoints map
one to one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from litevlm.config import VisionConfig, VLMConfig
from litevlm.model.layers import RMSNorm, pack_bf16
from litevlm.model.modules import submodules


def _act(name: str):
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate="tanh")
    if name == "quick_gelu":
        return _QuickGELU()
    raise ValueError(f"unsupported activation {name!r}")


class _QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


def _norm(cfg: VisionConfig) -> nn.Module:
    if cfg.norm_type == "rms_norm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.projection = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.patch_embeddings = PatchEmbeddings(cfg)
        self.position_embeddings = nn.Parameter(torch.zeros(1, cfg.num_patches + 1, cfg.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embeddings.projection(pixels)  # (T, C, g, g)
        x = x.flatten(2).transpose(1, 2)  # (T, g*g, C)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embeddings  # (T, 1 + g*g, C)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        c = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(c, c, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(c, c, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(c, c, bias=cfg.qkv_bias)
        self.projection_layer = nn.Linear(c, c)
        # qk-norm normalises over the full width before the head split (the 6B ViTs).
        self.q_norm = RMSNorm(c) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, n, c = x.shape
        q = self.q_norm(self.q_proj(x)).view(t, n, self.num_heads, -1).transpose(1, 2)  # (T, H, N, D)
        k = self.k_norm(self.k_proj(x)).view(t, n, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(t, n, self.num_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional
        return self.projection_layer(y.transpose(1, 2).reshape(t, n, c))  # (T, N, C)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _act(cfg.hidden_act)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)
        self.layernorm_before = _norm(cfg)
        self.layernorm_after = _norm(cfg)
        self.lambda_1 = nn.Parameter(cfg.layer_scale_init * torch.ones(cfg.hidden_size))
        self.lambda_2 = nn.Parameter(cfg.layer_scale_init * torch.ones(cfg.hidden_size))
        # Inference calls with at least this many rows run in bf16 (0: never): `vit_blocks_bf16`.
        self.bf16_min_rows = 0
        self._packed: tuple | None = None  # (weight versions, `packed()`)
        self._packed16: tuple | None = None  # (the `packed()` list it was made from, its bf16 copies)

    def forward(self, x):
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))

    def packed(self) -> list:
        """The block's weights in `vit_blocks`' order, projections row-major and q, k, v packed into one
        (a zero bias where the model has none); rebuilt when a weight changes."""
        a, m = self.attention, self.mlp
        key = _weights_key(self)
        if self._packed is None or self._packed[0] != key:
            c = a.q_proj.in_features
            qkv_b = (
                torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                if a.q_proj.bias is not None
                else a.q_proj.weight.new_zeros(3 * c)
            )
            weights = [
                None if t is None else t.detach().contiguous()
                for t in (
                    self.layernorm_before.weight,
                    getattr(self.layernorm_before, "bias", None),
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).t(),
                    qkv_b,
                    a.projection_layer.weight.t(),
                    a.projection_layer.bias,
                    self.lambda_1,
                    self.layernorm_after.weight,
                    getattr(self.layernorm_after, "bias", None),
                    m.fc1.weight.t(),
                    m.fc1.bias,
                    m.fc2.weight.t(),
                    m.fc2.bias,
                    self.lambda_2,
                )
            ]
            self._packed = (key, weights)
        return self._packed[1]

    def bf16_weights(self) -> list:
        """`vit_blocks_bf16`' weights: `packed()` in bf16, its projections packed for the CPU library (q, k and v
        apart) with bf16 biases; made once per packing."""
        w = self.packed()
        if self._packed16 is None or self._packed16[0] is not w:
            c = w[2].shape[0]
            half = [None if t is None else t.to(torch.bfloat16) for t in w]
            qkv = [t for i in range(3) for t in (pack_bf16(w[2][:, i * c : (i + 1) * c]), half[3][i * c : (i + 1) * c])]
            self._packed16 = (
                w,
                [
                    half[0],
                    half[1],
                    *qkv,
                    pack_bf16(w[4]),
                    half[5],
                    half[6],
                    half[7],
                    half[8],
                    pack_bf16(w[9]),
                    half[10],
                    pack_bf16(w[11]),
                    half[12],
                    half[13],
                ],
            )
        return self._packed16[1]


def vit_blocks(x: torch.Tensor, weights: list[list[torch.Tensor]], heads: int, eps: float) -> torch.Tensor:
    """InternViT blocks (LayerNorm, exact GELU, no qk-norm) on raw weights: x (T, N, C).
    Per block: [norm1 w, b, qkv W (C, 3C) row-major, qkv b, proj W (C, C), proj b, lambda_1, norm2 w, b,
    fc1 W (C, I), fc1 b, fc2 W (I, C), fc2 b, lambda_2]."""
    t, n, c = x.shape
    d = c // heads
    for w in weights:
        h = F.layer_norm(x, [c], w[0], w[1], eps).reshape(t * n, c)
        q, k, v = (
            torch.addmm(w[3][i * c : (i + 1) * c], h, w[2][:, i * c : (i + 1) * c]).view(t, n, heads, d).transpose(1, 2)
            for i in range(3)
        )  # three products: contiguous q, k, v keep attention on its fast path
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t * n, c)
        x = x + w[6] * torch.addmm(w[5], y, w[4]).view(t, n, c)
        h = F.gelu(torch.addmm(w[10], F.layer_norm(x, [c], w[7], w[8], eps).reshape(t * n, c), w[9]))
        x = x + w[13] * torch.addmm(w[12], h, w[11]).view(t, n, c)
    return x


def vit_blocks_bf16(x: torch.Tensor, weights: list[list[torch.Tensor | None]], heads: int, eps: float) -> torch.Tensor:
    """`vit_blocks` in bf16 end to end (CPUs with AMX / AVX512-BF16): x (T, N, C) fp32 is cast once, every
    product runs on weights packed for the CPU library (fc1 with its GELU fused), norms, attention and the
    residual stream stay bf16, and the output is cast back once. Casting around each product instead cost
    what the bf16 products saved at 2-3 views. Per block (`Block.bf16_weights`): [norm1 w, b, q W, q b, k W,
    k b, v W, v b, proj W, proj b, lambda_1, norm2 w, b, fc1 W, fc1 b, fc2 W, fc2 b, lambda_2]."""
    t, n, c = x.shape
    d = c // heads
    x = x.to(torch.bfloat16)
    for w in weights:
        h = F.layer_norm(x, [c], w[0], w[1], eps).reshape(t * n, c)
        q, k, v = (
            torch.ops.mkldnn._linear_pointwise(h, w[2 + 2 * i], w[3 + 2 * i], "none", [], "")
            .view(t, n, heads, d)
            .transpose(1, 2)
            for i in range(3)
        )
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t * n, c)
        x = x + w[10] * torch.ops.mkldnn._linear_pointwise(y, w[8], w[9], "none", [], "").view(t, n, c)
        h = torch.ops.mkldnn._linear_pointwise(
            F.layer_norm(x, [c], w[11], w[12], eps).reshape(t * n, c), w[13], w[14], "gelu", [], "none"
        )
        x = x + w[17] * torch.ops.mkldnn._linear_pointwise(h, w[15], w[16], "none", [], "").view(t, n, c)
    return x.float()


def _weights_key(module: nn.Module) -> tuple:
    """(data_ptr, version) of every parameter of module and below, read through `submodules`
    (`Module.parameters()` is slower, and this runs at every vision call)."""
    return tuple(
        (p.data_ptr(), p._version) for m in submodules(module) for p in m._parameters.values() if p is not None
    )


def _plain_linears(block: Block) -> bool:
    """Every projection of the block an nn.Linear as built (not, say, an FP8Linear) with no hooks
    (calibration observes them): only then may its weights be used raw."""
    a, m = block._modules["attention"]._modules, block._modules["mlp"]._modules  # direct dict reads: every call
    return all(
        type(lin) is nn.Linear and not (lin._forward_hooks or lin._forward_pre_hooks)
        for lin in (a["q_proj"], a["k_proj"], a["v_proj"], a["projection_layer"], m["fc1"], m["fc2"])
    )


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, S, S) -> last-layer features without CLS, (tiles, g*g, C)."""
        x = self.embeddings(pixels)
        if self._plain_ops(x):  # CPU inference: the blocks as plain ops on packed weights, no module calls
            blocks = list(self.encoder.layer)
            if all(b.bf16_min_rows and x.shape[0] * x.shape[1] >= b.bf16_min_rows for b in blocks):
                return vit_blocks_bf16(x, [b.bf16_weights() for b in blocks], self.cfg.num_heads, self.cfg.norm_eps)[
                    :, 1:
                ]
            return vit_blocks(x, [b.packed() for b in blocks], self.cfg.num_heads, self.cfg.norm_eps)[:, 1:]
        for block in self.encoder.layer:
            x = block(x)
        return x[:, 1:]

    def _plain_ops(self, x: torch.Tensor) -> bool:
        """fp32 CPU inference with LayerNorm, exact GELU, no qk-norm and plain projections: `vit_blocks` (or, in
        bf16 mode, `vit_blocks_bf16`) applies; else the blocks run as modules."""
        return not (
            not x.is_cpu
            or x.dtype != torch.float32
            or torch.is_grad_enabled()
            or self.cfg.qk_norm
            or self.cfg.norm_type != "layer_norm"
            or self.cfg.hidden_act != "gelu"
            or not all(_plain_linears(b) for b in self.encoder.layer)
        )


def pixel_shuffle(x: torch.Tensor, grid: int, fold: int = 2) -> torch.Tensor:
    """(T, g*g, C) -> (T, g*g/4, 4C), with exactly transformers' (and the original v2) channel order.

    `fold` 1 (downsample ratio 1.0) keeps one token a patch: the identity, as in transformers."""
    if fold == 1:
        return x
    t, _, c = x.shape
    x = x.reshape(t, grid, grid, c)  # (T, W, H, C) in transformers' naming
    x = x.view(t, grid, grid // 2, c * 2)  # fold pairs along the second spatial axis
    x = x.permute(0, 2, 1, 3).contiguous()  # (T, H/2, W, 2C)
    x = x.view(t, grid // 2, grid // 2, c * 4)  # fold pairs along the first spatial axis
    x = x.permute(0, 2, 1, 3).contiguous()  # (T, W/2, H/2, 4C)
    return x.reshape(t, -1, c * 4)


class Projector(nn.Module):
    """LayerNorm(4C, eps 1e-5) -> Linear -> GELU -> Linear, into the LLM's width."""

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.projector_in)
        self.linear_1 = nn.Linear(cfg.projector_in, cfg.text.hidden_size)
        self.act = _act(cfg.projector_act)
        self.linear_2 = nn.Linear(cfg.text.hidden_size, cfg.text.hidden_size)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))
