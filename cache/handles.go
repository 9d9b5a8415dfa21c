package cache

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/rs/zerolog"
)

// DefaultMaxHandles is the default number of cached open backing files.
const DefaultMaxHandles int64 = 4096

// HandlesOptions configures a Handles cache. The zero value is usable.
type HandlesOptions struct {
	// MaxOpen bounds the cached descriptors (0: DefaultMaxHandles).
	// Handles in use beyond it stay open until released.
	MaxOpen int64
	// OnOpen runs once when a handle is opened, before any Acquire returns
	// it; its result is Handle.Data (e.g. a registered cuFile handle). An
	// error fails the Acquire and closes the file.
	OnOpen func(h *Handle) (any, error)
	// OnEvict runs once per handle, after it left the cache and its last
	// user released it, just before its descriptor is closed (e.g. a
	// cuFile deregistration). It must not call back into Handles.
	OnEvict func(h *Handle)
	// Log receives close errors; the zero value is silent.
	Log zerolog.Logger
}

// Handles is a ristretto cache of open backing files keyed by (device,
// inode, access mode). All methods may be called concurrently.
type Handles struct {
	opts  HandlesOptions
	cache *ristretto.Cache[string, *Handle]

	// mu guards paths. Lock order: ristretto's internal locks, then mu
	// (OnExit runs under ristretto's locks and releases handles, which
	// takes mu); nothing calls into the cache while holding mu.
	mu    sync.Mutex
	paths map[string][]*Handle // GUARDED_BY(mu): open handles by the path they were opened through

	hits, misses, evictions, closed atomic.Uint64
}

// Handle is one open backing file shared by concurrent users. Invariant:
// refs counts Acquires not yet Released, plus one while the handle is in
// the cache; at zero the file is closed and the count never rises again.
type Handle struct {
	// File is the open backing file. Users must not close it; they may use
	// ReadAt/WriteAt concurrently (never Seek or Read).
	File *os.File
	// Path is the path it was opened by.
	Path string
	// ID is its identity at open.
	ID Identity
	// Data is what OnOpen returned.
	Data any

	owner  *Handles
	key    string
	refs   atomic.Int64
	cached atomic.Bool // true until the cache's reference is dropped
}

// HandleStats are the handle cache's counters.
type HandleStats struct {
	Hits      uint64 `json:"hits"`
	Misses    uint64 `json:"misses"`
	Evictions uint64 `json:"evictions"`
	Closed    uint64 `json:"closed"`
}

// NewHandles returns a handle cache.
func NewHandles(opts HandlesOptions) (*Handles, error) {
	if opts.MaxOpen == 0 {
		opts.MaxOpen = DefaultMaxHandles
	}
	if opts.MaxOpen < 1 {
		return nil, fmt.Errorf("cache: MaxOpen (%d) must be >= 1", opts.MaxOpen)
	}
	hs := &Handles{opts: opts, paths: make(map[string][]*Handle)}
	c, err := ristretto.NewCache(&ristretto.Config[string, *Handle]{
		NumCounters:        max(opts.MaxOpen*10, 100),
		MaxCost:            opts.MaxOpen,
		BufferItems:        64,
		IgnoreInternalCost: true,
		OnEvict:            func(*ristretto.Item[*Handle]) { hs.evictions.Add(1) },
		// OnExit sees every value leaving the cache: evicted, rejected,
		// replaced or deleted.
		OnExit: func(h *Handle) {
			if h != nil && h.cached.CompareAndSwap(true, false) {
				h.Release()
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("cache: new handle cache: %w", err)
	}
	hs.cache = c
	return hs, nil
}

// Acquire returns an open handle of path with access mode flag (os.O_RDONLY,
// os.O_WRONLY or os.O_RDWR; other bits are ignored), sharing a cached one
// when it is the same file. The caller must call Release exactly once.
func (hs *Handles) Acquire(ctx context.Context, path string, flag int) (*Handle, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	flag &= os.O_RDONLY | os.O_WRONLY | os.O_RDWR
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("cache: stat %q: %w", path, err)
	}
	id, err := IdentityOf(fi)
	if err != nil {
		return nil, err
	}
	if h, ok := hs.cache.Get(handleKey(id, flag)); ok && h.tryRef() {
		hs.hits.Add(1)
		return h, nil
	}
	hs.misses.Add(1)
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, fmt.Errorf("cache: open %q: %w", path, err)
	}
	fi, err = f.Stat()
	if err == nil {
		id, err = IdentityOf(fi)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("cache: stat %q: %w", path, err)
	}
	h := &Handle{File: f, Path: path, ID: id, owner: hs, key: handleKey(id, flag)}
	if hs.opts.OnOpen != nil {
		if h.Data, err = hs.opts.OnOpen(h); err != nil {
			f.Close()
			return nil, fmt.Errorf("cache: open hook for %q: %w", path, err)
		}
	}
	h.refs.Store(2) // the caller's and the cache's
	h.cached.Store(true)
	hs.mu.Lock()
	hs.paths[path] = append(hs.paths[path], h)
	hs.mu.Unlock()
	hs.cache.Set(h.key, h, 1)
	return h, nil
}

// Invalidate drops the cached handles opened through path (the file was
// replaced or unlinked through the mount). Handles in use stay open until
// released.
func (hs *Handles) Invalidate(path string) {
	hs.mu.Lock()
	var keys []string
	for _, h := range hs.paths[path] {
		keys = append(keys, h.key)
	}
	hs.mu.Unlock()
	for _, k := range keys {
		hs.cache.Del(k)
	}
}

// Stats returns the counters.
func (hs *Handles) Stats() HandleStats {
	return HandleStats{Hits: hs.hits.Load(), Misses: hs.misses.Load(), Evictions: hs.evictions.Load(), Closed: hs.closed.Load()}
}

// Close drops every cached handle; each is closed when its last user
// releases it. Acquire must not be called after Close.
func (hs *Handles) Close() {
	hs.cache.Close()
}

// Wait blocks until pending cache updates are applied (for tests and
// benchmarks that need a deterministic cache state).
func (hs *Handles) Wait() { hs.cache.Wait() }

// tryRef takes a reference unless the handle is already closed.
func (h *Handle) tryRef() bool {
	for {
		n := h.refs.Load()
		if n <= 0 {
			return false
		}
		if h.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Release returns a reference taken by Acquire. The last one runs OnEvict
// and closes the file.
func (h *Handle) Release() {
	switch n := h.refs.Add(-1); {
	case n > 0:
		return
	case n < 0:
		panic(fmt.Sprintf("BUG: cache: handle %q released more often than acquired", h.Path))
	}
	hs := h.owner
	if hs.opts.OnEvict != nil {
		hs.opts.OnEvict(h)
	}
	if err := h.File.Close(); err != nil {
		hs.opts.Log.Warn().Err(err).Str("path", h.Path).Msg("close cached backing file")
	}
	hs.closed.Add(1)
	// Release may run under ristretto's locks (OnExit): never call into
	// the cache here.
	hs.mu.Lock()
	rest := hs.paths[h.Path][:0]
	for _, o := range hs.paths[h.Path] {
		if o != h {
			rest = append(rest, o)
		}
	}
	if len(rest) == 0 {
		delete(hs.paths, h.Path)
	} else {
		hs.paths[h.Path] = rest
	}
	hs.mu.Unlock()
}

func handleKey(id Identity, flag int) string {
	var b [17]byte
	binary.LittleEndian.PutUint64(b[0:], id.Dev)
	binary.LittleEndian.PutUint64(b[8:], id.Ino)
	b[16] = byte(flag)
	return string(b[:])
}
