package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// indexTar writes a WebDataset shard of n samples (jpg, cls) to path and
// returns each member's contents by name.
func indexTar(t testing.TB, path string, n int) map[string][]byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	members := map[string][]byte{}
	for i := range n {
		for _, ext := range []string{"jpg", "cls"} {
			name := fmt.Sprintf("train/sample-%06d.%s", i, ext)
			data := bytes.Repeat([]byte{byte(i), byte(len(ext))}, 50+i%300)
			if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o444, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
				t.Fatal(err)
			}
			if _, err := tw.Write(data); err != nil {
				t.Fatal(err)
			}
			members[name] = data
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	writeFile(t, path, buf.Bytes())
	return members
}

// wantIndex parses path in this process: what the daemon must serve.
func wantIndex(t testing.TB, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	x, err := cache.Parse(f, st.Size(), path)
	if err != nil {
		t.Fatal(err)
	}
	js, err := x.JSON()
	if err != nil {
		t.Fatal(err)
	}
	return js
}

func xattrIndex(p string) ([]byte, error) {
	return xattr.Get(p, "user.gdsfs.index") // EINTR asked again, as gdsfs's own commands do
}

// TestIndexThroughMount serves indexes of each format through the
// user.gdsfs.index xattr, `gdsfs index` and read-by-name, and agrees with
// the parser run on the backing file.
func TestIndexThroughMount(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true})
	members := indexTar(t, filepath.Join(m.backing, "shard-000000.tar"), 5)
	for _, name := range []string{"dtypes.safetensors", "arr_i8_fortran.npy", "nested_default.pt"} {
		b, err := os.ReadFile(filepath.Join("..", "cache", "testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(m.backing, name), b)
	}
	writeFile(t, filepath.Join(m.backing, "notes.txt"), []byte("no index here"))
	writeFile(t, filepath.Join(m.backing, "broken.safetensors"), []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, '{'})

	for _, name := range []string{"shard-000000.tar", "dtypes.safetensors", "arr_i8_fortran.npy", "nested_default.pt"} {
		got, err := xattrIndex(filepath.Join(m.mnt, name))
		if err != nil {
			t.Fatalf("getxattr user.gdsfs.index of %s: %v", name, err)
		}
		if want := wantIndex(t, filepath.Join(m.backing, name)); !bytes.Equal(got, want) {
			t.Errorf("%s: xattr index differs from the parser's:\n got %.200s\nwant %.200s", name, got, want)
		}
		out, code := runGdsfs(t, "index", "--json", filepath.Join(m.mnt, name))
		if code != 0 || strings.TrimSpace(out) != string(got) {
			t.Errorf("gdsfs index --json %s: exit %d, output %.200s", name, code, out)
		}
	}
	for _, name := range []string{"notes.txt", "broken.safetensors"} {
		if _, err := xattrIndex(filepath.Join(m.mnt, name)); !errors.Is(err, syscall.ENODATA) {
			t.Errorf("getxattr user.gdsfs.index of %s: %v, want ENODATA", name, err)
		}
	}
	out, code := runGdsfs(t, "index", filepath.Join(m.mnt, "broken.safetensors"))
	if code != 2 || !strings.Contains(out, "not a valid safetensors file: header length") {
		t.Errorf("gdsfs index of a corrupt file: exit %d, %q; want exit 2 and the parser's reason", code, out)
	}
	out, code = runGdsfs(t, "index", filepath.Join(m.mnt, "shard-000000.tar"))
	if code != 0 || !strings.Contains(out, "train/sample-000003.cls") || !strings.Contains(out, "5 samples") {
		t.Errorf("gdsfs index table: exit %d\n%s", code, out)
	}

	// Read by name: a sample field, a member path, a tensor.
	ctx := context.Background()
	cl := openSession(t, m.mnt)
	f := openRO(t, filepath.Join(m.mnt, "shard-000000.tar"))
	ls, err := cl.ReadNames(ctx, f, ctl.HostDevice, []string{"sample/3/jpg", "train/sample-000001.cls"})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range [][]byte{members["train/sample-000003.jpg"], members["train/sample-000001.cls"]} {
		got, err := cl.Bytes(ctx, ls[i])
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("read by name %d: %d bytes, %v; want %d bytes", i, len(got), err, len(want))
		}
	}
	if _, err := cl.ReadNames(ctx, f, ctl.HostDevice, []string{"sample/99/jpg"}); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("read of an unknown name: %v, want ENOENT", err)
	}
	ids := make([]uint64, len(ls))
	for i, l := range ls {
		ids[i] = l.ID
	}
	if err := cl.Release(ctx, ids...); err != nil {
		t.Fatal(err)
	}
}

