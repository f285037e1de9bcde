"""Request parsing: bytes in, a ChatRequest (question + each camera's encoded image bytes) or APIError out.

Images must be base64 data URLs: the parser never fetches a URL and never opens a file named in a
request. Each image's camera is named by a text part just before it ("CAM_BACK"); unnamed images take
the cameras not named, in nuScenes order; cameras may be missing (the pipeline refuses only the questions that
need them). Only image headers are read here (format, size, the pixel limit); the pipeline decodes the views a
question needs when the request's turn comes, so a queue holds bytes, not pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.serve.limits import Limits
from litevlm.serve.protocol import APIError, short, type_name, validate_request

# Decoders for untrusted bytes: common raster formats only (PIL's EPS plugin would run Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 64
MAX_PARTS = 64
_CAMERA_LABEL = re.compile(r"^\s*\[?\s*(CAM_[A-Z0-9_]*)\s*\]?\s*:?\s*$", re.IGNORECASE)
_SCHEME = re.compile(r"^([a-z][a-z0-9+.\-]*):", re.IGNORECASE)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class ChatRequest:
    question: str
    images: dict[str, bytes]  # camera -> encoded image bytes (header checked, pixels not yet decoded)
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


def parse_chat_request(
    body: bytes, *, model_name: str, limits: Limits, check_question: Callable[[str], Any] | None = None
) -> ChatRequest:
    """Validate a chat-completions body; raise APIError naming the first problem found."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text: send JSON", code="invalid_json") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, nesting bombs
        raise APIError(400, f"the request body is not valid JSON: {short(str(e), 120)}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type_name(data)}", code="invalid_request")
    _refuse_surrogates(data)
    params = validate_request(data)
    if params.model != model_name:
        raise APIError(
            404,
            f"the model {short(params.model)!r} does not exist; this server serves {model_name!r} (GET /v1/models)",
            code="model_not_found",
            param="model",
        )
    req = ChatRequest(
        question="",
        images={},
        stream=bool(params.stream),
        include_usage=bool(params.stream_options and params.stream_options.include_usage),
        max_tokens=params.max_completion_tokens or params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
    )
    question, urls = _parse_messages(params.messages, limits)
    if len(question) > limits.max_prompt_chars:
        raise APIError(
            400,
            f"the question is {len(question)} characters long; the limit is {limits.max_prompt_chars}",
            code="prompt_too_long",
            param="messages",
        )
    if not question:
        raise APIError(
            400,
            "the question is empty: add a text part asking something about the scene",
            code="invalid_prompt",
            param="messages",
        )
    if check_question is not None:
        try:
            check_question(question)
        except LiteVLMError as e:
            raise APIError(400, str(e), code="invalid_prompt", param="messages") from None
    req.question = question
    req.images = {cam: _decode_data_url(url, where, limits.max_image_pixels) for cam, (url, where) in urls.items()}
    return req


