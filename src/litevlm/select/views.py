"""View selection: LiteVLM's Patch Selection Module (`ViewSelector`), run on the question text alone.

Most driving questions concern one or two of the six cameras, so the paper (arXiv 2506.07416,
section 3, "Patch Selection Module") decides which views to
encode before any pixel is touched. Two scorers are fused per view:
  1. a lexical map (`lexical_views`): DriveLM c-tags `<c1,CAM_BACK,x,y>` (any number), camera names,
     DriveLM direction phrases ("to the back left of the ego car", "front view") and their common
     variants ("behind us on the right", "rear-right camera", "on the left side ahead"); it scores a
     named camera 1 and stays silent on scene-wide questions;
  2. a learned module: a 4-layer transformer encoder over the hashed question words, N learned latent
     queries (one per camera) cross-attending to it, a shared MLP giving one logit per latent. Our
     addition: a latent whose camera the lexical map named (and, apart, every latent when some other
     camera was named) gets a learned offset, so the module learns what the map misses (implicit
     questions, "turn left" -> both left cameras) instead of re-deriving the map from words.
score_v = weight * lexical_v + (1 - weight) * sigmoid(logit_v); views with score >= threshold are
encoded. weight and threshold are calibrated on a validation split for a stated target recall
(`litevlm.train.views`) and stored with the checkpoint. When no view passes, every view is kept:
the pipeline never answers blind.

The module reads its own tokens, not the VLM's: each word is hashed (crc32) to a bucket and so are
its character trigrams (fastText style), summed into one embedding. The selector therefore does not
depend on which checkpoint's tokenizer is served (a 150k-entry InternVL vocabulary would dwarf the
module), and an unseen word still shares trigrams with known ones ("rearward", "back-right").
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError

SELECTOR_DIR = "view_selector"
SELECTOR_FORMAT = "litevlm-view-selector"
WEIGHTS_FILE = "selector.safetensors"

# A DriveLM object tag, leniently: <c1,CAM_BACK,1088.3,497.5> (spaces and case tolerated).
TAG_RE = re.compile(r"<\s*c\d+\s*,\s*(cam_(?:front|back)(?:_(?:left|right))?)\s*,[^>]*>", re.IGNORECASE)
# DriveLM's multiple-choice suffix: the options ("Back up.", "Going ahead.") are not directions.
MC_RE = re.compile(r"please select the correct answer", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------
# The lexical map
# ------------------------------------------------------------------------------------------------
_EGO = r"(?:us|me|the ego(?: car| vehicle)?|ego(?: car| vehicle)?|our (?:car|vehicle))"
_PLACE = r"(?:the|our|its)"
_FRONT_PLACE = r"(?:ahead|in front|to the front|at the front)"
_BACK_PLACE = r"(?:behind|in the back|at the back|to the back|to the rear|in the rear|at the rear)"
# Words before "to the left" that make it a motion, not a place ("steering to the left").
_MOTION = {
    "turn",
    "turns",
    "turning",
    "turned",
    "steer",
    "steers",
    "steering",
    "go",
    "goes",
    "going",
    "move",
    "moves",
    "moving",
    "drive",
    "drives",
    "driving",
    "swerve",
    "swerving",
    "merge",
    "merging",
    "change",
    "changing",
    "veer",
    "veering",
    "pull",
    "pulling",
    "head",
    "heading",
    "back",
    "backing",
    "reverse",
    "reversing",
}


def _cam(end: str, side: str | None = None) -> set[str]:
    end = "FRONT" if end in ("front", "forward", "ahead") else "BACK"
    return {f"CAM_{end}" + (f"_{side.upper()}" if side else "")}


def _pair(side: str) -> set[str]:
    return {f"CAM_FRONT_{side.upper()}", f"CAM_BACK_{side.upper()}"}


def _side_place(m: re.Match) -> set[str]:
    side, where = m.group(1), m.group(2)
    return _cam("front" if re.match(_FRONT_PLACE, where) else "back", side)


def _unless_motion(cams):
    """A handler that ignores the match when the word before it is a motion verb."""

    def handler(m: re.Match) -> set[str]:
        before = m.string[: m.start()].split()
        return set() if before and before[-1] in _MOTION else cams(m)

    return handler


# Ordered: each rule consumes its matches, so a later, looser rule never re-reads them
# ("on the left side ahead" is one camera, not "left side" plus "ahead").
_RULES: list[tuple[re.Pattern, object]] = [
    (re.compile(p), h)
    for p, h in [
        # camera names: CAM_FRONT_LEFT, cam front left
        (r"\bcam (front|back)(?: (left|right))?\b", lambda m: _cam(m.group(1), m.group(2))),
        # asking for every view outright
        (
            r"\b(?:all|every|each)(?: (?:of )?(?:the )?(?:six|6))? (?:camera views|cameras|views|camera|view|images)\b"
            r"|\bsurround(?:ing)? views?\b|\b360\b|\ball around\b|\bin all directions\b",
            lambda m: set(CAMERAS),
        ),
        (rf"\bin front of {_EGO}\b|\bin front\b(?! of)", lambda m: _cam("front")),
        (r"\bin front of\b", lambda m: set()),  # in front of another object: no camera
        # side and end both given: "on the left side ahead", "to the right behind"
        (rf"\b(?:on|to) {_PLACE} (left|right)(?: hand)?(?: side)?,? ({_FRONT_PLACE}|{_BACK_PLACE})\b", _side_place),
        # "ahead on the left", "ahead of us to the right", "behind us on the right"
        (
            rf"(?<!go )(?<!goes )(?<!going )(?<!went )"
            rf"\b(ahead|behind)(?: of {_EGO}| {_EGO})?,? (?:on|to) {_PLACE} (left|right)\b",
            lambda m: _cam("front" if m.group(1) == "ahead" else "back", m.group(2)),
        ),
        # end then side: "front left", "back-right", "rear right camera"
        (r"\b(front|back|rear) ?(left|right)\b", _unless_motion(lambda m: _cam(m.group(1), m.group(2)))),
        # side then end: "left rear camera", "right front side"
        (
            r"\b(left|right) (front|back|rear)\b(?= (?:view|camera|cam|side|corner|quarter|of)\b|\s*[?.,!;:]|\s*$)",
            lambda m: _cam(m.group(2), m.group(1)),
        ),
        # an end alone, as a place: "to the back of the ego car", "in the front view", "rear camera"
        (r"\b(?:to|in|at|on|from|towards?) the (front|back|rear)\b", lambda m: _cam(m.group(1))),
        (
            r"\b(front|back|rear|forward|backward|rearward)s?(?: facing)? "
            r"(?:view|views|camera|cameras|cam|image|images)\b",
            lambda m: _cam(m.group(1)),
        ),
        (r"\brear\b(?! end)", lambda m: _cam("back")),
        (r"(?<!go )(?<!goes )(?<!going )(?<!went )\bahead\b", lambda m: _cam("front")),
        (rf"\bbehind {_EGO}\b|\bfrom behind\b|\bbehind(?=\s*(?:[?.,!;:]|$))", lambda m: _cam("back")),
        # a side alone, as a place: both cameras of that side
        (r"\b(?:on|to) (?:the|our|its) (left|right)(?: hand)? side\b", _unless_motion(lambda m: _pair(m.group(1)))),
        (rf"\bto the (left|right) of {_EGO}\b", lambda m: _pair(m.group(1))),
        (r"\bon (?:the|our|its) (left|right)\b(?! (?:lane|turn|turns|hand lane))", lambda m: _pair(m.group(1))),
        (
            r"\b(left|right)(?: hand)? side (?:of|view|views|camera|cameras)\b"
            r"|\b(left|right) (?:view|views|camera|cameras|cam|mirror)\b",
            lambda m: _pair(m.group(1) or m.group(2)),
        ),
    ]
]


def _split_options(question: str) -> tuple[str, str]:
    m = MC_RE.search(question)
    return (question, "") if m is None else (question[: m.start()], question[m.start() :])


def lexical_views(question: str) -> dict[str, float]:
    """Per-camera lexical score (1.0 named, 0.0 not), in CAMERAS order; all zero when nothing is named.

    c-tags count anywhere (also in multiple-choice options); direction words only before the
    options. A scene-wide question ("What are the important objects in the current scene?",
    "Predict the behavior of the ego vehicle.") names no camera and scores zero everywhere.
    """
    found = {m.group(1).upper() for m in TAG_RE.finditer(question)}
    body, _ = _split_options(question)
    text = TAG_RE.sub(" object ", body).lower()
    text = re.sub(r"\s+", " ", re.sub(r"[_\-/]", " ", text)).strip()
    for pattern, handler in _RULES:
        if pattern.search(text) is None:
            continue
        for m in pattern.finditer(text):
            found |= handler(m)
        text = pattern.sub(" | ", text)  # consumed: a bar stops later rules from spanning it
    return {c: (1.0 if c in found else 0.0) for c in CAMERAS}


# ------------------------------------------------------------------------------------------------
# Question features: hashed words and character trigrams
# ------------------------------------------------------------------------------------------------
_WORD_RE = re.compile(r"\d+(?:\.\d+)?|[a-z]+|[^\sa-z\d]")


def question_words(question: str) -> list[str]:
    """The module's words: lower-cased, a c-tag becomes "[tag] cam_back", numbers "[num]",
    multiple-choice options "[options]" (only their tags are kept). The first word is "[q]"."""
    body, options = _split_options(question)
    words = ["[q]"]
    pos = 0
    for m in TAG_RE.finditer(body):
        words += _plain_words(body[pos : m.start()]) + ["[tag]", m.group(1).lower()]
        pos = m.end()
    words += _plain_words(body[pos:])
    if options:
        words.append("[options]")
        for m in TAG_RE.finditer(options):
            words += ["[tag]", m.group(1).lower()]
    return words


def _plain_words(text: str) -> list[str]:
    text = re.sub(
        r"\bcam_(front|back)(?:_(left|right))?\b",
        lambda m: f" cam_{m.group(1)}" + (f"_{m.group(2)}" if m.group(2) else "") + " ",
        text.lower(),
    )
    out = []
    for piece in text.split():
        if piece.startswith("cam_") and piece.upper() in CAMERAS:
            out.append(piece)
            continue
        out += ["[num]" if w[0].isdigit() else w for w in _WORD_RE.findall(piece)]
    return out


@lru_cache(maxsize=1 << 16)
def word_ids(word: str, buckets: int, max_ngrams: int) -> tuple[int, ...]:
    """Bucket ids (1..buckets-1; 0 is padding) of a word and of its character trigrams."""

    def h(s: str) -> int:
        return zlib.crc32(s.encode("utf-8")) % (buckets - 1) + 1

    ids = [h("w:" + word)]
    if not (word.startswith("[") or word.startswith("cam_")) and word.isalpha():
        padded = f"<{word}>"
        ids += [h("g:" + padded[i : i + 3]) for i in range(len(padded) - 2)][:max_ngrams]
    return tuple(ids)


@dataclass
class ViewSelectorConfig:
    """The module's shape and its hashing; a checkpoint stores it and nothing else decides it."""

    width: int = 64
    layers: int = 4
    heads: int = 4
    ffn: int = 128
    buckets: int = 4096
    max_words: int = 80  # longer questions are cut (the lexical map still reads all of them)
    max_ngrams: int = 12  # trigrams per word
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("width", "layers", "heads", "ffn", "max_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"config field {name!r}: must be positive; got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"config field 'heads': must divide width ({self.width}); got {self.heads}")
        if self.buckets < 2:
            raise ValueError(f"config field 'buckets': must be at least 2; got {self.buckets}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config field 'dropout': must be in [0, 1); got {self.dropout}")

    def features(self, questions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, T, K) long, mask (B, T) bool) for a batch of questions, padded with bucket 0."""
        rows = [
            [word_ids(w, self.buckets, self.max_ngrams) for w in question_words(q)[: self.max_words]] for q in questions
        ]
        t = max(len(r) for r in rows)
        k = max(len(ids) for r in rows for ids in r)
        pad_word = [0] * k
        ids = torch.tensor(
            [[list(w) + [0] * (k - len(w)) for w in r] + [pad_word] * (t - len(r)) for r in rows], dtype=torch.long
        )  # (B, T, K)
        mask = torch.tensor([[True] * len(r) + [False] * (t - len(r)) for r in rows], dtype=torch.bool)  # (B, T)
        return ids, mask


# ------------------------------------------------------------------------------------------------
# The selector
# ------------------------------------------------------------------------------------------------
def fuse(lexical: torch.Tensor, probs: torch.Tensor, weight: float) -> torch.Tensor:
    """Per-view score (B, N) = weight * lexical + (1 - weight) * module probability."""
    return weight * lexical + (1.0 - weight) * probs


def _mha_ops(
    query: torch.Tensor,
    kv: torch.Tensor,
    allowed: torch.Tensor | None,
    in_w: torch.Tensor,
    in_b: torch.Tensor,
    out_w: torch.Tensor,
    out_b: torch.Tensor,
    heads: int,
    self_attention: bool,
) -> torch.Tensor:
    """`nn.MultiheadAttention(query, kv, kv)` without dropout or weights, on raw weights (in_w (3C, C) =
    [q; k; v] as the module packs them): (B, Q, C), (B, T, C), allowed (B, 1, 1, T) bool or None (every
    key) -> (B, Q, C)."""
    b, nq, c = query.shape
    if self_attention:
        q, k, v = F.linear(query, in_w, in_b).chunk(3, -1)
    else:
        q = F.linear(query, in_w[:c], in_b[:c])
        k, v = F.linear(kv, in_w[c:], in_b[c:]).chunk(2, -1)
    t, d = kv.shape[1], c // heads
    q = q.reshape(b, nq, heads, d).transpose(1, 2)
    k = k.reshape(b, t, heads, d).transpose(1, 2)
    v = v.reshape(b, t, heads, d).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return F.linear(y.transpose(1, 2).reshape(b, nq, c), out_w, out_b)


def _logits_ops(
    x: torch.Tensor,
    allowed: torch.Tensor | None,
    q: torch.Tensor,
    encoder: list[list[torch.Tensor]],
    tail: list[torch.Tensor],
    heads: int,
    eps: float,
) -> torch.Tensor:
    """The module's inference from the embedded words x (B, T, C) and the latent queries q (B, N, C) on
    raw weights, in one call (`ViewSelector._packed_logits`): the encoder's pre-norm layers, its
    output norm, the latents' cross-attention and the head -> logits (B, N)."""
    c = x.shape[-1]
    for w in encoder:  # [norm1 w, b, in_proj w, b, out_proj w, b, norm2 w, b, linear1 w, b, linear2 w, b]
        h = F.layer_norm(x, [c], w[0], w[1], eps)
        x = x + _mha_ops(h, h, allowed, w[2], w[3], w[4], w[5], heads, True)
        h = F.layer_norm(x, [c], w[6], w[7], eps)
        x = x + F.linear(F.gelu(F.linear(h, w[8], w[9])), w[10], w[11])
    x = F.layer_norm(x, [c], tail[0], tail[1], eps)  # [norm, latent_norm, cross in / out, head norm, head linears]
    z = q + _mha_ops(
        F.layer_norm(q, [c], tail[2], tail[3], eps), x, allowed, tail[4], tail[5], tail[6], tail[7], heads, False
    )
    h = F.gelu(F.linear(F.layer_norm(z, [c], tail[8], tail[9], eps), tail[10], tail[11]))
    return F.linear(h, tail[12], tail[13]).squeeze(-1)


