/*
 * blocks.c - block files of a committed checkpoint: a lookup of
 * DIR/.N[a0:b0,a1:b1,...], where N is a committed tensor file in DIR, gives
 * a read-only file whose content is the block [a0:b0) x [a1:b1) x ... of
 * the tensor in row-major order (names: planner/block.c).
 *
 * Workload: a loader of a column shard (DTensor Shard(1)) reads its whole
 * block with one pread instead of one per row. A read request of a block
 * file maps to the tensor's global runs (ckpt_layout_local_pieces); one
 * run is served like the tensor file (spliced from the data file when it
 * is one stored run), several are gathered from each chunk with few large
 * preadv calls (ckpt_stored_read_box).
 *
 * Lifetime: a block node is made at its first lookup, under the tensor's
 * directory (not listed by readdir), and counts the kernel's lookups; when
 * the kernel forgets them all it leaves the tree and is freed once no
 * request or open file holds it, so a long-running loader that opens many
 * distinct blocks does not grow the mount. A lookup of the same name while
 * it lives finds the same node.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "read.h"

void ckpt__block_free(ckpt_block_t *b) { free(b); }

bool ckpt__block_name(const ckpt_node_t *dir, const char *name) {
  size_t len = strlen(name);
  return name[0] == '.' && len > 0 && name[len - 1] == ']' && dir->ck &&
         dir->ck->state == CKPT_COMMITTED && dir->ck->meta &&
         (dir->kind == CKPT_NODE_CKPT || dir->kind == CKPT_NODE_CDIR);
}

int ckpt__block_lookup(ckpt_fs_t *fs, ckpt_node_t *dir, const char *name,
                       ckpt_node_t **out) {
  CKPT_HELD(&fs->lock);
  ckpt_ckpt_t *ck = dir->ck;
  const char *base, *slices;
  size_t base_len;
  char tname[256];
  if (ckpt_block_name_split(name, &base, &base_len, &slices) ||
      base_len >= sizeof(tname))
    return -ENOENT;
  memcpy(tname, base, base_len);
  tname[base_len] = '\0';
  ckpt_node_t *t = ckpt__node_child(fs, dir, tname);
  if (!t || t->hidden || t->kind != CKPT_NODE_CTENSOR)
    return -ENOENT;
  ckpt_node_t *n = ckpt__node_child(fs, dir, name);
  if (n) {
    if (n->kind != CKPT_NODE_CBLOCK)
      return -ENOENT;
    n->nlookup++;
    *out = n;
    return 0;
  }
  const ckpt_tensor_meta_t *tm = &ck->meta->tensors[t->u.tensor];
  if (tm->ndim < 1)
    return -ENOENT; /* a 0-d tensor has no blocks */
  ckpt_block_t *b =
      malloc(sizeof(*b) + 2 * (size_t)tm->ndim * sizeof(b->dims[0]));
  if (!b)
    return -ENOMEM;
  b->tensor = t->u.tensor;
  b->ndim = tm->ndim;
  int64_t *lo = b->dims, *sizes = b->dims + tm->ndim;
  uint64_t numel = 0;
  if (ckpt_block_parse(slices, strlen(slices), tm->ndim, tm->shape, lo,
                       sizes) ||
      ckpt_dims_numel(sizes, tm->ndim, &numel)) {
    free(b);
    return -ENOENT;
  }
  b->bytes = numel * ckpt_dtype_size(tm->dtype); /* <= the tensor's */
  n = ckpt__node_new(fs, dir, name, CKPT_NODE_CBLOCK, t->mode, ck);
  if (!n) {
    free(b);
    return -ENOMEM;
  }
  n->u.block = b;
  n->uid = t->uid;
  n->gid = t->gid;
  n->mtime = t->mtime;
  n->ctime = t->ctime;
  n->atime = t->atime;
  n->nlookup = 1;
  *out = n;
  return 0;
}

void ckpt__block_forget(ckpt_fs_t *fs, ckpt_node_t *n, uint64_t nlookup) {
  CKPT_HELD(&fs->lock);
  if (n->kind != CKPT_NODE_CBLOCK)
    return;
  n->nlookup = nlookup < n->nlookup ? n->nlookup - nlookup : 0;
  if (n->nlookup == 0 && n->attached)
    ckpt__node_detach(fs, n);
}

