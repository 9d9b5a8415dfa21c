package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

// opCounter counts the FUSE requests the daemon serves, by operation.
type opCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *opCounter) ObserveFUSE(op string, d time.Duration, errno syscall.Errno) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[op]++
}

func (c *opCounter) AddBytes(engine, direction string, n int64) {}

// take returns the counts so far and starts again from zero.
func (c *opCounter) take() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.n
	c.n = map[string]int{}
	return n
}

// TestRequestsPerAccess counts the synchronous requests that common
// accesses to files the mount has not seen send to the daemon: each is a
// round trip the caller waits for (RELEASE is asynchronous and not
// counted). A data loader's sample (open, fstat, read, close of a
// read-only file) waits for one FLUSH besides its LOOKUP and OPEN: the
// close of any descriptor releases the process's POSIX locks on the file,
// read-only ones included, and FLUSH is how the daemon learns of it
// (posixlock.go); a file opened for writing has its FLUSH report the
// backing filesystem's write errors too. A listing answers the lookups of
// the stats that follow it (READDIRPLUS).
func TestRequestsPerAccess(t *testing.T) {
	obs := &opCounter{n: map[string]int{}}
	// Long timeouts: no entry expires while a case runs on a slow box
	// (an expired one adds a LOOKUP).
	mnt, backing, _ := testMountWith(t, Options{Observer: obs, EntryTimeout: time.Hour, AttrTimeout: time.Hour})
	const files = 20
	cases := []struct {
		name   string
		access func(dir string) error
		want   map[string]int // per file
	}{
		{"read-only open, fstat, read, close", func(p string) error {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := f.Stat(); err != nil {
				return err
			}
			_, err = f.Read(make([]byte, 16))
			if err != nil {
				return err
			}
			return f.Close()
		}, map[string]int{"Lookup": 1, "Open": 1, "Flush": 1}},
		{"write open, write, close", func(p string) error {
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := f.Write([]byte("y")); err != nil {
				return err
			}
			return f.Close()
		}, map[string]int{"Lookup": 1, "Open": 1, "Flush": 1}},
		{"lstat", func(p string) error {
			var st syscall.Stat_t
			return syscall.Lstat(p, &st)
		}, map[string]int{"Lookup": 1}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sub := fmt.Sprintf("d%d", i)
			if err := os.Mkdir(filepath.Join(backing, sub), 0o755); err != nil {
				t.Fatal(err)
			}
			for j := range files {
				if err := os.WriteFile(filepath.Join(backing, sub, fmt.Sprintf("f%d", j)), []byte("x"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			var st syscall.Stat_t
			if err := syscall.Lstat(filepath.Join(mnt, sub), &st); err != nil {
				t.Fatal(err)
			}
			obs.take()
			for j := range files {
				if err := tc.access(filepath.Join(mnt, sub, fmt.Sprintf("f%d", j))); err != nil {
					t.Fatal(err)
				}
			}
			got := obs.take()
			for op, per := range tc.want {
				if got[op] != per*files {
					t.Errorf("%d files: %d %s requests, want %d (all requests: %v)", files, got[op], op, per*files, got)
				}
			}
		})
	}
	t.Run("listing primes the stats that follow", func(t *testing.T) {
		if err := os.Mkdir(filepath.Join(backing, "list"), 0o755); err != nil {
			t.Fatal(err)
		}
		for j := range files {
			if err := os.WriteFile(filepath.Join(backing, "list", fmt.Sprintf("f%d", j)), []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		es, err := os.ReadDir(filepath.Join(mnt, "list"))
		if err != nil {
			t.Fatal(err)
		}
		if len(es) != files {
			t.Fatalf("listed %d entries, want %d", len(es), files)
		}
		obs.take()
		var st syscall.Stat_t
		for _, e := range es {
			if err := syscall.Lstat(filepath.Join(mnt, "list", e.Name()), &st); err != nil {
				t.Fatal(err)
			}
		}
		if got := obs.take(); got["Lookup"] != 0 || got["GetAttr"] != 0 {
			t.Errorf("stats after a listing sent %v, want no Lookup or GetAttr (READDIRPLUS answers them)", got)
		}
	})
}
