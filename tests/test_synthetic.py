"""The synthetic world: determinism, geometry, tags, QA balance and views, rendering."""

import collections
import math
import re

import numpy as np
import pytest

from litevlm.cameras import CAMERAS, IMAGE_HEIGHT, IMAGE_WIDTH
from litevlm.data.drivelm import infer_views
from litevlm.data.synthetic import (
    CATEGORIES,
    DIR_PHRASES,
    SceneObject,
    frame_from_objects,
    make_frame,
    question_corpus,
    render_view,
    render_views,
    tag_camera,
)

TAG = re.compile(r"<c(\d+),(CAM_[A-Z_]+),(\d+\.\d),(\d+\.\d)>")
DIRECTION_FAMILIES = (
    "objects_direction",
    "exists_moving",
    "exists_colour",
    "traffic_element",
    "vehicle_colour",
    "vehicle_colour_mc",
    "light_state",
    "light_is",
)
TAG_FAMILIES = (
    "moving_status_mc",
    "is_moving",
    "visual_description",
    "sign_or_barrier",
    "future_state",
    "actions_based_on",
)
SCENE_FAMILIES = (
    "important_objects",
    "notice_one",
    "notice_order",
    "notice_full",
    "safe_actions",
    "behavior",
    "behavior_mc",
)


@pytest.fixture(scope="module")
def frames():
    return [make_frame(0, i) for i in range(200)]


def _changed(img_a, img_b) -> np.ndarray:
    return np.abs(np.asarray(img_a, dtype=np.int16) - np.asarray(img_b, dtype=np.int16)).sum(-1) > 0


def test_make_frame_is_deterministic_per_seed_and_index():
    a, b, c = make_frame(3, 7), make_frame(3, 7), make_frame(3, 8)
    assert [(q.question, q.answer) for q in a.qas] == [(q.question, q.answer) for q in b.qas]
    assert [o.tag for o in a.objects] == [o.tag for o in b.objects]
    assert (a.scene_id, a.frame_id) == (b.scene_id, b.frame_id) and a.frame_id != c.frame_id
    assert [q.question for q in a.qas] != [q.question for q in c.qas]
    ra, rb = render_views(a, (112, 63)), render_views(b, (112, 63))
    assert all(ra[cam].tobytes() == rb[cam].tobytes() for cam in CAMERAS)
    assert make_frame(4, 7).frame_id != a.frame_id


def test_every_frame_has_all_categories_in_drivelm_order(frames):
    for f in frames[:50]:
        cats = [q.category for q in f.qas]
        assert set(cats) == set(CATEGORIES)
        assert cats == sorted(cats, key=CATEGORIES.index)
        assert 3 <= len(f.objects) <= 8
        assert all(q.tag in (0, 1, 2, 3) and q.views for q in f.qas)


def test_world_constraints(frames):
    for f in frames:
        per_cam = collections.Counter(o.camera for o in f.objects)
        assert max(per_cam.values()) <= 3
        assert all(4.0 <= o.distance <= 40.0 for o in f.objects)
    empty_views = sum(len(set(CAMERAS) - {o.camera for o in f.objects}) for f in frames)
    assert empty_views > 0  # some cameras see nothing


def test_tags_are_well_formed_and_match_key_objects(frames):
    for f in frames[:50]:
        infos = f.key_object_infos()
        assert len(infos) == len(f.objects)
        ks = sorted(o.k for o in f.objects)
        assert ks == list(range(1, len(f.objects) + 1))
        for o in f.objects:
            m = TAG.fullmatch(o.tag)
            assert m, o.tag
            cam, u, v = m.group(2), float(m.group(3)), float(m.group(4))
            assert cam == o.camera == tag_camera(o.x, o.y)
            assert 0 <= u < IMAGE_WIDTH and 0 <= v < IMAGE_HEIGHT
            x0, y0, x1, y1 = infos[o.tag]["2d_bbox"]
            assert x0 - 0.1 <= u <= x1 + 0.1 and y0 - 0.1 <= v <= y1 + 0.1
        for qa in f.qas:  # every tag a QA mentions is a key object of the frame
            for t in TAG.finditer(qa.question + " " + qa.answer):
                assert t.group(0) in infos


