/*
 * staging.c - the data and xattrs of staged files, in memory.
 *
 * A staged file is an array of 1 MiB segments, allocated on first write
 * (unwritten ranges are holes that read as zeros). Small files would waste
 * most of a segment, so segment 0 starts at the size written and doubles up
 * to a full segment. All allocations are charged to the mount's budget
 * (staging_mem); a write that would exceed it fails with ENOSPC.
 *
 * Workload: trainers write large tensors sequentially in 1 MiB requests,
 * and many small tensors once; reads of staged data are rare.
 */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>

#include "fs_int.h"

#define SEG0_MIN 4096u

const char *const ckpt__xattr_names[CKPT_X_COUNT] = {
    [CKPT_X_DTYPE] = "user.ckpt.dtype",
    [CKPT_X_SHAPE] = "user.ckpt.shape",
    [CKPT_X_OFFSETS] = "user.ckpt.offsets",
    [CKPT_X_SIZES] = "user.ckpt.sizes",
};

static const uint8_t zero_page[4096];

static bool budget_take(ckpt_staging_t *b, uint64_t n) {
  uint64_t cur = atomic_load(&b->used);
  do {
    if (cur + n > b->limit || cur + n < cur)
      return false;
  } while (!atomic_compare_exchange_weak(&b->used, &cur, cur + n));
  return true;
}

static void budget_give(ckpt_staging_t *b, uint64_t n) {
  atomic_fetch_sub(&b->used, n);
}

ckpt_sfile_t *ckpt__sfile_new(ckpt_staging_t *budget) {
  ckpt_sfile_t *sf = calloc(1, sizeof(*sf));
  if (!sf)
    return NULL;
  pthread_mutex_init(&sf->lock, NULL);
  sf->budget = budget;
  return sf;
}

static uint64_t seg_cap(const ckpt_sfile_t *sf, uint32_t i) {
  return i == 0 ? sf->seg0_cap : CKPT_SEG_SIZE;
}

/* Free segments from index `from` on. */
static void drop_segments(ckpt_sfile_t *sf, uint32_t from) {
  for (uint32_t i = from; i < sf->nsegs; i++) {
    if (sf->segs[i]) {
      budget_give(sf->budget, seg_cap(sf, i));
      free(sf->segs[i]);
      sf->segs[i] = NULL;
    }
  }
  if (from == 0)
    sf->seg0_cap = 0;
}

void ckpt__sfile_free(ckpt_sfile_t *sf) {
  if (!sf)
    return;
  drop_segments(sf, 0);
  free(sf->segs);
  for (int i = 0; i < CKPT_X_COUNT; i++)
    free(sf->xattr[i]);
  pthread_mutex_destroy(&sf->lock);
  free(sf);
}

static int grow_index(ckpt_sfile_t *sf, uint32_t nsegs) {
  if (nsegs <= sf->nsegs)
    return 0;
  uint32_t cap = sf->nsegs ? sf->nsegs : 1;
  while (cap < nsegs)
    cap *= 2;
  uint8_t **s = realloc(sf->segs, cap * sizeof(*s));
  if (!s)
    return -ENOMEM;
  memset(s + sf->nsegs, 0, (cap - sf->nsegs) * sizeof(*s));
  sf->segs = s;
  sf->nsegs = cap;
  return 0;
}

/* Make segment i hold at least `need` bytes (need <= CKPT_SEG_SIZE). */
static int ensure_segment(ckpt_sfile_t *sf, uint32_t i, uint64_t need) {
  uint64_t cap = sf->segs[i] ? seg_cap(sf, i) : 0;
  if (cap >= need)
    return 0;
  uint64_t want = CKPT_SEG_SIZE;
  if (i == 0) {
    want = cap ? cap : SEG0_MIN;
    while (want < need)
      want *= 2;
    if (want > CKPT_SEG_SIZE)
      want = CKPT_SEG_SIZE;
  }
  if (!budget_take(sf->budget, want - cap))
    return -ENOSPC;
  uint8_t *p = realloc(sf->segs[i], want);
  if (!p) {
    budget_give(sf->budget, want - cap);
    return -ENOMEM;
  }
  memset(p + cap, 0, want - cap);
  sf->segs[i] = p;
  if (i == 0)
    sf->seg0_cap = (uint32_t)want;
  return 0;
}

