package cufile

import (
	"fmt"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Lib is the loaded cuFile library (libcufile.so.0). It is never unloaded
// (libcufile's thread_local state crashes on dlclose). Methods are safe for
// concurrent use ("all APIs are thread-safe"); those touching GPU buffers
// must run with the buffer's context current (Driver.Do).
type Lib struct {
	lib *library
	fn  struct {
		driverOpen, getVersion, driverGetProperties uintptr
		handleRegister, handleDeregister            uintptr
		bufRegister, bufDeregister, read, write     uintptr
	}
}

// LoadLib dlopens libcufile.so.0 and resolves the symbols gdsfs uses. A host
// without GDS gets a *LibraryError.
func LoadLib() (*Lib, error) {
	lib, err := openLibrary("libcufile.so.0", "GPUDirect Storage (libcufile) is not installed; gdsfs uses its posix engine")
	if err != nil {
		return nil, err
	}
	l := &Lib{lib: lib}
	f := &l.fn
	if err := lib.bind(map[string]*uintptr{
		"cuFileDriverOpen": &f.driverOpen,
		"cuFileGetVersion": &f.getVersion, "cuFileDriverGetProperties": &f.driverGetProperties,
		"cuFileHandleRegister": &f.handleRegister, "cuFileHandleDeregister": &f.handleDeregister,
		"cuFileBufRegister": &f.bufRegister, "cuFileBufDeregister": &f.bufDeregister,
		"cuFileRead": &f.read, "cuFileWrite": &f.write,
	}, map[string]bool{"cuFileGetVersion": true}); err != nil {
		return nil, err
	}
	return l, nil
}

// fileStatus decodes a CUfileError_t returned by value: 8 bytes of INTEGER
// class, so it comes back whole in RAX (x86-64) / X0 (arm64): err in the low
// 32 bits, cu_err in the high 32.
func fileStatus(op string, r uintptr) error {
	code := int(int32(uint64(r)))
	if code == fileSuccess {
		return nil
	}
	return &FileError{Op: op, Code: code, CUDA: int(int32(uint64(r) >> 32))}
}

// DriverOpen opens the cuFile driver. Call it once, before other calls.
func (l *Lib) DriverOpen() error {
	r, _, _ := purego.SyscallN(l.fn.driverOpen)
	return fileStatus("cuFileDriverOpen", r)
}

// Version is cuFileGetVersion's 1000*major + 10*minor, or 0 when the
// library predates the call.
func (l *Lib) Version() int {
	if l.fn.getVersion == 0 {
		return 0
	}
	var v int32
	r, _, _ := purego.SyscallN(l.fn.getVersion, uintptr(unsafe.Pointer(&v)))
	if fileStatus("cuFileGetVersion", r) != nil {
		return 0
	}
	return int(v)
}

// DriverProps is the part of CUfileDrvProps_t gdsfs reports.
type DriverProps struct {
	NVFSMajor, NVFSMinor   uint32
	MaxDirectIOSizeKiB     uint64
	StatusFlags            uint32 // CUfileDriverStatusFlags bits: filesystems GDS supports here
	ControlFlags           uint32 // bit 0 poll mode, bit 1 compat mode allowed
	FeatureFlags           uint32 // bit 1 batch IO, bit 2 streams, bit 4 P2P
	MaxDeviceCacheSizeKiB  uint32
	PerBufferCacheSizeKiB  uint32
	MaxPinnedMemSizeKiB    uint32
	MaxBatchIOSize         uint32
	MaxBatchIOTimeoutMsecs uint32
}

// CompatAllowed reports whether cuFile may fall back to POSIX I/O itself.
func (p DriverProps) CompatAllowed() bool { return p.ControlFlags&(1<<1) != 0 }

// DriverProps returns the driver's properties (cuFileDriverGetProperties).
func (l *Lib) DriverProps() (DriverProps, error) {
	// CUfileDrvProps_t: 56 bytes on LP64 (anchors-gds.md 2.2, checked
	// against CUDA 13.0's cufile.h): see the offsets below.
	var raw [56]byte
	r, _, _ := purego.SyscallN(l.fn.driverGetProperties, uintptr(unsafe.Pointer(&raw[0])))
	if err := fileStatus("cuFileDriverGetProperties", r); err != nil {
		return DriverProps{}, err
	}
	u32 := func(off int) uint32 { return *(*uint32)(unsafe.Pointer(&raw[off])) }
	return DriverProps{
		NVFSMajor: u32(0), NVFSMinor: u32(4),
		MaxDirectIOSizeKiB: *(*uint64)(unsafe.Pointer(&raw[16])),
		StatusFlags:        u32(24), ControlFlags: u32(28), FeatureFlags: u32(32),
		MaxDeviceCacheSizeKiB: u32(36), PerBufferCacheSizeKiB: u32(40), MaxPinnedMemSizeKiB: u32(44),
		MaxBatchIOSize: u32(48), MaxBatchIOTimeoutMsecs: u32(52),
	}, nil
}

// cuFileDescr is CUfileDescr_t: type at 0, the fd/handle union at 8 (the
// union is pointer-sized and pointer-aligned), fs_ops at 16; 24 bytes.
type cuFileDescr struct {
	typ   int32
	_     int32
	fd    int32
	_     int32
	fsOps uintptr
}

const handleTypeOpaqueFD = 1

// HandleRegister registers fd with cuFile and returns the CUfileHandle_t.
// The fd must stay open until HandleDeregister.
func (l *Lib) HandleRegister(fd int) (uintptr, error) {
	d := cuFileDescr{typ: handleTypeOpaqueFD, fd: int32(fd)}
	var h uintptr
	r, _, _ := purego.SyscallN(l.fn.handleRegister, uintptr(unsafe.Pointer(&h)), uintptr(unsafe.Pointer(&d)))
	if err := fileStatus("cuFileHandleRegister", r); err != nil {
		return 0, err
	}
	return h, nil
}

// HandleDeregister releases a handle from HandleRegister.
func (l *Lib) HandleDeregister(h uintptr) {
	purego.SyscallN(l.fn.handleDeregister, h)
}

// BufRegister registers device memory [p, p+size) for cuFile I/O.
func (l *Lib) BufRegister(p uintptr, size int64) error {
	r, _, _ := purego.SyscallN(l.fn.bufRegister, p, uintptr(size), 0)
	return fileStatus("cuFileBufRegister", r)
}

// BufDeregister deregisters memory from BufRegister.
func (l *Lib) BufDeregister(p uintptr) error {
	r, _, _ := purego.SyscallN(l.fn.bufDeregister, p)
	return fileStatus("cuFileBufDeregister", r)
}

// ioResult decodes cuFileRead/cuFileWrite's ssize_t: bytes moved, -1 with
// errno for a filesystem error, other negatives for -CUfileOpError.
func ioResult(op string, r, errno uintptr) (int64, error) {
	n := int64(r)
	switch {
	case n >= 0:
		return n, nil
	case n == -1:
		return 0, fmt.Errorf("cufile: %s: filesystem error (errno %d)", op, errno)
	default:
		return 0, &FileError{Op: op, Code: int(-n)}
	}
}

// Read reads size bytes at fileOff into the registered buffer base+bufOff.
func (l *Lib) Read(h, base uintptr, size, fileOff, bufOff int64) (int64, error) {
	r, _, errno := purego.SyscallN(l.fn.read, h, base, uintptr(size), uintptr(fileOff), uintptr(bufOff))
	return ioResult("cuFileRead", r, errno)
}

// Write writes size bytes from base+bufOff to the file at fileOff.
func (l *Lib) Write(h, base uintptr, size, fileOff, bufOff int64) (int64, error) {
	r, _, errno := purego.SyscallN(l.fn.write, h, base, uintptr(size), uintptr(fileOff), uintptr(bufOff))
	return ioResult("cuFileWrite", r, errno)
}
