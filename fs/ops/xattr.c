/*
 * xattr.c - extended attributes: user.ckpt.* of staged files (a
 * tensor's description), of committed items and checkpoints (read-only,
 * but for protected), and of the root (the world).
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "catalog.h"
#include "metadb.h"
#include "ops_int.h"

/* ------------------------------------------------------------------------
 * Extended attributes.
 * ---------------------------------------------------------------------- */

static void reply_xattr_value(fuse_req_t req, const char *v, size_t len,
                              size_t size) {
  if (size == 0)
    fuse_reply_xattr(req, len);
  else if (size < len)
    fuse_reply_err(req, ERANGE);
  else
    fuse_reply_buf(req, v, len);
}

/* Say why a user.ckpt.* value was refused, with the valid forms. */
static void log_refused_xattr(ckpt_fs_t *fs, ckpt_node_t *n, const char *name,
                              const char *value, size_t size) {
  pthread_mutex_lock(&fs->lock);
  char *path = ckpt__node_path(n);
  pthread_mutex_unlock(&fs->lock);
  const char *want;
  char dtypes[512] = "";
  if (strcmp(name, "user.ckpt.dtype") == 0) {
    size_t off = 0;
    for (int d = 0; d < CKPT_DTYPE_COUNT && off < sizeof(dtypes); d++)
      off += (size_t)snprintf(dtypes + off, sizeof(dtypes) - off, "%s%s",
                              d ? ", " : "", ckpt_dtype_name((ckpt_dtype_t)d));
    want = dtypes;
  } else if (strcmp(name, "user.ckpt.fqn") == 0) {
    want = "the item's FQN: 1 to 4096 bytes, no NUL";
  } else {
    want = "comma-separated whole numbers (4096,1024; empty for a scalar), "
           "as many as the shape's, with offsets + sizes within the shape";
  }
  char shown[300];
  ckpt__op_log_text(shown, sizeof(shown), value, size);
  ckpt__log("%s/%s: refused %s=\"%s\": valid: %s", n->ck->name,
            path ? path : "?", name, shown, want);
  free(path);
}

/* What committed node n was staged as (its entries row), or NULL. */
static const ckpt_entry_attr_t *node_entry(const ckpt_node_t *n) {
  return n->entry && n->ck && n->ck->meta ? &n->ck->meta->entries[n->entry - 1]
                                          : NULL;
}

/* A staged directory or checkpoint directory: its other xattrs. */
static bool staged_dir(ckpt_fs_t *fs, const ckpt_node_t *n) {
  if (n->kind == CKPT_NODE_SDIR)
    return true;
  if (n->kind != CKPT_NODE_CKPT)
    return false;
  pthread_mutex_lock(&fs->lock);
  bool yes = n->ck->state != CKPT_COMMITTED;
  pthread_mutex_unlock(&fs->lock);
  return yes;
}

static int set_dir_xattr(ckpt_fs_t *fs, ckpt_node_t *n, const char *name,
                         const char *value, size_t size, int flags) {
  if (!ckpt_xattr_name_ok(name, strlen(name)))
    return -ENOTSUP;
  int rc = ckpt__op_staged_change_begin(fs, n->ck);
  if (rc == 0) {
    pthread_mutex_lock(&fs->lock);
    rc = ckpt__xlist_set(&n->xl, name, value, size, flags);
    pthread_mutex_unlock(&fs->lock);
    ckpt__op_staged_change_end(n->ck);
  }
  return rc;
}

/* The staged file at path rel (relative, no "." or ".." component)
 * below staged directory dir, referenced, or NULL with *rc. fs->lock
 * held. */
static ckpt_node_t *staged_file_at(ckpt_fs_t *fs, ckpt_node_t *dir,
                                   const char *rel, const struct fuse_ctx *ctx,
                                   int *rc) {
  CKPT_HELD(&fs->lock);
  char name[NAME_MAX + 1];
  ckpt_node_t *n = dir;
  if (!dir->attached) { /* removed, still open: nothing below it */
    *rc = -ENOENT;
    return NULL;
  }
  for (const char *p = rel;;) {
    const char *slash = strchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    if (len == 0 || len > NAME_MAX || (len == 1 && p[0] == '.') ||
        (len == 2 && p[0] == '.' && p[1] == '.')) {
      *rc = -EINVAL;
      return NULL;
    }
    if (n->kind != CKPT_NODE_SDIR && n->kind != CKPT_NODE_CKPT) {
      *rc = -ENOTDIR;
      return NULL;
    }
    if (!ckpt__op_may_search_node(ctx, n)) {
      *rc = -EACCES; /* as a path through it would be */
      return NULL;
    }
    memcpy(name, p, len);
    name[len] = '\0';
    if (!(n = ckpt__node_child(fs, n, name))) {
      *rc = -ENOENT;
      return NULL;
    }
    if (!slash)
      break;
    p = slash + 1;
  }
  if (n->kind != CKPT_NODE_SFILE || n->ck != dir->ck) {
    *rc = n->kind == CKPT_NODE_SDIR ? -EISDIR : -EINVAL;
    return NULL;
  }
  if (!ckpt__op_may_write_node(ctx, n)) {
    *rc = -EACCES; /* as a setxattr on the file itself would be */
    return NULL;
  }
  ckpt__node_ref(n);
  return n;
}

