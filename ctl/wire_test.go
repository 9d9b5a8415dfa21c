package ctl

import (
	"bytes"
	"errors"
	"reflect"
	"syscall"
	"testing"
)

// The command numbers are part of the protocol: docs/protocol.md lists them.
func TestCommandNumbers(t *testing.T) {
	for _, tc := range []struct {
		name string
		cmd  uint32
		want uint32
		size int
	}{
		{"HELLO", CmdHello, 0xC1004701, 256},
		{"SLAB", CmdSlab, 0xC2804702, 640},
		{"ALLOC", CmdAlloc, 0xC0804703, 128},
		{"RELEASE", CmdRelease, 0xC8404704, 2112},
		{"STATUS", CmdStatus, 0xFFC04705, 16320},
		{"READ", CmdRead, 0xF0404710, 12352},
		{"READ_NAMES", CmdReadNames, 0xF0404711, 12352},
		{"WRITE", CmdWrite, 0xC0804712, 128},
		{"INDEX", CmdIndex, 0xFFC04713, 16320},
	} {
		if tc.cmd != tc.want {
			t.Errorf("%s = %#x, want %#x", tc.name, tc.cmd, tc.want)
		}
		if got := CmdSize(tc.cmd); got != tc.size {
			t.Errorf("%s size = %d, want %d", tc.name, got, tc.size)
		}
		if tc.size > 16383 {
			t.Errorf("%s size %d does not fit _IOC_SIZE", tc.name, tc.size)
		}
	}
}

func TestReadRoundTrip(t *testing.T) {
	b := make([]byte, SizeRead)
	req := ReadRequest{Token: Token{7, 9}, Device: -1, Ranges: []Range{{0, 1}, {4095, 8193}, {1 << 40, 0}}}
	req.Encode(b)
	got, err := DecodeReadRequest(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, req) {
		t.Errorf("decoded %+v, want %+v", got, req)
	}
	rep := ReadReply{Leases: []Lease{{ID: 1, Slab: 2, Offset: 4095, Length: 10, Valid: 3, Engine: EngineHost}}}
	rep.Encode(b)
	gotRep, err := DecodeReadReply(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(gotRep, rep) {
		t.Errorf("decoded %+v, want %+v", gotRep, rep)
	}
}

func TestReadNamesRoundTrip(t *testing.T) {
	b := make([]byte, SizeRead)
	req := ReadNamesRequest{Token: Token{1, 2}, Device: 3, Names: []string{"a.jpg", "layer.0/weight", "a.jpg"}}
	if err := req.Encode(b); err != nil {
		t.Fatal(err)
	}
	got, err := DecodeReadNamesRequest(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, req) {
		t.Errorf("decoded %+v, want %+v", got, req)
	}
}

func TestOtherRoundTrips(t *testing.T) {
	hello := HelloReply{Version: 1, UID: 1000, Caps: CapHostSlabs | CapWrite, Token: Token{3, 4}, MaxRanges: MaxRanges,
		MaxNamesBytes: NamesBytes, Align: AlignBytes, MaxLease: 1 << 30, Page: PageBytes, DaemonPID: 42, Engine: "host", DaemonVersion: "dev"}
	b := make([]byte, SizeHello)
	hello.Encode(b)
	if got, err := DecodeHelloReply(b); err != nil || !reflect.DeepEqual(got, hello) {
		t.Errorf("hello: got %+v, %v", got, err)
	}

	slab := SlabReply{Slab: 5, Size: 1 << 26, MapOffset: 4096, Kind: SlabHost, Device: -1, Handle: []byte("/dev/shm/gdsfs-5")}
	b = make([]byte, SizeSlab)
	slab.Encode(b)
	if got, err := DecodeSlabReply(b); err != nil || !reflect.DeepEqual(got, slab) {
		t.Errorf("slab: got %+v, %v", got, err)
	}

	wr := WriteRequest{Token: Token{1, 1}, Lease: 9, LeaseOffset: 1, FileOffset: 1 << 33, Length: 77, Flags: WriteSync}
	b = make([]byte, SizeWrite)
	wr.Encode(b)
	if got, err := DecodeWriteRequest(b); err != nil || !reflect.DeepEqual(got, wr) {
		t.Errorf("write: got %+v, %v", got, err)
	}

	rel := ReleaseRequest{Token: Token{}, IDs: []uint64{1, 2, 3}}
	b = make([]byte, SizeRelease)
	rel.Encode(b)
	if got, err := DecodeReleaseRequest(b); err != nil || !reflect.DeepEqual(got, rel) {
		t.Errorf("release: got %+v, %v", got, err)
	}
	relRep := ReleaseReply{Released: 2, Status: []syscall.Errno{0, syscall.ENOENT, 0}}
	relRep.Encode(b)
	if got, err := DecodeReleaseReply(b, 3); err != nil || !reflect.DeepEqual(got, relRep) {
		t.Errorf("release reply: got %+v, %v", got, err)
	}

	doc := make([]byte, PageBytes+10)
	for i := range doc {
		doc[i] = byte(i)
	}
	b = make([]byte, SizePage)
	if err := EncodePage(b, doc, PageBytes); err != nil {
		t.Fatal(err)
	}
	pg, err := DecodePageReply(b)
	if err != nil || pg.Total != uint64(len(doc)) || !reflect.DeepEqual(pg.Data, doc[PageBytes:]) || pg.Generation != fnv64a(doc) {
		t.Errorf("page: got total %d len %d, %v", pg.Total, len(pg.Data), err)
	}
	b2 := make([]byte, SizePage)
	if err := EncodePageGen(b2, doc, PageBytes, PageGeneration(doc)); err != nil || !bytes.Equal(b2, b) {
		t.Errorf("EncodePageGen with PageGeneration differs from EncodePage (%v)", err)
	}
	if err := EncodePage(b, doc, uint64(len(doc))+1); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("page past end: %v, want EINVAL", err)
	}
}

