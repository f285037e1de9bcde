"""The assembled vision-language model: InternViT -> pixel shuffle -> projector -> decoder.

`encode_tiles` turns image tiles into LLM-width visual tokens; `embed` places them at the
`<IMG_CONTEXT>` placeholders of a prompt (tile-major, then row-major, as transformers'
masked_scatter does); the decoder then runs over text and visual tokens alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn

from litevlm.config import VLMConfig
from litevlm.errors import LiteVLMError
from litevlm.model import cpu_steps
from litevlm.model.lm import TextModel
from litevlm.model.prompt import Tiling
from litevlm.model.vision import Projector, VisionTower, pixel_shuffle

if TYPE_CHECKING:
    from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class VLM(nn.Module):
    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg.vision)
        self.multi_modal_projector = Projector(cfg)
        self.language_model = TextModel(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        if cfg.text.tie_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def set_bf16_matmul(self, min_rows: int = 32, warm_rows: int = 512) -> None:
        """Run in bf16 wherever an inference call has at least `min_rows` rows: the vision tower
        (`vit_blocks_bf16`) end to end, and a prompt's prefill on the native CPU steps (the four products of each
        layer in bf16 around an fp32 residual stream; the modules stay fp32). Decode steps and tree verification (a
        few rows) stay fp32. 0 turns it off. Needs a CPU with AMX or AVX512-BF16; a pipeline's backend made
        afterwards (`Pipeline.rebuild`) takes the setting.

        Weights are packed once for the CPU library (`litevlm.model.layers.pack_bf16`), and its kernel for every
        weight shape and row count the model will see (1-6 views; decoder row buckets up to `warm_rows`) is
        built here rather than inside the first prompts of each length."""
        from litevlm.model.layers import BF16_ROW_BUCKET, bf16_matmul_supported

        if min_rows and (self.device.type != "cpu" or self.dtype != torch.float32 or not bf16_matmul_supported()):
            raise LiteVLMError(
                "bf16 matmuls are a CPU path for fp32 models on CPUs with AMX or AVX512-BF16; "
                f"this model is {self.dtype} on {self.device}"
                + ("" if bf16_matmul_supported() else ", and this CPU has neither")
            )
        for block in self.vision_tower.encoder.layer:
            block.bf16_min_rows = min_rows
        for layer in self.language_model.layers:
            layer.bf16_min_rows = min_rows
        if not min_rows:
            return
        with torch.no_grad():
            # the vision tower's rows (views x tiles x (patches + 1)) are not padded: run it on 1-6 blank views
            s = self.cfg.vision.image_size
            for views in range(1, 7):
                self.vision_tower(torch.zeros(views * self.cfg.tiles_per_view, 3, s, s, device=self.device))
            first = -(-min_rows // BF16_ROW_BUCKET) * BF16_ROW_BUCKET
            # the native prompt's products: plain bf16 weights, the same row buckets
            plain = {
                tuple(w.shape): w for w in cpu_steps.native_bf16_products(self.language_model.layers, self.cfg.text)
            }
            for (k, _), w in plain.items():
                for rows in range(first, warm_rows + 1, BF16_ROW_BUCKET):
                    torch.zeros(rows, k, dtype=torch.bfloat16) @ w

    @property
    def matmul_precision(self) -> str:
        return "bf16" if self.language_model.layers[0].bf16_min_rows else str(self.dtype).removeprefix("torch.")

    # -- vision ---------------------------------------------------------------------------------
    def encode_tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, S, S) normalised pixels -> (tiles, tokens_per_tile, C_llm) visual tokens."""
        return self.encode_tiles_and_patches(pixels)[0]

    def encode_tiles_and_patches(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode_tiles`, plus the vision tower's own patch features (tiles, g*g, Cv) it shuffled and projected."""
        s = self.cfg.vision.image_size
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, s, s):
            raise LiteVLMError(f"image tiles must have shape (tiles, 3, {s}, {s}); got {tuple(pixels.shape)}")
        feats = self.vision_tower(pixels.to(self.dtype))  # (T, g*g, Cv)
        return self.multi_modal_projector(
            pixel_shuffle(feats, self.cfg.vision.grid, self.cfg.shuffle)
        ), feats  # (T, g*g/4, C), (T, g*g, Cv)

    # -- text -----------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, visual: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the visual tokens (N, C) scattered into the image placeholders in order."""
        x = self.language_model.embed_tokens(input_ids)  # (B, L, C)
        slots = input_ids == self.cfg.image_token_id
        n_slots = int(slots.sum())
        n_visual = 0 if visual is None else visual.reshape(-1, x.shape[-1]).shape[0]
        if n_slots != n_visual:
            raise LiteVLMError(
                f"the prompt has {n_slots} image placeholder tokens but {n_visual} visual tokens were given "
                f"({self.cfg.tokens_per_tile} per tile): the images do not match the prompt"
            )
        if n_visual:  # into the placeholders in order (masked_scatter's order, at a fraction of its time on a CPU)
            rows = slots.reshape(-1).nonzero().squeeze(1)
            x = x.reshape(-1, x.shape[-1]).index_copy(0, rows, visual.reshape(-1, x.shape[-1]).to(x.dtype)).view_as(x)
        return x

    def forward(self, input_ids: torch.Tensor, pixels: torch.Tensor | None = None, positions=None) -> torch.Tensor:
        """Full-sequence logits without a cache (training and equivalence checks)."""
        visual = self.encode_tiles(pixels) if pixels is not None else None
        x = self.embed(input_ids, visual)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return self.lm_head(self.language_model(x, positions))

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def image_to_uint8_tiles(image, image_size: int, tiles_per_view: int) -> np.ndarray:
    """A PIL image (any size) -> (tiles_per_view, 3, S, S) uint8: resized to (S*tiles, S), cut left to right."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise LiteVLMError(f"expected a PIL image, got {type(image).__name__}")
    return Tiling(tiles=tiles_per_view).cut(image, image_size)


def normalize_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, S, S) -> float32 normalised with the ImageNet mean and std, as InternVL does."""
    mean = torch.tensor(IMAGENET_MEAN, device=tiles.device)[:, None, None]
    std = torch.tensor(IMAGENET_STD, device=tiles.device)[:, None, None]
    return (tiles.float() / 255.0 - mean) / std


def image_to_tiles(image, image_size: int, tiles_per_view: int) -> torch.Tensor:
    """A PIL image (any size) -> (tiles_per_view, 3, S, S) float32, normalised."""
    return normalize_tiles(torch.from_numpy(image_to_uint8_tiles(image, image_size, tiles_per_view)))


def cut_view(source, tiling: Tiling, size: int, resample: str = "fast") -> np.ndarray:
    """One image (a path, encoded bytes, PIL image, uint8 array or tensor) read at the scale its tiles need and cut
    into (tiles, 3, S, S) uint8 tiles (`Tiling.cut`; `litevlm.model.images`)."""
    from litevlm.model.images import read_image

    image = read_image(source, lambda w, h: tiling.target(w, h, size), resample)
    return tiling.cut(image, size, resample)


def cut_images(sources, tiling: Tiling, size: int, resample: str = "fast") -> list[np.ndarray]:
    """Each image read and cut (`cut_view`), in order, side by side where torch has several threads; each is still
    its own whole resize, so the bytes are those of cutting them one by one. A bad image raises its `LiteVLMError`
    (the first such in order)."""
    from litevlm.model.images import side_by_side

    return side_by_side(lambda s: cut_view(s, tiling, size, resample), list(sources))


def load_image(source) -> Image.Image:
    """A path, encoded bytes, PIL image, uint8 array or tensor -> RGB PIL image, or a LiteVLMError naming the
    problem."""
    from litevlm.model.images import read_image

    return read_image(source, resample="pil")
