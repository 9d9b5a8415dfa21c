package reader

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/gdsfs/gdsfs/cache"
)

// indexDoc is the index JSON (docs/index-format.md) as PrintIndex reads it.
type indexDoc struct {
	Format   string `json:"format"`
	Version  int    `json:"version"`
	FileSize int64  `json:"file_size"`
	// tar
	Members int `json:"members"`
	Samples []struct {
		Key    string                 `json:"key"`
		Fields map[string]indexMember `json:"fields"`
		Offset int64                  `json:"offset"`
		Length int64                  `json:"length"`
		Cols   map[string]cache.Range `json:"columns"`
	} `json:"samples"`
	Other   []indexMember      `json:"other"`
	Skipped []cache.TarSkipped `json:"skipped"`
	// safetensors
	HeaderLength int64             `json:"header_length"`
	DataOffset   int64             `json:"data_offset"`
	Metadata     map[string]string `json:"metadata"`
	Tensors      []cache.Tensor    `json:"tensors"`
	// torchzip
	Archive string            `json:"archive"`
	Torch   bool              `json:"torch"`
	Records []cache.ZipRecord `json:"records"`
	// npy
	NpyVersion   string  `json:"npy_version"`
	Dtype        string  `json:"dtype"`
	ItemSize     int64   `json:"item_size"`
	FortranOrder bool    `json:"fortran_order"`
	Shape        []int64 `json:"shape"`
	DataLength   int64   `json:"data_length"`
	// mds
	Kind    string            `json:"kind"`
	Columns []cache.MDSColumn `json:"columns"`
	Shards  []cache.MDSShard  `json:"shards"`
}

type indexMember struct {
	Name   string `json:"name"`
	Offset int64  `json:"offset"`
	Length int64  `json:"length"`
	Link   string `json:"link"`
}

// PrintIndex prints an index JSON document (Index, LocalIndex) as gdsfs
// index's tables.
func PrintIndex(w io.Writer, doc []byte) error {
	var d indexDoc
	if err := json.Unmarshal(doc, &d); err != nil {
		return fmt.Errorf("decode index: %w", err)
	}
	if d.Version != cache.IndexVersion {
		return fmt.Errorf("index version %d: this gdsfs reads version %d; use --json", d.Version, cache.IndexVersion)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(cols ...any) {
		for i, c := range cols {
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			fmt.Fprint(tw, c)
		}
		fmt.Fprintln(tw)
	}
	switch d.Format {
	case string(cache.FormatTar):
		fmt.Fprintf(w, "tar, %d bytes: %d members, %d samples\n", d.FileSize, d.Members, len(d.Samples))
		row("NAME", "OFFSET", "LENGTH", "SAMPLE", "FIELD")
		for i, s := range d.Samples {
			fields := make([]string, 0, len(s.Fields))
			for f := range s.Fields {
				fields = append(fields, f)
			}
			sort.Slice(fields, func(a, b int) bool { return s.Fields[fields[a]].Offset < s.Fields[fields[b]].Offset })
			for _, f := range fields {
				m := s.Fields[f]
				row(m.Name+linkNote(m.Link), m.Offset, m.Length, i, f)
			}
		}
		for _, m := range d.Other {
			row(m.Name+linkNote(m.Link), m.Offset, m.Length, "-", "-")
		}
		for _, s := range d.Skipped {
			row(s.Name, "-", "-", "skipped", s.Type+": "+s.Reason)
		}
	case string(cache.FormatSafetensors):
		fmt.Fprintf(w, "safetensors, %d bytes: %d tensors, data at %d\n", d.FileSize, len(d.Tensors), d.DataOffset)
		keys := make([]string, 0, len(d.Metadata))
		for k := range d.Metadata {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(w, "metadata %s = %q\n", k, d.Metadata[k])
		}
		row("NAME", "DTYPE", "SHAPE", "OFFSET", "LENGTH")
		for _, t := range d.Tensors {
			row(t.Name, t.Dtype, shapeString(t.Shape), t.Offset, t.Length)
		}
	case string(cache.FormatTorchZip):
		what := "zip"
		if d.Torch {
			what = "torch.save zip"
		}
		fmt.Fprintf(w, "%s %q, %d bytes: %d records\n", what, d.Archive, d.FileSize, len(d.Records))
		row("NAME", "OFFSET", "LENGTH", "STORED")
		for _, r := range d.Records {
			stored := "yes"
			if r.Compressed {
				stored = fmt.Sprintf("no (compressed, %d bytes unpacked)", r.UncompressedLength)
			}
			row(r.Name, r.Offset, r.Length, stored)
		}
	case string(cache.FormatNpy):
		fmt.Fprintf(w, "npy %s, %d bytes\n", d.NpyVersion, d.FileSize)
		row("dtype", d.Dtype)
		row("shape", shapeString(d.Shape))
		row("fortran_order", d.FortranOrder)
		row("data", fmt.Sprintf("offset %d, length %d (name \"data\")", d.DataOffset, d.DataLength))
	case string(cache.FormatMDS):
		cols := make([]string, len(d.Columns))
		for i, c := range d.Columns {
			cols[i] = fmt.Sprintf("%s:%s", c.Name, c.Encoding)
		}
		if d.Kind == "dataset" {
			total := int64(0)
			for _, s := range d.Shards {
				total += s.Samples
			}
			fmt.Fprintf(w, "MDS dataset: %d shards, %d samples, columns %s\n", len(d.Shards), total, strings.Join(cols, " "))
			row("SHARD", "SAMPLES", "FIRST", "BYTES", "COMPRESSED")
			for _, s := range d.Shards {
				row(s.Basename, s.Samples, s.FirstSample, s.Bytes, orDash(s.ZipBasename))
			}
			break
		}
		fmt.Fprintf(w, "MDS shard, %d bytes: %d samples, columns %s\n", d.FileSize, len(d.Samples), strings.Join(cols, " "))
		row("NAME", "OFFSET", "LENGTH")
		for i, s := range d.Samples {
			row(fmt.Sprintf("sample/%d", i), s.Offset, s.Length)
			for _, c := range d.Columns {
				if r, ok := s.Cols[c.Name]; ok {
					row(fmt.Sprintf("sample/%d/%s", i, c.Name), r.Offset, r.Length)
				}
			}
		}
	default:
		return fmt.Errorf("index format %q is unknown to this gdsfs; use --json", d.Format)
	}
	return tw.Flush()
}

func linkNote(link string) string {
	if link == "" {
		return ""
	}
	return " -> " + link
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func shapeString(s []int64) string {
	var b bytes.Buffer
	b.WriteByte('[')
	for i, d := range s {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprint(&b, d)
	}
	b.WriteByte(']')
	return b.String()
}
