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

	"github.com/dgraph-io/ristretto/v2"
	"github.com/rs/zerolog"
	"golang.org/x/sync/singleflight"
)

// DefaultIndexBudget is the default memory budget of parsed indexes
// (--meta-cache): about 100k tar shards of 1,000 samples.
const DefaultIndexBudget int64 = 256 << 20

// minIndexBudget keeps ristretto's bookkeeping meaningful.
const minIndexBudget int64 = 1 << 20

// Indexes is a ristretto cache of parsed indexes keyed by file identity.
// All methods may be called concurrently.
type Indexes struct {
	log   zerolog.Logger
	cache *ristretto.Cache[string, *indexEntry]
	group singleflight.Group
	paths pathTable

	hits, misses, evictions, parses, parseErrors atomic.Uint64
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
	x := &Indexes{log: log}
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

// Get returns the index of the file at path. f, when not nil, is an open
// descriptor of that file (it is only read with ReadAt); with f nil, Get
// stats path and opens it only on a miss. A hit does one stat and no read.
// It returns ErrNoIndex for files of no indexed format, an error wrapping
// ErrInvalid for corrupt ones, and the stat/open error for missing files.
func (x *Indexes) Get(ctx context.Context, path string, f *os.File) (*Index, error) {
	var fi os.FileInfo
	var err error
	if f != nil {
		fi, err = f.Stat()
	} else {
		fi, err = os.Stat(path)
	}
	if err != nil {
		return nil, fmt.Errorf("cache: stat %q: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, ErrNoIndex
	}
	id, err := IdentityOf(fi)
	if err != nil {
		return nil, err
	}
	key := id.key()
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
	ch := x.group.DoChan(key, func() (any, error) {
		// Another flight may have cached it between our Get and Do.
		if e, ok := x.cache.Get(key); ok {
			return e, nil
		}
		return x.load(path, f, id, gen), nil
	})
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case res := <-ch:
		e := res.Val.(*indexEntry)
		return e.idx, e.err
	}
}

// load parses the file and caches the answer unless the path was
// invalidated meanwhile.
func (x *Indexes) load(path string, f *os.File, id Identity, gen uint64) *indexEntry {
	x.parses.Add(1)
	idx, err := x.parse(path, f, id)
	e := &indexEntry{idx: idx, err: err, key: id.key(), path: path}
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

func (x *Indexes) parse(path string, f *os.File, id Identity) (*Index, error) {
	if f != nil {
		idx, err := Parse(f, id.Size, path)
		if !errors.Is(err, syscall.EBADF) {
			return idx, err
		}
		// A write-only descriptor cannot be read: open the path.
	}
	g, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("cache: open %q: %w", path, err)
	}
	defer g.Close()
	fi, err := g.Stat()
	if err != nil {
		return nil, fmt.Errorf("cache: stat %q: %w", path, err)
	}
	if got, err := IdentityOf(fi); err != nil || got != id {
		return nil, fmt.Errorf("cache: %q changed while being indexed; retry", path)
	}
	return Parse(g, id.Size, path)
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
		BudgetBytes: x.cache.MaxCost(),
		UsedBytes:   x.cache.MaxCost() - x.cache.RemainingCost(),
	}
}

// Close releases the cache. Get must not be called after Close.
func (x *Indexes) Close() {
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
