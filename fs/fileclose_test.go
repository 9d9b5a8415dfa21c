package fs

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// closingControl is a fakeControl that is told when an open it served a
// FileIoctl of is released.
type closingControl struct {
	*fakeControl
	seen   chan *os.File
	closed chan *os.File
}

func (c *closingControl) FileIoctl(ctx context.Context, caller Caller, f *os.File, path string, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	if f != nil {
		c.seen <- f
	}
	return c.fakeControl.FileIoctl(ctx, caller, f, path, cmd, in, out)
}

func (c *closingControl) FileClosed(f *os.File) { c.closed <- f }

// TestFileClosedOnRelease: the FUSE release of an open tells the Control
// which of its files (FileIoctl's f) is closed, so per-open state (the
// daemon's readahead streams) goes with it.
func TestFileClosedOnRelease(t *testing.T) {
	ctl := &closingControl{fakeControl: newFakeControl(), seen: make(chan *os.File, 4), closed: make(chan *os.File, 4)}
	mnt, backing, _ := testMount(t, ctl)
	if err := os.WriteFile(filepath.Join(backing, "shard.tar"), []byte("contents"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(mnt, "shard.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ioctl(f.Fd(), iowr(2, 16), make([]byte, 16)); err != nil {
		t.Fatal(err)
	}
	served := <-ctl.seen
	f.Close()
	select { // the release follows the close
	case got := <-ctl.closed:
		if got != served {
			t.Errorf("FileClosed(%p), want FileIoctl's file %p", got, served)
		}
	case <-time.After(30 * time.Second): // a guard, not a measure: a release comes at once
		t.Fatal("no FileClosed after the open was closed")
	}
}
