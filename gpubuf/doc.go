// Package gpubuf owns the daemon's transfer memory: a pool of large slabs per
// device (GPU memory, or shared host memory on machines without a GPU) and
// leases of 4 KiB-aligned ranges within them, handed to client sessions.
//
// # Concepts
//
//   - A Backend supplies slab memory. The host backend (NewHostBackend) lives
//     here: shared-memory files under a private directory in /dev/shm, mode
//     0600, owned by the uid the slab serves, mmapped by the daemon and by
//     clients. The CUDA backend (cuMemAlloc, cuIpcGetMemHandle, cuMemsetD8)
//     lives in package cufile and implements the same interfaces.
//   - A Memory is one slab's memory. Optional abilities are found by type
//     assertion: HostMemory (bytes the daemon can address), DeviceMemory (a
//     CUDA device pointer) and Chowner (files that must follow the slab's uid).
//   - A Pool hands out Leases: ranges of one slab, owned by an Owner (session
//     and uid). Leases are rounded up to Align bytes and start at a multiple of
//     Align within their slab, so a read widened to 4 KiB alignment lands at an
//     aligned slab offset and the client is told where its first byte is; bytes
//     are never moved on the GPU to realign them.
//
// # Invariants
//
//   - I1: a slab serves one uid at a time. A slab passes to another uid only
//     when it holds no lease, and it is scrubbed (zeroed) and, where the memory
//     is a file, chowned before the new uid's first lease is handed out.
//   - I2: a lease is reachable only through its owner's session
//     (Lookup/Release take the Owner; another session gets ErrNotFound).
//   - I3: the free extents of a slab and its leases partition the slab; free
//     extents are sorted and never adjacent (they are coalesced on release).
//   - I4: the bytes of all slabs of a device never exceed that device's budget.
//
// # Requests larger than a slab
//
// A lease larger than the slab size gets a dedicated slab of exactly its
// (aligned) size, counted against the budget and freed when the lease is
// released. Its slab ID is never reused, so a client's cached mapping of an
// old slab ID can never alias new memory.
//
// # Exhaustion
//
// Alloc never waits for memory to be released: when the budget is spent and
// no slab has a fitting free extent for the owner's uid, it returns
// ErrExhausted at once (the control path answers EAGAIN) and logs the pool's
// state. It does wait for a slab that is being allocated (or scrubbed) for
// the same uid and can still hold the request: concurrent first requests
// share one new slab instead of each reserving a slab of the budget (which
// refused requests of an empty pool while its budget was all "in flight").
//
// # Locking
//
// Each device has its own mutex (deviceState.mu) guarding its slabs' free
// lists, uids and lease counts; scrubbing runs outside it (the slab is marked
// busy meanwhile). Sessions' lease tables are sharded by session ID, each shard
// with its own mutex. Lock order: session shard, then device. No lock is held
// across a Backend call except Close.
package gpubuf
