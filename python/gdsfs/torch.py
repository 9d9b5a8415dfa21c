"""PyTorch integration: tensors from gdsfs leases and a GDS-aware IterableDataset.

DataLoader workers never touch CUDA: they ask the daemon (an ioctl on the
shard they opened) to read sample fields into its slabs and yield small
picklable TensorRefs. The main process, which has the CUDA context, turns
them into tensors: in the DataLoader's pin-memory thread (GDSBatch.pin_memory)
or with materialize(). In host mode (a mount without GPU) the same API yields
CPU tensors from the daemon's shared host memory.

Example:
    >>> ds = gdsfs.torch.GDSShardDataset("/mnt/data/train-{000..009}.tar",
    ...                                  gpu_keys=["x.npy"], shuffle=True, seed=17)
    >>> dl = gdsfs.torch.DataLoader(ds, batch_size=64, num_workers=8)
    >>> for batch in dl:
    ...     batch["x.npy"]          # a CUDA tensor
"""

from __future__ import annotations

from ._collate import collate
from ._dataset import DataLoader, GDSShardDataset, StatefulDataLoader, default_decode, stateful_dataloader
from ._errors import GDSPoolError, GDSPoolWarning, GDSShardChangedError, GDSShardError, GDSShardWarning
from ._tensors import GDSBatch, GDSSample, TensorRef, materialize, tensor_from_ref, writable_view

__all__ = [
    "DataLoader",
    "GDSBatch",
    "GDSPoolError",
    "GDSPoolWarning",
    "GDSSample",
    "GDSShardDataset",
    "GDSShardChangedError",
    "GDSShardError",
    "GDSShardWarning",
    "StatefulDataLoader",
    "TensorRef",
    "collate",
    "default_decode",
    "materialize",
    "stateful_dataloader",
    "tensor_from_ref",
    "writable_view",
]
