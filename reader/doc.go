// Package reader reads files of a gdsfs mount through the control path, as
// `gdsfs read` and `gdsfs index` do: Read streams a byte range from the
// daemon's slabs (host slabs mapped, CUDA slabs imported or opened by IPC
// and copied back) or measures the control path's throughput against the
// engine alone in this process; Index fetches a file's shard index from its
// virtual attribute, or paged through the control file when it is larger
// than an attribute holds.
//
// A Read keeps one batch of leases ahead of the writer and releases every
// lease it took before it returns, whatever the outcome; slab mappings are
// undone before the session ends. Errors the user can act on (a path off a
// mount, a device the daemon does not serve) are internal/usage errors whose
// message says what to do.
package reader
