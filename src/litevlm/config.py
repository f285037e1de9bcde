"""Configuration dataclasses for the InternVL-architecture model, with named shape presets.

A config is the whole truth about a checkpoint's shapes: checkpoints store it beside their weights
and nothing is inferred from file names. Derived sizes are computed and validated in
`__post_init__`; an inconsistent field raises `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field


def flag(default, help: str, **more):
    """A dataclass field that is also a command-line flag, its help text beside its default.

    `more` may hold `flag` (the option string, when not the field's name), `choices`, `metavar`, and for a dict
    field `parse` (one repeatable KEY=VALUE item); `litevlm.options.add_recipe_options` reads them.
    """
    metadata = {"help": help, **more}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"config field {name!r}: {why}")


@dataclass
class VisionConfig:
    """InternViT: patch embedding + CLS + absolute positions, pre-norm blocks with layer scale."""

    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    intermediate_size: int = 4096
    image_size: int = 448
    patch_size: int = 14
    qkv_bias: bool = True
    qk_norm: bool = False
    norm_type: str = "layer_norm"  # or "rms_norm" (the 6B ViTs)
    norm_eps: float = 1e-6
    layer_scale_init: float = 0.1
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        _require(self.hidden_size % self.num_heads == 0, "num_heads", "must divide hidden_size")
        _require(self.image_size % self.patch_size == 0, "patch_size", "must divide image_size")
        _require(self.grid % 2 == 0, "image_size", "image_size / patch_size must be even for pixel shuffle 0.5")
        _require(self.norm_type in ("layer_norm", "rms_norm"), "norm_type", "must be layer_norm or rms_norm")
        _require(self.hidden_act in ("gelu", "quick_gelu", "gelu_pytorch_tanh"), "hidden_act", "unsupported")

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class TextConfig:
    """A Qwen2 / Llama / InternLM2-style decoder: RMSNorm, RoPE, GQA, SwiGLU."""

    vocab_size: int = 151674
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    intermediate_size: int = 4864
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    qkv_bias: bool = True  # Qwen2 yes; Llama / InternLM2 no
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    arch: str = "qwen2"  # "qwen2" or "llama": the transformers text model type

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            _require(self.hidden_size % self.num_heads == 0, "num_heads", "must divide hidden_size")
            self.head_dim = self.hidden_size // self.num_heads
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide num_heads")
        _require(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
        _require(self.arch in ("qwen2", "llama"), "arch", "must be 'qwen2' or 'llama'")


@dataclass
class VLMConfig:
    """Vision tower + pixel shuffle + projector + decoder, and the special token ids that join them."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    downsample_ratio: float = 0.5
    projector_act: str = "gelu"
    image_token_id: int = 151667  # <IMG_CONTEXT>
    img_start_id: int = 151665  # <img>
    img_end_id: int = 151666  # </img>
    eos_token_id: int = 151645  # <|im_end|>
    pad_token_id: int = 151643
    tiles_per_view: int = 1  # LiteVLM multi-view layout: every camera view cut into this many tiles
    name: str = "custom"

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)
        if isinstance(self.text, dict):
            self.text = TextConfig(**self.text)
        _require(
            self.downsample_ratio in (0.5, 1.0),
            "downsample_ratio",
            "must be 0.5 (pixel shuffle 2x2 -> 1) or 1.0 (one token a patch)",
        )
        for f in ("image_token_id", "img_start_id", "img_end_id", "eos_token_id", "pad_token_id"):
            _require(
                0 <= getattr(self, f) < self.text.vocab_size,
                f,
                f"must be a token id below vocab_size={self.text.vocab_size}",
            )
        _require(self.tiles_per_view in (1, 2), "tiles_per_view", "must be 1 or 2")
        _require(self.projector_act in ("gelu", "quick_gelu", "gelu_pytorch_tanh"), "projector_act", "unsupported")

    @property
    def tokens_per_tile(self) -> int:
        return self.token_grid**2

    @property
    def token_grid(self) -> int:
        """Visual tokens along each side of a tile: the patch grid after the pixel shuffle."""
        return self.vision.grid // self.shuffle

    @property
    def shuffle(self) -> int:
        """Patches folded into one visual token along each side (2 for InternVL's pixel shuffle 0.5, else 1)."""
        return round(1 / self.downsample_ratio)

    @property
    def projector_in(self) -> int:
        return self.vision.hidden_size * self.shuffle**2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> VLMConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"config has unknown fields {sorted(unknown)}")
        return cls(**d)


def _internvit_300m() -> VisionConfig:
    return VisionConfig()  # the defaults are InternViT-300M-448px-V2_5


# Real shapes, from the transformers InternVL checkpoints' config.json files.
PRESETS: dict[str, callable] = {
    "internvl2.5-1b": lambda: VLMConfig(
        vision=_internvit_300m(),
        text=TextConfig(151674, 896, 24, 14, 2, 4864, norm_eps=1e-6, qkv_bias=True, arch="qwen2"),
        name="internvl2.5-1b",
    ),
    "internvl2.5-2b": lambda: VLMConfig(
        vision=_internvit_300m(),
        text=TextConfig(92553, 2048, 24, 16, 8, 8192, norm_eps=1e-5, qkv_bias=False, arch="llama"),
        image_token_id=92546,
        img_start_id=92544,
        img_end_id=92545,
        eos_token_id=92542,
        pad_token_id=2,
        name="internvl2.5-2b",
    ),
    "internvl3-1b": lambda: VLMConfig(
        vision=_internvit_300m(),
        text=TextConfig(151674, 896, 24, 14, 2, 4864, norm_eps=1e-6, qkv_bias=True, arch="qwen2"),
        name="internvl3-1b",
    ),
    "internvl3-2b": lambda: VLMConfig(
        vision=_internvit_300m(),
        text=TextConfig(151674, 1536, 28, 12, 2, 8960, norm_eps=1e-6, qkv_bias=True, arch="qwen2"),
        name="internvl3-2b",
    ),
}
# The paper's 2B shapes (DESIGN section 2): InternVL2.5-2B.
PRESETS["2b"] = PRESETS["internvl2.5-2b"]
PRESETS["1b"] = PRESETS["internvl3-1b"]


def preset(name: str) -> VLMConfig:
    """A fresh config for a named preset (exact-name lookup)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
