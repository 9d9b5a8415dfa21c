package cache

import (
	"archive/tar"
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/rs/zerolog"
)

// writeBigTar writes a WebDataset shard of n/2 samples with two members
// each (jpg of 100 bytes, cls of 1 byte): n members in all.
func writeBigTar(b testing.TB, path string, n int) {
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	w := bufio.NewWriterSize(f, 1<<20)
	writeBigTarTo(b, w, n)
	if err := w.Flush(); err != nil {
		b.Fatal(err)
	}
	// Written back, as a shard read for training usually is: the parses
	// measured do not pay its writeback (cache.writtenBack would).
	if err := f.Sync(); err != nil {
		b.Fatal(err)
	}
}

// writeBigTarTo writes the shard of writeBigTar to w.
func writeBigTarTo(b testing.TB, w io.Writer, n int) {
	tw := tar.NewWriter(w)
	jpg := make([]byte, 100)
	for i := range n / 2 {
		for _, m := range []struct {
			ext  string
			data []byte
		}{{"jpg", jpg}, {"cls", []byte{byte(i)}}} {
			h := &tar.Header{Name: fmt.Sprintf("%08d.%s", i, m.ext), Mode: 0o444, Size: int64(len(m.data)), Typeflag: tar.TypeReg}
			if err := tw.WriteHeader(h); err != nil {
				b.Fatal(err)
			}
			if _, err := tw.Write(m.data); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkTarIndex50k measures the index of a 50,000-member tar: the first
// parse (cold cache; the file is in the page cache), a cache hit through
// Indexes.Get (one stat, no read), and Resolve of a sample field on a hit.
func BenchmarkTarIndex50k(b *testing.B) {
	path := filepath.Join(b.TempDir(), "shard-000000.tar")
	writeBigTar(b, path, 50_000)
	ctx := context.Background()
	b.Run("parse", func(b *testing.B) {
		defer cpuPerOp(b)()
		for b.Loop() {
			x, err := NewIndexes(256<<20, zerolog.Nop())
			if err != nil {
				b.Fatal(err)
			}
			idx, err := getPath(ctx, x, path)
			if err != nil || len(idx.Tar.Samples) != 25_000 {
				b.Fatalf("%v, %v", idx, err)
			}
			if _, err := idx.JSON(); err != nil {
				b.Fatal(err)
			}
			x.Close()
		}
	})
	x, err := NewIndexes(256<<20, zerolog.Nop())
	if err != nil {
		b.Fatal(err)
	}
	defer x.Close()
	if _, err := getPath(ctx, x, path); err != nil {
		b.Fatal(err)
	}
	b.Run("hit", func(b *testing.B) {
		defer cpuPerOp(b)()
		for b.Loop() {
			if _, err := getPath(ctx, x, path); err != nil {
				b.Fatal(err)
			}
		}
	})
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	b.Run("hit-fd", func(b *testing.B) {
		defer cpuPerOp(b)()
		for b.Loop() {
			if _, err := x.Get(ctx, path, f); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("hit+resolve", func(b *testing.B) {
		i := 0
		for b.Loop() {
			idx, err := x.Get(ctx, path, f)
			if err != nil {
				b.Fatal(err)
			}
			if _, _, err := idx.Resolve(fmt.Sprintf("sample/%d/jpg", i%25_000)); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	if p := x.Stats().Parses; p != 1 {
		b.Fatalf("hits parsed again: %d parses", p)
	}
	b.ReportMetric(float64(len(mustJSONB(b, x, path))), "json-bytes")
}

// cpuPerOp reports the process's CPU time (user + system, all threads) per
// op: on a shared, loaded machine it is steadier than wall time.
func cpuPerOp(b *testing.B) func() {
	start := cpuNow()
	return func() {
		if b.N > 0 {
			b.ReportMetric(float64(cpuNow()-start)/float64(b.N), "cpu-ns/op")
		}
	}
}

func cpuNow() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

func mustJSONB(b *testing.B, x *Indexes, path string) []byte {
	idx, err := getPath(context.Background(), x, path)
	if err != nil {
		b.Fatal(err)
	}
	js, err := idx.JSON()
	if err != nil {
		b.Fatal(err)
	}
	return js
}
