"""The one parser of the devices users name: ``device=`` and ``map_location=`` arguments.

Used by gdsfs.torch (materialize, GDSBatch.to), gdsfs.safetensors and gdsfs.checkpoint, so that
one spelling means one device everywhere:

- an int N is ``cuda:N``; a string or ``torch.device`` is what ``torch.device`` makes of it;
- only ``cpu`` and ``cuda`` devices are accepted (ValueError otherwise): those are the memories
  the daemon reads into and writes from;
- ``cuda`` without an index is the current CUDA device;
- a CUDA device that does not exist is an error (RuntimeError), never a silent load to the CPU,
  as torch.load and safetensors do.
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["DeviceLike", "parse_device"]

DeviceLike = Union[int, str, torch.device]


def parse_device(device: DeviceLike, *, what: str = "device") -> torch.device:
    """The ``torch.device`` that ``device`` names, with an index when it is a CUDA device.

    Args:
        device: an int (CUDA ordinal), a string ("cpu", "cuda", "cuda:1") or a torch.device.
        what: the argument's name, for the error messages ("device", "map_location").

    Raises:
        ValueError: not a CPU or CUDA device.
        RuntimeError: a CUDA device that torch does not see.
    """
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"gdsfs: {what} {device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cpu":
        return dev
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = dev.index
    if index is None and n:
        index = torch.cuda.current_device()
    if index is None or index >= n:
        raise RuntimeError(
            f"gdsfs: {what} {str(device)!r} names a CUDA device that does not exist: torch sees {n} CUDA device(s); "
            f"pass {what}='cpu' or an existing 'cuda:N'"
        )
    return torch.device("cuda", index)