/* user.ckpt.metas on staged directory dir: many files' user.ckpt.meta in
 * one request (the Python writers send them once a checkpoint's files are
 * written: one FUSE round trip per file fewer). The value is records of
 * PATH NUL META NUL, PATH relative to dir, META as for user.ckpt.meta.
 * Applied in order, as that many setxattrs would be: the first record that
 * fails ends the batch with its error (logged, with its path), the ones
 * before it stay set. */
static int set_metas(ckpt_fs_t *fs, ckpt_node_t *dir, const char *value,
                     size_t size, const struct fuse_ctx *ctx) {
  if (size == 0 || value[size - 1] != '\0')
    return -EINVAL; /* (the last record ends with its NUL) */
  int rc = ckpt__op_staged_change_begin(fs, dir->ck);
  if (rc)
    return rc;
  for (const char *p = value, *end = value + size; rc == 0 && p < end;) {
    const char *meta = (const char *)memchr(p, '\0', (size_t)(end - p)) + 1;
    const char *next =
        meta < end ? memchr(meta, '\0', (size_t)(end - meta)) : NULL;
    if (!next) {
      ckpt__log("%s: user.ckpt.metas: a path without its meta at byte %zu",
                dir->ck->name, (size_t)(p - value));
      rc = -EINVAL;
      break;
    }
    pthread_mutex_lock(&fs->lock);
    ckpt_node_t *n = staged_file_at(fs, dir, p, ctx, &rc);
    pthread_mutex_unlock(&fs->lock);
    if (n) {
      size_t len = (size_t)(next - meta);
      rc = ckpt__sfile_setxattr(n->u.sf, CKPT_XATTR_META, meta, len, 0);
      if (rc == -EINVAL)
        log_refused_xattr(fs, n, CKPT_XATTR_META, meta, len);
      pthread_mutex_lock(&fs->lock);
      ckpt__node_unref(fs, n);
      pthread_mutex_unlock(&fs->lock);
    } else {
      char shown[300];
      ckpt__op_log_text(shown, sizeof(shown), p, strlen(p));
      ckpt__log("%s: user.ckpt.metas: \"%s\": %s", dir->ck->name, shown,
                strerror(-rc));
    }
    p = next + 1;
  }
  ckpt__op_staged_change_end(dir->ck);
  return rc;
}

/* The reply to a getxattr or listxattr whose answer rc (its length, or
 * -errno) was put in buf of size bytes (size 0: only the length); frees
 * buf. */
static void reply_filled(fuse_req_t req, int rc, char *buf, size_t size) {
  if (rc < 0)
    fuse_reply_err(req, -rc);
  else if (size == 0)
    fuse_reply_xattr(req, (size_t)rc);
  else
    fuse_reply_buf(req, buf, (size_t)rc);
  free(buf);
}

/* getxattr of a name found in v[k] (under the lock that protects v, if
 * any): replied. */
static void reply_kept(fuse_req_t req, pthread_mutex_t *lock,
                       const ckpt_xattr_t *const *v, const uint32_t *k,
                       const char *name, size_t size) {
  char *buf = size ? malloc(size) : NULL;
  int rc = -ENOMEM;
  if (!size || buf) {
    if (lock)
      pthread_mutex_lock(lock);
    rc = ckpt__xattrs_get(*v, *k, name, buf, size);
    if (lock)
      pthread_mutex_unlock(lock);
  }
  reply_filled(req, rc, buf, size);
}

/* The FQN of a committed tensor or bytes item. */
static const char *committed_fqn(const ckpt_node_t *n) {
  const ckpt_metadata_t *m = n->ck->meta;
  return n->kind == CKPT_NODE_CTENSOR ? m->tensors[n->u.tensor].fqn
                                      : m->blobs[n->u.blob].fqn;
}

