/*
 * layout.c - where the bytes of a stored chunk land in the global tensor.
 *
 * A chunk is the box [offsets, offsets+sizes) of a row-major tensor of the
 * global shape. Its data file holds the box's elements in the box's own
 * row-major order, so chunk-local byte offset = local element index x
 * itemsize. Reading a byte range of the global tensor (pread on a committed
 * tensor file) asks which pieces of which chunks cover it.
 *
 * Geometry. Let k be the smallest dimension such that every dimension after
 * k is full (size == shape). Then the chunk is a sequence of "runs": for each
 * multi-index (i_0 .. i_{k-1}) over the outer dimensions, sizes[k] x
 * prod(shape[k+1..]) elements that are contiguous in both the chunk and the
 * global tensor. Run r (row-major rank of the multi-index) starts at
 *
 *     global element  sum_{j<k} (offsets[j]+i_j)*stride[j]
 *                     + offsets[k]*stride[k]
 *     local element   r * runlen
 *
 * Global starts increase strictly with r, and two consecutive runs are never
 * adjacent in the global tensor (dimension k is not full, so at least
 * stride[k] elements lie between them), hence runs are already the maximal
 * pieces: a row shard is one run, a column shard one run per row.
 *
 * Workload: a reader of a large tensor issues many small reads (e.g. 1 MiB
 * at a time over a column shard of a [1e7, 4] tensor with 1e7 runs), so a
 * call binary-searches its first run and then walks only the runs it
 * touches: O(ndim * log(runs) + pieces), no allocation.
 *
 * Arithmetic: callers have validated the chunk against the shape and that
 * numel x itemsize fits uint64, so every element or byte position computed
 * here fits; only off + len needs saturation.
 */
#include <assert.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ckpt_planner.h"

/* The run decomposition of one chunk; strides and positions in elements. */
typedef struct {
  int nouter;                     /* k: dimensions indexed by the runs */
  const int64_t *offsets;         /* the chunk's offsets */
  const int64_t *sizes;           /* the chunk's sizes */
  uint64_t stride[CKPT_MAX_NDIM]; /* global stride of each dimension */
  uint64_t base;                  /* offsets[k]*stride[k] (0 for 0-d) */
  uint64_t runlen;                /* elements per run */
  uint64_t nruns;                 /* prod(sizes[0..k-1]) */
} runs_t;

static bool chunk_empty(int ndim, const int64_t *sizes) {
  for (int j = 0; j < ndim; j++)
    if (sizes[j] == 0)
      return true;
  return false;
}

/* Decompose a non-empty chunk into runs. */
static void runs_init(runs_t *rs, int ndim, const int64_t *shape,
                      const int64_t *offsets, const int64_t *sizes) {
  assert(ndim >= 0 && ndim <= CKPT_MAX_NDIM);
  rs->offsets = offsets;
  rs->sizes = sizes;
  uint64_t stride = 1;
  for (int j = ndim - 1; j >= 0; j--) {
    assert(offsets[j] >= 0 && sizes[j] > 0 &&
           shape[j] - offsets[j] >= sizes[j]);
    rs->stride[j] = stride;
    stride *= (uint64_t)shape[j];
  }
  if (ndim == 0) { /* a scalar: one run of one element */
    rs->nouter = 0;
    rs->base = 0;
    rs->runlen = 1;
    rs->nruns = 1;
    return;
  }
  int k = ndim - 1;
  while (k > 0 && sizes[k] == shape[k])
    k--;
  rs->nouter = k;
  rs->base = (uint64_t)offsets[k] * rs->stride[k];
  rs->runlen = (uint64_t)sizes[k] * rs->stride[k];
  rs->nruns = 1;
  for (int j = 0; j < k; j++)
    rs->nruns *= (uint64_t)sizes[j];
}

/* Global start (elements) of run r; fills its multi-index into idx. */
static uint64_t run_start(const runs_t *rs, uint64_t r, int64_t *idx) {
  uint64_t start = rs->base;
  for (int j = rs->nouter - 1; j >= 0; j--) {
    uint64_t s = (uint64_t)rs->sizes[j];
    idx[j] = (int64_t)(r % s);
    r /= s;
    start += (uint64_t)(rs->offsets[j] + idx[j]) * rs->stride[j];
  }
  return start;
}

/* Advance idx to the next run and return that run's global start, given
 * the current one. Amortized O(1): each carry resets a dimension. */
static uint64_t run_next(const runs_t *rs, int64_t *idx, uint64_t start) {
  int j = rs->nouter - 1;
  while (j > 0 && idx[j] == rs->sizes[j] - 1) {
    start -= (uint64_t)idx[j] * rs->stride[j];
    idx[j] = 0;
    j--;
  }
  /* j >= 0 here: the caller never advances past the last run. */
  idx[j]++;
  return start + rs->stride[j];
}

void ckpt_layout_extent(int ndim, const int64_t *shape, const int64_t *offsets,
                        const int64_t *sizes, size_t itemsize, uint64_t *first,
                        uint64_t *end) {
  assert(ndim >= 0 && ndim <= CKPT_MAX_NDIM && first && end);
  *first = *end = 0;
  if (chunk_empty(ndim, sizes))
    return;
  /* First and last element of the box, as global element indices. */
  uint64_t lo = 0, hi = 0, stride = 1;
  for (int j = ndim - 1; j >= 0; j--) {
    lo += (uint64_t)offsets[j] * stride;
    hi += (uint64_t)(offsets[j] + sizes[j] - 1) * stride;
    stride *= (uint64_t)shape[j];
  }
  *first = lo * itemsize;
  *end = (hi + 1) * itemsize;
}

