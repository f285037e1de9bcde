"""One frame of the six cameras, asked several questions: each view read, cut and encoded once.

A car asks several questions about each moment of its cameras (DriveLM's perception, prediction, planning and
behaviour questions are about the same six images). The views' tiles and visual tokens do not depend on the
question, so a `Frame` makes them the first time a question needs a view and keeps them for the next; view
selection, token selection, prefill and decode stay per question. The views a question needs that are not made yet
are encoded in one batch, as `Pipeline.answer` encodes them; a tile's visual tokens do not depend on the tiles beside
it in that batch (each tile attends only to itself; a test checks the bytes on the CPU paths), so a frame's answers
equal `Pipeline.answer`'s token for token.

Across requests (`litevlm serve`, `litevlm eval`) the same frame comes back with new questions: a `ViewCache` keyed
by content (camera, a hash of the image's bytes, the tiling, the model's weights) serves them, least recently used
out by bytes, cleared whenever the weights change (`Pipeline.rebuild`).

A camera whose image is missing or unreadable fails only the questions that need its view, with an error naming it;
a question that needs every view (scene-wide) is refused when any is missing, naming them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from litevlm.cameras import CAMERAS
from litevlm.errors import CameraError, LiteVLMError

DEFAULT_CACHE_MB = 256


@dataclass
class EncodedView:
    """What a view gives every question: its tiles' visual tokens (tiles, tokens_per_tile, C)."""

    visual: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.visual.numel() * self.visual.element_size()


