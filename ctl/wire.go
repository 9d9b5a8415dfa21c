package ctl

import (
	"encoding/binary"
	"hash/fnv"
	"math"
	"syscall"

	"github.com/gdsfs/gdsfs/internal/engname"
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

	ioctlType = 'G'
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
		{CmdPin, "PIN", SizePin, true},
	}
}

// CommandName returns cmd's name as docs/protocol.md spells it, or "" for
// a number that is not a command of the protocol.
func CommandName(cmd uint32) string {
	c, _ := LookupCommand(cmd)
	return c.Name
}

// LookupCommand returns the command of number cmd, and false for a number
// that is not a command of the protocol.
func LookupCommand(cmd uint32) (Command, bool) {
	for _, c := range Commands() {
		if c.Cmd == cmd {
			return c, true
		}
	}
	return Command{}, false
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
	// CapDeviceUUIDs: STATUS names each CUDA device's UUID
	// (pool.devices[].uuid), so that a client whose CUDA_VISIBLE_DEVICES
	// view differs from the daemon's can name the daemon's ordinal of
	// its own GPU (docs/protocol.md, section 2 "Device").
	CapDeviceUUIDs
	// CapReadVersion: INDEX replies carry the version of the file the
	// index was parsed from (PageReply.Version), and a READ that names a
	// version (ReadRequest.Version) is refused with ESTALE unless the
	// file is still at that version before and after its bytes are read
	// (docs/protocol.md, READ).
	CapReadVersion
	// CapIndexColumns: INDEX accepts IndexFlagColumns and then serves a
	// tar's index as columns (PageReply.Form IndexFormTarColumns,
	// docs/index-format.md "Tar columns"); set with CapIndex.
	CapIndexColumns
)

// IndexFlagColumns is INDEX's request flags bit 0 (CapIndexColumns): serve
// the index in the compact columns form where the file's format has one.
const IndexFlagColumns uint32 = 1

// INDEX reply forms (PageReply.Form): what the paged document is.
const (
	IndexFormJSON       uint32 = 0 // the JSON document (docs/index-format.md)
	IndexFormTarColumns uint32 = 1 // a tar's columns document (cache.DecodeTarColumns)
)

// ReadFlagVersion is READ's flags bit 0: the request's version field
// (bytes 48..55) holds a file version from INDEX.
const ReadFlagVersion uint32 = 1

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
	EngineTier // the daemon's memory tier (PIN), copied into the slab
)

var engineNames = [...]string{engname.None, engname.Host, engname.Posix, engname.GDS, engname.GDSCompat, engname.Tier}

// EngineNames returns the name of every engine code, in code order.
func EngineNames() []string { return append([]string(nil), engineNames[:]...) }

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
	// Flags: INDEX only, IndexFlagColumns (with CapIndexColumns); 0 for
	// STATUS.
	Flags uint32
}

// PageReply is one page of a JSON document.
type PageReply struct {
	Total      uint64
	Generation uint64
	// Version is INDEX's file version (with CapReadVersion): an opaque
	// non-zero name of the file's contents at the time the index was
	// parsed; 0 for STATUS and from daemons without CapReadVersion.
	Version uint64
	// Form is what the document is: IndexFormJSON, or for an INDEX
	// request with IndexFlagColumns, IndexFormTarColumns where the file
	// is a tar.
	Form uint32
	Data []byte // at most PageBytes
}

