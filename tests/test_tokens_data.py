"""`litevlm train tokens` on any checkpoint and the user's DriveLM data: the c-tag geometry under every tiling, the
teacher labels with their c-tag prior, the cache a rerun resumes from, and the saved selector in use."""

import json
import shutil

import pytest
import torch

from litevlm.model.prompt import Tiling
from litevlm.select.tokens import ViewGrid, box_cells, cell_index, tag_cells, tag_features, view_grid, view_grids

TAG = "<c1,CAM_BACK,1250.0,700.0>"  # x = 1250 of 1600, y = 700 of 900


# ------------------------------------------------------------------------------------------------
# Geometry
# ------------------------------------------------------------------------------------------------
def test_fixed_tiling_geometry_is_the_tiles_side_by_side_one():
    """An int layout (drive-tiny's) and the ViewGrid of fixed tiling give the same cells and features."""
    spans = [("CAM_FRONT", 10, 42), ("CAM_BACK", 50, 82)]
    for tiles in (1, 2):
        g = view_grid(Tiling(tiles=tiles), tiles)
        assert g == ViewGrid(tiles, 1, False)
        for box in [(0, 0, 399, 224), (410, 460, 790, 670), (820, 0, 990, 100), (-50, 800, 1700, 950)]:
            assert box_cells(box, 4, tiles) == box_cells(box, 4, g)
        q = f"Is {TAG} moving? And <c2,CAM_FRONT,10.0,890.0>?"
        sp = [(c, s, s + 16 * tiles) for c, s, _ in spans]
        assert torch.equal(tag_features(q, sp, 4, tiles), tag_features(q, sp, 4, [g, g]))


def test_dynamic_grid_cells_by_hand():
    """2 x 2 tiles of a 2 x 2 token raster each: the tiles' raster is 4 x 4 over the image, tiles row-major."""
    g = ViewGrid(2, 2)
    # x = 1250 -> column int(1250 * 4 / 1600) = 3 (tile column 1, cell column 1); y = 700 -> row int(700 * 4 / 900)
    # = 3 (tile row 1, cell row 1): tile 1 * 2 + 1 = 3, cell 1 * 2 + 1 = 3 -> 3 * 4 + 3 = 15
    assert tag_cells(TAG, 2, g) == [("CAM_BACK", [15])]
    assert cell_index(3, 3, 2, tile_cols=2) == 15
    assert box_cells((0, 0, 399, 224), 2, g) == [0]  # the top-left cell of the top-left tile
    assert box_cells((0, 450, 399, 674), 2, g) == [8]  # row 2 of the raster is the first row of tile 2
    with pytest.raises(ValueError, match="tile_cols"):
        cell_index(0, 2, 2)


def test_thumbnail_cell_follows_the_tiles():
    """With a thumbnail the point is marked in the tiles' raster and in the thumbnail's 2 x 2 raster (last)."""
    g = ViewGrid(2, 1, thumbnail=True)  # tokens 0-7: two tiles side by side; 8-11: the thumbnail
    # tiles' raster 4 x 2: column int(1250 * 4 / 1600) = 3 -> tile 1, col 1; row int(700 * 2 / 900) = 1 -> 4 + 2 + 1
    # thumbnail 2 x 2: column 1, row 1 -> 8 + 3
    assert tag_cells(TAG, 2, g) == [("CAM_BACK", [7, 11])]
    f = tag_features(TAG, [("CAM_FRONT", 5, 17), ("CAM_BACK", 20, 32)], 2, [g, g])
    assert f[0].nonzero().flatten().tolist() == [12 + 7, 12 + 11]
    assert box_cells((0, 0, 1600, 900), 2, g) == list(range(12))


def test_view_grids_from_the_token_counts():
    """The pipeline hands the selector its tiling; the grid of each view follows from its token count."""
    dyn = Tiling(max_tiles=6, thumbnail=True)
    assert view_grid(dyn, 1) == ViewGrid(1, 1, False)  # one tile: no thumbnail
    assert view_grid(dyn, 3) == ViewGrid(2, 1, True)  # a 16:9 image: 2 x 1 + thumbnail
    assert view_grid(Tiling(max_tiles=12), 8) == ViewGrid(4, 2, False)
    assert view_grid(Tiling(tiles=2, thumbnail=True), 3) == ViewGrid(2, 1, True)
    # the grid InternVL's tiling cuts a 16:9 image into is what the count gives back, whatever the image's size
    for size in [(160, 90), (1600, 900), (800, 450)]:
        cols, rows = dyn.grid(*size, 56)
        assert view_grid(dyn, dyn.count(*size, 56)) == ViewGrid(cols, rows, cols * rows > 1)
    assert view_grids(dyn, [("CAM_FRONT", 0, 12), ("CAM_BACK", 20, 24)], 4) == [ViewGrid(2, 1, True), ViewGrid(1)]
    from litevlm.errors import LiteVLMError

    with pytest.raises(LiteVLMError, match="does not fit"):
        view_grid(Tiling(tiles=2), 3)


