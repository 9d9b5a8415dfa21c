package ctl

import (
	"fmt"
	"syscall"
	"testing"
)

// TestPinLayoutMatchesProtocolDoc: PIN's fields are where docs/protocol.md
// 3.9 puts them, and the document names no other.
func TestPinLayoutMatchesProtocolDoc(t *testing.T) {
	doc, _ := readProtocolDoc(t)
	const u = false
	want := map[string]map[string]docField{
		"3.9 request": {"offset": at(pinOffset, u), "length": at(pinLength, u), "flags": at(pinFlags, u)},
		"3.9 reply": {"size": at(pinSize, u), "cached": at(pinCached, u), "filled": at(pinFilled, u), "chunk": at(pinChunk, u),
			"budget": at(pinBudget, u), "used": at(pinUsed, u), "yours": at(pinYours, u), "share": at(pinShare, u)},
	}
	for key, fields := range want {
		if fmt.Sprint(len(doc[key])) != fmt.Sprint(len(fields)) {
			t.Errorf("%s: docs/protocol.md names %d fields, pin.go %d", key, len(doc[key]), len(fields))
		}
		for name, w := range fields {
			if got, ok := doc[key][name]; !ok || got != w {
				t.Errorf("%s %s: docs/protocol.md says %+v (present %v); pin.go has %+v", key, name, got, ok, w)
			}
		}
	}
	if pinReqEnd != int(pinFlags)+4 || pinReplyEnd != int(pinShare)+8 || pinReplyEnd > SizePin {
		t.Errorf("PIN ends: request %d, reply %d of %d", pinReqEnd, pinReplyEnd, SizePin)
	}
}

// TestPinRequest: round trips, and what the decoder refuses.
func TestPinRequest(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mod   func(b []byte)
		errno syscall.Errno
	}{
		{"ok", func([]byte) {}, 0},
		{"unknown flag", func(b []byte) { pinFlags.put(b, 2) }, syscall.EINVAL},
		{"reserved byte", func(b []byte) { b[100] = 1 }, syscall.EINVAL},
		{"bad magic", func(b []byte) { b[0] = 0 }, syscall.EINVAL},
		{"version 2", func(b []byte) { hdrVersion.put(b, 2) }, syscall.EPROTO},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := PinRequest{Offset: 1 << 20, Length: 64 << 20, Flags: PinUnpin}
			b := make([]byte, SizePin)
			r.Encode(b)
			tc.mod(b)
			got, err := DecodePinRequest(b)
			if tc.errno != 0 {
				if err != tc.errno {
					t.Fatalf("decode: %v, want %v", err, tc.errno)
				}
				return
			}
			if err != nil || got != r {
				t.Fatalf("round trip %+v -> %+v, %v", r, got, err)
			}
		})
	}
	if _, err := DecodePinRequest(make([]byte, SizePin-1)); err != syscall.EINVAL {
		t.Errorf("short buffer: %v, want EINVAL", err)
	}
}

// FuzzDecodePin feeds arbitrary bytes to PIN's decoders: no panic, and
// what the request decoder accepts survives a round trip.
func FuzzDecodePin(f *testing.F) {
	b := make([]byte, SizePin)
	(&PinRequest{Offset: 4096, Length: 1 << 30}).Encode(b)
	f.Add(b)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		fit := make([]byte, SizePin)
		copy(fit, data)
		for _, in := range [][]byte{data, fit} {
			if r, err := DecodePinRequest(in); err == nil {
				out := make([]byte, SizePin)
				r.Encode(out)
				if r2, err := DecodePinRequest(out); err != nil || r2 != r {
					t.Fatalf("PIN round trip: %+v -> %+v, %v", r, r2, err)
				}
			}
			_, _ = DecodePinReply(in)
		}
	})
}
