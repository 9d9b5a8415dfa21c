package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"golang.org/x/sys/unix"
)

// The security audit's tests of the features added after the round-2
// hardening (docs/security.md, "Audit of the features added after the round-2 hardening"): the memory tier as a second uid.

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
	case "writer":
		err = childWriter(env("MNT"), env("FILE"), env("ROUNDS"))
	case "inherited":
		err = childInherited(env("MNT"), env("WANT"))
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
		hits := m.tierStats(t)["hits"].(float64)
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
		// Served from the tier uid 10001 filled (root's hits say so; the
		// lease names the engine uid 10002 would get without the tier,
		// which may not learn what uid 10001 pinned: tierTold).
		if now := m.tierStats(t)["hits"].(float64); now <= hits || strings.Contains(line, fmt.Sprint(ctl.EngineTier)) {
			t.Errorf("%s: first READ by uid %d: %s, tier hits %v then %v: want it served from the tier uid %d filled, not named so", tc.name, b, strings.TrimSpace(line), hits, now, a)
		}
		tc.change()
		fmt.Fprintln(stdin, "go")
		rest, _ := io.ReadAll(r)
		if err := cmd.Wait(); err != nil {
			t.Errorf("%s: uid %d's held descriptor: %v: %s%s", tc.name, b, err, rest, stderr.String())
		}
	}
}

// childInherited runs as a uid that cannot open the file itself and was
// handed two descriptors of it (as SCM_RIGHTS or fork would): fd 3 open
// read-only, fd 4 read-write. A descriptor grants what it was opened with:
// fd 3 READs (its bytes hash to want) and cannot WRITE (EBADF), fd 4 WRITEs.
func childInherited(mnt, want string) error {
	ctx := context.Background()
	ro, rw := os.NewFile(3, "inherited-ro"), os.NewFile(4, "inherited-rw")
	st, err := ro.Stat()
	if err != nil {
		return err
	}
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	if sum, _, err := readSum(cl, ro, st.Size()); err != nil || sum != want {
		return fmt.Errorf("READ through the inherited read-only descriptor: %v, bytes are the file's: %v", err, sum == want)
	}
	l, err := cl.Alloc(ctx, ctl.HostDevice, 2<<20)
	if err != nil {
		return err
	}
	if err := cl.Write(ctx, ro, l, 0, 0, 2<<20, false); !errors.Is(err, syscall.EBADF) {
		return fmt.Errorf("WRITE through the inherited read-only descriptor: %v, want EBADF", err)
	}
	if err := cl.Write(ctx, rw, l, 0, 0, 2<<20, true); err != nil {
		return fmt.Errorf("WRITE through the inherited read-write descriptor: %w", err)
	}
	fmt.Println("ok")
	return nil
}

