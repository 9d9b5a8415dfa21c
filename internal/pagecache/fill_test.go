package pagecache

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// Fill brings a range of a cold file into the page cache through its own
// open: the caller's offset stays put, the end of the file shortens it, a
// done context stops it and a closed file is an error.
func TestFill(t *testing.T) {
	const size = 9<<20 + 123
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Seek(100, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	done, cancel := context.WithCancel(context.Background())
	cancel()
	var fl Fills
	cases := []struct {
		name    string
		ctx     context.Context
		off, n  int64
		want    int64
		wantErr bool
	}{
		{"a range", context.Background(), 1 << 20, 6 << 20, 6 << 20, false},
		{"past the end", context.Background(), 8 << 20, 4 << 20, size - 8<<20, false},
		{"nothing", context.Background(), 0, 0, 0, false},
		{"done context", done, 0, 1 << 20, 0, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
				t.Fatal(err)
			}
			got, err := fl.Fill(c.ctx, f, c.off, c.n)
			if (err != nil) != c.wantErr || got != c.want {
				t.Fatalf("Fill(%d, %d) = %d, %v; want %d, error %v", c.off, c.n, got, err, c.want, c.wantErr)
			}
			if cached, ok := Cached(f, c.off, max(c.want, 1)); ok && c.want > 0 && cached < c.want {
				t.Errorf("%d of %d bytes cached after Fill", cached, c.want)
			}
			if pos, _ := f.Seek(0, io.SeekCurrent); pos != 100 {
				t.Errorf("the caller's offset moved to %d", pos)
			}
		})
	}
	f.Close()
	if _, err := fl.Fill(context.Background(), f, 0, 4096); err == nil {
		t.Error("Fill of a closed file succeeded")
	}
}
