package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
)

// tierAsked is what a uid is told of a file of a mount with a memory tier,
// through the mount as that uid: its READs' engines, user.gdsfs.info
// (without the fields that name the copy of the file: path, inode, mtime),
// PIN's report, and what gdsfs warm --pin and --unpin print of it (their
// timings left out).
type tierAsked struct {
	Engines []ctl.EngineCode
	Info    map[string]any
	Report  ctl.PinReply // the tier's global use left out
	Warm    string
	Unpin   string
}

// warmFigures keeps of warm --pin's lines what does not depend on timing.
var warmFigures = regexp.MustCompile(`(pinned|unpinned) \d+ files?, [^:;]+|read [^ ]+ [^ ]+ into the tier|\([^)]* were already in it\)|\(yours: [^)]*\)|exit \d+`)

// askTierAs is what uid is told of file (a name in m's mount): a child of
// the test binary READs it and reads its info and PIN report, then gdsfs
// warm --pin and --unpin run as uid.
func askTierAs(t *testing.T, m *tierMount, bin string, uid uint32, file string) tierAsked {
	t.Helper()
	p := filepath.Join(m.mnt, file)
	out := child{bin: bin, family: "TIERSEE", mode: "ask", env: map[string]string{"FILE": p, "MNT": m.mnt}, uid: uid}.mustRun(t, time.Minute)
	var a tierAsked
	line, ok := strings.CutPrefix(lastLine(out), "ANSWER ")
	if !ok || json.Unmarshal([]byte(line), &a) != nil {
		t.Fatalf("uid %d's child said:\n%s", uid, out)
	}
	for _, k := range []string{"path", "dev", "ino", "mtime_ns"} {
		delete(a.Info, k)
	}
	g := gdsfsBin(t)
	warm, code := runAsUID(t, uid, g, "warm", "--pin", "--progress", "never", p)
	a.Warm = strings.Join(warmFigures.FindAllString(fmt.Sprintf("%s exit %d", warm, code), -1), " | ")
	unpin, code := runAsUID(t, uid, g, "warm", "--unpin", "--progress", "never", p)
	a.Unpin = strings.Join(warmFigures.FindAllString(fmt.Sprintf("%s exit %d", unpin, code), -1), " | ")
	return a
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// TestTierNotToldToOtherUsersMount: uid 10001 owns two identical 0644 files
// of a mount with a memory tier and pins one. Uid 10002 may read both, owns
// neither and may not write them: the kernel would not tell it their
// page-cache residency, and the tier is residency too, so everything it is
// told of the pinned file (READ engines, user.gdsfs.info, PIN, what warm
// --pin and --unpin print) must be what it is told of the other, while
// uid 10001 sees its pin. With --residency readers uid 10002 sees it too.
func TestTierNotToldToOtherUsersMount(t *testing.T) {
	for _, readers := range []bool{false, true} {
		t.Run(fmt.Sprintf("residency readers %v", readers), func(t *testing.T) {
			m := startTier(t, tierOpts{budget: 16 << 20, readers: readers})
			data := randomBytes(21, 3*tierChunk+5000)
			for _, name := range []string{"pinned.bin", "other.bin"} {
				p := filepath.Join(m.backing, name)
				writeFile(t, p, data)
				if err := os.Chown(p, 10001, 10001); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(p, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			bin := worldExecutable(t, os.Args[0])
			out, code := runAsUID(t, 10001, gdsfsBin(t), "warm", "--pin", "--progress", "never", filepath.Join(m.mnt, "pinned.bin"))
			if code != 0 {
				t.Fatalf("uid 10001's warm --pin: exit %d: %s", code, out)
			}
			// Uid 10001 sees its pin.
			own := child{bin: bin, family: "TIERSEE", mode: "ask", env: map[string]string{"FILE": filepath.Join(m.mnt, "pinned.bin"), "MNT": m.mnt}, uid: 10001}.mustRun(t, time.Minute)
			var o tierAsked
			if line, ok := strings.CutPrefix(lastLine(own), "ANSWER "); !ok || json.Unmarshal([]byte(line), &o) != nil {
				t.Fatalf("uid 10001's child said:\n%s", own)
			}
			if o.Engines[0] != ctl.EngineTier || o.Info["cached"] != float64(len(data)) || o.Report.Cached != uint64(len(data)) {
				t.Errorf("uid 10001 does not see its own pin: %+v", o)
			}
			other := askTierAs(t, m, bin, 10002, "other.bin")
			pinned := askTierAs(t, m, bin, 10002, "pinned.bin")
			a, _ := json.Marshal(pinned)
			b, _ := json.Marshal(other)
			same := string(a) == string(b)
			switch {
			case !readers && !same:
				t.Errorf("uid 10002 (neither owner nor writer) is told of uid 10001's pin:\npinned by 10001: %s\npinned by nobody: %s", a, b)
			case readers && (same || pinned.Engines[0] != ctl.EngineTier):
				t.Errorf("--residency readers: uid 10002 is not told of uid 10001's pin:\npinned by 10001: %s\npinned by nobody: %s", a, b)
			}
		})
	}
}

// TestTierseeChild is the child side of the tests above.
func TestTierseeChild(t *testing.T) {
	mode, env := childMode(t, "TIERSEE")
	if mode != "ask" {
		childExit(fmt.Errorf("unknown child mode %q", mode))
	}
	childExit(childAskTier(env("MNT"), env("FILE")))
}

// childAskTier READs file in a few ranges, reads its user.gdsfs.info and
// PIN's report, and prints them as an ANSWER line.
func childAskTier(mnt, file string) error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	var a tierAsked
	ranges := []ctl.Range{{Offset: 0, Length: 8192}, {Offset: tierChunk - 100, Length: 5000}, {Offset: 3 * tierChunk, Length: 5000}}
	ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
	if err != nil {
		return fmt.Errorf("READ: %w", err)
	}
	for _, l := range ls {
		a.Engines = append(a.Engines, l.Engine)
		if err := cl.Release(ctx, l.ID); err != nil {
			return err
		}
	}
	b := make([]byte, 64<<10)
	n, err := syscall.Getxattr(file, "user.gdsfs.info", b)
	if err != nil {
		return fmt.Errorf("user.gdsfs.info: %w", err)
	}
	if err := json.Unmarshal(b[:n], &a.Info); err != nil {
		return err
	}
	if a.Report, err = ctl.Pin(ctx, f, ctl.PinRequest{}); err != nil {
		return fmt.Errorf("PIN: %w", err)
	}
	a.Report.Used = 0
	out, err := json.Marshal(a)
	if err != nil {
		return err
	}
	fmt.Println("ANSWER " + string(out))
	return nil
}
