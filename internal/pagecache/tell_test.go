package pagecache

import (
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
}
