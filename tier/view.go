package tier

import "fmt"

// View is a hit: extents of one file, referenced until Release, so that
// copies from them never race a free (T3).
type View struct {
	t     *Tier
	e     *entry
	ext   []*extent // a snapshot of the entry's extents
	chunk int64
	size  int64
}

// Lookup returns a view of the file id if the tier holds every extent of
// each of spans ([start, end) byte ranges, end clipped to the size), or
// false (a miss). A hit refreshes the entry's recency. Release the view.
func (t *Tier) Lookup(id Identity, spans [][2]int64) (*View, bool) {
	if !t.Enabled() {
		return nil, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.mu.entries[id.Key]
	if e == nil || e.id != id {
		t.mu.st.Misses++
		return nil, false
	}
	for _, sp := range spans {
		end := min(sp[1], id.Size)
		for i := int(sp[0] / t.chunk); sp[0] < end && int64(i)*t.chunk < end; i++ {
			if e.ext[i] == nil {
				t.mu.st.Misses++
				return nil, false
			}
		}
	}
	t.mu.st.Hits++
	e.refs++
	t.mu.lru.MoveToFront(e.elem)
	return &View{t: t, e: e, ext: append([]*extent(nil), e.ext...), chunk: t.chunk, size: id.Size}, true
}

// Release ends the view; it is idempotent.
func (v *View) Release() {
	if v.e != nil {
		v.t.unref(v.e)
		v.e = nil
	}
}

// Each calls fn with the tier bytes of [off, off+n) of the file, clipped to
// the file's size, in order, one piece per extent: pos is the piece's
// offset from off. It stops at fn's first error.
func (v *View) Each(off, n int64, fn func(pos int64, b []byte) error) (int64, error) {
	return v.pieces(off, n, func(pos int64, i int, within, m int64) error {
		return fn(pos, v.ext[i].mem.Bytes()[within:within+m])
	})
}

// pieces calls fn per extent piece of [off, off+n) (clipped to the size):
// pos from off, the extent's index, the piece's offset within it and its
// length.
func (v *View) pieces(off, n int64, fn func(pos int64, i int, within, m int64) error) (int64, error) {
	end := min(off+n, v.size)
	var done int64
	for p := off; p < end; {
		i := int(p / v.chunk)
		if i >= len(v.ext) || v.ext[i] == nil {
			return done, fmt.Errorf("BUG: tier: view lacks extent %d", i)
		}
		base := int64(i) * v.chunk
		q := min(end, base+v.chunk)
		if err := fn(p-off, i, p-base, q-p); err != nil {
			return done, err
		}
		done += q - p
		p = q
	}
	v.t.hitBytes(done)
	return done, nil
}

func (t *Tier) hitBytes(n int64) {
	t.mu.Lock()
	t.mu.st.HitBytes += uint64(n)
	t.mu.Unlock()
}
