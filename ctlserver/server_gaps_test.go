package ctlserver

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/fs"
)

// The index cache's counters are part of user.gdsfs.stats / STATUS.
func TestStatsIndexCache(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	p, _ := tarFile(t, e.dir, 3)
	for range 2 { // a miss (one parse), then a hit
		if _, errno := e.srv.Xattr(ctx, fs.Caller{UID: 1000}, pathTarget(p, false), "user.gdsfs.index"); errno != 0 {
			t.Fatal(errno)
		}
	}
	doc, errno := e.srv.Xattr(ctx, fs.Caller{UID: 1000}, pathTarget(e.dir, true), "user.gdsfs.stats")
	if errno != 0 {
		t.Fatal(errno)
	}
	var st struct {
		Index *struct {
			Hits, Misses, Parses uint64
			Evictions            *uint64
			BudgetBytes          int64 `json:"budget_bytes"`
		} `json:"index"`
	}
	if err := json.Unmarshal(doc, &st); err != nil {
		t.Fatal(err)
	}
	if st.Index == nil || st.Index.Hits != 1 || st.Index.Misses != 1 || st.Index.Parses != 1 || st.Index.Evictions == nil || st.Index.BudgetBytes != 16<<20 {
		t.Errorf("stats index figures: %s", doc)
	}
	e2 := newEnv(t, envOptions{noIndexes: true})
	if doc, _ := e2.srv.Xattr(ctx, fs.Caller{UID: 1000}, pathTarget(e2.dir, true), "user.gdsfs.stats"); strings.Contains(string(doc), `"index"`) {
		t.Errorf("stats of a server without indexes: %s", doc)
	}
}

// A corrupt shard: user.gdsfs.index stays ENODATA, user.gdsfs.info says why.
func TestInfoIndexError(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	c := fs.Caller{UID: 1000}
	bad := filepath.Join(e.dir, "bad.tar")
	junk := make([]byte, 1024)
	copy(junk[257:], "ustar\x00")
	if err := os.WriteFile(bad, junk, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, errno := e.srv.Xattr(ctx, c, pathTarget(bad, false), "user.gdsfs.index"); errno != syscall.ENODATA {
		t.Fatalf("index of a corrupt tar: %v, want ENODATA", errno)
	}
	v, errno := e.srv.Xattr(ctx, c, pathTarget(bad, false), "user.gdsfs.info")
	if errno != 0 {
		t.Fatal(errno)
	}
	var fi fileInfo
	if err := json.Unmarshal(v, &fi); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(fi.IndexError, "tar") || fi.Format != "" {
		t.Errorf("info of a corrupt tar: %s; want index_error naming the format", v)
	}
	plain, _ := e.file("plain.bin", 100, os.O_RDONLY)
	if v, _ := e.srv.Xattr(ctx, c, pathTarget(plain.Name(), false), "user.gdsfs.info"); strings.Contains(string(v), "index_error") {
		t.Errorf("info of a file of no format has index_error: %s", v)
	}
}

// Ioctls of other types (a tty TCGETS from Python's open()) are ENOTTY but
// not counted as refusals; an unknown 'G' command still is.
func TestForeignIoctlsNotRefusals(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	f, _ := e.file("x.bin", 100, os.O_RDONLY)
	const tcgets = 0x5401
	if errno := e.rawFile(1000, f, tcgets, make([]byte, 0)); errno != syscall.ENOTTY {
		t.Fatalf("TCGETS on a data file: %v, want ENOTTY", errno)
	}
	sess, errno := e.srv.OpenSession(ctx, fs.Caller{UID: 1000})
	if errno != 0 {
		t.Fatal(errno)
	}
	defer sess.Close()
	if _, errno := sess.Ioctl(ctx, fs.Caller{UID: 1000}, tcgets, nil, nil); errno != syscall.ENOTTY {
		t.Fatalf("TCGETS on .gdsfs: %v, want ENOTTY", errno)
	}
	st := e.srv.Stats().Counters
	if st.Errors["ENOTTY"] != 0 || st.Foreign != 2 {
		t.Errorf("after two TCGETS: refused %v, foreign %d; want no ENOTTY refusal, 2 foreign", st.Errors, st.Foreign)
	}
	unknown := uint32(3<<30 | 64<<16 | 'G'<<8 | 0x7f)
	if errno := e.rawFile(1000, f, unknown, make([]byte, 64)); errno != syscall.ENOTTY {
		t.Fatalf("unknown G command: %v, want ENOTTY", errno)
	}
	if n := e.srv.Stats().Counters.Errors["ENOTTY"]; n != 1 {
		t.Errorf("unknown G command counted %d times as ENOTTY, want 1", n)
	}
}
