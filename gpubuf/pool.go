package gpubuf

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Defaults for Config's zero values.
const (
	DefaultSlabBytes   = 64 << 20
	DefaultBudgetBytes = 2 << 30
	// DefaultUIDShare is the fraction of a device's budget one uid may
	// hold when Config.UIDShareBytes is 0: half, so that a uid holding all
	// it may leaves the other half to everyone else.
	DefaultUIDShare = 0.5
	// DefaultLogEvery is how often a repeated warning (the same refusal
	// for the same uid and device) is logged at most.
	DefaultLogEvery = 10 * time.Second
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
	// UIDShareBytes is the most slab memory one uid's sessions may hold
	// per device (the uid's fair share). It is rounded up to a whole
	// number of slabs and capped at the budget. Default: DefaultUIDShare
	// of the budget. Set it to BudgetBytes to let one uid take everything.
	UIDShareBytes int64
	// Log receives exhaustion warnings (at most one per uid, device and
	// kind of refusal every LogEvery, with a count of those suppressed)
	// and failures to free memory. Default: silent.
	Log zerolog.Logger
	// LogEvery is the period of repeated warnings. Default DefaultLogEvery.
	LogEvery time.Duration
	// Now is the clock of the warning rate limiter. Default time.Now.
	Now func() time.Time
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
	if c.UIDShareBytes < 0 {
		errs = append(errs, fmt.Errorf("gpubuf: UIDShareBytes (%d) must not be negative", c.UIDShareBytes))
	}
	if c.LogEvery < 0 {
		errs = append(errs, fmt.Errorf("gpubuf: LogEvery (%v) must not be negative", c.LogEvery))
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

// ShareBytes is the per-uid share a pool of budget bytes in slabs of slab
// bytes grants for a requested share (0: the default): a whole number of
// slabs, at least one, at most the budget.
func ShareBytes(budget, slab, share int64) int64 {
	if share == 0 {
		share = int64(float64(budget) * DefaultUIDShare)
	}
	share = (share + slab - 1) / slab * slab
	return max(slab, min(share, budget))
}

// Lease is a range of one slab held by an Owner. Its fields never change.
type Lease struct {
	ID     uint64
	Owner  Owner
	Slab   *Slab
	Offset int64 // within the slab; a multiple of Align
	Length int64 // a multiple of Align, at least the requested size
}

// Slab is one allocation of backend memory for one uid (I1). ID, Device,
// Size, Memory, Dedicated and the uid never change; the free list and
// lease count are guarded by the device's mutex.
type Slab struct {
	ID        uint32
	Device    int
	Size      int64
	Memory    Memory
	Dedicated bool // holds exactly one lease larger than a regular slab

	dev *deviceState
	uid uint32

	// GUARDED_BY(dev.mu)
	free   []extent // sorted by off, never adjacent (I3)
	leases int
}

// UID is the uid the slab serves, for its whole life.
func (s *Slab) UID() uint32 { return s.uid }

type extent struct{ off, len int64 }

type deviceState struct {
	id     int
	budget int64
	share  int64 // the most bytes one uid may hold (I5)

	mu sync.Mutex
	// GUARDED_BY(mu)
	slabs   []*Slab
	bytes   int64               // sum of slab sizes plus allocations in flight (I4)
	uids    map[uint32]*uidHold // per uid: its part of bytes (I5), refusals
	pending []*pendingSlab      // regular slabs being allocated
	freed   uint64              // idle slabs freed to make room for another uid
}

// uidHold is one uid's part of a device. GUARDED_BY(deviceState.mu)
type uidHold struct {
	bytes   int64  // its slabs' sizes plus its allocations in flight
	refused uint64 // Allocs refused for lack of memory
	freed   uint64 // its idle slabs freed to make room for other uids
}

// hold returns uid's record, creating it. LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) hold(uid uint32) *uidHold {
	h := dev.uids[uid]
	if h == nil {
		h = &uidHold{}
		dev.uids[uid] = h
	}
	return h
}

// charge adds n bytes (negative: frees them) to the device and to uid.
// LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) charge(uid uint32, n int64) {
	dev.bytes += n
	h := dev.hold(uid)
	h.bytes += n
	if h.bytes == 0 && h.refused == 0 && h.freed == 0 {
		delete(dev.uids, uid)
	}
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
	warn      *limiter

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
	if cfg.LogEvery == 0 {
		cfg.LogEvery = DefaultLogEvery
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	share := ShareBytes(cfg.BudgetBytes, cfg.SlabBytes, cfg.UIDShareBytes)
	p := &Pool{backend: cfg.Backend, slabBytes: cfg.SlabBytes, log: cfg.Log, warn: newLimiter(cfg.LogEvery, cfg.Now)}
	for i := range cfg.Backend.Devices() {
		p.devices = append(p.devices, &deviceState{id: i, budget: cfg.BudgetBytes, share: share, uids: map[uint32]*uidHold{}})
	}
	for i := range p.shards {
		p.shards[i].sessions = make(map[uint64]*sessionLeases)
	}
	return p, nil
}

// Backend is the pool's memory backend.
func (p *Pool) Backend() Backend { return p.backend }

// MaxLeaseBytes is the largest lease one uid can ever be granted on a
// device: its share (at most the budget). Longer requests can never
// succeed, however long the caller waits.
func (p *Pool) MaxLeaseBytes() int64 {
	if len(p.devices) == 0 {
		return 0
	}
	return p.devices[0].share
}

// AlignUp rounds n up to a multiple of Align: the size a lease of n bytes
// takes in its slab.
func AlignUp(n int64) int64 { return (n + Align - 1) &^ (Align - 1) }

func (p *Pool) shard(session uint64) *sessionShard {
	return &p.shards[session%sessionShards]
}

// Alloc leases at least n bytes (rounded up to Align) on device for owner.
// It never waits for memory to be released: it returns ErrExhausted when
// owner's uid holds its share or the device's budget is spent and no idle
// slab of another uid can be freed. ctx bounds the backend allocation.
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
	dev := p.devices[device]
	if n > dev.share {
		dev.mu.Lock()
		err := p.exhausted(dev, owner.UID, n, refusedTooLarge)
		dev.mu.Unlock()
		return nil, err
	}
	size := AlignUp(n)
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

// allocShared carves size bytes out of a regular slab of uid, allocating a
// new slab when none has room. A request that a slab being allocated for
// uid can still hold waits for that slab instead of allocating its own:
// concurrent first requests share slabs, and the budget is not spent on
// slabs that are mostly empty while other requests are refused.
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
		// uid has no idle slab (bestFit would have used it): a new one
		// must fit its share, and the budget once idle slabs of other
		// uids are freed.
		victims, why := dev.makeRoom(uid, p.slabBytes)
		if why != 0 {
			err := p.exhausted(dev, uid, size, why)
			dev.mu.Unlock()
			return nil, 0, err
		}
		return p.allocSlab(ctx, dev, uid, size, victims)
	}
}

