"""Do the chunks of a tensor tile it exactly? The check `ckptctl
import-dcp` makes of a stock DCP .metadata before it creates anything
(dcp.read_dcp_metadata): every chunk of the tensor's rank and inside it,
no two overlapping, together covering every element, in O(m log m) for
the layouts DCP makes (grids, slices along one or two dimensions) and
within a bounded number of steps for any other (planner/cover.c is the C
side's check of the same property)."""
import math

from .errors import CkptfsError


def dims_text(xs):
    return "[" + ", ".join(str(x) for x in xs) + "]"


def chunk_desc(i, c):
    return f"chunk {i} (offsets {dims_text(c.offsets)}, sizes {dims_text(c.sizes)})"


# Box placements and comparisons _overlap_nd may make in 3 or more
# dimensions: only a hostile layout comes near (DCP's own are grids, or
# slices along one or two dimensions, checked exactly in O(m log m)).
COVER_BUDGET = 2_000_000


def _overlap_grid(size, boxes, limit):
    """_chunk_overlap on the grid of the distinct cut points: False when it
    would have more than limit cells."""
    import bisect
    import itertools
    ndim = len(size)
    cuts, cells = [], 1
    for k in range(ndim):
        v = {0, size[k]}
        for _, o, z in boxes:
            v.add(o[k])
            v.add(o[k] + z[k])
        cuts.append(sorted(v))
        cells *= len(cuts[k]) - 1
        if cells > limit:
            return False
    owner = [-1] * cells
    widths = [len(c) - 1 for c in cuts]
    for b, (i, o, z) in enumerate(boxes):
        spans = [range(bisect.bisect_left(cuts[k], o[k]),
                       bisect.bisect_left(cuts[k], o[k] + z[k])) for k in range(ndim)]
        for idx in itertools.product(*spans):
            cell = 0
            for k in range(ndim):
                cell = cell * widths[k] + idx[k]
            if owner[cell] >= 0:
                return (boxes[owner[cell]][0], i), None
            owner[cell] = b
    for cell, who in enumerate(owner):
        if who < 0:
            off, sz = [0] * ndim, [0] * ndim
            for k in reversed(range(ndim)):
                cell, x = divmod(cell, widths[k])
                off[k], sz[k] = cuts[k][x], cuts[k][x + 1] - cuts[k][x]
            return None, (off, sz)
    return None, None


def _overlap_sweep2(boxes):
    """Two overlapping boxes of 2-D boxes, or None, in O(m log m): a sweep
    along dimension 0. The boxes still open at a start all hold that
    coordinate, so, none overlapping, their dimension-1 intervals are
    disjoint: a new box can only meet its neighbours among them."""
    import bisect
    import heapq
    starts, opened, ending = [], [], []  # active: lo1 sorted, (hi1, i); heap of hi0
    for i, o, z in sorted(boxes, key=lambda b: b[1][0]):
        while ending and ending[0][0] <= o[0]:
            _, lo1 = heapq.heappop(ending)
            p = bisect.bisect_left(starts, lo1)
            del starts[p], opened[p]
        p = bisect.bisect_right(starts, o[1])
        if p > 0 and opened[p - 1][0] > o[1]:
            return opened[p - 1][1], i
        if p < len(starts) and starts[p] < o[1] + z[1]:
            return opened[p][1], i
        starts.insert(p, o[1])
        opened.insert(p, (o[1] + z[1], i))
        heapq.heappush(ending, (o[0] + z[0], o[1]))
    return None


def _overlap_sweep(boxes, budget):
    """Two overlapping boxes, or None: a sweep along dimension 0 comparing
    each box with those still open at its start; OverflowError past
    budget[0] comparisons (counted down)."""
    ndim = len(boxes[0][1])
    active = []
    for i, o, z in sorted(boxes, key=lambda b: b[1][0]):
        active = [a for a in active if a[1][0] + a[2][0] > o[0]]
        budget[0] -= len(active) + 1
        if budget[0] < 0:
            raise OverflowError
        for a in active:
            if all(a[1][k] < o[k] + z[k] and o[k] < a[1][k] + a[2][k]
                   for k in range(1, ndim)):
                return a[0], i
        active.append((i, o, z))
    return None


