package ctl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"unsafe"

	"github.com/gdsfs/gdsfs/handoff"
	"golang.org/x/sys/unix"
)

// ControlName is the control file's name at the mount root.
const ControlName = ".gdsfs"

// ErrLeaseNotHeld is returned (wrapped) by Client.Bytes for a lease this
// client does not hold: never read or allocated by it (nor adopted),
// released, or the client is closed. The daemon may already have handed
// that memory to another read.
var ErrLeaseNotHeld = errors.New("gdsfs: lease not held by this client")

// Transport carries one ioctl to the daemon: the kernel in production
// (NewClient, Attach), a server in process in its tests
// (NewTransportClient).
type Transport interface {
	// Control issues cmd on the control file; buf is the request on entry
	// and the reply on return.
	Control(ctx context.Context, cmd uint32, buf []byte) error
	// File issues cmd on the data file f, likewise.
	File(ctx context.Context, f *os.File, cmd uint32, buf []byte) error
	// Close ends the session the transport carries.
	Close() error
}

// Client is a control-path session seen from a client process: the Go
// counterpart of the Python gdsfs client, used by the CLI, tests and
// benchmarks. Its methods are safe for concurrent use. The ioctls it issues
// cannot be cancelled through ctx once in the kernel (the daemon honours
// signals); ctx is checked before each one.
type Client struct {
	t     Transport
	hello HelloReply
	tok   Token // the token requests carry (the attached session's, or this one's)

	mu     sync.Mutex
	maps   map[uint64]mapping // GUARDED_BY(mu): host slab mappings
	held   map[uint64]Lease   // GUARDED_BY(mu): leases this client holds, by id
	closed bool               // GUARDED_BY(mu)

	// readBufs recycles READ/READ_NAMES buffers (12 KiB each, every
	// request): fewer allocations, fewer garbage collections.
	readBufs sync.Pool
}

// readBuf returns a SizeRead buffer; putReadBuf gives it back.
func (c *Client) readBuf() []byte {
	if b, ok := c.readBufs.Get().(*[]byte); ok {
		return *b
	}
	return make([]byte, SizeRead)
}

func (c *Client) putReadBuf(b []byte) { c.readBufs.Put(&b) }

// mapping is one mmap of a host slab's file.
type mapping struct {
	whole []byte // the whole mapping, for munmap
	slab  []byte // the slab's bytes within it
}

// OpenSession opens <mountpoint>/.gdsfs, which starts a session owned by
// the caller's uid, and says hello.
func OpenSession(mountpoint string) (*Client, error) {
	f, err := os.OpenFile(filepath.Join(mountpoint, ControlName), os.O_RDONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("gdsfs: open control file (is %s a gdsfs mount?): %w", mountpoint, err)
	}
	return NewClient(f)
}

// NewClient says hello on an open control file (for example one inherited
// from a parent process: the session is the parent's). The Client owns f.
func NewClient(f *os.File) (*Client, error) {
	return NewTransportClient(context.Background(), kernel{ctl: f}, Token{})
}

// Attach opens <mountpoint>/.gdsfs and acts on the session of tok (handed
// over by another process of the same uid) instead of the new one: leases
// it takes belong to tok's session and outlive this Client.
func Attach(mountpoint string, tok Token) (*Client, error) {
	f, err := os.OpenFile(filepath.Join(mountpoint, ControlName), os.O_RDONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("gdsfs: open control file (is %s a gdsfs mount?): %w", mountpoint, err)
	}
	return NewTransportClient(context.Background(), kernel{ctl: f}, tok)
}

// NewTransportClient says HELLO over t and returns the client of the
// session it opened (attach != zero: of that session instead). NewClient
// and Attach use the kernel; a server's tests pass a transport that calls
// it in process.
func NewTransportClient(ctx context.Context, t Transport, attach Token) (*Client, error) {
	buf := make([]byte, SizeHello)
	EncodeHello(buf)
	if err := t.Control(ctx, CmdHello, buf); err != nil {
		t.Close()
		return nil, fmt.Errorf("gdsfs: HELLO: %w", err)
	}
	h, err := DecodeHelloReply(buf)
	if err != nil {
		t.Close()
		return nil, fmt.Errorf("gdsfs: HELLO reply: %w", err)
	}
	if h.Version != uint32(Version) {
		t.Close()
		return nil, fmt.Errorf("gdsfs: daemon speaks protocol %d, this client %d: %w", h.Version, Version, syscall.EPROTO)
	}
	c := &Client{t: t, hello: h, tok: h.Token, maps: map[uint64]mapping{}, held: map[uint64]Lease{}}
	if !attach.IsZero() {
		c.tok = attach
	}
	return c, nil
}

