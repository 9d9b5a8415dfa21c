package integration

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
)

// saveCheckpoint writes data as name the way checkpoint writers do:
// a temporary file, fsync, rename over the previous one. On failure it
// removes the temporary file and returns the error.
func saveCheckpoint(dir, name string, write func(f *os.File) error) (err error) {
	tmp := filepath.Join(dir, name+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			if rerr := os.Remove(tmp); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}
	}()
	if err := write(f); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, name))
}

// TestFaultDiskFullCheckpoint: the backing filesystem (an 8 MiB tmpfs)
// fills up during a checkpoint save, through plain writes and through the
// control path's WRITE. Both report ENOSPC, the previous checkpoint is
// intact, the space comes back, the daemon serves on and a save that fits
// succeeds.
func TestFaultDiskFullCheckpoint(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	if err := syscall.Mount("gdsfs-diskfull", backing, "tmpfs", 0, "size=8m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(backing, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "64MiB", "--slab-size", "16MiB")
	ckpt := "model.ckpt"
	v1 := genBytes(1, 0, 3<<20+77)
	if err := saveCheckpoint(mnt, ckpt, func(f *os.File) error { _, err := f.Write(v1); return err }); err != nil {
		t.Fatalf("first checkpoint: %v", err)
	}
	var before syscall.Statfs_t
	if err := syscall.Statfs(backing, &before); err != nil {
		t.Fatal(err)
	}
	checkV1 := func(when string) {
		t.Helper()
		got, err := os.ReadFile(filepath.Join(mnt, ckpt))
		if err != nil {
			t.Fatalf("%s: read checkpoint: %v", when, err)
		}
		if !bytes.Equal(got, v1) {
			t.Fatalf("%s: the previous checkpoint changed (%d bytes, want %d)", when, len(got), len(v1))
		}
	}

	// Plain writes (torch.save through the mount).
	big := genBytes(2, 0, 6<<20)
	err := saveCheckpoint(mnt, ckpt, func(f *os.File) error { _, err := f.Write(big); return err })
	if !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("save of a checkpoint that does not fit, by write(2): %v, want ENOSPC", err)
	}
	checkV1("after ENOSPC from write(2)")

	// The control path: lease bytes WRITE into the file.
	ctx := context.Background()
	cl := openSession(t, mnt)
	l, err := cl.Alloc(ctx, ctl.HostDevice, int64(len(big)))
	if err != nil {
		t.Fatal(err)
	}
	b, err := cl.Bytes(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	copy(b, big)
	err = saveCheckpoint(mnt, ckpt, func(f *os.File) error { return cl.Write(ctx, f, l, 0, 0, int64(len(big)), true) })
	if !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("save of a checkpoint that does not fit, by WRITE: %v, want ENOSPC", err)
	}
	checkV1("after ENOSPC from WRITE")
	if err := cl.Release(ctx, l.ID); err != nil {
		t.Fatal(err)
	}

	var after syscall.Statfs_t
	if err := syscall.Statfs(backing, &after); err != nil {
		t.Fatal(err)
	}
	if after.Bfree != before.Bfree {
		t.Errorf("free blocks %d after the failed saves, %d before: space not given back", after.Bfree, before.Bfree)
	}

	// A save that fits succeeds, by both paths.
	v2 := genBytes(3, 0, 2<<20+1)
	l2, err := cl.Alloc(ctx, ctl.HostDevice, int64(len(v2)))
	if err != nil {
		t.Fatal(err)
	}
	b2, err := cl.Bytes(ctx, l2)
	if err != nil {
		t.Fatal(err)
	}
	copy(b2, v2)
	if err := saveCheckpoint(mnt, ckpt, func(f *os.File) error { return cl.Write(ctx, f, l2, 0, 0, int64(len(v2)), true) }); err != nil {
		t.Fatalf("save that fits, by WRITE: %v", err)
	}
	if err := cl.Release(ctx, l2.ID); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(mnt, ckpt))
	if err != nil || !bytes.Equal(got, v2) {
		t.Fatalf("checkpoint after a good save: %d bytes, %v; want the new %d bytes", len(got), err, len(v2))
	}
	cl.Close()
	s := d.mustScrape()
	enospc := s.Sum("gdsfs_control_errors_total", "errno", "ENOSPC")
	if enospc != 1 {
		t.Errorf("daemon counted %v ENOSPC control-path errors, want 1", enospc)
	}
	if _, err := d.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20, pipeFDs: 1 << 20}); err != nil {
		t.Error(err)
	}
	t.Logf("disk full: write(2) and WRITE both reported ENOSPC, the previous %d-byte checkpoint stayed intact, %d free blocks back, the next save succeeded", len(v1), after.Bfree)
}
