package gpubuf

import (
	"errors"
	"fmt"
	"sort"
)

// Stats is a snapshot of the pool's accounting, for `gdsfs status` and
// metrics. Fields are consistent per device and per session shard, not
// across them.
type Stats struct {
	Backend   string         `json:"backend"`
	SlabBytes int64          `json:"slab_bytes"`
	Devices   []DeviceStats  `json:"devices"`
	Sessions  []SessionStats `json:"sessions"`
	UIDs      []UIDStats     `json:"uids"`
}

// DeviceStats is one device's share of Stats.
type DeviceStats struct {
	Device int `json:"device"`
	// UUID is the CUDA device's UUID ("GPU-..."), filled in by the
	// control path where the driver tells it; empty for host memory.
	UUID           string `json:"uuid,omitempty"`
	BudgetBytes    int64  `json:"budget_bytes"`
	AllocatedBytes int64  `json:"allocated_bytes"` // slabs' memory, including allocations in flight
	LeasedBytes    int64  `json:"leased_bytes"`
	Slabs          int    `json:"slabs"`
	SlabsInUse     int    `json:"slabs_in_use"` // slabs holding at least one lease
	Leases         int    `json:"leases"`
	// UIDShareBytes is the most slab memory one uid may hold on the device.
	UIDShareBytes int64 `json:"uid_share_bytes"`
	// FreedSlabs counts idle slabs freed to make room for another uid.
	FreedSlabs uint64 `json:"freed_slabs"`
}

// SessionStats is what one session holds.
type SessionStats struct {
	Session     uint64 `json:"session"`
	UID         uint32 `json:"uid"`
	Leases      int    `json:"leases"`
	LeasedBytes int64  `json:"leased_bytes"`
}

// UIDStats is what all sessions of one uid hold, summed over devices.
type UIDStats struct {
	UID         uint32 `json:"uid"`
	Sessions    int    `json:"sessions"`
	LeasedBytes int64  `json:"leased_bytes"`
	// AllocatedBytes is the slab memory of the uid (leased or idle,
	// allocations in flight included): what counts against its share.
	AllocatedBytes int64 `json:"allocated_bytes"`
	// Refused counts the uid's Allocs refused for lack of memory (its
	// share held, or the budget spent), since the pool started.
	Refused uint64 `json:"refused"`
	// FreedSlabs counts the uid's idle slabs freed for other uids.
	FreedSlabs uint64 `json:"freed_slabs"`
}

// Stats returns a snapshot of the pool's accounting.
func (p *Pool) Stats() Stats {
	// Empty lists, never nil: the JSON has [] rather than null, which
	// clients iterate over without a check.
	st := Stats{Backend: p.backend.Name(), SlabBytes: p.slabBytes,
		Devices: []DeviceStats{}, Sessions: []SessionStats{}, UIDs: []UIDStats{}}
	uids := map[uint32]*UIDStats{}
	uidStat := func(uid uint32) *UIDStats {
		u := uids[uid]
		if u == nil {
			u = &UIDStats{UID: uid}
			uids[uid] = u
		}
		return u
	}
	for _, dev := range p.devices {
		dev.mu.Lock()
		ds := DeviceStats{Device: dev.id, BudgetBytes: dev.budget, AllocatedBytes: dev.bytes, Slabs: len(dev.slabs),
			UIDShareBytes: dev.share, FreedSlabs: dev.freed}
		for uid, h := range dev.uids {
			u := uidStat(uid)
			u.AllocatedBytes += h.bytes
			u.Refused += h.refused
			u.FreedSlabs += h.freed
		}
		for _, s := range dev.slabs {
			var free int64
			for _, e := range s.free {
				free += e.len
			}
			ds.LeasedBytes += s.Size - free
			ds.Leases += s.leases
			if s.leases > 0 {
				ds.SlabsInUse++
			}
		}
		dev.mu.Unlock()
		st.Devices = append(st.Devices, ds)
	}
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.Lock()
		for id, sl := range sh.sessions {
			st.Sessions = append(st.Sessions, SessionStats{Session: id, UID: sl.uid, Leases: len(sl.leases), LeasedBytes: sl.bytes})
			u := uidStat(sl.uid)
			u.Sessions++
			u.LeasedBytes += sl.bytes
		}
		sh.mu.Unlock()
	}
	sort.Slice(st.Sessions, func(i, j int) bool { return st.Sessions[i].Session < st.Sessions[j].Session })
	for _, u := range uids {
		st.UIDs = append(st.UIDs, *u)
	}
	sort.Slice(st.UIDs, func(i, j int) bool { return st.UIDs[i].UID < st.UIDs[j].UID })
	return st
}

