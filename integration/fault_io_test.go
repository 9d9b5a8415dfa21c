package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// faultyEngines serves every file with the engine the daemon chose, except
// that transfers of files whose name contains "bad" fail with EIO after
// moving part of the bytes, as a disk with a bad sector does.
type faultyEngines struct{ ch ctlserver.EngineChooser }

func (f faultyEngines) Choose(file *os.File, path string, off, n int64) (cufile.Engine, string) {
	e, why := f.ch.Choose(file, path, off, n)
	if strings.Contains(filepath.Base(path), "bad") {
		return faultyEngine{e}, "test: fails with EIO"
	}
	return e, why
}

type faultyEngine struct{ cufile.Engine }

func (e faultyEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	half, err := e.Engine.ReadAt(ctx, f, dst, dstOff, fileOff, n/2)
	if err != nil {
		return half, err
	}
	return half, fmt.Errorf("read %s at %d: %w", f.Name(), fileOff+half, syscall.EIO)
}

func (e faultyEngine) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	return 0, fmt.Errorf("write %s at %d: %w", f.Name(), fileOff, syscall.EIO)
}

// TestFaultBackingIOError: a backing file whose transfers fail. Each
// request on it fails with EIO and holds no lease afterwards; the daemon
// and concurrent requests on good files carry on, byte-exact; the errors
// are counted by errno.
func TestFaultBackingIOError(t *testing.T) {
	requireRoot(t)
	tm := startMount(t, mountOpts{Daemon: true, Config: func(c *daemon.Config) {
		c.SlabBytes, c.HostPoolBytes, c.MetaCacheBytes = 8<<20, 128<<20, 16<<20
		c.MetricsAddr = "127.0.0.1:0" // the metrics the errors are counted in
		c.WrapEngines = func(ch ctlserver.EngineChooser) ctlserver.EngineChooser { return faultyEngines{ch} }
	}})
	d, mnt, backing := tm.d, tm.mnt, tm.backing
	m, pool := d.Metrics(), d.Pool()
	good := genBytes(7, 0, 3<<20+5)
	writeFile(t, filepath.Join(backing, "good.bin"), good)
	writeFile(t, filepath.Join(backing, "bad.bin"), genBytes(8, 0, 3<<20))

	ctx := context.Background()
	var goodReads, badReads atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl, err := ctl.OpenSession(mnt)
			if err != nil {
				errs <- err
				return
			}
			defer cl.Close()
			f, err := os.Open(filepath.Join(mnt, "good.bin"))
			if err != nil {
				errs <- err
				return
			}
			defer f.Close()
			for {
				select {
				case <-stop:
					return
				default:
				}
				ranges := []ctl.Range{{Offset: 0, Length: uint64(len(good))}, {Offset: 12345, Length: 1 << 20}}
				ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
				if err == nil {
					err = verifyLeases(ctx, cl, ranges, ls, good)
					var ids []uint64
					for _, l := range ls {
						ids = append(ids, l.ID)
					}
					if rerr := cl.Release(ctx, ids...); err == nil {
						err = rerr
					}
				}
				if err != nil {
					errs <- fmt.Errorf("good file: %w", err)
					return
				}
				goodReads.Add(1)
			}
		}()
	}

	cl := openSession(t, mnt)
	bad := openRO(t, filepath.Join(mnt, "bad.bin"))
	for range 50 {
		_, err := cl.Read(ctx, bad, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 1 << 20}, {Offset: 2 << 20, Length: 4096}})
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("READ of the failing file: %v, want EIO", err)
		}
		badReads.Add(1)
	}
	// The failing file's WRITE fails with EIO too, and the lease stays the
	// client's to release.
	wf, err := os.OpenFile(filepath.Join(mnt, "bad-out.bin"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer wf.Close()
	l, err := cl.Alloc(ctx, ctl.HostDevice, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.Write(ctx, wf, l, 0, 0, 8192, true); !errors.Is(err, syscall.EIO) {
		t.Errorf("WRITE to the failing file: %v, want EIO", err)
	}
	if err := cl.Release(ctx, l.ID); err != nil {
		t.Errorf("release after a failed WRITE: %v", err)
	}
	// The daemon still serves this very session after the failures.
	checkStillServes(t, cl, openRO(t, filepath.Join(mnt, "good.bin")), good)
	// Let the good readers do some work after the failures too.
	for after, deadline := goodReads.Load(), time.Now().Add(10*time.Second); goodReads.Load() < after+20 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if goodReads.Load() == 0 {
		t.Error("no good read completed alongside the failing ones")
	}
	if n, b := leasedOf(pool); n != 0 || b != 0 {
		t.Errorf("pool holds %d leases (%d bytes) after every reader released, want none: failed reads leaked", n, b)
	}
	s, err := m.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get("gdsfs_control_errors_total", "command", "READ", "errno", "EIO"); int64(got) != badReads.Load() {
		t.Errorf("gdsfs_control_errors_total{READ,EIO} = %v, want %d", got, badReads.Load())
	}
	if got, _ := s.Get("gdsfs_control_errors_total", "command", "WRITE", "errno", "EIO"); got != 1 {
		t.Errorf("gdsfs_control_errors_total{WRITE,EIO} = %v, want 1", got)
	}
	t.Logf("EIO injection: %d failing READs and 1 failing WRITE answered EIO while %d good READs stayed byte-exact; pool idle after", badReads.Load(), goodReads.Load())
}

func leasedOf(p *gpubuf.Pool) (int, int64) {
	var n int
	var b int64
	for _, d := range p.Stats().Devices {
		n += d.Leases
		b += d.LeasedBytes
	}
	return n, b
}
