package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/daemon"
)

// tierChunk is the tier's extent size in these tests: files of a few
// extents stay small.
const tierChunk = 256 << 10

// tierMount is a mount with a memory tier (extents of tierChunk),
// reachable by other uids.
type tierMount struct {
	d            *daemon.Daemon
	mnt, backing string
	stopped      bool
}

// tierOpts configures startTier.
type tierOpts struct {
	budget  int64
	source  string // "": a fresh backing directory
	metrics bool   // serve metrics on a free port
	noPass  bool   // no kernel passthrough: writes reach the daemon
	readers bool   // --residency readers
	share   int64  // --uid-share in bytes (0: the default fraction)
}

// startTier starts a daemon the way startDaemon does, with a tier, and
// stops it when the test ends unless stop did.
func startTier(t *testing.T, o tierOpts) *tierMount {
	t.Helper()
	requireRoot(t)
	if gdsfsBin(t) == "" {
		t.Skip("GDSFS_BIN not set (make build)")
	}
	backing, mnt := mountDirs(t, t.TempDir())
	if o.source != "" {
		backing = o.source
	}
	for p := filepath.Dir(mnt); p != os.TempDir() && p != "/"; p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	c := daemon.Config{
		Mountpoint: mnt, Source: backing, AllowOther: true,
		Engine: cufile.Config{Engine: cufile.EngineHost,
			HostDir: filepath.Join("/dev/shm", fmt.Sprintf("gdsfs-itest-%d-%s", os.Getpid(), randHex(4)))},
		HostPoolBytes: 64 << 20, MetaCacheBytes: 16 << 20, Version: "itest",
		TierBytes: o.budget, TierChunkBytes: tierChunk, NoPassthrough: o.noPass, ResidencyToReaders: o.readers,
		UIDShareBytes: o.share,
	}
	if o.metrics {
		c.MetricsAddr = "127.0.0.1:0"
	}
	if testing.Verbose() {
		c.Log = zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.DebugLevel)
	}
	d, err := daemon.Start(context.Background(), c)
	if err != nil {
		t.Fatalf("start a daemon with a tier: %v", err)
	}
	m := &tierMount{d: d, mnt: mnt, backing: backing}
	t.Cleanup(func() { m.stop(t) })
	return m
}

// stop unmounts and closes the daemon (once).
func (m *tierMount) stop(t *testing.T) {
	t.Helper()
	if m.stopped {
		return
	}
	m.stopped = true
	if err := m.d.Unmount(); err != nil {
		t.Errorf("unmount %s (files left open?): %v", m.mnt, err)
	}
	if err := m.d.Close(); err != nil {
		t.Errorf("close the daemon: %v", err)
	}
}

// pin runs gdsfs warm --pin as root and returns its output.
func (m *tierMount) pin(t *testing.T, names ...string) string {
	t.Helper()
	args := []string{"warm", "--pin", "--progress", "never"}
	for _, n := range names {
		args = append(args, filepath.Join(m.mnt, n))
	}
	out, code := runGdsfs(t, args...)
	if code != 0 {
		t.Fatalf("gdsfs warm --pin: exit %d: %s", code, out)
	}
	return out
}

// info is user.gdsfs.info of a file of the mount.
func (m *tierMount) info(t *testing.T, name string) map[string]any {
	t.Helper()
	b := make([]byte, 64<<10)
	n, err := syscall.Getxattr(filepath.Join(m.mnt, name), "user.gdsfs.info", b)
	if err != nil {
		t.Fatalf("user.gdsfs.info of %s: %v", name, err)
	}
	var v map[string]any
	if err := json.Unmarshal(b[:n], &v); err != nil {
		t.Fatal(err)
	}
	return v
}

func (m *tierMount) cached(t *testing.T, name string) int64 {
	t.Helper()
	c, ok := m.info(t, name)["cached"].(float64)
	if !ok {
		t.Fatalf("user.gdsfs.info of %s has no cached", name)
	}
	return int64(c)
}