// Every refusal a decoder makes, with the errno docs/protocol.md promises.
func TestDecodeRefusals(t *testing.T) {
	valid := func() []byte {
		b := make([]byte, SizeRead)
		(&ReadRequest{Token: Token{1, 2}, Ranges: []Range{{0, 1}}}).Encode(b)
		return b
	}
	for _, tc := range []struct {
		name   string
		mutate func([]byte) []byte
		want   syscall.Errno
	}{
		{"bad magic", func(b []byte) []byte { b[0] ^= 1; return b }, syscall.EINVAL},
		{"version 2", func(b []byte) []byte { b[4] = 2; return b }, syscall.EPROTO},
		{"header flags", func(b []byte) []byte { b[6] = 1; return b }, syscall.EINVAL},
		{"header reserved", func(b []byte) []byte { b[31] = 1; return b }, syscall.EINVAL},
		{"read flags", func(b []byte) []byte { b[36] = 1; return b }, syscall.EINVAL},
		{"read reserved", func(b []byte) []byte { b[50] = 1; return b }, syscall.EINVAL},
		{"count 0", func(b []byte) []byte { le.PutUint32(b[40:], 0); return b }, syscall.EINVAL},
		{"count 257", func(b []byte) []byte { le.PutUint32(b[40:], MaxRanges+1); return b }, syscall.E2BIG},
		{"count huge", func(b []byte) []byte { le.PutUint32(b[40:], 1<<31); return b }, syscall.E2BIG},
		{"short buffer", func(b []byte) []byte { return b[:100] }, syscall.EINVAL},
		{"empty buffer", func(b []byte) []byte { return nil }, syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeReadRequest(tc.mutate(valid()))
			if !errors.Is(err, tc.want) {
				t.Errorf("got %v, want %v", err, tc.want)
			}
		})
	}
}

func TestDecodeNamesRefusals(t *testing.T) {
	mk := func(count, n uint32, area string) []byte {
		b := make([]byte, SizeRead)
		PutHeader(b, Token{1, 2})
		le.PutUint32(b[40:], count)
		le.PutUint32(b[44:], n)
		copy(b[64:], area)
		return b
	}
	for _, tc := range []struct {
		name string
		b    []byte
		want syscall.Errno
	}{
		{"unterminated", mk(1, 3, "abc"), syscall.EINVAL},
		{"empty name", mk(2, 3, "a\x00\x00"), syscall.EINVAL},
		{"too few names", mk(3, 4, "a\x00b\x00"), syscall.EINVAL},
		{"too many names", mk(1, 4, "a\x00b\x00"), syscall.EINVAL},
		{"names_len too big", mk(1, NamesBytes+1, "a\x00"), syscall.EINVAL},
		{"count 0", mk(0, 0, ""), syscall.EINVAL},
		{"count 257", mk(257, 2, "a\x00"), syscall.E2BIG},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := DecodeReadNamesRequest(tc.b); !errors.Is(err, tc.want) {
				t.Errorf("got %v, want %v", err, tc.want)
			}
		})
	}
	r := ReadNamesRequest{Names: []string{"a\x00b"}}
	if err := r.Encode(make([]byte, SizeRead)); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("encode name with NUL: %v, want EINVAL", err)
	}
	long := []string{string(repeat('x', NamesBytes/2)), string(repeat('y', NamesBytes/2))}
	r = ReadNamesRequest{Names: long}
	if err := r.Encode(make([]byte, SizeRead)); !errors.Is(err, syscall.E2BIG) {
		t.Errorf("encode oversize names: %v, want E2BIG", err)
	}
}

func repeat(c byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = c
	}
	return b
}

