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
#include <pthread.h>
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

/* A data file as its chunks were checked (verify): what an fstat says of
 * it then. gen counts the changes seen, so that a check that ran across
 * one does not count. */
struct ckpt_seen {
  int64_t key; /* rank << 32 | file */
  _Atomic uint32_t gen;
  uint32_t *order;    /* its chunks and blobs (indices into verified), by
                         file offset; seen[0].order holds them all */
  uint32_t n_order;
  _Atomic uint64_t ahead; /* checks handed to the ahead threads reach this
                             file offset (ahead_lock) */
  bool known;  /* the rest (under seen_lock) */
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime, ctime;
};

static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t file_key(int32_t rank, uint32_t file) {
  return (int64_t)rank << 32 | file;
}

static int by_key(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = ((const struct ckpt_seen *)b)->key;
  return (x > y) - (x < y);
}

/* Where chunk (i < n_chunks) or blob (i - n_chunks) i of m is. */
typedef struct {
  const char *fqn;
  int32_t rank;
  uint32_t file;
  uint64_t pos, len, want;
} item_loc_t;

static item_loc_t item_loc(const ckpt_metadata_t *m, uint32_t i) {
  if (i < m->n_chunks) {
    const ckpt_chunk_meta_t *c = &m->chunks[i];
    return (item_loc_t){m->tensors[c->tensor].fqn, c->rank, c->file,
                        c->file_offset, c->length, c->checksum};
  }
  const ckpt_blob_meta_t *b = &m->blobs[i - m->n_chunks];
  return (item_loc_t){b->fqn, b->rank, b->file, b->file_offset, b->length,
                      b->checksum};
}

typedef struct {
  int64_t key;
  uint64_t pos;
  uint32_t i;
} item_key_t;

static int by_file_pos(const void *a, const void *b) {
  const item_key_t *x = a, *y = b;
  if (x->key != y->key)
    return (x->key > y->key) - (x->key < y->key);
  return (x->pos > y->pos) - (x->pos < y->pos);
}

/* One ckpt_seen per data file that a chunk or blob of meta is in, with
 * its items in file order. */
static int seen_init(ckpt_stored_t *s, const ckpt_metadata_t *meta) {
  uint32_t n = meta->n_chunks + meta->n_blobs;
  item_key_t *items = malloc((n ? n : 1) * sizeof(*items));
  uint32_t *order = malloc((n ? n : 1) * sizeof(*order));
  if (!items || !order) {
    free(items);
    free(order);
    return -ENOMEM;
  }
  for (uint32_t i = 0; i < n; i++) {
    item_loc_t l = item_loc(meta, i);
    items[i] = (item_key_t){file_key(l.rank, l.file), l.pos, i};
  }
  qsort(items, n, sizeof(*items), by_file_pos);
  uint32_t d = 0;
  for (uint32_t i = 0; i < n; i++)
    if (i == 0 || items[i].key != items[i - 1].key)
      d++;
  s->seen = calloc(d ? d : 1, sizeof(*s->seen));
  if (!s->seen) {
    free(items);
    free(order);
    return -ENOMEM;
  }
  struct ckpt_seen *f = NULL;
  for (uint32_t i = 0; i < n; i++) {
    if (i == 0 || items[i].key != items[i - 1].key) {
      f = f ? f + 1 : s->seen;
      f->key = items[i].key;
      f->order = order + i;
    }
    order[i] = items[i].i;
    f->n_order++;
  }
  if (!d)
    s->seen->order = order; /* freed with it */
  s->n_seen = d;
  free(items);
  return 0;
}

static struct ckpt_seen *find_seen(const ckpt_stored_t *s, int32_t rank,
                                   uint32_t file) {
  int64_t key = file_key(rank, file);
  return s->seen ? bsearch(&key, s->seen, s->n_seen, sizeof(*s->seen), by_key)
                 : NULL;
}

static void ahead_forget(const ckpt_stored_t *s);

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
      (!(s->verified = calloc((size_t)meta->n_chunks + meta->n_blobs + 1,
                              sizeof(*s->verified))) ||
       seen_init(s, meta)))
    return -ENOMEM;
  s->id = ckpt__fdcache_new_id(cache);
  return 0;
}

