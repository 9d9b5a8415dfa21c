package handoff

import (
	"bytes"
	"syscall"
	"testing"
)

func TestWireRoundTrip(t *testing.T) {
	cases := []struct {
		name string
		req  Request
		rep  Reply
	}{
		{"zero", Request{}, Reply{}},
		{"typical", Request{Session: 3, Secret: 0xfeedface, Slab: 12}, Reply{Slab: 12, Bytes: 64 << 20}},
		{"all ones", Request{Session: ^uint64(0), Secret: ^uint64(0), Slab: ^uint64(0)}, Reply{Errno: syscall.EPERM, Slab: ^uint64(0), Bytes: ^uint64(0)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeRequest(EncodeRequest(tc.req))
			if err != nil || got != tc.req {
				t.Errorf("request round trip: %+v, %v; want %+v", got, err, tc.req)
			}
			rep, err := DecodeReply(EncodeReply(tc.rep))
			if err != nil || rep != tc.rep {
				t.Errorf("reply round trip: %+v, %v; want %+v", rep, err, tc.rep)
			}
		})
	}
}

// FuzzDecodeRequest: any message decodes to a request or ErrMalformed,
// never panics, and what decodes re-encodes to the same bytes.
func FuzzDecodeRequest(f *testing.F) {
	f.Add(EncodeRequest(Request{Session: 1, Secret: 2, Slab: 3}))
	f.Add([]byte{})
	f.Add(make([]byte, RequestBytes))
	f.Add(EncodeReply(Reply{Slab: 1}))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRequest(b)
		if err != nil {
			return
		}
		if !bytes.Equal(EncodeRequest(r), b) {
			t.Fatalf("%x decoded to %+v, which encodes to %x", b, r, EncodeRequest(r))
		}
	})
}

// FuzzDecodeReply: the client's decoder never panics.
func FuzzDecodeReply(f *testing.F) {
	f.Add(EncodeReply(Reply{Slab: 1, Bytes: 2}))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeReply(b)
		if err == nil && len(b) != ReplyBytes {
			t.Fatalf("%d bytes decoded to %+v", len(b), r)
		}
	})
}
