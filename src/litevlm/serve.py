"""`litevlm serve`: an OpenAI-compatible HTTP server for the pipeline.

`POST /v1/chat/completions` takes a user message of text and `image_url` parts. Images must be
base64 data URLs: the server never fetches a URL and never opens a file named in a request. Each
image's camera is named by a text part just before it ("CAM_BACK"); unnamed images take the
cameras not named, in nuScenes order. The answer carries OpenAI `usage` plus a `litevlm` extension
field: the views used, visual and prompt token counts, and per-stage milliseconds. `GET /v1/models`,
`GET /health` and `GET /metrics` (Prometheus text format) complete the set.

One model instance answers one request at a time on a single worker thread. Admitted requests are
counted against a bounded queue (429 with Retry-After when it is full) and each has a deadline
(504). Every refusal is a 4xx with an OpenAI-style error body naming the problem. Streaming is
honest about what it is: the pipeline produces the whole answer, then the server sends it as SSE
chunks, one per generated token (decoded incrementally), so the first byte comes no sooner than a
non-streamed answer would.

FastAPI and uvicorn are imported only when a server is built, so `litevlm --help` works without
them (`pip install litevlm[serve]`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import json
import math
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError

if TYPE_CHECKING:
    from fastapi import FastAPI

# Stage histograms shown even before the first request; any other stage the pipeline reports is added.
STAGE_METRICS = ("select_views", "vit", "select_tokens", "prefill", "decode", "total")
# Seconds; a tiny model on a GPU answers in ~1 ms, a 2B model on a CPU in tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Decoders for untrusted bytes: common raster formats only (PIL's EPS plugin would run Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 64
MAX_PARTS = 64
# Features of the OpenAI API this pipeline cannot honour: refused rather than silently ignored.
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "stop", "audio", "prediction")
_CAMERA_LABEL = re.compile(r"^\s*\[?\s*(CAM_[A-Z0-9_]*)\s*\]?\s*:?\s*$", re.IGNORECASE)
_SCHEME = re.compile(r"^([a-z][a-z0-9+.\-]*):", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------
# Errors: every refusal is an APIError rendered as OpenAI's {"error": {...}} body
# ------------------------------------------------------------------------------------------------
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
}


class APIError(Exception):
    """A request the server refuses: HTTP status, a message saying what to fix, a stable code."""

    def __init__(
        self, status: int, message: str, *, code: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _short(value: Any, n: int = 60) -> str:
    s = value if isinstance(value, str) else repr(value)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def _type_name(value: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------
# Limits
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server. `max_queue` counts requests waiting for the model
    besides the one it is answering; `timeout_s` runs from admission to the finished answer."""

    max_queue: int = 16
    timeout_s: float = 60.0
    max_body_bytes: int = 32 * 2**20
    max_image_pixels: int = 3200 * 1800  # four nuScenes frames' worth
    max_images: int = len(CAMERAS)
    max_prompt_chars: int = 4000

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if not 1 <= self.max_images <= len(CAMERAS):
            raise ValueError(f"max_images must be in 1..{len(CAMERAS)} (one image per camera), got {self.max_images}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")


# ------------------------------------------------------------------------------------------------
# Request parsing and validation (pure functions: bytes in, ChatRequest or APIError out)
# ------------------------------------------------------------------------------------------------
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
        raise APIError(400, f"the request body is not valid JSON: {_short(str(e), 120)}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_type_name(data)}", code="invalid_request")

    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, f"`model` is required: a string, here {model_name!r}", code="invalid_type", param="model")
    if model != model_name:
        raise APIError(
            404,
            f"the model {_short(model)!r} does not exist; this server serves {model_name!r} (GET /v1/models)",
            code="model_not_found",
            param="model",
        )
    for key in UNSUPPORTED:
        if data.get(key) not in (None, [], ""):
            raise APIError(400, f"`{key}` is not supported by this server", code="unsupported_parameter", param=key)
    if data.get("logprobs") not in (None, False):
        raise APIError(
            400, "`logprobs` is not supported by this server", code="unsupported_parameter", param="logprobs"
        )
    fmt = data.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(
            400,
            "`response_format` must be {'type': 'text'}: structured output is not supported",
            code="unsupported_parameter",
            param="response_format",
        )

    req = ChatRequest(question="", images={})
    req.stream = _optional(data, "stream", bool, False)
    opts = _optional(data, "stream_options", dict, None)
    if opts is not None:
        req.include_usage = _optional(opts, "include_usage", bool, False, where="stream_options.")
    n = _optional(data, "n", int, 1)
    if n != 1:
        raise APIError(400, f"`n` must be 1: one answer per request, got {n}", code="invalid_value", param="n")
    for key in ("max_completion_tokens", "max_tokens"):
        value = _optional(data, key, int, None)
        if value is not None:
            if value < 1:
                raise APIError(400, f"`{key}` must be >= 1, got {value}", code="invalid_value", param=key)
            req.max_tokens = value
            break
    req.temperature = _number(data, "temperature", 0.0, 2.0)
    req.top_p = _number(data, "top_p", 0.0, 1.0, open_low=True)
    req.seed = _optional(data, "seed", int, None)

    question, urls = _parse_messages(data.get("messages"), limits)
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


