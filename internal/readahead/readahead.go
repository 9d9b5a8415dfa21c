// Package readahead decides when and how far the daemon reads ahead of a
// stream of READs of one open file, as the kernel's readahead does for
// read(2), which the control path's READs never get: a READ of a batch of
// small samples is served with buffered preads of a few ranges, and the
// next READ comes only after the client has worked through the batch, so
// without readahead the disk idles while the client computes and the
// client waits while the disk reads (issue 15: cold small samples).
//
// A Stream records one open file's READs. A READ that starts where the
// previous one ended (within GapBytes either way) continues a sequential
// run, and so does the first READ of a file when it starts within
// GapBytes of offset 0 (the kernel's "start of file" rule). A run reads
// ahead a window after the READ: the larger of the READ and MinBytes at
// first, doubling with every READ of the run up to MaxBytes. A new window
// is asked for only once less than half of the current one is left ahead,
// so most READs of a run cost no readahead request at all. Any other READ
// ends the run and reads nothing ahead (random access gains nothing).
//
// The streams of one owner (a Tracker's, the daemon's uid) reading ahead
// at once share MaxBytes: each one's window grows to at most MaxBytes
// divided by their number, and at least its READ's length (or MinBytes).
// What a stream has read ahead and its reader has not yet consumed is what
// the disk is idle for at the end of its file, while the reader works
// through it: N DataLoader workers reading N files in step, each MaxBytes
// ahead, leave the disk idle for N windows' worth of their work at every
// file's end (issue 15: cold 64 KiB samples, 8 workers, 0.85x the disk),
// where one window's worth in all keeps it as busy.
//
// Readahead is only a hint: the caller starts reading the window into the
// page cache and every READ still reads its bytes from the file. A caller
// that drops a window (too much in flight) gives it back (Unread), so the
// next READ asks for it again instead of meeting the cold disk. Tracker
// keeps the Streams of many open files, bounded, and per owner (uid)
// fairly.
package readahead

import "sync"

// Defaults of Config's zero fields.
const (
	DefaultMinBytes = 1 << 20
	DefaultMaxBytes = 32 << 20
	DefaultGapBytes = 1 << 20
	// DefaultStreams is the number of open files a Tracker remembers.
	DefaultStreams = 1024
)

// Config is the readahead policy. The zero value is the default policy.
type Config struct {
	// MinBytes is the smallest first window. Default DefaultMinBytes.
	MinBytes int64
	// MaxBytes is the largest window; negative turns readahead off.
	// Default DefaultMaxBytes.
	MaxBytes int64
	// GapBytes is how far a READ may start from the end of the previous
	// one (forward or back) and still continue its run: a tar's headers
	// and small members between two batches' ranges. Default
	// DefaultGapBytes.
	GapBytes int64
	// Streams bounds the open files a Tracker remembers (the least
	// recently read is forgotten first). Default DefaultStreams.
	Streams int
}

// WithDefaults fills in c's zero fields.
func (c Config) WithDefaults() Config {
	if c.MinBytes <= 0 {
		c.MinBytes = DefaultMinBytes
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = DefaultMaxBytes
	}
	if c.MaxBytes > 0 && c.MinBytes > c.MaxBytes {
		c.MinBytes = c.MaxBytes
	}
	if c.GapBytes <= 0 {
		c.GapBytes = DefaultGapBytes
	}
	if c.Streams <= 0 {
		c.Streams = DefaultStreams
	}
	return c
}

// Off reports whether c turns readahead off.
func (c Config) Off() bool { return c.MaxBytes < 0 }

// Range is the byte range [Off, End) of a file.
type Range struct {
	Off, End int64
}

// Len is the length of r (0 when empty).
func (r Range) Len() int64 { return max(0, r.End-r.Off) }

// Stream is the READ history of one open file. The zero value has seen no
// READ. A Stream is not safe for concurrent use (Tracker locks it).
type Stream struct {
	seen   bool
	next   int64 // end of the last READ
	window int64 // current window; 0: not in a sequential run
	ahead  int64 // end of what has been read ahead (>= next in a run)
	size   int64 // the file's size at the last READ
}

// live reports whether s is reading ahead: in a run, short of its file's
// end (a Tracker's owners share MaxBytes among their live streams).
func (s *Stream) live() bool { return s.window > 0 && s.ahead < s.size }

// Read records a READ of [lo, hi) of a file of size bytes (c with its
// defaults filled in) and returns the range to read ahead now, empty when
// none. The range lies within [hi, size). Input out of order (hi <= lo,
// lo < 0, hi > size) reads nothing ahead and ends the run.
func (s *Stream) Read(c Config, lo, hi, size int64) Range { return s.read(c, lo, hi, size, c.MaxBytes) }

// read is Read with windows of at most share (of c.MaxBytes, shared with
// other streams) or the READ's length, whichever is more, and never more
// than c.MaxBytes.
func (s *Stream) read(c Config, lo, hi, size, share int64) Range {
	if c.Off() || lo < 0 || hi <= lo || hi > size {
		*s = Stream{seen: true, next: max(0, hi)}
		return Range{}
	}
	n := hi - lo
	limit := min(c.MaxBytes, max(share, n))
	seq := s.seen && lo >= s.next-c.GapBytes && lo <= s.next+c.GapBytes
	switch {
	case seq && s.window > 0:
		s.window = min(limit, max(2*s.window, n))
	case seq || (!s.seen && lo <= c.GapBytes):
		s.window = min(limit, max(c.MinBytes, n))
		s.ahead = hi
	default:
		s.window = 0
	}
	s.seen, s.next, s.size = true, hi, size
	if s.window == 0 {
		s.ahead = hi
		return Range{}
	}
	s.ahead = max(s.ahead, hi)
	if s.ahead-hi >= s.window/2 {
		return Range{} // still half a window or more ahead
	}
	end := size // hi + window, without overflowing near the largest sizes
	if s.window < size-hi {
		end = hi + s.window
	}
	r := Range{Off: s.ahead, End: end}
	s.ahead = max(s.ahead, end)
	if r.Len() == 0 {
		return Range{}
	}
	return r
}

