package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// TestControlWriteDirectCoherent: a reader who read a file's old bytes
// through the mount, then had the daemon WRITE over them (O_DIRECT for the
// aligned body under the default --direct-io auto, buffered head and
// tail), reads the new bytes through the same descriptor and a new one,
// with and without passthrough; the backing file is the oracle. The body
// left the backing file's page cache, so the write did go around it.
func TestControlWriteDirectCoherent(t *testing.T) {
	for _, tc := range []struct {
		name string
		noPT bool
	}{{"passthrough", false}, {"no passthrough", true}} {
		t.Run(tc.name, func(t *testing.T) {
			m := startMount(t, mountOpts{Daemon: true, NoPassthrough: tc.noPT, SlabBytes: 4 << 20, BudgetBytes: 32 << 20})
			want := m.addFile(t, "ckpt", 3<<20, 5)
			ctx := context.Background()
			p := filepath.Join(m.mnt, "ckpt")
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			cl := openSession(t, m.mnt)
			l, err := cl.Alloc(ctx, ctl.HostDevice, 2<<20+8192)
			if err != nil {
				t.Fatal(err)
			}
			buf, err := cl.Bytes(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			copy(buf, randomBytes(77, len(buf)))
			backing, err := os.Open(filepath.Join(m.backing, "ckpt"))
			if err != nil {
				t.Fatal(err)
			}
			defer backing.Close()
			for _, w := range []struct {
				name             string
				leaseOff, offset int64
				n                int64
			}{
				{"aligned", 0, 0, 1 << 20},
				{"unaligned head and tail", 100, 4096 + 100, 1<<20 + 5000},
				{"extends the file", 0, 3<<20 - 4096, 2 << 20},
			} {
				// The reader reads the old bytes through the mount (cached).
				if err := readsAs(f, want); err != nil {
					t.Fatalf("%s: before the WRITE: %v", w.name, err)
				}
				if err := cl.Write(ctx, f, l, w.leaseOff, w.offset, w.n, false); err != nil {
					t.Fatalf("%s: WRITE: %v", w.name, err)
				}
				if end := w.offset + w.n; end > int64(len(want)) {
					want = append(want, make([]byte, end-int64(len(want)))...)
				}
				copy(want[w.offset:], buf[w.leaseOff:w.leaseOff+w.n])
				start := (w.offset + 4095) &^ 4095
				body := (w.offset+w.n)&^4095 - start
				if c, ok := pagecache.Cached(backing, start, body); ok && c != 0 {
					t.Errorf("%s: %d of the %d body bytes are in the backing file's page cache: the WRITE did not go around it", w.name, c, body)
				}
				if err := readsAs(f, want); err != nil {
					t.Errorf("%s: the reader, after the WRITE: %v", w.name, err)
				}
				g, err := os.Open(p)
				if err != nil {
					t.Fatal(err)
				}
				if err := readsAs(g, want); err != nil {
					t.Errorf("%s: a new reader: %v", w.name, err)
				}
				g.Close()
				if err := readsAs(backing, want); err != nil {
					t.Errorf("%s: the backing file: %v", w.name, err)
				}
			}
			if err := cl.Release(ctx, l.ID); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// readsAs reads all of f from offset 0 and compares it with want.
func readsAs(f *os.File, want []byte) error {
	got := make([]byte, len(want)+4096)
	n, err := f.ReadAt(got, 0)
	if n != len(want) {
		return fmt.Errorf("%s reads %d bytes, want %d (%v)", f.Name(), n, len(want), err)
	}
	for i := range want {
		if got[i] != want[i] {
			return fmt.Errorf("%s differs from the oracle from offset %d", f.Name(), i)
		}
	}
	return nil
}