def _optional(obj: dict, key: str, kind: type, default, where: str = ""):
    value = obj.get(key)
    if value is None:
        return default
    # bool is an int in Python; JSON true is not a count.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise APIError(
            400,
            f"`{where}{key}` must be {_type_name(kind())}, got {_type_name(value)}",
            code="invalid_type",
            param=where + key,
        )
    return value


def _number(obj: dict, key: str, low: float, high: float, open_low: bool = False) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"`{key}` must be a number, got {_type_name(value)}", code="invalid_type", param=key)
    ok = (low < value if open_low else low <= value) and value <= high  # NaN fails both
    if not ok:
        raise APIError(
            400,
            f"`{key}` must be in {'(' if open_low else '['}{low}, {high}], got {value}",
            code="invalid_value",
            param=key,
        )
    return float(value)


def _content_parts(content, where: str) -> list[tuple[str, str, str]]:
    """(kind, value, where) for each part: kind is "text" or "image", value the text or the URL."""
    if isinstance(content, str):
        return [("text", content, where)]
    if not isinstance(content, list):
        raise APIError(
            400,
            f"`{where}` must be a string or an array of content parts, got {_type_name(content)}",
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
                f"`{at}` must be an object with a string `type` ('text' or 'image_url'), got {_short(part)}",
                code="invalid_type",
                param=at,
            )
        kind = part["type"]
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(
                    400,
                    f"`{at}.text` must be a string, got {_type_name(text)}",
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
                    f"`{at}.image_url.url` must be a string (a base64 data URL), got {_type_name(url)}",
                    code="invalid_type",
                    param=at + ".image_url.url",
                )
            parts.append(("image", url, at + ".image_url.url"))
        else:
            raise APIError(
                400,
                f"`{at}.type` {_short(kind)!r} is not supported: use 'text' and 'image_url' parts",
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
                f"`{at}` must be an object with `role` and `content`, got {_type_name(m)}",
                code="invalid_type",
                param=at,
            )
        if m.get("role") not in ROLES:
            raise APIError(
                400,
                f"`{at}.role` must be one of {', '.join(ROLES)}, got {_short(m.get('role'))}",
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
    missing = [c for c in CAMERAS if c not in named]
    if missing:
        raise APIError(
            400,
            f"{len(named)} camera images given, missing {', '.join(missing)}: this model needs all "
            f"{len(CAMERAS)} views. Name each image with a text part before it (e.g. 'CAM_BACK'); unnamed "
            f"images are taken in nuScenes order ({', '.join(CAMERAS)})",
            code="missing_cameras",
            param="messages",
        )
    return " ".join(texts), {c: named[c] for c in CAMERAS}


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
            f"{_short(url)!r}. This server never fetches URLs and never reads files named in a request.",
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
            f"`{where}`: the data URL's media type must be image/*, got {_short(fields[0])!r}",
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
            f"`{where}`: not a readable {'/'.join(IMAGE_FORMATS)} image ({_short(str(e), 100)})",
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


def decode_image(raw: bytes, where: str, max_pixels: int):
    """Encoded bytes -> RGB PIL image, or APIError (truncated or corrupt data)."""
    im = _open_image(raw, where, max_pixels)
    try:
        im.load()
        return im.convert("RGB")
    except Exception as e:  # untrusted bytes, as above
        raise APIError(
            400,
            f"`{where}`: the image data is corrupt or truncated ({_short(str(e), 100)})",
            code="invalid_image",
            param=where,
        ) from None
    finally:
        im.close()


# ------------------------------------------------------------------------------------------------
# Metrics, in Prometheus text format
# ------------------------------------------------------------------------------------------------
class _Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, seconds: float) -> None:
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.counts[i] += 1
                break
        self.sum += seconds
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out, cum = [], 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{b}"}} {cum}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum:.6f}" if labels else f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.count}" if labels else f"{name}_count {self.count}")
        return out


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Request counters and latency histograms; updated from the event loop and the model thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.errors: dict[str, int] = {}
        self.stages: dict[str, _Histogram] = {s: _Histogram() for s in STAGE_METRICS}
        self.queue_wait = _Histogram()
        self.request_latency = _Histogram()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def count_error(self, code: str) -> None:
        with self._lock:
            self.errors[code] = self.errors.get(code, 0) + 1

    def observe_answer(
        self, timings_ms: dict[str, float], queue_s: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        with self._lock:
            for stage, ms in timings_ms.items():
                self.stages.setdefault(stage, _Histogram()).observe(ms / 1000.0)
            self.queue_wait.observe(queue_s)
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def observe_request(self, seconds: float) -> None:
        with self._lock:
            self.request_latency.observe(seconds)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        with self._lock:
            out = [
                "# HELP litevlm_requests_total HTTP requests answered, by endpoint and status code.",
                "# TYPE litevlm_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f'litevlm_requests_total{{endpoint="{_label(endpoint)}",status="{status}"}} {n}')
            out += [
                "# HELP litevlm_errors_total Refused or failed chat requests, by error code.",
                "# TYPE litevlm_errors_total counter",
            ]
            for code, n in sorted(self.errors.items()):
                out.append(f'litevlm_errors_total{{code="{_label(code)}"}} {n}')
            out += [
                "# HELP litevlm_stage_latency_seconds Pipeline stage wall time per answered request.",
                "# TYPE litevlm_stage_latency_seconds histogram",
            ]
            for stage, h in self.stages.items():
                out += h.lines("litevlm_stage_latency_seconds", f'stage="{_label(stage)}"')
            out += [
                "# HELP litevlm_queue_wait_seconds Time from admission until the model starts on a request.",
                "# TYPE litevlm_queue_wait_seconds histogram",
            ]
            out += self.queue_wait.lines("litevlm_queue_wait_seconds", "")
            out += [
                "# HELP litevlm_request_latency_seconds Chat request time from arrival to a finished answer.",
                "# TYPE litevlm_request_latency_seconds histogram",
            ]
            out += self.request_latency.lines("litevlm_request_latency_seconds", "")
            for name, value, help_ in (
                ("litevlm_prompt_tokens_total", self.prompt_tokens, "Prompt tokens prefilled."),
                ("litevlm_completion_tokens_total", self.completion_tokens, "Tokens generated."),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, (help_, value) in gauges.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# The model worker: one request at a time, bounded admission, deadlines
# ------------------------------------------------------------------------------------------------
@dataclass
class _Job:
    req: ChatRequest
    images: dict
    admitted: float
    abandoned: bool = False  # the client was answered 504 (or left): skip it if not started
    queue_s: float = 0.0
    service_s: float = 0.0


@dataclass
class _Worker:
    pipe: Any
    limits: Limits
    metrics: Metrics
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="litevlm-model")
    )
    pending: int = 0  # admitted and not finished; touched only on the event loop
    service_ema_s: float = 0.0

    def retry_after_s(self) -> float:
        per = self.service_ema_s or 0.1  # no answer measured yet: a guess
        return min(self.limits.timeout_s, max(0.05, per * max(1, self.pending)))

    def check_capacity(self) -> None:
        """429 with Retry-After (whole seconds, and OpenAI's retry-after-ms) when the queue is full."""
        if self.pending >= self.limits.max_queue + 1:
            wait = self.retry_after_s()
            raise APIError(
                429,
                f"the server is busy: {self.pending} requests in flight, the queue holds "
                f"{self.limits.max_queue}; retry after {wait:.2f} s",
                code="queue_full",
                headers={"Retry-After": str(math.ceil(wait)), "retry-after-ms": str(int(wait * 1000))},
            )

    async def answer(self, req: ChatRequest):
        self.check_capacity()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.timeout_s
        self.pending += 1
        submitted = False
        job = None
        try:
            images = await asyncio.wait_for(asyncio.to_thread(self._decode, req), self.limits.timeout_s)
            job = _Job(req, images, admitted=time.perf_counter())
            fut = loop.run_in_executor(self.executor, self._run, job)
            submitted = True
            fut.add_done_callback(lambda f, job=job: self._finished(f, job))
            return job, await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            if job is not None:
                job.abandoned = True
            raise APIError(
                504,
                f"no answer within the server's {self.limits.timeout_s:g} s timeout; the server is "
                "overloaded or the request is too large",
                code="timeout",
            ) from None
        except asyncio.CancelledError:
            if job is not None:
                job.abandoned = True
            raise
        finally:
            if not submitted:
                self.pending -= 1

    def _decode(self, req: ChatRequest) -> dict:
        return {cam: decode_image(raw, f"image {cam}", self.limits.max_image_pixels) for cam, raw in req.images.items()}

    def _finished(self, fut, job: _Job) -> None:
        self.pending -= 1
        if job.service_s:
            self.service_ema_s = (
                job.service_s if not self.service_ema_s else 0.8 * self.service_ema_s + 0.2 * job.service_s
            )
        if not fut.cancelled():
            fut.exception()  # an abandoned job's error is retrieved here, not logged as "never retrieved"

    def _run(self, job: _Job):
        """On the model thread. Per-request sampling settings are applied and always restored, so a
        request can change nothing another one sees."""
        if job.abandoned:
            return None
        start = time.perf_counter()
        job.queue_s = start - job.admitted
        pipe, req = self.pipe, job.req
        overrides: dict[str, Any] = {}
        if (
            req.max_tokens is not None
        ):  # above the server's --max-new-tokens it is clamped (the KV cache is sized for it)
            overrides["max_new_tokens"] = min(req.max_tokens, pipe.max_new_tokens)
        if req.temperature is not None:
            overrides["temperature"] = req.temperature
        if req.top_p is not None:
            overrides["top_p"] = req.top_p
        if req.seed is not None:  # a fresh generator: a seeded request neither reads nor moves the shared one
            import torch

            overrides["generator"] = torch.Generator(device=pipe.generator.device).manual_seed(req.seed)
        saved = {name: getattr(pipe, name) for name in overrides}
        try:
            for name, value in overrides.items():
                setattr(pipe, name, value)
            ans = pipe.answer(req.question, job.images)
        finally:
            for name, value in saved.items():
                setattr(pipe, name, value)
        job.service_s = time.perf_counter() - start
        self.metrics.observe_answer(ans.timings_ms, job.queue_s, ans.input_tokens, len(ans.tokens))
        return ans


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------
def _eos_id(pipe) -> int | None:
    tok = getattr(pipe, "tokenizer", None)
    return getattr(tok, "eos_id", None)


def _finish_reason(pipe, ans) -> str:
    return "stop" if _eos_id(pipe) in ans.tokens else "length"


def _usage(ans) -> dict:
    return {
        "prompt_tokens": ans.input_tokens,
        "completion_tokens": len(ans.tokens),
        "total_tokens": ans.input_tokens + len(ans.tokens),
    }


def _extension(ans, job: _Job) -> dict:
    ext = ans.to_dict()
    ext.pop("text", None)
    ext["queue_ms"] = round(job.queue_s * 1000, 3)
    return ext


def stream_pieces(pipe, ans) -> list[str]:
    """The answer text cut into one piece per generated token, by incremental decoding.

    A token that ends inside a multi-byte character (or adds only trailing space) yields no piece
    until a later token completes it, so the pieces always join to exactly `ans.text`."""
    tok, eos = getattr(pipe, "tokenizer", None), _eos_id(pipe)
    if tok is None:
        return [ans.text] if ans.text else []
    ids = [t for t in ans.tokens if t != eos]
    pieces, emitted = [], ""
    for i in range(1, len(ids) + 1):
        cur = tok.decode(ids[:i]).lstrip()
        if len(cur) > len(emitted) and ans.text.startswith(cur):
            pieces.append(cur[len(emitted) :])
            emitted = cur
    if len(ans.text) > len(emitted):
        pieces.append(ans.text[len(emitted) :])
    return pieces


def _completion(pipe, model_name: str, ans, job: _Job) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ans.text},
                "finish_reason": _finish_reason(pipe, ans),
                "logprobs": None,
            }
        ],
        "usage": _usage(ans),
        "litevlm": _extension(ans, job),
    }


