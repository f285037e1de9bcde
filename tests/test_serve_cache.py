"""`litevlm serve` with the pipeline's view cache and cameras that fail: a frame sent again is served from the
cache (hits in the answer and in /metrics, nothing decoded again), and a missing or unreadable image fails only
the questions that need its view, with a 400 naming the camera."""

import argparse
import base64
import io

import pytest

pytest.importorskip("fastapi", reason="pip install 'litevlm[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'litevlm[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'litevlm[serve]'")
httpx = pytest.importorskip("httpx", reason="pip install 'litevlm[serve]'")

from test_serve import metric_samples  # noqa: E402

from litevlm import Pipeline  # noqa: E402
from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.frame import ViewCache  # noqa: E402
from litevlm.serve import ServerThread, add_serve_arguments, build_app, image_data_url, user_message  # noqa: E402
from litevlm.serve.cli import app_options  # noqa: E402

# What the lexical ViewSelector of `full_model_dir` picks for each (checked in test_questions_select_the_views).
FRONT = "Is there a red car to the front of the ego car?"  # CAM_FRONT
BACK = "What is behind the ego car?"  # CAM_BACK
SCENE = "What are the important objects in the current scene?"  # all six


def frame_urls(seed: int) -> dict:
    """A synthetic frame's six views as PNG data URLs (the same bytes each time a test sends them)."""
    from litevlm.data.synthetic import make_frame, render_views

    return {c: image_data_url(im) for c, im in render_views(make_frame(seed, 0), size=(160, 90)).items()}


@pytest.fixture(scope="module")
def pipe(full_model_dir):
    pipe = Pipeline.from_pretrained(full_model_dir, max_new_tokens=4, select_views=True)
    pipe.answer(FRONT, {c: image_data_url_bytes(u) for c, u in frame_urls(99).items()})  # warm-up
    return pipe


@pytest.fixture(scope="module")
def server(pipe):
    with ServerThread(build_app(pipe, model_name="tiny", timeout_s=30, view_cache_bytes=64 << 20)) as s:
        yield s


def image_data_url_bytes(url: str) -> bytes:
    return base64.b64decode(url.partition(",")[2])


def ask(server, question: str, urls: dict, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [user_message(question, urls)], **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def cache_metrics(server) -> dict:
    s = metric_samples(httpx.get(server.url + "/metrics").text)
    counters = {k: s[(f"litevlm_view_cache_{k}_total", ())] for k in ("hits", "misses", "evictions")}
    gauges = {k: s[(f"litevlm_view_cache_{k}", ())] for k in ("bytes", "max_bytes", "entries")}
    return {**counters, **gauges, "encoded": s[("litevlm_views_encoded_total", ())]}


def test_questions_select_the_views(pipe):
    assert pipe.select_views(FRONT) == ["CAM_FRONT"] and pipe.select_views(BACK) == ["CAM_BACK"]
    assert pipe.select_views(SCENE) == list(CAMERAS)


def test_the_same_frame_again_is_served_from_the_cache(server, pipe):
    urls = frame_urls(1)
    before = cache_metrics(server)
    first = ask(server, SCENE, urls)
    assert first.status_code == 200, first.text
    assert first.json()["litevlm"]["cache"] == {"encoded": 6, "reused": 0, "hits": 0, "misses": 6}
    mid = cache_metrics(server)
    assert mid["misses"] - before["misses"] == 6 and mid["encoded"] - before["encoded"] == 6
    assert mid["bytes"] > before["bytes"] and mid["max_bytes"] == 64 << 20

    second = ask(server, FRONT, urls)  # another question about the same frame: its view is a hit, not decoded
    assert second.status_code == 200, second.text
    assert second.json()["litevlm"]["cache"] == {"encoded": 0, "reused": 0, "hits": 1, "misses": 0}
    after = cache_metrics(server)
    assert after["hits"] - mid["hits"] == 1 and after["encoded"] == mid["encoded"] and after["misses"] == mid["misses"]


def test_one_changed_pixel_is_a_miss(server):
    from PIL import Image

    urls = frame_urls(2)
    assert ask(server, FRONT, urls).status_code == 200
    assert ask(server, FRONT, urls).json()["litevlm"]["cache"] == {"encoded": 0, "reused": 0, "hits": 1, "misses": 0}
    im = Image.open(io.BytesIO(image_data_url_bytes(urls["CAM_FRONT"]))).convert("RGB")
    im.putpixel((0, 0), tuple(255 - v for v in im.getpixel((0, 0))))
    changed = {**urls, "CAM_FRONT": image_data_url(im)}
    before = cache_metrics(server)
    r = ask(server, FRONT, changed)
    assert r.status_code == 200 and r.json()["litevlm"]["cache"] == {"encoded": 1, "reused": 0, "hits": 0, "misses": 1}
    assert cache_metrics(server)["misses"] - before["misses"] == 1


def test_a_missing_camera_fails_only_the_questions_that_need_it(server):
    five = {c: u for c, u in frame_urls(3).items() if c != "CAM_BACK"}
    ok = ask(server, FRONT, five)
    assert ok.status_code == 200 and ok.json()["litevlm"]["views"] == ["CAM_FRONT"]
    for question, stream in ((BACK, False), (BACK, True), (SCENE, False)):
        r = ask(server, question, five, stream=stream)  # streamed too: a JSON error before any event
        assert r.status_code == 400, (question, stream, r.text)
        err = r.json()["error"]
        assert err["code"] == "missing_cameras" and "CAM_BACK" in err["message"], err
    assert ask(server, FRONT, five).status_code == 200  # still serving


def test_a_corrupt_image_fails_only_the_questions_that_need_it(server):
    urls = frame_urls(4)
    raw = image_data_url_bytes(urls["CAM_BACK"])
    # Its header is good (the parser passes it); its pixels are cut off, found only when the view is decoded.
    corrupt = {**urls, "CAM_BACK": "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()}
    assert ask(server, FRONT, corrupt).status_code == 200
    r = ask(server, BACK, corrupt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and "CAM_BACK" in err["message"], err
    assert ask(server, SCENE, corrupt).status_code == 400
    assert ask(server, FRONT, corrupt).status_code == 200


def test_view_cache_flag(full_model_dir, pipe):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert app_options(p.parse_args([]))["view_cache_bytes"] == 256 << 20
    assert app_options(p.parse_args(["--view-cache-mb", "0"]))["view_cache_bytes"] == 0
    with pytest.raises(Exception, match="--view-cache-mb"):
        app_options(p.parse_args(["--view-cache-mb", "-1"]))
    other = Pipeline.from_pretrained(full_model_dir, max_new_tokens=2, select_views=True)
    build_app(other, view_cache_bytes=1 << 20)
    assert isinstance(other.view_cache, ViewCache) and other.view_cache.max_bytes == 1 << 20
    build_app(other, view_cache_bytes=0)
    assert other.view_cache is None
    samples = metric_samples(build_app(other).state.metrics.render().decode())
    assert samples[("litevlm_view_cache_max_bytes", ())] == 0  # the cache off: zeros, not an error
