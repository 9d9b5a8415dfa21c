package integration

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
)

// TestIndexColumnsThroughMount: through a real mount, a tar's INDEX in the
// columns form decodes to the JSON INDEX serves without the flag, at the
// same file version, in fewer bytes; a client that never asks keeps the
// JSON.
func TestIndexColumnsThroughMount(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true})
	ctx := context.Background()
	cl := openSession(t, m.mnt)
	if cl.Hello().Caps&ctl.CapIndexColumns == 0 {
		t.Fatal("the daemon does not advertise INDEX_COLUMNS")
	}
	p := filepath.Join(m.mnt, "cols.tar")
	indexTar(t, p, 3000) // several INDEX pages of JSON
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	js, v1, err := cl.IndexVersion(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	cols, form, v2, err := cl.IndexColumns(ctx, f)
	if err != nil || form != ctl.IndexFormTarColumns || v2 != v1 {
		t.Fatalf("IndexColumns: form %d, version %d (JSON's %d): %v", form, v2, v1, err)
	}
	x, err := cache.DecodeTarColumns(cols)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := x.JSON(); string(got) != string(js) {
		t.Fatalf("the columns decode to another document than INDEX's JSON (%d vs %d bytes)", len(got), len(js))
	}
	if len(cols) >= len(js)/2 || len(js) <= ctl.PageBytes {
		t.Fatalf("columns %d bytes, JSON %d", len(cols), len(js))
	}
}