def _sse_events(pipe, model_name: str, ans, job: _Job, include_usage: bool) -> list[str]:
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": None,
    }

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in stream_pieces(pipe, ans)]
    # OpenAI sends usage in an extra chunk with no choices when asked (stream_options.include_usage);
    # otherwise it rides on the final chunk, beside the litevlm extension.
    final = {"litevlm": _extension(ans, job)}
    if not include_usage:
        final["usage"] = _usage(ans)
    events.append(chunk({}, _finish_reason(pipe, ans), **final))
    if include_usage:
        events.append(f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(ans)}, separators=(',', ':'))}\n\n")
    events.append("data: [DONE]\n\n")
    return events


async def _read_body(request, limit: int, timeout_s: float) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise APIError(400, f"invalid Content-Length header {_short(length)!r}", code="invalid_request")
        if int(length) > limit:
            raise APIError(413, f"the request body is {int(length)} bytes; the limit is {limit}", code="body_too_large")
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout") from None
    except ClientDisconnect:  # nobody will read the answer; counted as a 400, not a server error
        raise APIError(
            400, "the client disconnected before sending the whole body", code="client_disconnected"
        ) from None
    return b"".join(chunks)


# ------------------------------------------------------------------------------------------------
# The application
# ------------------------------------------------------------------------------------------------
class _CountRequests:
    """ASGI middleware: counts every HTTP response by endpoint and status (unknown paths as 'other')."""

    def __init__(self, app, metrics: Metrics, endpoints: tuple[str, ...]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        endpoint = (
            path if path in self.endpoints else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        )
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(endpoint, status)


def build_app(
    pipe,
    *,
    model_name: str | None = None,
    max_queue: int = 16,
    timeout_s: float = 60.0,
    max_body_bytes: int = 32 * 2**20,
    max_image_pixels: int = 3200 * 1800,
    max_images: int = len(CAMERAS),
    max_prompt_chars: int = 4000,
) -> FastAPI:
    """The FastAPI app serving `pipe` (a litevlm Pipeline) under the model id `model_name` (default: pipe.name)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = Limits(
        max_queue=max_queue,
        timeout_s=timeout_s,
        max_body_bytes=max_body_bytes,
        max_image_pixels=max_image_pixels,
        max_images=max_images,
        max_prompt_chars=max_prompt_chars,
    )
    model_name = model_name or getattr(pipe, "name", None) or "litevlm"
    metrics = Metrics()
    worker = _Worker(pipe, limits, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="litevlm", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics, app.state.limits, app.state.model_name = metrics, limits, model_name
    endpoints = ("/v1/chat/completions", "/v1/models", "/health", "/metrics")
    app.add_middleware(_CountRequests, metrics=metrics, endpoints=endpoints)

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request, err: APIError):
        metrics.count_error(err.code)
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, err):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        msg = f"{request.method} {_short(request.url.path)}: {err.detail}"
        return error_response(APIError(err.status_code, msg, code=code, headers=dict(err.headers or {})))

    @app.exception_handler(Exception)
    async def on_bug(request, err):
        metrics.count_error("internal_error")
        return JSONResponse(
            {
                "error": {
                    "message": f"internal server error: {type(err).__name__}",
                    "type": "server_error",
                    "param": None,
                    "code": "internal_error",
                }
            },
            status_code=500,
        )

    # Plain Starlette routes: each handler takes the request and parses it itself.
    async def chat_completions(request):
        t0 = time.perf_counter()
        body = await _read_body(request, limits.max_body_bytes, limits.timeout_s)
        # Shed load before parsing: under overload a 429 must cost next to nothing. (Admission is
        # checked again after parsing, when the slot is taken.)
        worker.check_capacity()
        check = getattr(pipe, "check_question", None)
        req = await asyncio.to_thread(
            parse_chat_request, body, model_name=model_name, limits=limits, check_question=check
        )
        try:
            job, ans = await worker.answer(req)
        except LiteVLMError as e:  # the pipeline refused the input (e.g. an image it cannot use)
            raise APIError(400, str(e), code="invalid_request", param="messages") from None
        metrics.observe_request(time.perf_counter() - t0)
        if req.stream:
            events = _sse_events(pipe, model_name, ans, job, req.include_usage)

            async def send():
                for event in events:
                    yield event

            return StreamingResponse(send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(_completion(pipe, model_name, ans, job))

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "litevlm"}

    async def list_models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request):
        model_id = request.path_params["model_id"]
        if model_id != model_name:
            raise APIError(
                404,
                f"the model {_short(model_id)!r} does not exist; this server serves {model_name!r}",
                code="model_not_found",
                param="model",
            )
        return JSONResponse(model_card())

    async def health(request):
        return JSONResponse(
            {
                "status": "ok",
                "model": model_name,
                "in_flight": worker.pending,
                "max_queue": limits.max_queue,
                "timeout_s": limits.timeout_s,
            }
        )

    async def prometheus(request):
        gauges = {
            "litevlm_in_flight_requests": ("Admitted chat requests not yet finished.", worker.pending),
            "litevlm_queue_capacity": ("Requests that may wait besides the one being answered.", limits.max_queue),
        }
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/models", list_models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", prometheus, methods=["GET"])
    return app


# ------------------------------------------------------------------------------------------------
# Client side: building a request
# ------------------------------------------------------------------------------------------------
def image_data_url(image, fmt: str = "PNG") -> str:
    """A PIL image as a base64 data URL, the only image form the server accepts."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def user_message(question: str, images: dict) -> dict:
    """An OpenAI user message: the question, then each camera's name followed by its image.

    `images` maps camera name -> PIL image or data URL."""
    content: list[dict] = [{"type": "text", "text": question}]
    for cam, image in images.items():
        url = image if isinstance(image, str) else image_data_url(image)
        content += [{"type": "text", "text": cam}, {"type": "image_url", "image_url": {"url": url}}]
    return {"role": "user", "content": content}


# ------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------
class ServerThread:
    """A uvicorn server for `app` on a background thread, on a free 127.0.0.1 port (tests, benchmarks).

    with ServerThread(build_app(pipe)) as server:
        httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.server = self.thread = self.sock = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        import uvicorn

        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without it
        # every response waits ~40 ms for a delayed ACK (Nagle) between its header and body writes.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, self.port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_keep_alive=30)
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="litevlm-serve"
        )
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
            self.sock.close()
            self.server = None

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(pipe, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info", **app_options) -> None:
    """Serve `pipe` until interrupted; `app_options` go to `build_app`."""
    import uvicorn

    app = build_app(pipe, **app_options)
    limits = app.state.limits
    print(
        f"litevlm serve: model {app.state.model_name!r} at http://{host}:{port}/v1 "
        f"(queue {limits.max_queue}, timeout {limits.timeout_s:g} s)",
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's own flags (the pipeline's come from `litevlm.options`)."""
    d = Limits()
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 exposes the server to the network)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the model directory's name)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="requests that may wait besides the one being answered; more get 429",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds from admission to answer before a 504")
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="largest request body (MiB)")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, help="largest image, width x height")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars, help="longest question (characters)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _limits(args) -> dict:
    """The `build_app` options of parsed server flags, checked (a bad one is a `LiteVLMError`)."""
    try:
        limits = dict(
            model_name=args.model_name,
            max_queue=args.max_queue,
            timeout_s=args.timeout,
            max_body_bytes=int(args.max_body_mb * 2**20),
            max_image_pixels=args.max_image_pixels,
            max_prompt_chars=args.max_prompt_chars,
        )
        Limits(**{k: v for k, v in limits.items() if k != "model_name"})
    except ValueError as e:
        raise LiteVLMError(f"serve: {e}") from None
    return limits