int ckpt_layout_pieces(int ndim, const int64_t *shape, const int64_t *offsets,
                       const int64_t *sizes, size_t itemsize, uint64_t off,
                       uint64_t len,
                       int (*cb)(void *arg, const ckpt_piece_t *p), void *arg) {
  assert(ndim >= 0 && ndim <= CKPT_MAX_NDIM && itemsize > 0 && cb);
  if (len == 0 || chunk_empty(ndim, sizes))
    return 0;
  uint64_t lim = len > UINT64_MAX - off ? UINT64_MAX : off + len;

  runs_t rs;
  runs_init(&rs, ndim, shape, offsets, sizes);
  uint64_t isz = (uint64_t)itemsize;
  uint64_t runbytes = rs.runlen * isz;
  int64_t idx[CKPT_MAX_NDIM];

  /* First run that ends after off: the smallest r with end(r) > off. */
  uint64_t lo = 0, hi = rs.nruns;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (run_start(&rs, mid, idx) * isz + runbytes > off)
      hi = mid;
    else
      lo = mid + 1;
  }
  if (lo == rs.nruns)
    return 0;

  uint64_t r = lo;
  uint64_t estart = run_start(&rs, r, idx); /* elements */
  for (;;) {
    uint64_t start = estart * isz; /* bytes */
    if (start >= lim)
      return 0;
    uint64_t a = start > off ? start : off;
    uint64_t b = start + runbytes < lim ? start + runbytes : lim;
    ckpt_piece_t p = {
        .src = r * runbytes + (a - start), .dst = a, .len = b - a};
    int rc = cb(arg, &p);
    if (rc != 0)
      return rc;
    if (++r == rs.nruns)
      return 0;
    estart = run_next(&rs, idx, estart);
  }
}

typedef struct {
  bool any;
  uint64_t first, end;
} span_t;

static int span_piece(void *arg, const ckpt_piece_t *p) {
  span_t *s = arg;
  if (!s->any)
    s->first = p->src;
  s->any = true;
  s->end = p->src + p->len;
  return 0;
}

void ckpt_layout_span(int ndim, const int64_t *shape, const int64_t *offsets,
                      const int64_t *sizes, size_t itemsize, uint64_t off,
                      uint64_t len, uint64_t *src_first, uint64_t *src_end) {
  span_t s = {.any = false};
  ckpt_layout_pieces(ndim, shape, offsets, sizes, itemsize, off, len,
                     span_piece, &s);
  *src_first = s.any ? s.first : 0;
  *src_end = s.any ? s.end : 0;
}

typedef struct {
  const uint8_t *src;
  uint64_t src_base;
  uint8_t *out;
  uint64_t out_base;
} copy_t;

static int copy_piece(void *arg, const ckpt_piece_t *p) {
  copy_t *c = arg;
  assert(p->src >= c->src_base && p->dst >= c->out_base);
  memcpy(c->out + (p->dst - c->out_base), c->src + (p->src - c->src_base),
         (size_t)p->len);
  return 0;
}

void ckpt_layout_copy(int ndim, const int64_t *shape, const int64_t *offsets,
                      const int64_t *sizes, size_t itemsize, uint64_t off,
                      uint64_t len, const uint8_t *src, uint64_t src_base,
                      uint8_t *out) {
  copy_t c = {.src = src, .src_base = src_base, .out = out, .out_base = off};
  ckpt_layout_pieces(ndim, shape, offsets, sizes, itemsize, off, len,
                     copy_piece, &c);
}

int ckpt_layout_local_pieces(int ndim, const int64_t *shape,
                             const int64_t *offsets, const int64_t *sizes,
                             size_t itemsize, uint64_t off, uint64_t len,
                             int (*cb)(void *arg, const ckpt_piece_t *p),
                             void *arg) {
  assert(ndim >= 0 && ndim <= CKPT_MAX_NDIM && itemsize > 0 && cb);
  if (len == 0 || chunk_empty(ndim, sizes))
    return 0;
  runs_t rs;
  runs_init(&rs, ndim, shape, offsets, sizes);
  uint64_t isz = (uint64_t)itemsize;
  uint64_t runbytes = rs.runlen * isz;
  /* The chunk's own bytes: runs one after another, run r at r*runbytes. */
  uint64_t r = off / runbytes;
  if (r >= rs.nruns)
    return 0;
  uint64_t total = rs.nruns * runbytes;
  uint64_t lim = len > total - off ? total : off + len;
  int64_t idx[CKPT_MAX_NDIM];
  uint64_t estart = run_start(&rs, r, idx); /* elements */
  for (;;) {
    uint64_t local = r * runbytes;
    uint64_t a = local > off ? local : off;
    uint64_t b = local + runbytes < lim ? local + runbytes : lim;
    ckpt_piece_t p = {.src = a, .dst = estart * isz + (a - local),
                      .len = b - a};
    int rc = cb(arg, &p);
    if (rc != 0)
      return rc;
    if (++r == rs.nruns || r * runbytes >= lim)
      return 0;
    estart = run_next(&rs, idx, estart);
  }
}
