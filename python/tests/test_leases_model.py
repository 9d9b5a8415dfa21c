"""A model-based (stateful property) test of lease ownership, over a real
host-engine mount: random interleavings of iter/next/break/islice/close,
del + gc.collect, materialize (copy and zero-copy), collate, pickled copies,
set_epoch/state_dict/load_state_dict, dataset close/reclaim, and
DataLoaders (num_workers 0 and 2, fork and spawn, stock and gdsfs) across
several datasets and sessions. Every byte that comes back is checked
against the file; a TensorRef is expected to materialize exactly once
(GDSLeaseError after); at the end of each run the pool must be idle.

Seeded: GDSFS_MODEL_SEED (default 11) picks the runs, GDSFS_MODEL_STEPS
(default: a CI-sized budget) the steps of each; the seed is printed on
failure. GDSFS_MODEL_SHRINK=1 shrinks a failing run to a short program
(slow: each candidate replays against the daemon). Long local mode, e.g.:

    GDSFS_MODEL_STEPS=20000 GDSFS_MODEL_SEED=$RANDOM \\
        /usr/bin/python3 -m pytest -q python/tests/test_leases_model.py
"""

from __future__ import annotations

import gc
import io
import itertools
import os
import pickle
import sys
import tarfile
import traceback
import warnings
from typing import Any, Iterator

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule, run_state_machine_as_test  # noqa: E402

import gdsfs  # noqa: E402
import gdsfs.torch as gt  # noqa: E402
from gdsfs import _leases  # noqa: E402

import conftest  # noqa: E402

# Hypothesis looks for referrers of the RNGs it manages; gc.freeze() (below)
# hides them and it warns, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:It looks like `register_random`")

SEED = int(os.environ.get("GDSFS_MODEL_SEED", "11"))
STEPS = int(os.environ.get("GDSFS_MODEL_STEPS", "0"))  # total steps of the plain run; 0: CI size
SHRINK = os.environ.get("GDSFS_MODEL_SHRINK", "") not in ("", "0")  # shrink a failing run (slow)
NSHARDS, PER_SHARD = 3, 10


def _npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


class Data:
    """Small shards (a few pages per sample, so each has its own lease)."""

    def __init__(self, mount: conftest.Mount) -> None:
        self.mount = mount
        rng = np.random.default_rng(7)
        self.truth: dict[str, tuple[bytes, int]] = {}
        self.paths: list[str] = []
        os.makedirs(os.path.join(mount.src, "m"), exist_ok=True)
        for s in range(NSHARDS):
            name = f"m-{s}.tar"
            with tarfile.open(os.path.join(mount.src, "m", name), "w") as tf:
                for i in range(PER_SHARD):
                    key = f"m{s}/{i:03d}"
                    a = rng.integers(0, 256, int(rng.integers(1, 9000)), dtype=np.uint8)
                    for ext, data in (("cls", str(i).encode()), ("npy", _npy(a))):
                        ti = tarfile.TarInfo(f"{key}.{ext}")
                        ti.size = len(data)
                        tf.addfile(ti, io.BytesIO(data))
                    self.truth[key] = (a.tobytes(), i)
            self.paths.append(os.path.join(mount.mnt, "m", name))


@pytest.fixture(scope="module")
def model_data(tmp_path_factory: pytest.TempPathFactory, gdsfs_bin: str) -> Iterator[Data]:
    # A mount of its own: "the pool is idle" is then about this module only.
    # Under pytest's temp root, which removes old runs' directories itself.
    base = str(tmp_path_factory.mktemp("gdsfs-model"))
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.mkdir(src)
    os.mkdir(mnt)
    m = conftest.mount(gdsfs_bin, src, mnt, os.path.join(base, "daemon.log"))
    # What exists now (torch, pytest, ...) is never garbage: keep it out of
    # the collections the rules ask for, which are then ~100x cheaper.
    gc.collect()
    gc.freeze()
    try:
        yield Data(m)
    finally:
        gc.unfreeze()
        conftest.unmount(gdsfs_bin, mnt)


