package cache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/fileid"
	"github.com/gdsfs/gdsfs/internal/openflags"
)

// DefaultIndexBudget is the default memory budget of parsed indexes
// (--meta-cache): about 100k tar shards of 1,000 samples.
const DefaultIndexBudget int64 = 256 << 20

// minIndexBudget keeps ristretto's bookkeeping meaningful.
const minIndexBudget int64 = 1 << 20

// DefaultParses is how many files are parsed at once (each parse is bounded
// by the parsers' limits, docs/index-format.md "Limits"), and
// DefaultParsesPerUID how many of them one requesting uid may hold (so one
// user asking for many files cannot take every slot); further misses wait
// up to DefaultParseWait for a slot, then fail with ErrBusy.
const (
	DefaultParses       = 2
	DefaultParsesPerUID = 1
)

// DefaultParseWait bounds the wait for a parse slot.
const DefaultParseWait = 5 * time.Second

// ErrBusy reports that every parse slot stayed taken for the whole wait: the
// daemon is parsing other files (the answer is not cached; retry later).
var ErrBusy = errors.New("cache: every index parse slot is busy; retry later")

// Indexes is a ristretto cache of parsed indexes keyed by file identity.
// All methods may be called concurrently.
type Indexes struct {
	log   zerolog.Logger
	cache *ristretto.Cache[string, *indexEntry]
	paths pathTable
	// flights are the parses in progress, one per identity key: later
	// misses of the key wait for its answer instead of parsing again.
	flights struct {
		mu sync.Mutex
		m  map[string]*flight // GUARDED_BY(mu)
	}
	// running counts the flights' goroutines: Close waits for them, since a
	// flight outlives the caller that started it and writes to the cache.
	running sync.WaitGroup

	// slots holds one token per parse in flight (at most DefaultParses),
	// uids one per parse of each requesting uid; a miss waits up to
	// parseWait for both.
	slots     chan struct{}
	uids      uidSlots
	parseWait time.Duration
	// parseFn parses one file (Parse; tests substitute a slow one).
	parseFn func(r io.ReaderAt, size int64, name string) (*Index, error)

	hits, misses, evictions, parses, parseErrors, busy atomic.Uint64
}

// indexEntry is one cached answer: an index or the parse error (a corrupt
// file stays corrupt until its identity changes, so errors are cached too).
type indexEntry struct {
	idx  *Index
	err  error
	key  string
	path string
}

// IndexStats are the counters behind user.gdsfs.stats and gdsfs status.
type IndexStats struct {
	Hits        uint64 `json:"hits"`
	Misses      uint64 `json:"misses"`
	Evictions   uint64 `json:"evictions"`
	Parses      uint64 `json:"parses"`
	ParseErrors uint64 `json:"parse_errors"`
	// Busy counts misses refused with ErrBusy (no parse slot in time).
	Busy        uint64 `json:"busy"`
	BudgetBytes int64  `json:"budget_bytes"`
	UsedBytes   int64  `json:"used_bytes"`
}

// NewIndexes returns an index cache holding up to budgetBytes of parsed
// indexes (0 means DefaultIndexBudget).
func NewIndexes(budgetBytes int64, log zerolog.Logger) (*Indexes, error) {
	if budgetBytes == 0 {
		budgetBytes = DefaultIndexBudget
	}
	if budgetBytes < minIndexBudget {
		return nil, fmt.Errorf("cache: index budget %d bytes is below the minimum of %d (1 MiB)", budgetBytes, minIndexBudget)
	}
	x := &Indexes{log: log, slots: make(chan struct{}, DefaultParses), parseWait: DefaultParseWait, parseFn: Parse}
	x.uids.m = make(map[uint32]*uidSlot)
	x.flights.m = make(map[string]*flight)
	x.paths.m = make(map[string]pathEntry)
	drop := func(it *ristretto.Item[*indexEntry]) {
		if e := it.Value; e != nil {
			x.paths.forget(e.path, e.key)
		}
	}
	c, err := ristretto.NewCache(&ristretto.Config[string, *indexEntry]{
		// ~10 counters per expected entry; a small index costs ~4 KiB.
		NumCounters:        max(budgetBytes/4096*10, 1000),
		MaxCost:            budgetBytes,
		BufferItems:        64,
		IgnoreInternalCost: true,
		OnEvict: func(it *ristretto.Item[*indexEntry]) {
			x.evictions.Add(1)
			drop(it)
		},
		OnReject: drop,
	})
	if err != nil {
		return nil, fmt.Errorf("cache: new index cache: %w", err)
	}
	x.cache = c
	return x, nil
}

