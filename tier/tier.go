package tier

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// DefaultChunkBytes is the extent size: the unit of filling, charging and
// hit checks.
const DefaultChunkBytes = 64 << 20

// DefaultSettleTime is how long past a file's ctime a fill waits (T2): well
// above any kernel timestamp granularity (a jiffy, at most 10 ms).
const DefaultSettleTime = 50 * time.Millisecond

// align is the granularity of extent memory (the wire's and the pool's).
const align = 4096

// Errors of Pin, told apart with errors.Is.
var (
	// ErrTooLarge: the pin needs more than the uid may ever hold
	// (UIDShareBytes) or than the whole budget.
	ErrTooLarge = errors.New("tier: larger than the tier allows one user")
	// ErrFull: the tier is held by other uids' pins that this uid may not
	// evict (they hold no more than it would).
	ErrFull = errors.New("tier: full of other users' pins")
	// ErrChanged: the file changed while it was being pinned.
	ErrChanged = errors.New("tier: file changed while pinning")
	// ErrDisabled: the tier has no budget.
	ErrDisabled = errors.New("tier: disabled (no --tier-budget)")
	// ErrNotOwner: an unpin of extents another uid pinned.
	ErrNotOwner = errors.New("tier: the file's extents were pinned by another user")
)

// Memory is one extent's bytes. Close frees them; it is called once, when
// no copy from the extent is in flight.
type Memory interface {
	Bytes() []byte
	Close() error
}

// Sealer is Memory that must be sealed once filled, before any hit copies
// out of it (the pinned tier's memory registered for DMA after the read:
// cufile's TierSeal). Seal is called once, never under a lock; an error
// fails the fill and the memory is closed.
type Sealer interface {
	Seal() error
}

// Allocator supplies extent memory: Alloc returns n bytes (n a multiple of
// 4096), not necessarily zeroed. Called concurrently, never under a lock.
type Allocator interface {
	Alloc(n int64) (Memory, error)
	// Name says what the memory is ("host", "pinned"), for STATUS.
	Name() string
}

// Config configures a Tier.
type Config struct {
	// BudgetBytes is the most memory the tier holds; 0 disables it (every
	// Pin fails with ErrDisabled, every Lookup misses).
	BudgetBytes int64
	// UIDShareBytes is the most one uid's pins may hold; 0: BudgetBytes.
	UIDShareBytes int64
	// ChunkBytes is the extent size (a multiple of 4096); 0:
	// DefaultChunkBytes.
	ChunkBytes int64
	// Alloc supplies the memory; nil: anonymous host memory (HostAllocator).
	Alloc Allocator
	// SettleTime is T2's wait; 0: DefaultSettleTime, negative: none.
	SettleTime time.Duration
	// Workers is the parallel reads of one Pin; 0: 8.
	Workers int
	// Now is the clock; nil: time.Now.
	Now func() time.Time
	// Log receives evictions and refusals at debug level.
	Log zerolog.Logger
	// DeviceBytes is the device tier's budget per GPU (device.go); 0: none.
	DeviceBytes int64
	// DeviceAlloc supplies device-tier memory; nil: no device tier.
	DeviceAlloc DeviceAllocator
}

// Validate reports every problem of c at once.
func (c Config) Validate() error {
	var errs []error
	if c.BudgetBytes < 0 {
		errs = append(errs, fmt.Errorf("tier: BudgetBytes (%d) must be >= 0", c.BudgetBytes))
	}
	if c.UIDShareBytes < 0 {
		errs = append(errs, fmt.Errorf("tier: UIDShareBytes (%d) must be >= 0", c.UIDShareBytes))
	}
	if c.ChunkBytes < 0 || c.ChunkBytes%align != 0 {
		errs = append(errs, fmt.Errorf("tier: ChunkBytes (%d) must be a positive multiple of %d", c.ChunkBytes, align))
	}
	if c.DeviceBytes < 0 {
		errs = append(errs, fmt.Errorf("tier: DeviceBytes (%d) must be >= 0", c.DeviceBytes))
	}
	if c.Workers < 0 {
		errs = append(errs, fmt.Errorf("tier: Workers (%d) must be >= 0", c.Workers))
	}
	return errors.Join(errs...)
}

// Key is a file's identity on the node.
type Key struct{ Dev, Ino uint64 }

// Identity is one version of a file: what a hit checks (T1).
type Identity struct {
	Key
	Size             int64
	MtimeNs, CtimeNs int64
}

// IdentityOf is the identity of the file st describes.
func IdentityOf(st *syscall.Stat_t) Identity {
	return Identity{Key: Key{Dev: st.Dev, Ino: st.Ino}, Size: st.Size, MtimeNs: st.Mtim.Nano(), CtimeNs: st.Ctim.Nano()}
}

