/*
 * sfile_xattr.c - the user.ckpt.* xattrs of a staged file (a tensor's\n * dtype, shape, offsets, sizes, FQN): validated when set, against the\n * others already set.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <xxhash.h>

#include "stage_int.h"

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

/* Is v[idx] valid, and consistent with the other values of v (NULL:
 * not set)? */
static int check_xattrs(const char *const v[CKPT_X_COUNT], int idx) {
  const char *val = v[idx];
  size_t len = strlen(val);
  if (idx == CKPT_X_FQN) /* any bytes but NUL (checked by the caller) */
    return ckpt_fqn_valid(val, len) ? 0 : -EINVAL;
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

/* Would the xattrs be consistent with value `val` at index `idx`? */
static int check_consistent(ckpt_sfile_t *sf, int idx, const char *val) {
  const char *v[CKPT_X_COUNT];
  for (int i = 0; i < CKPT_X_COUNT; i++)
    v[i] = sf->xattr[i];
  v[idx] = val;
  return check_xattrs(v, idx);
}

/* user.ckpt.meta = "dtype=F32;shape=4,8;offsets=0,4;sizes=4,4;fqn=m.w":
 * several xattrs in one setxattr (one FUSE request instead of one per
 * xattr). Fields are KEY=VALUE, KEY the name after "user.ckpt.", each at
 * most once, separated by ';'; fqn's value (any bytes) runs to the end, so
 * it comes last. Split into out[] (copies), or -EINVAL. */
static int split_meta(const char *val, size_t len, char *out[CKPT_X_COUNT]) {
  const char *p = val, *end = val + len;
  while (p < end) {
    const char *eq = memchr(p, '=', (size_t)(end - p));
    if (!eq)
      return -EINVAL;
    int idx = -1;
    for (int i = 0; i < CKPT_X_COUNT; i++) {
      const char *key = ckpt__xattr_names[i] + strlen("user.ckpt.");
      if (strlen(key) == (size_t)(eq - p) && memcmp(key, p, (size_t)(eq - p)) == 0)
        idx = i;
    }
    if (idx < 0 || out[idx])
      return -EINVAL;
    const char *v = eq + 1;
    const char *semi = idx == CKPT_X_FQN ? NULL : memchr(v, ';', (size_t)(end - v));
    size_t n = (size_t)((semi ? semi : end) - v);
    if (n > 4096)
      return -EINVAL;
    if (!(out[idx] = strndup(v, n)))
      return -ENOMEM;
    p = semi ? semi + 1 : end;
  }
  return len ? 0 : -EINVAL; /* nothing to set */
}

static int set_meta(ckpt_sfile_t *sf, const char *val, size_t len, int flags) {
  char *nv[CKPT_X_COUNT] = {NULL};
  int rc = split_meta(val, len, nv);
  pthread_mutex_lock(&sf->lock);
  const char *v[CKPT_X_COUNT];
  for (int i = 0; i < CKPT_X_COUNT; i++)
    v[i] = nv[i] ? nv[i] : sf->xattr[i];
  for (int i = 0; i < CKPT_X_COUNT && rc == 0; i++) {
    if (!nv[i])
      continue;
    if ((flags & XATTR_CREATE) && sf->xattr[i])
      rc = -EEXIST;
    else if ((flags & XATTR_REPLACE) && !sf->xattr[i])
      rc = -ENODATA;
    else
      rc = check_xattrs(v, i);
  }
  for (int i = 0; i < CKPT_X_COUNT && rc == 0; i++) {
    if (nv[i]) { /* all of them or none */
      free(sf->xattr[i]);
      sf->xattr[i] = nv[i];
      nv[i] = NULL;
    }
  }
  pthread_mutex_unlock(&sf->lock);
  for (int i = 0; i < CKPT_X_COUNT; i++)
    free(nv[i]);
  return rc;
}

int ckpt__sfile_setxattr(ckpt_sfile_t *sf, const char *name, const char *val,
                         size_t len, int flags) {
  if (strcmp(name, CKPT_XATTR_META) == 0) /* each field <= 4096 bytes */
    return memchr(val, '\0', len) ? -EINVAL : set_meta(sf, val, len, flags);
  int idx = ckpt__xattr_index(name);
  if (idx < 0 && ckpt_xattr_name_ok(name, strlen(name))) {
    pthread_mutex_lock(&sf->lock);
    int rc = ckpt__xlist_set(&sf->other, name, val, len, flags);
    pthread_mutex_unlock(&sf->lock);
    return rc;
  }
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
    rc = check_consistent(sf, idx, copy);
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
  int rc;
  if (idx < 0) {
    pthread_mutex_lock(&sf->lock);
    rc = ckpt__xattrs_get(sf->other.v, sf->other.n, name, buf, size);
    pthread_mutex_unlock(&sf->lock);
    return rc;
  }
  pthread_mutex_lock(&sf->lock);
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
  if (idx < 0) {
    pthread_mutex_lock(&sf->lock);
    int rc = ckpt__xlist_remove(&sf->other, name);
    pthread_mutex_unlock(&sf->lock);
    return rc;
  }
  pthread_mutex_lock(&sf->lock);
  int rc = sf->xattr[idx] ? 0 : -ENODATA;
  free(sf->xattr[idx]);
  sf->xattr[idx] = NULL;
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

int ckpt__sfile_listxattr(ckpt_sfile_t *sf, char *buf, size_t size) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  int rc = 0;
  pthread_mutex_lock(&sf->lock);
  for (int i = 0; rc == 0 && i < CKPT_X_COUNT; i++)
    if (sf->xattr[i])
      rc = ckpt_buf_append(&b, ckpt__xattr_names[i],
                           strlen(ckpt__xattr_names[i]) + 1);
  if (rc == 0)
    rc = ckpt__xattrs_names(sf->other.v, sf->other.n, &b);
  pthread_mutex_unlock(&sf->lock);
  if (rc == 0)
    rc = size && size < b.len ? -ERANGE : (int)b.len;
  if (rc > 0 && size)
    memcpy(buf, b.data, b.len);
  ckpt_buf_free(&b);
  return rc;
}

int ckpt__sfile_xattrs_copy(ckpt_sfile_t *sf, ckpt_entry_attr_t *e) {
  pthread_mutex_lock(&sf->lock);
  int rc = ckpt__xlist_copy_out(&sf->other, e);
  pthread_mutex_unlock(&sf->lock);
  return rc;
}