class ViewCache:
    """Encoded views keyed by content, least recently used out once they hold more than `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_MB << 20):
        if max_bytes < 0:
            raise LiteVLMError(f"the view cache's bound must be >= 0 bytes; got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, EncodedView] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: tuple) -> EncodedView | None:
        view = self.entries.get(key)
        if view is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return view

    def put(self, key: tuple, view: EncodedView) -> None:
        if key in self.entries or view.nbytes > self.max_bytes:
            return
        self.entries[key] = view
        self.bytes += view.nbytes
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self.entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
        }


def content_key(source) -> tuple[str, object]:
    """(a digest of the image's content, the source to read it from): a file is read once here and its bytes are
    what gets decoded, so the digest is of what is decoded. Encoded bytes and files hash what they hold; arrays,
    tensors and PIL images their pixels (with their shape), so one changed pixel changes the key."""
    from PIL import Image

    h = hashlib.blake2b(digest_size=16)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise LiteVLMError(f"image file not found: {path}")
        source = path.read_bytes()
    if isinstance(source, (bytes, bytearray, memoryview)):
        h.update(b"encoded")
        h.update(source)
        return h.hexdigest(), source
    if isinstance(source, Image.Image):
        h.update(f"pil {source.mode} {source.size}".encode())
        h.update(source.tobytes())
        return h.hexdigest(), source
    if isinstance(source, torch.Tensor):
        pixels = source.detach().cpu().contiguous().numpy()
    elif isinstance(source, np.ndarray):
        pixels = np.ascontiguousarray(source)
    else:
        raise LiteVLMError(
            f"an image must be a path, encoded bytes, a PIL image, a uint8 array or tensor; got {type(source).__name__}"
        )
    h.update(f"{type(source).__name__} {pixels.dtype} {pixels.shape}".encode())
    h.update(memoryview(pixels).cast("B"))
    return h.hexdigest(), source


class Frame:
    """The cameras of one moment (`Pipeline.frame(images)`): `answer(q)` / `stream(q)` as `Pipeline.answer` /
    `Pipeline.stream` with these images, each view read, cut and encoded once for all the frame's questions.

    images maps camera names to images (paths, encoded bytes, PIL images, HxWx3 uint8 arrays, uint8 tensors HWC or
    CHW); cameras may be missing: only the questions that need them fail. `encoded` counts the views this frame
    encoded; `failed` holds the cameras whose image could not be read, with why."""

    def __init__(self, pipe, images: Mapping, cache: ViewCache | None = None):
        pipe.check_images(images)
        self.pipe = pipe
        self.images = dict(images)
        self.cache = cache
        self.views: dict[str, EncodedView] = {}
        self.failed: dict[str, str] = {}
        self.encoded = 0
        self.hits = self.misses = 0  # of the content cache, for this frame's views

    def answer(self, question: str):
        """The whole answer at once: `stream` run to its end."""
        for item in self.stream(question):
            pass
        return item

    def stream(self, question: str):
        """`Pipeline.stream` of `question` about this frame."""
        return self.pipe.stream_frame(question, self)

    def answer_all(self, questions: list[str], max_batch: int = 8) -> list:
        """Every question's answer, decoded together as one batch (`Pipeline.answer_all`): the answers
        `answer(question)` gives one at a time."""
        return self.pipe.answer_all(list(questions), self, max_batch)

    # -- the views --------------------------------------------------------------------------------
    def check_views(self, views: list[str]) -> None:
        """A clear error where a view the question needs has no image, or one that could not be read."""
        missing = [c for c in views if c not in self.images]
        if missing:
            if self.pipe.view_selector is None:
                raise CameraError(
                    f"{len(self.images)} camera views given, missing {', '.join(missing)}: without view selection "
                    "every question needs all six",
                    "missing_cameras",
                    missing,
                )
            if len(views) == len(CAMERAS):
                raise CameraError(
                    f"this question needs every camera (a scene-wide question) and {', '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} missing: it is not answered blind to a camera",
                    "missing_cameras",
                    missing,
                )
            raise CameraError(
                f"this question needs {', '.join(views)}; the image of {', '.join(missing)} is missing",
                "missing_cameras",
                missing,
            )
        bad = [c for c in views if c in self.failed]
        if bad:
            message = "; ".join(f"this question needs {c}, whose image {self.failed[c]}" for c in bad)
            raise CameraError(message, "invalid_image", bad)

    def visual(self, views: list[str], timer) -> tuple[torch.Tensor, list[int]]:
        """The views' visual tokens (tiles, tokens_per_tile, C), in order, and each view's token count: the views
        not yet made are read and cut ("preprocess", side by side) and encoded in one batch ("vit")."""
        self.check_views(views)
        todo = [c for c in views if c not in self.views]
        if todo:
            self._make(todo, timer)
        self.check_views(views)  # a view that failed to read just now
        visual = [self.views[c].visual for c in views]
        tpt = self.pipe.cfg.tokens_per_tile
        return torch.cat(visual) if len(visual) > 1 else visual[0], [v.shape[0] * tpt for v in visual]

    def _make(self, cameras: list[str], timer) -> None:
        from litevlm.model.images import side_by_side
        from litevlm.model.vlm import cut_view, normalize_tiles

        pipe = self.pipe
        size = pipe.cfg.vision.image_size
        with timer("preprocess"):
            keys, sources = {}, {}
            for c in cameras:
                try:
                    key, sources[c] = content_key(self.images[c]) if self.cache is not None else (None, self.images[c])
                except LiteVLMError as e:
                    self._fail(c, e)
                    continue
                if key is not None:
                    keys[c] = (c, key, pipe.format.tiling, size, pipe.resample, pipe.weights_version)
                    hit = self.cache.get(keys[c])
                    self.hits, self.misses = self.hits + (hit is not None), self.misses + (hit is None)
                    if hit is not None:
                        self.views[c] = hit
                        sources.pop(c)

            def read(c):
                try:
                    return cut_view(sources[c], pipe.format.tiling, size, pipe.resample)
                except LiteVLMError as e:
                    return e

            tiles = {}
            for c, t in zip(list(sources), side_by_side(read, list(sources))):
                if isinstance(t, LiteVLMError):
                    self._fail(c, t)
                else:
                    tiles[c] = normalize_tiles(torch.from_numpy(t)).to(pipe.model.device)
        if not tiles:
            return
        with timer("vit"):  # one batch, as fast as the views one question needs ever were; kept view by view
            visual = pipe.model.encode_tiles(torch.cat(list(tiles.values())))  # (tiles, tokens_per_tile, C)
            for c, v in zip(tiles, visual.split([t.shape[0] for t in tiles.values()])):
                self.views[c] = EncodedView(v)
                self.encoded += 1
                if c in keys:  # a copy of its own: a cached view never holds the whole batch's memory
                    self.cache.put(keys[c], EncodedView(v.clone()))

    def _fail(self, camera: str, err: LiteVLMError) -> None:
        why = str(err)
        if why.startswith("cannot read"):
            self.failed[camera] = f"cannot be read ({why})"
        elif "not found" in why:
            self.failed[camera] = f"is missing ({why})"
        else:
            self.failed[camera] = f"is unusable ({why})"
