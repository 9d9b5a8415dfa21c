package integration

import (
	"archive/tar"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// The load and fault tests share a deterministic dataset: every byte of
// every file is a function of (file seed, offset), so a client verifies
// any range it reads without a copy of the file.

const (
	loadDataFiles   = 12
	loadShards      = 4
	loadShardMember = 40
)

// splitmix64 is a one-step PRNG: good enough to make every 8-byte word of
// the dataset distinct, and cheap to evaluate at any offset.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// genBytes returns bytes [off, off+n) of the file with this seed.
func genBytes(seed uint64, off int64, n int) []byte {
	b := make([]byte, n)
	for i := 0; i < n; {
		p := off + int64(i)
		w := splitmix64(seed*0x100000001b3 ^ uint64(p/8))
		for j := p % 8; j < 8 && i < n; j++ {
			b[i] = byte(w >> (8 * j))
			i++
		}
	}
	return b
}

// loadDataSize is the size of data file i: 1..~6 MiB, never aligned.
func loadDataSize(i int) int64 { return int64(1<<20+i*(512<<10)) + int64(i*4099+17) }

func loadDataName(i int) string  { return fmt.Sprintf("data/file-%02d.bin", i) }
func loadDataSeed(i int) uint64  { return uint64(1000 + i) }
func loadShardName(s int) string { return fmt.Sprintf("shards/shard-%02d.tar", s) }

// loadMember describes member j of shard s.
func loadMember(s, j int) (name string, seed uint64, size int) {
	return fmt.Sprintf("sample-%04d.bin", j), uint64(100000 + s*1000 + j), 100 + (j*7919+s*104729)%30000
}

// writeLoadDataset writes the dataset under dir.
func writeLoadDataset(t testing.TB, dir string) {
	t.Helper()
	for i := 0; i < loadDataFiles; i++ {
		writeFile(t, filepath.Join(dir, loadDataName(i)), genBytes(loadDataSeed(i), 0, int(loadDataSize(i))))
	}
	if err := os.MkdirAll(filepath.Join(dir, "shards"), 0o755); err != nil {
		t.Fatal(err)
	}
	for s := 0; s < loadShards; s++ {
		f, err := os.Create(filepath.Join(dir, loadShardName(s)))
		if err != nil {
			t.Fatal(err)
		}
		tw := tar.NewWriter(f)
		for j := 0; j < loadShardMember; j++ {
			name, seed, size := loadMember(s, j)
			if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(size), Typeflag: tar.TypeReg}); err != nil {
				t.Fatal(err)
			}
			if _, err := tw.Write(genBytes(seed, 0, size)); err != nil {
				t.Fatal(err)
			}
		}
		if err := tw.Close(); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "work"), 0o777); err != nil {
		t.Fatal(err)
	}
}
