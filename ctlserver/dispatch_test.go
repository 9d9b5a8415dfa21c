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

// TestHandlersCoverCommandTable: every command of ctl.Commands() has
// exactly one handler, of the kind its File says, and nothing else has
// one.
func TestHandlersCoverCommandTable(t *testing.T) {
	for _, cmd := range ctl.Commands() {
		_, h, ok := handlerOf(cmd.Cmd)
		if !ok {
			t.Errorf("%s: not in ctl.LookupCommand", cmd.Name)
			continue
		}
		if (h.file != nil) != cmd.File || (h.control != nil) == cmd.File {
			t.Errorf("%s: file handler %v, control handler %v; the table says data file = %v", cmd.Name, h.file != nil, h.control != nil, cmd.File)
		}
		if cmd.File && (fileCommand(cmd.Cmd) == nil || controlCommand(cmd.Cmd) != nil) ||
			!cmd.File && (fileCommand(cmd.Cmd) != nil || controlCommand(cmd.Cmd) == nil) {
			t.Errorf("%s: served by the wrong dispatcher", cmd.Name)
		}
	}
	for _, cmd := range []uint32{0, 0x5401, ctl.CmdRead ^ 1<<16, ctl.CmdHello &^ 0xff} {
		if _, _, ok := handlerOf(cmd); ok || fileCommand(cmd) != nil || controlCommand(cmd) != nil {
			t.Errorf("%#x: has a handler, but is no command of the protocol", cmd)
		}
	}
}
