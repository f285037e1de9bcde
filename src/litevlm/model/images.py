"""Camera images to tiles: reading at the scale the tiles need, and one antialiased resize in uint8.

A view reaches the vision tower as `Tiling.cut` tiles of S x S pixels. Reading and cutting costs more than the
encoder on a CPU when done naively (a full-size decode, then a bicubic resize from full size in PIL), so:

- raw frames (HxWx3 uint8 arrays; uint8 tensors, HWC or CHW) go to the resize as they are, with no PIL round trip;
- a JPEG is decoded by libjpeg-turbo straight into an array (`simplejpeg`: no PIL image to copy out of) at the
  smallest of its DCT scales (1/2, 1/4, 1/8) that still covers the tiles' size (reduced-size decoding): nothing the
  resize keeps is lost, most of the decode is skipped. Where `simplejpeg` is not installed, or declines a file (CMYK,
  corrupt, too many pixels), PIL reads it at the same scale (`PIL.Image.draft`) and names any fault;
- the resize is torch's separable antialiased bicubic on uint8, the same filter as PIL's bicubic resize (within one
  level of every byte of it) at a fraction of its time.

`resample="pil"` keeps the reference path (PIL decodes in full, PIL's bicubic resize), byte for byte what
transformers' PIL image processor makes: the equivalence tests use it, and the preprocessing benchmark compares the
two.
"""

from __future__ import annotations

import io
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from litevlm.errors import LiteVLMError

RESAMPLE = ("fast", "pil")
FAST_SHRINK = 1.5  # a JPEG is decoded by libjpeg's fast paths where its tiles are this much smaller both ways
# Pixels are only ever read here (the resize makes new ones), so a read-only array (a PIL image's, a caller's frame)
# is taken as it is instead of copied to quiet torch's warning about it.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def check_resample(resample: str) -> str:
    if resample not in RESAMPLE:
        raise LiteVLMError(f"resample={resample!r}: use one of {', '.join(RESAMPLE)}")
    return resample