def native_ops():
    """torch.ops.litevlm_cpu where the native CPU code is built (`litevlm.model.native`), else None."""
    from litevlm.model import native

    return native.ops()


def keep_mask(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, N) bool: views whose score passes; a row where none passes keeps every view."""
    keep = scores >= threshold
    return keep | ~keep.any(dim=-1, keepdim=True)


class ViewSelector(nn.Module):
    """Which cameras a question needs: the lexical map fused with a small latent-query transformer.

    `weight` (lexical share of the score), `threshold` and `target_recall` come from calibration
    and travel with the checkpoint. weight = 1 is the lexical map alone (the module is not run).
    """

    def __init__(
        self,
        cfg: ViewSelectorConfig | None = None,
        *,
        weight: float = 0.5,
        threshold: float = 0.5,
        target_recall: float = 0.995,
        cameras: Sequence[str] = CAMERAS,
    ):
        super().__init__()
        self.cfg = cfg or ViewSelectorConfig()
        self.cameras = tuple(cameras)
        self.weight, self.threshold, self.target_recall = float(weight), float(threshold), float(target_recall)
        self.meta: dict = {}
        c, n = self.cfg.width, len(self.cameras)
        self.embed = nn.EmbeddingBag(self.cfg.buckets, c, mode="mean", padding_idx=0)
        self.pos = nn.Parameter(torch.randn(self.cfg.max_words, c) * 0.02)
        layer = nn.TransformerEncoderLayer(
            c, self.cfg.heads, self.cfg.ffn, self.cfg.dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, self.cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(c)
        # One learned query per camera, at unit scale: each view's identity must survive the
        # residual sum with the attention output and the head's LayerNorm from the first step.
        self.latents = nn.Parameter(torch.randn(n, c))
        self.latent_norm = nn.LayerNorm(c)
        self.lexical_query = nn.Parameter(torch.zeros(2, c))  # offsets: this camera named, another one named
        self.cross = nn.MultiheadAttention(c, self.cfg.heads, dropout=self.cfg.dropout, batch_first=True)
        self.head = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, c), nn.GELU(), nn.Linear(c, 1))

    @classmethod
    def lexical_only(cls) -> ViewSelector:
        """The lexical map alone (weight 1, threshold 0.5): for a model without a trained selector."""
        return cls(
            ViewSelectorConfig(width=8, layers=1, heads=1, ffn=8, buckets=2, max_words=1), weight=1.0, threshold=0.5
        ).eval()

    # -- the module ---------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, mask: torch.Tensor, lexical: torch.Tensor) -> torch.Tensor:
        """Logits (B, N) from hashed word ids (B, T, K), their mask (B, T) and the lexical map (B, N)."""
        b, t, k = ids.shape
        inference = not (self.training or torch.is_grad_enabled())
        if inference and b == 1 and ids.is_cpu and bool(mask.all()):  # one question: no padding
            logits = self._native_logits(ids[0], lexical[0])
            if logits is not None:
                return logits
        x = self.embed(ids.reshape(b * t, k)).reshape(b, t, -1) + self.pos[:t]  # (B, T, C)
        fast = self._packed_logits() if inference else None
        named = lexical.to(x.dtype)  # (B, N)
        other = (named.sum(-1, keepdim=True) > 0).to(x.dtype) * (1.0 - named)  # (B, N)
        q = (
            self.latents + named[..., None] * self.lexical_query[0] + other[..., None] * self.lexical_query[1]
        )  # (B, N, C)
        if fast is not None:  # inference in one call on raw weights (a question is ~100 tiny ops)
            fn, encoder, tail, eps = fast
            allowed = None if bool(mask.all()) else mask[:, None, None]
            return fn(x, allowed, q, encoder, tail, self.cfg.heads, eps)
        x = self.norm(self.encoder(x, src_key_padding_mask=~mask))  # (B, T, C)
        z = q + self.cross(self.latent_norm(q), x, x, key_padding_mask=~mask, need_weights=False)[0]  # (B, N, C)
        return self.head(z).squeeze(-1)  # (B, N)

    def _native_logits(self, ids: torch.Tensor, lexical: torch.Tensor) -> torch.Tensor | None:
        """Logits (1, N) of one question, word ids (T, K) and lexical map (N,) on the CPU, as one native call
        (cpu_steps.cpp); None where the native code does not serve this module."""
        native = self._native()
        if native is None:
            return None
        ops, packed, eps = native
        cfg = self.cfg
        return ops.view_logits(
            ids, lexical, packed, cfg.layers, cfg.width, cfg.ffn, cfg.heads, cfg.buckets, cfg.max_words, eps
        )

    def _uniform_eps(self) -> float | None:
        """The norms' one eps where every encoder layer is GELU (what `_logits_ops` and the native code
        describe), else None (the modules run)."""
        layers = list(self.encoder.layers)
        norms = [m for layer in layers for m in (layer.norm1, layer.norm2)] + [
            self.norm,
            self.latent_norm,
            self.head[0],
        ]
        if len({n.eps for n in norms}) != 1 or any(layer.activation_relu_or_gelu != 2 for layer in layers):
            return None
        return norms[0].eps

    def _native_tensors(self) -> list[torch.Tensor]:
        """Every weight in the native `view_logits`' order, each linear weight transposed to (in, out) (the cross
        in-projection as its q part and its k|v part)."""
        tensors = [self.embed.weight, self.pos, self.latents, self.lexical_query]
        for layer in self.encoder.layers:
            attn = layer.self_attn
            tensors += [
                layer.norm1.weight,
                layer.norm1.bias,
                attn.in_proj_weight.t(),
                attn.in_proj_bias,
                attn.out_proj.weight.t(),
                attn.out_proj.bias,
                layer.norm2.weight,
                layer.norm2.bias,
                layer.linear1.weight.t(),
                layer.linear1.bias,
                layer.linear2.weight.t(),
                layer.linear2.bias,
            ]
        c = self.cfg.width
        cross_in = self.cross.in_proj_weight  # (3C, C): the q rows, then the k|v rows
        return tensors + [
            self.norm.weight,
            self.norm.bias,
            self.latent_norm.weight,
            self.latent_norm.bias,
            cross_in[:c].t(),
            cross_in[c:].t(),
            self.cross.in_proj_bias,
            self.cross.out_proj.weight.t(),
            self.cross.out_proj.bias,
            self.head[0].weight,
            self.head[0].bias,
            self.head[1].weight.t(),
            self.head[1].bias,
            self.head[3].weight.t(),
            self.head[3].bias,
        ]

    def _native(self):
        """(torch.ops.litevlm_cpu, every weight packed into one fp32 buffer, eps) for the native inference, the
        buffer rebuilt when a weight changes; None where the native code is unavailable or does not describe
        this module (mixed norm eps, a non-GELU encoder, weights not fp32)."""
        ops = native_ops()
        if ops is None or self.latents.dtype != torch.float32:
            return None
        cache = self.__dict__.get("_native_pack")
        if cache is not None and cache[0] == tuple((p.data_ptr(), p._version) for p in cache[1]):
            return cache[2]
        params = list(self.parameters())
        eps = self._uniform_eps()
        packed = None if eps is None else torch.cat([w.detach().reshape(-1) for w in self._native_tensors()])
        args = None if packed is None else (ops, packed, eps)
        self.__dict__["_native_pack"] = (tuple((p.data_ptr(), p._version) for p in params), params, args)
        return args

    def _packed_logits(self):
        """(`_logits_ops`, encoder weights, tail weights, eps) for inference, rebuilt when a weight changes; None for
        a module `_logits_ops` does not describe (mixed norm eps, a non-GELU encoder), which then runs its modules."""
        cache = self.__dict__.get("_script_args")
        if cache is not None and cache[0] == tuple((p.data_ptr(), p._version) for p in cache[1]):
            return cache[2]
        eps = self._uniform_eps()
        if eps is None:
            return None
        layers = list(self.encoder.layers)
        encoder = [
            [
                layer.norm1.weight,
                layer.norm1.bias,
                layer.self_attn.in_proj_weight,
                layer.self_attn.in_proj_bias,
                layer.self_attn.out_proj.weight,
                layer.self_attn.out_proj.bias,
                layer.norm2.weight,
                layer.norm2.bias,
                layer.linear1.weight,
                layer.linear1.bias,
                layer.linear2.weight,
                layer.linear2.bias,
            ]
            for layer in layers
        ]
        tail = [
            self.norm.weight,
            self.norm.bias,
            self.latent_norm.weight,
            self.latent_norm.bias,
            self.cross.in_proj_weight,
            self.cross.in_proj_bias,
            self.cross.out_proj.weight,
            self.cross.out_proj.bias,
            self.head[0].weight,
            self.head[0].bias,
            self.head[1].weight,
            self.head[1].bias,
            self.head[3].weight,
            self.head[3].bias,
        ]
        params = [p for group in encoder for p in group] + tail
        args = (_logits_ops, [[p.detach() for p in g] for g in encoder], [p.detach() for p in tail], eps)
        self.__dict__["_script_args"] = (tuple((p.data_ptr(), p._version) for p in params), params, args)
        return args

    def lexical(self, questions: Sequence[str]) -> torch.Tensor:
        """The lexical map (B, N) of a batch of questions."""
        maps = [lexical_views(q) for q in questions]
        return torch.tensor([[m[c] for c in self.cameras] for m in maps]).reshape(-1, len(self.cameras))

    def probabilities(
        self, questions: Sequence[str], lexical: torch.Tensor | None = None, batch: int = 256
    ) -> torch.Tensor:
        """The module's probability (B, N) that each view is needed (call .eval() first)."""
        lexical = self.lexical(questions) if lexical is None else lexical
        dev = self.latents.device
        if len(questions) == 1:  # the pipeline's case, kept lean: one call, no batching
            ids, mask = self.cfg.features(questions)
            logits = self._native_logits(ids[0], lexical[0]) if dev.type == "cpu" and not self.training else None
            if logits is not None:
                return torch.sigmoid(logits)
            with torch.inference_mode():
                return torch.sigmoid(self(ids.to(dev), mask.to(dev), lexical.to(dev)).float()).cpu()
        out = []
        with torch.inference_mode():
            for i in range(0, len(questions), batch):
                ids, mask = self.cfg.features(questions[i : i + batch])
                logits = self(ids.to(dev), mask.to(dev), lexical[i : i + batch].to(dev))
                out.append(torch.sigmoid(logits.float()).cpu())
        return torch.cat(out) if out else torch.zeros(0, len(self.cameras))

    def scores(self, questions: Sequence[str]) -> torch.Tensor:
        """Fused scores (B, N) for a batch of questions."""
        lex = self.lexical(questions)
        if self.weight >= 1.0:
            return lex
        return fuse(lex, self.probabilities(questions, lex), self.weight)

    # -- the paper's interface ------------------------------------------------------------------------
    def score(self, question: str) -> dict[str, float]:
        """Fused per-camera score of one question: weight * lexical + (1 - weight) * module."""
        return dict(zip(self.cameras, self.scores([question])[0].tolist()))

    def select(self, question: str) -> tuple[list[str], dict[str, float]]:
        """(views to encode in CAMERAS order, per-camera scores); all six when none passes the threshold."""
        scores = self.score(question)
        kept = [c for c in self.cameras if scores[c] >= self.threshold]
        return (kept or list(self.cameras)), scores

    # -- checkpoint -----------------------------------------------------------------------------------
    def save(self, model_dir: str | Path, recipe: dict | None = None, extra: dict | None = None) -> Path:
        """Write `model_dir/view_selector/` (selector.safetensors + config.json); returns that folder."""
        from safetensors.torch import save_file

        d = Path(model_dir) / SELECTOR_DIR
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": SELECTOR_FORMAT,
            "cameras": list(self.cameras),
            "config": asdict(self.cfg),
            "weight": self.weight,
            "threshold": self.threshold,
            "target_recall": self.target_recall,
            "recipe": recipe or {},
            **(extra or {}),
        }
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": SELECTOR_FORMAT})
        (d / "config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return d

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> ViewSelector:
        """Load from `model_dir/view_selector/` (or that folder itself); a mismatch names the tensor."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        d = Path(model_dir)
        if not (d / WEIGHTS_FILE).is_file():
            d = d / SELECTOR_DIR
        if not (d / WEIGHTS_FILE).is_file() or not (d / "config.json").is_file():
            raise LiteVLMError(
                f"no ViewSelector at {model_dir}: expected {SELECTOR_DIR}/config.json and {WEIGHTS_FILE}; "
                "train one with `litevlm train views --model MODEL`"
            )
        try:
            meta = json.loads((d / "config.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise LiteVLMError(f"{d / 'config.json'} is not valid JSON: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != SELECTOR_FORMAT:
            raise LiteVLMError(
                f"{d / 'config.json'} is not a ViewSelector checkpoint "
                f"(format {meta.get('format') if isinstance(meta, dict) else None!r})"
            )
        if tuple(meta.get("cameras", ())) != CAMERAS:
            raise LiteVLMError(f"{d} was trained for cameras {meta.get('cameras')}, this rig has {list(CAMERAS)}")
        try:
            known = {f.name for f in fields(ViewSelectorConfig)}
            cfg = ViewSelectorConfig(**{k: v for k, v in meta["config"].items() if k in known})
            sel = cls(cfg, weight=meta["weight"], threshold=meta["threshold"], target_recall=meta["target_recall"])
        except (TypeError, ValueError, KeyError) as e:
            raise LiteVLMError(f"{d / 'config.json'} holds an invalid ViewSelector config: {e}") from None
        try:
            state = load_file(str(d / WEIGHTS_FILE))
        except (SafetensorError, OSError) as e:
            raise LiteVLMError(f"cannot read {d / WEIGHTS_FILE}: {e}") from None
        expected = sel.state_dict()
        for name, tensor in expected.items():
            if name not in state:
                raise LiteVLMError(f"{d / WEIGHTS_FILE} lacks tensor {name!r}: it does not match its config.json")
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise LiteVLMError(
                    f"{d / WEIGHTS_FILE}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                    f"config.json implies {tuple(tensor.shape)}"
                )
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            raise LiteVLMError(f"{d / WEIGHTS_FILE} has tensor {unexpected[0]!r} that a ViewSelector does not")
        sel.load_state_dict(state)
        sel.meta = meta
        return sel.to(device).eval()


# ------------------------------------------------------------------------------------------------
# Command line: `litevlm views --question "..." [--json]`
# ------------------------------------------------------------------------------------------------
def load_for_model(model: str | Path) -> ViewSelector:
    """The selector of a model (bundled name or directory), or a selector directory itself."""
    p = Path(model)
    if (p / WEIGHTS_FILE).is_file() or (p / SELECTOR_DIR / WEIGHTS_FILE).is_file():
        return ViewSelector.load(p)
    from litevlm.models import resolve_model_dir

    return ViewSelector.load(resolve_model_dir(model))
