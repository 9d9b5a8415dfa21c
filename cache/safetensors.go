package cache

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/bits"
	"sort"
	"strconv"
	"unicode/utf8"
)

// safetensorsFormatMaxHeader is the safetensors library's MAX_HEADER_SIZE:
// a longer header is no safetensors file at all.
const safetensorsFormatMaxHeader = 100_000_000

// SafetensorsMaxHeader is the longest header gdsfs indexes (16 MiB, about
// 300,000 tensors; real checkpoints' headers are well below 1 MiB). Parsing
// costs about 5 times the header in memory, so the format's own limit of
// 100 MB would let one crafted file cost the daemon ~1 GB per parse. A file
// beyond it is still served through the mount and by READ; it has no index
// (user.gdsfs.info says why).
const SafetensorsMaxHeader = 16 << 20

// safetensorsDtypeBits is the element size of every dtype the safetensors
// format defines.
var safetensorsDtypeBits = map[string]uint64{
	"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
	"F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
	"I16": 16, "U16": 16, "F16": 16, "BF16": 16,
	"I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

// Safetensors is the index of a safetensors file.
type Safetensors struct {
	// HeaderLength is the JSON header's length (the file's first 8 bytes).
	HeaderLength int64 `json:"header_length"`
	// DataOffset is where the byte buffer starts (8 + HeaderLength).
	DataOffset int64 `json:"data_offset"`
	// Metadata is the header's "__metadata__" (nil when absent).
	Metadata map[string]string `json:"metadata,omitempty"`
	// Tensors in file order, with absolute offsets.
	Tensors []Tensor `json:"tensors"`
}

// Tensor is one safetensors tensor.
type Tensor struct {
	Name  string  `json:"name"`
	Dtype string  `json:"dtype"`
	Shape []int64 `json:"shape"`
	Range
}

// ParseSafetensors indexes a safetensors file, checking it as the
// safetensors library does: known dtypes, lengths that match shapes, and a
// buffer covered exactly, without holes or overlaps.
func ParseSafetensors(r io.ReaderAt, size int64) (*Safetensors, error) {
	const what = "safetensors file"
	if size < 8 {
		return nil, invalidf(what, "%d bytes is too short for the 8-byte header length", size)
	}
	var lenBuf [8]byte
	if err := readAt(r, lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("cache: read safetensors header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	switch {
	case n > safetensorsFormatMaxHeader:
		return nil, invalidf(what, "header length %d exceeds the format's limit of %d bytes", n, safetensorsFormatMaxHeader)
	case n > SafetensorsMaxHeader:
		return nil, invalidf(what, "header of %d bytes exceeds gdsfs's index limit of 16 MiB (%d bytes); the file is still readable, but has no index", n, SafetensorsMaxHeader)
	case n > uint64(size-8):
		return nil, invalidf(what, "header length %d runs past the end of the %d-byte file", n, size)
	case n < 2:
		return nil, invalidf(what, "header length %d is too short for a JSON object", n)
	}
	hdr := make([]byte, n)
	if err := readAt(r, hdr, 8); err != nil {
		return nil, fmt.Errorf("cache: read safetensors header: %w", err)
	}
	if hdr[0] != '{' {
		return nil, invalidf(what, "header does not start with '{'")
	}
	if !utf8.Valid(hdr) {
		return nil, invalidf(what, "header is not UTF-8")
	}
	st := &Safetensors{HeaderLength: int64(n), DataOffset: 8 + int64(n)}
	bufLen := uint64(size) - 8 - n
	if err := st.decodeHeader(hdr, bufLen); err != nil {
		return nil, err
	}
	return st, nil
}

func (st *Safetensors) decodeHeader(hdr []byte, bufLen uint64) error {
	const what = "safetensors file"
	dec := json.NewDecoder(bytes.NewReader(hdr))
	dec.UseNumber()
	if _, err := dec.Token(); err != nil {
		return invalidf(what, "header JSON: %v", err)
	}
	type info struct {
		Dtype       string        `json:"dtype"`
		Shape       []json.Number `json:"shape"`
		DataOffsets []json.Number `json:"data_offsets"`
	}
	seen := make(map[string]bool)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return invalidf(what, "header JSON: %v", err)
		}
		name, ok := tok.(string)
		if !ok {
			return invalidf(what, "header JSON: key is not a string")
		}
		if seen[name] {
			return invalidf(what, "duplicate key %q in header", name)
		}
		seen[name] = true
		if name == "__metadata__" {
			var md map[string]string
			if err := dec.Decode(&md); err != nil {
				return invalidf(what, "__metadata__ must map strings to strings: %v", err)
			}
			st.Metadata = md
			continue
		}
		var in info
		if err := dec.Decode(&in); err != nil {
			return invalidf(what, "tensor %q: %v", name, err)
		}
		eltBits, ok := safetensorsDtypeBits[in.Dtype]
		if !ok {
			return invalidf(what, "tensor %q: unknown dtype %q", name, in.Dtype)
		}
		if len(in.DataOffsets) != 2 {
			return invalidf(what, "tensor %q: data_offsets must be [begin, end]", name)
		}
		begin, err1 := parseUint(in.DataOffsets[0])
		end, err2 := parseUint(in.DataOffsets[1])
		if err1 != nil || err2 != nil || begin > end || end > bufLen {
			return invalidf(what, "tensor %q: data_offsets %v outside the %d-byte buffer", name, in.DataOffsets, bufLen)
		}
		shape := make([]int64, len(in.Shape))
		nbits := eltBits
		for i, d := range in.Shape {
			v, err := parseUint(d)
			if err != nil || v > 1<<62 {
				return invalidf(what, "tensor %q: bad shape %v", name, in.Shape)
			}
			shape[i] = int64(v)
			hi, lo := bits.Mul64(nbits, v)
			if hi != 0 {
				return invalidf(what, "tensor %q: shape %v overflows", name, in.Shape)
			}
			nbits = lo
		}
		if nbits%8 != 0 || nbits/8 != end-begin {
			return invalidf(what, "tensor %q: %s%v needs %d bits but data_offsets hold %d bytes", name, in.Dtype, shape, nbits, end-begin)
		}
		st.Tensors = append(st.Tensors, Tensor{
			Name: name, Dtype: in.Dtype, Shape: shape,
			Range: Range{Offset: st.DataOffset + int64(begin), Length: int64(end - begin)},
		})
	}
	if _, err := dec.Token(); err != nil {
		return invalidf(what, "header JSON: %v", err)
	}
	rest := hdr[dec.InputOffset():]
	if len(bytes.TrimLeft(rest, " \t\r\n")) != 0 {
		return invalidf(what, "bytes after the header's JSON object")
	}
	// The buffer must be covered exactly, in offset order.
	sort.Sort(byOffset(st.Tensors))
	var at uint64
	for _, t := range st.Tensors {
		b := uint64(t.Offset - st.DataOffset)
		if b != at {
			return invalidf(what, "tensor %q starts at buffer offset %d, expected %d (holes and overlaps are not allowed)", t.Name, b, at)
		}
		at += uint64(t.Length)
	}
	if at != bufLen {
		return invalidf(what, "tensors cover %d of the %d buffer bytes", at, bufLen)
	}
	if st.Tensors == nil {
		st.Tensors = []Tensor{}
	}
	return nil
}

// byOffset orders tensors by offset, zero-length ones first, then by name,
// so the order is stable and the coverage check sees empty tensors where
// they sit.
type byOffset []Tensor

func (s byOffset) Len() int      { return len(s) }
func (s byOffset) Swap(i, j int) { s[i], s[j] = s[j], s[i] }
func (s byOffset) Less(i, j int) bool {
	if s[i].Offset != s[j].Offset {
		return s[i].Offset < s[j].Offset
	}
	if s[i].Length != s[j].Length {
		return s[i].Length < s[j].Length
	}
	return s[i].Name < s[j].Name
}

// parseUint parses a JSON number that must be a non-negative integer.
func parseUint(n json.Number) (uint64, error) {
	v, err := strconv.ParseUint(string(n), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("not a non-negative integer: %s", n)
	}
	return v, nil
}
