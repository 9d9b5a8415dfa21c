package cache

import "strconv"

// geoList numbers the distinct geometries (npy headers, MDS ndarray
// headers) of one shard while it is parsed, so that the index lists each
// once and its members name them by number. Its size is the geometries'
// estimated bytes in the index; add refuses one that would pass its limit.
type geoList[T any] struct {
	list  []T
	byGeo map[string]int // geometry key -> index into list
	size  int
}

// add returns the index of the geometry h whose key is key, listing it
// (at an estimated cost of cost bytes) when it is new, or -1 when that
// would take the list past limit bytes.
func (g *geoList[T]) add(key []byte, cost, limit int, h T) int {
	if k, ok := g.byGeo[string(key)]; ok {
		return k
	}
	if g.size+cost > limit {
		return -1
	}
	if g.byGeo == nil {
		g.byGeo = make(map[string]int)
	}
	g.size += cost
	g.byGeo[string(key)] = len(g.list)
	g.list = append(g.list, h)
	return len(g.list) - 1
}

// appendGeometryJSON appends the fields an npy header and an MDS ndarray
// header share, as an unclosed JSON object: {"header_length":N,
// "dtype":"...","shape":[...] (the caller adds its own fields and '}').
func appendGeometryJSON(b []byte, headerLength int64, dtype string, shape []int64) []byte {
	b = append(b, `{"header_length":`...)
	b = strconv.AppendInt(b, headerLength, 10)
	b = append(b, `,"dtype":`...)
	b = appendJSONString(b, dtype)
	b = append(b, `,"shape":[`...)
	for i, d := range shape {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, d, 10)
	}
	return append(b, ']')
}

// appendGeometriesJSON appends ,"key":[...] with the n geometries one
// writes (one(b, i) appends the i-th), or nothing when there are none.
func appendGeometriesJSON(b []byte, key string, n int, one func(b []byte, i int) []byte) []byte {
	if n == 0 {
		return b
	}
	b = append(append(append(b, `,"`...), key...), `":[`...)
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = one(b, i)
	}
	return append(b, ']')
}