def dct_scale(width: int, height: int, target) -> int:
    """The denominator (1, 2, 4 or 8) of the smallest JPEG DCT scale whose size still covers target(width, height),
    by PIL's rule (`Image.draft`), so both decoders read a file at the same size."""
    tw, th = target(width, height)
    most = min(width // max(tw, 1), height // max(th, 1))
    return next(d for d in (8, 4, 2, 1) if d <= max(most, 1))


def decode_jpeg(data: bytes, target=None):
    """JPEG bytes -> (H, W, 3) uint8 array by libjpeg-turbo, at `dct_scale`'s scale; None where simplejpeg is not
    installed or declines the file (CMYK, corrupt, more pixels than PIL's bomb limit), for PIL to read or to name.

    Where the resize then shrinks the decoded image by at least `FAST_SHRINK` both ways, libjpeg's fast paths decode
    it: the fast integer inverse DCT, and the colour planes (half the image's size in a 4:2:0 JPEG, about the tiles'
    own size by then) widened by merged upsampling instead of the smoothing one. A third less decoding, for tiles a
    little further from the camera's own pixels than the JPEG's own loss puts them (the preprocessing benchmark
    measures both)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    from PIL import Image

    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            return None  # PIL warns or refuses, as it does for any image that large
        d = dct_scale(width, height, target) if target is not None else 1
        w, h = -(-width // d), -(-height // d)  # libjpeg rounds a scaled size up
        tw, th = target(width, height) if target is not None else (width, height)
        fast = tw * FAST_SHRINK <= w and th * FAST_SHRINK <= h
        # the largest scale whose size covers (w, h) is 1/d itself
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", fastdct=fast, fastupsample=fast, min_width=w, min_height=h
        )
    except ValueError:
        return None


def open_image(source, target=None, draft: bool = True, data: bytes | None = None):
    """A path or encoded bytes -> an RGB PIL image, decoded at the smallest JPEG scale that still covers `target`
    (a function (width, height) -> the (width, height) the tiles need; None or draft=False: full size). data: the
    source's bytes where they were already read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, (bytes, bytearray, memoryview)):
        where, opener = "the image bytes", io.BytesIO(bytes(source))
    else:
        path = Path(source)
        if data is None and not path.is_file():
            raise LiteVLMError(f"image file not found: {path}")
        where, opener = f"image {path}", path if data is None else io.BytesIO(data)
    try:
        with Image.open(opener) as im:
            if draft and target is not None and im.format == "JPEG":
                im.draft("RGB", target(*im.size))  # a DCT scale whose size is at least the target's, or none
            im.load()
            return im if im.mode == "RGB" else im.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:
        raise LiteVLMError(f"cannot read {where}: {e}") from None
    except Exception as e:  # a decoder's other failures on untrusted bytes: still the image's fault, named
        raise LiteVLMError(f"cannot read {where}: {type(e).__name__}: {e}") from None


def read_bytes(source) -> bytes:
    """A path or encoded bytes -> the bytes, naming a missing file."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    path = Path(source)
    if not path.is_file():
        raise LiteVLMError(f"image file not found: {path}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise LiteVLMError(f"cannot read image {path}: {e}") from None


def as_pixels(image) -> torch.Tensor:
    """A PIL image, HxWx3 (or 4) uint8 array, or uint8 tensor (HWC or CHW) -> (3, H, W) uint8 tensor on the CPU, a
    view of the caller's pixels where it can be (an array's or tensor's; a PIL image is copied once)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        return torch.from_numpy(np.asarray(rgb)).permute(2, 0, 1)  # (3, H, W), channels last in memory
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] not in (3, 4):
            raise LiteVLMError(f"an image array must be HxWx3 (or 4); got shape {image.shape}")
        if image.dtype != np.uint8:
            raise LiteVLMError(f"an image array must be uint8 (0-255); got {image.dtype}")
        if any(st < 0 for st in image.strides):  # a flipped view: torch takes positive strides only
            image = image.copy()
        return torch.from_numpy(image)[..., :3].permute(2, 0, 1)
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.ndim != 3:
            raise LiteVLMError(
                f"an image tensor must be uint8 HxWx3 or 3xHxW; got {str(image.dtype).removeprefix('torch.')} "
                f"{tuple(image.shape)}"
            )
        image = image.detach().cpu()
        if image.shape[0] in (3, 4) and image.shape[2] not in (3, 4):  # CHW
            return image[:3]
        if image.shape[2] in (3, 4):  # HWC
            return image[..., :3].permute(2, 0, 1)
        raise LiteVLMError(f"an image tensor must be uint8 HxWx3 or 3xHxW; got shape {tuple(image.shape)}")
    raise LiteVLMError(
        f"an image must be a path, encoded bytes, a PIL image, a uint8 array or tensor; got {type(image).__name__}"
    )


def resize(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(3, H, W) uint8 -> (3, height, width) uint8, antialiased bicubic (PIL's filter, within one level)."""
    if pixels.shape[1:] == (height, width):
        return pixels
    return F.interpolate(pixels[None], size=(height, width), mode="bicubic", antialias=True)[0]


def read_image(source, target=None, resample: str = "fast"):
    """Any image source -> what `Tiling.cut` takes: (3, H, W) uint8 pixels (fast), or an RGB PIL image (pil).

    target: (width, height) -> the size the tiles need, for a JPEG's reduced-size decoding (fast path only)."""
    from PIL import Image

    if isinstance(source, (str, Path, bytes, bytearray, memoryview)):
        data = read_bytes(source) if resample == "fast" else None
        if data is not None and data[:3] == b"\xff\xd8\xff" and (array := decode_jpeg(data, target)) is not None:
            return torch.from_numpy(array).permute(2, 0, 1)
        im = open_image(source, target, draft=resample == "fast", data=data)
        return as_pixels(im) if resample == "fast" else im
    if resample == "fast":
        return as_pixels(source)
    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    return Image.fromarray(as_pixels(source).permute(1, 2, 0).contiguous().numpy())


_POOLS: dict[int, ThreadPoolExecutor] = {}  # worker count -> the threads that cut images side by side
_POOLS_LOCK = threading.Lock()


def side_by_side(fn, items: list) -> list:
    """[fn(x) for x in items], one item a thread where torch runs on more than one (the threads the user runs with:
    one pinned thread does them one after another). PIL's decoding and torch's resize release the GIL. The first
    exception in order is raised; every item is still tried."""
    workers = min(len(items), torch.get_num_threads())
    if workers < 2:
        return [fn(x) for x in items]
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="litevlm-cut")
    return list(pool.map(fn, items))
