package cache

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Tar is the index of an uncompressed tar archive as WebDataset reads it:
// regular members grouped into samples by key (the path up to the first dot
// of the base name), in archive order.
type Tar struct {
	// Members is the number of member headers read (every type).
	Members int `json:"members"`
	// Samples are runs of consecutive members sharing a key.
	Samples []TarSample `json:"samples"`
	// Other are regular members that belong to no sample: no extension,
	// or a WebDataset-reserved "__name__" path.
	Other []TarMember `json:"other,omitempty"`
	// Skipped are members whose data cannot be served as one byte range
	// (sparse files, symlinks, devices, dangling hard links, names that are
	// not UTF-8), each with the reason. Directories are not listed.
	Skipped []TarSkipped `json:"skipped,omitempty"`
	// NpyHeaders are the distinct geometries of the samples' .npy fields
	// (TarField.Npy), so that a client plans reads without reading each
	// member's header itself.
	NpyHeaders []NpyHeader `json:"npy_headers,omitempty"`

	nameBytes int      // member and link names read, against tarMaxNameBytes
	npy       npyTable // NpyHeaders while parsing
}

// count records one more member header with the given names and reports
// whether the archive is still within tarMaxMembers and tarMaxNameBytes.
func (t *Tar) count(name, link string) bool {
	t.Members++
	t.nameBytes += len(name) + len(link)
	return t.Members <= tarMaxMembers && t.nameBytes <= tarMaxNameBytes
}

// overLimit is the error for an archive beyond count's limits.
func (t *Tar) overLimit() error {
	if t.Members > tarMaxMembers {
		return invalidf("tar", "more than %d members exceed gdsfs's index limit; split the shard", tarMaxMembers)
	}
	return invalidf("tar", "member names of more than %d bytes (8 MiB) in all exceed gdsfs's index limit; split the shard", tarMaxNameBytes)
}

// TarSample is one WebDataset sample: the fields sharing a key.
type TarSample struct {
	Key    string
	Fields []TarField
}

// TarField is one member of a sample. Field is the member name after the
// key and its dot ("seg.png" for "a/000123.seg.png"). Npy is 1 + the index
// in Tar.NpyHeaders of the geometry of a .npy field's array, 0 for none
// (not a .npy field, a hard link, or a header the client parses itself:
// parseNpyMember).
type TarField struct {
	Field string
	TarMember
	Npy int
}

// TarMember is a member's data range. For a hard link, Range is the data of
// the member it links to and Link names that member.
type TarMember struct {
	Name string `json:"name"`
	Range
	Link string `json:"link,omitempty"`
}

// TarSkipped is a member that Resolve refuses, with the reason.
type TarSkipped struct {
	Name   string `json:"name"`
	Type   string `json:"type"`
	Reason string `json:"reason"`
}

// MarshalJSON writes {"key": ..., "fields": {"<field>": member, ...}} with
// the fields in archive order (a JSON object keeps its order in Python).
func (s TarSample) MarshalJSON() ([]byte, error) {
	return s.appendJSON(nil), nil
}

func (s *TarSample) appendJSON(b []byte) []byte {
	b = append(b, `{"key":`...)
	b = appendJSONString(b, s.Key)
	b = append(b, `,"fields":{`...)
	for i := range s.Fields {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, s.Fields[i].Field)
		b = append(b, ':')
		b = s.Fields[i].TarMember.appendJSON(b)
		if k := s.Fields[i].Npy; k > 0 {
			b = append(strconv.AppendInt(append(b[:len(b)-1], `,"npy":`...), int64(k-1), 10), '}')
		}
	}
	return append(b, "}}"...)
}

func (m *TarMember) appendJSON(b []byte) []byte {
	b = append(b, `{"name":`...)
	b = appendJSONString(b, m.Name)
	b = appendRange(append(b, ','), m.Range)
	if m.Link != "" {
		b = append(b, `,"link":`...)
		b = appendJSONString(b, m.Link)
	}
	return append(b, '}')
}

