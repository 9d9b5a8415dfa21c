package gpubuf

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/rs/zerolog"
)

// Defaults for Config's zero values.
const (
	DefaultSlabBytes   = 64 << 20
	DefaultBudgetBytes = 2 << 30
)

// sessionShards is the number of independently locked session tables.
const sessionShards = 16

// Owner identifies who holds a lease: a control-path session and the uid that
// opened it.
type Owner struct {
	Session uint64
	UID     uint32
}

// Config configures a Pool. The zero value of every field but Backend is
// usable.
type Config struct {
	// Backend supplies slab memory. Required.
	Backend Backend
	// SlabBytes is the size of a regular slab, a multiple of Align.
	// Default DefaultSlabBytes.
	SlabBytes int64
	// BudgetBytes is the most memory the pool allocates per device, a
	// multiple of Align. Default DefaultBudgetBytes.
	BudgetBytes int64
	// Log receives exhaustion and scrub failures. Default: silent.
	Log zerolog.Logger
}

// Validate reports every problem of c at once.
func (c Config) Validate() error {
	var errs []error
	if c.Backend == nil {
		errs = append(errs, errors.New("gpubuf: Config.Backend is nil"))
	}
	if c.SlabBytes < 0 || c.SlabBytes%Align != 0 {
		errs = append(errs, fmt.Errorf("gpubuf: SlabBytes (%d) must be a positive multiple of %d", c.SlabBytes, Align))
	}
	if c.BudgetBytes < 0 || c.BudgetBytes%Align != 0 {
		errs = append(errs, fmt.Errorf("gpubuf: BudgetBytes (%d) must be a positive multiple of %d", c.BudgetBytes, Align))
	}
	slab, budget := c.SlabBytes, c.BudgetBytes
	if slab == 0 {
		slab = DefaultSlabBytes
	}
	if budget == 0 {
		budget = DefaultBudgetBytes
	}
	if slab > 0 && budget > 0 && budget < slab {
		errs = append(errs, fmt.Errorf("gpubuf: BudgetBytes (%d) must be at least SlabBytes (%d)", budget, slab))
	}
	return errors.Join(errs...)
}

// Lease is a range of one slab held by an Owner. Its fields never change.
type Lease struct {
	ID     uint64
	Owner  Owner
	Slab   *Slab
	Offset int64 // within the slab; a multiple of Align
	Length int64 // a multiple of Align, at least the requested size
}

// Slab is one allocation of backend memory. ID, Device, Size, Memory and
// Dedicated never change; the rest is guarded by the device's mutex.
type Slab struct {
	ID        uint32
	Device    int
	Size      int64
	Memory    Memory
	Dedicated bool // holds exactly one lease larger than a regular slab

	dev *deviceState

	// GUARDED_BY(dev.mu)
	uid    uint32
	free   []extent // sorted by off, never adjacent (I3)
	leases int
	busy   bool // being scrubbed for a new uid: not allocatable
}

// UID is the uid the slab currently serves.
func (s *Slab) UID() uint32 {
	s.dev.mu.Lock()
	defer s.dev.mu.Unlock()
	return s.uid
}

type extent struct{ off, len int64 }

type deviceState struct {
	id     int
	budget int64

	mu sync.Mutex
	// GUARDED_BY(mu)
	slabs   []*Slab
	bytes   int64          // sum of slab sizes plus allocations in flight (I4)
	pending []*pendingSlab // regular slabs being allocated or scrubbed
}

type sessionShard struct {
	mu       sync.Mutex
	sessions map[uint64]*sessionLeases // GUARDED_BY(mu)
}

type sessionLeases struct {
	uid    uint32
	leases map[uint64]*Lease
	bytes  int64
}

// Pool is the set of slabs of every device and the leases within them. All
// methods are safe for concurrent use.
type Pool struct {
	backend   Backend
	slabBytes int64
	log       zerolog.Logger

	devices   []*deviceState
	nextSlab  atomic.Uint32
	nextLease atomic.Uint64
	slabs     sync.Map // uint32 -> *Slab; written once per slab, read often
	shards    [sessionShards]sessionShard
	closed    atomic.Bool
}

// NewPool returns an empty pool; memory is allocated on demand.
func NewPool(cfg Config) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.SlabBytes == 0 {
		cfg.SlabBytes = DefaultSlabBytes
	}
	if cfg.BudgetBytes == 0 {
		cfg.BudgetBytes = DefaultBudgetBytes
	}
	p := &Pool{backend: cfg.Backend, slabBytes: cfg.SlabBytes, log: cfg.Log}
	for i := range cfg.Backend.Devices() {
		p.devices = append(p.devices, &deviceState{id: i, budget: cfg.BudgetBytes})
	}
	for i := range p.shards {
		p.shards[i].sessions = make(map[uint64]*sessionLeases)
	}
	return p, nil
}

