package integration

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
)

// TestCLIErrors: every misuse of the CLI gets one line naming what is
// wrong and what to do, exit code 2, and never a mount.
func TestCLIErrors(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	d := func(p string) string { return filepath.Join(dir, p) }
	for _, p := range []string{"m", "d", "src"} {
		if err := os.Mkdir(d(p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, d("file"), []byte("x"))
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	// A live mount for the cases that need one.
	live, liveBacking := filepath.Join(dir, "live"), filepath.Join(dir, "livesrc")
	for _, p := range []string{live, liveBacking} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(liveBacking, "data"), make([]byte, 8192))
	startBinDaemon(t, liveBacking, live, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	liveData := filepath.Join(live, "data")

	tests := []struct {
		name string
		args []string
		want string // the whole message, after "gdsfs: "
	}{
		{"unknown command", []string{"nosuch"}, `unknown command "nosuch" for "gdsfs" (see gdsfs --help)`},
		{"mount without mountpoint", []string{"mount"}, "accepts 1 arg(s), received 0 (see gdsfs mount --help)"},
		{"mount two mountpoints", []string{"mount", d("m"), d("d")}, "accepts 1 arg(s), received 2 (see gdsfs mount --help)"},
		{"mount unknown flag", []string{"mount", "--bogus", d("m")}, "unknown flag: --bogus (see gdsfs mount --help)"},
		{"mountpoint missing", []string{"mount", d("nope")}, fmt.Sprintf("mountpoint %s does not exist; create it with mkdir -p %s", d("nope"), d("nope"))},
		{"mountpoint is a file", []string{"mount", d("file")}, fmt.Sprintf("mountpoint %s is not a directory; name a directory", d("file"))},
		{"source missing", []string{"mount", "--source", d("nope"), d("m")}, fmt.Sprintf("--source %s does not exist; create it with mkdir -p %s", d("nope"), d("nope"))},
		{"source is the mountpoint", []string{"mount", "--source", d("m"), d("m")}, fmt.Sprintf("--source %q is the mountpoint; leave --source out to overmount it", d("m"))},
		{"already mounted", []string{"mount", live}, fmt.Sprintf("%s is already mounted by gdsfs; unmount it first: gdsfs unmount %s", live, live)},
		{"bad log level", []string{"mount", "--log-level", "loud", d("m")}, `--log-level "loud": use debug, info, warn or error`},
		{"bad engine", []string{"mount", "--engine", "warp", d("m")}, `--engine "warp": use auto, gds, posix or host`},
		{"bad host pool", []string{"mount", "--host-pool", "1x", d("m")}, `--host-pool "1x": give a size such as 64MiB or 2GiB`},
		{"bad gpu pool", []string{"mount", "--gpu-pool", "-1", d("m")}, `--gpu-pool "-1": give a size such as 64MiB or 2GiB`},
		{"unaligned slab", []string{"mount", "--slab-size", "5000", d("m")}, `--slab-size "5000": must be a multiple of 4KiB`},
		{"too many io workers", []string{"mount", "--io-workers", "999", d("m")}, "--io-workers 999: give 1 to 256, or 0 for the default"},
		{"bad direct-io", []string{"mount", "--direct-io", "sometimes", d("m")}, `--direct-io "sometimes": use auto, always or never`},
		{"bad meta cache", []string{"mount", "--meta-cache", "lots", d("m")}, `--meta-cache "lots": give a size such as 64MiB or 2GiB`},
		{"bad readahead", []string{"mount", "--readahead", "lots", d("m")}, `--readahead "lots": give a size such as 64MiB or 2GiB`},
		{"negative readahead", []string{"mount", "--readahead", "-1", d("m")}, `--readahead "-1": give a size such as 64MiB or 2GiB`},
		{"bad gpu pool unit", []string{"mount", "--gpu-pool", "12XB", d("m")}, `--gpu-pool "12XB": give a size such as 64MiB or 2GiB`},
		{"bad residency", []string{"mount", "--residency", "x", d("m")}, `--residency "x": give owners or readers`},
		{"max-open-per-user not a number", []string{"mount", "--max-open-per-user", "abc", d("m")}, `--max-open-per-user "abc": give a whole number (see gdsfs mount --help)`},
		{"attr-timeout not a duration", []string{"mount", "--attr-timeout", "soon", d("m")}, `--attr-timeout "soon": give a duration such as 1s, 500ms or 2m (see gdsfs mount --help)`},
		{"metrics address without port", []string{"mount", "--metrics-addr", "nonsense", d("m")}, `--metrics-addr "nonsense": address nonsense: missing port in address; give a free HOST:PORT such as 127.0.0.1:9477`},
		{"metrics port busy", []string{"mount", "--metrics-addr", busy.Addr().String(), d("m")}, fmt.Sprintf("--metrics-addr %q: listen tcp %s: bind: address already in use; give a free HOST:PORT such as 127.0.0.1:9477", busy.Addr().String(), busy.Addr().String())},
		{"unmount without mountpoint", []string{"unmount"}, "accepts 1 arg(s), received 0 (see gdsfs unmount --help)"},
		{"unmount a plain directory", []string{"unmount", d("d")}, fmt.Sprintf("%s is not a mount point; nothing to unmount", d("d"))},
		{"unmount a missing path", []string{"unmount", d("nope")}, fmt.Sprintf("%s does not exist; nothing to unmount (check the path)", d("nope"))},
		{"negative attr-timeout", []string{"mount", "--attr-timeout", "-1s", d("m")}, "--attr-timeout -1s: give a duration >= 0 such as 1s (0 disables the cache)"},
		{"negative entry-timeout", []string{"mount", "--entry-timeout", "-5ms", d("m")}, "--entry-timeout -5ms: give a duration >= 0 such as 1s (0 disables the cache)"},
		{"unmount another filesystem", []string{"unmount", "/proc"}, "/proc is a proc mount, not gdsfs; use umount(8)"},
		{"warm without path", []string{"warm"}, "requires at least 1 arg(s), only received 0 (see gdsfs warm --help)"},
		{"warm missing path", []string{"warm", d("nope")}, fmt.Sprintf("%s does not exist; name files or directories to warm", d("nope"))},
		{"warm zero workers", []string{"warm", "--workers", "0", d("d")}, "--workers 0: give 1 to 256"},
		{"warm bad progress", []string{"warm", "--progress", "loud", d("d")}, `--progress "loud": use auto, always or never`},
		{"status of a plain directory", []string{"status", d("d")}, fmt.Sprintf("%s is not a gdsfs mountpoint (no .gdsfs in it); give the directory gdsfs mount was given", d("d"))},
		{"status watch too often", []string{"status", "--watch", "--interval", "1ms", live}, "--interval 1ms: give at least 100ms, such as 2s"},
		{"status metrics nobody serves", []string{"status", "--metrics", "127.0.0.1:1", live}, `--metrics 127.0.0.1:1: Get "http://127.0.0.1:1/metrics": dial tcp 127.0.0.1:1: connect: connection refused; give the daemon's --metrics-addr`},
		{"read off the mount", []string{"read", d("file")}, fmt.Sprintf("%s is not on a gdsfs mount (no .gdsfs above it); mount its directory with gdsfs mount", d("file"))},
		{"read negative offset", []string{"read", "--offset", "-5", liveData}, "--offset -5: give a byte offset >= 0"},
		{"stat off the mount", []string{"stat", d("file")}, fmt.Sprintf("%s is not on a gdsfs mount (it has no user.gdsfs.info); mount its directory with gdsfs mount", d("file"))},
		{"bench mount tiny size", []string{"bench", "mount", "--size", "1"}, `--size "1": give a size of at least 1MiB, such as 1GiB`},
		{"bench engines bad size", []string{"bench", "engines", "--size", "x"}, `--size "x": give a size from 1MiB to 1TiB, such as 4GiB`},
		{"doctor unknown flag", []string{"doctor", "--bogus"}, "unknown flag: --bogus (see gdsfs doctor --help)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, code := runGdsfs(t, tt.args...)
			if code != 2 {
				t.Errorf("gdsfs %s: exit %d, want 2 (usage)\n%s", strings.Join(tt.args, " "), code, out)
			}
			if got := strings.TrimSpace(out); got != "gdsfs: "+tt.want {
				t.Errorf("gdsfs %s:\n got: %s\nwant: gdsfs: %s", strings.Join(tt.args, " "), got, tt.want)
			}
		})
	}
	// None of the misuses left a mount behind.
	for _, p := range []string{"m", "d", "src"} {
		if typ := mountType(t, d(p)); typ != "" {
			t.Errorf("%s is mounted (%s) after a refused command", d(p), typ)
		}
	}
	t.Logf("CLI misuse: %d cases, each exit 2 with its one-line message", len(tests))
}

// TestControlRefusalTable: every refusal docs/protocol.md section 4 lists,
// issued through the kernel to the gdsfs binary, with the errno a client
// gets; the daemon serves correct bytes afterwards.
func TestControlRefusalTable(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	writeLoadDataset(t, backing)
	writeFile(t, filepath.Join(backing, "plain.txt"), []byte("not an indexed format\n"))
	// 16 MiB slabs, 32 MiB pool: a lease can hold at most 32 MiB.
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "32MiB", "--slab-size", "16MiB")
	ctx := context.Background()
	cl := openSession(t, mnt)
	tok := cl.Token()
	// The largest data file: a few whole-file leases fill the pool.
	last := loadDataFiles - 1
	data := openRO(t, filepath.Join(mnt, loadDataName(last)))
	size := uint64(loadDataSize(last))
	shard := openRO(t, filepath.Join(mnt, loadShardName(0)))
	plain := openRO(t, filepath.Join(mnt, "plain.txt"))
	dirf := openRO(t, mnt)
	ctlf := openRO(t, filepath.Join(mnt, ctl.ControlName))
	rw, err := os.OpenFile(filepath.Join(mnt, "work", "out"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	lease, err := cl.Alloc(ctx, ctl.HostDevice, 4096)
	if err != nil {
		t.Fatal(err)
	}
	one := ctl.Range{Offset: 0, Length: 1}
	read := func(mut func(b []byte), ranges ...ctl.Range) []byte {
		b := readReq(tok, ctl.HostDevice, ranges...)
		if mut != nil {
			mut(b)
		}
		return b
	}
	le := binary.LittleEndian
	page := func(tk ctl.Token, off uint64) []byte {
		b := make([]byte, ctl.SizePage)
		(&ctl.PageRequest{Token: tk, Offset: off}).Encode(b)
		return b
	}
	alloc := func(dev int32, n uint64) []byte {
		b := make([]byte, ctl.SizeAlloc)
		(&ctl.AllocRequest{Token: tok, Device: dev, Length: n}).Encode(b)
		return b
	}
	write := func(w ctl.WriteRequest) []byte {
		b := make([]byte, ctl.SizeWrite)
		w.Token = tok
		(&w).Encode(b)
		return b
	}
	names := func(ns ...string) []byte {
		b := make([]byte, ctl.SizeRead)
		if err := (&ctl.ReadNamesRequest{Token: tok, Device: ctl.HostDevice, Names: ns}).Encode(b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	release := func(ids ...uint64) []byte {
		b := make([]byte, ctl.SizeRelease)
		(&ctl.ReleaseRequest{Token: tok, IDs: ids}).Encode(b)
		return b
	}
	slab := func(id uint64) []byte {
		b := make([]byte, ctl.SizeSlab)
		(&ctl.SlabRequest{Token: tok, Slab: id}).Encode(b)
		return b
	}
	huge := make([]ctl.Range, 6) // 6 whole files: more than the 32 MiB pool
	for i := range huge {
		huge[i] = ctl.Range{Offset: 0, Length: size}
	}
	tests := []struct {
		name string
		f    *os.File
		cmd  uint32
		buf  []byte
		want syscall.Errno
	}{
		{"unknown command number", data, 0xC0104799, make([]byte, 16), syscall.ENOTTY},
		{"READ on a directory", dirf, ctl.CmdRead, read(nil, one), syscall.ENOTTY},
		{"READ on the control file", ctlf, ctl.CmdRead, read(nil, one), syscall.ENOTTY},
		{"HELLO on a data file", data, ctl.CmdHello, func() []byte { b := make([]byte, ctl.SizeHello); ctl.EncodeHello(b); return b }(), syscall.ENOTTY},
		{"bad magic", data, ctl.CmdRead, read(func(b []byte) { b[0] ^= 0xff }, one), syscall.EINVAL},
		{"header flags", data, ctl.CmdRead, read(func(b []byte) { b[6] = 1 }, one), syscall.EINVAL},
		{"header reserved", data, ctl.CmdRead, read(func(b []byte) { b[24] = 1 }, one), syscall.EINVAL},
		{"READ flags", data, ctl.CmdRead, read(func(b []byte) { b[36] = 1 }, one), syscall.EINVAL},
		{"READ reserved", data, ctl.CmdRead, read(func(b []byte) { b[50] = 1 }, one), syscall.EINVAL},
		{"READ count 0", data, ctl.CmdRead, read(func(b []byte) { le.PutUint32(b[40:], 0) }, one), syscall.EINVAL},
		{"READ offset past EOF", data, ctl.CmdRead, read(nil, ctl.Range{Offset: size + 1, Length: 1}), syscall.EINVAL},
		{"ALLOC length 0", ctlf, ctl.CmdAlloc, alloc(ctl.HostDevice, 0), syscall.EINVAL},
		{"READ_NAMES names area malformed", shard, ctl.CmdReadNames, func() []byte {
			b := names("sample-0000.bin")
			b[64+len("sample-0000.bin")] = 'x' // no NUL terminator
			return b
		}(), syscall.EINVAL},
		{"WRITE outside the lease", rw, ctl.CmdWrite, write(ctl.WriteRequest{Lease: lease.ID, LeaseOffset: 4000, Length: 200}), syscall.EINVAL},
		{"STATUS offset past total", ctlf, ctl.CmdStatus, page(ctl.Token{}, 1<<40), syscall.EINVAL},
		{"INDEX offset past total", shard, ctl.CmdIndex, page(tok, 1<<40), syscall.EINVAL},
		{"protocol version 2", data, ctl.CmdRead, read(func(b []byte) { le.PutUint16(b[4:], 2) }, one), syscall.EPROTO},
		{"unknown session", data, ctl.CmdRead, func() []byte { return readReq(ctl.Token{Session: tok.Session + 1000, Secret: 1}, -1, one) }(), syscall.EPERM},
		{"wrong secret", data, ctl.CmdRead, readReq(ctl.Token{Session: tok.Session, Secret: tok.Secret ^ 1}, -1, one), syscall.EPERM},
		{"SLAB without a lease in it", ctlf, ctl.CmdSlab, slab(lease.Slab + 1), syscall.ENOENT},
		{"READ offset+length overflows", data, ctl.CmdRead, read(nil, ctl.Range{Offset: 1<<63 - 10, Length: 20}), syscall.ERANGE},
		{"READ length >= 2^63", data, ctl.CmdRead, read(nil, ctl.Range{Offset: 0, Length: 1 << 63}), syscall.ERANGE},
		{"WRITE file offset overflows", rw, ctl.CmdWrite, write(ctl.WriteRequest{Lease: lease.ID, FileOffset: 1<<63 - 1, Length: 10}), syscall.ERANGE},
		{"READ count 257", data, ctl.CmdRead, read(func(b []byte) { le.PutUint32(b[40:], 257) }, one), syscall.E2BIG},
		{"ALLOC larger than a lease can be", ctlf, ctl.CmdAlloc, alloc(ctl.HostDevice, 1<<30), syscall.E2BIG},
		{"READ of more than the pool", data, ctl.CmdRead, func() []byte {
			b := make([]byte, ctl.SizeRead)
			(&ctl.ReadRequest{Token: tok, Device: ctl.HostDevice, Ranges: huge}).Encode(b)
			return b
		}(), syscall.E2BIG},
		{"RELEASE count 257", ctlf, ctl.CmdRelease, func() []byte { b := release(1); le.PutUint32(b[32:], 257); return b }(), syscall.E2BIG},
		{"RELEASE count 0", ctlf, ctl.CmdRelease, func() []byte { b := release(1); le.PutUint32(b[32:], 0); return b }(), syscall.EINVAL},
		{"READ on a GPU device of a host daemon", data, ctl.CmdRead, readReq(tok, 0, one), syscall.ENODEV},
		{"ALLOC on an unknown device", ctlf, ctl.CmdAlloc, alloc(7, 4096), syscall.ENODEV},
		{"SLAB of an unknown slab", ctlf, ctl.CmdSlab, slab(1 << 40), syscall.ENOENT},
		{"WRITE of a lease not held", rw, ctl.CmdWrite, write(ctl.WriteRequest{Lease: 1 << 40, Length: 1}), syscall.ENOENT},
		{"READ_NAMES of a name not in the index", shard, ctl.CmdReadNames, names("no-such-member"), syscall.ENOENT},
		{"INDEX of an unindexed file", plain, ctl.CmdIndex, page(tok, 0), syscall.ENODATA},
		{"READ_NAMES on an unindexed file", plain, ctl.CmdReadNames, names("x"), syscall.ENODATA},
		{"WRITE on a read-only descriptor", data, ctl.CmdWrite, write(ctl.WriteRequest{Lease: lease.ID, Length: 1}), syscall.EBADF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ioctlErr(tt.f, tt.cmd, tt.buf); got != tt.want {
				t.Errorf("got %v (%s), want %v (%s)", got, errnoName(got), tt.want, errnoName(tt.want))
			}
		})
	}

	// EAGAIN: the pool is full now; the Go client's message names it.
	var held []uint64
	for range 8 {
		ls, err := cl.Read(ctx, data, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: size}})
		if err != nil {
			if !strings.Contains(err.Error(), syscall.EAGAIN.Error()) {
				t.Errorf("READ on a full pool: %v, want EAGAIN (%q)", err, syscall.EAGAIN.Error())
			}
			break
		}
		held = append(held, ls[0].ID)
	}
	if len(held) == 8 {
		t.Error("a 32 MiB pool never answered EAGAIN")
	}
	if err := cl.Release(ctx, append(held, lease.ID)...); err != nil {
		t.Fatal(err)
	}
	// The daemon is fine: bytes still right, nothing held, every refusal
	// counted by errno.
	checkStillServes(t, cl, data, genBytes(loadDataSeed(last), 0, int(size)))
	cl.Close()
	for _, f := range []*os.File{data, shard, plain, dirf, ctlf, rw} {
		f.Close()
	}
	idle, err := d.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20, pipeFDs: 1 << 20})
	if err != nil {
		t.Error(err)
	}
	s := d.mustScrape()
	counted := s.Sum("gdsfs_control_errors_total") - s.Sum("gdsfs_control_errors_total", "errno", "EINTR")
	// Refusals the kernel answers itself (ENOTTY for unknown command
	// numbers on some files) never reach the daemon, so the count may be
	// lower than the table; it can never be higher.
	if counted > float64(len(tests)+1) || counted == 0 {
		t.Errorf("daemon counted %v refusals for %d refused requests", counted, len(tests)+1)
	}
	t.Logf("control refusals: %d cases + EAGAIN, each with its documented errno; daemon counted %v; idle after (%v B leased)", len(tests), counted, idle.poolBytes)
}

func errnoName(e syscall.Errno) string {
	if e == 0 {
		return "success"
	}
	return e.Error()
}
