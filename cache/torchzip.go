package cache

import (
	"archive/zip"
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

// torchZipMaxRecords bounds the records we index; torch.save writes a few
// per tensor storage.
const torchZipMaxRecords = 1 << 20

// ParseTorchZip indexes a zip archive from its central directory (zip64
// included), taking each record's data offset from its local header.
func ParseTorchZip(r io.ReaderAt, size int64) (*TorchZip, error) {
	const what = "torch zip"
	zr, err := zip.NewReader(r, size)
	if err != nil && !errors.Is(err, zip.ErrInsecurePath) {
		return nil, invalidf(what, "%s", strings.TrimPrefix(err.Error(), "zip: "))
	}
	if len(zr.File) > torchZipMaxRecords {
		return nil, invalidf(what, "%d records exceed the limit of %d", len(zr.File), torchZipMaxRecords)
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

// String describes the archive briefly, for logs.
func (z *TorchZip) String() string {
	return fmt.Sprintf("torch zip %q, %d records", z.Archive, len(z.Records))
}
