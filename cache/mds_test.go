package cache

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// mdsSample is one sample of the test dataset: columns id (int64), label
// (str) and tokens (bytes), stored in sorted column order.
type mdsSample struct {
	id     int64
	label  string
	tokens []byte
}

// mdsColumns is the writer config of the test dataset, as MDSWriter
// serialises it (json.dumps(sort_keys=True)).
const mdsConfigJSON = `{"column_encodings": ["int64", "str", "bytes"], "column_names": ["id", "label", "tokens"], "column_sizes": [8, null, null], "compression": null, "format": "mds", "hashes": [], "size_limit": 67108864, "version": 2}`

// writeMDSShard encodes samples as MDSWriter.encode_joint_shard does:
// u32 count, u32 offsets[count+1] (absolute), config JSON, then samples,
// each [u32 size of each variable column][values in column order].
func writeMDSShard(samples []mdsSample) []byte {
	var enc [][]byte
	for _, s := range samples {
		var b []byte
		b = binary.LittleEndian.AppendUint32(b, uint32(len(s.label)))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(s.tokens)))
		b = binary.LittleEndian.AppendUint64(b, uint64(s.id))
		b = append(b, s.label...)
		b = append(b, s.tokens...)
		enc = append(enc, b)
	}
	n := len(samples)
	start := uint32(4 + 4*(n+1) + len(mdsConfigJSON))
	out := binary.LittleEndian.AppendUint32(nil, uint32(n))
	at := start
	out = binary.LittleEndian.AppendUint32(out, at)
	for _, b := range enc {
		at += uint32(len(b))
		out = binary.LittleEndian.AppendUint32(out, at)
	}
	out = append(out, mdsConfigJSON...)
	for _, b := range enc {
		out = append(out, b...)
	}
	return out
}

func testSamples(n int) []mdsSample {
	s := make([]mdsSample, n)
	for i := range s {
		s[i] = mdsSample{id: int64(1000 + i), label: fmt.Sprintf("label-%d", i), tokens: bytes.Repeat([]byte{byte(i)}, i*3)}
	}
	return s
}