// Hello is what the daemon said at hello time.
func (c *Client) Hello() HelloReply { return c.hello }

// Token is the token of the session this client acts on; hand it to
// another process of the same uid to share the session (Attach).
func (c *Client) Token() Token { return c.tok }

// Read reads ranges of f (a file opened on the mount) into slabs of device
// and returns one lease per range. More than MaxRanges ranges are sent in
// several requests; if one fails, the leases of the earlier ones are
// released and the error returned.
func (c *Client) Read(ctx context.Context, f *os.File, device int32, ranges []Range) ([]Lease, error) {
	return c.ReadVersion(ctx, f, device, 0, ranges)
}

// ReadVersion is Read of f at version (IndexVersion's, with
// CapReadVersion; 0: any): when the file is not at that version before and
// after its bytes are read, the error is syscall.ESTALE and no lease of
// the call remains.
func (c *Client) ReadVersion(ctx context.Context, f *os.File, device int32, version uint64, ranges []Range) ([]Lease, error) {
	var out []Lease
	buf := c.readBuf()
	defer c.putReadBuf(buf)
	for len(ranges) > 0 {
		batch := ranges[:min(len(ranges), MaxRanges)]
		ranges = ranges[len(batch):]
		req := ReadRequest{Token: c.tok, Device: device, Version: version, Ranges: batch}
		req.Encode(buf)
		ls, err := c.readCall(ctx, f, CmdRead, buf)
		if err != nil {
			c.releaseQuietly(out)
			return nil, fmt.Errorf("gdsfs: READ %s: %w", f.Name(), err)
		}
		c.hold(ls)
		out = append(out, ls...)
	}
	return out, nil
}

// ReadNames reads entries of f's index (docs/protocol.md, READ_NAMES) into
// slabs of device, one lease per name.
func (c *Client) ReadNames(ctx context.Context, f *os.File, device int32, names []string) ([]Lease, error) {
	var out []Lease
	buf := c.readBuf()
	defer c.putReadBuf(buf)
	for len(names) > 0 {
		// Fill the names area as far as it goes.
		n, used := 0, 0
		for n < len(names) && n < MaxRanges && used+len(names[n])+1 <= NamesBytes {
			used += len(names[n]) + 1
			n++
		}
		if n == 0 {
			c.releaseQuietly(out)
			return nil, fmt.Errorf("gdsfs: READ_NAMES %s: name of %d bytes does not fit the %d-byte names area: %w", f.Name(), len(names[0]), NamesBytes, syscall.E2BIG)
		}
		req := ReadNamesRequest{Token: c.tok, Device: device, Names: names[:n]}
		names = names[n:]
		if err := req.Encode(buf); err != nil {
			c.releaseQuietly(out)
			return nil, fmt.Errorf("gdsfs: READ_NAMES %s: %w", f.Name(), err)
		}
		ls, err := c.readCall(ctx, f, CmdReadNames, buf)
		if err != nil {
			c.releaseQuietly(out)
			return nil, fmt.Errorf("gdsfs: READ_NAMES %s: %w", f.Name(), err)
		}
		c.hold(ls)
		out = append(out, ls...)
	}
	return out, nil
}

func (c *Client) readCall(ctx context.Context, f *os.File, cmd uint32, buf []byte) ([]Lease, error) {
	if err := c.t.File(ctx, f, cmd, buf); err != nil {
		return nil, err
	}
	r, err := DecodeReadReply(buf)
	if err != nil {
		return nil, err
	}
	return r.Leases, nil
}