def test_object_on_a_view_border_appears_in_both_views():
    az = math.radians(27.0)  # CAM_FRONT covers up to +32.25 deg, CAM_FRONT_LEFT from +22.75 deg
    car = SceneObject("car", 15 * math.cos(az), 15 * math.sin(az), heading=0.0, colour="red")
    f = frame_from_objects([car])
    assert car.camera == "CAM_FRONT" and set(car.views) >= {"CAM_FRONT", "CAM_FRONT_LEFT"}
    size = (224, 126)
    for cam in ("CAM_FRONT", "CAM_FRONT_LEFT"):
        diff = _changed(render_view(f, cam, size), render_view(f, cam, size, empty=True))
        assert diff.sum() > 20, cam
    # The shared border is the left edge of CAM_FRONT and the right edge of CAM_FRONT_LEFT.
    assert car.views["CAM_FRONT"].u0 < 100  # left edge of the front view
    assert car.views["CAM_FRONT_LEFT"].u1 > IMAGE_WIDTH - 300  # right edge of the front-left view
    for cam in ("CAM_BACK", "CAM_FRONT_RIGHT"):
        assert not _changed(render_view(f, cam, size), render_view(f, cam, size, empty=True)).any()


def test_distance_sets_size_and_row():
    near = SceneObject("car", 8.0, 0.0, colour="blue")
    far = SceneObject("car", 25.0, 0.0, colour="blue")
    f_near, f_far = frame_from_objects([near]), frame_from_objects([far])
    bn, bf = near.views["CAM_FRONT"], far.views["CAM_FRONT"]
    assert (bn.v1 - bn.v0) > 2 * (bf.v1 - bf.v0) and (bn.u1 - bn.u0) > 2 * (bf.u1 - bf.u0)
    assert bn.v1 > bf.v1 > IMAGE_HEIGHT / 2  # nearer: lower in the image; both below the horizon
    size = (224, 126)
    rows_near = np.nonzero(
        _changed(render_view(f_near, "CAM_FRONT", size), render_view(f_near, "CAM_FRONT", size, True)).any(1)
    )[0]
    rows_far = np.nonzero(
        _changed(render_view(f_far, "CAM_FRONT", size), render_view(f_far, "CAM_FRONT", size, True)).any(1)
    )[0]
    assert rows_near.max() > rows_far.max() and len(rows_near) > 2 * len(rows_far)


def test_yes_no_balanced_per_family(frames):
    counts = collections.defaultdict(collections.Counter)
    for f in frames:
        for qa in f.qas:
            if qa.answer in ("Yes.", "No.", "High.", "Low."):
                counts[qa.family][qa.answer in ("Yes.", "High.")] += 1
    assert {
        "exists_colour",
        "exists_moving",
        "is_moving",
        "traffic_element",
        "sign_or_barrier",
        "in_path",
        "safe_turn",
        "collision",
        "light_is",
    } <= set(counts)
    for fam, c in counts.items():
        n = c[True] + c[False]
        assert n >= 25, fam
        assert 0.35 <= c[True] / n <= 0.65, (fam, dict(c))


def test_multiple_choice_letters_uniform(frames):
    letters = collections.defaultdict(collections.Counter)
    for f in frames:
        for qa in f.qas:
            if "Please select the correct answer" in qa.question:
                assert qa.answer in "ABCD" and len(qa.answer) == 1 and qa.closed and qa.tag == 0
                options = re.findall(r"\b([ABCD])\. ", qa.question)
                assert options == ["A", "B", "C", "D"]
                letters[qa.family][qa.answer] += 1
    assert {"moving_status_mc", "behavior_mc", "vehicle_colour_mc"} <= set(letters)
    for fam, c in letters.items():
        n = sum(c.values())
        assert all(0.15 <= c[x] / n <= 0.35 for x in "ABCD"), (fam, dict(c))