/* Is the FQN of a committed item the one its path gives ('/' -> '.')? */
static bool committed_fqn_derived(const ckpt_node_t *n) {
  const ckpt_metadata_t *m = n->ck->meta;
  const char *path = n->kind == CKPT_NODE_CTENSOR
                         ? m->tensors[n->u.tensor].path
                         : m->blobs[n->u.blob].path;
  const char *fqn = committed_fqn(n);
  for (; *path && *fqn; path++, fqn++)
    if (*fqn != (*path == '/' ? '.' : *path))
      return false;
  return *path == '\0' && *fqn == '\0';
}

/* A committed checkpoint's directory tells what retention sees of it:
 * user.ckpt.step (recorded at commit, else from the name),
 * user.ckpt.metric.KEY per metric, user.ckpt.protected (0 or 1: the
 * marker of ckptctl protect, else the commit word). false when n is not
 * such a directory. */
#define METRIC_XATTR "user.ckpt.metric."
static bool committed_ckpt(ckpt_fs_t *fs, const ckpt_node_t *n) {
  if (n->kind != CKPT_NODE_CKPT)
    return false;
  pthread_mutex_lock(&fs->lock);
  bool yes = n->ck->state == CKPT_COMMITTED && n->ck->meta;
  pthread_mutex_unlock(&fs->lock);
  return yes;
}

static void reply_ckpt_xattr(fuse_req_t req, ckpt_fs_t *fs,
                             const ckpt_node_t *n, const char *name,
                             size_t size) {
  const ckpt_metadata_t *m = n->ck->meta;
  char v[48];
  double x;
  int len = -1;
  if (strcmp(name, "user.ckpt.step") == 0) {
    int64_t step = m->has_step ? m->step : ckpt_step_from_name(n->ck->name);
    if (step >= 0)
      len = snprintf(v, sizeof(v), "%lld", (long long)step);
  } else if (strcmp(name, "user.ckpt.protected") == 0) {
    /* the mark is BACKING_DIR's (a tier's copy has none) */
    int dfd = ckpt_store_open_dir(fs->backing_fd, n->ck->name, O_RDONLY);
    int mark = dfd >= 0 ? ckpt__protect_read(dfd) : -1;
    if (dfd >= 0)
      close(dfd);
    len = snprintf(v, sizeof(v), "%d", mark >= 0 ? mark : m->protect);
  } else if (strncmp(name, METRIC_XATTR, strlen(METRIC_XATTR)) == 0 &&
             ckpt_metadata_metric(m, name + strlen(METRIC_XATTR), &x)) {
    len = ckpt_metric_format(x, v, sizeof(v));
  }
  if (len < 0)
    fuse_reply_err(req, ENODATA);
  else
    reply_xattr_value(req, v, (size_t)len, size);
}

/* setxattr user.ckpt.protected 1 or 0 on a committed checkpoint's
 * directory: ckptctl protect / unprotect (catalog.c), on BACKING_DIR. */
static int set_protected(ckpt_fs_t *fs, const ckpt_node_t *n,
                         const char *value, size_t size) {
  if (size && value[size - 1] == '\n')
    size--;
  if (size != 1 || (value[0] != '0' && value[0] != '1'))
    return -EINVAL;
  int rc = ckpt__checkpoint_protect(fs->backing_fd, n->ck->name,
                                    value[0] == '1');
  if (rc == -ENOENT && fs->tier_fd >= 0)
    rc = -EAGAIN; /* in the tier only: not flushed yet */
  if (rc)
    ckpt__log("%s: user.ckpt.protected=%c refused: %s%s", n->ck->name,
              value[0], strerror(-rc),
              rc == -EAGAIN ? " (not flushed to BACKING_DIR yet; try again "
                              "once it is)" : "");
  else
    ckpt__log("%s: %s", n->ck->name,
              value[0] == '1' ? "protected" : "no longer protected");
  return rc;
}

static int list_ckpt_xattrs(const ckpt_node_t *n, ckpt_buf_t *b) {
  const ckpt_metadata_t *m = n->ck->meta;
  bool step = m->has_step || ckpt_step_from_name(n->ck->name) >= 0;
  int rc = step ? ckpt_buf_append(b, "user.ckpt.step", 15) : 0;
  if (rc == 0)
    rc = ckpt_buf_append(b, "user.ckpt.protected", 20);
  for (uint32_t i = 0; rc == 0 && i < m->n_metrics; i++)
    rc = ckpt_buf_printf(b, METRIC_XATTR "%s", m->metrics[i].key) < 0
             ? -ENOMEM
             : ckpt_buf_append(b, "", 1);
  return rc;
}

