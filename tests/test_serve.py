"""`litevlm serve` against a live server on 127.0.0.1: the official openai client, SSE, the
litevlm extension, metrics, the bounded queue (429 + Retry-After) and the per-request timeout."""

import json
import threading
import time

import pytest

# The server is the optional extra litevlm[serve]: without its packages these tests are skipped, not broken.
pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from litevlm import Pipeline  # noqa: E402
from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.pipeline import STAGES, Answer  # noqa: E402
from litevlm.serve import (  # noqa: E402
    APIError,
    Limits,
    ServerThread,
    build_app,
    image_data_url,
    parse_chat_request,
    stream_pieces,
    user_message,
)

openai = pytest.importorskip("openai")

QUESTION = "Is there a red car to the front of the ego car?"


@pytest.fixture(scope="module")
def images():
    from litevlm.data.synthetic import make_frame, render_views

    return render_views(make_frame(1, 0), size=(160, 90))


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, images):
    pipe = Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=8)
    pipe.answer(QUESTION, images)  # warm-up (a first answer may build native kernels): not within a deadline
    return pipe


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """A second instance of the same model, never touched by the server's thread."""
    return Pipeline.from_pretrained(tiny_model_dir, max_new_tokens=8)


@pytest.fixture(scope="module")
def server(pipe):
    with ServerThread(build_app(pipe, model_name="tiny", max_queue=4, timeout_s=30)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_plain_answer_with_the_openai_client(client, reference, images):
    resp = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, images)])
    ans = reference.answer(QUESTION, images)
    assert resp.object == "chat.completion" and resp.model == "tiny"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ans.text
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == ans.input_tokens
    assert resp.usage.completion_tokens == len(ans.tokens)
    assert resp.usage.total_tokens == ans.input_tokens + len(ans.tokens)


def test_views_and_timings_extension(client, images):
    resp = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, images)])
    ext = resp.model_extra["litevlm"]
    assert ext["views"] == list(CAMERAS)
    assert ext["num_visual_tokens"] > 0 and ext["input_tokens"] == resp.usage.prompt_tokens
    for stage in (*STAGES, "total"):
        assert ext["timings_ms"][stage] >= 0
    assert ext["timings_ms"]["total"] == pytest.approx(sum(ext["timings_ms"][s] for s in STAGES), abs=0.01)
    assert ext["queue_ms"] >= 0


def test_streamed_answer_equals_the_plain_one(client, reference, images):
    plain = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, images)])
    stream = client.chat.completions.create(
        model="tiny", messages=[user_message(QUESTION, images)], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert finals[0].model_extra["litevlm"]["views"] == list(CAMERAS)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    # One chunk per generated token that adds text.
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert pieces == stream_pieces(reference, reference.answer(QUESTION, images))
    assert len(pieces) > 1, plain.choices[0].message.content


def test_stream_without_include_usage_puts_usage_on_the_final_chunk(server, images):
    body = {"model": "tiny", "messages": [user_message(QUESTION, images)], "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: ") :])
    assert final["choices"][0]["finish_reason"] and final["usage"]["completion_tokens"] >= 1


def test_stream_pieces_join_to_the_text_with_multibyte_characters(reference):
    tok = reference.tokenizer
    ids = tok.encode(" é ü 日本 car") + [tok.eos_id]
    ans = Answer(text=tok.decode(ids[:-1]).strip(), views=[], num_visual_tokens=0, timings_ms={}, tokens=ids)
    pieces = stream_pieces(reference, ans)
    assert "".join(pieces) == ans.text == "é ü 日本 car"
    assert all(pieces) and "\ufffd" not in "".join(pieces)


