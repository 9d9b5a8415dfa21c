"""Small WebDataset tars for the dataset error and feature tests, written with the standard
library into a fresh directory of the session's gdsfs mount."""

from __future__ import annotations

import io
import itertools
import os
import tarfile
from typing import Any, Mapping, Sequence

_seq = itertools.count()


def fresh_dir(mount: Any, name: str) -> tuple[str, str]:
    """(backing dir, the same dir on the mount), new for each call."""
    rel = f"{name}-{os.getpid()}-{next(_seq)}"
    src = os.path.join(mount.src, rel)
    os.makedirs(src)
    return src, os.path.join(mount.mnt, rel)


def write_tar(path: str, samples: Sequence[tuple[str, Mapping[str, bytes]]]) -> None:
    """A tar of samples (key, {field: bytes}), members in sorted field order."""
    with tarfile.open(path, "w") as tf:
        for key, fields in samples:
            for ext in sorted(fields):
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(fields[ext])
                ti.mode = 0o444
                tf.addfile(ti, io.BytesIO(fields[ext]))


def npy(arr: Any) -> bytes:
    import numpy as np

    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()
