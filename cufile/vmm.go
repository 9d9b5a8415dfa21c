package cufile

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// CUDA virtual memory management (VMM): physical allocations (cuMemCreate)
// mapped into reserved address ranges, exportable as POSIX file
// descriptors (cuMemExportToShareableHandle). Unlike a legacy IPC handle,
// whose 64 bytes any process that learns them can open, a descriptor
// reaches only the process it is passed to (SCM_RIGHTS), and the physical
// memory behind it lives until the last process that imported it lets go:
// a client's mapping stays valid, and never shows another allocation,
// after the daemon frees the slab.

// vmmFuncs are the VMM entry points (CUDA 10.2+), bound optionally: a
// driver without them gets legacy cuMemAlloc slabs.
type vmmFuncs struct {
	cuDeviceGetAttribute                                         uintptr
	cuMemGetAllocationGranularity, cuMemCreate, cuMemRelease     uintptr
	cuMemAddressReserve, cuMemAddressFree, cuMemMap, cuMemUnmap  uintptr
	cuMemSetAccess                                               uintptr
	cuMemExportToShareableHandle, cuMemImportFromShareableHandle uintptr
}

func (d *Driver) bindVMM() {
	f := &d.vmm
	fns := map[string]*uintptr{
		"cuDeviceGetAttribute":           &f.cuDeviceGetAttribute,
		"cuMemGetAllocationGranularity":  &f.cuMemGetAllocationGranularity,
		"cuMemCreate":                    &f.cuMemCreate,
		"cuMemRelease":                   &f.cuMemRelease,
		"cuMemAddressReserve":            &f.cuMemAddressReserve,
		"cuMemAddressFree":               &f.cuMemAddressFree,
		"cuMemMap":                       &f.cuMemMap,
		"cuMemUnmap":                     &f.cuMemUnmap,
		"cuMemSetAccess":                 &f.cuMemSetAccess,
		"cuMemExportToShareableHandle":   &f.cuMemExportToShareableHandle,
		"cuMemImportFromShareableHandle": &f.cuMemImportFromShareableHandle,
	}
	optional := map[string]bool{}
	for n := range fns {
		optional[n] = true
	}
	_ = d.lib.bind(fns, optional) // all optional: cannot fail
}

// CUDA enum values (cuda.h).
const (
	cuDevAttrVMMSupported       = 102 // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
	cuDevAttrPosixFDSupported   = 103 // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
	cuDevAttrRDMAWithVMM        = 110 // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
	cuMemAllocationTypePinned   = 1   // CU_MEM_ALLOCATION_TYPE_PINNED
	cuMemHandleTypePosixFD      = 1   // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	cuMemLocationTypeDevice     = 1   // CU_MEM_LOCATION_TYPE_DEVICE
	cuMemAccessProtReadWrite    = 3   // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	cuMemAllocGranularityRecomm = 1   // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
)

// memAllocationProp is CUmemAllocationProp (32 bytes on x86-64).
type memAllocationProp struct {
	typ         int32 // CUmemAllocationType
	handleTypes int32 // CUmemAllocationHandleType
	locType     int32 // CUmemLocation.type
	locID       int32 // CUmemLocation.id
	win32Meta   uintptr
	compression uint8
	rdma        uint8 // allocFlags.gpuDirectRDMACapable
	usage       uint16
	reserved    [4]uint8
}

// memAccessDesc is CUmemAccessDesc (12 bytes).
type memAccessDesc struct {
	locType, locID int32
	flags          int32
}

var (
	_ = [1]struct{}{}[unsafe.Sizeof(memAllocationProp{})-32]
	_ = [1]struct{}{}[unsafe.Sizeof(memAccessDesc{})-12]
)

// VMMAllocation is one physical allocation mapped at Ptr for Bytes bytes
// (a multiple of the device's allocation granularity).
type VMMAllocation struct {
	Handle uint64 // CUmemGenericAllocationHandle
	Ptr    uintptr
	Bytes  int64
	RDMA   bool // created GPUDirect-RDMA capable (for cuFile P2P)
}

