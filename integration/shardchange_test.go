package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
)

// TestReadVersionThroughMount: through a real mount, a READ at INDEX's
// version is served while the shard is unchanged and is ESTALE once the
// shard was rewritten in place, through the mount and behind it (the
// daemon checks the backing file, not the kernel's cached attributes);
// the descriptor's new INDEX names a new version that reads again.
func TestReadVersionThroughMount(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true})
	ctx := context.Background()
	cl := openSession(t, m.mnt)
	if cl.Hello().Caps&ctl.CapReadVersion == 0 {
		t.Fatal("the daemon does not advertise READ_VERSION")
	}
	for i, where := range []string{m.mnt, m.backing} {
		name := filepath.Base(where) + ".tar"
		indexTar(t, filepath.Join(m.mnt, name), 20)
		old := time.Now().Add(-time.Hour)
		if err := os.Chtimes(filepath.Join(m.backing, name), old, old); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(filepath.Join(m.mnt, name))
		if err != nil {
			t.Fatal(err)
		}
		_, v1, err := cl.IndexVersion(ctx, f)
		if err != nil || v1 == 0 {
			t.Fatalf("%s: IndexVersion: %d, %v", where, v1, err)
		}
		ranges := []ctl.Range{{Offset: 512, Length: 100}}
		ls, err := cl.ReadVersion(ctx, f, ctl.HostDevice, v1, ranges)
		if err != nil {
			t.Fatalf("%s: READ at the index's version: %v", where, err)
		}
		if err := cl.Release(ctx, ls[0].ID); err != nil {
			t.Fatal(err)
		}
		// Relaid in place: the same bytes shifted by one 512-byte block.
		data, err := os.ReadFile(filepath.Join(m.backing, name))
		if err != nil {
			t.Fatal(err)
		}
		g, err := os.OpenFile(filepath.Join(where, name), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := g.WriteAt(append(bytes.Repeat([]byte{0}, 512), data[:len(data)-512]...), 0); err != nil {
			t.Fatal(err)
		}
		if err := g.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := cl.ReadVersion(ctx, f, ctl.HostDevice, v1, ranges); !errors.Is(err, syscall.ESTALE) {
			t.Fatalf("%s (%d): READ at the old version after a rewrite: %v, want ESTALE", where, i, err)
		}
		f.Close()
	}
	doc, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Leases int `json:"leases"`
	}
	if err := json.Unmarshal(doc, &st); err != nil || st.Leases != 0 {
		t.Fatalf("%d leases held after the refused READs (%v)", st.Leases, err)
	}
}
