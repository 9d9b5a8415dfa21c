// Package fs is gdsfs's FUSE layer: a go-fuse v2 loopback over a backing
// directory (or over the directory a mount hides, for overmounts) with kernel
// FUSE passthrough, plus the control path's FUSE surface.
//
// # Node tree
//
// Every node embeds go-fuse's *LoopbackNode for its Inode, and overrides
// every operation that touches the backing tree: go-fuse's loopback builds
// absolute paths, which fail beyond PATH_MAX and follow symlinks planted in
// the backing tree. gdsfs resolves each node's path relative to a
// descriptor of the backing root with openat2 (RESOLVE_BENEATH,
// RESOLVE_NO_SYMLINKS, RESOLVE_NO_MAGICLINKS), acts on the last component
// with an *at call that does not follow it, and checks that the object
// reached is the node's (inode number and type; ESTALE otherwise, on which
// the kernel looks the path up again). Operations on an open file use its
// descriptor. See backing.go.
//
// Inodes are created (create, mkdir, mknod, symlink, O_TMPFILE) on
// dedicated threads with the caller's filesystem uid and gid and umask 0,
// keeping root's capabilities (creds.go): the backing filesystem gives the
// new inode the caller's owner, the directory's group in a setgid
// directory, and exactly the mode the kernel sent (already masked with the
// caller's umask), setuid bits included. Modes are reported as they are
// (go-fuse's NullPermissions), 0000 included.
//
// # Passthrough
//
// Open files are go-fuse LoopbackFiles wrapped in a *fileHandle. When the
// kernel offers FUSE passthrough (Linux >= 6.9) the kernel reads and writes
// the backing file itself and the daemon never sees data. go-fuse disables
// passthrough for the whole mount the first time a backing-file registration
// fails, without saying so. To make that visible and per file, the handle's
// PassthroughFd registers the descriptor once itself first: a refusal is
// logged, counted and that one file is served by the daemon, and go-fuse
// never sees a failure. Server.Passthrough reports the state.
//
// # Control path
//
// With a Control (Options.Control), the root holds a virtual file
// ".gdsfs" (not in the backing directory, not listed by readdir): open
// starts a Session, its ioctls go to Session.Ioctl, its release ends the
// session. Ioctls on data files go to Control.FileIoctl; ioctls are never
// passed to backing files (the daemon runs as root; forwarding arbitrary
// ioctls would let any client use root's capabilities). getxattr of
// "user.gdsfs.*" asks Control.Xattr first; listxattr lists only the backing
// file's real attributes, so copies (cp -a, rsync -X) never copy virtual
// ones; setxattr/removexattr of "user.gdsfs.*" fail with EPERM.
//
// # Change notification
//
// Control.Changed is called for every namespace change (rename: both paths,
// unlink, link), setattr of the size, fallocate, and daemon-served writes.
// With passthrough, writes never reach the daemon, so Changed is also called
// when a file is opened for writing (O_WRONLY, O_RDWR or O_TRUNC) and again
// when that open is released: between those two calls the file may change
// at any time, and callers caching derived state must treat it as such.
//
// # Paths given to Control
//
// Backing paths are absolute paths valid in the daemon process. For an
// overmount they go through the kept directory descriptor
// ("/proc/self/fd/N/..."), because the mount hides the original path.
package fs
