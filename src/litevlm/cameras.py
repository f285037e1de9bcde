"""The six nuScenes cameras, in the order DriveLM lists them."""

CAMERAS: tuple[str, ...] = (
    "CAM_FRONT",
    "CAM_FRONT_LEFT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK",
    "CAM_BACK_LEFT",
    "CAM_BACK_RIGHT",
)

# Optical-axis azimuth in degrees, counter-clockwise (to the left) positive, 0 = straight ahead.
YAW_DEG: dict[str, float] = {
    "CAM_FRONT": 0.0,
    "CAM_FRONT_LEFT": 55.0,
    "CAM_FRONT_RIGHT": -55.0,
    "CAM_BACK": 180.0,
    "CAM_BACK_LEFT": 110.0,
    "CAM_BACK_RIGHT": -110.0,
}

# Usable horizontal field of view of the undistorted 1600x900 images.
HFOV_DEG: dict[str, float] = {cam: (89.0 if cam == "CAM_BACK" else 64.5) for cam in CAMERAS}

IMAGE_WIDTH, IMAGE_HEIGHT = 1600, 900  # DriveLM coordinates are in these pixels


def check_camera(name: str) -> str:
    """Return `name` if it is one of the six cameras, else raise a LiteVLMError naming the valid ones."""
    from litevlm.errors import LiteVLMError

    if name not in CAMERAS:
        raise LiteVLMError(f"unknown camera {name!r}; expected one of {', '.join(CAMERAS)}")
    return name


# DriveLM's direction words for each camera ("What are objects to the back left of the ego car?").
DIRECTION: dict[str, str] = {
    "CAM_FRONT": "front",
    "CAM_FRONT_LEFT": "front left",
    "CAM_FRONT_RIGHT": "front right",
    "CAM_BACK": "back",
    "CAM_BACK_LEFT": "back left",
    "CAM_BACK_RIGHT": "back right",
}


def focal_px(cam: str) -> float:
    """Pinhole focal length in 1600x900 pixels that gives `cam` its usable HFOV (~1268; ~814 for CAM_BACK)."""
    import math

    return (IMAGE_WIDTH / 2) / math.tan(math.radians(HFOV_DEG[cam] / 2))
