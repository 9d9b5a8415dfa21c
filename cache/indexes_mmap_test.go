package cache

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// setTarSize rewrites the size field of the tar header at hdr (512 bytes)
// and its checksum, in place: one store of a writer into a mapped shard.
func setTarSize(hdr []byte, size int64) {
	copy(hdr[124:136], fmt.Sprintf("%011o\x00", size))
	copy(hdr[148:156], "        ")
	var sum int64
	for _, c := range hdr[:512] {
		sum += int64(c)
	}
	copy(hdr[148:156], fmt.Sprintf("%06o\x00 ", sum))
}

// TestIndexOfAMappedFileNeverStale: a store into a page of a MAP_SHARED
// mapping that is already dirty changes no timestamp. An index built between
// two such stores must not stay cached under the file's unchanged identity:
// the next Get answers the file's current bytes (the backing file parsed
// afresh is the oracle).
func TestIndexOfAMappedFileNeverStale(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range []struct {
		name string
		size int
	}{{"000.a.bin", 3000}, {"000.b.bin", 1000}} {
		if err := tw.WriteHeader(&tar.Header{Name: m.name, Mode: 0o644, Size: int64(m.size), Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(make([]byte, m.size)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	bHdr := 512 + 3072 // the second member's header
	path := filepath.Join(t.TempDir(), "shard.tar")
	writeFile(t, path, data)
	w, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Sync(); err != nil { // clean pages: the first store faults
		t.Fatal(err)
	}
	m, err := syscall.Mmap(int(w.Fd()), 0, len(data), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(m)

	x := newTestIndexes(t)
	ctx := context.Background()
	check := func(when string) {
		t.Helper()
		got, err := getPath(ctx, x, path)
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		now, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		want, err := Parse(bytes.NewReader(now), int64(len(now)), path)
		if err != nil {
			t.Fatalf("%s: the oracle's parse: %v", when, err)
		}
		gj, _ := got.JSON()
		wj, _ := want.JSON()
		if !bytes.Equal(gj, wj) {
			t.Errorf("%s: the index is\n%s\nthe file's bytes index as\n%s", when, gj, wj)
		}
	}
	setTarSize(m[bHdr:], 900) // the page is dirty now, its times set
	check("after the first store")
	time.Sleep(100 * time.Millisecond) // a later time than the first store's, to the timestamp's grain
	setTarSize(m[bHdr:], 800)          // into the dirty page: no timestamp changes
	check("after the second store")
}
