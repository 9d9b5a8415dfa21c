package cache

import (
	"encoding/binary"
	"fmt"
	"io"
	"math/bits"
	"strconv"
	"strings"
	"unicode/utf8"
)

const (
	npyMagic = "\x93NUMPY"
	// npyMaxHeader bounds the header we read; numpy itself refuses
	// headers over 10000 bytes unless told otherwise.
	npyMaxHeader = 1 << 20
)

// Npy is the index of a .npy file.
type Npy struct {
	// Version is the format version, "1.0", "2.0" or "3.0".
	Version string `json:"npy_version"`
	// Dtype is the header's descr: a dtype string such as "<f4", or the
	// Python literal of a structured dtype's field list.
	Dtype string `json:"dtype"`
	// ItemSize is the element size in bytes (0 when Dtype is structured).
	ItemSize int64 `json:"item_size"`
	// FortranOrder is true for column-major data.
	FortranOrder bool    `json:"fortran_order"`
	Shape        []int64 `json:"shape"`
	// DataOffset and DataLength locate the array's bytes. For structured
	// dtypes the length runs to the end of the file.
	DataOffset int64 `json:"data_offset"`
	DataLength int64 `json:"data_length"`
}

// ParseNpy indexes a .npy file: its header's dtype, order and shape and
// where the data lies.
func ParseNpy(r io.ReaderAt, size int64) (*Npy, error) {
	const what = "npy file"
	var pre [12]byte
	if size < 10 {
		return nil, invalidf(what, "%d bytes is too short for the header", size)
	}
	if err := readAt(r, pre[:min(size, 12)], 0); err != nil {
		return nil, fmt.Errorf("cache: read npy header: %w", err)
	}
	if string(pre[:6]) != npyMagic {
		return nil, invalidf(what, "missing \\x93NUMPY magic")
	}
	major, minor := pre[6], pre[7]
	var hlen, start int64
	switch major {
	case 1:
		hlen, start = int64(binary.LittleEndian.Uint16(pre[8:])), 10
	case 2, 3:
		if size < 12 {
			return nil, invalidf(what, "%d bytes is too short for a version %d header", size, major)
		}
		hlen, start = int64(binary.LittleEndian.Uint32(pre[8:])), 12
	default:
		return nil, invalidf(what, "unsupported format version %d.%d", major, minor)
	}
	if hlen > npyMaxHeader || hlen > size-start {
		return nil, invalidf(what, "header length %d runs past the end of the %d-byte file", hlen, size)
	}
	hdr := make([]byte, hlen)
	if err := readAt(r, hdr, start); err != nil {
		return nil, fmt.Errorf("cache: read npy header: %w", err)
	}
	if !utf8.Valid(hdr) {
		return nil, invalidf(what, "header is not UTF-8")
	}
	n := &Npy{Version: fmt.Sprintf("%d.%d", major, minor), DataOffset: start + hlen}
	if err := n.parseHeader(string(hdr)); err != nil {
		return nil, invalidf(what, "header %q: %v", truncate(string(hdr), 120), err)
	}
	rest := size - n.DataOffset
	if n.ItemSize == 0 {
		n.DataLength = rest
		return n, nil
	}
	count := uint64(1)
	for _, d := range n.Shape {
		hi, lo := bits.Mul64(count, uint64(d))
		if hi != 0 {
			return nil, invalidf(what, "shape %v overflows", n.Shape)
		}
		count = lo
	}
	hi, nbytes := bits.Mul64(count, uint64(n.ItemSize))
	if hi != 0 || nbytes > uint64(rest) {
		return nil, invalidf(what, "%s%v needs %d bytes of data but the file has %d after the header", n.Dtype, n.Shape, nbytes, rest)
	}
	n.DataLength = int64(nbytes)
	return n, nil
}

