package cache

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTorchZipAgreesWithTools indexes torch.save files (torch 2.11 fixtures
// at 64 and 4096 alignment, and files saved here by Debian's torch) and a
// deflated zip, and checks every stored record's bytes against Python's
// zipfile and every tensor storage against torch.load.
func TestTorchZipAgreesWithTools(t *testing.T) {
	needPython(t, "torch")
	dir := t.TempDir()
	saved := filepath.Join(dir, "saved_here.pt")
	pyRun(t, `
import sys, torch
torch.manual_seed(0)
sd = {"w": torch.randn(33, 7), "b": torch.arange(10, dtype=torch.int16), "h": torch.randn(5).half(), "nested": [torch.ones(2, 2)]}
sd["view"] = sd["w"][1:3]
torch.save(sd, sys.argv[1])
`, saved)
	deflated := filepath.Join(dir, "deflated.zip")
	pyRun(t, `
import sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w") as z:
    z.writestr("arc/stored.bin", b"s" * 100, compress_type=zipfile.ZIP_STORED)
    z.writestr("arc/deflated.bin", b"d" * 1000, compress_type=zipfile.ZIP_DEFLATED)
`, deflated)
	paths := []string{"testdata/nested_default.pt", "testdata/model_align4096.pt", "testdata/dtypes_default.pt", saved, deflated}
	// One interpreter per view for all files: torch takes seconds to import.
	var zipRefs map[string][]struct {
		Name   string `json:"name"`
		Stored bool   `json:"stored"`
		SHA256 string `json:"sha256"`
	}
	refViews(t, "zip", paths, &zipRefs)
	var storageRefs map[string][]string
	refViews(t, "torchbytes", paths[:4], &storageRefs)
	for _, path := range paths {
		t.Run(filepath.Base(path), func(t *testing.T) {
			x := parseFile(t, path)
			if x.Format != FormatTorchZip {
				t.Fatalf("format = %s", x.Format)
			}
			z := x.TorchZip
			ref := zipRefs[path]
			if len(ref) != len(z.Records) {
				t.Fatalf("%d records, zipfile has %d", len(z.Records), len(ref))
			}
			byHash := map[string]bool{}
			for i, r := range ref {
				rec := z.Records[i]
				if rec.Name != r.Name || rec.Compressed == r.Stored {
					t.Errorf("record %d = %q compressed=%v, zipfile: %q stored=%v", i, rec.Name, rec.Compressed, r.Name, r.Stored)
				}
				off, n, err := x.Resolve(r.Name)
				if !r.Stored {
					if !errors.Is(err, ErrNotAddressable) {
						t.Errorf("Resolve(compressed %q) = %v, want ErrNotAddressable", r.Name, err)
					}
					continue
				}
				if err != nil {
					t.Errorf("Resolve(%q): %v", r.Name, err)
					continue
				}
				if got := rangeSHA(t, path, Range{off, n}); got != r.SHA256 {
					t.Errorf("record %q: bytes differ from zipfile's", r.Name)
				}
				byHash[r.SHA256] = true
			}
			if strings.HasSuffix(path, ".zip") {
				return
			}
			if !z.Torch || z.Archive == "" {
				t.Errorf("archive %q torch=%v, want a torch.save archive", z.Archive, z.Torch)
			}
			// Short names resolve under the archive folder.
			if _, _, err := x.Resolve("data.pkl"); err != nil {
				t.Errorf("Resolve(data.pkl): %v", err)
			}
			if strings.Contains(path, "align4096") {
				for _, rec := range z.Records {
					if strings.Contains(rec.Name, "/data/") && rec.Offset%4096 != 0 {
						t.Errorf("%q at %d, want 4096-aligned", rec.Name, rec.Offset)
					}
				}
			}
			storages := storageRefs[path]
			if len(storages) == 0 {
				t.Fatalf("torch.load found no storages in %s", path)
			}
			for _, h := range storages {
				if !byHash[h] {
					t.Errorf("a tensor storage of torch.load is in no record")
				}
			}
		})
	}
}

// eocd builds an end-of-central-directory record.
func eocd(records uint16, dirSize, dirOff uint32) []byte {
	b := []byte("PK\x05\x06")
	b = binary.LittleEndian.AppendUint16(b, 0)
	b = binary.LittleEndian.AppendUint16(b, 0)
	b = binary.LittleEndian.AppendUint16(b, records)
	b = binary.LittleEndian.AppendUint16(b, records)
	b = binary.LittleEndian.AppendUint32(b, dirSize)
	b = binary.LittleEndian.AppendUint32(b, dirOff)
	return binary.LittleEndian.AppendUint16(b, 0)
}

func smallZip(t testing.TB, name string) []byte {
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, err := zw.CreateHeader(&zip.FileHeader{Name: name, Method: zip.Store})
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte("payload"))
	zw.Close()
	return buf.Bytes()
}

func TestTorchZipRejects(t *testing.T) {
	good := smallZip(t, "arc/data/0")
	badLocal := bytes.Clone(good)
	copy(badLocal, "XXXX") // local header signature
	bomb := append([]byte("PK\x03\x04"), eocd(65535, 46*65535, 0)...)
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"truncated", good[:len(good)-30], "not a valid torch zip"},
		{"no directory", []byte("PK\x03\x04 nothing else here"), "not a valid torch zip"},
		{"directory bomb", bomb, "not a valid torch zip"},
		{"bad local header", badLocal, "local header"},
		{"non-UTF-8 name", smallZip(t, "arc/\xff\xfe"), "not UTF-8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseTorchZip(bytes.NewReader(tc.data), int64(len(tc.data)))
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want ErrInvalid with %q", err, tc.want)
			}
		})
	}
}

func FuzzTorchZip(f *testing.F) {
	f.Add(smallZip(f, "arc/data/0"))
	f.Add(append([]byte("PK\x03\x04"), eocd(3, 100, 0)...))
	if b, err := os.ReadFile("testdata/dtypes_default.pt"); err == nil {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkParse(t, data, ParseTorchZip, func(x *TorchZip) *Index { return &Index{Format: FormatTorchZip, TorchZip: x} })
	})
}
