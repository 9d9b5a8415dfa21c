package cache

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"unicode/utf8"
)

// The tar columns form (docs/index-format.md, "Tar columns"): a tar's index
// with its per-sample arrays as packed little-endian integer columns, so
// that a client decodes a shard's samples in one pass per column instead of
// parsing one JSON object per sample and field. Everything but the samples
// travels as the head: the JSON document with "samples" empty.
const (
	colsMagic   = "GDXC"
	colsVersion = 1
	colsHeader  = 48
	// colsMaxCount bounds every count of a columns document (samples,
	// fields, names, links): above any tar the parser indexes
	// (tarMaxMembers), far below what would overflow the decoder's sizes.
	colsMaxCount = 1 << 22
)

// Widths of the columns, in the header's widths array (bytes 40..47).
const (
	colKeyEnd = iota
	colFieldEnd
	colNameID
	colOffset
	colLength
	colNpy
	colNameEnd
	colLink
	colCount
)

// ErrNoColumns reports an index whose format has no columns form (only tar
// has): INDEX then serves the JSON.
var ErrNoColumns = errors.New("cache: no columns form for this format")

// ErrBadColumns is wrapped by every DecodeTarColumns error.
var ErrBadColumns = errors.New("cache: malformed tar columns document")

// ColumnsHash returns the tar columns document of the index and its FNV-1a
// 64 hash (the generation of the INDEX pages that serve it), computed once;
// ErrNoColumns for formats other than tar. Callers must not modify the
// bytes.
func (x *Index) ColumnsHash() ([]byte, uint64, error) {
	if x.Tar == nil {
		return nil, 0, ErrNoColumns
	}
	x.colsOnce.Do(func() {
		x.cols, x.colsErr = x.encodeColumns()
		h := fnv.New64a()
		h.Write(x.cols) // never fails
		x.colsHash = h.Sum64()
	})
	return x.cols, x.colsHash, x.colsErr
}

// widthOf is the fewest bytes of 1, 2, 4, 8 that hold v.
func widthOf(v uint64) uint8 {
	switch {
	case v <= math.MaxUint8:
		return 1
	case v <= math.MaxUint16:
		return 2
	case v <= math.MaxUint32:
		return 4
	}
	return 8
}

