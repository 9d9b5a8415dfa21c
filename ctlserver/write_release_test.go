package ctlserver

import (
	"context"
	"errors"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// blockingWriter blocks every WriteAt until release is closed.
type blockingWriter struct {
	cufile.Engine
	entered chan struct{}
	release chan struct{}
}

func (b *blockingWriter) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	b.entered <- struct{}{}
	<-b.release
	return b.Engine.WriteAt(ctx, f, src, srcOff, fileOff, n)
}

// A RELEASE waits for the WRITEs in flight from the leases it releases,
// and only those: releasing one lease of a session while another lease of
// it is being written (a checkpoint's data files written in parallel, one
// done before the others) neither waits for that write nor holds back the
// session's next WRITE; releasing the lease under the write waits for it,
// so its memory never goes back to the pool while the engine reads it.
func TestReleaseWaitsOnlyForWritesOfItsLeases(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20})
	bw := &blockingWriter{Engine: cufile.NewHostEngine(cufile.Options{}), entered: make(chan struct{}, 2), release: make(chan struct{})}
	e.srv.opts.Engines = fixedEngine{bw}
	cl := e.client(1000, ctl.Token{})
	ctx := context.Background()
	f, _ := e.file("ckpt", 0, os.O_RDWR)
	var ls []ctl.Lease
	for range 3 {
		l, err := cl.Alloc(ctx, ctl.HostDevice, 8192)
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
	}
	writing, other, next := ls[0], ls[1], ls[2]
	wrote := make(chan error, 1)
	go func() { wrote <- cl.Write(ctx, f, writing, 0, 0, 8192, false) }()
	<-bw.entered // the WRITE of lease 0 is in the engine, and stays there

	// Liveness, not timing: each step below returns at once when right; the
	// deadline only turns a hang into a failure.
	stuck := func(ch <-chan error, what string) {
		t.Helper()
		select {
		case err := <-ch:
			if err != nil {
				t.Errorf("%s: %v", what, err)
			}
		case <-time.After(30 * time.Second):
			close(bw.release)
			t.Fatalf("%s waited for another lease's WRITE", what)
		}
	}
	releasedOther := make(chan error, 1)
	go func() { releasedOther <- cl.Release(ctx, other.ID) }()
	stuck(releasedOther, "RELEASE of a lease no WRITE uses")
	// The session's next WRITE starts (reaches the engine) while the first is still in flight.
	wrote2 := make(chan error, 1)
	go func() { wrote2 <- cl.Write(ctx, f, next, 0, 8192, 8192, false) }()
	entered := make(chan error, 1)
	go func() { <-bw.entered; entered <- nil }()
	stuck(entered, "the next WRITE")

	released := make(chan error, 1)
	go func() { released <- cl.Release(ctx, writing.ID) }()
	for range 1000 {
		runtime.Gosched() // give RELEASE every chance to run ahead
	}
	select {
	case err := <-released:
		t.Fatalf("RELEASE of a lease under a WRITE returned (%v) before the WRITE", err)
	default:
	}
	if n, _ := e.leased(); n != 2 {
		t.Errorf("pool holds %d leases during the writes, want 2 (the other one released, none under a write)", n)
	}
	close(bw.release)
	for _, ch := range []chan error{wrote, wrote2, released} {
		if err := <-ch; err != nil {
			t.Error(err)
		}
	}
	if err := cl.Write(ctx, f, writing, 0, 0, 1, false); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("WRITE from a released lease: %v, want ENOENT", err)
	}
	if err := cl.Release(ctx, next.ID); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.leased(); n != 0 {
		t.Errorf("pool holds %d leases after every release", n)
	}
}
