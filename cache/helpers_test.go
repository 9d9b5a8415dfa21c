package cache

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// python is Debian's interpreter, which has torch and numpy (the first
// python3 on PATH may not).
const python = "/usr/bin/python3"

// needPython skips the test when python3 or one of mods cannot be imported.
// CI installs them (scripts/install-deps.sh), so there the test runs.
func needPython(t testing.TB, mods ...string) {
	t.Helper()
	args := []string{"-c", "import sys\nfor m in sys.argv[1:]: __import__(m)"}
	if out, err := exec.Command(python, append(args, mods...)...).CombinedOutput(); err != nil {
		t.Skipf("%s with %v not available: %v %s", python, mods, err, out)
	}
}

// pyRun runs a Python snippet with args and fails the test on error.
func pyRun(t testing.TB, code string, args ...string) []byte {
	t.Helper()
	out, err := exec.Command(python, append([]string{"-c", code}, args...)...).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("python: %v\n%s", err, stderr)
	}
	return out
}

// refView runs testdata/refview.py KIND FILE and decodes its JSON into v.
func refView(t testing.TB, kind, file string, v any) {
	t.Helper()
	refViews(t, kind, []string{file}, v)
}

// refViews runs refview.py once for several files; v receives {file: view}.
func refViews(t testing.TB, kind string, files []string, v any) {
	t.Helper()
	script, err := filepath.Abs("testdata/refview.py")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python, append([]string{script, kind}, files...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("refview %s %v: %v\n%s", kind, files, err, stderr.Bytes())
	}
	if err := json.Unmarshal(out, v); err != nil {
		t.Fatalf("refview %s output: %v", kind, err)
	}
}

// run runs a command in dir and fails the test on error.
func run(t testing.TB, dir, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}

// parseFile parses path with Parse and fails the test on error.
func parseFile(t testing.TB, path string) *Index {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	x, err := Parse(f, fi.Size(), path)
	if err != nil {
		t.Fatalf("Parse(%s): %v", path, err)
	}
	checkIndex(t, x)
	return x
}

// checkIndex checks properties every index has: valid JSON with the
// envelope, and ranges inside the file.
func checkIndex(t testing.TB, x *Index) {
	t.Helper()
	js, err := x.JSON()
	if err != nil {
		t.Fatalf("JSON: %v", err)
	}
	var env struct {
		Format   Format `json:"format"`
		Version  int    `json:"version"`
		FileSize int64  `json:"file_size"`
	}
	if err := json.Unmarshal(js, &env); err != nil {
		t.Fatalf("index JSON does not decode: %v\n%s", err, js)
	}
	if env.Format != x.Format || env.Version != IndexVersion || env.FileSize != x.FileSize {
		t.Fatalf("envelope = %+v, want format %s version %d size %d", env, x.Format, IndexVersion, x.FileSize)
	}
	for _, r := range ranges(x) {
		if r.Offset < 0 || r.Length < 0 || r.Offset > x.FileSize || r.Length > x.FileSize-r.Offset {
			t.Fatalf("range %+v outside the %d-byte file", r, x.FileSize)
		}
	}
}

// ranges lists every range an index hands out.
func ranges(x *Index) []Range {
	var rs []Range
	switch {
	case x.Tar != nil:
		for _, s := range x.Tar.Samples {
			for _, f := range s.Fields {
				rs = append(rs, f.Range)
			}
		}
		for _, m := range x.Tar.Other {
			rs = append(rs, m.Range)
		}
	case x.Safetensors != nil:
		for _, s := range x.Safetensors.Tensors {
			rs = append(rs, s.Range)
		}
	case x.TorchZip != nil:
		for _, r := range x.TorchZip.Records {
			rs = append(rs, r.Range)
		}
	case x.Npy != nil:
		rs = append(rs, Range{x.Npy.DataOffset, x.Npy.DataLength})
	case x.MDS != nil:
		for _, s := range x.MDS.Samples {
			rs = append(rs, s.Range)
			rs = append(rs, s.Columns...)
		}
	}
	return rs
}

// rangeSHA returns the sha256 (hex) of bytes [r.Offset, r.Offset+r.Length) of path.
func rangeSHA(t testing.TB, path string, r Range) string {
	t.Helper()
	b := readRange(t, path, r)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func readRange(t testing.TB, path string, r Range) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, r.Length)
	if _, err := f.ReadAt(b, r.Offset); err != nil {
		t.Fatalf("read %+v of %s: %v", r, path, err)
	}
	return b
}

// checkParse is the body of every parser's fuzz target: parsing data either
// fails with an error wrapping ErrInvalid or yields an index (built by wrap
// from the parser's result) whose ranges checkIndex accepts.
func checkParse[T any](t *testing.T, data []byte, parse func(io.ReaderAt, int64) (T, error), wrap func(T) *Index) {
	t.Helper()
	v, err := parse(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("error does not wrap ErrInvalid: %v", err)
		}
		return
	}
	x := wrap(v)
	x.FileSize = int64(len(data))
	checkIndex(t, x)
}
