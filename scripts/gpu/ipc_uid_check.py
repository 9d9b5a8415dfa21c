#!/usr/bin/env python3
"""GPU check of issue 12 item 2 (CUDA part): slab memory never crosses uids.

Usage (as root, on a GPU machine, after scripts/gpu-build.sh):

    ipc_uid_check.py [--bin build/gpu/gdsfs] [--work /tmp/gdsfs-ipc-uid] [--device 0] [--json OUT]

A root daemon (the CUDA backend, auto engine) serves a mount with a 64 MiB
pool of 16 MiB slabs. Two non-root uids, one process each (setpriv, as on
CI), use it:

  A (uid 10001) reads its 0600 file into every slab of the pool, maps each
    slab in its own process the way gdsfs.torch does (CUDA virtual memory:
    the descriptor from the daemon's slab socket, imported with
    cuMemImportFromShareableHandle; legacy IPC only on old drivers), checks
    the bytes, releases every lease and keeps the mappings.
  B (uid 10002) first tries A's slabs with what it could learn of A's: SLAB
    with A's token (the ioctl), the slab socket with A's token, with a
    forged token and with its own token: every try must be refused (EPERM)
    with no handle or descriptor. Then B reads its own 0600 file, whose
    every 4 KiB page starts with a marker, into the whole pool again (the
    daemon must free A's idle slabs to make room), and checks its bytes.
  A, while B holds its leases, checks its retained mappings: they still
    hold A's bytes, unchanged, and not one page of B's marker.

Exits 0 when every check passes; prints one line per check and a verdict.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import time

UID_A, UID_B = 10001, 10002
SLAB = 16 << 20
POOL = 64 << 20
RANGE = 15 << 20  # one lease per slab
NRANGES = POOL // SLAB
MARKER = b"GDSFS-UID-B-PAGE"  # at the start of every 4 KiB page of B's file
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def log(msg: str) -> None:
    print(f"ipc_uid_check: {msg}", flush=True)


# ---------------------------------------------------------------- orchestrator


def as_uid(uid: int, argv: list[str]) -> list[str]:
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    raise SystemExit("ipc_uid_check: setpriv not found (util-linux)")


def child(uid: int, role: str, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=args.pydir, HOME="/tmp", PYTHONUNBUFFERED="1")
    argv = [sys.executable, args.self_copy, "--role", role, "--mnt", args.mnt, "--device", str(args.device), *extra]
    return subprocess.Popen(as_uid(uid, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env, cwd="/")


def expect(p: subprocess.Popen, who: str) -> dict:
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise SystemExit(f"ipc_uid_check: FAIL: {who} exited ({p.returncode}) without a report")
    return json.loads(line)


def orchestrate(args: argparse.Namespace) -> int:
    work = args.work
    src, mnt = os.path.join(work, "src"), os.path.join(work, "mnt")
    if os.path.ismount(mnt):
        subprocess.run([args.bin, "unmount", mnt], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(src)
    os.makedirs(mnt)
    d = work
    while d not in ("/", ""):
        os.chmod(d, os.stat(d).st_mode | 0o055)  # other uids must reach the mount
        d = os.path.dirname(d)
    # The clients run the package and this script from a copy every uid can read.
    pydir = os.path.join(work, "py")
    shutil.copytree(os.path.join(REPO, "python", "gdsfs"), os.path.join(pydir, "gdsfs"))
    args.self_copy = os.path.join(pydir, "ipc_uid_check.py")
    shutil.copy(os.path.abspath(__file__), args.self_copy)
    os.chmod(args.self_copy, 0o755)
    for root, dirs, files in os.walk(pydir):
        for n in dirs + files:
            os.chmod(os.path.join(root, n), 0o755)
    args.pydir, args.mnt = pydir, mnt

    size = NRANGES * RANGE + 4096
    fa, fb = os.path.join(src, "a.bin"), os.path.join(src, "b.bin")
    with open(fa, "wb") as f:
        f.write(os.urandom(size))
    page = bytearray(os.urandom(size))
    for off in range(0, size, 4096):
        page[off : off + len(MARKER)] = MARKER
    with open(fb, "wb") as f:
        f.write(page)
    for p, uid in ((fa, UID_A), (fb, UID_B)):
        os.chown(p, uid, uid)
        os.chmod(p, 0o600)

    mlog = os.path.join(args.out, "ipc-uid-mount.log")
    pool = ["--engine", "host", "--host-pool"] if args.device < 0 else ["--gpu-pool"]
    cmd = [args.bin, "mount", "--background", "--source", src, "--allow-other", *pool, f"{POOL >> 20}MiB",
           "--slab-size", f"{SLAB >> 20}MiB", "--uid-share", "100%", "--log-file", mlog, mnt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print(r.stderr, open(mlog).read()[-3000:] if os.path.exists(mlog) else "", file=sys.stderr)
        log("FAIL: mount")
        return 1
    results: dict = {"checks": []}
    ok = True

    def check(name: str, passed: bool, detail: str = "") -> None:
        nonlocal ok
        ok = ok and passed
        results["checks"].append({"check": name, "pass": passed, "detail": detail})
        log(f"{'PASS' if passed else 'FAIL'}: {name}{': ' + detail if detail else ''}")

    a = b = None
    try:
        with open(mlog) as f:
            ready = [json.loads(line) for line in f if '"control path ready"' in line]
        handles = ready[-1].get("slab_handles", "?") if ready else "?"
        results["slab_handles"] = handles
        log(f"daemon: slab handles {handles!r} (vmm: CUDA virtual memory descriptors; legacy-ipc: 64-byte bearer handles)")

        a = child(UID_A, "a", args, ["--file", os.path.join(mnt, "a.bin")])
        ra = expect(a, "A")
        check("A maps its slabs in its own process and sees its bytes", ra["ok"], ra["detail"])
        results["a"] = ra
        if not ra["ok"]:
            return 1
        if args.device >= 0:
            check("A's slabs are CUDA virtual memory (kind 3), mapped from a descriptor", ra["kind"] == 3,
                  f"kind {ra['kind']}" + ("" if ra["kind"] == 3 else ": legacy CUDA IPC handles are bearer capabilities"))

        b = child(UID_B, "b", args, ["--file", os.path.join(mnt, "b.bin"), "--token", f"{ra['token'][0]}:{ra['token'][1]}",
                                     "--slabs", ",".join(map(str, ra["slabs"]))])
        rb = expect(b, "B")
        results["b"] = rb
        for t in rb["tries"]:
            check(f"B with {t['what']} gets nothing", t["refused"], t["detail"])
        check("B reads its own file into the whole pool (A's idle slabs freed, new memory)", rb["ok"], rb["detail"])
        check("B's slabs are not A's slab ids", not set(rb["slabs"]) & set(ra["slabs"]), f"A {ra['slabs']}, B {rb['slabs']}")

        a.stdin.write("check\n")
        a.stdin.flush()
        rc = expect(a, "A")
        results["a_check"] = rc
        check("A's retained mappings still hold A's bytes after the daemon freed the slabs", rc["intact"], rc["detail"])
        check("A's retained mappings show none of B's pages", rc["marker_pages"] == 0, f"{rc['marker_pages']} pages of B's marker seen")
        if args.device >= 0:
            got = rc["returned_bytes"]
            check("A's kept mappings' memory goes back to the GPU when A closes its session and drops its tensors",
                  got >= NRANGES * SLAB * 9 // 10, f"{got / 2**20:.0f} MiB returned (kept: {NRANGES * SLAB >> 20} MiB)")
        status = subprocess.run([args.bin, "status", mnt], capture_output=True, text=True, timeout=60)
        results["status"] = status.stdout[-3000:]
        b.stdin.write("done\n")
        b.stdin.flush()
    finally:
        for p in (a, b):
            if p is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        subprocess.run([args.bin, "unmount", mnt], capture_output=True, timeout=60)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
    results["pass"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


# ---------------------------------------------------------------- clients


def report(d: dict) -> None:
    print(json.dumps(d), flush=True)


def file_gpu(path: str, device: int):
    with open(path, "rb") as f:
        data = f.read()
    if device < 0:
        return data  # --device -1: a dry run of this script on host slabs, no torch
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(f"cuda:{device}")


def slab_view(s, sid: int, device: int):
    """The whole slab, mapped in this process: a CUDA tensor (gdsfs.torch's
    mapping: descriptor import or legacy IPC) or host bytes."""
    if device < 0:
        m = s._host_mapping(sid)
        return m.view[m.base : m.base + m.size]
    from gdsfs import _tensors

    return _tensors._slab_tensor(s, sid)


def same(view, want) -> bool:
    if isinstance(want, bytes):
        return bytes(view) == want
    import torch

    return torch.equal(view, want)


def cuda_init(device: int) -> None:
    if device >= 0:
        import torch

        torch.cuda.init()
        torch.zeros(1, device=f"cuda:{device}")


def role_a(args: argparse.Namespace) -> None:
    import gdsfs

    cuda_init(args.device)
    want = file_gpu(args.file, args.device)
    s = gdsfs.Session(args.mnt, device=args.device)
    with open(args.file, "rb") as f:
        refs = s.read(f, [(i * RANGE, RANGE) for i in range(NRANGES)])
    slabs = sorted({r.slab for r in refs})
    kind = s.slab_info(refs[0].slab).kind
    whole = {sid: slab_view(s, sid, args.device) for sid in slabs}  # kept: the retained mappings
    views = [whole[r.slab][r.offset : r.offset + r.valid] for r in refs]
    good = all(same(v, want[i * RANGE : i * RANGE + r.valid]) for i, (r, v) in enumerate(zip(refs, views)))
    token = [s.token.session, s.token.secret]
    s.release(refs)  # every lease released; the mappings stay
    report({"ok": good, "detail": f"{len(refs)} leases in {len(slabs)} slabs, {sum(r.valid for r in refs)} bytes compared on the GPU",
            "kind": kind, "token": token, "slabs": slabs})
    if sys.stdin.readline().strip() != "check":
        return
    if args.device < 0:
        # Host slabs the daemon freed are truncated: touching the kept
        # mapping would raise SIGBUS (gpubuf). Nothing to read here.
        report({"intact": True, "marker_pages": 0, "detail": "dry run on host slabs: freed slabs fault, not read"})
        sys.stdin.readline()
        s.close()
        return
    import torch

    torch.cuda.synchronize()
    intact = all(torch.equal(v, want[i * RANGE : i * RANGE + r.valid]) for i, (r, v) in enumerate(zip(refs, views)))
    marker = torch.frombuffer(bytearray(MARKER), dtype=torch.uint8).to(f"cuda:{args.device}")
    pages = 0
    for t in whole.values():
        n = t.numel() // 4096 * 4096
        heads = t[:n].view(-1, 4096)[:, : len(MARKER)]
        pages += int((heads == marker).all(dim=1).sum().item())
    # Closing the session and dropping the last tensors unmaps the slabs:
    # the memory the kept mappings held (the daemon freed it long ago)
    # goes back to the GPU.
    import gc

    free_kept, _ = torch.cuda.mem_get_info(args.device)
    s.close()
    del views, whole, heads, t
    gc.collect()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info(args.device)
    report({"intact": intact, "marker_pages": pages, "returned_bytes": free_after - free_kept,
            "detail": f"{len(refs)} retained views compared with A's file after B filled the pool"})
    sys.stdin.readline()


def role_b(args: argparse.Namespace) -> None:
    import fcntl

    import gdsfs
    from gdsfs import _protocol as proto

    cuda_init(args.device)
    sess, secret = (int(x) for x in args.token.split(":"))
    a_tok = proto.Token(sess, secret)
    a_slabs = [int(x) for x in args.slabs.split(",")]
    s = gdsfs.Session(args.mnt, device=args.device)
    tries = []

    def refused(what: str, fn) -> None:
        try:
            got = fn()
        except OSError as e:
            tries.append({"what": what, "refused": e.errno == errno.EPERM, "detail": f"errno {errno.errorcode.get(e.errno, e.errno)}"})
            return
        tries.append({"what": what, "refused": False, "detail": f"handed {got!r}"})

    def slab_ioctl(tok, sid):
        buf = proto.encode_slab(tok, sid)
        fcntl.ioctl(s._control_fd()[0], proto.SLAB, buf, True)
        d = proto.decode_slab(buf)
        return f"kind {d.kind}, {len(d.handle)}-byte handle"

    def socket_fd(tok, sid):
        fd, n = proto.fetch_slab_fd(s.hello.slab_socket, s.hello.daemon_pid, tok, sid)
        os.close(fd)
        return f"a descriptor of {n} bytes"

    for sid in a_slabs:
        refused(f"A's token, SLAB ioctl for slab {sid}", lambda: slab_ioctl(a_tok, sid))
        refused(f"A's token, slab socket for slab {sid}", lambda: socket_fd(a_tok, sid))
    refused("a forged token (A's session, wrong secret), slab socket", lambda: socket_fd(proto.Token(sess, secret ^ 0x5A5A), a_slabs[0]))
    refused("its own token and A's slab id, slab socket", lambda: socket_fd(s.token, a_slabs[0]))
    refused("its own token and A's slab id, SLAB ioctl", lambda: slab_ioctl(s.token, a_slabs[0]))

    want = file_gpu(args.file, args.device)
    deadline = time.monotonic() + 60
    while True:
        try:
            with open(args.file, "rb") as f:
                refs = s.read(f, [(i * RANGE, RANGE) for i in range(NRANGES)])
            break
        except gdsfs.GDSUnavailableError as e:
            if getattr(e, "errno", None) != errno.EAGAIN or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    slabs = sorted({r.slab for r in refs})
    views = [slab_view(s, r.slab, args.device)[r.offset : r.offset + r.valid] for r in refs]
    good = all(same(v, want[i * RANGE : i * RANGE + r.valid]) for i, (r, v) in enumerate(zip(refs, views)))
    report({"tries": tries, "ok": good, "slabs": slabs, "detail": f"{len(refs)} leases in {len(slabs)} new slabs, bytes match"})
    sys.stdin.readline()  # hold the leases while A checks
    s.release(refs)
    s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="orchestrate", choices=["orchestrate", "a", "b"])
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "gpu", "gdsfs"))
    ap.add_argument("--work", default="/tmp/gdsfs-ipc-uid")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gdsfs-gpu-out"))
    ap.add_argument("--json")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--mnt")
    ap.add_argument("--file")
    ap.add_argument("--token")
    ap.add_argument("--slabs")
    args = ap.parse_args()
    if args.role == "a":
        role_a(args)
        return 0
    if args.role == "b":
        role_b(args)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("ipc_uid_check: run as root (it mounts and runs clients as other uids)")
    os.makedirs(args.out, exist_ok=True)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
