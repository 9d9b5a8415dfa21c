package cache

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// tarTree writes the member tree the tar tests archive: samples with one
// and two-dot fields, a long path, a UTF-8 name, an empty member, a file
// with no extension, a hard link, a symlink and a sparse file.
func tarTree(t *testing.T, dir string) {
	t.Helper()
	write := func(name, data string) {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("000000.jpg", strings.Repeat("J", 700))
	write("000000.cls", "3")
	write("000001.jpg", strings.Repeat("K", 1500))
	write("000001.seg.png", strings.Repeat("P", 513))
	write("000001.cls", "7")
	write("README", "no extension")
	write("ünïcode.txt", "utf-8 name")
	write("000003.txt", "")
	long := strings.Repeat("d", 60) + "/" + strings.Repeat("e", 60)
	write(long+"/000004.json", `{"long": true}`)
	if err := os.Link(filepath.Join(dir, "000000.jpg"), filepath.Join(dir, "zz_hard.jpg")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("000000.cls", filepath.Join(dir, "zz_link.cls")); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "zz_sparse.bin"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("head"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("tail"), 1<<20); err != nil {
		t.Fatal(err)
	}
}

type refTar struct {
	Members []struct {
		Name   string `json:"name"`
		Offset int64  `json:"offset"`
		Size   int64  `json:"size"`
		Type   string `json:"type"`
		Link   string `json:"link"`
		SHA256 string `json:"sha256"`
	} `json:"members"`
	Samples []struct {
		Key    string   `json:"key"`
		Fields []string `json:"fields"`
	} `json:"samples"`
}

// TestTarAgreesWithTools archives a tree with GNU tar (gnu, pax and ustar
// formats) and Python's tarfile (PAX and GNU), and checks that our index
// gives every member the data range Python's tarfile reports, groups
// samples as WebDataset does, and flags sparse members and symlinks.
func TestTarAgreesWithTools(t *testing.T) {
	needPython(t, "tarfile")
	src := t.TempDir()
	tarTree(t, src)
	out := t.TempDir()
	members := []string{"000000.jpg", "000000.cls", "000001.jpg", "000001.seg.png", "000001.cls", "README",
		"ünïcode.txt", "000003.txt", strings.Repeat("d", 60), "zz_hard.jpg", "zz_link.cls", "zz_sparse.bin"}
	cases := []struct {
		name string
		make func(dst string)
	}{
		{"gnutar-gnu", func(dst string) {
			run(t, src, "tar", append([]string{"--format=gnu", "--sparse", "-cf", dst}, members...)...)
		}},
		{"gnutar-pax", func(dst string) {
			run(t, src, "tar", append([]string{"--format=pax", "--sparse", "-cf", dst}, members...)...)
		}},
		{"gnutar-ustar", func(dst string) {
			// ustar has no sparse files and no names over 255 bytes.
			run(t, src, "tar", append([]string{"--format=ustar", "-cf", dst}, members[:len(members)-1]...)...)
		}},
		{"python-pax", func(dst string) { pyTar(t, src, dst, "PAX_FORMAT", members) }},
		{"python-gnu", func(dst string) { pyTar(t, src, dst, "GNU_FORMAT", members) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(out, tc.name+".tar")
			tc.make(dst)
			x := parseFile(t, dst)
			if x.Format != FormatTar {
				t.Fatalf("format = %s, want tar", x.Format)
			}
			var ref refTar
			refView(t, "tar", dst, &ref)
			checkTarAgainst(t, x, &ref, dst)
		})
	}
}

func pyTar(t *testing.T, src, dst, format string, members []string) {
	t.Helper()
	pyRun(t, `
import os, sys, tarfile
src, dst, fmt = sys.argv[1], sys.argv[2], sys.argv[3]
os.chdir(src)
with tarfile.open(dst, "w", format=getattr(tarfile, fmt)) as tf:
    for m in sys.argv[4:]:
        tf.add(m)
`, append([]string{src, dst, format}, members...)...)
}

func checkTarAgainst(t *testing.T, x *Index, ref *refTar, path string) {
	t.Helper()
	sawSparse := false
	for _, m := range ref.Members {
		off, n, err := x.Resolve(m.Name)
		switch m.Type {
		case "file", "hardlink":
			if err != nil {
				t.Errorf("Resolve(%q): %v", m.Name, err)
				continue
			}
			if m.Type == "file" && (off != m.Offset || n != m.Size) {
				t.Errorf("%q: range (%d, %d), tarfile says (%d, %d)", m.Name, off, n, m.Offset, m.Size)
			}
			if got := rangeSHA(t, path, Range{off, n}); got != m.SHA256 {
				t.Errorf("%q: bytes differ from tarfile's extraction", m.Name)
			}
		case "sparse", "symlink":
			sawSparse = sawSparse || m.Type == "sparse"
			if !errors.Is(err, ErrNotAddressable) {
				t.Errorf("Resolve(%s %q) = (%d, %d, %v), want ErrNotAddressable", m.Type, m.Name, off, n, err)
			}
		}
	}
	if len(x.Tar.Samples) != len(ref.Samples) {
		t.Fatalf("%d samples, WebDataset grouping gives %d: %s", len(x.Tar.Samples), len(ref.Samples), mustJSON(t, x))
	}
	for i, s := range x.Tar.Samples {
		var fields []string
		for _, f := range s.Fields {
			fields = append(fields, f.Field)
		}
		if s.Key != ref.Samples[i].Key || strings.Join(fields, ",") != strings.Join(ref.Samples[i].Fields, ",") {
			t.Errorf("sample %d = %q %v, WebDataset gives %q %v", i, s.Key, fields, ref.Samples[i].Key, ref.Samples[i].Fields)
		}
	}
	if (strings.Contains(path, "gnutar-gnu") || strings.Contains(path, "gnutar-pax")) && !sawSparse {
		t.Errorf("tarfile saw no sparse member in %s; the test lost its sparse case", path)
	}
}

func mustJSON(t testing.TB, x *Index) string {
	js, err := x.JSON()
	if err != nil {
		t.Fatal(err)
	}
	return string(js)
}

func TestTarSampleNames(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range []struct{ name, data string }{
		{"a/000001.jpg", "jpeg"}, {"a/000001.txt", "text"}, {"a/000002.jpg", "j2"},
	} {
		if err := tw.WriteHeader(&tar.Header{Name: m.name, Mode: 0o644, Size: int64(len(m.data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(m.data)); err != nil {
			t.Fatal(err)
		}
	}
	tw.Close()
	x, err := Parse(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "s.tar")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		want string
		err  error
	}{
		{"a/000001.jpg", "jpeg", nil},
		{"sample/0/txt", "text", nil},
		{"sample/1/jpg", "j2", nil},
		{"sample/1", "j2", nil},
		{"sample/0", "", nil},
		{"sample/2/jpg", "", ErrNotFound},
		{"sample/0/png", "", ErrNotFound},
		{"sample/-1/jpg", "", ErrNotFound},
		{"nope", "", ErrNotFound},
	} {
		off, n, err := x.Resolve(tc.name)
		if !errors.Is(err, tc.err) {
			t.Errorf("Resolve(%q) error %v, want %v", tc.name, err, tc.err)
			continue
		}
		if tc.err == nil && tc.want != "" && string(buf.Bytes()[off:off+n]) != tc.want {
			t.Errorf("Resolve(%q) = %q, want %q", tc.name, buf.Bytes()[off:off+n], tc.want)
		}
	}
	// sample/0 spans both fields and the header between them.
	off, n, _ := x.Resolve("sample/0")
	if got := string(buf.Bytes()[off : off+n]); !strings.HasPrefix(got, "jpeg") || !strings.HasSuffix(got, "text") {
		t.Errorf("sample/0 span = %q", got)
	}
}

func TestTarRejects(t *testing.T) {
	good := smallTar(t)
	truncated := good[:len(good)-1500] // cuts into the last member's data
	badSum := bytes.Clone(good)
	badSum[148] ^= 1
	var one bytes.Buffer
	tw := tar.NewWriter(&one)
	if err := tw.WriteHeader(&tar.Header{Name: "a.bin", Mode: 0o644, Size: 3, Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	tw.Write([]byte("abc"))
	tw.Close()
	huge := one.Bytes()
	copy(huge[124:136], "77777777777\x00") // size 8 GiB in a small file
	sumFix(huge[:512])
	for _, tc := range []struct {
		name string
		data []byte
		file string
		want string
	}{
		{"truncated", truncated, "x.tar", "not a valid tar"},
		{"checksum", badSum, "x.tar", "not a valid tar"},
		{"size past EOF", huge, "x.tar", "run past the end"},
		{"gzip", []byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3}, "x.tar.gz", "gzip-compressed shard cannot be served"},
		{"zstd", []byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0}, "x.tzst", "zstd-compressed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(bytes.NewReader(tc.data), int64(len(tc.data)), tc.file)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse = %v, want an ErrInvalid containing %q", err, tc.want)
			}
		})
	}
	if _, err := Parse(bytes.NewReader([]byte{0x1f, 0x8b, 8}), 3, "notes.gz"); !errors.Is(err, ErrNoIndex) {
		t.Errorf("a gzip file not named tar: %v, want ErrNoIndex", err)
	}
}

// sumFix recomputes a tar header's checksum.
func sumFix(h []byte) {
	copy(h[148:156], "        ")
	var s int64
	for _, c := range h[:512] {
		s += int64(c)
	}
	copy(h[148:156], []byte(strings.Repeat("0", 6-len(octalString(s)))+octalString(s)+"\x00 "))
}

func octalString(v int64) string {
	const digits = "01234567"
	if v == 0 {
		return "0"
	}
	var b []byte
	for ; v > 0; v /= 8 {
		b = append([]byte{digits[v%8]}, b...)
	}
	return string(b)
}

// smallTar is a seed archive written by archive/tar: PAX records, a GNU
// long name, a hard link, a symlink and a directory.
func smallTar(t testing.TB) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(h *tar.Header, data string) {
		h.Size = int64(len(data))
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(data)); err != nil {
			t.Fatal(err)
		}
	}
	add(&tar.Header{Name: "dir/", Typeflag: tar.TypeDir, Mode: 0o755}, "")
	add(&tar.Header{Name: "dir/000001.jpg", Typeflag: tar.TypeReg}, strings.Repeat("x", 600))
	add(&tar.Header{Name: "dir/000001.cls", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"comment": "pax"}}, "1")
	add(&tar.Header{Name: strings.Repeat("L", 150) + ".txt", Typeflag: tar.TypeReg, Format: tar.FormatGNU}, "long")
	add(&tar.Header{Name: "dir/000002.jpg", Typeflag: tar.TypeLink, Linkname: "dir/000001.jpg"}, "")
	add(&tar.Header{Name: "dir/000002.lnk", Typeflag: tar.TypeSymlink, Linkname: "000001.cls"}, "")
	add(&tar.Header{Name: "dir/000003.bin", Typeflag: tar.TypeReg}, strings.Repeat("y", 1100))
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// trimTar drops the zero padding after an archive's end blocks: small
// seeds keep the fuzzer's mutations and minimisation fast.
func trimTar(b []byte) []byte {
	end := len(b)
	for end >= 512 && bytes.Equal(b[end-512:end], make([]byte, 512)) {
		end -= 512
	}
	return b[:min(len(b), end+1024)]
}

