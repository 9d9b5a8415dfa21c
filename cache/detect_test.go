package cache

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestDetect(t *testing.T) {
	st := stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{1})
	tarb := smallTar(t)
	for _, tc := range []struct {
		name string
		data []byte
		file string
		want Format
		err  error
	}{
		{"tar by magic", tarb, "anything.bin", FormatTar, nil},
		{"safetensors by content", st, "weights", FormatSafetensors, nil},
		{"npy by magic", npyFile(1, "{}", nil), "x", FormatNpy, nil},
		{"zip by magic", smallZip(t, "a/b"), "x.bin", FormatTorchZip, nil},
		{"mds by extension", []byte{0}, "shard.00003.mds", FormatMDS, nil},
		{"mds index by name", []byte("{}"), "/d/index.json", FormatMDS, nil},
		{"truncated safetensors by extension", st[:5], "m.safetensors", FormatSafetensors, nil},
		{"empty .tar", nil, "e.tar", FormatTar, nil},
		{"text", []byte("hello world"), "notes.txt", "", ErrNoIndex},
		{"dcp data file", smallZip(t, "archive/data.pkl"), "__0_0.distcp", "", ErrNoIndex},
		{"empty", nil, "x", "", ErrNoIndex},
		{"gzip tar", []byte{0x1f, 0x8b, 8}, "a.tar.gz", "", ErrInvalid},
		{"gzip other", []byte{0x1f, 0x8b, 8}, "a.gz", "", ErrNoIndex},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Detect(bytes.NewReader(tc.data), int64(len(tc.data)), tc.file)
			if got != tc.want || !errors.Is(err, tc.err) {
				t.Errorf("Detect = %q, %v; want %q, %v", got, err, tc.want, tc.err)
			}
		})
	}
}

// FuzzParse runs format detection and every parser it dispatches to on
// arbitrary bytes under each file-name hint.
func FuzzParse(f *testing.F) {
	f.Add(smallTar(f), uint8(0))
	f.Add(npyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", make([]byte, 4)), uint8(1))
	f.Add(stFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{1}), uint8(2))
	f.Add(writeMDSShard(testSamples(2)), uint8(3))
	f.Add(mdsIndexJSON(1), uint8(4))
	f.Add(smallZip(f, "a/data.pkl"), uint8(5))
	names := []string{"x.tar", "x.npy", "x.safetensors", "shard.00000.mds", "index.json", "x.pt", "x.tar.gz", "x"}
	f.Fuzz(func(t *testing.T, data []byte, hint uint8) {
		x, err := Parse(bytes.NewReader(data), int64(len(data)), names[int(hint)%len(names)])
		if err != nil {
			if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrNoIndex) {
				t.Fatalf("unexpected error kind: %v", err)
			}
			return
		}
		checkIndex(t, x)
	})
}

func TestParseFixtures(t *testing.T) {
	entries, err := os.ReadDir("testdata")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Format{".safetensors": FormatSafetensors, ".pt": FormatTorchZip, ".npy": FormatNpy, ".tar": FormatTar}
	for _, e := range entries {
		f, ok := want[filepath.Ext(e.Name())]
		if !ok {
			continue
		}
		if x := parseFile(t, filepath.Join("testdata", e.Name())); x.Format != f {
			t.Errorf("%s: format %s, want %s", e.Name(), x.Format, f)
		}
	}
}
