package handoff

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
)

// Wire constants (docs/protocol.md, "Slab descriptors").
const (
	// Magic starts every request and reply: the bytes "GDFS".
	Magic uint32 = 0x53464447
	// Version is the version of the socket protocol.
	Version uint16 = 1
	// OpSlabFD asks for the descriptor of a slab's memory.
	OpSlabFD uint16 = 1
	// RequestBytes is the size of a request message.
	RequestBytes = 40
	// ReplyBytes is the size of a reply message.
	ReplyBytes = 32
)

var le = binary.LittleEndian

// Request asks for the descriptor of one slab on behalf of a session.
type Request struct {
	Session, Secret uint64 // the session token HELLO returned
	Slab            uint64 // slab id, from a lease descriptor
}

// Reply answers a Request. Errno 0 means the message carries one
// descriptor, of Bytes bytes of memory.
type Reply struct {
	Errno syscall.Errno
	Slab  uint64
	Bytes uint64 // bytes of memory behind the descriptor (what to map)
}

// ErrMalformed reports a message that is not a valid request or reply.
var ErrMalformed = errors.New("handoff: malformed message")

// EncodeRequest returns r as a RequestBytes message.
func EncodeRequest(r Request) []byte {
	b := make([]byte, RequestBytes)
	le.PutUint32(b[0:], Magic)
	le.PutUint16(b[4:], Version)
	le.PutUint16(b[6:], OpSlabFD)
	le.PutUint64(b[8:], r.Session)
	le.PutUint64(b[16:], r.Secret)
	le.PutUint64(b[24:], r.Slab)
	return b
}

// DecodeRequest decodes a request message. Anything but exactly
// RequestBytes bytes with the magic, version 1, op SLAB_FD and zero
// reserved bytes is ErrMalformed.
func DecodeRequest(b []byte) (Request, error) {
	if len(b) != RequestBytes {
		return Request{}, fmt.Errorf("%w: request of %d bytes, want %d", ErrMalformed, len(b), RequestBytes)
	}
	if le.Uint32(b[0:]) != Magic || le.Uint16(b[4:]) != Version || le.Uint16(b[6:]) != OpSlabFD {
		return Request{}, fmt.Errorf("%w: bad magic, version or op", ErrMalformed)
	}
	if le.Uint64(b[32:]) != 0 {
		return Request{}, fmt.Errorf("%w: reserved bytes not zero", ErrMalformed)
	}
	return Request{Session: le.Uint64(b[8:]), Secret: le.Uint64(b[16:]), Slab: le.Uint64(b[24:])}, nil
}

// EncodeReply returns r as a ReplyBytes message.
func EncodeReply(r Reply) []byte {
	b := make([]byte, ReplyBytes)
	le.PutUint32(b[0:], Magic)
	le.PutUint16(b[4:], Version)
	le.PutUint32(b[8:], uint32(r.Errno))
	le.PutUint64(b[16:], r.Slab)
	le.PutUint64(b[24:], r.Bytes)
	return b
}

// DecodeReply decodes a reply message.
func DecodeReply(b []byte) (Reply, error) {
	if len(b) != ReplyBytes {
		return Reply{}, fmt.Errorf("%w: reply of %d bytes, want %d", ErrMalformed, len(b), ReplyBytes)
	}
	if le.Uint32(b[0:]) != Magic || le.Uint16(b[4:]) != Version {
		return Reply{}, fmt.Errorf("%w: bad magic or version", ErrMalformed)
	}
	return Reply{Errno: syscall.Errno(le.Uint32(b[8:])), Slab: le.Uint64(b[16:]), Bytes: le.Uint64(b[24:])}, nil
}
