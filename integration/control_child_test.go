package integration

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
)

// TestControlChild is not a test: the control tests re-exec the test binary
// with GDSFS_CTL_CHILD set to run a client process (a worker, another uid,
// a process to kill). It does nothing otherwise.
func TestControlChild(t *testing.T) {
	mode, env := childMode(t, "CTL")
	var err error
	switch mode {
	case "otheruid":
		err = childOtherUID(env("MNT"), env("FILE"), env("TOKEN"))
	case "worker":
		err = childWorker(env("MNT"), env("FILE"), env("TOKEN"))
	case "hold":
		err = childHold(env("MNT"), env("FILE"))
	case "e2e-read":
		err = childE2ERead(env("MNT"), strings.Split(env("FILES"), ","), env("SEED"))
	case "e2e-write":
		err = childE2EWrite(env("MNT"), env("DIR"))
	default:
		err = fmt.Errorf("unknown child mode %q", mode)
	}
	childExit(err)
}

// childOtherUID runs as another uid: the token it was handed is refused,
// a session of its own works (its slabs are its own files).
func childOtherUID(mnt, file, token string) error {
	ctx := context.Background()
	tok, err := parseToken(token)
	if err != nil {
		return err
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	stolen, err := ctl.Attach(mnt, tok)
	if err != nil {
		return err
	}
	defer stolen.Close()
	if _, err := stolen.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 10}}); !errors.Is(err, syscall.EPERM) {
		return fmt.Errorf("READ with another uid's token: %v, want EPERM", err)
	}
	fmt.Println("eperm ok")
	own, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer own.Close()
	if own.Hello().UID != uint32(os.Getuid()) {
		return fmt.Errorf("session uid %d, want %d", own.Hello().UID, os.Getuid())
	}
	ranges := []ctl.Range{{Offset: 3, Length: 70000}}
	ls, err := own.Read(ctx, f, ctl.HostDevice, ranges)
	if err != nil {
		return err
	}
	want := make([]byte, 70000)
	if _, err := f.ReadAt(want, 3); err != nil {
		return err
	}
	if err := verifyLeases(ctx, own, ranges, ls, append(make([]byte, 3), want...)); err != nil {
		return err
	}
	fmt.Println("own ok")
	return nil
}

// childWorker reads a few ranges into the session it inherited (fd 3) or
// was handed (token), prints the leases and exits without releasing them.
func childWorker(mnt, file, token string) error {
	var cl *ctl.Client
	var err error
	if token != "" {
		tok, perr := parseToken(token)
		if perr != nil {
			return perr
		}
		cl, err = ctl.Attach(mnt, tok)
	} else {
		cl, err = ctl.NewClient(os.NewFile(3, "inherited-control"))
	}
	if err != nil {
		return err
	}
	defer cl.Close()
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	ranges := []ctl.Range{{Offset: 0, Length: 4096}, {Offset: 12345, Length: 1 << 20}, {Offset: 2<<20 + 1, Length: 77}}
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges)
	if err != nil {
		return err
	}
	out := make([]workerLease, len(ls))
	for i, l := range ls {
		out[i] = workerLease{Lease: l, Offset: ranges[i].Offset}
	}
	b, _ := json.Marshal(out)
	fmt.Printf("leases %s\n", b)
	return nil
}

// childHold takes leases, says so, and waits to be killed.
func childHold(mnt, file string) error {
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	if _, err := cl.Read(context.Background(), f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 1 << 20}, {Offset: 5, Length: 300000}}); err != nil {
		return err
	}
	fmt.Println("ready")
	time.Sleep(2 * time.Minute) // the parent kills this process; the timeout bounds a broken test
	return errors.New("not killed within 2 minutes")
}

// childE2ERead reads random ranges of files and checks every byte against
// the file read plainly.
func childE2ERead(mnt string, files []string, seed string) error {
	ctx := context.Background()
	s, err := strconv.ParseUint(seed, 10, 64)
	if err != nil {
		return err
	}
	r := mrand.New(mrand.NewPCG(s, 99))
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	type file struct {
		f    *os.File
		data []byte
	}
	var fs []file
	for _, p := range files {
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		fs = append(fs, file{f, data})
	}
	var held []uint64
	for i := range 60 {
		fl := fs[r.IntN(len(fs))]
		ranges := randomRanges(r, uint64(len(fl.data)), r.IntN(8)+1, 2<<20)
		ls, err := cl.Read(ctx, fl.f, ctl.HostDevice, ranges)
		if errors.Is(err, syscall.EAGAIN) {
			// The pool is shared with the other readers: give back and retry.
			if err := cl.Release(ctx, held...); err != nil {
				return err
			}
			held = nil
			continue
		}
		if err != nil {
			return fmt.Errorf("iteration %d: %w", i, err)
		}
		if err := verifyLeases(ctx, cl, ranges, ls, fl.data); err != nil {
			return fmt.Errorf("iteration %d, %s: %w", i, fl.f.Name(), err)
		}
		for _, l := range ls {
			if l.ID != 0 {
				held = append(held, l.ID)
			}
		}
		if r.IntN(3) == 0 {
			if err := cl.Release(ctx, held...); err != nil {
				return err
			}
			held = nil
		}
	}
	return nil
}

// childE2EWrite writes checkpoints through ALLOC + WRITE, fsyncs them and
// checks them with sha256sum through the mount; it prints name and sum.
func childE2EWrite(mnt, dir string) error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	r := mrand.New(mrand.NewPCG(5, 6))
	for k := range 4 {
		n := int64(r.IntN(9<<20) + 1)
		l, err := cl.Alloc(ctx, ctl.HostDevice, n)
		if errors.Is(err, syscall.EAGAIN) {
			time.Sleep(50 * time.Millisecond) // readers hold the pool; they release as they go
			l, err = cl.Alloc(ctx, ctl.HostDevice, n)
		}
		if err != nil {
			return err
		}
		buf, err := cl.Bytes(ctx, l)
		if err != nil {
			return err
		}
		for i := range buf {
			buf[i] = byte(r.Uint32())
		}
		sum := sha256.Sum256(buf)
		want := hex.EncodeToString(sum[:])
		name := fmt.Sprintf("ckpt-%d", k)
		p := filepath.Join(dir, name)
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
		if err != nil {
			return err
		}
		// Two writes: the tail first, at an unaligned split.
		split := n / 3
		if err := cl.Write(ctx, f, l, split, split, n-split, false); err != nil {
			return err
		}
		if split > 0 {
			if err := cl.Write(ctx, f, l, 0, 0, split, k%2 == 0); err != nil {
				return err
			}
		}
		if err := f.Sync(); err != nil {
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		out, err := exec.Command("sha256sum", p).Output()
		if err != nil {
			return err
		}
		if got := strings.Fields(string(out))[0]; got != want {
			return fmt.Errorf("%s: sha256sum %s, want %s", name, got, want)
		}
		if err := cl.Release(ctx, l.ID); err != nil {
			return err
		}
		fmt.Println(name, want)
	}
	return nil
}
