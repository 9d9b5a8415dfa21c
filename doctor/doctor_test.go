package doctor

import "testing"

func TestKernelVersion(t *testing.T) {
	for _, tc := range []struct {
		rel      string
		maj, min int
	}{
		{"6.18.44-fc-v595", 6, 18},
		{"6.9.0", 6, 9},
		{"5.15.0-91-generic", 5, 15},
		{"6.10rc1", 6, 10},
		{"garbage", 0, 0},
	} {
		if maj, min := kernelVersion(tc.rel); maj != tc.maj || min != tc.min {
			t.Errorf("kernelVersion(%q) = %d.%d, want %d.%d", tc.rel, maj, min, tc.maj, tc.min)
		}
	}
}