// Backend is the pool's memory backend.
func (p *Pool) Backend() Backend { return p.backend }

// SlabBytes is the size of a regular slab.
func (p *Pool) SlabBytes() int64 { return p.slabBytes }

func alignUp(n int64) int64 { return (n + Align - 1) &^ (Align - 1) }

func (p *Pool) shard(session uint64) *sessionShard {
	return &p.shards[session%sessionShards]
}

// Alloc leases at least n bytes (rounded up to Align) on device for owner.
// It never waits for memory to be released: it returns ErrExhausted when the
// device's budget is spent. ctx bounds the backend allocation and scrubbing.
func (p *Pool) Alloc(ctx context.Context, owner Owner, device int, n int64) (*Lease, error) {
	if p.closed.Load() {
		return nil, ErrClosed
	}
	if n <= 0 {
		return nil, fmt.Errorf("gpubuf: lease size %d must be positive", n)
	}
	if device < 0 || device >= len(p.devices) {
		return nil, fmt.Errorf("gpubuf: device %d does not exist (the %s backend has %d)", device, p.backend.Name(), len(p.devices))
	}
	if n > p.devices[device].budget {
		return nil, fmt.Errorf("gpubuf: lease of %d bytes exceeds the pool budget of %d bytes: %w", n, p.devices[device].budget, ErrExhausted)
	}
	size := alignUp(n)
	dev := p.devices[device]
	var (
		slab *Slab
		off  int64
		err  error
	)
	if size > p.slabBytes {
		slab, err = p.allocDedicated(ctx, dev, owner.UID, size)
	} else {
		slab, off, err = p.allocShared(ctx, dev, owner.UID, size)
	}
	if err != nil {
		return nil, err
	}
	l := &Lease{ID: p.nextLease.Add(1), Owner: owner, Slab: slab, Offset: off, Length: size}
	sh := p.shard(owner.Session)
	sh.mu.Lock()
	sl := sh.sessions[owner.Session]
	if sl == nil {
		sl = &sessionLeases{uid: owner.UID, leases: make(map[uint64]*Lease)}
		sh.sessions[owner.Session] = sl
	}
	sl.leases[l.ID] = l
	sl.bytes += l.Length
	sh.mu.Unlock()
	return l, nil
}

// allocShared carves size bytes out of a regular slab serving uid, creating or
// reassigning a slab when none has room. A request that a slab being
// allocated (or scrubbed) for uid can still hold waits for that slab instead
// of allocating its own: concurrent first requests share slabs, and the
// budget is not spent on slabs that are mostly empty while other requests
// are refused.
func (p *Pool) allocShared(ctx context.Context, dev *deviceState, uid uint32, size int64) (*Slab, int64, error) {
	for {
		dev.mu.Lock()
		if s, off, ok := dev.bestFit(uid, size); ok {
			dev.mu.Unlock()
			return s, off, nil
		}
		if ps := dev.joinPending(uid, size, p.slabBytes); ps != nil {
			dev.mu.Unlock()
			select {
			case <-ps.done:
				continue // the slab is in (or its allocation failed): look again
			case <-ctx.Done():
				return nil, 0, ctx.Err()
			}
		}
		if dev.bytes+p.slabBytes <= dev.budget {
			return p.allocSlab(ctx, dev, uid, size)
		}
		// Budget spent: take over an idle slab of another uid, scrubbed first.
		if s := dev.idleSlab(); s != nil {
			return p.takeOver(ctx, dev, s, uid, size)
		}
		err := p.exhausted(dev, uid, size)
		dev.mu.Unlock()
		return nil, 0, err
	}
}

// pendingSlab is a regular slab on its way to serving uid (being allocated,
// or scrubbed for a new uid): requests of uid it can hold wait for it.
type pendingSlab struct {
	uid      uint32
	promised int64         // bytes of the requests counting on it, its creator's included
	done     chan struct{} // closed when the slab is usable or its allocation failed
}

// bestFit carves size bytes from the smallest fitting free extent of uid's
// regular slabs; best fit keeps large extents for large requests.
// LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) bestFit(uid uint32, size int64) (*Slab, int64, bool) {
	var best *Slab
	bestIdx := -1
	for _, s := range dev.slabs {
		if s.Dedicated || s.busy || s.uid != uid {
			continue
		}
		for i, e := range s.free {
			if e.len >= size && (bestIdx < 0 || e.len < best.free[bestIdx].len) {
				best, bestIdx = s, i
			}
		}
	}
	if best == nil {
		return nil, 0, false
	}
	return best, best.carve(bestIdx, size), true
}

