"""Where a recipe's inputs came from: the models a training run read, named so that they can be found again.

A folder path names a model only while the folder exists and holds what it held: a scratch folder (/tmp/x, runs/x)
is gone or overwritten by the time anyone reads the record, and a bundled folder (src/litevlm/weights/drive-hd)
holds other weights after the next commit. So a recipe that reads another model (the checkpoint it continues from,
the TokenSelector that thins its prompts, the model a module is distilled on) records, beside the path it was
given, that folder's source (`recipe_sources`):

- `NAME@COMMIT` when the folder lies in a git checkout and is committed there unchanged: `git show COMMIT:PATH`
  gives it back. NAME is a bundled model's name (drive-hd@479f6d9 is src/litevlm/weights/drive-hd at 479f6d9),
  else the folder's path in the checkout.
- `NAME sha256:HEX` otherwise: the folder's name and the first 12 hex digits of the sha256 over its weight files
  (`content_hash`).

A stage that nobody can name any more (a scratch folder never committed) is recorded as `unknown: ` and the reason.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from litevlm.errors import LiteVLMError
from litevlm.models import WEIGHTS_DIR

# The fields of a lineage stage or a recipe that name a folder read, and those that hold its source.
PATH_FIELDS = ("checkpoint", "init", "token_drop_selector")
SOURCE_FIELDS = ("source", "sources")
UNKNOWN = "unknown: "


def source_of(path: str | Path) -> str:
    """How a recipe names the model folder at `path`: NAME@COMMIT inside a git checkout that holds it unchanged,
    else NAME sha256:HEX (module docstring)."""
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise LiteVLMError(f"no model folder at {path}: give the folder of a model (or of its module) to read")
    named = _committed(folder)
    if named is not None:
        return f"{named[0]}@{named[1]}"
    return f"{folder.name} sha256:{content_hash(folder)}"


def recipe_sources(**paths: str | Path | None) -> dict[str, str]:
    """{field: its folder's source} for a recipe's fields that name a folder (those set)."""
    return {name: source_of(p) for name, p in paths.items() if p is not None}


def content_hash(folder: Path) -> str:
    """The first 12 hex digits of the sha256 over the folder's .safetensors files (every file where it holds none),
    each file's path in the folder and its bytes, in path order; hidden folders (caches) are left out."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not _hidden(p, folder)]
    weights = [p for p in files if p.suffix == ".safetensors"] or files
    h = hashlib.sha256()
    for f in weights:
        h.update(f.relative_to(folder).as_posix().encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


def same_stage(a: dict, b: dict) -> bool:
    """Whether two lineage stages record the same training: equal once the folders they were read from (their
    paths and sources) are left out, so that one stage read from two copies of its folder counts once."""
    return _without_folders(a) == _without_folders(b)


def _without_folders(x):
    if isinstance(x, dict):
        return {
            k: (None if v is None else "") if k in PATH_FIELDS else _without_folders(v)
            for k, v in x.items()
            if k not in SOURCE_FIELDS
        }
    if isinstance(x, list):
        return [_without_folders(v) for v in x]
    return x


def _hidden(path: Path, folder: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(folder).parts)


def _committed(folder: Path) -> tuple[str, str] | None:
    """(name, short commit) when `folder` lies in a git checkout whose HEAD holds it as it is now; None when it is
    outside one, or has changed, untracked or ignored files there."""
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top is None or _git(folder, "status", "--porcelain", "--ignored", "--", ".") != "":
        return None
    if not _git(folder, "ls-files", "--", "."):
        return None
    commit = _git(folder, "rev-parse", "--short", "HEAD")
    if commit is None:
        return None
    try:
        name = folder.relative_to(WEIGHTS_DIR.resolve()).as_posix()
    except ValueError:
        name = folder.relative_to(Path(top).resolve()).as_posix()
    return name, commit


def _git(folder: Path, *args: str) -> str | None:
    """git's output in `folder`, None where git fails there (not a checkout) or is not installed: either way the
    folder is named by its content instead."""
    try:
        proc = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None