func putWidth(b []byte, w uint8, v uint64) []byte {
	switch w {
	case 1:
		return append(b, byte(v))
	case 2:
		return binary.LittleEndian.AppendUint16(b, uint16(v))
	case 4:
		return binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	return binary.LittleEndian.AppendUint64(b, v)
}

func getWidth(b []byte, w uint8, i int) uint64 {
	switch w {
	case 1:
		return uint64(b[i])
	case 2:
		return uint64(binary.LittleEndian.Uint16(b[2*i:]))
	case 4:
		return uint64(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return binary.LittleEndian.Uint64(b[8*i:])
}

// colsLink is one hard-link field: its index among all fields and the
// member it links to.
type colsLink struct {
	field int
	link  string
}

func (x *Index) encodeColumns() ([]byte, error) {
	t := x.Tar
	// The head: the JSON document with "samples" empty.
	body, err := (&Tar{Members: t.Members, Samples: []TarSample{}, Other: t.Other, Skipped: t.Skipped, NpyHeaders: t.NpyHeaders}).MarshalJSON()
	if err != nil {
		return nil, fmt.Errorf("cache: encode tar columns head: %w", err)
	}
	head := envelope(x.Format, x.FileSize, body)

	nameID := map[string]int{}
	var names []string
	var keyBytes, nameBytes, linkBytes, fields int
	var maxOff, maxLen, maxNpy uint64
	var links []colsLink
	for i := range t.Samples {
		s := &t.Samples[i]
		keyBytes += len(s.Key)
		for j := range s.Fields {
			f := &s.Fields[j]
			if _, ok := nameID[f.Field]; !ok {
				nameID[f.Field] = len(names)
				names = append(names, f.Field)
				nameBytes += len(f.Field)
			}
			if f.Offset < 0 || f.Length < 0 {
				return nil, fmt.Errorf("BUG: cache: tar columns: field %q has a negative range", f.Name)
			}
			maxOff = max(maxOff, uint64(f.Offset))
			maxLen = max(maxLen, uint64(f.Length))
			maxNpy = max(maxNpy, uint64(f.Npy))
			if f.Link != "" {
				links = append(links, colsLink{fields, f.Link})
				linkBytes += len(f.Link)
			}
			fields++
		}
	}
	if len(t.Samples) > colsMaxCount || fields > colsMaxCount {
		return nil, fmt.Errorf("BUG: cache: tar columns: %d samples, %d fields exceed %d", len(t.Samples), fields, colsMaxCount)
	}
	var w [colCount]uint8
	w[colKeyEnd] = widthOf(uint64(keyBytes))
	w[colFieldEnd] = widthOf(uint64(fields))
	w[colNameID] = widthOf(uint64(max(len(names)-1, 0)))
	w[colOffset] = widthOf(maxOff)
	w[colLength] = widthOf(maxLen)
	w[colNpy] = widthOf(maxNpy)
	w[colNameEnd] = widthOf(uint64(nameBytes))
	w[colLink] = widthOf(uint64(max(fields, linkBytes)))

	size := colsHeader + len(head) +
		len(names)*int(w[colNameEnd]) + nameBytes +
		len(t.Samples)*int(w[colKeyEnd]+w[colFieldEnd]) + keyBytes +
		fields*int(w[colNameID]+w[colOffset]+w[colLength]+w[colNpy]) +
		2*len(links)*int(w[colLink]) + linkBytes
	b := make([]byte, 0, size)
	b = append(b, colsMagic...)
	for _, v := range []int{colsVersion, len(head), len(t.Samples), fields, len(names), len(links), keyBytes, nameBytes, linkBytes} {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	b = append(b, w[:]...)
	b = append(b, head...)
	end := 0
	for _, n := range names {
		end += len(n)
		b = putWidth(b, w[colNameEnd], uint64(end))
	}
	for _, n := range names {
		b = append(b, n...)
	}
	end = 0
	for i := range t.Samples {
		end += len(t.Samples[i].Key)
		b = putWidth(b, w[colKeyEnd], uint64(end))
	}
	for i := range t.Samples {
		b = append(b, t.Samples[i].Key...)
	}
	end = 0
	for i := range t.Samples {
		end += len(t.Samples[i].Fields)
		b = putWidth(b, w[colFieldEnd], uint64(end))
	}
	for _, col := range []int{colNameID, colOffset, colLength, colNpy} {
		for i := range t.Samples {
			for j := range t.Samples[i].Fields {
				f := &t.Samples[i].Fields[j]
				var v uint64
				switch col {
				case colNameID:
					v = uint64(nameID[f.Field])
				case colOffset:
					v = uint64(f.Offset)
				case colLength:
					v = uint64(f.Length)
				case colNpy:
					v = uint64(f.Npy)
				}
				b = putWidth(b, w[col], v)
			}
		}
	}
	for _, l := range links {
		b = putWidth(b, w[colLink], uint64(l.field))
	}
	end = 0
	for _, l := range links {
		end += len(l.link)
		b = putWidth(b, w[colLink], uint64(end))
	}
	for _, l := range links {
		b = append(b, l.link...)
	}
	if len(b) != size {
		return nil, fmt.Errorf("BUG: cache: tar columns: wrote %d bytes, sized %d", len(b), size)
	}
	return b, nil
}

// colsReader takes the sections of a columns document in order.
type colsReader struct {
	b   []byte
	off int
}

// take returns the next n items of w bytes each, or false when the
// document is shorter (n and w are bounded by the caller, so n*w does not
// overflow).
func (r *colsReader) take(n int, w uint8) ([]byte, bool) {
	nb := n * int(w)
	if nb > len(r.b)-r.off {
		return nil, false
	}
	s := r.b[r.off : r.off+nb]
	r.off += nb
	return s, true
}

func badColumns(why string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadColumns, fmt.Sprintf(why, args...))
}

// ends checks a column of n cumulative ends (width w) over total bytes or
// items: non-decreasing, the last one total (0 items: total 0).
func ends(col []byte, w uint8, n, total int, what string) error {
	prev := uint64(0)
	for i := 0; i < n; i++ {
		v := getWidth(col, w, i)
		if v < prev || v > uint64(total) {
			return badColumns("%s end %d (%d) is out of order or past %d", what, i, v, total)
		}
		prev = v
	}
	if prev != uint64(total) {
		return badColumns("%s ends at %d, not at %d", what, prev, total)
	}
	return nil
}

// DecodeTarColumns decodes a tar columns document (the INDEX reply of form
// ctl.IndexFormTarColumns) into the index it was encoded from: its JSON() is
// the JSON document the daemon would have served. Every count is bounded
// and every index checked; a malformed document is an error wrapping
// ErrBadColumns, never a panic.
func DecodeTarColumns(doc []byte) (*Index, error) {
	if len(doc) < colsHeader || string(doc[:4]) != colsMagic {
		return nil, badColumns("no %q header", colsMagic)
	}
	var h [9]int
	for i := range h {
		v := binary.LittleEndian.Uint32(doc[4+4*i:])
		if i > 0 && (uint64(v) > uint64(len(doc)) || (i >= 2 && i <= 5 && v > colsMaxCount)) {
			return nil, badColumns("header field %d (%d) exceeds the document or the bound %d", i, v, colsMaxCount)
		}
		h[i] = int(v)
	}
	if h[0] != colsVersion {
		return nil, badColumns("version %d, this client knows %d", h[0], colsVersion)
	}
	headLen, nSamples, nFields, nNames, nLinks, keyBytes, nameBytes, linkBytes := h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]
	var w [colCount]uint8
	copy(w[:], doc[40:48])
	for i, v := range w {
		if v != 1 && v != 2 && v != 4 && v != 8 {
			return nil, badColumns("column %d has width %d (1, 2, 4 or 8)", i, v)
		}
	}
	if nSamples > nFields || nNames > nFields || nLinks > nFields {
		return nil, badColumns("%d samples, %d names, %d links for %d fields", nSamples, nNames, nLinks, nFields)
	}
	r := &colsReader{b: doc, off: colsHeader}
	head, ok1 := r.take(headLen, 1)
	nameEnd, ok2 := r.take(nNames, w[colNameEnd])
	nameBlob, ok3 := r.take(nameBytes, 1)
	keyEnd, ok4 := r.take(nSamples, w[colKeyEnd])
	keyBlob, ok5 := r.take(keyBytes, 1)
	fieldEnd, ok6 := r.take(nSamples, w[colFieldEnd])
	nameIDs, ok7 := r.take(nFields, w[colNameID])
	offs, ok8 := r.take(nFields, w[colOffset])
	lens, ok9 := r.take(nFields, w[colLength])
	npys, ok10 := r.take(nFields, w[colNpy])
	linkField, ok11 := r.take(nLinks, w[colLink])
	linkEnd, ok12 := r.take(nLinks, w[colLink])
	linkBlob, ok13 := r.take(linkBytes, 1)
	if !(ok1 && ok2 && ok3 && ok4 && ok5 && ok6 && ok7 && ok8 && ok9 && ok10 && ok11 && ok12 && ok13) {
		return nil, badColumns("%d bytes end inside a column", len(doc))
	}
	if r.off != len(doc) {
		return nil, badColumns("%d bytes after the last column", len(doc)-r.off)
	}
	for _, e := range []struct {
		col      []byte
		w        uint8
		n, total int
		what     string
	}{
		{nameEnd, w[colNameEnd], nNames, nameBytes, "name"},
		{keyEnd, w[colKeyEnd], nSamples, keyBytes, "key"},
		{fieldEnd, w[colFieldEnd], nSamples, nFields, "sample fields"},
		{linkEnd, w[colLink], nLinks, linkBytes, "link"},
	} {
		if err := ends(e.col, e.w, e.n, e.total, e.what); err != nil {
			return nil, err
		}
	}
	for _, blob := range [][]byte{nameBlob, keyBlob, linkBlob} {
		if !utf8.Valid(blob) {
			return nil, badColumns("names are not UTF-8")
		}
	}

	var env struct {
		Format   Format `json:"format"`
		Version  int    `json:"version"`
		FileSize int64  `json:"file_size"`
	}
	t := &Tar{}
	if err := json.Unmarshal(head, &env); err != nil {
		return nil, badColumns("head: %v", err)
	}
	var rest struct {
		Members    int             `json:"members"`
		Samples    json.RawMessage `json:"samples"`
		Other      []TarMember     `json:"other"`
		Skipped    []TarSkipped    `json:"skipped"`
		NpyHeaders []NpyHeader     `json:"npy_headers"`
	}
	if err := json.Unmarshal(head, &rest); err != nil {
		return nil, badColumns("head: %v", err)
	}
	if env.Format != FormatTar || env.Version != IndexVersion || env.FileSize < 0 || strings.TrimSpace(string(rest.Samples)) != "[]" {
		return nil, badColumns("head is not a version %d tar index with no samples", IndexVersion)
	}
	t.Members, t.Other, t.Skipped, t.NpyHeaders = rest.Members, rest.Other, rest.Skipped, rest.NpyHeaders

	names := make([]string, nNames)
	prev := 0
	for i := range names {
		e := int(getWidth(nameEnd, w[colNameEnd], i))
		names[i] = string(nameBlob[prev:e])
		prev = e
	}
	linkOf := make(map[int]string, nLinks)
	prev, prevField := 0, -1
	for i := 0; i < nLinks; i++ {
		fi := getWidth(linkField, w[colLink], i)
		e := int(getWidth(linkEnd, w[colLink], i))
		if fi >= uint64(nFields) || int(fi) <= prevField || e == prev {
			return nil, badColumns("link %d names field %d (of %d, in order, non-empty)", i, fi, nFields)
		}
		linkOf[int(fi)] = string(linkBlob[prev:e])
		prev, prevField = e, int(fi)
	}
	t.Samples = make([]TarSample, nSamples)
	prevKey, first := 0, 0
	for i := range t.Samples {
		ke := int(getWidth(keyEnd, w[colKeyEnd], i))
		fe := int(getWidth(fieldEnd, w[colFieldEnd], i))
		key := string(keyBlob[prevKey:ke])
		fs := make([]TarField, 0, fe-first)
		for j := first; j < fe; j++ {
			id := getWidth(nameIDs, w[colNameID], j)
			off, n := getWidth(offs, w[colOffset], j), getWidth(lens, w[colLength], j)
			npy := getWidth(npys, w[colNpy], j)
			if id >= uint64(nNames) || off > math.MaxInt64 || n > math.MaxInt64-off || npy > uint64(len(t.NpyHeaders)) {
				return nil, badColumns("field %d: name %d of %d, range %d+%d, npy %d of %d", j, id, nNames, off, n, npy, len(t.NpyHeaders))
			}
			field := names[id]
			fs = append(fs, TarField{Field: field, TarMember: TarMember{Name: key + "." + field, Range: Range{Offset: int64(off), Length: int64(n)}, Link: linkOf[j]}, Npy: int(npy)})
		}
		t.Samples[i] = TarSample{Key: key, Fields: fs}
		prevKey, first = ke, fe
	}
	return &Index{Format: FormatTar, FileSize: env.FileSize, Tar: t}, nil
}
