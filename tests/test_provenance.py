"""Where the bundled models came from: every folder a recipe read is named by a commit or its content, never by a
scratch path, and each commit a bundled config names holds what the config says it does.

The checks on commits read the repository's history; in a checkout without it (a shallow clone, an installed
package) they are skipped with the reason.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from litevlm.errors import LiteVLMError
from litevlm.models import WEIGHTS_DIR
from litevlm.train.lineage import PATH_FIELDS, UNKNOWN, content_hash, recipe_sources, same_stage, source_of

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(WEIGHTS_DIR.rglob("config.json"))
IDENTITY = re.compile(r"^[\w.-]+(/[\w.-]+)*(@[0-9a-f]{7,40}| sha256:[0-9a-f]{12})$")
COMMITTED = re.compile(r"^(?P<name>[\w.-]+(/[\w.-]+)*)@(?P<commit>[0-9a-f]{7,40})$")
BUNDLED_PATH = re.compile(r"^src/litevlm/weights/[\w.-]+$")


def git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def has_git() -> bool:
    return shutil.which("git") is not None


def in_history(commit: str) -> bool:
    return has_git() and git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def scratch(text: str) -> bool:
    """A path into a scratch folder: /tmp, a tmp* folder (tempfile's), runs/, .bench-data."""
    if "/tmp" in text or "runs/" in text or ".bench-data" in text:
        return True
    return "/" in text and any(part.startswith("tmp") for part in re.split(r"[\s/`()]+", text))


def walk(x, where: str = ""):
    """(where, dict) for every dict inside a JSON value."""
    if isinstance(x, dict):
        yield where, x
        for k, v in x.items():
            yield from walk(v, f"{where}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from walk(v, f"{where}[{i}]")


def strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from strings(v)


def named(value) -> bool:
    return isinstance(value, str) and (IDENTITY.match(value) is not None or value.startswith(UNKNOWN))


# -- the helper ---------------------------------------------------------------------------------------------------


def make_model(folder: Path, weights: bytes) -> Path:
    (folder / "token_selector").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "token_selector" / "selector.safetensors").write_bytes(b"selector")
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.skipif(not has_git(), reason="needs git")
def test_a_committed_folder_is_named_by_its_commit_and_any_other_by_its_content(tmp_path):
    repo = tmp_path / "repo"
    model = make_model(repo / "models" / "m", b"weights")
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    ident = ("-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false")
    assert git(*ident, "commit", "-q", "-m", "m", cwd=repo).returncode == 0
    head = git("rev-parse", "--short", "HEAD", cwd=repo).stdout.strip()
    assert source_of(model) == f"models/m@{head}"
    assert recipe_sources(init=model, token_drop_selector=None) == {"init": f"models/m@{head}"}

    outside = make_model(tmp_path / "scratch" / "m", b"weights")  # the same weights in a folder git does not hold
    assert source_of(outside) == f"m sha256:{content_hash(outside)}"
    (outside / "config.json").write_text('{"steps": 3}')
    assert source_of(outside) == f"m sha256:{content_hash(model)}"  # named by its weights, not its card
    (outside / "token_selector" / "selector.safetensors").write_bytes(b"another selector")
    assert content_hash(outside) != content_hash(model)  # a module's weights are part of what was read

    (model / "model.safetensors").write_bytes(b"other weights")  # changed since HEAD: HEAD does not hold it
    assert source_of(model) == f"m sha256:{content_hash(model)}" and content_hash(model) != content_hash(outside)
    untracked = make_model(repo / "runs" / "x", b"weights")
    assert source_of(untracked) == f"x sha256:{content_hash(untracked)}"
    with pytest.raises(LiteVLMError, match="no model folder"):
        source_of(tmp_path / "missing")


def test_a_bundled_model_is_named_by_its_name_and_the_commit():
    folder = WEIGHTS_DIR / "drive-hd"
    if not has_git() or git("rev-parse", "--show-toplevel", cwd=folder).returncode != 0:
        pytest.skip("the bundled models are not in a git checkout here")
    if git("status", "--porcelain", "--", ".", cwd=folder).stdout.strip():
        pytest.skip("drive-hd's folder has uncommitted changes: it is named by its content until they are committed")
    assert source_of(folder) == f"drive-hd@{git('rev-parse', '--short', 'HEAD').stdout.strip()}"


def test_a_stage_read_from_two_folders_is_one_stage():
    stage = {
        "checkpoint": "src/litevlm/weights/drive-tiny",
        "source": "drive-tiny@8be1d08",
        "steps": 5,
        "recipe": {"lr": 1e-4, "init": "runs/cC", "sources": {"init": "cC sha256:0123456789ab"}},
    }
    copy = {
        **stage,
        "checkpoint": "runs/soup",
        "source": "soup sha256:ba9876543210",
        "recipe": {"lr": 1e-4, "init": "unknown: trained in a scratch folder and never committed"},
    }
    assert same_stage(stage, copy)
    assert not same_stage(stage, {**copy, "steps": 6})
    assert not same_stage(stage, {**copy, "recipe": {"lr": 1e-4, "init": None}})  # from scratch is another stage


# -- the bundled configs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(WEIGHTS_DIR).parent.as_posix())
def test_a_bundled_config_names_what_it_read_by_commit_or_as_unknown(path):
    meta = json.loads(path.read_text())
    assert not [s for s in strings(meta) if scratch(s)], "a scratch path in the record"
    assert COMMITTED.match(meta.get("source", "")), "the folder's own weights name the commit that made them"
    for where, d in walk(meta):
        if "checkpoint" in d:
            assert named(d.get("source")), f"{where}: a lineage stage without its source"
        for name, value in (d.get("sources") or {}).items():
            assert named(value), f"{where}.sources.{name} = {value!r}"
        for field in PATH_FIELDS:
            value = d.get(field)
            if value is None or named(value):
                continue
            beside = d.get("source") if field == "checkpoint" else (d.get("sources") or {}).get(field)
            assert BUNDLED_PATH.match(value) and named(beside), f"{where}.{field} = {value!r} with no source"


def weights_file(folder: Path) -> str:
    return "model.safetensors" if (folder / "model.safetensors").is_file() else "selector.safetensors"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(WEIGHTS_DIR).parent.as_posix())
