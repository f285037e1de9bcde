"""DriveLM loading: our synthetic folders and hand-written real-format files take one path."""

import json

import pytest
from PIL import Image

from litevlm.cameras import CAMERAS
from litevlm.data.drivelm import (
    Sample,
    infer_closed,
    infer_tag,
    infer_views,
    load_images,
    load_samples,
    resolve_image_path,
    samples_from_frame,
)
from litevlm.data.synthetic import make_frame, render_views, write_dataset
from litevlm.errors import LiteVLMError

SCENE, FRAME = "5e1f0c3a9b7d4e2f8a6c1b0d9e8f7a6b", "0a9b8c7d6e5f44332211ffeeddccbbaa"
T1, T2 = "<c1,CAM_FRONT,812.4,470.0>", "<c2,CAM_BACK_LEFT,402.0,455.5>"


def _qa(q, a, **extra):
    return {"Q": q, "A": a, "C": None, "con_up": None, "con_down": None, "cluster": None, "layer": None, **extra}


def _real_paths():
    return {
        cam: f"../nuscenes/samples/{cam}/n015-2018-07-01-10-00-00+0800__{cam}__15304104000{i}.jpg"
        for i, cam in enumerate(CAMERAS)
    }


def _real_train_json():
    return {
        SCENE: {
            "scene_description": "The ego vehicle waits at a red light.",
            "key_frames": {
                FRAME: {
                    "key_object_infos": {
                        T1: {
                            "Category": "Vehicle",
                            "Status": "Stationary",
                            "Visual_description": "Blue hatchback.",
                            "2d_bbox": [752.0, 430.5, 876.6, 509.5],
                        },
                        T2: {
                            "Category": "Pedestrian",
                            "Status": "Moving",
                            "Visual_description": "Person.",
                            "2d_bbox": [380.2, 390.0, 425.6, 521.0],
                        },
                    },
                    "QA": {
                        "perception": [
                            _qa(
                                "What are the important objects in the current scene? Those objects will be "
                                "considered for the future reasoning and driving decision.",
                                "There is a blue hatchback to the front of the ego vehicle and a person to the back "
                                f"left of the ego vehicle. The IDs of these objects are {T1} and {T2}.",
                            ),
                            _qa(
                                f"What is the moving status of object {T1}? Please select the correct answer from "
                                "the following options: A. Turn left. B. Stopped. C. Going ahead. D. Back up.",
                                "B",
                            ),
                            _qa("Is there any traffic element in the front view?", "No."),
                            _qa(
                                "What are objects to the back left of the ego car?",
                                "There is one pedestrian to the back left of the ego car.",
                            ),
                        ],
                        "prediction": [
                            _qa(
                                "What object should the ego vehicle notice first?",
                                f"Firstly, notice {T1}. Secondly, notice {T2}.",
                            ),
                            _qa(f"Is {T2} a traffic sign or a road barrier?", "No."),
                        ],
                        "planning": [
                            _qa(
                                "In this scenario, what are safe actions to take for the ego vehicle?",
                                "Remain stationary.",
                            )
                        ],
                        "behavior": [
                            _qa(
                                "Predict the behavior of the ego vehicle.",
                                "The ego vehicle is going straight. The ego vehicle is not moving.",
                            )
                        ],
                    },
                    "image_paths": _real_paths(),
                }
            },
        }
    }


@pytest.fixture
def real(tmp_path):
    """A DriveLM training file in challenge/, nuScenes images under a separate root."""
    root = tmp_path / "data"
    for cam, p in _real_paths().items():
        dst = root / "nuscenes" / p[len("../nuscenes/") :]
        dst.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 18), (10, 20, 30)).save(dst)
    path = tmp_path / "challenge" / "train.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_real_train_json()))
    return path, root