// Get returns the index of the file f, open for reading, at path (used as
// the name invalidations find the entry by, and as the format hint). Get
// only reads through f, with ReadAt: it never opens anything, so it can
// neither block on what a path names nor read with more rights than the
// caller's descriptor has; a descriptor not open for reading fails with an
// error wrapping syscall.EBADF. A hit does one fstat and no read. It
// returns ErrNoIndex for files of no indexed format (and for anything but
// a regular file), an error wrapping ErrInvalid for corrupt ones or ones
// beyond the parsers' limits (cached like indexes, under the file's
// identity), ErrBusy when no parse slot freed up in time, and ctx's error
// when ctx ends first (the parse goes on and its answer is cached).
func (x *Indexes) Get(ctx context.Context, path string, f *os.File) (*Index, error) {
	if f == nil {
		return nil, fmt.Errorf("BUG: cache: Get of %q without a descriptor: %w", path, syscall.EBADF)
	}
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("cache: stat %q: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, ErrNoIndex
	}
	// Before the cache: a cached index is the file's contents too.
	if err := readable(f); err != nil {
		return nil, fmt.Errorf("cache: index %q: %w", path, err)
	}
	id, err := fileid.Of(fi)
	if err != nil {
		return nil, err
	}
	key := id.Key()
	if e, ok := x.cache.Get(key); ok {
		x.hits.Add(1)
		if e.path != path {
			// Another name of the same file (hard link): remember it too,
			// so that Invalidate of this name finds the entry.
			x.paths.note(path, key)
		}
		return e.idx, e.err
	}
	x.misses.Add(1)
	gen := x.paths.note(path, key)
	fl := x.fly(ctx, key, path, f, id, gen)
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-fl.done:
		return fl.e.idx, fl.e.err
	}
}

// flight is one parse in progress; e is set before done is closed.
type flight struct {
	done chan struct{}
	e    *indexEntry
}

// fly returns the flight of key, starting it (the parse of f) if there is
// none. The flight outlives a caller that gives up (and may then close f):
// it reads through its own duplicate of f's descriptor, made before fly
// returns.
func (x *Indexes) fly(ctx context.Context, key, path string, f *os.File, id fileid.ID, gen uint64) *flight {
	x.flights.mu.Lock()
	fl := x.flights.m[key]
	if fl != nil {
		x.flights.mu.Unlock()
		return fl
	}
	fl = &flight{done: make(chan struct{})}
	x.flights.m[key] = fl
	x.flights.mu.Unlock()
	g, err := dupFile(f)
	uid := requester(ctx)
	x.running.Add(1)
	go func() {
		defer x.running.Done()
		switch e, ok := x.cache.Get(key); {
		case err != nil:
			fl.e = &indexEntry{err: fmt.Errorf("cache: index %q: %w", path, err), key: key, path: path}
		case ok:
			// A flight that just ended cached it between our miss and now.
			fl.e = e
		default:
			fl.e = x.load(uid, path, g, id, gen)
		}
		if g != nil {
			g.Close()
		}
		x.flights.mu.Lock()
		delete(x.flights.m, key)
		x.flights.mu.Unlock()
		close(fl.done)
	}()
	return fl
}

// readable checks that f was opened for reading (O_RDONLY or O_RDWR).
func readable(f *os.File) error {
	fl, err := openflags.Of(f)
	if err != nil {
		return err
	}
	if fl&unix.O_ACCMODE == unix.O_WRONLY || fl&unix.O_PATH != 0 {
		return fmt.Errorf("descriptor not open for reading: %w", syscall.EBADF)
	}
	return nil
}

