"""The native CPU steps (cpu_steps.cpp): built once per machine with the local C++ compiler, then loaded.

The source ships inside the package. The first process that needs it compiles it against the installed
torch with the machine's C++ compiler and ninja (a dependency) in about 10 s, into a cache folder keyed by the source, the torch version and the
interpreter, so later processes only load the library. Where no compiler is at hand, or the build fails,
`ops()` returns None, says why once on stderr, and the TorchScript steps serve instead.

    LITEVLM_NATIVE=0          never build or load them (TorchScript steps)
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
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
_LOADED: list = []  # [torch.ops.litevlm_cpu or None], filled on first use
_ERROR: list = []  # [why the build or load failed], beside it


def enabled() -> bool:
    return os.environ.get("LITEVLM_NATIVE", "1") not in ("0", "false", "no", "off")


def build_dir() -> Path:
    """The folder this source, torch and interpreter build into."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__.encode(),
        sys.version.encode(),
        platform.machine().encode(),
        " ".join(CFLAGS).encode(),
    ):
        key.update(part)
    root = Path(os.environ.get("LITEVLM_CACHE") or Path.home() / ".cache" / "litevlm")
    return root / "native" / key.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """Compile (or find already compiled) and load the library -> its folder. Raises where it cannot."""
    from torch.utils.cpp_extension import load

    scripts = sysconfig.get_path(
        "scripts"
    )  # where pip puts the `ninja` package's binary, off PATH in an unactivated venv
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
            except Exception as err:  # no compiler, no ninja, a failed build: TorchScript serves
                lines = str(err).strip().splitlines() or [type(err).__name__]
                reason = next((line for line in lines if "error:" in line), lines[-1])
                _ERROR.append(reason[:300])
                print(f"litevlm: native CPU steps unavailable ({_ERROR[0]}); using TorchScript", file=sys.stderr)
        _LOADED.append(result)
    return _LOADED[0]


def error() -> str | None:
    """Why `ops()` returned None (after it did), or None."""
    return _ERROR[0] if _ERROR else ("disabled by LITEVLM_NATIVE" if _LOADED and _LOADED[0] is None else None)
