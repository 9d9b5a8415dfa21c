package cufile

// GPU tests: they run only where libcuda.so.1 loads and a device is present
// (scripts/gpu-test.sh runs them on the GPU machine from a static test
// binary); elsewhere they skip.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// gpuEngines opens the engines or skips the test without a GPU.
func gpuEngines(t *testing.T) *Engines {
	t.Helper()
	d, err := LoadDriver()
	if err != nil {
		t.Skipf("no GPU: %v", err)
	}
	_ = d
	e, err := Open(Config{Engine: EngineAuto})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
	})
	for _, p := range e.Probe().Probes {
		t.Logf("probe %-18s ok=%-5v %s", p.Name, p.OK, p.Detail)
	}
	return e
}

// gpuTestFile writes n pseudo-random bytes under GDSFS_GPU_TEST_DIR (a
// directory on the disk under test) or t.TempDir().
func gpuTestFile(t *testing.T, n int64) (*os.File, []byte) {
	t.Helper()
	dir := os.Getenv("GDSFS_GPU_TEST_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	data := make([]byte, n)
	r := rand.NewChaCha8([32]byte{1, 2, 3})
	_, _ = r.Read(data)
	p := filepath.Join(dir, fmt.Sprintf("gpu-test-%d.dat", n))
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(p) })
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, data
}

// gpuEngineCases lists every GPU engine that can run here.
func gpuEngineCases(t *testing.T, e *Engines, f *os.File) []Engine {
	cases := []Engine{
		newPosixEngine(cudaStager{d: e.drv}, Options{Direct: "never"}),
		namedEngine{newPosixEngine(cudaStager{d: e.drv}, Options{Direct: "always"}), "posix-direct"},
	}
	if e.gds == nil {
		t.Log("gds engine not available here (see probes)")
	} else if err := e.gds.probe(f); err != nil {
		t.Logf("gds engine refuses the test file: %v", err)
	} else {
		cases = append(cases, e.gds)
	}
	return cases
}

type namedEngine struct {
	Engine
	name string
}

func (n namedEngine) Name() string { return n.name }

