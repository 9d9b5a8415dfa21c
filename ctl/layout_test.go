package ctl

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// docField is one field of a layout in docs/protocol.md.
type docField struct {
	off int
	typ string // "u32", "i32", "u64", "32 bytes", ...
}

var (
	docHeading = regexp.MustCompile(`^#+ ([0-9]+(?:\.[0-9]+)*)\.? `)
	docRow     = regexp.MustCompile("^\\| ([0-9]+) \\| ([^|]*?) \\| `([a-z_]+)(?:\\[[a-z0-9]+\\])?`")
	docInline  = regexp.MustCompile("`([0-9]+) ([ui][0-9]+) ([a-z_]+)")
	docCommand = regexp.MustCompile("^\\| `([A-Z_]+)` \\| 0x[0-9a-f]+ \\| ([0-9]+) \\| `0x([0-9A-F]+)` \\| (control|data) file \\|")
)

// readProtocolDoc returns the fields of every layout of docs/protocol.md,
// keyed by "section part" ("3.6 request", "2 "), and its command table.
func readProtocolDoc(t *testing.T) (map[string]map[string]docField, []Command) {
	t.Helper()
	f, err := os.Open("../docs/protocol.md")
	if err != nil {
		t.Fatalf("the normative protocol text: %v", err)
	}
	defer f.Close()
	layouts := map[string]map[string]docField{}
	var cmds []Command
	section, part := "", ""
	add := func(off, typ, name string) {
		key := section + " " + part
		if layouts[key] == nil {
			layouts[key] = map[string]docField{}
		}
		n, _ := strconv.Atoi(off)
		if _, dup := layouts[key][name]; !dup {
			layouts[key][name] = docField{n, strings.TrimSpace(typ)}
		}
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if m := docHeading.FindStringSubmatch(line); m != nil {
			section, part = m[1], ""
			continue
		}
		switch {
		case strings.HasPrefix(line, "Request:"), strings.Contains(line, ". Request:"):
			part = "request"
		case strings.HasPrefix(line, "Reply:"):
			part = "reply"
		}
		if m := docCommand.FindStringSubmatch(line); m != nil {
			size, _ := strconv.Atoi(m[2])
			cmd, _ := strconv.ParseUint(m[3], 16, 32)
			cmds = append(cmds, Command{Cmd: uint32(cmd), Name: m[1], Size: size, File: m[4] == "data"})
			continue
		}
		if m := docRow.FindStringSubmatch(line); m != nil {
			add(m[1], m[2], m[3])
			continue
		}
		for _, m := range docInline.FindAllStringSubmatch(line, -1) {
			add(m[1], m[2], m[3])
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return layouts, cmds
}

// at is a field of this package's layouts, as the document names its type.
func at[T u16 | u32 | u64](o T, signed bool) docField {
	typ := map[bool]string{false: "u", true: "i"}[signed]
	switch any(o).(type) {
	case u16:
		typ += "16"
	case u32:
		typ += "32"
	case u64:
		typ += "64"
	}
	return docField{int(o), typ}
}

// area is a byte area of a layout.
func area(start, end int) docField { return docField{start, fmt.Sprintf("%d bytes", end-start)} }

// TestLayoutsMatchProtocolDoc: every field offset, type and size of the
// layouts wire.go encodes and decodes is the one docs/protocol.md's tables
// give, every field those tables name is in a layout, and the command
// table is the document's.
func TestLayoutsMatchProtocolDoc(t *testing.T) {
	doc, cmds := readProtocolDoc(t)
	const u, i = false, true
	want := map[string]map[string]docField{
		"1.3 ": {"magic": at(hdrMagic, u), "version": at(hdrVersion, u), "flags": at(hdrFlags, u),
			"session": at(hdrSession, u), "secret": at(hdrSecret, u)},
		"2 ": {"lease": at(leaseID, u), "slab": at(leaseSlab, u), "offset": at(leaseOffset, u),
			"length": at(leaseLength, u), "valid": at(leaseValid, u), "engine": at(leaseEngine, u)},
		"3.1 reply": {"version": at(helloVersion, u), "uid": at(helloUID, u), "caps": at(helloCaps, u),
			"session": at(helloSession, u), "secret": at(helloSecret, u), "max_ranges": at(helloMaxRanges, u),
			"max_names_bytes": at(helloMaxNamesBytes, u), "align": at(helloAlign, u), "devices": at(helloDevices, u),
			"max_lease": at(helloMaxLease, u), "page": at(helloPage, u), "daemon_pid": at(helloDaemonPID, u),
			"engine": area(helloEngine, helloEngineEnd), "daemon_version": area(helloDaemonVersion, helloDaemonVersionEnd),
			"slab_socket": area(helloSlabSocket, helloSlabSocketEnd)},
		"3.2 request": {"slab": at(slabReqSlab, u)},
		"3.2 reply": {"slab": at(slabSlab, u), "size": at(slabSize, u), "map_offset": at(slabMapOffset, u),
			"kind": at(slabKind, u), "device": at(slabDevice, i), "handle_len": at(slabHandleLen, u),
			"handle": area(slabHandle, slabHandle+HandleBytes)},
		"3.3 request": {"device": at(allocDevice, i), "reserved": at(allocReserved, u), "length": at(allocLength, u)},
		"3.4 request": {"count": at(releaseCount, u), "ids": at(releaseIDs, u)},
		"3.4 reply":   {"released": at(releaseReleased, u), "status": at(releaseStatus, i)},
		"3.5 request": {"offset": at(pageReqOffset, u), "flags": at(pageReqFlags, u)},
		"3.5 reply": {"total": at(pageTotal, u), "generation": at(pageGeneration, u), "len": at(pageLen, u), "form": at(pageForm, u),
			"version": at(pageVersion, u), "data": area(pageData, pageData+PageBytes)},
		"3.6 request": {"device": at(readDevice, i), "flags": at(readFlags, u), "count": at(readCount, u),
			"version": at(readVersion, u), "ranges": {readRanges, fmt.Sprintf("%d bytes × %d", rangeBytes, MaxRanges)}},
		"3.6 reply": {"count": at(readReplyCount, u)},
		"3.7 request": {"device": at(readDevice, i), "flags": at(readFlags, u), "count": at(readCount, u),
			"names_len": at(namesLen, u), "names": area(namesArea, namesArea+NamesBytes)},
		"3.8 request": {"lease": at(writeLease, u), "lease_offset": at(writeLeaseOffset, u),
			"file_offset": at(writeFileOffset, u), "length": at(writeLength, u), "flags": at(writeFlags, u)},
		"3.8 reply": {"written": at(writeWritten, u), "engine": at(writeEngine, u)},
	}
	for key, fields := range want {
		for name, w := range fields {
			got, ok := doc[key][name]
			if !ok {
				t.Errorf("%s: docs/protocol.md has no field %q", key, name)
				continue
			}
			if got != w {
				t.Errorf("%s %s: docs/protocol.md says offset %d, %s; wire.go has %d, %s", key, name, got.off, got.typ, w.off, w.typ)
			}
		}
		for name := range doc[key] {
			if _, ok := fields[name]; !ok {
				t.Errorf("%s: docs/protocol.md names %q, which wire.go's layout lacks", key, name)
			}
		}
	}
	if got, want := fmt.Sprint(cmds), fmt.Sprint(Commands()); got != want {
		t.Errorf("docs/protocol.md's commands:\n%s\nctl.Commands():\n%s", got, want)
	}
	// Record sizes the arrays step by.
	if leaseBytes != 48 || rangeBytes != 16 || headerBytes != 32 {
		t.Errorf("record sizes %d, %d, %d; docs/protocol.md: lease 48, range 16, header 32", leaseBytes, rangeBytes, headerBytes)
	}
}

// docSized is a command as a section heading of docs/protocol.md names it:
// "### 3.6 `READ` (data file, 12352 bytes): ...".
var docSized = regexp.MustCompile("`([A-Z_]+)` \\((control|data) file, ([0-9]+) bytes\\)")

// TestHeadingSizesMatchCommands: each command's section heading in
// docs/protocol.md gives the file it is issued on and the buffer size of
// the command table (section 1.1 and ctl.Commands()).
func TestHeadingSizesMatchCommands(t *testing.T) {
	b, err := os.ReadFile("../docs/protocol.md")
	if err != nil {
		t.Fatalf("the normative protocol text: %v", err)
	}
	got := map[string]Command{}
	for _, line := range strings.Split(string(b), "\n") {
		if !docHeading.MatchString(line) {
			continue
		}
		for _, m := range docSized.FindAllStringSubmatch(line, -1) {
			size, _ := strconv.Atoi(m[3])
			got[m[1]] = Command{Name: m[1], Size: size, File: m[2] == "data"}
		}
	}
	for _, c := range Commands() {
		h, ok := got[c.Name]
		if !ok {
			t.Errorf("%s: no section heading of docs/protocol.md names its size", c.Name)
			continue
		}
		if h.Size != c.Size || h.File != c.File {
			t.Errorf("%s: the heading says %d bytes, data file %v; ctl.Commands() %d bytes, data file %v", c.Name, h.Size, h.File, c.Size, c.File)
		}
		delete(got, c.Name)
	}
	for name := range got {
		t.Errorf("docs/protocol.md has a section for %s, which ctl.Commands() lacks", name)
	}
}
