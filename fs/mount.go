package fs

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// Default kernel cache timeouts. Datasets and checkpoints are read far more
// often than they change, and every change made through the mount updates
// the kernel's caches itself; the timeouts only bound how long a change
// made behind the mount's back (directly in the backing directory) can stay
// invisible.
const (
	DefaultAttrTimeout  = time.Second
	DefaultEntryTimeout = time.Second
)

// maxStackDepth lets the backing directory live on a stacked filesystem
// (overlayfs, as in containers): the kernel refuses a passthrough backing
// file whose filesystem is stacked as deep as this value or deeper. 2 is
// the kernel's maximum; it means the gdsfs mount itself cannot be used as
// another stacking filesystem's lower layer.
const maxStackDepth = 2

// Options configures Mount. The zero value of every field but Mountpoint is
// usable.
type Options struct {
	// Source is the backing directory. Empty means overmount: Mount opens
	// Mountpoint before mounting over it and serves the hidden directory
	// through that descriptor.
	Source string
	// Mountpoint is the directory to mount on.
	Mountpoint string
	// ReadOnly mounts read-only (the kernel fails writes with EROFS).
	ReadOnly bool
	// AllowOther lets users other than the mounting one use the mount. The
	// kernel still checks every access against the backing files' modes
	// (default_permissions).
	AllowOther bool
	// Debug logs every FUSE operation (very verbose).
	Debug bool
	// Observer, if set, is told about every FUSE operation the daemon
	// serves (metrics); see fs/observe.go.
	Observer Observer
	// NoPassthrough makes the daemon serve all reads and writes even where
	// the kernel offers passthrough (for comparison and tests).
	NoPassthrough bool
	// AttrTimeout and EntryTimeout are the kernel's attribute and name
	// cache timeouts. Zero means the defaults above; negative disables
	// caching.
	AttrTimeout, EntryTimeout time.Duration
	// Control serves the control path. Nil disables it: no .gdsfs file, no
	// virtual xattrs, ioctls fail with ENOTTY.
	Control Control
	// Logger receives the mount's logs. The zero value discards them.
	Logger zerolog.Logger
	// MaxOpenPerUser is each uid's budget of the daemon's descriptors
	// held by its open files, directories and control sessions on the
	// mount (openbudget.go); past it that uid's opens fail with EMFILE.
	// Zero: a quarter of what the daemon's RLIMIT_NOFILE leaves after
	// its reserve.
	MaxOpenPerUser int64
	// Removed, if set, is told the device and inode number of each
	// regular file whose name the daemon removed (an unlink, or a rename
	// over it), after the removal and before the request returns, so that
	// what the daemon holds of the file (cuFile's registered handles) can
	// go with its last name (removed.go). Nil: the removals are not
	// stat'ed.
	Removed func(dev, ino uint64)
}

// Validate reports every problem with o at once.
func (o *Options) Validate() error {
	var errs []error
	if o.Mountpoint == "" {
		errs = append(errs, errors.New("fs: Mountpoint is empty; name the directory to mount on"))
	}
	if o.Source != "" && o.Mountpoint != "" && filepath.Clean(o.Source) == filepath.Clean(o.Mountpoint) {
		errs = append(errs, fmt.Errorf("fs: Source %q equals Mountpoint; leave Source empty to overmount", o.Source))
	}
	if o.MaxOpenPerUser < 0 {
		errs = append(errs, fmt.Errorf("fs: MaxOpenPerUser (%d) must not be negative; 0 picks the default share", o.MaxOpenPerUser))
	}
	return errors.Join(errs...)
}

func timeout(d, def time.Duration) time.Duration {
	switch {
	case d == 0:
		return def
	case d < 0:
		return 0
	}
	return d
}

// Server is a running gdsfs mount.
type Server struct {
	srv        *fuse.Server
	mountpoint string
	m          *mountState

	closeOnce sync.Once
	// sourceDir is the overmounted directory's descriptor (nil with
	// Source); it must stay open as long as the mount serves.
	sourceDir *os.File
}

// mountState is what every node of one mount shares. It is read-only after
// Mount returns, except for the passthrough state, which locks itself.
type mountState struct {
	ctl      Control
	log      zerolog.Logger
	root     string // backing root path, valid in this process
	pt       *passthrough
	readOnly bool

	// rootFd is an O_PATH descriptor of the backing root; every backing
	// path is resolved from it (backing.go). dev is the root's device.
	rootFd int
	dev    uint64
	// mk creates inodes as their callers (creds.go).
	mk *creators
	// stash keeps descriptors of files just renamed over (stash.go).
	stash lookupStash
	// opens is each uid's budget of the daemon's descriptors
	// (openbudget.go).
	opens *openBudget
	// lockOwners counts the lock owners holding POSIX locks on any file
	// of the mount; flushOwners is the lock owner of each FLUSH in
	// flight while there are any, and lockWaits the blocked F_SETLKW
	// requests (posixlock.go).
	lockOwners  atomic.Int64
	flushOwners sync.Map
	lockWaits   lockWaits
	// removedHook is Options.Removed (removed.go).
	removedHook func(dev, ino uint64)
}

