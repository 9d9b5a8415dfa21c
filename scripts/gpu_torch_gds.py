#!/usr/bin/env python3
"""torch.cuda.gds (cuFile through PyTorch) read throughput, for comparison
with gdsfs's engines in scripts/gpu-test.sh.

Usage: gpu_torch_gds.py FILE [--no-cold]

Reads the whole FILE into one CUDA storage with GdsFile.load_storage, warm
(best of 3) and cold (after dropping the page cache), and prints one line per
mode: "torch.cuda.gds <warm|cold> <GB/s>" or why it could not run.
"""
import os
import sys
import time


def drop_caches(path):
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main():
    path = sys.argv[1]
    cold = "--no-cold" not in sys.argv
    try:
        import torch
        import torch.cuda.gds as gds
    except Exception as e:  # noqa: BLE001 - report any import failure
        print(f"torch.cuda.gds unavailable: {e}")
        return
    size = os.path.getsize(path)
    t = torch.empty(size, dtype=torch.uint8, device="cuda")
    st = t.untyped_storage()
    try:
        gds.gds_register_buffer(st)
    except Exception as e:  # noqa: BLE001
        print(f"torch.cuda.gds: gds_register_buffer failed ({e}); reading unregistered")
    try:
        f = gds.GdsFile(path, os.O_RDONLY)
    except Exception as e:  # noqa: BLE001
        print(f"torch.cuda.gds unavailable: GdsFile failed: {e}")
        return

    def once():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f.load_storage(st, 0)
        torch.cuda.synchronize()
        return size / (time.perf_counter() - t0) / 1e9

    try:
        once()  # warm-up
        print(f"torch.cuda.gds warm {max(once() for _ in range(3)):.2f}")
        if cold:
            drop_caches(path)
            print(f"torch.cuda.gds cold {once():.2f}")
    except Exception as e:  # noqa: BLE001
        print(f"torch.cuda.gds failed: {e}")


if __name__ == "__main__":
    main()
