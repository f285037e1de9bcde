"""The native CPU steps (cpu_steps.cpp): built once per torch installation with the local C++ compiler, then loaded.

The source ships inside the package. The first process that needs it compiles it against the installed
torch with the machine's C++ compiler and ninja (a dependency), for this CPU's instructions (-march=native), into a
cache folder keyed by the source, the torch installation (its folder, build and main library), the interpreter and
its environment (sys.prefix), the CPU's instruction-set flags and the compile flags, so later processes of this
installation only load the library, two virtual environments never rebuild over each other's folder, and a machine
with other instructions builds its own. Where no compiler is at hand, or the build fails, `ops()` returns None, says
why once on stderr, and the eager steps serve.

A build never writes into the folder that others load from: one process at a time (a file lock beside the folder)
compiles into a private temporary folder in a child interpreter, which also proves the library loads, writes the
READY marker last and renames the folder onto its final name, an atomic step. A process loads a library only from a
final folder holding READY, so it never sees a half-written one, and one that waits on another's build loads that.

    LITEVLM_NATIVE=0          never build or load them (eager steps)
    LITEVLM_CACHE=DIR         where builds are kept (default ~/.cache/litevlm)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_steps.cpp")
# OpenMP where torch's own runtime is GCC's libgomp (Linux): a prompt's row loops then split over torch's threads
# (at::parallel_for), and the library shares torch's libgomp by its soname. Elsewhere only the simd pragmas.
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
CFLAGS = ["-O3", "-march=native", *(OPENMP or ["-fopenmp-simd"])]
NAME = "litevlm_cpu"
READY = "READY"  # written last into a build folder; it holds the library's file name
_LOADED: list = []  # [torch.ops.litevlm_cpu or None], filled on first use
_ERROR: list = []  # [why the build or load failed], beside it


def enabled() -> bool:
    return os.environ.get("LITEVLM_NATIVE", "1") not in ("0", "false", "no", "off")


def cpu_features() -> str:
    """What the machine's instructions are: the CPU's flags (the `flags` line of /proc/cpuinfo, where there is one)
    and the vector capability torch dispatches to. A build with -march=native runs only where these match."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "")
    except OSError:  # not Linux: the machine name and torch's capability still tell ISAs apart
        flags = platform.processor()
    return " ".join(sorted(flags.split())) + " | " + torch.backends.cpu.get_cpu_capability()


def torch_installation() -> str:
    """Which torch installation this is, beyond its version: the real path of its package folder, the commit it was
    built from, and the size and time of its main library (a reinstall over the same folder changes them)."""
    folder = Path(torch.__file__).resolve().parent
    parts = [str(folder), str(getattr(torch.version, "git_version", ""))]
    for lib in sorted((folder / "lib").glob("libtorch_cpu.*")):
        stat = lib.stat()
        parts.append(f"{lib.name} {stat.st_size} {stat.st_mtime_ns}")
    return "\n".join(parts)