// Mount mounts o.Source (or, with no Source, the directory under
// o.Mountpoint) on o.Mountpoint and serves it until Unmount or until the
// kernel unmounts it (Wait returns then).
func Mount(ctx context.Context, o Options) (*Server, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	s := &Server{mountpoint: o.Mountpoint}
	root := o.Source
	if root == "" {
		// Open before mounting: afterwards the path names the mount.
		d, err := os.Open(o.Mountpoint)
		if err != nil {
			return nil, fmt.Errorf("open mountpoint %q to overmount it: %w", o.Mountpoint, err)
		}
		if st, err := d.Stat(); err != nil || !st.IsDir() {
			d.Close()
			return nil, fmt.Errorf("overmount %q: not a directory", o.Mountpoint)
		}
		s.sourceDir = d
		root = fmt.Sprintf("/proc/self/fd/%d", d.Fd())
	} else if abs, err := filepath.Abs(root); err == nil {
		root = abs
	}
	fail := func(err error) (*Server, error) {
		s.closeSource()
		return nil, err
	}

	lb, err := gofs.NewLoopbackRoot(root)
	if err != nil {
		return fail(fmt.Errorf("open backing directory %q: %w", root, err))
	}
	m := &mountState{
		ctl:      o.Control,
		log:      o.Logger,
		root:     root,
		readOnly: o.ReadOnly,
		rootFd:   -1,

		removedHook: o.Removed,
	}
	m.pt = newPassthrough(m.log)
	limit, err := openLimit()
	if err != nil {
		return fail(err)
	}
	m.opens = newOpenBudget(limit, o.MaxOpenPerUser, m.log)
	// The stash's descriptors come out of the reserve.
	m.stash.start(int(m.opens.reserve / 4))
	s.m = m
	if m.rootFd, err = unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return fail(fmt.Errorf("open backing directory %q: %w", root, err))
	}
	if m.mk, err = newCreators(); err != nil {
		return fail(fmt.Errorf("mount %q: %w", o.Mountpoint, err))
	}
	if !m.mk.asCaller && m.mk.euid == 0 {
		m.log.Warn().Msg("cannot create files with the callers' credentials (the daemon lacks CAP_SETPCAP): new files are created by root and chowned to their callers, and a setuid bit asked for at creation is lost")
	}
	lbRoot, ok := lb.(*gofs.LoopbackNode)
	if !ok {
		return fail(fmt.Errorf("BUG: go-fuse's loopback root is a %T, not a *LoopbackNode", lb))
	}
	rootNode := &node{LoopbackNode: lbRoot, m: m}
	rootNode.RootData.RootNode = rootNode
	m.dev = lbRoot.RootData.Dev

	attr := timeout(o.AttrTimeout, DefaultAttrTimeout)
	entry := timeout(o.EntryTimeout, DefaultEntryTimeout)
	goLog := log.New(o.Logger.With().Str("component", "go-fuse").Logger(), "", 0)
	fsName := o.Source
	if fsName == "" {
		fsName = o.Mountpoint
	}
	mo := fuse.MountOptions{
		AllowOther: o.AllowOther,
		// The kernel checks permissions against the modes the backing
		// files report, so the daemon (root) never widens access.
		Options:       []string{"default_permissions"},
		FsName:        fsName,
		Name:          "gdsfs",
		Debug:         o.Debug,
		Logger:        goLog,
		EnableLocks:   true,
		DirectMount:   true,
		MaxStackDepth: maxStackDepth,
		// Large reads and writes in one request when the daemon serves
		// them (no passthrough).
		MaxWrite: 1 << 20,
		// RELEASE is a background request, and the kernel keeps at most
		// MaxBackground of those in flight (default 12). Under sustained
		// open/close churn the queue of releases then grows faster than
		// it drains, and every queued release pins the daemon's backing
		// descriptor: 64 busy clients drove the daemon to its 20000
		// descriptor limit (EMFILE to every open) within a minute. With
		// 1024 the same load peaks below 100 descriptors
		// (integration/load_mixed_test.go).
		MaxBackground: 1024,
	}
	if o.ReadOnly {
		mo.Options = append(mo.Options, "ro")
	}
	gopts := &gofs.Options{
		MountOptions: mo,
		AttrTimeout:  &attr,
		EntryTimeout: &entry,
		Logger:       goLog,
		// Report modes as they are: go-fuse otherwise turns a mode
		// 0000 into 0644 (0755 for directories), and the kernel checks
		// access against the mode the daemon reports.
		NullPermissions: true,
		OnAdd: func(ctx context.Context) {
			if m.ctl != nil {
				rootNode.addControl(ctx)
			}
		},
	}
	// gofs.Mount, with the raw filesystem wrapped when observed.
	var raw fuse.RawFileSystem = &lockOwnerFS{RawFileSystem: gofs.NewNodeFS(rootNode, gopts), m: m}
	if o.Observer != nil {
		raw = &observedFS{RawFileSystem: raw, obs: o.Observer}
	}
	srv, err := fuse.NewServer(raw, o.Mountpoint, &gopts.MountOptions)
	if err != nil {
		return fail(fmt.Errorf("mount %q: %w", o.Mountpoint, err))
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		// As gofs.Mount: the serve loop ends by itself when the mount fails.
		return fail(fmt.Errorf("mount %q: %w", o.Mountpoint, err))
	}
	s.srv = srv
	if err := closeFuseFdsOnExec(); err != nil {
		m.log.Warn().Err(err).Msg("cannot mark the /dev/fuse connection close-on-exec: programs started by this process inherit it")
	}
	m.pt.start(srv, o.NoPassthrough)
	on, why := m.pt.state()
	ev := m.log.Info()
	if !on {
		ev = m.log.Warn()
	}
	ev.Str("mountpoint", o.Mountpoint).Str("backing", root).Bool("passthrough", on).Str("why", why).
		Bool("control", m.ctl != nil).Int64("nofile_limit", m.opens.limit).Int64("max_open_per_user", m.opens.perUID).
		Int64("open_reserve", m.opens.reserve).Msg("mounted")
	return s, nil
}

