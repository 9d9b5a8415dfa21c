// Package cache parses shard metadata (WebDataset tar, MosaicML MDS,
// safetensors, torch.save zip archives and .npy headers) into indexes that
// say where every sample, tensor or record lives in the backing file, and
// keeps parsed indexes in a ristretto cache keyed by file identity
// (Indexes).
//
// # Parsers
//
// Each parser takes an io.ReaderAt and the file size and never trusts a
// length read from the file: every allocation is bounded by the file size
// and by a fixed cap, and every offset is checked against the size before it
// is used. The caps bound each parse's memory to about 150 MiB whatever the
// file (docs/index-format.md, "Limits"), and are checked from the lengths
// the file declares before anything is allocated. Malformed input yields an error that wraps ErrInvalid and reads
// "cache: not a valid <format>: <why>"; a file that is none of the known
// formats yields ErrNoIndex. Parsers never panic on input (fuzzed).
//
// Tar archives of plain headers (most WebDataset shards) are read by a fast
// header scanner; any header it does not fully understand sends the whole
// archive to archive/tar, and FuzzTar checks the two agree.
//
// # Index JSON
//
// Index.JSON is one envelope {"format": ..., "version": 1, ...} with absolute
// byte offsets and lengths in the backing file; docs/index-format.md is the
// schema. Index.Resolve maps a name (tar member, "sample/<i>/<field>",
// safetensors tensor, zip record, MDS "sample/<i>/<column>") to a byte range
// for read-by-name.
//
// # Caches and invariants
//
//   - I1: an index is only ever served for the file identity (device, inode,
//     size, mtime ns, ctime ns) it was parsed from. A change made behind the
//     daemon's back changes the identity, so the old entry is simply never
//     looked up again. Changes made through the mount call Invalidate, which
//     also covers writes that leave size and timestamps unchanged (coarse
//     timestamp granularity).
//   - I2: concurrent misses for one identity parse once (Indexes.flights).
//   - I3: a hit performs one fstat and no read of the file.
//   - I5: Indexes reads a file only through the descriptor its caller
//     passes (open for reading: the caller's own access), never opens a
//     path, and parses at most DefaultParses files at once, at most
//     DefaultParsesPerUID of them for one requesting uid (WithRequester); a
//     miss waits at most DefaultParseWait for a slot (ErrBusy, not cached).
//
// Lock order: ristretto's internal locks, then Indexes.paths.mu (eviction
// callbacks run under ristretto's locks and take ours);
// nothing calls into a ristretto cache while holding ours, and no lock is
// held while parsing or doing I/O. Indexes.uids.mu (the per-uid parse
// slots) and Indexes.flights.mu are only ever taken alone.
package cache
