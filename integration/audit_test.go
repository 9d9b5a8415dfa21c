package integration

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
)

// The security audit's tests of the features added after the round-2
// hardening (docs/security-audit.md): the memory tier as a second uid.

// TestAuditChild is not a test: TestTierSecondUser re-execs the test binary
// with GDSFS_AUDIT_CHILD set to run a client process of another uid.
func TestAuditChild(t *testing.T) {
	mode, env := childMode(t, "AUDIT")
	var err error
	switch mode {
	case "heldfd":
		err = childHeldFD(env("MNT"), env("FILE"), env("OLD"), env("NEW"))
	case "status":
		err = childTierStatus(env("MNT"))
	default:
		err = fmt.Errorf("unknown child mode %q", mode)
	}
	childExit(err)
}

// readSum READs the whole of f (size bytes) through cl and returns the
// sha256 of its bytes and the engine that moved them.
func readSum(cl *ctl.Client, f *os.File, size int64) (string, ctl.EngineCode, error) {
	ctx := context.Background()
	ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: uint64(size)}})
	if err != nil {
		return "", 0, err
	}
	b, err := cl.Bytes(ctx, ls[0])
	if err != nil {
		return "", 0, err
	}
	sum := sha256.Sum256(b)
	if err := cl.Release(ctx, ls[0].ID); err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(sum[:]), ls[0].Engine, nil
}

// childHeldFD opens file, READs it (its bytes must hash to old), says
// "opened", waits for a line on stdin (the parent changes the file), READs
// through the descriptor it holds (still old: an open descriptor keeps
// the file it opened and the access it was granted), then opens file
// anew: new is the hash that open must READ, or "" when the open must be
// refused (EACCES).
func childHeldFD(mnt, file, old, new string) error {
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
	st, err := f.Stat()
	if err != nil {
		return err
	}
	sum, eng, err := readSum(cl, f, st.Size())
	if err != nil || sum != old {
		return fmt.Errorf("first READ: %v, bytes are the file's: %v", err, sum == old)
	}
	fmt.Printf("opened %v\n", eng)
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return err
	}
	if sum, _, err = readSum(cl, f, st.Size()); err != nil || sum != old {
		return fmt.Errorf("READ through the held descriptor after the change: %v, bytes are those it opened: %v", err, sum == old)
	}
	g, err := os.Open(file)
	if new == "" {
		if err == nil {
			g.Close()
			return errors.New("a new open after the change succeeded")
		}
		if !errors.Is(err, syscall.EACCES) {
			return fmt.Errorf("a new open after the change: %v, want EACCES", err)
		}
		fmt.Println("reopen refused")
		return nil
	}
	if err != nil {
		return err
	}
	defer g.Close()
	if sum, eng, err = readSum(cl, g, st.Size()); err != nil || sum != new {
		return fmt.Errorf("READ of a new open after the change: %v (engine %v), bytes are the new file's: %v", err, eng, sum == new)
	}
	fmt.Println("reopen new bytes")
	return nil
}

// childTierStatus prints STATUS's tier as this uid sees it.
func childTierStatus(mnt string) error {
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	doc, err := cl.Status(context.Background())
	if err != nil {
		return err
	}
	fmt.Println(string(doc))
	return nil
}

