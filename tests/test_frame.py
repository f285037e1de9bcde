"""One frame, several questions: each view read and encoded once, the content cache, cameras that fail, raw frames,
and e2e."""

import numpy as np
import pytest
import torch
from PIL import Image
from test_pipeline import check_timings, timed_answer, watch_stages

from litevlm import LiteVLMError, Pipeline
from litevlm.cameras import CAMERAS
from litevlm.frame import ViewCache
from litevlm.model.prompt import Tiling
from litevlm.model.vlm import cut_view

BACK = "Is there a car behind the ego car?"  # CAM_BACK only (the lexical ViewSelector)
FRONT_LEFT = "Is there a pedestrian to the front left of the ego car?"  # CAM_FRONT_LEFT only
SCENE = "What are the important objects in the current scene?"  # every view
QUESTIONS = (BACK, FRONT_LEFT, SCENE, "Is there a barrier to the back left of the ego car?")


@pytest.fixture(scope="module")
def pipe(full_model_dir):
    return Pipeline.from_pretrained(full_model_dir, max_new_tokens=8, select_views=True, select_tokens=0.5)


@pytest.fixture(scope="module")
def images():
    from litevlm.data.synthetic import make_frame, render_views

    return render_views(make_frame(1, 0), size=(160, 90))


def test_a_frames_answers_equal_answer_with_each_view_encoded_once(pipe, images):
    frame = pipe.frame(images)
    encoded, reused = [], []
    for q in (*QUESTIONS, BACK):
        alone = pipe.answer(q, images)
        got = frame.answer(q)
        assert got.tokens == alone.tokens and got.views == alone.views
        assert got.kept_tokens == alone.kept_tokens
        encoded.append(got.cache["encoded"])
        reused.append(got.cache["reused"])
    assert encoded == [1, 1, 4, 0, 0]  # CAM_BACK, CAM_FRONT_LEFT, the four others, then nothing new
    assert reused == [0, 0, 2, 1, 1]  # the scene-wide question found two views made
    assert frame.encoded == len(CAMERAS)


def test_a_tiles_tokens_do_not_depend_on_the_tiles_beside_it(pipe, images):
    tiles, _ = pipe.tiles(images, list(CAMERAS))
    with torch.no_grad():
        together = pipe.model.encode_tiles(tiles)
        one_by_one = torch.cat([pipe.model.encode_tiles(tiles[i : i + 1]) for i in range(tiles.shape[0])])
    assert torch.equal(together, one_by_one)


def test_e2e_holds_preprocessing_and_every_stage(pipe, images, monkeypatch):
    """Each answer's timings against clocks of our own (`check_timings`): the stages' work watched from outside, and
    the wall time around the call, asked alone and through one frame (whose later questions read no image)."""
    inner = watch_stages(pipe, monkeypatch)
    frame = pipe.frame(images)
    for q in QUESTIONS:
        for answer, args in ((pipe.answer, (q, images)), (frame.answer, (q,))):
            for stage in inner:
                inner[stage] = 0.0
            ans, wall = timed_answer(answer, *args)
            check_timings(ans.timings_ms, inner, wall)
            assert inner["prefill"] > 0 and (inner["vit"] > 0) == (ans.cache["encoded"] > 0)


def test_the_cache_misses_on_one_changed_pixel_evicts_past_its_bound_and_clears_with_the_weights(pipe, images):
    arrays = {c: np.asarray(im).copy() for c, im in images.items()}
    pipe.view_cache = ViewCache()
    try:
        first = pipe.answer(BACK, arrays)
        assert first.cache == {"encoded": 1, "reused": 0, "hits": 0, "misses": 1}
        again = pipe.answer(BACK, {c: a.copy() for c, a in arrays.items()})  # same content, other arrays
        assert again.cache == {"encoded": 0, "reused": 0, "hits": 1, "misses": 0} and again.tokens == first.tokens
        changed = {c: a.copy() for c, a in arrays.items()}
        changed["CAM_BACK"][5, 7, 1] ^= 1
        assert pipe.answer(BACK, changed).cache == {"encoded": 1, "reused": 0, "hits": 0, "misses": 1}
        pipe.rebuild(warmup=False)  # weights may have changed: nothing encoded before is served
        assert pipe.view_cache.stats()["entries"] == 0
        assert pipe.answer(BACK, arrays).cache["misses"] == 1
        one_view = pipe.view_cache.bytes
        pipe.view_cache = ViewCache(max_bytes=2 * one_view)  # room for two views
        pipe.answer(SCENE, arrays)
        stats = pipe.view_cache.stats()
        assert stats["entries"] == 2 and stats["evictions"] == 4 and stats["bytes"] <= 2 * one_view
        # the least recently used go first: the last two views the scene-wide question encoded stay
        assert pipe.answer(SCENE, arrays).cache["hits"] == 2
    finally:
        pipe.view_cache = None