// readAll READs the whole of a file of the mount (a fresh descriptor)
// through a session and returns its bytes and the engine that moved them.
func (m *tierMount) readAll(t *testing.T, name string) ([]byte, ctl.EngineCode) {
	t.Helper()
	ctx := context.Background()
	cl := openSession(t, m.mnt)
	f := openRO(t, filepath.Join(m.mnt, name))
	st, err := os.Stat(filepath.Join(m.backing, name)) // the oracle's size
	if err != nil {
		t.Fatal(err)
	}
	ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: uint64(st.Size()) + 4096}})
	if err != nil {
		t.Fatalf("READ %s: %v", name, err)
	}
	if ls[0].Valid == 0 {
		return nil, ls[0].Engine
	}
	b, err := cl.Bytes(ctx, ls[0])
	if err != nil {
		t.Fatal(err)
	}
	out := append([]byte(nil), b...)
	if err := cl.Release(ctx, ls[0].ID); err != nil {
		t.Fatal(err)
	}
	return out, ls[0].Engine
}

// tierStats is STATUS's tier as root sees it.
func (m *tierMount) tierStats(t *testing.T) map[string]any {
	t.Helper()
	cl := openSession(t, m.mnt)
	doc, err := cl.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var st ctlserver.Stats
	if err := json.Unmarshal(doc, &st); err != nil || st.Tier == nil {
		t.Fatalf("STATUS: %v, tier %v", err, st.Tier)
	}
	var v map[string]any
	b, _ := json.Marshal(st.Tier)
	_ = json.Unmarshal(b, &v)
	return v
}