func TestMDSShard(t *testing.T) {
	samples := testSamples(50)
	dir := t.TempDir()
	path := filepath.Join(dir, "shard.00000.mds")
	if err := os.WriteFile(path, writeMDSShard(samples), 0o644); err != nil {
		t.Fatal(err)
	}
	x := parseFile(t, path)
	if x.Format != FormatMDS || x.MDS == nil {
		t.Fatalf("format %s, MDS %v", x.Format, x.MDS)
	}
	if got := len(x.MDS.Samples); got != len(samples) {
		t.Fatalf("%d samples, want %d", got, len(samples))
	}
	wantCols := []MDSColumn{{"id", "int64", 8}, {"label", "str", -1}, {"tokens", "bytes", -1}}
	if !sameColumns(x.MDS.Columns, wantCols) {
		t.Fatalf("columns %+v, want %+v", x.MDS.Columns, wantCols)
	}
	for i, s := range samples {
		for _, c := range []struct {
			col  string
			want []byte
		}{
			{"id", binary.LittleEndian.AppendUint64(nil, uint64(s.id))},
			{"label", []byte(s.label)},
			{"tokens", s.tokens},
		} {
			off, n, err := x.Resolve(fmt.Sprintf("sample/%d/%s", i, c.col))
			if err != nil {
				t.Fatalf("Resolve sample %d %s: %v", i, c.col, err)
			}
			if got := readRange(t, path, Range{off, n}); !bytes.Equal(got, c.want) {
				t.Errorf("sample %d %s = %q, want %q", i, c.col, got, c.want)
			}
		}
		off, n, err := x.Resolve(fmt.Sprintf("sample/%d", i))
		if err != nil || n != int64(8+8+len(s.label)+len(s.tokens)) {
			t.Errorf("sample %d range (%d, %d, %v)", i, off, n, err)
		}
	}
	for _, bad := range []string{"sample/50", "sample/1/nope", "sample/x"} {
		if _, _, err := x.Resolve(bad); !errors.Is(err, ErrNotFound) {
			t.Errorf("Resolve(%q) = %v, want ErrNotFound", bad, err)
		}
	}
	// The JSON names columns per sample.
	var doc struct {
		Kind    string `json:"kind"`
		Samples []struct {
			Offset  int64            `json:"offset"`
			Columns map[string]Range `json:"columns"`
		} `json:"samples"`
	}
	if err := json.Unmarshal([]byte(mustJSON(t, x)), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Kind != "shard" || len(doc.Samples) != 50 || doc.Samples[7].Columns["label"].Length != int64(len("label-7")) {
		t.Errorf("JSON = %+v", doc)
	}
}

func mdsIndexJSON(shards ...int) []byte {
	var parts []string
	for i, n := range shards {
		parts = append(parts, fmt.Sprintf(`{"column_encodings": ["int64", "str", "bytes"], "column_names": ["id", "label", "tokens"], "column_sizes": [8, null, null], "compression": "zstd:7", "format": "mds", "hashes": [], "raw_data": {"basename": "shard.%05d.mds", "bytes": 1234, "hashes": {}}, "samples": %d, "size_limit": 67108864, "version": 2, "zip_data": {"basename": "shard.%05d.mds.zstd", "bytes": 99, "hashes": {}}}`, i, n, i))
	}
	return []byte(`{"shards": [` + strings.Join(parts, ", ") + `], "version": 2}`)
}

func TestMDSIndexJSON(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.json")
	if err := os.WriteFile(path, mdsIndexJSON(10, 20, 5), 0o644); err != nil {
		t.Fatal(err)
	}
	x := parseFile(t, path)
	d := x.MDSDataset
	if x.Format != FormatMDS || d == nil || d.Kind != "dataset" {
		t.Fatalf("index = %+v", x)
	}
	if d.Samples != 35 || len(d.Shards) != 3 || d.Shards[2].FirstSample != 30 || d.Shards[1].Basename != "shard.00001.mds" ||
		d.Shards[0].ZipBasename != "shard.00000.mds.zstd" || d.Shards[0].Compression != "zstd:7" || len(d.Columns) != 3 {
		t.Errorf("dataset = %+v", d)
	}
	other := filepath.Join(dir, "sub", "index.json")
	os.MkdirAll(filepath.Dir(other), 0o755)
	os.WriteFile(other, []byte(`{"name": "not mds"}`), 0o644)
	f, _ := os.Open(other)
	defer f.Close()
	if _, err := Parse(f, 19, other); !errors.Is(err, ErrNoIndex) {
		t.Errorf("a non-MDS index.json: %v, want ErrNoIndex", err)
	}
}

func TestMDSRejects(t *testing.T) {
	good := writeMDSShard(testSamples(3))
	put := func(b []byte, off int, v uint32) []byte {
		b = bytes.Clone(b)
		binary.LittleEndian.PutUint32(b[off:], v)
		return b
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"short", []byte{1, 0}, "too short"},
		{"count too big", put(good, 0, 1<<30), "exceed gdsfs's index limit"},
		{"table past EOF", put(good, 0, 1000), "offset table"},
		{"decreasing", put(good, 8, 1), "decreases"},
		{"end past EOF", put(good, 16, 1<<31), "past the end"},
		{"no config", put(good, 4, 20), "config JSON of 0 bytes"},
		{"bad config", append(append(bytes.Clone(good[:20]), "{bad"...), good[24:]...), "config JSON: invalid character"},
		{"var column past sample", put(good, int(binary.LittleEndian.Uint32(good[4:])), 1<<20), "runs past the sample's end"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseMDS(bytes.NewReader(tc.data), int64(len(tc.data)))
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want ErrInvalid with %q", err, tc.want)
			}
		})
	}
}

func FuzzMDS(f *testing.F) {
	f.Add(writeMDSShard(testSamples(4)))
	f.Add(writeMDSShard(nil))
	f.Add(mdsShard([]string{"v", "x"}, []string{"ndarray:int16", "ndarray"}, []int64{-1, -1},
		[][][]byte{{ndValue(-1, 0, []uint64{3}, 6), ndValue(34, 1, []uint64{2, 2}, 16)}, {ndValue(-1, 0, nil, 2), ndValue(7, 0, []uint64{1}, 1)}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		checkParse(t, data, ParseMDS, func(x *MDS) *Index { return &Index{Format: FormatMDS, MDS: x} })
	})
}

func FuzzMDSIndex(f *testing.F) {
	f.Add(mdsIndexJSON(3, 4))
	f.Add([]byte(`{"shards": []}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := ParseMDSIndex(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrNoIndex) {
				t.Fatalf("unexpected error kind: %v", err)
			}
			return
		}
		checkIndex(t, &Index{Format: FormatMDS, FileSize: int64(len(data)), MDSDataset: d})
	})
}
