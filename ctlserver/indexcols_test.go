package ctlserver

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// INDEX with IndexFlagColumns serves a tar's index as columns that decode
// to the JSON it serves without the flag, at the same file version; a file
// without a columns form gets its JSON (form 0); a page request with other
// flags, or STATUS with any, is EINVAL.
func TestIndexColumns(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 4 << 20})
	cl := e.client(1000, ctl.Token{})
	if cl.Hello().Caps&ctl.CapIndexColumns == 0 {
		t.Fatal("no CapIndexColumns with indexes")
	}
	ctx := context.Background()
	p := filepath.Join(e.dir, "s.tar")
	if err := os.WriteFile(p, tarOf(t, 1000, 20000, 3, 40000), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	js, version, err := cl.IndexVersion(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	cols, form, v2, err := cl.IndexColumns(ctx, f)
	if err != nil || form != ctl.IndexFormTarColumns || v2 != version {
		t.Fatalf("IndexColumns: form %d, version %d (JSON's %d), %v", form, v2, version, err)
	}
	x, err := cache.DecodeTarColumns(cols)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := x.JSON(); string(got) != string(js) {
		t.Fatalf("columns decode to\n%s\nnot INDEX's JSON\n%s", got, js)
	}

	st, err := os.ReadFile("../cache/testdata/model.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	q := filepath.Join(e.dir, "m.safetensors")
	if err := os.WriteFile(q, st, 0o644); err != nil {
		t.Fatal(err)
	}
	g, err := os.Open(q)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	njs, err := cl.Index(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	ncols, nform, _, err := cl.IndexColumns(ctx, g)
	if err != nil || nform != ctl.IndexFormJSON || string(ncols) != string(njs) {
		t.Fatalf("safetensors with the columns flag: form %d, %v; %q vs %q", nform, err, ncols, njs)
	}

	buf := make([]byte, ctl.SizePage)
	(&ctl.PageRequest{Flags: 2}).Encode(buf)
	if errno := e.rawFile(1000, f, ctl.CmdIndex, buf); errno != syscall.EINVAL {
		t.Fatalf("INDEX with flags 2: %v, want EINVAL", errno)
	}
	c := fs.Caller{UID: 1000, GID: 1000, PID: 1}
	sess, errno := e.srv.OpenSession(ctx, c)
	if errno != 0 {
		t.Fatal(errno)
	}
	defer sess.Close()
	(&ctl.PageRequest{Flags: ctl.IndexFlagColumns}).Encode(buf)
	if _, errno := sess.Ioctl(ctx, c, ctl.CmdStatus, buf, make([]byte, len(buf))); errno != syscall.EINVAL {
		t.Fatalf("STATUS with flags: %v, want EINVAL", errno)
	}
	(&ctl.PageRequest{}).Encode(buf)
	if _, errno := sess.Ioctl(ctx, c, ctl.CmdStatus, buf, make([]byte, len(buf))); errno != 0 {
		t.Fatalf("STATUS without flags: %v", errno)
	}
}

// BenchmarkServerIndexPage: the daemon's work for one INDEX page of a
// cached 4,096-sample tar index (lookup, version, copy), JSON and columns.
func BenchmarkServerIndexPage(b *testing.B) {
	e := newEnv(b, envOptions{slabBytes: 1 << 20, budgetBytes: 4 << 20})
	sizes := make([]int, 8192)
	for i := range sizes {
		sizes[i] = 16
	}
	p := filepath.Join(e.dir, "s.tar")
	if err := os.WriteFile(p, tarOf(b, sizes...), 0o644); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	for _, tc := range []struct {
		name  string
		flags uint32
	}{{"json", 0}, {"columns", ctl.IndexFlagColumns}} {
		b.Run(tc.name, func(b *testing.B) {
			buf := make([]byte, ctl.SizePage)
			for b.Loop() {
				(&ctl.PageRequest{Flags: tc.flags}).Encode(buf)
				if errno := e.rawFile(1000, f, ctl.CmdIndex, buf); errno != 0 {
					b.Fatal(errno)
				}
			}
		})
	}
}
