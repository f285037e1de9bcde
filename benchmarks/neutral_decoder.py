"""drive-hd on a decoder no token-pruning method was trained for, for the pruning race on neutral ground.

drive-hd's last training stage thinned 60% of its prompts exactly as its TokenSelector prunes them (r = 0.1, 0.2,
0.3): the decoder learnt to answer from the selector's choices, which the training-free pruners meet zero-shot. The
stage before it thinned half its prompts at random (keep 10%-95% of the visual tokens), which serves every method
alike, and the shipped TokenSelector was distilled on that stage's weights by the project's own recipe (MODEL.md).
This writes a model folder that is drive-hd with that stage: the decoder and towers of commit NEUTRAL_COMMIT, and
in config.json the recipe and lineage that made them, as that commit recorded them (with the commits of the stages
that the shipped drive-hd's lineage names); its architecture fields are the shipped drive-hd's, refused if that
commit's differ. The tokenizer, ViewSelector, TokenSelector and draft head are the shipped drive-hd's; MODEL.md says
which commit the weights and the recipe come from. Both come from the repository's history (a full clone; a
shallow one has to fetch that commit first).

    python benchmarks/neutral_decoder.py --out .bench-data/drive-hd-neutral
    python benchmarks/token_pruning.py --model .bench-data/drive-hd-neutral --data .bench-data/heldout --n 600

The folder is written beside its destination and renamed into place, so an interrupted run leaves nothing that
looks whole; an existing folder that holds what this would write (weights, config, card and the shipped files) is
kept, and one that differs in any of them is written again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from litevlm.train.lineage import same_stage

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = Path("src/litevlm/weights/drive-hd")
NEUTRAL_COMMIT = "5046942"  # drive-hd's stage with random thinning only, before the selector-taught stage
ARCHITECTURE = ("litevlm", "format")  # config.json's fields that say what the weights are; the rest is their record
STAGE = ("steps", "train_seconds", "recipe", "looks_probe")  # what a lineage entry keeps of a checkpoint's record


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True)


def resolve(commit: str) -> str:
    """`commit` as a short hash; an error that says how to get it where the checkout lacks it."""
    proc = git("rev-parse", "--verify", "--short", f"{commit}^{{commit}}")
    if proc.returncode != 0:
        raise SystemExit(
            f"no commit {commit} in the repository's history ({proc.stderr.decode().strip()}): this needs a full "
            f"clone (`git fetch --unshallow`, or `git fetch origin {commit}`)"
        )
    return proc.stdout.decode().strip()


def git_show(commit: str, name: str) -> bytes:
    """The file `name` of drive-hd's folder at `commit`, from git's history."""
    path = f"{commit}:{SHIPPED.as_posix()}/{name}"
    proc = git("show", path)
    if proc.returncode != 0:
        raise SystemExit(
            f"cannot read {path} from the repository's history ({proc.stderr.decode().strip()}): this needs a full "
            f"clone (`git fetch --unshallow`, or `git fetch origin {commit}`)"
        )
    return proc.stdout


def differences(a, b, prefix: str = "") -> list[str]:
    """The dotted keys where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys()) for d in differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".") or "(the whole value)"]


def stage_config(commit: str) -> dict:
    """config.json for drive-hd with `commit`'s weights: the shipped architecture fields, refused where `commit`'s
    differ (its weights would not fit them), and `commit`'s record of how its weights were made (`with_sources`);
    `source` names the weights as `litevlm.train.lineage` does, drive-hd@COMMIT."""
    shipped = json.loads((ROOT / SHIPPED / "config.json").read_text())
    theirs = json.loads(git_show(commit, "config.json"))
    changed = differences({k: theirs.get(k) for k in ARCHITECTURE}, {k: shipped.get(k) for k in ARCHITECTURE})
    if changed:
        raise SystemExit(
            f"drive-hd's architecture at commit {commit} differs from the shipped one's in {', '.join(changed)}: its "
            "weights do not fit the shipped config, tokenizer and modules; pick a commit of the same architecture"
        )
    record = with_sources({k: v for k, v in theirs.items() if k not in ARCHITECTURE}, shipped.get("lineage", []))
    return {**{k: shipped[k] for k in ARCHITECTURE}, **record, "source": f"drive-hd@{commit}"}