// hold records ls as held by this client.
func (c *Client) hold(ls []Lease) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	for _, l := range ls {
		if l.ID != 0 {
			c.held[l.ID] = l
		}
	}
}

// Adopt records leases that another process read or allocated into this
// client's session (a worker handed the session's token, see Attach), so
// that Bytes serves them. The caller vouches that they are the session's
// and still held: the daemon is not asked. Leases of another session stay
// unusable (the daemon refuses their RELEASE and WRITE).
func (c *Client) Adopt(ls ...Lease) {
	c.hold(ls)
}

func (c *Client) releaseQuietly(ls []Lease) {
	ids := make([]uint64, 0, len(ls))
	for _, l := range ls {
		if l.ID != 0 {
			ids = append(ids, l.ID)
		}
	}
	_ = c.Release(context.Background(), ids...)
}

// Alloc leases n bytes of device memory to fill and WRITE from.
func (c *Client) Alloc(ctx context.Context, device int32, n int64) (Lease, error) {
	if n <= 0 {
		return Lease{}, fmt.Errorf("gdsfs: ALLOC of %d bytes: %w", n, syscall.EINVAL)
	}
	buf := make([]byte, SizeAlloc)
	req := AllocRequest{Token: c.ctlToken(), Device: device, Length: uint64(n)}
	req.Encode(buf)
	if err := c.t.Control(ctx, CmdAlloc, buf); err != nil {
		return Lease{}, fmt.Errorf("gdsfs: ALLOC %d bytes on device %d: %w", n, device, err)
	}
	l, err := DecodeAllocReply(buf)
	if err != nil {
		return Lease{}, err
	}
	c.hold([]Lease{l})
	return l, nil
}

// Write writes n bytes of lease l, starting leaseOff bytes after its first
// byte, to f at fileOff; with sync the daemon fdatasyncs f first.
func (c *Client) Write(ctx context.Context, f *os.File, l Lease, leaseOff, fileOff, n int64, sync bool) error {
	if leaseOff < 0 || fileOff < 0 || n <= 0 {
		return fmt.Errorf("gdsfs: WRITE %s: offsets must be >= 0 and length > 0: %w", f.Name(), syscall.EINVAL)
	}
	buf := make([]byte, SizeWrite)
	req := WriteRequest{Token: c.tok, Lease: l.ID, LeaseOffset: uint64(leaseOff), FileOffset: uint64(fileOff), Length: uint64(n)}
	if sync {
		req.Flags = WriteSync
	}
	req.Encode(buf)
	if err := c.t.File(ctx, f, CmdWrite, buf); err != nil {
		return fmt.Errorf("gdsfs: WRITE %s: %w", f.Name(), err)
	}
	r, err := DecodeWriteReply(buf)
	if err != nil {
		return fmt.Errorf("gdsfs: WRITE %s reply: %w", f.Name(), err)
	}
	if r.Written != uint64(n) {
		return fmt.Errorf("gdsfs: WRITE %s: daemon wrote %d of %d bytes: %w", f.Name(), r.Written, n, syscall.EIO)
	}
	return nil
}

// Release gives leases back. It returns an error naming the ids the session
// did not hold (all the others are released). From the call on, Bytes
// refuses every id named, whatever the daemon answers.
func (c *Client) Release(ctx context.Context, ids ...uint64) error {
	c.mu.Lock()
	for _, id := range ids {
		delete(c.held, id)
	}
	c.mu.Unlock()
	buf := make([]byte, SizeRelease)
	var errs []error
	for len(ids) > 0 {
		batch := ids[:min(len(ids), MaxReleaseIDs)]
		ids = ids[len(batch):]
		req := ReleaseRequest{Token: c.ctlToken(), IDs: batch}
		req.Encode(buf)
		if err := c.t.Control(ctx, CmdRelease, buf); err != nil {
			return fmt.Errorf("gdsfs: RELEASE: %w", err)
		}
		r, err := DecodeReleaseReply(buf, len(batch))
		if err != nil {
			return fmt.Errorf("gdsfs: RELEASE reply: %w", err)
		}
		for i, e := range r.Status {
			if e != 0 {
				errs = append(errs, fmt.Errorf("gdsfs: release lease %d: %w", batch[i], e))
			}
		}
	}
	return errors.Join(errs...)
}

