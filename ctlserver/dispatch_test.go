package ctlserver

import (
	"context"
	"os"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// TestDispatchFollowsCommandTable: each command of ctl.Commands() is
// served by the dispatcher its File says (data file: FileIoctl; control
// file: the session's Ioctl) and answered ENOTTY by the other. A zeroed
// buffer has no magic, so the right one refuses it with EINVAL.
func TestDispatchFollowsCommandTable(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	c := fs.Caller{UID: 1000, GID: 1000, PID: 1}
	sess, errno := e.srv.OpenSession(ctx, c)
	if errno != 0 {
		t.Fatal(errno)
	}
	defer sess.Close()
	f, _ := e.file("d", 100, os.O_RDWR)
	for _, cmd := range ctl.Commands() {
		onFile := func() syscall.Errno {
			_, errno := e.srv.FileIoctl(ctx, c, f, f.Name(), cmd.Cmd, make([]byte, cmd.Size), make([]byte, cmd.Size))
			return errno
		}
		onControl := func() syscall.Errno {
			_, errno := sess.Ioctl(ctx, c, cmd.Cmd, make([]byte, cmd.Size), make([]byte, cmd.Size))
			return errno
		}
		right, wrong := onControl, onFile
		if cmd.File {
			right, wrong = onFile, onControl
		}
		if got := right(); got != syscall.EINVAL {
			t.Errorf("%s (zeroed) where the table says it goes: %v, want EINVAL", cmd.Name, got)
		}
		if got := wrong(); got != syscall.ENOTTY {
			t.Errorf("%s on the other kind of file: %v, want ENOTTY", cmd.Name, got)
		}
	}
}
