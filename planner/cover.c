/*
 * cover.c - do boxes cover a tensor exactly (ckpt_planner.h)?
 *
 * The loader of .metadata (store/metadb.c) asks this of every tensor: a
 * gap would be served as whatever the reader's buffer held, an overlap as
 * two different answers for one element. The input is hostile, so the
 * cost is bounded: a grid of the distinct cut points when it is small
 * (regular layouts: O(m log m + cells)), else a sweep along dimension 0
 * whose comparisons are counted; a layout that would need more than
 * CKPT_COVER_BUDGET of them is refused as too irregular (-E2BIG).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_planner.h"

#define NONE UINT32_MAX

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

static size_t find_cut(const int64_t *a, size_t n, int64_t v) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (a[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

typedef struct {
  int ndim;
  const int64_t *shape;
  const int64_t *const *box; /* box[i]: ndim offsets, then ndim sizes */
  const uint32_t *ne;        /* the non-empty boxes */
  size_t m;
  ckpt_cover_t *res;
} cover_t;

static int64_t lo_of(const cover_t *c, size_t i, int k) {
  return c->box[c->ne[i]][k];
}
static int64_t hi_of(const cover_t *c, size_t i, int k) {
  return c->box[c->ne[i]][k] + c->box[c->ne[i]][c->ndim + k];
}

static void overlap(cover_t *c, size_t a, size_t b) {
  c->res->kind = CKPT_COVER_OVERLAP;
  c->res->a = c->ne[a];
  c->res->b = c->ne[b];
}

/* 1 when the grid would be too large, else 0 (result set) or -ENOMEM. */
static int cover_grid(cover_t *c) {
  const int ndim = c->ndim;
  const size_t m = c->m, per = 2 * m + 2;
  const uint64_t limit = 4 * (uint64_t)m + 64;
  size_t nc[CKPT_MAX_NDIM], lo[CKPT_MAX_NDIM], hi[CKPT_MAX_NDIM],
      cur[CKPT_MAX_NDIM];
  uint64_t cells = 1;
  uint32_t *owner = NULL;
  int rc = -ENOMEM;
  int64_t *cuts = malloc((size_t)ndim * per * sizeof(*cuts));
  if (!cuts)
    goto out;
  for (int k = 0; k < ndim; k++) {
    int64_t *v = cuts + (size_t)k * per;
    size_t j = 0;
    v[j++] = 0;
    v[j++] = c->shape[k];
    for (size_t i = 0; i < m; i++) {
      v[j++] = lo_of(c, i, k);
      v[j++] = hi_of(c, i, k);
    }
    qsort(v, j, sizeof(*v), cmp_i64);
    nc[k] = 1;
    for (size_t i = 1; i < j; i++)
      if (v[i] != v[nc[k] - 1])
        v[nc[k]++] = v[i];
    if (__builtin_mul_overflow(cells, nc[k] - 1, &cells) || cells > limit) {
      rc = 1;
      goto out;
    }
  }
  if (!(owner = malloc(cells * sizeof(*owner))))
    goto out;
  memset(owner, 0xff, cells * sizeof(*owner));
  rc = 0;
  for (size_t i = 0; i < m; i++) {
    for (int k = 0; k < ndim; k++) {
      const int64_t *v = cuts + (size_t)k * per;
      lo[k] = cur[k] = find_cut(v, nc[k], lo_of(c, i, k));
      hi[k] = find_cut(v, nc[k], hi_of(c, i, k));
    }
    for (;;) {
      size_t cell = 0;
      for (int k = 0; k < ndim; k++)
        cell = cell * (nc[k] - 1) + cur[k];
      if (owner[cell] != NONE) {
        overlap(c, owner[cell], i);
        goto out;
      }
      owner[cell] = (uint32_t)i;
      int k = ndim - 1;
      while (k >= 0 && ++cur[k] == hi[k]) {
        cur[k] = lo[k];
        k--;
      }
      if (k < 0)
        break;
    }
  }
  for (size_t cell = 0; cell < cells; cell++) {
    if (owner[cell] != NONE)
      continue;
    size_t rest = cell;
    for (int k = ndim - 1; k >= 0; k--) {
      const int64_t *v = cuts + (size_t)k * per;
      size_t idx = rest % (nc[k] - 1);
      rest /= nc[k] - 1;
      c->res->gap_off[k] = v[idx];
      c->res->gap_size[k] = v[idx + 1] - v[idx];
    }
    c->res->kind = CKPT_COVER_GAP;
    c->res->gap_known = true;
    break;
  }
out:
  free(owner);
  free(cuts);
  return rc;
}

