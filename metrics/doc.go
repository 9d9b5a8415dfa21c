// Package metrics is gdsfs's Prometheus instrumentation: one registry per
// daemon, small recording methods the other packages call without
// importing Prometheus, and an HTTP server for /metrics.
//
// # Decoupling
//
// Packages that produce figures (fs, ctl, gpubuf, cache) never import this
// package or Prometheus. Event counts and latencies reach it through small
// interfaces the producers define themselves (for example an observer with
// ObserveFUSE), which *Metrics satisfies; state that already lives in a
// producer (pool occupancy, sessions, index cache counters, passthrough) is
// read at scrape time, in the producer's own type (gpubuf.Stats,
// cache.IndexStats, fs.PassthroughStats), through callbacks registered with
// SetPool, SetIndex and SetPassthrough: no figure is copied into a struct
// of this package. Package daemon wires the two together.
//
// # Label cardinality
//
// Every label has a bounded set of values. FUSE op, control command,
// engine and direction names outside the known tables are recorded as
// "other"; errnos outside the errno table as "other"; pool figures are
// labelled per uid only for the first MaxUIDLabels uids (ordered by
// leased bytes), the rest are summed into uid="other". A scrape therefore
// never grows without bound, however clients behave.
//
// # Names
//
// All families are prefixed gdsfs_, counters end in _total, durations are
// _seconds histograms and sizes _bytes, as the Prometheus naming guide
// asks. docs/operations.md lists every family.
//
// # Concurrency
//
// Every method of *Metrics may be called concurrently. Recording methods
// take no lock of this package (Prometheus vectors are lock-free on the
// read path for existing label values); the callback setters take a mutex
// that only scrapes contend for.
package metrics
