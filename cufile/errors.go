package cufile

import (
	"errors"
	"fmt"
)

// LibraryError reports a shared library that could not be loaded (or lacks a
// symbol gdsfs needs). It is what every CUDA entry point returns on a host
// without the NVIDIA driver or without GDS; callers fall back, never crash.
type LibraryError struct {
	Lib  string // "libcuda.so.1" or "libcufile.so.0"
	Hint string // what it means for the user
	Err  error
}

func (e *LibraryError) Error() string {
	return fmt.Sprintf("cufile: %s not loadable: %v (%s)", e.Lib, e.Err, e.Hint)
}

func (e *LibraryError) Unwrap() error { return e.Err }

// ErrNoDevice reports a driver that loaded but has no usable CUDA device.
var ErrNoDevice = errors.New("cufile: no CUDA device")

// CUDAError is a failed CUDA driver API call.
type CUDAError struct {
	Op   string // the driver function, e.g. "cuMemAlloc_v2"
	Code int    // CUresult
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY", when the driver could name it
}

func (e *CUDAError) Error() string {
	if e.Name != "" {
		return fmt.Sprintf("cufile: %s: %s (%d)", e.Op, e.Name, e.Code)
	}
	return fmt.Sprintf("cufile: %s: CUresult %d", e.Op, e.Code)
}

// FileError is a failed cuFile call: Code is the CUfileOpError (5000 and up),
// CUDA the CUresult cuFile reports alongside CU_FILE_CUDA_DRIVER_ERROR.
type FileError struct {
	Op   string
	Code int
	CUDA int
}

// cuFile error codes gdsfs tells apart (cufile.h CUfileOpError).
const (
	fileSuccess             = 0
	fileCUDADriverError     = 5011
	fileMemoryAlreadyReg    = 5023
	fileHandleNotRegistered = 5027
)

var fileErrorNames = map[int]string{
	5001: "CU_FILE_DRIVER_NOT_INITIALIZED",
	5002: "CU_FILE_DRIVER_INVALID_PROPS",
	5003: "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
	5004: "CU_FILE_DRIVER_VERSION_MISMATCH",
	5005: "CU_FILE_DRIVER_VERSION_READ_ERROR",
	5006: "CU_FILE_DRIVER_CLOSING",
	5007: "CU_FILE_PLATFORM_NOT_SUPPORTED",
	5008: "CU_FILE_IO_NOT_SUPPORTED",
	5009: "CU_FILE_DEVICE_NOT_SUPPORTED",
	5010: "CU_FILE_NVFS_DRIVER_ERROR",
	5011: "CU_FILE_CUDA_DRIVER_ERROR",
	5012: "CU_FILE_CUDA_POINTER_INVALID",
	5013: "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
	5014: "CU_FILE_CUDA_POINTER_RANGE_ERROR",
	5015: "CU_FILE_CUDA_CONTEXT_MISMATCH",
	5016: "CU_FILE_INVALID_MAPPING_SIZE",
	5017: "CU_FILE_INVALID_MAPPING_RANGE",
	5018: "CU_FILE_INVALID_FILE_TYPE",
	5019: "CU_FILE_INVALID_FILE_OPEN_FLAG",
	5020: "CU_FILE_DIO_NOT_SET",
	5022: "CU_FILE_INVALID_VALUE",
	5023: "CU_FILE_MEMORY_ALREADY_REGISTERED",
	5024: "CU_FILE_MEMORY_NOT_REGISTERED",
	5025: "CU_FILE_PERMISSION_DENIED",
	5026: "CU_FILE_DRIVER_ALREADY_OPEN",
	5027: "CU_FILE_HANDLE_NOT_REGISTERED",
	5028: "CU_FILE_HANDLE_ALREADY_REGISTERED",
	5029: "CU_FILE_DEVICE_NOT_FOUND",
	5030: "CU_FILE_INTERNAL_ERROR",
	5031: "CU_FILE_GETNEWFD_FAILED",
	5033: "CU_FILE_NVFS_SETUP_ERROR",
	5034: "CU_FILE_IO_DISABLED",
	5035: "CU_FILE_BATCH_SUBMIT_FAILED",
	5036: "CU_FILE_GPU_MEMORY_PINNING_FAILED",
	5037: "CU_FILE_BATCH_FULL",
	5038: "CU_FILE_ASYNC_NOT_SUPPORTED",
}

func (e *FileError) Error() string {
	name := fileErrorNames[e.Code]
	if name == "" {
		name = "CUfileOpError"
	}
	if e.Code == fileCUDADriverError {
		return fmt.Sprintf("cufile: %s: %s (%d, CUresult %d)", e.Op, name, e.Code, e.CUDA)
	}
	return fmt.Sprintf("cufile: %s: %s (%d)", e.Op, name, e.Code)
}