// MarshalJSON writes the index by hand: a 50,000-member shard is encoded
// several times faster than through reflection.
func (t *Tar) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 64+len(t.Samples)*160)
	b = append(b, `{"members":`...)
	b = strconv.AppendInt(b, int64(t.Members), 10)
	b = append(b, `,"samples":[`...)
	for i := range t.Samples {
		if i > 0 {
			b = append(b, ',')
		}
		b = t.Samples[i].appendJSON(b)
	}
	b = append(b, ']')
	if len(t.Other) > 0 {
		b = append(b, `,"other":[`...)
		for i := range t.Other {
			if i > 0 {
				b = append(b, ',')
			}
			b = t.Other[i].appendJSON(b)
		}
		b = append(b, ']')
	}
	if len(t.Skipped) > 0 {
		sk, err := json.Marshal(t.Skipped)
		if err != nil {
			return nil, err
		}
		b = append(append(b, `,"skipped":`...), sk...)
	}
	b = appendGeometriesJSON(b, "npy_headers", len(t.NpyHeaders), func(b []byte, i int) []byte { return t.NpyHeaders[i].appendJSON(b) })
	return append(b, '}'), nil
}

// appendJSONString appends s as a JSON string. s must be valid UTF-8 (the
// parser replaces invalid names); control characters and the characters
// JSON requires are escaped.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// span is the range from the first field's data to the last field's end,
// over fields stored in this sample (not hard links to elsewhere).
func (s *TarSample) span() Range {
	var lo, hi int64 = -1, 0
	for _, f := range s.Fields {
		if f.Link != "" {
			continue
		}
		if lo < 0 || f.Offset < lo {
			lo = f.Offset
		}
		hi = max(hi, f.Offset+f.Length)
	}
	if lo < 0 {
		if len(s.Fields) == 0 {
			return Range{}
		}
		return s.Fields[0].Range
	}
	return Range{Offset: lo, Length: hi - lo}
}

// tarMaxMembers and tarMaxNameBytes bound the members indexed and their
// names' bytes, hence the parse's memory: measured, a parse costs about
// 420 bytes per member plus 12 bytes per name byte (names are kept as
// member, key and field, and twice in the JSON), so an archive at both
// limits costs about 210 MiB at most (docs/index-format.md, "Limits").
// WebDataset shards hold thousands of members.
const (
	tarMaxMembers   = 1 << 18
	tarMaxNameBytes = 8 << 20
)

// tarBufBytes is the read-ahead of the header reader: one refill at the end
// of a member's data usually covers the next header and small members.
const tarBufBytes = 32 << 10

// ParseTar indexes an uncompressed tar archive (ustar, GNU and PAX headers).
// Archives of plain headers only (most WebDataset shards) take a fast path;
// anything else (PAX records, GNU long names, sparse files, base-256
// numbers, damage) is read with archive/tar, which the fast path agrees
// with wherever it answers (FuzzTar checks both on every input).
func ParseTar(r io.ReaderAt, size int64) (*Tar, error) {
	if t, ok := parseTarFast(r, size); ok {
		return t, nil
	}
	return parseTarStd(r, size)
}