class Box:
    """What the bundles hold: the teardown empties every box, so that no
    holder survives in Hypothesis' own frames (the last rule's arguments)."""

    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v

    def __repr__(self) -> str:
        v = self.v
        return f"Box({v['__key__']!r})" if isinstance(v, dict) else f"Box({type(v).__name__})"


def _iterate(f: Any) -> Any:
    """f(), where a resume state of another worker count is refused (as it
    should be): that rule then yields nothing."""
    try:
        return f()
    except ValueError as e:
        if "resume with the same world size and num_workers" not in str(e):
            raise
        return []


def _lk(t: gt.TensorRef) -> tuple[int, int, int]:
    return (t.ref.daemon_pid, t.ref.session, t.ref.lease)


class LeaseModel(RuleBasedStateMachine):
    """The consumer's view: which samples it holds, which fields it spent."""

    data: Data  # set per run
    workers_ok = False  # DataLoader rules with workers
    contexts: tuple[str, ...] = ("fork",)

    datasets = Bundle("datasets")
    iterators = Bundle("iterators")
    samples = Bundle("samples")
    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        self.live_ds: list[gt.GDSShardDataset] = []
        self.spent: set[tuple[int, int, int]] = set()
        self.views: list[tuple[torch.Tensor, str, int]] = []
        self.loaders = 0
        self.boxes: list[Box] = []
        warnings.simplefilter("ignore", gdsfs.GDSFallbackWarning)

    def _box(self, v: Any) -> Box:
        b = Box(v)
        self.boxes.append(b)
        return b

    def _boxes(self, vs: Any) -> Any:
        return hypothesis.stateful.multiple(*[self._box(v) for v in vs])

    # -- checks -------------------------------------------------------------

    def _check_bytes(self, key: str, got: Any, start: int = 0) -> None:
        want, _ = self.data.truth[key]
        g = got.cpu().numpy().tobytes() if isinstance(got, torch.Tensor) else bytes(got)
        assert g == want[start:], f"{key}: materialized bytes are not the file's ({len(g)} bytes, want {len(want) - start})"

    def _check_cls(self, s: Any) -> None:
        assert s["cls"] == self.data.truth[s["__key__"]][1], s["__key__"]

    def _materialize_field(self, s: Any, copy: bool = True) -> None:
        t = s["npy"]
        if isinstance(t, torch.Tensor):  # read with plain pread (closed dataset)
            self._check_bytes(s["__key__"], t)
            return
        if _lk(t) in self.spent:
            with pytest.raises(gdsfs.GDSLeaseError):
                t.materialize(copy=copy)
            return
        got = t.materialize(copy=copy)
        self.spent.add(_lk(t))
        self._check_bytes(s["__key__"], got)
        if not copy:
            self.views.append((got[3:], s["__key__"], 3))

    # -- datasets -----------------------------------------------------------

    @precondition(lambda self: len(self.live_ds) < 4)
    @rule(target=datasets, shards=st.lists(st.integers(0, NSHARDS - 1), min_size=1, max_size=3, unique=True),
          read_ahead=st.integers(1, 6), shuffle=st.booleans())
    def new_dataset(self, shards: list[int], read_ahead: int, shuffle: bool) -> gt.GDSShardDataset:
        ds = gt.GDSShardDataset([self.data.paths[i] for i in shards], gpu_keys=["npy"], read_ahead=read_ahead, shuffle=shuffle, seed=len(self.live_ds))
        self.live_ds.append(ds)
        return ds

    @rule(ds=datasets, epoch=st.integers(0, 3))
    def set_epoch(self, ds: gt.GDSShardDataset, epoch: int) -> None:
        ds.set_epoch(epoch)
        assert ds.epoch == epoch

    @rule(ds=datasets, load=st.booleans())
    def state_dict(self, ds: gt.GDSShardDataset, load: bool) -> None:
        try:
            sd = ds.state_dict()
        except RuntimeError as e:
            # Documented: after a stock DataLoader's workers iterated it, the
            # main process cannot know their progress (docs/pytorch.md).
            assert getattr(ds, "_model_stock_workers", False) and "cannot see what the workers" in str(e), e
            return
        assert sd["epoch"] == ds.epoch
        if load:
            ds.load_state_dict(pickle.loads(pickle.dumps(sd)))

    @rule(ds=consumes(datasets))
    def close_dataset(self, ds: gt.GDSShardDataset) -> None:
        ds.close()

    @rule(ds=datasets)
    def reclaim(self, ds: gt.GDSShardDataset) -> None:
        ds.reclaim()

    # -- plain iteration ----------------------------------------------------

    @rule(target=iterators, ds=datasets)
    def start(self, ds: gt.GDSShardDataset) -> Any:
        return self._box(iter(ds))

    @rule(target=samples, it=iterators, k=st.integers(1, 4))
    def next_(self, it: Box, k: int) -> Any:
        if it.v is None:
            return hypothesis.stateful.multiple()
        return self._boxes(_iterate(lambda: list(itertools.islice(it.v, k))))  # islice over a live iterator: it stays open

    @rule(target=samples, ds=datasets, n=st.integers(1, 12))
    def islice(self, ds: gt.GDSShardDataset, n: int) -> Any:
        return self._boxes(_iterate(lambda: list(itertools.islice(ds, n))))

    @rule(target=samples, ds=datasets, n=st.integers(1, 12))
    def for_break(self, ds: gt.GDSShardDataset, n: int) -> Any:
        def loop() -> list[Any]:
            out = []
            for s in ds:
                out.append(s)
                if len(out) == n:
                    break
            return out

        return self._boxes(_iterate(loop))

    @rule(target=samples, ds=datasets)
    def next_iter(self, ds: gt.GDSShardDataset) -> Any:
        return self._boxes(_iterate(lambda: list(itertools.islice(iter(ds), 1))))

    @rule(it=consumes(iterators))
    def close_iterator(self, it: Box) -> None:
        if it.v is not None:
            it.v.close()

    @rule(it=consumes(iterators))
    def drop_iterator(self, it: Box) -> None:
        it.v = None
        gc.collect()

    # -- the consumer -------------------------------------------------------

    @rule(s=samples)
    def materialize(self, s: Box) -> None:
        if s.v is not None:
            self._check_cls(s.v)
            self._materialize_field(s.v)

    @rule(s=samples)
    def view(self, s: Box) -> None:
        if s.v is not None:
            self._materialize_field(s.v, copy=False)

    @rule(s=samples)
    def release(self, s: Box) -> None:
        t = s.v["npy"] if s.v is not None else None
        if isinstance(t, gt.TensorRef):
            t.release()
            self.spent.add(_lk(t))

    @rule(target=samples, s=samples)
    def pickled_copy(self, s: Box) -> Any:
        return self._boxes([] if s.v is None else [pickle.loads(pickle.dumps(s.v))])

    @rule(s=consumes(samples), collect=st.booleans())
    def drop_sample(self, s: Box, collect: bool) -> None:
        s.v = None
        if collect:
            gc.collect()

    @precondition(lambda self: bool(self.views))
    @rule(i=st.integers(0, 7), collect=st.booleans())
    def drop_view(self, i: int, collect: bool) -> None:
        del self.views[i % len(self.views)]
        if collect:
            gc.collect()

    @rule(target=batches, ss=st.lists(samples, min_size=1, max_size=5))
    def collate(self, ss: list[Box]) -> Any:
        vs = [s.v for s in ss]
        if not all(v is not None and isinstance(v["npy"], gt.TensorRef) for v in vs):
            return hypothesis.stateful.multiple()
        return self._box(gt.collate(vs))

    @rule(b=batches)
    def materialize_batch(self, b: Box) -> None:
        box = b
        b = box.v
        if b is None or b.materialized:
            return
        refs = b.data["npy"].refs
        if any(_lk(t) in self.spent for t in refs):
            with pytest.raises(gdsfs.GDSLeaseError):
                b.materialize()
            return
        out = b.materialize()
        self.spent.update(_lk(t) for t in refs)
        for i, key in enumerate(out["__key__"]):
            self._check_bytes(key, out["npy"][i])

    @rule(b=consumes(batches))
    def drop_batch(self, b: Box) -> None:
        b.v = None
        gc.collect()

    # -- DataLoaders --------------------------------------------------------

    @precondition(lambda self: self.loaders < 3)
    @rule(target=batches, ds=datasets, workers=st.sampled_from([0, 2]), stock=st.booleans(), n=st.integers(1, 3), ctx=st.integers(0, 7))
    def dataloader(self, ds: gt.GDSShardDataset, workers: int, stock: bool, n: int, ctx: int) -> Any:
        return self._dataloader(ds, workers, stock, n, self.contexts[ctx % len(self.contexts)])

    def _dataloader(self, ds: gt.GDSShardDataset, workers: int, stock: bool, n: int, context: str) -> Any:
        if workers and not self.workers_ok:
            workers = 0
        kw: dict[str, Any] = {"batch_size": 3, "num_workers": workers}
        if workers:
            self.loaders += 1
            kw["multiprocessing_context"] = context
            RUNS[context] = RUNS.get(context, 0) + 1
        if stock and workers:
            ds._model_stock_workers = True  # type: ignore[attr-defined]
        dl = torch.utils.data.DataLoader(ds, collate_fn=gt.collate, **kw) if stock else gt.DataLoader(ds, **kw)

        def take() -> list[Any]:
            it = iter(dl)
            return list(itertools.islice(it, n))  # then abandoned mid-epoch

        got = _iterate(take)
        # Unbind both (the closure's cell too) rather than del: pyflakes reads a del of a
        # name a closure uses as leaving the closure an undefined name.
        take = dl = None  # type: ignore[assignment]
        gc.collect()
        keep = []
        while got:
            b = got.pop(0)
            if b.materialized:
                for i, key in enumerate(b["__key__"]):
                    self._check_bytes(key, b["npy"][i])
            else:
                keep.append(b)
            del b
        # This frame can outlive the call (seen with spawned workers: a
        # traceback kept somewhere names it): it must not hold batches.
        boxes = self._boxes(keep)
        keep.clear()
        return boxes

    # -- invariants and the end ---------------------------------------------

    @invariant()
    def views_keep_their_bytes(self) -> None:
        for v, key, start in self.views:
            self._check_bytes(key, v, start)

    def teardown(self) -> None:
        self.views_keep_their_bytes()
        self.views.clear()
        for ds in self.live_ds:
            ds.close()
        self.live_ds.clear()
        # Drop every holder the bundles still have, then the pool is idle.
        for b in self.boxes:
            b.v = None
        self.boxes.clear()
        gc.collect()
        _leases.drain()
        m = self.data.mount
        n = m.wait_leases(0, timeout_s=5.0)
        assert n == 0, f"the pool is not idle after the run: {m.stats()}; held here: {_leases.live()}"