def run_server(pipe, args) -> None:
    """Serve `pipe` with the parsed server flags of `args` (`add_serve_arguments`) until interrupted."""
    serve_forever(pipe, args.host, args.port, log_level=args.log_level, **_limits(args))


def add_serve_parser(subparsers, add_pipeline_options: Callable, make_pipeline: Callable) -> argparse.ArgumentParser:
    """Register `litevlm serve` on a parser's subparsers; `make_pipeline(args)` builds the pipeline."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (POST /v1/chat/completions)", description=__doc__.split("\n\n")[1]
    )
    add_serve_arguments(p)
    add_pipeline_options(p)
    p.set_defaults(func=serve_main, make_pipeline=make_pipeline)
    return p


def serve_main(args) -> None:
    _limits(args)  # checked before the model loads
    run_server(args.make_pipeline(args), args)


def main(argv: list[str] | None = None) -> int:
    """`python -m litevlm.serve [options]`: the same as `litevlm serve`."""
    import sys

    from litevlm.options import add_pipeline_options, pipeline_from_args

    p = argparse.ArgumentParser(prog="litevlm serve", description=__doc__.split("\n\n")[1])
    add_serve_arguments(p)
    add_pipeline_options(p)
    args = p.parse_args(argv)
    try:
        _limits(args)
        run_server(pipeline_from_args(args), args)
    except LiteVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
