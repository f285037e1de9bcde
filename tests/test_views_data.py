"""`litevlm train views --data`: the ViewSelector recipe on a DriveLM file. Labels per question from c-tags, the
lexical map, label-views answers or all six, counted per source; the validation split holds whole scenes out;
the label cache is reused; the trained selector is saved beside a model and used by its pipeline; bad input."""

import json
import shutil

import pytest

from litevlm.cameras import CAMERAS
from litevlm.cli import main
from litevlm.data.source import load_data, scene_split
from litevlm.errors import LiteVLMError
from litevlm.train.views import ViewRecipe, data_examples, label_questions

F, FL, FR, B, BL, BR = CAMERAS
SCENES = 6
TAGGED = "What is the moving status of object <c1,CAM_BACK,{x}.0,501.7>?"  # x = the scene's number
NAMED = "What are the objects to the front left of the ego car?"
IMPLICIT = "Is it safe for the ego vehicle to turn left?"
SCENE_WIDE = "What are the important objects in the current scene?"
ELSEWHERE = "Can we change lanes to the right?"  # labelled, but not a question of the data


def _frame(scene: int) -> dict:
    return {
        "key_object_infos": {},
        "QA": {
            "perception": [{"Q": SCENE_WIDE, "A": "A car."}, {"Q": NAMED, "A": "A car."}],
            "prediction": [{"Q": TAGGED.format(x=scene), "A": "Going ahead."}],
            "planning": [{"Q": IMPLICIT, "A": "No."}],
            "behavior": [],
        },
        # never written: the selector reads questions only
        "image_paths": {cam: f"../nuscenes/samples/{cam}/missing_{scene}.jpg" for cam in CAMERAS},
    }


@pytest.fixture
def drivelm(tmp_path):
    """A train-v1_1 style file: six scenes of one key frame, four questions each, images absent; and a
    label-views file answering the implicit question, one outside the data, and one the c-tag overrides."""
    data = {f"scene-{i}": {"scene_description": "", "key_frames": {f"frame-{i}": _frame(i)}} for i in range(SCENES)}
    path = tmp_path / "train_v1_1.json"
    path.write_text(json.dumps(data))
    labels = tmp_path / "labels.jsonl"
    lines = [
        {"question": IMPLICIT, "views": [FL, BL], "source": "llm"},
        {"question": ELSEWHERE, "views": [FR, BR], "source": "llm"},
        {"question": TAGGED.format(x=0), "views": [F], "source": "llm"},
    ]
    labels.write_text("".join(json.dumps(item) + "\n" for item in lines))
    return path, labels


def test_labels_per_source(drivelm):
    path, labels = drivelm
    assert not any(f.exists() for s in load_data(path, require_images=False) for f in s.images.values())
    data = data_examples(path, label_files=[labels], recipe=ViewRecipe(val_fraction=0.3))
    assert data.sources == {"c-tag": SCENES, "lexical": SCENES, "label-views": SCENES, "all six": SCENES}
    assert data.extra == [(ELSEWHERE, (FR, BR))]
    got = dict(data.train + data.val)
    assert got[TAGGED.format(x=0)] == (B,)  # the c-tag wins over the label line
    assert got[NAMED] == (FL,) and got[IMPLICIT] == (FL, BL) and got[SCENE_WIDE] == CAMERAS
    without = data_examples(path, recipe=ViewRecipe(val_fraction=0.3))
    assert without.sources == {"c-tag": SCENES, "lexical": SCENES, "label-views": 0, "all six": 2 * SCENES}
    assert dict(without.train + without.val)[IMPLICIT] == CAMERAS and without.extra == []


@pytest.mark.parametrize("seed", [0, 5])
def test_validation_split_holds_whole_scenes_out(drivelm, seed):
    path, labels = drivelm
    recipe = ViewRecipe(val_fraction=0.3, torch_seed=seed)
    data = data_examples(path, label_files=[labels], recipe=recipe)
    kept, held = scene_split(load_data(path, require_images=False), 0.3, seed=seed)
    held_scenes = {s.scene_id for s in held}
    assert 0 < len(held_scenes) < SCENES and (data.val_scenes, data.train_scenes) == (
        len(held_scenes),
        SCENES - len(held_scenes),
    )
    assert len(data.val) == 4 * len(held_scenes) and len(data.train) == 4 * (SCENES - len(held_scenes))
    # each scene's c-tag question carries its number: the held-out ones are exactly the held-out scenes
    tagged_val = {q for q, _ in data.val if "<c1" in q}
    tagged_train = {q for q, _ in data.train if "<c1" in q}
    assert tagged_val == {TAGGED.format(x=s.split("-")[1]) for s in held_scenes}
    assert not tagged_val & tagged_train


