package ctlserver

import (
	"context"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// fileHandler serves a data-file command (ctl.Command.File) on f, the
// caller's descriptor of the file at path.
type fileHandler func(s *Server, ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno

// controlHandler serves a control-file command on session ss, the open of
// <mount>/.gdsfs it was issued on.
type controlHandler func(ss *session, ctx context.Context, c fs.Caller, in, out []byte) syscall.Errno

// handler is what serves one command of ctl.Commands(): file for a
// data-file command, control for a control-file one (exactly one is set).
type handler struct {
	file    fileHandler
	control controlHandler
}

// handlerOf returns the handler of command cmd of ctl.Commands(), and
// false for a number the table does not hold. Which dispatcher may serve
// it (FileIoctl or the session's Ioctl), its name and its size are the
// table's: this switch only binds each command to its code
// (TestHandlersCoverCommandTable).
func handlerOf(cmd uint32) (ctl.Command, handler, bool) {
	c, ok := ctl.LookupCommand(cmd)
	if !ok {
		return c, handler{}, false
	}
	var h handler
	switch cmd {
	case ctl.CmdHello:
		h.control = (*session).helloCmd
	case ctl.CmdSlab:
		h.control = (*session).slabCmd
	case ctl.CmdAlloc:
		h.control = (*session).allocCmd
	case ctl.CmdRelease:
		h.control = (*session).releaseCmd
	case ctl.CmdStatus:
		h.control = (*session).statusCmd
	case ctl.CmdRead:
		h.file = func(s *Server, ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno {
			return s.read(ctx, c, f, path, in, out, false)
		}
	case ctl.CmdReadNames:
		h.file = func(s *Server, ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno {
			return s.read(ctx, c, f, path, in, out, true)
		}
	case ctl.CmdWrite:
		h.file = (*Server).write
	case ctl.CmdIndex:
		h.file = (*Server).index
	case ctl.CmdPin:
		h.file = (*Server).pin // pin.go
	}
	return c, h, true
}

// fileCommand returns the handler of data-file command cmd, or nil when
// cmd is not one (a control-file command, or no command at all: ENOTTY).
func fileCommand(cmd uint32) fileHandler {
	c, h, ok := handlerOf(cmd)
	if !ok || !c.File {
		return nil
	}
	return h.file
}

// controlCommand returns the handler of control-file command cmd, or nil
// when cmd is not one. The buffer's size is the one cmd encodes
// (ctl.CmdSize; ctl.TestCommands: the table's).
func controlCommand(cmd uint32) controlHandler {
	c, h, ok := handlerOf(cmd)
	if !ok || c.File {
		return nil
	}
	return h.control
}

func (ss *session) helloCmd(_ context.Context, _ fs.Caller, in, out []byte) syscall.Errno {
	if err := ctl.DecodeHello(in); err != nil {
		return plainErrno(err)
	}
	ss.hello(out)
	return 0
}

func (ss *session) slabCmd(_ context.Context, c fs.Caller, in, out []byte) syscall.Errno {
	req, err := ctl.DecodeSlabRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	return ss.within(req.Token, c, func(t *session) syscall.Errno { return t.slab(req.Slab, out) })
}

func (ss *session) allocCmd(ctx context.Context, c fs.Caller, in, out []byte) syscall.Errno {
	req, err := ctl.DecodeAllocRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	return ss.within(req.Token, c, func(t *session) syscall.Errno { return t.alloc(ctx, req, out) })
}

func (ss *session) releaseCmd(_ context.Context, c fs.Caller, in, out []byte) syscall.Errno {
	req, err := ctl.DecodeReleaseRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	return ss.within(req.Token, c, func(t *session) syscall.Errno {
		t.release(req.IDs, out)
		return 0
	})
}

func (ss *session) statusCmd(_ context.Context, _ fs.Caller, in, out []byte) syscall.Errno {
	req, err := ctl.DecodePageRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	if req.Flags != 0 {
		return syscall.EINVAL // INDEX's flags only
	}
	return ss.statusPage(req.Offset, out)
}
