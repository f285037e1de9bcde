"""The prompt a checkpoint was fine-tuned with: its chat template, system message, camera labels and view tiling.

A question over some camera views becomes one user turn, rendered by the checkpoint's own chat template:

    [system turn, if the template or `system` gives one]
    <|im_start|>user\n
    CAM_FRONT: <img><IMG_CONTEXT> x n</img>\n        (one line per kept view, in the given order)
    ...
    {question}<|im_end|>\n<|im_start|>assistant\n

Each view is written into the user's message as its camera label followed by `<IMG_CONTEXT>\n`, which is how
transformers' InternVL chat template writes an image; the rendered text then has every `<IMG_CONTEXT>` expanded to
`<img>` + `<IMG_CONTEXT>` x (tokens of that view) + `</img>`, as InternVL's processor does, and is tokenised whole.
The camera label tells the model which view it is looking at, so a pruned set of views (view selection) still
reads unambiguously. A checkpoint without a chat template gets ChatML with no system turn (drive-tiny's format).

`PromptFormat` also holds the tiling (`Tiling`): how one camera image becomes square tiles for the vision tower.
The settings are saved as `prompt.json` beside the trained modules, so that a pipeline rebuilds the same prompt.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from litevlm.errors import LiteVLMError

PROMPT_FILE = "prompt.json"
IMAGE_MARK = "<IMG_CONTEXT>"  # what a chat template writes for an image, before expansion
# ChatML: the format of checkpoints that bring no chat template (drive-tiny's).
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_STRINGS = ("<img>", "</img>", IMAGE_MARK, "<|im_start|>", "<|im_end|>")


@dataclass
class PromptLayout:
    ids: list[int]
    # (camera, first placeholder index, one past the last) for each view, in prompt order
    view_spans: list[tuple[str, int, int]]


# ------------------------------------------------------------------------------------------------
# Tiling: one camera image -> square tiles
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tiling:
    """How a camera image becomes tiles of the vision tower's size S.

    Fixed (`max_tiles` 0): the image is resized to (S * tiles, S) and cut left to right, the paper's multi-view
    layout (2 tiles per camera, no thumbnail). Dynamic (`max_tiles` > 0): InternVL's dynamic tiling, the grid of
    at most `max_tiles` tiles whose aspect ratio is closest to the image's, cut row by row. With `thumbnail`, a
    view cut into more than one tile also gets the whole image resized to S x S, last.
    """

    tiles: int = 1
    max_tiles: int = 0
    thumbnail: bool = False

    def __post_init__(self):
        if self.max_tiles < 0 or (self.max_tiles == 0 and self.tiles < 1):
            raise LiteVLMError(f"tiling needs at least one tile per view; got tiles={self.tiles}, max={self.max_tiles}")

    def grid(self, width: int, height: int, size: int) -> tuple[int, int]:
        """(columns, rows) of tiles for an image of this size (the thumbnail not counted)."""
        if not self.max_tiles:
            return self.tiles, 1
        return closest_grid(width, height, size, self.max_tiles)

    def count(self, width: int, height: int, size: int) -> int:
        """Tiles an image of this size makes, the thumbnail included."""
        cols, rows = self.grid(width, height, size)
        return cols * rows + (1 if self.thumbnail and cols * rows > 1 else 0)

    def most(self) -> int:
        """The most tiles one view can make."""
        n = self.max_tiles or self.tiles
        return n + (1 if self.thumbnail and n > 1 else 0)

    def target(self, width: int, height: int, size: int) -> tuple[int, int]:
        """(width, height) of the largest resize an image of this size makes (its grid; the thumbnail is smaller)."""
        cols, rows = self.grid(width, height, size)
        return size * cols, size * rows

    def cut(self, image, size: int, resample: str = "fast") -> np.ndarray:
        """An image (a PIL image, an HxWx3 uint8 array, or (3, H, W) uint8 pixels) -> (tiles, 3, S, S) uint8, in the
        order the tokens are written. resample: "fast", torch's antialiased bicubic resize on uint8
        (`litevlm.model.images`); "pil", PIL's bicubic resize (the reference, transformers' PIL processor's bytes)."""
        if resample == "pil":
            return self._cut_pil(image, size)
        from litevlm.model.images import as_pixels, check_resample, resize

        check_resample(resample)
        pixels = as_pixels(image)  # (3, H, W)
        cols, rows = self.grid(pixels.shape[2], pixels.shape[1], size)
        a = resize(pixels, size * rows, size * cols)  # (3, rows*S, cols*S)
        # (3, rows, S, cols, S) -> (rows, cols, 3, S, S): row by row, left to right
        tiles = a.reshape(3, rows, size, cols, size).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, size, size)
        if self.thumbnail and rows * cols > 1:  # (rows*cols, 3, S, S) + the whole image
            tiles = torch.cat([tiles, resize(pixels, size, size)[None]])
        return np.ascontiguousarray(tiles.numpy())

    def _cut_pil(self, image, size: int) -> np.ndarray:
        from PIL import Image

        if not isinstance(image, Image.Image):
            from litevlm.model.images import read_image

            image = read_image(image, resample="pil")
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        cols, rows = self.grid(*rgb.size, size)
        a = np.asarray(rgb.resize((size * cols, size * rows), Image.BICUBIC))
        a = a.reshape(rows, size, cols, size, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, size, size)
        if self.thumbnail and rows * cols > 1:  # (rows*cols, 3, S, S) + the whole image
            thumb = np.asarray(rgb.resize((size, size), Image.BICUBIC)).transpose(2, 0, 1)[None]
            a = np.concatenate([a, thumb])
        return np.ascontiguousarray(a)