def test_a_missing_or_corrupt_camera_fails_only_the_questions_that_need_it(pipe, images, tmp_path):
    corrupt = tmp_path / "CAM_BACK.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    broken = {**images, "CAM_BACK": corrupt}
    frame = pipe.frame(broken)
    with pytest.raises(LiteVLMError, match="CAM_BACK.*cannot be read"):
        frame.answer(BACK)
    assert frame.answer(FRONT_LEFT).tokens == pipe.answer(FRONT_LEFT, images).tokens
    with pytest.raises(LiteVLMError, match="CAM_BACK"):
        frame.answer(SCENE)  # scene-wide: never answered blind to a camera

    five = {c: im for c, im in images.items() if c != "CAM_BACK"}
    with pytest.raises(LiteVLMError, match="needs CAM_BACK.*CAM_BACK is missing"):
        pipe.answer(BACK, five)
    with pytest.raises(LiteVLMError, match="needs every camera.*CAM_BACK is missing"):
        pipe.answer(SCENE, five)
    assert pipe.answer(FRONT_LEFT, five).tokens == pipe.answer(FRONT_LEFT, images).tokens
    with pytest.raises(LiteVLMError, match="unknown camera"):
        pipe.answer(BACK, {**images, "CAM_ROOF": images["CAM_BACK"]})


def test_without_view_selection_every_question_needs_all_six(full_model_dir, images):
    base = Pipeline.from_pretrained(full_model_dir, max_new_tokens=4, warmup=False)
    with pytest.raises(LiteVLMError, match="missing CAM_BACK: without view selection every question needs all six"):
        base.answer(FRONT_LEFT, {c: im for c, im in images.items() if c != "CAM_BACK"})


def test_arrays_tensors_and_files_give_the_answer_of_the_png(pipe, images, tmp_path):
    """Every form of the same pixels gives the PNG's tiles byte for byte, the visual features a frame encodes from
    them and the PNG's answer; the same forms of other pixels (each view mirrored) give the mirrored PNG's tiles and
    features, which differ from the first ones: the comparison tells images apart. An RGBA array's alpha (random
    here) is ignored."""
    from litevlm.model.generate import StageTimer

    rng = np.random.default_rng(0)

    def forms(hwc: dict, folder) -> dict:
        folder.mkdir()
        paths = {}
        for c, a in hwc.items():
            Image.fromarray(a).save(folder / f"{c}.png")
            paths[c] = folder / f"{c}.png"
        alpha = {c: rng.integers(0, 256, a.shape[:2] + (1,), dtype=np.uint8) for c, a in hwc.items()}
        return {
            "png": paths,
            "bytes": {c: p.read_bytes() for c, p in paths.items()},
            "pil": {c: Image.fromarray(a) for c, a in hwc.items()},
            "array": hwc,
            "tensor hwc": {c: torch.from_numpy(a.copy()) for c, a in hwc.items()},
            "tensor chw": {c: torch.from_numpy(a.copy()).permute(2, 0, 1).contiguous() for c, a in hwc.items()},
            "rgba array": {c: np.concatenate([a, alpha[c]], 2) for c, a in hwc.items()},
        }

    def read(imgs) -> tuple[torch.Tensor, torch.Tensor]:
        """(tiles (6, 3, S, S), visual tokens (6, tokens_per_tile, C)) of the six views, as an answer reads them."""
        tiles, _ = pipe.tiles(imgs, list(CAMERAS))
        with torch.no_grad():
            visual, _ = pipe.frame(imgs).visual(list(CAMERAS), StageTimer(pipe.model.device))
        return tiles, visual

    hwc = {c: np.asarray(im) for c, im in images.items()}
    mirrored = {c: np.ascontiguousarray(a[:, ::-1]) for c, a in hwc.items()}
    tiles, visual = read(images)
    other_tiles, other_visual = read({c: Image.fromarray(a) for c, a in mirrored.items()})
    assert (tiles != other_tiles).any() and (visual - other_visual).abs().max() > 1e-3  # the control differs
    want = pipe.answer(SCENE, images).tokens
    for name, imgs in forms(hwc, tmp_path / "same").items():
        got_tiles, got_visual = read(imgs)
        assert torch.equal(got_tiles, tiles) and torch.equal(got_visual, visual), name
        assert pipe.answer(SCENE, imgs).tokens == want, name
    for name, imgs in forms(mirrored, tmp_path / "mirrored").items():
        got_tiles, got_visual = read(imgs)
        assert torch.equal(got_tiles, other_tiles) and torch.equal(got_visual, other_visual), name
    with pytest.raises(LiteVLMError, match="uint8"):
        pipe.answer(BACK, {**hwc, "CAM_BACK": hwc["CAM_BACK"].astype(np.float32)})