// TestWriteThroughHeldDescriptor: a WRITE (its aligned body through the
// daemon's O_DIRECT reopen) lands in the file the caller's descriptor
// opened, never in what the path names since: after a rename over the
// file and after an unlink, the held file has the bytes and the file now at
// the path is untouched (the backing directory is the oracle). An O_PATH
// descriptor cannot WRITE at all (EBADF), and a descriptor handed to a uid
// that cannot open the file grants that uid what it grants, no more.
func TestWriteThroughHeldDescriptor(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 4 << 20, BudgetBytes: 32 << 20})
	ctx := context.Background()
	cl := openSession(t, m.mnt)
	l, err := cl.Alloc(ctx, ctl.HostDevice, 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := cl.Bytes(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	copy(buf, randomBytes(7, len(buf)))
	other := randomBytes(8, 3<<20)
	for _, tc := range []struct {
		name   string
		change func(p string)
	}{
		{"renamed over", func(p string) {
			writeFile(t, p+".new", other)
			if err := os.Rename(p+".new", p); err != nil {
				t.Fatal(err)
			}
		}},
		{"unlinked", func(p string) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := strings.ReplaceAll(tc.name, " ", "-")
			old := m.addFile(t, name, 3<<20, 9)
			p := filepath.Join(m.mnt, name)
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			tc.change(p)
			if err := cl.Write(ctx, f, l, 0, 0, 2<<20, true); err != nil {
				t.Fatalf("WRITE through the held descriptor: %v", err)
			}
			want := append(append([]byte(nil), buf...), old[2<<20:]...)
			if err := readsAs(f, want); err != nil {
				t.Errorf("the held file after the WRITE: %v", err)
			}
			if b, err := os.ReadFile(filepath.Join(m.backing, name)); err == nil && !bytes.Equal(b, other) {
				t.Errorf("the file now at the path changed (%d bytes, was %d): the WRITE reached it", len(b), len(other))
			}
		})
	}
	t.Run("O_PATH", func(t *testing.T) {
		m.addFile(t, "opath", 3<<20, 10)
		fd, err := unix.Open(filepath.Join(m.mnt, "opath"), unix.O_PATH, 0)
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(fd), "opath")
		defer f.Close()
		if err := cl.Write(ctx, f, l, 0, 0, 2<<20, false); !errors.Is(err, syscall.EBADF) {
			t.Errorf("WRITE through an O_PATH descriptor: %v, want EBADF", err)
		}
	})
	t.Run("handed to another uid", func(t *testing.T) {
		data := m.addFile(t, "owned", 3<<20, 11)
		bp := filepath.Join(m.backing, "owned")
		if err := os.Chown(bp, 10001, 10001); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(bp, 0o600); err != nil {
			t.Fatal(err)
		}
		ro := openRO(t, filepath.Join(m.mnt, "owned"))
		rw, err := os.OpenFile(filepath.Join(m.mnt, "owned"), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer rw.Close()
		cmd := child{family: "AUDIT", mode: "inherited", uid: 10002, env: map[string]string{"MNT": m.mnt, "WANT": sumHex(data)}}.cmd(t)
		cmd.ExtraFiles = []*os.File{ro, rw}
		out, err := cmd.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "ok" {
			t.Errorf("uid 10002 with uid 10001's descriptors: %v: %s", err, out)
		}
	})
}

// writerRound is the bytes one round of childWriter writes: round k's
// region of the file is [k*writerRound, (k+1)*writerRound).
const writerRound = 8 << 20

// childWriter WRITEs round after round (rounds; "0": until killed) of
// fresh bytes (randomBytes(k)) into region k of file through ALLOC +
// WRITE (an aligned body: O_DIRECT), fsyncs after each and then prints
// "synced k".
func childWriter(mnt, file, rounds string) error {
	ctx := context.Background()
	n, err := strconv.Atoi(rounds)
	if err != nil {
		return err
	}
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	l, err := cl.Alloc(ctx, ctl.HostDevice, writerRound)
	if err != nil {
		return err
	}
	b, err := cl.Bytes(ctx, l)
	if err != nil {
		return err
	}
	for k := 0; n == 0 || k < n; k++ {
		copy(b, randomBytes(uint64(k), writerRound))
		if err := cl.Write(ctx, f, l, 0, int64(k)*writerRound, writerRound, false); err != nil {
			return err
		}
		if err := f.Sync(); err != nil {
			return err
		}
		fmt.Printf("synced %d\n", k)
	}
	return nil
}

