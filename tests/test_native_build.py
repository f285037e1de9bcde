"""The native library's build folder per torch installation, its atomic publishing, and recipes' clocks.

No compiler runs here: `native.compile_into` is replaced by a fake that writes a library file, and
`torch.ops.load_library` by one that records what would be loaded.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from litevlm.model import native

CPU = "fpu sse2 avx2 | AVX2"


def fake_torch(root: Path, lib_bytes: bytes = b"x") -> str:
    """A torch package folder with a main library -> its __init__.py path (what torch.__file__ would be)."""
    (root / "torch" / "lib").mkdir(parents=True)
    (root / "torch" / "lib" / "libtorch_cpu.so").write_bytes(lib_bytes)
    (root / "torch" / "__init__.py").write_text("")
    return str(root / "torch" / "__init__.py")


def test_two_torch_installations_of_one_version_build_into_two_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("LITEVLM_CACHE", str(tmp_path / "cache"))
    a, b = fake_torch(tmp_path / "venv-a"), fake_torch(tmp_path / "venv-b")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv-a"))
    monkeypatch.setattr(torch, "__file__", a)
    first = native.build_dir(cpu=CPU)
    assert first == native.build_dir(cpu=CPU)  # stable
    assert first.parent == tmp_path / "cache" / "native"
    monkeypatch.setattr(torch, "__file__", b)
    assert native.build_dir(cpu=CPU) != first  # another torch folder
    monkeypatch.setattr(torch, "__file__", a)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv-b"))
    assert native.build_dir(cpu=CPU) != first  # the same torch seen from another environment
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv-a"))
    monkeypatch.setattr(torch.version, "git_version", "another-commit")
    assert native.build_dir(cpu=CPU) != first  # another build of torch
    monkeypatch.undo()
    monkeypatch.setenv("LITEVLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv-a"))
    monkeypatch.setattr(torch, "__file__", a)
    (Path(a).parent / "lib" / "libtorch_cpu.so").write_bytes(b"reinstalled")
    assert native.build_dir(cpu=CPU) != first  # torch reinstalled over the same folder


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """native.build with a fake compiler (counts its runs, takes `delay` s) and a recording loader."""
    monkeypatch.setenv("LITEVLM_CACHE", str(tmp_path / "cache"))
    final = native.build_dir()
    state = types.SimpleNamespace(final=final, compiled=0, loaded=[], delay=0.0)

    def compile_into(folder: Path, verbose: bool = False) -> Path:
        state.compiled += 1
        folder.mkdir(parents=True, exist_ok=True)
        time.sleep(state.delay)
        lib = folder / "litevlm_cpu.so"
        lib.write_text(f"built by run {state.compiled}")
        return lib

    monkeypatch.setattr(native, "build_dir", lambda: final)
    monkeypatch.setattr(native, "compile_into", compile_into)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: state.loaded.append(Path(path)))
    return state


def test_a_folder_without_the_ready_marker_is_never_loaded(fake_build):
    final = fake_build.final
    final.mkdir(parents=True)
    (final / "litevlm_cpu.so").write_text("half-written")  # a build that never finished
    assert native.library(final) is None
    assert native.build() == final
    assert fake_build.compiled == 1  # rebuilt, not loaded
    assert fake_build.loaded == [final / "litevlm_cpu.so"]
    assert (final / "litevlm_cpu.so").read_text() == "built by run 1"
    assert (final / native.READY).read_text().strip() == "litevlm_cpu.so"
    assert not list(final.parent.glob("*.tmp-*")) and not list(final.parent.glob("*.old-*"))
    # a published folder is loaded as it is
    assert native.build() == final
    assert fake_build.compiled == 1
    assert fake_build.loaded == [final / "litevlm_cpu.so"] * 2


def test_a_second_publisher_does_not_clobber_the_first(tmp_path):
    final = tmp_path / "native" / "key"
    final.parent.mkdir()
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "litevlm_cpu.so").write_text(name)
    assert native.publish(tmp_path / "first", final, "litevlm_cpu.so")
    assert not native.publish(tmp_path / "second", final, "litevlm_cpu.so")
    assert native.library(final).read_text() == "first"
    assert not (tmp_path / "first").exists() and not (tmp_path / "second").exists()


def test_concurrent_builders_compile_once_and_load_the_published_library(fake_build):
    fake_build.delay = 0.3
    threads = [threading.Thread(target=native.build) for _ in range(3)]  # flock excludes separate opens too
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_build.compiled == 1
    assert fake_build.loaded == [fake_build.final / "litevlm_cpu.so"] * 3


def test_a_failed_build_publishes_nothing(fake_build, monkeypatch):
    def broken(folder, verbose=False):
        folder.mkdir(parents=True, exist_ok=True)
        raise RuntimeError("foo.cpp:1:1: error: no compiler here")

    monkeypatch.setattr(native, "compile_into", broken)
    with pytest.raises(RuntimeError, match="no compiler here"):
        native.build()
    assert not fake_build.final.exists() and not list(fake_build.final.parent.glob("*.tmp-*"))
    assert fake_build.loaded == []


def test_the_token_recipes_budget_starts_after_its_setup(monkeypatch, tmp_path):
    """Loading the target and making its pipeline (a native build may take a minute) come before the clock starts:
    a setup that takes longer than the whole budget still leaves labelling its share of it."""
    import litevlm.models
    import litevlm.pipeline
    from litevlm.train import tokens

    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(tokens, "time", types.SimpleNamespace(time=lambda: clock.now))
    model = torch.nn.Linear(2, 2)
    loaded = types.SimpleNamespace(model=model, path=tmp_path)  # a folder: the recipe records where it came from
    monkeypatch.setattr(litevlm.models, "load_model", lambda name: loaded)

    def slow_setup(loaded, **options):
        clock.now += 600.0  # ten minutes of setup
        return types.SimpleNamespace(format=types.SimpleNamespace(tiling=None))

    monkeypatch.setattr(litevlm.pipeline.Pipeline, "from_loaded", staticmethod(slow_setup))
    seen = []

    class Stop(Exception):
        pass

    def build_items(pipe, recipe, frames, rng, deadline, progress):
        seen.append(deadline)
        raise Stop

    monkeypatch.setattr(tokens, "build_items", build_items)
    with pytest.raises(Stop):
        tokens.train_token_selector("fake", tokens.TokenRecipe(minutes=1.0, threads=torch.get_num_threads()))
    assert seen == [pytest.approx(1600.0 + 0.4 * 60)]