// Wait blocks until the mount is unmounted (by Unmount, by `gdsfs unmount`,
// or by the kernel), then releases the backing directory.
func (s *Server) Wait() {
	s.srv.Wait()
	s.closeSource()
}

// Unmount unmounts the filesystem. It fails with EBUSY while files on the
// mount are in use; see UnmountLazy.
func (s *Server) Unmount() error {
	if err := s.srv.Unmount(); err != nil {
		return fmt.Errorf("unmount %q: %w", s.mountpoint, err)
	}
	return nil
}

// UnmountLazy detaches the mount even when files on it are in use; it goes
// away when they are closed.
func (s *Server) UnmountLazy() error {
	if err := syscall.Unmount(s.mountpoint, syscall.MNT_DETACH); err != nil {
		return fmt.Errorf("lazy unmount %q: %w", s.mountpoint, err)
	}
	return nil
}

// Passthrough reports whether reads and writes go through kernel FUSE
// passthrough, and why (or why not). It is fixed at mount time; files the
// kernel refuses later are served by the daemon one by one, and the reason
// then counts them and names the first.
func (s *Server) Passthrough() (bool, string) { return s.m.pt.state() }

// PassthroughStats counts opens of data files by how their I/O is served.
type PassthroughStats struct {
	// Passthrough counts backing files registered with the kernel: one per
	// file opened while no other open of it was active (later concurrent
	// opens share the registration and are not counted).
	Passthrough uint64
	// Daemon counts opens whose reads and writes the daemon serves
	// (passthrough off, or refused for that file).
	Daemon uint64
	// Refused counts kernel refusals of a backing file.
	Refused uint64
}

// OpenStats returns the descriptors each uid's opens hold and the budget.
func (s *Server) OpenStats() OpenStats { return s.m.opens.stats() }

// Stats returns the passthrough counters.
func (s *Server) Stats() PassthroughStats { return s.m.pt.stats() }

func (s *Server) closeSource() {
	s.closeOnce.Do(func() {
		if s.m != nil {
			if s.m.mk != nil {
				s.m.mk.close()
			}
			s.m.stash.close()
			if s.m.rootFd >= 0 {
				unix.Close(s.m.rootFd)
			}
		}
		if s.sourceDir != nil {
			s.sourceDir.Close()
		}
	})
}

// backingPath joins the backing root and a mount-relative path.
func (m *mountState) backingPath(rel string) string {
	if rel == "" {
		return m.root
	}
	return m.root + "/" + strings.TrimPrefix(rel, "/")
}

func (m *mountState) changed(p string) {
	if m.ctl != nil {
		m.ctl.Changed(p)
	}
}
