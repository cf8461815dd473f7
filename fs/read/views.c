/*
 * views.c - views of a committed checkpoint in the formats other tools
 * load, generated on the fly from the stored chunks (nothing is copied on
 * disk):
 *
 *   NAME/.npy/PATH.npy      each tensor as a NumPy .npy file (header from
 *                           planner/npy.c, then the global tensor's bytes)
 *   NAME/.safetensors/      model.safetensors, or the shards
 *                           model-0000K-of-0000N.safetensors and
 *                           model.safetensors.index.json when the tensors
 *                           pass -o safetensors_shard (planner/safetensors.c)
 *
 * Like .commit and .status, the two directories are not listed by readdir
 * of NAME (listings stay as the SPEC has them) but are found by lookup;
 * their contents are listed. Their nodes are made at the first lookup of
 * each directory, and the safetensors plan (the header bytes of every
 * shard, a few hundred bytes per tensor) then too, under fs->lock, once
 * per checkpoint; it is freed with the checkpoint. A read maps its byte
 * range onto header bytes and tensor bytes, and reads the latter through
 * the committed read path (storage.c), with verify=1's checks. View files
 * are not direct_io: they go through the mount's page cache, so that
 * np.load(mmap_mode="r") (a shared mapping) works.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>

#include "read.h"

/* The state of one checkpoint's views (ck->views); fields written under
 * fs->lock before any node that uses them exists, then immutable. */
struct ckpt_views {
  bool npy_done;        /* the .npy tree is made */
  bool st_done;         /* the .safetensors files are made */
  ckpt_st_plan_t plan;  /* valid when st_done */
  char *index;          /* index json text, or NULL (one file) */
  size_t index_len;
};

#define NPY_DIR ".npy"
#define ST_DIR ".safetensors"
#define ST_INDEX "model.safetensors.index.json"
#define VIEW_AHEAD ((uint64_t)2 << 20) /* readahead step of spliced reads */

void ckpt__views_free(struct ckpt_views *v) {
  if (v == NULL)
    return;
  ckpt_st_plan_free(&v->plan);
  free(v->index);
  free(v);
}

int ckpt__views_attach(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  CKPT_HELD(&fs->lock);
  assert(ck->state == CKPT_COMMITTED && ck->meta != NULL);
  if (ck->views == NULL && (ck->views = calloc(1, sizeof(*ck->views))) == NULL)
    return -ENOMEM;
  struct timespec when = {.tv_sec = ck->meta->created_at};
  static const char *const names[] = {NPY_DIR, ST_DIR};
  for (size_t i = 0; i < 2; i++) {
    if (ckpt__node_child(fs, ck->dir, names[i]) != NULL)
      continue;
    ckpt_node_t *d = ckpt__node_new(fs, ck->dir, names[i], CKPT_NODE_VROOT,
                                    S_IFDIR | 0555, ck);
    if (d == NULL)
      return -ENOMEM;
    ckpt__committed_shared(ck, d);
    d->mtime = d->ctime = when;
  }
  return 0;
}

/* ----- .npy ----- */

/* Add PATH.npy for tensor i below root, with its directories. A path that
 * does not fit (a name beyond 255 bytes with ".npy", a file where a
 * directory is needed) is left out and logged. */
static int npy_add(ckpt_fs_t *fs, ckpt_node_t *root, uint32_t i,
                   struct timespec when) {
  ckpt_ckpt_t *ck = root->ck;
  const char *path = ck->meta->tensors[i].path;
  ckpt_node_t *dir = root;
  for (const char *p = path;;) {
    const char *slash = strchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    char name[256];
    size_t need = len + (slash ? 0 : 4);
    if (len == 0 || need > 255)
      goto skip;
    memcpy(name, p, len);
    if (slash)
      name[len] = '\0';
    else
      memcpy(name + len, ".npy", 5);
    ckpt_node_t *c = ckpt__node_child(fs, dir, name);
    if (!slash) {
      if (c != NULL)
        goto skip;
      c = ckpt__node_new(fs, dir, name, CKPT_NODE_VNPY, S_IFREG | 0444, ck);
      if (c == NULL)
        return -ENOMEM;
      ckpt__committed_shared(ck, c);
      c->u.tensor = i;
      c->mtime = c->ctime = when;
      return 0;
    }
    if (c != NULL && c->kind != CKPT_NODE_VDIR)
      goto skip;
    if (c == NULL) {
      c = ckpt__node_new(fs, dir, name, CKPT_NODE_VDIR, S_IFDIR | 0555, ck);
      if (c == NULL)
        return -ENOMEM;
      ckpt__committed_shared(ck, c);
      c->mtime = c->ctime = when;
    }
    dir = c;
    p = slash + 1;
  }
skip:
  ckpt__log("%s: no .npy view of %s (the path does not fit)", ck->name, path);
  return 0;
}

