package integration

import (
	"archive/tar"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestIndexOfAMappedShardThroughMount: a writer maps a tar shard of the
// backing directory MAP_SHARED and rewrites a member's size field twice,
// 100 ms apart; the second store goes into a page already dirty, which
// changes no timestamp. An index fetched through the mount between the
// two stores must not be served after the second: each fetch answers the
// backing file's current bytes.
func TestIndexOfAMappedShardThroughMount(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, mb := range []struct {
		name string
		size int
	}{{"000.jpg", 3000}, {"000.cls", 1000}} {
		if err := tw.WriteHeader(&tar.Header{Name: mb.name, Mode: 0o644, Size: int64(mb.size), Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(make([]byte, mb.size)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	backing := filepath.Join(m.backing, "shard.tar")
	writeFile(t, backing, data)
	w, err := os.OpenFile(backing, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Sync(); err != nil { // clean pages: the first store faults
		t.Fatal(err)
	}
	mp, err := syscall.Mmap(int(w.Fd()), 0, len(data), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mp)
	hdr := mp[512+3072:] // the second member's header
	setSize := func(size int64) {
		copy(hdr[124:136], fmt.Sprintf("%011o\x00", size))
		copy(hdr[148:156], "        ")
		var sum int64
		for _, c := range hdr[:512] {
			sum += int64(c)
		}
		copy(hdr[148:156], fmt.Sprintf("%06o\x00 ", sum))
	}
	check := func(when string) {
		t.Helper()
		got, err := xattrIndex(filepath.Join(m.mnt, "shard.tar"))
		if err != nil {
			t.Fatalf("%s: getxattr user.gdsfs.index: %v", when, err)
		}
		if want := wantIndex(t, backing); !bytes.Equal(got, want) {
			t.Errorf("%s: the mount's index is\n%s\nthe backing file's bytes index as\n%s", when, got, want)
		}
	}
	setSize(900) // the page is dirty now, its times set
	check("after the first store")
	time.Sleep(100 * time.Millisecond) // a later time than the first store's, to the timestamp's grain
	setSize(800)                       // into the dirty page: no timestamp changes
	check("after the second store")
}
