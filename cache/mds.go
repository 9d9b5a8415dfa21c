package cache

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
)

const (
	// mdsMaxSamples bounds a shard's sample count (its offset table and the
	// index's memory); MDS shards default to 64 MiB, in which 2^18 samples
	// are 256 bytes each.
	mdsMaxSamples = 1 << 18
	// mdsMaxRanges bounds samples x columns, the column ranges the index
	// holds (a column of fixed size 0 costs the file nothing): a parse at
	// 2^20 ranges peaks at about 100 MiB, most of it the JSON.
	mdsMaxRanges = 1 << 20
	// mdsMaxConfig bounds the shard's embedded config JSON.
	mdsMaxConfig = 1 << 20
	// mdsMaxIndexJSON bounds a dataset's index.json.
	mdsMaxIndexJSON = 16 << 20
)

// MDS is the index of one MosaicML Streaming MDS shard (shard.NNNNN.mds).
type MDS struct {
	// Columns in the order their values are stored (sorted by name by the
	// writer), from the config JSON embedded in the shard.
	Columns []MDSColumn
	// Samples with their absolute ranges and per-column value ranges.
	Samples []MDSSample
	// NdarrayHeaders are the distinct geometries of the values of ndarray
	// columns whose encoding leaves dtype or shape to each sample (the
	// samples' Ndarray index them).
	NdarrayHeaders []MDSNdarray
}

// MDSColumn is a column of an MDS dataset. Size is the fixed value size,
// or -1 for variable-size encodings (each sample then stores the size).
type MDSColumn struct {
	Name     string `json:"name"`
	Encoding string `json:"encoding"`
	Size     int64  `json:"size"`
}

// MDSSample is one sample: its bytes, and each column value's bytes (in
// Columns order; an ndarray value includes its dtype/shape prefix when the
// encoding stores one).
type MDSSample struct {
	Range
	Columns []Range
	// Ndarray holds, per column, 1 + the index in MDS.NdarrayHeaders of the
	// value's geometry, 0 for none (not such an ndarray column, or a header
	// the client parses itself); nil when the shard has no such column.
	Ndarray []int32
}

// MarshalJSON writes {"kind": "shard", "columns": [...], "samples":
// [{"offset", "length", "columns": {"<name>": {"offset", "length"[, "ndarray"]}}}]
// [, "ndarray_headers": [...]]}.
func (m *MDS) MarshalJSON() ([]byte, error) {
	cols, err := json.Marshal(m.Columns)
	if err != nil {
		return nil, err
	}
	names := make([][]byte, len(m.Columns))
	for i, c := range m.Columns {
		if names[i], err = json.Marshal(c.Name); err != nil {
			return nil, err
		}
	}
	out := make([]byte, 0, 64+len(cols)+len(m.Samples)*(48+40*len(m.Columns)))
	out = append(out, `{"kind":"shard","columns":`...)
	out = append(out, cols...)
	out = append(out, `,"samples":[`...)
	for i, s := range m.Samples {
		if i > 0 {
			out = append(out, ',')
		}
		out = appendRange(append(out, '{'), s.Range)
		out = append(out, `,"columns":{`...)
		for c, r := range s.Columns {
			if c > 0 {
				out = append(out, ',')
			}
			out = append(out, names[c]...)
			out = appendRange(append(out, ":{"...), r)
			if s.Ndarray != nil && s.Ndarray[c] > 0 {
				out = strconv.AppendInt(append(out, `,"ndarray":`...), int64(s.Ndarray[c]-1), 10)
			}
			out = append(out, '}')
		}
		out = append(out, "}}"...)
	}
	out = append(out, ']')
	out = appendGeometriesJSON(out, "ndarray_headers", len(m.NdarrayHeaders), func(b []byte, i int) []byte { return m.NdarrayHeaders[i].appendJSON(b) })
	return append(out, '}'), nil
}

func appendRange(b []byte, r Range) []byte {
	b = append(b, `"offset":`...)
	b = strconv.AppendInt(b, r.Offset, 10)
	b = append(b, `,"length":`...)
	return strconv.AppendInt(b, r.Length, 10)
}

// mdsConfig is the writer config MDS embeds in each shard (and repeats per
// shard in index.json).
type mdsConfig struct {
	ColumnNames     []string `json:"column_names"`
	ColumnEncodings []string `json:"column_encodings"`
	ColumnSizes     []*int64 `json:"column_sizes"`
	Compression     *string  `json:"compression"`
	Format          string   `json:"format"`
}

