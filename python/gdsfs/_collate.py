"""gdsfs.torch.collate: batches of GDSSamples (or one sample, for batch_size=None).

The batching itself (TensorRef columns kept in daemon memory, one gather per field at
materialization) is _tensors.collate; this layer decides what a batch of samples that do not all
have the same fields means, and wraps single samples.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence, Union

from . import _core
from ._tensors import GDSBatch, GDSSample, TensorRef, _Batches, _RefColumn, collate as _collate_batch

__all__ = ["collate"]

MISSING_POLICIES = ("raise", "drop")


def _where(s: Mapping[str, Any], i: int) -> str:
    if "__key__" not in s:
        return f"sample {i} of the batch"
    return f"sample {s.get('__key__')!r} of shard {s.get('__url__')!r}"


def _release_refs(refs: Iterable[TensorRef]) -> None:
    """Give back the leases of TensorRefs no one will materialize (dropped fields or samples).
    Never touches CUDA: usable in DataLoader workers."""
    by_session: dict[tuple[str, int], list[Any]] = {}
    for t in refs:
        if t.ref.lease:
            by_session.setdefault((t.ref.mount, t.ref.session), []).append(t.ref)
    for rs in by_session.values():
        try:
            _core.session_for(rs[0]).release(rs)
        except Exception:  # noqa: BLE001 - the session's end returns them anyway
            pass


def _same_fields(samples: Sequence[Mapping[str, Any]], missing: str) -> Sequence[Mapping[str, Any]]:
    first = samples[0]
    keys0 = first.keys()
    if all(s.keys() == keys0 for s in samples):  # set equality of the key views, no set made per sample
        return samples
    want = list(keys0)
    wanted = set(want)
    if missing == "raise":
        for i, s in enumerate(samples[1:], 1):
            have = set(s.keys())
            lacks = [k for k in want if k not in have]
            if lacks:
                raise ValueError(
                    f"gdsfs: {_where(s, i)} has no field {lacks[0]!r}, which {_where(first, 0)} has: read only fields every sample has "
                    f"(keys=[...]), or collate with functools.partial(gdsfs.torch.collate, missing='drop') to keep only "
                    "the fields every sample of a batch has")
            extra = sorted(have - wanted)
            if extra:
                raise ValueError(
                    f"gdsfs: {_where(s, i)} has field {extra[0]!r}, which {_where(first, 0)} lacks: read only fields every sample has "
                    f"(keys=[...]), or collate with functools.partial(gdsfs.torch.collate, missing='drop') to keep only "
                    "the fields every sample of a batch has")
    common = set.intersection(*(set(s.keys()) for s in samples))
    out: list[Mapping[str, Any]] = []
    dropped: list[TensorRef] = []
    for s in samples:
        kept = GDSSample({k: s[k] for k in want if k in common})
        for attr in ("progress", "epoch", "gpu_fields"):
            if hasattr(s, attr):
                setattr(kept, attr, getattr(s, attr))
        dropped.extend(v for k, v in s.items() if k not in common and isinstance(v, TensorRef))
        out.append(kept)
    _release_refs(dropped)
    return out


class _SampleBatch(GDSBatch):
    """One sample collated for batch_size=None: materializes to a GDSBatch of that sample's
    fields, without the batch dimension."""

    def materialize(self, device: Any = None, *, pin: bool = False, _defer: bool = False, _parsed: bool = False,
                    _record: bool = True) -> GDSBatch:
        refs = [k for k, v in self.data.items() if isinstance(v, _RefColumn)]
        b = super().materialize(device, pin=pin, _defer=_defer, _parsed=_parsed, _record=_record)
        data = dict(b.data)
        for k in refs:
            data[k] = data[k][0]
        out = GDSBatch(data, gpu_fields=b.gpu_fields, progress=b.progress, epoch=b.epoch, slots=b.slots, engines=b.engines)
        out._pending, b._pending = b._pending, None
        return out


def collate(samples: Union[Sequence[Mapping[str, Any]], Mapping[str, Any]], *, missing: str = "raise") -> GDSBatch:
    """Collate GDSSamples into a GDSBatch (use as DataLoader collate_fn).

    TensorRef fields stay in daemon memory until pin_memory()/materialize();
    tensors are stacked, numbers become tensors, everything else a list.
    Given one sample (DataLoader(batch_size=None)), the batch materializes to
    that sample's fields without a batch dimension, other fields as they are.

    Args:
        samples: the samples of a batch, or one sample.
        missing: what a batch whose samples do not all have the same fields
            means: "raise" (default: ValueError naming the sample, its shard
            and the field) or "drop" (keep the fields every sample of the
            batch has; the dropped gpu fields' leases go back at once).
    """
    if missing not in MISSING_POLICIES:
        raise ValueError(f"gdsfs: collate missing={missing!r} is not one of {', '.join(MISSING_POLICIES)}")
    if isinstance(samples, Mapping):
        one = _collate_batch([samples])
        data = {k: (v if isinstance(v, _RefColumn) else samples[k]) for k, v in one.data.items()}
        return _SampleBatch(data, gpu_fields=one.gpu_fields, progress=one.progress, epoch=one.epoch, slots=one.slots, engines=one.engines)
    if not samples:
        raise ValueError("gdsfs: collate of an empty batch")
    return _collate_batch(_same_fields(samples, missing))


class _KCollate:
    """A DataLoader worker's collate_fn when it sends k batches per item (gdsfs.torch.DataLoader's
    batches_per_item): torch's fetcher hands it up to k * batch_size samples (fewer only at the end
    of the worker's samples) and it collates each batch_size of them with collate, in order.
    drop_last: a short batch (the worker's last) is left out; torch itself is told not to drop a
    short item, which would drop that item's full batches too."""

    def __init__(self, batch_size: int, k: int, drop_last: bool) -> None:
        self.batch_size, self.k, self.drop_last = batch_size, k, drop_last

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> _Batches:
        n, bs = len(samples), self.batch_size
        if self.drop_last:
            n -= n % bs
        return _Batches(collate(samples[i : i + bs]) for i in range(0, n, bs))
