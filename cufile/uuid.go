package cufile

import "fmt"

// UUID is a CUDA device's 16-byte UUID (CUuuid), the identity of a GPU
// that does not depend on which devices a process sees: CUDA ordinals
// are positions in the process's CUDA_VISIBLE_DEVICES view, UUIDs are
// the same in every process on the node.
type UUID [16]byte

// String spells u as nvidia-smi -L and CUDA_VISIBLE_DEVICES do:
// "GPU-" and the 16 bytes in lowercase hex, grouped 8-4-4-4-12. The
// daemon publishes device UUIDs in this form (docs/protocol.md, STATUS).
func (u UUID) String() string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}
