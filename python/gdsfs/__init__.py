"""gdsfs: GPU-direct reads of files on a gdsfs mount, without CUDA in the caller.

The core (this package) uses only the standard library and never imports
torch; PyTorch integration lives in submodules that import torch themselves
(``gdsfs.torch``, ``gdsfs.safetensors``, ``gdsfs.checkpoint``, ``gdsfs.dcp``).

Example:
    >>> import gdsfs
    >>> gdsfs.capabilities("/mnt/data/train-000.tar").engine
    'host'
"""

from __future__ import annotations

import importlib
from typing import Any

from ._core import Capabilities, Ref, Session, capabilities, find_mount, is_gdsfs_path, layout, status
from ._errors import GDSFallbackWarning, GDSLeaseError, GDSPoolError, GDSPoolWarning, GDSUnavailableError

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "GDSFallbackWarning",
    "GDSLeaseError",
    "GDSPoolError",
    "GDSPoolWarning",
    "GDSUnavailableError",
    "Ref",
    "Session",
    "capabilities",
    "find_mount",
    "is_gdsfs_path",
    "layout",
    "status",
]

_SUBMODULES = ("torch", "safetensors", "checkpoint", "dcp")


def __getattr__(name: str) -> Any:
    # PEP 562: gdsfs.torch etc. load on first use, so `import gdsfs` never
    # imports torch.
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gdsfs' has no attribute {name!r}")
