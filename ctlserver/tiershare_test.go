package ctlserver

import (
	"context"
	"encoding/json"
	"os"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
)

// TestTierFiguresOwnOnly: what STATUS's tier and a PIN report tell uid
// 10002 (its own pins' figures and the tier's configuration) do not move
// while uid 10001 pins a file, READs it from the tier and unpins it, and
// move with 10002's own pin; root's figures (the node's) move with
// 10001's. Before, every uid's STATUS had the node's used and cached
// bytes, files and hit counters, and PIN's used was the tier's memory:
// 10002 could watch 10001's pins come and go.
func TestTierFiguresOwnOnly(t *testing.T) {
	e, _ := newTierEnv(t, 1<<20)
	a, _ := e.file("a", 200<<10, os.O_RDONLY)
	b, _ := e.file("b", 100<<10, os.O_RDONLY)
	for uid, f := range map[int]*os.File{10001: a, 10002: b} {
		if err := os.Chown(f.Name(), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	pin := func(uid uint32, f *os.File, n uint64, flags uint32) ctl.PinReply {
		t.Helper()
		buf := pinBuf(0, n, flags)
		if errno := e.rawFile(uid, f, ctl.CmdPin, buf); errno != 0 {
			t.Fatalf("uid %d: PIN of %d bytes: %v", uid, n, errno)
		}
		r, err := ctl.DecodePinReply(buf)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	// seen is what uid 10002 is told of the tier, and root.
	seen := func() (string, string) {
		t.Helper()
		mine, _ := json.Marshal(struct {
			Status any
			Report ctl.PinReply
		}{e.srv.StatsFor(10002).Tier, pin(10002, b, 0, 0)})
		root, _ := json.Marshal(e.srv.StatsFor(0).Tier)
		return string(mine), string(root)
	}
	pin(10002, b, 1<<20, 0)
	before, rootBefore := seen()
	steps := []struct {
		name string
		do   func()
	}{
		{"uid 10001 pins its file", func() { pin(10001, a, 1<<20, 0) }},
		{"uid 10001 READs it from the tier", func() {
			cl := e.client(10001, ctl.Token{})
			ls, err := cl.Read(context.Background(), a, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 64 << 10}})
			if err != nil || ls[0].Engine != ctl.EngineTier {
				t.Fatalf("uid 10001's READ: %v, %+v", err, ls)
			}
			releaseAll(t, cl, ls)
		}},
		{"uid 10001 pins uid 10002's file too", func() { pin(10001, b, 1<<20, 0) }},
		{"uid 10001 unpins both", func() { pin(10001, a, 0, ctl.PinUnpin); pin(10001, b, 0, ctl.PinUnpin) }},
	}
	rootMoved := false
	for _, s := range steps {
		s.do()
		mine, root := seen()
		if mine != before {
			t.Errorf("after %s, uid 10002 is told:\n%s\nbefore:\n%s", s.name, mine, before)
		}
		rootMoved = rootMoved || root != rootBefore
	}
	if !rootMoved {
		t.Errorf("root's tier figures never moved with uid 10001's pins: %s", rootBefore)
	}
	st := e.srv.StatsFor(10002).Tier
	if st.UsedBytes != 100<<10 || st.CachedBytes != 100<<10 || st.Files != 1 || len(st.UIDs) != 1 || st.UIDs[0].Bytes != 100<<10 {
		t.Errorf("uid 10002's own figures: %+v", st)
	}
	if r := pin(10002, b, 0, 0); r.Used != 100<<10 || r.Yours != 100<<10 || r.Budget != 1<<20 || r.Share != 512<<10 {
		t.Errorf("uid 10002's PIN report: %+v", r)
	}
}