// ctlToken is the token control-file commands carry: zero for this
// client's own session (the control file names it), the attached one's
// otherwise.
func (c *Client) ctlToken() Token {
	if c.tok == c.hello.Token {
		return Token{}
	}
	return c.tok
}

// Slab asks how to map slab id.
func (c *Client) Slab(ctx context.Context, id uint64) (SlabReply, error) {
	buf := make([]byte, SizeSlab)
	req := SlabRequest{Token: c.ctlToken(), Slab: id}
	req.Encode(buf)
	if err := c.t.Control(ctx, CmdSlab, buf); err != nil {
		return SlabReply{}, fmt.Errorf("gdsfs: SLAB %d: %w", id, err)
	}
	return DecodeSlabReply(buf)
}

// SlabFD fetches a descriptor of slab id's memory from the daemon's slab
// socket (CapSlabFD): for CUDA slabs of kind SlabCUDAFD the shareable
// handle to import, for host slabs the slab file. The socket gives it only
// to a process of the session's uid whose session holds a lease in the
// slab; a refusal is the daemon's errno (errors.Is). The caller closes the
// file; a mapping made from it stays valid after it is closed.
func (c *Client) SlabFD(ctx context.Context, id uint64) (*os.File, handoff.Reply, error) {
	if c.hello.Caps&CapSlabFD == 0 || c.hello.SlabSocket == "" {
		return nil, handoff.Reply{}, fmt.Errorf("gdsfs: slab %d: the daemon serves no slab socket (HELLO caps %#x): upgrade the daemon: %w", id, c.hello.Caps, syscall.EOPNOTSUPP)
	}
	tok := c.tok
	return handoff.Fetch(ctx, c.hello.SlabSocket, int(c.hello.DaemonPID), handoff.Request{Session: tok.Session, Secret: tok.Secret, Slab: id})
}

