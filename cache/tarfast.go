package cache

import (
	"bytes"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"
)

// parseTarFast indexes an archive whose headers are all plain ustar, GNU or
// v7 headers with octal numbers and simple types, reading each 512-byte
// header once and allocating little more than the names. It reports false
// as soon as it meets anything else, and the caller starts over with
// archive/tar; it must then never have answered differently from it.
func parseTarFast(r io.ReaderAt, size int64) (*Tar, bool) {
	br := newBufReaderAt(r, size)
	t := &Tar{}
	byName := make(map[string]Range)
	var blk [512]byte
	for off := int64(0); ; {
		if off == size {
			break // EOF without end blocks is accepted, as archive/tar does
		}
		if size-off < 512 || !br.block(blk[:], off) {
			return nil, false
		}
		if blk == [512]byte{} {
			// End of archive: a second zero block or the end of the file.
			if size-off == 512 {
				break
			}
			if size-off < 1024 || !br.block(blk[:], off+512) || blk != [512]byte{} {
				return nil, false
			}
			break
		}
		h, ok := fastHeader(&blk)
		if !ok {
			return nil, false
		}
		if !t.count(h.name, h.link) {
			return nil, false // archive/tar's path says which limit
		}
		data := off + 512
		nb := h.size
		if h.headerOnly {
			nb = 0
		}
		if nb > size-data {
			return nil, false // truncated: archive/tar says how
		}
		off = data + (nb+511)&^511
		switch {
		case !utf8.ValidString(h.name):
			t.Skipped = append(t.Skipped, TarSkipped{Name: strings.ToValidUTF8(h.name, "\uFFFD"), Type: h.typ(), Reason: "name is not valid UTF-8"})
		case h.flag == '0' || h.flag == '7':
			rg := Range{Offset: data, Length: nb}
			byName[h.name] = rg
			t.add(TarMember{Name: h.name, Range: rg}, br)
		case h.flag == '1':
			rg, ok := byName[h.link]
			if !ok {
				t.Skipped = append(t.Skipped, TarSkipped{Name: h.name, Type: "hardlink", Reason: "hard link to " + strconv.Quote(h.link) + ", which is not an earlier regular member"})
				continue
			}
			byName[h.name] = rg
			t.add(TarMember{Name: h.name, Range: rg, Link: h.link}, nil)
		case h.flag == '5':
		default:
			t.Skipped = append(t.Skipped, TarSkipped{Name: h.name, Type: h.typ(), Reason: "not a regular file"})
		}
	}
	t.finish()
	return t, true
}

// fastHdr is what the fast path reads from one header.
type fastHdr struct {
	name, link string
	flag       byte // after the NUL (old regular file) conversion
	size       int64
	headerOnly bool
}

func (h *fastHdr) typ() string { return typeName(h.flag) }

// fastHeader decodes a header the way archive/tar's readHeader does, or
// reports false for anything it leaves to archive/tar.
func fastHeader(b *[512]byte) (fastHdr, bool) {
	// Checksum, over the block with the checksum field read as spaces;
	// historic writers summed signed bytes.
	want, ok := octal(b[148:156])
	if !ok {
		return fastHdr{}, false
	}
	var us, ss int64
	for i, c := range b {
		if i >= 148 && i < 156 {
			c = ' '
		}
		us += int64(c)
		ss += int64(int8(c))
	}
	if want != us && want != ss {
		return fastHdr{}, false
	}
	magic, version := string(b[257:263]), string(b[263:265])
	var ustar, gnu bool
	switch {
	case magic == "ustar\x00" && string(b[508:512]) == "tar\x00":
		return fastHdr{}, false // STAR: a different prefix layout
	case magic == "ustar\x00":
		ustar = true
	case magic == "ustar " && version == " \x00":
		gnu = true
	}
	h := fastHdr{flag: b[156]}
	switch h.flag {
	case '0', 0, '7':
	case '1', '2', '3', '4', '5', '6':
		h.headerOnly = true
	default:
		return fastHdr{}, false // PAX, GNU long names, sparse, vendor types
	}
	var sizeOK bool
	h.size, sizeOK = octal(b[124:136])
	if !sizeOK || h.size < 0 {
		return fastHdr{}, false
	}
	// archive/tar fails a header whose other numbers do not parse.
	for _, f := range [][]byte{b[100:108], b[108:116], b[116:124], b[136:148]} {
		if _, ok := octal(f); !ok {
			return fastHdr{}, false
		}
	}
	h.name = cstring(b[0:100])
	h.link = cstring(b[157:257])
	if ustar || gnu {
		for _, f := range [][]byte{b[329:337], b[337:345]} {
			if _, ok := octal(f); !ok {
				return fastHdr{}, false
			}
		}
	}
	switch {
	case ustar:
		if p := cstring(b[345:500]); p != "" {
			h.name = p + "/" + h.name
		}
	case gnu:
		// GNU keeps atime and ctime where ustar has the prefix; archive/tar
		// has a fallback for files whose fields do not parse.
		for _, f := range [][]byte{b[345:357], b[357:369]} {
			if f[0] != 0 {
				if _, ok := octal(f); !ok {
					return fastHdr{}, false
				}
			}
		}
	}
	if h.flag == 0 {
		h.flag = '0'
		if strings.HasSuffix(h.name, "/") {
			h.flag, h.headerOnly = '5', true
		}
	}
	return h, true
}

// octal parses a numeric field as archive/tar does for octal: NULs and
// spaces trimmed at both ends, empty is 0. Base-256 fields (high bit set)
// are left to archive/tar.
func octal(f []byte) (int64, bool) {
	if len(f) > 0 && f[0]&0x80 != 0 {
		return 0, false
	}
	f = bytes.Trim(f, " \x00")
	if len(f) == 0 {
		return 0, true
	}
	if i := bytes.IndexByte(f, 0); i >= 0 {
		f = f[:i]
	}
	v, err := strconv.ParseUint(string(f), 8, 64)
	if err != nil {
		return 0, false
	}
	return int64(v), true
}

// cstring is a NUL-terminated field.
func cstring(f []byte) string {
	if i := bytes.IndexByte(f, 0); i >= 0 {
		f = f[:i]
	}
	return string(f)
}

// block reads the 512 bytes at off into b through the read-ahead buffer.
func (br *bufReaderAt) block(b []byte, off int64) bool {
	br.pos = off
	n, err := io.ReadFull(br, b)
	return err == nil && n == len(b)
}