func (c *mdsConfig) columns(what string) ([]MDSColumn, error) {
	if len(c.ColumnNames) != len(c.ColumnEncodings) || len(c.ColumnNames) != len(c.ColumnSizes) {
		return nil, invalidf(what, "column_names, column_encodings and column_sizes differ in length (%d, %d, %d)",
			len(c.ColumnNames), len(c.ColumnEncodings), len(c.ColumnSizes))
	}
	cols := make([]MDSColumn, len(c.ColumnNames))
	for i, name := range c.ColumnNames {
		cols[i] = MDSColumn{Name: name, Encoding: c.ColumnEncodings[i], Size: -1}
		if s := c.ColumnSizes[i]; s != nil {
			if *s < 0 || *s > 1<<32 {
				return nil, invalidf(what, "column %q has size %d", name, *s)
			}
			cols[i].Size = *s
		}
	}
	return cols, nil
}

// ParseMDS indexes an uncompressed MDS shard: the u32 sample count, the
// u32 offset table, the embedded config JSON naming the columns, and each
// sample's u32 size prefix of its variable-size columns.
func ParseMDS(r io.ReaderAt, size int64) (*MDS, error) {
	const what = "MDS shard"
	if size < 8 {
		return nil, invalidf(what, "%d bytes is too short for a sample count and offset table", size)
	}
	var nb [4]byte
	if err := readAt(r, nb[:], 0); err != nil {
		return nil, fmt.Errorf("cache: read MDS sample count: %w", err)
	}
	n := int64(binary.LittleEndian.Uint32(nb[:]))
	tableEnd := 4 + 4*(n+1)
	if n > mdsMaxSamples {
		return nil, invalidf(what, "%d samples exceed gdsfs's index limit of %d; split the shard", n, mdsMaxSamples)
	}
	if tableEnd > size {
		return nil, invalidf(what, "%d samples need a %d-byte offset table but the file has %d bytes", n, tableEnd, size)
	}
	table := make([]byte, 4*(n+1))
	if err := readAt(r, table, 4); err != nil {
		return nil, fmt.Errorf("cache: read MDS offset table: %w", err)
	}
	offs := make([]int64, n+1)
	for i := range offs {
		offs[i] = int64(binary.LittleEndian.Uint32(table[4*i:]))
		if i > 0 && offs[i] < offs[i-1] {
			return nil, invalidf(what, "offset table decreases at sample %d (%d < %d)", i, offs[i], offs[i-1])
		}
	}
	if offs[0] < tableEnd {
		return nil, invalidf(what, "first sample at %d overlaps the offset table ending at %d", offs[0], tableEnd)
	}
	if offs[n] > size {
		return nil, invalidf(what, "samples end at %d, past the end of the %d-byte file", offs[n], size)
	}
	cfgLen := offs[0] - tableEnd
	if cfgLen == 0 || cfgLen > mdsMaxConfig {
		return nil, invalidf(what, "config JSON of %d bytes between offset table and samples (want 1..%d)", cfgLen, mdsMaxConfig)
	}
	raw := make([]byte, cfgLen)
	if err := readAt(r, raw, tableEnd); err != nil {
		return nil, fmt.Errorf("cache: read MDS config: %w", err)
	}
	var cfg mdsConfig
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return nil, invalidf(what, "config JSON: %v", err)
	}
	if cfg.Format != "" && cfg.Format != "mds" {
		return nil, invalidf(what, "config says format %q", cfg.Format)
	}
	cols, err := cfg.columns(what)
	if err != nil {
		return nil, err
	}
	if n*int64(len(cols)) > mdsMaxRanges {
		return nil, invalidf(what, "%d samples of %d columns exceed gdsfs's index limit of %d column ranges; split the shard", n, len(cols), mdsMaxRanges)
	}
	m := &MDS{Columns: cols, Samples: make([]MDSSample, n)}
	var fixed, nvar int64
	specs := make([]*mdsNdSpec, len(cols))
	nd := false
	for c, col := range cols {
		if col.Size < 0 {
			nvar++
		} else {
			fixed += col.Size
		}
		if sp, ok := parseMDSNdSpec(col.Encoding); ok {
			specs[c], nd = &sp, true
		}
	}
	var geo []int32
	geoTable := mdsNdTable{byRaw: make([]map[string]int, len(cols))}
	if nd {
		geo = make([]int32, n*int64(len(cols)))
	}
	// The sample prefixes and ndarray headers through a read-ahead buffer:
	// many small samples per read, and for large ones 512 bytes from the
	// sample's start (a larger buffer would copy most of the file).
	bufBytes := int64(tarBufBytes)
	if n > 0 && (offs[n]-offs[0])/n > 4<<10 {
		bufBytes = 512
	}
	br := &bufReaderAt{r: r, size: size, buf: make([]byte, 0, max(min(size, bufBytes), 512))}
	prefix := make([]byte, 4*nvar)
	colRanges := make([]Range, n*int64(len(cols)))
	for i := range n {
		s := &m.Samples[i]
		s.Range = Range{Offset: offs[i], Length: offs[i+1] - offs[i]}
		lo, hi := i*int64(len(cols)), (i+1)*int64(len(cols))
		s.Columns = colRanges[lo:hi:hi]
		if nd {
			s.Ndarray = geo[lo:hi:hi]
		}
		if s.Length < 4*nvar+fixed {
			return nil, invalidf(what, "sample %d has %d bytes, fewer than its columns' %d", i, s.Length, 4*nvar+fixed)
		}
		if nvar > 0 {
			if p := br.peek(s.Offset, len(prefix)); p != nil {
				copy(prefix, p)
			} else if err := readAt(r, prefix, s.Offset); err != nil {
				return nil, fmt.Errorf("cache: read MDS sample %d: %w", i, err)
			}
		}
		at, v := s.Offset+4*nvar, 0
		for c, col := range cols {
			l := col.Size
			if l < 0 {
				l = int64(binary.LittleEndian.Uint32(prefix[4*v:]))
				v++
			}
			if l > s.Offset+s.Length-at {
				return nil, invalidf(what, "sample %d: column %q of %d bytes runs past the sample's end", i, col.Name, l)
			}
			s.Columns[c] = Range{Offset: at, Length: l}
			if sp := specs[c]; sp != nil {
				// The header's first two bytes say its length.
				head := br.peek(at, int(min(l, 2)))
				if end, ok := sp.headerLen(head); head != nil && !ok && end > len(head) && int64(end) <= l {
					head = br.peek(at, end)
				}
				if head != nil {
					s.Ndarray[c] = int32(geoTable.value(c, sp, head, l))
				}
			}
			at += l
		}
	}
	m.NdarrayHeaders = geoTable.list
	return m, nil
}

