"""Where models live and how one is loaded: a bundled model's name or a checkpoint directory -> its folder, the
trained modules' folders beside its weights, and `load_model` (weights, tokenizer and prompt format of any
checkpoint). Also the camera-image folder a question is asked about."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from litevlm.cameras import CAMERAS
from litevlm.data.tokenizer import Tokenizer
from litevlm.errors import LiteVLMError
from litevlm.model.prompt import PROMPT_FILE, PromptFormat, read_format
from litevlm.model.vlm import VLM

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
    """A folder with one image per camera, named by camera (CAM_FRONT.png, CAM_BACK.jpg, ...): camera -> path.

    Some cameras may be missing (a camera can fail on a car): only the questions that need them fail
    (`litevlm.frame.Frame`). A file named after no camera, or a folder with no camera image at all, is an error."""
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
        if f.stem in images:
            raise LiteVLMError(f"{root} has two images of {f.stem}: {images[f.stem].name} and {f.name}; keep one")
        images[f.stem] = f
    if not images:
        raise LiteVLMError(f"{root} holds no camera image; name them {', '.join(c + '.png' for c in CAMERAS)}")
    return images


# ------------------------------------------------------------------------------------------------
# Loading a model with everything its prompt needs
# ------------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    """A checkpoint ready to prompt: the model, its tokenizer, its prompt format and the folder it came from."""

    model: VLM
    tokenizer: Tokenizer
    format: PromptFormat
    path: Path


def load_model(
    name_or_path: str | Path = "drive-tiny", *, device="cpu", dtype: torch.dtype = torch.float32, **format_changes
) -> Loaded:
    """Any checkpoint: ours (`save_native`, or FP8 from `litevlm quantize`), a transformers InternVL (`-hf`) folder
    or the original InternVL layout, with its tokenizer and prompt format (`litevlm.model.prompt.read_format`).

    `format_changes` (system, camera_label, tiles, max_tiles, thumbnail; None = keep) adjust the prompt format of
    a model that has no prompt.json yet; one that has one was trained with it, and a change is refused.
    """
    from litevlm.model.hf import NATIVE_FORMAT, load_hf, load_native

    path = resolve_model_dir(name_or_path)
    meta = _read_config(path)
    if meta.get("format") != NATIVE_FORMAT:  # transformers' (its config may carry our special ids as "litevlm")
        model, _ = load_hf(path, dtype=dtype, device=device)
    elif "fp8" in meta:
        from litevlm.quant.fp8 import load_fp8

        model = load_fp8(path, device=device, dtype=dtype)
    else:
        model = load_native(path).to(device=device, dtype=dtype)
    tokenizer = tokenizer_for(path, model.cfg)
    fmt = read_format(path, tiles=model.cfg.tiles_per_view)
    changed = fmt.with_overrides(**format_changes)
    if changed != fmt and (path / PROMPT_FILE).is_file():
        ours, theirs = changed.to_dict(), fmt.to_dict()
        diff = ", ".join(f"{k}: {theirs[k]!r} -> {ours[k]!r}" for k in ours if ours[k] != theirs[k])
        raise LiteVLMError(
            f"{path / PROMPT_FILE} fixes the prompt its trained modules were made with; the options ask for another "
            f"({diff}). Drop those options, or train the modules again into a copy of the checkpoint"
        )
    return Loaded(model, tokenizer, changed, path)


def tokenizer_for(path: Path, cfg) -> Tokenizer:
    """The checkpoint's own tokenizer (tokenizer.json; else, with transformers installed, converted from the slow
    tokenizer files), checked against the model: vocabulary size and the ids of the prompt's special tokens."""
    if (path / "tokenizer.json").is_file():
        tok = Tokenizer.from_dir(path)
    elif any((path / f).is_file() for f in ("tokenizer.model", "vocab.json")):
        tok = _converted_tokenizer(path)
    else:
        raise LiteVLMError(
            f"{path} has no tokenizer (tokenizer.json, or vocab.json + merges.txt, or tokenizer.model): put the "
            "checkpoint's tokenizer files beside its config.json"
        )
    if tok.vocab_size > cfg.text.vocab_size:
        raise LiteVLMError(
            f"the tokenizer in {path} has {tok.vocab_size} tokens but the model's embedding has "
            f"{cfg.text.vocab_size} rows: this tokenizer does not belong to this checkpoint"
        )
    wrong = [
        f"{name} is {got} in the tokenizer but {want} in the model's config"
        for name, got, want in (
            ("<img>", tok.img_start_id, cfg.img_start_id),
            ("</img>", tok.img_end_id, cfg.img_end_id),
            ("<IMG_CONTEXT>", tok.image_id, cfg.image_token_id),
        )
        if got != want
    ]
    if wrong:
        raise LiteVLMError(f"the tokenizer in {path} does not fit the checkpoint: {'; '.join(wrong)}")
    return tok


def _converted_tokenizer(path: Path) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise LiteVLMError(
            f"{path} has no tokenizer.json; converting its slow tokenizer files needs transformers "
            "(pip install 'litevlm[hf]'), or save a tokenizer.json beside config.json"
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise LiteVLMError(f"cannot read the tokenizer files in {path}: {e}") from None
    return Tokenizer(hf.backend_tokenizer, hf.pad_token)


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LiteVLMError(f"{path / 'config.json'} is not valid JSON: {e.msg} at line {e.lineno}") from None


def modules_dir(loaded: Loaded, out: str | Path | None = None) -> Path:
    """Where a recipe saves the module it trained for `loaded` (`out`, else the model's own folder), with the prompt
    format it was trained on written there as prompt.json, so that `Pipeline.from_pretrained` rebuilds that prompt."""
    d = Path(out) if out is not None else loaded.path
    d.mkdir(parents=True, exist_ok=True)
    if (d / PROMPT_FILE).is_file() and read_format(d) != loaded.format:
        raise LiteVLMError(
            f"{d / PROMPT_FILE} holds another prompt format than the one these modules are trained with; "
            "save them into a copy of the checkpoint instead"
        )
    loaded.format.save(d)
    return d