// Stat returns the identity of the open file f.
func Stat(f *os.File) (Identity, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return Identity{}, fmt.Errorf("tier: stat %s: %w", f.Name(), err)
	}
	var st syscall.Stat_t
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = syscall.Fstat(int(fd), &st) }); err != nil {
		return Identity{}, fmt.Errorf("tier: stat %s: %w", f.Name(), err)
	}
	if serr != nil {
		return Identity{}, fmt.Errorf("tier: stat %s: %w", f.Name(), serr)
	}
	return IdentityOf(&st), nil
}

// extent is one chunk of an entry.
type extent struct {
	mem Memory
	n   int64 // bytes of memory (len of mem)
}

// entry is one file in the tier.
type entry struct {
	id   Identity
	path string // the backing path it was pinned by (InvalidatePath)
	// GUARDED_BY(Tier.mu)
	ext       []*extent  // per chunk; nil: not held
	filling   []bool     // per chunk: a Pin is reading it
	pinners   [][]uint32 // per chunk: the uids whose pins asked for it, each charged for it
	orphans   []*extent  // extents no pin asks for any more, freed when refs is 0
	held      int64      // file bytes in held extents
	refs      int        // hits and fills using the entry
	dead      bool       // unreachable (T3): freed when refs is 0
	elem      *list.Element
	wake      chan struct{}    // closed (and replaced) when a fill of it ends
	dev       map[int]*devCopy // copies on GPUs (device.go)
	admitting map[int]bool     // devices a copy is being made on
}

// Tier is the cache. Its methods are safe for concurrent use.
type Tier struct {
	cfg   Config
	chunk int64
	share int64

	mu struct {
		sync.Mutex
		entries map[Key]*entry           // live entries
		paths   map[string]*entry        // by backing path
		lru     list.List                // of *entry, most recent first
		used    int64                    // bytes allocated, dead entries' and orphans included
		uids    map[uint32]int64         // bytes charged per uid: the extents its pins asked for
		st      Counters                 // counters
		gone    map[*entry]struct{}      // dead entries still referenced
		devUsed map[int]int64            // device tier bytes per device, reserved included
		devLRU  map[int]*list.List       // of *devCopy per device, most recent first
		devUIDs map[int]map[uint32]int64 // device tier bytes per device and uid
	}
}

// Counters are the tier's event counts.
type Counters struct {
	Hits          uint64 `json:"hits"`
	Misses        uint64 `json:"misses"`
	HitBytes      uint64 `json:"hit_bytes"`
	FilledBytes   uint64 `json:"filled_bytes"`
	Evictions     uint64 `json:"evictions"`
	Invalidations uint64 `json:"invalidations"`
	Refused       uint64 `json:"refused"`
	// The device tier: READs served device-to-device, copies made and
	// evicted.
	DeviceHits      uint64 `json:"device_hits,omitempty"`
	DeviceAdmits    uint64 `json:"device_admits,omitempty"`
	DeviceEvictions uint64 `json:"device_evictions,omitempty"`
}