/* ----- .safetensors ----- */

static int st_build(ckpt_fs_t *fs, ckpt_node_t *root) {
  ckpt_ckpt_t *ck = root->ck;
  struct ckpt_views *v = ck->views;
  const ckpt_metadata_t *m = ck->meta;
  ckpt_st_tensor_t *t = calloc(m->n_tensors ? m->n_tensors : 1, sizeof(*t));
  if (t == NULL)
    return -ENOMEM;
  for (uint32_t i = 0; i < m->n_tensors; i++) {
    t[i].name = m->tensors[i].fqn;
    t[i].dtype = m->tensors[i].dtype;
    t[i].ndim = m->tensors[i].ndim;
    t[i].shape = m->tensors[i].shape;
  }
  int rc = ckpt_st_plan(t, m->n_tensors, fs->opts.safetensors_shard,
                        &v->plan);
  if (rc == 0 && v->plan.n_shards > 1) {
    ckpt_buf_t b;
    ckpt_buf_init(&b);
    rc = ckpt_st_index_json(&v->plan, t, m->n_tensors, &b);
    v->index_len = b.len;
    v->index = rc == 0 ? ckpt_buf_steal(&b) : NULL;
    ckpt_buf_free(&b);
    if (rc == 0 && v->index == NULL)
      rc = -ENOMEM;
  }
  free(t);
  if (rc < 0) {
    ckpt_st_plan_free(&v->plan);
    free(v->index);
    v->index = NULL;
    ckpt__log("%s: no .safetensors view: %s", ck->name, strerror(-rc));
    return rc;
  }
  for (uint32_t k = 0; k < v->plan.n_shards; k++)
    if (v->plan.shards[k].header_len - 8 > CKPT_ST_MAX_HEADER)
      ckpt__log("%s: .safetensors file %u has a header of %llu bytes: "
                "safetensors readers refuse more than %llu (a smaller "
                "safetensors_shard splits it)", ck->name, k + 1,
                (unsigned long long)(v->plan.shards[k].header_len - 8),
                (unsigned long long)CKPT_ST_MAX_HEADER);
  for (size_t i = 0; i < v->plan.n_tensors; i++)
    if (v->plan.place[i].shard == CKPT_ST_LEFT_OUT)
      ckpt__log("%s: %s left out of the .safetensors view (%s)", ck->name,
                m->tensors[i].fqn,
                ckpt_st_dtype_name(m->tensors[i].dtype)
                    ? "its name is not UTF-8 or is reserved"
                    : "safetensors has no such dtype");
  return 0;
}

static int st_add(ckpt_fs_t *fs, ckpt_node_t *root, struct timespec when) {
  ckpt_ckpt_t *ck = root->ck;
  struct ckpt_views *v = ck->views;
  for (uint32_t k = 0; k < v->plan.n_shards; k++) {
    char name[64];
    ckpt_st_shard_name(&v->plan, k, name, sizeof(name));
    ckpt_node_t *c =
        ckpt__node_new(fs, root, name, CKPT_NODE_VST, S_IFREG | 0444, ck);
    if (c == NULL)
      return -ENOMEM;
    ckpt__committed_shared(ck, c);
    c->u.shard = k;
    c->mtime = c->ctime = when;
  }
  if (v->index != NULL) {
    ckpt_node_t *c =
        ckpt__node_new(fs, root, ST_INDEX, CKPT_NODE_VINDEX, S_IFREG | 0444,
                       ck);
    if (c == NULL)
      return -ENOMEM;
    ckpt__committed_shared(ck, c);
    c->mtime = c->ctime = when;
  }
  return 0;
}

