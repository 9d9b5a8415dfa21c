package tier

import (
	"container/list"
	"context"
	"fmt"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// The device tier (Config.DeviceBytes, gdsfs mount --gpu-cache): copies of
// whole pinned files in a GPU's own memory, for files loaded again and
// again onto the same GPU (inference replicas, evaluation jobs). A READ
// into a CUDA slab of device d of a file the tier holds whole gets a copy
// on d at its first hit there (one host-to-device copy per extent, then
// device-to-device into the slab); later hits on d are device-to-device
// copies only. Copies are evicted least recently used first under
// DeviceBytes per device (only copies no READ is using), and go with their
// file: an invalidated or evicted file loses its copies. A copy is charged
// to the uid whose READ made it, and a READ that finds the device's budget
// full evicts, least recently used first, copies of the uid holding the
// most there while that uid holds more than the reader would, else the
// reader's own: one uid's READs cannot push the others' copies out beyond
// equal shares (one uid alone uses the whole budget, plain LRU).

// DeviceMemory is one extent's copy in a GPU's memory.
type DeviceMemory interface {
	Ptr() uintptr
	Close() error
}

// DeviceAllocator allocates device-tier memory: n bytes on device.
type DeviceAllocator interface {
	AllocDevice(device int, n int64) (DeviceMemory, error)
}

// DeviceCopier is the Copier of a tier with a device tier.
type DeviceCopier interface {
	Copier
	// HostToDevice copies src into device memory dst of device.
	HostToDevice(ctx context.Context, device int, dst uintptr, src []byte) error
	// DeviceToSlab copies n bytes of device memory src into CUDA slab
	// memory dst at dstOff (src is on dst's device).
	DeviceToSlab(ctx context.Context, dst gpubuf.Memory, dstOff int64, src uintptr, n int64) error
}

// devCopy is one file's copy on one device.
type devCopy struct {
	e      *entry
	device int
	uid    uint32         // charged to
	ext    []DeviceMemory // per extent of e
	bytes  int64
	elem   *list.Element
}

// deviceOn returns the copy of v's file on device, making it if the tier
// has room (and the file is held whole); nil: serve from host memory.
func (v *View) deviceOn(ctx context.Context, device int, dc DeviceCopier, uid uint32) *devCopy {
	t := v.t
	if t.cfg.DeviceBytes == 0 || t.cfg.DeviceAlloc == nil || device < 0 {
		return nil
	}
	e := v.e
	t.mu.Lock()
	if c := e.dev[device]; c != nil {
		t.mu.devLRU[device].MoveToFront(c.elem)
		t.mu.st.DeviceHits++
		t.mu.Unlock()
		return c
	}
	var need int64
	whole := !e.dead && !e.admitting[device]
	for _, x := range e.ext {
		if x == nil {
			whole = false
			break
		}
		need += x.n
	}
	if !whole || !t.makeDeviceRoomLocked(device, uid, need) {
		t.mu.Unlock()
		return nil
	}
	if e.admitting == nil {
		e.admitting = map[int]bool{}
	}
	e.admitting[device] = true
	t.mu.devUsed[device] += need
	t.chargeDeviceLocked(device, uid, need)
	ext := append([]*extent(nil), e.ext...)
	t.mu.Unlock()

	c := &devCopy{e: e, device: device, uid: uid, ext: make([]DeviceMemory, len(ext)), bytes: need}
	var err error
	for i, x := range ext {
		var m DeviceMemory
		if m, err = t.cfg.DeviceAlloc.AllocDevice(device, x.n); err != nil {
			err = fmt.Errorf("tier: allocate %d bytes on device %d: %w", x.n, device, err)
			break
		}
		c.ext[i] = m
		if err = dc.HostToDevice(ctx, device, m.Ptr(), x.mem.Bytes()); err != nil {
			break
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(e.admitting, device)
	if err != nil || e.dead {
		if err != nil {
			t.cfg.Log.Debug().Err(err).Str("path", e.path).Int("device", device).Msg("tier: no device copy")
		}
		t.freeDeviceLocked(c)
		return nil
	}
	if e.dev == nil {
		e.dev = map[int]*devCopy{}
	}
	e.dev[device] = c
	c.elem = t.mu.devLRU[device].PushFront(c)
	t.mu.st.DeviceAdmits++
	return c
}

// makeDeviceRoomLocked evicts copies on device (none in use) until need
// more bytes for uid fit, or reports that they cannot without evicting
// anything: least recently used first, copies of the uid holding the most
// while it holds more than uid would, then uid's own.
func (t *Tier) makeDeviceRoomLocked(device int, uid uint32, need int64) bool {
	if need > t.cfg.DeviceBytes {
		return false
	}
	l := t.mu.devLRU[device]
	if l == nil {
		l = list.New()
		t.mu.devLRU[device] = l
	}
	held := t.mu.devUIDs[device]
	var victims []*devCopy
	picked := map[*devCopy]bool{}
	freed := map[uint32]int64{}
	fits := func() bool { return t.mu.devUsed[device]-sum(freed)+need <= t.cfg.DeviceBytes }
	oldest := func(u uint32) *devCopy {
		for el := l.Back(); el != nil; el = el.Prev() {
			if c := el.Value.(*devCopy); c.uid == u && c.e.refs == 0 && !picked[c] {
				return c
			}
		}
		return nil
	}
	for !fits() {
		v, vb := uid, int64(-1)
		for u, b := range held {
			if b -= freed[u]; u != uid && b > vb {
				v, vb = u, b
			}
		}
		var c *devCopy
		if vb > held[uid]-freed[uid]+need {
			c = oldest(v)
		}
		if c == nil {
			c = oldest(uid)
		}
		if c == nil {
			return false
		}
		victims = append(victims, c)
		picked[c] = true
		freed[c.uid] += c.bytes
	}
	for _, c := range victims {
		l.Remove(c.elem)
		delete(c.e.dev, device)
		t.freeDeviceLocked(c)
		t.mu.st.DeviceEvictions++
	}
	return true
}

// chargeDeviceLocked charges n bytes of device's copies to uid.
func (t *Tier) chargeDeviceLocked(device int, uid uint32, n int64) {
	m := t.mu.devUIDs[device]
	if m == nil {
		m = map[uint32]int64{}
		t.mu.devUIDs[device] = m
	}
	if m[uid] += n; m[uid] <= 0 {
		delete(m, uid)
	}
}

// freeDeviceLocked frees a copy that is in no table (any more).
func (t *Tier) freeDeviceLocked(c *devCopy) {
	for i, m := range c.ext {
		if m == nil {
			continue
		}
		if err := m.Close(); err != nil {
			t.cfg.Log.Error().Err(err).Int("device", c.device).Msg("tier: free device extent")
		}
		c.ext[i] = nil
	}
	t.mu.devUsed[c.device] -= c.bytes
	t.chargeDeviceLocked(c.device, c.uid, -c.bytes)
}

// dropDevicesLocked frees every device copy of e (e is being freed).
func (t *Tier) dropDevicesLocked(e *entry) {
	for d, c := range e.dev {
		t.mu.devLRU[d].Remove(c.elem)
		t.freeDeviceLocked(c)
		delete(e.dev, d)
	}
}

// DeviceStats is one device's part of the device tier.
type DeviceStats struct {
	Device int   `json:"device"`
	Bytes  int64 `json:"bytes"`
	Files  int   `json:"files"`
}

// deviceStatsLocked lists the devices with copies.
func (t *Tier) deviceStatsLocked() []DeviceStats {
	var out []DeviceStats
	for d, l := range t.mu.devLRU {
		if l.Len() > 0 || t.mu.devUsed[d] > 0 {
			out = append(out, DeviceStats{Device: d, Bytes: t.mu.devUsed[d], Files: l.Len()})
		}
	}
	return out
}