// New returns a tier configured by cfg.
func New(cfg Config) (*Tier, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ChunkBytes == 0 {
		cfg.ChunkBytes = DefaultChunkBytes
	}
	if cfg.Alloc == nil {
		cfg.Alloc = HostAllocator{}
	}
	if cfg.SettleTime == 0 {
		cfg.SettleTime = DefaultSettleTime
	}
	if cfg.Workers == 0 {
		cfg.Workers = 8
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	t := &Tier{cfg: cfg, chunk: cfg.ChunkBytes, share: cfg.UIDShareBytes}
	if t.share == 0 || t.share > cfg.BudgetBytes {
		t.share = cfg.BudgetBytes
	}
	t.mu.entries = map[Key]*entry{}
	t.mu.paths = map[string]*entry{}
	t.mu.uids = map[uint32]int64{}
	t.mu.gone = map[*entry]struct{}{}
	t.mu.devUsed = map[int]int64{}
	t.mu.devLRU = map[int]*list.List{}
	t.mu.devUIDs = map[int]map[uint32]int64{}
	return t, nil
}

// Enabled reports whether the tier has a budget.
func (t *Tier) Enabled() bool { return t != nil && t.cfg.BudgetBytes > 0 }

// ChunkBytes is the extent size: pins are best issued in multiples of it.
func (t *Tier) ChunkBytes() int64 { return t.chunk }

// chunks is the number of extents of a file of size bytes.
func (t *Tier) chunks(size int64) int { return int((size + t.chunk - 1) / t.chunk) }

// extentBytes is the memory of extent i of a file of size bytes.
func (t *Tier) extentBytes(size int64, i int) int64 {
	off := int64(i) * t.chunk
	return alignUp(min(t.chunk, size-off))
}

func alignUp(n int64) int64 { return (n + align - 1) &^ (align - 1) }

// PinResult is what Pin did.
type PinResult struct {
	Size   int64 // the file's size
	Cached int64 // bytes of the file in the tier now
	Filled int64 // bytes this call read into the tier
	// Mine is the bytes of the file in the tier that the uid's pins asked
	// for (PinnedBy), whoever's pin read them; MineFilled the bytes of
	// them this call added. They do not depend on what other uids pinned:
	// for a uid the file's residency may not be told to, they are what
	// Cached and Filled would be had no other uid pinned the file (its
	// pins read every extent themselves).
	Mine, MineFilled int64
}

// Pin reads the extents of [off, off+n) of f (n < 0: to end of file) that
// the tier lacks into it, charged to uid, and returns how much of the file
// is cached. path is f's backing path (InvalidatePath's key). n == 0 only
// reports. Extents filled before an error or a cancellation stay (a pin
// resumes where it stopped). f must be open for reading: the caller checked
// that the requester may read the file.
func (t *Tier) Pin(ctx context.Context, f *os.File, path string, uid uint32, off, n int64) (PinResult, error) {
	if !t.Enabled() {
		return PinResult{}, ErrDisabled
	}
	id, err := Stat(f)
	if err != nil {
		return PinResult{}, err
	}
	res := PinResult{Size: id.Size}
	if off < 0 || off > id.Size {
		return res, fmt.Errorf("tier: pin at %d of a %d-byte file: %w", off, id.Size, syscall.EINVAL)
	}
	if n < 0 || off+n > id.Size || off+n < off {
		n = id.Size - off
	}
	if n == 0 || id.Size == 0 {
		res.Cached, res.Mine = t.Cached(id), t.PinnedBy(id, uid)
		return res, nil
	}
	if err := t.settle(ctx, id); err != nil {
		return res, err
	}
	e, todo, marked, err := t.reserve(id, path, uid, off, n)
	if err != nil {
		return res, err
	}
	defer t.unref(e)
	filled, err := t.fill(ctx, f, e, uid, todo)
	res.Filled = filled
	if err == nil {
		// Extents another pin was filling: the answer waits for them.
		err = t.waitFills(ctx, e, off, n)
	}
	res.Cached, res.Mine = t.Cached(id), t.PinnedBy(id, uid)
	t.mu.Lock()
	for _, i := range marked {
		if e.ext[i] != nil {
			res.MineFilled += t.dataBytes(e.id.Size, i)
		}
	}
	t.mu.Unlock()
	return res, err
}

// dataBytes is the file bytes of extent i of a file of size bytes.
func (t *Tier) dataBytes(size int64, i int) int64 { return min(t.chunk, size-int64(i)*t.chunk) }

// waitFills waits until no extent of [off, off+n) of e is being filled.
func (t *Tier) waitFills(ctx context.Context, e *entry, off, n int64) error {
	for {
		t.mu.Lock()
		busy := false
		for i := int(off / t.chunk); i < len(e.filling) && int64(i)*t.chunk < off+n; i++ {
			busy = busy || e.filling[i]
		}
		wake := e.wake
		t.mu.Unlock()
		if !busy {
			return nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return fmt.Errorf("tier: pin: %w", ctx.Err())
		}
	}
}

// wakeLocked tells waitFills that a fill of e ended.
func (e *entry) wakeLocked() {
	close(e.wake)
	e.wake = make(chan struct{})
}

// settle waits until f's ctime is SettleTime in the past (T2).
func (t *Tier) settle(ctx context.Context, id Identity) error {
	if t.cfg.SettleTime < 0 {
		return nil
	}
	wait := time.Unix(0, id.CtimeNs).Add(t.cfg.SettleTime).Sub(t.cfg.Now())
	if wait <= 0 {
		return nil
	}
	tm := time.NewTimer(min(wait, t.cfg.SettleTime))
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("tier: pin: %w", ctx.Err())
	}
}