ssize_t ckpt__sfile_write(ckpt_sfile_t *sf, const void *buf, size_t n,
                          uint64_t off) {
  if (n == 0)
    return 0;
  if (off > INT64_MAX - n || ((off + n - 1) >> CKPT_SEG_SHIFT) >= UINT32_MAX)
    return -EFBIG;
  pthread_mutex_lock(&sf->lock);
  uint32_t last = (uint32_t)((off + n - 1) >> CKPT_SEG_SHIFT);
  int rc = grow_index(sf, last + 1);
  /* A file that grows past segment 0 needs it whole. */
  if (rc == 0 && last > 0 && sf->segs[0] && sf->seg0_cap < CKPT_SEG_SIZE)
    rc = ensure_segment(sf, 0, CKPT_SEG_SIZE);
  size_t done = 0;
  while (rc == 0 && done < n) {
    uint64_t pos = off + done;
    uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
    uint64_t in = pos & (CKPT_SEG_SIZE - 1);
    size_t chunk = n - done;
    if (chunk > CKPT_SEG_SIZE - in)
      chunk = (size_t)(CKPT_SEG_SIZE - in);
    rc = ensure_segment(sf, i, last > 0 ? CKPT_SEG_SIZE : in + chunk);
    if (rc)
      break;
    memcpy(sf->segs[i] + in, (const uint8_t *)buf + done, chunk);
    done += chunk;
  }
  if (off + done > sf->size)
    sf->size = off + done;
  pthread_mutex_unlock(&sf->lock);
  return done ? (ssize_t)done : rc;
}

size_t ckpt__sfile_read(ckpt_sfile_t *sf, void *buf, size_t n, uint64_t off) {
  pthread_mutex_lock(&sf->lock);
  size_t total = 0;
  if (off < sf->size) {
    if (n > sf->size - off)
      n = (size_t)(sf->size - off);
    while (total < n) {
      uint64_t pos = off + total;
      uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
      uint64_t in = pos & (CKPT_SEG_SIZE - 1);
      size_t chunk = n - total;
      if (chunk > CKPT_SEG_SIZE - in)
        chunk = (size_t)(CKPT_SEG_SIZE - in);
      uint8_t *dst = (uint8_t *)buf + total;
      uint64_t have = (i < sf->nsegs && sf->segs[i]) ? seg_cap(sf, i) : 0;
      size_t from_seg = in < have ? (size_t)(have - in < chunk ? have - in
                                                                : chunk)
                                  : 0;
      if (from_seg)
        memcpy(dst, sf->segs[i] + in, from_seg);
      memset(dst + from_seg, 0, chunk - from_seg);
      total += chunk;
    }
  }
  pthread_mutex_unlock(&sf->lock);
  return total;
}

int ckpt__sfile_truncate(ckpt_sfile_t *sf, uint64_t size) {
  if (size > INT64_MAX || (size >> CKPT_SEG_SHIFT) >= UINT32_MAX)
    return -EFBIG;
  pthread_mutex_lock(&sf->lock);
  if (size < sf->size) {
    /* Free whole segments past the end, zero the tail of the last one so
     * that growing the file again reads zeros. */
    uint32_t keep = (uint32_t)((size + CKPT_SEG_SIZE - 1) >> CKPT_SEG_SHIFT);
    if (keep < sf->nsegs)
      drop_segments(sf, keep);
    uint32_t i = (uint32_t)(size >> CKPT_SEG_SHIFT);
    uint64_t in = size & (CKPT_SEG_SIZE - 1);
    /* Segment 0 of a small file may end before `in` (the file grew by
     * truncate or by writes to later segments only). */
    if (in && i < sf->nsegs && sf->segs[i] && in < seg_cap(sf, i))
      memset(sf->segs[i] + in, 0, seg_cap(sf, i) - in);
  }
  sf->size = size;
  pthread_mutex_unlock(&sf->lock);
  return 0;
}

uint64_t ckpt__sfile_size(ckpt_sfile_t *sf) {
  pthread_mutex_lock(&sf->lock);
  uint64_t s = sf->size;
  pthread_mutex_unlock(&sf->lock);
  return s;
}

