"""The explain figure marks exactly the kept tokens, on the patches they were made from; `ask --explain` writes it at
its fixed size; `ask` asks several questions of one frame, and answers with a camera missing where the question does
not need it."""

import json

import numpy as np
import pytest
from PIL import Image

from litevlm.cameras import CAMERAS
from litevlm.cli import main
from litevlm.errors import LiteVLMError
from litevlm.explain import DIM, PIXELS, draw_explanation, explain, token_box, token_boxes
from litevlm.model.prompt import Tiling
from litevlm.pipeline import Answer, Pipeline


def _same_boxes(a, b) -> bool:
    return len(a) == len(b) and np.allclose(sorted(a), sorted(b))


@pytest.fixture
def figures(monkeypatch):
    """The figures `draw_explanation` closes, kept open for the test to read (its panels, patches and veils)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def _panel(fig, cam: str):
    """The axes of `cam`'s panel (its title starts with the camera's name)."""
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(f"{cam}:")]
    return ax


def _luminance(rgba) -> float:
    r, g, b = rgba[:3]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _write_images(folder, cameras=CAMERAS, size=(160, 90)):
    rng = np.random.default_rng(0)
    for cam in cameras:
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{cam}.png")
    return folder


def test_a_tokens_box_covers_the_patches_the_pixel_shuffle_folded_into_it():
    """Derived from the vision tower, not from `token_box`: 56 px tiles of 14 px patches are 4 x 4 patches, which the
    pixel shuffle folds 2 x 2 into 4 tokens a tile; each token's box is the union of its four patches, mapped from the
    tiles (cut from the image resized to 112 x 56, left to right) back to a 448 x 112 image (4 px a resized px)."""
    import torch

    from litevlm.model.vision import pixel_shuffle

    g, patch, size = 4, 14, 56
    rows_cols = torch.tensor([[r, c] for r in range(g) for c in range(g)], dtype=torch.float32)  # (g*g, 2) row-major
    folded = pixel_shuffle(rows_cols[None], g)[0].reshape(4, 4, 2)  # (token, patch of the token, (row, col))
    tiling = Tiling(tiles=2)
    for tile in range(2):
        for cell in range(4):
            r, c = folded[cell, :, 0], folded[cell, :, 1]
            x0, x1 = tile * size + int(c.min()) * patch, tile * size + (int(c.max()) + 1) * patch  # resized pixels
            y0, y1 = int(r.min()) * patch, (int(r.max()) + 1) * patch
            assert (x1 - x0, y1 - y0) == (2 * patch, 2 * patch)  # four neighbouring patches: a 2 x 2 square
            want = (4.0 * x0, 2.0 * y0, 4.0 * x1, 2.0 * y1)  # 448 / 112 across, 112 / 56 down
            assert token_box(tile * 4 + cell, 448, 112, tiling, size, 4) == want, (tile, cell)


def test_token_boxes_of_fixed_tiles():
    # 2 tiles of 2x2 tokens over a 400x100 image: tile t covers x in [200t, 200t + 200), each token a quarter of it
    tiling = Tiling(tiles=2)
    assert token_boxes(400, 100, [0, 5], tiling, 56, 4) == [(0.0, 0.0, 100.0, 50.0), (300.0, 0.0, 400.0, 50.0)]
    assert len(token_boxes(400, 100, None, tiling, 56, 4)) == 8  # None: every token
    with pytest.raises(LiteVLMError, match="out of range"):
        token_boxes(400, 100, [8], tiling, 56, 4)
    with pytest.raises(LiteVLMError, match="no square grid"):
        token_boxes(400, 100, [0], tiling, 56, 3)


def test_token_boxes_of_a_dynamic_grid_with_a_thumbnail():
    tiling = Tiling(max_tiles=4, thumbnail=True)
    assert tiling.grid(100, 100, 50) == (2, 2)  # 4 tiles row by row, then the thumbnail: 5 x 4 tokens
    # token 11: tile 2 (row 1, column 0), cell 3 (row 1, column 1) -> token column 1, token row 3 of a 4x4 grid
    assert token_box(11, 100, 100, tiling, 50, 4) == (25.0, 75.0, 50.0, 100.0)
    assert token_box(6, 100, 100, tiling, 50, 4) == (50.0, 25.0, 75.0, 50.0)  # tile 1 (row 0, column 1), cell 2 (1, 0)
    assert token_box(17, 100, 100, tiling, 50, 4) is None  # the thumbnail overlaps every tile: not drawn
    assert len(token_boxes(100, 100, None, tiling, 50, 4)) == 16


def test_the_figure_draws_the_kept_tokens_shaded_by_score(tmp_path, figures):
    """A hand-made answer: two views encoded, one not, one camera missing; scores shade the kept tokens, the
    thumbnail's are left out, and the PNG has the fixed size whatever the images' sizes.

    The boxes expected are worked out by hand: 100 x 100 images cut 2 x 2 into 50 px tiles (then the thumbnail, tile
    4), 2 x 2 tokens a tile, so a token is a 25 px square. The shading is read from the figure itself: a kept token
    is drawn in the colour map's colour of its score (brighter for a higher score), a pruned patch not at all, under
    the veil."""
    tiling = Tiling(max_tiles=4, thumbnail=True)
    images = {c: Image.new("RGB", (100, 100), (90, 90, 90)) for c in CAMERAS if c != "CAM_BACK_LEFT"}
    images["CAM_BACK"] = np.zeros((100, 100, 3), dtype=np.uint8)  # any image source
    kept = {"CAM_FRONT": [0, 5, 17], "CAM_BACK": [3, 19]}
    ans = Answer(
        text="Yes.",
        views=["CAM_FRONT", "CAM_BACK"],
        num_visual_tokens=5,
        timings_ms={"total": 12.5, "e2e": 20.25},
        kept_tokens=kept,
        kept_scores={"CAM_FRONT": [-1.0, -2.0, -0.5], "CAM_BACK": [-3.0, -0.1]},
        tokens_per_view={"CAM_FRONT": 20, "CAM_BACK": 20},
    )
    ex = draw_explanation(
        images, ans, "Is there a car?", tmp_path / "x.png", tiling=tiling, image_size=50, tokens_per_tile=4
    )
    assert Image.open(ex.path).size == PIXELS
    assert set(ex.boxes) == {"CAM_FRONT", "CAM_BACK"}
    # CAM_FRONT: token 0 is tile 0's top-left cell; token 5 tile 1 (top right) cell 1 (its top right); 17 the
    # thumbnail's. CAM_BACK: token 3 is tile 0's cell 3 (its bottom right); 19 the thumbnail's.
    front = {0: (0.0, 0.0, 25.0, 25.0), 5: (75.0, 0.0, 100.0, 25.0)}
    back = {3: (25.0, 25.0, 50.0, 50.0)}
    assert _same_boxes(ex.boxes["CAM_FRONT"], list(front.values()))
    assert _same_boxes(ex.boxes["CAM_BACK"], list(back.values()))

    import matplotlib

    (fig,) = figures
    viridis = matplotlib.colormaps["viridis"]
    lo, hi = -3.0, -0.1  # the scores' range over both views, the thumbnail's tokens' included
    drawn = {}  # token -> its rectangle's edge colour
    for cam, want in (("CAM_FRONT", front), ("CAM_BACK", back)):
        ax = _panel(fig, cam)
        (coll,) = ax.collections
        edges = coll.get_edgecolor()
        boxes = [tuple(np.r_[p.vertices.min(0), p.vertices.max(0)]) for p in coll.get_paths()]
        assert len(edges) == len(boxes) == len(want)
        for token, box in want.items():
            (i,) = [i for i, b in enumerate(boxes) if np.allclose(b, box)]
            score = ans.kept_scores[cam][kept[cam].index(token)]
            assert np.allclose(edges[i][:3], viridis((score - lo) / (hi - lo))[:3], atol=1e-6), (cam, token)
            drawn[(cam, token)] = edges[i]
        # the veil: clear over the kept tokens' patches, dark over every pruned one (images shown at full size)
        photo, veil = ax.get_images()
        alpha = np.asarray(veil.get_array())[..., 3]
        clear = np.zeros((100, 100), dtype=bool)
        for x0, y0, x1, y1 in want.values():
            clear[int(y0) : int(y1), int(x0) : int(x1)] = True
        assert (alpha[clear] == 0.0).all() and np.allclose(alpha[~clear], DIM)
    # a higher score is drawn brighter: token 0 (-1.0) over token 5 (-2.0) over CAM_BACK's token 3 (-3.0)
    shades = [_luminance(drawn[k]) for k in (("CAM_FRONT", 0), ("CAM_FRONT", 5), ("CAM_BACK", 3))]
    assert shades[0] > shades[1] > shades[2]
    assert not _panel(fig, "CAM_FRONT_LEFT").collections  # a view not selected: nothing drawn on it
    with pytest.raises(LiteVLMError, match="makes 20"):  # an answer from other images or another tiling
        ans.tokens_per_view["CAM_FRONT"] = 16
        draw_explanation(images, ans, "q", tmp_path / "y.png", tiling=tiling, image_size=50, tokens_per_tile=4)
    with pytest.raises(LiteVLMError, match="PNG"):
        draw_explanation(images, ans, "q", tmp_path / "y.jpg", tiling=tiling, image_size=50, tokens_per_tile=4)


def test_the_figure_marks_a_pipelines_kept_tokens(full_model_dir, tmp_path):
    """A real answer's kept tokens (TokenSelector at r = 0.5 over every view), drawn: on each encoded view exactly
    the boxes of `answer.kept_tokens`; without pruning, every token of the encoded views."""
    images = {c: str(p) for c, p in ((c, tmp_path / f"{c}.png") for c in CAMERAS)}
    _write_images(tmp_path)
    pipe = Pipeline.from_pretrained(full_model_dir, select_tokens=0.5, max_new_tokens=4)
    q = "What are the important objects in the current scene?"
    ans = pipe.frame(images).answer(q)
    assert ans.kept_tokens is not None and sum(map(len, ans.kept_tokens.values())) < sum(ans.tokens_per_view.values())
    ex = explain(pipe, images, ans, q, tmp_path / "x.png")
    # the tiny model: one 56 px tile a view, 2 x 2 tokens, so over a 160 x 90 image token i is the 80 x 45 box at
    # column i % 2, row i // 2
    assert pipe.format.tiling == Tiling(tiles=1) and pipe.cfg.tokens_per_tile == 4
    assert set(ex.boxes) == set(ans.views)
    for cam in ans.views:
        cells = [divmod(i, 2) for i in ans.kept_tokens[cam]]  # (row, column)
        want = [(80.0 * c, 45.0 * r, 80.0 * (c + 1), 45.0 * (r + 1)) for r, c in cells]
        assert _same_boxes(ex.boxes[cam], want)
    ans.kept_tokens = None  # no pruning: every token of the encoded views is kept
    ex = explain(pipe, images, ans, q, tmp_path / "all.png")
    assert all(len(ex.boxes[c]) == ans.tokens_per_view[c] for c in ans.views)


def test_ask_explain_writes_the_figure(full_model_dir, tmp_path, capsys):
    images = tmp_path / "cams"
    images.mkdir()
    _write_images(images)
    out = tmp_path / "why.png"
    argv = ["ask", "--model", str(full_model_dir), "--images", str(images), "--max-new-tokens", "4"]
    argv += ["--select-tokens", "0.5", "--select-min-tokens", "0", "--question", "Anything ahead?"]
    assert main([*argv, "--explain", str(out)]) == 0
    assert Image.open(out).size == PIXELS
    text = capsys.readouterr().out
    assert "(images to answer)" in text and "(the paper's stages)" in text and f"explained: {out}" in text
    # several questions: one figure each, numbered by question
    assert main([*argv, "--question", "What is behind the ego car?", "--explain", str(out)]) == 0
    assert [Image.open(tmp_path / f"why-{i}.png").size for i in (1, 2)] == [PIXELS, PIXELS]
    capsys.readouterr()
    # a bad path is refused before the model loads
    assert (
        main(["ask", "--model", "no-such-model", "--images", str(images), "--question", "q", "--explain", "x.jpg"]) == 2
    )
    assert "PNG" in capsys.readouterr().err
    assert main([*argv, "--explain", str(images / "why.png")]) == 2
    assert "outside the images folder" in capsys.readouterr().err


def test_ask_with_a_camera_missing_answers_what_does_not_need_it(tmp_path, capsys):
    """Five of the six images: a question about CAM_BACK is answered, a scene-wide one is refused naming the
    missing camera; both asked of one frame, the answered one still printed, the command failing at the end."""
    images = _write_images(tmp_path, [c for c in CAMERAS if c != "CAM_FRONT"])
    behind, scene = "Is there a car behind the ego car?", "What are the important objects in the current scene?"
    argv = ["ask", "--images", str(images), "--select-views", "--max-new-tokens", "6"]  # drive-tiny
    assert main([*argv, "--question", behind, "--question", scene]) == 2
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == f"[1] {behind}" and lines[2].startswith("views: CAM_BACK ") and lines[3] == f"[2] {scene}"
    assert (
        "error: question 2: this question needs every camera" in captured.err and "CAM_FRONT is missing" in captured.err
    )
    assert "1 of 2 questions not answered" in captured.err
    assert main([*argv, "--question", behind, "--question", scene, "--json"]) == 2
    answers = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert answers[0]["views"] == ["CAM_BACK"] and "CAM_FRONT is missing" in answers[1]["error"]
    assert main([*argv, "--question", scene]) == 2
    assert "CAM_FRONT is missing" in capsys.readouterr().err


def test_the_demo_shows_both_measures_and_explains_an_answer(full_model_dir, tmp_path, capsys):
    from litevlm.demo import run_demo

    result = run_demo(str(full_model_dir), out=str(tmp_path / "d.png"), n_questions=2, rounds=1)
    assert result["explain"] == str(tmp_path / "demo_explain.png") and Image.open(result["explain"]).size == PIXELS
    assert result["explained"]["config"] == "litevlm"
    for name in ("litevlm", "baseline"):  # e2e holds the stages and the images' reading besides
        assert 0 < result["stages_ms"][name] <= result["e2e_ms"][name]
    assert result["speedup_stages"] == pytest.approx(result["stages_ms"]["baseline"] / result["stages_ms"]["litevlm"])
    assert result["speedup_e2e"] == pytest.approx(result["e2e_ms"]["baseline"] / result["e2e_ms"]["litevlm"])
    text = capsys.readouterr().out
    assert "paper's measure (the five stages)" in text and "images to answer (e2e)" in text
    assert str(tmp_path / "demo_explain.png") in text
    with pytest.raises(LiteVLMError, match="PNG"):  # before the model loads
        run_demo("no-such-model", out=str(tmp_path / "d.png"), explain=tmp_path / "e.jpg")