// reserve finds or makes the entry of id, makes room for the extents of
// [off, off+n) (evicting as the package doc says), charges uid for those
// of them its pins had not asked for, and marks the ones neither held nor
// being filled as filling. It returns the entry, referenced, the extents
// to fill, and the extents of the range now marked as asked for by uid.
func (t *Tier) reserve(id Identity, path string, uid uint32, off, n int64) (*entry, []int, []int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.mu.entries[id.Key]
	if e != nil && e.id != id {
		t.killLocked(e) // another version of the file
		t.mu.st.Invalidations++
		e = nil
	}
	if e == nil {
		k := t.chunks(id.Size)
		e = &entry{id: id, path: path, ext: make([]*extent, k), filling: make([]bool, k), pinners: make([][]uint32, k), wake: make(chan struct{})}
		e.elem = t.mu.lru.PushFront(e)
		t.mu.entries[id.Key] = e
		if old := t.mu.paths[path]; old != nil && old != e {
			delete(t.mu.paths, path)
		}
		t.mu.paths[path] = e
	} else {
		t.mu.lru.MoveToFront(e.elem)
	}
	var todo, marked []int
	var need, charge int64 // memory to allocate; uid's new charge
	for i := int(off / t.chunk); i < t.chunks(id.Size) && int64(i)*t.chunk < off+n; i++ {
		if e.ext[i] == nil && !e.filling[i] {
			todo = append(todo, i)
			need += t.extentBytes(id.Size, i)
		}
		if !slices.Contains(e.pinners[i], uid) {
			marked = append(marked, i)
			charge += t.extentBytes(id.Size, i)
		}
	}
	if err := t.makeRoomLocked(e, uid, charge, need); err != nil {
		t.mu.st.Refused++
		if e.held == 0 && e.refs == 0 && !hasFilling(e) {
			t.killLocked(e) // made for this pin only
		}
		return nil, nil, nil, err
	}
	for _, i := range todo {
		e.filling[i] = true
	}
	for _, i := range marked {
		e.pinners[i] = append(e.pinners[i], uid)
	}
	t.mu.used += need
	if charge > 0 {
		t.mu.uids[uid] += charge // no zero charge left in the per-uid accounting
	}
	e.refs++
	return e, todo, marked, nil
}

func hasFilling(e *entry) bool {
	for _, f := range e.filling {
		if f {
			return true
		}
	}
	return false
}

// makeRoomLocked evicts so that uid may be charged charge more bytes and
// need more bytes of memory fit the budget, or returns why they cannot
// without evicting anything.
func (t *Tier) makeRoomLocked(keep *entry, uid uint32, charge, need int64) error {
	if charge == 0 && need == 0 {
		return nil
	}
	mine := t.mu.uids[uid]
	if charge > t.share {
		return fmt.Errorf("%w: the pin needs %s, one user may hold %s of the tier", ErrTooLarge,
			humanize.IBytes(uint64(charge)), humanize.IBytes(uint64(t.share)))
	}
	// Plan first: evict nothing unless the pin fits afterwards.
	type victim struct {
		e   *entry
		own bool // only uid's pins of it go (dropPinsLocked)
	}
	var victims []victim
	freed := map[uint32]int64{} // charges freed per uid
	var freedMem int64
	picked := map[*entry]bool{}
	would := func() int64 { return mine - freed[uid] + charge }
	shareFits := func() bool { return would() <= t.share }
	budgetFits := func() bool { return t.mu.used-freedMem+need <= t.cfg.BudgetBytes }
	// The uid's own pins, least recent first: of a file only it pinned the
	// file goes; of a file other uids pinned too, only its pins go (the
	// extents only it asked for with them), the rest stays theirs. Pins
	// that free no memory go only for the share, never for the budget.
	for el := t.mu.lru.Back(); el != nil && !(shareFits() && budgetFits()); el = el.Prev() {
		e := el.Value.(*entry)
		if e == keep || e.refs != 0 {
			continue
		}
		c, m := t.pinsOfLocked(e, uid)
		if c == 0 || shareFits() && m == 0 {
			continue
		}
		victims = append(victims, victim{e, true})
		picked[e] = true
		freed[uid] += c
		freedMem += m
	}
	// Then files of the largest holder, while it holds more than uid
	// would, whole: every uid that pinned them must hold more too.
	for !(shareFits() && budgetFits()) {
		v, vb := uint32(0), int64(-1)
		for u, b := range t.mu.uids {
			if b -= freed[u]; u != uid && b > vb {
				v, vb = u, b
			}
		}
		if vb <= would() {
			break
		}
		var pick *entry
		for el := t.mu.lru.Back(); el != nil; el = el.Prev() {
			e := el.Value.(*entry)
			if e != keep && e.refs == 0 && !picked[e] && t.chargesLocked(e, v) > 0 && t.othersHoldMoreLocked(e, uid, would(), freed) {
				pick = e
				break
			}
		}
		if pick == nil {
			break
		}
		victims = append(victims, victim{pick, false})
		picked[pick] = true
		for i, x := range pick.ext {
			if x != nil {
				freedMem += x.n
				for _, u := range pick.pinners[i] {
					freed[u] += x.n
				}
			}
		}
	}
	if !shareFits() {
		return fmt.Errorf("%w: the pin needs %s and you hold %s of your %s share; unpin files or pin fewer",
			ErrTooLarge, humanize.IBytes(uint64(charge)), humanize.IBytes(uint64(mine)), humanize.IBytes(uint64(t.share)))
	}
	if !budgetFits() {
		return fmt.Errorf("%w: the pin needs %s, %s of the %s budget is in use and no user holding more than you has idle pins",
			ErrFull, humanize.IBytes(uint64(need)), humanize.IBytes(uint64(t.mu.used)), humanize.IBytes(uint64(t.cfg.BudgetBytes)))
	}
	for _, x := range victims {
		t.cfg.Log.Debug().Str("path", x.e.path).Int64("bytes", x.e.held).Uint32("for_uid", uid).Bool("own", x.own).Msg("tier: evicted")
		if x.own {
			t.dropPinsLocked(x.e, uid)
		} else {
			t.killLocked(x.e)
		}
		t.mu.st.Evictions++
	}
	return nil
}

