package cache

import (
	"bytes"
	"context"
	"errors"
	"hash/fnv"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

func newTestIndexes(t *testing.T) *Indexes {
	t.Helper()
	x, err := NewIndexes(64<<20, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Close)
	return x
}

// getPath opens path read-only and asks x for its index, as the daemon does
// with the caller's descriptor.
func getPath(ctx context.Context, x *Indexes, path string) (*Index, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return x.Get(ctx, path, f)
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestIndexesSingleflight asks 64 goroutines for the same cold index: it
// is parsed once, and later asks hit without parsing.
func TestIndexesSingleflight(t *testing.T) {
	x := newTestIndexes(t)
	path := filepath.Join(t.TempDir(), "shard.00000.mds")
	writeFile(t, path, writeMDSShard(testSamples(2000)))
	ctx := context.Background()
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, 64)
	for range 64 {
		wg.Go(func() {
			<-start
			idx, err := getPath(ctx, x, path)
			if err == nil && len(idx.MDS.Samples) != 2000 {
				err = errors.New("wrong index")
			}
			errs <- err
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if p := x.Stats().Parses; p != 1 {
		t.Fatalf("64 concurrent cold asks parsed %d times, want 1", p)
	}
	for range 100 {
		if _, err := getPath(ctx, x, path); err != nil {
			t.Fatal(err)
		}
	}
	st := x.Stats()
	if st.Parses != 1 || st.Hits < 100 {
		t.Fatalf("after 100 more asks: %+v, want 1 parse and >= 100 hits", st)
	}
	if st.UsedBytes <= 0 {
		t.Errorf("used bytes %d after caching an index", st.UsedBytes)
	}
}

// TestIndexesChangeBehindBack rewrites a file directly (not through any
// Invalidate): the identity changes and the next Get parses the new
// content instead of serving the stale index.
func TestIndexesChangeBehindBack(t *testing.T) {
	x := newTestIndexes(t)
	path := filepath.Join(t.TempDir(), "shard.00000.mds")
	writeFile(t, path, writeMDSShard(testSamples(3)))
	ctx := context.Background()
	idx, err := getPath(ctx, x, path)
	if err != nil || len(idx.MDS.Samples) != 3 {
		t.Fatalf("Get = %v, %v", idx, err)
	}
	// Same size, different content and mtime: only the identity tells.
	b := writeMDSShard(testSamples(3))
	copy(b[len(b)-3:], "xyz")
	writeFile(t, path, b)
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(path, old, old); err != nil {
		t.Fatal(err)
	}
	idx2, err := getPath(ctx, x, path)
	if err != nil {
		t.Fatal(err)
	}
	if idx2 == idx || x.Stats().Parses != 2 {
		t.Fatalf("changed file served from cache (parses %d)", x.Stats().Parses)
	}
	// Replaced by another format: the answer follows.
	writeFile(t, path+".tmp", []byte("plain text, no index"))
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
	if _, err := getPath(ctx, x, path); !errors.Is(err, ErrInvalid) {
		t.Fatalf("after replacement: %v, want ErrInvalid (a .mds that is not MDS)", err)
	}
}

// TestIndexesInvalidate covers a write through the mount that keeps size
// and timestamps (coarse clock): only Invalidate can tell, and it does.
func TestIndexesInvalidate(t *testing.T) {
	x := newTestIndexes(t)
	path := filepath.Join(t.TempDir(), "a.npy")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	v1 := npyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", make([]byte, 8))
	if _, err := f.WriteAt(v1, 0); err != nil {
		t.Fatal(err)
	}
	fi, _ := f.Stat()
	ctx := context.Background()
	if _, err := x.Get(ctx, path, f); err != nil {
		t.Fatal(err)
	}
	v2 := npyFile(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", make([]byte, 8))
	if _, err := f.WriteAt(v2, 0); err != nil {
		t.Fatal(err)
	}
	// Pretend the clock did not tick: restore mtime (ctime moves, but a
	// coarse-grained filesystem could keep it too).
	os.Chtimes(path, fi.ModTime(), fi.ModTime())
	x.Invalidate(path)
	idx, err := x.Get(ctx, path, f)
	if err != nil {
		t.Fatal(err)
	}
	if idx.Npy.Dtype != "<i4" {
		t.Fatalf("after Invalidate: dtype %q, want <i4", idx.Npy.Dtype)
	}
	if p := x.Stats().Parses; p != 2 {
		t.Errorf("parses = %d, want 2", p)
	}
}

func TestIndexesErrors(t *testing.T) {
	x := newTestIndexes(t)
	dir := t.TempDir()
	ctx := context.Background()
	plain := filepath.Join(dir, "notes.txt")
	writeFile(t, plain, []byte("hello"))
	bad := filepath.Join(dir, "bad.safetensors")
	writeFile(t, bad, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'})
	for _, tc := range []struct {
		path string
		want error
	}{
		{plain, ErrNoIndex},
		{dir, ErrNoIndex},
		{bad, ErrInvalid},
		{filepath.Join(dir, "missing.tar"), os.ErrNotExist},
	} {
		for range 2 { // the second ask is answered from the cache
			if _, err := getPath(ctx, x, tc.path); !errors.Is(err, tc.want) {
				t.Errorf("Get(%s) = %v, want %v", tc.path, err, tc.want)
			}
		}
	}
	if p := x.Stats().Parses; p != 2 {
		t.Errorf("parses = %d, want 2 (errors are cached)", p)
	}
	// A write-only descriptor is refused: Get never opens the path.
	sp := filepath.Join(dir, "m.safetensors")
	writeFile(t, sp, stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{7}))
	wo, err := os.OpenFile(sp, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer wo.Close()
	if idx, err := x.Get(ctx, sp, wo); !errors.Is(err, syscall.EBADF) {
		t.Errorf("Get with a write-only descriptor = %v, %v; want EBADF", idx, err)
	}
	if p := x.Stats().Parses; p != 2 {
		t.Errorf("parses = %d after a write-only Get, want 2 (nothing parsed)", p)
	}
	// Cancelled callers return at once.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	writeFile(t, filepath.Join(dir, "c.npy"), npyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", make([]byte, 4)))
	if _, err := getPath(cctx, x, filepath.Join(dir, "c.npy")); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Get = %v", err)
	}
	if _, err := NewIndexes(1000, zerolog.Nop()); err == nil {
		t.Error("NewIndexes accepted a 1000-byte budget")
	}
}

// TestIndexesEviction fills a small budget: entries are evicted, counted,
// and evicted files parse again.
func TestIndexesEviction(t *testing.T) {
	x, err := NewIndexes(1<<20, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	dir := t.TempDir()
	ctx := context.Background()
	data := writeMDSShard(testSamples(1000)) // ~100 KiB of JSON, ~300 KiB of cost
	for i := range 20 {
		p := filepath.Join(dir, "shard."+string(rune('a'+i))+".mds")
		writeFile(t, p, data)
		if _, err := getPath(ctx, x, p); err != nil {
			t.Fatal(err)
		}
	}
	st := x.Stats()
	if st.Evictions == 0 || st.UsedBytes > 1<<20 {
		t.Fatalf("after 20 large indexes in 1 MiB: %+v", st)
	}
}

// TestIndexJSONHash: the hash INDEX pages carry as their generation is the
// FNV-1a 64 of the JSON they serve (docs/protocol.md), computed once.
func TestIndexJSONHash(t *testing.T) {
	data := smallTar(t)
	x, err := Parse(bytes.NewReader(data), int64(len(data)), "a.tar")
	if err != nil {
		t.Fatal(err)
	}
	js, gen, err := x.JSONHash()
	if err != nil {
		t.Fatal(err)
	}
	h := fnv.New64a()
	h.Write(js)
	again, _ := x.JSON()
	if gen != h.Sum64() || !bytes.Equal(js, again) {
		t.Fatalf("JSONHash = %x, FNV-1a 64 of the JSON %x", gen, h.Sum64())
	}
}
