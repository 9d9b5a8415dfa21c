package cache

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// TorchZip is the index of a zip archive as torch.save writes it: every
// record under one top-level folder (the archive name), stored uncompressed.
// Storages' dtypes and shapes live in the pickle (data.pkl), which the
// Python client decodes; the index gives each record's bytes.
type TorchZip struct {
	// Archive is the top-level folder every record lives under ("" if the
	// records do not share one).
	Archive string `json:"archive"`
	// Torch is true when the archive holds <archive>/data.pkl, i.e. it was
	// written by torch.save.
	Torch bool `json:"torch"`
	// Records in central-directory order.
	Records []ZipRecord `json:"records"`
}

// ZipRecord is one zip entry. Range covers the record's data as stored; a
// compressed record cannot be served by range (Resolve refuses it).
type ZipRecord struct {
	Name string `json:"name"`
	Range
	Compressed bool `json:"compressed"`
	// UncompressedLength is set for compressed records.
	UncompressedLength int64 `json:"uncompressed_length,omitempty"`
}

// torchZipMaxRecords and torchZipMaxDirBytes bound the records we index
// and the central directory archive/zip reads (and holds: about 2.5 times
// its size), checked from the end-of-central-directory record before it is
// read. torch.save writes a few records per tensor storage.
const (
	torchZipMaxRecords  = 1 << 18
	torchZipMaxDirBytes = 32 << 20
)

// ParseTorchZip indexes a zip archive from its central directory (zip64
// included), taking each record's data offset from its local header.
func ParseTorchZip(r io.ReaderAt, size int64) (*TorchZip, error) {
	const what = "torch zip"
	if n, dirBytes, ok := zipDirectory(r, size); ok {
		switch {
		case n > torchZipMaxRecords:
			return nil, invalidf(what, "%d records exceed gdsfs's index limit of %d", n, torchZipMaxRecords)
		case dirBytes > torchZipMaxDirBytes:
			return nil, invalidf(what, "central directory of %d bytes exceeds gdsfs's index limit of %d (32 MiB)", dirBytes, torchZipMaxDirBytes)
		}
	}
	zr, err := zip.NewReader(r, size)
	if err != nil && !errors.Is(err, zip.ErrInsecurePath) {
		return nil, invalidf(what, "%s", strings.TrimPrefix(err.Error(), "zip: "))
	}
	if len(zr.File) > torchZipMaxRecords {
		return nil, invalidf(what, "%d records exceed gdsfs's index limit of %d", len(zr.File), torchZipMaxRecords)
	}
	z := &TorchZip{Records: make([]ZipRecord, 0, len(zr.File))}
	for i, f := range zr.File {
		if !utf8.ValidString(f.Name) {
			return nil, invalidf(what, "record %d: name %q is not UTF-8", i, f.Name)
		}
		off, err := f.DataOffset()
		if err != nil {
			return nil, invalidf(what, "record %q: local header: %s", f.Name, strings.TrimPrefix(err.Error(), "zip: "))
		}
		clen := f.CompressedSize64
		if off < 0 || off > size || clen > uint64(size-off) {
			return nil, invalidf(what, "record %q: %d bytes at offset %d run past the end of the %d-byte file", f.Name, clen, off, size)
		}
		rec := ZipRecord{Name: f.Name, Range: Range{Offset: off, Length: int64(clen)}}
		if f.Method != zip.Store {
			rec.Compressed = true
			rec.UncompressedLength = int64(min(f.UncompressedSize64, 1<<62))
		} else if f.UncompressedSize64 != clen {
			return nil, invalidf(what, "stored record %q: compressed size %d differs from size %d", f.Name, clen, f.UncompressedSize64)
		}
		z.Records = append(z.Records, rec)
	}
	if len(z.Records) > 0 {
		if folder, _, ok := strings.Cut(z.Records[0].Name, "/"); ok {
			z.Archive = folder
			for _, rec := range z.Records {
				if !strings.HasPrefix(rec.Name, folder+"/") {
					z.Archive = ""
					break
				}
			}
		}
	}
	for _, rec := range z.Records {
		if z.Archive != "" && rec.Name == z.Archive+"/data.pkl" {
			z.Torch = true
		}
	}
	return z, nil
}

// zipDirectory reads the record count and central directory size from the
// end-of-central-directory record (zip64's when the classic one defers to
// it). ok is false when there is none to find; archive/zip then says what
// is wrong.
func zipDirectory(r io.ReaderAt, size int64) (records, dirBytes uint64, ok bool) {
	const eocdLen, maxComment = 22, 65535
	tail := min(size, eocdLen+maxComment)
	if tail < eocdLen {
		return 0, 0, false
	}
	buf := make([]byte, tail)
	if err := readAt(r, buf, size-tail); err != nil {
		return 0, 0, false
	}
	i := bytes.LastIndex(buf[:len(buf)-eocdLen+4], []byte("PK\x05\x06"))
	if i < 0 {
		return 0, 0, false
	}
	records = uint64(binary.LittleEndian.Uint16(buf[i+10:]))
	dirBytes = uint64(binary.LittleEndian.Uint32(buf[i+12:]))
	if records != 0xffff && dirBytes != 0xffffffff {
		return records, dirBytes, true
	}
	// zip64: a locator just before the record points at the zip64 record.
	loc := i - 20
	if loc < 0 || string(buf[loc:loc+4]) != "PK\x06\x07" {
		return records, dirBytes, true
	}
	off := binary.LittleEndian.Uint64(buf[loc+8:])
	var rec [56]byte
	if off > uint64(size) || uint64(size)-off < uint64(len(rec)) || readAt(r, rec[:], int64(off)) != nil || string(rec[:4]) != "PK\x06\x06" {
		return 0, 0, false
	}
	return binary.LittleEndian.Uint64(rec[32:]), binary.LittleEndian.Uint64(rec[40:]), true
}

// String describes the archive briefly, for logs.
func (z *TorchZip) String() string {
	return fmt.Sprintf("torch zip %q, %d records", z.Archive, len(z.Records))
}