// ReadRequest asks for file ranges in slabs.
type ReadRequest struct {
	Token  Token
	Device int32
	// Version, when non-zero, is a PageReply.Version of INDEX: the daemon
	// answers ESTALE unless the file is at that version (ReadFlagVersion).
	Version uint64
	Ranges  []Range // 1..MaxRanges
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

// Fields of a message: each layout below gives a field's offset once, and
// its encoder and decoder both go through it (docs/protocol.md's tables;
// TestLayoutsMatchProtocolDoc checks them against the document).
type (
	u16 int // offset of a little-endian uint16
	u32 int // offset of a little-endian uint32 (or int32)
	u64 int // offset of a little-endian uint64
)

func (o u16) get(b []byte) uint16    { return le.Uint16(b[o:]) }
func (o u16) put(b []byte, v uint16) { le.PutUint16(b[o:], v) }
func (o u32) get(b []byte) uint32    { return le.Uint32(b[o:]) }
func (o u32) put(b []byte, v uint32) { le.PutUint32(b[o:], v) }
func (o u64) get(b []byte) uint64    { return le.Uint64(b[o:]) }
func (o u64) put(b []byte, v uint64) { le.PutUint64(b[o:], v) }

// elem is element i of an array of uint32 starting at o.
func (o u32) elem(i int) u32 { return o + u32(4*i) }

// elem is element i of an array of uint64 starting at o.
func (o u64) elem(i int) u64 { return o + u64(8*i) }

// Common header (docs/protocol.md 1.3), first in every request and reply.
const (
	hdrMagic    u32 = 0
	hdrVersion  u16 = 4
	hdrFlags    u16 = 6
	hdrSession  u64 = 8
	hdrSecret   u64 = 16
	hdrReserved u64 = 24
	headerBytes     = 32
)

// Lease descriptor (section 2), at the start of its record.
const (
	leaseID       u64 = 0
	leaseSlab     u64 = 8
	leaseOffset   u64 = 16
	leaseLength   u64 = 24
	leaseValid    u64 = 32
	leaseEngine   u32 = 40
	leaseReserved u32 = 44
	leaseBytes        = 48
)

// Range of a READ request, at the start of its record.
const (
	rangeOffset u64 = 0
	rangeLength u64 = 8
	rangeBytes      = 16
)

// HELLO reply (3.1). The request is a bare header.
const (
	helloVersion       u32 = 32
	helloUID           u32 = 36
	helloCaps          u64 = 40
	helloSession       u64 = 48
	helloSecret        u64 = 56
	helloMaxRanges     u32 = 64
	helloMaxNamesBytes u32 = 68
	helloAlign         u32 = 72
	helloDevices       u32 = 76
	helloMaxLease      u64 = 80
	helloPage          u64 = 88
	helloDaemonPID     u32 = 96
	// NUL-padded strings: [start, end).
	helloEngine, helloEngineEnd               = 104, 136
	helloDaemonVersion, helloDaemonVersionEnd = 136, 168
	helloSlabSocket, helloSlabSocketEnd       = 168, 168 + SlabSocketBytes
)

// SLAB (3.2).
const (
	slabReqSlab   u64 = 32 // request; the rest of it is reserved
	slabReqEnd        = 40
	slabSlab      u64 = 32
	slabSize      u64 = 40
	slabMapOffset u64 = 48
	slabKind      u32 = 56
	slabDevice    u32 = 60
	slabHandleLen u32 = 64
	slabHandle        = 128 // HandleBytes
)

// ALLOC (3.3). The reply is a lease descriptor at allocLease.
const (
	allocDevice   u32 = 32
	allocReserved u32 = 36
	allocLength   u64 = 40
	allocReqEnd       = 48 // reserved from here
	allocLease        = 32
)

// RELEASE (3.4).
const (
	releaseCount    u32 = 32
	releaseReserved     = 36 // to releaseIDs
	releaseIDs      u64 = 64
	releaseReleased u32 = 32 // reply
	releaseStatus   u32 = 64 // reply: i32 per requested id
)

// STATUS and INDEX (3.5).
const (
	pageReqOffset  u64 = 32
	pageReqFlags   u32 = 40 // INDEX: IndexFlagColumns
	pageReqEnd         = 44 // reserved from here
	pageTotal      u64 = 32
	pageGeneration u64 = 40
	pageLen        u32 = 48
	pageForm       u32 = 52 // IndexForm*
	pageVersion    u64 = 56 // INDEX, with CapReadVersion
	pageData           = 64 // PageBytes
)

// READ (3.6) and READ_NAMES (3.7) requests, and their common reply.
const (
	readDevice      u32 = 32
	readFlags       u32 = 36
	readCount       u32 = 40
	readReserved        = 44 // READ: to readVersion
	readVersion     u64 = 48 // READ with ReadFlagVersion
	readReserved2       = 56 // READ: to readRanges
	readRanges          = 64 // rangeBytes each
	namesLen        u32 = 44
	namesReserved       = 48 // READ_NAMES: to namesArea
	namesArea           = 64 // NamesBytes
	readReplyCount  u32 = 32
	readReplyLeases     = 64 // leaseBytes each
)

// WRITE (3.8).
const (
	writeLease       u64 = 32
	writeLeaseOffset u64 = 40
	writeFileOffset  u64 = 48
	writeLength      u64 = 56
	writeFlags       u32 = 64
	writeReqEnd          = 68 // reserved from here
	writeWritten     u64 = 32
	writeEngine      u32 = 40
)

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	// Eight bytes at a time: a STATUS or INDEX page request checks its
	// 16 KiB tail on every page.
	var x uint64
	for len(b) >= 32 {
		x |= le.Uint64(b) | le.Uint64(b[8:]) | le.Uint64(b[16:]) | le.Uint64(b[24:])
		if x != 0 {
			return false
		}
		b = b[32:]
	}
	for _, c := range b {
		x |= uint64(c)
	}
	return x == 0
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
	hdrMagic.put(b, Magic)
	hdrVersion.put(b, Version)
	hdrFlags.put(b, 0)
	hdrSession.put(b, t.Session)
	hdrSecret.put(b, t.Secret)
	hdrReserved.put(b, 0)
}