// parseTarStd indexes a tar archive through archive/tar.
func parseTarStd(r io.ReaderAt, size int64) (*Tar, error) {
	br := newBufReaderAt(r, size)
	tr := tar.NewReader(br)
	t := &Tar{}
	// latest data range of each regular member name, for hard links.
	byName := make(map[string]Range)
	for {
		hdrOff := br.pos
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			if br.err != nil {
				return nil, fmt.Errorf("cache: read tar at offset %d: %w", hdrOff, br.err)
			}
			return nil, invalidf("tar", "header at offset %d: %v", hdrOff, tarWhy(err))
		}
		if !t.count(h.Name, h.Linkname) {
			return nil, t.overLimit()
		}
		data := br.pos
		if !utf8.ValidString(h.Name) {
			t.Skipped = append(t.Skipped, TarSkipped{Name: strings.ToValidUTF8(h.Name, "\uFFFD"), Type: tarType(h), Reason: "name is not valid UTF-8"})
			continue
		}
		switch {
		case isSparse(h):
			t.Skipped = append(t.Skipped, TarSkipped{Name: h.Name, Type: "sparse", Reason: "sparse member: its bytes in the archive are not the file's contents"})
			continue
		case h.Typeflag == tar.TypeReg || h.Typeflag == tar.TypeCont:
			if h.Size < 0 || data > size || h.Size > size-data {
				return nil, invalidf("tar", "member %q at offset %d: %d bytes of data run past the end of the %d-byte file", h.Name, hdrOff, h.Size, size)
			}
			rg := Range{Offset: data, Length: h.Size}
			byName[h.Name] = rg
			t.add(TarMember{Name: h.Name, Range: rg}, br)
		case h.Typeflag == tar.TypeLink:
			rg, ok := byName[h.Linkname]
			if !ok {
				t.Skipped = append(t.Skipped, TarSkipped{Name: h.Name, Type: "hardlink", Reason: fmt.Sprintf("hard link to %q, which is not an earlier regular member", h.Linkname)})
				continue
			}
			byName[h.Name] = rg
			t.add(TarMember{Name: h.Name, Range: rg, Link: h.Linkname}, nil)
		case h.Typeflag == tar.TypeDir:
		default:
			t.Skipped = append(t.Skipped, TarSkipped{Name: h.Name, Type: tarType(h), Reason: "not a regular file"})
		}
	}
	t.finish()
	return t, nil
}

// add files a regular member (or hard link) under its sample, starting a
// new sample when the key changes, as WebDataset's group_by_keys does. br
// reads the first bytes of a regular member's data, for the geometry of a
// .npy field (nil for hard links: they get none).
func (t *Tar) add(m TarMember, br *bufReaderAt) {
	key, field, ok := sampleKey(m.Name)
	if !ok {
		t.Other = append(t.Other, m)
		return
	}
	npy := 0
	if br != nil && isNpyField(field) {
		if head := br.peek(m.Offset, int(min(m.Length, npyMemberHead))); head != nil {
			npy = t.npy.member(head, m.Length)
		}
	}
	if n := len(t.Samples); n == 0 || t.Samples[n-1].Key != key {
		t.Samples = append(t.Samples, TarSample{Key: key})
	}
	s := &t.Samples[len(t.Samples)-1]
	for i := range s.Fields {
		if s.Fields[i].Field == field {
			// A repeated member replaces the earlier one, as extraction would.
			s.Fields[i].TarMember, s.Fields[i].Npy = m, npy
			return
		}
	}
	s.Fields = append(s.Fields, TarField{Field: field, TarMember: m, Npy: npy})
}

// finish ends a parse: the npy geometry table moves to NpyHeaders.
func (t *Tar) finish() {
	if t.Samples == nil {
		t.Samples = []TarSample{}
	}
	t.NpyHeaders, t.npy = t.npy.list, npyTable{}
}

// keyRE is WebDataset's base_plus_ext pattern; reservedRE its skip pattern.
var (
	keyRE      = regexp.MustCompile(`^((?:.*/|)[^.]+)[.]([^/]*)$`)
	reservedRE = regexp.MustCompile(`__[^/]*__($|/)`)
)

// sampleKey splits a member name into WebDataset key and field.
func sampleKey(name string) (key, field string, ok bool) {
	if strings.Contains(name, "__") && reservedRE.MatchString(name) {
		return "", "", false
	}
	slash := strings.LastIndexByte(name, '/')
	base := name[slash+1:]
	// Fast path, equal to the pattern's leftmost match when the base name
	// starts with a non-dot and holds a dot.
	if base != "" && base[0] != '.' {
		if dot := strings.IndexByte(base, '.'); dot > 0 {
			return name[:slash+1+dot], base[dot+1:], true
		}
		return "", "", false
	}
	m := keyRE.FindStringSubmatch(name)
	if m == nil {
		return "", "", false
	}
	return m[1], m[2], true
}