def test_write_dataset_round_trip(tmp_path):
    out = write_dataset(tmp_path / "synth", frames=2, seed=5, size=(64, 36), progress=False)
    assert out == tmp_path / "synth" / "drivelm.json" and out.exists()
    samples = load_samples(tmp_path / "synth")
    frames = [make_frame(5, 0), make_frame(5, 1)]
    assert len(samples) == sum(len(f.qas) for f in frames)
    by_frame = [s for s in samples if s.frame_id == frames[1].frame_id]
    for i, (s, qa) in enumerate(zip(by_frame, frames[1].qas)):
        assert s.id == f"{frames[1].scene_id}_{frames[1].frame_id}_{i}"
        assert (s.question, s.answer, s.category, s.tag, s.closed, s.views, s.family) == (
            qa.question,
            qa.answer,
            qa.category,
            qa.tag,
            qa.closed,
            qa.views,
            qa.family,
        )
    s = by_frame[0]
    assert set(s.images) == set(CAMERAS) and s.key_objects == frames[1].key_object_infos()
    imgs = load_images(s)
    assert all(im.size == (64, 36) for im in imgs.values())
    assert imgs["CAM_FRONT"].tobytes() == render_views(frames[1], (64, 36))["CAM_FRONT"].tobytes()
    data = json.loads(out.read_text())
    fr = data[frames[0].scene_id]["key_frames"][frames[0].frame_id]
    assert set(fr["QA"]) == {"perception", "prediction", "planning", "behavior"}
    assert all(
        set(q) >= {"Q", "A", "C", "con_up", "con_down", "cluster", "layer", "tag"} for q in fr["QA"]["perception"]
    )
    assert fr["image_paths"]["CAM_FRONT"] == f"images/CAM_FRONT/{frames[0].frame_id}.png"
    assert "scene_description" in data[frames[0].scene_id]


def test_real_format_loads_with_inferred_fields(real):
    path, root = real
    samples = load_samples(path, images_root=root)
    assert [s.id for s in samples] == [f"{SCENE}_{FRAME}_{i}" for i in range(8)]
    important, mc, front, backleft, notice, sign, safe, beh = samples
    assert (important.tag, important.closed, important.views) == (2, False, CAMERAS)
    assert (mc.tag, mc.closed, mc.views) == (0, True, ("CAM_FRONT",))
    assert (front.tag, front.closed, front.views) == (0, True, ("CAM_FRONT",))
    assert backleft.views == ("CAM_BACK_LEFT",) and backleft.tag == 2
    assert (notice.tag, notice.views) == (3, CAMERAS)
    assert (sign.tag, sign.closed, sign.views) == (0, True, ("CAM_BACK_LEFT",))
    assert (safe.tag, safe.category) == (1, "planning")
    assert beh.category == "behavior" and beh.views == CAMERAS
    assert set(important.key_objects) == {T1, T2}
    imgs = load_images(mc, ["CAM_FRONT", "CAM_BACK"])
    assert set(imgs) == {"CAM_FRONT", "CAM_BACK"} and imgs["CAM_FRONT"].size == (32, 18)
    # Without a root, DriveLM's own "../nuscenes/..." is relative to the JSON's folder.
    no_root = load_samples(path)
    assert no_root[0].images["CAM_FRONT"] == path.parent / _real_paths()["CAM_FRONT"]


def test_test_eval_and_llama_formats(tmp_path, real):
    path, root = real
    data = _real_train_json()
    fr = data[SCENE]["key_frames"][FRAME]
    del fr["key_object_infos"]
    fr["QA"] = {
        "perception": [_qa("What are objects to the front of the ego car?", "", tag=[2])],
        "prediction": [],
        "planning": [_qa("What actions could the ego vehicle take?", "", tag=[1])],
        "behavior": [
            _qa(
                "Predict the behavior of the ego vehicle. Please select the correct answer from the following "
                "options: A. x B. y C. z D. w",
                "",
                tag=[0],
            )
        ],
    }
    p = tmp_path / "test_eval.json"
    p.write_text(json.dumps(data))
    s = load_samples(p, images_root=root)
    assert [x.tag for x in s] == [2, 1, 0] and [x.id[-1] for x in s] == ["0", "1", "2"] and s[2].closed
    llama = [
        {
            "id": f"{SCENE}_{FRAME}_3",
            "image": ["data/" + v[3:] for v in _real_paths().values()],
            "conversations": [
                {"from": "human", "value": "<image>\nIs there any traffic element in the front view?"},
                {"from": "gpt", "value": "No."},
            ],
        }
    ]
    p2 = tmp_path / "test_llama.json"
    p2.write_text(json.dumps(llama))
    (s2,) = load_samples(p2, images_root=root)
    assert (s2.id, s2.frame_id, s2.question, s2.tag, s2.views) == (
        f"{SCENE}_{FRAME}_3",
        FRAME,
        "Is there any traffic element in the front view?",
        0,
        ("CAM_FRONT",),
    )
    assert load_images(s2)["CAM_BACK"].size == (32, 18)


