package fileid

import (
	"os"
	"path/filepath"
	"testing"
)

// TestIdentity: the same file has the same identity through a path and a
// descriptor; a write changes it, another file has another inode.
func TestIdentity(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "a")
	if err := os.WriteFile(p, []byte("one"), 0o644); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	byPath, err := Of(fi)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	byFD, err := OfFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if byPath != byFD || byPath.Key() != byFD.Key() || byPath.Size != 3 {
		t.Fatalf("path %v, descriptor %v", byPath, byFD)
	}
	if _, err := f.WriteAt([]byte("four"), 0); err != nil {
		t.Fatal(err)
	}
	after, err := OfFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if after.Inode != byPath.Inode || after.Key() == byPath.Key() {
		t.Errorf("after a write: %v (was %v): same inode, another key wanted", after, byPath)
	}
	if err := os.WriteFile(filepath.Join(dir, "b"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fi, _ = os.Stat(filepath.Join(dir, "b"))
	other, _ := Of(fi)
	if other.Inode == byPath.Inode {
		t.Errorf("two files share inode %v", other.Inode)
	}
	if _, err := Of(fakeInfo{}); err == nil {
		t.Error("Of without stat data: no error")
	}
}

type fakeInfo struct{ os.FileInfo }

func (fakeInfo) Name() string { return "fake" }
func (fakeInfo) Sys() any     { return nil }