class SpawnFirst(LeaseModel):
    """Starts with a spawned-worker DataLoader over a new dataset, whose
    (unmaterialized) batches the random steps then interleave with."""

    @initialize(target=LeaseModel.batches, stock=st.booleans())
    def spawned(self, stock: bool) -> Any:
        ds = self.new_dataset([0, 1], 2, True)
        return self._dataloader(ds, 2, True, 2, "spawn")


# DataLoaders with workers started, per multiprocessing context.
RUNS: dict[str, int] = {}


class TextUnraisables:
    """sys.unraisablehook for the runs: keeps each report as text only.

    pytest's own hook keeps the last unraisable exception, its traceback
    and so its frames' locals, until the test ends. torch 1.13's spawned
    DataLoader workers sometimes abort at exit ("terminate called without
    an active exception": their queue's feeder thread is still pickling a
    tensor when the interpreter finalizes; a plain torch dataset does it
    too), and the abandoned iterator's __del__ then raises "DataLoader
    worker ... is killed by signal: Aborted" from _shutdown_workers. Kept by
    pytest, that traceback keeps the iterator alive, with the batches it
    had received out of order: they hold leases, their session cannot end,
    and the teardown saw the pool not idle. Here the report is formatted
    at once and the exception let go; the reports are warned after the run.
    """

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.prev: Any = None

    def hook(self, u: Any) -> None:
        try:
            what = repr(u.object)
        except Exception:  # noqa: BLE001 - a report must not raise in the hook
            what = f"<{type(u.object).__name__}>"
        where = f"{u.err_msg or 'Exception ignored in'}: {what}"
        self.reports.append(where + "\n" + "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))

    def __enter__(self) -> "TextUnraisables":
        self.prev, sys.unraisablehook = sys.unraisablehook, self.hook
        return self

    def __exit__(self, *exc: object) -> None:
        sys.unraisablehook = self.prev
        for r in self.reports:
            warnings.warn(pytest.PytestUnraisableExceptionWarning(r))


def _run(data: Data, *, seed: int, examples: int, steps: int, workers: bool, contexts: tuple[str, ...] = ("fork",), base: type = LeaseModel) -> None:
    class Machine(base):  # type: ignore[misc, valid-type]
        pass

    Machine.data = data
    Machine.workers_ok = workers
    Machine.contexts = contexts

    def factory() -> LeaseModel:
        return Machine()

    hypothesis.seed(seed)(factory)
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    cfg = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck), print_blob=False, phases=phases)
    try:
        with TextUnraisables():
            run_state_machine_as_test(factory, settings=cfg)
    except BaseException:
        print(f"\nlease model failed with GDSFS_MODEL_SEED={SEED} (run seed {seed}); rerun with that seed to reproduce")
        raise