// pendingSlab is a regular slab on its way to serving uid: requests of uid
// it can hold wait for it.
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
		if s.Dedicated || s.uid != uid {
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

// refusal is why an Alloc was refused; 0 when it was not.
type refusal int

const (
	refusedShare    refusal = iota + 1 // the uid holds its share
	refusedBudget                      // the budget is spent on leased slabs
	refusedTooLarge                    // the request exceeds any uid's share
)

func (r refusal) String() string {
	switch r {
	case refusedShare:
		return "uid share held"
	case refusedBudget:
		return "budget spent on leased slabs"
	case refusedTooLarge:
		return "larger than a uid's share"
	}
	return "not refused"
}

// makeRoom finds what must be freed for uid to allocate size more bytes
// within its share (I5) and the budget (I4), takes those slabs out of the
// device and charges size to uid; the caller frees the victims (Close,
// outside the lock) before allocating. Idle slabs of uid go first, then
// idle slabs of the uids holding the most. Memory is never handed from one
// uid to another (I1): an idle slab of another uid is freed, and new
// memory is allocated for uid. When the room cannot be made nothing is
// changed and the refusal says why. LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) makeRoom(uid uint32, size int64) ([]*Slab, refusal) {
	idle := map[uint32][]*Slab{}
	var own []*Slab
	for _, s := range dev.slabs {
		if s.leases != 0 {
			continue
		}
		if s.uid == uid {
			own = append(own, s)
		} else {
			idle[s.uid] = append(idle[s.uid], s)
		}
	}
	held := dev.hold(uid).bytes
	var victims []*Slab
	freed := int64(0)
	for held-freed+size > dev.share {
		if len(own) == 0 {
			return nil, refusedShare
		}
		victims = append(victims, own[0])
		freed += own[0].Size
		own = own[1:]
	}
	total := dev.bytes - freed
	// The uid's own idle slabs, then the largest holders' idle slabs.
	holding := map[uint32]int64{}
	for u := range idle {
		holding[u] = dev.uids[u].bytes
	}
	for total+size > dev.budget {
		if len(own) > 0 {
			victims = append(victims, own[0])
			total -= own[0].Size
			own = own[1:]
			continue
		}
		var top uint32
		found := false
		for u, ss := range idle {
			if len(ss) > 0 && (!found || holding[u] > holding[top] || holding[u] == holding[top] && u < top) {
				top, found = u, true
			}
		}
		if !found {
			return nil, refusedBudget
		}
		s := idle[top][0]
		idle[top] = idle[top][1:]
		victims = append(victims, s)
		total -= s.Size
		holding[top] -= s.Size
	}
	for _, s := range victims {
		dev.removeSlab(s)
		dev.charge(s.uid, -s.Size)
		if s.uid != uid {
			dev.freed++
			dev.hold(s.uid).freed++
		}
	}
	dev.charge(uid, size)
	return victims, 0
}