func TestAddOverflows(t *testing.T) {
	for _, tc := range []struct {
		off, n uint64
		want   bool
	}{
		{0, 0, false},
		{1<<63 - 1, 0, false},
		{1<<63 - 1, 1, true},
		{1 << 63, 0, true},
		{0, 1 << 63, true},
		{1 << 62, 1<<62 - 1, false},
		{1 << 62, 1 << 62, true},
	} {
		if got := AddOverflows(tc.off, tc.n); got != tc.want {
			t.Errorf("AddOverflows(%d, %d) = %v, want %v", tc.off, tc.n, got, tc.want)
		}
	}
}

// FuzzDecode feeds arbitrary bytes to every request decoder (the daemon's
// attack surface). A decoder must not panic; what it accepts must survive
// an encode/decode round trip unchanged.
func FuzzDecode(f *testing.F) {
	seed := func(size int, enc func([]byte)) {
		b := make([]byte, size)
		enc(b)
		f.Add(b)
	}
	seed(SizeHello, EncodeHello)
	seed(SizeRead, (&ReadRequest{Token: Token{1, 2}, Device: -1, Ranges: []Range{{0, 4096}, {1, 2}}}).Encode)
	seed(SizeRead, func(b []byte) { _ = (&ReadNamesRequest{Token: Token{1, 2}, Names: []string{"x", "y/z"}}).Encode(b) })
	seed(SizeWrite, (&WriteRequest{Token: Token{1, 2}, Lease: 3, Length: 5}).Encode)
	seed(SizeRelease, (&ReleaseRequest{IDs: []uint64{1, 2}}).Encode)
	seed(SizePage, (&PageRequest{Offset: 7}).Encode)
	seed(SizeSlab, (&SlabRequest{Slab: 3}).Encode)
	seed(SizeAlloc, (&AllocRequest{Device: -1, Length: 4096}).Encode)
	f.Add([]byte{})
	f.Add([]byte("GDFS"))

	f.Fuzz(func(t *testing.T, data []byte) {
		// The fuzzer's inputs are rarely exactly a command's size: fit them
		// to each size so that every decoder sees every input.
		fit := func(size int) []byte {
			b := make([]byte, size)
			copy(b, data)
			return b
		}
		_ = DecodeHello(data)
		_ = DecodeHello(fit(SizeHello))
		for _, b := range [][]byte{data, fit(SizeRead)} {
			if r, err := DecodeReadRequest(b); err == nil {
				out := make([]byte, SizeRead)
				r.Encode(out)
				if r2, err := DecodeReadRequest(out); err != nil || !reflect.DeepEqual(r, r2) {
					t.Fatalf("READ round trip: %+v -> %+v, %v", r, r2, err)
				}
			}
			if r, err := DecodeReadNamesRequest(b); err == nil {
				out := make([]byte, SizeRead)
				if err := r.Encode(out); err != nil {
					t.Fatalf("READ_NAMES re-encode: %v", err)
				}
				if r2, err := DecodeReadNamesRequest(out); err != nil || !reflect.DeepEqual(r, r2) {
					t.Fatalf("READ_NAMES round trip: %+v -> %+v, %v", r, r2, err)
				}
			}
		}
		if r, err := DecodeWriteRequest(fit(SizeWrite)); err == nil {
			out := make([]byte, SizeWrite)
			r.Encode(out)
			if r2, err := DecodeWriteRequest(out); err != nil || r != r2 {
				t.Fatalf("WRITE round trip: %+v -> %+v, %v", r, r2, err)
			}
		}
		if r, err := DecodeReleaseRequest(fit(SizeRelease)); err == nil {
			if len(r.IDs) == 0 || len(r.IDs) > MaxReleaseIDs {
				t.Fatalf("RELEASE accepted %d ids", len(r.IDs))
			}
		}
		_, _ = DecodePageRequest(fit(SizePage))
		_, _ = DecodeSlabRequest(fit(SizeSlab))
		_, _ = DecodeAllocRequest(fit(SizeAlloc))
		// Client-side decoders must not panic on a hostile daemon either.
		_, _ = DecodeReadReply(fit(SizeRead))
		_, _ = DecodeSlabReply(fit(SizeSlab))
		_, _ = DecodePageReply(fit(SizePage))
		_, _ = DecodeHelloReply(fit(SizeHello))
		_, _ = DecodeReleaseReply(fit(SizeRelease), MaxReleaseIDs)
	})
}

// TestAllZero: a non-zero byte anywhere in a buffer of any length, at
// every alignment of the word-wise loop, is found.
func TestAllZero(t *testing.T) {
	for n := 0; n <= 80; n++ {
		b := make([]byte, n)
		if !allZero(b) {
			t.Fatalf("%d zero bytes: not all zero", n)
		}
		for i := range b {
			b[i] = 0x80
			if allZero(b) {
				t.Fatalf("%d bytes with byte %d set: all zero", n, i)
			}
			b[i] = 0
		}
	}
}
