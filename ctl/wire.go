package ctl

import (
	"encoding/binary"
	"math"
	"syscall"
)

// Wire constants of protocol version 1 (docs/protocol.md is normative).
const (
	// Magic starts every request and reply: the bytes "GDFS".
	Magic uint32 = 0x53464447
	// Version is the protocol version this package speaks.
	Version uint16 = 1

	// MaxRanges is the most ranges (or names) one READ / READ_NAMES carries.
	MaxRanges = 256
	// MaxReleaseIDs is the most lease ids one RELEASE carries.
	MaxReleaseIDs = 256
	// NamesBytes is the size of the READ_NAMES names area.
	NamesBytes = 12288
	// PageBytes is the data capacity of one STATUS/INDEX page.
	PageBytes = SizePage - 64
	// HandleBytes is the size of the SLAB handle area.
	HandleBytes = 512
	// AlignBytes is the alignment reads are widened to.
	AlignBytes = 4096
	// HostDevice is the device number of shared host memory.
	HostDevice int32 = -1

	headerBytes = 32
	leaseBytes  = 48
	rangeBytes  = 16
	ioctlType   = 'G'
)

// Request/reply buffer sizes, one per command (the size encoded in the
// command number).
const (
	SizeHello   = 256
	SizeSlab    = 640
	SizeAlloc   = 128
	SizeRelease = 64 + 8*MaxReleaseIDs
	SizePage    = 16320
	SizeRead    = 64 + leaseBytes*MaxRanges
	SizeWrite   = 128
)

// Command numbers: Linux's _IOWR('G', nr, size). Control-file commands are
// issued on <mount>/.gdsfs, data-file commands on a regular file of the mount.
const (
	CmdHello     uint32 = 3<<30 | SizeHello<<16 | ioctlType<<8 | 0x01
	CmdSlab      uint32 = 3<<30 | SizeSlab<<16 | ioctlType<<8 | 0x02
	CmdAlloc     uint32 = 3<<30 | SizeAlloc<<16 | ioctlType<<8 | 0x03
	CmdRelease   uint32 = 3<<30 | SizeRelease<<16 | ioctlType<<8 | 0x04
	CmdStatus    uint32 = 3<<30 | SizePage<<16 | ioctlType<<8 | 0x05
	CmdRead      uint32 = 3<<30 | SizeRead<<16 | ioctlType<<8 | 0x10
	CmdReadNames uint32 = 3<<30 | SizeRead<<16 | ioctlType<<8 | 0x11
	CmdWrite     uint32 = 3<<30 | SizeWrite<<16 | ioctlType<<8 | 0x12
	CmdIndex     uint32 = 3<<30 | SizePage<<16 | ioctlType<<8 | 0x13
)

// Command describes one command of the protocol.
type Command struct {
	Cmd  uint32 // the ioctl number
	Name string // as docs/protocol.md spells it ("READ_NAMES")
	Size int    // the request's and the reply's size (CmdSize(Cmd))
	File bool   // issued on a data file; else on <mount>/.gdsfs
}

// Commands returns every command of the protocol, in docs/protocol.md's
// order: the one table names, sizes and metric labels come from.
func Commands() []Command {
	return []Command{
		{CmdHello, "HELLO", SizeHello, false},
		{CmdSlab, "SLAB", SizeSlab, false},
		{CmdAlloc, "ALLOC", SizeAlloc, false},
		{CmdRelease, "RELEASE", SizeRelease, false},
		{CmdStatus, "STATUS", SizePage, false},
		{CmdRead, "READ", SizeRead, true},
		{CmdReadNames, "READ_NAMES", SizeRead, true},
		{CmdWrite, "WRITE", SizeWrite, true},
		{CmdIndex, "INDEX", SizePage, true},
	}
}

// CommandName returns cmd's name as docs/protocol.md spells it, or "" for
// a number that is not a command of the protocol.
func CommandName(cmd uint32) string {
	for _, c := range Commands() {
		if c.Cmd == cmd {
			return c.Name
		}
	}
	return ""
}

// OurCmd reports whether cmd is of gdsfs's ioctl type ('G'). Other types
// (a tty's TCGETS, which Python's open() issues to ask isatty) are answered
// ENOTTY without being counted as control-path refusals.
func OurCmd(cmd uint32) bool { return (cmd>>8)&0xff == ioctlType }