func isSparse(h *tar.Header) bool {
	if h.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range h.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

func tarType(h *tar.Header) string { return typeName(h.Typeflag) }

// typeName names a tar type flag (both tar paths use it, so they agree).
func typeName(flag byte) string {
	switch flag {
	case tar.TypeSymlink:
		return "symlink"
	case tar.TypeChar:
		return "char"
	case tar.TypeBlock:
		return "block"
	case tar.TypeFifo:
		return "fifo"
	case tar.TypeLink:
		return "hardlink"
	case tar.TypeReg:
		return "file"
	}
	return fmt.Sprintf("type %q", flag)
}

// tarWhy turns archive/tar's errors into words.
func tarWhy(err error) string {
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "truncated (file ends inside a header or member)"
	case errors.Is(err, tar.ErrHeader):
		return "bad header (checksum, number field or magic)"
	}
	return strings.TrimPrefix(err.Error(), "archive/tar: ")
}

// bufReaderAt is an io.ReadSeeker over an io.ReaderAt with a read-ahead
// buffer. archive/tar seeks over member data (Seeker) and reads headers in
// 512-byte blocks; pos is then the offset of the next unread byte, which is
// how the parser learns each member's data offset.
type bufReaderAt struct {
	r    io.ReaderAt
	size int64
	pos  int64
	buf  []byte // file bytes [bufOff, bufOff+len(buf))
	boff int64
	err  error // first read error other than EOF
}

func newBufReaderAt(r io.ReaderAt, size int64) *bufReaderAt {
	return &bufReaderAt{r: r, size: size, buf: make([]byte, 0, max(min(size, tarBufBytes), 512))}
}

func (b *bufReaderAt) Read(p []byte) (int, error) {
	if b.pos >= b.size {
		return 0, io.EOF
	}
	if b.pos < b.boff || b.pos >= b.boff+int64(len(b.buf)) {
		n := min(int64(cap(b.buf)), b.size-b.pos)
		b.buf = b.buf[:n]
		m, err := b.r.ReadAt(b.buf, b.pos)
		b.buf = b.buf[:m]
		b.boff = b.pos
		if m == 0 {
			if err == nil || err == io.EOF {
				// The file is shorter than its stat said.
				return 0, io.ErrUnexpectedEOF
			}
			b.err = err
			return 0, err
		}
	}
	n := copy(p, b.buf[b.pos-b.boff:])
	b.pos += int64(n)
	return n, nil
}

// peek returns the n bytes of the file at off (n at most the buffer's
// capacity), from the read-ahead buffer when it holds them, else refilling
// it at off; pos, where the next Read starts, does not move. It returns nil
// when the file has fewer bytes there or the read fails (the parse's own
// reads then report the failure).
func (b *bufReaderAt) peek(off int64, n int) []byte {
	if n < 0 || off < 0 || int64(n) > b.size-off || n > cap(b.buf) {
		return nil
	}
	if off < b.boff || off+int64(n) > b.boff+int64(len(b.buf)) {
		m := min(int64(cap(b.buf)), b.size-off)
		b.buf = b.buf[:m]
		k, _ := b.r.ReadAt(b.buf, off)
		b.buf = b.buf[:k]
		b.boff = off
		if k < n {
			return nil
		}
	}
	return b.buf[off-b.boff : off-b.boff+int64(n)]
}

func (b *bufReaderAt) Seek(off int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
	case io.SeekCurrent:
		off += b.pos
	case io.SeekEnd:
		off += b.size
	default:
		return 0, errors.New("cache: bad whence")
	}
	if off < 0 {
		return 0, errors.New("cache: negative seek")
	}
	b.pos = off
	return off, nil
}
