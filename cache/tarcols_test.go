package cache

import (
	"archive/tar"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

// colsTars are tars whose columns must decode to their exact JSON: every
// kind of member the index carries (hard links, other members, skipped
// ones, npy geometry, keys that are not ASCII, names that need escaping),
// an empty archive, and one with offsets and lengths past 32 bits' widths.
func colsTars(t testing.TB) map[string]*Index {
	out := map[string]*Index{}
	add := func(name string, data []byte) {
		x, err := Parse(bytes.NewReader(data), int64(len(data)), name+".tar")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = x
	}
	add("small", smallTar(t))
	add("tiny", tinyTar(t))
	add("empty", make([]byte, 1024))
	add("npy", npyTar(t, false,
		[2]string{"a.x.npy", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", make([]byte, 8))},
		[2]string{"a.cls", "1"},
		[2]string{"b.x.npy", npyPadded("{'descr': '<i8', 'fortran_order': True, 'shape': (1, 1), }", make([]byte, 8))},
		[2]string{"é/ü.q\"uote.bin", "z"}))
	if b, err := os.ReadFile("testdata/sparse.tar"); err == nil {
		add("sparse", b)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := 0; i < 300; i++ {
		for _, ext := range []string{"cls", "jpg", "seg.png"} {
			h := &tar.Header{Name: fmt.Sprintf("d/%06d.%s", i, ext), Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}
			if err := tw.WriteHeader(h); err != nil {
				t.Fatal(err)
			}
			tw.Write([]byte("x"))
		}
	}
	tw.Close()
	add("many", buf.Bytes())
	// Wide numbers: a synthetic index (no file holds 5 GB here).
	out["wide"] = &Index{Format: FormatTar, FileSize: 6 << 30, Tar: &Tar{Members: 2, Samples: []TarSample{{Key: "k", Fields: []TarField{
		{Field: "bin", TarMember: TarMember{Name: "k.bin", Range: Range{Offset: 5 << 30, Length: 1 << 30}}},
		{Field: "cls", TarMember: TarMember{Name: "k.cls", Range: Range{Offset: 512, Length: 70000}}},
	}}}}}
	return out
}

// TestTarColumnsDecodeToTheJSON: a tar's columns document decodes to the
// index whose JSON is byte for byte the document INDEX serves without
// columns, and it is smaller than that JSON.
func TestTarColumnsDecodeToTheJSON(t *testing.T) {
	for name, x := range colsTars(t) {
		t.Run(name, func(t *testing.T) {
			cols, gen, err := x.ColumnsHash()
			if err != nil {
				t.Fatal(err)
			}
			if again, gen2, _ := x.ColumnsHash(); &again[0] != &cols[0] || gen2 != gen {
				t.Error("ColumnsHash is not computed once")
			}
			y, err := DecodeTarColumns(cols)
			if err != nil {
				t.Fatalf("DecodeTarColumns: %v", err)
			}
			want, got := mustJSON(t, x), mustJSON(t, y)
			if got != want {
				t.Fatalf("decoded JSON differs:\n got %s\nwant %s", got, want)
			}
			if len(x.Tar.Samples) > 10 && len(cols) >= len(want)/2 {
				t.Errorf("columns %d bytes, JSON %d: not half of it", len(cols), len(want))
			}
		})
	}
}

func TestColumnsOnlyForTar(t *testing.T) {
	x := parseFile(t, "testdata/model.safetensors")
	if _, _, err := x.ColumnsHash(); !errors.Is(err, ErrNoColumns) {
		t.Fatalf("safetensors ColumnsHash err = %v, want ErrNoColumns", err)
	}
}

// TestTarColumnsMalformed: every bound and index of the document is
// checked; each malformed document is an ErrBadColumns error.
func TestTarColumnsMalformed(t *testing.T) {
	good, _, err := colsTars(t)["small"].ColumnsHash()
	if err != nil {
		t.Fatal(err)
	}
	headLen := int(binary.LittleEndian.Uint32(good[8:]))
	edit := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	u32 := func(off int, v uint32) []byte {
		return edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[off:], v); return b })
	}
	cases := map[string][]byte{
		"empty":              nil,
		"short header":       good[:47],
		"bad magic":          edit(func(b []byte) []byte { b[0] = 'X'; return b }),
		"version":            u32(4, 2),
		"head past end":      u32(8, uint32(len(good))+1),
		"samples over bound": u32(12, colsMaxCount+1),
		"fields over bound":  u32(16, 1<<31),
		"samples > fields":   u32(16, 0),
		"names > fields":     u32(20, 100),
		"width 3":            edit(func(b []byte) []byte { b[40] = 3; return b }),
		"width 0":            edit(func(b []byte) []byte { b[47] = 0; return b }),
		"truncated":          good[:len(good)-1],
		"trailing byte":      append(append([]byte(nil), good...), 0),
		"head not tar":       edit(func(b []byte) []byte { copy(b[colsHeader+len(`{"format":"`):], "npy"); return b }),
		"head not JSON":      edit(func(b []byte) []byte { b[colsHeader] = '['; return b }),
		"key not UTF-8":      edit(func(b []byte) []byte { b[bytes.LastIndex(b, []byte("dir/000003"))] = 0xff; return b }),
	}
	// The name-end column starts after the head: its first end past the
	// name bytes is out of order.
	cases["name end past its bytes"] = edit(func(b []byte) []byte { b[colsHeader+headLen] = 0xff; return b })
	for name, doc := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := DecodeTarColumns(doc); !errors.Is(err, ErrBadColumns) {
				t.Fatalf("err = %v, want ErrBadColumns", err)
			}
		})
	}
}

