package cufile

import "testing"

func TestUUIDString(t *testing.T) {
	tests := []struct {
		name string
		u    UUID
		want string
	}{
		{"zero", UUID{}, "GPU-00000000-0000-0000-0000-000000000000"},
		{"bytes in order", UUID{0x4a, 0x8c, 0x2a, 0x6e, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xfe, 0xdc, 0xba, 0x98},
			"GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba98"},
		{"all ones", UUID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
			"GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.u.String(); got != tc.want {
				t.Errorf("UUID%v.String() = %q, want %q", [16]byte(tc.u), got, tc.want)
			}
		})
	}
}
