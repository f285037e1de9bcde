"""Reading a module tree on hot paths, where `nn.Module.modules()` and `.parameters()` cost tens of microseconds."""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn


def submodules(module: nn.Module) -> Iterator[nn.Module]:
    """module and every module below it, read straight from the module dicts (no names, no memo: a module shared
    between two parents comes twice)."""
    stack = [module]
    while stack:
        m = stack.pop()
        yield m
        stack.extend(c for c in m._modules.values() if c is not None)