def test_each_commit_a_bundled_config_names_holds_what_it_says(path):
    meta = json.loads(path.read_text())
    commits = {m["commit"] for _, d in walk(meta) for v in strings(d) if (m := COMMITTED.match(v))}
    missing = sorted(c for c in commits if not in_history(c))
    if missing:
        pytest.skip(f"commits {', '.join(missing)} are not in this checkout's history (a shallow clone?)")
    bundled = Path("src/litevlm/weights")

    # the folder's own weights: made by that commit (there, and not in its parent), the bytes in the folder now
    own = COMMITTED.match(meta.get("source", ""))
    assert own, "the folder's own weights name no commit"
    name = weights_file(path.parent)
    blob = f"{bundled / own['name'] / name}"
    now = git("hash-object", str(path.parent / name)).stdout.strip()
    assert git("rev-parse", f"{own['commit']}:{blob}").stdout.strip() == now
    assert git("rev-parse", f"{own['commit']}^:{blob}").stdout.strip() != now

    for where, d in walk(meta):
        if "checkpoint" in d and (m := COMMITTED.match(d["source"])):  # a stage: its record is that commit's
            there = json.loads(git("show", f"{m['commit']}:{bundled / m['name'] / 'config.json'}").stdout)
            assert (there["steps"], there["train_seconds"]) == (d["steps"], d["train_seconds"]), where
        for value in (d.get("sources") or {}).values():  # what a recipe read: that folder is there
            if m := COMMITTED.match(value):
                assert git("cat-file", "-e", f"{m['commit']}:{bundled / m['name'] / 'config.json'}").returncode == 0


# -- the neutral decoder's folder ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def neutral(benchmark_script):
    mod = benchmark_script("neutral_decoder")
    if not in_history(mod.NEUTRAL_COMMIT):
        pytest.skip(f"commit {mod.NEUTRAL_COMMIT} is not in this checkout's history (`git fetch --unshallow`)")
    return mod


def test_the_neutral_folder_carries_the_recipe_that_made_its_weights(neutral, tmp_path):
    commit = neutral.NEUTRAL_COMMIT
    out = tmp_path / "neutral"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "neutral_decoder.py"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    meta = json.loads((out / "config.json").read_text())
    theirs = json.loads(git("show", f"{commit}:src/litevlm/weights/drive-hd/config.json").stdout)
    shipped = json.loads((WEIGHTS_DIR / "drive-hd" / "config.json").read_text())

    # the commit's record, not the shipped stage's: random thinning, no selector
    assert "token_drop_selector" in shipped["recipe"] and meta["recipe"].get("token_drop_selector") is None
    assert {k: v for k, v in meta["recipe"].items() if k != "sources"} == theirs["recipe"]
    before = shipped["lineage"][len(theirs["lineage"]) - 1]  # the stage it continued from, as shipped
    assert meta["recipe"]["sources"] == {"init": before["source"]} and COMMITTED.match(before["source"])
    assert (meta["steps"], meta["train_seconds"]) == (theirs["steps"], theirs["train_seconds"])
    assert len(meta["lineage"]) == len(theirs["lineage"])
    assert all(same_stage(a, b) for a, b in zip(meta["lineage"], theirs["lineage"]))
    assert meta["litevlm"] == shipped["litevlm"] == theirs["litevlm"] and meta["source"] == f"drive-hd@{commit}"
    weights = subprocess.run(
        ["git", "show", f"{commit}:src/litevlm/weights/drive-hd/model.safetensors"], cwd=ROOT, capture_output=True
    ).stdout
    assert (out / "model.safetensors").read_bytes() == weights
    card = (out / "MODEL.md").read_text()
    assert f"weights of commit {commit}" in card and f"those commit {commit} recorded" in card
    assert (out / "token_selector" / "selector.safetensors").read_bytes() == (
        WEIGHTS_DIR / "drive-hd" / "token_selector" / "selector.safetensors"
    ).read_bytes()

    # the same again is kept; a stale config is written again
    stamp = (out / "config.json").stat().st_mtime_ns
    neutral.write(out, commit)
    assert (out / "config.json").stat().st_mtime_ns == stamp
    (out / "config.json").write_text(json.dumps(shipped))
    neutral.write(out, commit)
    assert json.loads((out / "config.json").read_text()) == meta and not (tmp_path / "neutral.partial").exists()


def test_the_neutral_folder_refuses_a_commit_of_another_architecture(neutral, monkeypatch):
    real = neutral.git_show

    def other_shape(commit, name):
        data = real(commit, name)
        if name != "config.json":
            return data
        meta = json.loads(data)
        meta["litevlm"]["text"]["num_layers"] += 1
        return json.dumps(meta).encode()

    monkeypatch.setattr(neutral, "git_show", other_shape)
    with pytest.raises(SystemExit, match=r"architecture.*litevlm\.text\.num_layers"):
        neutral.stage_config(neutral.NEUTRAL_COMMIT)