// othersHoldMoreLocked reports whether every uid other than uid whose pins
// asked for a held extent of e holds more than would (after freed):
// evicting e then takes nothing from a uid holding no more than the
// pinning uid.
func (t *Tier) othersHoldMoreLocked(e *entry, uid uint32, would int64, freed map[uint32]int64) bool {
	for i, x := range e.ext {
		if x == nil {
			continue
		}
		for _, u := range e.pinners[i] {
			if u != uid && t.mu.uids[u]-freed[u] <= would {
				return false
			}
		}
	}
	return true
}

// chargesLocked is the bytes of e's held extents that uid is charged for.
func (t *Tier) chargesLocked(e *entry, uid uint32) int64 {
	var n int64
	for i, x := range e.ext {
		if x != nil && slices.Contains(e.pinners[i], uid) {
			n += x.n
		}
	}
	return n
}

// pinsOfLocked is what dropping uid's pins of e (no fill in flight) would
// free: uid's charges, and the memory of the extents only uid asked for.
func (t *Tier) pinsOfLocked(e *entry, uid uint32) (charge, mem int64) {
	for i, x := range e.ext {
		if x != nil && slices.Contains(e.pinners[i], uid) {
			charge += x.n
			if len(e.pinners[i]) == 1 {
				mem += x.n
			}
		}
	}
	return charge, mem
}

// dropPinsLocked drops uid's pins of e: uid is no longer charged for any
// extent of it, the extents no other uid asked for are freed (at once, or
// when the hits using them end: T3), and the entry goes once no pin asks
// for any of it. Fills in flight carry on; what they read for nobody is
// freed when they end (fillOne).
func (t *Tier) dropPinsLocked(e *entry, uid uint32) {
	left := false
	for i, p := range e.pinners {
		if j := slices.Index(p, uid); j >= 0 {
			e.pinners[i] = slices.Delete(p, j, j+1)
			t.uncharge(uid, t.extentBytes(e.id.Size, i))
			if x := e.ext[i]; x != nil && len(e.pinners[i]) == 0 {
				e.ext[i] = nil
				e.held -= t.dataBytes(e.id.Size, i)
				e.orphans = append(e.orphans, x)
			}
		}
		left = left || len(e.pinners[i]) > 0
	}
	if !left {
		t.killLocked(e)
		return
	}
	if e.refs == 0 {
		t.freeOrphansLocked(e)
	}
}

// freeOrphansLocked frees the extents of e no pin asks for (e.refs is 0).
func (t *Tier) freeOrphansLocked(e *entry) {
	for _, x := range e.orphans {
		if err := x.mem.Close(); err != nil {
			t.cfg.Log.Error().Err(err).Str("path", e.path).Msg("tier: free extent")
		}
		t.mu.used -= x.n
	}
	e.orphans = nil
}