// CmdSize returns the buffer size encoded in an ioctl command number.
func CmdSize(cmd uint32) int { return int(cmd>>16) & 0x3fff }

// Capability bits of HelloReply.Caps.
const (
	CapHostSlabs uint64 = 1 << iota
	CapCUDASlabs
	CapReadNames
	CapIndex
	CapWrite
	// CapSlabFD: slab memory is handed out as file descriptors on the
	// slab socket named in HelloReply.SlabSocket (docs/protocol.md,
	// "Slab descriptors"). CUDA slabs of kind SlabCUDAFD can only be
	// mapped this way.
	CapSlabFD
)

// Slab kinds of SlabReply.Kind.
const (
	SlabHost uint32 = 1 // Handle is the path of a shared-memory file
	SlabCUDA uint32 = 2 // Handle is a 64-byte legacy CUDA IPC memory handle (a bearer capability)
	// SlabCUDAFD is CUDA virtual-memory-management memory: Handle is
	// empty; the client fetches a POSIX file descriptor of the allocation
	// from the slab socket (CapSlabFD) and imports it
	// (cuMemImportFromShareableHandle).
	SlabCUDAFD uint32 = 3
)

// SlabSocketBytes is the room for HelloReply.SlabSocket (NUL-padded).
const SlabSocketBytes = 88

// WriteSync asks WRITE to fdatasync the file before replying.
const WriteSync uint32 = 1

// EngineCode names the engine that moved a lease's bytes.
type EngineCode uint32

// Engine codes (docs/protocol.md section 5).
const (
	EngineNone EngineCode = iota
	EngineHost
	EnginePosix
	EngineGDS
	EngineGDSCompat
)

var engineNames = [...]string{"none", "host", "posix", "gds", "gds-compat"}

// String returns the engine's name as the protocol spells it.
func (e EngineCode) String() string {
	if int(e) < len(engineNames) {
		return engineNames[e]
	}
	return "unknown"
}

// EngineCodeOf maps an engine name to its code (EngineNone if unknown).
func EngineCodeOf(name string) EngineCode {
	for i, n := range engineNames {
		if n == name {
			return EngineCode(i)
		}
	}
	return EngineNone
}

// Token names a session: its id and the secret HELLO returned.
type Token struct {
	Session, Secret uint64
}

// IsZero reports whether t names no session.
func (t Token) IsZero() bool { return t == Token{} }

// Lease is a lease descriptor as it travels in READ and ALLOC replies.
type Lease struct {
	ID     uint64     // lease id; 0 when no memory was needed (Valid == 0)
	Slab   uint64     // slab id
	Offset uint64     // offset in the slab of the first requested byte
	Length uint64     // requested length
	Valid  uint64     // bytes of data at Offset (< Length only at end of file)
	Engine EngineCode // engine that moved the bytes
}

// Range is one (offset, length) pair of a READ request.
type Range struct {
	Offset, Length uint64
}

// HelloReply is the HELLO reply.
type HelloReply struct {
	Version       uint32
	UID           uint32
	Caps          uint64
	Token         Token
	MaxRanges     uint32
	MaxNamesBytes uint32
	Align         uint32
	Devices       uint32
	MaxLease      uint64
	Page          uint64
	DaemonPID     uint32
	Engine        string // at most 31 bytes
	DaemonVersion string // at most 31 bytes
	// SlabSocket is the address of the slab socket ("@name": abstract
	// namespace; else a path), set with CapSlabFD; at most
	// SlabSocketBytes-1 bytes.
	SlabSocket string
}

// SlabRequest asks how to map a slab.
type SlabRequest struct {
	Token Token
	Slab  uint64
}

// SlabReply says how to map a slab.
type SlabReply struct {
	Slab      uint64
	Size      uint64
	MapOffset uint64
	Kind      uint32
	Device    int32
	Handle    []byte // at most HandleBytes
}

// AllocRequest asks for a lease to write from.
type AllocRequest struct {
	Token  Token
	Device int32
	Length uint64
}

// ReleaseRequest gives leases back.
type ReleaseRequest struct {
	Token Token
	IDs   []uint64 // 1..MaxReleaseIDs
}

