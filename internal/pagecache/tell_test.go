package pagecache

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

func TestMayTell(t *testing.T) {
	in := func(gids ...uint32) func(uint32) bool {
		return func(g uint32) bool {
			for _, x := range gids {
				if x == g {
					return true
				}
			}
			return false
		}
	}
	for _, tc := range []struct {
		name     string
		mode     uint32
		asker    Asker
		writable bool
		want     bool
	}{
		{"owner of a 0400 file", 0o400, Asker{UID: 10001}, false, true},
		{"root", 0o000, Asker{UID: 0}, false, true},
		{"writable descriptor", 0o644, Asker{UID: 10002}, true, true},
		{"world-readable, other user", 0o644, Asker{UID: 10002}, false, false},
		{"world-readable, group member", 0o644, Asker{UID: 10002, InGroup: in(10001)}, false, false},
		{"group-writable, group member", 0o664, Asker{UID: 10002, InGroup: in(5, 10001)}, false, true},
		{"group-writable, not a member", 0o664, Asker{UID: 10002, InGroup: in(5)}, false, false},
		{"world-writable, other user", 0o646, Asker{UID: 10002}, false, true},
		{"world-writable but group not: a member", 0o646, Asker{UID: 10002, InGroup: in(10001)}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &syscall.Stat_t{Uid: 10001, Gid: 10001, Mode: syscall.S_IFREG | tc.mode}
			if got := MayTell(st, tc.asker, tc.writable); got != tc.want {
				t.Errorf("MayTell(mode %#o, uid %d) = %v, want %v", tc.mode, tc.asker.UID, got, tc.want)
			}
		})
	}
	// A world-readable dataset (0644) is decided without the caller's
	// groups, which the daemon reads from /proc (20 us).
	asked := false
	st := &syscall.Stat_t{Uid: 10001, Gid: 10001, Mode: syscall.S_IFREG | 0o644}
	if MayTell(st, Asker{UID: 10002, InGroup: func(uint32) bool { asked = true; return true }}, false) || asked {
		t.Errorf("MayTell of a 0644 file for another uid: asked its groups %v (want no question, and false)", asked)
	}
}

// TestMayTellMatchesKernel asks the kernel itself: processes of uids 10001
// and 10002 (with and without group 10001) open files of uid 10001 in
// several modes and call cachestat(2); MayTell must answer as the kernel
// does (EPERM: not told).
func TestMayTellMatchesKernel(t *testing.T) {
	if os.Getenv("PAGECACHE_TELL_HELPER") != "" {
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to run processes as other uids")
	}
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The test binary's directory is root's only: run a copy.
	self, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	helper := filepath.Join(dir, "helper")
	if err := os.WriteFile(helper, self, 0o755); err != nil {
		t.Fatal(err)
	}
	modes := []uint32{0o644, 0o664, 0o646, 0o666, 0o604}
	for _, m := range modes {
		p := filepath.Join(dir, fmt.Sprintf("f%o", m))
		if err := os.WriteFile(p, make([]byte, 8192), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, 10001, 10001); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, os.FileMode(m)); err != nil {
			t.Fatal(err)
		}
	}
	askers := []struct {
		uid    uint32
		groups []uint32
	}{{10001, nil}, {10002, nil}, {10002, []uint32{10001}}}
	checked := 0
	for _, m := range modes {
		p := filepath.Join(dir, fmt.Sprintf("f%o", m))
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		for _, a := range askers {
			cmd := exec.Command(helper, "-test.run=^TestMayTellHelper$")
			cmd.Env = append(os.Environ(), "PAGECACHE_TELL_HELPER="+p)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: a.uid, Gid: a.uid, Groups: a.groups}}
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("helper as uid %d: %v\n%s", a.uid, err, out)
			}
			var kernel string
			for _, l := range strings.Split(string(out), "\n") {
				if v, ok := strings.CutPrefix(l, "cachestat: "); ok {
					kernel = v
				}
			}
			if kernel == "" || kernel == "open refused" || kernel == "no cachestat" {
				continue
			}
			asker := Asker{UID: a.uid, InGroup: func(g uint32) bool { return g == a.uid || slices.Contains(a.groups, g) }}
			if got, want := MayTell(&st, asker, false), kernel == "told"; got != want {
				t.Errorf("mode %#o, uid %d groups %v: MayTell %v, the kernel: %s", m, a.uid, a.groups, got, kernel)
			}
			checked++
		}
	}
	if checked == 0 {
		t.Skip("the kernel answered no case (no cachestat(2))")
	}
}

// TestMayTellHelper is TestMayTellMatchesKernel's process: it prints
// whether cachestat(2) tells it the residency of the file named.
func TestMayTellHelper(t *testing.T) {
	p := os.Getenv("PAGECACHE_TELL_HELPER")
	if p == "" {
		t.Skip("run by TestMayTellMatchesKernel")
	}
	f, err := os.Open(p)
	if err != nil {
		fmt.Println("cachestat: open refused")
		return
	}
	defer f.Close()
	switch _, err := cachestat(f, 0, 4096); {
	case err == nil:
		fmt.Println("cachestat: told")
	case errors.Is(err, syscall.EPERM):
		fmt.Println("cachestat: refused")
	default:
		fmt.Println("cachestat: no cachestat")
	}
}
