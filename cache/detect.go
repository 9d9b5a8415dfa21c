package cache

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"path"
	"strings"
)

// compressors are the magics of compressed streams, which cannot be served
// by byte range.
var compressors = []struct {
	name  string
	magic []byte
}{
	{"gzip", []byte{0x1f, 0x8b}},
	{"bzip2", []byte("BZh")},
	{"xz", []byte{0xfd, '7', 'z', 'X', 'Z', 0}},
	{"zstd", []byte{0x28, 0xb5, 0x2f, 0xfd}},
	{"lz4", []byte{0x04, 0x22, 0x4d, 0x18}},
}

// Detect names the format of a file from its first bytes, using name (base
// name and extension only) as a hint where the content has no magic (MDS) or
// where the hint makes a better error message than ErrNoIndex (a truncated
// ".safetensors" is reported as an invalid safetensors file).
func Detect(r io.ReaderAt, size int64, name string) (Format, error) {
	var head [512]byte
	n, err := r.ReadAt(head[:min(size, int64(len(head)))], 0)
	if err != nil && err != io.EOF {
		return "", fmt.Errorf("cache: read header: %w", err)
	}
	b := head[:n]
	base := strings.ToLower(path.Base(name))
	ext := path.Ext(base)

	if ext == ".distcp" {
		// torch.distributed.checkpoint data: one torch.save archive per
		// item, concatenated; DCP's .metadata (a pickle the Python client
		// decodes) says where each item lies.
		return "", ErrNoIndex
	}
	switch {
	case bytes.HasPrefix(b, []byte(npyMagic)):
		return FormatNpy, nil
	case bytes.HasPrefix(b, []byte("PK\x03\x04")), bytes.HasPrefix(b, []byte("PK\x05\x06")):
		return FormatTorchZip, nil
	case len(b) >= 262 && string(b[257:262]) == "ustar":
		return FormatTar, nil
	case ext == ".mds" || isMDSIndexName(base):
		return FormatMDS, nil
	case looksSafetensors(b, size):
		return FormatSafetensors, nil
	}
	for _, c := range compressors {
		if bytes.HasPrefix(b, c.magic) {
			if isTarName(base) {
				return "", invalidf("tar", "%s-compressed shard cannot be served by byte range; store shards as uncompressed .tar", c.name)
			}
			if strings.Contains(base, ".mds.") {
				return "", invalidf("MDS shard", "%s-compressed shard cannot be served by byte range; use the uncompressed raw_data shard", c.name)
			}
			return "", ErrNoIndex
		}
	}
	switch ext {
	case ".tar":
		// Pre-POSIX (v7) archives have no magic; the parser checks the
		// header checksum and says what is wrong.
		return FormatTar, nil
	case ".safetensors":
		return FormatSafetensors, nil
	case ".npy":
		return FormatNpy, nil
	}
	return "", ErrNoIndex
}

// looksSafetensors reports whether b starts like a safetensors file: an
// 8-byte little-endian header length that fits in the file, then '{'.
func looksSafetensors(b []byte, size int64) bool {
	if len(b) < 9 {
		return false
	}
	n := binary.LittleEndian.Uint64(b)
	return n >= 2 && n <= safetensorsFormatMaxHeader && n <= uint64(size-8) && b[8] == '{'
}

func isTarName(base string) bool {
	for _, s := range []string{".tar.", ".tgz", ".tbz", ".tbz2", ".txz", ".tzst"} {
		if strings.Contains(base, s) || strings.HasSuffix(base, s) {
			return true
		}
	}
	return false
}

func isMDSIndexName(name string) bool {
	return strings.ToLower(path.Base(name)) == "index.json"
}