// ReleaseReply reports what RELEASE did, per requested id.
type ReleaseReply struct {
	Released uint32
	Status   []syscall.Errno // one per requested id; 0 if released
}

// PageRequest asks for one page of a STATUS or INDEX document.
type PageRequest struct {
	Token  Token
	Offset uint64
}

// PageReply is one page of a JSON document.
type PageReply struct {
	Total      uint64
	Generation uint64
	Data       []byte // at most PageBytes
}

// ReadRequest asks for file ranges in slabs.
type ReadRequest struct {
	Token  Token
	Device int32
	Ranges []Range // 1..MaxRanges
}

// ReadNamesRequest asks for index entries in slabs.
type ReadNamesRequest struct {
	Token  Token
	Device int32
	Names  []string // 1..MaxRanges, non-empty, without NUL
}

// ReadReply is the reply of READ and READ_NAMES.
type ReadReply struct {
	Leases []Lease
}

// WriteRequest writes lease bytes into the file.
type WriteRequest struct {
	Token       Token
	Lease       uint64
	LeaseOffset uint64
	FileOffset  uint64
	Length      uint64
	Flags       uint32
}

// WriteReply reports a WRITE.
type WriteReply struct {
	Written uint64
	Engine  EngineCode
}

var le = binary.LittleEndian

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// checkBuf fails with EINVAL unless b has exactly the command's size.
func checkBuf(b []byte, size int) error {
	if len(b) != size {
		return syscall.EINVAL
	}
	return nil
}

// PutHeader writes a request header with token t.
func PutHeader(b []byte, t Token) {
	le.PutUint32(b[0:], Magic)
	le.PutUint16(b[4:], Version)
	le.PutUint16(b[6:], 0)
	le.PutUint64(b[8:], t.Session)
	le.PutUint64(b[16:], t.Secret)
	le.PutUint64(b[24:], 0)
}

// putReplyHeader clears b and writes a reply header.
func putReplyHeader(b []byte) {
	clear(b)
	le.PutUint32(b[0:], Magic)
	le.PutUint16(b[4:], Version)
}

// decodeHeader checks a request header and returns its token.
func decodeHeader(b []byte) (Token, error) {
	if len(b) < headerBytes || le.Uint32(b[0:]) != Magic {
		return Token{}, syscall.EINVAL
	}
	if le.Uint16(b[4:]) != Version {
		return Token{}, syscall.EPROTO
	}
	if le.Uint16(b[6:]) != 0 || !allZero(b[24:32]) {
		return Token{}, syscall.EINVAL
	}
	return Token{Session: le.Uint64(b[8:]), Secret: le.Uint64(b[16:])}, nil
}

// checkReplyHeader checks the header of a reply.
func checkReplyHeader(b []byte, size int) error {
	if len(b) != size || le.Uint32(b[0:]) != Magic {
		return syscall.EBADMSG
	}
	if le.Uint16(b[4:]) != Version {
		return syscall.EPROTO
	}
	return nil
}

// putString writes s NUL-padded into b (truncated to len(b)-1 bytes).
func putString(b []byte, s string) {
	clear(b)
	if len(s) > len(b)-1 {
		s = s[:len(b)-1]
	}
	copy(b, s)
}

// getString reads a NUL-padded string.
func getString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// EncodeHello writes a HELLO request into b (SizeHello bytes).
func EncodeHello(b []byte) {
	clear(b)
	PutHeader(b, Token{})
}

// DecodeHello checks a HELLO request.
func DecodeHello(b []byte) error {
	if err := checkBuf(b, SizeHello); err != nil {
		return err
	}
	_, err := decodeHeader(b)
	if err != nil {
		return err
	}
	if !allZero(b[headerBytes:]) {
		return syscall.EINVAL
	}
	return nil
}

