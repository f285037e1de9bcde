"""Synthetic six-camera driving frames with DriveLM-style question answering.

A seeded bird's-eye world (vehicles, pedestrians, cyclists, traffic lights, signs, cones, barriers
around the ego car) is projected into the six nuScenes views with a yaw-only pinhole model
(nuScenes camera yaws and fields of view), drawn with flat shapes, and given perception / prediction /
planning / behavior QA whose answers can be read from the pixels of the views each question names.
`write_dataset` writes the DriveLM-nuScenes training JSON, so synthetic and real data share one loader.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from litevlm.cameras import CAMERAS, DIRECTION, HFOV_DEG, IMAGE_HEIGHT, IMAGE_WIDTH, YAW_DEG, focal_px
from litevlm.errors import LiteVLMError

# ------------------------------------------------------------------------------------------------
# The world's vocabulary
# ------------------------------------------------------------------------------------------------
VEHICLES = ("car", "truck", "bus", "van")
MOVERS = VEHICLES + ("pedestrian", "cyclist")
TRAFFIC_ELEMENTS = ("traffic light", "sign")
CLASSES = MOVERS + TRAFFIC_ELEMENTS + ("cone", "barrier")
PLURAL = {
    "car": "cars",
    "truck": "trucks",
    "bus": "buses",
    "van": "vans",
    "pedestrian": "pedestrians",
    "cyclist": "cyclists",
}
# Clearly distinct hues: colour questions must be answerable from a few pixels.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (205, 35, 35),
    "blue": (35, 75, 215),
    "green": (40, 165, 60),
    "yellow": (240, 210, 40),
    "white": (242, 242, 242),
    "black": (22, 22, 26),
}
LIGHT_STATES = ("red", "yellow", "green")
SIGN_KINDS = ("stop", "speed limit", "yield", "crossing")
SIGN_NAMES = {
    "stop": "stop sign",
    "speed limit": "speed limit sign",
    "yield": "yield sign",
    "crossing": "pedestrian crossing sign",
}
# DriveLM's moving statuses that have a visual cue here (Reverse parking / Drive backward do not).
MOVING_STATUSES = ("Going ahead", "Turn left", "Turn right", "Stopped", "Back up")
STEERS = (
    "steering to the left",
    "slightly steering to the left",
    "going straight",
    "slightly steering to the right",
    "steering to the right",
)
# Road direction in the ego frame per steering class: steering left turns the ego car's nose left
# of the road, so the road (and its vanishing point) swings to the right (negative yaw).
STEER_ROAD_YAW = (-12.0, -5.0, 0.0, 5.0, 12.0)
SPEEDS = ("not moving", "driving slowly", "driving with normal speed")
SPEED_MPS = {"not moving": 0.0, "driving slowly": 3.0, "driving with normal speed": 8.0}
BEHAVIORS = tuple(f"The ego vehicle is {s}. The ego vehicle is {v}." for s in STEERS for v in SPEEDS)
CATEGORIES = ("perception", "prediction", "planning", "behavior")
# Template families of the generated QA (QA.family), by category.
FAMILIES = (
    "important_objects",
    "objects_direction",
    "exists_colour",
    "exists_moving",
    "traffic_element",
    "light_is",
    "light_state",
    "vehicle_colour",
    "vehicle_colour_mc",
    "visual_description",
    "sign_or_barrier",
    "future_state",
    "moving_status_mc",
    "is_moving",
    "in_path",
    "collision",
    "notice_one",
    "notice_order",
    "notice_full",
    "actions_based_on",
    "safe_actions",
    "safe_turn",
    "behavior",
    "behavior_mc",
)
FRAMES_PER_SCENE = 4  # DriveLM annotates 4-8 key frames per scene

# (length along heading, width, height) in metres. Billboards (drawn facing the camera) use width only.
SIZE = {
    "car": (4.5, 1.9, 1.5),
    "van": (5.0, 2.0, 2.2),
    "truck": (7.5, 2.5, 3.4),
    "bus": (11.0, 2.6, 3.1),
    "cyclist": (1.7, 0.6, 1.75),
    "pedestrian": (0.55, 0.55, 1.75),
    "traffic light": (0.6, 0.6, 4.0),
    "sign": (0.9, 0.9, 2.7),
    "cone": (0.5, 0.5, 0.75),
    "barrier": (2.0, 2.0, 1.0),
}
BILLBOARD = ("pedestrian", "traffic light", "sign", "cone", "barrier")
# Vertical extent of the 2D box (DriveLM boxes a traffic light's housing and a sign's face, not the pole).
BOX_Z = {"traffic light": (2.9, 4.0), "sign": (1.8, 2.7)}
# Distance ranges (m). CAM_BACK's wider lens makes things smaller, so its ranges are shortened.
RANGE = {
    "car": (6, 30),
    "van": (6, 30),
    "truck": (7, 32),
    "bus": (8, 32),
    "pedestrian": (4, 20),
    "cyclist": (5, 22),
    "traffic light": (7, 25),
    "sign": (5, 20),
    "cone": (4, 16),
    "barrier": (4, 18),
}
NEAR_M = 16.0  # "close": behaviour and collision rules; front objects avoid a band around it
FRONT_GAP = (13.0, 19.0)
LANE_HALF = 1.6  # an object whose centre is this close to the ego lane's axis is "in the path"
LANE_GAP = (1.6, 2.8)  # front objects avoid this lateral band, so in-lane is never a judgement call
H_CAM = 1.55  # camera height (m)
NEAR_PLANE = 0.5
CX, CY = IMAGE_WIDTH / 2, IMAGE_HEIGHT / 2

SKY, ROAD, VERGE, MARK = (172, 204, 236), (92, 92, 98), (150, 144, 132), (236, 236, 236)
WINDOW, TYRE, DARK = (48, 58, 72), (15, 15, 15), (35, 35, 38)
SKIN, LEGS, ORANGE = (228, 186, 150), (48, 48, 72), (255, 135, 0)
MC_SUFFIX = " Please select the correct answer from the following options:"


# ------------------------------------------------------------------------------------------------
# Data types
# ------------------------------------------------------------------------------------------------
@dataclass
class QA:
    question: str
    answer: str
    category: str  # perception | prediction | planning | behavior
    tag: int  # DriveLM metric routing: 0 accuracy, 1 judge, 2 language, 3 match
    closed: bool  # yes/no (or Low/High) and multiple choice: exact-match answers
    views: tuple[str, ...]  # the cameras needed to answer, in CAMERAS order
    family: str = ""  # which template family made it (for per-family accuracy and balance)


@dataclass(frozen=True)
class ViewBox:
    """An object's projection into one camera, in 1600x900 pixels, not clipped."""

    u0: float
    v0: float
    u1: float
    v1: float
    depth: float  # forward distance of the nearest face (m): sets size and row
    uc: float  # projection of the object's centre
    v_ground: float  # image row of the object's foot (poles reach down to it)

    def clipped(self) -> tuple[float, float, float, float]:
        return clip_box((self.u0, self.v0, self.u1, self.v1))