// TestTierPinServesReads: gdsfs warm --pin fills the tier, READs of the
// file are then served from it (engine tier) with the file's bytes, a
// second warm reads nothing, and status, user.gdsfs.info and the metrics
// say so.
func TestTierPinServesReads(t *testing.T) {
	m := startTier(t, tierOpts{budget: 8 << 20, metrics: true})
	data := randomBytes(1, 3*tierChunk+123)
	writeFile(t, filepath.Join(m.backing, "w.bin"), data)
	got, eng := m.readAll(t, "w.bin")
	if eng == ctl.EngineTier || !bytes.Equal(got, data) {
		t.Fatalf("before the pin: engine %v, bytes equal %v", eng, bytes.Equal(got, data))
	}
	if c := m.cached(t, "w.bin"); c != 0 {
		t.Fatalf("cached %d before the pin", c)
	}
	out := m.pin(t, "w.bin")
	if !strings.Contains(out, "pinned 1 files") {
		t.Fatalf("warm --pin said: %s", out)
	}
	if c := m.cached(t, "w.bin"); c != int64(len(data)) {
		t.Fatalf("cached %d after the pin, want %d", c, len(data))
	}
	got, eng = m.readAll(t, "w.bin")
	if eng != ctl.EngineTier || !bytes.Equal(got, data) {
		t.Fatalf("after the pin: engine %v, bytes equal %v", eng, bytes.Equal(got, data))
	}
	// Ranges inside the file, across extents, to its end.
	cl := openSession(t, m.mnt)
	f := openRO(t, filepath.Join(m.mnt, "w.bin"))
	ranges := []ctl.Range{{Offset: 5, Length: 10}, {Offset: tierChunk - 3, Length: 7}, {Offset: 3*tierChunk + 100, Length: 4096}}
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges)
	if err != nil {
		t.Fatal(err)
	}
	if err := verifyLeases(context.Background(), cl, ranges, ls, data); err != nil {
		t.Fatal(err)
	}
	for i, l := range ls {
		if l.Engine != ctl.EngineTier {
			t.Errorf("range %d: engine %v", i, l.Engine)
		}
	}
	if out := m.pin(t, "w.bin"); !strings.Contains(out, "read 0 B into the tier") {
		t.Errorf("second warm --pin read again: %s", out)
	}
	out, code := runGdsfs(t, "status", m.mnt)
	if code != 0 || !strings.Contains(out, "tier:") || !strings.Contains(out, "2 hits") {
		t.Errorf("gdsfs status (exit %d):\n%s", code, out)
	}
	resp, err := http.Get("http://" + m.d.MetricsAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"gdsfs_tier_hits_total 2", fmt.Sprintf("gdsfs_tier_cached_bytes %d", len(data)), "gdsfs_tier_budget_bytes 8.388608e+06"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// TestTierNeverStale: after any change of a pinned file, behind the mount
// or through it, a READ returns the file's new bytes (the backing file is
// the oracle), never the tier's.
func TestTierNeverStale(t *testing.T) {
	for _, noPass := range []bool{false, true} {
		t.Run(fmt.Sprintf("passthrough=%v", !noPass), func(t *testing.T) {
			testTierNeverStale(t, startTier(t, tierOpts{budget: 16 << 20, noPass: noPass}))
		})
	}
}

func testTierNeverStale(t *testing.T, m *tierMount) {
	n := 2*tierChunk + 10
	for i, tc := range []struct {
		name   string
		change func(t *testing.T, mntPath, backPath string, fresh []byte)
	}{
		{"rewritten in the backing directory", func(t *testing.T, _, back string, fresh []byte) {
			writeFile(t, back, fresh)
		}},
		{"written through the mount", func(t *testing.T, p, _ string, fresh []byte) {
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(fresh, 0); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		}},
		{"written through the mount, still open", func(t *testing.T, p, _ string, fresh []byte) {
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			if _, err := f.WriteAt(fresh, 0); err != nil {
				t.Fatal(err)
			}
		}},
		{"WRITE ioctl", func(t *testing.T, p, _ string, fresh []byte) {
			ctx := context.Background()
			cl := openSession(t, m.mnt)
			l, err := cl.Alloc(ctx, ctl.HostDevice, int64(len(fresh)))
			if err != nil {
				t.Fatal(err)
			}
			b, err := cl.Bytes(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			copy(b, fresh)
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if err := cl.Write(ctx, f, l, 0, 0, int64(len(fresh)), false); err != nil {
				t.Fatal(err)
			}
		}},
		{"truncated and rewritten through the mount", func(t *testing.T, p, _ string, fresh []byte) {
			if err := os.Truncate(p, 0); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, fresh, 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"renamed over through the mount", func(t *testing.T, p, _ string, fresh []byte) {
			if err := os.WriteFile(p+".new", fresh, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(p+".new", p); err != nil {
				t.Fatal(err)
			}
		}},
		{"unlinked and recreated through the mount", func(t *testing.T, p, _ string, fresh []byte) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, fresh, 0o644); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := fmt.Sprintf("s%d.bin", i)
			old, fresh := randomBytes(uint64(10+i), n), randomBytes(uint64(100+i), n)
			writeFile(t, filepath.Join(m.backing, name), old)
			m.pin(t, name)
			if got, eng := m.readAll(t, name); eng != ctl.EngineTier || !bytes.Equal(got, old) {
				t.Fatalf("pinned: engine %v, bytes equal %v", eng, bytes.Equal(got, old))
			}
			tc.change(t, filepath.Join(m.mnt, name), filepath.Join(m.backing, name), fresh)
			oracle, err := os.ReadFile(filepath.Join(m.backing, name))
			if err != nil || !bytes.Equal(oracle, fresh) {
				t.Fatalf("the backing file after the change: %v, new bytes %v", err, bytes.Equal(oracle, fresh))
			}
			got, eng := m.readAll(t, name)
			if eng == ctl.EngineTier || !bytes.Equal(got, oracle) {
				t.Fatalf("after the change: engine %v, bytes equal to the file %v", eng, bytes.Equal(got, oracle))
			}
			// Pinned again, the new bytes are served.
			m.pin(t, name)
			if got, eng := m.readAll(t, name); eng != ctl.EngineTier || !bytes.Equal(got, oracle) {
				t.Fatalf("pinned again: engine %v, bytes equal %v", eng, bytes.Equal(got, oracle))
			}
		})
	}
	if st := m.tierStats(t); st["invalidations"].(float64) == 0 {
		t.Errorf("no invalidations counted: %v", st)
	}
}

// runAsUID runs a command as uid (gid the same, no groups).
func runAsUID(t *testing.T, uid uint32, name string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	cmd.Dir = "/"
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return out.String(), 0
	case errors.As(err, &ee):
		return out.String(), ee.ExitCode()
	}
	t.Fatalf("run %s as uid %d: %v", name, uid, err)
	return "", -1
}

// TestTierAccessByUID: only a uid that may read a file pins it or learns
// what the tier holds of it; a write-only descriptor cannot pin.
func TestTierAccessByUID(t *testing.T) {
	m := startTier(t, tierOpts{budget: 8 << 20})
	own := filepath.Join(m.backing, "own.bin")
	writeFile(t, own, randomBytes(3, tierChunk))
	wo := filepath.Join(m.backing, "wo.bin")
	writeFile(t, wo, randomBytes(4, tierChunk))
	for p, mode := range map[string]os.FileMode{own: 0o600, wo: 0o602} {
		if err := os.Chown(p, 10001, 10001); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
	}
	bin := gdsfsBin(t)
	ownMnt := filepath.Join(m.mnt, "own.bin")
	out, code := runAsUID(t, 10002, bin, "warm", "--pin", "--progress", "never", ownMnt)
	if code == 0 || !strings.Contains(out, "permission denied") {
		t.Errorf("uid 10002 pinning a 0600 file of uid 10001: exit %d: %s", code, out)
	}
	if c := m.cached(t, "own.bin"); c != 0 {
		t.Errorf("uid 10002's refused pin left %d bytes in the tier", c)
	}
	out, code = runAsUID(t, 10002, "getfattr", "-n", "user.gdsfs.info", "--only-values", ownMnt)
	if code == 0 || !strings.Contains(out, "Permission denied") {
		t.Errorf("uid 10002 probing user.gdsfs.info: exit %d: %s", code, out)
	}
	// A write-only descriptor (mode 0602: others may write, not read).
	py := `import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
buf = bytearray(128)
struct.pack_into("<IHH", buf, 0, 0x53464447, 1, 0)
struct.pack_into("<QQ", buf, 32, 0, 1 << 20)
try:
    fcntl.ioctl(fd, 0xC0804714, buf, True)
    print("PIN succeeded")
except OSError as e:
    print("errno", e.errno)
`
	out, _ = runAsUID(t, 10002, "/usr/bin/python3", "-c", py, filepath.Join(m.mnt, "wo.bin"))
	if strings.TrimSpace(out) != fmt.Sprint("errno ", int(syscall.EBADF)) {
		t.Errorf("PIN on a write-only descriptor: %s", out)
	}
	// Its owner may pin it, and sees it cached; uid 10002 still cannot probe.
	out, code = runAsUID(t, 10001, bin, "warm", "--pin", "--progress", "never", ownMnt)
	if code != 0 {
		t.Fatalf("uid 10001 pinning its own file: exit %d: %s", code, out)
	}
	out, code = runAsUID(t, 10001, "getfattr", "-n", "user.gdsfs.info", "--only-values", ownMnt)
	if code != 0 || !strings.Contains(out, fmt.Sprintf(`"cached":%d`, tierChunk)) {
		t.Errorf("uid 10001's user.gdsfs.info: exit %d: %s", code, out)
	}
	if _, code = runAsUID(t, 10002, "getfattr", "-n", "user.gdsfs.info", "--only-values", ownMnt); code == 0 {
		t.Error("uid 10002 read user.gdsfs.info of a file it cannot read")
	}
}

// TestTierBudget: a file larger than a user's share is refused with a
// message naming the share and the budget; the tier evicts the least
// recently pinned file to make room for a new one.
func TestTierBudget(t *testing.T) {
	m := startTier(t, tierOpts{budget: 4 * tierChunk}) // --uid-share 50%: 2 extents per user
	writeFile(t, filepath.Join(m.backing, "big.bin"), randomBytes(5, 3*tierChunk))
	out, code := runGdsfs(t, "warm", "--pin", "--progress", "never", filepath.Join(m.mnt, "big.bin"))
	if code == 0 || !strings.Contains(out, "needs 768 KiB, one user may hold 512 KiB of its 1.0 MiB") {
		t.Errorf("pin beyond the share: exit %d: %s", code, out)
	}
	for i := range 3 {
		writeFile(t, filepath.Join(m.backing, fmt.Sprint("e", i)), randomBytes(uint64(6+i), tierChunk))
		m.pin(t, fmt.Sprint("e", i))
	}
	if c0, c2 := m.cached(t, "e0"), m.cached(t, "e2"); c0 != 0 || c2 != tierChunk {
		t.Errorf("after 3 pins into a 2-extent share: e0 %d cached (want 0, evicted), e2 %d", c0, c2)
	}
	if st := m.tierStats(t); st["evictions"].(float64) != 1 || st["cached_bytes"].(float64) != 2*tierChunk {
		t.Errorf("tier stats: %v", st)
	}
	if out, code := runGdsfs(t, "warm", "--unpin", "--progress", "never", filepath.Join(m.mnt, "e2")); code != 0 || m.cached(t, "e2") != 0 {
		t.Errorf("warm --unpin: exit %d: %s", code, out)
	}
}

// TestTierKilledMidWarm: a warm --pin killed mid-way leaves the daemon
// consistent; running it again resumes and completes the file.
func TestTierKilledMidWarm(t *testing.T) {
	m := startTier(t, tierOpts{budget: 64 << 20})
	data := randomBytes(12, 96*tierChunk)
	writeFile(t, filepath.Join(m.backing, "k.bin"), data)
	cmd := exec.Command(gdsfsBin(t), "warm", "--pin", "--workers", "1", "--progress", "always", filepath.Join(m.mnt, "k.bin"))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The bar's first output: the pins have begun.
	if _, err := stderr.Read(make([]byte, 1)); err != nil {
		t.Fatalf("warm --pin wrote nothing: %v", err)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if c := m.cached(t, "k.bin"); c < 0 || c > int64(len(data)) {
		t.Fatalf("cached %d of %d after the kill", c, len(data))
	}
	out := m.pin(t, "k.bin")
	if !strings.Contains(out, "pinned 1 files") {
		t.Fatalf("resumed warm --pin: %s", out)
	}
	if c := m.cached(t, "k.bin"); c != int64(len(data)) {
		t.Fatalf("cached %d after resuming, want %d", c, len(data))
	}
	if st := m.tierStats(t); int64(st["used_bytes"].(float64)) != int64(len(data)) {
		t.Errorf("tier uses %v bytes for a %d-byte file (a reservation leaked?)", st["used_bytes"], len(data))
	}
	if got, eng := m.readAll(t, "k.bin"); eng != ctl.EngineTier || !bytes.Equal(got, data) {
		t.Fatalf("after the resumed pin: engine %v, bytes equal %v", eng, bytes.Equal(got, data))
	}
}

// TestTierGPUCacheNeedsGPU: --gpu-cache on a daemon of host slabs is a
// configuration error naming the flag.
func TestTierGPUCacheNeedsGPU(t *testing.T) {
	requireRoot(t)
	backing, mnt := mountDirs(t, t.TempDir())
	for _, tc := range []struct {
		tier int64
		want string
	}{{8 << 20, "--gpu-cache needs GPU slabs"}, {0, "give --tier-budget too"}} {
		d, err := daemon.Start(context.Background(), daemon.Config{Mountpoint: mnt, Source: backing,
			Engine:    cufile.Config{Engine: cufile.EngineHost, HostDir: filepath.Join("/dev/shm", "gdsfs-itest-"+randHex(4))},
			SlabBytes: 1 << 20, HostPoolBytes: 16 << 20, TierBytes: tc.tier, GPUCacheBytes: 1 << 20})
		var ce *daemon.ConfigError
		if err == nil {
			d.Close()
		}
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("tier %d, --gpu-cache 1MiB: %v, want a configuration error saying %q", tc.tier, err, tc.want)
		}
	}
}

// TestTierRestartEmpty: the tier lives in the daemon: a new daemon on the
// same backing directory starts with nothing pinned.
func TestTierRestartEmpty(t *testing.T) {
	first := startTier(t, tierOpts{budget: 8 << 20})
	data := randomBytes(13, tierChunk+1)
	writeFile(t, filepath.Join(first.backing, "r.bin"), data)
	first.pin(t, "r.bin")
	if c := first.cached(t, "r.bin"); c != int64(len(data)) {
		t.Fatalf("cached %d", c)
	}
	first.stop(t)
	second := startTier(t, tierOpts{budget: 8 << 20, source: first.backing})
	if c := second.cached(t, "r.bin"); c != 0 {
		t.Fatalf("a new daemon's tier holds %d bytes", c)
	}
	if got, eng := second.readAll(t, "r.bin"); eng == ctl.EngineTier || !bytes.Equal(got, data) {
		t.Fatalf("after the restart: engine %v, bytes equal %v", eng, bytes.Equal(got, data))
	}
}