void ckpt_stored_destroy(ckpt_stored_t *s) {
  ahead_forget(s); /* first: its checks use all of s */
  if (s->cache)
    ckpt__fdcache_forget(s->cache, s->id);
  free((void *)s->verified);
  s->verified = NULL;
  if (s->seen)
    free(s->seen[0].order);
  free(s->seen);
  s->seen = NULL;
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
  if (rc == 0 && ref->fresh && s->seen) /* one fstat per descriptor opened */
    ckpt__stored_seen(s, rank, k, ref->fd);
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

int ckpt_stored_run(const ckpt_stored_t *s, ckpt_item_t it, int32_t *rank,
                    uint32_t *file, uint64_t *pos) {
  const ckpt_metadata_t *m = s->meta;
  if (it.blob) {
    const ckpt_blob_meta_t *b = &m->blobs[it.i];
    *rank = b->rank, *file = b->file, *pos = b->file_offset;
    return 1;
  }
  const ckpt_tensor_meta_t *t = &m->tensors[it.i];
  if (t->n_chunks != 1)
    return 0;
  const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk];
  for (int d = 0; d < t->ndim; d++)
    if (c->dims[d] != 0 || c->dims[t->ndim + d] != t->shape[d])
      return 0; /* a part of the tensor: not this item's whole run */
  *rank = c->rank, *file = c->file, *pos = c->file_offset;
  return 1;
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
static _Atomic uint64_t verify_hashed, verify_known;

uint64_t ckpt_store_verify_failures(void) {
  return atomic_load_explicit(&verify_failures, memory_order_relaxed);
}

void ckpt_store_verify_bytes(uint64_t *hashed, uint64_t *known) {
  *hashed = atomic_load_explicit(&verify_hashed, memory_order_relaxed);
  *known = atomic_load_explicit(&verify_known, memory_order_relaxed);
}

/* Verdicts are published under check_lock, so that the threads waiting
 * for a chunk another one is hashing (CHECKING) wake up. */
static pthread_mutex_t check_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t check_done = PTHREAD_COND_INITIALIZER;

static void set_state(const ckpt_stored_t *s, uint32_t i, uint8_t v) {
  pthread_mutex_lock(&check_lock);
  atomic_store(&s->verified[i], v);
  pthread_cond_broadcast(&check_done);
  pthread_mutex_unlock(&check_lock);
}

static void wait_checked(const ckpt_stored_t *s, uint32_t i) {
  pthread_mutex_lock(&check_lock);
  while (atomic_load(&s->verified[i]) == CKPT_CHUNK_CHECKING)
    pthread_cond_wait(&check_done, &check_lock);
  pthread_mutex_unlock(&check_lock);
}

/* In a thread checking ahead of the reader: set when the checkpoint goes
 * (ahead_forget), so that its check stops within one read. */
static _Thread_local const _Atomic bool *hash_stop;

/* Hash a chunk or blob: 0, 1 when damaged (logged), or -errno (the data
 * file cannot be opened or read: not known to be damaged). */
static int hash_stored(const ckpt_stored_t *s, const char *fqn, int32_t rank,
                       uint32_t file, uint64_t pos, uint64_t len,
                       uint64_t want) {
  ckpt_fdref_t ref;
  int rc = stored_fd(s, rank, file, &ref);
  if (rc)
    return rc;
  uint64_t got = want;
  /* hashed before (store/known.c), and the file unchanged since */
  bool known = ckpt_store_known(ref.fd, pos, len, want);
  struct stat before, after;
  bool still = false;
  if (!known) {
    bool seen = fstat(ref.fd, &before) == 0;
    rc = ckpt__stored_checksum_stop(ref.fd, pos, len, &got, hash_stop);
    /* remembered as the file was while it was hashed */
    still = seen && rc == 0 && got == want && fstat(ref.fd, &after) == 0 &&
            ckpt__same_version(&before, &after);
  }
  ckpt_fdref_put(&ref);
  if (still)
    ckpt_store_known_hashed(&before, pos, len, want);
  if (rc == 0)
    atomic_fetch_add_explicit(known ? &verify_known : &verify_hashed, len,
                              memory_order_relaxed);
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
    return 1;
  }
  return rc;
}

/* Check stored chunk or blob i of s (verified[i]) once, and again after
 * its data file changed (ckpt_stored_recheck): 0 or -EIO. One thread
 * hashes, the others wait for its verdict. A change of the file seen while
 * hashing makes the verdict void: checked again. */