// checkInvariants verifies I1 and I3-I5 and that the sessions' leases match the
// slabs' lease counts. Tests call it; it locks every device and shard.
func (p *Pool) checkInvariants() error {
	var errs []error
	perSlab := map[*Slab][]*Lease{}
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.Lock()
		for id, sl := range sh.sessions {
			var bytes int64
			for _, l := range sl.leases {
				perSlab[l.Slab] = append(perSlab[l.Slab], l)
				bytes += l.Length
				if l.Owner.Session != id || l.Owner.UID != sl.uid {
					errs = append(errs, fmt.Errorf("lease %d owner %+v in session %d uid %d", l.ID, l.Owner, id, sl.uid))
				}
			}
			if bytes != sl.bytes {
				errs = append(errs, fmt.Errorf("session %d counts %d bytes, leases hold %d", id, sl.bytes, bytes))
			}
		}
		sh.mu.Unlock()
	}
	for _, dev := range p.devices {
		dev.mu.Lock()
		var total int64
		for _, s := range dev.slabs {
			total += s.Size
			ls := perSlab[s]
			if len(ls) != s.leases {
				errs = append(errs, fmt.Errorf("slab %d counts %d leases, sessions hold %d", s.ID, s.leases, len(ls)))
			}
			// Free extents and leases must tile the slab exactly (I3).
			type iv struct{ off, len int64 }
			var all []iv
			for i, e := range s.free {
				if e.len <= 0 || e.off%Align != 0 || e.len%Align != 0 {
					errs = append(errs, fmt.Errorf("slab %d bad free extent %+v", s.ID, e))
				}
				if i > 0 && s.free[i-1].off+s.free[i-1].len >= e.off {
					errs = append(errs, fmt.Errorf("slab %d free extents %d,%d overlap or touch", s.ID, i-1, i))
				}
				all = append(all, iv(e))
			}
			for _, l := range ls {
				if l.Owner.UID != s.uid {
					errs = append(errs, fmt.Errorf("slab %d serves uid %d but holds lease %d of uid %d", s.ID, s.uid, l.ID, l.Owner.UID))
				}
				all = append(all, iv{l.Offset, l.Length})
			}
			sort.Slice(all, func(i, j int) bool { return all[i].off < all[j].off })
			var at int64
			for _, x := range all {
				if x.off != at {
					errs = append(errs, fmt.Errorf("slab %d: gap or overlap at %d (next range at %d)", s.ID, at, x.off))
					break
				}
				at += x.len
			}
			if at != s.Size && len(errs) == 0 {
				errs = append(errs, fmt.Errorf("slab %d: ranges cover %d of %d bytes", s.ID, at, s.Size))
			}
		}
		if total > dev.budget || total > dev.bytes {
			errs = append(errs, fmt.Errorf("device %d: slabs hold %d bytes, accounted %d, budget %d", dev.id, total, dev.bytes, dev.budget))
		}
		// I5: each uid's slabs fit its share and its account.
		perUID := map[uint32]int64{}
		for _, s := range dev.slabs {
			perUID[s.uid] += s.Size
		}
		var accounted int64
		for uid, h := range dev.uids {
			accounted += h.bytes
			if h.bytes > dev.share || perUID[uid] > h.bytes {
				errs = append(errs, fmt.Errorf("device %d uid %d: slabs hold %d bytes, accounted %d, share %d", dev.id, uid, perUID[uid], h.bytes, dev.share))
			}
		}
		for uid, n := range perUID {
			if dev.uids[uid] == nil {
				errs = append(errs, fmt.Errorf("device %d uid %d: %d bytes of slabs not accounted", dev.id, uid, n))
			}
		}
		if accounted != dev.bytes {
			errs = append(errs, fmt.Errorf("device %d: uids account %d bytes, the device %d", dev.id, accounted, dev.bytes))
		}
		dev.mu.Unlock()
	}
	return errors.Join(errs...)
}