// joinPending promises size bytes of a pending slab of uid that can still
// hold them, and returns it; nil when none can. LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) joinPending(uid uint32, size, slabBytes int64) *pendingSlab {
	for _, ps := range dev.pending {
		if ps.uid == uid && ps.promised+size <= slabBytes {
			ps.promised += size
			return ps
		}
	}
	return nil
}

// addPending registers a slab on its way to uid, promised to a request of
// size bytes. LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) addPending(uid uint32, size int64) *pendingSlab {
	ps := &pendingSlab{uid: uid, promised: size, done: make(chan struct{})}
	dev.pending = append(dev.pending, ps)
	return ps
}

// endPending unregisters ps and wakes the requests waiting for it.
// LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) endPending(ps *pendingSlab) {
	for i, x := range dev.pending {
		if x == ps {
			dev.pending = append(dev.pending[:i], dev.pending[i+1:]...)
			break
		}
	}
	close(ps.done)
}

// idleSlab returns a regular slab that holds no lease and is not being
// scrubbed, or nil. LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) idleSlab() *Slab {
	for _, s := range dev.slabs {
		if !s.Dedicated && !s.busy && s.leases == 0 {
			return s
		}
	}
	return nil
}

// allocSlab allocates a new regular slab for uid and carves size bytes from
// it. It is called with dev.mu held and the budget checked, and unlocks it.
func (p *Pool) allocSlab(ctx context.Context, dev *deviceState, uid uint32, size int64) (*Slab, int64, error) {
	dev.bytes += p.slabBytes
	ps := dev.addPending(uid, size)
	dev.mu.Unlock()
	mem, err := p.backend.Alloc(ctx, dev.id, p.slabBytes, uid)
	if err != nil {
		dev.mu.Lock()
		dev.bytes -= p.slabBytes
		dev.endPending(ps)
		dev.mu.Unlock()
		return nil, 0, fmt.Errorf("gpubuf: allocate %d-byte slab on device %d: %w", p.slabBytes, dev.id, err)
	}
	s := p.newSlab(dev, mem, uid, false)
	dev.mu.Lock()
	if p.closed.Load() {
		// Close ran while the backend allocated: it cannot have seen s.
		dev.endPending(ps)
		dev.mu.Unlock()
		p.closeSlab(s)
		return nil, 0, ErrClosed
	}
	off := s.carve(0, size)
	dev.slabs = append(dev.slabs, s)
	dev.endPending(ps)
	dev.mu.Unlock()
	return s, off, nil
}

// takeOver scrubs idle slab s, hands it to uid and carves size bytes from
// it. It is called with dev.mu held and unlocks it.
func (p *Pool) takeOver(ctx context.Context, dev *deviceState, s *Slab, uid uint32, size int64) (*Slab, int64, error) {
	prev := s.uid
	s.busy = true
	s.uid = uid
	off := s.carve(0, size)
	ps := dev.addPending(uid, size)
	dev.mu.Unlock()
	if err := p.reassign(ctx, s, uid); err != nil {
		dev.mu.Lock()
		s.put(off, size)
		if cerr := ctx.Err(); cerr != nil && errors.Is(err, cerr) {
			// The caller gave up (an interrupted ioctl), the memory did
			// not fail: the slab holds only prev's bytes (some perhaps
			// zeroed) and was not chowned, so it goes back to prev
			// idle. Retiring it would keep its bytes charged to the
			// budget for the pool's life.
			s.uid = prev
			s.busy = false
			dev.endPending(ps)
			dev.mu.Unlock()
			return nil, 0, err
		}
		// A slab that could not be scrubbed must never serve anyone:
		// it stays busy (unallocatable) until the pool closes.
		dev.endPending(ps)
		dev.mu.Unlock()
		p.log.Error().Err(err).Uint32("slab", s.ID).Msg("gpubuf: slab scrub failed; slab retired")
		return nil, 0, err
	}
	dev.mu.Lock()
	s.busy = false
	dev.endPending(ps)
	dev.mu.Unlock()
	return s, off, nil
}