int ckpt__sfile_walk(ckpt_sfile_t *sf,
                     int (*fn)(void *arg, const void *p, size_t n),
                     void *arg) {
  uint64_t pos = 0;
  while (pos < sf->size) {
    uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
    uint64_t in = pos & (CKPT_SEG_SIZE - 1);
    uint64_t chunk = sf->size - pos;
    if (chunk > CKPT_SEG_SIZE - in)
      chunk = CKPT_SEG_SIZE - in;
    uint64_t have = (i < sf->nsegs && sf->segs[i]) ? seg_cap(sf, i) : 0;
    int rc;
    if (in < have) {
      uint64_t n = have - in < chunk ? have - in : chunk;
      if ((rc = fn(arg, sf->segs[i] + in, (size_t)n)) != 0)
        return rc;
      pos += n;
    } else {
      uint64_t n = chunk < sizeof(zero_page) ? chunk : sizeof(zero_page);
      if ((rc = fn(arg, zero_page, (size_t)n)) != 0)
        return rc;
      pos += n;
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------
 * xattrs: validated when set, against the others already set.
 * ---------------------------------------------------------------------- */

int ckpt__xattr_index(const char *name) {
  for (int i = 0; i < CKPT_X_COUNT; i++)
    if (strcmp(name, ckpt__xattr_names[i]) == 0)
      return i;
  return -1;
}

static bool parse_dims(const char *v, ckpt_dims_t *d) {
  return v && ckpt_dims_parse(v, strlen(v), d) == 0;
}

/* Would the xattrs be consistent with value `val` at index `idx`? */
static int check_consistent(ckpt_sfile_t *sf, int idx, const char *val,
                            size_t len) {
  const char *v[CKPT_X_COUNT];
  for (int i = 0; i < CKPT_X_COUNT; i++)
    v[i] = sf->xattr[i];
  v[idx] = val;
  if (idx == CKPT_X_DTYPE) {
    ckpt_dtype_t dt;
    return ckpt_dtype_parse(val, len, &dt);
  }
  ckpt_dims_t shape, offs, sizes;
  if (ckpt_dims_parse(val, len, idx == CKPT_X_SHAPE    ? &shape
                                : idx == CKPT_X_OFFSETS ? &offs
                                                        : &sizes) != 0)
    return -EINVAL;
  bool has_shape = idx == CKPT_X_SHAPE || parse_dims(v[CKPT_X_SHAPE], &shape);
  bool has_offs = idx == CKPT_X_OFFSETS || parse_dims(v[CKPT_X_OFFSETS], &offs);
  bool has_sizes = idx == CKPT_X_SIZES || parse_dims(v[CKPT_X_SIZES], &sizes);
  if (has_shape) {
    uint64_t numel;
    if (ckpt_dims_numel(shape.d, shape.ndim, &numel) != 0)
      return -EINVAL;
    if ((has_offs && offs.ndim != shape.ndim) ||
        (has_sizes && sizes.ndim != shape.ndim))
      return -EINVAL;
    for (int i = 0; i < shape.ndim; i++) {
      int64_t o = has_offs ? offs.d[i] : 0;
      int64_t s = has_sizes ? sizes.d[i] : shape.d[i] - o;
      if (o > shape.d[i] || s > shape.d[i] - o)
        return -EINVAL;
    }
  } else if (has_offs && has_sizes && offs.ndim != sizes.ndim) {
    return -EINVAL;
  }
  return 0;
}

int ckpt__sfile_setxattr(ckpt_sfile_t *sf, const char *name, const char *val,
                         size_t len, int flags) {
  int idx = ckpt__xattr_index(name);
  if (idx < 0)
    return -ENOTSUP;
  if (len > 4096 || memchr(val, '\0', len))
    return -EINVAL;
  char *copy = malloc(len + 1);
  if (!copy)
    return -ENOMEM;
  memcpy(copy, val, len);
  copy[len] = '\0';
  pthread_mutex_lock(&sf->lock);
  int rc = 0;
  if ((flags & XATTR_CREATE) && sf->xattr[idx])
    rc = -EEXIST;
  else if ((flags & XATTR_REPLACE) && !sf->xattr[idx])
    rc = -ENODATA;
  else
    rc = check_consistent(sf, idx, copy, len);
  if (rc == 0) {
    free(sf->xattr[idx]);
    sf->xattr[idx] = copy;
    copy = NULL;
  }
  pthread_mutex_unlock(&sf->lock);
  free(copy);
  return rc;
}

int ckpt__sfile_getxattr(ckpt_sfile_t *sf, const char *name, char *buf,
                         size_t size) {
  int idx = ckpt__xattr_index(name);
  if (idx < 0)
    return -ENODATA;
  pthread_mutex_lock(&sf->lock);
  int rc;
  const char *v = sf->xattr[idx];
  if (!v) {
    rc = -ENODATA;
  } else {
    size_t n = strlen(v);
    if (size == 0)
      rc = (int)n;
    else if (size < n)
      rc = -ERANGE;
    else
      memcpy(buf, v, n), rc = (int)n;
  }
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

int ckpt__sfile_removexattr(ckpt_sfile_t *sf, const char *name) {
  int idx = ckpt__xattr_index(name);
  if (idx < 0)
    return -ENODATA;
  pthread_mutex_lock(&sf->lock);
  int rc = sf->xattr[idx] ? 0 : -ENODATA;
  free(sf->xattr[idx]);
  sf->xattr[idx] = NULL;
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

int ckpt__sfile_listxattr(ckpt_sfile_t *sf, char *buf, size_t size) {
  pthread_mutex_lock(&sf->lock);
  size_t need = 0;
  for (int i = 0; i < CKPT_X_COUNT; i++)
    if (sf->xattr[i])
      need += strlen(ckpt__xattr_names[i]) + 1;
  int rc = (int)need;
  if (size && size < need) {
    rc = -ERANGE;
  } else if (size) {
    char *p = buf;
    for (int i = 0; i < CKPT_X_COUNT; i++)
      if (sf->xattr[i]) {
        size_t l = strlen(ckpt__xattr_names[i]) + 1;
        memcpy(p, ckpt__xattr_names[i], l);
        p += l;
      }
  }
  pthread_mutex_unlock(&sf->lock);
  return rc;
}