def closest_grid(width: int, height: int, size: int, max_tiles: int, min_tiles: int = 1) -> tuple[int, int]:
    """InternVL's dynamic-tiling grid: of all (columns, rows) with min..max tiles, the one whose aspect ratio is
    closest to the image's; on a tie the larger grid wins when the image has more than half its pixels."""
    grids = sorted(
        {
            (c, r)
            for n in range(min_tiles, max_tiles + 1)
            for c in range(1, n + 1)
            for r in range(1, n + 1)
            if min_tiles <= c * r <= max_tiles
        },
        key=lambda g: g[0] * g[1],
    )
    aspect = width / height
    best, best_diff = (1, 1), math.inf
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and width * height > 0.5 * size * size * c * r:
            best = (c, r)
    return best


# ------------------------------------------------------------------------------------------------
# The prompt format
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptFormat:
    """What a checkpoint's prompt looks like (module docstring); `build` makes one question's prompt.

    chat_template: the checkpoint's Jinja chat template (None: ChatML, no system turn).
    system: the system message (None: whatever the template does without one).
    camera_label: written before each view's image; `{camera}` is its name, `{index}` its place (1, 2, ...).
    tiling: how each view's image is cut into tiles.
    tokens: the template's special-token variables (bos_token, eos_token, ...), from tokenizer_config.json.
    """

    chat_template: str | None = None
    system: str | None = None
    camera_label: str = "{camera}: "
    tiling: Tiling = field(default_factory=Tiling)
    tokens: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        try:
            self.camera_label.format(camera="CAM_FRONT", index=1)
        except (KeyError, IndexError, ValueError) as e:
            raise LiteVLMError(
                f"camera label {self.camera_label!r} is not a valid format: use {{camera}} and {{index}} ({e})"
            ) from None

    # -- rendering ------------------------------------------------------------------------------
    @cached_property
    def _template(self):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise LiteVLMError(f"the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template or CHATML)
        except TemplateError as e:
            raise LiteVLMError(f"the checkpoint's chat template does not parse: {e}") from None

    def render(self, question: str, views: list[str]) -> str:
        """The prompt as text, each view's image written as `<IMG_CONTEXT>` (not yet expanded)."""
        from jinja2 import TemplateError

        content = "".join(self.label(c, i) + IMAGE_MARK + "\n" for i, c in enumerate(views)) + question
        messages = ([{"role": "system", "content": self.system}] if self.system is not None else []) + [
            {"role": "user", "content": content}
        ]
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **self.tokens)
        except TemplateError as e:
            raise LiteVLMError(f"the checkpoint's chat template failed to render a prompt: {e}") from None
        if question not in text or text.count(IMAGE_MARK) != len(views):
            raise LiteVLMError(
                "the chat template does not write the user's message into the prompt (no user turn?): "
                f"rendered {text[:200]!r}"
            )
        return text

    def label(self, camera: str, index: int) -> str:
        return self.camera_label.format(camera=camera, index=index + 1)

    def build(self, tokenizer, question: str, views: list[str], tokens: int | list[int]) -> PromptLayout:
        """One question's prompt ids over `views` with `tokens` visual tokens per view (one count, or one each)."""
        counts = [tokens] * len(views) if isinstance(tokens, int) else list(tokens)
        if len(counts) != len(views):
            raise LiteVLMError(f"{len(views)} views but visual token counts for {len(counts)}")
        # Each image block is tokenized with one placeholder and widened to its count after: the placeholder and the
        # block's ends are special tokens, which the tokenizer never merges with their neighbours, so the ids are
        # those of the fully written text, without running the tokenizer over hundreds of placeholders.
        pieces = self.render(question, views).split(IMAGE_MARK)
        short = tokenizer.encode(pieces[0] + "".join(f"<img>{IMAGE_MARK}</img>" + p for p in pieces[1:]))
        img_start, image = tokenizer.img_start_id, tokenizer.image_id
        starts = [i for i, t in enumerate(short) if t == img_start]
        if len(starts) != len(views):
            raise LiteVLMError(f"the prompt holds {len(starts)} <img> tokens for {len(views)} views")
        ids, spans, done = [], [], 0
        for c, s, n in zip(views, starts, counts):
            if short[s + 1 : s + 2] != [image]:
                raise LiteVLMError("the tokenizer does not keep <img> and its placeholder as single tokens")
            ids += short[done : s + 1]
            spans.append((c, len(ids), len(ids) + n))
            ids += [image] * n
            done = s + 2
        return PromptLayout(ids + short[done:], spans)

    # -- saving ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("tokens")
        return d

    @classmethod
    def from_dict(cls, d: dict, tokens: dict | None = None) -> PromptFormat:
        try:
            tiling = Tiling(**(d.get("tiling") or {}))
            rest = {k: d[k] for k in ("chat_template", "system", "camera_label") if k in d}
            return cls(tiling=tiling, tokens=dict(tokens or {}), **rest)
        except TypeError as e:
            raise LiteVLMError(f"invalid prompt format: {e}") from None

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / PROMPT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    def with_overrides(self, **changes) -> PromptFormat:
        """This format with the given settings replaced (None: kept); tiles, max_tiles, thumbnail set the tiling."""
        tiling = {k: changes.pop(k) for k in ("tiles", "max_tiles", "thumbnail") if changes.get(k) is not None}
        changes = {k: v for k, v in changes.items() if v is not None}
        if tiling:
            if "tiles" in tiling and "max_tiles" not in tiling:
                tiling["max_tiles"] = 0  # a fixed tile count turns dynamic tiling off
            changes["tiling"] = replace(self.tiling, **tiling)
        return replace(self, **changes)