// allocDedicated allocates a slab of exactly size bytes for one lease,
// freeing idle regular slabs when the budget requires it.
func (p *Pool) allocDedicated(ctx context.Context, dev *deviceState, uid uint32, size int64) (*Slab, error) {
	dev.mu.Lock()
	var evict []*Slab
	for i := 0; i < len(dev.slabs) && dev.bytes+size > dev.budget; {
		s := dev.slabs[i]
		if s.Dedicated || s.busy || s.leases != 0 {
			i++
			continue
		}
		dev.slabs = append(dev.slabs[:i], dev.slabs[i+1:]...)
		dev.bytes -= s.Size
		evict = append(evict, s)
	}
	if dev.bytes+size > dev.budget {
		// Put the idle slabs back: nothing was freed for nothing.
		dev.slabs = append(dev.slabs, evict...)
		for _, s := range evict {
			dev.bytes += s.Size
		}
		err := p.exhausted(dev, uid, size)
		dev.mu.Unlock()
		return nil, err
	}
	dev.bytes += size
	dev.mu.Unlock()
	for _, s := range evict {
		p.closeSlab(s)
	}
	mem, err := p.backend.Alloc(ctx, dev.id, size, uid)
	if err != nil {
		dev.mu.Lock()
		dev.bytes -= size
		dev.mu.Unlock()
		return nil, fmt.Errorf("gpubuf: allocate dedicated %d-byte slab on device %d: %w", size, dev.id, err)
	}
	s := p.newSlab(dev, mem, uid, true)
	dev.mu.Lock()
	if p.closed.Load() {
		dev.mu.Unlock()
		p.closeSlab(s)
		return nil, ErrClosed
	}
	s.carve(0, size)
	dev.slabs = append(dev.slabs, s)
	dev.mu.Unlock()
	return s, nil
}

func (p *Pool) newSlab(dev *deviceState, mem Memory, uid uint32, dedicated bool) *Slab {
	s := &Slab{
		ID:        p.nextSlab.Add(1),
		Device:    dev.id,
		Size:      mem.Size(),
		Memory:    mem,
		Dedicated: dedicated,
		dev:       dev,
		uid:       uid,
		free:      []extent{{0, mem.Size()}},
	}
	p.slabs.Store(s.ID, s)
	return s
}

// reassign scrubs s and hands it to uid. The caller marked s busy.
func (p *Pool) reassign(ctx context.Context, s *Slab, uid uint32) error {
	if err := s.Memory.Scrub(ctx); err != nil {
		return fmt.Errorf("gpubuf: scrub slab %d for uid %d: %w", s.ID, uid, err)
	}
	if c, ok := s.Memory.(Chowner); ok {
		if err := c.Chown(uid); err != nil {
			return err
		}
	}
	return nil
}

// exhausted logs the device's state and returns ErrExhausted. LOCKS_REQUIRED(dev.mu)
func (p *Pool) exhausted(dev *deviceState, uid uint32, size int64) error {
	var leased, largest, slabBytes int64
	inUse := 0
	for _, s := range dev.slabs {
		slabBytes += s.Size
		if s.leases > 0 {
			inUse++
		}
		var free int64
		for _, e := range s.free {
			free += e.len
			if e.len > largest && s.uid == uid && !s.busy {
				largest = e.len
			}
		}
		leased += s.Size - free
	}
	p.log.Warn().Int("device", dev.id).Uint32("uid", uid).Int64("want_bytes", size).
		Int64("budget_bytes", dev.budget).Int64("allocated_bytes", dev.bytes).Int64("leased_bytes", leased).
		Int("slabs", len(dev.slabs)).Int("slabs_in_use", inUse).Int64("largest_free_bytes_for_uid", largest).
		Msg("gpubuf: pool exhausted")
	return fmt.Errorf("%w: device %d has %d of %d bytes leased, %d slabs (%d more bytes being allocated), none with %d free bytes for uid %d",
		ErrExhausted, dev.id, leased, dev.budget, len(dev.slabs), dev.bytes-slabBytes, size, uid)
}

// carve takes size bytes from the start of free extent i. LOCKS_REQUIRED(dev.mu)
func (s *Slab) carve(i int, size int64) int64 {
	e := &s.free[i]
	off := e.off
	e.off += size
	e.len -= size
	if e.len == 0 {
		s.free = append(s.free[:i], s.free[i+1:]...)
	}
	s.leases++
	return off
}

// put returns [off, off+size) to the free list, coalescing neighbours.
// LOCKS_REQUIRED(dev.mu)
func (s *Slab) put(off, size int64) {
	s.leases--
	i := sort.Search(len(s.free), func(i int) bool { return s.free[i].off > off })
	s.free = append(s.free, extent{})
	copy(s.free[i+1:], s.free[i:])
	s.free[i] = extent{off, size}
	if i+1 < len(s.free) && s.free[i].off+s.free[i].len == s.free[i+1].off {
		s.free[i].len += s.free[i+1].len
		s.free = append(s.free[:i+1], s.free[i+2:]...)
	}
	if i > 0 && s.free[i-1].off+s.free[i-1].len == s.free[i].off {
		s.free[i-1].len += s.free[i].len
		s.free = append(s.free[:i], s.free[i+1:]...)
	}
}

