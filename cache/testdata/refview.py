"""Reference views of shard files through the real Python tools, for cache's tests.

Usage: refview.py KIND FILE...  (KIND: tar, npy, zip, torchbytes, safetensors_vs_pt PT)
Prints JSON on stdout. Run with /usr/bin/python3 (Debian's, which has torch and numpy).
"""
import hashlib, json, re, sys, tarfile, zipfile

def tar_view(path):
    # tarfile's own view of every member: data offset, size, type.
    out = []
    with tarfile.open(path, "r:") as tf:
        for m in tf.getmembers():
            kind = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.CONTTYPE: "file",
                    tarfile.LNKTYPE: "hardlink", tarfile.SYMTYPE: "symlink", tarfile.DIRTYPE: "dir",
                    tarfile.GNUTYPE_SPARSE: "sparse"}.get(m.type, "other")
            if m.sparse is not None:
                kind = "sparse"
            rec = {"name": m.name, "offset": m.offset_data, "size": m.size, "type": kind, "link": m.linkname}
            if kind in ("file", "hardlink"):
                rec["sha256"] = hashlib.sha256(tf.extractfile(m).read()).hexdigest()
            out.append(rec)
    # WebDataset's grouping (tariterators.base_plus_ext + group_by_keys) of regular files.
    samples = []
    for rec in out:
        if rec["type"] not in ("file", "hardlink"):
            continue
        if re.search(r"__[^/]*__($|/)", rec["name"]):
            continue
        mt = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", rec["name"])
        if not mt:
            continue
        key, field = mt.group(1), mt.group(2)
        if not samples or samples[-1]["key"] != key:
            samples.append({"key": key, "fields": []})
        if field not in samples[-1]["fields"]:
            samples[-1]["fields"].append(field)
    return {"members": out, "samples": samples}

def npy_view(path):
    import numpy as np
    a = np.load(path, mmap_mode="r", max_header_size=1 << 20)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "fortran_order": bool(a.flags.f_contiguous and not a.flags.c_contiguous),
            "offset": int(a.offset), "nbytes": int(a.nbytes)}

def zip_view(path):
    # zipfile's view: every record's content hash and method.
    with zipfile.ZipFile(path) as z:
        return [{"name": i.filename, "stored": i.compress_type == zipfile.ZIP_STORED, "size": i.file_size,
                 "sha256": hashlib.sha256(z.read(i.filename)).hexdigest()} for i in z.infolist()]

def torch_bytes(path):
    # torch.load's view: the raw bytes of every tensor storage, by hash.
    import torch
    obj = torch.load(path, map_location="cpu")
    seen = []
    def walk(o):
        if isinstance(o, torch.Tensor):
            seen.append(hashlib.sha256(_storage_bytes(o)).hexdigest())
        elif isinstance(o, dict):
            for v in o.values(): walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o: walk(v)
    walk(obj)
    return sorted(set(seen))

def _storage_bytes(t):
    import torch
    st = t.storage()
    n = st.size() * st.element_size()
    base = torch.empty(0, dtype=t.dtype).set_(st, 0, (st.size(),), (1,))
    if t.dtype == torch.bfloat16:
        base = base.view(torch.int16)
    if t.dtype == torch.bool:
        base = base.to(torch.uint8)
    b = base.numpy().tobytes()
    assert len(b) == n
    return b

def tensor_bytes(path):
    # Named tensors of a torch.save'd flat dict: name -> (dtype, shape, sha256 of contiguous bytes).
    import torch
    obj = torch.load(path, map_location="cpu")
    out = {}
    for k, t in obj.items():
        c = t.contiguous()
        v = c.view(torch.int16) if c.dtype == torch.bfloat16 else (c.to(torch.uint8) if c.dtype == torch.bool else c)
        out[k] = {"shape": list(t.shape), "sha256": hashlib.sha256(v.numpy().tobytes()).hexdigest()}
    return out

if __name__ == "__main__":
    kind, paths = sys.argv[1], sys.argv[2:]
    fn = {"tar": tar_view, "npy": npy_view, "zip": zip_view, "torchbytes": torch_bytes, "tensors": tensor_bytes}[kind]
    # One file: its view. Several: {file: view} (one interpreter start).
    json.dump(fn(paths[0]) if len(paths) == 1 else {p: fn(p) for p in paths}, sys.stdout)