func sumHex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// TestTierSecondUser: uid 10001 pins its files; uid 10002 can neither pin
// nor probe those it cannot open on the backing directory (a 0600 file, a
// file in a 0700 directory), evicts none of them by trying, and sees no
// trace of them in STATUS, gdsfs status or the metrics. A descriptor uid
// 10002 opened before a chmod 000 or a rename over the file keeps reading
// the file it opened (POSIX); a new open is refused, or reads the new file,
// never the tier's old bytes.
func TestTierSecondUser(t *testing.T) {
	m := startTier(t, tierOpts{budget: 8 << 20, metrics: true})
	const a, b = 10001, 10002
	files := map[string]os.FileMode{"secret.bin": 0o600, "priv/p.bin": 0o644, "shared.bin": 0o644, "over.bin": 0o644}
	data := map[string][]byte{}
	if err := os.Mkdir(filepath.Join(m.backing, "priv"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(filepath.Join(m.backing, "priv"), a, a); err != nil {
		t.Fatal(err)
	}
	seed := uint64(40)
	for name, mode := range files {
		seed++
		data[name] = randomBytes(seed, tierChunk+777)
		p := filepath.Join(m.backing, name)
		writeFile(t, p, data[name])
		if err := os.Chown(p, a, a); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
	}
	bin := gdsfsBin(t)
	for name := range files {
		if out, code := runAsUID(t, a, bin, "warm", "--pin", "--progress", "never", filepath.Join(m.mnt, name)); code != 0 {
			t.Fatalf("uid %d pinning its %s: exit %d: %s", a, name, code, out)
		}
	}
	cachedAll := func(when string) {
		t.Helper()
		for name := range files {
			if c := m.cached(t, name); c != int64(len(data[name])) {
				t.Errorf("%s: %s has %d bytes cached, want %d", when, name, c, len(data[name]))
			}
		}
	}
	cachedAll("after uid 10001's pins")
	for _, name := range []string{"secret.bin", "priv/p.bin"} {
		p := filepath.Join(m.mnt, name)
		for _, args := range [][]string{{"warm", "--pin", "--progress", "never", p}, {"warm", "--unpin", "--progress", "never", p}, {"warm", "--progress", "never", p}} {
			// warm skips what it cannot open (exit 0 unless pinning).
			if out, code := runAsUID(t, b, bin, args...); code == 0 && args[1] == "--pin" || !strings.Contains(out, "permission denied") {
				t.Errorf("uid %d: gdsfs %s: exit %d: %s", b, strings.Join(args[:2], " "), code, out)
			}
		}
		if out, code := runAsUID(t, b, "getfattr", "-n", "user.gdsfs.info", "--only-values", p); code == 0 || !strings.Contains(out, "Permission denied") {
			t.Errorf("uid %d probing user.gdsfs.info of %s: exit %d: %s", b, name, code, out)
		}
	}
	cachedAll("after uid 10002's tries")

	// What uid 10002 sees of the tier: its own figures and totals only.
	out := child{family: "AUDIT", mode: "status", uid: b, env: map[string]string{"MNT": m.mnt}}.mustRun(t, time.Minute)
	var st ctlserver.Stats
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &st); err != nil || st.Tier == nil {
		t.Fatalf("uid %d's STATUS: %v: %s", b, err, out)
	}
	if len(st.Tier.UIDs) != 0 {
		t.Errorf("uid %d's STATUS lists tier uids %v (it pinned nothing)", b, st.Tier.UIDs)
	}
	if root := m.tierStats(t); !strings.Contains(fmt.Sprint(root["uids"]), fmt.Sprint(a)) {
		t.Fatalf("root's STATUS lacks uid %d's pins: %v", a, root["uids"])
	}
	text, _ := runAsUID(t, b, bin, "status", m.mnt)
	resp, err := http.Get("http://" + m.d.MetricsAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for what, doc := range map[string]string{"STATUS": out, "gdsfs status": text, "metrics": string(metrics)} {
		for _, name := range []string{"secret", "p.bin", "priv", m.backing} {
			if strings.Contains(doc, name) {
				t.Errorf("uid %d's %s names %q", b, what, name)
			}
		}
	}

	// Held descriptors across a chmod 000 and a rename over the file.
	fresh := randomBytes(99, len(data["over.bin"]))
	for _, tc := range []struct {
		name, newSum string
		change       func()
	}{
		{"shared.bin", "", func() {
			if err := os.Chmod(filepath.Join(m.mnt, "shared.bin"), 0); err != nil {
				t.Error(err)
			}
		}},
		{"over.bin", sumHex(fresh), func() {
			p := filepath.Join(m.mnt, "over.bin")
			writeFile(t, p+".new", fresh)
			if err := os.Chmod(p+".new", 0o644); err != nil {
				t.Error(err)
			}
			if err := os.Rename(p+".new", p); err != nil {
				t.Error(err)
			}
		}},
	} {
		c := child{family: "AUDIT", mode: "heldfd", uid: b, env: map[string]string{
			"MNT": m.mnt, "FILE": filepath.Join(m.mnt, tc.name), "OLD": sumHex(data[tc.name]), "NEW": tc.newSum}}
		cmd := c.cmd(t)
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		r := bufio.NewReader(stdout)
		line, err := r.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "opened ") {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("%s: child said %q, %v: %s", tc.name, line, err, stderr.String())
		}
		if !strings.Contains(line, fmt.Sprint(ctl.EngineTier)) {
			t.Errorf("%s: first READ by uid %d served by %s, want the tier uid %d filled", tc.name, b, strings.TrimSpace(line), a)
		}
		tc.change()
		fmt.Fprintln(stdin, "go")
		rest, _ := io.ReadAll(r)
		if err := cmd.Wait(); err != nil {
			t.Errorf("%s: uid %d's held descriptor: %v: %s%s", tc.name, b, err, rest, stderr.String())
		}
	}
}