def build_dir(cpu: str | None = None, cflags: list[str] | None = None) -> Path:
    """The folder this source builds into for this torch installation, interpreter and environment (sys.prefix), CPU
    (`cpu_features()`) and compile flags (CFLAGS): a cache folder shared between machines never hands one a library
    built for instructions it lacks, nor between virtual environments one built against another torch."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__,
        torch_installation(),
        sys.version,
        str(Path(sys.prefix).resolve()),
        platform.machine(),
        cpu_features() if cpu is None else cpu,
        " ".join(CFLAGS if cflags is None else cflags),
    ):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    root = Path(os.environ.get("LITEVLM_CACHE") or Path.home() / ".cache" / "litevlm")
    return root / "native" / key.hexdigest()[:16]


def library(folder: Path) -> Path | None:
    """The library of a complete (published) build folder, or None where the folder is missing or unfinished."""
    try:
        name = (folder / READY).read_text().strip()
    except OSError:
        return None
    return folder / name if name and (folder / name).is_file() else None


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on `path` (created) so that one process at a time builds a folder; the lock goes with
    the process, so a killed builder never leaves it held. Without fcntl (Windows) there is no lock: the atomic
    publish still keeps a concurrent build harmless, only wasted."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process is building: say why this one pauses, then wait for it
            print("litevlm: waiting for another process's build of the native CPU steps ...", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_into(folder: Path, verbose: bool = False) -> Path:
    """Compile the library into `folder` -> its path. torch's `load` builds and loads in one call, so it runs in a
    child interpreter: this process then loads only the published copy, and a library that fails to load is never
    published. The child imports the same torch (its folder first on PYTHONPATH)."""
    spec = {
        "name": NAME,
        "sources": [str(SOURCE)],
        "build_directory": str(folder),
        "extra_cflags": CFLAGS,
        "extra_ldflags": OPENMP,
        "is_python_module": False,
        "verbose": verbose,
    }
    code = (
        "import json, sys, warnings; warnings.simplefilter('ignore')\n"
        "from torch.utils.cpp_extension import load\n"
        "load(**json.loads(sys.argv[1]))\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    site = str(Path(torch.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=not verbose, text=True, check=False
    )
    if run.returncode != 0:
        raise RuntimeError((run.stderr or "").strip() or f"the build exited with status {run.returncode}")
    built = sorted(folder.glob(f"{NAME}*.so")) + sorted(folder.glob(f"{NAME}*.pyd"))
    if not built:
        raise RuntimeError(f"the build left no {NAME} library in {folder}")
    return built[0]


def publish(temp: Path, final: Path, lib_name: str) -> bool:
    """Mark the finished build in `temp` READY (last) and rename it onto `final`, atomically: True where it became
    `final`; False where `final` was already published (by another process), whose build is kept and `temp`
    discarded. An unfinished `final` (no READY: never loaded) is replaced."""
    (temp / READY).write_text(lib_name + "\n")
    for _ in range(2):
        try:
            os.rename(temp, final)  # onto a missing (or empty) folder only: a published one is never overwritten
            return True
        except OSError:
            if library(final) is not None:
                shutil.rmtree(temp, ignore_errors=True)
                return False
            # an unfinished folder (from a killed build of an older layout): move it aside, then take its name
            junk = final.with_name(f"{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(final, junk)
            shutil.rmtree(junk, ignore_errors=True)
    raise RuntimeError(f"could not publish the native build at {final}")


def build(verbose: bool = False) -> Path:
    """Compile (or find already compiled) and load the library -> its folder. Raises where it cannot."""
    scripts = sysconfig.get_path("scripts")  # where pip puts the `ninja` binary, off PATH in an unactivated venv
    if shutil.which("ninja") is None and scripts and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    final = build_dir()
    if library(final) is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        with _locked(final.with_name(final.name + ".lock")):
            if library(final) is None:  # not published while this process waited for the lock
                for stale in final.parent.glob(final.name + ".tmp-*"):  # a killed builder's (the lock is ours)
                    shutil.rmtree(stale, ignore_errors=True)
                print("litevlm: building the native CPU steps (once per installation) ...", file=sys.stderr, flush=True)
                temp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
                try:
                    publish(temp, final, compile_into(temp, verbose).name)
                finally:
                    shutil.rmtree(temp, ignore_errors=True)
    lib = library(final)
    if lib is None:
        raise RuntimeError(f"the native build folder {final} holds no finished library")
    torch.ops.load_library(str(lib))
    return final


def ops():
    """torch.ops.litevlm_cpu (built and loaded on first use), or None where disabled or not buildable here."""
    if not _LOADED:
        result = None
        if enabled():
            try:
                build()
                result = torch.ops.litevlm_cpu
            except Exception as err:  # no compiler, no ninja, a failed build: the eager steps serve
                lines = str(err).strip().splitlines() or [type(err).__name__]
                reason = next((line for line in lines if "error:" in line), lines[-1])
                _ERROR.append(reason[:300])
                print(f"litevlm: native CPU steps unavailable ({_ERROR[0]}); using the modules", file=sys.stderr)
        _LOADED.append(result)
    return _LOADED[0]


def error() -> str | None:
    """Why `ops()` returned None (after it did), or None."""
    return _ERROR[0] if _ERROR else ("disabled by LITEVLM_NATIVE" if _LOADED and _LOADED[0] is None else None)