// Unread gives back window r, which Read returned and the caller did not
// read (dropped: too much in flight), so that the stream's next READ asks
// for it again. Only the stream's last window can be given back; any other
// r leaves s as it is.
func (s *Stream) Unread(r Range) {
	if s.window > 0 && r.Len() > 0 && s.ahead == r.End && r.Off >= s.next {
		s.ahead = r.Off
	}
}

// Tracker keeps the Streams of up to Config.Streams open files, keyed by
// K (the daemon keys by the open file, so two opens of one file, by one
// user or two, never share a Stream). Safe for concurrent use.
type Tracker[K comparable] struct {
	c Config

	mu      sync.Mutex
	streams map[K]*entry   // GUARDED_BY(mu)
	owners  map[uint32]int // GUARDED_BY(mu): streams per owner
	live    map[uint32]int // GUARDED_BY(mu): streams per owner reading ahead (Stream.live)
	clock   uint64         // GUARDED_BY(mu)
}

type entry struct {
	Stream
	used  uint64 // Tracker.clock at the last READ
	owner uint32
}

// NewTracker returns a Tracker with policy c (defaults filled in).
func NewTracker[K comparable](c Config) *Tracker[K] {
	return &Tracker[K]{c: c.WithDefaults(), streams: map[K]*entry{}, owners: map[uint32]int{}, live: map[uint32]int{}}
}

// Config returns the Tracker's policy, defaults filled in.
func (t *Tracker[K]) Config() Config { return t.c }

// Read records a READ of [lo, hi) of key's file of size bytes and returns
// the range to read ahead (see Stream.Read). It is ReadAs of owner 0.
func (t *Tracker[K]) Read(key K, lo, hi, size int64) Range { return t.ReadAs(key, 0, lo, hi, size) }

// ReadAs is Read for a stream of owner (the daemon: the reading uid). A
// full table forgets a stream of the owner holding the most (the least
// recently read of them), so that one owner's many opens cost only its
// own streams once it holds more than any other. The owner's streams
// reading ahead share the largest window (see the package doc).
func (t *Tracker[K]) ReadAs(key K, owner uint32, lo, hi, size int64) Range {
	if t.c.Off() {
		return Range{}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.clock++
	e := t.streams[key]
	if e == nil {
		if len(t.streams) >= t.c.Streams {
			t.evictLocked(owner)
		}
		e = &entry{owner: owner}
		t.streams[key] = e
		t.owners[owner]++
	}
	e.used = t.clock
	// A stream is counted for the owner that made it, whoever reads it
	// next (one open file read by two uids: a passed descriptor), so that
	// its counts stay those dropLocked takes back.
	was := e.live()
	k := int64(t.live[e.owner]) // the owner's live streams, this one among them
	if !was {
		k++
	}
	r := e.read(t.c, lo, hi, size, max(t.c.MinBytes, t.c.MaxBytes/max(k, 1)))
	t.reliveLocked(e.owner, was, e.live())
	return r
}

// reliveLocked counts a stream of owner that was or is now live.
func (t *Tracker[K]) reliveLocked(owner uint32, was, is bool) {
	switch {
	case is && !was:
		t.live[owner]++
	case was && !is:
		if t.live[owner]--; t.live[owner] <= 0 {
			delete(t.live, owner)
		}
	}
}

// Unread gives back window r of key's stream (see Stream.Unread).
func (t *Tracker[K]) Unread(key K, r Range) {
	t.mu.Lock()
	if e := t.streams[key]; e != nil {
		was := e.live()
		e.Unread(r)
		t.reliveLocked(e.owner, was, e.live())
	}
	t.mu.Unlock()
}

// Forget drops key's Stream (its file was closed).
func (t *Tracker[K]) Forget(key K) {
	t.mu.Lock()
	if e := t.streams[key]; e != nil {
		t.dropLocked(key, e)
	}
	t.mu.Unlock()
}

// Len is the number of Streams remembered.
func (t *Tracker[K]) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.streams)
}

// evictLocked forgets the least recently read Stream of the owner holding
// the most (newcomer, about to add one, when it holds as many). A scan: it
// runs only when a new file's first READ finds the table full.
func (t *Tracker[K]) evictLocked(newcomer uint32) {
	victim, most := newcomer, t.owners[newcomer]
	for o, n := range t.owners {
		if n > most {
			victim, most = o, n
		}
	}
	var (
		oldest K
		used   uint64
		found  bool
	)
	for k, e := range t.streams {
		if e.owner == victim && (!found || e.used < used) {
			oldest, used, found = k, e.used, true
		}
	}
	if found {
		t.dropLocked(oldest, t.streams[oldest])
	}
}

// dropLocked forgets key's stream e.
func (t *Tracker[K]) dropLocked(key K, e *entry) {
	t.reliveLocked(e.owner, e.live(), false)
	delete(t.streams, key)
	if t.owners[e.owner]--; t.owners[e.owner] <= 0 {
		delete(t.owners, e.owner)
	}
}