// mapSlab returns the bytes of host slab id, mapping it on first use. The
// mapping stays valid until Close. Unexported: a slab holds the bytes of
// other leases too; callers reach lease bytes only through Bytes.
func (c *Client) mapSlab(ctx context.Context, id uint64) ([]byte, error) {
	c.mu.Lock()
	m, ok := c.maps[id]
	c.mu.Unlock()
	if ok {
		return m.slab, nil
	}
	r, err := c.Slab(ctx, id)
	if err != nil {
		return nil, err
	}
	if r.Kind != SlabHost {
		return nil, fmt.Errorf("gdsfs: slab %d is CUDA memory on device %d: open its IPC handle with CUDA, it cannot be mapped on the host", id, r.Device)
	}
	whole := r.MapOffset + r.Size
	if r.Size == 0 || whole < r.Size || whole > 1<<46 {
		return nil, fmt.Errorf("gdsfs: slab %d: implausible size %d at offset %d: %w", id, r.Size, r.MapOffset, syscall.EBADMSG)
	}
	f, err := os.OpenFile(string(r.Handle), os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("gdsfs: open slab %d: %w", id, err)
	}
	defer f.Close()
	b, err := unix.Mmap(int(f.Fd()), 0, int(whole), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("gdsfs: map slab %d (%s): %w", id, r.Handle, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if prev, ok := c.maps[id]; ok {
		// Another goroutine mapped it meanwhile: keep one mapping.
		_ = unix.Munmap(b)
		return prev.slab, nil
	}
	m = mapping{whole: b, slab: b[r.MapOffset:whole:whole]}
	c.maps[id] = m
	return m.slab, nil
}

// Bytes returns the valid bytes of host lease l (mapping its slab on first
// use). They alias the slab: valid until l is released or the client
// closes, after which the daemon may reuse the memory for other reads. A
// lease this client does not hold (never read or allocated by it nor
// adopted, released, or the client closed), or a Lease value that differs
// from the one the daemon handed out, is refused with ErrLeaseNotHeld.
func (c *Client) Bytes(ctx context.Context, l Lease) ([]byte, error) {
	if l.Valid == 0 && l.ID == 0 {
		return nil, nil
	}
	c.mu.Lock()
	h, ok := c.held[l.ID]
	closed := c.closed
	c.mu.Unlock()
	switch {
	case closed:
		return nil, fmt.Errorf("gdsfs: lease %d: the client is closed: %w", l.ID, ErrLeaseNotHeld)
	case !ok:
		return nil, fmt.Errorf("gdsfs: lease %d: never read or allocated by this client, or released (Adopt leases read by another process): %w", l.ID, ErrLeaseNotHeld)
	case h != l:
		return nil, fmt.Errorf("gdsfs: lease %d: %+v is not the lease the daemon handed out (%+v): %w", l.ID, l, h, ErrLeaseNotHeld)
	}
	if l.Valid == 0 {
		return nil, nil
	}
	m, err := c.mapSlab(ctx, l.Slab)
	if err != nil {
		return nil, err
	}
	if l.Offset > uint64(len(m)) || l.Valid > uint64(len(m))-l.Offset {
		return nil, fmt.Errorf("gdsfs: lease %d (%d bytes at %d) lies outside slab %d (%d bytes): %w", l.ID, l.Valid, l.Offset, l.Slab, len(m), syscall.EBADMSG)
	}
	return m[l.Offset : l.Offset+l.Valid : l.Offset+l.Valid], nil
}

// Status returns the daemon's STATUS document (JSON).
func (c *Client) Status(ctx context.Context) ([]byte, error) {
	doc, err := c.pages(ctx, func(buf []byte) error { return c.t.Control(ctx, CmdStatus, buf) })
	if err != nil {
		return nil, fmt.Errorf("gdsfs: STATUS: %w", err)
	}
	return doc, nil
}

// Index returns f's shard index (JSON), however large.
func (c *Client) Index(ctx context.Context, f *os.File) ([]byte, error) {
	doc, _, err := c.IndexVersion(ctx, f)
	return doc, err
}

// IndexVersion returns f's shard index and the version of the file it was
// parsed from (0 from a daemon without CapReadVersion), for ReadVersion.
func (c *Client) IndexVersion(ctx context.Context, f *os.File) ([]byte, uint64, error) {
	doc, version, err := c.pagesVersion(ctx, func(buf []byte) error { return c.t.File(ctx, f, CmdIndex, buf) })
	if err != nil {
		return nil, 0, fmt.Errorf("gdsfs: INDEX %s: %w", f.Name(), err)
	}
	return doc, version, nil
}

// IndexColumns is IndexVersion asking for the columns form
// (IndexFlagColumns; the daemon must have CapIndexColumns): a tar's index
// comes as IndexFormTarColumns (cache.DecodeTarColumns decodes it), any
// other file's as IndexFormJSON.
func (c *Client) IndexColumns(ctx context.Context, f *os.File) (doc []byte, form uint32, version uint64, err error) {
	doc, version, form, err = c.pagesForm(ctx, IndexFlagColumns, func(buf []byte) error { return c.t.File(ctx, f, CmdIndex, buf) })
	if err != nil {
		return nil, 0, 0, fmt.Errorf("gdsfs: INDEX %s: %w", f.Name(), err)
	}
	return doc, form, version, nil
}

// pages reads a paged document, starting again when it changes meanwhile.
func (c *Client) pages(ctx context.Context, call func([]byte) error) ([]byte, error) {
	doc, _, err := c.pagesVersion(ctx, call)
	return doc, err
}

// pagesVersion is pages with the first page's Version; a page of another
// generation or version starts the document again.
func (c *Client) pagesVersion(ctx context.Context, call func([]byte) error) ([]byte, uint64, error) {
	doc, version, _, err := c.pagesForm(ctx, 0, call)
	return doc, version, err
}

// pagesForm is pagesVersion with request flags (INDEX's IndexFlagColumns)
// and the first page's Form; a page of another form starts again too.
func (c *Client) pagesForm(_ context.Context, flags uint32, call func([]byte) error) ([]byte, uint64, uint32, error) {
	buf := make([]byte, SizePage)
	for attempt := 0; attempt < 5; attempt++ {
		var doc []byte
		var gen, version uint64
		var form uint32
		for {
			(&PageRequest{Offset: uint64(len(doc)), Flags: flags}).Encode(buf)
			if err := call(buf); err != nil {
				return nil, 0, 0, err
			}
			p, err := DecodePageReply(buf)
			if err != nil {
				return nil, 0, 0, err
			}
			if len(doc) == 0 {
				gen, version, form = p.Generation, p.Version, p.Form
				if p.Total > 1<<32 {
					return nil, 0, 0, fmt.Errorf("document of %d bytes: %w", p.Total, syscall.EBADMSG)
				}
				doc = make([]byte, 0, p.Total)
			} else if p.Generation != gen || p.Version != version || p.Form != form {
				break
			}
			if len(p.Data) == 0 && uint64(len(doc)) < p.Total {
				return nil, 0, 0, fmt.Errorf("empty page at %d of %d: %w", len(doc), p.Total, syscall.EBADMSG)
			}
			doc = append(doc, p.Data...)
			if uint64(len(doc)) >= p.Total {
				return doc[:p.Total], version, form, nil
			}
		}
	}
	return nil, 0, 0, fmt.Errorf("document kept changing while it was read: %w", syscall.EAGAIN)
}

// Close unmaps every slab and closes the control file, which ends the
// session unless another process still holds the descriptor. Close is
// idempotent.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	maps := c.maps
	c.maps = map[uint64]mapping{}
	c.held = map[uint64]Lease{}
	c.mu.Unlock()
	var errs []error
	for id, m := range maps {
		if err := unix.Munmap(m.whole); err != nil {
			errs = append(errs, fmt.Errorf("gdsfs: unmap slab %d: %w", id, err))
		}
	}
	if err := c.t.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// kernel is the production transport: ioctl(2) on descriptors.
type kernel struct {
	ctl *os.File
}

func (k kernel) Control(ctx context.Context, cmd uint32, buf []byte) error {
	return ioctl(ctx, k.ctl, cmd, buf)
}

func (k kernel) File(ctx context.Context, f *os.File, cmd uint32, buf []byte) error {
	return ioctl(ctx, f, cmd, buf)
}

func (k kernel) Close() error { return k.ctl.Close() }

// ioctl issues cmd on f with buf as its argument (len(buf) must be the size
// encoded in cmd). EINTR is retried: the daemon undoes an interrupted
// request, so repeating it is safe (but costly: see ioctlQuiet).
func ioctl(ctx context.Context, f *os.File, cmd uint32, buf []byte) error {
	if len(buf) != CmdSize(cmd) {
		return fmt.Errorf("BUG: ctl: %d-byte buffer for a %d-byte command", len(buf), CmdSize(cmd))
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		var errno syscall.Errno
		if err := rc.Control(func(fd uintptr) {
			errno = ioctlQuiet(fd, cmd, buf)
		}); err != nil {
			return err
		}
		if errno == syscall.EINTR {
			continue
		}
		if errno != 0 {
			return errno
		}
		return nil
	}
}

// ioctlQuiet issues the ioctl with the Go runtime's preemption signal
// (SIGURG) blocked on the calling thread. A signal that reaches a thread
// waiting in a FUSE request makes the kernel send the daemon an INTERRUPT,
// and the daemon abandons the request (EINTR) so that a client can be
// stopped; the runtime sends SIGURG to threads it wants to preempt, often
// just as they enter the ioctl, and every such READ was thrown away and
// redone (measured: 4 of 384 8 MiB READs with 16 in flight; none with the
// signal blocked). Other signals still interrupt. A SIGURG sent meanwhile
// is delivered when the mask is restored.
func ioctlQuiet(fd uintptr, cmd uint32, buf []byte) syscall.Errno {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var block, old unix.Sigset_t
	sig := uint(unix.SIGURG) - 1
	block.Val[sig/64] |= 1 << (sig % 64)
	masked := unix.PthreadSigmask(unix.SIG_BLOCK, &block, &old) == nil
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, uintptr(cmd), uintptr(unsafe.Pointer(&buf[0])))
	if masked {
		_ = unix.PthreadSigmask(unix.SIG_SETMASK, &old, nil)
	}
	return errno
}
