package tier

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// sealAlloc is a FuncAllocator over HostAllocator whose Seal records the
// bytes each extent holds when sealed (they must be the file's: sealed
// after the read) and can fail.
type sealAlloc struct {
	mu     sync.Mutex
	sealed map[*byte][]byte
	live   atomic.Int64
	fail   error
}

func (s *sealAlloc) allocator() FuncAllocator {
	return FuncAllocator{
		Kind: "sealed",
		New: func(n int64) ([]byte, error) {
			m, err := HostAllocator{}.Alloc(n)
			if err != nil {
				return nil, err
			}
			s.live.Add(1)
			return m.Bytes(), nil
		},
		Free: func(b []byte) error {
			s.live.Add(-1)
			return hostMemory(b).Close()
		},
		Seal: func(b []byte) error {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.fail != nil {
				return s.fail
			}
			s.sealed[&b[0]] = bytes.Clone(b)
			return nil
		},
	}
}

// TestSealAfterFill: memory that must be sealed (the pinned tier's,
// registered for DMA once filled) is sealed once per extent, after the
// read, before it serves a hit; a failed seal fails the pin, frees the
// extent and charges nothing.
func TestSealAfterFill(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail error
	}{{"sealed", nil}, {"seal fails", errors.New("no more pinnable memory")}} {
		t.Run(tc.name, func(t *testing.T) {
			s := &sealAlloc{sealed: map[*byte][]byte{}, fail: tc.fail}
			tr, err := New(Config{BudgetBytes: 1 << 20, ChunkBytes: 64 * kib, Alloc: s.allocator(), SettleTime: -1, Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			data, f := writeFile(t, t.TempDir(), "a", 150*kib+7, 3)
			res, err := tr.Pin(context.Background(), f, f.Name(), 1000, 0, -1)
			if tc.fail != nil {
				if err == nil || !strings.Contains(err.Error(), "no more pinnable memory") {
					t.Fatalf("pin with a failing seal: %+v, %v", res, err)
				}
				if st := tr.Stats(); st.UsedBytes != 0 || st.CachedBytes != 0 || s.live.Load() != 0 {
					t.Fatalf("after a failed seal: %+v, %d extents live", st, s.live.Load())
				}
				if _, ok := tr.Lookup(ident(t, f), [][2]int64{{0, 4096}}); ok {
					t.Fatal("an unsealed extent served a hit")
				}
				tr.Close()
				return
			}
			if err != nil || res.Cached != int64(len(data)) {
				t.Fatalf("pin: %+v, %v", res, err)
			}
			if len(s.sealed) != 3 {
				t.Fatalf("%d extents sealed, want 3", len(s.sealed))
			}
			var got []byte
			for i := range 3 {
				for _, b := range s.sealed {
					if bytes.Equal(b[:min(len(b), 16)], data[i*64*kib:i*64*kib+16]) {
						got = append(got, b[:min(int64(len(b)), int64(len(data))-int64(i)*64*kib)]...)
					}
				}
			}
			if !bytes.Equal(got, data) {
				t.Fatal("the extents sealed did not hold the file's bytes: sealed before the read")
			}
			checkInvariants(t, tr)
			tr.Close()
			if n := s.live.Load(); n != 0 {
				t.Fatalf("%d extents not freed after Close", n)
			}
		})
	}
}