def _refuse_surrogates(data) -> None:
    """400 for the first string (or key) holding a lone UTF-16 surrogate: JSON's `\\ud800` escape parses,
    but it is no character, so no tokenizer, camera label or UTF-8 encoder can take it."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                at = f"{where}.{k}" if where else str(k)
                if _SURROGATE.search(k):
                    at = where or "(body)"
                    raise APIError(
                        400, f"a key in `{at}` holds a lone UTF-16 surrogate", code="invalid_unicode", param=at
                    )
                stack.append((v, at))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str) and (m := _SURROGATE.search(value)):
            raise APIError(
                400,
                f"`{where}` holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) at character {m.start()}, "
                "which is not a character: send valid Unicode",
                code="invalid_unicode",
                param=where,
            )


def _content_parts(content, where: str) -> list[tuple[str, str, str]]:
    """(kind, value, where) for each part: kind is "text" or "image", value the text or the URL."""
    if isinstance(content, str):
        return [("text", content, where)]
    if not isinstance(content, list):
        raise APIError(
            400,
            f"`{where}` must be a string or an array of content parts, got {type_name(content)}",
            code="invalid_type",
            param=where,
        )
    if len(content) > MAX_PARTS:
        raise APIError(
            400, f"`{where}` has {len(content)} parts; the limit is {MAX_PARTS}", code="invalid_value", param=where
        )
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise APIError(
                400,
                f"`{at}` must be an object with a string `type` ('text' or 'image_url'), got {short(part)}",
                code="invalid_type",
                param=at,
            )
        kind = part["type"]
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(
                    400,
                    f"`{at}.text` must be a string, got {type_name(text)}",
                    code="invalid_type",
                    param=at + ".text",
                )
            parts.append(("text", text, at))
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise APIError(
                    400,
                    f"`{at}.image_url.url` must be a string (a base64 data URL), got {type_name(url)}",
                    code="invalid_type",
                    param=at + ".image_url.url",
                )
            parts.append(("image", url, at + ".image_url.url"))
        else:
            raise APIError(
                400,
                f"`{at}.type` {short(kind)!r} is not supported: use 'text' and 'image_url' parts",
                code="unsupported_content",
                param=at + ".type",
            )
    return parts


def _camera_label(text: str, where: str) -> str | None:
    """The camera a text part names ("CAM_BACK", "CAM_BACK:", "[CAM_BACK]"), or None if it is question text."""
    m = _CAMERA_LABEL.match(text) if len(text) <= 64 else None
    if m is None:
        return None
    cam = m.group(1).upper()
    if cam not in CAMERAS:
        raise APIError(
            400,
            f"`{where}`: unknown camera {m.group(1)!r}; name each image with one of {', '.join(CAMERAS)}",
            code="unknown_camera",
            param=where,
        )
    return cam


def _parse_messages(messages, limits: Limits) -> tuple[str, dict[str, tuple[str, str]]]:
    """The question and camera -> (image URL, where) from the last message, which must be the user's.

    The pipeline answers one question about one set of views, so earlier messages (system prompts,
    previous turns) are checked for shape but not used, and may not carry images."""
    if not isinstance(messages, list) or not messages:
        raise APIError(
            400,
            "`messages` must be a non-empty array of {role, content} objects",
            code="invalid_type",
            param="messages",
        )
    if len(messages) > MAX_MESSAGES:
        raise APIError(
            400,
            f"`messages` has {len(messages)} entries; the limit is {MAX_MESSAGES}",
            code="invalid_value",
            param="messages",
        )
    parts: list[tuple[str, str, str]] = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(
                400,
                f"`{at}` must be an object with `role` and `content`, got {type_name(m)}",
                code="invalid_type",
                param=at,
            )
        if m.get("role") not in ROLES:
            raise APIError(
                400,
                f"`{at}.role` must be one of {', '.join(ROLES)}, got {short(m.get('role'))}",
                code="invalid_value",
                param=at + ".role",
            )
        last = i == len(messages) - 1
        if last and m["role"] != "user":
            raise APIError(
                400,
                f"the last message must be the user's question, got role {m['role']!r}",
                code="invalid_value",
                param=at + ".role",
            )
        if m.get("content") is None and not last:
            continue  # e.g. an assistant turn that only called a tool
        parts = _content_parts(m.get("content"), at + ".content")
        if not last and any(kind == "image" for kind, _, _ in parts):
            raise APIError(
                400,
                f"`{at}` carries an image: images belong in the last (user) message",
                code="invalid_value",
                param=at + ".content",
            )

    n_images = sum(kind == "image" for kind, _, _ in parts)
    if n_images > limits.max_images:
        raise APIError(
            400,
            f"{n_images} images in one request; the limit is {limits.max_images} (one per camera)",
            code="too_many_images",
            param="messages",
        )
    named: dict[str, tuple[str, str]] = {}
    unnamed: list[tuple[str, str]] = []
    texts: list[str] = []
    label: tuple[str, str] | None = None  # (camera, where) of a label waiting for its image
    for kind, value, where in parts:
        cam = _camera_label(value, where) if kind == "text" else None
        if label is not None and kind == "text":
            raise APIError(
                400,
                f"`{label[1]}` names camera {label[0]} but the next part is not an image",
                code="invalid_value",
                param=label[1],
            )
        if cam is not None:
            label = (cam, where)
        elif kind == "text":
            if value.strip():
                texts.append(value.strip())
        elif label is not None:
            if label[0] in named:
                raise APIError(
                    400, f"`{label[1]}`: camera {label[0]} is given twice", code="duplicate_camera", param=label[1]
                )
            named[label[0]] = (value, where)
            label = None
        else:
            unnamed.append((value, where))
    if label is not None:
        raise APIError(
            400, f"`{label[1]}` names camera {label[0]} but no image follows it", code="invalid_value", param=label[1]
        )
    free = [c for c in CAMERAS if c not in named]
    named.update(zip(free, unnamed))  # unnamed images take the cameras left, in nuScenes order
    if not named:
        raise APIError(
            400,
            f"no camera images given: send up to {len(CAMERAS)} images, each named with a text part before it "
            f"(e.g. 'CAM_BACK'); unnamed images are taken in nuScenes order ({', '.join(CAMERAS)})",
            code="missing_cameras",
            param="messages",
        )
    # Fewer than six is the pipeline's call, per question: it refuses (naming the camera) only the questions that
    # need a view that is not here.
    return " ".join(texts), {c: named[c] for c in CAMERAS if c in named}


def _decode_data_url(url: str, where: str, max_pixels: int) -> bytes:
    """Bytes of a base64 image data URL, with the image header checked; anything else is refused."""
    head = url[:80].strip()
    if not head.lower().startswith("data:"):
        scheme = _SCHEME.match(head)
        if scheme and len(scheme.group(1)) > 1:  # "c:" is a Windows drive letter
            s = scheme.group(1).lower()
            got = "a remote URL" if s in ("http", "https", "ftp", "ftps", "ws", "wss") else f"a {s}: URL"
        elif head.startswith(("/", "\\", "~", ".")) or re.match(r"^[a-zA-Z]:[\\/]", head) or "/" in head:
            got = "a file path"
        else:
            got = "a string that is not a data URL"
        raise APIError(
            400,
            f"`{where}` must be a base64 data URL (data:image/png;base64,...); got {got} "
            f"{short(url)!r}. This server never fetches URLs and never reads files named in a request.",
            code="image_url_not_allowed",
            param=where,
        )
    meta, comma, payload = url.partition(",")
    if not comma:
        raise APIError(
            400, f"`{where}`: malformed data URL (no comma before the data)", code="invalid_image", param=where
        )
    fields = [f.strip().lower() for f in meta[5:].split(";")]
    if fields[0] and not fields[0].startswith("image/"):
        raise APIError(
            400,
            f"`{where}`: the data URL's media type must be image/*, got {short(fields[0])!r}",
            code="invalid_image",
            param=where,
        )
    if "base64" not in fields[1:]:
        raise APIError(
            400,
            f"`{where}`: the data URL must be base64-encoded (data:image/png;base64,...)",
            code="invalid_image",
            param=where,
        )
    try:
        raw = base64.b64decode("".join(payload.split()), validate=True)  # line-wrapped base64 is fine
    except (binascii.Error, ValueError) as e:
        raise APIError(
            400, f"`{where}`: the image's base64 is invalid ({e})", code="invalid_image", param=where
        ) from None
    if not raw:
        raise APIError(400, f"`{where}`: the image is empty", code="invalid_image", param=where)
    _open_image(raw, where, max_pixels).close()
    return raw


def _open_image(raw: bytes, where: str, max_pixels: int):
    """Open (header only) and check the pixel count before any pixel is decoded."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise APIError(400, f"`{where}`: {e}", code="image_too_large", param=where) from None
    except Exception as e:  # untrusted bytes: any decoder failure is the client's bad image
        raise APIError(
            400,
            f"`{where}`: not a readable {'/'.join(IMAGE_FORMATS)} image ({short(str(e), 100)})",
            code="invalid_image",
            param=where,
        ) from None
    w, h = im.size
    if w < 1 or h < 1 or w * h > max_pixels:
        im.close()
        raise APIError(
            400,
            f"`{where}`: the image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}",
            code="image_too_large",
            param=where,
        )
    return im
