#!/usr/bin/env python3
"""GPU check: CUDA devices named by UUID between the daemon and its clients (devuuid).

Usage (as root, on a GPU machine, after scripts/gpu-build.sh; scripts/gpu-test.sh section devuuid):

    devuuid_check.py [--bin build/gpu/gdsfs] [--work /root/gdsfs-gpu/devuuid] [--out DIR] [--json OUT]

1. A root daemon that sees every GPU (CUDA_VISIBLE_DEVICES unset) mounts WORK/src at WORK/mnt.
2. Its published UUIDs (gdsfs status --json: pool.devices[].uuid) are torch's
   get_device_properties(i).uuid and gdsfs._cuda.device_uuids() of a process that sees every
   GPU, ordinal for ordinal.
3. For each target (the last GPU named CUDA_VISIBLE_DEVICES=GPU-<uuid>; with 2+ GPUs also GPU 1
   named CUDA_VISIBLE_DEVICES=1), a client whose only GPU is the target reads a file with
   device=0 and keeps the lease: the daemon's STATUS shows the lease on the target's daemon
   device and on no other; the bytes materialized on the client's cuda:0 equal the file, and
   gdsfs.safetensors.load_file(device="cuda:0", strict=True) equals the file's tensors.
4. Before vs after on this machine: the same client with GDSFS_DEVICE_UUIDS=0 (ordinals as they
   are, the old behaviour) leases on the daemon's device 0 instead.
5. With 2+ GPUs: a daemon that sees only GPU 0; a client on GPU 1 gets the one-line error with
   strict=True, and without it a GDSFallbackWarning and the right tensors by plain reads.

Exits 0 when every check passes; one line per check, then a verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NBYTES = 8 << 20


def log(msg: str) -> None:
    print(f"devuuid_check: {msg}", flush=True)


# ---------------------------------------------------------------- client (a trainer process)


def client(args: argparse.Namespace) -> int:
    import warnings

    import torch

    import gdsfs
    import gdsfs.safetensors as gst
    import gdsfs.torch as gt

    def say(d: dict) -> None:
        print(json.dumps(d), flush=True)

    torch.cuda.init()
    mine = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    want = open(os.path.join(args.src, "blob.bin"), "rb").read()
    ref_st = gst.load_file(os.path.join(args.src, "t.safetensors"), device="cpu")
    st_path = os.path.join(args.mnt, "t.safetensors")
    if args.role == "refused":
        out: dict = {"mine": mine}
        try:
            gdsfs.Session(args.mnt, device=0)
            out["error"] = ""
        except gdsfs.GDSUnavailableError as e:
            out["error"] = str(e)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = gst.load_file(st_path, device="cuda:0")
        out["warnings"] = [str(x.message) for x in w if issubclass(x.category, gdsfs.GDSFallbackWarning)]
        out["equal"] = all(torch.equal(got[k].cpu(), ref_st[k]) for k in ref_st) and got[next(iter(got))].device == torch.device("cuda", 0)
        say(out)
        return 0
    s = gdsfs.Session(args.mnt, device=0)
    with open(os.path.join(args.mnt, "blob.bin"), "rb") as f:
        [ref] = s.read(f, [(0, len(want))])
    m = s._device_map()
    say({"mine": mine, "ref_device": ref.device, "to_daemon": m.to_daemon(0) if m is not None else None})
    sys.stdin.readline()  # the parent has looked at STATUS
    out = {}
    try:  # without the translation (GDSFS_DEVICE_UUIDS=0) this maps another GPU's memory: it may fail
        t = gt.tensor_from_ref(ref)
        out["bytes_equal"] = t.device == torch.device("cuda", 0) and bytes(t.cpu().numpy().tobytes()) == want
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["bytes_error"] = f"{type(e).__name__}: {e}"
    s.close()
    try:
        got = gst.load_file(st_path, device="cuda:0", strict=True)
        out["safetensors_equal"] = all(torch.equal(got[k].cpu(), ref_st[k]) and got[k].device == torch.device("cuda", 0) for k in ref_st)
    except Exception as e:  # noqa: BLE001
        out["safetensors_error"] = f"{type(e).__name__}: {e}"
    say(out)
    return 0


# ---------------------------------------------------------------- orchestrator


def dirs(args: argparse.Namespace, name: str) -> tuple[str, str]:
    src, mnt = os.path.join(args.work, name, "src"), os.path.join(args.work, name, "mnt")
    if os.path.ismount(mnt):
        subprocess.run([args.bin, "unmount", mnt], capture_output=True)
    os.makedirs(src, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    return src, mnt


def start(args: argparse.Namespace, src: str, mnt: str, env: dict, logname: str) -> None:
    r = subprocess.run([args.bin, "mount", "--background", "--allow-other", "--source", src, "--gpu-pool", "1GiB",
                        "--log-file", os.path.join(args.out, logname), mnt], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not os.path.ismount(mnt):
        raise SystemExit(f"devuuid_check: FAIL: mount {mnt}: {r.stderr.strip()}")


def stop(args: argparse.Namespace, mnt: str) -> None:
    subprocess.run([args.bin, "unmount", mnt], capture_output=True, timeout=60)
    if os.path.ismount(mnt):
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def status(args: argparse.Namespace, mnt: str) -> dict:
    return json.loads(subprocess.run([args.bin, "status", "--json", mnt], capture_output=True, text=True, check=True, timeout=60).stdout)


def run_client(args: argparse.Namespace, src: str, mnt: str, visible: str, role: str, extra_env: dict, at_read=None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(CUDA_VISIBLE_DEVICES=visible, PYTHONPATH=os.path.join(REPO, "python"), PYTHONUNBUFFERED="1", **extra_env)
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role, "--src", src, "--mnt", mnt],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
    out = []
    line = p.stdout.readline()
    if line:
        out.append(json.loads(line))
        if role == "reader":
            if at_read is not None:
                out.append(at_read())
            p.stdin.write("go\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if line:
                out.append(json.loads(line))
    p.stdin.close()
    p.wait(timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"devuuid_check: FAIL: client ({visible}, {role}) exited {p.returncode}")
    return out


def norm(u: str) -> str:
    u = u.lower()
    for pre in ("gpu-", "mig-"):
        if u.startswith(pre):
            u = u[len(pre):]
    return u.replace("-", "")


def leased(st: dict) -> dict[int, int]:
    return {int(d["device"]): int(d.get("leased_bytes", 0)) for d in st["pool"]["devices"]}


def orchestrate(args: argparse.Namespace) -> int:
    import torch

    os.makedirs(args.out, exist_ok=True)
    fails: list[str] = []
    report: dict = {}

    def check(ok: bool, what: str) -> None:
        log(("ok: " if ok else "FAIL: ") + what)
        if not ok:
            fails.append(what)

    env_all = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")}
    src, mnt = dirs(args, "all")
    with open(os.path.join(src, "blob.bin"), "wb") as f:
        f.write(os.urandom(NBYTES))
    sys.path.insert(0, os.path.join(REPO, "python"))
    import gdsfs.safetensors as gst

    gst.save_file({"w": torch.randn(1 << 20), "b": torch.arange(4099, dtype=torch.int64)}, os.path.join(src, "t.safetensors"))
    start(args, src, mnt, env_all, "devuuid-all.log")
    try:
        # 2. the daemon's UUIDs are torch's and the driver's, ordinal for ordinal
        daemon = [d.get("uuid", "") for d in sorted(status(args, mnt)["pool"]["devices"], key=lambda d: d["device"])]
        probe = subprocess.run([sys.executable, "-c", "import json, torch; from gdsfs import _cuda; torch.cuda.init(); "
                                "print(json.dumps([[str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())], "
                                "[u.hex() for u in _cuda.device_uuids()]]))"],
                               env=dict(env_all, PYTHONPATH=os.path.join(REPO, "python")), capture_output=True, text=True, timeout=120)
        theirs, drv = json.loads(probe.stdout) if probe.returncode == 0 else ([], [])
        report["daemon_uuids"], report["torch_uuids"] = daemon, theirs
        log(f"daemon {daemon}; torch {theirs}")
        check(len(daemon) > 0 and all(daemon), "the daemon publishes a UUID per GPU")
        check([norm(u) for u in daemon] == [norm(u) for u in theirs], "the daemon's UUIDs are torch's, ordinal for ordinal")
        check([norm(u) for u in daemon] == [norm(u) for u in drv], "the daemon's UUIDs are gdsfs._cuda.device_uuids()'s")
        n = len(daemon) if all(daemon) else 0
        # 3. a client that sees only the target GPU
        targets = [(n - 1, daemon[n - 1], "uuid spelling")] if n else []
        if n >= 2:
            targets.append((1, "1", "ordinal spelling"))
        for k, visible, how in targets:
            for translate in (True, False):
                extra = {} if translate else {"GDSFS_DEVICE_UUIDS": "0"}
                got = run_client(args, src, mnt, visible, "reader", extra, lambda: leased(status(args, mnt)))
                if len(got) < 3:
                    check(False, f"client CUDA_VISIBLE_DEVICES={visible}: no report")
                    continue
                first, held, last = got
                on = [d for d, b in held.items() if b > 0]
                tag = f"CUDA_VISIBLE_DEVICES={visible} ({how}){'' if translate else ', GDSFS_DEVICE_UUIDS=0'}"
                report.setdefault("runs", []).append({"visible": visible, "translate": translate, "leased_on": on, **first, **last})
                log(f"{tag}: client cuda:0 {first['mine'][:1]}, lease on daemon device(s) {on}")
                if translate:
                    check(on == [k], f"{tag}: the lease lies on the daemon's device {k} (the client's GPU) only")
                    check(first["to_daemon"] == k and first["ref_device"] == 0, f"{tag}: cuda:0 -> daemon {k}; Ref.device 0")
                    check(norm(first["mine"][0]) == norm(daemon[k]), f"{tag}: the client's cuda:0 is the daemon's device {k}")
                    check(bool(last.get("bytes_equal")), f"{tag}: bytes on cuda:0 equal the file")
                    check(bool(last.get("safetensors_equal")), f"{tag}: load_file(device='cuda:0', strict=True) equals the file")
                else:
                    log(f"{tag}: before the change, the lease lands on daemon device(s) {on} "
                        f"(bytes: {last.get('bytes_equal', last.get('bytes_error'))}; load_file: {last.get('safetensors_equal', last.get('safetensors_error'))})")
                    if k != 0:
                        check(on == [0], f"{tag}: ordinals as they are put it on the daemon's device 0 (the old behaviour)")
    finally:
        stop(args, mnt)
    # 5. a daemon without the client's GPU
    if len(report.get("daemon_uuids", [])) >= 2:
        env0 = dict(env_all, CUDA_VISIBLE_DEVICES="0")
        src0, mnt0 = dirs(args, "gpu0")
        for name in ("blob.bin", "t.safetensors"):
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(src0, name), "wb") as b:
                b.write(a.read())
        start(args, src0, mnt0, env0, "devuuid-gpu0.log")
        try:
            [got] = run_client(args, src0, mnt0, "1", "refused", {})
            err = got.get("error", "")
            log(f"client on GPU 1, daemon on GPU 0: {err!r}")
            check("is not one of the gdsfs daemon's GPUs" in err and "\n" not in err and "device='cpu'" in err,
                  "a GPU the daemon lacks: the one-line error")
            check(any("is not one of the gdsfs daemon's GPUs" in w for w in got.get("warnings", [])) and bool(got.get("equal")),
                  "a load onto it warns once and reads the right tensors plainly")
        finally:
            stop(args, mnt0)
    else:
        log("SKIP: a daemon without the client's GPU (needs 2 GPUs: nvidia-h200-x2)")
    if args.json:
        report["fails"] = fails
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    log("PASS" if not fails else f"FAIL ({len(fails)}): {fails}")
    return 0 if not fails else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "gpu", "gdsfs"))
    ap.add_argument("--work", default="/root/gdsfs-gpu/devuuid")
    ap.add_argument("--out", default="/tmp/gdsfs-gpu-out")
    ap.add_argument("--json")
    ap.add_argument("--role", choices=["reader", "refused"], help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--mnt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return client(args)
    args.bin = os.path.abspath(args.bin)
    t0 = time.monotonic()
    try:
        return orchestrate(args)
    finally:
        log(f"{time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