def clip_box(box: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    """A (u0, v0, u1, v1) box in 1600x900 pixels cut to the image (it may come out empty: u1 <= u0)."""
    u0, v0, u1, v1 = box
    return (max(u0, 0.0), max(v0, 0.0), min(u1, IMAGE_WIDTH - 0.1), min(v1, IMAGE_HEIGHT - 0.1))


@dataclass
class SceneObject:
    """One object in the ego frame (x forward, y left, metres; heading radians, counter-clockwise)."""

    cls: str
    x: float
    y: float
    heading: float = 0.0
    colour: str | None = None  # vehicles; shirt colour of pedestrians and cyclists
    motion: str = "Stopped"  # vehicles: a MOVING_STATUSES entry; pedestrians/cyclists: Going ahead | Stopped
    light: str | None = None  # traffic lights: red | yellow | green
    sign: str | None = None  # signs: a SIGN_KINDS entry
    elevation: float = 0.0  # traffic lights and signs: housing / face raised (or lowered) on its pole, m
    # Filled in by frame_from_objects:
    k: int = 0
    camera: str = ""
    tag: str = ""
    views: dict[str, ViewBox] = field(default_factory=dict)

    @property
    def distance(self) -> float:
        return math.hypot(self.x, self.y)

    @property
    def azimuth(self) -> float:
        return math.degrees(math.atan2(self.y, self.x))

    @property
    def moving(self) -> bool:
        return self.cls in MOVERS and self.motion != "Stopped"

    @property
    def status(self) -> str | None:
        if self.cls in TRAFFIC_ELEMENTS:
            return None
        return "Moving" if self.moving else "Stationary"

    @property
    def category(self) -> str:
        return {
            "pedestrian": "Pedestrian",
            "cyclist": "Cyclist",
            "traffic light": "Traffic element",
            "sign": "Traffic element",
            "cone": "Barrier",
            "barrier": "Barrier",
        }.get(self.cls, "Vehicle")

    def noun(self) -> str:
        """Short noun phrase with article: 'a red car', 'a green light', 'a stop sign'."""
        if self.cls in VEHICLES:
            return f"a {self.colour} {self.cls}"
        if self.cls == "traffic light":
            return f"a {self.light} light"
        if self.cls == "sign":
            return f"a {SIGN_NAMES[self.sign]}"
        return {"cone": "a traffic cone", "barrier": "a road barrier"}.get(self.cls, f"a {self.cls}")

    def description(self) -> str:
        """DriveLM's Visual_description: 'Red car.', 'Pedestrian in a blue shirt.'."""
        if self.cls in ("pedestrian", "cyclist"):
            return f"{self.cls.capitalize()} in a {self.colour} shirt."
        text = self.noun().split(" ", 1)[1]
        return text[0].upper() + text[1:] + "."

    def bbox(self) -> list[float]:
        """[x_min, y_min, x_max, y_max] in the tag camera, clipped to the 1600x900 image."""
        return [round(c, 1) for c in self.views[self.camera].clipped()]

    def boxes(self) -> dict[str, list[float]]:
        """The clipped box in each camera that sees part of the object."""
        return {c: [round(x, 1) for x in b.clipped()] for c, b in self.views.items()}


@dataclass(frozen=True)
class Ego:
    road_yaw_deg: float  # direction of the road in the ego frame; its vanishing point shows the steering
    steer: str
    speed: str
    cause: str  # why the speed is what it is ("red light", "clear road", ...)

    @property
    def speed_mps(self) -> float:
        return SPEED_MPS[self.speed]

    @property
    def steering_deg(self) -> float:
        return -self.road_yaw_deg  # left positive

    @property
    def behavior(self) -> str:
        return f"The ego vehicle is {self.steer}. The ego vehicle is {self.speed}."


@dataclass
class Frame:
    scene_id: str
    frame_id: str
    objects: list[SceneObject]
    qas: list[QA]
    ego: Ego

    def key_object_infos(self) -> dict[str, dict]:
        """DriveLM's key_object_infos (c-tag -> Category, Status, Visual_description, 2d_bbox in the tag's
        camera), plus our "2d_bboxes": the clipped box in every camera that shows part of the object."""
        return {
            o.tag: {
                "Category": o.category,
                "Status": o.status,
                "Visual_description": o.description(),
                "2d_bbox": o.bbox(),
                "2d_bboxes": o.boxes(),
            }
            for o in sorted(self.objects, key=lambda o: o.k)
        }

    def qa_by_category(self) -> dict[str, list[QA]]:
        return {c: [q for q in self.qas if q.category == c] for c in CATEGORIES}

    def to_drivelm(self, image_paths: dict[str, str]) -> dict:
        """This frame as a DriveLM-nuScenes key frame, plus our keys: tag, views, closed, family."""
        qa = {
            c: [
                {
                    "Q": q.question,
                    "A": q.answer,
                    "C": None,
                    "con_up": None,
                    "con_down": None,
                    "cluster": None,
                    "layer": None,
                    "tag": [q.tag],
                    "views": list(q.views),
                    "closed": q.closed,
                    "family": q.family,
                }
                for q in qs
            ]
            for c, qs in self.qa_by_category().items()
        }
        return {
            "key_object_infos": self.key_object_infos(),
            "QA": qa,
            "image_paths": dict(image_paths),
            "ego": {
                "speed_mps": self.ego.speed_mps,
                "steering_deg": round(self.ego.steering_deg, 2),
                "behavior": self.ego.behavior,
            },
        }


# ------------------------------------------------------------------------------------------------
# Geometry
# ------------------------------------------------------------------------------------------------
def _wrap(deg: float) -> float:
    return (deg + 180.0) % 360.0 - 180.0


def tag_camera(x: float, y: float) -> str:
    """The camera whose optical axis is nearest the point, among those whose image contains it."""
    az = math.degrees(math.atan2(y, x))
    inside = [(abs(_wrap(az - YAW_DEG[c])), c) for c in CAMERAS if abs(_wrap(az - YAW_DEG[c])) < HFOV_DEG[c] / 2]
    return min(inside)[1]


def _to_cam(cam: str, x: float, y: float) -> tuple[float, float]:
    """(forward, left) coordinates of an ego-frame ground point in the camera's frame."""
    yaw = math.radians(YAW_DEG[cam])
    c, s = math.cos(yaw), math.sin(yaw)
    return x * c + y * s, -x * s + y * c


def _road(psi_deg: float, x: float, y: float) -> tuple[float, float]:
    """(along, across) coordinates in the road frame whose axis runs through the ego car at yaw psi."""
    p = math.radians(psi_deg)
    return x * math.cos(p) + y * math.sin(p), -x * math.sin(p) + y * math.cos(p)


def _from_road(psi_deg: float, xr: float, yr: float) -> tuple[float, float]:
    p = math.radians(psi_deg)
    return xr * math.cos(p) - yr * math.sin(p), xr * math.sin(p) + yr * math.cos(p)


def _footprint(o: SceneObject) -> list[tuple[float, float]]:
    L, W, _ = SIZE[o.cls]
    if o.cls in BILLBOARD:
        return [(o.x, o.y)]
    hx, hy = math.cos(o.heading), math.sin(o.heading)
    return [
        (o.x + a * L / 2 * hx - b * W / 2 * hy, o.y + a * L / 2 * hy + b * W / 2 * hx) for a in (-1, 1) for b in (-1, 1)
    ]


def project(o: SceneObject, cam: str) -> ViewBox | None:
    """The object's box in `cam` (1600x900 pixels), or None when no part of it is in the image."""
    fx = focal_px(cam)
    fc, lc = _to_cam(cam, o.x, o.y)
    _, W, H = SIZE[o.cls]
    if o.cls in BILLBOARD:
        if fc < NEAR_PLANE:
            return None
        uc = CX - fx * lc / fc
        u0, u1, depth = uc - fx * W / 2 / fc, uc + fx * W / 2 / fc, fc
    else:
        pts = [_to_cam(cam, px, py) for px, py in _footprint(o)]
        if max(f for f, _ in pts) < NEAR_PLANE:
            return None
        # Corners behind the camera are pulled onto the near plane: they land far outside the image,
        # which is where the clipped box must extend anyway.
        us = [CX - fx * lat / max(f, NEAR_PLANE) for f, lat in pts]
        u0, u1 = min(us), max(us)
        depth = max(NEAR_PLANE, min(f for f, _ in pts))
        uc = CX - fx * lc / fc if fc >= NEAR_PLANE else (u0 + u1) / 2
    z0, z1 = (z + o.elevation for z in BOX_Z[o.cls]) if o.cls in BOX_Z else (0.0, H)
    v0, v1 = CY + fx * (H_CAM - z1) / depth, CY + fx * (H_CAM - z0) / depth
    if u1 <= 0 or u0 >= IMAGE_WIDTH or v1 <= 0 or v0 >= IMAGE_HEIGHT:
        return None
    return ViewBox(u0, v0, u1, v1, depth, uc, CY + fx * H_CAM / depth)


def _angular_interval(o: SceneObject) -> tuple[float, float]:
    """Azimuth span (degrees) seen from the ego car, widened for a moving object's trail."""
    az = o.azimuth
    if o.cls in BILLBOARD:
        half = math.degrees(math.atan2(SIZE[o.cls][1] / 2, o.distance))
        lo, hi = az - half, az + half
    else:
        rel = [_wrap(math.degrees(math.atan2(py, px)) - az) for px, py in _footprint(o)]
        lo, hi = az + min(rel), az + max(rel)
    if o.moving:  # the trail is drawn up to one object-width beside it
        w = hi - lo
        lo, hi = lo - w, hi + w
    return lo, hi


def _overlaps(a: tuple[float, float], b: tuple[float, float], margin: float = 1.5) -> bool:
    ca, cb = (a[0] + a[1]) / 2, (b[0] + b[1]) / 2
    return abs(_wrap(ca - cb)) < (a[1] - a[0]) / 2 + (b[1] - b[0]) / 2 + margin


# ------------------------------------------------------------------------------------------------
# World sampling
# ------------------------------------------------------------------------------------------------
_CLASS_PRIOR = {
    "vehicle": 0.42,
    "pedestrian": 0.14,
    "cyclist": 0.10,
    "traffic light": 0.10,
    "sign": 0.10,
    "cone": 0.07,
    "barrier": 0.07,
}
_CAM_PRIOR = {
    "CAM_FRONT": 0.3,
    "CAM_FRONT_LEFT": 0.14,
    "CAM_FRONT_RIGHT": 0.14,
    "CAM_BACK": 0.14,
    "CAM_BACK_LEFT": 0.14,
    "CAM_BACK_RIGHT": 0.14,
}


def _choice(rng: np.random.Generator, items):
    items = list(items)
    return items[int(rng.integers(len(items)))]


def _weighted(rng: np.random.Generator, prior: dict):
    keys = list(prior)
    return keys[int(rng.choice(len(keys), p=np.array(list(prior.values())) / sum(prior.values())))]


def _sample_class(rng: np.random.Generator) -> str:
    c = _weighted(rng, _CLASS_PRIOR)
    return _choice(rng, VEHICLES) if c == "vehicle" else c


def _in_path(o: SceneObject, psi: float) -> bool:
    xr, yr = _road(psi, o.x, o.y)
    return o.camera == "CAM_FRONT" and xr > 0 and abs(yr) < LANE_HALF


def _new_object(
    rng: np.random.Generator, cls: str, cam: str, psi: float, in_lane: bool = False, near: bool | None = None
) -> SceneObject | None:
    """One object of class `cls` whose centre lies in `cam` only (never in an overlap with a neighbour)."""
    lo, hi = RANGE[cls]
    if cam == "CAM_BACK":
        hi = lo + 0.7 * (hi - lo)
    if cam == "CAM_FRONT" and near is not None:
        lo, hi = (lo, min(hi, FRONT_GAP[0])) if near else (max(lo, FRONT_GAP[1]), hi)
        if lo >= hi:
            return None
    d = float(rng.uniform(lo, hi))
    if in_lane:
        x, y = _from_road(psi, d, float(rng.uniform(-1.0, 1.0)))
    elif cam == "CAM_FRONT" and rng.random() < 0.5:
        # The neighbouring lanes: beside the path but at the same image positions as in-lane objects
        # of other road directions, so a c-tag's coordinates alone do not say "in the path".
        x, y = _from_road(psi, d, float(rng.choice([-1.0, 1.0]) * rng.uniform(LANE_GAP[1] + 0.1, 5.5)))
    else:
        half = HFOV_DEG[cam] / 2 - 2.0
        az = YAW_DEG[cam] + float(rng.uniform(-half, half))
        x, y = d * math.cos(math.radians(az)), d * math.sin(math.radians(az))
    o = SceneObject(cls, x, y)
    o.camera = tag_camera(x, y)
    az = o.azimuth
    if o.camera != cam or any(abs(_wrap(az - YAW_DEG[c])) < HFOV_DEG[c] / 2 + 2.0 for c in CAMERAS if c != cam):
        return None  # centre in an overlap: which camera it belongs to would be a judgement call
    if cam == "CAM_FRONT":
        xr, yr = _road(psi, x, y)
        if FRONT_GAP[0] < o.distance < FRONT_GAP[1] or LANE_GAP[0] <= abs(yr) <= LANE_GAP[1]:
            return None
    if cls in VEHICLES:
        o.colour = _choice(rng, COLOURS)
        o.motion = _choice(rng, MOVING_STATUSES)
        base = psi if (in_lane or rng.random() < 0.5) else psi + 180.0
        turn = {"Turn left": 22.0, "Turn right": -22.0}.get(o.motion, 0.0)
        o.heading = math.radians(base + turn + float(rng.uniform(-4, 4)))
    elif cls in ("pedestrian", "cyclist"):
        o.colour = _choice(rng, COLOURS)
        o.motion = "Going ahead" if rng.random() < 0.5 else "Stopped"
        o.heading = (
            math.radians(psi + _choice(rng, (0.0, 180.0)) + float(rng.uniform(-10, 10)))
            if cls == "cyclist"
            else float(rng.uniform(-math.pi, math.pi))
        )
    elif cls == "traffic light":
        o.light = _choice(rng, LIGHT_STATES)
        o.elevation = float(rng.uniform(-0.6, 0.4))
    elif cls == "sign":
        o.sign = _choice(rng, SIGN_KINDS)
        o.elevation = float(rng.uniform(-0.5, 0.7))  # pole heights vary: a tag's row alone does not say "sign"
    elif cls == "barrier":
        o.heading = math.radians(psi + 90.0)
    return o


def derive_speed(objects: list[SceneObject], psi: float) -> tuple[str, str]:
    """The ego speed class and its cause, from what the front view shows (first rule that fires)."""
    front = [o for o in objects if o.camera == "CAM_FRONT"]
    path = [o for o in front if _in_path(o, psi) and o.distance < NEAR_M]
    if any(o.cls == "traffic light" and o.light == "red" for o in front):
        return "not moving", "red light"
    if any(o.cls == "sign" and o.sign == "stop" and o.distance < NEAR_M for o in front):
        return "not moving", "stop sign"
    if any(o.cls in ("pedestrian", "cyclist") for o in path):
        return "not moving", "road user in the path"
    if any(o.cls == "traffic light" and o.light == "yellow" for o in front):
        return "driving slowly", "yellow light"
    if path:
        return "driving slowly", "obstacle in the path"
    if any(o.cls in ("pedestrian", "cyclist") for o in front):
        return "driving slowly", "road user ahead"
    return "driving with normal speed", "clear road"


def _cause_object(rng: np.random.Generator, speed: str, psi: float) -> SceneObject | None:
    """An object in the front view that makes the ego car drive at `speed` (so speed classes are balanced)."""
    for _ in range(20):
        kind = int(rng.integers(3))
        if speed == "not moving":
            o = [
                lambda: _new_object(rng, "traffic light", "CAM_FRONT", psi),
                lambda: _new_object(rng, "sign", "CAM_FRONT", psi, near=True),
                lambda: _new_object(
                    rng, _choice(rng, ("pedestrian", "cyclist")), "CAM_FRONT", psi, in_lane=True, near=True
                ),
            ][kind]()
            if o is not None and o.cls == "traffic light":
                o.light = "red"
            if o is not None and o.cls == "sign":
                o.sign = "stop"
        elif speed == "driving slowly":
            o = [
                lambda: _new_object(rng, "traffic light", "CAM_FRONT", psi),
                lambda: _new_object(
                    rng, _choice(rng, VEHICLES + ("cone", "barrier")), "CAM_FRONT", psi, in_lane=True, near=True
                ),
                lambda: _new_object(rng, "pedestrian", "CAM_FRONT", psi, near=False),
            ][kind]()
            if o is not None and o.cls == "traffic light":
                o.light = "yellow"
        else:
            return None
        if o is not None and derive_speed([o], psi)[0] == speed:
            return o
    return None


def _try_add(objs: list[SceneObject], o: SceneObject | None, psi: float, speed: str | None) -> bool:
    if o is None or sum(p.camera == o.camera for p in objs) >= 3:
        return False
    if o.cls == "traffic light" and any(p.cls == "traffic light" and p.camera == o.camera for p in objs):
        return False
    iv = _angular_interval(o)
    if any(_overlaps(iv, _angular_interval(p)) for p in objs):
        return False
    if speed is not None and derive_speed(objs + [o], psi)[0] != speed:
        return False
    objs.append(o)
    return True


def _sample_world(rng: np.random.Generator) -> tuple[list[SceneObject], float]:
    steer = int(rng.integers(len(STEERS)))
    psi = STEER_ROAD_YAW[steer] + float(rng.uniform(-1.5, 1.5))
    speed = SPEEDS[int(rng.integers(len(SPEEDS)))]
    n = int(rng.integers(3, 9))
    objs: list[SceneObject] = []
    if not _try_add(objs, _cause_object(rng, speed, psi), psi, speed):
        speed = derive_speed([], psi)[0]  # no cause could be placed: keep the road clear instead
    for _ in range(60):
        if len(objs) >= n:
            break
        cls, cam = _sample_class(rng), _weighted(rng, _CAM_PRIOR)
        # Objects in the ego lane ahead are common enough for path and collision questions.
        in_lane = cam == "CAM_FRONT" and cls not in TRAFFIC_ELEMENTS and rng.random() < 0.5
        _try_add(objs, _new_object(rng, cls, cam, psi, in_lane=in_lane), psi, speed)
    return objs, psi


def _hex_id(*key: int) -> str:
    return np.random.default_rng(list(key)).bytes(16).hex()


def make_frame(seed: int, index: int) -> Frame:
    """Frame `index` of the synthetic stream `seed`: deterministic per (seed, index)."""
    rng = np.random.default_rng([seed, index])
    objs, psi = _sample_world(rng)
    scene_id = _hex_id(seed, index // FRAMES_PER_SCENE, 1)
    return frame_from_objects(objs, road_yaw_deg=psi, rng=rng, scene_id=scene_id, frame_id=_hex_id(seed, index, 2))


def frame_from_objects(
    objects: list[SceneObject],
    road_yaw_deg: float = 0.0,
    rng: np.random.Generator | int = 0,
    scene_id: str = "0" * 32,
    frame_id: str = "1" * 32,
) -> Frame:
    """A frame from hand-placed objects: projections, c-tags, ego behaviour and QA are computed here."""
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    objs = list(objects)
    for o in objs:
        o.camera = tag_camera(o.x, o.y)
        o.views = {c: b for c in CAMERAS if (b := project(o, c)) is not None}
        if o.camera not in o.views:
            raise LiteVLMError(
                f"object {o.cls} at ({o.x:.1f}, {o.y:.1f}) is not visible in its camera {o.camera}; "
                "place it at least 0.5 m from the ego car"
            )
    # c-ids in random order: a DriveLM-like id must not hint at an object's importance.
    for k, i in enumerate(rng.permutation(len(objs)), start=1):
        o = objs[int(i)]
        o.k = k
        b = o.views[o.camera]
        u0, v0, u1, v1 = b.clipped()
        u = min(max(b.uc, u0), u1)
        o.tag = f"<c{k},{o.camera},{u:.1f},{(v0 + v1) / 2:.1f}>"
    speed, cause = derive_speed(objs, road_yaw_deg)
    steer = STEERS[int(np.argmin([abs(road_yaw_deg - s) for s in STEER_ROAD_YAW]))]
    ego = Ego(road_yaw_deg, steer, speed, cause)
    frame = Frame(scene_id, frame_id, objs, [], ego)
    frame.qas = _make_qas(frame, rng)
    return frame


# ------------------------------------------------------------------------------------------------
# Questions and answers
# ------------------------------------------------------------------------------------------------
DIR_PHRASES = {  # how a question may point at a camera; answers always use the DriveLM phrase (first)
    "CAM_FRONT": (
        "to the front of the ego car",
        "in front of the ego vehicle",
        "ahead of us",
        "in the front view",
        "in the front camera",
        "in CAM_FRONT",
    ),
    "CAM_FRONT_LEFT": (
        "to the front left of the ego car",
        "ahead on the left",
        "on the left side ahead",
        "in the front-left view",
        "in the front left camera",
        "in CAM_FRONT_LEFT",
    ),
    "CAM_FRONT_RIGHT": (
        "to the front right of the ego car",
        "ahead on the right",
        "on the right side ahead",
        "in the front-right view",
        "in the front right camera",
        "in CAM_FRONT_RIGHT",
    ),
    "CAM_BACK": (
        "to the back of the ego car",
        "behind the ego vehicle",
        "behind us",
        "in the rear view",
        "in the rear camera",
        "in CAM_BACK",
    ),
    "CAM_BACK_LEFT": (
        "to the back left of the ego car",
        "behind us on the left",
        "on the left side behind",
        "in the back-left view",
        "in the rear left camera",
        "in CAM_BACK_LEFT",
    ),
    "CAM_BACK_RIGHT": (
        "to the back right of the ego car",
        "behind us on the right",
        "on the right side behind",
        "in the back-right view",
        "in the rear right camera",
        "in CAM_BACK_RIGHT",
    ),
}
ALL_VIEWS = CAMERAS
STATUS_WORD = {
    "Going ahead": "going ahead",
    "Turn left": "turning left",
    "Turn right": "turning right",
    "Stopped": "stationary",
    "Back up": "backing up",
}


def _join(items: list[str]) -> str:
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


def _yes(b: bool) -> str:
    return "Yes." if b else "No."


def _views(*cams: str) -> tuple[str, ...]:
    return tuple(c for c in CAMERAS if c in cams)


def _mc(rng: np.random.Generator, question: str, correct: str, universe: tuple[str, ...]) -> tuple[str, str]:
    """DriveLM's 4-option form: the answer at a uniformly random letter, distractors uniform over the rest."""
    others = [u for u in universe if u != correct]
    pick = [others[int(i)] for i in rng.permutation(len(others))[:3]]
    slot = int(rng.integers(4))
    options = pick[:slot] + [correct] + pick[slot:]
    text = " ".join(f"{'ABCD'[i]}. {opt}" for i, opt in enumerate(options))
    return f"{question}{MC_SUFFIX} {text}", "ABCD"[slot]


def _action(o: SceneObject, frame: Frame) -> tuple[str, str, str]:
    """(action, reason, probability) the ego car takes because of one object; visible facts only."""
    psi = frame.ego.road_yaw_deg
    front, path = o.camera == "CAM_FRONT", _in_path(o, psi)
    if o.cls == "traffic light" and front:
        return {
            "red": ("stop", "the traffic light is red", "high"),
            "yellow": ("slow down", "the traffic light is yellow", "high"),
            "green": ("keep going", "the traffic light is green", "high"),
        }[o.light]
    if o.cls == "sign" and o.sign == "stop" and front and o.distance < NEAR_M:
        return "stop", "there is a stop sign close ahead", "high"
    if path and o.distance < NEAR_M:
        if o.cls in ("pedestrian", "cyclist"):
            return "stop", f"the {o.cls} is in the path of the ego vehicle", "high"
        return "brake and slow down", f"the {o.cls} is close ahead in the ego lane", "high"
    if path:
        return "slow down", f"the {o.cls} is ahead in the ego lane", "medium"
    if front and o.cls in ("pedestrian", "cyclist"):
        return "slow down", f"the {o.cls} is ahead of the ego vehicle", "medium"
    if o.cls in MOVERS and o.moving:
        return "keep going at the same speed", f"the {o.cls} is not in the moving direction of the ego vehicle", "high"
    return "keep going at the same speed", "there is no safety issue", "high"


def _notice_order(frame: Frame) -> list[SceneObject]:
    """What to notice first: things in the ego lane, then traffic control ahead, then the rest by distance."""
    psi = frame.ego.road_yaw_deg

    def rank(o: SceneObject):
        if _in_path(o, psi):
            group = 0
        elif o.camera == "CAM_FRONT" and (o.cls == "traffic light" or (o.cls == "sign" and o.sign == "stop")):
            group = 1
        elif o.camera in ("CAM_FRONT", "CAM_FRONT_LEFT", "CAM_FRONT_RIGHT"):
            group = 2
        else:
            group = 3
        return group, o.distance

    return sorted(frame.objects, key=rank)


def _state(o: SceneObject) -> str:
    if o.cls == "traffic light":
        return f"a {o.light} traffic light"
    if o.cls == "sign":
        return f"a {SIGN_NAMES[o.sign]}"
    if o.cls in MOVERS:
        return STATUS_WORD[o.motion] if o.cls in VEHICLES else ("moving" if o.moving else "stationary")
    return "stationary"


def _turn_unsafe(frame: Frame, side: str) -> bool:
    cams = ("CAM_FRONT_LEFT", "CAM_BACK_LEFT") if side == "left" else ("CAM_FRONT_RIGHT", "CAM_BACK_RIGHT")
    return any(o.cls in MOVERS and o.camera in cams for o in frame.objects)


def _visible(frame: Frame, cam: str, pred) -> list[SceneObject]:
    """Objects matching `pred` with any part in `cam` (not only those whose tag camera it is)."""
    return [o for o in frame.objects if cam in o.views and pred(o)]


def _balanced_objects(rng, objs, answer_of) -> tuple[SceneObject, bool] | None:
    """Pick an object for a yes/no question so that Yes and No are equally likely.

    Asked only when the frame holds objects with both answers: the coin then decides, so the answer
    cannot be guessed from the question's text or from how often the frame allows each answer.
    """
    yes = [o for o in objs if answer_of(o)]
    no = [o for o in objs if not answer_of(o)]
    if not yes or not no:
        return None
    want = bool(rng.random() < 0.5)
    return _choice(rng, yes if want else no), want


def _absent_text(sample, present, tries: int = 30):
    """Draw question attributes from the world's prior until they describe nothing visible in the frame."""
    for _ in range(tries):
        attrs = sample()
        if not present(*attrs):
            return attrs
    return None


def _make_qas(frame: Frame, rng: np.random.Generator) -> list[QA]:
    out: list[QA] = []
    objs = frame.objects
    psi = frame.ego.road_yaw_deg
    by_cam = {c: [o for o in objs if o.camera == c] for c in CAMERAS}

    def add(family, category, q, a, tag, closed, views):
        out.append(QA(q, a, category, tag, closed, _views(*views), family))

    def dirp(cam):
        return _choice(rng, DIR_PHRASES[cam])

    # ---- perception --------------------------------------------------------------------------
    important = _notice_order(frame)[:3]
    q = _choice(
        rng,
        (
            "What are the important objects in the current scene? Those objects will be considered for the "
            "future reasoning and driving decision.",
            "What are the important objects in the current scene?",
            "Which objects around the ego vehicle matter for the driving decision? Give their IDs.",
            "List the important objects around the ego car and their IDs.",
        ),
    )
    a = (
        f"There is {_join([f'{o.noun()} to the {DIRECTION[o.camera]} of the ego vehicle' for o in important])}. "
        f"The IDs of these objects are {_join([o.tag for o in important])}."
        if important
        else "There are no important objects around the ego vehicle."
    )
    add("important_objects", "perception", q, a, 2, False, ALL_VIEWS)

    cam = _choice(rng, CAMERAS)
    seen = sorted(by_cam[cam], key=lambda o: o.views[cam].uc)
    ans = (
        f"There is {_join([o.noun() for o in seen])} {DIR_PHRASES[cam][0]}."
        if seen
        else f"There is nothing {DIR_PHRASES[cam][0]}."
    )
    add(
        "objects_direction",
        "perception",
        _choice(
            rng,
            (
                "What are objects {d}?",
                "What objects are {d}?",
                "Which objects can be seen {d}?",
                "What is visible {d}?",
            ),
        ).format(d=dirp(cam)),
        ans,
        2,
        False,
        (cam,),
    )

    # Existence questions: Yes from a real object, No from the world's prior re-drawn until absent,
    # so the classes, colours and cameras named look alike whatever the answer.
    movers = [o for o in objs if o.cls in MOVERS]
    if movers:
        if rng.random() < 0.5:
            o = _choice(rng, movers)
            attrs, want = (o.camera, o.cls, o.moving), True
        else:

            def draw():
                cls = _sample_class(rng)
                while cls not in MOVERS:
                    cls = _sample_class(rng)
                mov = bool(rng.random() < (0.8 if cls in VEHICLES else 0.5))
                return _weighted(rng, _CAM_PRIOR), cls, mov

            attrs = _absent_text(draw, lambda c, k, m: bool(_visible(frame, c, lambda o: o.cls == k and o.moving == m)))
            want = False
        if attrs is not None:
            c, k, m = attrs
            if k in VEHICLES:
                word = "moving" if m else _choice(rng, ("parked", "stopped", "stationary"))
            else:
                word = (
                    _choice(rng, ("moving", "walking" if k == "pedestrian" else "riding"))
                    if m
                    else _choice(rng, ("stationary", "standing"))
                )
            q = _choice(rng, ("Are there {w} {p} {d}?", "Is there any {w} {k} {d}?", "Can you see {w} {p} {d}?"))
            add("exists_moving", "perception", q.format(w=word, p=PLURAL[k], k=k, d=dirp(c)), _yes(want), 0, True, (c,))

    vehicles = [o for o in objs if o.cls in VEHICLES]
    for _ in range(2):
        if not vehicles:
            break
        if rng.random() < 0.5:
            o = _choice(rng, vehicles)
            attrs, want = (o.camera, o.cls, o.colour), True
        else:
            attrs = _absent_text(
                lambda: (_weighted(rng, _CAM_PRIOR), _choice(rng, VEHICLES), _choice(rng, COLOURS)),
                lambda c, k, col: bool(_visible(frame, c, lambda o: o.cls == k and o.colour == col)),
            )
            want = False
        if attrs is not None:
            c, k, col = attrs
            q = _choice(
                rng,
                (
                    "Is there a {col} {k} {d}?",
                    "Can you see a {col} {k} {d}?",
                    "Is a {col} {k} visible {d}?",
                    "Is there any {col} {k} {d}?",
                ),
            )
            add("exists_colour", "perception", q.format(col=col, k=k, d=dirp(c)), _yes(want), 0, True, (c,))

    # Colour of "the vehicle" in a view: only where exactly one vehicle shows there at all.
    single = [
        c
        for c in CAMERAS
        if len(_visible(frame, c, lambda o: o.cls in VEHICLES)) == 1 and any(o.cls in VEHICLES for o in by_cam[c])
    ]
    if single:
        c = _choice(rng, single)
        o = next(o for o in by_cam[c] if o.cls in VEHICLES)
        if rng.random() < 0.7:
            q = _choice(
                rng,
                (
                    "What is the colour of the vehicle {d}?",
                    "What colour is the {k} {d}?",
                    "Which colour does the vehicle {d} have?",
                ),
            ).format(d=dirp(c), k=o.cls)
            q, a = _mc(rng, q, f"{o.colour.capitalize()}.", tuple(f"{x.capitalize()}." for x in COLOURS))
            add("vehicle_colour_mc", "perception", q, a, 0, True, (c,))
        else:
            q = _choice(rng, ("What is the colour of the vehicle {d}?", "What colour is the {k} {d}?")).format(
                d=dirp(c), k=o.cls
            )
            add("vehicle_colour", "perception", q, f"The {o.cls} is {o.colour}.", 2, False, (c,))

    if vehicles:
        o = _choice(rng, vehicles)
        q = _choice(
            rng, ("What is the moving status of object {t}?", "How is {t} moving?", "What is {t} doing?")
        ).format(t=o.tag)
        q, a = _mc(rng, q, f"{o.motion}.", tuple(f"{m}." for m in MOVING_STATUSES))
        add("moving_status_mc", "perception", q, a, 0, True, (o.camera,))

    polarity = rng.random() < 0.5  # True: "is it moving?", False: "is it stationary?"
    pick = _balanced_objects(rng, movers, lambda o: o.moving == polarity)
    if pick:
        o, want = pick
        q = _choice(
            rng,
            ("Is {t} moving?", "Is the object {t} in motion?")
            if polarity
            else ("Is {t} stationary?", "Is the object {t} standing still?"),
        ).format(t=o.tag)
        add("is_moving", "perception", q, _yes(want), 0, True, (o.camera,))

    elements = [o for o in objs if o.cls in TRAFFIC_ELEMENTS]
    if elements:
        if rng.random() < 0.5:
            c, want = _choice(rng, elements).camera, True
        else:
            c = _absent_text(
                lambda: (_weighted(rng, _CAM_PRIOR),),
                lambda c: bool(_visible(frame, c, lambda o: o.cls in TRAFFIC_ELEMENTS)),
            )
            c, want = (c[0] if c else None), False
        if c is not None:
            q = _choice(
                rng,
                (
                    "Is there any traffic element {d}?",
                    "Are there traffic lights or traffic signs {d}?",
                    "Can you see a traffic light or a traffic sign {d}?",
                ),
            ).format(d=dirp(c))
            if c == "CAM_FRONT" and rng.random() < 0.4:
                q = "Is there any traffic element in the front view?"
            add("traffic_element", "perception", q, _yes(want), 0, True, (c,))

    lit = [
        c
        for c in CAMERAS
        if len(_visible(frame, c, lambda o: o.cls == "traffic light")) == 1
        and any(o.cls == "traffic light" for o in by_cam[c])
    ]
    if lit:
        c = _choice(rng, lit)
        o = next(o for o in by_cam[c] if o.cls == "traffic light")
        d = "in front of the ego car" if c == "CAM_FRONT" and rng.random() < 0.3 else dirp(c)
        if rng.random() < 0.5:
            q = _choice(
                rng, ("What is the state of the traffic light {d}?", "What colour is the traffic light {d} showing?")
            )
            add("light_state", "perception", q.format(d=d), f"The traffic light is {o.light}.", 2, False, (c,))
        else:
            want = bool(rng.random() < 0.5)
            state = o.light if want else _choice(rng, [s for s in LIGHT_STATES if s != o.light])
            q = _choice(
                rng,
                (
                    "Is the traffic light {d} {s}?",
                    "Is the traffic light {d} showing {s}?",
                    "Does the traffic light {d} show {s}?",
                ),
            )
            add("light_is", "perception", q.format(d=d, s=state), _yes(want), 0, True, (c,))

    if objs:
        o = _choice(rng, objs)
        q = _choice(rng, ("What is the visual description of {t}?", "Describe {t}.", "What does {t} look like?"))
        add("visual_description", "perception", q.format(t=o.tag), o.description(), 2, False, (o.camera,))

    # ---- prediction --------------------------------------------------------------------------
    # Traffic lights are among the No cases: like signs, their boxes sit above the horizon.
    pick = _balanced_objects(rng, [o for o in objs if o.cls != "cone"], lambda o: o.cls in ("sign", "barrier"))
    if pick:
        o, want = pick
        q = _choice(
            rng,
            (
                "Is {t} a traffic sign or a road barrier?",
                "Is the object {t} a sign or a barrier?",
                "Is {t} a road sign or a barrier?",
            ),
        ).format(t=o.tag)
        add("sign_or_barrier", "prediction", q, _yes(want), 0, True, (o.camera,))

    front = by_cam["CAM_FRONT"]
    pick = _balanced_objects(rng, front, lambda o: _in_path(o, psi))
    if pick:
        o, want = pick
        q = _choice(
            rng,
            (
                "Would {t} be in the moving direction of the ego vehicle?",
                "Is {t} in the path of the ego vehicle?",
                "Is {t} in the ego lane ahead?",
            ),
        ).format(t=o.tag)
        add("in_path", "prediction", q, _yes(want), 0, True, ("CAM_FRONT",))

    order = _notice_order(frame)
    ordinals = (("first", "Firstly"), ("second", "Secondly"), ("third", "Thirdly"))
    r = rng.random()
    if r < 0.25 and len(order) >= 3:
        q = (
            "What object should the ego vehicle notice first when the ego vehicle is getting to the next "
            "possible location? "
            "What is the state of the object that is first noticed by the ego vehicle and what action should "
            "the ego vehicle take? "
            "What object should the ego vehicle notice second when the ego vehicle is getting to the next "
            "possible location? "
            "What is the state of the object perceived by the ego vehicle as second and what action should "
            "the ego vehicle take? "
            "What object should the ego vehicle notice third? "
            "What is the state of the object perceived by the ego vehicle as third and what action should "
            "the ego vehicle take?"
        )
        a = " ".join(
            f"{w}, notice {o.tag}. The object is {_state(o)}, so the ego vehicle should {_action(o, frame)[0]}."
            for (_, w), o in zip(ordinals, order)
        )
        add("notice_full", "prediction", q, a, 3, False, ALL_VIEWS)
    elif r < 0.5 and len(order) >= 3:
        q = _choice(
            rng,
            (
                "In what order should the ego vehicle notice the objects around it? Name three.",
                "Which three objects should the ego vehicle notice first, second and third?",
            ),
        )
        a = " ".join(f"{w}, notice {o.tag}." for (_, w), o in zip(ordinals, order))
        add("notice_order", "prediction", q, a, 3, False, ALL_VIEWS)
    elif order:
        i = int(rng.integers(min(3, len(order))))
        q = _choice(
            rng,
            (
                "What object should the ego vehicle notice {n} when the ego vehicle is getting to the next "
                "possible location?",
                "Which object should the ego vehicle notice {n}?",
                "What should the ego car notice {n}?",
            ),
        ).format(n=ordinals[i][0])
        add("notice_one", "prediction", q, f"{ordinals[i][1]}, notice {order[i].tag}.", 3, False, ALL_VIEWS)

    if movers:
        o = _choice(rng, movers)
        fut = (
            {
                "Going ahead": "Keep going straight.",
                "Turn left": "Turn left.",
                "Turn right": "Turn right.",
                "Stopped": "Stationary.",
                "Back up": "Back up.",
            }[o.motion]
            if o.cls in VEHICLES
            else ("Keep moving." if o.moving else "Stationary.")
        )
        q = _choice(rng, ("What is the future state of {t}?", "What will {t} do next?")).format(t=o.tag)
        add("future_state", "prediction", q, fut, 2, False, (o.camera,))

    # ---- planning ----------------------------------------------------------------------------
    if objs:
        o = _choice(rng, objs)
        act, why, prob = _action(o, frame)
        q = _choice(
            rng,
            (
                "What actions could the ego vehicle take based on {t}? Why take this action and what's the "
                "probability?",
                "Based on {t}, what should the ego vehicle do and why?",
                "What action should the ego vehicle take because of {t}?",
            ),
        ).format(t=o.tag)
        add(
            "actions_based_on",
            "planning",
            q,
            f"The action is to {act}. The reason is that {why}, with a {prob} probability.",
            1,
            False,
            (o.camera,),
        )

    base = {
        "red light": "Remain stationary and wait for the green light.",
        "stop sign": "Stop at the stop sign, then go ahead slowly.",
        "road user in the path": "Remain stationary and let the road user pass.",
        "yellow light": "Slow down and prepare to stop.",
        "obstacle in the path": "Slow down and keep a safe distance.",
        "road user ahead": "Slow down and watch the road user ahead.",
        "clear road": "Keep going at the same speed.",
    }[frame.ego.cause]
    turns = [s for s in ("left", "right") if not _turn_unsafe(frame, s)]
    tail = {
        2: " Turning left or right is also safe.",
        1: f" Turning {''.join(turns)} is also safe.",
        0: " Turning left or right is not safe.",
    }[len(turns)]
    q = _choice(
        rng,
        (
            "In this scenario, what are safe actions to take for the ego vehicle?",
            "What are safe actions to take for the ego vehicle?",
            "What can the ego vehicle safely do now?",
        ),
    )
    add("safe_actions", "planning", q, base + tail, 1, False, ALL_VIEWS)

    unsafe = {s: _turn_unsafe(frame, s) for s in ("left", "right")}
    if unsafe["left"] != unsafe["right"]:  # both answers available: the coin picks the side
        want = bool(rng.random() < 0.5)
        side = next(s for s in ("left", "right") if (not unsafe[s]) == want)
        q = _choice(
            rng,
            (
                "Is it safe for the ego vehicle to turn {s}?",
                "Can the ego vehicle safely turn {s} now?",
                "Would turning {s} be safe for the ego car?",
            ),
        ).format(s=side)
        cams = ("CAM_FRONT_LEFT", "CAM_BACK_LEFT") if side == "left" else ("CAM_FRONT_RIGHT", "CAM_BACK_RIGHT")
        add("safe_turn", "planning", q, _yes(want), 0, True, cams)

    pick = _balanced_objects(rng, front, lambda o: _in_path(o, psi) and o.distance < NEAR_M)
    if pick:
        o, high = pick
        q = _choice(
            rng,
            (
                "What is the probability of colliding with {t} after the ego vehicle accelerates and goes straight?",
                "If the ego vehicle accelerates and goes straight, how likely is a collision with {t}?",
            ),
        ).format(t=o.tag)
        add("collision", "planning", q, "High." if high else "Low.", 0, True, ("CAM_FRONT",))

    # ---- behavior ----------------------------------------------------------------------------
    add(
        "behavior",
        "behavior",
        _choice(
            rng,
            (
                "Predict the behavior of the ego vehicle.",
                "What is the ego vehicle doing?",
                "Describe the current behavior of the ego car.",
            ),
        ),
        frame.ego.behavior,
        2,
        False,
        ALL_VIEWS,
    )
    q, a = _mc(rng, "Predict the behavior of the ego vehicle.", frame.ego.behavior, BEHAVIORS)
    add("behavior_mc", "behavior", q, a, 0, True, ALL_VIEWS)

    order_idx = {c: i for i, c in enumerate(CATEGORIES)}
    return sorted(out, key=lambda qa: order_idx[qa.category])  # stable: DriveLM's P, Pred, Plan, B order


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------
def _blend(c, bg, t: float) -> tuple[int, int, int]:
    return tuple(int(a + (b - a) * t) for a, b in zip(c, bg))


def _clip_near(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sutherland-Hodgman against the camera's near plane, on (forward, left) ground points."""
    out = []
    for i, p in enumerate(pts):
        q = pts[i - 1]
        pin, qin = p[0] >= NEAR_PLANE, q[0] >= NEAR_PLANE
        if pin != qin:
            t = (NEAR_PLANE - q[0]) / (p[0] - q[0])
            out.append((NEAR_PLANE, q[1] + t * (p[1] - q[1])))
        if pin:
            out.append(p)
    return out


def _ground_polygon(cam: str, psi: float, quad: list[tuple[float, float]], s: tuple[float, float]):
    """Road-frame ground quad -> output-pixel polygon in `cam`, or None if behind the camera."""
    fx = focal_px(cam)
    pts = _clip_near([_to_cam(cam, *_from_road(psi, xr, yr)) for xr, yr in quad])
    if len(pts) < 3:
        return None
    poly = [((CX - fx * lat / f) * s[0], (CY + fx * H_CAM / f) * s[1]) for f, lat in pts]
    xs = [p[0] for p in poly]
    if max(xs) < 0 or min(xs) > IMAGE_WIDTH * s[0]:
        return None
    return poly


def _draw_road(d: ImageDraw.ImageDraw, cam: str, psi: float, s: tuple[float, float]) -> None:
    road = _ground_polygon(cam, psi, [(-400, -7), (400, -7), (400, 7), (-400, 7)], s)
    if road:
        d.polygon(road, fill=ROAD)
    for yr in (-7.0, 7.0):  # solid road edges
        p = _ground_polygon(cam, psi, [(-400, yr - 0.12), (400, yr - 0.12), (400, yr + 0.12), (-400, yr + 0.12)], s)
        if p:
            d.polygon(p, fill=MARK)
    for yr in (-5.25, -1.75, 1.75, 5.25):  # dashed lane lines
        for x0 in range(-60, 61, 9):
            p = _ground_polygon(
                cam, psi, [(x0, yr - 0.09), (x0 + 3, yr - 0.09), (x0 + 3, yr + 0.09), (x0, yr + 0.09)], s
            )
            if p:
                d.polygon(p, fill=MARK)


def _draw_vehicle(d, o: SceneObject, x0, y0, x1, y1, col) -> None:
    w, h = x1 - x0, y1 - y0
    wheel = lambda a, b, top: d.ellipse([a, y0 + top * h, b, y1], fill=TYRE)  # noqa: E731
    if o.cls == "car":
        wheel(x0 + 0.06 * w, x0 + 0.32 * w, 0.72)
        wheel(x1 - 0.32 * w, x1 - 0.06 * w, 0.72)
        d.rectangle([x0, y0 + 0.42 * h, x1, y0 + 0.86 * h], fill=col)
        d.polygon(
            [(x0 + 0.14 * w, y0 + 0.45 * h), (x0 + 0.26 * w, y0), (x1 - 0.26 * w, y0), (x1 - 0.14 * w, y0 + 0.45 * h)],
            fill=col,
        )
        d.polygon(
            [
                (x0 + 0.22 * w, y0 + 0.42 * h),
                (x0 + 0.30 * w, y0 + 0.1 * h),
                (x1 - 0.30 * w, y0 + 0.1 * h),
                (x1 - 0.22 * w, y0 + 0.42 * h),
            ],
            fill=WINDOW,
        )
    elif o.cls == "van":
        wheel(x0 + 0.08 * w, x0 + 0.30 * w, 0.8)
        wheel(x1 - 0.30 * w, x1 - 0.08 * w, 0.8)
        d.rectangle([x0, y0 + 0.04 * h, x1, y0 + 0.9 * h], fill=col)
        d.rectangle([x0 + 0.08 * w, y0 + 0.12 * h, x1 - 0.08 * w, y0 + 0.36 * h], fill=WINDOW)
    elif o.cls == "truck":
        for a in (0.04, 0.40, 0.76):
            wheel(x0 + a * w, x0 + (a + 0.2) * w, 0.78)
        d.rectangle([x0, y0 + 0.70 * h, x1, y0 + 0.86 * h], fill=DARK)
        d.rectangle([x0, y0, x1, y0 + 0.70 * h], fill=col)
        for a in (0.33, 0.66):  # cargo-box ribs: a truck has no windows
            d.rectangle([x0 + (a - 0.025) * w, y0 + 0.05 * h, x0 + (a + 0.025) * w, y0 + 0.65 * h], fill=DARK)
    else:  # bus: a long row of windows
        wheel(x0 + 0.08 * w, x0 + 0.24 * w, 0.86)
        wheel(x1 - 0.24 * w, x1 - 0.08 * w, 0.86)
        d.rectangle([x0, y0 + 0.02 * h, x1, y0 + 0.92 * h], fill=col)
        d.rectangle([x0 + 0.04 * w, y0 + 0.14 * h, x1 - 0.04 * w, y0 + 0.48 * h], fill=WINDOW)
        n = max(2, min(8, int(round(3 * w / max(h, 1e-6)))))
        for i in range(1, n):
            xm = x0 + w * i / n
            d.rectangle([xm - 0.015 * w, y0 + 0.14 * h, xm + 0.015 * w, y0 + 0.48 * h], fill=col)


def _lamp(d, xc, yc, r, fill) -> None:
    d.rectangle([xc - r, yc - r, xc + r, yc + r], fill=fill, outline=TYRE)


# A moving object's trail: faded copies of it (blend toward the road, shift as a fraction of the full one).
TRAIL_COPIES = ((0.75, 1.0), (0.5, 0.55))


def trail_direction(o: SceneObject, b: ViewBox, cam: str) -> float:
    """Image-space shift (1600-px units, signed) from a moving object to where it was 2.5 m back along its
    travel; 0 when that point is behind the camera. `trail_shift` turns it into the drawn offset."""
    travel = o.heading + (math.pi if o.motion == "Back up" else 0.0)
    f, lat = _to_cam(cam, o.x - 2.5 * math.cos(travel), o.y - 2.5 * math.sin(travel))
    return CX - focal_px(cam) * lat / f - b.uc if f > NEAR_PLANE else 0.0


def trail_shift(du: float, width: float) -> float:
    """The trail's full offset: du's side, its length held between 0.45 and 1.1 object widths (any unit)."""
    return math.copysign(min(max(abs(du), 0.45 * width), 1.1 * width), du if du != 0 else 1.0)


def trail_boxes(o: SceneObject, b: ViewBox, cam: str) -> list[tuple[float, float, float, float]]:
    """Where a moving object's trail copies lie in one view (1600x900 pixels), as drawn; [] when it stands."""
    if not o.moving:
        return []
    w, h = b.u1 - b.u0, b.v1 - b.v0
    du = trail_shift(trail_direction(o, b, cam), w)
    xc = (b.u0 + b.u1) / 2
    gx0, gx1 = (b.u0, b.u1) if o.cls in VEHICLES else (xc - 0.3 * w, xc + 0.3 * w)
    top = b.v0 + (0.3 if o.cls in VEHICLES else 0.1) * h
    return [(gx0 + du * frac, top, gx1 + du * frac, b.v1 - 0.08 * h) for _, frac in TRAIL_COPIES]


def _draw_object(d: ImageDraw.ImageDraw, o: SceneObject, b: ViewBox, cam: str, s: tuple[float, float]) -> None:
    x0, y0, x1, y1 = b.u0 * s[0], b.v0 * s[1], b.u1 * s[0], b.v1 * s[1]
    # A thing far away still gets two output pixels each way, so it never vanishes at 112 px.
    if x1 - x0 < 2:
        x0, x1 = (x0 + x1) / 2 - 1, (x0 + x1) / 2 + 1
    if y1 - y0 < 2:
        y0 = y1 - 2
    w, h = x1 - x0, y1 - y0
    xc = (x0 + x1) / 2
    col = COLOURS.get(o.colour or "", DARK)

    if o.moving:  # motion trail: faded copies on the side the object came from
        du = trail_shift(trail_direction(o, b, cam) * s[0], w)
        top = y0 + (0.3 if o.cls in VEHICLES else 0.1) * h
        gx0, gx1 = (x0, x1) if o.cls in VEHICLES else (xc - max(0.3 * w, 1), xc + max(0.3 * w, 1))
        for t, frac in TRAIL_COPIES:
            d.rectangle([gx0 + du * frac, top, gx1 + du * frac, y1 - 0.08 * h], fill=_blend(col, ROAD, t))

    if o.cls in VEHICLES:
        _draw_vehicle(d, o, x0, y0, x1, y1, col)
        r = max(0.1 * min(w, h), 1.2)
        if o.motion in ("Turn left", "Turn right"):  # indicator on the image side of the turn
            _lamp(d, x0 if o.motion == "Turn left" else x1, y0 + 0.45 * h, r, ORANGE)
        elif o.motion == "Back up":  # white reversing lamps
            _lamp(d, x0 + 0.12 * w, y0 + 0.62 * h, r, (255, 255, 255))
            _lamp(d, x1 - 0.12 * w, y0 + 0.62 * h, r, (255, 255, 255))
    elif o.cls == "pedestrian":
        d.rectangle([x0 + 0.2 * w, y0 + 0.55 * h, x1 - 0.2 * w, y1], fill=LEGS)
        d.rectangle([x0 + 0.05 * w, y0 + 0.15 * h, x1 - 0.05 * w, y0 + 0.57 * h], fill=col)
        d.ellipse([xc - 0.3 * w, y0, xc + 0.3 * w, y0 + 0.15 * h], fill=SKIN)
    elif o.cls == "cyclist":
        dw = 0.36 * h
        if w > 2 * dw:
            d.ellipse([x0, y1 - dw, x0 + dw, y1], outline=TYRE, width=max(1, int(dw / 6)))
            d.ellipse([x1 - dw, y1 - dw, x1, y1], outline=TYRE, width=max(1, int(dw / 6)))
            d.line(
                [(x0 + dw / 2, y1 - dw / 2), (xc, y1 - 0.55 * h), (x1 - dw / 2, y1 - dw / 2)],
                fill=DARK,
                width=max(1, int(dw / 8)),
            )
        else:
            d.ellipse([xc - max(0.15 * w, 1), y1 - dw, xc + max(0.15 * w, 1), y1], fill=TYRE)
        tw = min(0.3 * w, 0.12 * h)
        d.rectangle([xc - tw, y0 + 0.12 * h, xc + tw, y0 + 0.55 * h], fill=col)
        d.ellipse([xc - 0.07 * h, y0, xc + 0.07 * h, y0 + 0.13 * h], fill=SKIN)
    elif o.cls == "traffic light":
        pw = max(0.15 * w, 1)
        d.rectangle([xc - pw / 2, y1, xc + pw / 2, b.v_ground * s[1]], fill=DARK)
        d.rectangle([x0, y0, x1, y1], fill=(28, 28, 28))
        for i, state in enumerate(LIGHT_STATES):
            c = COLOURS[state] if state != "yellow" else (255, 190, 0)
            on = state == o.light
            cy = y0 + h * (i + 0.5) / 3
            r = (0.42 if on else 0.3) * min(w, h / 3)
            d.ellipse([xc - r, cy - r, xc + r, cy + r], fill=c if on else _blend(c, (28, 28, 28), 0.75))
    elif o.cls == "sign":
        pw = max(0.08 * w, 1)
        d.rectangle([xc - pw / 2, y1, xc + pw / 2, b.v_ground * s[1]], fill=(120, 120, 120))
        yc, r = (y0 + y1) / 2, min(w, h) / 2
        if o.sign == "stop":
            d.regular_polygon((xc, yc, r), 8, rotation=22.5, fill=COLOURS["red"])
            d.rectangle([xc - 0.6 * r, yc - 0.12 * r, xc + 0.6 * r, yc + 0.12 * r], fill=(255, 255, 255))
        elif o.sign == "speed limit":
            d.ellipse([xc - r, yc - r, xc + r, yc + r], fill=COLOURS["red"])
            d.ellipse([xc - 0.7 * r, yc - 0.7 * r, xc + 0.7 * r, yc + 0.7 * r], fill=(255, 255, 255))
            d.rectangle([xc - 0.35 * r, yc - 0.2 * r, xc + 0.35 * r, yc + 0.2 * r], fill=TYRE)
        elif o.sign == "yield":
            d.polygon([(xc - r, yc - 0.8 * r), (xc + r, yc - 0.8 * r), (xc, yc + r)], fill=COLOURS["red"])
            d.polygon(
                [(xc - 0.55 * r, yc - 0.55 * r), (xc + 0.55 * r, yc - 0.55 * r), (xc, yc + 0.45 * r)],
                fill=(255, 255, 255),
            )
        else:
            d.rectangle([xc - r, yc - r, xc + r, yc + r], fill=(30, 90, 200))
            d.polygon(
                [(xc - 0.6 * r, yc + 0.5 * r), (xc + 0.6 * r, yc + 0.5 * r), (xc, yc - 0.6 * r)], fill=(255, 255, 255)
            )
    elif o.cls == "cone":
        d.polygon([(x0, y1), (xc, y0), (x1, y1)], fill=ORANGE)
        d.rectangle([x0 + 0.3 * w, y0 + 0.45 * h, x1 - 0.3 * w, y0 + 0.62 * h], fill=(255, 255, 255))
    elif o.cls == "barrier":
        d.rectangle([x0 + 0.08 * w, y0 + 0.5 * h, x0 + 0.16 * w, y1], fill=DARK)
        d.rectangle([x1 - 0.16 * w, y0 + 0.5 * h, x1 - 0.08 * w, y1], fill=DARK)
        for i in range(6):
            d.rectangle(
                [x0 + w * i / 6, y0, x0 + w * (i + 1) / 6, y0 + 0.55 * h],
                fill=COLOURS["red"] if i % 2 == 0 else (255, 255, 255),
            )


def render_view(
    frame: Frame, cam: str, size: tuple[int, int] = (IMAGE_WIDTH, IMAGE_HEIGHT), empty: bool = False
) -> Image.Image:
    """One camera's image: sky, ground, road and lane lines, then objects far to near."""
    W, H = size
    s = (W / IMAGE_WIDTH, H / IMAGE_HEIGHT)  # geometry is in 1600x900, drawn at the requested size
    img = Image.new("RGB", (W, H), SKY)
    d = ImageDraw.Draw(img)
    d.rectangle([0, CY * s[1], W, H], fill=VERGE)
    _draw_road(d, cam, frame.ego.road_yaw_deg, s)
    if not empty:
        for o in sorted((o for o in frame.objects if cam in o.views), key=lambda o: -o.views[cam].depth):
            _draw_object(d, o, o.views[cam], cam, s)
    return img


def render_views(
    frame: Frame, size: tuple[int, int] = (IMAGE_WIDTH, IMAGE_HEIGHT), empty: bool = False
) -> dict[str, Image.Image]:
    """The six camera images of `frame` (CAMERAS order); `empty` draws the road without any object."""
    return {cam: render_view(frame, cam, size, empty) for cam in CAMERAS}


def render_empty_road(
    size: tuple[int, int] = (IMAGE_WIDTH, IMAGE_HEIGHT), frame: Frame | None = None
) -> dict[str, Image.Image]:
    """Six views of the road with no object on it (of `frame`'s road, else a straight one): the
    'does the model look at all' ablation."""
    if frame is None:
        frame = Frame("0" * 32, "0" * 32, [], [], Ego(0.0, "going straight", "driving with normal speed", "clear road"))
    return render_views(frame, size, empty=True)


# ------------------------------------------------------------------------------------------------
# Dataset writing
# ------------------------------------------------------------------------------------------------
def write_dataset(
    out_dir, frames: int, seed: int, size: tuple[int, int] = (IMAGE_WIDTH, IMAGE_HEIGHT), progress: bool = True
) -> Path:
    """Write `frames` frames as DriveLM-nuScenes JSON (out_dir/drivelm.json) and PNGs; returns the JSON path."""
    from tqdm import tqdm

    out = Path(out_dir)
    for cam in CAMERAS:
        (out / "images" / cam).mkdir(parents=True, exist_ok=True)
    data: dict[str, dict] = {}
    for i in tqdm(range(frames), desc="synth frames", unit="frame", disable=not progress):
        f = make_frame(seed, i)
        paths = {}
        for cam, img in render_views(f, size).items():
            rel = f"images/{cam}/{f.frame_id}.png"
            img.save(out / rel, compress_level=1)
            paths[cam] = rel
        scene = data.setdefault(
            f.scene_id,
            {
                "scene_description": f"Synthetic scene {i // FRAMES_PER_SCENE} of seed {seed}: the ego vehicle "
                "drives on a multi-lane road among vehicles, road users and traffic elements.",
                "key_frames": {},
            },
        )
        scene["key_frames"][f.frame_id] = f.to_drivelm(paths)
    path = out / "drivelm.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def question_corpus(n_frames: int = 500, seed: int = 0) -> list[str]:
    """Every question and answer text (and object description) of `n_frames` frames: tokenizer training text."""
    texts: list[str] = []
    for i in range(n_frames):
        f = make_frame(seed, i)
        for qa in f.qas:
            texts += [qa.question, qa.answer]
        texts += [o.description() for o in f.objects]
    texts += [f"{cam}: " for cam in CAMERAS] + ["user\n", "assistant\n"]
    return texts