static int verify_stored(const ckpt_stored_t *s, uint32_t i, const char *fqn,
                         int32_t rank, uint32_t file, uint64_t pos,
                         uint64_t len, uint64_t want) {
  struct ckpt_seen *f = NULL;
  for (;;) {
    uint8_t known = atomic_load(&s->verified[i]);
    if (known == CKPT_CHUNK_GOOD)
      return 0;
    if (known == CKPT_CHUNK_BAD)
      return -EIO;
    if (known == CKPT_CHUNK_CHECKING) {
      wait_checked(s, i);
      continue;
    }
    if (!f)
      f = find_seen(s, rank, file);
    uint32_t gen = f ? atomic_load(&f->gen) : 0;
    uint8_t unchecked = CKPT_CHUNK_UNCHECKED;
    if (!atomic_compare_exchange_strong(&s->verified[i], &unchecked,
                                        CKPT_CHUNK_CHECKING))
      continue;
    int rc = hash_stored(s, fqn, rank, file, pos, len, want);
    bool moved = f && atomic_load(&f->gen) != gen;
    set_state(s, i, moved || rc < 0 ? CKPT_CHUNK_UNCHECKED
                    : rc              ? CKPT_CHUNK_BAD
                                      : CKPT_CHUNK_GOOD);
    if (moved)
      continue;
    if (rc == 1) { /* counted once per chunk and change of its file */
      atomic_fetch_add_explicit(&verify_failures, 1, memory_order_relaxed);
      return -EIO;
    }
    if (rc)
      return rc; /* a read error: not known bad, try again next time */
    /* A change seen after the test above: its reset may have run before
     * the verdict was set. */
    uint8_t good = CKPT_CHUNK_GOOD;
    if (f && atomic_load(&f->gen) != gen &&
        atomic_compare_exchange_strong(&s->verified[i], &good,
                                       CKPT_CHUNK_UNCHECKED))
      continue;
    return 0;
  }
}

static int verify_item(const ckpt_stored_t *s, uint32_t i) {
  item_loc_t l = item_loc(s->meta, i);
  return verify_stored(s, i, l.fqn, l.rank, l.file, l.pos, l.len, l.want);
}

/* ----- Checks ahead of the reader -----
 * A load reads a data file's chunks in about the order they were written.
 * Hashing a chunk at its first read would stall the reader for the time
 * it takes (a pread of the whole chunk and XXH3: the copy out of the page
 * cache bounds it); instead, when a read touches a chunk, the chunks that
 * follow it in its data file, up to AHEAD_BYTES, are handed to
 * AHEAD_THREADS threads, which check them while the reader is served (a
 * read that reaches one still being hashed waits for its verdict). */
#define AHEAD_BYTES ((uint64_t)256 << 20)
#define AHEAD_QUEUE 4096
#define AHEAD_THREADS 2

static struct {
  pthread_mutex_t lock; /* protects everything below */
  pthread_cond_t work;  /* a check was queued */
  pthread_cond_t idle;  /* a check finished */
  struct {
    const ckpt_stored_t *s;
    uint32_t i;
  } q[AHEAD_QUEUE];
  uint32_t head, n;
  const ckpt_stored_t *running[AHEAD_THREADS];
  _Atomic bool stop[AHEAD_THREADS]; /* running[k] is going: give up */
  bool started;
  uint32_t threads; /* started */
} ahead = {.lock = PTHREAD_MUTEX_INITIALIZER,
           .work = PTHREAD_COND_INITIALIZER,
           .idle = PTHREAD_COND_INITIALIZER};

static void *ahead_main(void *arg) {
  uintptr_t me = (uintptr_t)arg;
  hash_stop = &ahead.stop[me];
  pthread_mutex_lock(&ahead.lock);
  for (;;) {
    while (ahead.n == 0)
      pthread_cond_wait(&ahead.work, &ahead.lock);
    const ckpt_stored_t *s = ahead.q[ahead.head].s;
    uint32_t i = ahead.q[ahead.head].i;
    ahead.head = (ahead.head + 1) % AHEAD_QUEUE;
    ahead.n--;
    ahead.running[me] = s;
    pthread_mutex_unlock(&ahead.lock);
    verify_item(s, i);
    pthread_mutex_lock(&ahead.lock);
    ahead.running[me] = NULL;
    atomic_store(&ahead.stop[me], false);
    pthread_cond_broadcast(&ahead.idle);
  }
  return NULL;
}

/* The threads, at the first use (ahead.lock held): false if none. */
static bool ahead_start(void) {
  if (!ahead.started) {
    ahead.started = true;
    for (uintptr_t k = 0; k < AHEAD_THREADS; k++) {
      pthread_t t;
      if (pthread_create(&t, NULL, ahead_main, (void *)k) == 0) {
        pthread_detach(t);
        ahead.threads++;
      }
    }
  }
  return ahead.threads > 0; /* else the reads check each chunk */
}

