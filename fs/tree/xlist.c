/*
 * xlist.c - the extended attributes a staged entry keeps besides
 * ckptfs's own (user.* but user.ckpt.*): a small sorted array per entry,
 * bounded as ckpt_planner.h says, copied into the entry's row at commit.
 * The caller holds the lock that protects the list.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>

#include "tree.h"

/* Index of name in v[n], or -(insertion point) - 1. */
static int64_t find(const ckpt_xattr_t *v, uint32_t n, const char *name) {
  uint32_t lo = 0, hi = n;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    int c = strcmp(v[mid].name, name);
    if (c == 0)
      return mid;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -(int64_t)lo - 1;
}

/* Bytes of names and values in l, without entry skip (-1: none). */
static uint64_t total(const ckpt_xlist_t *l, int64_t skip) {
  uint64_t t = 0;
  for (uint32_t i = 0; i < l->n; i++)
    if ((int64_t)i != skip)
      t += strlen(l->v[i].name) + l->v[i].len;
  return t;
}

int ckpt__xlist_set(ckpt_xlist_t *l, const char *name, const void *val,
                    size_t len, int flags) {
  if (len > CKPT_XATTR_VALUE_MAX)
    return -E2BIG;
  int64_t at = find(l->v, l->n, name);
  if (at >= 0 && (flags & XATTR_CREATE))
    return -EEXIST;
  if (at < 0 && (flags & XATTR_REPLACE))
    return -ENODATA;
  if ((at < 0 && l->n >= CKPT_XATTR_COUNT_MAX) ||
      total(l, at) + strlen(name) + len > CKPT_XATTR_TOTAL_MAX)
    return -ENOSPC;
  uint8_t *copy = len ? malloc(len) : NULL;
  if (len && !copy)
    return -ENOMEM;
  if (len)
    memcpy(copy, val, len);
  if (at >= 0) {
    free(l->v[at].value);
    l->v[at].value = copy;
    l->v[at].len = (uint32_t)len;
    return 0;
  }
  char *nm = strdup(name);
  ckpt_xattr_t *v = nm ? realloc(l->v, (l->n + 1) * sizeof(*v)) : NULL;
  if (!v) {
    free(nm);
    free(copy);
    return -ENOMEM;
  }
  size_t pos = (size_t)(-at - 1);
  memmove(&v[pos + 1], &v[pos], (l->n - pos) * sizeof(*v));
  v[pos] = (ckpt_xattr_t){nm, copy, (uint32_t)len};
  l->v = v;
  l->n++;
  return 0;
}

int ckpt__xlist_remove(ckpt_xlist_t *l, const char *name) {
  int64_t at = find(l->v, l->n, name);
  if (at < 0)
    return -ENODATA;
  free(l->v[at].name);
  free(l->v[at].value);
  memmove(&l->v[at], &l->v[at + 1], (l->n - (size_t)at - 1) * sizeof(*l->v));
  l->n--;
  return 0;
}

void ckpt__xlist_free(ckpt_xlist_t *l) {
  for (uint32_t i = 0; i < l->n; i++) {
    free(l->v[i].name);
    free(l->v[i].value);
  }
  free(l->v);
  l->v = NULL;
  l->n = 0;
}

int ckpt__xlist_copy_out(const ckpt_xlist_t *l, ckpt_entry_attr_t *e) {
  ckpt_entry_attr_t src = {.path = "", .n_xattrs = l->n, .xattrs = l->v};
  ckpt_entry_attr_t tmp;
  if (l->n == 0)
    return 0;
  if (ckpt_entry_attr_copy(&tmp, &src))
    return -ENOMEM;
  free(tmp.path);
  e->n_xattrs = tmp.n_xattrs;
  e->xattrs = tmp.xattrs;
  return 0;
}

int ckpt__xattrs_get(const ckpt_xattr_t *v, uint32_t n, const char *name,
                     void *buf, size_t size) {
  int64_t at = find(v, n, name);
  if (at < 0)
    return -ENODATA;
  if (size == 0)
    return (int)v[at].len;
  if (size < v[at].len)
    return -ERANGE;
  if (v[at].len)
    memcpy(buf, v[at].value, v[at].len);
  return (int)v[at].len;
}

int ckpt__xattrs_names(const ckpt_xattr_t *v, uint32_t n, ckpt_buf_t *b) {
  int rc = 0;
  for (uint32_t i = 0; rc == 0 && i < n; i++)
    rc = ckpt_buf_append(b, v[i].name, strlen(v[i].name) + 1);
  return rc;
}