// TestWriterKilledMidWrite: a writer killed (SIGKILL) between WRITEs of
// 8 MiB, most likely inside one, leaves the daemon serving, no session,
// lease or descriptor behind (the daemon's figures back to idle), and the
// file holding every round it had fsynced (the backing file is the
// oracle; a round after the last fsync may be partly written).
func TestWriterKilledMidWrite(t *testing.T) {
	requireRoot(t)
	backing, mnt := mountDirs(t, t.TempDir())
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "128MiB", "--slab-size", "16MiB")
	run := func(name, rounds string) *exec.Cmd {
		if err := os.WriteFile(filepath.Join(backing, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		return child{family: "AUDIT", mode: "writer", env: map[string]string{"MNT": mnt, "FILE": filepath.Join(mnt, name), "ROUNDS": rounds}}.cmd(t)
	}
	if out, err := run("warm", "2").CombinedOutput(); err != nil {
		t.Fatalf("warm-up writer: %v\n%s", err, out)
	}
	base, err := d.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20, pipeFDs: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	cmd := run("killed", "0")
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
	synced := -1
	for synced < 2 {
		line, err := r.ReadString('\n')
		if err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("writer: %v: %s", err, stderr.String())
		}
		if _, err := fmt.Sscanf(line, "synced %d", &synced); err != nil {
			t.Fatalf("writer said %q", line)
		}
	}
	// Round 3's ALLOC'd bytes are being copied or written now.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if _, err := d.waitIdle(base); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(backing, "killed"))
	if err != nil {
		t.Fatal(err)
	}
	for k := 0; k <= synced; k++ {
		end := (k + 1) * writerRound
		if len(got) < end || !bytes.Equal(got[k*writerRound:end], randomBytes(uint64(k), writerRound)) {
			t.Errorf("round %d, fsynced before the kill, is not in the file (%d bytes)", k, len(got))
		}
	}
	// The daemon still serves: a READ of the file returns its bytes.
	cl := openSession(t, mnt)
	f := openRO(t, filepath.Join(mnt, "killed"))
	sum, _, err := readSum(cl, f, int64(len(got)))
	if err != nil || sum != sumHex(got) {
		t.Errorf("READ after the kill: %v, bytes are the file's: %v", err, sum == sumHex(got))
	}
}

// TestTierKilledMidPinServesOnlyWholeExtents: gdsfs warm --pin killed
// (SIGKILL) while it fills the tier leaves only whole extents behind: every
// extent-sized READ afterwards returns the file's bytes (the backing file
// is the oracle), whether the tier serves it (a whole extent it kept) or
// the engine does (an extent it never finished), and what the tier holds
// is a whole number of extents.
func TestTierKilledMidPinServesOnlyWholeExtents(t *testing.T) {
	m := startTier(t, tierOpts{budget: 128 << 20})
	data := randomBytes(21, 256*tierChunk)
	writeFile(t, filepath.Join(m.backing, "k.bin"), data)
	cmd := exec.Command(gdsfsBin(t), "warm", "--pin", "--workers", "2", "--progress", "always", filepath.Join(m.mnt, "k.bin"))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = io.Copy(io.Discard, stderr) }()
	// Kill it once the tier holds its first extent (the daemon's figure,
	// asked again and again: no event to wait on), most likely mid-file.
	for deadline := time.Now().Add(time.Minute); m.cached(t, "k.bin") == 0; {
		if time.Now().After(deadline) {
			t.Fatal("nothing pinned a minute after warm --pin started")
		}
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	c := m.cached(t, "k.bin")
	if c%tierChunk != 0 || c > int64(len(data)) {
		t.Errorf("%d bytes cached after the kill: not whole %d-byte extents", c, tierChunk)
	}
	cl := openSession(t, m.mnt)
	f := openRO(t, filepath.Join(m.mnt, "k.bin"))
	ctx := context.Background()
	hits := int64(0)
	for off := uint64(0); off < uint64(len(data)); off += tierChunk {
		ranges := []ctl.Range{{Offset: off, Length: tierChunk}}
		ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
		if err != nil {
			t.Fatal(err)
		}
		if err := verifyLeases(ctx, cl, ranges, ls, data); err != nil {
			t.Errorf("extent at %d (engine %v): %v", off, ls[0].Engine, err)
		}
		if ls[0].Engine == ctl.EngineTier {
			hits += tierChunk
		}
		if err := cl.Release(ctx, ls[0].ID); err != nil {
			t.Fatal(err)
		}
	}
	// The interrupted PIN may still install an extent it had read whole.
	if after := m.cached(t, "k.bin"); hits < c || hits > after || after%tierChunk != 0 {
		t.Errorf("the tier served %d bytes of extent READs; it held %d before them, %d after", hits, c, after)
	}
	t.Logf("killed mid-pin: %d of %d extents kept", c/tierChunk, len(data)/tierChunk)
}