void ckpt__op_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                        const char *value, size_t size, int flags) {
  ckpt__metrics_request(req, CKPT_OP_setxattr);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int rc;
  if (n->kind == CKPT_NODE_ROOT && strcmp(name, CKPT_JOB_XATTR) == 0) {
    rc = ckpt__job_declare(fs, fuse_req_ctx(req)->pid, value, size);
  } else if (ckpt__op_is_committed_kind(n->kind)) {
    rc = -EROFS;
  } else if (committed_ckpt(fs, n) &&
             strcmp(name, "user.ckpt.protected") == 0) {
    rc = set_protected(fs, n, value, size);
  } else if (committed_ckpt(fs, n)) {
    rc = -EROFS;
  } else if (staged_dir(fs, n) && strcmp(name, CKPT_XATTR_METAS) == 0) {
    rc = flags ? -EINVAL : set_metas(fs, n, value, size, fuse_req_ctx(req));
  } else if (staged_dir(fs, n) && strcmp(name, CKPT_XATTR_MKDIRS) == 0) {
    rc = flags ? -EINVAL : ckpt__op_mkdirs(fs, n, value, size, fuse_req_ctx(req));
  } else if (staged_dir(fs, n)) {
    rc = set_dir_xattr(fs, n, name, value, size, flags);
  } else if (n->kind == CKPT_NODE_SLINK) {
    rc = -EPERM; /* as Linux: no user.* attributes on a symbolic link */
  } else if (n->kind != CKPT_NODE_SFILE) {
    rc = -ENOTSUP;
  } else {
    if ((rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
      rc = ckpt__sfile_setxattr(n->u.sf, name, value, size, flags);
      ckpt__op_staged_change_end(n->ck);
    }
    if (rc == -EINVAL)
      log_refused_xattr(fs, n, name, value, size);
  }
  ckpt__op_put_node(fs, n);
  fuse_reply_err(req, -rc);
}

/* The root tells the mount's world, so that a trainer can check its own
 * world size and rank against the mount's before staging anything. */
static const char root_xattrs[] = "user.ckpt.world_size\0user.ckpt.rank";

static void reply_root_xattr(fuse_req_t req, const ckpt_fs_t *fs,
                             const char *name, size_t size) {
  char v[16];
  int len;
  if (strcmp(name, "user.ckpt.world_size") == 0)
    len = snprintf(v, sizeof(v), "%d", fs->world_size);
  else if (strcmp(name, "user.ckpt.rank") == 0)
    len = snprintf(v, sizeof(v), "%d", fs->rank);
  else {
    fuse_reply_err(req, ENODATA);
    return;
  }
  reply_xattr_value(req, v, (size_t)len, size);
}

void ckpt__op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                        size_t size) {
  ckpt__metrics_request(req, CKPT_OP_getxattr);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  const ckpt_entry_attr_t *e = ckpt__op_is_committed_kind(n->kind) ||
                                       committed_ckpt(fs, n)
                                   ? node_entry(n)
                                   : NULL;
  if (n->kind == CKPT_NODE_ROOT) {
    reply_root_xattr(req, fs, name, size);
  } else if (e && ckpt__xattr_index(name) < 0 &&
             ckpt_xattr_name_ok(name, strlen(name))) {
    reply_kept(req, NULL, (const ckpt_xattr_t *const *)&e->xattrs,
               &e->n_xattrs, name, size);
  } else if (committed_ckpt(fs, n)) {
    reply_ckpt_xattr(req, fs, n, name, size);
  } else if (staged_dir(fs, n)) {
    reply_kept(req, &fs->lock, (const ckpt_xattr_t *const *)&n->xl.v,
               &n->xl.n, name, size);
  } else if (n->kind == CKPT_NODE_SFILE) {
    char *buf = size ? malloc(size) : NULL;
    reply_filled(req, size && !buf ? -ENOMEM : ckpt__sfile_getxattr(n->u.sf, name, buf, size), buf,
                 size);
  } else if ((n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_CBLOB) &&
             ckpt__xattr_index(name) == CKPT_X_FQN) {
    const char *fqn = committed_fqn(n);
    reply_xattr_value(req, fqn, strlen(fqn), size);
  } else if (n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_CBLOCK) {
    bool blk = n->kind == CKPT_NODE_CBLOCK;
    const ckpt_tensor_meta_t *t =
        &n->ck->meta->tensors[blk ? n->u.block->tensor : n->u.tensor];
    /* A block file's shape is the block's. */
    const int64_t *shape = blk ? n->u.block->dims + t->ndim : t->shape;
    int idx = ckpt__xattr_index(name);
    if (idx == CKPT_X_DTYPE) {
      const char *v = ckpt_dtype_name(t->dtype);
      reply_xattr_value(req, v, strlen(v), size);
    } else if (idx == CKPT_X_SHAPE) {
      int len = ckpt_dims_format(shape, t->ndim, CKPT_DIMS_CSV, NULL, 0);
      char *v = malloc((size_t)len + 1);
      if (!v) {
        fuse_reply_err(req, ENOMEM);
      } else {
        ckpt_dims_format(shape, t->ndim, CKPT_DIMS_CSV, v, (size_t)len + 1);
        reply_xattr_value(req, v, (size_t)len, size);
        free(v);
      }
    } else {
      fuse_reply_err(req, ENODATA);
    }
  } else {
    fuse_reply_err(req, ENODATA);
  }
  ckpt__op_put_node(fs, n);
}

