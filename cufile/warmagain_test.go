package cufile

import (
	"bytes"
	"context"
	"testing"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// TestColdReadOfAFileMemoryHoldsLeavesItCached is the user who loads the
// same checkpoint twice (an eval job, a restart): a file the page cache can
// hold is read through it even when cold, so the second load is served from
// memory, as torch.load's second read of a local file is. The GPU run of
// 2026-12-01 18:30 loaded a DCP checkpoint the daemon had written with
// O_DIRECT three times at the disk's rate (1.8 GB/s each, 0.01 of 8 GiB
// cached after them), 39.6 GB/s only once something else had read it
// through the cache. Only a file larger than DirectReadMinFile still reads
// its cold ranges around the cache.
func TestColdReadOfAFileMemoryHoldsLeavesItCached(t *testing.T) {
	const chunk = 4 * gpubuf.Align
	const size = 32 * chunk // 32 chunks: O_DIRECT territory when cold (>= 4 chunks)
	host := func() gpubuf.Memory { return &hostMem{mmapBytes(size)} }
	dev := func() gpubuf.Memory { return &fakeDevMem{data: make([]byte, size)} }
	hostBytes := func(m gpubuf.Memory) []byte { return m.(*hostMem).b }
	devBytes := func(m gpubuf.Memory) []byte { return m.(*fakeDevMem).data }
	for _, tc := range []struct {
		name       string
		engine     func(Options) Engine
		mem        func() gpubuf.Memory
		bytes      func(gpubuf.Memory) []byte
		minFile    int64
		wantCached bool
	}{
		{"host, default threshold", func(o Options) Engine { return NewHostEngine(o) }, host, hostBytes, 0, true},
		{"posix, default threshold", func(o Options) Engine { return newPosixEngine(&fakeStager{failH2DAt: -1}, o) }, dev, devBytes, 0, true},
		{"host, file above the threshold", func(o Options) Engine { return NewHostEngine(o) }, host, hostBytes, size / 2, false},
		{"posix, file above the threshold", func(o Options) Engine { return newPosixEngine(&fakeStager{failH2DAt: -1}, o) }, dev, devBytes, size / 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, data := coldFile(t, size)
			e := tc.engine(Options{ChunkBytes: chunk, Workers: 2, DirectReadMinFile: tc.minFile})
			mem := tc.mem()
			got, err := e.ReadAt(context.Background(), f, mem, 0, 0, size)
			if err != nil || got != size {
				t.Fatalf("ReadAt = %d, %v; want %d", got, err, size)
			}
			if !bytes.Equal(tc.bytes(mem), data) {
				t.Fatal("bytes differ from the file")
			}
			cached, _ := pagecache.Cached(f, 0, size)
			if isCached := cached >= size*9/10; isCached != tc.wantCached {
				t.Errorf("after a cold read of the whole file %d of %d bytes are in the page cache; want cached = %v", cached, size, tc.wantCached)
			}
			if br, ok := BufferedReaderOf(e); !ok || br.ReadsBuffered(size, size) != tc.wantCached {
				t.Errorf("ReadsBuffered(%d, file of %d) disagrees with the read: want %v", size, size, tc.wantCached)
			}
		})
	}
}