static int by_start0(const void *pa, const void *pb, void *arg) {
  const cover_t *c = arg;
  int64_t a = c->box[*(const uint32_t *)pa][0],
          b = c->box[*(const uint32_t *)pb][0];
  return a < b ? -1 : a > b;
}

/* Overlaps of the boxes in start order along dimension 0 (ndim >= 2):
 * each new box is compared with the active ones (those still spanning its
 * start). 0 (result set), -E2BIG beyond the budget, -ENOMEM. */
static int cover_sweep(cover_t *c, uint32_t *order, uint64_t budget) {
  const int ndim = c->ndim;
  qsort_r(order, c->m, sizeof(*order), by_start0, c);
  c->ne = order;
  uint32_t *active = malloc((c->m + 1) * sizeof(*active));
  if (!active)
    return -ENOMEM;
  size_t n_active = 0;
  int rc = 0;
  for (size_t i = 0; i < c->m; i++) {
    const int64_t start = lo_of(c, i, 0);
    size_t kept = 0;
    for (size_t j = 0; j < n_active; j++)
      if (hi_of(c, active[j], 0) > start)
        active[kept++] = active[j];
    n_active = kept;
    if (budget < n_active) {
      rc = -E2BIG;
      break;
    }
    budget -= n_active + 1;
    for (size_t j = 0; j < n_active; j++) {
      size_t a = active[j];
      bool meet = true;
      for (int k = 1; k < ndim && meet; k++)
        meet = lo_of(c, a, k) < hi_of(c, i, k) &&
               lo_of(c, i, k) < hi_of(c, a, k);
      if (meet) {
        overlap(c, a, i);
        goto out;
      }
    }
    active[n_active++] = (uint32_t)i;
  }
out:
  free(active);
  return rc;
}

int ckpt_cover_check(int ndim, const int64_t *shape, size_t n,
                     const int64_t *const *box, ckpt_cover_t *res) {
  return ckpt_cover_check_budget(ndim, shape, n, box, CKPT_COVER_BUDGET, res);
}

int ckpt_cover_check_budget(int ndim, const int64_t *shape, size_t n,
                            const int64_t *const *box, uint64_t budget,
                            ckpt_cover_t *res) {
  memset(res, 0, sizeof(*res));
  uint64_t numel;
  if (ndim < 0 || ndim > CKPT_MAX_NDIM ||
      ckpt_dims_numel(shape, ndim, &numel) < 0)
    return -EINVAL;
  uint32_t *ne = malloc((n + 1) * sizeof(*ne));
  if (!ne)
    return -ENOMEM;
  size_t m = 0;
  uint64_t covered = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t v = 1;
    for (int k = 0; k < ndim; k++) { /* inside the shape: no overflow */
      int64_t o = box[i][k], s = box[i][ndim + k];
      if (o < 0 || s < 0 || o > shape[k] || s > shape[k] - o) {
        free(ne);
        return -EINVAL;
      }
      v *= (uint64_t)s;
    }
    if (v > 0) {
      ne[m++] = (uint32_t)i;
      if (__builtin_add_overflow(covered, v, &covered))
        covered = UINT64_MAX; /* they overlap: found below */
    }
  }
  res->covered = covered;
  cover_t c = {ndim, shape, box, ne, m, res};
  int rc = 0;
  if (ndim == 0) {
    if (m > 1)
      overlap(&c, 0, 1);
    else if (m == 0)
      res->kind = CKPT_COVER_GAP;
  } else if (m > 0) {
    res->kind = CKPT_COVER_EXACT;
    rc = cover_grid(&c);
    if (rc == 1)
      rc = cover_sweep(&c, ne, budget);
    if (rc == 0 && res->kind == CKPT_COVER_EXACT && covered != numel)
      res->kind = CKPT_COVER_GAP;
  } else if (numel > 0) {
    res->kind = CKPT_COVER_GAP;
  }
  free(ne);
  return rc;
}
