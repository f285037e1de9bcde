"""Where models live: a bundled model's name or a checkpoint directory -> its folder, and the trained modules'
folders beside its weights. Also the camera-image folder a question is asked about."""

from __future__ import annotations

from pathlib import Path

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError

WEIGHTS_DIR = Path(__file__).parent / "weights"
DRAFT_SUBDIR = "draft"  # a model directory keeps its draft head here


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A bundled model name ("drive-tiny") or a directory holding config.json."""
    p = Path(name_or_path)
    if not p.exists() and (WEIGHTS_DIR / str(name_or_path)).is_dir():
        p = WEIGHTS_DIR / str(name_or_path)
    if not (p / "config.json").is_file():
        bundled = sorted(d.name for d in WEIGHTS_DIR.iterdir() if d.is_dir()) if WEIGHTS_DIR.is_dir() else []
        raise LiteVLMError(
            f"no model at {name_or_path!r}: expected a directory with config.json and model.safetensors, "
            f"or a bundled model name ({', '.join(bundled) or 'none installed'})"
        )
    return p


def part_dir(path: Path, name: str) -> Path:
    """A trained module's folder beside the weights (`litevlm quantize` copies them into FP8 checkpoints)."""
    if (path / name).is_dir():
        return path / name
    raise LiteVLMError(f"{path} has no {name}/ folder: train it first (litevlm train {name.split('_')[0]})")


def draft_dir(model_dir: str | Path) -> Path:
    """Where a model directory keeps its draft head."""
    return Path(model_dir) / DRAFT_SUBDIR


def images_from_dir(folder: str | Path) -> dict[str, Path]:
    """A folder with one image per camera, named by camera (CAM_FRONT.png, CAM_BACK.jpg, ...)."""
    root = Path(folder)
    if not root.is_dir():
        raise LiteVLMError(f"image folder not found: {root}")
    files = [f for f in sorted(root.iterdir()) if f.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", ".bmp")]
    images = {}
    for f in files:
        if f.stem not in CAMERAS:
            raise LiteVLMError(
                f"{f.name}: unknown camera name {f.stem!r}; name images {', '.join(c + '.png' for c in CAMERAS)}"
            )
        images[f.stem] = f
    missing = [c for c in CAMERAS if c not in images]
    if missing:
        raise LiteVLMError(f"{root} has {len(images)} camera views; missing {', '.join(missing)}: all six are required")
    return images
