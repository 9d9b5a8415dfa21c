package ctlserver

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
)

// TestBytesRefusesLeasesNotHeld: no Client API reads the bytes of a lease
// the client does not hold. After its release, the daemon hands the same
// memory to the next read (here: of another file), so Bytes on the old
// Lease would return that file's bytes.
func TestBytesRefusesLeasesNotHeld(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// lose makes l unusable for cl and may return another client's
		// view of the same memory (nil: none).
		lose func(t *testing.T, e *testEnv, cl *ctl.Client, l ctl.Lease)
	}{
		{"released", func(t *testing.T, e *testEnv, cl *ctl.Client, l ctl.Lease) {
			if err := cl.Release(ctx, l.ID); err != nil {
				t.Fatal(err)
			}
		}},
		{"released twice", func(t *testing.T, e *testEnv, cl *ctl.Client, l ctl.Lease) {
			if err := cl.Release(ctx, l.ID); err != nil {
				t.Fatal(err)
			}
			if err := cl.Release(ctx, l.ID); err == nil {
				t.Error("second release of a lease: no error")
			}
		}},
		{"client closed", func(t *testing.T, e *testEnv, cl *ctl.Client, l ctl.Lease) {
			if err := cl.Close(); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{slabBytes: 1 << 20})
			cl := e.client(1000, ctl.Token{})
			f, data := e.file("a", 9000, os.O_RDONLY)
			ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 9000}})
			if err != nil {
				t.Fatal(err)
			}
			l := ls[0]
			if got, err := cl.Bytes(ctx, l); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("held lease: %v (bytes equal: %v)", err, bytes.Equal(got, data))
			}
			tc.lose(t, e, cl, l)
			// Another reader of the same uid gets the memory.
			other := e.client(1000, ctl.Token{})
			g, _ := e.file("b", 9000, os.O_RDONLY)
			if _, err := other.Read(ctx, g, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 9000}}); err != nil {
				t.Fatal(err)
			}
			got, err := cl.Bytes(ctx, l)
			if !errors.Is(err, ctl.ErrLeaseNotHeld) {
				t.Fatalf("Bytes of a lease no longer held: %d bytes, err %v; want ErrLeaseNotHeld", len(got), err)
			}
		})
	}
}

// TestBytesRefusesForgedLeases: a Lease value is usable only as the daemon
// handed it out; ids of another client's session are refused until
// adopted, and adoption of the session's own leases (read by a worker
// with the token) serves them.
func TestBytesRefusesForgedLeases(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, envOptions{slabBytes: 1 << 20})
	owner := e.client(1000, ctl.Token{})
	f, data := e.file("a", 20000, os.O_RDONLY)
	ls, err := owner.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 8192}, {Offset: 8192, Length: 8192}})
	if err != nil {
		t.Fatal(err)
	}
	wider := ls[0]
	wider.Valid += 8192 // would reach into the next lease
	moved := ls[0]
	moved.Offset += 4096
	for name, l := range map[string]ctl.Lease{"wider": wider, "moved": moved, "unknown id": {ID: ls[1].ID + 100, Slab: ls[1].Slab, Valid: 1}} {
		if _, err := owner.Bytes(ctx, l); !errors.Is(err, ctl.ErrLeaseNotHeld) {
			t.Errorf("%s lease: %v, want ErrLeaseNotHeld", name, err)
		}
	}

	worker := e.client(1000, owner.Token())
	wl, err := worker.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 100, Length: 5000}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Bytes(ctx, wl[0]); !errors.Is(err, ctl.ErrLeaseNotHeld) {
		t.Errorf("a worker's lease before Adopt: %v, want ErrLeaseNotHeld", err)
	}
	owner.Adopt(wl...)
	got, err := owner.Bytes(ctx, wl[0])
	if err != nil || !bytes.Equal(got, data[100:5100]) {
		t.Fatalf("adopted lease: %v (bytes equal: %v)", err, bytes.Equal(got, data[100:5100]))
	}
	if err := owner.Release(ctx, wl[0].ID, ls[0].ID, ls[1].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Bytes(ctx, wl[0]); !errors.Is(err, ctl.ErrLeaseNotHeld) {
		t.Errorf("adopted lease after release: %v, want ErrLeaseNotHeld", err)
	}
	e.checkIdle()
}
