"""The OpenAI chat-completions wire format as pydantic models, and the server's error type.

Fields follow the order of the OpenAI API reference. Request models are strict (JSON `true` is not a
count, `"8"` is not a number, NaN is not a temperature); a validation failure becomes one APIError
naming the field. Parameters the pipeline cannot honour are declared so they can be refused by name
rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The range torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
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

    def json_bytes(self) -> bytes:
        """The body as JSON bytes. ASCII escapes keep it valid whatever the message quotes (a lone
        surrogate from the request cannot be encoded as UTF-8, but `\\ud800` is valid JSON)."""
        return json.dumps(self.body(), ensure_ascii=True, separators=(",", ":")).encode("ascii")


def short(value: Any, n: int = 60) -> str:
    s = value if isinstance(value, str) else repr(value)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions. `messages` is checked further by the parser (cameras, images)."""

    messages: list[Any]
    model: str
    audio: Any = None
    frequency_penalty: Any = None
    function_call: Any = None
    functions: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    modalities: Any = None
    n: int | None = 1
    prediction: Any = None
    presence_penalty: Any = None
    response_format: Any = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    tool_choice: Any = None
    tools: Any = None
    top_logprobs: Any = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    web_search_options: Any = None


# Parameters this pipeline cannot honour: refused unless absent or their neutral value (which asks
# for nothing the pipeline does not do).
UNSUPPORTED = (
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "prediction",
    "presence_penalty",
    "stop",
    "tool_choice",
    "tools",
    "top_logprobs",
    "web_search_options",
)
# Pydantic error types that mean "the right type, a wrong value".
_VALUE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def validate_request(data: dict) -> ChatCompletionRequest:
    """The request model, or APIError(400) naming the first bad field; unsupported parameters refused."""
    try:
        req = ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"`{where}` is required", code="invalid_type", param=where) from None
        code = "invalid_value" if err["type"] in _VALUE_ERRORS else "invalid_type"
        got = type_name(err["input"]) if code == "invalid_type" else short(err["input"])
        raise APIError(400, f"`{where}`: {err['msg']}, got {got}", code=code, param=where) from None
    refused = [k for k in UNSUPPORTED if not _neutral(getattr(req, k))]
    if refused:
        raise APIError(
            400,
            f"not supported by this server: {', '.join(f'`{k}`' for k in refused)} (send them unset)",
            code="unsupported_parameter",
            param=refused[0],
        )
    fmt = req.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(
            400,
            "`response_format` must be {'type': 'text'}: structured output is not supported",
            code="unsupported_parameter",
            param="response_format",
        )
    if req.modalities not in (None, ["text"]):
        raise APIError(
            400,
            "`modalities` must be ['text']: this server answers in text only",
            code="unsupported_parameter",
            param="modalities",
        )
    if req.n not in (None, 1):
        raise APIError(400, f"`n` must be 1: one answer per request, got {req.n}", code="invalid_value", param="n")
    return req


def _neutral(value) -> bool:
    """null, false, zero, or empty: a value that asks for nothing."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, (str, list, dict)) and not value


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(_Out):
    index: int = 0
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None
    litevlm: dict | None = None  # views, token counts, per-stage milliseconds


class DeltaMessage(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class StreamChoice(_Out):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionStreamResponse(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[StreamChoice]
    system_fingerprint: None = None
    usage: Usage | None = None
    litevlm: dict | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "litevlm"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
