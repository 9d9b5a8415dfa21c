package ctlserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// pathTarget is an xattr target whose opener opens p the way fs does for a
// node (read-only, not following a symlink at p, not blocking).
func pathTarget(p string, isRoot bool) fs.XattrTarget {
	return fs.XattrTarget{Path: p, IsRoot: isRoot, Open: func() (*os.File, error) {
		return os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
	}}
}

// TestWriteOnlyDescriptor: every request that reads a file needs a
// descriptor open for reading; WRITE needs one open for writing.
func TestWriteOnlyDescriptor(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	wo, _ := e.file("w.npy", 4096, os.O_WRONLY)
	// An indexable file: the index must not be served either.
	if _, err := wo.WriteAt(npyBytes(), 0); err != nil {
		t.Fatal(err)
	}
	cl := e.client(1000, ctl.Token{})
	if _, err := cl.Read(ctx, wo, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 100}}); !errors.Is(err, syscall.EBADF) {
		t.Errorf("READ through a write-only descriptor: %v, want EBADF", err)
	}
	if _, err := cl.ReadNames(ctx, wo, ctl.HostDevice, []string{"data"}); !errors.Is(err, syscall.EBADF) {
		t.Errorf("READ_NAMES through a write-only descriptor: %v, want EBADF", err)
	}
	if _, err := cl.Index(ctx, wo); !errors.Is(err, syscall.EBADF) {
		t.Errorf("INDEX through a write-only descriptor: %v, want EBADF", err)
	}
	ro, err := os.Open(wo.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if _, err := cl.Index(ctx, ro); err != nil {
		t.Errorf("INDEX through a read-only descriptor: %v", err)
	}
	l, err := cl.Alloc(ctx, ctl.HostDevice, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.Write(ctx, ro, l, 0, 0, 10, false); !errors.Is(err, syscall.EBADF) {
		t.Errorf("WRITE through a read-only descriptor: %v, want EBADF", err)
	}
	if err := cl.Write(ctx, wo, l, 0, 0, 10, false); err != nil {
		t.Errorf("WRITE through a write-only descriptor: %v", err)
	}
}

// npyBytes is a small valid .npy file (float32[2]).
func npyBytes() []byte {
	hdr := "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
	for (10+len(hdr)+1)%64 != 0 {
		hdr += " "
	}
	hdr += "\n"
	b := append([]byte("\x93NUMPY\x01\x00"), byte(len(hdr)), byte(len(hdr)>>8))
	b = append(b, hdr...)
	return append(b, make([]byte, 8)...)
}

// TestXattrNeverBlocks: a FIFO at a node's name is never opened for I/O
// (the daemon would block); info reports it, index has none.
func TestXattrNeverBlocks(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	p := filepath.Join(e.dir, "shard.tar")
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Fatal(err)
	}
	c := fs.Caller{UID: 1000}
	v, errno := e.srv.Xattr(ctx, c, pathTarget(p, false), "user.gdsfs.info")
	if errno != 0 {
		t.Fatalf("info of a FIFO: %v", errno)
	}
	var fi fileInfo
	if err := json.Unmarshal(v, &fi); err != nil || fi.Type != "other" {
		t.Errorf("info of a FIFO: %s, %v", v, err)
	}
	if _, errno := e.srv.Xattr(ctx, c, pathTarget(p, false), "user.gdsfs.index"); errno != syscall.ENODATA {
		t.Errorf("index of a FIFO: %v, want ENODATA", errno)
	}
	if _, errno := e.srv.Xattr(ctx, c, fs.XattrTarget{Path: p}, "user.gdsfs.index"); errno != syscall.ENODATA {
		t.Errorf("index without an opener: %v, want ENODATA", errno)
	}
}

// TestStatsOwnOnly: a non-root uid sees its own sessions and figures and
// everyone's totals; root sees every session.
func TestStatsOwnOnly(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	for _, uid := range []uint32{1001, 1002} {
		cl := e.client(uid, ctl.Token{})
		if _, err := cl.Alloc(ctx, ctl.HostDevice, 4096); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		uid          uint32
		wantSessions int
	}{{1001, 1}, {1002, 1}, {0, 2}, {1003, 0}} {
		doc, errno := e.srv.Xattr(ctx, fs.Caller{UID: tc.uid}, pathTarget(e.dir, true), "user.gdsfs.stats")
		if errno != 0 {
			t.Fatal(errno)
		}
		var st Stats
		if err := json.Unmarshal(doc, &st); err != nil {
			t.Fatal(err)
		}
		if len(st.Pool.Sessions) != tc.wantSessions {
			t.Errorf("uid %d sees %d sessions, want %d: %s", tc.uid, len(st.Pool.Sessions), tc.wantSessions, doc)
		}
		for _, s := range st.Pool.Sessions {
			if tc.uid != 0 && s.UID != tc.uid {
				t.Errorf("uid %d sees uid %d's session", tc.uid, s.UID)
			}
		}
		for _, u := range st.Pool.UIDs {
			if tc.uid != 0 && u.UID != tc.uid {
				t.Errorf("uid %d sees uid %d's figures", tc.uid, u.UID)
			}
		}
		if st.Sessions != 2 || st.Pool.Devices[0].LeasedBytes != 8192 {
			t.Errorf("uid %d: totals %d sessions, %d bytes leased; want 2 and 8192", tc.uid, st.Sessions, st.Pool.Devices[0].LeasedBytes)
		}
	}
	// STATUS on a session is filtered by the session's uid alike.
	cl := e.client(1003, ctl.Token{})
	doc, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var st Stats
	if err := json.Unmarshal(doc, &st); err != nil {
		t.Fatal(err)
	}
	for _, s := range st.Pool.Sessions {
		if s.UID != 1003 {
			t.Errorf("STATUS of uid 1003 shows uid %d's session", s.UID)
		}
	}
}

// busyIndexer answers every lookup with err.
type busyIndexer struct{ err error }

func (b busyIndexer) Get(context.Context, string, *os.File) (*cache.Index, error) { return nil, b.err }
func (b busyIndexer) Invalidate(string)                                           {}

// TestIndexBusy: a lookup that found no parse slot in time, or ran out of
// its deadline, is EAGAIN (retry), and user.gdsfs.info says so.
func TestIndexBusy(t *testing.T) {
	ctx := context.Background()
	for _, err := range []error{cache.ErrBusy, context.DeadlineExceeded} {
		e := newEnv(t, envOptions{})
		e.srv.opts.Indexes = busyIndexer{err: fmt.Errorf("test: %w", err)}
		f, _ := e.file("a.tar", 4096, os.O_RDONLY)
		cl := e.client(1000, ctl.Token{})
		if _, got := cl.Index(ctx, f); !errors.Is(got, syscall.EAGAIN) {
			t.Errorf("INDEX with %v: %v, want EAGAIN", err, got)
		}
		if _, got := cl.ReadNames(ctx, f, ctl.HostDevice, []string{"x"}); !errors.Is(got, syscall.EAGAIN) {
			t.Errorf("READ_NAMES with %v: %v, want EAGAIN", err, got)
		}
		v, errno := e.srv.Xattr(ctx, fs.Caller{UID: 1000}, pathTarget(f.Name(), false), "user.gdsfs.info")
		if errno != 0 || !strings.Contains(string(v), "index not ready") {
			t.Errorf("info with %v: %s, %v", err, v, errno)
		}
	}
}