// VMMSupport reports whether device can allocate VMM memory exportable as
// POSIX file descriptors (nil) or why not, and whether the allocation can
// be GPUDirect-RDMA capable.
func (d *Driver) VMMSupport(device int) (rdma bool, err error) {
	f := &d.vmm
	if f.cuDeviceGetAttribute == 0 || f.cuMemCreate == 0 || f.cuMemExportToShareableHandle == 0 ||
		f.cuMemImportFromShareableHandle == 0 || f.cuMemMap == 0 || f.cuMemSetAccess == 0 ||
		f.cuMemAddressReserve == 0 || f.cuMemGetAllocationGranularity == 0 {
		return false, errors.New("the driver lacks the CUDA virtual memory management API (cuMemCreate and friends, CUDA 10.2+)")
	}
	if device < 0 || device >= len(d.devs) {
		return false, fmt.Errorf("cufile: CUDA device %d does not exist", device)
	}
	attr := func(a int) (int32, error) {
		var v int32
		err := d.check("cuDeviceGetAttribute", cuCall(f.cuDeviceGetAttribute, uintptr(unsafe.Pointer(&v)), uintptr(a), uintptr(d.devs[device])))
		return v, err
	}
	if v, err := attr(cuDevAttrVMMSupported); err != nil || v == 0 {
		return false, fmt.Errorf("device %d does not support virtual memory management (%v)", device, err)
	}
	if v, err := attr(cuDevAttrPosixFDSupported); err != nil || v == 0 {
		return false, fmt.Errorf("device %d cannot export memory as POSIX file descriptors (%v)", device, err)
	}
	v, err := attr(cuDevAttrRDMAWithVMM)
	return err == nil && v != 0, nil
}

func (d *Driver) allocProp(device int, rdma bool) memAllocationProp {
	p := memAllocationProp{typ: cuMemAllocationTypePinned, handleTypes: cuMemHandleTypePosixFD,
		locType: cuMemLocationTypeDevice, locID: d.devs[device]}
	if rdma {
		p.rdma = 1
	}
	return p
}

// VMMGranularity is the recommended allocation granularity of device.
func (d *Driver) VMMGranularity(device int) (int64, error) {
	if device < 0 || device >= len(d.devs) {
		return 0, fmt.Errorf("cufile: CUDA device %d does not exist", device)
	}
	prop := d.allocProp(device, false)
	var g uintptr
	err := d.check("cuMemGetAllocationGranularity", cuCall(d.vmm.cuMemGetAllocationGranularity,
		uintptr(unsafe.Pointer(&g)), uintptr(unsafe.Pointer(&prop)), cuMemAllocGranularityRecomm))
	if err == nil && g == 0 {
		err = errors.New("cufile: cuMemGetAllocationGranularity returned 0")
	}
	return int64(g), err
}

// VMMAlloc creates size bytes (rounded up to the granularity) of pinned
// device memory exportable as a POSIX file descriptor, maps it read-write
// for device and returns it. rdma asks for GPUDirect-RDMA capable memory.
func (d *Driver) VMMAlloc(device int, size int64, rdma bool) (VMMAllocation, error) {
	g, err := d.VMMGranularity(device)
	if err != nil {
		return VMMAllocation{}, err
	}
	a := VMMAllocation{Bytes: (size + g - 1) / g * g, RDMA: rdma}
	prop := d.allocProp(device, rdma)
	err = d.Do(device, func() error {
		if err := d.check("cuMemCreate", cuCall(d.vmm.cuMemCreate, uintptr(unsafe.Pointer(&a.Handle)), uintptr(a.Bytes), uintptr(unsafe.Pointer(&prop)), 0)); err != nil {
			return err
		}
		if err := d.mapHandle(device, a.Handle, a.Bytes, &a.Ptr); err != nil {
			_ = d.check("cuMemRelease", cuCall(d.vmm.cuMemRelease, uintptr(a.Handle)))
			return err
		}
		return nil
	})
	return a, err
}