int ckpt__views_populate(ckpt_fs_t *fs, ckpt_node_t *root) {
  CKPT_HELD(&fs->lock);
  assert(root->kind == CKPT_NODE_VROOT);
  ckpt_ckpt_t *ck = root->ck;
  struct ckpt_views *v = ck->views;
  struct timespec when = {.tv_sec = ck->meta->created_at};
  bool npy = strcmp(root->name, NPY_DIR) == 0;
  if (npy ? v->npy_done : v->st_done)
    return 0;
  int rc = 0;
  if (npy) {
    for (uint32_t i = 0; rc == 0 && i < ck->meta->n_tensors; i++)
      rc = npy_add(fs, root, i, when);
  } else {
    rc = st_build(fs, root);
    if (rc == 0)
      rc = st_add(fs, root, when);
  }
  if (rc < 0) { /* start again at the next lookup */
    while (root->children != NULL)
      ckpt__node_detach(fs, root->children);
    if (!npy) {
      ckpt_st_plan_free(&v->plan);
      free(v->index);
      v->index = NULL;
    }
    return rc;
  }
  if (npy)
    v->npy_done = true;
  else
    v->st_done = true;
  return 0;
}

/* ----- Sizes and reads ----- */

/* The .npy header of tensor i into b. */
static int npy_header(const ckpt_ckpt_t *ck, uint32_t i, ckpt_buf_t *b) {
  const ckpt_tensor_meta_t *t = &ck->meta->tensors[i];
  return ckpt_npy_header(t->dtype, t->ndim, t->shape, b);
}

/* Tensor i of a committed checkpoint, as the store's reader names it. */
static ckpt_item_t tensor_item(uint32_t i) {
  ckpt_item_t it = {false, i};
  return it;
}

uint64_t ckpt__view_size(const ckpt_node_t *n) {
  ckpt_ckpt_t *ck = n->ck;
  switch (n->kind) {
  case CKPT_NODE_VNPY: {
    ckpt_buf_t b;
    ckpt_buf_init(&b);
    uint64_t hdr = npy_header(ck, n->u.tensor, &b) == 0 ? b.len : 0;
    ckpt_buf_free(&b);
    return hdr + ckpt_stored_size(&ck->stored, tensor_item(n->u.tensor));
  }
  case CKPT_NODE_VST:
    return ck->views->plan.shards[n->u.shard].file_size;
  case CKPT_NODE_VINDEX:
    return ck->views->index_len;
  default:
    return 0;
  }
}

size_t ckpt__view_shard_tensors(const ckpt_node_t *n, const size_t **out) {
  const ckpt_st_plan_t *p = &n->ck->views->plan;
  const ckpt_st_shard_t *sh = &p->shards[n->u.shard];
  *out = p->order + sh->first;
  return sh->count;
}

/* Read [off, off+size) of tensor i into buf (the range lies inside it). */
static int tensor_read(ckpt_ckpt_t *ck, uint32_t i, char *buf,
                       size_t size, uint64_t off) {
  if (size == 0)
    return 0;
  int rc = ckpt_stored_verify(&ck->stored, tensor_item(i), size, off);
  if (rc)
    return rc;
  ssize_t r = ckpt_stored_read(&ck->stored, tensor_item(i), buf, size, off);
  if (r < 0)
    return (int)r;
  return (size_t)r == size ? 0 : -EIO;
}

/* Copy the part of [off, off+size) that falls in bytes [at, at+len) of
 * the file, whose contents are src, into buf (buf[0] is byte off). */
static void copy_part(char *buf, uint64_t off, size_t size, uint64_t at,
                      const void *src, uint64_t len) {
  uint64_t b = off > at ? off : at;
  uint64_t e = off + size < at + len ? off + size : at + len;
  if (b < e)
    memcpy(buf + (b - off), (const char *)src + (b - at), (size_t)(e - b));
}

/* Reply with bytes [toff, toff+len) of tensor i spliced from its data file
 * when they are one contiguous stored run: true if replied. */
