package cufile

// BufferedReader is implemented by engines whose reads go through the
// page cache (buffered preads), so reading a file ahead into the cache
// (the control path's readahead, package internal/readahead) serves their
// next reads from memory.
type BufferedReader interface {
	// ReadsBuffered reports whether the engine reads ranges of at most
	// n bytes of a file of size bytes through the page cache whatever
	// their residency (an engine that may choose O_DIRECT for them
	// answers false).
	ReadsBuffered(n, size int64) bool
}

// Wrapper is implemented by engines that wrap another (metrics'
// instrumented engines), so optional abilities of the wrapped engine
// stay reachable.
type Wrapper interface {
	// Unwrap returns the wrapped engine.
	Unwrap() Engine
}

// BufferedReaderOf returns e's BufferedReader, looking through Wrappers.
func BufferedReaderOf(e Engine) (BufferedReader, bool) {
	for range 8 { // a bound, not a depth anyone nests
		if br, ok := e.(BufferedReader); ok {
			return br, true
		}
		w, ok := e.(Wrapper)
		if !ok {
			return nil, false
		}
		e = w.Unwrap()
	}
	return nil, false
}

// readsBuffered is the posix and host engines' answer: useDirect reads
// ranges below four chunks, and any range of a file of at most
// DirectReadMinFile, buffered in "auto" mode.
func (opts Options) readsBuffered(n, size int64) bool {
	switch opts.Direct {
	case "always":
		return false
	case "never":
		return true
	}
	return n < 4*opts.ChunkBytes || (opts.DirectReadMinFile >= 0 && size <= opts.DirectReadMinFile)
}

// ReadsBuffered implements BufferedReader.
func (e *posixEngine) ReadsBuffered(n, size int64) bool { return e.opts.readsBuffered(n, size) }

// ReadsBuffered implements BufferedReader.
func (e *hostEngine) ReadsBuffered(n, size int64) bool { return e.opts.readsBuffered(n, size) }

var (
	_ BufferedReader = (*posixEngine)(nil)
	_ BufferedReader = (*hostEngine)(nil)
)
