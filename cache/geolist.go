package cache

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