func TestGPUReadRandomRanges(t *testing.T) {
	e := gpuEngines(t)
	const fileSize = 1<<30 + 12345
	f, data := gpuTestFile(t, fileSize)
	ctx := context.Background()
	memSize := int64(1<<30 + 64<<20)
	mem, err := e.Backend().Alloc(ctx, 0, memSize, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	dm := mem.(gpubuf.DeviceMemory)
	type rng struct{ memOff, fileOff, n int64 }
	ranges := []rng{
		{0, 0, 1}, {4096, 1, 1}, {1, 4095, 2}, {4096, 4096, 4096}, {123, 12345, 1<<20 + 7},
		{0, 64 << 20, 64 << 20}, {8191, 3<<20 + 5, 100<<20 + 3}, {0, 0, 1 << 30},
		{4096, fileSize - 5000, 20000}, // across EOF: short read of 5000
	}
	r := rand.New(rand.NewPCG(42, 42))
	for range 12 {
		n := int64(1) << r.IntN(28)
		n += r.Int64N(n)
		off := r.Int64N(fileSize - n)
		moff := r.Int64N(memSize - n)
		if r.IntN(2) == 0 {
			off &^= gpubuf.Align - 1
			moff &^= gpubuf.Align - 1
		}
		ranges = append(ranges, rng{moff, off, n})
	}
	for _, eng := range gpuEngineCases(t, e, f) {
		t.Run(eng.Name(), func(t *testing.T) {
			for _, c := range ranges {
				want := min(c.n, fileSize-c.fileOff)
				// Sentinel around the destination catches stray writes.
				lo, hi := max(0, c.memOff-4096), min(memSize, c.memOff+c.n+4096)
				if err := e.drv.Memset(0, dm.DevicePtr()+uintptr(lo), 0xA5, hi-lo); err != nil {
					t.Fatal(err)
				}
				got, err := eng.ReadAt(ctx, f, mem, c.memOff, c.fileOff, c.n)
				if err != nil || got != want {
					t.Fatalf("ReadAt(mem %d, file %d, n %d) = %d, %v; want %d", c.memOff, c.fileOff, c.n, got, err, want)
				}
				back := make([]byte, hi-lo)
				if err := e.drv.CopyDtoH(0, back, dm.DevicePtr()+uintptr(lo)); err != nil {
					t.Fatal(err)
				}
				pre, body, post := back[:c.memOff-lo], back[c.memOff-lo:c.memOff-lo+got], back[c.memOff-lo+got:]
				if !bytes.Equal(body, data[c.fileOff:c.fileOff+got]) {
					t.Fatalf("range (mem %d, file %d, n %d): bytes differ from the file", c.memOff, c.fileOff, c.n)
				}
				if !isAllByte(pre, 0xA5) || !isAllByte(post, 0xA5) {
					t.Fatalf("range (mem %d, file %d, n %d): bytes outside the range were written", c.memOff, c.fileOff, c.n)
				}
			}
			t.Logf("%s: %d ranges byte-exact (1 B to 1 GiB, aligned and not)", eng.Name(), len(ranges))
		})
	}
}

func isAllByte(b []byte, v byte) bool {
	for _, c := range b {
		if c != v {
			return false
		}
	}
	return true
}

func TestGPUWriteRoundTrip(t *testing.T) {
	e := gpuEngines(t)
	ctx := context.Background()
	const n = 96<<20 + 333
	mem, err := e.Backend().Alloc(ctx, 0, 128<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	dm := mem.(gpubuf.DeviceMemory)
	src := make([]byte, 128<<20)
	_, _ = rand.NewChaCha8([32]byte{9}).Read(src)
	if err := e.drv.CopyHtoD(0, dm.DevicePtr(), src); err != nil {
		t.Fatal(err)
	}
	f, orig := gpuTestFile(t, 100<<20)
	for _, eng := range gpuEngineCases(t, e, f) {
		t.Run(eng.Name(), func(t *testing.T) {
			const memOff, fileOff = 4096 + 17, 8192 + 5
			got, err := eng.WriteAt(ctx, f, mem, memOff, fileOff, n)
			if err != nil || got != n {
				t.Fatalf("WriteAt = %d, %v", got, err)
			}
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
			back, err := os.ReadFile(f.Name())
			if err != nil {
				t.Fatal(err)
			}
			want := append([]byte(nil), orig...)
			want = append(want[:fileOff], src[memOff:memOff+n]...)
			if len(back) < len(want) {
				want = want[:len(back)]
			}
			if !bytes.Equal(back[:fileOff+n], want[:fileOff+n]) {
				t.Fatal("file differs from the device bytes written")
			}
			t.Logf("%s: %d bytes written and read back byte-exact", eng.Name(), n)
		})
	}
}

// TestGPUNoMemoryCrossesUIDs checks on real device memory that another
// uid gets new memory, never the previous uid's (gpubuf I1): alice's idle
// slab is freed to make room and bob's slab holds none of her bytes.
func TestGPUNoMemoryCrossesUIDs(t *testing.T) {
	e := gpuEngines(t)
	ctx := context.Background()
	p, err := gpubuf.NewPool(gpubuf.Config{Backend: e.Backend(), SlabBytes: 2 << 20, BudgetBytes: 2 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	alice := gpubuf.Owner{Session: 1, UID: 1001}
	l, err := p.Alloc(ctx, alice, 0, 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	dm := l.Slab.Memory.(gpubuf.DeviceMemory)
	if err := e.drv.Memset(0, dm.DevicePtr(), 0x5A, 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(alice, l.ID); err != nil {
		t.Fatal(err)
	}
	bob := gpubuf.Owner{Session: 2, UID: 1002}
	l2, err := p.Alloc(ctx, bob, 0, 4096)
	if err != nil || l2.Slab == l.Slab {
		t.Fatalf("bob's lease: %v (alice's slab %v)", err, l2 != nil && l2.Slab == l.Slab)
	}
	if _, err := p.Slab(l.Slab.ID); err == nil {
		t.Error("alice's idle slab was not freed to make room for bob")
	}
	back := make([]byte, 2<<20)
	if err := e.drv.CopyDtoH(0, back, l2.Slab.Memory.(gpubuf.DeviceMemory).DevicePtr()); err != nil {
		t.Fatal(err)
	}
	if !isAllByte(back, 0) {
		t.Fatal("bob's new slab holds bytes it was not given (alice's?)")
	}
}

// TestGPUIPCExport exports a slab and has a second process (python3,
// ctypes) map it and hash the lease's bytes: a VMM slab's POSIX descriptor
// passed as the child's fd 3 (cuMemImportFromShareableHandle), or a legacy
// slab's 64-byte IPC handle (cuIpcOpenMemHandle_v2, which cannot be opened
// in the exporting process).
func TestGPUIPCExport(t *testing.T) {
	e := gpuEngines(t)
	script := os.Getenv("GDSFS_IPC_CHECK")
	if script == "" {
		script = "../scripts/gpu_ipc_check.py"
	}
	if _, err := os.Stat(script); err != nil {
		t.Fatalf("IPC checker %s: %v (set GDSFS_IPC_CHECK)", script, err)
	}
	ctx := context.Background()
	p, err := gpubuf.NewPool(gpubuf.Config{Backend: e.Backend(), SlabBytes: 8 << 20, BudgetBytes: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	o := gpubuf.Owner{Session: 1, UID: uint32(os.Getuid())}
	if _, err := p.Alloc(ctx, o, 0, 12345); err != nil { // the lease under test is not at offset 0
		t.Fatal(err)
	}
	l, err := p.Alloc(ctx, o, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, 1<<20)
	_, _ = rand.NewChaCha8([32]byte{7}).Read(payload)
	dm := l.Slab.Memory.(gpubuf.DeviceMemory)
	if err := e.drv.CopyHtoD(0, dm.DevicePtr()+uintptr(l.Offset), payload); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(payload)
	py := os.Getenv("GDSFS_PYTHON")
	if py == "" {
		py = "python3"
	}
	var cmd *exec.Cmd
	if fe, ok := l.Slab.Memory.(interface {
		ExportFD() (*os.File, int64, error)
	}); ok {
		f, n, err := fe.ExportFD()
		if err != nil {
			t.Fatalf("ExportFD: %v", err)
		}
		defer f.Close()
		cmd = exec.CommandContext(ctx, py, script, fmt.Sprintf("fd:3:%d", n), fmt.Sprint(l.Offset), fmt.Sprint(len(payload)), hex.EncodeToString(sum[:]))
		cmd.ExtraFiles = []*os.File{f}
	} else {
		h, err := p.Export(o, l.Slab.ID)
		if err != nil || len(h) != 64 {
			t.Fatalf("Export = %d bytes, %v", len(h), err)
		}
		cmd = exec.CommandContext(ctx, py, script, hex.EncodeToString(h), fmt.Sprint(l.Offset), fmt.Sprint(len(payload)), hex.EncodeToString(sum[:]))
	}
	out, err := cmd.CombinedOutput()
	t.Logf("%s", strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("second process could not read the exported slab: %v", err)
	}
}

// TestGPUWriteDirect writes device memory over a cached file through the
// posix engine's O_DIRECT write path (D2H into pinned bounce buffers,
// pipelined with the pwrites): byte-exact for aligned and unaligned ranges,
// coherent for a reader who had read the old bytes, the aligned body out of
// the page cache afterwards; it logs buffered vs O_DIRECT WriteAt+fsync of
// 256 MiB (figures, not assertions).
func TestGPUWriteDirect(t *testing.T) {
	e := gpuEngines(t)
	ctx := context.Background()
	const memSize = 300 << 20
	mem, err := e.Backend().Alloc(ctx, 0, memSize, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	dm := mem.(gpubuf.DeviceMemory)
	src := make([]byte, memSize)
	_, _ = rand.NewChaCha8([32]byte{11}).Read(src)
	if err := e.drv.CopyHtoD(0, dm.DevicePtr(), src); err != nil {
		t.Fatal(err)
	}
	direct := newPosixEngine(cudaStager{d: e.drv}, Options{Direct: "auto"})
	defer direct.Close()
	f, orig := gpuTestFile(t, 64<<20)
	directOK := canDirect(t, filepath.Dir(f.Name()))
	for _, c := range []struct {
		name            string
		memOff, fileOff int64
		n               int64
	}{
		{"aligned", 0, 0, 32 << 20},
		{"unaligned head and tail", 4096 + 17, 8192 + 17, 40<<20 + 333},
		{"memory out of line", 1, 4096, 16 << 20},
		{"extends the file", 0, 60 << 20, 24<<20 + 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := f.ReadAt(make([]byte, len(orig)), 0); err != nil { // cached old bytes
				t.Fatal(err)
			}
			got, err := direct.WriteAt(ctx, f, mem, c.memOff, c.fileOff, c.n)
			if err != nil || got != c.n {
				t.Fatalf("WriteAt = %d, %v", got, err)
			}
			head, body, _ := alignedSplit(c.fileOff, c.n)
			if cached, ok := pagecache.Cached(f, c.fileOff+head, body); ok && directOK && cached != 0 {
				t.Errorf("%d of %d body bytes cached after an O_DIRECT write", cached, body)
			}
			copy(orig[c.fileOff:], src[c.memOff:c.memOff+min(c.n, int64(len(orig))-c.fileOff)])
			want := orig
			if end := c.fileOff + c.n; end > int64(len(orig)) {
				want = append(append([]byte(nil), orig...), src[c.memOff+int64(len(orig))-c.fileOff:c.memOff+c.n]...)
				orig = want
			}
			back := make([]byte, len(want))
			if _, err := f.ReadAt(back, 0); err != nil || !bytes.Equal(back, want) {
				t.Fatalf("the file differs from the device bytes written (%v)", err)
			}
		})
	}
	const n = 256 << 20
	for _, mode := range []string{"never", "always", "always/preallocated"} {
		policy, prealloc := strings.CutSuffix(mode, "/preallocated")
		eng := newPosixEngine(cudaStager{d: e.drv}, Options{Direct: policy})
		p := filepath.Join(filepath.Dir(f.Name()), "gpu-write-rate.dat")
		w, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if prealloc {
			if err := unix.Fallocate(int(w.Fd()), 0, 0, n); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := eng.WriteAt(ctx, w, mem, 0, 0, n); err != nil {
			t.Fatal(err)
		}
		if err := w.Sync(); err != nil {
			t.Fatal(err)
		}
		secs := time.Since(start).Seconds()
		w.Close()
		os.Remove(p)
		eng.Close()
		t.Logf("posix WriteAt+fsync of 256 MiB, --direct-io %s: %.2f GB/s", mode, float64(n)/secs/1e9)
	}
}
