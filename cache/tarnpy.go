package cache

import (
	"encoding/binary"
	"strconv"
	"strings"
)

// NpyHeader is the geometry of a tar member's .npy array, as the Python
// client's own header parse (gdsfs._layout.parse_npy_header) reads it: the
// array's bytes start HeaderLength bytes into the member.
type NpyHeader struct {
	HeaderLength int64   `json:"header_length"`
	Dtype        string  `json:"dtype"`
	Shape        []int64 `json:"shape"`
	FortranOrder bool    `json:"fortran_order"`
}

// Bounds of the tar index's npy geometry. npyMemberHead is what the client
// reads of a member to parse its header itself (a header that does not fit
// gets no geometry, as the client then fails it). npyMaxDims is numpy's
// dimension limit, npyMaxDtype bounds a dtype string; npyTableBytes bounds
// the table of distinct headers (its JSON), npyRawBytes the header bytes
// remembered to skip parsing a header seen before. Members past either
// bound get no geometry: the client reads their headers as before.
const (
	npyMemberHead = 4096
	npyMaxDims    = 64
	npyMaxDtype   = 32
	npyTableBytes = 8 << 20
	npyRawBytes   = 1 << 20
)

// npyTable collects a tar's distinct npy headers while it is parsed.
type npyTable struct {
	geoList[NpyHeader]
	byRaw    map[string]int // header bytes -> index into list, or -1: no geometry
	rawBytes int
}

// isNpyField reports whether a sample field holds a .npy array by its name,
// as the client decides (the field's last dot-separated part is "npy").
func isNpyField(field string) bool {
	return field == "npy" || strings.HasSuffix(field, ".npy")
}

// member returns 1 + the table index of the geometry of a member whose
// first bytes are head (at most npyMemberHead of its length bytes), or 0
// when the member gets none (not a header the client would parse the same
// way, or the table is full).
func (t *npyTable) member(head []byte, length int64) int {
	end, ok := npyHeaderEnd(head)
	if !ok {
		return 0
	}
	raw := head[:end]
	if k, ok := t.byRaw[string(raw)]; ok {
		return k + 1
	}
	k := -1
	if h, ok := parseNpyMember(raw, length); ok {
		k = t.add(h)
	}
	if t.rawBytes+len(raw) <= npyRawBytes {
		if t.byRaw == nil {
			t.byRaw = make(map[string]int)
		}
		t.byRaw[string(raw)] = k
		t.rawBytes += len(raw)
	}
	return k + 1
}

// add files h in the table and returns its index, or -1 when the table is full.
func (t *npyTable) add(h NpyHeader) int {
	key := make([]byte, 0, 32+8*len(h.Shape))
	key = strconv.AppendInt(key, h.HeaderLength, 10)
	key = append(append(append(key, ' '), h.Dtype...), ' ')
	key = strconv.AppendBool(key, h.FortranOrder)
	for _, d := range h.Shape {
		key = strconv.AppendInt(append(key, ' '), d, 10)
	}
	return t.geoList.add(key, 80+len(h.Dtype)+20*len(h.Shape), npyTableBytes, h)
}

// npyHeaderEnd returns where the header of the .npy bytes b ends (magic,
// version, length, dict), if b holds all of it.
func npyHeaderEnd(b []byte) (int, bool) {
	if len(b) < 10 || string(b[:6]) != npyMagic {
		return 0, false
	}
	var hlen, start int
	switch b[6] {
	case 1:
		hlen, start = int(binary.LittleEndian.Uint16(b[8:])), 10
	case 2, 3:
		if len(b) < 12 {
			return 0, false
		}
		v := binary.LittleEndian.Uint32(b[8:])
		if v > npyMemberHead {
			return 0, false
		}
		hlen, start = int(v), 12
	default:
		return 0, false
	}
	if start+hlen > len(b) {
		return 0, false
	}
	return start + hlen, true
}

// parseNpyMember parses the header raw (magic to the end of the dict, as
// npyHeaderEnd delimits it) of a member of length bytes. It answers only
// where the client's parse (Python's ast.literal_eval of the dict, then
// descr, shape and fortran_order) would give the same geometry: the header
// is printable ASCII and newlines without backslashes, integers have no
// leading zeros, the shape is a real tuple of integers, the dtype a simple
// one whose data fits in the member. Anything else gets no geometry, and
// the client parses (and rejects, with its own error) the header itself.
func parseNpyMember(raw []byte, length int64) (NpyHeader, bool) {
	start := 10
	if raw[6] != 1 {
		start = 12
	}
	for _, c := range raw[start:] {
		if (c < 0x20 && c != '\n') || c > 0x7e || c == '\\' {
			return NpyHeader{}, false
		}
	}
	p := &pyLit{s: string(raw[start:]), strict: true}
	d, err := p.dict()
	if err != nil {
		return NpyHeader{}, false
	}
	descr, ok := d["descr"]
	if !ok || descr.kind != 's' || len(descr.str) > npyMaxDtype {
		return NpyHeader{}, false
	}
	item, err := npyItemSize(descr.str)
	if err != nil {
		return NpyHeader{}, false
	}
	fo, ok := d["fortran_order"]
	if !ok || fo.kind != 'b' {
		return NpyHeader{}, false
	}
	sh, ok := d["shape"]
	if !ok || sh.kind != '(' || sh.paren || len(sh.ints) > npyMaxDims {
		return NpyHeader{}, false
	}
	count := int64(1)
	for _, v := range sh.ints {
		if v != 0 && count > (1<<62)/v {
			return NpyHeader{}, false
		}
		count *= v
	}
	hl := int64(len(raw))
	if count != 0 && item > (length-hl)/count {
		return NpyHeader{}, false
	}
	shape := append([]int64{}, sh.ints...)
	return NpyHeader{HeaderLength: hl, Dtype: descr.str, Shape: shape, FortranOrder: fo.b}, true
}

// appendJSON appends the header as a JSON object.
func (h *NpyHeader) appendJSON(b []byte) []byte {
	b = appendGeometryJSON(b, h.HeaderLength, h.Dtype, h.Shape)
	b = append(b, `,"fortran_order":`...)
	b = strconv.AppendBool(b, h.FortranOrder)
	return append(b, '}')
}