def _overlap_nd(boxes, budget):
    """Two overlapping boxes of boxes (any number of dimensions), or None.
    1-D and 2-D: exact sweeps. More: split along the dimension whose
    slabs (between consecutive cut points) the boxes cross fewest times,
    and check each slab's boxes without that dimension (two boxes meet
    only in a slab both cross whole); OverflowError past budget[0] box
    placements and comparisons."""
    import bisect
    ndim = len(boxes[0][1])
    if ndim == 1:
        prev = None
        for b in sorted(boxes, key=lambda b: b[1][0]):
            if prev and b[1][0] < prev[1][0] + prev[2][0]:
                return prev[0], b[0]
            if not prev or b[1][0] + b[2][0] > prev[1][0] + prev[2][0]:
                prev = b
        return None
    if ndim == 2:
        return _overlap_sweep2(boxes)
    best = None
    for k in range(ndim):
        cuts = sorted({x for _, o, z in boxes for x in (o[k], o[k] + z[k])})
        spans = [(bisect.bisect_left(cuts, o[k]), bisect.bisect_left(cuts, o[k] + z[k]))
                 for _, o, z in boxes]
        cost = sum(b - a for a, b in spans)
        if best is None or cost < best[0]:
            best = (cost, k, cuts, spans)
    cost, k, cuts, spans = best
    if cost > budget[0]:
        return _overlap_sweep(boxes, budget)
    budget[0] -= cost
    slabs = [[] for _ in range(len(cuts) - 1)]
    for (i, o, z), (a, b) in zip(boxes, spans):
        rest = (i, o[:k] + o[k + 1:], z[:k] + z[k + 1:])
        for j in range(a, b):
            slabs[j].append(rest)
    for slab in slabs:
        if len(slab) > 1:
            pair = _overlap_nd(slab, budget)
            if pair:
                return pair
    return None


def _chunk_overlap(size, boxes):
    """Two of boxes (non-empty, inside size: [(i, offsets, sizes)]) that
    overlap: (i, j), or None; and a gap (offsets, sizes) when it is found
    on the way, else None. Dimensions that every box spans whole are left
    out (they separate none); then the grid of the distinct cut points
    when it has at most 4m + 64 cells (every grid layout, any 1-D one:
    O(m log m + cells)), else _overlap_nd (exact sweeps in 2-D,
    O(m log m); slabs of the others), whose work is counted
    (OverflowError past COVER_BUDGET). planner/cover.c checks the
    .metadata the store loads alike."""
    ndim = len(size)
    keep = [k for k in range(ndim) if any(o[k] or z[k] != size[k] for _, o, z in boxes)]
    if not keep:
        return ((boxes[0][0], boxes[1][0]) if len(boxes) > 1 else None), None
    red = [(i, [o[k] for k in keep], [z[k] for k in keep]) for i, o, z in boxes]
    got = _overlap_grid([size[k] for k in keep], red, 4 * len(boxes) + 64)
    if got is not False:
        pair, gap = got
        if gap:
            off, sz = [0] * ndim, list(size)
            for j, k in enumerate(keep):
                off[k], sz[k] = gap[0][j], gap[1][j]
            gap = (off, sz)
        return pair, gap
    return _overlap_nd(red, [COVER_BUDGET]), None


def check_tiling(what, size, chunks):
    """Refuse (CkptfsError, what: the tensor) unless chunks tile a tensor of
    size exactly: each of its rank, inside it, no two overlapping, and
    together covering every element. DCP reads nothing into elements no
    chunk covers: the import would commit its buffer's uninitialised
    memory there. Returns the chunks' element counts."""
    ndim, numel = len(size), math.prod(size)
    shape = f"size {dims_text(size)}, {numel} elements"
    if not chunks and numel > 0:
        raise CkptfsError(f"{what} ({shape}) has no chunks: DCP would read nothing "
                          "into it, and the import would commit uninitialised memory")
    boxes, vols, covered = [], [], 0
    for i, c in enumerate(chunks):
        o, z = tuple(c.offsets), tuple(c.sizes)
        if len(o) != ndim or len(z) != ndim:
            dims = (f"has {len(o)} dimensions" if len(o) == len(z) else
                    f"has offsets in {len(o)} dimensions and sizes in {len(z)}")
            raise CkptfsError(f"{what} ({shape}): {chunk_desc(i, c)} {dims}; the tensor "
                              f"has {ndim}")
        for k in range(ndim):
            if o[k] + z[k] > size[k]:
                raise CkptfsError(f"{what} ({shape}): {chunk_desc(i, c)} is out of bounds: "
                                  f"it ends at {o[k] + z[k]} in dimension {k}, of size {size[k]}")
        v = math.prod(z)
        vols.append(v)
        if v:
            boxes.append((i, o, z))
            covered += v
    if not boxes:
        pair, gap = None, ([0] * ndim, list(size)) if numel else None
    else:
        try:
            pair, gap = _chunk_overlap(size, boxes)
        except OverflowError:
            raise CkptfsError(f"{what} ({shape}): its {len(chunks)} chunks are too irregular "
                              f"to check (more than {COVER_BUDGET} comparisons)") from None
    if pair:
        a, b = pair
        raise CkptfsError(f"{what} ({shape}): {chunk_desc(a, chunks[a])} and "
                          f"{chunk_desc(b, chunks[b])} overlap")
    if covered != numel:
        where_gap = (f": a gap at offsets {dims_text(gap[0])}, sizes "
                     f"{dims_text(gap[1])}" if gap else "")
        raise CkptfsError(f"{what} ({shape}): its chunks cover {covered} of its {numel} "
                          f"elements{where_gap}: DCP would read nothing there, and the "
                          "import would commit uninitialised memory")
    return vols
