package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"strconv"
	"strings"
	"sync"
)

// Format names an indexed file layout; it is the "format" tag of the JSON.
type Format string

// The formats cache indexes.
const (
	FormatTar         Format = "tar"
	FormatMDS         Format = "mds"
	FormatSafetensors Format = "safetensors"
	FormatTorchZip    Format = "torchzip"
	FormatNpy         Format = "npy"
)

// IndexVersion is the "version" of the index JSON schema (docs/index-format.md).
const IndexVersion = 1

var (
	// ErrNoIndex reports a file that is none of the indexed formats (the
	// xattr answers ENODATA).
	ErrNoIndex = errors.New("cache: no index for this file (not a tar, MDS, safetensors, torch zip or npy file)")
	// ErrInvalid is wrapped by every "not a valid <format>" parse error.
	ErrInvalid = errors.New("cache: invalid shard")
	// ErrNotFound reports a name that Resolve does not know.
	ErrNotFound = errors.New("cache: no such name in index")
	// ErrNotAddressable reports a name whose bytes are in the file but cannot
	// be served as one plain byte range (compressed zip record, sparse tar
	// member).
	ErrNotAddressable = errors.New("cache: not addressable by byte range")
)

// invalidError is a parse error: "cache: not a valid <format>: <why>".
type invalidError struct {
	format string
	why    string
}

func (e *invalidError) Error() string {
	return "cache: not a valid " + e.format + ": " + e.why
}

func (e *invalidError) Unwrap() error { return ErrInvalid }

func invalidf(format, why string, args ...any) error {
	return &invalidError{format: format, why: fmt.Sprintf(why, args...)}
}

// Range is a byte range of the backing file.
type Range struct {
	Offset int64 `json:"offset"`
	Length int64 `json:"length"`
}

// Index is one parsed file. Exactly one of the format fields is set. An Index
// is immutable once built and safe for concurrent use.
type Index struct {
	Format Format
	// FileSize is the size of the file the index was parsed from.
	FileSize int64

	Tar         *Tar
	MDS         *MDS
	MDSDataset  *MDSDataset
	Safetensors *Safetensors
	TorchZip    *TorchZip
	Npy         *Npy

	jsonOnce sync.Once
	json     []byte
	jsonHash uint64
	jsonErr  error

	colsOnce sync.Once // ColumnsHash (tar only)
	cols     []byte
	colsHash uint64
	colsErr  error

	namesOnce sync.Once
	names     map[string]nameEntry
}

// nameEntry is what Resolve answers for one name.
type nameEntry struct {
	r   Range
	err error // ErrNotAddressable (wrapped) when the name exists but has no plain range
}

// body returns the format-specific part of the index.
func (x *Index) body() any {
	switch {
	case x.Tar != nil:
		return x.Tar
	case x.MDS != nil:
		return x.MDS
	case x.MDSDataset != nil:
		return x.MDSDataset
	case x.Safetensors != nil:
		return x.Safetensors
	case x.TorchZip != nil:
		return x.TorchZip
	case x.Npy != nil:
		return x.Npy
	}
	return nil
}

// JSON returns the index serialised as the documented envelope. The bytes
// are computed once and shared: callers must not modify them.
func (x *Index) JSON() ([]byte, error) {
	x.jsonOnce.Do(x.encode)
	return x.json, x.jsonErr
}

// JSONHash returns JSON() and its FNV-1a 64 hash (the generation of the
// INDEX pages that serve it), both computed once.
func (x *Index) JSONHash() ([]byte, uint64, error) {
	x.jsonOnce.Do(x.encode)
	return x.json, x.jsonHash, x.jsonErr
}

func (x *Index) encode() {
	x.json, x.jsonErr = x.marshal()
	h := fnv.New64a()
	h.Write(x.json) // never fails
	x.jsonHash = h.Sum64()
}

func (x *Index) marshal() ([]byte, error) {
	var body []byte
	var err error
	switch {
	case x.Tar != nil:
		// Hand-written encoders, called directly: json.Marshal would
		// re-scan their output, which costs more than writing it.
		body, err = x.Tar.MarshalJSON()
	case x.MDS != nil:
		body, err = x.MDS.MarshalJSON()
	default:
		body, err = json.Marshal(x.body())
	}
	if err != nil {
		return nil, fmt.Errorf("cache: encode %s index: %w", x.Format, err)
	}
	if len(body) < 2 || body[0] != '{' {
		return nil, fmt.Errorf("BUG: cache: %s index body is not a JSON object", x.Format)
	}
	return envelope(x.Format, x.FileSize, body), nil
}

// envelope is the index document of a format's body (a JSON object): the
// envelope fields go first so a reader can dispatch on "format" before the
// (possibly large) body.
func envelope(f Format, fileSize int64, body []byte) []byte {
	head := fmt.Sprintf(`{"format":%q,"version":%d,"file_size":%d`, f, IndexVersion, fileSize)
	out := make([]byte, 0, len(head)+len(body)+1)
	out = append(out, head...)
	if len(body) > 2 {
		out = append(out, ',')
	}
	return append(out, body[1:]...)
}