// MDSDataset is the index of an MDS dataset directory's index.json: the
// shard list with sample counts, and the columns.
type MDSDataset struct {
	Kind    string      `json:"kind"` // "dataset"
	Columns []MDSColumn `json:"columns"`
	Samples int64       `json:"samples"`
	Shards  []MDSShard  `json:"shards"`
}

// MDSShard is one shard of an MDS dataset. Basename is the raw shard;
// ZipBasename the compressed one when the writer compressed (only raw
// shards can be served by range). FirstSample is the dataset-wide index of
// the shard's first sample.
type MDSShard struct {
	Basename    string      `json:"basename"`
	Bytes       int64       `json:"bytes"`
	Samples     int64       `json:"samples"`
	FirstSample int64       `json:"first_sample"`
	Compression string      `json:"compression,omitempty"`
	ZipBasename string      `json:"zip_basename,omitempty"`
	Columns     []MDSColumn `json:"columns,omitempty"` // only when they differ from the dataset's
}

// ParseMDSIndex indexes an MDS dataset's index.json. A JSON file that is not
// an MDS index (no "shards" list) gives ErrNoIndex.
func ParseMDSIndex(r io.ReaderAt, size int64) (*MDSDataset, error) {
	const what = "MDS index.json"
	if size > mdsMaxIndexJSON {
		return nil, invalidf(what, "%d bytes exceed gdsfs's index limit of %d (16 MiB)", size, mdsMaxIndexJSON)
	}
	raw := make([]byte, size)
	if err := readAt(r, raw, 0); err != nil {
		return nil, fmt.Errorf("cache: read MDS index.json: %w", err)
	}
	var doc struct {
		Shards []struct {
			mdsConfig
			Samples *int64 `json:"samples"`
			RawData *struct {
				Basename string `json:"basename"`
				Bytes    int64  `json:"bytes"`
			} `json:"raw_data"`
			ZipData *struct {
				Basename string `json:"basename"`
			} `json:"zip_data"`
		} `json:"shards"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return nil, ErrNoIndex
	}
	if doc.Shards == nil {
		return nil, ErrNoIndex
	}
	d := &MDSDataset{Kind: "dataset", Shards: make([]MDSShard, 0, len(doc.Shards))}
	for i, s := range doc.Shards {
		if s.Format != "mds" {
			return nil, invalidf(what, "shard %d has format %q; only mds shards are indexed", i, s.Format)
		}
		if s.Samples == nil || *s.Samples < 0 || *s.Samples > 1<<40 || s.RawData == nil {
			return nil, invalidf(what, "shard %d lacks samples or raw_data", i)
		}
		cols, err := s.columns(what)
		if err != nil {
			return nil, err
		}
		sh := MDSShard{Basename: s.RawData.Basename, Bytes: s.RawData.Bytes, Samples: *s.Samples, FirstSample: d.Samples}
		if s.Compression != nil {
			sh.Compression = *s.Compression
		}
		if s.ZipData != nil {
			sh.ZipBasename = s.ZipData.Basename
		}
		if i == 0 {
			d.Columns = cols
		} else if !sameColumns(cols, d.Columns) {
			sh.Columns = cols
		}
		d.Samples += *s.Samples
		d.Shards = append(d.Shards, sh)
	}
	if d.Columns == nil {
		d.Columns = []MDSColumn{}
	}
	return d, nil
}

func sameColumns(a, b []MDSColumn) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