// tinyTar is a fuzz seed with every kind of header smallTar has but tiny
// contents.
func tinyTar(t testing.TB) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range []*tar.Header{
		{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "d/1.jpg", Typeflag: tar.TypeReg, Size: 2, PAXRecords: map[string]string{"comment": "x"}},
		{Name: strings.Repeat("L", 101) + ".t", Typeflag: tar.TypeReg, Size: 1, Format: tar.FormatGNU},
		{Name: "d/2.jpg", Typeflag: tar.TypeLink, Linkname: "d/1.jpg"},
		{Name: "d/2.lnk", Typeflag: tar.TypeSymlink, Linkname: "1.jpg"},
	} {
		h.Mode |= 0o644
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write(bytes.Repeat([]byte("z"), int(h.Size)))
	}
	tw.Close()
	return trimTar(buf.Bytes())
}

func FuzzTar(f *testing.F) {
	f.Add(tinyTar(f))
	f.Add(make([]byte, 1024))
	f.Add(npyTar(f, false, [2]string{"a.x.npy", npyPadded("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", make([]byte, 8))}, [2]string{"a.npy", "\x93NUMPY\x01\x00"}))
	if b, err := os.ReadFile("testdata/sparse.tar"); err == nil {
		f.Add(trimTar(b))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tr, err := ParseTar(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error does not wrap ErrInvalid: %v", err)
			}
		} else {
			checkIndex(t, &Index{Format: FormatTar, FileSize: int64(len(data)), Tar: tr})
		}
		// Wherever the fast path answers, archive/tar must agree.
		fast, ok := parseTarFast(bytes.NewReader(data), int64(len(data)))
		if !ok {
			return
		}
		std, err := parseTarStd(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			t.Fatalf("fast path indexed what archive/tar rejects (%v)", err)
		}
		fj, _ := fast.MarshalJSON()
		sj, _ := std.MarshalJSON()
		if !bytes.Equal(fj, sj) {
			t.Fatalf("fast path and archive/tar differ:\nfast %s\n std %s", fj, sj)
		}
	})
}