def test_named_cameras_in_any_order_map_to_the_right_views(client, reference, images):
    order = list(reversed(CAMERAS))
    resp = client.chat.completions.create(
        model="tiny", messages=[user_message(QUESTION, {c: images[c] for c in order})]
    )
    assert resp.choices[0].message.content == reference.answer(QUESTION, images).text
    # Unnamed images take the cameras left, in nuScenes order: here swapping two of them changes the input.
    swapped = dict(images)
    swapped["CAM_FRONT"], swapped["CAM_BACK"] = images["CAM_BACK"], images["CAM_FRONT"]
    content = [{"type": "text", "text": QUESTION}] + [
        {"type": "image_url", "image_url": {"url": image_data_url(swapped[c])}} for c in CAMERAS
    ]
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
    assert resp.choices[0].message.content == reference.answer(QUESTION, swapped).text


def test_per_request_settings_do_not_leak_into_later_requests(client, reference, images):
    short = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, images)], max_tokens=2)
    assert short.usage.completion_tokens <= 2
    sampled = client.chat.completions.create(
        model="tiny", messages=[user_message(QUESTION, images)], temperature=1.0, top_p=0.9, seed=5
    )
    again = client.chat.completions.create(
        model="tiny", messages=[user_message(QUESTION, images)], temperature=1.0, top_p=0.9, seed=5
    )
    assert sampled.choices[0].message.content == again.choices[0].message.content  # seeded per request
    plain = client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, images)])
    assert plain.choices[0].message.content == reference.answer(QUESTION, images).text