// fill reads extents todo of e from f and installs each as it completes.
func (t *Tier) fill(ctx context.Context, f *os.File, e *entry, uid uint32, todo []int) (int64, error) {
	var (
		mu     sync.Mutex
		filled int64
		first  error
	)
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(t.cfg.Workers, len(todo)) {
		wg.Go(func() {
			for i := range next {
				n, err := t.fillOne(ctx, f, e, uid, i)
				mu.Lock()
				filled += n
				if err != nil && first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	k := 0
feed:
	for ; k < len(todo); k++ {
		mu.Lock()
		failed := first != nil
		mu.Unlock()
		if failed || ctx.Err() != nil {
			break
		}
		select {
		case next <- todo[k]:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	// Extents never started give their reservation back.
	t.mu.Lock()
	for _, i := range todo[k:] {
		t.abandonLocked(e, i)
	}
	t.mu.Unlock()
	if first == nil && ctx.Err() != nil {
		first = fmt.Errorf("tier: pin: %w", ctx.Err())
	}
	return filled, first
}

// abandonLocked gives back extent i's reservation: its memory, and the
// charges of every uid whose pin asked for it; the extent is then asked
// for by no uid (a later pin asks again).
func (t *Tier) abandonLocked(e *entry, i int) {
	e.filling[i] = false
	n := t.extentBytes(e.id.Size, i)
	for _, u := range e.pinners[i] {
		t.uncharge(u, n)
	}
	e.pinners[i] = nil
	e.wakeLocked()
	t.mu.used -= n
}

func (t *Tier) uncharge(uid uint32, n int64) {
	if t.mu.uids[uid] -= n; t.mu.uids[uid] <= 0 {
		delete(t.mu.uids, uid)
	}
}

// fillOne reads extent i and installs it (T2).
func (t *Tier) fillOne(ctx context.Context, f *os.File, e *entry, uid uint32, i int) (int64, error) {
	size := t.extentBytes(e.id.Size, i)
	off := int64(i) * t.chunk
	data := min(t.chunk, e.id.Size-off)
	mem, err := t.cfg.Alloc.Alloc(size)
	if err == nil && int64(len(mem.Bytes())) != size {
		_ = mem.Close()
		err = fmt.Errorf("tier: allocator returned %d bytes, asked %d", len(mem.Bytes()), size)
	}
	if err != nil {
		t.mu.Lock()
		t.abandonLocked(e, i)
		t.mu.Unlock()
		return 0, fmt.Errorf("tier: allocate %s: %w", humanize.IBytes(uint64(size)), err)
	}
	b := mem.Bytes()
	err = writeBack(f, off, data)
	if err == nil {
		err = readFull(ctx, f, b[:data], off)
	}
	clear(b[data:])
	if ctx.Err() == nil {
		// A file that changed explains a failed read too (it shrank).
		if now, serr := Stat(f); serr != nil && err == nil {
			err = serr
		} else if serr == nil && now != e.id {
			err = fmt.Errorf("%w: %s; pin it again", ErrChanged, f.Name())
		}
	}
	if s, ok := mem.(Sealer); ok && err == nil {
		if serr := s.Seal(); serr != nil {
			err = fmt.Errorf("tier: seal %s of %s: %w", humanize.IBytes(uint64(size)), f.Name(), serr)
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil || e.dead || len(e.pinners[i]) == 0 {
		// Unpinned while it was read (dropPinsLocked): nobody asks for it.
		unpinned := err == nil && !e.dead
		t.abandonLocked(e, i)
		_ = mem.Close()
		if err == nil && !unpinned {
			err = fmt.Errorf("%w: %s; pin it again", ErrChanged, f.Name())
		}
		return 0, err
	}
	e.filling[i] = false
	e.wakeLocked()
	e.ext[i] = &extent{mem: mem, n: size}
	e.held += data
	t.mu.st.FilledBytes += uint64(data)
	return data, nil
}

// writeBack writes [off, off+n) of f's dirty pages to disk and waits for
// it. Writeback write-protects the pages of the range in every shared
// mapping of the file, so a store into one after the read faults and
// updates the file's times (the identity T1 checks); a store into a page
// already dirty and writable changes no timestamp, and would otherwise
// leave the tier with bytes the file no longer has under an unchanged
// identity. Clean ranges cost one call.
func writeBack(f *os.File, off, n int64) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("tier: write back %s: %w", f.Name(), err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SyncFileRange(int(fd), off, n, unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE|unix.SYNC_FILE_RANGE_WAIT_AFTER)
	}); err != nil {
		return fmt.Errorf("tier: write back %s: %w", f.Name(), err)
	}
	if serr != nil && !errors.Is(serr, syscall.ESPIPE) {
		return fmt.Errorf("tier: write back %s at %d: %w", f.Name(), off, serr)
	}
	return nil
}

// readPiece bounds one pread, so a cancelled pin stops within a moment.
const readPiece = 8 << 20

func readFull(ctx context.Context, f *os.File, b []byte, off int64) error {
	for done := 0; done < len(b); {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("tier: pin: %w", err)
		}
		m, err := f.ReadAt(b[done:min(len(b), done+readPiece)], off+int64(done))
		done += m
		if err != nil && done < len(b) {
			return fmt.Errorf("tier: read %s at %d: %w", f.Name(), off+int64(done), err)
		}
	}
	return nil
}

// killLocked makes e unreachable (T3) and frees it unless referenced.
func (t *Tier) killLocked(e *entry) {
	if e.dead {
		return
	}
	e.dead = true
	if t.mu.entries[e.id.Key] == e {
		delete(t.mu.entries, e.id.Key)
	}
	if t.mu.paths[e.path] == e {
		delete(t.mu.paths, e.path)
	}
	t.mu.lru.Remove(e.elem)
	if e.refs > 0 {
		t.mu.gone[e] = struct{}{}
		return
	}
	t.freeLocked(e)
}

// freeLocked frees a dead, unreferenced entry's extents.
func (t *Tier) freeLocked(e *entry) {
	delete(t.mu.gone, e)
	for i, x := range e.ext {
		if x == nil {
			continue
		}
		if err := x.mem.Close(); err != nil {
			t.cfg.Log.Error().Err(err).Str("path", e.path).Msg("tier: free extent")
		}
		t.mu.used -= x.n
		for _, u := range e.pinners[i] {
			t.uncharge(u, x.n)
		}
		e.pinners[i] = nil
		e.ext[i] = nil
	}
	e.held = 0
	t.freeOrphansLocked(e)
	t.dropDevicesLocked(e)
}

func (t *Tier) unref(e *entry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e.refs--; e.refs == 0 && e.dead {
		t.freeLocked(e)
	} else if e.refs == 0 && len(e.orphans) > 0 {
		t.freeOrphansLocked(e)
	}
}

// Cached is the bytes of the file id in the tier (0 for another version).
func (t *Tier) Cached(id Identity) int64 {
	if !t.Enabled() {
		return 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.mu.entries[id.Key]; e != nil && e.id == id {
		return e.held
	}
	return 0
}

// PinnedBy is the bytes of the file id in the tier that uid's pins asked
// for, whoever's pin read them (0 for another version): what the tier
// holds of the file for uid, which does not depend on other uids' pins.
func (t *Tier) PinnedBy(id Identity, uid uint32) int64 {
	if !t.Enabled() {
		return 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.mu.entries[id.Key]
	if e == nil || e.id != id {
		return 0
	}
	var n int64
	for i, x := range e.ext {
		if x != nil && slices.Contains(e.pinners[i], uid) {
			n += t.dataBytes(e.id.Size, i)
		}
	}
	return n
}

// HeldFor is the memory of the extents in the tier that uid's pins asked
// for, whoever's pin read them: what uid's pins hold, which does not
// depend on other uids' pins. It is uid's charge but for the extents its
// pins in flight are still reading.
func (t *Tier) HeldFor(uid uint32) int64 {
	if !t.Enabled() {
		return 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var n int64
	for _, e := range t.mu.entries {
		for i, x := range e.ext {
			if x != nil && slices.Contains(e.pinners[i], uid) {
				n += x.n
			}
		}
	}
	return n
}

// Empty reports whether the tier holds no file (invalidations then have
// nothing to find).
func (t *Tier) Empty() bool {
	if !t.Enabled() {
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.mu.entries) == 0
}

// Invalidate drops the entry of key (a write through the mount).
func (t *Tier) Invalidate(k Key) {
	if !t.Enabled() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.mu.entries[k]; e != nil {
		t.killLocked(e)
		t.mu.st.Invalidations++
	}
}

// InvalidatePath drops the entry pinned through backing path p.
func (t *Tier) InvalidatePath(p string) {
	if !t.Enabled() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.mu.paths[p]; e != nil {
		t.killLocked(e)
		t.mu.st.Invalidations++
	}
}

// Unpin drops uid's pins of the file id: uid is no longer charged for it,
// the extents no other uid's pins asked for are freed, the others stay for
// those uids (dropPinsLocked); root (uid 0) drops the whole file. A uid
// none of whose pins asked for the file, which other uids pinned, gets
// ErrNotOwner (for a uid the file's residency may be told to; others use
// UnpinOwn). It returns the bytes of the file uid's pins held (root: all
// the tier held of it).
func (t *Tier) Unpin(id Identity, uid uint32) (int64, error) {
	return t.unpin(id, uid, true)
}

// UnpinOwn is Unpin telling uid nothing of other uids' pins: a file none
// of uid's pins asked for is no error, as a file not in the tier.
func (t *Tier) UnpinOwn(id Identity, uid uint32) (int64, error) {
	return t.unpin(id, uid, false)
}

func (t *Tier) unpin(id Identity, uid uint32, told bool) (int64, error) {
	if !t.Enabled() {
		return 0, ErrDisabled
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.mu.entries[id.Key]
	if e == nil {
		return 0, nil
	}
	if uid == 0 {
		n := e.held
		t.killLocked(e)
		return n, nil
	}
	var mine int64
	asked, others := false, false
	for i, p := range e.pinners {
		if slices.Contains(p, uid) {
			asked = true
			if e.ext[i] != nil && e.id == id {
				mine += t.dataBytes(e.id.Size, i)
			}
		}
		others = others || len(p) > 0 && !slices.Contains(p, uid) || len(p) > 1
	}
	switch {
	case asked:
		t.dropPinsLocked(e, uid)
	case !others && !hasFilling(e):
		t.killLocked(e) // held by no pin
	case told:
		return 0, ErrNotOwner
	}
	return mine, nil
}

// UIDStats is one uid's part of the tier.
type UIDStats struct {
	UID   uint32 `json:"uid"`
	Bytes int64  `json:"bytes"`
}

// ScopeUID is Stats.Scope of StatsFor: one uid's figures, no counters.
const ScopeUID = "uid"

// Stats is the tier's state, for STATUS and metrics.
type Stats struct {
	// Scope is "" for the node's figures (Stats), ScopeUID for one uid's
	// (StatsFor).
	Scope         string     `json:"scope,omitempty"`
	Memory        string     `json:"memory"`
	BudgetBytes   int64      `json:"budget_bytes"`
	UIDShareBytes int64      `json:"uid_share_bytes"`
	ChunkBytes    int64      `json:"chunk_bytes"`
	UsedBytes     int64      `json:"used_bytes"`
	CachedBytes   int64      `json:"cached_bytes"`
	Files         int        `json:"files"`
	UIDs          []UIDStats `json:"uids"`
	Counters
	// DeviceBudgetBytes is the device tier's budget per GPU (0: none);
	// Devices what it holds on each.
	DeviceBudgetBytes int64         `json:"device_budget_bytes,omitempty"`
	Devices           []DeviceStats `json:"devices,omitempty"`
}

// Stats returns a snapshot.
func (t *Tier) Stats() Stats {
	s := Stats{Memory: t.cfg.Alloc.Name(), BudgetBytes: t.cfg.BudgetBytes, UIDShareBytes: t.share, ChunkBytes: t.chunk}
	t.mu.Lock()
	defer t.mu.Unlock()
	s.UsedBytes, s.Counters, s.Files = t.mu.used, t.mu.st, len(t.mu.entries)
	for _, e := range t.mu.entries {
		s.CachedBytes += e.held
	}
	for u, b := range t.mu.uids {
		s.UIDs = append(s.UIDs, UIDStats{UID: u, Bytes: b})
	}
	sort.Slice(s.UIDs, func(i, j int) bool { return s.UIDs[i].UID < s.UIDs[j].UID })
	if t.cfg.DeviceAlloc != nil {
		s.DeviceBudgetBytes = t.cfg.DeviceBytes
		s.Devices = t.deviceStatsLocked()
		sort.Slice(s.Devices, func(i, j int) bool { return s.Devices[i].Device < s.Devices[j].Device })
	}
	return s
}

// StatsFor is the tier as uid may see it when the node's figures are not
// its business (ctlserver's STATUS to a uid other than root): the tier's
// configuration, and the figures of uid's own pins, which do not depend on
// other uids' pins: UsedBytes and UIDs its charge, CachedBytes and Files
// the file bytes and files its pins hold, Devices its own copies. The
// counters are the node's and are left out (zero); Scope says so.
func (t *Tier) StatsFor(uid uint32) Stats {
	s := Stats{Memory: t.cfg.Alloc.Name(), BudgetBytes: t.cfg.BudgetBytes, UIDShareBytes: t.share, ChunkBytes: t.chunk, Scope: ScopeUID}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.mu.entries {
		mine := false
		for i, x := range e.ext {
			if x != nil && slices.Contains(e.pinners[i], uid) {
				s.UsedBytes += x.n
				s.CachedBytes += t.dataBytes(e.id.Size, i)
				mine = true
			}
		}
		if mine {
			s.Files++
		}
	}
	if s.UsedBytes > 0 {
		s.UIDs = []UIDStats{{UID: uid, Bytes: s.UsedBytes}}
	}
	if t.cfg.DeviceAlloc != nil {
		s.DeviceBudgetBytes = t.cfg.DeviceBytes
		for d, l := range t.mu.devLRU {
			ds := DeviceStats{Device: d}
			for el := l.Front(); el != nil; el = el.Next() {
				if c := el.Value.(*devCopy); c.uid == uid {
					ds.Bytes += c.bytes
					ds.Files++
				}
			}
			if ds.Files > 0 {
				s.Devices = append(s.Devices, ds)
			}
		}
		sort.Slice(s.Devices, func(i, j int) bool { return s.Devices[i].Device < s.Devices[j].Device })
	}
	return s
}

// Close frees every extent no hit or fill uses; those in use are freed
// when released.
func (t *Tier) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.mu.entries {
		t.killLocked(e)
	}
	return nil
}

func sum(m map[uint32]int64) int64 {
	var s int64
	for _, v := range m {
		s += v
	}
	return s
}
