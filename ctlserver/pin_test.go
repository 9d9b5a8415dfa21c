package ctlserver

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/tier"
)

// newTierEnv is newEnv's server with a memory tier of budget bytes (64 KiB
// extents, half a budget per uid).
func newTierEnv(t testing.TB, budget int64) (*testEnv, *tier.Tier) {
	t.Helper()
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20, noIndexes: true})
	tr, err := tier.New(tier.Config{BudgetBytes: budget, UIDShareBytes: budget / 2, ChunkBytes: 64 << 10, SettleTime: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	opts := e.srv.opts
	opts.Tier, opts.TierCopier = tr, tier.HostCopier{}
	if e.srv, err = NewServer(opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.srv.Close() })
	return e, tr
}

func pinBuf(off, n uint64, flags uint32) []byte {
	b := make([]byte, ctl.SizePin)
	(&ctl.PinRequest{Offset: off, Length: n, Flags: flags}).Encode(b)
	return b
}

// TestPinRefusals: every errno of docs/protocol.md 3.9 the server decides.
func TestPinRefusals(t *testing.T) {
	e, _ := newTierEnv(t, 256<<10)
	ro, _ := e.file("ro", 100<<10, os.O_RDONLY)
	// Others may write it: uid 10002 is told what the tier holds of it
	// (Server.tierTold), so an unpin of uid 10001's pin is refused.
	if err := os.Chmod(ro.Name(), 0o666); err != nil {
		t.Fatal(err)
	}
	wo, _ := e.file("wo", 4096, os.O_WRONLY)
	big, _ := e.file("big", 200<<10, os.O_RDONLY)
	dir, err := os.Open(e.dir)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	bad := pinBuf(0, 1, 0)
	bad[100] = 1
	for _, tc := range []struct {
		name  string
		uid   uint32
		f     *os.File
		buf   []byte
		errno syscall.Errno
	}{
		{"pin", 10001, ro, pinBuf(0, 1<<20, 0), 0},
		{"write-only descriptor", 10001, wo, pinBuf(0, 1, 0), syscall.EBADF},
		{"a directory", 10001, dir, pinBuf(0, 1, 0), syscall.ENOTTY},
		{"reserved byte", 10001, ro, bad, syscall.EINVAL},
		{"offset past the end", 10001, ro, pinBuf(1<<30, 1, 0), syscall.EINVAL},
		{"offset beyond int64", 10001, ro, pinBuf(1<<63, 1, 0), syscall.ERANGE},
		{"beyond the share", 10001, big, pinBuf(0, 1<<20, 0), syscall.E2BIG},
		{"unpin of another uid's, by a writer", 10002, ro, pinBuf(0, 0, ctl.PinUnpin), syscall.EPERM},
		{"unpin of its own", 10001, ro, pinBuf(0, 0, ctl.PinUnpin), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if errno := e.rawFile(tc.uid, tc.f, ctl.CmdPin, tc.buf); errno != tc.errno {
				t.Fatalf("PIN: %v, want %v", errno, tc.errno)
			}
		})
	}
	// Without a tier.
	plain := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 2 << 20, noIndexes: true})
	if errno := plain.rawFile(1, ro, ctl.CmdPin, pinBuf(0, 1, 0)); errno != syscall.EOPNOTSUPP {
		t.Fatalf("PIN without a tier: %v", errno)
	}
}

// TestPinHit: a pinned file's READ is served by the tier (engine code 5,
// to its owner) byte-exact; user.gdsfs.info says cached; STATUS shows a
// uid only its own part of the tier.
func TestPinHit(t *testing.T) {
	e, _ := newTierEnv(t, 1<<20)
	f, data := e.file("x", 100<<10+3, os.O_RDONLY)
	if err := os.Chown(f.Name(), 10001, 10001); err != nil { // told: its owner
		t.Fatal(err)
	}
	b := pinBuf(0, 1<<20, 0)
	if errno := e.rawFile(10001, f, ctl.CmdPin, b); errno != 0 {
		t.Fatal(errno)
	}
	r, err := ctl.DecodePinReply(b)
	if err != nil || r.Cached != uint64(len(data)) || r.Filled != uint64(len(data)) || r.Yours != 104<<10 || r.Chunk != 64<<10 {
		t.Fatalf("PIN reply %+v, %v", r, err)
	}
	cl := e.client(10001, ctl.Token{})
	ranges := []ctl.Range{{Offset: 3, Length: 70 << 10}, {Offset: 100 << 10, Length: 4096}}
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range ls {
		r := ranges[i]
		want := data[r.Offset:min(r.Offset+r.Length, uint64(len(data)))]
		got, err := cl.Bytes(context.Background(), l)
		if err != nil || l.Engine != ctl.EngineTier || !bytes.Equal(got, want) {
			t.Errorf("range %d: engine %v, bytes equal %v, %v", i, l.Engine, bytes.Equal(got, want), err)
		}
	}
	info, errno := e.srv.Xattr(context.Background(), fs.Caller{UID: 10001}, fs.XattrTarget{Path: f.Name(),
		Open: func() (*os.File, error) { return os.Open(f.Name()) }}, "user.gdsfs.info")
	var fi fileInfo
	if errno != 0 || json.Unmarshal(info, &fi) != nil || fi.Cached == nil || *fi.Cached != int64(len(data)) {
		t.Fatalf("user.gdsfs.info: %s, %v", info, errno)
	}
	// Uid 10002 pinned nothing: its tier figures are its own pins' (none),
	// not the node's (before, its cached_bytes was the tier's).
	if st := e.srv.StatsFor(10002); st.Tier == nil || len(st.Tier.UIDs) != 0 || st.Tier.CachedBytes != 0 || st.Tier.Scope != tier.ScopeUID {
		t.Errorf("uid 10002's STATUS tier: %+v", st.Tier)
	}
	if st := e.srv.StatsFor(0); len(st.Tier.UIDs) != 1 || st.Tier.Hits != 1 {
		t.Errorf("root's STATUS tier: %+v", st.Tier)
	}
	// A write through the mount (Changed) ends the hits.
	e.srv.Changed(f.Name())
	if ls, err = cl.Read(context.Background(), f, ctl.HostDevice, ranges[:1]); err != nil || ls[0].Engine == ctl.EngineTier {
		t.Fatalf("READ after Changed: %+v, %v", ls, err)
	}
}
