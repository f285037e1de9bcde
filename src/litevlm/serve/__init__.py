"""`litevlm serve`: an OpenAI-compatible HTTP server for the pipeline.

`POST /v1/chat/completions` takes a user message of text and `image_url` parts. Images must be
base64 data URLs: the server never fetches a URL and never opens a file named in a request. Each
image's camera is named by a text part just before it ("CAM_BACK"); unnamed images take the
cameras not named, in nuScenes order. A camera may be left out, or its image be unreadable: only the
questions that need its view are refused (400 naming the camera). The pipeline keeps encoded views in a
content-keyed cache (`--view-cache-mb`), so a frame sent again is neither decoded nor encoded again.
The answer carries OpenAI `usage` plus a `litevlm` extension field: the views used, visual and prompt
token counts, per-stage milliseconds and the view cache's hits. `GET /v1/models`,
`GET /health` and `GET /metrics` (Prometheus) complete the set.

One model instance answers one request at a time on a single worker thread. Admitted requests wait
in a bounded queue as the bytes they came with (429 with Retry-After when it is full) and each has
a deadline (504). A streamed answer's text is sent as the pipeline makes it. A request whose client
has gone, or whose deadline has passed, is dropped where it stands. Every refusal is a 4xx with an
OpenAI-style error body naming the problem.

Modules: protocol (the wire format as pydantic models), limits, parse (request validation), worker
(the model thread and its queue), chat (the chat-completions route), metrics, app (the FastAPI app),
server (uvicorn with connection bounds), cli (the command's flags), replicas (`--replicas N`: the app as
Ray Serve replicas). FastAPI, uvicorn, pydantic and
prometheus_client are imported only when a server is built, so `litevlm --help` works without them
(`pip install litevlm[serve]`).
"""

from __future__ import annotations

import base64
import io
from importlib import import_module

from litevlm.serve.cli import add_serve_arguments, run_server, serve_main

# Names re-exported lazily from the modules that need the server's extra dependencies.
_LAZY = {
    "APIError": "protocol",
    "Limits": "limits",
    "ChatRequest": "parse",
    "parse_chat_request": "parse",
    "Metrics": "metrics",
    "Worker": "worker",
    "stream_pieces": "worker",
    "build_app": "app",
    "ServerThread": "server",
}

__all__ = [
    *_LAZY,
    "add_serve_arguments",
    "add_serve_parser",
    "image_data_url",
    "run_server",
    "serve_main",
    "user_message",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"litevlm.serve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'litevlm.serve' has no attribute {name!r}")


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