// TestTarJSONNames checks the hand-written JSON encoder on names that need
// escaping: the decoded index must give back the exact names.
func TestTarJSONNames(t *testing.T) {
	names := []string{"q\"uote.txt", "back\\slash.txt", "new\nline.txt", "tab\t.é.txt", "ctl\x01.bin"}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		if err := tw.WriteHeader(&tar.Header{Name: n, Mode: 0o644, Size: 1, Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte("x"))
	}
	tw.Close()
	x, err := Parse(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "n.tar")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Samples []struct {
			Key    string `json:"key"`
			Fields map[string]struct {
				Name string `json:"name"`
			} `json:"fields"`
		} `json:"samples"`
	}
	if err := json.Unmarshal([]byte(mustJSON(t, x)), &doc); err != nil {
		t.Fatalf("index JSON: %v", err)
	}
	var got []string
	for _, s := range doc.Samples {
		for _, f := range s.Fields {
			got = append(got, f.Name)
		}
	}
	if strings.Join(got, "|") != strings.Join(names, "|") {
		t.Errorf("names through JSON = %q, want %q", got, names)
	}
}

// TestTarFastPath checks that plain archives (GNU tar, ustar, archive/tar
// with short names) take the fast path and give archive/tar's answer, and
// that special headers send the parser to archive/tar.
func TestTarFastPath(t *testing.T) {
	src := t.TempDir()
	tarTree(t, src)
	dst := filepath.Join(t.TempDir(), "plain.tar")
	run(t, src, "tar", "--format=ustar", "-cf", dst, "000000.jpg", "000000.cls", "000001.jpg", "000001.seg.png", "README", "zz_hard.jpg", "zz_link.cls", "000003.txt")
	var big bytes.Buffer
	writeBigTarTo(t, &big, 200)
	for _, tc := range []struct {
		name string
		data []byte
		fast bool
	}{
		{"gnu tar ustar", mustRead(t, dst), true},
		{"archive/tar short names", big.Bytes(), true},
		{"pax and long names", smallTar(t), false},
		{"gnu sparse", mustRead(t, "testdata/sparse.tar"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fast, ok := parseTarFast(bytes.NewReader(tc.data), int64(len(tc.data)))
			if ok != tc.fast {
				t.Fatalf("fast path taken = %v, want %v", ok, tc.fast)
			}
			std, err := parseTarStd(bytes.NewReader(tc.data), int64(len(tc.data)))
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				fj, _ := fast.MarshalJSON()
				sj, _ := std.MarshalJSON()
				if !bytes.Equal(fj, sj) {
					t.Errorf("fast path differs from archive/tar:\nfast %s\n std %s", fj, sj)
				}
			}
		})
	}
}

func mustRead(t testing.TB, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
