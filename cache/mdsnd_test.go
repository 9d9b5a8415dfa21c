package cache

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// mdsShard encodes samples (per sample, per column, the encoded value) of
// columns (names sorted, encodings, sizes: -1 for variable ones) as
// MDSWriter.encode_joint_shard does.
func mdsShard(names, encs []string, sizes []int64, samples [][][]byte) []byte {
	cs := make([]string, len(sizes))
	for i, s := range sizes {
		cs[i] = "null"
		if s >= 0 {
			cs[i] = fmt.Sprint(s)
		}
	}
	q := func(v []string) string {
		b, _ := json.Marshal(v)
		return string(b)
	}
	cfg := fmt.Sprintf(`{"column_encodings": %s, "column_names": %s, "column_sizes": [%s], "compression": null, "format": "mds", "hashes": [], "size_limit": 67108864, "version": 2}`,
		q(encs), q(names), strings.Join(cs, ", "))
	var blobs [][]byte
	for _, s := range samples {
		var b []byte
		for c, v := range s {
			if sizes[c] < 0 {
				b = binary.LittleEndian.AppendUint32(b, uint32(len(v)))
			}
		}
		for _, v := range s {
			b = append(b, v...)
		}
		blobs = append(blobs, b)
	}
	at := uint32(4 + 4*(len(blobs)+1) + len(cfg))
	out := binary.LittleEndian.AppendUint32(nil, uint32(len(blobs)))
	out = binary.LittleEndian.AppendUint32(out, at)
	for _, b := range blobs {
		at += uint32(len(b))
		out = binary.LittleEndian.AppendUint32(out, at)
	}
	out = append(out, cfg...)
	for _, b := range blobs {
		out = append(out, b...)
	}
	return out
}

// ndValue encodes an ndarray value as NDArray.encode does: [dtype code]
// [ndim<<2 | shape code, dims as that uint][data of size data bytes].
func ndValue(dtype int, shapeCode int, dims []uint64, data int) []byte {
	var b []byte
	if dtype >= 0 {
		b = append(b, byte(dtype))
	}
	if shapeCode >= 0 {
		b = append(b, byte(len(dims)<<2|shapeCode))
		for _, d := range dims {
			switch shapeCode {
			case 0:
				b = append(b, byte(d))
			case 1:
				b = binary.LittleEndian.AppendUint16(b, uint16(d))
			case 2:
				b = binary.LittleEndian.AppendUint32(b, uint32(d))
			default:
				b = binary.LittleEndian.AppendUint64(b, d)
			}
		}
	}
	return append(b, make([]byte, data)...)
}

// TestMDSNdarrayHeaders: values of ndarray columns with per-sample dtype or
// shape get the geometry the client's parse gives, shared between samples
// of one geometry; malformed headers, data that does not match the shape,
// fixed columns and other encodings get none.
func TestMDSNdarrayHeaders(t *testing.T) {
	type geo struct {
		hl    int64
		dtype string
		shape []int64
	}
	for _, tc := range []struct {
		name  string
		enc   string
		size  int64
		value []byte
		want  *geo
	}{
		{"dtype and shape", "ndarray", -1, ndValue(34, 0, []uint64{2, 3}, 24), &geo{4, "float32", []int64{2, 3}}},
		{"u16 dims", "ndarray", -1, ndValue(8, 1, []uint64{300}, 300), &geo{4, "uint8", []int64{300}}},
		{"u32 dims", "ndarray", -1, ndValue(9, 2, []uint64{2, 1}, 2), &geo{10, "int8", []int64{2, 1}}},
		{"u64 dims", "ndarray", -1, ndValue(66, 3, []uint64{1}, 8), &geo{10, "float64", []int64{1}}},
		{"zero dim", "ndarray", -1, ndValue(66, 0, []uint64{0, 5}, 0), &geo{4, "float64", []int64{0, 5}}},
		{"0-d", "ndarray", -1, ndValue(65, 0, nil, 8), &geo{2, "int64", []int64{}}},
		{"shape only", "ndarray:int16", -1, ndValue(-1, 0, []uint64{3}, 6), &geo{2, "int16", []int64{3}}},
		{"empty shape part", "ndarray:int16:", -1, ndValue(-1, 0, []uint64{3}, 6), &geo{2, "int16", []int64{3}}},
		{"dtype only", "ndarray::2,2", -1, ndValue(33, -1, nil, 16), &geo{1, "int32", []int64{2, 2}}},
		{"fixed", "ndarray:int16:3", 6, ndValue(-1, -1, nil, 6), nil},
		{"bytes", "bytes", -1, ndValue(34, 0, []uint64{1}, 4), nil},
		{"unknown dtype code", "ndarray", -1, ndValue(7, 0, []uint64{1}, 1), nil},
		{"data short", "ndarray", -1, ndValue(34, 0, []uint64{2, 3}, 20), nil},
		{"data past the shape", "ndarray", -1, ndValue(34, 0, []uint64{2}, 12), nil},
		{"dims past the value", "ndarray", -1, []byte{34, 20<<2 | 3, 1}, nil},
		{"empty value", "ndarray", -1, nil, nil},
		{"huge dim", "ndarray", -1, ndValue(8, 3, []uint64{1 << 60, 0}, 0), nil},
		{"unknown fixed dtype", "ndarray:bfloat16", -1, ndValue(-1, 0, []uint64{1}, 2), nil},
		{"leading zero in fixed dims", "ndarray::02", -1, ndValue(8, -1, nil, 2), nil},
		{"extra part", "ndarray:uint8::x", -1, ndValue(-1, 0, []uint64{1}, 1), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			names, encs, sizes := []string{"a", "id", "x"}, []string{"bytes", "int64", tc.enc}, []int64{-1, 8, tc.size}
			var samples [][][]byte
			for i := range 3 {
				samples = append(samples, [][]byte{bytes.Repeat([]byte{1}, i), make([]byte, 8), tc.value})
			}
			data := mdsShard(names, encs, sizes, samples)
			m, err := ParseMDS(bytes.NewReader(data), int64(len(data)))
			if err != nil {
				t.Fatal(err)
			}
			js, err := m.MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			var doc struct {
				Samples []struct {
					Columns map[string]struct {
						Offset, Length int64
						Ndarray        *int `json:"ndarray"`
					} `json:"columns"`
				} `json:"samples"`
				NdarrayHeaders []MDSNdarray `json:"ndarray_headers"`
			}
			if err := json.Unmarshal(js, &doc); err != nil {
				t.Fatalf("%v: %s", err, js)
			}
			for i, s := range doc.Samples {
				if s.Columns["a"].Ndarray != nil || s.Columns["id"].Ndarray != nil {
					t.Fatalf("sample %d: geometry on a non-ndarray column: %s", i, js)
				}
				k := s.Columns["x"].Ndarray
				if tc.want == nil {
					if k != nil || len(doc.NdarrayHeaders) != 0 {
						t.Fatalf("sample %d: geometry %v, want none: %s", i, k, js)
					}
					continue
				}
				if k == nil || *k != 0 || len(doc.NdarrayHeaders) != 1 {
					t.Fatalf("sample %d: geometry %v of %d, want the one entry: %s", i, k, len(doc.NdarrayHeaders), js)
				}
				h := doc.NdarrayHeaders[0]
				if got := (geo{h.HeaderLength, h.Dtype, h.Shape}); !reflect.DeepEqual(got, *tc.want) {
					t.Fatalf("geometry %+v, want %+v", got, *tc.want)
				}
			}
		})
	}
}

