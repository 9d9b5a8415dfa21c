package ctlserver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// tierAnswer is everything a uid is told about a file of the tier's, in
// the order it asks: its READs' engine codes and its STATUS's readahead
// figures after them, user.gdsfs.info, PIN replies (a report, a pin, a
// pin again; the tier's global use left out), its STATUS's own tier bytes,
// and unpin's errno and the info after it.
type tierAnswer struct {
	Engines             []ctl.EngineCode
	Readahead           [3]uint64
	Info                string
	Report, Pin, Repin  ctl.PinReply
	StatusBytes         int64
	Unpin               syscall.Errno
	InfoAfter, Reported string
}

// askTier is what uid asker is told of a 0644 file of uid 10001 after uid
// pinner pinned it whole (0: nobody did), in a fresh server with a tier;
// readers is --residency readers.
func askTier(t *testing.T, asker, pinner uint32, readers bool) tierAnswer {
	t.Helper()
	const (
		fileBytes = 2 << 20
		sample    = 8 << 10
		k         = 8
		step      = k * (sample + 512)
	)
	e, _ := newTierEnv(t, 8<<20)
	e.srv.opts.ResidencyToReaders = readers
	f, data := e.file("shared.bin", fileBytes, os.O_RDONLY)
	if err := os.Chown(f.Name(), 10001, 10001); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	pin := func(uid uint32, n uint64, flags uint32) (ctl.PinReply, syscall.Errno) {
		t.Helper()
		// The caller's own descriptor, as through the mount.
		g, err := os.Open(f.Name())
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		b := pinBuf(0, n, flags)
		if errno := e.rawFile(uid, g, ctl.CmdPin, b); errno != 0 {
			return ctl.PinReply{}, errno
		}
		r, err := ctl.DecodePinReply(b)
		if err != nil {
			t.Fatal(err)
		}
		r.Used = 0 // the tier's use: every pin's, like the kernel's meminfo
		return r, 0
	}
	if pinner != 0 {
		if _, errno := pin(pinner, 1<<30, 0); errno != 0 {
			t.Fatalf("uid %d's pin: %v", pinner, errno)
		}
	}
	info := func() string {
		t.Helper()
		b, errno := e.srv.Xattr(context.Background(), fs.Caller{UID: asker, GID: asker, PID: 1},
			fs.XattrTarget{Path: f.Name(), Open: func() (*os.File, error) { return os.Open(f.Name()) }}, "user.gdsfs.info")
		if errno != 0 {
			t.Fatalf("uid %d: user.gdsfs.info: %v", asker, errno)
		}
		// The fields that name this test's copy of the file go.
		var v map[string]any
		if err := json.Unmarshal(b, &v); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"path", "dev", "ino", "mtime_ns"} {
			delete(v, k)
		}
		out, _ := json.Marshal(v)
		return string(out)
	}
	var a tierAnswer
	cl := e.client(asker, ctl.Token{})
	for j := range 4 {
		rs := batch(uint64(j)*step, k, sample)
		ls, err := cl.Read(context.Background(), f, ctl.HostDevice, rs)
		if err != nil {
			t.Fatalf("uid %d: READ: %v", asker, err)
		}
		checkBytes(t, cl, rs, ls, data)
		for _, l := range ls {
			a.Engines = append(a.Engines, l.Engine)
		}
		releaseAll(t, cl, ls)
		e.srv.ra.wg.Wait()
	}
	c := e.srv.StatsFor(asker).Counters
	a.Readahead = [3]uint64{c.Readaheads, c.ReadaheadBytes, c.ReadaheadDropped}
	a.Info = info()
	var errno syscall.Errno
	for _, p := range []struct {
		r *ctl.PinReply
		n uint64
	}{{&a.Report, 0}, {&a.Pin, 1 << 30}, {&a.Repin, 1 << 30}} {
		if *p.r, errno = pin(asker, p.n, 0); errno != 0 {
			t.Fatalf("uid %d: PIN of %d bytes: %v", asker, p.n, errno)
		}
	}
	if st := e.srv.StatsFor(asker).Tier; st != nil {
		for _, u := range st.UIDs {
			if u.UID == asker {
				a.StatusBytes = u.Bytes
			}
		}
	}
	_, a.Unpin = pin(asker, 0, ctl.PinUnpin)
	a.InfoAfter = info()
	r, _ := pin(asker, 0, 0)
	a.Reported = fmt.Sprint(r.Cached, r.Filled)
	return a
}