typedef struct {
  int n;
  ckpt_piece_t first;
} one_run_t;

static int first_run(void *arg, const ckpt_piece_t *p) {
  one_run_t *o = arg;
  if (o->n++ == 0)
    o->first = *p;
  return o->n > 1; /* a second run: stop */
}

bool ckpt__block_run(const ckpt_ckpt_t *ck, const ckpt_block_t *b,
                     uint64_t *off) {
  const ckpt_tensor_meta_t *t = &ck->meta->tensors[b->tensor];
  one_run_t o = {0};
  if (b->bytes == 0)
    return false;
  ckpt_layout_local_pieces(t->ndim, t->shape, b->dims, b->dims + b->ndim,
                           ckpt_dtype_size(t->dtype), 0, b->bytes, first_run,
                           &o);
  if (o.n != 1 || o.first.len != b->bytes)
    return false;
  *off = o.first.dst;
  return true;
}

void ckpt__block_read(fuse_req_t req, ckpt_node_t *n, size_t size,
                      uint64_t off) {
  const ckpt_block_t *b = n->u.block;
  const ckpt_stored_t *s = &n->ck->stored;
  const ckpt_tensor_meta_t *t = &n->ck->meta->tensors[b->tensor];
  const int64_t *lo = b->dims, *sizes = b->dims + b->ndim;
  if (off >= b->bytes || size == 0) {
    fuse_reply_buf(req, NULL, 0);
    return;
  }
  if (size > b->bytes - off)
    size = (size_t)(b->bytes - off);
  ckpt_item_t it = {false, b->tensor};
  one_run_t o = {0};
  ckpt_layout_local_pieces(t->ndim, t->shape, lo, sizes,
                           ckpt_dtype_size(t->dtype), off, size, first_run,
                           &o);
  char *buf = NULL;
  ssize_t r;
  if (o.n == 1 && o.first.len == size) {
    /* One contiguous run of the tensor: as a read of the tensor file. */
    uint64_t goff = o.first.dst;
    int rc = ckpt_stored_verify(s, it, size, goff);
    if (rc) {
      fuse_reply_err(req, -rc);
      return;
    }
    ckpt_fdref_t ref;
    uint64_t pos;
    size_t len;
    rc = ckpt_stored_span(s, it, size, goff, &ref, &pos, &len);
    if (rc < 0) {
      fuse_reply_err(req, -rc);
      return;
    }
    if (rc == 1 && len == size) {
      ckpt__reply_spliced(req, n->ck, &ref, pos, len);
      return;
    }
    if (rc == 1)
      ckpt_fdref_put(&ref);
    if (!(buf = malloc(size))) {
      fuse_reply_err(req, ENOMEM);
      return;
    }
    r = ckpt_stored_read(s, it, buf, size, goff);
  } else {
    if (!(buf = malloc(size))) {
      fuse_reply_err(req, ENOMEM);
      return;
    }
    r = ckpt_stored_read_box(s, b->tensor, lo, sizes, buf, size, off);
  }
  if (r >= 0 && (size_t)r != size)
    r = -EIO;
  if (r < 0) {
    fuse_reply_err(req, (int)-r);
  } else {
    ckpt__metrics_read(req, size);
    fuse_reply_buf(req, buf, size);
  }
  free(buf);
}
void ckpt__reply_spliced(fuse_req_t req, ckpt_ckpt_t *ck, ckpt_fdref_t *ref,
                         uint64_t pos, size_t len) {
  struct fuse_bufvec bv = FUSE_BUFVEC_INIT(len);
  bv.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK | FUSE_BUF_FD_RETRY;
  bv.buf[0].fd = ref->fd;
  bv.buf[0].pos = (off_t)pos;
  CKPT_SPLICED(ck);
  ckpt__metrics_read(req, len);
  fuse_reply_data(req, &bv, FUSE_BUF_SPLICE_MOVE);
  ckpt_fdref_put(ref); /* the reply has been written */
}