def test_model_plain_iteration(model_data: Data) -> None:
    """Generators, samples, batches, views and sessions in one process."""
    steps = STEPS or 4000
    _run(model_data, seed=SEED, examples=max(1, steps // 50), steps=50, workers=False)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_model_with_workers(model_data: Data) -> None:
    """The same with DataLoaders of 0 and 2 forked workers."""
    steps = STEPS // 4 or 1000
    RUNS.clear()
    _run(model_data, seed=SEED + 1, examples=max(1, steps // 40), steps=40, workers=True)
    assert RUNS.get("fork", 0) > 0, "no DataLoader with workers ran: raise GDSFS_MODEL_STEPS"


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_model_with_spawned_workers(model_data: Data) -> None:
    """A short run whose worker DataLoaders spawn (slow to start)."""
    steps = STEPS // 10 or 60
    RUNS.clear()
    _run(model_data, seed=SEED + 2, examples=max(1, steps // 30), steps=30, workers=True, contexts=("spawn", "fork"), base=SpawnFirst)
    assert RUNS.get("spawn", 0) > 0


class _RaisesAtDel:
    """Stands for an abandoned DataLoader iterator whose __del__ raises
    (its worker was killed by a signal) while it holds a batch."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __del__(self) -> None:
        raise RuntimeError("DataLoader worker (pid 0) is killed by signal: Aborted.")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unraisable_in_a_run_keeps_no_leases(model_data: Data) -> None:
    """An exception raised by a holder's __del__ during a model run does
    not keep that holder (and its leases) alive: the runs' teardown checks
    that the pool is idle."""
    ds = gt.GDSShardDataset([model_data.paths[0]], gpu_keys=["npy"])
    try:
        with TextUnraisables() as u:
            holder = _RaisesAtDel(gt.collate(list(itertools.islice(ds, 3))))
            holder = None  # noqa: F841 - its __del__ raises
            gc.collect()
            _leases.drain()
            assert _leases.live() == [], f"an unraisable exception kept its object's leases: {_leases.live()}"
        assert len(u.reports) == 1 and "killed by signal" in u.reports[0], u.reports
    finally:
        ds.close()
    assert model_data.mount.wait_leases(0, timeout_s=5.0) == 0