/* s goes away: none of its checks may stay queued or running. */
static void ahead_forget(const ckpt_stored_t *s) {
  pthread_mutex_lock(&ahead.lock);
  uint32_t kept = 0;
  for (uint32_t k = 0; k < ahead.n; k++) {
    uint32_t from = (ahead.head + k) % AHEAD_QUEUE;
    if (ahead.q[from].s != s)
      ahead.q[(ahead.head + kept++) % AHEAD_QUEUE] = ahead.q[from];
  }
  ahead.n = kept;
  for (;;) {
    bool busy = false;
    for (int k = 0; k < AHEAD_THREADS; k++)
      if (ahead.running[k] == s) {
        atomic_store(&ahead.stop[k], true);
        busy = true;
      }
    if (!busy)
      break;
    pthread_cond_wait(&ahead.idle, &ahead.lock);
  }
  pthread_mutex_unlock(&ahead.lock);
}

/* The end of f's last item (items are sorted by file offset). */
static uint64_t seen_end(const ckpt_stored_t *s, const struct ckpt_seen *f) {
  item_loc_t x = item_loc(s->meta, f->order[f->n_order - 1]);
  return x.pos + x.len;
}

/* The next data file of f's rank, or NULL. */
static struct ckpt_seen *seen_next(const ckpt_stored_t *s,
                                   struct ckpt_seen *f) {
  struct ckpt_seen *g = f + 1;
  return g < s->seen + s->n_seen && g->key >> 32 == f->key >> 32 ? g : NULL;
}

/* Bytes already handed to the ahead threads past byte end of f, counting
 * on into the rank's next data files while each is queued whole; up to
 * `enough` (UINT64_MAX when nothing of the rank is left to queue).
 * Lock-free: the reads' fast path. */
static uint64_t queued_past(const ckpt_stored_t *s, struct ckpt_seen *f,
                            uint64_t end, uint64_t enough) {
  uint64_t a = atomic_load(&f->ahead);
  if (a != UINT64_MAX)
    return a > end ? a - end : 0;
  uint64_t fe = seen_end(s, f), got = fe > end ? fe - end : 0;
  for (struct ckpt_seen *g = seen_next(s, f); g; g = seen_next(s, g)) {
    if (got >= enough)
      return got;
    a = atomic_load(&g->ahead);
    if (a != UINT64_MAX)
      return got + a;
    got += seen_end(s, g);
  }
  return UINT64_MAX;
}

/* Queue g's unchecked items that start in [start, start + *left) and not
 * queued yet (ahead.lock held); takes the bytes covered off *left. True
 * when all of g is queued and the queue took everything (go on with the
 * next file). */
static bool queue_file(const ckpt_stored_t *s, struct ckpt_seen *g,
                       uint64_t start, uint64_t *left) {
  const ckpt_metadata_t *m = s->meta;
  uint64_t limit = start + *left, from = atomic_load(&g->ahead);
  if (from == UINT64_MAX) {
    uint64_t fe = seen_end(s, g);
    *left -= fe > start ? (fe - start < *left ? fe - start : *left) : 0;
    return *left > 0;
  }
  if (from < start)
    from = start;
  uint32_t lo = 0, hi = g->n_order; /* the first item at or after from */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (item_loc(m, g->order[mid]).pos < from)
      lo = mid + 1;
    else
      hi = mid;
  }
  uint64_t reach = from;
  bool took_all = true;
  for (; lo < g->n_order; lo++) {
    if (!ahead_start() || ahead.n == AHEAD_QUEUE) {
      took_all = false;
      break;
    }
    uint32_t j = g->order[lo];
    item_loc_t x = item_loc(m, j);
    if (x.pos >= limit)
      break;
    if (atomic_load(&s->verified[j]) == CKPT_CHUNK_UNCHECKED) {
      ahead.q[(ahead.head + ahead.n++) % AHEAD_QUEUE].s = s;
      ahead.q[(ahead.head + ahead.n - 1) % AHEAD_QUEUE].i = j;
      pthread_cond_signal(&ahead.work);
    }
    reach = x.pos + x.len;
  }
  bool whole = lo == g->n_order;
  uint64_t covered = reach > start ? reach - start : 0;
  *left -= covered < *left ? covered : *left;
  if (whole)
    reach = UINT64_MAX; /* all of the file */
  if (reach > atomic_load(&g->ahead))
    atomic_store(&g->ahead, reach);
  return whole && took_all && *left > 0;
}

