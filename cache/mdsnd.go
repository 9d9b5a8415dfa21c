package cache

import (
	"encoding/binary"
	"strconv"
	"strings"
)

// MDSNdarray is the geometry of an MDS ndarray value whose column encoding
// leaves its dtype or shape to each sample ("ndarray", "ndarray:float32"):
// the value's array bytes start HeaderLength bytes into it, Dtype is the
// MDS dtype name ("float32"), Shape the C-order shape. It is what the
// Python client's own parse of the value's header
// (gdsfs._layout.mds_ndarray_prefix and mds_ndarray_check) gives.
type MDSNdarray struct {
	HeaderLength int64   `json:"header_length"`
	Dtype        string  `json:"dtype"`
	Shape        []int64 `json:"shape"`
}

// Bounds of the MDS index's ndarray geometry. mdsNdMaxDims is NDArray's
// axis limit (6 bits of the shape byte: it refuses 64), mdsNdMaxHead the
// longest header (dtype code, shape byte, 63 u64 dims). mdsNdTableBytes
// bounds the table of distinct geometries (its estimated JSON),
// mdsNdRawBytes the header bytes remembered to parse each distinct header
// once, mdsNdMaxDim a dimension (JSON numbers stay exact). Values past
// a bound get no geometry: the client reads their headers as before.
const (
	mdsNdMaxDims    = 63
	mdsNdMaxHead    = 2 + 8*mdsNdMaxDims
	mdsNdTableBytes = 8 << 20
	mdsNdRawBytes   = 1 << 20
	mdsNdMaxDim     = 1 << 53
)

// mdsDtype returns the name and size of an MDS ndarray dtype code
// (streaming's NDArray._int2dtype), or ok false.
func mdsDtype(code byte) (name string, size int64, ok bool) {
	switch code {
	case 8:
		return "uint8", 1, true
	case 9:
		return "int8", 1, true
	case 16:
		return "uint16", 2, true
	case 17:
		return "int16", 2, true
	case 18:
		return "float16", 2, true
	case 32:
		return "uint32", 4, true
	case 33:
		return "int32", 4, true
	case 34:
		return "float32", 4, true
	case 64:
		return "uint64", 8, true
	case 65:
		return "int64", 8, true
	case 66:
		return "float64", 8, true
	}
	return "", 0, false
}

// mdsDtypeSize returns the size of an MDS ndarray dtype name, or 0.
func mdsDtypeSize(name string) int64 {
	for _, c := range [...]byte{8, 9, 16, 17, 18, 32, 33, 34, 64, 65, 66} {
		if n, s, _ := mdsDtype(c); n == name {
			return s
		}
	}
	return 0
}

// mdsNdSpec is what a column's ndarray encoding fixes: dtype ("" and size
// 0: each sample's header stores it) and shape (nil: stored per sample).
type mdsNdSpec struct {
	dtype string
	item  int64
	shape []int64
}

// parseMDSNdSpec parses an ndarray column encoding "ndarray[:dtype[:d0,d1,...]]"
// and reports whether its values get geometry: the encoding leaves dtype or
// shape to the sample and is written the one way the client's own parse
// (gdsfs._layout.mds_ndarray_spec) reads the same: a known MDS dtype name,
// dims of decimal digits without leading zeros. Anything else gets none.
func parseMDSNdSpec(enc string) (mdsNdSpec, bool) {
	parts := strings.Split(enc, ":")
	if parts[0] != "ndarray" || len(parts) > 3 {
		return mdsNdSpec{}, false
	}
	var sp mdsNdSpec
	if len(parts) > 1 && parts[1] != "" {
		if sp.item = mdsDtypeSize(parts[1]); sp.item == 0 {
			return mdsNdSpec{}, false
		}
		sp.dtype = parts[1]
	}
	if len(parts) > 2 && parts[2] != "" {
		dims := strings.Split(parts[2], ",")
		if len(dims) > mdsNdMaxDims {
			return mdsNdSpec{}, false
		}
		sp.shape = make([]int64, 0, len(dims))
		for _, d := range dims {
			if d == "" || len(d) > 15 || (len(d) > 1 && d[0] == '0') || strings.Trim(d, "0123456789") != "" {
				return mdsNdSpec{}, false
			}
			v, err := strconv.ParseInt(d, 10, 64)
			if err != nil {
				return mdsNdSpec{}, false
			}
			sp.shape = append(sp.shape, v)
		}
	}
	return sp, sp.dtype == "" || sp.shape == nil
}

// headerLen returns the length of the header of a value whose first bytes
// are head (at most mdsNdMaxHead of them), if head holds all of it.
func (sp *mdsNdSpec) headerLen(head []byte) (int, bool) {
	at := 0
	if sp.dtype == "" {
		at = 1
	}
	if sp.shape != nil {
		return at, at <= len(head)
	}
	if at >= len(head) {
		return 0, false
	}
	ndim, code := int(head[at]>>2), head[at]&3
	at += 1 + ndim<<code
	return at, at <= len(head)
}

