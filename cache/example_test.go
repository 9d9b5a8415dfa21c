package cache_test

import (
	"context"
	"fmt"
	"os"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/cache"
)

// Parse a file once and resolve a name to the byte range a reader asks for.
func ExampleParse() {
	f, err := os.Open("testdata/arr_i8_fortran.npy")
	if err != nil {
		panic(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	x, err := cache.Parse(f, st.Size(), f.Name())
	if err != nil {
		panic(err)
	}
	off, n, _ := x.Resolve("data")
	fmt.Println(x.Format, x.Npy.Dtype, x.Npy.Shape, x.Npy.FortranOrder, off, n)
	// Output: npy <i8 [4 6] true 128 192
}

// The daemon keeps one Indexes: the first Get of a file parses it, later
// ones are answered from the cache until the file changes.
func ExampleIndexes() {
	ix, err := cache.NewIndexes(cache.DefaultIndexBudget, zerolog.Nop())
	if err != nil {
		panic(err)
	}
	defer ix.Close()
	ctx := context.Background()
	// The daemon passes the caller's descriptor of the file.
	f, err := os.Open("testdata/model.safetensors")
	if err != nil {
		panic(err)
	}
	defer f.Close()
	for range 3 {
		x, err := ix.Get(ctx, f.Name(), f)
		if err != nil {
			panic(err)
		}
		off, n, _ := x.Resolve("layer.bias")
		fmt.Println(off, n)
	}
	st := ix.Stats()
	fmt.Println("parses", st.Parses, "hits", st.Hits)
	// Output:
	// 224 256
	// 224 256
	// 224 256
	// parses 1 hits 2
}
