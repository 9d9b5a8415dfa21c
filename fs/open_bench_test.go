package fs

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/rs/zerolog"
)

// BenchmarkOpenClose opens and closes a file on the mount from parallel
// goroutines: the open path every sample read takes (LOOKUP is cached,
// OPEN and RELEASE reach the daemon).
func BenchmarkOpenClose(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("mounting FUSE needs root")
	}
	dir := b.TempDir()
	backing, mnt := filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(backing, "f"), []byte("x"), 0o644); err != nil {
		b.Fatal(err)
	}
	srv, err := Mount(context.Background(), Options{Source: backing, Mountpoint: mnt, Logger: zerolog.Nop()})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		if err := srv.Unmount(); err != nil {
			srv.UnmountLazy()
		}
		srv.Wait()
	}()
	p := filepath.Join(mnt, "f")
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			f, err := os.Open(p)
			if err != nil {
				b.Error(err)
				return
			}
			f.Close()
		}
	})
}