// Encode writes the HELLO reply into b (SizeHello bytes).
func (r *HelloReply) Encode(b []byte) {
	putReplyHeader(b)
	le.PutUint32(b[32:], r.Version)
	le.PutUint32(b[36:], r.UID)
	le.PutUint64(b[40:], r.Caps)
	le.PutUint64(b[48:], r.Token.Session)
	le.PutUint64(b[56:], r.Token.Secret)
	le.PutUint32(b[64:], r.MaxRanges)
	le.PutUint32(b[68:], r.MaxNamesBytes)
	le.PutUint32(b[72:], r.Align)
	le.PutUint32(b[76:], r.Devices)
	le.PutUint64(b[80:], r.MaxLease)
	le.PutUint64(b[88:], r.Page)
	le.PutUint32(b[96:], r.DaemonPID)
	putString(b[104:136], r.Engine)
	putString(b[136:168], r.DaemonVersion)
	putString(b[168:168+SlabSocketBytes], r.SlabSocket)
}

// DecodeHelloReply decodes a HELLO reply.
func DecodeHelloReply(b []byte) (HelloReply, error) {
	if err := checkReplyHeader(b, SizeHello); err != nil {
		return HelloReply{}, err
	}
	return HelloReply{
		Version:       le.Uint32(b[32:]),
		UID:           le.Uint32(b[36:]),
		Caps:          le.Uint64(b[40:]),
		Token:         Token{Session: le.Uint64(b[48:]), Secret: le.Uint64(b[56:])},
		MaxRanges:     le.Uint32(b[64:]),
		MaxNamesBytes: le.Uint32(b[68:]),
		Align:         le.Uint32(b[72:]),
		Devices:       le.Uint32(b[76:]),
		MaxLease:      le.Uint64(b[80:]),
		Page:          le.Uint64(b[88:]),
		DaemonPID:     le.Uint32(b[96:]),
		Engine:        getString(b[104:136]),
		DaemonVersion: getString(b[136:168]),
		SlabSocket:    getString(b[168 : 168+SlabSocketBytes]),
	}, nil
}

// Encode writes the SLAB request into b (SizeSlab bytes).
func (r *SlabRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	le.PutUint64(b[32:], r.Slab)
}

// DecodeSlabRequest decodes a SLAB request.
func DecodeSlabRequest(b []byte) (SlabRequest, error) {
	if err := checkBuf(b, SizeSlab); err != nil {
		return SlabRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return SlabRequest{}, err
	}
	if !allZero(b[40:]) {
		return SlabRequest{}, syscall.EINVAL
	}
	return SlabRequest{Token: t, Slab: le.Uint64(b[32:])}, nil
}

// Encode writes the SLAB reply into b (SizeSlab bytes). The handle is
// truncated to HandleBytes; the server checks its length first.
func (r *SlabReply) Encode(b []byte) {
	putReplyHeader(b)
	h := r.Handle
	if len(h) > HandleBytes {
		h = h[:HandleBytes]
	}
	le.PutUint64(b[32:], r.Slab)
	le.PutUint64(b[40:], r.Size)
	le.PutUint64(b[48:], r.MapOffset)
	le.PutUint32(b[56:], r.Kind)
	le.PutUint32(b[60:], uint32(r.Device))
	le.PutUint32(b[64:], uint32(len(h)))
	copy(b[128:], h)
}

// DecodeSlabReply decodes a SLAB reply.
func DecodeSlabReply(b []byte) (SlabReply, error) {
	if err := checkReplyHeader(b, SizeSlab); err != nil {
		return SlabReply{}, err
	}
	n := le.Uint32(b[64:])
	if n > HandleBytes {
		return SlabReply{}, syscall.EBADMSG
	}
	return SlabReply{
		Slab:      le.Uint64(b[32:]),
		Size:      le.Uint64(b[40:]),
		MapOffset: le.Uint64(b[48:]),
		Kind:      le.Uint32(b[56:]),
		Device:    int32(le.Uint32(b[60:])),
		Handle:    append([]byte(nil), b[128:128+n]...),
	}, nil
}

// Encode writes the ALLOC request into b (SizeAlloc bytes).
func (r *AllocRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	le.PutUint32(b[32:], uint32(r.Device))
	le.PutUint64(b[40:], r.Length)
}

// DecodeAllocRequest decodes an ALLOC request.
func DecodeAllocRequest(b []byte) (AllocRequest, error) {
	if err := checkBuf(b, SizeAlloc); err != nil {
		return AllocRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return AllocRequest{}, err
	}
	if !allZero(b[36:40]) || !allZero(b[48:]) {
		return AllocRequest{}, syscall.EINVAL
	}
	return AllocRequest{Token: t, Device: int32(le.Uint32(b[32:])), Length: le.Uint64(b[40:])}, nil
}

