/*
 * reader.c - the one reader of committed chunks and blobs (store.h): the
 * mount's reads, its .npy and .safetensors views, ckptctl export and
 * ckptfs-fsck all come here.
 *
 * A read of a tensor's byte range asks each chunk that touches it for the
 * bytes it holds (ckpt_layout_span: one pread of the chunk bytes the range
 * needs, then the copies). The loader (metadb.c) has checked that the
 * chunks of a tensor cover it exactly, so every byte of the range is
 * written by exactly one chunk.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>

#include "failpoint.h"
#include "metadb.h"
#include "store_int.h"

int ckpt_stored_init(ckpt_stored_t *s, ckpt_fdcache_t *cache,
                     const char *name, int dirfd, const ckpt_metadata_t *meta,
                     bool verify) {
  memset(s, 0, sizeof(*s));
  int fp = ckpt_failpoint_error("reader_init");
  if (fp)
    return fp;
  struct stat st;
  if (fstat(dirfd, &st))
    return -errno;
  if (strlen(name) >= sizeof(s->name))
    return -ENAMETOOLONG;
  strcpy(s->name, name);
  ckpt__save_key(meta->save_id, s->save_id);
  s->dev = st.st_dev;
  s->ino = st.st_ino;
  ckpt_store_dir_handle(dirfd, "", &s->handle);
  s->meta = meta;
  s->cache = cache;
  if (verify &&
      !(s->verified = calloc((size_t)meta->n_chunks + meta->n_blobs + 1,
                             sizeof(*s->verified))))
    return -ENOMEM;
  s->id = ckpt__fdcache_new_id(cache);
  return 0;
}

void ckpt_stored_destroy(ckpt_stored_t *s) {
  if (s->cache)
    ckpt__fdcache_forget(s->cache, s->id);
  free((void *)s->verified);
  s->verified = NULL;
  s->cache = NULL;
}

/* Here, not in identity.c: the descriptor cache is the reader's. */
void ckpt_stored_rebind(ckpt_stored_t *s, const ckpt_version_t *v) {
  ckpt__stored_set_identity(s, v);
  if (s->cache) /* idle descriptors of files the new version may not use */
    ckpt__fdcache_forget(s->cache, s->id);
}

uint64_t ckpt_stored_size(const ckpt_stored_t *s, ckpt_item_t it) {
  const ckpt_metadata_t *m = s->meta;
  if (it.blob)
    return m->blobs[it.i].length;
  const ckpt_tensor_meta_t *t = &m->tensors[it.i];
  uint64_t numel = 0;
  ckpt_dims_numel(t->shape, t->ndim, &numel);
  return numel * ckpt_dtype_size(t->dtype);
}

/* A data file that cannot be opened makes the checkpoint damaged: EIO
 * (ENOENT from read(2) would puzzle the caller). */
static int stored_fd(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                     ckpt_fdref_t *ref) {
  int rc = ckpt_stored_fd(s, rank, k, ref);
  return rc == 0 || rc == -ENOMEM || rc == -EMFILE || rc == -ENFILE ? rc
                                                                    : -EIO;
}

/* Does chunk c of tensor t hold any byte of [off, off+size)? Not merely
 * "does its extent overlap": the column chunks of a tensor interleave, and
 * a range inside one of them must not need (or verify) the others. */
static bool chunk_touches(const ckpt_tensor_meta_t *t,
                          const ckpt_chunk_meta_t *c, uint64_t off,
                          size_t size) {
  uint64_t first, end, lo, hi;
  size_t isz = ckpt_dtype_size(t->dtype);
  ckpt_layout_extent(t->ndim, t->shape, c->dims, c->dims + t->ndim, isz,
                     &first, &end);
  if (!(end > off && first < off + size))
    return false;
  ckpt_layout_span(t->ndim, t->shape, c->dims, c->dims + t->ndim, isz, off,
                   size, &lo, &hi);
  return lo < hi;
}

/* Read the part of one chunk that falls in [off, off+size). */
static int read_chunk(const ckpt_stored_t *s, const ckpt_tensor_meta_t *t,
                      const ckpt_chunk_meta_t *c, uint8_t *out, uint64_t off,
                      size_t size) {
  size_t isz = ckpt_dtype_size(t->dtype);
  const int64_t *offs = c->dims, *sizes = c->dims + t->ndim;
  uint64_t lo, hi;
  ckpt_layout_span(t->ndim, t->shape, offs, sizes, isz, off, size, &lo, &hi);
  if (lo >= hi)
    return 0;
  if (hi > c->length)
    return -EIO;
  ckpt_fdref_t ref;
  int rc = stored_fd(s, c->rank, c->file, &ref);
  if (rc)
    return rc;
  size_t n = (size_t)(hi - lo);
  uint8_t *tmp = malloc(n);
  if (!tmp) {
    ckpt_fdref_put(&ref);
    return -ENOMEM;
  }
  rc = ckpt__pread_full(ref.fd, tmp, n, c->file_offset + lo);
  ckpt_fdref_put(&ref);
  if (rc == 0)
    ckpt_layout_copy(t->ndim, t->shape, offs, sizes, isz, off, size, tmp, lo,
                     out);
  free(tmp);
  return rc;
}

