// Package instrument wraps the daemon's components with metrics
// recording: decorators over fs.Control (control-path requests, sessions)
// and ctlserver.EngineChooser (bytes moved per engine). Package daemon composes
// them when it builds the mount, so neither fs nor ctl knows metrics exist.
//
// It is separate from package metrics so that metrics stays a leaf every
// package may use, while this package depends on fs and ctl.
package instrument

import (
	"context"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// Recorder is what the decorators record into (*metrics.Metrics
// satisfies it).
type Recorder interface {
	ObserveControl(command string, d time.Duration, errno syscall.Errno)
	AddBytes(engine, direction string, n int64)
	SessionOpened()
	SessionClosed()
}

// CommandName names an ioctl command number as docs/protocol.md does
// ("READ"; ctl.CommandName), or "other" for a number the protocol does not
// define.
func CommandName(cmd uint32) string {
	if n := ctl.CommandName(cmd); n != "" {
		return n
	}
	return "other"
}

// Control returns c with every control-path request, its latency and its
// errno recorded in r, and sessions counted. Recording never changes a
// result.
func Control(c fs.Control, r Recorder) fs.Control {
	return &control{Control: c, r: r}
}

type control struct {
	fs.Control
	r Recorder
}

func (c *control) OpenSession(ctx context.Context, who fs.Caller) (fs.Session, syscall.Errno) {
	s, errno := c.Control.OpenSession(ctx, who)
	if errno != 0 || s == nil {
		return s, errno
	}
	c.r.SessionOpened()
	return &session{Session: s, r: c.r}, 0
}

func (c *control) FileIoctl(ctx context.Context, who fs.Caller, f *os.File, path string, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	start := time.Now()
	n, errno := c.Control.FileIoctl(ctx, who, f, path, cmd, in, out)
	if ctl.OurCmd(cmd) { // a tty probe (Python's open() asks isatty) is no control request
		c.r.ObserveControl(CommandName(cmd), time.Since(start), errno)
	}
	return n, errno
}

func (c *control) Xattr(ctx context.Context, who fs.Caller, t fs.XattrTarget, name string) ([]byte, syscall.Errno) {
	start := time.Now()
	v, errno := c.Control.Xattr(ctx, who, t, name)
	c.r.ObserveControl("xattr:"+strings.TrimPrefix(name, "user.gdsfs."), time.Since(start), errno)
	return v, errno
}

type session struct {
	fs.Session
	r Recorder
}

func (s *session) Ioctl(ctx context.Context, who fs.Caller, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	start := time.Now()
	n, errno := s.Session.Ioctl(ctx, who, cmd, in, out)
	if ctl.OurCmd(cmd) {
		s.r.ObserveControl(CommandName(cmd), time.Since(start), errno)
	}
	return n, errno
}

// Close ends the session; fs calls it once per session.
func (s *session) Close() error {
	err := s.Session.Close()
	s.r.SessionClosed()
	return err
}

// Engines returns ch with the bytes every engine it chooses moves recorded
// in r under the engine's name. The answer and its reason are ch's.
func Engines(ch ctlserver.EngineChooser, r Recorder) ctlserver.EngineChooser {
	return &chooser{ch: ch, r: r}
}

type chooser struct {
	ch ctlserver.EngineChooser
	r  Recorder
}

func (c *chooser) Choose(f *os.File, path string, off, n int64) (cufile.Engine, string) {
	return c.wrap(c.ch.Choose(f, path, off, n))
}

// ChooseAs implements ctlserver.ResidencyChooser: ch's answer for a caller
// who may not be told residency stays ch's (Choose's where ch does not
// depend on residency).
func (c *chooser) ChooseAs(f *os.File, path string, off, n int64, mayKnow func() bool) (cufile.Engine, string) {
	if rc, ok := c.ch.(ctlserver.ResidencyChooser); ok {
		return c.wrap(rc.ChooseAs(f, path, off, n, mayKnow))
	}
	return c.Choose(f, path, off, n)
}

func (c *chooser) wrap(e cufile.Engine, why string) (cufile.Engine, string) {
	if e == nil {
		return e, why
	}
	return wrapEngine(e, c.r), why
}

// wrapEngine returns e recording its bytes in r, with e's ReadVec (the
// optional ability ctlserver looks for) and no other.
func wrapEngine(e cufile.Engine, r Recorder) cufile.Engine {
	w := &engine{Engine: e, r: r}
	if vr, ok := e.(cufile.VecReader); ok {
		// ctlserver serves a READ of many small ranges through ReadVec when
		// the engine has it: keep it visible behind the wrapper (issue 15's
		// small samples ran range by range on mounts with --metrics-addr).
		return &vecEngine{engine: w, vr: vr}
	}
	return w
}

type engine struct {
	cufile.Engine
	r Recorder
}

// Unwrap implements cufile.Wrapper: the engine's optional abilities stay
// reachable through the wrapper.
func (e *engine) Unwrap() cufile.Engine { return e.Engine }

func (e *engine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	got, err := e.Engine.ReadAt(ctx, f, dst, dstOff, fileOff, n)
	e.r.AddBytes(e.Name(), "read", got)
	return got, err
}

func (e *engine) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	got, err := e.Engine.WriteAt(ctx, f, src, srcOff, fileOff, n)
	e.r.AddBytes(e.Name(), "write", got)
	return got, err
}

// vecEngine is the recording wrapper of an engine that reads many ranges
// in one call.
type vecEngine struct {
	*engine
	vr cufile.VecReader
}

func (e *vecEngine) ReadVec(ctx context.Context, f *os.File, segs []cufile.Segment) ([]int64, error) {
	n, err := e.vr.ReadVec(ctx, f, segs)
	var sum int64
	for _, k := range n {
		sum += k
	}
	e.r.AddBytes(e.Name(), "read", sum)
	return n, err
}
