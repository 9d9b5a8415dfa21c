package instrument

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/metrics"
)

type fixedEngine struct{ e cufile.Engine }

func (c fixedEngine) Choose(*os.File, string, int64, int64) (cufile.Engine, string) {
	return c.e, "test"
}

// newServer is a ctlserver.Server over a small host pool, wrapped as package
// daemon wraps it.
func newServer(t *testing.T, m *metrics.Metrics) fs.Control {
	t.Helper()
	be, err := gpubuf.NewHostBackend(gpubuf.HostBackendOptions{Dir: filepath.Join(t.TempDir(), "slabs")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: be, SlabBytes: 1 << 20, BudgetBytes: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	srv, err := ctlserver.NewServer(ctlserver.Options{
		Pool:    pool,
		Engines: Engines(fixedEngine{cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})}, m),
		Engine:  "host",
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return Control(srv, m)
}

func TestControlAndEngineRecording(t *testing.T) {
	m := metrics.New()
	c := newServer(t, m)
	ctx := context.Background()
	who := fs.Caller{UID: 1000, GID: 1000, PID: 1}

	sess, errno := c.OpenSession(ctx, who)
	if errno != 0 {
		t.Fatal(errno)
	}
	buf := make([]byte, ctl.SizeHello)
	ctl.EncodeHello(buf)
	out := make([]byte, ctl.SizeHello)
	if _, errno := sess.Ioctl(ctx, who, ctl.CmdHello, buf, out); errno != 0 {
		t.Fatalf("HELLO: %v", errno)
	}
	hello, err := ctl.DecodeHelloReply(out)
	if err != nil {
		t.Fatal(err)
	}
	tok := hello.Token

	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, 10000), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	req := make([]byte, ctl.SizeRead)
	(&ctl.ReadRequest{Token: tok, Device: ctl.HostDevice, Ranges: []ctl.Range{{Offset: 0, Length: 10000}}}).Encode(req)
	out = make([]byte, ctl.SizeRead)
	if _, errno := c.FileIoctl(ctx, who, f, p, ctl.CmdRead, req, out); errno != 0 {
		t.Fatalf("READ: %v", errno)
	}
	// A refusal: the same token from another uid.
	if _, errno := c.FileIoctl(ctx, fs.Caller{UID: 1001}, f, p, ctl.CmdRead, req, make([]byte, ctl.SizeRead)); errno != syscall.EPERM {
		t.Fatalf("READ as another uid: %v, want EPERM", errno)
	}
	// An unknown command of ours is a refused control request; a tty probe
	// (TCGETS, what Python's open() sends to ask isatty) is none at all.
	unknown := uint32(3<<30 | 8<<16 | 'G'<<8 | 0x7f)
	if _, errno := c.FileIoctl(ctx, who, f, p, unknown, make([]byte, 8), make([]byte, 8)); errno != syscall.ENOTTY {
		t.Fatalf("unknown command: %v, want ENOTTY", errno)
	}
	const tcgets = 0x5401
	if _, errno := c.FileIoctl(ctx, who, f, p, tcgets, nil, nil); errno != syscall.ENOTTY {
		t.Fatalf("TCGETS: %v, want ENOTTY", errno)
	}
	if _, errno := c.Xattr(ctx, who, fs.XattrTarget{Path: p}, "user.gdsfs.backing"); errno != 0 {
		t.Fatalf("xattr backing: %v", errno)
	}
	if err := sess.Close(); err != nil {
		t.Fatal(err)
	}

	s, err := m.Gather()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"gdsfs_control_requests_total", []string{"command", "HELLO"}, 1},
		{"gdsfs_control_requests_total", []string{"command", "READ"}, 2},
		{"gdsfs_control_errors_total", []string{"command", "READ", "errno", "EPERM"}, 1},
		{"gdsfs_control_errors_total", []string{"command", "other", "errno", "ENOTTY"}, 1},
		{"gdsfs_control_requests_total", []string{"command", "xattr:backing"}, 1},
		// 10000 bytes widened to 4 KiB alignment.
		{"gdsfs_bytes_total", []string{"engine", "host", "direction", "read"}, 10000},
		{"gdsfs_control_sessions", nil, 0},
		{"gdsfs_control_sessions_opened_total", nil, 1},
	}
	for _, tt := range tests {
		got, ok := s.Get(tt.name, tt.labels...)
		if !ok || got != tt.want {
			t.Errorf("%s = %v (present %v), want %v", metrics.Series(tt.name, tt.labels...), got, ok, tt.want)
		}
	}
}

type rangeEngine struct {
	fixedEngine
	asked *[2]int64
}

func (c rangeEngine) Choose(_ *os.File, _ string, off, n int64) (cufile.Engine, string) {
	*c.asked = [2]int64{off, n}
	return c.e, "range"
}

// TestEnginesPassesRange: the wrapper asks the wrapped chooser about the
// very range it was asked about (READs are chosen by their span), keeps its
// reason, and records the chosen engine's bytes.
func TestEnginesPassesRange(t *testing.T) {
	var asked [2]int64
	m := metrics.New()
	w := Engines(rangeEngine{fixedEngine{cufile.NewHostEngine(cufile.Options{})}, &asked}, m)
	e, why := w.Choose(nil, "p", 4096, 8192)
	if e == nil || why != "range" || asked != [2]int64{4096, 8192} {
		t.Fatalf("Choose = %v, %q, asked %v", e, why, asked)
	}
	if _, ok := e.(*engine); !ok {
		t.Fatalf("Choose returned %T, want the recording engine", e)
	}
	if e, _ := Engines(fixedEngine{}, m).Choose(nil, "p", 0, -1); e != nil {
		t.Fatalf("a chooser without an engine answered %v through the wrapper, want nil", e)
	}
}