ssize_t ckpt_stored_read(const ckpt_stored_t *s, ckpt_item_t it, void *buf,
                         size_t size, uint64_t off) {
  uint64_t total = ckpt_stored_size(s, it);
  if (off >= total)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  const ckpt_metadata_t *m = s->meta;
  if (it.blob) {
    const ckpt_blob_meta_t *b = &m->blobs[it.i];
    ckpt_fdref_t ref;
    int rc = stored_fd(s, b->rank, b->file, &ref);
    if (rc)
      return rc;
    rc = ckpt__pread_full(ref.fd, buf, size, b->file_offset + off);
    ckpt_fdref_put(&ref);
    return rc ? rc : (ssize_t)size;
  }
  const ckpt_tensor_meta_t *t = &m->tensors[it.i];
  for (uint32_t i = 0; i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
    if (!chunk_touches(t, c, off, size))
      continue;
    int rc = read_chunk(s, t, c, buf, off, size);
    if (rc)
      return rc;
  }
  return (ssize_t)size;
}

typedef struct {
  uint32_t n;        /* pieces seen */
  ckpt_piece_t first;
} span_ctx_t;

static int count_piece(void *arg, const ckpt_piece_t *p) {
  span_ctx_t *c = arg;
  if (c->n++ == 0)
    c->first = *p;
  return c->n > 1; /* a second piece: not one span, stop */
}

int ckpt_stored_span(const ckpt_stored_t *s, ckpt_item_t it, size_t size,
                     uint64_t off, ckpt_fdref_t *ref, uint64_t *pos,
                     size_t *len) {
  uint64_t total = ckpt_stored_size(s, it);
  if (off >= total || size == 0)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  const ckpt_metadata_t *m = s->meta;
  int32_t rank;
  uint32_t file;
  uint64_t at;
  if (it.blob) {
    const ckpt_blob_meta_t *b = &m->blobs[it.i];
    rank = b->rank, file = b->file, at = b->file_offset + off;
  } else {
    const ckpt_tensor_meta_t *t = &m->tensors[it.i];
    size_t isz = ckpt_dtype_size(t->dtype);
    const ckpt_chunk_meta_t *hit = NULL;
    for (uint32_t i = 0; i < t->n_chunks; i++) {
      const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
      if (!chunk_touches(t, c, off, size))
        continue;
      if (hit)
        return 0; /* several chunks */
      hit = c;
    }
    if (!hit)
      return 0;
    span_ctx_t sc = {0};
    ckpt_layout_pieces(t->ndim, t->shape, hit->dims, hit->dims + t->ndim, isz,
                       off, size, count_piece, &sc);
    if (sc.n != 1 || sc.first.dst != off || sc.first.len != size ||
        sc.first.src + size > hit->length)
      return 0;
    rank = hit->rank, file = hit->file, at = hit->file_offset + sc.first.src;
  }
  int rc = stored_fd(s, rank, file, ref);
  if (rc)
    return rc;
  /* The bytes must be there: a short data file is damage, not zeros. */
  struct stat st;
  if (fstat(ref->fd, &st) || (uint64_t)st.st_size < at + size) {
    ckpt_fdref_put(ref);
    return -EIO;
  }
  *pos = at;
  *len = size;
  return 1;
}

/* Chunks and blobs that verify found damaged, in this process: the
 * mount's metrics read it (ckpt_store_verify_failures). */
static _Atomic uint64_t verify_failures;

uint64_t ckpt_store_verify_failures(void) {
  return atomic_load_explicit(&verify_failures, memory_order_relaxed);
}

