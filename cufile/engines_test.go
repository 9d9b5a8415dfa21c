package cufile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// hasGPU reports whether this host has the NVIDIA driver; CI does not, and
// these tests check the behaviour without it.
func hasGPU() bool {
	_, err := LoadDriver()
	return err == nil
}

func TestMissingLibrariesAreErrors(t *testing.T) {
	if hasGPU() {
		t.Skip("NVIDIA driver present: absence cannot be tested here")
	}
	_, err := LoadDriver()
	var le *LibraryError
	if !errors.As(err, &le) || le.Lib != "libcuda.so.1" || le.Hint == "" {
		t.Fatalf("LoadDriver() = %v, want a *LibraryError naming libcuda.so.1", err)
	}
	if _, err := openLibrary("libgdsfs-does-not-exist.so.9", "test"); !errors.As(err, &le) {
		t.Fatalf("openLibrary of a missing library = %v", err)
	}
}

func TestOpenWithoutGPU(t *testing.T) {
	if hasGPU() {
		t.Skip("NVIDIA driver present")
	}
	for _, tc := range []struct {
		engine  string
		wantErr bool
	}{
		{"", false},
		{EngineAuto, false},
		{EngineHost, false},
		{EnginePosix, true},
		{EngineGDS, true},
		{"bogus", true},
	} {
		t.Run("engine="+tc.engine, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "shm")
			e, err := Open(Config{Engine: tc.engine, HostDir: dir})
			if tc.wantErr {
				if err == nil {
					e.Close()
					t.Fatal("Open succeeded")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := e.Close(); err != nil {
					t.Error(err)
				}
				if _, err := os.Stat(dir); !os.IsNotExist(err) {
					t.Error("host slab directory left behind")
				}
			}()
			r := e.Probe()
			if r.Engine != EngineHost || r.Backend != "host" || r.Why == "" {
				t.Errorf("report %+v, want the host engine with a reason", r)
			}
			if tc.engine != EngineHost && (len(r.Probes) == 0 || r.Probes[0].Name != "libcuda" || r.Probes[0].OK) {
				t.Errorf("probes %+v: want a failed libcuda probe first", r.Probes)
			}
			pool, err := gpubuf.NewPool(gpubuf.Config{Backend: e.Backend(), SlabBytes: 16 * gpubuf.Align, BudgetBytes: 32 * gpubuf.Align})
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			f, data := writeRandomFile(t, 10*gpubuf.Align)
			eng, why := e.Choose(f, f.Name(), 0, -1)
			if eng.Name() != EngineHost || why == "" {
				t.Fatalf("Choose = %s (%q)", eng.Name(), why)
			}
			if eng2, why2 := e.Choose(nil, f.Name(), 0, -1); eng2 != eng || why2 != why {
				t.Errorf("Choose(nil, path) = %s (%q), want the same answer as with the file", eng2.Name(), why2)
			}
			l, err := pool.Alloc(context.Background(), gpubuf.Owner{Session: 1, UID: uint32(os.Getuid())}, 0, 10*gpubuf.Align)
			if err != nil {
				t.Fatal(err)
			}
			got, err := eng.ReadAt(context.Background(), f, l.Slab.Memory, l.Offset, 0, l.Length)
			if err != nil || got != 10*gpubuf.Align {
				t.Fatalf("ReadAt = %d, %v", got, err)
			}
			if string(l.Slab.Memory.(gpubuf.HostMemory).HostBytes()[l.Offset:][:got]) != string(data) {
				t.Error("slab bytes differ from the file")
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero", Config{}, true},
		{"tuned", Config{Engine: EnginePosix, ChunkBytes: 16 << 20, Workers: 16, Direct: "always"}, true},
		{"bad engine", Config{Engine: "fast"}, false},
		{"unaligned chunk", Config{ChunkBytes: 1000}, false},
		{"cold chunk", Config{ColdChunkBytes: 2 << 20}, true},
		{"unaligned cold chunk", Config{ColdChunkBytes: 1000}, false},
		{"negative workers", Config{Workers: -1}, false},
		{"bad direct", Config{Direct: "sometimes"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.cfg.Validate(); (err == nil) != tc.ok {
				t.Errorf("Validate() = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestFileStatusDecoding(t *testing.T) {
	// CUfileError_t {err, cu_err} returned in one register, err in the low half.
	if err := fileStatus("op", 0); err != nil {
		t.Errorf("success decoded as %v", err)
	}
	var fe *FileError
	err := fileStatus("cuFileHandleRegister", uintptr(5027))
	if !errors.As(err, &fe) || fe.Code != 5027 || fe.CUDA != 0 {
		t.Errorf("5027 decoded as %v", err)
	}
	err = fileStatus("cuFileRead", uintptr(uint64(700)<<32|5011))
	if !errors.As(err, &fe) || fe.Code != 5011 || fe.CUDA != 700 {
		t.Errorf("5011/700 decoded as %v", err)
	}
	if n, err := ioResult("cuFileRead", uintptr(4096), 0); n != 4096 || err != nil {
		t.Errorf("ioResult(4096) = %d, %v", n, err)
	}
	neg := int64(-5027)
	if _, err := ioResult("cuFileRead", uintptr(neg), 0); !errors.As(err, &fe) || fe.Code != 5027 {
		t.Errorf("ioResult(-5027) = %v", err)
	}
}
