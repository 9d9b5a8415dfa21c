package cache

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// npyTar is a tar of the members (name, bytes), in order; pax adds a PAX
// record to each header, which sends the parse down archive/tar's path.
func npyTar(t testing.TB, pax bool, members ...[2]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range members {
		h := &tar.Header{Name: m[0], Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(m[1]))}
		if pax {
			h.PAXRecords = map[string]string{"comment": "x"}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(m[1])); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// npyPadded is a version-1 .npy of header, padded with spaces and a newline
// to a 64-byte multiple as numpy writes it, and data.
func npyPadded(header string, data []byte) string {
	h := header
	for (10+len(h)+1)%64 != 0 {
		h += " "
	}
	return string(npyFile(1, h+"\n", data))
}

// npyGeometry returns the geometry the tar index gives each sample field
// named field (nil: none), by sample key.
func npyGeometry(t *testing.T, data []byte, field string) map[string]*NpyHeader {
	t.Helper()
	tr, err := ParseTar(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*NpyHeader{}
	for _, s := range tr.Samples {
		for _, f := range s.Fields {
			if f.Field != field {
				continue
			}
			out[s.Key] = nil
			if f.Npy > 0 {
				out[s.Key] = &tr.NpyHeaders[f.Npy-1]
			}
		}
	}
	return out
}

func TestTarNpyGeometry(t *testing.T) {
	f4 := "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
	d24 := make([]byte, 24)
	quoted := `{"shape":(2,3),"fortran_order":False,"descr":"<f4"}`
	for _, tc := range []struct {
		name string
		npy  string
		want *NpyHeader // nil: no geometry, the client parses the header itself
	}{
		{"f4", npyPadded(f4, d24), &NpyHeader{HeaderLength: 128, Dtype: "<f4", Shape: []int64{2, 3}}},
		{"fortran", npyPadded("{'descr': '<i8', 'fortran_order': True, 'shape': (3, 1), }", d24), &NpyHeader{HeaderLength: 128, Dtype: "<i8", Shape: []int64{3, 1}, FortranOrder: true}},
		{"scalar", npyPadded("{'descr': '|u1', 'fortran_order': False, 'shape': (), }", []byte{7}), &NpyHeader{HeaderLength: 128, Dtype: "|u1", Shape: []int64{}}},
		{"empty", npyPadded("{'descr': '<f2', 'fortran_order': False, 'shape': (0, 5), }", nil), &NpyHeader{HeaderLength: 128, Dtype: "<f2", Shape: []int64{0, 5}}},
		{"one dim", npyPadded("{'descr': '|b1', 'fortran_order': False, 'shape': (4,), }", make([]byte, 4)), &NpyHeader{HeaderLength: 128, Dtype: "|b1", Shape: []int64{4}}},
		{"version 2", string(npyFile(2, f4+"\n", d24)), &NpyHeader{HeaderLength: int64(12 + len(f4) + 1), Dtype: "<f4", Shape: []int64{2, 3}}},
		{"version 3", string(npyFile(3, f4, d24)), &NpyHeader{HeaderLength: int64(12 + len(f4)), Dtype: "<f4", Shape: []int64{2, 3}}},
		{"key order and quotes", string(npyFile(1, quoted, d24)), &NpyHeader{HeaderLength: int64(10 + len(quoted)), Dtype: "<f4", Shape: []int64{2, 3}}},
		{"extra bytes after the data", npyPadded(f4, make([]byte, 30)), &NpyHeader{HeaderLength: 128, Dtype: "<f4", Shape: []int64{2, 3}}},
		// Python reads these differently or not at all: no geometry.
		{"shape (3) is an int", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (6), }", d24), nil},
		{"leading zero", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (06,), }", d24), nil},
		{"python 2 long", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (6L,), }", d24), nil},
		{"backslash", npyPadded("{'descr': '\\<f4', 'fortran_order': False, 'shape': (6,), }", d24), nil},
		{"newline in a string", npyPadded("{'descr': '<f\n4', 'fortran_order': False, 'shape': (6,), }", d24), nil},
		{"tab", npyPadded("{'descr': '<f4',\t'fortran_order': False, 'shape': (6,), }", d24), nil},
		{"not ascii", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'é': 1}", d24), nil},
		{"no shape", npyPadded("{'descr': '<f4', 'fortran_order': False, }", d24), nil},
		{"fortran_order 1", npyPadded("{'descr': '<f4', 'fortran_order': 1, 'shape': (6,), }", d24), nil},
		{"list shape", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': [6], }", d24), nil},
		{"structured", npyPadded("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", d24), nil},
		{"object", npyPadded("{'descr': '|O', 'fortran_order': False, 'shape': (3,), }", d24), nil},
		{"data past the member", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }", d24), nil},
		{"bad dict", npyPadded("{'descr': '<f4' 'fortran_order': False, 'shape': (6,), }", d24), nil},
		{"bytes after the dict", npyPadded(f4+" x", d24), nil},
		{"header past 4 KiB", string(npyFile(1, f4+strings.Repeat(" ", 4096)+"\n", d24)), nil},
		{"cut short", npyPadded(f4, d24)[:40], nil},
		{"bad version", "\x93NUMPY\x04\x00" + npyPadded(f4, d24)[8:], nil},
		{"not npy", "plain bytes, not an array", nil},
		{"empty member", "", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, pax := range []bool{false, true} {
				data := npyTar(t, pax, [2]string{"a.cls", "1"}, [2]string{"a.x.npy", tc.npy}, [2]string{"b.x.npy", npyPadded(f4, d24)})
				got := npyGeometry(t, data, "x.npy")
				if !reflect.DeepEqual(got["a"], tc.want) {
					t.Fatalf("pax=%v: geometry %+v, want %+v", pax, got["a"], tc.want)
				}
				if got["b"] == nil {
					t.Fatalf("pax=%v: the good member after it has no geometry", pax)
				}
				x := &Index{Format: FormatTar, FileSize: int64(len(data))}
				x.Tar, _ = ParseTar(bytes.NewReader(data), int64(len(data)))
				checkIndex(t, x)
			}
		})
	}
}

// TestTarNpyFixtures: each fixture .npy as a tar member gets the geometry
// the npy-file index (ParseNpy) reads from it; python/tests checks the same
// against numpy through the daemon.
func TestTarNpyFixtures(t *testing.T) {
	for _, n := range []string{"arr_f4.npy", "arr_i8_fortran.npy", "arr_u1.npy"} {
		b, err := os.ReadFile(filepath.Join("testdata", n))
		if err != nil {
			t.Fatal(err)
		}
		want, err := ParseNpy(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			t.Fatal(err)
		}
		got := npyGeometry(t, npyTar(t, false, [2]string{"s.npy", string(b)}), "npy")["s"]
		if got == nil || got.HeaderLength != want.DataOffset || got.Dtype != want.Dtype || !reflect.DeepEqual(got.Shape, want.Shape) || got.FortranOrder != want.FortranOrder {
			t.Fatalf("%s: tar geometry %+v, npy index %+v", n, got, want)
		}
	}
}

// TestTarNpyTable: samples with one header share one table entry, and the
// JSON carries the table and each field's index into it.
func TestTarNpyTable(t *testing.T) {
	a := npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", make([]byte, 8))
	b := npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", make([]byte, 12))
	data := npyTar(t, false, [2]string{"0.x.npy", a}, [2]string{"1.x.npy", a}, [2]string{"2.x.npy", b}, [2]string{"3.npy", a}, [2]string{"3.y.bin", a})
	tr, err := ParseTar(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	js, err := tr.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Samples []struct {
			Fields map[string]struct {
				Npy *int `json:"npy"`
			} `json:"fields"`
		} `json:"samples"`
		NpyHeaders []NpyHeader `json:"npy_headers"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatalf("%v: %s", err, js)
	}
	if len(doc.NpyHeaders) != 2 || doc.NpyHeaders[0].Shape[0] != 2 || doc.NpyHeaders[1].Shape[0] != 3 {
		t.Fatalf("npy_headers %+v, want the two distinct headers: %s", doc.NpyHeaders, js)
	}
	idx := func(s int, f string) int {
		if p := doc.Samples[s].Fields[f].Npy; p != nil {
			return *p
		}
		return -1
	}
	if got := []int{idx(0, "x.npy"), idx(1, "x.npy"), idx(2, "x.npy"), idx(3, "npy"), idx(3, "y.bin")}; !reflect.DeepEqual(got, []int{0, 0, 1, 0, -1}) {
		t.Fatalf("fields' npy = %v, want [0 0 1 0 -1] (y.bin is not an npy field): %s", got, js)
	}
}

// FuzzNpyMember: any member bytes give geometry only within the member.
func FuzzNpyMember(f *testing.F) {
	f.Add([]byte(npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", make([]byte, 24))), int64(88))
	f.Add(npyFile(3, "{'descr':'<f2','fortran_order':True,'shape':(1,)}", []byte{0, 0}), int64(0))
	f.Fuzz(func(t *testing.T, data []byte, extra int64) {
		length := int64(len(data)) + max(0, extra%(1<<20))
		head := data[:min(len(data), npyMemberHead)]
		var tb npyTable
		k := tb.member(head, length)
		if k == 0 {
			return
		}
		h := tb.list[k-1]
		if h.HeaderLength > int64(len(head)) || len(h.Shape) > npyMaxDims {
			t.Fatalf("geometry %+v outside the %d header bytes", h, len(head))
		}
		item, err := npyItemSize(h.Dtype)
		if err != nil {
			t.Fatalf("geometry with dtype %q: %v", h.Dtype, err)
		}
		n := item
		for _, d := range h.Shape {
			if d == 0 {
				n = 0
				break
			}
		}
		for _, d := range h.Shape {
			if n != 0 && d > (length-h.HeaderLength)/n {
				t.Fatalf("geometry %+v: data past the %d-byte member", h, length)
			}
			n *= d
		}
		if n > length-h.HeaderLength {
			t.Fatalf("geometry %+v: %d data bytes past the %d-byte member", h, n, length)
		}
		if again := tb.member(head, length); again != k {
			t.Fatalf("the same header gave entries %d and %d", k, again)
		}
	})
}