/* Check stored chunk or blob i of s (verified[i]) once: 0 or -EIO. */
static int verify_stored(const ckpt_stored_t *s, uint32_t i, const char *fqn,
                         int32_t rank, uint32_t file, uint64_t pos,
                         uint64_t len, uint64_t want) {
  uint8_t known = atomic_load(&s->verified[i]);
  if (known != CKPT_CHUNK_UNCHECKED)
    return known == CKPT_CHUNK_GOOD ? 0 : -EIO;
  ckpt_fdref_t ref;
  int rc = stored_fd(s, rank, file, &ref);
  if (rc)
    return rc;
  uint64_t got = 0;
  rc = ckpt__stored_checksum(ref.fd, pos, len, &got);
  ckpt_fdref_put(&ref);
  if (rc == -ENODATA || (rc == 0 && got != want)) {
    char name[64];
    ckpt_data_file_name(rank, file, name, sizeof(name));
    if (rc)
      ckpt__log("%s: %s: rank %d, %s: truncated (bytes %" PRIu64
                "..%" PRIu64 " missing)", s->name, fqn, rank, name, pos,
                pos + len);
    else
      ckpt__log("%s: %s: rank %d, %s at %" PRIu64 ": checksum %016" PRIx64
                ", stored %016" PRIx64, s->name, fqn, rank, name, pos, got,
                want);
    /* counted once per chunk: the first read that finds it bad */
    uint8_t unchecked = CKPT_CHUNK_UNCHECKED;
    if (atomic_compare_exchange_strong(&s->verified[i], &unchecked,
                                       CKPT_CHUNK_BAD))
      atomic_fetch_add_explicit(&verify_failures, 1, memory_order_relaxed);
    return -EIO;
  }
  if (rc)
    return rc; /* a read error: not known bad, try again next time */
  atomic_store(&s->verified[i], CKPT_CHUNK_GOOD);
  return 0;
}

int ckpt_stored_verify(const ckpt_stored_t *s, ckpt_item_t it, size_t size,
                       uint64_t off) {
  if (!s->verified) /* verify=0: nothing to do on the read path */
    return 0;
  const ckpt_metadata_t *m = s->meta;
  uint64_t total = ckpt_stored_size(s, it);
  if (off >= total || size == 0)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  if (it.blob) {
    const ckpt_blob_meta_t *b = &m->blobs[it.i];
    return verify_stored(s, m->n_chunks + it.i, b->fqn, b->rank, b->file,
                         b->file_offset, b->length, b->checksum);
  }
  const ckpt_tensor_meta_t *t = &m->tensors[it.i];
  for (uint32_t i = 0; i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
    if (!chunk_touches(t, c, off, size))
      continue;
    int rc = verify_stored(s, t->first_chunk + i, t->fqn, c->rank, c->file,
                           c->file_offset, c->length, c->checksum);
    if (rc)
      return rc;
  }
  return 0;
}

/* ----- Block reads: gathered preadv ----- */

#define GATHER_IOV 1024 /* IOV_MAX on Linux */

typedef struct {
  const ckpt_stored_t *s;
  const ckpt_tensor_meta_t *t;
  const ckpt_chunk_meta_t *c;
  uint32_t ci;        /* chunk index in meta->chunks */
  uint8_t *out;       /* the caller's buffer: box byte off is out[0] */
  uint64_t off;
  const ckpt_piece_t *run; /* the box run being mapped (src: box byte,
                              dst: global byte) */
  uint8_t *scratch;   /* CKPT_GATHER_GAP bytes for the gaps */
  ckpt_fdref_t ref;
  bool have_fd;
  struct iovec iov[GATHER_IOV];
  int niov;
  uint64_t pos, end;  /* file bytes [pos, end) of the pending batch */
  int rc;
} gather_t;

/* Read the pending batch: preadv until all of it is in (short reads are
 * continued; the file ending first is damage: -EIO). */