// FuzzTarColumns: DecodeTarColumns never panics and wraps ErrBadColumns on
// every refusal; a document it accepts encodes again to one that decodes
// to the same JSON; and any tar's columns decode to its JSON.
func FuzzTarColumns(f *testing.F) {
	for _, x := range colsTars(f) {
		cols, _, err := x.ColumnsHash()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(cols)
	}
	f.Add(tinyTar(f))
	f.Fuzz(func(t *testing.T, data []byte) {
		y, err := DecodeTarColumns(data)
		if err != nil {
			if !errors.Is(err, ErrBadColumns) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("error %q: not one line wrapping ErrBadColumns", err)
			}
		} else {
			js := mustJSON(t, y)
			again, _, err := (&Index{Format: FormatTar, FileSize: y.FileSize, Tar: y.Tar}).ColumnsHash()
			if err != nil {
				t.Fatalf("re-encode: %v", err)
			}
			z, err := DecodeTarColumns(again)
			if err != nil {
				t.Fatalf("re-encoded document refused: %v", err)
			}
			if got := mustJSON(t, z); got != js {
				t.Fatalf("re-encoded document decodes to\n%s\nnot\n%s", got, js)
			}
		}
		// The same bytes as a tar: its columns decode to its JSON.
		tr, err := ParseTar(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			return
		}
		x := &Index{Format: FormatTar, FileSize: int64(len(data)), Tar: tr}
		cols, _, err := x.ColumnsHash()
		if err != nil {
			t.Fatalf("columns of a parsed tar: %v", err)
		}
		z, err := DecodeTarColumns(cols)
		if err != nil {
			t.Fatalf("columns of a parsed tar refused: %v", err)
		}
		if got, want := mustJSON(t, z), mustJSON(t, x); got != want {
			t.Fatalf("columns decode to\n%s\nnot the tar's\n%s", got, want)
		}
	})
}

// BenchmarkTarColumns50k: the daemon's one-time cost of a 25,000-sample
// shard's columns document against its JSON, and the Go client's decode of
// each (DecodeTarColumns against json.Unmarshal of the generic document).
func BenchmarkTarColumns50k(b *testing.B) {
	path := b.TempDir() + "/shard-000000.tar"
	writeBigTar(b, path, 50_000)
	data := mustRead(b, path)
	x, err := Parse(bytes.NewReader(data), int64(len(data)), "shard.tar")
	if err != nil {
		b.Fatal(err)
	}
	js, _ := x.JSON()
	cols, _, _ := x.ColumnsHash()
	b.Run("encode-json", func(b *testing.B) {
		for b.Loop() {
			if _, err := (&Index{Format: x.Format, FileSize: x.FileSize, Tar: x.Tar}).JSON(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(len(js)), "bytes")
	})
	b.Run("encode-columns", func(b *testing.B) {
		for b.Loop() {
			if _, _, err := (&Index{Format: x.Format, FileSize: x.FileSize, Tar: x.Tar}).ColumnsHash(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(len(cols)), "bytes")
	})
	b.Run("decode-json", func(b *testing.B) {
		for b.Loop() {
			var v map[string]any
			if err := json.Unmarshal(js, &v); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode-columns", func(b *testing.B) {
		for b.Loop() {
			if _, err := DecodeTarColumns(cols); err != nil {
				b.Fatal(err)
			}
		}
	})
}
