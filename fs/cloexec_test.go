package fs

import (
	"os/exec"
	"strings"
	"testing"
)

// TestFuseFdNotInherited: a process serving a mount that starts another
// program (a test running the CLI against an in-process mount; the daemon
// running fusermount3) must not hand it the /dev/fuse connection. A child
// holding it keeps the connection alive after the server dies, and a child
// that then touches the mount waits forever (D state) instead of getting
// ENOTCONN.
func TestFuseFdNotInherited(t *testing.T) {
	testMount(t, nil)
	out, err := exec.Command("/bin/sh", "-c", `for f in /proc/self/fd/*; do readlink "$f" || true; done`).CombinedOutput()
	if err != nil {
		t.Fatalf("listing the child's descriptors: %v\n%s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.TrimSpace(l) == "/dev/fuse" {
			t.Fatalf("a child started after Mount inherited the /dev/fuse connection; its descriptors:\n%s", out)
		}
	}
}