// parse returns the geometry of a value whose header is raw (as headerLen
// delimits it) and its array bytes, or ok false where the client's parse
// fails (an unknown dtype code) or is refused (the array bytes do not
// match the shape: the value would not decode).
func (sp *mdsNdSpec) parse(raw []byte) (h MDSNdarray, nbytes int64, ok bool) {
	h.Dtype, h.HeaderLength = sp.dtype, int64(len(raw))
	item, at := sp.item, 0
	if sp.dtype == "" {
		if h.Dtype, item, ok = mdsDtype(raw[0]); !ok {
			return MDSNdarray{}, 0, false
		}
		at = 1
	}
	if sp.shape != nil {
		h.Shape = append([]int64{}, sp.shape...)
	} else {
		ndim, size := int(raw[at]>>2), 1<<(raw[at]&3)
		h.Shape = make([]int64, ndim)
		for i := range ndim {
			p := raw[at+1+i*size:]
			var v uint64
			switch size {
			case 1:
				v = uint64(p[0])
			case 2:
				v = uint64(binary.LittleEndian.Uint16(p))
			case 4:
				v = uint64(binary.LittleEndian.Uint32(p))
			default:
				v = binary.LittleEndian.Uint64(p)
			}
			if v > mdsNdMaxDim {
				return MDSNdarray{}, 0, false
			}
			h.Shape[i] = int64(v)
		}
	}
	n := item
	for _, d := range h.Shape {
		if d == 0 {
			return h, 0, true
		}
	}
	for _, d := range h.Shape {
		if n > (1<<40)/d {
			return MDSNdarray{}, 0, false // larger than any MDS shard (offsets are u32)
		}
		n *= d
	}
	return h, n, true
}

// mdsNdTable collects a shard's distinct ndarray geometries while it is
// parsed: those of values whose array bytes fill the rest of the value
// (others are parsed, and remembered, but not listed).
type mdsNdTable struct {
	geoList[MDSNdarray]
	byRaw    []map[string]int // per column: header bytes -> index into seen
	seen     []mdsNdSeen
	rawBytes int // memory of byRaw and seen, estimated
}

// mdsNdSeen is a header parsed before: its geometry, array bytes and index
// in the table's list (-1: not listed yet, -2: none, or the list is full).
type mdsNdSeen struct {
	h      MDSNdarray
	nbytes int64
	k      int
}

// value returns 1 + the table index of the geometry of a value of column c
// (spec sp) of length bytes whose first bytes are head (at most
// mdsNdMaxHead of them), or 0 when it gets none.
func (t *mdsNdTable) value(c int, sp *mdsNdSpec, head []byte, length int64) int {
	end, ok := sp.headerLen(head)
	if !ok {
		return 0
	}
	raw := head[:end]
	var one mdsNdSeen
	e := &one
	if j, ok := t.byRaw[c][string(raw)]; ok {
		e = &t.seen[j]
	} else {
		one.k = -2
		if h, nb, ok := sp.parse(raw); ok {
			one = mdsNdSeen{h: h, nbytes: nb, k: -1}
		}
		if cost := 64 + 2*len(raw) + 8*len(one.h.Shape); t.rawBytes+cost <= mdsNdRawBytes {
			if t.byRaw[c] == nil {
				t.byRaw[c] = make(map[string]int)
			}
			t.byRaw[c][string(raw)] = len(t.seen)
			t.seen = append(t.seen, one)
			t.rawBytes += cost
			e = &t.seen[len(t.seen)-1]
		}
	}
	if e.k == -2 || e.nbytes != length-int64(end) {
		return 0
	}
	if e.k == -1 {
		if e.k = t.add(e.h); e.k < 0 {
			e.k = -2
			return 0
		}
	}
	return e.k + 1
}

// add files h in the table and returns its index, or -1 when the table is
// full.
func (t *mdsNdTable) add(h MDSNdarray) int {
	key := make([]byte, 0, 24+8*len(h.Shape))
	key = strconv.AppendInt(key, h.HeaderLength, 10)
	key = append(append(key, ' '), h.Dtype...)
	for _, d := range h.Shape {
		key = strconv.AppendInt(append(key, ' '), d, 10)
	}
	return t.geoList.add(key, 64+len(h.Dtype)+20*len(h.Shape), mdsNdTableBytes, h)
}

// appendJSON appends the geometry as a JSON object.
func (h *MDSNdarray) appendJSON(b []byte) []byte {
	return append(appendGeometryJSON(b, h.HeaderLength, h.Dtype, h.Shape), '}')
}
