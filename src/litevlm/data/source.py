"""One data source for every command: `--data PATH [--images ROOT]`, checked before any work starts, and the
seeded split by scene that recipes hold their validation and calibration questions out with.

PATH is a folder written by `litevlm data synth` or a DriveLM JSON in any layout `litevlm.data.drivelm` reads
(train v1_1, challenge val/test, llama). The split rule: each scene's key is sha256("{seed}:{scene id}"); the
scenes are ordered by key and the first ceil(fraction x scenes) of them are held out (at least one when there are
two or more scenes, never all). It depends only on the scene ids, the seed and the fraction, not on the file's
order, and no scene is on both sides.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from pathlib import Path

from litevlm.data.drivelm import Sample, load_samples
from litevlm.errors import LiteVLMError


def add_data_options(p: argparse.ArgumentParser, required: bool = False, default_help: str = "") -> None:
    """`--data PATH [--images ROOT]`."""
    p.add_argument(
        "--data",
        required=required,
        default=None,
        help="a folder written by `litevlm data synth`, or a DriveLM JSON (train v1_1, challenge, llama)"
        + (f"; default: {default_help}" if default_help else ""),
    )
    p.add_argument("--images", default=None, help="where a DriveLM JSON's images live (nuScenes root)")


def check_data_options(args: argparse.Namespace) -> None:
    """`--images` without `--data` is refused: it only says where a --data JSON's images live."""
    if args.images is not None and args.data is None:
        raise LiteVLMError("--images says where --data's images live: pass --data too")


def load_data(path, images_root=None, require_images: bool = True) -> list[Sample]:
    """Every question of `path`, with every image file it names checked to exist before anything runs."""
    samples = load_samples(path, images_root=images_root, require_images=require_images)
    if not samples:
        raise LiteVLMError(f"{path} holds no questions")
    if require_images:
        check_image_files(samples, path, images_root)
    return samples


def check_image_files(samples: list[Sample], path, images_root=None) -> None:
    """One error naming how many image files are missing, and the first few, if any is."""
    seen: set[Path] = set()
    missing: list[str] = []
    for s in samples:
        for cam, f in s.images.items():
            if isinstance(f, Path) and f not in seen:
                seen.add(f)
                if not f.is_file():
                    missing.append(f"{f} ({cam} of {s.id})")
    if missing:
        hint = "" if images_root else "; pass --images ROOT where the nuScenes images live"
        raise LiteVLMError(
            f"{len(missing)} of the {len(seen)} images that {path} names are missing, e.g. "
            + "; ".join(missing[:3])
            + hint
        )


def scene_key(scene: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{scene}".encode()).hexdigest()


def scene_split(samples: list[Sample], fraction: float, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """(kept, held out): whole scenes held out by the module docstring's rule, questions kept in file order."""
    if not 0.0 <= fraction < 1.0:
        raise LiteVLMError(f"a held-out fraction must be in [0, 1); got {fraction}")
    scenes = sorted({s.scene_id for s in samples}, key=lambda sc: scene_key(sc, seed))
    n = min(math.ceil(fraction * len(scenes)), len(scenes) - 1) if len(scenes) > 1 and fraction > 0 else 0
    held = set(scenes[:n])
    return [s for s in samples if s.scene_id not in held], [s for s in samples if s.scene_id in held]
