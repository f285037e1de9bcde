"""drive-hd on a decoder no token-pruning method was trained for, for the pruning race on neutral ground.

drive-hd's last training stage thinned 60% of its prompts exactly as its TokenSelector prunes them (r = 0.1, 0.2,
0.3): the decoder learnt to answer from the selector's choices, which the training-free pruners meet zero-shot. The
stage before it thinned half its prompts at random (keep 10%-95% of the visual tokens), which serves every method
alike, and the shipped TokenSelector was distilled on that stage's weights by the project's own recipe (MODEL.md).
This writes a model folder that is drive-hd with that stage's weights: the same config, tokenizer, ViewSelector,
TokenSelector and draft head, the decoder and towers of commit NEUTRAL_COMMIT. The stage's weights come from the
repository's history (a full clone; a shallow one has to fetch that commit first).

    python benchmarks/neutral_decoder.py --out .bench-data/drive-hd-neutral
    python benchmarks/token_pruning.py --model .bench-data/drive-hd-neutral --data .bench-data/heldout --n 600

The folder is written beside its destination and renamed into place, so an interrupted run leaves nothing that
looks whole; an existing folder with the same weights is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = Path("src/litevlm/weights/drive-hd")
NEUTRAL_COMMIT = "5046942"  # drive-hd's stage with random thinning only, before the selector-taught stage
STAGE_NOTE = (
    "drive-hd with its weights from commit {commit}: the stage that thinned half its prompts' visual tokens at random "
    "(keep 10%-95%), before the stage taught the TokenSelector's prunings. The rest (config, tokenizer, ViewSelector, "
    "TokenSelector distilled on these weights, draft head) is the shipped drive-hd's. Written by "
    "benchmarks/neutral_decoder.py for the token-pruning race; not a model to deploy.\n"
)


def stage_weights(commit: str) -> bytes:
    """The model.safetensors of drive-hd at `commit`, from git's history."""
    path = f"{commit}:{SHIPPED.as_posix()}/model.safetensors"
    proc = subprocess.run(["git", "show", path], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"cannot read {path} from the repository's history ({proc.stderr.decode().strip()}): this needs a full "
            f"clone (`git fetch --unshallow`, or `git fetch origin {commit}`)"
        )
    return proc.stdout


def write(out: Path, commit: str) -> Path:
    weights = stage_weights(commit)
    digest = hashlib.sha256(weights).hexdigest()
    if (out / "model.safetensors").is_file() and (out / "NEUTRAL.md").is_file():
        if hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == digest:
            print(f"{out} holds these weights already", file=sys.stderr)
            return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(ROOT / SHIPPED, partial)
    (partial / "model.safetensors").write_bytes(weights)
    (partial / "MODEL.md").unlink(missing_ok=True)  # the shipped card describes the other weights
    (partial / "NEUTRAL.md").write_text(STAGE_NOTE.format(commit=commit) + f"\nsha256 of model.safetensors: {digest}\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".bench-data/drive-hd-neutral", help="the model folder to write")
    p.add_argument("--commit", default=NEUTRAL_COMMIT, help="the commit whose drive-hd weights to take")
    args = p.parse_args(argv)
    out = write(Path(args.out).resolve(), args.commit)
    from litevlm.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(str(out))  # it loads as a model: shapes checked against the config
    print(f"wrote {out} ({pipe.cfg.name}, weights of {args.commit})")


if __name__ == "__main__":
    main()