def with_sources(record: dict, shipped_lineage: list[dict]) -> dict:
    """`record` (a commit's recipe and lineage) with its stages as the shipped lineage records them, where that holds
    them all (the same training, `same_stage`): there each stage names the commit that made it, and the recipe the
    sources it read; the commit's own record names only the folders they were read from. Else `record` as it is."""
    earlier = record.get("lineage", [])
    if len(shipped_lineage) <= len(earlier):
        return record
    stage, shipped_stage = {k: record.get(k) for k in STAGE}, shipped_lineage[len(earlier)]
    if not same_stage(stage, {k: shipped_stage.get(k) for k in STAGE}) or not all(
        same_stage(a, b) for a, b in zip(earlier, shipped_lineage)
    ):
        print("the shipped lineage does not hold this stage: its record is kept as committed", file=sys.stderr)
        return record
    return {**record, "recipe": shipped_stage["recipe"], "lineage": shipped_lineage[: len(earlier)]}


def card(commit: str, meta: dict, digest: str) -> str:
    """MODEL.md of the folder: where its weights, recipe and modules come from."""
    r = meta.get("recipe", {})
    if r.get("token_drop_prob") and r.get("token_drop_selector"):
        thinning = f"{r['token_drop_prob']:.0%} of its frames' visual tokens pruned by a TokenSelector"
    elif r.get("token_drop_prob"):
        keep = r.get("token_drop_min_keep", 0.3)
        thinning = f"{r['token_drop_prob']:.0%} of its frames' visual tokens thinned at random (keep {keep:.0%}-95%)"
    else:
        thinning = "no visual tokens thinned"
    selector = json.loads((ROOT / SHIPPED / "token_selector" / "config.json").read_text())
    distilled = selector.get("recipe", {}).get("sources", {}).get("model") == f"drive-hd@{commit}"
    return "\n".join(
        [
            f"# drive-hd at commit {commit}",
            "",
            f"drive-hd with the weights of commit {commit}, for the token-pruning race on a decoder no pruning method "
            "was taught. Written by `benchmarks/neutral_decoder.py`; not a model to deploy.",
            "",
            f"- Weights: drive-hd's `model.safetensors` at commit {commit} (sha256 {digest}), from a stage of "
            f"{meta.get('steps')} steps with {thinning}.",
            f"- Recipe and lineage (config.json): those commit {commit} recorded for these weights (`source`); "
            "the architecture fields are the shipped drive-hd's, the same as that commit's.",
            "- Tokenizer, ViewSelector, TokenSelector and draft head: the shipped drive-hd's"
            + (" (its TokenSelector was distilled on these weights)." if distilled else "."),
            f"- The card these weights were shipped with: `git show {commit}:{SHIPPED.as_posix()}/MODEL.md`.",
            "",
        ]
    )


def folder_files(commit: str) -> dict[str, bytes]:
    """Every file of the folder to write, by its path in it."""
    shipped = ROOT / SHIPPED
    files = {f.relative_to(shipped).as_posix(): f.read_bytes() for f in sorted(shipped.rglob("*")) if f.is_file()}
    weights = git_show(commit, "model.safetensors")
    meta = stage_config(commit)
    files["model.safetensors"] = weights
    files["config.json"] = (json.dumps(meta, indent=2) + "\n").encode()
    files["MODEL.md"] = card(commit, meta, hashlib.sha256(weights).hexdigest()).encode()
    return files


def write(out: Path, commit: str) -> Path:
    commit = resolve(commit)
    files = folder_files(commit)
    if out.is_dir():
        held = {f.relative_to(out).as_posix(): f for f in out.rglob("*") if f.is_file()}
        if held.keys() == files.keys() and all(held[k].read_bytes() == v for k, v in files.items()):
            print(f"{out} holds drive-hd at commit {commit} already", file=sys.stderr)
            return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for name, data in files.items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(data)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".bench-data/drive-hd-neutral", help="the model folder to write")
    p.add_argument("--commit", default=NEUTRAL_COMMIT, help="the commit whose drive-hd weights and recipe to take")
    args = p.parse_args(argv)
    out = write(Path(args.out).resolve(), args.commit)
    from litevlm.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(str(out))  # it loads as a model: shapes checked against the config
    print(f"{out}: {pipe.cfg.name} with the weights and recipe of commit {args.commit}")


if __name__ == "__main__":
    main()
