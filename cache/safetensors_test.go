package cache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSafetensorsAgreesWithTorch indexes files written by the safetensors
// library (testdata, from ../shared/fixtures) and checks every tensor's
// bytes against the same tensors saved by torch.save and read back by
// torch.load (Debian's torch).
func TestSafetensorsAgreesWithTorch(t *testing.T) {
	needPython(t, "torch")
	cases := []struct{ st, pt string }{
		{"model.safetensors", "model_align4096.pt"},
		{"dtypes.safetensors", "dtypes_default.pt"},
	}
	var refs map[string]map[string]struct {
		Shape  []int64 `json:"shape"`
		SHA256 string  `json:"sha256"`
	}
	refViews(t, "tensors", []string{filepath.Join("testdata", cases[0].pt), filepath.Join("testdata", cases[1].pt)}, &refs)
	for _, tc := range cases {
		t.Run(tc.st, func(t *testing.T) {
			path := filepath.Join("testdata", tc.st)
			x := parseFile(t, path)
			if x.Format != FormatSafetensors {
				t.Fatalf("format = %s", x.Format)
			}
			ref := refs[filepath.Join("testdata", tc.pt)]
			if len(ref) != len(x.Safetensors.Tensors) {
				t.Fatalf("%d tensors, torch has %d", len(x.Safetensors.Tensors), len(ref))
			}
			for _, tn := range x.Safetensors.Tensors {
				r, ok := ref[tn.Name]
				if !ok {
					t.Errorf("tensor %q not in the torch file", tn.Name)
					continue
				}
				if !equalShape(tn.Shape, r.Shape) {
					t.Errorf("%q shape %v, torch %v", tn.Name, tn.Shape, r.Shape)
				}
				off, n, err := x.Resolve(tn.Name)
				if err != nil || off != tn.Offset || n != tn.Length {
					t.Errorf("Resolve(%q) = %d, %d, %v", tn.Name, off, n, err)
				}
				if got := rangeSHA(t, path, tn.Range); got != r.SHA256 {
					t.Errorf("%q (%s): bytes differ from torch's", tn.Name, tn.Dtype)
				}
			}
		})
	}
	x := parseFile(t, "testdata/dtypes.safetensors")
	if md := x.Safetensors.Metadata; md["format"] != "pt" || md["note"] != "gdsfs fixture" {
		t.Errorf("metadata = %v", md)
	}
}

func equalShape(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// stFile builds a safetensors file from a header and a buffer.
func stFile(header string, buf []byte) []byte {
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(out, header...), buf...)
}

func TestSafetensorsRejects(t *testing.T) {
	ok := `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`
	withLen := func(n uint64) []byte {
		b := stFile(ok, make([]byte, 8))
		binary.LittleEndian.PutUint64(b, n)
		return b
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"short", []byte{1, 2, 3}, "too short"},
		{"length 2^63", withLen(1 << 63), "exceeds the format's limit"},
		{"length past EOF", withLen(4096), "runs past the end"},
		{"not an object", stFile(`["a"]`, nil), "does not start with '{'"},
		{"deep nesting", stFile(`{"__metadata__":`+strings.Repeat("[", 20000)+strings.Repeat("]", 20000)+`}`, nil), "__metadata__"},
		{"duplicate", stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, []byte{1, 2}), "duplicate key"},
		{"hole", stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, []byte{1, 2}), "holes and overlaps"},
		{"overlap", stFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, []byte{1, 2}), "holes and overlaps"},
		{"uncovered tail", stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{1, 2}), "cover 1 of the 2"},
		{"offsets past buffer", stFile(`{"a":{"dtype":"U8","shape":[9],"data_offsets":[0,9]}}`, []byte{1}), "outside the 1-byte buffer"},
		{"bad dtype", stFile(`{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}`, make([]byte, 4)), "unknown dtype"},
		{"shape mismatch", stFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, make([]byte, 8)), "needs 96 bits"},
		{"negative shape", stFile(`{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}`, make([]byte, 8)), "bad shape"},
		{"shape overflow", stFile(`{"a":{"dtype":"F64","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}}`, make([]byte, 8)), "overflows"},
		{"not utf-8", stFile("{\"\xff\":{}}", nil), "not UTF-8"},
		{"trailing bytes", stFile(ok+`x`, make([]byte, 8)), "after the header"},
		{"metadata not strings", stFile(`{"__metadata__":{"a":1}}`, nil), "__metadata__"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSafetensors(bytes.NewReader(tc.data), int64(len(tc.data)))
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want ErrInvalid with %q", err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), "cache: not a valid safetensors file: ") {
				t.Errorf("message %q lacks the standard prefix", err)
			}
		})
	}
	// Space padding after the header object is legal (the Rust writer pads to 8).
	padded := stFile(ok+"   ", make([]byte, 8))
	if _, err := ParseSafetensors(bytes.NewReader(padded), int64(len(padded))); err != nil {
		t.Errorf("padded header: %v", err)
	}
}

func FuzzSafetensors(f *testing.F) {
	for _, name := range []string{"testdata/dtypes.safetensors", "testdata/model.safetensors"} {
		b, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		if len(b) > 4096 {
			b = append(b[:0:0], b[:8+int(binary.LittleEndian.Uint64(b))]...)
		}
		f.Add(b)
	}
	f.Add(stFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}`, make([]byte, 8)))
	f.Fuzz(func(t *testing.T, data []byte) {
		checkParse(t, data, ParseSafetensors, func(x *Safetensors) *Index { return &Index{Format: FormatSafetensors, Safetensors: x} })
	})
}
