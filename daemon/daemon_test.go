package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/metrics"
)

// testConfig is a host-engine daemon over a fresh backing directory, its
// slab files under the test's own directory.
func testConfig(t *testing.T) Config {
	t.Helper()
	dir := t.TempDir()
	c := Config{
		Mountpoint:    filepath.Join(dir, "mnt"),
		Source:        filepath.Join(dir, "backing"),
		Engine:        cufile.Config{Engine: cufile.EngineHost, HostDir: filepath.Join(dir, "slabs")},
		SlabBytes:     1 << 20,
		HostPoolBytes: 16 << 20,
	}
	for _, d := range []string{c.Mountpoint, c.Source} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if testing.Verbose() {
		c.Log = zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)
	}
	return c
}

func requireMount(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root (CI runs as root)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse: install fuse3")
	}
}

// TestStartServesAndCloses: a daemon started from a Config serves the
// control path end to end (HELLO names its slab socket and version, a READ
// moves the file's bytes, the slab's descriptor comes over the socket,
// STATUS names the log file), records it in the metrics served over HTTP,
// and Close after the unmount leaves no slab directory behind.
func TestStartServesAndCloses(t *testing.T) {
	requireMount(t)
	c := testConfig(t)
	c.MetricsAddr = "127.0.0.1:0"
	c.LogFile = "/var/log/gdsfs/test.log"
	data := bytes.Repeat([]byte("gdsfs daemon "), 1000)
	if err := os.WriteFile(filepath.Join(c.Source, "f.bin"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	d, err := Start(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			d.Close()
		}
	})

	cl, err := ctl.OpenSession(c.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	if h := cl.Hello(); h.SlabSocket != d.SlabSocket() || h.SlabSocket == "" || h.DaemonVersion != Version || h.Engine != "host" {
		t.Errorf("HELLO %+v, want slab socket %q, version %q, engine host", h, d.SlabSocket(), Version)
	}
	f, err := os.Open(filepath.Join(c.Mountpoint, "f.bin"))
	if err != nil {
		t.Fatal(err)
	}
	ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 1, Length: 8000}})
	if err != nil {
		t.Fatal(err)
	}
	sf, rep, err := cl.SlabFD(ctx, ls[0].Slab)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, ls[0].Valid)
	_, err = sf.ReadAt(got, int64(ls[0].Offset))
	sf.Close()
	if err != nil || !bytes.Equal(got, data[1:8001]) || rep.Slab != ls[0].Slab {
		t.Fatalf("bytes through the slab socket's descriptor differ (%v, reply %+v)", err, rep)
	}
	doc, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var st ctlserver.Stats
	if err := json.Unmarshal(doc, &st); err != nil || st.LogFile != c.LogFile || st.Version != Version {
		t.Errorf("STATUS log file %q version %q (%v), want %q %q", st.LogFile, st.Version, err, c.LogFile, Version)
	}
	if err := cl.Release(ctx, ls[0].ID); err != nil {
		t.Fatal(err)
	}
	f.Close()
	cl.Close()

	resp, err := http.Get("http://" + d.MetricsAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := metrics.ParseText(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"gdsfs_control_requests_total", []string{"command", "READ"}, 1},
		{"gdsfs_bytes_total", []string{"engine", "host", "direction", "read"}, 8192}, // [1, 8001) widened to 4 KiB
	} {
		if got, _ := snap.Get(s.name, s.labels...); got != s.want {
			t.Errorf("%s = %v, want %v", metrics.Series(s.name, s.labels...), got, s.want)
		}
	}

	if err := d.Unmount(); err != nil {
		t.Fatal(err)
	}
	d.Wait()
	closed = true
	if err := d.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := os.Stat(c.Engine.HostDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("slab directory %s after Close: %v, want it removed", c.Engine.HostDir, err)
	}
	if _, err := http.Get("http://" + d.MetricsAddr() + "/metrics"); err == nil {
		t.Error("metrics still served after Close")
	}
	if err := d.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestCloseUnmounts: Close of a daemon still mounted unmounts it first.
func TestCloseUnmounts(t *testing.T) {
	requireMount(t)
	c := testConfig(t)
	d, err := Start(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(c.Mountpoint, ctl.ControlName)); err != nil {
		t.Fatalf("no control file while mounted: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(c.Mountpoint, ctl.ControlName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("control file after Close: %v, want the mount gone", err)
	}
}

// TestStartFails: a Start that fails part way says why (a *ConfigError
// naming the flag when the configuration is at fault) and undoes what it
// built: the engines' slab directory is gone, nothing is mounted.
func TestStartFails(t *testing.T) {
	for _, tc := range []struct {
		name   string
		set    func(*Config)
		config bool   // a *ConfigError
		want   string // in the message
	}{
		{"bad metrics address", func(c *Config) { c.MetricsAddr = "nope" }, true, "--metrics-addr \"nope\""},
		// After the engines, the pool and the indexes were built.
		{"slab socket in a missing directory", func(c *Config) { c.SlabSocket = filepath.Join(c.Source, "no", "sock") }, true, "--slab-socket"},
		{"invalid config", func(c *Config) { c.SlabBytes = 1000 }, true, "SlabBytes (1000)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := testConfig(t)
			tc.set(&c)
			d, err := Start(context.Background(), c)
			if err == nil {
				d.Close()
				t.Fatal("Start succeeded")
			}
			var ce *ConfigError
			if errors.As(err, &ce) != tc.config || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q (ConfigError %v), want one naming %q (ConfigError %v)", err, errors.As(err, &ce), tc.want, tc.config)
			}
			if _, err := os.Stat(c.Engine.HostDir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("slab directory after a failed Start: %v, want none", err)
			}
			ents, err := os.ReadDir(c.Mountpoint)
			if err != nil || len(ents) != 0 {
				t.Errorf("mountpoint after a failed Start: %v entries, %v; want an empty directory", len(ents), err)
			}
		})
	}
}