// putLease writes a lease descriptor at b[0:48].
func putLease(b []byte, l Lease) {
	le.PutUint64(b[0:], l.ID)
	le.PutUint64(b[8:], l.Slab)
	le.PutUint64(b[16:], l.Offset)
	le.PutUint64(b[24:], l.Length)
	le.PutUint64(b[32:], l.Valid)
	le.PutUint32(b[40:], uint32(l.Engine))
	le.PutUint32(b[44:], 0)
}

// getLease reads a lease descriptor at b[0:48].
func getLease(b []byte) Lease {
	return Lease{
		ID:     le.Uint64(b[0:]),
		Slab:   le.Uint64(b[8:]),
		Offset: le.Uint64(b[16:]),
		Length: le.Uint64(b[24:]),
		Valid:  le.Uint64(b[32:]),
		Engine: EngineCode(le.Uint32(b[40:])),
	}
}

// EncodeAllocReply writes the ALLOC reply into b (SizeAlloc bytes).
func EncodeAllocReply(b []byte, l Lease) {
	putReplyHeader(b)
	putLease(b[32:], l)
}

// DecodeAllocReply decodes an ALLOC reply.
func DecodeAllocReply(b []byte) (Lease, error) {
	if err := checkReplyHeader(b, SizeAlloc); err != nil {
		return Lease{}, err
	}
	return getLease(b[32:]), nil
}

// Encode writes the RELEASE request into b (SizeRelease bytes). At most
// MaxReleaseIDs ids are encoded; the caller splits longer lists.
func (r *ReleaseRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	ids := r.IDs
	if len(ids) > MaxReleaseIDs {
		ids = ids[:MaxReleaseIDs]
	}
	le.PutUint32(b[32:], uint32(len(ids)))
	for i, id := range ids {
		le.PutUint64(b[64+8*i:], id)
	}
}

// DecodeReleaseRequest decodes a RELEASE request.
func DecodeReleaseRequest(b []byte) (ReleaseRequest, error) {
	if err := checkBuf(b, SizeRelease); err != nil {
		return ReleaseRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return ReleaseRequest{}, err
	}
	if !allZero(b[36:64]) {
		return ReleaseRequest{}, syscall.EINVAL
	}
	n := le.Uint32(b[32:])
	switch {
	case n == 0:
		return ReleaseRequest{}, syscall.EINVAL
	case n > MaxReleaseIDs:
		return ReleaseRequest{}, syscall.E2BIG
	}
	ids := make([]uint64, n)
	for i := range ids {
		ids[i] = le.Uint64(b[64+8*i:])
	}
	return ReleaseRequest{Token: t, IDs: ids}, nil
}

// Encode writes the RELEASE reply into b (SizeRelease bytes).
func (r *ReleaseReply) Encode(b []byte) {
	putReplyHeader(b)
	le.PutUint32(b[32:], r.Released)
	for i, e := range r.Status {
		if i == MaxReleaseIDs {
			break
		}
		le.PutUint32(b[64+4*i:], uint32(e))
	}
}

// DecodeReleaseReply decodes a RELEASE reply for a request of n ids.
func DecodeReleaseReply(b []byte, n int) (ReleaseReply, error) {
	if err := checkReplyHeader(b, SizeRelease); err != nil {
		return ReleaseReply{}, err
	}
	if n < 0 || n > MaxReleaseIDs {
		return ReleaseReply{}, syscall.EINVAL
	}
	r := ReleaseReply{Released: le.Uint32(b[32:]), Status: make([]syscall.Errno, n)}
	for i := range r.Status {
		r.Status[i] = syscall.Errno(le.Uint32(b[64+4*i:]))
	}
	return r, nil
}

// Encode writes the STATUS/INDEX request into b (SizePage bytes).
func (r *PageRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	le.PutUint64(b[32:], r.Offset)
}

// DecodePageRequest decodes a STATUS or INDEX request.
func DecodePageRequest(b []byte) (PageRequest, error) {
	if err := checkBuf(b, SizePage); err != nil {
		return PageRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return PageRequest{}, err
	}
	if !allZero(b[40:]) {
		return PageRequest{}, syscall.EINVAL
	}
	return PageRequest{Token: t, Offset: le.Uint64(b[32:])}, nil
}