def test_models_health_and_metrics(client, server, images):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[user_message(QUESTION, images)])
    assert e.value.body["code"] == "model_not_found"
    client.chat.completions.create(model="tiny", messages=[user_message(QUESTION, images)])
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = metric_samples(r.text)
    assert samples[("litevlm_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] >= 1
    assert samples[("litevlm_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "404")))] >= 1
    assert samples[("litevlm_errors_total", (("code", "model_not_found"),))] >= 1
    for stage in ("select_views", "vit", "select_tokens", "prefill", "decode", "total"):
        assert samples[("litevlm_stage_latency_seconds_count", (("stage", stage),))] >= 1
    assert samples[("litevlm_queue_wait_seconds_count", ())] >= 1
    assert samples[("litevlm_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("litevlm_in_flight_requests", ())] == 0


def metric_samples(text: str) -> dict:
    """(name, sorted labels) -> value, parsed by prometheus_client's own parser (which refuses malformed text)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_parse_refuses_with_named_problems(images):
    limits = Limits()
    ok = {"model": "m", "messages": [user_message(QUESTION, images)]}
    req = parse_chat_request(json.dumps(ok).encode(), model_name="m", limits=limits)
    assert req.question == QUESTION and list(req.images) == list(CAMERAS)
    # Fewer than six: the pipeline decides per question. Unnamed images still take the cameras in nuScenes order.
    four = {"model": "m", "messages": [user_message(QUESTION, {c: images[c] for c in CAMERAS[:4]})]}
    assert list(parse_chat_request(json.dumps(four).encode(), model_name="m", limits=limits).images) == list(
        CAMERAS[:4]
    )
    unnamed = {"model": "m", "messages": [user_message(QUESTION, {})]}
    unnamed["messages"][0]["content"] += [
        {"type": "image_url", "image_url": {"url": image_data_url(images[c])}} for c in CAMERAS[:2]
    ]
    assert list(parse_chat_request(json.dumps(unnamed).encode(), model_name="m", limits=limits).images) == list(
        CAMERAS[:2]
    )
    none = {"model": "m", "messages": [{"role": "user", "content": QUESTION}]}
    with pytest.raises(APIError) as e:
        parse_chat_request(json.dumps(none).encode(), model_name="m", limits=limits)
    assert e.value.status == 400 and e.value.code == "missing_cameras"
    with pytest.raises(ValueError, match="max_images"):
        Limits(max_images=7)


# ------------------------------------------------------------------------------------------------
# Queue and timeout, with a stub pipeline whose answers we control
# ------------------------------------------------------------------------------------------------
class StubPipe:
    """Looks like a Pipeline to the server; each answer waits until `gate` is set (or `delay_s`)."""

    name = "stub"
    max_new_tokens, temperature, top_p = 8, 0.0, 1.0

    def __init__(self, delay_s: float = 0.0):
        import torch

        self.generator = torch.Generator()
        self.gate = threading.Event()
        self.delay_s = delay_s
        self.started = 0

    def answer(self, question, images):
        self.started += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        else:
            assert self.gate.wait(10)
        return Answer(
            text=f"ok: {question}",
            views=list(CAMERAS),
            num_visual_tokens=0,
            timings_ms={s: 0.0 for s in (*STAGES, "total")},
            tokens=[1, 2],
        )


def _post(url, body, out, i):
    out[i] = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)


def _wait_for(cond, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def test_a_full_queue_answers_429_with_retry_after(images):
    stub = StubPipe()
    urls = {c: image_data_url(images[c]) for c in CAMERAS}
    body = {"model": "stub", "messages": [user_message("q", urls)]}
    with ServerThread(build_app(stub, max_queue=2, timeout_s=20)) as server:
        out = {}
        threads = [threading.Thread(target=_post, args=(server.url, body, out, i)) for i in range(3)]
        for t in threads:  # one answering, two waiting: the queue is full
            t.start()
        _wait_for(lambda: httpx.get(server.url + "/health").json()["in_flight"] == 3)
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) > 0
        assert r.json()["error"]["code"] == "queue_full" and "busy" in r.json()["error"]["message"]
        stub.gate.set()
        for t in threads:
            t.join()
        assert [out[i].status_code for i in range(3)] == [200, 200, 200]
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20).status_code == 200


def test_a_request_past_its_deadline_gets_504_and_the_server_recovers(images):
    stub = StubPipe(delay_s=0.6)
    urls = {c: image_data_url(images[c]) for c in CAMERAS}
    body = {"model": "stub", "messages": [user_message("q", urls)]}
    with ServerThread(build_app(stub, max_queue=4, timeout_s=0.3)) as server:
        out = {}
        threads = [threading.Thread(target=_post, args=(server.url, body, out, i)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [out[i].status_code for i in range(2)] == [504, 504]
        assert out[0].json()["error"]["code"] == "timeout"
        _wait_for(lambda: httpx.get(server.url + "/health").json()["in_flight"] == 0)
        assert stub.started <= 1  # the second one timed out while waiting and was never run
        stub.delay_s = 0.01
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok: q"


def test_cli_parses_serve_options_and_checks_them_before_the_model_loads():
    from litevlm.cli import build_parser
    from litevlm.errors import LiteVLMError
    from litevlm.serve import serve_main

    parser = build_parser()
    args = parser.parse_args(["serve", "--port", "0", "--max-queue", "3", "--timeout", "5", "--model", "m"])
    assert args.host == "127.0.0.1" and (args.port, args.max_queue, args.timeout, args.model) == (0, 3, 5.0, "m")
    d = Limits()
    assert (args.header_timeout, args.body_timeout, args.max_connections) == (
        d.header_timeout_s,
        d.body_timeout_s,
        d.max_connections,
    )
    for flag, message in (("--max-queue", "max_queue"), ("--header-timeout", "header_timeout_s")):
        bad = parser.parse_args(["serve", flag, "-1"])
        bad.make_pipeline = lambda a: pytest.fail("the limits are checked before the model loads")
        with pytest.raises(LiteVLMError, match=message):
            serve_main(bad)
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--header-timeout", "--body-timeout", "--max-connections"):
        assert flag in help_text
    assert "(default: 10.0)" in help_text and "(default: 256)" in help_text


def test_ray_flags_without_replicas_are_refused_before_the_model_loads():
    from litevlm.cli import build_parser
    from litevlm.errors import LiteVLMError
    from litevlm.serve import serve_main

    parser = build_parser()
    for flags, message in (
        (["--ray-address", "auto"], "--ray-address only with --replicas N > 1"),
        (["--cpus-per-replica", "2"], "--cpus-per-replica only with"),
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "2", "--cpus-per-replica", "0"], "--cpus-per-replica must be > 0"),
    ):
        bad = parser.parse_args(["serve", *flags])
        bad.make_pipeline = lambda a: pytest.fail("the flags are checked before the model loads")
        with pytest.raises(LiteVLMError, match=message):
            serve_main(bad)