static bool reply_spliced(fuse_req_t req, ckpt_ckpt_t *ck, uint32_t i,
                          size_t len, uint64_t toff) {
  ckpt_fdref_t ref;
  uint64_t pos;
  size_t got;
  if (ckpt_stored_verify(&ck->stored, tensor_item(i), len, toff) != 0 ||
      ckpt_stored_span(&ck->stored, tensor_item(i), len, toff, &ref, &pos,
                       &got) != 1)
    return false;
  if (got != len) {
    ckpt_fdref_put(&ref);
    return false;
  }
  int fd = ref.fd;
  /* Sequential loads: each time a read crosses a VIEW_AHEAD boundary of
   * the data file, ask for the next 4 x VIEW_AHEAD bytes in the background
   * (the run may end sooner: the kernel clips at the end of the file). */
  if ((pos + len) / VIEW_AHEAD != pos / VIEW_AHEAD)
    posix_fadvise(fd, (off_t)((pos + len) / VIEW_AHEAD * VIEW_AHEAD),
                  (off_t)(4 * VIEW_AHEAD), POSIX_FADV_WILLNEED);
  struct fuse_bufvec bv = FUSE_BUFVEC_INIT(len);
  bv.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK | FUSE_BUF_FD_RETRY;
  bv.buf[0].fd = fd;
  bv.buf[0].pos = (off_t)pos;
  CKPT_SPLICED(ck);
  ckpt__metrics_read(req, len);
  fuse_reply_data(req, &bv, FUSE_BUF_SPLICE_MOVE);
  ckpt_fdref_put(&ref);
  return true;
}

void ckpt__view_read(fuse_req_t req, ckpt_node_t *n,
                     size_t size, uint64_t off) {
  ckpt_ckpt_t *ck = n->ck;
  struct ckpt_views *v = ck->views;
  uint64_t total = ckpt__view_size(n);
  if (off >= total || size == 0) {
    fuse_reply_buf(req, NULL, 0);
    return;
  }
  if (size > total - off)
    size = (size_t)(total - off);
  int rc = 0;
  char *buf = NULL;
  ckpt_buf_t hdr;
  ckpt_buf_init(&hdr);
  if (n->kind == CKPT_NODE_VINDEX) {
    /* A copy: once the reply is written, a release on another thread may
     * drop the last reference to the checkpoint (see reply_copy, ops.c). */
    if ((buf = malloc(size)) == NULL)
      rc = -ENOMEM;
    else
      memcpy(buf, v->index + off, size);
  } else if (n->kind == CKPT_NODE_VNPY) {
    if ((rc = npy_header(ck, n->u.tensor, &hdr)) != 0)
      goto out;
    /* Wholly inside the tensor's bytes: perhaps one stored run. */
    if (off >= hdr.len &&
        reply_spliced(req, ck, n->u.tensor, size, off - hdr.len))
      goto done;
    if ((buf = malloc(size)) == NULL) {
      rc = -ENOMEM;
      goto out;
    }
    copy_part(buf, off, size, 0, hdr.data, hdr.len);
    if (off + size > hdr.len) {
      uint64_t b = off > hdr.len ? off : hdr.len;
      rc = tensor_read(ck, n->u.tensor, buf + (b - off),
                       (size_t)(off + size - b), b - hdr.len);
    }
  } else if (n->kind == CKPT_NODE_VST) {
    const ckpt_st_plan_t *p = &v->plan;
    const ckpt_st_shard_t *sh = &p->shards[n->u.shard];
    size_t j = ckpt_st_find(p, n->u.shard, off);
    size_t end = sh->first + sh->count;
    if (j < end) {
      const ckpt_st_place_t *pl = &p->place[p->order[j]];
      if (off >= pl->offset && off + size <= pl->offset + pl->length &&
          reply_spliced(req, ck, (uint32_t)p->order[j], size,
                        off - pl->offset))
        goto done;
    }
    if ((buf = malloc(size)) == NULL) {
      rc = -ENOMEM;
      goto out;
    }
    copy_part(buf, off, size, 0, sh->header, sh->header_len);
    for (; rc == 0 && j < end; j++) {
      const ckpt_st_place_t *pl = &p->place[p->order[j]];
      if (pl->offset >= off + size)
        break;
      uint64_t b = off > pl->offset ? off : pl->offset;
      uint64_t e = off + size < pl->offset + pl->length ? off + size
                                                         : pl->offset + pl->length;
      if (b < e)
        rc = tensor_read(ck, (uint32_t)p->order[j], buf + (b - off),
                         (size_t)(e - b), b - pl->offset);
    }
  } else {
    rc = -EBADF;
  }
out:
  if (rc) {
    fuse_reply_err(req, -rc);
  } else {
    ckpt__metrics_read(req, size);
    fuse_reply_buf(req, buf, size);
  }
done:
  free(buf);
  ckpt_buf_free(&hdr);
}