// Resolve returns the byte range of name, using the naming of the index's
// format (docs/index-format.md, "Names"): a tar member name or
// "sample/<i>/<field>", a safetensors tensor name, a zip record name (with or
// without the archive folder), an MDS "sample/<i>" or "sample/<i>/<column>",
// or "data" for npy. Unknown names give ErrNotFound; names without a plain
// range (compressed records, sparse members) give ErrNotAddressable.
func (x *Index) Resolve(name string) (offset, length int64, err error) {
	x.namesOnce.Do(x.buildNames)
	if e, ok := x.names[name]; ok {
		return e.r.Offset, e.r.Length, e.err
	}
	if r, ok, err := x.resolveSample(name); ok {
		return r.Offset, r.Length, err
	}
	if x.TorchZip != nil && x.TorchZip.Archive != "" {
		if e, ok := x.names[x.TorchZip.Archive+"/"+name]; ok {
			return e.r.Offset, e.r.Length, e.err
		}
	}
	return 0, 0, fmt.Errorf("%w: %q in %s index", ErrNotFound, name, x.Format)
}

// resolveSample answers "sample/<i>[/<field>]" for tar and MDS shards
// without a per-name map entry (samples are numbered, the map would double
// the index's memory).
func (x *Index) resolveSample(name string) (Range, bool, error) {
	rest, ok := strings.CutPrefix(name, "sample/")
	if !ok || (x.Tar == nil && x.MDS == nil) {
		return Range{}, false, nil
	}
	num, field, _ := strings.Cut(rest, "/")
	i, err := strconv.Atoi(num)
	if err != nil || i < 0 {
		return Range{}, false, nil
	}
	notFound := fmt.Errorf("%w: %q in %s index", ErrNotFound, name, x.Format)
	if x.Tar != nil {
		if i >= len(x.Tar.Samples) {
			return Range{}, true, notFound
		}
		s := &x.Tar.Samples[i]
		if field == "" {
			return s.span(), true, nil
		}
		for _, f := range s.Fields {
			if f.Field == field {
				return f.Range, true, nil
			}
		}
		return Range{}, true, notFound
	}
	if i >= len(x.MDS.Samples) {
		return Range{}, true, notFound
	}
	s := &x.MDS.Samples[i]
	if field == "" {
		return s.Range, true, nil
	}
	for c, col := range x.MDS.Columns {
		if col.Name == field && c < len(s.Columns) {
			return s.Columns[c], true, nil
		}
	}
	return Range{}, true, notFound
}

func (x *Index) buildNames() {
	names := make(map[string]nameEntry)
	switch {
	case x.Tar != nil:
		for _, s := range x.Tar.Samples {
			for _, f := range s.Fields {
				names[f.Name] = nameEntry{r: f.Range}
			}
		}
		for _, m := range x.Tar.Other {
			names[m.Name] = nameEntry{r: m.Range}
		}
		for _, m := range x.Tar.Skipped {
			if _, dup := names[m.Name]; !dup {
				names[m.Name] = nameEntry{err: fmt.Errorf("%w: tar member %q: %s", ErrNotAddressable, m.Name, m.Reason)}
			}
		}
	case x.Safetensors != nil:
		for _, t := range x.Safetensors.Tensors {
			names[t.Name] = nameEntry{r: t.Range}
		}
	case x.TorchZip != nil:
		for _, r := range x.TorchZip.Records {
			e := nameEntry{r: r.Range}
			if r.Compressed {
				e.err = fmt.Errorf("%w: zip record %q is compressed", ErrNotAddressable, r.Name)
			}
			names[r.Name] = e
		}
	case x.Npy != nil:
		names["data"] = nameEntry{r: Range{Offset: x.Npy.DataOffset, Length: x.Npy.DataLength}}
	}
	x.names = names
}

// cost estimates the index's memory footprint in bytes (its ristretto cost).
func (x *Index) cost() int64 {
	js, _ := x.JSON()
	// The JSON is cached alongside the parsed structs, which take about as
	// much again; the name map is built on demand and is smaller than both.
	// A tar's columns form (ColumnsHash, on demand) is smaller than its
	// JSON: counted as a JSON more.
	n := 3 * int64(len(js))
	if x.Tar != nil {
		n += int64(len(js))
	}
	return 256 + n
}

// Parse detects the format of the file r (size bytes, named name: only the
// base name and extension are used, as a hint) and parses it.
func Parse(r io.ReaderAt, size int64, name string) (*Index, error) {
	f, err := Detect(r, size, name)
	if err != nil {
		return nil, err
	}
	x := &Index{Format: f, FileSize: size}
	switch f {
	case FormatTar:
		x.Tar, err = ParseTar(r, size)
	case FormatSafetensors:
		x.Safetensors, err = ParseSafetensors(r, size)
	case FormatTorchZip:
		x.TorchZip, err = ParseTorchZip(r, size)
	case FormatNpy:
		x.Npy, err = ParseNpy(r, size)
	case FormatMDS:
		if isMDSIndexName(name) {
			x.MDSDataset, err = ParseMDSIndex(r, size)
		} else {
			x.MDS, err = ParseMDS(r, size)
		}
	}
	if err != nil {
		return nil, err
	}
	return x, nil
}

// readAt fills b from r at off. Unlike io.ReaderAt, a full read that also
// reports io.EOF (allowed at the end of the file) is a success, and a short
// one is io.ErrUnexpectedEOF (the file shrank under us).
func readAt(r io.ReaderAt, b []byte, off int64) error {
	if len(b) == 0 {
		return nil
	}
	n, err := r.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