// parseHeader reads the header's Python dict literal:
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
func (n *Npy) parseHeader(h string) error {
	p := &pyLit{s: h}
	d, err := p.dict()
	if err != nil {
		return err
	}
	descr, ok := d["descr"]
	if !ok {
		return fmt.Errorf("no 'descr'")
	}
	switch descr.kind {
	case 's':
		n.Dtype = descr.str
		n.ItemSize, err = npyItemSize(descr.str)
		if err != nil {
			return err
		}
	case '[':
		n.Dtype = descr.raw
	default:
		return fmt.Errorf("'descr' is neither a string nor a list")
	}
	fo, ok := d["fortran_order"]
	if !ok || fo.kind != 'b' {
		return fmt.Errorf("'fortran_order' must be True or False")
	}
	n.FortranOrder = fo.b
	sh, ok := d["shape"]
	if !ok || sh.kind != '(' {
		return fmt.Errorf("'shape' must be a tuple of integers")
	}
	n.Shape = sh.ints
	if n.Shape == nil {
		n.Shape = []int64{}
	}
	return nil
}

// npyItemSize returns the byte size of a simple numpy dtype string such as
// "<f4", "|b1", "<U8" or "<M8[ns]". Object arrays are pickled and refused.
func npyItemSize(d string) (int64, error) {
	s := d
	if s != "" && strings.ContainsRune("<>|=", rune(s[0])) {
		s = s[1:]
	}
	if i := strings.IndexByte(s, '['); i >= 0 && strings.HasSuffix(s, "]") {
		s = s[:i]
	}
	if s == "" {
		return 0, fmt.Errorf("empty dtype")
	}
	kind, digits := s[0], s[1:]
	if kind == 'O' {
		return 0, fmt.Errorf("object arrays are pickled, not addressable by byte range")
	}
	if !strings.ContainsRune("biufcSaUVMm?", rune(kind)) {
		return 0, fmt.Errorf("unknown dtype %q", d)
	}
	if digits == "" {
		if kind == '?' {
			return 1, nil
		}
		return 0, fmt.Errorf("dtype %q has no size", d)
	}
	v, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || v <= 0 || v > 1<<40 {
		return 0, fmt.Errorf("dtype %q has a bad size", d)
	}
	if kind == 'U' {
		v *= 4
	}
	return v, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// pyLit parses the small subset of Python literals npy headers use. strict
// refuses what Python reads differently or not at all (integers with leading
// zeros or an L suffix, newlines in strings; backslashes are refused by the
// caller), for geometry that must equal the client's own parse.
type pyLit struct {
	s      string
	i      int
	depth  int
	strict bool
}

// pyVal is one literal: kind 's' string, 'b' bool, 'i' int, '(' tuple of
// ints, 't' other tuple, '[' list (kept raw), 'n' None. paren marks "(x)":
// one value in parentheses without a comma, which Python reads as x, not
// as a tuple.
type pyVal struct {
	kind  byte
	str   string
	b     bool
	ints  []int64
	raw   string
	paren bool
}

const pyMaxDepth = 32

func (p *pyLit) ws() {
	for p.i < len(p.s) && strings.IndexByte(" \t\r\n", p.s[p.i]) >= 0 {
		p.i++
	}
}

func (p *pyLit) eat(c byte) bool {
	p.ws()
	if p.i < len(p.s) && p.s[p.i] == c {
		p.i++
		return true
	}
	return false
}

func (p *pyLit) dict() (map[string]pyVal, error) {
	if !p.eat('{') {
		return nil, fmt.Errorf("not a dict literal")
	}
	d := make(map[string]pyVal)
	for !p.eat('}') {
		k, err := p.value()
		if err != nil {
			return nil, err
		}
		if k.kind != 's' {
			return nil, fmt.Errorf("dict key is not a string")
		}
		if !p.eat(':') {
			return nil, fmt.Errorf("missing ':' after %q", k.str)
		}
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		d[k.str] = v
		if !p.eat(',') {
			if !p.eat('}') {
				return nil, fmt.Errorf("missing ',' or '}' at byte %d", p.i)
			}
			break
		}
	}
	p.ws()
	if p.i != len(p.s) {
		return nil, fmt.Errorf("bytes after the dict")
	}
	return d, nil
}

func (p *pyLit) value() (pyVal, error) {
	p.ws()
	if p.i >= len(p.s) {
		return pyVal{}, fmt.Errorf("unexpected end")
	}
	p.depth++
	defer func() { p.depth-- }()
	if p.depth > pyMaxDepth {
		return pyVal{}, fmt.Errorf("nested too deeply")
	}
	switch c := p.s[p.i]; {
	case c == '\'' || c == '"':
		s, err := p.str()
		return pyVal{kind: 's', str: s}, err
	case c == '(':
		p.i++
		var ints []int64
		kind := byte('(')
		n, comma := 0, true
		for !p.eat(')') {
			v, err := p.value()
			if err != nil {
				return pyVal{}, err
			}
			n++
			if v.kind == 'i' {
				ints = append(ints, v.ints[0])
			} else {
				kind = 't' // a tuple that is not all integers (inside a structured descr)
			}
			if !p.eat(',') {
				if !p.eat(')') {
					return pyVal{}, fmt.Errorf("missing ',' or ')' at byte %d", p.i)
				}
				comma = false
				break
			}
		}
		return pyVal{kind: kind, ints: ints, paren: n == 1 && !comma}, nil
	case c == '[':
		start := p.i
		p.i++
		for !p.eat(']') {
			if _, err := p.value(); err != nil {
				return pyVal{}, err
			}
			if !p.eat(',') {
				if !p.eat(']') {
					return pyVal{}, fmt.Errorf("missing ',' or ']' at byte %d", p.i)
				}
				break
			}
		}
		return pyVal{kind: '[', raw: p.s[start:p.i]}, nil
	case c >= '0' && c <= '9':
		j := p.i
		for j < len(p.s) && p.s[j] >= '0' && p.s[j] <= '9' {
			j++
		}
		v, err := strconv.ParseInt(p.s[p.i:j], 10, 64)
		if err != nil || v > 1<<62 {
			return pyVal{}, fmt.Errorf("integer %q out of range", p.s[p.i:j])
		}
		if p.strict && j-p.i > 1 && p.s[p.i] == '0' {
			return pyVal{}, fmt.Errorf("integer %q has leading zeros", p.s[p.i:j])
		}
		p.i = j
		if p.i < len(p.s) && p.s[p.i] == 'L' { // Python 2 long
			if p.strict {
				return pyVal{}, fmt.Errorf("a Python 2 long at byte %d", p.i)
			}
			p.i++
		}
		return pyVal{kind: 'i', ints: []int64{v}}, nil
	}
	for _, w := range []struct {
		word string
		v    pyVal
	}{{"True", pyVal{kind: 'b', b: true}}, {"False", pyVal{kind: 'b'}}, {"None", pyVal{kind: 'n'}}} {
		if strings.HasPrefix(p.s[p.i:], w.word) {
			p.i += len(w.word)
			return w.v, nil
		}
	}
	return pyVal{}, fmt.Errorf("unexpected %q at byte %d", p.s[p.i], p.i)
}

func (p *pyLit) str() (string, error) {
	q := p.s[p.i]
	p.i++
	var b strings.Builder
	for p.i < len(p.s) {
		c := p.s[p.i]
		p.i++
		switch c {
		case q:
			return b.String(), nil
		case '\n':
			if p.strict {
				return "", fmt.Errorf("newline in a string")
			}
			b.WriteByte(c)
		case '\\':
			if p.strict {
				return "", fmt.Errorf("backslash in a string")
			}
			if p.i >= len(p.s) {
				return "", fmt.Errorf("unterminated string")
			}
			b.WriteByte(p.s[p.i])
			p.i++
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("unterminated string")
}
