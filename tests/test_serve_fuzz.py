"""Hostile and malformed requests against a live loopback server: each one a 4xx with an
OpenAI-style error body (or, where the HTTP framing itself is broken or never finished, a 4xx or a
closed connection within the server's timeouts), no URL fetched, no file read, and the server
healthy and answering correctly afterwards."""

import base64
import io
import json
import socket
import struct
import zlib

import pytest

# The server is the optional extra litevlm[serve]: without its packages these tests are skipped, not broken.
pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from test_serve import metric_samples  # noqa: E402

from litevlm import Pipeline  # noqa: E402
from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.serve import ServerThread, build_app, image_data_url, user_message  # noqa: E402

QUESTION = "Is there a red car to the front of the ego car?"
MAX_BODY = 1_000_000
MAX_PIXELS = 400_000
MAX_CONNECTIONS = 64


def png_header(width: int, height: int) -> bytes:
    """A PNG claiming width x height whose data is one tiny IDAT: a decompression-bomb shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def b64url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):
    from litevlm.data.synthetic import make_frame, render_views

    images = render_views(make_frame(3, 0), size=(160, 90))
    urls = {c: image_data_url(images[c]) for c in CAMERAS}
    pipe = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=8)
    expected = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=8).answer(QUESTION, images).text
    # A real image on disk and a listening socket: the server must touch neither.
    path = tmp_path_factory.mktemp("files") / "CAM_FRONT.png"
    images["CAM_FRONT"].save(path)
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    app = build_app(
        pipe,
        model_name="tiny",
        max_queue=4,
        timeout_s=30,
        max_body_bytes=MAX_BODY,
        max_image_pixels=MAX_PIXELS,
        max_prompt_chars=2000,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        max_connections=MAX_CONNECTIONS,
    )
    with ServerThread(app) as server:
        yield dict(server=server, urls=urls, expected=expected, path=path, trap=trap, png=images["CAM_BACK"])
    trap.close()


def hostile_requests(w) -> list[tuple[str, dict, str | None]]:
    """(name, httpx request kwargs, expected error code or None for any 4xx)."""
    urls, trap_port = w["urls"], w["trap"].getsockname()[1]
    png = base64.b64decode(urls["CAM_BACK"].split(",", 1)[1])

    def raw(data: bytes) -> dict:
        return {"content": data, "headers": {"content-type": "application/json"}}

    def chat(messages=None, **extra):
        body = {"model": "tiny", "messages": messages if messages is not None else [user_message(QUESTION, urls)]}
        body.update(extra)
        return raw(json.dumps(body).encode())  # ASCII escapes: lone surrogates travel as \ud800

    def with_image(cam: str, url) -> dict:
        return chat([user_message(QUESTION, {**urls, cam: url})])

    def parts(*content) -> dict:
        return chat([{"role": "user", "content": list(content)}])

    img = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    six = [img(urls[c]) for c in CAMERAS]
    tiff = io.BytesIO()
    w["png"].save(tiff, format="TIFF")
    cases = [
        # -- the body: not JSON, not an object, bombs
        ("empty body", raw(b""), "invalid_json"),
        ("not json", raw(b"hello"), "invalid_json"),
        ("truncated json", raw(b'{"model": "tiny", "messages": [{"role": "user", "content": "hi'), "invalid_json"),
        ("json array", raw(b"[]"), "invalid_request"),
        ("json string", raw(b'"chat"'), "invalid_request"),
        ("json null", raw(b"null"), "invalid_request"),
        ("json number", raw(b"42"), "invalid_request"),
        ("invalid utf-8", raw(b'{"model": "\xff\xfe"}'), "invalid_json"),
        ("nesting bomb", raw(b"[" * 200_000 + b"]" * 200_000), "invalid_json"),
        ("5000-digit integer", raw(b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}"), "invalid_json"),
        ("NaN temperature", chat(temperature=float("nan")), "invalid_value"),
        ("body over the limit", raw(b"x" * (MAX_BODY + 10)), "body_too_large"),
        (
            "chunked body over the limit",
            {"content": iter([b"[" * 100_000] * 11), "headers": {"content-type": "application/json"}},
            "body_too_large",
        ),
        # -- model
        ("no model", raw(json.dumps({"messages": [user_message(QUESTION, urls)]}).encode()), "invalid_type"),
        ("model is a number", chat(model=7), "invalid_type"),
        ("model is a list", chat(model=["tiny"]), "invalid_type"),
        ("unknown model", chat(model="gpt-4o"), "model_not_found"),
        # -- messages
        ("no messages", {"json": {"model": "tiny"}}, "invalid_type"),
        ("messages is an object", chat(messages={"role": "user"}), "invalid_type"),
        ("messages is empty", chat(messages=[]), "invalid_type"),
        ("messages is a string", chat(messages="hi"), "invalid_type"),
        ("messages are numbers", chat(messages=[1, 2, 3]), "invalid_type"),
        ("message without role", chat(messages=[{"content": "hi"}]), "invalid_value"),
        ("unknown role", chat(messages=[{"role": "robot", "content": "hi"}]), "invalid_value"),
        (
            "last message is the assistant's",
            chat(messages=[user_message(QUESTION, urls), {"role": "assistant", "content": "x"}]),
            "invalid_value",
        ),
        ("content is a number", chat(messages=[{"role": "user", "content": 5}]), "invalid_type"),
        ("content is an object", chat(messages=[{"role": "user", "content": {"text": "hi"}}]), "invalid_type"),
        ("content is null", chat(messages=[{"role": "user", "content": None}]), "invalid_type"),
        ("content parts are strings", chat(messages=[{"role": "user", "content": ["hi", "there"]}]), "invalid_type"),
        ("part without type", parts({"text": "hi"}), "invalid_type"),
        (
            "audio part",
            parts(text(QUESTION), {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
            "unsupported_content",
        ),
        ("type is a number", parts({"type": 123}), "invalid_type"),
        ("text is a number", parts({"type": "text", "text": 5}), "invalid_type"),
        ("image_url is null", parts(text(QUESTION), {"type": "image_url", "image_url": None}), "invalid_type"),
        ("url is a number", parts(text(QUESTION), {"type": "image_url", "image_url": {"url": 123}}), "invalid_type"),
        (
            "nested garbage url",
            parts(text(QUESTION), {"type": "image_url", "image_url": {"url": {"a": [[[{"b": None}]]]}}}),
            "invalid_type",
        ),
        (
            "deeply nested content",
            chat(messages=[{"role": "user", "content": json.loads("[" * 500 + "]" * 500)}]),
            "invalid_type",
        ),
        (
            "image in an earlier message",
            chat(messages=[user_message("x", urls), user_message(QUESTION, urls)]),
            "invalid_value",
        ),
        ("too many parts", parts(*[text("a")] * 100), "invalid_value"),
        (
            "too many messages",
            chat(messages=[{"role": "system", "content": "x"}] * 100 + [user_message(QUESTION, urls)]),
            "invalid_value",
        ),
        # -- images that are not data URLs: never fetched, never read
        ("http url", with_image("CAM_FRONT", f"http://127.0.0.1:{trap_port}/front.png"), "image_url_not_allowed"),
        ("https url", with_image("CAM_FRONT", "https://example.com/front.jpg"), "image_url_not_allowed"),
        ("ftp url", with_image("CAM_FRONT", "ftp://example.com/front.jpg"), "image_url_not_allowed"),
        ("file url", with_image("CAM_FRONT", f"file://{w['path']}"), "image_url_not_allowed"),
        ("absolute path", with_image("CAM_FRONT", str(w["path"])), "image_url_not_allowed"),
        ("etc passwd", with_image("CAM_FRONT", "/etc/passwd"), "image_url_not_allowed"),
        ("relative path", with_image("CAM_FRONT", "images/../CAM_FRONT.png"), "image_url_not_allowed"),
        ("windows path", with_image("CAM_FRONT", "C:\\images\\front.png"), "image_url_not_allowed"),
        (
            "bare image_url string",
            parts(text(QUESTION), {"type": "image_url", "image_url": str(w["path"])}, *six[1:]),
            "image_url_not_allowed",
        ),
        # -- data URLs that are not good images
        ("data url not base64", with_image("CAM_FRONT", "data:image/png,abc"), "invalid_image"),
        ("data url without comma", with_image("CAM_FRONT", "data:image/png;base64"), "invalid_image"),
        ("data url of text", with_image("CAM_FRONT", b64url(b"hello", "text/plain")), "invalid_image"),
        ("truncated base64", with_image("CAM_FRONT", urls["CAM_FRONT"][:-3]), "invalid_image"),
        ("base64 with junk", with_image("CAM_FRONT", "data:image/png;base64,!!!!$$$$"), "invalid_image"),
        ("empty image", with_image("CAM_FRONT", "data:image/png;base64,"), "invalid_image"),
        ("random bytes", with_image("CAM_FRONT", b64url(bytes(range(256)) * 8)), "invalid_image"),
        ("truncated png", with_image("CAM_FRONT", b64url(png[: len(png) // 2])), "invalid_image"),
        ("png header only", with_image("CAM_FRONT", b64url(png[:33])), "invalid_image"),
        (
            "svg",
            with_image("CAM_FRONT", b64url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")),
            "invalid_image",
        ),
        ("tiff is not accepted", with_image("CAM_FRONT", b64url(tiff.getvalue(), "image/tiff")), "invalid_image"),
        ("huge dimensions", with_image("CAM_FRONT", b64url(png_header(30000, 30000))), "image_too_large"),
        ("bomb dimensions", with_image("CAM_FRONT", b64url(png_header(200_000, 200_000))), "image_too_large"),
        ("over the pixel limit", with_image("CAM_FRONT", b64url(png_header(1000, 1000))), "image_too_large"),
        ("zero width", with_image("CAM_FRONT", b64url(png_header(0, 10))), None),
        # -- cameras
        ("unknown camera", parts(text(QUESTION), text("CAM_TOP"), *six), "unknown_camera"),
        ("label without image", parts(text(QUESTION), *six[:5], text("CAM_BACK_RIGHT")), "invalid_value"),
        ("label then text", parts(text("CAM_FRONT"), text(QUESTION), *six), "invalid_value"),
        (
            "duplicate camera",
            parts(text(QUESTION), text("CAM_BACK"), six[0], text("CAM_BACK"), six[1], *six[2:]),
            "duplicate_camera",
        ),
        ("three images", parts(text(QUESTION), *six[:3]), "missing_cameras"),
        ("no images", chat(messages=[{"role": "user", "content": QUESTION}]), "missing_cameras"),
        ("seven images", parts(text(QUESTION), *six, six[0]), "too_many_images"),
        ("forty images", parts(text(QUESTION), *(six * 6), *six[:4]), "too_many_images"),
        # -- the question
        ("question too long", parts(text("why " * 600), *six), "prompt_too_long"),
        ("question over the token limit", parts(text("1 " * 900), *six), "invalid_prompt"),
        ("no question", parts(*six), "invalid_prompt"),
        ("blank question", parts(text("   \n "), *six), "invalid_prompt"),
        # -- parameters
        ("stream is a string", chat(stream="yes"), "invalid_type"),
        ("stream_options is a string", chat(stream=True, stream_options="x"), "invalid_type"),
        ("max_tokens zero", chat(max_tokens=0), "invalid_value"),
        ("max_tokens negative", chat(max_completion_tokens=-5), "invalid_value"),
        ("max_tokens string", chat(max_tokens="8"), "invalid_type"),
        ("max_tokens boolean", chat(max_tokens=True), "invalid_type"),
        ("temperature too high", chat(temperature=5), "invalid_value"),
        ("temperature string", chat(temperature="hot"), "invalid_type"),
        ("top_p zero", chat(top_p=0), "invalid_value"),
        ("n = 2", chat(n=2), "invalid_value"),
        ("seed float", chat(seed=1.5), "invalid_type"),
        ("tools", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "unsupported_parameter"),
        ("stop sequences", chat(stop=["\n"]), "unsupported_parameter"),
        ("json mode", chat(response_format={"type": "json_object"}), "unsupported_parameter"),
        ("logprobs", chat(logprobs=True), "unsupported_parameter"),
        # -- numbers out of every range the pipeline takes
        ("seed above 2^64-1", chat(seed=2**64), "invalid_value"),
        ("seed below -2^63", chat(seed=-(2**63) - 1), "invalid_value"),
        ("seed of 100 digits", chat(seed=10**100), "invalid_value"),
        ("seed string", chat(seed="5"), "invalid_type"),
        ("seed boolean", chat(seed=True), "invalid_type"),
        ("temperature negative", chat(temperature=-0.1), "invalid_value"),
        ("temperature Infinity", raw(b'{"model": "tiny", "messages": [], "temperature": Infinity}'), "invalid_value"),
        ("temperature -Infinity", raw(b'{"model": "tiny", "messages": [], "temperature": -Infinity}'), "invalid_value"),
        ("top_p NaN", raw(b'{"model": "tiny", "messages": [], "top_p": NaN}'), "invalid_value"),
        ("top_p above 1", chat(top_p=1.5), "invalid_value"),
        ("top_p negative", chat(top_p=-0.5), "invalid_value"),
        ("top_p 1e400", raw(b'{"model": "tiny", "messages": [], "top_p": 1e400}'), "invalid_value"),
        ("n zero", chat(n=0), "invalid_value"),
        ("n string", chat(n="1"), "invalid_type"),
        ("max_tokens float", chat(max_tokens=8.5), "invalid_type"),
        ("max_tokens 1e3", raw(b'{"model": "tiny", "messages": [], "max_tokens": 1e3}'), "invalid_type"),
        ("max_completion_tokens zero", chat(max_completion_tokens=0), "invalid_value"),
        ("max_tokens -2^63", chat(max_tokens=-(2**63)), "invalid_value"),
        ("stream number", chat(stream=1), "invalid_type"),
        ("stream_options list", chat(stream=True, stream_options=[1]), "invalid_type"),
        ("include_usage string", chat(stream=True, stream_options={"include_usage": "yes"}), "invalid_type"),
        ("user is a number", chat(user=5), "invalid_type"),
        # -- parameters the pipeline cannot honour
        ("logit_bias", chat(logit_bias={"42": 100}), "unsupported_parameter"),
        ("presence_penalty", chat(presence_penalty=1.0), "unsupported_parameter"),
        ("frequency_penalty", chat(frequency_penalty=-2), "unsupported_parameter"),
        ("top_logprobs", chat(top_logprobs=5), "unsupported_parameter"),
        ("audio output", chat(audio={"voice": "alloy", "format": "wav"}), "unsupported_parameter"),
        ("prediction", chat(prediction={"type": "content", "content": "x"}), "unsupported_parameter"),
        ("functions", chat(functions=[{"name": "f"}]), "unsupported_parameter"),
        ("function_call", chat(function_call="auto"), "unsupported_parameter"),
        ("tool_choice", chat(tool_choice="required"), "unsupported_parameter"),
        ("audio modality", chat(modalities=["text", "audio"]), "unsupported_parameter"),
        ("web search", chat(web_search_options={"search_context_size": "low"}), "unsupported_parameter"),
        ("stop string", chat(stop="."), "unsupported_parameter"),
        ("json schema", chat(response_format={"type": "json_schema", "json_schema": {}}), "unsupported_parameter"),
        ("response_format string", chat(response_format="json"), "unsupported_parameter"),
        # -- lone surrogates anywhere a JSON string can be
        ("surrogate role", chat(messages=[{"role": "\ud800", "content": QUESTION}]), "invalid_unicode"),
        ("surrogate content string", chat(messages=[{"role": "user", "content": "\ud800"}]), "invalid_unicode"),
        ("surrogate question", parts(text(QUESTION + "\udc00"), *six), "invalid_unicode"),
        ("surrogate camera label", parts(text(QUESTION), text("CAM_BACK\udbff"), *six), "invalid_unicode"),
        ("surrogate model", chat(model="tiny\ud800"), "invalid_unicode"),
        ("surrogate key", chat(**{"\ud800": 1}), "invalid_unicode"),
        ("surrogate image url", with_image("CAM_FRONT", "data:image/png;base64,\ud800"), "invalid_unicode"),
        ("surrogate system message", chat(messages=[{"role": "system", "content": "\udfff"}]), "invalid_unicode"),
        ("surrogate part type", parts({"type": "te\udc80xt", "text": QUESTION}), "invalid_unicode"),
        ("surrogate pair halves reversed", parts(text("\udc00\ud800 car?"), *six), "invalid_unicode"),
        # -- bodies that are not JSON text
        ("utf-8 BOM", raw(b"\xef\xbb\xbf" + chat()["content"]), "invalid_json"),
        ("utf-16 body", raw(json.dumps({"model": "tiny"}).encode("utf-16")), "invalid_json"),
        ("nul bytes", raw(b"\0" * 64), "invalid_json"),
        ("only whitespace", raw(b" \n\t " * 100), "invalid_json"),
        ("two json objects", raw(b'{"model": "tiny"}{"model": "tiny"}'), "invalid_json"),
        ("single quotes", raw(b"{'model': 'tiny'}"), "invalid_json"),
        ("trailing comma", raw(b'{"model": "tiny",}'), "invalid_json"),
        ("deep object nesting", raw(b'{"a":' * 100_000 + b"1" + b"}" * 100_000), "invalid_json"),
        # -- bodies not declared as JSON
        (
            "text/plain",
            {"content": chat()["content"], "headers": {"content-type": "text/plain"}},
            "unsupported_media_type",
        ),
        ("no content-type", {"content": chat()["content"]}, "unsupported_media_type"),
        ("form body", {"data": {"model": "tiny"}}, "unsupported_media_type"),
        ("multipart body", {"files": {"f": b"{}"}}, "unsupported_media_type"),
        (
            "json-ish type",
            {"content": b"{}", "headers": {"content-type": "application/jsonx"}},
            "unsupported_media_type",
        ),
        ("gzip over plain bytes", raw_with(b"{}", {"content-encoding": "gzip"}), "unsupported_media_type"),
        ("deflate", raw_with(b"{}", {"content-encoding": "deflate"}), "unsupported_media_type"),
        ("brotli", raw_with(b"{}", {"content-encoding": "br"}), "unsupported_media_type"),
        ("two encodings", raw_with(b"{}", {"content-encoding": "gzip, identity"}), "unsupported_media_type"),
        (
            "content-type with junk",
            {"content": b"{}", "headers": {"content-type": "\x7f/\x7f"}},
            "unsupported_media_type",
        ),
    ]
    return cases


def raw_with(data: bytes, headers: dict) -> dict:
    return {"content": data, "headers": {"content-type": "application/json", **headers}}


def test_hostile_requests_are_refused_cleanly_and_the_server_survives(world):
    server, cases = world["server"], hostile_requests(world)
    assert len(cases) >= 50
    failures = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, kwargs, code in cases:
            r = http.post("/v1/chat/completions", **kwargs)
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            ok = 400 <= r.status_code < 500 and isinstance(err.get("message"), str) and err.get("code")
            if not ok or (code is not None and err.get("code") != code):
                failures.append(f"{name}: {r.status_code} {r.text[:200]}")
        # Wrong methods and paths, a path traversal attempt: 4xx with an OpenAI-style body too.
        for method, path, status in (
            ("GET", "/v1/chat/completions", 405),
            ("POST", "/v1/completions", 404),
            ("GET", "/v1/models/nope", 404),
            ("GET", "/static/..%2f..%2fetc%2fpasswd", 404),
            ("DELETE", "/health", 405),
        ):
            r = http.request(method, path)
            if r.status_code != status or "message" not in r.json().get("error", {}):
                failures.append(f"{method} {path}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    with pytest.raises(BlockingIOError):
        world["trap"].accept()  # nobody connected to the URL we sent

    # Healthy, and answering correctly afterwards.
    assert httpx.get(server.url + "/health").json() == {
        "status": "ok",
        "model": "tiny",
        "in_flight": 0,
        "max_queue": 4,
        "timeout_s": 30,
    }
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, world["urls"])])
    assert resp.choices[0].message.content == world["expected"]
    samples = metric_samples(httpx.get(server.url + "/metrics").text)
    assert not [k for k in samples if k[0] == "litevlm_requests_total" and dict(k[1])["status"].startswith("5")]
    assert samples[("litevlm_errors_total", (("code", "image_url_not_allowed"),))] == 9


def test_error_bodies_name_the_problem(world):
    server, urls = world["server"], world["urls"]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [user_message(QUESTION, {**urls, "CAM_BACK": "/etc/passwd"})]},
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error"
    assert "data URL" in err["message"] and "file path" in err["message"] and "/etc/passwd" in err["message"]
    assert err["param"].startswith("messages[0].content[")
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": "tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        *[{"type": "image_url", "image_url": {"url": urls[c]}} for c in CAMERAS[:2]],
                    ],
                }
            ],
        },
    )
    assert (
        r.status_code == 400
        and "missing CAM_FRONT_RIGHT, CAM_BACK, CAM_BACK_LEFT, CAM_BACK_RIGHT" in r.json()["error"]["message"]
    )


def framing_cases() -> list[tuple[str, bytes]]:
    """(name, bytes sent on a fresh connection): HTTP framing broken or never finished."""
    good = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return [
        ("nothing at all", b""),
        ("half a request line", b"POST /v1/chat/compl"),
        ("partial headers", good + b"Content-Le"),
        ("headers without the blank line", good + b"Content-Length: 2\r\n"),
        ("slow body", good + b'Content-Length: 100\r\n\r\n{"model": '),
        ("body shorter than its length", good + b"Content-Length: 5000\r\n\r\n{}"),
        ("slow chunked body", good + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\n'),
        ("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello\r\n\r\n"),
        ("no HTTP version", b"GET /health\r\n\r\n"),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("header without colon", b"GET /health HTTP/1.1\r\nHost: x\r\nbroken header\r\n\r\n"),
        ("NUL in a header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"),
        ("no Host header", b"GET /health HTTP/1.1\r\n\r\n"),
        ("two Content-Lengths", good + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"),
        ("negative Content-Length", good + b"Content-Length: -1\r\n\r\n{}"),
        ("non-numeric Content-Length", good + b"Content-Length: ten\r\n\r\n{}"),
        ("Content-Length and chunked", good + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}"),
        ("bad chunk size", good + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
        ("unknown transfer coding", good + b"Transfer-Encoding: gzip\r\n\r\n{}"),
        ("unfinished headers over 64 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000),
        ("100-continue over the body limit", good + b"Expect: 100-continue\r\nContent-Length: 99999999\r\n\r\n"),
        (
            "absolute-form target to another host",
            b"GET http://evil.example/v1/models/ HTTP/1.1\r\nHost: evil.example\r\n\r\n",
        ),
    ]


def read_until_closed(s: socket.socket, timeout_s: float) -> bytes:
    s.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return data
        if not chunk:
            return data
        data += chunk


def test_broken_framing_slow_clients_and_floods_are_bounded(world):
    """Each framing case, all at once: a 4xx or a closed connection within the header/body timeouts
    (a test failure, not a hang, past 20 s); 400 idle connections beyond the cap closed on accept; then
    the server answers as before."""
    server = world["server"]
    cases = framing_cases()
    socks = []
    for _, data in cases:
        s = socket.create_connection((server.host, server.port))
        s.sendall(data)
        socks.append(s)
    flood = [socket.create_connection((server.host, server.port)) for _ in range(400)]
    failures = []
    try:
        for (name, _), s in zip(cases, socks):
            reply = read_until_closed(s, 20)
            if reply and not reply.startswith(b"HTTP/1.1 4"):
                failures.append(f"{name}: {reply[:200]!r}")
        flooded = [read_until_closed(s, 20) for s in flood]
    finally:
        for s in socks + flood:
            s.close()
    assert not failures, "\n".join(failures)
    assert all(r == b"" or r.startswith(b"HTTP/1.1 408 ") for r in flooded)
    assert sum(r == b"" for r in flooded) >= len(flood) - MAX_CONNECTIONS  # closed on accept
    assert len(cases) + len(hostile_requests(world)) >= 150
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, world["urls"])])
    assert resp.choices[0].message.content == world["expected"]
    assert httpx.get(server.url + "/health").json()["in_flight"] == 0
