package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/tier"
)

// tierSeenBy is what uid is told of the tier through the mount: STATUS's
// tier (the AUDIT child's) and gdsfs status's tier line.
func tierSeenBy(t *testing.T, m *tierMount, uid uint32) string {
	t.Helper()
	out := child{family: "AUDIT", mode: "status", uid: uid, env: map[string]string{"MNT": m.mnt}}.mustRun(t, time.Minute)
	var st ctlserver.Stats
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &st); err != nil || st.Tier == nil {
		t.Fatalf("uid %d's STATUS: %v: %s", uid, err, out)
	}
	text, code := runAsUID(t, uid, gdsfsBin(t), "status", m.mnt)
	line := regexp.MustCompile(`(?m)^tier:.*$`).FindString(text)
	if code != 0 || line == "" {
		t.Fatalf("uid %d's gdsfs status: exit %d:\n%s", uid, code, text)
	}
	b, _ := json.Marshal(st.Tier)
	return string(b) + "\n" + line
}

// ownTier is uid's STATUS tier.
func ownTier(t *testing.T, m *tierMount, uid uint32) tier.Stats {
	t.Helper()
	var st tier.Stats
	if err := json.Unmarshal([]byte(strings.SplitN(tierSeenBy(t, m, uid), "\n", 2)[0]), &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// warmAs runs gdsfs warm (args) as uid on files of m and keeps what does
// not depend on timing.
func warmAs(t *testing.T, m *tierMount, uid uint32, args ...string) string {
	t.Helper()
	full := []string{"warm", "--progress", "never"}
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			a = filepath.Join(m.mnt, a)
		}
		full = append(full, a)
	}
	out, code := runAsUID(t, uid, gdsfsBin(t), full...)
	return strings.Join(warmFigures.FindAllString(fmt.Sprintf("%s exit %d", out, code), -1), " | ")
}

