"""The torch-free core of the gdsfs client: sessions, leases, slabs.

Core API for other modules (gdsfs.torch, gdsfs.safetensors, gdsfs.checkpoint,
gdsfs.dcp). These signatures are stable; everything not listed is private.

    find_mount(path) -> str | None
        The gdsfs mount root containing path, or None when path is not on a
        gdsfs mount (no exception).

    Session.open(path, *, device=None, strict=False) -> Session | None
        A session of the gdsfs mount that holds path. Returns None (after a
        one-time GDSFallbackWarning) when path is not on a gdsfs mount or the
        daemon cannot serve it; strict=True raises GDSUnavailableError instead.
        device=None targets the daemon's default device (host mode: host
        memory). Sessions are context managers; close() is idempotent and
        returns every lease to the pool. A Session pickles as a small token:
        the unpickled copy (e.g. in a DataLoader worker) can read() but not
        map slabs or release (those stay with the process that opened it).

    session.host_mode -> bool            True when slabs are host shared memory
    session.device -> int                target device (-1 in host mode)

    session.read(fd, ranges, *, device=None) -> list[Ref]
        Read byte ranges [(offset, length), ...] of an open file on the mount
        (fd: int or an object with fileno()) into slab memory with as few
        ioctls as the protocol allows. One Ref per range, in order; when it
        returns, the bytes are in place. Ref.valid < Ref.length only at EOF.

    session.alloc(nbytes, *, device=None) -> Ref
        A writable lease of nbytes (for checkpoint save).

    session.host_buffer(ref) -> memoryview
        Host mode only: a writable memoryview of exactly ref's bytes in the
        mmapped slab (the slab is mapped once per process and cached).

    session.write(fd, ref, offset, nbytes=None) -> int
        Have the daemon write ref's bytes (or the first nbytes) to the open
        file fd (opened writable on the mount) at offset. Returns bytes written.

    session.release(refs) -> None
        Return leases to the pool (only in the process that opened the
        session). Releasing twice is an error from the daemon, ignored here.

    session.slab_info(slab_id) -> SlabInfo
        (kind, size, handle): handle is the shm path (host) or the 64-byte
        CUDA IPC handle; cached. gdsfs.torch uses it to map slabs.

    capabilities(path) -> Capabilities      what the daemon serves for path
    layout(path) -> dict                    the daemon's parsed index (JSON)

    gdsfs.torch.tensor_from_ref(ref, dtype, shape, device=None, *, copy=True,
                                session=None) -> torch.Tensor
        Materialize a Ref as a tensor: CPU tensor from the host slab in host
        mode; a CUDA tensor (D2D copy, or a zero-copy view with copy=False)
        from the IPC-mapped slab otherwise.
    gdsfs.torch.writable_view(session, ref, dtype, shape) -> torch.Tensor
        A tensor view of an allocated lease to fill (host or CUDA).

Ref is a frozen, picklable descriptor: it crosses process boundaries, slabs
and file descriptors never do.
"""