/* The names a committed item or block lists: user.ckpt.fqn where the
 * path does not say the FQN (so that copying the tree keeps it; getxattr
 * answers it always). */
static int list_item_xattrs(const ckpt_node_t *n, ckpt_buf_t *b) {
  static const char names[] =
      "user.ckpt.dtype\0user.ckpt.shape\0user.ckpt.fqn";
  const size_t fqn_at = sizeof("user.ckpt.dtype\0user.ckpt.shape");
  if (n->kind == CKPT_NODE_CBLOCK)
    return ckpt_buf_append(b, names, fqn_at);
  bool tensor = n->kind == CKPT_NODE_CTENSOR;
  bool fqn = !committed_fqn_derived(n);
  size_t len = tensor ? (fqn ? sizeof(names) : fqn_at)
                      : (fqn ? sizeof(names) - fqn_at : 0);
  return ckpt_buf_append(b, tensor ? names : names + fqn_at, len);
}

void ckpt__op_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  ckpt__metrics_request(req, CKPT_OP_listxattr);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  if (n->kind == CKPT_NODE_SFILE) {
    char *buf = size ? malloc(size) : NULL;
    reply_filled(req, size && !buf ? -ENOMEM : ckpt__sfile_listxattr(n->u.sf, buf, size), buf,
                 size);
    ckpt__op_put_node(fs, n);
    return;
  }
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  int rc = 0;
  bool committed = committed_ckpt(fs, n);
  if (n->kind == CKPT_NODE_ROOT) {
    rc = ckpt_buf_append(&b, root_xattrs, sizeof(root_xattrs));
  } else if (committed) {
    rc = list_ckpt_xattrs(n, &b);
  } else if (staged_dir(fs, n)) {
    pthread_mutex_lock(&fs->lock);
    rc = ckpt__xattrs_names(n->xl.v, n->xl.n, &b);
    pthread_mutex_unlock(&fs->lock);
  } else if (n->kind == CKPT_NODE_CBLOCK || n->kind == CKPT_NODE_CTENSOR ||
             n->kind == CKPT_NODE_CBLOB) {
    rc = list_item_xattrs(n, &b);
  }
  const ckpt_entry_attr_t *e =
      committed || ckpt__op_is_committed_kind(n->kind) ? node_entry(n) : NULL;
  if (rc == 0 && e)
    rc = ckpt__xattrs_names(e->xattrs, e->n_xattrs, &b);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    reply_xattr_value(req, (const char *)b.data, b.len, size);
  ckpt_buf_free(&b);
  ckpt__op_put_node(fs, n);
}

void ckpt__op_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_removexattr);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int rc;
  if (n->kind == CKPT_NODE_ROOT && strcmp(name, CKPT_JOB_XATTR) == 0) {
    rc = ckpt__job_declare(fs, fuse_req_ctx(req)->pid, "end", 3);
  } else if (ckpt__op_is_committed_kind(n->kind)) {
    rc = -EROFS;
  } else if (staged_dir(fs, n)) {
    if ((rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
      pthread_mutex_lock(&fs->lock);
      rc = ckpt__xlist_remove(&n->xl, name);
      pthread_mutex_unlock(&fs->lock);
      ckpt__op_staged_change_end(n->ck);
    }
  } else if (n->kind != CKPT_NODE_SFILE) {
    rc = -ENODATA;
  } else {
    if ((rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
      rc = ckpt__sfile_removexattr(n->u.sf, name);
      ckpt__op_staged_change_end(n->ck);
    }
  }
  ckpt__op_put_node(fs, n);
  fuse_reply_err(req, -rc);
}