def test_label_cache_is_reused_and_keyed_by_the_answers(drivelm, tmp_path):
    path, labels = drivelm
    cache_dir = tmp_path / "cache"
    data_examples(path, label_files=[labels], cache_dir=cache_dir)
    (cache,) = cache_dir.glob("labels-*.json")
    stored = json.loads(cache.read_text())
    assert stored[IMPLICIT] == [[FL, BL], "label-views"] and len(stored) == SCENES + 3
    stored[SCENE_WIDE] = [[F], "all six"]  # a rerun reads its labels from the cache, not the rules
    cache.write_text(json.dumps(stored))
    again = data_examples(path, label_files=[labels], cache_dir=cache_dir)
    assert dict(again.train + again.val)[SCENE_WIDE] == (F,)
    fresh = label_questions([SCENE_WIDE], {IMPLICIT: (FL,)}, cache_dir)  # other answers: another cache file
    assert fresh[SCENE_WIDE] == (CAMERAS, "all six") and len(list(cache_dir.glob("labels-*.json"))) == 2


def test_train_views_on_data_is_used_by_the_pipeline(tmp_path, tiny_model_dir, capsys):
    from litevlm.data.drivelm import load_images
    from litevlm.data.synthetic import write_dataset
    from litevlm.pipeline import Pipeline

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = write_dataset(tmp_path / "data", frames=12, seed=3, size=(96, 54))
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"question": IMPLICIT, "views": [FL, BL]}) + "\n")
    argv = ["train", "views", "--model", str(model), "--data", str(data), "--labels", str(labels)]
    assert main(argv + ["--steps", "5", "--val-fraction", "0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    samples = load_data(data)
    assert (
        sum(out["data"]["labels"].values())
        == len(samples)
        == out["data"]["train_questions"] + out["data"]["val_questions"]
    )
    assert out["validation"]["recall"] >= ViewRecipe().target_recall and out["path"] == str(model / "view_selector")
    assert (model / "prompt.json").is_file()  # saved with the prompt format, as every module beside a model

    pipe = Pipeline.from_pretrained(model, select_views=True, max_new_tokens=2)
    assert pipe.view_selector.meta["data"]["path"] == str(data)  # the selector just trained
    single = next(s for s in samples if len(s.views) == 1 and "<c" in s.question)
    camera = single.views[0]
    ans = pipe.answer(single.question, load_images(single))
    assert camera in ans.views and len(ans.views) < len(CAMERAS)
    assert ans.views == pipe.view_selector.select(single.question)[0]
    assert pipe.answer(SCENE_WIDE, load_images(single)).views == list(CAMERAS)


def test_bad_input_is_refused_before_anything_is_written(drivelm, tmp_path, capsys):
    path, labels = drivelm
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": IMPLICIT, "views": [F]}) + "\n")
    bad.write_text(bad.read_text() + json.dumps({"question": NAMED, "views": ["CAM_TOP"]}) + "\n")
    with pytest.raises(LiteVLMError, match=r"bad\.jsonl:2: unknown camera 'CAM_TOP'"):
        data_examples(path, label_files=[bad])
    cases = [
        (["--data", str(path), "--out", str(out), "--labels", str(bad)], "bad.jsonl:2"),
        (["--data", str(path)], "needs --out DIR or --model M"),
        (["--out", str(out), "--images", str(tmp_path)], "pass --data too"),
        (["--out", str(out), "--camera-label", "{camera}"], "pass --model"),
        (["--data", str(tmp_path / "nothing.json"), "--out", str(out)], "no DriveLM data"),
    ]
    for flags, message in cases:
        assert main(["train", "views", *flags]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()

    one = json.loads(path.read_text())
    (tmp_path / "one.json").write_text(json.dumps({"scene-0": one["scene-0"]}))
    with pytest.raises(LiteVLMError, match="one scene"):
        data_examples(tmp_path / "one.json")