def test_the_fast_resize_is_pils_within_one_level_and_a_jpeg_decodes_at_the_scale_its_tiles_need(tmp_path):
    from PIL import Image

    from litevlm.data.synthetic import make_frame, render_views

    im = render_views(make_frame(1, 0), size=(800, 450))["CAM_FRONT"]
    for tiling, size in ((Tiling(tiles=2), 56), (Tiling(max_tiles=4, thumbnail=True), 64)):
        fast, ref = cut_view(im, tiling, size), cut_view(im, tiling, size, "pil")
        assert fast.shape == ref.shape and np.abs(fast.astype(int) - ref).max() <= 1
    im.save(tmp_path / "view.jpg", quality=95)
    from litevlm.model.images import open_image

    assert open_image(tmp_path / "view.jpg", lambda w, h: (112, 56)).size == (200, 113)  # 1/4: still covers 112x56
    assert open_image(tmp_path / "view.jpg", lambda w, h: (500, 250)).size == (800, 450)  # no smaller scale covers it
    assert Image.open(tmp_path / "view.jpg").size == (800, 450)


@pytest.mark.parametrize("target", [(112, 56), (300, 150), (500, 250), (800, 450)])
def test_libjpeg_turbo_reads_a_jpeg_at_pils_scale_and_within_a_few_levels_of_its_tiles(tmp_path, target):
    """The fast path's JPEG decoder (libjpeg-turbo straight into an array) reads a file at the DCT scale PIL's draft
    picks, and its tiles stay within a few levels of those cut from PIL's reading of the same file at that scale
    (libjpeg's fast inverse DCT and merged colour upsampling, where the tiles are much smaller, are the only
    difference: a level or so, more only on a few pixels of hard colour edges). simplejpeg is a dependency of the
    package: without it this fails, it is not skipped."""
    import simplejpeg  # noqa: F401

    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.model.images import as_pixels, decode_jpeg, open_image, read_image

    im = render_views(make_frame(1, 0), size=(800, 450))["CAM_FRONT"]
    im.save(tmp_path / "view.jpg", quality=90)
    data = (tmp_path / "view.jpg").read_bytes()
    got = decode_jpeg(data, lambda w, h: target)
    pil = as_pixels(open_image(tmp_path / "view.jpg", lambda w, h: target))
    assert got is not None and got.shape == tuple(pil.permute(1, 2, 0).shape)
    tiles = lambda px: Tiling(tiles=2).cut(px, target[1])  # noqa: E731
    diff = np.abs(tiles(torch.from_numpy(got).permute(2, 0, 1)).astype(int) - tiles(pil))
    assert diff.mean() < 1.0 and (diff > 8).mean() < 1e-3  # a level or so; past 8 only a few pixels on hard edges
    assert torch.equal(read_image(tmp_path / "view.jpg", lambda w, h: target), torch.from_numpy(got).permute(2, 0, 1))


def test_a_jpeg_libjpeg_turbo_declines_is_named_by_pil_and_cmyk_reads_as_pils(tmp_path):
    """A truncated JPEG, which libjpeg-turbo declines, gets PIL's named error (the file in it); a CMYK one reads as
    PIL reads it."""
    from PIL import Image

    from litevlm.model.images import as_pixels, decode_jpeg, read_image

    Image.new("CMYK", (64, 32), (10, 200, 30, 0)).save(tmp_path / "cmyk.jpg")
    fast, pil = read_image(tmp_path / "cmyk.jpg"), as_pixels(read_image(tmp_path / "cmyk.jpg", resample="pil"))
    assert fast.shape == (3, 32, 64) and (fast.int() - pil.int()).abs().max() <= 2
    Image.new("RGB", (64, 32), (9, 9, 9)).save(tmp_path / "ok.jpg")
    (tmp_path / "cut.jpg").write_bytes((tmp_path / "ok.jpg").read_bytes()[:200])
    assert decode_jpeg((tmp_path / "cut.jpg").read_bytes()) is None
    with pytest.raises(LiteVLMError, match="cut.jpg"):
        read_image(tmp_path / "cut.jpg")