// TestTierNotToldToOtherUsers: uid 10002 may read uid 10001's 0644 file,
// neither owns nor may write it. The kernel would not tell it the file's
// page-cache residency, and the memory tier is residency too: nothing
// 10002 is told (its READs' engines, its readahead figures, the info, its
// PIN replies, its STATUS bytes, its unpin) may differ between "10001
// pinned the file" and "nobody did", while the owner, root, and every
// reader with --residency readers are told what the tier holds (the
// answers differ, so the test can fail).
func TestTierNotToldToOtherUsers(t *testing.T) {
	for _, tc := range []struct {
		who           string
		asker, pinner uint32
		readers, told bool
	}{
		{"other user", 10002, 10001, false, false},
		{"owner", 10001, 10002, false, true},
		{"root", 0, 10001, false, true},
		{"other user, --residency readers", 10002, 10001, true, true},
	} {
		t.Run(tc.who, func(t *testing.T) {
			pinned, none := askTier(t, tc.asker, tc.pinner, tc.readers), askTier(t, tc.asker, 0, tc.readers)
			same := reflect.DeepEqual(pinned, none)
			switch {
			case tc.told && same:
				t.Errorf("uid %d is told nothing of uid %d's pin: %+v", tc.asker, tc.pinner, pinned)
			case !tc.told && !same:
				t.Errorf("uid %d (neither owner nor writer) is told of uid %d's pin:\npinned by %d:\n%+v\npinned by nobody:\n%+v",
					tc.asker, tc.pinner, tc.pinner, pinned, none)
			}
			for _, eng := range pinned.Engines {
				if tc.told && eng != ctl.EngineTier {
					t.Errorf("uid %d's READ of the pinned file: engine %v, want tier", tc.asker, eng)
					break
				}
				if !tc.told && eng == ctl.EngineTier {
					t.Errorf("uid %d's READ of the pinned file: engine tier", tc.asker)
					break
				}
			}
		})
	}
}

// TestTierHitServedToOtherUsers: uid 10002's READ of a file uid 10001
// pinned is still served from the tier (its engine code says host): the
// tier's hit counters move, not the file's reads.
func TestTierHitServedToOtherUsers(t *testing.T) {
	e, _ := newTierEnv(t, 1<<20)
	f, data := e.file("x", 100<<10, os.O_RDONLY)
	if err := os.Chown(f.Name(), 10001, 10001); err != nil {
		t.Fatal(err)
	}
	if errno := e.rawFile(10001, f, ctl.CmdPin, pinBuf(0, 1<<20, 0)); errno != 0 {
		t.Fatal(errno)
	}
	cl := e.client(10002, ctl.Token{})
	rs := []ctl.Range{{Offset: 0, Length: 100 << 10}}
	g, err := os.Open(filepath.Join(e.dir, "x"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ls, err := cl.Read(context.Background(), g, ctl.HostDevice, rs)
	if err != nil {
		t.Fatal(err)
	}
	checkBytes(t, cl, rs, ls, data)
	releaseAll(t, cl, ls)
	if ls[0].Engine != ctl.EngineHost {
		t.Errorf("uid 10002's READ: engine %v, want host (the fixed engine it would get)", ls[0].Engine)
	}
	if st := e.srv.StatsFor(0).Tier; st.Hits != 1 || st.HitBytes == 0 {
		t.Errorf("root's STATUS tier after uid 10002's READ: %d hits, %d bytes: want it served from the tier", st.Hits, st.HitBytes)
	}
}

// checkBytes checks that leases ls of ranges hold the file's bytes, by
// whatever engine.
func checkBytes(t *testing.T, cl *ctl.Client, ranges []ctl.Range, ls []ctl.Lease, data []byte) {
	t.Helper()
	if len(ls) != len(ranges) {
		t.Fatalf("%d leases for %d ranges", len(ls), len(ranges))
	}
	for i, r := range ranges {
		want := data[r.Offset:min(r.Offset+r.Length, uint64(len(data)))]
		got, err := cl.Bytes(context.Background(), ls[i])
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("range %d %+v: bytes differ from the file's (%v)", i, r, err)
		}
	}
}

// BenchmarkTierHit is a READ of 16 x 64 KiB served from the tier, by the
// file's owner (told: engine tier) and by another user (not told: the
// residency rule and the engine it would get are asked too).
func BenchmarkTierHit(b *testing.B) {
	e, _ := newTierEnv(b, 8<<20)
	f, _ := e.file("x", 2<<20, os.O_RDONLY)
	if err := os.Chown(f.Name(), 10001, 10001); err != nil {
		b.Fatal(err)
	}
	if errno := e.rawFile(10001, f, ctl.CmdPin, pinBuf(0, 1<<30, 0)); errno != 0 {
		b.Fatal(errno)
	}
	e.srv.opts.Readahead.MaxBytes = -1
	rs := batch(0, 16, 64<<10)
	for _, c := range []struct {
		name string
		uid  uint32
		want ctl.EngineCode
	}{{"owner", 10001, ctl.EngineTier}, {"other", 10002, ctl.EngineHost}} {
		b.Run(c.name, func(b *testing.B) {
			cl := e.client(c.uid, ctl.Token{})
			ids := make([]uint64, len(rs))
			for b.Loop() {
				ls, err := cl.Read(context.Background(), f, ctl.HostDevice, rs)
				if err != nil || ls[0].Engine != c.want {
					b.Fatalf("READ: %v, engine %v", err, ls[0].Engine)
				}
				for i, l := range ls {
					ids[i] = l.ID
				}
				if err := cl.Release(context.Background(), ids...); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
