package cufile

import (
	"bytes"
	"context"
	"testing"
)

// refusingSlab is a fake slab whose cuFileBufRegister fails as when the
// GPU's BAR1 space is exhausted (5016), counted.
type refusingSlab struct {
	*fakeCuSlab
}

func (m refusingSlab) register(lib *Lib) error {
	return m.registerWith(lib, func() error {
		m.mu.Lock()
		defer m.mu.Unlock()
		m.bufRegisters++
		return &FileError{Op: "cuFileBufRegister", Code: 5016}
	})
}

// TestCuFileRegistrationRefusedIsNotFatal: with nvidia-fs, a slab that
// cuFile refuses to register is still read into by cuFile (bounced through
// its own buffers), the READ lands the file's bytes, the file is neither
// refused nor demoted to posix, and the registration is tried once, not on
// every READ; without nvidia-fs it is never tried.
func TestCuFileRegistrationRefusedIsNotFatal(t *testing.T) {
	const size = 1 << 20
	for _, c := range cuFileConfigs {
		t.Run(c.name, func(t *testing.T) {
			f, data := randomCachedFile(t, size)
			cf := newFakeCuFile(t)
			e := c.engines(cf)
			m := refusingSlab{cf.slab(size)}
			for i := range 3 {
				eng, why := e.ChooseAs(f, f.Name(), 0, size, nil)
				if _, ok := eng.(*fallbackEngine); !ok || eng.Name() != c.wantName() {
					t.Fatalf("READ %d: the file is chosen as %s (%q), want cuFile as %s", i, eng.Name(), why, c.wantName())
				}
				clear(m.data)
				got, err := eng.ReadAt(context.Background(), f, m, 0, 0, size)
				if err != nil || got != size || !bytes.Equal(m.data, data) {
					t.Fatalf("READ %d into a slab cuFile would not register = %d, %v (bytes equal %v)", i, got, err, bytes.Equal(m.data, data))
				}
			}
			want := 0
			if c.nvfs {
				want = 1
			}
			if n := m.registers(); n != want {
				t.Errorf("cuFileBufRegister tried %d times over 3 READs, want %d", n, want)
			}
			if r := e.Refusals(); len(r) != 0 {
				t.Errorf("a refused slab registration was taken for cuFile failing on the file: %+v", r)
			}
		})
	}
}