// TestMDSNdarrayTableBound: a shard of more distinct geometries than the
// table holds is indexed; the values past the bound get none.
func TestMDSNdarrayTableBound(t *testing.T) {
	n := mdsNdTableBytes/(64+len("uint8")+20*8) + 50
	var samples [][][]byte
	for i := range n {
		dims := []uint64{0, 1, 1, 1, 1, 1, uint64(i%65536) + 1, uint64(i/65536) + 1}
		samples = append(samples, [][]byte{ndValue(8, 1, dims, 0)})
	}
	data := mdsShard([]string{"x"}, []string{"ndarray"}, []int64{-1}, samples)
	m, err := ParseMDS(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	with := 0
	for i, s := range m.Samples {
		if k := s.Ndarray[0]; k > 0 {
			with++
			if h := m.NdarrayHeaders[k-1]; h.Shape[6] != int64(i%65536)+1 {
				t.Fatalf("sample %d: geometry %+v", i, h)
			}
		}
	}
	if with == 0 || with >= n || len(m.NdarrayHeaders) != with {
		t.Fatalf("%d of %d samples with geometry, %d entries", with, n, len(m.NdarrayHeaders))
	}
}

// FuzzMDSNdarray: any header bytes of a value of any ndarray encoding give
// geometry only within the value, with array bytes that fill the rest of
// it exactly, and the same geometry twice.
func FuzzMDSNdarray(f *testing.F) {
	f.Add("ndarray", ndValue(34, 0, []uint64{2, 3}, 24), int64(0))
	f.Add("ndarray:int16", ndValue(-1, 1, []uint64{300}, 600), int64(0))
	f.Add("ndarray::4", ndValue(8, -1, nil, 4), int64(3))
	f.Fuzz(func(t *testing.T, enc string, data []byte, extra int64) {
		sp, ok := parseMDSNdSpec(enc)
		if !ok {
			return
		}
		length := int64(len(data)) + max(0, extra%(1<<20))
		head := data[:min(len(data), mdsNdMaxHead)]
		tb := mdsNdTable{byRaw: make([]map[string]int, 1)}
		k := tb.value(0, &sp, head, length)
		if k == 0 {
			return
		}
		h := tb.list[k-1]
		if h.HeaderLength > int64(len(head)) || len(h.Shape) > mdsNdMaxDims {
			t.Fatalf("geometry %+v outside the %d header bytes", h, len(head))
		}
		n := mdsDtypeSize(h.Dtype)
		if n == 0 {
			t.Fatalf("geometry with dtype %q", h.Dtype)
		}
		for _, d := range h.Shape {
			if d < 0 || d > mdsNdMaxDim {
				t.Fatalf("geometry %+v: dimension %d", h, d)
			}
			if d == 0 {
				n = 0
				break
			}
		}
		for _, d := range h.Shape {
			if n != 0 && d > length/n {
				t.Fatalf("geometry %+v: data past the %d-byte value", h, length)
			}
			n *= d
		}
		if n != length-h.HeaderLength {
			t.Fatalf("geometry %+v: %d array bytes, the value has %d after the header", h, n, length-h.HeaderLength)
		}
		if again := tb.value(0, &sp, head, length); again != k {
			t.Fatalf("the same header gave entries %d and %d", k, again)
		}
	})
}