// tierShareFiles writes name (n bytes, the same bytes for every name) as
// uid's 0644 file in m's backing directory.
func tierShareFiles(t *testing.T, m *tierMount, uid uint32, n int, names ...string) {
	t.Helper()
	data := randomBytes(uint64(n), n)
	for _, name := range names {
		p := filepath.Join(m.backing, name)
		writeFile(t, p, data)
		if err := os.Chown(p, int(uid), int(uid)); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTierShareNotToldMount: uid 10002, whose share is 3 extents, holds
// its own g (1 extent) and pins f (3 extents), a 0644 file of uid 10001's
// it may read, neither owns nor may write. Everything it is told (warm
// --pin's figures, its STATUS tier and gdsfs status line, whether its g
// was evicted for f, its unpin) is the same whether 10001 pinned f before
// or nobody did. Before, a pin of extents 10001 held charged 10002
// nothing: f fit beside g exactly when 10001 had pinned it.
func TestTierShareNotToldMount(t *testing.T) {
	const a, b = 10001, 10002
	run := func(t *testing.T, pinnedByA bool) string {
		m := startTier(t, tierOpts{budget: 16 * tierChunk, share: 3 * tierChunk})
		tierShareFiles(t, m, a, 3*tierChunk-5000, "f.bin")
		tierShareFiles(t, m, b, tierChunk, "g.bin")
		var seen []string
		seen = append(seen, warmAs(t, m, b, "--pin", "g.bin"))
		if pinnedByA {
			if out := warmAs(t, m, a, "--pin", "f.bin"); !strings.Contains(out, "exit 0") {
				t.Fatalf("uid %d's warm --pin: %s", a, out)
			}
		}
		seen = append(seen, warmAs(t, m, b, "--pin", "f.bin"), tierSeenBy(t, m, b),
			warmAs(t, m, b, "--pin", "g.bin"), // g evicted for f: read again
			warmAs(t, m, b, "--unpin", "f.bin"), tierSeenBy(t, m, b))
		return strings.Join(seen, "\n")
	}
	alone, after := run(t, false), run(t, true)
	if alone != after {
		t.Errorf("uid %d is told of uid %d's pin:\npinned by %d first:\n%s\npinned by nobody:\n%s", b, a, a, after, alone)
	}
	if strings.Count(alone, "pinned 1 files, 256 KiB | read 256 KiB into the tier | (0 B were already in it)") != 2 {
		t.Errorf("uid %d's second pin of g (evicted for f) read nothing:\n%s", b, alone)
	}
}

// TestTierUnpinMovesChargeMount: uid 10001 pins f, uid 10002 pins f too
// (reading nothing), uid 10001 unpins it. Uid 10001's STATUS says it holds
// nothing and it may pin its whole share again; uid 10002 keeps f and is
// charged for it (its share counts f: pinning k evicts it). What uid 10002
// is told stays the same through uid 10001's pin and unpin. Before, f
// went with 10001's unpin (its extents were charged to 10001 alone).
func TestTierUnpinMovesChargeMount(t *testing.T) {
	const a, b = 10001, 10002
	m := startTier(t, tierOpts{budget: 16 * tierChunk, share: 3 * tierChunk})
	tierShareFiles(t, m, a, 2*tierChunk, "f.bin")
	tierShareFiles(t, m, a, 3*tierChunk, "h.bin")
	tierShareFiles(t, m, b, 2*tierChunk, "k.bin")
	for _, uid := range []uint32{a, b} {
		if out := warmAs(t, m, uid, "--pin", "f.bin"); !strings.Contains(out, "exit 0") {
			t.Fatalf("uid %d's warm --pin f: %s", uid, out)
		}
	}
	bBefore := tierSeenBy(t, m, b)
	if out := warmAs(t, m, a, "--unpin", "f.bin"); !strings.Contains(out, "exit 0") {
		t.Fatalf("uid %d's warm --unpin f: %s", a, out)
	}
	if st := ownTier(t, m, a); st.UsedBytes != 0 || len(st.UIDs) != 0 {
		t.Errorf("uid %d's STATUS after its unpin: %+v; want nothing held", a, st)
	}
	if c := m.cached(t, "f.bin"); c != 2*tierChunk {
		t.Errorf("uid %d's pin of f lost with uid %d's unpin: %d bytes cached", b, a, c)
	}
	if bAfter := tierSeenBy(t, m, b); bAfter != bBefore {
		t.Errorf("uid %d is told of uid %d's unpin:\nbefore: %s\nafter:  %s", b, a, bBefore, bAfter)
	}
	if st := ownTier(t, m, b); st.UsedBytes != 2*tierChunk {
		t.Errorf("uid %d's STATUS: %+v; want f charged to it", b, st)
	}
	if out := warmAs(t, m, a, "--pin", "h.bin"); !strings.Contains(out, "read 768 KiB into the tier") || !strings.Contains(out, "exit 0") {
		t.Errorf("uid %d's pin of its whole share after its unpin: %s", a, out)
	}
	if out := warmAs(t, m, b, "--pin", "k.bin"); !strings.Contains(out, "exit 0") {
		t.Fatalf("uid %d's warm --pin k: %s", b, out)
	}
	if c := m.cached(t, "f.bin"); c != 0 {
		t.Errorf("uid %d holds f (%d bytes) and k beyond its 3-extent share", b, c)
	}
	if st := ownTier(t, m, b); st.UsedBytes != 2*tierChunk || st.Files != 1 {
		t.Errorf("uid %d's STATUS after pinning k: %+v", b, st)
	}
}

// pinRangeAs issues one PIN of [off, off+n) of path as uid (a Python
// process: the CLI pins whole files only) and returns its errno, or its
// cached and filled.
func pinRangeAs(t *testing.T, uid uint32, path string, off, n int64) string {
	t.Helper()
	py := `import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
buf = bytearray(128)
struct.pack_into("<IHH", buf, 0, 0x53464447, 1, 0)
struct.pack_into("<QQ", buf, 32, int(sys.argv[2]), int(sys.argv[3]))
try:
    fcntl.ioctl(fd, 0xC0804714, buf, True)
    print("cached", struct.unpack_from("<Q", buf, 40)[0], "filled", struct.unpack_from("<Q", buf, 48)[0])
except OSError as e:
    print("errno", e.errno)
`
	out, code := runAsUID(t, uid, "/usr/bin/python3", "-c", py, path, fmt.Sprint(off), fmt.Sprint(n))
	if code != 0 {
		t.Fatalf("uid %d's PIN: exit %d: %s", uid, code, out)
	}
	return strings.TrimSpace(out)
}

// TestTierShareAboveNotToldMount: uid 10002 (a 3-extent share) PINs the
// whole of uid 10001's 4-extent file, of which 10001 pinned 2 extents, or
// nobody did: E2BIG both times, and its STATUS the same. Before, the PIN
// succeeded when 10001 had pinned 2 extents (it was charged only the 2
// others).
func TestTierShareAboveNotToldMount(t *testing.T) {
	const a, b = 10001, 10002
	run := func(t *testing.T, pinnedByA bool) string {
		m := startTier(t, tierOpts{budget: 16 * tierChunk, share: 3 * tierChunk})
		tierShareFiles(t, m, a, 4*tierChunk, "big.bin")
		p := filepath.Join(m.mnt, "big.bin")
		if pinnedByA {
			if got := pinRangeAs(t, a, p, 0, 2*tierChunk); got != fmt.Sprint("cached ", 2*tierChunk, " filled ", 2*tierChunk) {
				t.Fatalf("uid %d's PIN of 2 extents: %s", a, got)
			}
		}
		return pinRangeAs(t, b, p, 0, 4*tierChunk) + "\n" + tierSeenBy(t, m, b)
	}
	alone, after := run(t, false), run(t, true)
	if alone != after {
		t.Errorf("uid %d is told of uid %d's pin:\npinned by %d first:\n%s\npinned by nobody:\n%s", b, a, a, after, alone)
	}
	if !strings.HasPrefix(alone, "errno 7\n") {
		t.Errorf("uid %d's PIN of 4 extents with a 3-extent share: %s; want E2BIG (7)", b, alone)
	}
}