// EncodePage writes the page of doc at offset into b (SizePage bytes). It
// fails with EINVAL when offset is past the end of doc.
func EncodePage(b []byte, doc []byte, offset uint64) error {
	if offset > uint64(len(doc)) {
		return syscall.EINVAL
	}
	putReplyHeader(b)
	chunk := doc[offset:]
	if len(chunk) > PageBytes {
		chunk = chunk[:PageBytes]
	}
	le.PutUint64(b[32:], uint64(len(doc)))
	le.PutUint64(b[40:], fnv64a(doc))
	le.PutUint32(b[48:], uint32(len(chunk)))
	copy(b[64:], chunk)
	return nil
}

// DecodePageReply decodes a STATUS or INDEX reply.
func DecodePageReply(b []byte) (PageReply, error) {
	if err := checkReplyHeader(b, SizePage); err != nil {
		return PageReply{}, err
	}
	n := le.Uint32(b[48:])
	if n > PageBytes {
		return PageReply{}, syscall.EBADMSG
	}
	return PageReply{
		Total:      le.Uint64(b[32:]),
		Generation: le.Uint64(b[40:]),
		Data:       append([]byte(nil), b[64:64+n]...),
	}, nil
}

// fnv64a is the FNV-1a 64-bit hash of b (the page generation).
func fnv64a(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

// Encode writes the READ request into b (SizeRead bytes). At most MaxRanges
// ranges are encoded; the caller splits longer lists.
func (r *ReadRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	rs := r.Ranges
	if len(rs) > MaxRanges {
		rs = rs[:MaxRanges]
	}
	le.PutUint32(b[32:], uint32(r.Device))
	le.PutUint32(b[40:], uint32(len(rs)))
	for i, rg := range rs {
		le.PutUint64(b[64+rangeBytes*i:], rg.Offset)
		le.PutUint64(b[64+rangeBytes*i+8:], rg.Length)
	}
}

// DecodeReadRequest decodes a READ request. It checks the counts; range
// bounds against the file are the server's to check.
func DecodeReadRequest(b []byte) (ReadRequest, error) {
	if err := checkBuf(b, SizeRead); err != nil {
		return ReadRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return ReadRequest{}, err
	}
	if le.Uint32(b[36:]) != 0 || !allZero(b[44:64]) {
		return ReadRequest{}, syscall.EINVAL
	}
	n := le.Uint32(b[40:])
	switch {
	case n == 0:
		return ReadRequest{}, syscall.EINVAL
	case n > MaxRanges:
		return ReadRequest{}, syscall.E2BIG
	}
	rs := make([]Range, n)
	for i := range rs {
		rs[i] = Range{Offset: le.Uint64(b[64+rangeBytes*i:]), Length: le.Uint64(b[64+rangeBytes*i+8:])}
	}
	return ReadRequest{Token: t, Device: int32(le.Uint32(b[32:])), Ranges: rs}, nil
}

// Encode writes the READ_NAMES request into b (SizeRead bytes). It fails
// with E2BIG when the names do not fit and EINVAL when a name is empty or
// holds a NUL byte.
func (r *ReadNamesRequest) Encode(b []byte) error {
	if len(r.Names) > MaxRanges {
		return syscall.E2BIG
	}
	clear(b)
	PutHeader(b, r.Token)
	area := b[64 : 64+NamesBytes]
	n := 0
	for _, name := range r.Names {
		if name == "" {
			return syscall.EINVAL
		}
		for i := 0; i < len(name); i++ {
			if name[i] == 0 {
				return syscall.EINVAL
			}
		}
		if n+len(name)+1 > len(area) {
			return syscall.E2BIG
		}
		n += copy(area[n:], name)
		area[n] = 0
		n++
	}
	le.PutUint32(b[32:], uint32(r.Device))
	le.PutUint32(b[40:], uint32(len(r.Names)))
	le.PutUint32(b[44:], uint32(n))
	return nil
}

// DecodeReadNamesRequest decodes a READ_NAMES request.
func DecodeReadNamesRequest(b []byte) (ReadNamesRequest, error) {
	if err := checkBuf(b, SizeRead); err != nil {
		return ReadNamesRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return ReadNamesRequest{}, err
	}
	if le.Uint32(b[36:]) != 0 || !allZero(b[48:64]) {
		return ReadNamesRequest{}, syscall.EINVAL
	}
	count := le.Uint32(b[40:])
	switch {
	case count == 0:
		return ReadNamesRequest{}, syscall.EINVAL
	case count > MaxRanges:
		return ReadNamesRequest{}, syscall.E2BIG
	}
	n := le.Uint32(b[44:])
	if n > NamesBytes {
		return ReadNamesRequest{}, syscall.EINVAL
	}
	area := b[64 : 64+n]
	names := make([]string, 0, count)
	start := 0
	for i, c := range area {
		if c != 0 {
			continue
		}
		if i == start || len(names) == int(count) {
			return ReadNamesRequest{}, syscall.EINVAL
		}
		names = append(names, string(area[start:i]))
		start = i + 1
	}
	if start != len(area) || len(names) != int(count) {
		return ReadNamesRequest{}, syscall.EINVAL
	}
	return ReadNamesRequest{Token: t, Device: int32(le.Uint32(b[32:])), Names: names}, nil
}

// Encode writes the READ / READ_NAMES reply into b (SizeRead bytes).
func (r *ReadReply) Encode(b []byte) {
	putReplyHeader(b)
	ls := r.Leases
	if len(ls) > MaxRanges {
		ls = ls[:MaxRanges]
	}
	le.PutUint32(b[32:], uint32(len(ls)))
	for i, l := range ls {
		putLease(b[64+leaseBytes*i:], l)
	}
}

// DecodeReadReply decodes a READ / READ_NAMES reply.
func DecodeReadReply(b []byte) (ReadReply, error) {
	if err := checkReplyHeader(b, SizeRead); err != nil {
		return ReadReply{}, err
	}
	n := le.Uint32(b[32:])
	if n > MaxRanges {
		return ReadReply{}, syscall.EBADMSG
	}
	ls := make([]Lease, n)
	for i := range ls {
		ls[i] = getLease(b[64+leaseBytes*i:])
	}
	return ReadReply{Leases: ls}, nil
}

// Encode writes the WRITE request into b (SizeWrite bytes).
func (r *WriteRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	le.PutUint64(b[32:], r.Lease)
	le.PutUint64(b[40:], r.LeaseOffset)
	le.PutUint64(b[48:], r.FileOffset)
	le.PutUint64(b[56:], r.Length)
	le.PutUint32(b[64:], r.Flags)
}

// DecodeWriteRequest decodes a WRITE request.
func DecodeWriteRequest(b []byte) (WriteRequest, error) {
	if err := checkBuf(b, SizeWrite); err != nil {
		return WriteRequest{}, err
	}
	t, err := decodeHeader(b)
	if err != nil {
		return WriteRequest{}, err
	}
	flags := le.Uint32(b[64:])
	if flags&^WriteSync != 0 || !allZero(b[68:]) {
		return WriteRequest{}, syscall.EINVAL
	}
	return WriteRequest{
		Token:       t,
		Lease:       le.Uint64(b[32:]),
		LeaseOffset: le.Uint64(b[40:]),
		FileOffset:  le.Uint64(b[48:]),
		Length:      le.Uint64(b[56:]),
		Flags:       flags,
	}, nil
}

// Encode writes the WRITE reply into b (SizeWrite bytes).
func (r *WriteReply) Encode(b []byte) {
	putReplyHeader(b)
	le.PutUint64(b[32:], r.Written)
	le.PutUint32(b[40:], uint32(r.Engine))
}

// DecodeWriteReply decodes a WRITE reply.
func DecodeWriteReply(b []byte) (WriteReply, error) {
	if err := checkReplyHeader(b, SizeWrite); err != nil {
		return WriteReply{}, err
	}
	return WriteReply{Written: le.Uint64(b[32:]), Engine: EngineCode(le.Uint32(b[40:]))}, nil
}

// AddOverflows reports whether off+n overflows int64 (or either is >= 2^63).
func AddOverflows(off, n uint64) bool {
	return off > math.MaxInt64 || n > math.MaxInt64 || off > math.MaxInt64-n
}
