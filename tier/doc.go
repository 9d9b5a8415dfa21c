// Package tier is the daemon's data cache: a budgeted set of file extents
// held in memory the daemon owns (pinned host memory on a GPU machine, plain
// anonymous memory with the host engine), so that READs of cached ranges are
// served by one copy from the tier into the caller's slab (a DMA
// host-to-device copy on the GPU, a memcpy on the host engine) instead of a
// read of the backing file.
//
// # Entries and extents
//
// An entry is one file, keyed by its identity (Key: device and inode
// number) and valid for one version of it (Identity: size, mtime, ctime).
// Its bytes are held in extents of ChunkBytes (the last one clipped to the
// file's size, rounded up to 4 KiB, zero past end of file); an entry may hold
// some extents and not others (a pin that was interrupted, or of a part of
// the file). A READ is a hit only when every extent of its widened ranges is
// held.
//
// # Invariants
//
//   - T1. A hit is served only for a descriptor whose fstat matches the
//     entry's identity (dev, ino, size, mtime, ctime), checked at every hit.
//   - T2. Pin fills an extent only from the caller's descriptor, after the
//     file's ctime is at least SettleTime in the past (so a later change of
//     the file gets another ctime even on filesystems with coarse
//     timestamps) and after writing the extent's dirty pages back (so a
//     later store through a shared mapping faults and changes the times
//     too), and installs it only if the descriptor's identity is unchanged
//     after the read and the entry was not invalidated meanwhile.
//   - T3. Invalidate and InvalidatePath make the entry unreachable at once;
//     its memory is freed when the last hit or fill using it is done
//     (reference counts), never under a copy.
//   - T4. The memory allocated (every extent allocated and not yet freed,
//     each counted once) never exceeds BudgetBytes, and what one uid is
//     charged never exceeds UIDShareBytes.
//
// # Fairness
//
// A uid is charged for every extent its pins asked for, held or being
// filled, whoever's pin read it: its charge is the memory its own pins
// would hold had no other uid pinned anything, and what depends on it
// (the share check, which of its own pins go for its share, its STATUS
// bytes) does not depend on other uids' pins of the same files. An extent several uids pinned is
// charged to each of them and allocated once; an UNPIN drops the caller's
// pins (its charges), and frees the extents no other uid's pin asked for.
//
// A pin that does not fit evicts, least recently used first: the pinning
// uid's own pins (of a file only it pinned the file, of a file other uids
// pinned too only its pins and the extents only it asked for; pins that
// free no memory go for the share, never for the budget); then files of the uid charged the most, but only
// while that uid is charged more than the pinning uid would be after the
// pin (a file several uids pinned only while every one of them is). A uid
// can therefore take the tier down to equal shares, never evict a uid that
// holds less than itself, and never hold more than UIDShareBytes. A pin
// that cannot be made to fit that way is refused (ErrFull, ErrTooLarge);
// nothing is evicted for it then. The budget is the node's: whether a pin
// fits it depends on every uid's pins, as free memory does.
//
// # Lock order
//
// Tier.mu is the only lock; no read, allocation or copy runs under it (frees
// of extents do: munmap, cuMemFreeHost, cuMemFree).
package tier