/* A read touches item i: queue the unchecked items that follow it, up to
 * AHEAD_BYTES past its end (again when the reader has gone half of that):
 * in its data file, then in the rank's next data files (a load of a
 * checkpoint written once reads one data file per large tensor: its open
 * then finds the file checked, or being checked). */
static void ahead_of(const ckpt_stored_t *s, uint32_t i) {
  item_loc_t l = item_loc(s->meta, i);
  struct ckpt_seen *f = find_seen(s, l.rank, l.file);
  uint64_t end = l.pos + l.len;
  if (!f || queued_past(s, f, end, AHEAD_BYTES / 2) >= AHEAD_BYTES / 2)
    return;
  pthread_mutex_lock(&ahead.lock);
  uint64_t left = AHEAD_BYTES;
  for (struct ckpt_seen *g = f; g && queue_file(s, g, g == f ? end : 0, &left);
       g = seen_next(s, g))
    ;
  pthread_mutex_unlock(&ahead.lock);
}

/* Same as it was when last seen? Records what st says of it now. */
static bool seen_same(struct ckpt_seen *f, const struct stat *st) {
  pthread_mutex_lock(&seen_lock);
  bool same = !f->known ||
              (f->dev == st->st_dev && f->ino == st->st_ino &&
               f->size == st->st_size &&
               f->mtime.tv_sec == st->st_mtim.tv_sec &&
               f->mtime.tv_nsec == st->st_mtim.tv_nsec &&
               f->ctime.tv_sec == st->st_ctim.tv_sec &&
               f->ctime.tv_nsec == st->st_ctim.tv_nsec);
  f->known = true;
  f->dev = st->st_dev, f->ino = st->st_ino, f->size = st->st_size;
  f->mtime = st->st_mtim, f->ctime = st->st_ctim;
  pthread_mutex_unlock(&seen_lock);
  return same;
}

/* Data file f changed: every chunk and blob in it is checked again (one
 * being hashed now sees gen move). */
static void unverify_file(const ckpt_stored_t *s, struct ckpt_seen *f) {
  const ckpt_metadata_t *m = s->meta;
  atomic_fetch_add(&f->gen, 1);
  atomic_store(&f->ahead, 0);
  uint32_t n = m->n_chunks + m->n_blobs;
  for (uint32_t i = 0; i < n; i++) {
    int64_t key = i < m->n_chunks
                      ? file_key(m->chunks[i].rank, m->chunks[i].file)
                      : file_key(m->blobs[i - m->n_chunks].rank,
                                 m->blobs[i - m->n_chunks].file);
    if (key != f->key)
      continue;
    uint8_t v = CKPT_CHUNK_GOOD;
    if (!atomic_compare_exchange_strong(&s->verified[i], &v,
                                        CKPT_CHUNK_UNCHECKED) &&
        v == CKPT_CHUNK_BAD)
      atomic_compare_exchange_strong(&s->verified[i], &v,
                                     CKPT_CHUNK_UNCHECKED);
  }
}

static void compare_file(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                         const struct stat *st) {
  struct ckpt_seen *f = find_seen(s, rank, k);
  if (!f || seen_same(f, st))
    return;
  char name[64];
  ckpt_data_file_name(rank, k, name, sizeof(name));
  ckpt__log("%s: %s changed on disk since its chunks were checked: checking "
            "them again", s->name, name);
  unverify_file(s, f);
}

void ckpt__stored_seen(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                       int fd) {
  struct stat st;
  if (fstat(fd, &st) == 0)
    compare_file(s, rank, k, &st);
}

void ckpt_stored_recheck(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                         ckpt_fdref_t *ref) {
  struct stat st;
  if (!s->seen || fstat(ref->fd, &st))
    return;
  /* No link left: the name may hold another file now (a rename over it). */
  if (st.st_nlink == 0 && ckpt__fdcache_reopen(s, rank, k, ref) == 1 &&
      fstat(ref->fd, &st))
    return;
  compare_file(s, rank, k, &st);
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
    ahead_of(s, m->n_chunks + it.i);
    return verify_stored(s, m->n_chunks + it.i, b->fqn, b->rank, b->file,
                         b->file_offset, b->length, b->checksum);
  }
  const ckpt_tensor_meta_t *t = &m->tensors[it.i];
  for (uint32_t i = 0; i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
    if (!chunk_touches(t, c, off, size))
      continue;
    ahead_of(s, t->first_chunk + i);
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
    if (g->s->verified)
      ahead_of(g->s, g->ci);
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
