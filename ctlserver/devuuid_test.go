package ctlserver

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// twoGPUs stands in for the CUDA backend of a daemon with two devices;
// these tests only ask the server what it publishes, never for memory.
type twoGPUs struct{}

func (twoGPUs) Name() string { return "cuda" }
func (twoGPUs) Devices() int { return 2 }
func (twoGPUs) Alloc(context.Context, int, int64, uint32) (gpubuf.Memory, error) {
	return nil, errors.New("twoGPUs: no memory in this test")
}

// gpuServer is a Server over a two-device pool publishing uuids.
func gpuServer(t *testing.T, be gpubuf.Backend, uuids []string) *Server {
	t.Helper()
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: be, SlabBytes: 1 << 20, BudgetBytes: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	srv, err := NewServer(Options{Pool: pool, Engines: fixedEngine{cufile.NewHostEngine(cufile.Options{})}, Engine: "posix", DeviceUUIDs: uuids})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

// TestDeviceUUIDsPublished: a daemon that knows its GPUs' UUIDs says so in
// HELLO (CapDeviceUUIDs) and names them per device in STATUS, which is how
// a client whose CUDA_VISIBLE_DEVICES differs from the daemon's finds the
// daemon's ordinal of its own GPU; one that does not know them publishes
// neither, and clients keep using ordinals as they are.
func TestDeviceUUIDsPublished(t *testing.T) {
	uuids := []string{"GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba98", "GPU-ffffffff-0000-1111-2222-333333333333"}
	tests := []struct {
		name  string
		uuids []string
		want  []string // pool.devices[i].uuid; nil: no uuid fields, no cap
	}{
		{"known", uuids, uuids},
		{"unknown (an old driver)", nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := gpuServer(t, twoGPUs{}, tc.uuids)
			c := fs.Caller{UID: 1000, GID: 1000, PID: 1}
			sess, errno := srv.OpenSession(context.Background(), c)
			if errno != 0 {
				t.Fatal(errno)
			}
			cl, err := ctl.NewTransportClient(context.Background(), &inproc{srv: srv, sess: sess, caller: c}, ctl.Token{})
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			h := cl.Hello()
			if h.Devices != 2 || h.Caps&ctl.CapCUDASlabs == 0 {
				t.Fatalf("HELLO devices %d caps %#x, want 2 CUDA devices", h.Devices, h.Caps)
			}
			if got := h.Caps&ctl.CapDeviceUUIDs != 0; got != (tc.want != nil) {
				t.Errorf("HELLO CapDeviceUUIDs = %v, want %v", got, tc.want != nil)
			}
			doc, err := cl.Status(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			var st struct {
				Pool struct {
					Devices []map[string]any `json:"devices"`
				} `json:"pool"`
			}
			if err := json.Unmarshal(doc, &st); err != nil {
				t.Fatal(err)
			}
			if len(st.Pool.Devices) != 2 {
				t.Fatalf("STATUS pool.devices = %v, want 2 devices", st.Pool.Devices)
			}
			for i, d := range st.Pool.Devices {
				u, has := d["uuid"]
				if tc.want == nil {
					if has {
						t.Errorf("device %d: uuid %v published by a daemon that does not know it", i, u)
					}
					continue
				}
				if d["device"] != float64(i) || u != tc.want[i] {
					t.Errorf("STATUS pool.devices[%d] = device %v uuid %v, want device %d uuid %s", i, d["device"], u, i, tc.want[i])
				}
			}
		})
	}
}

// TestDeviceUUIDsNotForHostMemory: host slabs (wire device -1) have no
// GPU, so a host-memory daemon announces no UUIDs whatever it is given.
func TestDeviceUUIDsNotForHostMemory(t *testing.T) {
	e := newEnv(t, envOptions{})
	if e.srv.caps()&ctl.CapDeviceUUIDs != 0 {
		t.Fatal("a host-memory daemon announces CapDeviceUUIDs")
	}
	srv := gpuServer(t, twoGPUs{}, nil)
	srv.host = true // as NewServer sets it for the host backend
	srv.opts.DeviceUUIDs = []string{"GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba98"}
	if srv.caps()&ctl.CapDeviceUUIDs != 0 {
		t.Error("host memory announced with device UUIDs")
	}
}

// TestDeviceUUIDsValidate: a UUID list that does not match the pool's
// devices is a wiring bug, reported by NewServer rather than published.
func TestDeviceUUIDsValidate(t *testing.T) {
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: twoGPUs{}, SlabBytes: 1 << 20, BudgetBytes: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	_, err = NewServer(Options{Pool: pool, Engines: fixedEngine{cufile.NewHostEngine(cufile.Options{})}, DeviceUUIDs: []string{"GPU-x"}})
	if err == nil || !strings.Contains(err.Error(), "DeviceUUIDs has 1 UUIDs, the pool has 2 devices") {
		t.Fatalf("NewServer with 1 UUID for 2 devices: %v", err)
	}
}