def test_resolve_image_path_tries_common_roots(tmp_path):
    (tmp_path / "samples" / "CAM_FRONT").mkdir(parents=True)
    (tmp_path / "samples" / "CAM_FRONT" / "a.jpg").write_bytes(b"")
    got = resolve_image_path("../nuscenes/samples/CAM_FRONT/a.jpg", tmp_path / "json", tmp_path)
    assert got == tmp_path / "samples" / "CAM_FRONT" / "a.jpg"
    (tmp_path / "CAM_BACK").mkdir()
    (tmp_path / "CAM_BACK" / "b.jpg").write_bytes(b"")
    assert (
        resolve_image_path("../nuscenes/samples/CAM_BACK/b.jpg", tmp_path, tmp_path) == tmp_path / "CAM_BACK" / "b.jpg"
    )


def test_errors_are_clear(tmp_path, real):
    path, root = real
    with pytest.raises(LiteVLMError, match="no DriveLM data"):
        load_samples(tmp_path / "nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": {"key_frames": {}\n, }')
    with pytest.raises(LiteVLMError, match=r"malformed JSON at line 2"):
        load_samples(bad)
    data = _real_train_json()
    fr = data[SCENE]["key_frames"][FRAME]
    fr["image_paths"]["CAM_SIDE"] = fr["image_paths"].pop("CAM_BACK")
    p = tmp_path / "cam.json"
    p.write_text(json.dumps(data))
    with pytest.raises(LiteVLMError, match="unknown camera 'CAM_SIDE'"):
        load_samples(p, images_root=root)
    del fr["image_paths"]["CAM_SIDE"]
    p.write_text(json.dumps(data))
    with pytest.raises(LiteVLMError, match="CAM_BACK are missing"):
        load_samples(p, images_root=root)
    assert len(load_samples(p, images_root=root, require_images=False)) == 8
    data[SCENE]["key_frames"][FRAME]["QA"]["planning"] = [{"Q": "no answer key"}]
    p.write_text(json.dumps(data))
    with pytest.raises(LiteVLMError, match="planning QA 0"):
        load_samples(p, images_root=root, require_images=False)


def test_missing_and_corrupt_images(real):
    path, root = real
    s = load_samples(path, images_root=root)[0]
    s.images["CAM_FRONT"].unlink()
    with pytest.raises(LiteVLMError, match="CAM_FRONT.*not found: .*CAM_FRONT__"):
        load_images(s)
    s.images["CAM_BACK"].write_bytes(b"this is not a jpeg")
    with pytest.raises(LiteVLMError, match="cannot read image .*CAM_BACK__"):
        load_images(s, ["CAM_BACK"])
    with pytest.raises(LiteVLMError, match="unknown camera"):
        load_images(s, ["CAM_TOP"])


def test_inference_helpers():
    assert infer_tag("Is it safe?", "Yes.", "planning") == 0 and infer_closed("Is it safe?", "Yes.")
    assert infer_tag("What actions?", "Brake.", "planning") == 1 and not infer_closed("What actions?", "Brake.")
    assert infer_tag("Notice?", f"{T1} then {T2}", "prediction") == 3
    assert infer_tag("What does it mean?", "Stop.", "prediction") == 2
    assert infer_views(f"Will {T2} be in the moving direction of {T1}?") == ("CAM_FRONT", "CAM_BACK_LEFT")
    assert infer_views("Is there a red truck behind us on the right?") == ("CAM_BACK_RIGHT",)
    assert infer_views("Is it safe for the ego vehicle to turn left?") == CAMERAS


def test_samples_from_frame_in_memory():
    f = make_frame(2, 3)
    imgs = render_views(f, (32, 18))
    samples = samples_from_frame(f, imgs)
    assert [s.question for s in samples] == [q.question for q in f.qas]
    assert isinstance(samples[0], Sample) and samples[0].id.endswith("_0")
    assert load_images(samples[0])["CAM_BACK"].size == (32, 18)