def test_closed_answers_not_guessable_from_question_text(frames):
    # A blind "model": the majority answer for each question text (c-tags reduced to their camera).
    train, test = frames[:150], frames[150:]
    norm = lambda q: TAG.sub(lambda m: m.group(2), q)  # noqa: E731
    table = collections.defaultdict(collections.Counter)
    for f in train:
        for qa in f.qas:
            if qa.closed and qa.family != "behavior_mc":
                table[norm(qa.question)][qa.answer] += 1
    hits = [
        table[norm(qa.question)].most_common(1)[0][0] == qa.answer if table[norm(qa.question)] else False
        for f in test
        for qa in f.qas
        if qa.closed and qa.answer in ("Yes.", "No.")
    ]
    assert len(hits) > 100 and sum(hits) / len(hits) < 0.6


def test_views_follow_the_question(frames):
    seen = collections.Counter()
    for f in frames[:80]:
        for qa in f.qas:
            seen[qa.family] += 1
            if qa.family in SCENE_FAMILIES:
                assert qa.views == CAMERAS
            elif qa.family in TAG_FAMILIES:
                assert qa.views == (TAG.search(qa.question).group(2),)
                assert infer_views(qa.question) == qa.views
            elif qa.family in DIRECTION_FAMILIES:
                assert len(qa.views) == 1
                assert infer_views(qa.question) == qa.views, qa.question
            elif qa.family in ("in_path", "collision"):
                assert qa.views == ("CAM_FRONT",) and TAG.search(qa.question).group(2) == "CAM_FRONT"
            elif qa.family == "safe_turn":
                side = "LEFT" if "left" in qa.question else "RIGHT"
                assert qa.views == (f"CAM_FRONT_{side}", f"CAM_BACK_{side}")
            else:
                raise AssertionError(f"unknown family {qa.family}")
    assert seen["objects_direction"] == 80


def test_direction_phrases_each_name_their_camera():
    for cam, phrases in DIR_PHRASES.items():
        for p in phrases:
            assert infer_views(f"What objects are {p}?") == (cam,), p


def test_behavior_answer_is_canonical_and_follows_the_front_view():
    light = SceneObject("traffic light", 12.0, 1.0, light="red")
    f = frame_from_objects([light, SceneObject("car", -12.0, 3.5, colour="white", heading=math.pi)], road_yaw_deg=0.0)
    beh = next(q for q in f.qas if q.family == "behavior")
    assert beh.answer == "The ego vehicle is going straight. The ego vehicle is not moving."
    light.light = "green"
    g = frame_from_objects([light], road_yaw_deg=-12.0)
    assert (
        next(q for q in g.qas if q.family == "behavior").answer
        == "The ego vehicle is steering to the left. The ego vehicle is driving with normal speed."
    )


def test_render_sizes_empty_flag_and_speed():
    import time

    f = make_frame(1, 0)
    t = time.perf_counter()
    views = render_views(f, (224, 126))
    ms_per_view = (time.perf_counter() - t) * 1000 / 6
    assert list(views) == list(CAMERAS) and all(im.size == (224, 126) and im.mode == "RGB" for im in views.values())
    empty = render_views(f, (224, 126), empty=True)
    assert any(_changed(views[c], empty[c]).any() for c in CAMERAS)
    big = render_view(f, "CAM_FRONT", (1600, 900), empty=True)
    assert (
        big.size == (1600, 900) and len(np.unique(np.asarray(big).reshape(-1, 3), axis=0)) > 3
    )  # sky, verge, road, marks
    print(f"render: {ms_per_view:.2f} ms per view at 224x126")


def test_question_corpus_covers_questions_and_answers():
    texts = question_corpus(n_frames=3, seed=0)
    f = make_frame(0, 0)
    assert f.qas[0].question in texts and f.qas[0].answer in texts
    assert any(TAG.search(t) for t in texts)


def test_render_empty_road_without_a_frame():
    from litevlm.data.synthetic import render_empty_road

    views = render_empty_road((112, 63))
    assert list(views) == list(CAMERAS) and views["CAM_FRONT"].size == (112, 63)
    f = make_frame(0, 1)
    same_road = render_empty_road((112, 63), frame=f)
    assert same_road["CAM_FRONT"].tobytes() == render_view(f, "CAM_FRONT", (112, 63), empty=True).tobytes()
