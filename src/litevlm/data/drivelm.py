"""DriveLM-nuScenes loading: one `Sample` type for the real data and for our synthetic frames.

Reads the training format (scene -> key_frames -> frame with key_object_infos, QA by category,
image_paths), the challenge test/eval format (QA items with "tag"), and the flattened llama-adapter
list (DriveLM's repository documents all three). Sample ids are DriveLM's `<scene>_<frame>_<i>`, with `i` over
perception + prediction + planning + behavior in that order, as the official evaluator rebuilds them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from litevlm.cameras import CAMERAS, check_camera
from litevlm.errors import LiteVLMError

CATEGORIES = ("perception", "prediction", "planning", "behavior")
TAG_RE = re.compile(r"<c\d+,(CAM_[A-Z_]+),(-?\d+(?:\.\d+)?),(-?\d+(?:\.\d+)?)>")
MC_MARK = "Please select the correct answer"


@dataclass
class Sample:
    id: str  # "<scene>_<frame>_<i>"
    question: str
    answer: str
    category: str  # perception | prediction | planning | behavior ("" when the source does not say)
    tag: int  # 0 accuracy, 1 judge, 2 language, 3 match
    closed: bool  # yes/no or multiple choice: scored by exact match
    views: tuple[str, ...]  # cameras needed to answer, in CAMERAS order
    images: dict[str, Path | Image.Image]  # camera -> path (opened lazily by load_images) or image
    frame_id: str
    key_objects: dict = field(default_factory=dict)  # c-tag string -> DriveLM object info
    scene_id: str = ""
    family: str = ""  # our synthetic template family, "" for real data
    # Every metric tag the official evaluation routes this item by: the file's own list, or for a file without
    # tags the official rule (`official_tags`); () = not part of the official evaluation. `tag` is the first one.
    tags: tuple[int, ...] = ()


# ------------------------------------------------------------------------------------------------
# Inference of tag, closedness and views for data that does not carry them
# ------------------------------------------------------------------------------------------------
def infer_tag(question: str, answer: str, category: str) -> int:
    """One metric tag for any QA, guessed from its text: the routing the synthetic benchmarks' `tag` keeps.

    Every item gets a tag here (the rest go to language); the official routing, which leaves items out of
    the score, is `official_tags`.
    """
    if MC_MARK in question or answer.strip() in ("Yes.", "No."):
        return 0
    if "important objects" in question:
        return 2
    if len(TAG_RE.findall(answer)) >= 2:
        return 3
    if category == "planning":
        return 1
    return 2


_PLANNING_KINDS = ("what actions could the ego vehicle take", "lead to a collision", "safe actions")


def official_tags(question: str, answer: str, category: str, key_objects=None) -> tuple[int, ...]:
    """The metric tags DriveLM's challenge gives a QA of a file without tags, by the rule that builds its test set.

    That rule (challenge/extract_data.py and convert_data.py) keeps per frame: the perception answer naming
    every key object's class (here: the "important objects" question, tag 2), the moving-status question
    (tag 0, made multiple choice), the prediction answer holding every key object's c-tag (tag 3), a yes/no
    prediction question (tag 0), the three planning questions "What actions could the ego vehicle take",
    "... lead to a collision" and "... safe actions" (tag 1), and every behavior question (tag 0, made
    multiple choice). Here each item of those kinds is tagged (the rule keeps the first of a kind per
    frame); any other item gets () and is not part of the official score. `category` "" (llama files) is
    read from the question; without `key_objects` a tag-3 answer is one holding two or more c-tags.
    """
    q, a = question.lower(), answer.strip()
    if "what is the moving status of object" in q or MC_MARK in question:
        return (0,)
    if category == "behavior" or q.startswith("predict the behavior of the ego vehicle"):
        return (0,)
    if category in ("planning", "") and any(kind in q for kind in _PLANNING_KINDS):
        return (1,)
    if category in ("perception", "") and "important objects" in q:
        return (2,)
    if category in ("prediction", ""):
        if key_objects:
            if all(k.lower() in a.lower() for k in key_objects):
                return (3,)
        elif len(TAG_RE.findall(a)) >= 2:
            return (3,)
        if a in ("Yes.", "No."):
            return (0,)
    return ()


def infer_closed(question: str, answer: str) -> bool:
    return MC_MARK in question or answer.strip() in ("Yes.", "No.")


_SIDE = {"left": "_LEFT", "right": "_RIGHT"}
# Leftmost-longest matters: "to the front left" must not be read as "front" then stop.
_DIR_RE = re.compile(
    r"\bcam_(?P<cam_end>front|back)(?:_(?P<cam_side>left|right))?\b"
    r"|\bon the (?P<side_first>left|right)(?:[ -]hand)? side (?P<side_where>ahead|behind)\b"
    r"|\b(?P<rel>ahead|behind)(?: of)?(?: us| the ego (?:car|vehicle))?(?:,? (?:on|to) the (?P<rel_side>left|right))?\b"
    r"|\b(?P<end>front|back|rear)(?:[ -](?P<side>left|right))?\b"
)


def infer_views(question: str) -> tuple[str, ...]:
    """Cameras a question needs, read lexically: c-tags, camera names, direction phrases, else all six.

    A deliberately simple rule (the learned ViewSelector lives in litevlm.select.views): c-tags win;
    otherwise DriveLM's direction phrases ("to the back left of the ego car", "front view") and common
    variants ("behind us on the right", "ahead on the left", "rear camera"); scene-wide questions
    name no camera and need every view.
    """
    tags = [cam for cam, _, _ in TAG_RE.findall(question)]
    if tags:
        return tuple(c for c in CAMERAS if c in tags)
    text = question.split(MC_MARK)[0].lower()  # options ("Back up.", "Going ahead.") are not directions
    found = set()
    for m in _DIR_RE.finditer(text):
        g = m.groupdict()
        if g["cam_end"]:
            end, side = g["cam_end"], g["cam_side"]
        elif g["side_first"]:
            end, side = ("front" if g["side_where"] == "ahead" else "back"), g["side_first"]
        elif g["rel"]:
            end, side = ("front" if g["rel"] == "ahead" else "back"), g["rel_side"]
        else:
            end, side = g["end"], g["side"]
        found.add(("CAM_FRONT" if end == "front" else "CAM_BACK") + _SIDE.get(side or "", ""))
    return tuple(c for c in CAMERAS if c in found) or CAMERAS


# ------------------------------------------------------------------------------------------------
# Paths
# ------------------------------------------------------------------------------------------------
def resolve_image_path(raw: str, base: Path, images_root: Path | None) -> Path:
    """Where an image path from a DriveLM file lives on this machine.

    Without `images_root` the path is taken relative to the JSON's folder (what DriveLM's own "../nuscenes/..."
    means). With it, leading "../" and "data/" are stripped and root/path, root/nuscenes/..., root/samples/...
    and root/<CAM>/... are tried in turn; the first that exists wins (else the first candidate).
    """
    p = Path(raw)
    if p.is_absolute():
        return p
    if images_root is None:
        return base / p
    parts = [q for q in p.parts if q not in ("..", ".")]
    if parts and parts[0] == "data":
        parts = parts[1:]
    rel = Path(*parts) if parts else Path()
    candidates = [images_root / rel]
    for prefix in ("nuscenes", "samples"):
        if prefix in parts:
            candidates.append(images_root / Path(*parts[parts.index(prefix) + 1 :]))
    if "nuscenes" not in parts:
        candidates.append(images_root / "nuscenes" / rel)
    if "samples" not in parts:
        candidates.append(images_root / "samples" / rel)
    return next((c for c in candidates if c.exists()), candidates[0])


def _frame_images(
    image_paths, where: str, base: Path, images_root: Path | None, require_images: bool
) -> dict[str, Path]:
    if image_paths is None:
        if require_images:
            raise LiteVLMError(f"{where}: no image_paths (pass require_images=False to load questions only)")
        return {}
    if isinstance(image_paths, list):  # llama format: the six paths in CAMERAS order
        if len(image_paths) != len(CAMERAS):
            raise LiteVLMError(
                f"{where}: expected {len(CAMERAS)} image paths (one per camera), found {len(image_paths)}"
            )
        image_paths = dict(zip(CAMERAS, image_paths))
    if not isinstance(image_paths, dict):
        raise LiteVLMError(f"{where}: image_paths must map camera names to paths")
    for cam in image_paths:
        try:
            check_camera(cam)
        except LiteVLMError as e:
            raise LiteVLMError(f"{where}: {e}") from None
    missing = [c for c in CAMERAS if c not in image_paths]
    if missing and require_images:
        raise LiteVLMError(f"{where}: images for {', '.join(missing)} are missing; a frame needs all six cameras")
    return {c: resolve_image_path(str(image_paths[c]), base, images_root) for c in CAMERAS if c in image_paths}


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
def _read_json(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise LiteVLMError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LiteVLMError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def _sample(scene: str, frame: str, i: int, item, category: str, images, key_objects, where: str) -> Sample:
    if not isinstance(item, dict) or "Q" not in item or "A" not in item:
        raise LiteVLMError(f"{where}: a QA item needs 'Q' and 'A' keys")
    q, a = str(item["Q"]), str(item["A"] or "")
    given = item.get("tag")
    if given is None:
        tags = official_tags(q, a, category, key_objects)
        tag = infer_tag(q, a, category)
    else:
        raw = given if isinstance(given, list) else [given]
        try:
            tags = tuple(int(t) for t in raw)
        except (TypeError, ValueError):
            raise LiteVLMError(f"{where}: tag must be 0, 1, 2, 3 or a list of them, got {given!r}") from None
        if not tags or any(t not in (0, 1, 2, 3) for t in tags):
            raise LiteVLMError(f"{where}: tag must be 0, 1, 2, 3 or a list of them, got {given!r}")
        tag = tags[0]
    closed = bool(item["closed"]) if "closed" in item else infer_closed(q, a)
    if "views" in item:
        try:
            views = tuple(c for c in CAMERAS if c in {check_camera(v) for v in item["views"]})
        except LiteVLMError as e:
            raise LiteVLMError(f"{where}: {e}") from None
    else:
        views = infer_views(q)
    return Sample(
        f"{scene}_{frame}_{i}",
        q,
        a,
        category,
        tag,
        closed,
        views,
        dict(images),
        frame,
        key_objects,
        scene,
        str(item.get("family", "")),
        tags,
    )


def _from_nested(data: dict, base: Path, images_root: Path | None, require_images: bool, src: Path) -> list[Sample]:
    out: list[Sample] = []
    for scene, sc in data.items():
        if not isinstance(sc, dict) or not isinstance(sc.get("key_frames"), dict):
            raise LiteVLMError(f"{src}: scene {scene!r} has no 'key_frames' object; is this a DriveLM-nuScenes file?")
        for frame, fr in sc["key_frames"].items():
            where = f"{src}: scene {scene}, frame {frame}"
            if not isinstance(fr, dict) or not isinstance(fr.get("QA"), dict):
                raise LiteVLMError(f"{where}: no 'QA' object")
            images = _frame_images(fr.get("image_paths"), where, base, images_root, require_images)
            key_objects = fr.get("key_object_infos") or {}
            i = 0
            for cat in CATEGORIES:
                items = fr["QA"].get(cat) or []
                if not isinstance(items, list):
                    raise LiteVLMError(f"{where}: QA[{cat!r}] must be a list")
                for j, item in enumerate(items):
                    out.append(_sample(scene, frame, i, item, cat, images, key_objects, f"{where}, {cat} QA {j}"))
                    i += 1
    return out


def _from_llama(data: list, base: Path, images_root: Path | None, require_images: bool, src: Path) -> list[Sample]:
    out: list[Sample] = []
    for n, item in enumerate(data):
        where = f"{src}: item {n}"
        try:
            turns = item["conversations"]
            q = (
                next(t["value"] for t in turns if t["from"] == "human")
                .replace("<image>\n", "")
                .replace("<image>", "")
                .strip()
            )
            a = next((t["value"] for t in turns if t["from"] == "gpt"), "")
            scene, frame, _ = str(item["id"]).rsplit("_", 2)
        except (KeyError, TypeError, ValueError, StopIteration):
            raise LiteVLMError(
                f"{where}: expected id 'scene_frame_i' and human/gpt conversations (llama format)"
            ) from None
        images = _frame_images(item.get("image"), where, base, images_root, require_images)
        category = "behavior" if "behavior of the ego vehicle" in q else ""
        s = _sample(scene, frame, 0, {"Q": q, "A": a}, category, images, {}, where)
        s.id = str(item["id"])
        out.append(s)
    return out


def load_samples(path, images_root=None, require_images: bool = True) -> list[Sample]:
    """All QA samples of a DriveLM file or of a folder written by `write_dataset` (its drivelm.json).

    `images_root` is where real nuScenes images live (paths like "../nuscenes/samples/CAM_FRONT/x.jpg"
    are resolved against it); without it paths are relative to the JSON file's folder. Images are not
    opened here: `load_images(sample)` does that.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "drivelm.json"
    if not p.exists():
        raise LiteVLMError(f"no DriveLM data at {p}: give a DriveLM JSON file or a folder made by `litevlm data synth`")
    root = Path(images_root) if images_root is not None else None
    if root is not None and not root.is_dir():
        raise LiteVLMError(f"images root {root} is not a folder")
    data = _read_json(p)
    if isinstance(data, dict):
        return _from_nested(data, p.parent, root, require_images, p)
    if isinstance(data, list):
        return _from_llama(data, p.parent, root, require_images, p)
    raise LiteVLMError(f"{p}: expected a JSON object (scenes) or list (llama format), found {type(data).__name__}")


