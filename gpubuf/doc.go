// Package gpubuf owns the daemon's transfer memory: a pool of large slabs per
// device (GPU memory, or shared host memory on machines without a GPU) and
// leases of 4 KiB-aligned ranges within them, handed to client sessions.
//
// # Concepts
//
//   - A Backend supplies slab memory, new for one uid on every Alloc. The
//     host backend (NewHostBackend) lives here: a new shared-memory file per
//     slab under a private directory in /dev/shm, mode 0600, owned by the uid
//     the slab serves, mmapped by the daemon and by that uid's clients. The
//     CUDA backend lives in package cufile and implements the same
//     interfaces.
//   - A Memory is one slab's memory. Optional abilities are found by type
//     assertion: HostMemory (bytes the daemon can address) and DeviceMemory
//     (a CUDA device pointer).
//   - A Pool hands out Leases: ranges of one slab, owned by an Owner (session
//     and uid). Leases are rounded up to Align bytes and start at a multiple of
//     Align within their slab, so a read widened to 4 KiB alignment lands at an
//     aligned slab offset and the client is told where its first byte is; bytes
//     are never moved on the GPU to realign them.
//
// # Invariants
//
//   - I1: memory is per uid for its whole life. A slab is allocated for one
//     uid and serves only that uid until it is freed; freed memory is never
//     recycled across uids. Scrubbing and chowning memory for another uid is
//     not enough, because the previous owner's descriptor, MAP_SHARED mapping
//     or CUDA import outlives both: to make room for another uid the pool
//     frees an idle slab (Memory.Close, which leaves retained mappings
//     useless: host files are truncated to zero, so they fault) and allocates
//     new memory for the new uid.
//   - I2: a lease is reachable only through its owner's session
//     (Lookup/Release take the Owner; another session gets ErrNotFound), and
//     a slab is exported only to a session of its uid holding a lease in it.
//   - I3: the free extents of a slab and its leases partition the slab; free
//     extents are sorted and never adjacent (they are coalesced on release).
//   - I4: the bytes of all slabs of a device never exceed that device's budget.
//   - I5: the bytes of one uid's slabs on a device (allocations in flight
//     included) never exceed its share (Config.UIDShareBytes, half the budget
//     by default), so a uid holding all it may leaves the rest to others.
//
// # Requests larger than a slab
//
// A lease larger than the slab size gets a dedicated slab of exactly its
// (aligned) size, counted against the budget and the uid's share and freed
// when the lease is released. Slab IDs are never reused, so a client's
// cached mapping of an old slab ID can never alias new memory. No lease is
// larger than a uid's share (Pool.MaxLeaseBytes).
//
// # Exhaustion and fair sharing
//
// Alloc never waits for memory to be released. When the owner's uid holds
// its share, or the budget is spent and no idle (unleased) slab can be
// freed, it returns ErrExhausted at once (the control path answers EAGAIN),
// counts the refusal for the uid (Stats, metrics) and logs the pool's state,
// at most once per uid, device and reason every Config.LogEvery, with the
// count of lines suppressed since. When the budget is spent, the idle slabs
// freed to make room are the uid's own first, then those of the uids
// holding the most. Alloc does wait for a slab that is being allocated for
// the same uid and can still hold the request: concurrent first requests
// share one new slab instead of each reserving a slab of the budget (which
// refused requests of an empty pool while its budget was all "in flight").
//
// # Locking
//
// Each device has its own mutex (deviceState.mu) guarding its slabs' free
// lists and lease counts and the per-uid accounts; backend allocation and
// freeing run outside it (the bytes are charged first). Sessions' lease
// tables are sharded by session ID, each shard with its own mutex. Lock
// order: session shard, then device. No lock is held across a Backend call
// except Close.
package gpubuf