def read_chat_template(folder: Path) -> str | None:
    """A checkpoint folder's chat template: chat_template.jinja, chat_template.json or tokenizer_config.json's."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            t = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            raise LiteVLMError(f"{f} is not a JSON object") from None
        if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if t:
            return str(t)
    return None


def template_tokens(folder: Path) -> dict:
    """The special-token strings a chat template may use (bos_token, eos_token, ...), from tokenizer_config.json."""
    f = folder / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise LiteVLMError(f"{f} is not a JSON object") from None
    out = {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = d.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[k] = v
    return out


def read_format(folder: str | Path, tiles: int = 1) -> PromptFormat:
    """A model folder's prompt format: its prompt.json if it has one (written with its trained modules), else the
    checkpoint's own chat template with the default label and `tiles` fixed tiles per view."""
    d = Path(folder)
    tokens = template_tokens(d)
    if (d / PROMPT_FILE).is_file():
        try:
            saved = json.loads((d / PROMPT_FILE).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise LiteVLMError(f"{d / PROMPT_FILE} is not valid JSON: {e.msg}") from None
        return PromptFormat.from_dict(saved, tokens)
    return PromptFormat(chat_template=read_chat_template(d), tiling=Tiling(tiles=tiles), tokens=tokens)


def build_prompt(tokenizer, question: str, views: list[str], tokens_per_view: int) -> PromptLayout:
    """The default format's prompt (ChatML, `{camera}: ` labels): drive-tiny's."""
    return PromptFormat().build(tokenizer, question, views, tokens_per_view)