// Lookup returns the lease id of owner's session. A lease of another session
// (or uid) is reported as ErrNotFound, like one that does not exist.
func (p *Pool) Lookup(owner Owner, id uint64) (*Lease, error) {
	sh := p.shard(owner.Session)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sl := sh.sessions[owner.Session]; sl != nil {
		if l := sl.leases[id]; l != nil && l.Owner == owner {
			return l, nil
		}
	}
	return nil, fmt.Errorf("%w: lease %d of session %d", ErrNotFound, id, owner.Session)
}

// Release returns lease id of owner's session to the pool.
func (p *Pool) Release(owner Owner, id uint64) error {
	sh := p.shard(owner.Session)
	sh.mu.Lock()
	sl := sh.sessions[owner.Session]
	var l *Lease
	if sl != nil {
		l = sl.leases[id]
	}
	if l == nil || l.Owner != owner {
		sh.mu.Unlock()
		return fmt.Errorf("%w: lease %d of session %d", ErrNotFound, id, owner.Session)
	}
	delete(sl.leases, id)
	sl.bytes -= l.Length
	if len(sl.leases) == 0 {
		delete(sh.sessions, owner.Session)
	}
	sh.mu.Unlock()
	p.free(l)
	return nil
}

// ReleaseSession returns every lease of session to the pool and reports how
// many there were.
func (p *Pool) ReleaseSession(session uint64) int {
	sh := p.shard(session)
	sh.mu.Lock()
	sl := sh.sessions[session]
	delete(sh.sessions, session)
	sh.mu.Unlock()
	if sl == nil {
		return 0
	}
	for _, l := range sl.leases {
		p.free(l)
	}
	return len(sl.leases)
}

func (p *Pool) free(l *Lease) {
	s := l.Slab
	dev := s.dev
	dev.mu.Lock()
	s.put(l.Offset, l.Length)
	drop := s.Dedicated && s.leases == 0
	if drop {
		for i, x := range dev.slabs {
			if x == s {
				dev.slabs = append(dev.slabs[:i], dev.slabs[i+1:]...)
				break
			}
		}
		dev.bytes -= s.Size
	}
	dev.mu.Unlock()
	if drop {
		p.closeSlab(s)
	}
}

func (p *Pool) closeSlab(s *Slab) {
	p.slabs.Delete(s.ID)
	if err := s.Memory.Close(); err != nil {
		p.log.Error().Err(err).Uint32("slab", s.ID).Msg("gpubuf: free slab")
	}
}

// Slab returns the slab with the given ID.
func (p *Pool) Slab(id uint32) (*Slab, error) {
	v, ok := p.slabs.Load(id)
	if !ok {
		return nil, fmt.Errorf("%w: slab %d", ErrNotFound, id)
	}
	return v.(*Slab), nil
}

// Export returns the client mapping token of slab id (Memory.Export) if
// owner's session holds a lease in it, and ErrNotFound otherwise: a session
// can map only slabs that hold its own data.
func (p *Pool) Export(owner Owner, id uint32) ([]byte, error) {
	sh := p.shard(owner.Session)
	sh.mu.Lock()
	var slab *Slab
	if sl := sh.sessions[owner.Session]; sl != nil && sl.uid == owner.UID {
		for _, l := range sl.leases {
			if l.Slab.ID == id {
				slab = l.Slab
				break
			}
		}
	}
	sh.mu.Unlock()
	if slab == nil {
		return nil, fmt.Errorf("%w: slab %d holds no lease of session %d", ErrNotFound, id, owner.Session)
	}
	return slab.Memory.Export()
}

// Close frees every slab. Leases become invalid; later calls fail with
// ErrClosed. The backend is not closed: its creator owns it.
func (p *Pool) Close() error {
	if p.closed.Swap(true) {
		return nil
	}
	var errs []error
	for _, dev := range p.devices {
		dev.mu.Lock()
		slabs := dev.slabs
		dev.slabs = nil
		dev.bytes = 0
		dev.mu.Unlock()
		for _, s := range slabs {
			p.slabs.Delete(s.ID)
			if err := s.Memory.Close(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for i := range p.shards {
		sh := &p.shards[i]
		sh.mu.Lock()
		sh.sessions = make(map[uint64]*sessionLeases)
		sh.mu.Unlock()
	}
	return errors.Join(errs...)
}
