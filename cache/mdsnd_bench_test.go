package cache

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkMDSIndexNdarray measures the parse and JSON of MDS shards of
// 64 MiB (id: int64, x: "ndarray" float32, dtype and shape in each sample)
// from a file in the page cache: 4,096 samples of 16 KiB, 65,536 of 1 KiB.
func BenchmarkMDSIndexNdarray(b *testing.B) {
	for _, n := range []int{4096, 65536} {
		b.Run(fmt.Sprint(n), func(b *testing.B) { benchMDSIndex(b, n, (64<<20)/n) })
	}
}

func benchMDSIndex(b *testing.B, n, bytes int) {
	var samples [][][]byte
	for range n {
		samples = append(samples, [][]byte{make([]byte, 8), ndValue(34, 1, []uint64{uint64(bytes / 4)}, bytes)})
	}
	path := filepath.Join(b.TempDir(), "shard.00000.mds")
	if err := os.WriteFile(path, mdsShard([]string{"id", "x"}, []string{"int64", "ndarray"}, []int64{8, -1}, samples), 0o644); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		m, err := ParseMDS(f, st.Size())
		if err != nil || len(m.Samples) != n {
			b.Fatalf("%v, %v", m, err)
		}
		if _, err := m.MarshalJSON(); err != nil {
			b.Fatal(err)
		}
	}
}
