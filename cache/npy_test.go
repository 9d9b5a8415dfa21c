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

// TestNpyAgreesWithNumpy indexes .npy files written by numpy (2.x fixtures
// and files saved here, including a version 2.0 header and structured,
// unicode, datetime, boolean, big-endian, 0-d and empty arrays) and checks
// dtype, shape, order and data range against numpy's own memory map.
func TestNpyAgreesWithNumpy(t *testing.T) {
	needPython(t, "numpy")
	dir := t.TempDir()
	pyRun(t, `
import sys, numpy as np
d = sys.argv[1]
np.save(d + "/u5.npy", np.array(["a", "bcd", "ééé"], dtype="<U5"))
np.save(d + "/bool.npy", np.array([True, False, True]))
np.save(d + "/be_i4.npy", np.arange(6, dtype=">i4").reshape(2, 3))
np.save(d + "/dt.npy", np.array(["2020-01-01"], dtype="datetime64[ns]"))
np.save(d + "/scalar.npy", np.float64(3.5))
np.save(d + "/empty.npy", np.zeros((0, 4), dtype="<f2"))
np.save(d + "/c16_f.npy", np.asfortranarray(np.ones((3, 2), dtype="<c16")))
many = np.zeros(3, dtype=[("field_%04d" % i, "<f4") for i in range(3000)])
np.save(d + "/v2_struct.npy", many)
`, dir)
	paths := []string{"testdata/arr_f4.npy", "testdata/arr_i8_fortran.npy", "testdata/arr_u1.npy"}
	for _, n := range []string{"u5", "bool", "be_i4", "dt", "scalar", "empty", "c16_f", "v2_struct"} {
		paths = append(paths, filepath.Join(dir, n+".npy"))
	}
	var refs map[string]struct {
		Dtype        string  `json:"dtype"`
		Shape        []int64 `json:"shape"`
		FortranOrder bool    `json:"fortran_order"`
		Offset       int64   `json:"offset"`
		NBytes       int64   `json:"nbytes"`
	}
	refViews(t, "npy", paths, &refs)
	for _, path := range paths {
		t.Run(filepath.Base(path), func(t *testing.T) {
			x := parseFile(t, path)
			if x.Format != FormatNpy {
				t.Fatalf("format = %s", x.Format)
			}
			n := x.Npy
			ref, ok := refs[path]
			if !ok {
				t.Fatalf("no numpy view of %s", path)
			}
			if n.DataOffset != ref.Offset || n.DataLength != ref.NBytes || !equalShape(n.Shape, ref.Shape) || n.FortranOrder != ref.FortranOrder {
				t.Errorf("index %+v, numpy %+v", n, ref)
			}
			if n.ItemSize > 0 && n.Dtype != ref.Dtype {
				t.Errorf("dtype %q, numpy %q", n.Dtype, ref.Dtype)
			}
			if strings.Contains(path, "v2_struct") && (n.Version != "2.0" || n.ItemSize != 0 || !strings.HasPrefix(n.Dtype, "[")) {
				t.Errorf("structured v2 file indexed as %+v", n)
			}
			if off, l, err := x.Resolve("data"); err != nil || off != ref.Offset || l != ref.NBytes {
				t.Errorf("Resolve(data) = %d, %d, %v", off, l, err)
			}
		})
	}
}

func npyFile(major byte, header string, data []byte) []byte {
	b := []byte(npyMagic)
	b = append(b, major, 0)
	if major == 1 {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(header)))
	} else {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(header)))
	}
	return append(append(b, header...), data...)
}

func TestNpyRejects(t *testing.T) {
	hdr := func(s string) []byte { return npyFile(1, s, make([]byte, 16)) }
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"short", []byte(npyMagic), "too short"},
		{"version 9", npyFile(9, "{}", nil), "unsupported format version 9.0"},
		{"header past EOF", npyFile(2, "{}", nil)[:12], "runs past the end"},
		{"huge header length", append(append([]byte(npyMagic), 2, 0), 0xff, 0xff, 0xff, 0x7f), "runs past the end"},
		{"object dtype", hdr("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }"), "pickled"},
		{"data past EOF", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }"), "needs 24 bytes"},
		{"shape overflow", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904, 4611686018427387904), }"), "overflows"},
		{"no descr", hdr("{'fortran_order': False, 'shape': (2,), }"), "no 'descr'"},
		{"bad literal", hdr("{'descr': '<f4', 'fortran_order': Maybe, }"), "unexpected"},
		{"deep nesting", hdr("{'descr': " + strings.Repeat("[", 100) + strings.Repeat("]", 100) + "}"), "nested too deeply"},
		{"unterminated", hdr("{'descr': '<f4"), "unterminated"},
		{"not utf-8", hdr("{'descr': '\xff'}"), "not UTF-8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseNpy(bytes.NewReader(tc.data), int64(len(tc.data)))
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want ErrInvalid with %q", err, tc.want)
			}
		})
	}
}

func FuzzNpy(f *testing.F) {
	for _, n := range []string{"arr_f4.npy", "arr_i8_fortran.npy", "arr_u1.npy"} {
		b, err := os.ReadFile(filepath.Join("testdata", n))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(npyFile(2, "{'descr': [('a', '<f4'), ('b', '|u1')], 'fortran_order': False, 'shape': (), }", make([]byte, 5)))
	f.Fuzz(func(t *testing.T, data []byte) {
		checkParse(t, data, ParseNpy, func(x *Npy) *Index { return &Index{Format: FormatNpy, Npy: x} })
	})
}