def load_images(sample: Sample, cameras=None) -> dict[str, Image.Image]:
    """The sample's images (all, or `cameras` only) as RGB PIL images; a missing or unreadable file is an error."""
    out = {}
    for cam in cameras if cameras is not None else sample.images:
        check_camera(cam)
        if cam not in sample.images:
            raise LiteVLMError(f"sample {sample.id} has no image for {cam}")
        src = sample.images[cam]
        if isinstance(src, Image.Image):
            out[cam] = src.convert("RGB") if src.mode != "RGB" else src
            continue
        try:
            with Image.open(src) as im:
                out[cam] = im.convert("RGB")
        except FileNotFoundError:
            raise LiteVLMError(f"image for {cam} of sample {sample.id} not found: {src}") from None
        except (UnidentifiedImageError, OSError) as e:
            raise LiteVLMError(f"cannot read image {src} ({cam} of sample {sample.id}): {e}") from None
    return out


def samples_from_frame(frame, images: dict[str, Image.Image] | None = None) -> list[Sample]:
    """A synthetic Frame's QA as Samples without touching the disk (images: e.g. render_views(frame, size))."""
    key_objects = frame.key_object_infos()
    return [
        Sample(
            f"{frame.scene_id}_{frame.frame_id}_{i}",
            qa.question,
            qa.answer,
            qa.category,
            qa.tag,
            qa.closed,
            qa.views,
            dict(images or {}),
            frame.frame_id,
            key_objects,
            frame.scene_id,
            qa.family,
            (qa.tag,),
        )
        for i, qa in enumerate(frame.qas)
    ]