// mapHandle reserves bytes of address space, maps handle there and grants
// device read-write access. It runs on a thread with device's context.
func (d *Driver) mapHandle(device int, handle uint64, bytes int64, ptr *uintptr) error {
	var p uint64
	if err := d.check("cuMemAddressReserve", cuCall(d.vmm.cuMemAddressReserve, uintptr(unsafe.Pointer(&p)), uintptr(bytes), 0, 0, 0)); err != nil {
		return err
	}
	if err := d.check("cuMemMap", cuCall(d.vmm.cuMemMap, uintptr(p), uintptr(bytes), 0, uintptr(handle), 0)); err != nil {
		_ = d.check("cuMemAddressFree", cuCall(d.vmm.cuMemAddressFree, uintptr(p), uintptr(bytes)))
		return err
	}
	acc := memAccessDesc{locType: cuMemLocationTypeDevice, locID: d.devs[device], flags: cuMemAccessProtReadWrite}
	if err := d.check("cuMemSetAccess", cuCall(d.vmm.cuMemSetAccess, uintptr(p), uintptr(bytes), uintptr(unsafe.Pointer(&acc)), 1)); err != nil {
		_ = d.check("cuMemUnmap", cuCall(d.vmm.cuMemUnmap, uintptr(p), uintptr(bytes)))
		_ = d.check("cuMemAddressFree", cuCall(d.vmm.cuMemAddressFree, uintptr(p), uintptr(bytes)))
		return err
	}
	*ptr = uintptr(p)
	return nil
}

// VMMFree unmaps a and releases its handle. The physical memory is freed
// when no process maps or holds it any more: a client that imported it
// keeps it (and it keeps its bytes) until it unmaps or exits.
func (d *Driver) VMMFree(device int, a VMMAllocation) error {
	return d.Do(device, func() error {
		return errors.Join(
			d.check("cuMemUnmap", cuCall(d.vmm.cuMemUnmap, a.Ptr, uintptr(a.Bytes))),
			d.check("cuMemAddressFree", cuCall(d.vmm.cuMemAddressFree, a.Ptr, uintptr(a.Bytes))),
			d.check("cuMemRelease", cuCall(d.vmm.cuMemRelease, uintptr(a.Handle))))
	})
}

// VMMExportFD returns a new POSIX file descriptor of the allocation
// handle, close-on-exec; the caller closes it.
func (d *Driver) VMMExportFD(device int, handle uint64) (int, error) {
	var fd int32 = -1
	err := d.Do(device, func() error {
		return d.check("cuMemExportToShareableHandle", cuCall(d.vmm.cuMemExportToShareableHandle,
			uintptr(unsafe.Pointer(&fd)), uintptr(handle), cuMemHandleTypePosixFD, 0))
	})
	if err == nil {
		// The driver does not promise O_CLOEXEC: a process the daemon
		// starts (fusermount3) must not inherit a slab.
		unix.CloseOnExec(int(fd))
	}
	return int(fd), err
}

// VMMImport maps bytes of the allocation behind a POSIX file descriptor
// another process exported (a client's side; the Go CLI and tests use it)
// and returns its address here. The descriptor may be closed afterwards;
// unmap with VMMUnmap.
func (d *Driver) VMMImport(device int, fd int, bytes int64) (uintptr, error) {
	if _, err := d.VMMSupport(device); err != nil {
		return 0, err
	}
	var p uintptr
	err := d.Do(device, func() error {
		var h uint64
		// The descriptor goes by value in the void* osHandle argument.
		if err := d.check("cuMemImportFromShareableHandle", cuCall(d.vmm.cuMemImportFromShareableHandle,
			uintptr(unsafe.Pointer(&h)), uintptr(fd), cuMemHandleTypePosixFD)); err != nil {
			return err
		}
		err := d.mapHandle(device, h, bytes, &p)
		// The mapping holds the memory; the handle is not needed any more.
		return errors.Join(err, d.check("cuMemRelease", cuCall(d.vmm.cuMemRelease, uintptr(h))))
	})
	return p, err
}

// VMMUnmap unmaps what VMMImport mapped.
func (d *Driver) VMMUnmap(device int, p uintptr, bytes int64) error {
	return d.Do(device, func() error {
		return errors.Join(
			d.check("cuMemUnmap", cuCall(d.vmm.cuMemUnmap, p, uintptr(bytes))),
			d.check("cuMemAddressFree", cuCall(d.vmm.cuMemAddressFree, p, uintptr(bytes))))
	})
}