# ------------------------------------------------------------------------------------------------
# The recipe on DriveLM data
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drivelm_json(tmp_path_factory):
    from litevlm.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("drivelm"), frames=8, seed=0, size=(160, 90), progress=False)


def _copy(src, tmp_path, name="model"):
    d = tmp_path / name
    shutil.copytree(src, d)
    return d


def _recipe(**kw):
    from litevlm.train.tokens import TokenRecipe

    base = dict(questions=10, val_questions=4, epochs=2, batch=4, minutes=5, answer_tokens=6, threads=1)
    return TokenRecipe(**{**base, **kw})


def test_labels_carry_the_c_tag_prior_at_its_cell(tiny_model_dir, tmp_path, drivelm_json):
    """Under dynamic tiling with a thumbnail, a tagged question's prior marks the tag's tile cell and thumbnail cell
    of its camera's view, where a hand computation puts them."""
    from litevlm.data.source import load_data
    from litevlm.models import load_model
    from litevlm.pipeline import Pipeline
    from litevlm.train.tokens import LabelCache, data_items, frame_groups, label_questions

    loaded = load_model(_copy(tiny_model_dir, tmp_path), max_tiles=4, thumbnail=True)
    pipe = Pipeline.from_loaded(loaded, max_new_tokens=4)
    samples = load_data(drivelm_json)
    i, s = next((i, s) for i, s in enumerate(samples) if "<c" in s.question)
    recipe = _recipe(all_views_prob=0.0, extra_view_prob=0.0)  # just the views the question needs
    cache = LabelCache(tmp_path / "cache")
    groups = frame_groups([(i, s)])
    left = label_questions(pipe, groups, recipe, cache, float("inf"), False)
    _, items = data_items(pipe, groups, recipe, cache, False, "labels")
    (item,) = items
    assert left == 0 and torch.isclose(item.target.sum(), torch.tensor(1.0))
    # 160 x 90 under at most 4 tiles: 2 x 1 tiles + thumbnail, 3 tiles of 2 x 2 tokens = 12 tokens per view
    assert [e - b for _, b, e in item.spans] == [12] * len(item.views)
    cam, xs, ys = s.question.split("<c", 1)[1].split(">")[0].split(",")[1:4]
    col, row = int(float(xs) * 4 / 1600), int(float(ys) * 2 / 900)  # the tiles' 4 x 2 raster
    tile_cell = (col // 2) * 4 + row * 2 + col % 2
    thumb_cell = 8 + int(float(ys) * 2 / 900) * 2 + int(float(xs) * 2 / 1600)
    start = 12 * item.views.index(cam)
    marked = set(item.prior.nonzero().flatten().tolist())
    assert {start + tile_cell, start + thumb_cell} <= marked
    # the label mixes the cached teacher attention with the prior
    want = (1 - recipe.prior_weight) * cache.get(i) + recipe.prior_weight * item.prior
    torch.testing.assert_close(item.target, want)


def test_train_tokens_on_data_saves_resumes_and_serves(tiny_model_dir, tmp_path, drivelm_json, monkeypatch, capsys):
    """`litevlm train tokens --model M --data D`: a selector that `Pipeline.from_pretrained(select_tokens=0.5)` loads
    and prunes with; a rerun reads every teacher label from the cache (no teacher call) and reports the split."""
    from litevlm.cli import main
    from litevlm.data.drivelm import load_images
    from litevlm.data.source import load_data
    from litevlm.pipeline import Pipeline
    from litevlm.train import tokens

    model_dir = _copy(tiny_model_dir, tmp_path)
    calls = []
    teacher = tokens.teacher_attention
    monkeypatch.setattr(tokens, "teacher_attention", lambda *a, **k: calls.append(1) or teacher(*a, **k))
    flags = ["--questions", "10", "--val-questions", "4", "--epochs", "2", "--answer-tokens", "6", "--threads", "1"]
    argv = ["train", "tokens", "--model", str(model_dir), "--data", str(drivelm_json), "--tiles-per-view", "2"]
    main(argv + flags + ["--json"])
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(calls) == 14  # 10 training + 4 held-out questions, each labelled once
    assert first["source"]["val_questions"] == 4 and first["source"]["labels_from_cache"] == 0
    assert first["validation"]["selector"]["kept_label_mass@0.5"] > 0
    assert first["source"]["val_scenes"] == 1  # of the data's two scenes

    calls.clear()
    main(argv + flags)
    assert calls == []  # every label from the cache
    out = capsys.readouterr().out
    assert "14 labels from the cache" in out  # 10 training + 4 held-out
    assert "held-out scenes, scene_split(fraction=0.1, seed=0)" in out

    pipe = Pipeline.from_pretrained(model_dir, select_tokens=0.5, max_new_tokens=3)
    assert pipe.token_selector is not None and pipe.format.tiling == Tiling(tiles=2)
    sample = next(s for s in load_data(drivelm_json) if "<c" in s.question)
    answer = pipe.answer(sample.question, load_images(sample))
    assert answer.num_visual_tokens == 6 * 2 * 4 // 2  # r = 0.5 of six views x 2 tiles x 4 tokens


def test_train_tokens_under_torchrun_with_two_ranks(tiny_model_dir, tmp_path, drivelm_json):
    """`torchrun --nproc-per-node 2 -m litevlm train tokens --data D` on CPU (gloo): each rank labels its share of
    the frames into the shared cache, both train under DDP, rank 0 alone reports and saves a selector that loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from litevlm.pipeline import Pipeline

    model_dir = _copy(tiny_model_dir, tmp_path)
    argv = ["train", "tokens", "--model", str(model_dir), "--data", str(drivelm_json), "--json"]
    argv += ["--questions", "10", "--val-questions", "4", "--epochs", "2", "--answer-tokens", "6", "--threads", "1"]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(run + ["-m", "litevlm"] + argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 alone reports
    report = json.loads(lines[0])
    assert report["source"]["ranks"] == 2 and report["items"] == 10 and report["source"]["val_questions"] == 4
    shards = sorted(Path(report["source"]["cache"]).glob("labels-*.safetensors"))
    by_rank = {r: set() for r in ("r0", "r1")}
    for f in shards:
        by_rank[f.stem.rsplit("-", 1)[1]] |= set(load_file(str(f)))
    assert by_rank["r0"] and by_rank["r1"] and not by_rank["r0"] & by_rank["r1"]  # labels split, none twice
    assert len(by_rank["r0"] | by_rank["r1"]) == 14
    pipe = Pipeline.from_pretrained(model_dir, select_tokens=0.5, max_new_tokens=2)
    assert pipe.token_selector is not None


def test_an_hf_checkpoint_with_dynamic_tiling_serves_the_selector_it_trained(tiny_model_dir, tmp_path, drivelm_json):
    """A transformers (-hf) checkpoint prompted with a system message and InternVL's dynamic tiling plus thumbnail:
    the selector is saved beside it with that prompt format, and `Pipeline.from_pretrained` rebuilds both."""
    from litevlm.data.drivelm import load_images
    from litevlm.data.source import load_data
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.hf import load_native, save_hf
    from litevlm.models import load_model
    from litevlm.pipeline import Pipeline
    from litevlm.train.tokens import train_token_selector

    hf = save_hf(load_native(tiny_model_dir), tmp_path / "hf", tokenizer=Tokenizer.from_dir(tiny_model_dir))
    config = json.loads((hf / "config.json").read_text())
    config.pop("litevlm")  # a checkpoint of transformers' own, as a user brings it: no entry of ours
    (hf / "config.json").write_text(json.dumps(config))
    loaded = load_model(hf, system="You answer driving questions.", max_tiles=4, thumbnail=True)
    recipe = _recipe(questions=6, val_questions=2, epochs=1)
    out = train_token_selector(loaded, recipe, progress=False, data=drivelm_json)
    assert out == hf / "token_selector" and (hf / "prompt.json").is_file()
    pipe = Pipeline.from_pretrained(hf, select_tokens=0.5, max_new_tokens=2)
    assert pipe.format.tiling == Tiling(max_tiles=4, thumbnail=True)
    assert pipe.format.system == "You answer driving questions."
    sample = next(s for s in load_data(drivelm_json) if "<c" in s.question)
    answer = pipe.answer(sample.question, load_images(sample))
    # six 160 x 90 views, each 2 x 1 tiles + thumbnail of 4 tokens: 72 visual tokens, half of them kept
    assert answer.num_visual_tokens == 36
