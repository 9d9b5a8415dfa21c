"""Private format layers and I/O helpers behind gdsfs.safetensors, gdsfs.checkpoint and gdsfs.dcp.

Nothing here is public API. The modules split by job:

- ``stformat``: the safetensors header (parse, validate, build with a 4 KiB-aligned data section);
  standard library only.
- ``zipfmt``: the torch.save zip container (plan a 4 KiB-aligned archive, write its metadata, find
  record offsets in any existing archive); standard library only.
- ``atomic``: temp name + fsync + rename + directory fsync, so a crash leaves the old file or the
  new one, never a torn one; standard library only.
- ``tensorio``: moves tensor bytes between files and tensors through the gdsfs control path in
  batched requests, or through plain preads/pwrites when the daemon cannot serve; imports torch.
- ``unpickle``: the torch.save pickle decoder with batched storage fetch; weights-only loads run
  the installed torch's own weights-only unpickler; imports torch.
"""