// dupFile returns a duplicate of f's descriptor (same open file
// description, so the same access mode).
func dupFile(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var fd int
	var derr error
	if err := rc.Control(func(u uintptr) { fd, derr = unix.FcntlInt(u, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, fmt.Errorf("dup: %w", derr)
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// requesterKey is the context key of the requesting uid (WithRequester).
type requesterKey struct{}

// WithRequester returns ctx naming uid as the user a Get is for: a parse
// it starts counts against uid's share of the parse slots
// (DefaultParsesPerUID). Without it, Gets share the share of uid 0.
func WithRequester(ctx context.Context, uid uint32) context.Context {
	return context.WithValue(ctx, requesterKey{}, uid)
}

func requester(ctx context.Context) uint32 {
	uid, _ := ctx.Value(requesterKey{}).(uint32)
	return uid
}

// uidSlots are the per-uid parse slots; an entry lives while a parse of
// its uid runs or waits.
type uidSlots struct {
	mu sync.Mutex
	m  map[uint32]*uidSlot // GUARDED_BY(mu)
}

type uidSlot struct {
	ch    chan struct{} // one token per parse of the uid in flight
	users int           // GUARDED_BY(uidSlots.mu): holders and waiters
}

func (u *uidSlots) get(uid uint32) *uidSlot {
	u.mu.Lock()
	defer u.mu.Unlock()
	s := u.m[uid]
	if s == nil {
		s = &uidSlot{ch: make(chan struct{}, DefaultParsesPerUID)}
		u.m[uid] = s
	}
	s.users++
	return s
}

func (u *uidSlots) put(uid uint32, s *uidSlot) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if s.users--; s.users == 0 {
		delete(u.m, uid)
	}
}

// slot takes a slot of uid's share and a parse slot, waiting up to
// parseWait in all; it returns the function that gives both back, or nil.
func (x *Indexes) slot(uid uint32) func() {
	t := time.NewTimer(x.parseWait)
	defer t.Stop()
	own := x.uids.get(uid)
	select {
	case own.ch <- struct{}{}:
	case <-t.C:
		x.uids.put(uid, own)
		return nil
	}
	select {
	case x.slots <- struct{}{}:
	case <-t.C:
		<-own.ch
		x.uids.put(uid, own)
		return nil
	}
	return func() {
		<-x.slots
		<-own.ch
		x.uids.put(uid, own)
	}
}

// load parses the file and caches the answer unless the path was
// invalidated meanwhile.
func (x *Indexes) load(uid uint32, path string, f *os.File, id fileid.ID, gen uint64) *indexEntry {
	done := x.slot(uid)
	if done == nil {
		x.busy.Add(1)
		x.log.Warn().Str("path", path).Uint32("uid", uid).Dur("waited", x.parseWait).Msg("cache: no index parse slot free in time; answered EAGAIN (other files are being parsed)")
		return &indexEntry{err: fmt.Errorf("cache: index %q: %w", path, ErrBusy), key: id.Key(), path: path}
	}
	x.parses.Add(1)
	idx, err := x.parseFn(writtenBack{f}, id.Size, path)
	done()
	e := &indexEntry{idx: idx, err: err, key: id.Key(), path: path}
	if err != nil {
		x.parseErrors.Add(1)
		if errors.Is(err, ErrInvalid) {
			// Once per file identity: the error is cached under it, so the
			// next parse (and log line) is for a changed or evicted file.
			x.log.Warn().Err(err).Str("path", path).Msg("cache: corrupt shard: no index (user.gdsfs.index answers ENODATA; user.gdsfs.info has index_error)")
		}
		if !errors.Is(err, ErrNoIndex) && !errors.Is(err, ErrInvalid) {
			// I/O errors and races with writers are not cached.
			return e
		}
	}
	if !x.paths.current(path, e.key, gen) {
		return e
	}
	cost := int64(256)
	if idx != nil {
		cost = idx.cost()
	}
	x.cache.Set(e.key, e, cost)
	// Make the entry visible to the next Get (ristretto applies sets
	// asynchronously), so later callers hit instead of parsing again.
	x.cache.Wait()
	if !x.paths.current(path, e.key, gen) {
		// Invalidated between the check above and the Set: an Invalidate
		// before the Set was applied may have deleted nothing.
		x.cache.Del(e.key)
	}
	return e
}

// Invalidate drops what is cached for path. fs calls it (through ctl) after a write, truncate,
// rename or unlink through the mount: identity alone can miss a same-size
// write within one timestamp tick.
func (x *Indexes) Invalidate(path string) {
	if key, ok := x.paths.drop(path); ok {
		x.cache.Del(key)
	}
}

// Stats returns the counters.
func (x *Indexes) Stats() IndexStats {
	return IndexStats{
		Hits:        x.hits.Load(),
		Misses:      x.misses.Load(),
		Evictions:   x.evictions.Load(),
		Parses:      x.parses.Load(),
		ParseErrors: x.parseErrors.Load(),
		Busy:        x.busy.Load(),
		BudgetBytes: x.cache.MaxCost(),
		UsedBytes:   x.cache.MaxCost() - x.cache.RemainingCost(),
	}
}

// Close waits for the parses in flight (they outlive callers that gave up
// and write to the cache), then releases the cache. Get must not be called
// after Close.
func (x *Indexes) Close() {
	x.running.Wait()
	x.cache.Close()
}

// pathTable remembers which identity key each path was last looked up
// under, so Invalidate(path) can find the entry. gen tells a parse whether
// its path was invalidated while it ran.
type pathTable struct {
	mu      sync.Mutex
	m       map[string]pathEntry // GUARDED_BY(mu)
	lastGen uint64               // GUARDED_BY(mu)
}

type pathEntry struct {
	key string
	gen uint64
}

// note records that path has identity key and returns the registration's
// generation (unchanged if path already had that key).
func (t *pathTable) note(path, key string) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.m[path]; ok && e.key == key {
		return e.gen
	}
	t.lastGen++
	t.m[path] = pathEntry{key: key, gen: t.lastGen}
	return t.lastGen
}

// current reports whether path is still registered with key and gen.
func (t *pathTable) current(path, key string, gen uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[path]
	return ok && e.key == key && e.gen == gen
}

// forget removes path if it still maps to key (its entry left the cache).
func (t *pathTable) forget(path, key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.m[path]; ok && e.key == key {
		delete(t.m, path)
	}
}

// drop removes path and returns its key. Paths under a renamed directory
// need nothing: their files' identities, hence their indexes, are unchanged.
func (t *pathTable) drop(path string) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[path]
	delete(t.m, path)
	return e.key, ok
}

// readerAt is what the parsers read; *os.File satisfies it.
var _ io.ReaderAt = (*os.File)(nil)

// writtenBack is the reader of a parse: each ReadAt first writes the
// range's dirty pages back (sync_file_range). A store into a page of a
// MAP_SHARED mapping that is already dirty and writable changes no
// timestamp; writeback write-protects the range's pages in every mapping,
// so a store after the read faults and updates the file's times, and the
// index (cached under the identity Get took before reading) stops matching
// the file. A clean range costs one call; a range being written makes its
// writeback happen at the parse.
type writtenBack struct{ f *os.File }

func (w writtenBack) ReadAt(p []byte, off int64) (int, error) {
	if len(p) > 0 && off >= 0 {
		if err := writeBack(w.f, off, int64(len(p))); err != nil {
			return 0, err
		}
	}
	return w.f.ReadAt(p, off)
}

// writeBack writes [off, off+n) of f's dirty pages to disk and waits for
// it. ESPIPE (not a file with pages) leaves nothing to write back.
func writeBack(f *os.File, off, n int64) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("cache: write back %s: %w", f.Name(), err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SyncFileRange(int(fd), off, n, unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE|unix.SYNC_FILE_RANGE_WAIT_AFTER)
	}); err != nil {
		return fmt.Errorf("cache: write back %s: %w", f.Name(), err)
	}
	if serr != nil && !errors.Is(serr, syscall.ESPIPE) {
		return fmt.Errorf("cache: write back %s at %d: %w", f.Name(), off, serr)
	}
	return nil
}
