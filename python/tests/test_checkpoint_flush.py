"""gdsfs.checkpoint.save and the daemon's O_DIRECT writes (issue 14): the writer starts
writeback flushes only for bytes that go through the page cache."""

from __future__ import annotations

import pytest
import torch

from _ckpt_helpers import _bytes
from conftest import mount, unmount

MIB = 1 << 20


@pytest.mark.parametrize("direct_io", ["auto", "never"])
def test_checkpoint_save_flushes_only_what_goes_through_the_page_cache(tmp_path, gdsfs_bin, monkeypatch, direct_io):
    """gdsfs.checkpoint.save (write_from) starts writeback flushes only for bytes the daemon
    writes buffered: none for 4 KiB-aligned storages of >= 1 MiB under --direct-io auto; with
    --direct-io never it flushes as it goes. The file loads back exact either way."""
    import gdsfs.checkpoint as gck
    from gdsfs._ckpt import tensorio

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"),
              "--host-pool", "16MiB", "--slab-size", "4MiB", "--uid-share", "100%", "--direct-io", direct_io)
    flushers: list[object] = []

    class Recording(tensorio._Flusher):
        def __init__(self, fd: int, every: int) -> None:
            flushers.append(self)
            super().__init__(fd, every)

    monkeypatch.setattr(tensorio, "_Flusher", Recording)
    monkeypatch.setattr(tensorio, "FLUSH_BYTES", 2 * MIB)
    try:
        g = torch.Generator().manual_seed(9)
        data = {f"w{i}": torch.randn(3 * MIB // 4, generator=g) for i in range(3)}  # 3 x 3 MiB
        p = m.path("model.pt")
        gck.save(data, p)
        if direct_io == "auto":
            assert not flushers, "the writer flushed storages the daemon wrote with O_DIRECT"
        else:
            assert flushers, "storages written through the page cache were never flushed before the fsync"
        back = torch.load(p, weights_only=True)
        assert set(back) == set(data) and all(torch.equal(_bytes(back[k]), _bytes(data[k])) for k in data)
        assert m.wait_leases(0) == 0
    finally:
        unmount(gdsfs_bin, m.mnt)
