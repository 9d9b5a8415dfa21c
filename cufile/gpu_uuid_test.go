package cufile

// GPU test: runs only where libcuda.so.1 loads and a device is present.

import (
	"os/exec"
	"strings"
	"testing"
)

// TestGPUDeviceUUIDs checks that the daemon's device UUIDs are the ones
// nvidia-smi names for the same ordinals: what clients match their own
// CUDA devices against (docs/protocol.md, section 2 "Device").
func TestGPUDeviceUUIDs(t *testing.T) {
	e := gpuEngines(t)
	got := e.DeviceUUIDs()
	if len(got) != e.Driver().Devices() {
		t.Fatalf("DeviceUUIDs() = %q for %d devices", got, e.Driver().Devices())
	}
	seen := map[string]bool{}
	for i, u := range got {
		if !strings.HasPrefix(u, "GPU-") || len(u) != 40 || seen[u] {
			t.Errorf("device %d: UUID %q is not a distinct GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", i, u)
		}
		seen[u] = true
	}
	out, err := exec.Command("nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader").Output()
	if err != nil {
		t.Logf("nvidia-smi not usable (%v): UUIDs not compared with it", err)
		return
	}
	// nvidia-smi lists GPUs in PCI bus order, CUDA in its own (fastest
	// first unless CUDA_DEVICE_ORDER=PCI_BUS_ID): compare the sets.
	all := map[string]bool{}
	for _, l := range strings.Fields(string(out)) {
		all["GPU-"+strings.ToLower(strings.TrimPrefix(l, "GPU-"))] = true
	}
	for i, u := range got {
		if !all[u] {
			t.Errorf("device %d: UUID %s is not among nvidia-smi's %q", i, u, strings.Fields(string(out)))
		}
	}
}