// TestIndexLargePaged checks an index over the 64 KiB an xattr holds: the
// xattr says E2BIG, and `gdsfs index` and the client page it in full.
func TestIndexLargePaged(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true})
	indexTar(t, filepath.Join(m.backing, "big.tar"), 2000)
	p := filepath.Join(m.mnt, "big.tar")
	want := wantIndex(t, filepath.Join(m.backing, "big.tar"))
	if len(want) <= 64<<10 {
		t.Fatalf("test index is only %d bytes", len(want))
	}
	if _, err := xattrIndex(p); !errors.Is(err, syscall.E2BIG) {
		t.Fatalf("getxattr of a %d-byte index: %v, want E2BIG", len(want), err)
	}
	out, code := runGdsfs(t, "index", "--json", p)
	if code != 0 || strings.TrimSpace(out) != string(want) {
		t.Fatalf("gdsfs index --json of a large index: exit %d, %d bytes (want %d)", code, len(out), len(want))
	}
	cl := openSession(t, m.mnt)
	got, err := cl.Index(context.Background(), openRO(t, p))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("Client.Index: %d bytes, %v; want %d bytes", len(got), err, len(want))
	}
}

// TestIndexFollowsChanges rewrites indexed files through the mount (same
// size, so only invalidation or the identity can tell) and behind the
// daemon's back: the index always follows the file.
func TestIndexFollowsChanges(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true})
	npy := func(dtype string) []byte {
		h := fmt.Sprintf("{'descr': '%s', 'fortran_order': False, 'shape': (4,), }", dtype)
		h += strings.Repeat(" ", 117-len(h)) + "\n"
		return append(append([]byte("\x93NUMPY\x01\x00\x76\x00"), h...), make([]byte, 32)...)
	}
	dtypeOf := func(p string) string {
		t.Helper()
		js, err := xattrIndex(p)
		if err != nil {
			t.Fatalf("getxattr %s: %v", p, err)
		}
		var d struct {
			Dtype string `json:"dtype"`
		}
		if err := json.Unmarshal(js, &d); err != nil {
			t.Fatal(err)
		}
		return d.Dtype
	}
	p := filepath.Join(m.mnt, "a.npy")
	writeFile(t, p, npy("<f4"))
	if got := dtypeOf(p); got != "<f4" {
		t.Fatalf("dtype %q, want <f4", got)
	}
	// Through the mount, same size.
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(npy("<i4"), 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if got := dtypeOf(p); got != "<i4" {
		t.Errorf("after a write through the mount: dtype %q, want <i4", got)
	}
	// Renamed over through the mount.
	writeFile(t, filepath.Join(m.mnt, "b.npy"), npy("<u4"))
	if err := os.Rename(filepath.Join(m.mnt, "b.npy"), p); err != nil {
		t.Fatal(err)
	}
	if got := dtypeOf(p); got != "<u4" {
		t.Errorf("after a rename over it: dtype %q, want <u4", got)
	}
	// Behind the daemon's back, in the backing directory.
	writeFile(t, filepath.Join(m.backing, "a.npy"), npy("<f8"))
	if got := dtypeOf(p); got != "<f8" {
		t.Errorf("after a write in the backing directory: dtype %q, want <f8", got)
	}
}

// BenchmarkIndexXattrHit measures getxattr user.gdsfs.index through the
// mount on a cache hit: a small index (an .npy header, ~200 bytes of JSON)
// and a 250-sample tar (~45 KiB of JSON, near the xattr limit).
func BenchmarkIndexXattrHit(b *testing.B) {
	m := startMount(b, mountOpts{Daemon: true, OtherUIDs: true})
	indexTar(b, filepath.Join(m.backing, "s.tar"), 250)
	npy, err := os.ReadFile(filepath.Join("..", "cache", "testdata", "arr_f4.npy"))
	if err != nil {
		b.Fatal(err)
	}
	writeFile(b, filepath.Join(m.backing, "a.npy"), npy)
	for _, name := range []string{"a.npy", "s.tar"} {
		b.Run(name, func(b *testing.B) {
			p := filepath.Join(m.mnt, name)
			js, err := xattrIndex(p)
			if err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, 64<<10)
			for b.Loop() {
				if _, err := unix.Getxattr(p, "user.gdsfs.index", buf); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(js)), "json-bytes")
		})
	}
}