// removeSlab takes s out of the device's list. LOCKS_REQUIRED(dev.mu)
func (dev *deviceState) removeSlab(s *Slab) {
	for i, x := range dev.slabs {
		if x == s {
			dev.slabs = append(dev.slabs[:i], dev.slabs[i+1:]...)
			return
		}
	}
}

// allocSlab frees victims, allocates a new regular slab for uid and carves
// size bytes from it. It is called with dev.mu held and the room made
// (makeRoom), and unlocks it.
func (p *Pool) allocSlab(ctx context.Context, dev *deviceState, uid uint32, size int64, victims []*Slab) (*Slab, int64, error) {
	ps := dev.addPending(uid, size)
	dev.mu.Unlock()
	for _, s := range victims {
		p.closeSlab(s)
	}
	mem, err := p.backend.Alloc(ctx, dev.id, p.slabBytes, uid)
	if err != nil {
		dev.mu.Lock()
		dev.charge(uid, -p.slabBytes)
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

// allocDedicated allocates a slab of exactly size bytes for one lease,
// freeing idle slabs when uid's share or the budget requires it.
func (p *Pool) allocDedicated(ctx context.Context, dev *deviceState, uid uint32, size int64) (*Slab, error) {
	dev.mu.Lock()
	victims, why := dev.makeRoom(uid, size)
	if why != 0 {
		err := p.exhausted(dev, uid, size, why)
		dev.mu.Unlock()
		return nil, err
	}
	dev.mu.Unlock()
	for _, s := range victims {
		p.closeSlab(s)
	}
	mem, err := p.backend.Alloc(ctx, dev.id, size, uid)
	if err != nil {
		dev.mu.Lock()
		dev.charge(uid, -size)
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

// exhausted counts a refusal of uid, logs the device's state (rate
// limited: at most one line per uid, device and reason every LogEvery,
// carrying the count of those suppressed since) and returns ErrExhausted.
// LOCKS_REQUIRED(dev.mu)
func (p *Pool) exhausted(dev *deviceState, uid uint32, size int64, why refusal) error {
	h := dev.hold(uid)
	h.refused++
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
			if e.len > largest && s.uid == uid {
				largest = e.len
			}
		}
		leased += s.Size - free
	}
	if ok, suppressed := p.warn.allow(fmt.Sprintf("exhausted/%d/%d/%d", dev.id, uid, why)); ok {
		p.log.Warn().Int("device", dev.id).Uint32("uid", uid).Int64("want_bytes", size).Str("reason", why.String()).
			Int64("budget_bytes", dev.budget).Int64("uid_share_bytes", dev.share).Int64("uid_bytes", h.bytes).
			Int64("allocated_bytes", dev.bytes).Int64("leased_bytes", leased).
			Int("slabs", len(dev.slabs)).Int("slabs_in_use", inUse).Int64("largest_free_bytes_for_uid", largest).
			Uint64("uid_refusals", h.refused).Uint64("similar_suppressed", suppressed).
			Msg("gpubuf: pool exhausted")
	}
	switch why {
	case refusedShare:
		return fmt.Errorf("%w: uid %d holds %d bytes of device %d, its share is %d: release leases first",
			ErrExhausted, uid, h.bytes, dev.id, dev.share)
	case refusedTooLarge:
		return fmt.Errorf("%w: a lease of %d bytes exceeds the per-uid share of %d bytes of device %d",
			ErrExhausted, size, dev.share, dev.id)
	}
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
		dev.removeSlab(s)
		dev.charge(s.uid, -s.Size)
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
	if slab == nil || slab.uid != owner.UID {
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
		for _, h := range dev.uids {
			h.bytes = 0
		}
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
