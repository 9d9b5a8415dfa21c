// Package pagecache measures how much of a file the kernel's page cache
// holds and fills it: the one place gdsfs asks the kernel about residency.
//
// Residency is measured with cachestat(2) (Linux 6.5+), which counts the
// cached pages of a file range without mapping the file: the daemon's
// engine chooser calls Cached on the transfer path, where an mmap would take
// the process's mmap lock under every other thread's page faults. Uncached
// finds which pages are missing by bisecting the file with the same call,
// exact to the page: a fully cached or uncached file costs one call (4 us
// for a cached 64 MiB file, where mincore takes 1.2 ms), a file cached in
// every other page about log2(pages) walks of it (15 ms for 64 MiB,
// mincore 1.4 ms: BenchmarkUncached).
// On kernels without cachestat, Cached reports that it cannot tell; Uncached
// and Resident, used by `gdsfs warm` in its own process, measure with
// mincore(2) on a read-only mapping instead, so warming still resumes there.
//
// Warm reads the missing ranges of many files with a fixed pool of workers
// (Plan, then Warm); Resident says afterwards how much stayed cached.
//
// Pitfalls: the kernel counts whole pages, so Cached may report up to a page
// more than the range when the range ends inside a cached page; Uncached and
// Resident clip to the file size. A filesystem that cannot be measured
// (no cachestat, no mmap) is treated as not cached: warm reads it all.
package pagecache
