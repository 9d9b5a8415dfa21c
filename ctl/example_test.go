package ctl_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/gdsfs/gdsfs/ctl"
)

// A client reads two ranges of a file on a gdsfs mount into the daemon's
// slabs (shared host memory here) and looks at the bytes. (Compiled, not
// run: it needs a mount.)
func ExampleOpenSession() {
	ctx := context.Background()
	cl, err := ctl.OpenSession("/data")
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close() // ends the session: every lease goes back to the pool

	f, err := os.Open("/data/shard-000000.tar")
	if err != nil {
		log.Fatal(err)
	}
	defer f.Close()

	leases, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 512}, {Offset: 1536, Length: 100}})
	if err != nil {
		log.Fatal(err) // errors.Is(err, syscall.EAGAIN): pool full, release and retry
	}
	for _, l := range leases {
		b, err := cl.Bytes(ctx, l) // maps the slab once, then slices it; refused once l is released
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%d bytes (engine %v): %q...\n", len(b), l.Engine, b[:min(8, len(b))])
	}
	if err := cl.Release(ctx, leases[0].ID, leases[1].ID); err != nil {
		log.Fatal(err)
	}
}
