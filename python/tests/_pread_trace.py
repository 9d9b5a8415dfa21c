"""A DataLoader worker_init_fn that records the worker's header preads (tests of planning from
the daemon's index: a worker that plans from it makes none)."""

from __future__ import annotations

import os
from typing import Iterable, Mapping


class PreadTrace:
    """worker_init_fn: the worker notes itself (a file ``worker-<id>`` under log), and each pread
    it makes at one of starts (per shard file name: offsets where a header read lands, e.g. an
    x.npy member's or an MDS ndarray value's first byte) as a line in ``<prefix>-<id>``."""

    def __init__(self, log: str, starts: Mapping[str, Iterable[int]], prefix: str = "hdr") -> None:
        self.log, self.prefix = log, prefix
        self.starts = {k: set(v) for k, v in starts.items()}

    def __call__(self, wid: int) -> None:
        real, log, starts, prefix = os.pread, self.log, self.starts, self.prefix
        open(os.path.join(log, f"worker-{wid}"), "w").close()

        def pread(fd: int, n: int, off: int) -> bytes:
            try:
                name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                name = ""
            if off in starts.get(name, ()):
                with open(os.path.join(log, f"{prefix}-{wid}"), "a") as f:
                    f.write(f"{name} {off} {n}\n")
            return real(fd, n, off)

        os.pread = pread  # type: ignore[assignment]