// putReplyHeader clears b and writes a reply header.
func putReplyHeader(b []byte) {
	clear(b)
	hdrMagic.put(b, Magic)
	hdrVersion.put(b, Version)
}

// decodeHeader checks a request header and returns its token.
func decodeHeader(b []byte) (Token, error) {
	if len(b) < headerBytes || hdrMagic.get(b) != Magic {
		return Token{}, syscall.EINVAL
	}
	if hdrVersion.get(b) != Version {
		return Token{}, syscall.EPROTO
	}
	if hdrFlags.get(b) != 0 || hdrReserved.get(b) != 0 {
		return Token{}, syscall.EINVAL
	}
	return Token{Session: hdrSession.get(b), Secret: hdrSecret.get(b)}, nil
}

// checkReplyHeader checks the header of a reply.
func checkReplyHeader(b []byte, size int) error {
	if len(b) != size || hdrMagic.get(b) != Magic {
		return syscall.EBADMSG
	}
	if hdrVersion.get(b) != Version {
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
	helloVersion.put(b, r.Version)
	helloUID.put(b, r.UID)
	helloCaps.put(b, r.Caps)
	helloSession.put(b, r.Token.Session)
	helloSecret.put(b, r.Token.Secret)
	helloMaxRanges.put(b, r.MaxRanges)
	helloMaxNamesBytes.put(b, r.MaxNamesBytes)
	helloAlign.put(b, r.Align)
	helloDevices.put(b, r.Devices)
	helloMaxLease.put(b, r.MaxLease)
	helloPage.put(b, r.Page)
	helloDaemonPID.put(b, r.DaemonPID)
	putString(b[helloEngine:helloEngineEnd], r.Engine)
	putString(b[helloDaemonVersion:helloDaemonVersionEnd], r.DaemonVersion)
	putString(b[helloSlabSocket:helloSlabSocketEnd], r.SlabSocket)
}

// DecodeHelloReply decodes a HELLO reply.
func DecodeHelloReply(b []byte) (HelloReply, error) {
	if err := checkReplyHeader(b, SizeHello); err != nil {
		return HelloReply{}, err
	}
	return HelloReply{
		Version:       helloVersion.get(b),
		UID:           helloUID.get(b),
		Caps:          helloCaps.get(b),
		Token:         Token{Session: helloSession.get(b), Secret: helloSecret.get(b)},
		MaxRanges:     helloMaxRanges.get(b),
		MaxNamesBytes: helloMaxNamesBytes.get(b),
		Align:         helloAlign.get(b),
		Devices:       helloDevices.get(b),
		MaxLease:      helloMaxLease.get(b),
		Page:          helloPage.get(b),
		DaemonPID:     helloDaemonPID.get(b),
		Engine:        getString(b[helloEngine:helloEngineEnd]),
		DaemonVersion: getString(b[helloDaemonVersion:helloDaemonVersionEnd]),
		SlabSocket:    getString(b[helloSlabSocket:helloSlabSocketEnd]),
	}, nil
}

// Encode writes the SLAB request into b (SizeSlab bytes).
func (r *SlabRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	slabReqSlab.put(b, r.Slab)
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
	if !allZero(b[slabReqEnd:]) {
		return SlabRequest{}, syscall.EINVAL
	}
	return SlabRequest{Token: t, Slab: slabReqSlab.get(b)}, nil
}

// Encode writes the SLAB reply into b (SizeSlab bytes). The handle is
// truncated to HandleBytes; the server checks its length first.
func (r *SlabReply) Encode(b []byte) {
	putReplyHeader(b)
	h := r.Handle
	if len(h) > HandleBytes {
		h = h[:HandleBytes]
	}
	slabSlab.put(b, r.Slab)
	slabSize.put(b, r.Size)
	slabMapOffset.put(b, r.MapOffset)
	slabKind.put(b, r.Kind)
	slabDevice.put(b, uint32(r.Device))
	slabHandleLen.put(b, uint32(len(h)))
	copy(b[slabHandle:], h)
}

// DecodeSlabReply decodes a SLAB reply.
func DecodeSlabReply(b []byte) (SlabReply, error) {
	if err := checkReplyHeader(b, SizeSlab); err != nil {
		return SlabReply{}, err
	}
	n := slabHandleLen.get(b)
	if n > HandleBytes {
		return SlabReply{}, syscall.EBADMSG
	}
	return SlabReply{
		Slab:      slabSlab.get(b),
		Size:      slabSize.get(b),
		MapOffset: slabMapOffset.get(b),
		Kind:      slabKind.get(b),
		Device:    int32(slabDevice.get(b)),
		Handle:    append([]byte(nil), b[slabHandle:slabHandle+n]...),
	}, nil
}

// Encode writes the ALLOC request into b (SizeAlloc bytes).
func (r *AllocRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	allocDevice.put(b, uint32(r.Device))
	allocLength.put(b, r.Length)
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
	if allocReserved.get(b) != 0 || !allZero(b[allocReqEnd:]) {
		return AllocRequest{}, syscall.EINVAL
	}
	return AllocRequest{Token: t, Device: int32(allocDevice.get(b)), Length: allocLength.get(b)}, nil
}

// putLease writes a lease descriptor at b[0:leaseBytes].
func putLease(b []byte, l Lease) {
	leaseID.put(b, l.ID)
	leaseSlab.put(b, l.Slab)
	leaseOffset.put(b, l.Offset)
	leaseLength.put(b, l.Length)
	leaseValid.put(b, l.Valid)
	leaseEngine.put(b, uint32(l.Engine))
	leaseReserved.put(b, 0)
}

// getLease reads a lease descriptor at b[0:leaseBytes].
func getLease(b []byte) Lease {
	return Lease{
		ID:     leaseID.get(b),
		Slab:   leaseSlab.get(b),
		Offset: leaseOffset.get(b),
		Length: leaseLength.get(b),
		Valid:  leaseValid.get(b),
		Engine: EngineCode(leaseEngine.get(b)),
	}
}

// EncodeAllocReply writes the ALLOC reply into b (SizeAlloc bytes).
func EncodeAllocReply(b []byte, l Lease) {
	putReplyHeader(b)
	putLease(b[allocLease:], l)
}

// DecodeAllocReply decodes an ALLOC reply.
func DecodeAllocReply(b []byte) (Lease, error) {
	if err := checkReplyHeader(b, SizeAlloc); err != nil {
		return Lease{}, err
	}
	return getLease(b[allocLease:]), nil
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
	releaseCount.put(b, uint32(len(ids)))
	for i, id := range ids {
		releaseIDs.elem(i).put(b, id)
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
	if !allZero(b[releaseReserved:releaseIDs]) {
		return ReleaseRequest{}, syscall.EINVAL
	}
	n := releaseCount.get(b)
	switch {
	case n == 0:
		return ReleaseRequest{}, syscall.EINVAL
	case n > MaxReleaseIDs:
		return ReleaseRequest{}, syscall.E2BIG
	}
	ids := make([]uint64, n)
	for i := range ids {
		ids[i] = releaseIDs.elem(i).get(b)
	}
	return ReleaseRequest{Token: t, IDs: ids}, nil
}

// Encode writes the RELEASE reply into b (SizeRelease bytes).
func (r *ReleaseReply) Encode(b []byte) {
	putReplyHeader(b)
	releaseReleased.put(b, r.Released)
	for i, e := range r.Status {
		if i == MaxReleaseIDs {
			break
		}
		releaseStatus.elem(i).put(b, uint32(e))
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
	r := ReleaseReply{Released: releaseReleased.get(b), Status: make([]syscall.Errno, n)}
	for i := range r.Status {
		r.Status[i] = syscall.Errno(releaseStatus.elem(i).get(b))
	}
	return r, nil
}

// Encode writes the STATUS/INDEX request into b (SizePage bytes).
func (r *PageRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	pageReqOffset.put(b, r.Offset)
	pageReqFlags.put(b, r.Flags)
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
	if !allZero(b[pageReqEnd:]) {
		return PageRequest{}, syscall.EINVAL
	}
	return PageRequest{Token: t, Offset: pageReqOffset.get(b), Flags: pageReqFlags.get(b)}, nil
}

// EncodePage writes the page of doc at offset into b (SizePage bytes). It
// fails with EINVAL when offset is past the end of doc.
func EncodePage(b []byte, doc []byte, offset uint64) error {
	return EncodePageGen(b, doc, offset, PageGeneration(doc))
}

// PageGeneration is the generation of a paged document: the FNV-1a 64 hash
// of its bytes.
func PageGeneration(doc []byte) uint64 { return fnv64a(doc) }

// EncodePageGen is EncodePage with doc's PageGeneration computed by the
// caller: once per document served in many pages (hashing a 700 KB shard
// index on every page made reading it quadratic in its size).
func EncodePageGen(b []byte, doc []byte, offset, generation uint64) error {
	if offset > uint64(len(doc)) {
		return syscall.EINVAL
	}
	putReplyHeader(b)
	chunk := doc[offset:]
	if len(chunk) > PageBytes {
		chunk = chunk[:PageBytes]
	}
	pageTotal.put(b, uint64(len(doc)))
	pageGeneration.put(b, generation)
	pageLen.put(b, uint32(len(chunk)))
	copy(b[pageData:], chunk)
	return nil
}

// EncodeIndexPage is EncodePageGen for INDEX, with the file version the
// index was parsed from (non-zero, CapReadVersion).
func EncodeIndexPage(b []byte, doc []byte, offset, generation, version uint64) error {
	return EncodeIndexPageForm(b, doc, offset, generation, version, IndexFormJSON)
}

// EncodeIndexPageForm is EncodeIndexPage of a document of the given form
// (IndexFormJSON or IndexFormTarColumns).
func EncodeIndexPageForm(b []byte, doc []byte, offset, generation, version uint64, form uint32) error {
	if err := EncodePageGen(b, doc, offset, generation); err != nil {
		return err
	}
	pageVersion.put(b, version)
	pageForm.put(b, form)
	return nil
}

// DecodePageReply decodes a STATUS or INDEX reply.
func DecodePageReply(b []byte) (PageReply, error) {
	if err := checkReplyHeader(b, SizePage); err != nil {
		return PageReply{}, err
	}
	n := pageLen.get(b)
	if n > PageBytes {
		return PageReply{}, syscall.EBADMSG
	}
	return PageReply{
		Total:      pageTotal.get(b),
		Generation: pageGeneration.get(b),
		Version:    pageVersion.get(b),
		Form:       pageForm.get(b),
		Data:       append([]byte(nil), b[pageData:pageData+n]...),
	}, nil
}

// fnv64a is the FNV-1a 64-bit hash of b (the page generation).
func fnv64a(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b) // never fails
	return h.Sum64()
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
	readDevice.put(b, uint32(r.Device))
	readCount.put(b, uint32(len(rs)))
	if r.Version != 0 {
		readFlags.put(b, ReadFlagVersion)
		readVersion.put(b, r.Version)
	}
	for i, rg := range rs {
		e := b[readRanges+rangeBytes*i:]
		rangeOffset.put(e, rg.Offset)
		rangeLength.put(e, rg.Length)
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
	flags := readFlags.get(b)
	if flags&^ReadFlagVersion != 0 || !allZero(b[readReserved:readVersion]) || !allZero(b[readReserved2:readRanges]) {
		return ReadRequest{}, syscall.EINVAL
	}
	var version uint64
	if flags&ReadFlagVersion != 0 {
		if version = readVersion.get(b); version == 0 {
			return ReadRequest{}, syscall.EINVAL // no version is 0
		}
	} else if readVersion.get(b) != 0 {
		return ReadRequest{}, syscall.EINVAL // reserved without the flag
	}
	n := readCount.get(b)
	switch {
	case n == 0:
		return ReadRequest{}, syscall.EINVAL
	case n > MaxRanges:
		return ReadRequest{}, syscall.E2BIG
	}
	rs := make([]Range, n)
	for i := range rs {
		e := b[readRanges+rangeBytes*i:]
		rs[i] = Range{Offset: rangeOffset.get(e), Length: rangeLength.get(e)}
	}
	return ReadRequest{Token: t, Device: int32(readDevice.get(b)), Version: version, Ranges: rs}, nil
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
	area := b[namesArea : namesArea+NamesBytes]
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
	readDevice.put(b, uint32(r.Device))
	readCount.put(b, uint32(len(r.Names)))
	namesLen.put(b, uint32(n))
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
	if readFlags.get(b) != 0 || !allZero(b[namesReserved:namesArea]) {
		return ReadNamesRequest{}, syscall.EINVAL
	}
	count := readCount.get(b)
	switch {
	case count == 0:
		return ReadNamesRequest{}, syscall.EINVAL
	case count > MaxRanges:
		return ReadNamesRequest{}, syscall.E2BIG
	}
	n := namesLen.get(b)
	if n > NamesBytes {
		return ReadNamesRequest{}, syscall.EINVAL
	}
	area := b[namesArea : namesArea+n]
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
	return ReadNamesRequest{Token: t, Device: int32(readDevice.get(b)), Names: names}, nil
}

// Encode writes the READ / READ_NAMES reply into b (SizeRead bytes).
func (r *ReadReply) Encode(b []byte) {
	putReplyHeader(b)
	ls := r.Leases
	if len(ls) > MaxRanges {
		ls = ls[:MaxRanges]
	}
	readReplyCount.put(b, uint32(len(ls)))
	for i, l := range ls {
		putLease(b[readReplyLeases+leaseBytes*i:], l)
	}
}

// DecodeReadReply decodes a READ / READ_NAMES reply.
func DecodeReadReply(b []byte) (ReadReply, error) {
	if err := checkReplyHeader(b, SizeRead); err != nil {
		return ReadReply{}, err
	}
	n := readReplyCount.get(b)
	if n > MaxRanges {
		return ReadReply{}, syscall.EBADMSG
	}
	ls := make([]Lease, n)
	for i := range ls {
		ls[i] = getLease(b[readReplyLeases+leaseBytes*i:])
	}
	return ReadReply{Leases: ls}, nil
}

// Encode writes the WRITE request into b (SizeWrite bytes).
func (r *WriteRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, r.Token)
	writeLease.put(b, r.Lease)
	writeLeaseOffset.put(b, r.LeaseOffset)
	writeFileOffset.put(b, r.FileOffset)
	writeLength.put(b, r.Length)
	writeFlags.put(b, r.Flags)
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
	flags := writeFlags.get(b)
	if flags&^WriteSync != 0 || !allZero(b[writeReqEnd:]) {
		return WriteRequest{}, syscall.EINVAL
	}
	return WriteRequest{
		Token:       t,
		Lease:       writeLease.get(b),
		LeaseOffset: writeLeaseOffset.get(b),
		FileOffset:  writeFileOffset.get(b),
		Length:      writeLength.get(b),
		Flags:       flags,
	}, nil
}

// Encode writes the WRITE reply into b (SizeWrite bytes).
func (r *WriteReply) Encode(b []byte) {
	putReplyHeader(b)
	writeWritten.put(b, r.Written)
	writeEngine.put(b, uint32(r.Engine))
}

// DecodeWriteReply decodes a WRITE reply.
func DecodeWriteReply(b []byte) (WriteReply, error) {
	if err := checkReplyHeader(b, SizeWrite); err != nil {
		return WriteReply{}, err
	}
	return WriteReply{Written: writeWritten.get(b), Engine: EngineCode(writeEngine.get(b))}, nil
}

// AddOverflows reports whether off+n overflows int64 (or either is >= 2^63).
func AddOverflows(off, n uint64) bool {
	return off > math.MaxInt64 || n > math.MaxInt64 || off > math.MaxInt64-n
}