func TestCommandName(t *testing.T) {
	tests := []struct {
		cmd  uint32
		want string
	}{
		{ctl.CmdHello, "HELLO"}, {ctl.CmdSlab, "SLAB"}, {ctl.CmdAlloc, "ALLOC"},
		{ctl.CmdRelease, "RELEASE"}, {ctl.CmdStatus, "STATUS"}, {ctl.CmdRead, "READ"},
		{ctl.CmdReadNames, "READ_NAMES"}, {ctl.CmdWrite, "WRITE"}, {ctl.CmdIndex, "INDEX"},
		{0, "other"}, {ctl.CmdRead&^0xff | 0x7f, "other"},
	}
	for _, tt := range tests {
		if got := CommandName(tt.cmd); got != tt.want {
			t.Errorf("CommandName(%#x) = %q, want %q", tt.cmd, got, tt.want)
		}
	}
}

// TestEnginesKeepVectoredReads: an engine that reads many ranges in one
// call (cufile.VecReader: the posix and host engines) keeps that ability
// behind the recording wrapper, so a mount with --metrics-addr serves
// small-sample READs the same way as one without, and the bytes it moves
// are recorded.
func TestEnginesKeepVectoredReads(t *testing.T) {
	host := cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})
	m := metrics.New()
	e, _ := Engines(fixedEngine{fakeVecEngine{host}}, m).Choose(nil, "p", 0, 1)
	vr, ok := e.(cufile.VecReader)
	if !ok {
		t.Fatalf("Choose returned %T: the recording wrapper hides the engine's ReadVec", e)
	}
	p := filepath.Join(t.TempDir(), "f")
	data := make([]byte, 64<<10)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	be, err := gpubuf.NewHostBackend(gpubuf.HostBackendOptions{Dir: filepath.Join(t.TempDir(), "slabs")})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	mem, err := be.Alloc(context.Background(), 0, 8192, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	dst := mem.(gpubuf.HostMemory).HostBytes()
	n, err := vr.ReadVec(context.Background(), f, []cufile.Segment{
		{Dst: mem, DstOff: 0, FileOff: 100, N: 1000},
		{Dst: mem, DstOff: 4096, FileOff: 30000, N: 3000},
	})
	if err != nil || len(n) != 2 || n[0] != 1000 || n[1] != 3000 {
		t.Fatalf("ReadVec = %v, %v; want [1000 3000]", n, err)
	}
	if string(dst[:1000]) != string(data[100:1100]) || string(dst[4096:7096]) != string(data[30000:33000]) {
		t.Fatal("ReadVec through the wrapper read other bytes than the file's")
	}
	s, err := m.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get("gdsfs_bytes_total", "engine", "host", "direction", "read"); got != 4000 {
		t.Errorf("gdsfs_bytes_total{host,read} = %v after a vectored read of 4000 bytes, want 4000", got)
	}
	if e, _ := Engines(fixedEngine{readOnlyEngine{host}}, m).Choose(nil, "p", 0, 1); e != nil {
		if _, ok := e.(cufile.VecReader); ok {
			t.Errorf("an engine without ReadVec gained one through the wrapper (%T)", e)
		}
	}
}

// readOnlyEngine hides every optional ability of the engine it holds.
type readOnlyEngine struct{ cufile.Engine }

// fakeVecEngine reads vectors range by range, as a stand-in for the posix
// engine's ReadVec (CUDA memory only) on a machine without a GPU.
type fakeVecEngine struct{ cufile.Engine }

func (e fakeVecEngine) ReadVec(ctx context.Context, f *os.File, segs []cufile.Segment) ([]int64, error) {
	n := make([]int64, len(segs))
	for i, s := range segs {
		got, err := e.ReadAt(ctx, f, s.Dst, s.DstOff, s.FileOff, s.N)
		n[i] = got
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// residencyEngine answers "told" or "not told" as mayKnow says.
type residencyEngine struct{ fixedEngine }

func (c residencyEngine) ChooseAs(_ *os.File, _ string, _, _ int64, mayKnow func() bool) (cufile.Engine, string) {
	if mayKnow != nil && !mayKnow() {
		return c.e, "not told"
	}
	return c.e, "told"
}

// TestEnginesKeepsResidencyRule: the wrapper is a ctlserver.ResidencyChooser
// that hands the caller's rule to a chooser that has one (else ctl's
// residency rule would be lost on mounts with --metrics-addr), and answers
// Choose's for one that has none.
func TestEnginesKeepsResidencyRule(t *testing.T) {
	m := metrics.New()
	host := cufile.NewHostEngine(cufile.Options{})
	rc, ok := Engines(residencyEngine{fixedEngine{host}}, m).(ctlserver.ResidencyChooser)
	if !ok {
		t.Fatal("the wrapper is no ResidencyChooser")
	}
	if _, why := rc.ChooseAs(nil, "p", 0, -1, func() bool { return false }); why != "not told" {
		t.Errorf("ChooseAs for a caller who may not know: %q, want the wrapped chooser's %q", why, "not told")
	}
	plain := Engines(fixedEngine{host}, m).(ctlserver.ResidencyChooser)
	if e, why := plain.ChooseAs(nil, "p", 0, -1, func() bool { return false }); e == nil || why != "test" {
		t.Errorf("ChooseAs of a chooser without the rule: %v, %q", e, why)
	}
}
