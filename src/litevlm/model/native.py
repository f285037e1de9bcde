"""The native CPU steps (cpu_steps.cpp): built once per machine with the local C++ compiler, then loaded.

The source ships inside the package. The first process that needs it compiles it against the installed
torch with the machine's C++ compiler and ninja (a dependency), for this CPU's instructions (-march=native), into a
cache folder keyed by the source, torch, the interpreter, the CPU's instruction-set flags and the compile flags, so
later processes on this machine only load the library and a machine with other instructions builds its own. Where no
compiler is at hand, or the build fails, `ops()` returns None, says why once on stderr, and the eager steps serve.

    LITEVLM_NATIVE=0          never build or load them (eager steps)
    LITEVLM_CACHE=DIR         where builds are kept (default ~/.cache/litevlm)
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_steps.cpp")
# OpenMP where torch's own runtime is GCC's libgomp (Linux): a prompt's row loops then split over torch's threads
# (at::parallel_for), and the library shares torch's libgomp by its soname. Elsewhere only the simd pragmas.
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
CFLAGS = ["-O3", "-march=native", *(OPENMP or ["-fopenmp-simd"])]
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


def build_dir(cpu: str | None = None, cflags: list[str] | None = None) -> Path:
    """The folder this source builds into for this torch, interpreter, CPU (`cpu_features()`) and compile flags
    (CFLAGS): a cache folder shared between machines never hands one a library built for instructions it lacks."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__,
        sys.version,
        platform.machine(),
        cpu_features() if cpu is None else cpu,
        " ".join(CFLAGS if cflags is None else cflags),
    ):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    root = Path(os.environ.get("LITEVLM_CACHE") or Path.home() / ".cache" / "litevlm")
    return root / "native" / key.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """Compile (or find already compiled) and load the library -> its folder. Raises where it cannot."""
    from torch.utils.cpp_extension import load

    scripts = sysconfig.get_path("scripts")  # where pip puts the `ninja` binary, off PATH in an unactivated venv
    if shutil.which("ninja") is None and scripts and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("litevlm_cpu*.so")):
        print("litevlm: building the native CPU steps (once per machine) ...", file=sys.stderr, flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(
            name="litevlm_cpu",
            sources=[str(SOURCE)],
            build_directory=str(folder),
            extra_cflags=CFLAGS,
            extra_ldflags=OPENMP,
            is_python_module=False,
            verbose=verbose,
        )
    return folder


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
