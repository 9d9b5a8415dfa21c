package ctl

import (
	"context"
	"os"
	"syscall"
)

// SizePin is the PIN buffer's size.
const SizePin = 128

// CmdPin fills the daemon's memory tier with a range of a data file, or
// reports or drops what of the file it holds (docs/protocol.md 3.9).
const CmdPin uint32 = 3<<30 | SizePin<<16 | ioctlType<<8 | 0x14

// PinUnpin asks PIN to drop the file from the tier instead.
const PinUnpin uint32 = 1

// PIN (3.9).
const (
	pinOffset   u64 = 32
	pinLength   u64 = 40
	pinFlags    u32 = 48
	pinReqEnd       = 52 // reserved from here
	pinSize     u64 = 32 // reply
	pinCached   u64 = 40
	pinFilled   u64 = 48
	pinChunk    u64 = 56
	pinBudget   u64 = 64
	pinUsed     u64 = 72
	pinYours    u64 = 80
	pinShare    u64 = 88
	pinReplyEnd     = 96
)

// PinRequest is a PIN request: [Offset, Offset+Length) of the file into
// the tier (Length 0: only report; Length past the end: to the end).
type PinRequest struct {
	Offset, Length uint64
	Flags          uint32
}

// PinReply is the PIN reply: the file's size and bytes in the tier after
// the request, the bytes the request read, the tier's extent size, and its
// budget, use, the caller's bytes and per-uid share.
type PinReply struct {
	Size, Cached, Filled, Chunk uint64
	Budget, Used, Yours, Share  uint64
}

// Encode writes the request into b (SizePin bytes). PIN carries no token.
func (r *PinRequest) Encode(b []byte) {
	clear(b)
	PutHeader(b, Token{})
	pinOffset.put(b, r.Offset)
	pinLength.put(b, r.Length)
	pinFlags.put(b, r.Flags)
}

// DecodePinRequest decodes a PIN request.
func DecodePinRequest(b []byte) (PinRequest, error) {
	if err := checkBuf(b, SizePin); err != nil {
		return PinRequest{}, err
	}
	if _, err := decodeHeader(b); err != nil {
		return PinRequest{}, err
	}
	r := PinRequest{Offset: pinOffset.get(b), Length: pinLength.get(b), Flags: pinFlags.get(b)}
	if r.Flags&^PinUnpin != 0 || !allZero(b[pinReqEnd:]) {
		return PinRequest{}, syscall.EINVAL
	}
	return r, nil
}

// Encode writes the reply into b (SizePin bytes).
func (r *PinReply) Encode(b []byte) {
	putReplyHeader(b)
	pinSize.put(b, r.Size)
	pinCached.put(b, r.Cached)
	pinFilled.put(b, r.Filled)
	pinChunk.put(b, r.Chunk)
	pinBudget.put(b, r.Budget)
	pinUsed.put(b, r.Used)
	pinYours.put(b, r.Yours)
	pinShare.put(b, r.Share)
}

// DecodePinReply decodes a PIN reply.
func DecodePinReply(b []byte) (PinReply, error) {
	if err := checkReplyHeader(b, SizePin); err != nil {
		return PinReply{}, err
	}
	return PinReply{Size: pinSize.get(b), Cached: pinCached.get(b), Filled: pinFilled.get(b), Chunk: pinChunk.get(b),
		Budget: pinBudget.get(b), Used: pinUsed.get(b), Yours: pinYours.get(b), Share: pinShare.get(b)}, nil
}

// Pin issues PIN on f, a data file of a gdsfs mount open for reading. It
// needs no session. Errors are the ioctl's errno (docs/protocol.md 3.9).
func Pin(ctx context.Context, f *os.File, req PinRequest) (PinReply, error) {
	buf := make([]byte, SizePin)
	req.Encode(buf)
	if err := ioctl(ctx, f, CmdPin, buf); err != nil {
		return PinReply{}, err
	}
	return DecodePinReply(buf)
}
