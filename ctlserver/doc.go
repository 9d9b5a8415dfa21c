// Package ctlserver is the daemon side of gdsfs's control path: Server
// implements fs.Control, answering the ioctls on <mount>/.gdsfs and on data
// files and the user.gdsfs.* xattrs, with the wire format, command numbers
// and client of package ctl (normative text: docs/protocol.md). It is also
// the daemon's handoffserver.Source for slab descriptors.
//
// # Server invariants
//
//   - S1: a session belongs to the uid that opened .gdsfs; a token is usable
//     only by that uid and only with the right secret.
//   - S2: every lease the server hands out is recorded in exactly one
//     session; Session.Close releases all of them.
//   - S3: a READ or READ_NAMES is all or nothing: on error, no lease of the
//     request remains.
//   - S4: ranges are validated once, in the server, before any engine runs;
//     engines see 4 KiB-widened ranges inside a lease.
//   - S5: no engine touches memory that is not leased: a session's leases go
//     back to the pool only after its operations in flight finished (Close
//     waits), a READ's leases become releasable only once their bytes are in
//     place, and RELEASE of a lease waits for the WRITEs in flight from
//     that lease (only those: the session's other leases are written and
//     released meanwhile).
//   - S6: a data-file request uses only the access the caller's descriptor
//     grants: READ, READ_NAMES and INDEX need it open for reading, WRITE
//     for writing (EBADF otherwise); the server never opens a backing
//     file by path (xattrs reach it through fs's XattrTarget.Open), and
//     index lookups wait at most indexTimeout (EAGAIN).
//   - S7: user.gdsfs.stats and STATUS show a non-root uid only its own
//     sessions and per-uid figures, plus node-wide totals (StatsFor).
//
// # Locking
//
// Lock order: sessionShard.mu, then session.pin, then session.mu, then the
// pool's locks. session.pin is held (shared) across WRITE's engine call and
// (exclusive) across RELEASE; no other Server lock is held across an engine
// call. The engine chooser (EngineChooser.Choose) is asked per request, with
// no lock held but WRITE's shared session.pin, and its answer is not
// cached: it bounds its own cost.
package ctlserver