static int gather_flush(gather_t *g) {
  struct iovec *iov = g->iov;
  int n = g->niov;
  uint64_t pos = g->pos;
  g->niov = 0;
  while (n > 0) {
    ssize_t r = preadv(g->ref.fd, iov, n, (off_t)pos);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (r == 0)
      return -EIO;
    pos += (uint64_t)r;
    size_t left = (size_t)r;
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      iov++, n--;
    }
    if (n > 0 && left) {
      iov->iov_base = (uint8_t *)iov->iov_base + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

static int gather_push(gather_t *g, void *base, size_t len) {
  g->iov[g->niov].iov_base = base;
  g->iov[g->niov].iov_len = len;
  g->niov++;
  return 0;
}

/* One piece of chunk g->c (src: its stored byte, dst: global byte) that
 * falls in box run g->run: into the batch. */
static int gather_piece(void *arg, const ckpt_piece_t *p) {
  gather_t *g = arg;
  const ckpt_chunk_meta_t *c = g->c;
  if (p->src + p->len > c->length)
    return -EIO;
  int rc;
  if (!g->have_fd) {
    if (g->s->verified &&
        (rc = verify_stored(g->s, g->ci, g->t->fqn, c->rank, c->file,
                            c->file_offset, c->length, c->checksum)))
      return rc;
    if ((rc = stored_fd(g->s, c->rank, c->file, &g->ref)))
      return rc;
    g->have_fd = true;
  }
  uint64_t at = c->file_offset + p->src;
  uint8_t *dst = g->out + (g->run->src + (p->dst - g->run->dst) - g->off);
  if (g->niov > 0 &&
      (at < g->end || at - g->end > CKPT_GATHER_GAP ||
       g->niov + 2 > GATHER_IOV)) {
    if ((rc = gather_flush(g)))
      return rc;
  }
  if (g->niov == 0) {
    g->pos = g->end = at;
  } else if (at > g->end) {
    gather_push(g, g->scratch, (size_t)(at - g->end));
    g->end = at;
  }
  struct iovec *last = g->niov ? &g->iov[g->niov - 1] : NULL;
  if (last && last->iov_base != g->scratch &&
      (uint8_t *)last->iov_base + last->iov_len == dst)
    last->iov_len += (size_t)p->len; /* contiguous in both */
  else
    gather_push(g, dst, (size_t)p->len);
  g->end += p->len;
  return 0;
}

typedef struct {
  ckpt_piece_t *v;
  size_t n, cap;
} runs_list_t;

static int collect_run(void *arg, const ckpt_piece_t *p) {
  runs_list_t *l = arg;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 64;
    ckpt_piece_t *v = realloc(l->v, cap * sizeof(*v));
    if (!v)
      return -ENOMEM;
    l->v = v, l->cap = cap;
  }
  l->v[l->n++] = *p;
  return 0;
}

ssize_t ckpt_stored_read_box(const ckpt_stored_t *s, uint32_t tensor,
                             const int64_t *lo, const int64_t *sizes,
                             void *buf, size_t size, uint64_t off) {
  const ckpt_metadata_t *m = s->meta;
  const ckpt_tensor_meta_t *t = &m->tensors[tensor];
  size_t isz = ckpt_dtype_size(t->dtype);
  uint64_t numel = 0;
  ckpt_dims_numel(sizes, t->ndim, &numel);
  uint64_t total = numel * isz;
  if (off >= total || size == 0)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  /* The global runs of the request, in order. */
  runs_list_t runs = {0};
  int rc = ckpt_layout_local_pieces(t->ndim, t->shape, lo, sizes, isz, off,
                                    size, collect_run, &runs);
  gather_t *g = rc ? NULL : malloc(sizeof(*g));
  uint8_t *scratch = g ? malloc(CKPT_GATHER_GAP) : NULL;
  if (rc == 0 && (!g || !scratch))
    rc = -ENOMEM;
  uint64_t hull_lo = runs.n ? runs.v[0].dst : 0;
  uint64_t hull_hi = runs.n ? runs.v[runs.n - 1].dst + runs.v[runs.n - 1].len
                            : 0;
  for (uint32_t i = 0; rc == 0 && i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
    uint64_t first, end;
    ckpt_layout_extent(t->ndim, t->shape, c->dims, c->dims + t->ndim, isz,
                       &first, &end);
    if (end <= hull_lo || first >= hull_hi)
      continue;
    /* The runs are in increasing global order: the first one ending after
     * the chunk's first byte, by bisection, then on while they start
     * before its end (O(log runs + its runs) per chunk, not O(runs)). */
    size_t r0 = 0, r1 = runs.n;
    while (r0 < r1) {
      size_t mid = r0 + (r1 - r0) / 2;
      if (runs.v[mid].dst + runs.v[mid].len <= first)
        r0 = mid + 1;
      else
        r1 = mid;
    }
    if (r0 == runs.n || runs.v[r0].dst >= end)
      continue;
    g->s = s, g->t = t, g->c = c, g->ci = t->first_chunk + i;
    g->out = buf, g->off = off, g->scratch = scratch;
    g->niov = 0, g->have_fd = false, g->pos = g->end = 0, g->rc = 0;
    for (size_t r = r0; rc == 0 && r < runs.n && runs.v[r].dst < end; r++) {
      const ckpt_piece_t *run = &runs.v[r];
      g->run = run;
      rc = ckpt_layout_pieces(t->ndim, t->shape, c->dims, c->dims + t->ndim,
                              isz, run->dst, run->len, gather_piece, g);
    }
    if (rc == 0 && g->niov)
      rc = gather_flush(g);
    if (g->have_fd)
      ckpt_fdref_put(&g->ref);
  }
  free(scratch);
  free(g);
  free(runs.v);
  return rc ? rc : (ssize_t)size;
}
