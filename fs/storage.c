/*
 * storage.c - BACKING_DIR: the worker pool that writes data files, the
 * scan at mount (cleanup of unfinished saves, loading of committed
 * checkpoints), deletion of checkpoints, and reads of committed tensors
 * assembled from the chunks of every rank's data files.
 *
 * Layout (SPEC.md): BACKING_DIR/NAME/.metadata and
 * BACKING_DIR/NAME/__R_K.distcp. A directory without .metadata is an
 * unfinished save. Writers hold a shared flock on the NAME directory while
 * they write, so a starting mount removes it only when no one holds it.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "catalog.h"
#include "fs_int.h"
#include "metadb.h"

/* ------------------------------------------------------------------------
 * Worker pool: ckpt__pool_run hands out task indices to io_threads workers.
 * ---------------------------------------------------------------------- */
struct ckpt_pool {
  pthread_mutex_t lock; /* protects everything below */
  pthread_cond_t work;  /* a batch is available, or stopping */
  pthread_cond_t idle;  /* a batch finished */
  pthread_mutex_t run_lock; /* one batch at a time */
  uint32_t nthreads;
  pthread_t *threads;
  int (*fn)(void *arg, uint32_t i);
  void *arg;
  uint32_t next;    /* next task index to hand out */
  uint32_t n;       /* tasks in the batch */
  uint32_t running; /* tasks handed out and not finished */
  int result;       /* first non-zero task result */
  uint64_t batch;   /* batch generation */
  bool stopping;
};

static void *pool_main(void *arg) {
  ckpt_pool_t *p = arg;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (!p->stopping && p->next >= p->n)
      pthread_cond_wait(&p->work, &p->lock);
    if (p->stopping)
      break;
    uint32_t i = p->next++;
    p->running++;
    pthread_mutex_unlock(&p->lock);
    int rc = p->fn(p->arg, i);
    pthread_mutex_lock(&p->lock);
    if (rc && !p->result)
      p->result = rc;
    if (--p->running == 0 && p->next >= p->n)
      pthread_cond_broadcast(&p->idle);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int ckpt__pool_new(uint32_t nthreads, ckpt_pool_t **out) {
  ckpt_pool_t *p = calloc(1, sizeof(*p));
  if (!p)
    return -ENOMEM;
  p->threads = calloc(nthreads, sizeof(*p->threads));
  if (!p->threads) {
    free(p);
    return -ENOMEM;
  }
  pthread_mutex_init(&p->lock, NULL);
  pthread_mutex_init(&p->run_lock, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->idle, NULL);
  for (uint32_t i = 0; i < nthreads; i++) {
    int rc = pthread_create(&p->threads[i], NULL, pool_main, p);
    if (rc) {
      p->nthreads = i;
      ckpt__pool_free(p);
      return -rc;
    }
  }
  p->nthreads = nthreads;
  *out = p;
  return 0;
}

void ckpt__pool_free(ckpt_pool_t *p) {
  if (!p)
    return;
  pthread_mutex_lock(&p->lock);
  p->stopping = true;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->lock);
  for (uint32_t i = 0; i < p->nthreads; i++)
    pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->lock);
  pthread_mutex_destroy(&p->run_lock);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->idle);
  free(p->threads);
  free(p);
}

int ckpt__pool_run(ckpt_pool_t *p, uint32_t n,
                   int (*fn)(void *arg, uint32_t i), void *arg) {
  if (n == 0)
    return 0;
  pthread_mutex_lock(&p->run_lock);
  pthread_mutex_lock(&p->lock);
  p->fn = fn;
  p->arg = arg;
  p->next = 0;
  p->n = n;
  p->running = 0;
  p->result = 0;
  pthread_cond_broadcast(&p->work);
  while (p->next < p->n || p->running > 0)
    pthread_cond_wait(&p->idle, &p->lock);
  int rc = p->result;
  p->n = 0;
  p->next = 0;
  pthread_mutex_unlock(&p->lock);
  pthread_mutex_unlock(&p->run_lock);
  return rc;
}

/* ------------------------------------------------------------------------
 * Removal.
 * ---------------------------------------------------------------------- */

int ckpt__remove_tree(int parent_fd, const char *name) {
  int fd = openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  if (fd < 0)
    return errno == ENOTDIR ? (unlinkat(parent_fd, name, 0) ? -errno : 0)
                            : -errno;
  DIR *d = fdopendir(fd);
  if (!d) {
    int e = errno;
    close(fd);
    return -e;
  }
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    if (e->d_type == DT_DIR) {
      int r = ckpt__remove_tree(dirfd(d), e->d_name);
      if (r && !rc)
        rc = r;
    } else if (unlinkat(dirfd(d), e->d_name, 0) && errno != ENOENT && !rc) {
      rc = -errno;
    }
  }
  closedir(d);
  if (unlinkat(parent_fd, name, AT_REMOVEDIR) && errno != ENOENT && !rc)
    rc = -errno;
  return rc;
}

int ckpt__storage_remove(ckpt_fs_t *fs, const char *name) {
  return ckpt__checkpoint_remove(fs->backing_fd, name, false);
}

/* ------------------------------------------------------------------------
 * The scan at mount.
 * ---------------------------------------------------------------------- */

/* A directory stream of BACKING_DIR with a file position of its own: a
 * dup of backing_fd would share (and leave at the end) the position of
 * backing_fd, so that the next scan would find nothing. */
static DIR *open_backing_dir(ckpt_fs_t *fs) {
  int fd = openat(fs->backing_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d && fd >= 0) {
    int e = errno;
    close(fd);
    errno = e;
  }
  return d;
}

/* Is BACKING_DIR/name a committed checkpoint: a directory (not a symlink
 * to one elsewhere) with a .metadata? */
static bool has_metadata(int backing_fd, const char *name) {
  struct stat st;
  if (fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW) ||
      !S_ISDIR(st.st_mode))
    return false;
  char path[300];
  snprintf(path, sizeof(path), "%s/%s", name, CKPT_METADATA_FILE);
  return faccessat(backing_fd, path, F_OK, AT_SYMLINK_NOFOLLOW) == 0;
}

void ckpt__storage_cleanup(ckpt_fs_t *fs) {
  DIR *d = open_backing_dir(fs);
  if (!d)
    return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.' || !ckpt_name_valid(e->d_name))
      continue;
    if (has_metadata(fs->backing_fd, e->d_name)) {
      /* A committed checkpoint: only a temporary file can be stale. */
      char tmp[300];
      snprintf(tmp, sizeof(tmp), "%s/%s", e->d_name, CKPT_METADATA_TMP);
      unlinkat(fs->backing_fd, tmp, 0);
      continue;
    }
    int dfd = openat(fs->backing_fd, e->d_name,
                     O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (dfd < 0)
      continue;
    /* A save in flight holds the directory; leave it to its writers. */
    if (flock(dfd, LOCK_EX | LOCK_NB) == 0 &&
        !has_metadata(fs->backing_fd, e->d_name)) {
      ckpt__log("removing unfinished save %s", e->d_name);
      ckpt__remove_tree(fs->backing_fd, e->d_name);
    }
    close(dfd);
  }
  closedir(d);
  ckpt__remove_tree(fs->backing_fd, ".staging");
}

int ckpt__fs_load_one(ckpt_fs_t *fs, const char *name, char **err) {
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s/%s/%s", fs->backing_path, name,
           CKPT_METADATA_FILE);
  ckpt_metadata_t *meta = calloc(1, sizeof(*meta));
  if (!meta) {
    *err = strdup("out of memory");
    return -ENOMEM;
  }
  int rc = ckpt_metadb_load(path, meta, err);
  if (rc) {
    free(meta);
    return rc;
  }
  int dfd = openat(fs->backing_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  if (dfd < 0) {
    rc = -errno;
    *err = ckpt__strdup_printf("opening %s: %s", name, strerror(errno));
    ckpt_metadata_free(meta);
    free(meta);
    return rc;
  }
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *dir = ckpt__ckpt_lookup(fs, name);
  ckpt_ckpt_t *ck = dir ? dir->ck : ckpt__ckpt_new(fs, name);
  if (!ck)
    rc = -ENOMEM;
  else if (ck->meta)
    rc = -EEXIST; /* already shown */
  else
    rc = ckpt__ckpt_set_committed(fs, ck, meta, dfd, err);
  pthread_mutex_unlock(&fs->lock);
  if (rc) {
    if (rc != -EEXIST && !*err)
      *err = strdup(strerror(-rc));
    close(dfd);
    ckpt_metadata_free(meta);
    free(meta);
    return rc == -EEXIST ? 0 : rc;
  }
  return 0;
}

int ckpt__fs_load(ckpt_fs_t *fs) {
  DIR *d = open_backing_dir(fs);
  if (!d)
    return -errno;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!ckpt_name_valid(e->d_name) || !has_metadata(fs->backing_fd, e->d_name))
      continue;
    char *err = NULL;
    if (ckpt__fs_load_one(fs, e->d_name, &err))
      ckpt__log("not showing checkpoint %s: %s", e->d_name,
                err ? err : "unknown error");
    free(err);
  }
  closedir(d);
  return 0;
}

/* ------------------------------------------------------------------------
 * Reads of committed data.
 * ---------------------------------------------------------------------- */

/* The fd of data file K of rank R, opened on first use. */
static int data_fd(ckpt_ckpt_t *ck, int32_t rank, uint32_t file) {
  uint64_t i = (uint64_t)rank * ck->fds_stride + file;
  if (rank < 0 || file >= ck->fds_stride || i >= ck->nfds)
    return -EIO;
  pthread_mutex_lock(&ck->fd_lock);
  int fd = ck->fds[i];
  if (fd < 0) {
    char name[64];
    ckpt_data_file_name(rank, file, name, sizeof(name));
    fd = openat(ck->dirfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      /* A committed checkpoint whose data file is gone is damaged: a read
       * fails with EIO (ENOENT from read(2) would puzzle the caller). */
      ckpt__log("%s: cannot open %s: %s", ck->name, name, strerror(errno));
      fd = -EIO;
    } else {
      ck->fds[i] = fd;
    }
  }
  pthread_mutex_unlock(&ck->fd_lock);
  return fd;
}

/* Read exactly n bytes at off, or fail (a short file is corruption). */
static int pread_full(int fd, void *buf, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (r == 0)
      return -EIO;
    done += (size_t)r;
  }
  return 0;
}

/* Read the part of one chunk that falls in [off, off+size): one pread of
 * the chunk bytes that the range needs, then the copies. */
static int read_chunk(ckpt_ckpt_t *ck, const ckpt_tensor_meta_t *t,
                      const ckpt_chunk_meta_t *c, char *out, uint64_t off,
                      size_t size) {
  size_t isz = ckpt_dtype_size(t->dtype);
  const int64_t *offs = c->dims, *sizes = c->dims + t->ndim;
  uint64_t lo, hi;
  ckpt_layout_span(t->ndim, t->shape, offs, sizes, isz, off, size, &lo, &hi);
  if (lo >= hi)
    return 0;
  if (hi > c->length)
    return -EIO;
  int fd = data_fd(ck, c->rank, c->file);
  if (fd < 0)
    return fd;
  size_t n = (size_t)(hi - lo);
  uint8_t *tmp = malloc(n);
  if (!tmp)
    return -ENOMEM;
  int rc = pread_full(fd, tmp, n, c->file_offset + lo);
  if (rc == 0)
    ckpt_layout_copy(t->ndim, t->shape, offs, sizes, isz, off, size, tmp, lo,
                     (uint8_t *)out);
  free(tmp);
  return rc;
}

/* Does chunk c of tensor t hold any byte of [off, off+size)? */
static bool chunk_touches(const ckpt_tensor_meta_t *t,
                          const ckpt_chunk_meta_t *c, uint64_t off,
                          size_t size) {
  uint64_t first, end;
  ckpt_layout_extent(t->ndim, t->shape, c->dims, c->dims + t->ndim,
                     ckpt_dtype_size(t->dtype), &first, &end);
  return end > off && first < off + size;
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

/* The bytes [pos, pos+len) of a data file must be there. */
static int check_stored(int fd, uint64_t pos, uint64_t len) {
  struct stat st;
  if (fstat(fd, &st))
    return -errno;
  return (uint64_t)st.st_size >= pos + len ? 0 : -EIO;
}

int ckpt__committed_span(ckpt_ckpt_t *ck, const ckpt_node_t *n, size_t size,
                         uint64_t off, int *fd, uint64_t *pos, size_t *len) {
  uint64_t total = ckpt__committed_size(ck, n);
  if (off >= total || size == 0)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  const ckpt_metadata_t *m = ck->meta;
  int32_t rank;
  uint32_t file;
  uint64_t at;
  if (n->kind == CKPT_NODE_CBLOB) {
    const ckpt_blob_meta_t *b = &m->blobs[n->u.blob];
    rank = b->rank, file = b->file, at = b->file_offset + off;
  } else {
    const ckpt_tensor_meta_t *t = &m->tensors[n->u.tensor];
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
  int f = data_fd(ck, rank, file);
  if (f < 0)
    return f;
  int rc = check_stored(f, at, size);
  if (rc)
    return rc;
  *fd = f;
  *pos = at;
  *len = size;
  return 1;
}

/* Check stored chunk or blob i of ck (verified[i]) once: 0 or -EIO. */
static int verify_stored(ckpt_ckpt_t *ck, uint32_t i, const char *fqn,
                         int32_t rank, uint32_t file, uint64_t pos,
                         uint64_t len, uint64_t want) {
  uint8_t known = atomic_load(&ck->verified[i]);
  if (known != CKPT_CHUNK_UNCHECKED)
    return known == CKPT_CHUNK_GOOD ? 0 : -EIO;
  int fd = data_fd(ck, rank, file);
  if (fd < 0)
    return fd;
  uint64_t got = 0;
  int rc = ckpt__stored_checksum(fd, pos, len, &got);
  if (rc == -ENODATA || (rc == 0 && got != want)) {
    char name[64];
    ckpt_data_file_name(rank, file, name, sizeof(name));
    if (rc)
      ckpt__log("%s: %s: rank %d, %s: truncated (bytes %" PRIu64
                "..%" PRIu64 " missing)", ck->name, fqn, rank, name, pos,
                pos + len);
    else
      ckpt__log("%s: %s: rank %d, %s at %" PRIu64 ": checksum %016" PRIx64
                ", stored %016" PRIx64, ck->name, fqn, rank, name, pos, got,
                want);
    atomic_store(&ck->verified[i], CKPT_CHUNK_BAD);
    return -EIO;
  }
  if (rc)
    return rc; /* a read error: not known bad, try again next time */
  atomic_store(&ck->verified[i], CKPT_CHUNK_GOOD);
  return 0;
}

int ckpt__committed_verify(ckpt_ckpt_t *ck, const ckpt_node_t *n,
                           size_t size, uint64_t off) {
  if (!ck->verified) /* verify=0: nothing to do on the read path */
    return 0;
  const ckpt_metadata_t *m = ck->meta;
  uint64_t total = ckpt__committed_size(ck, n);
  if (off >= total || size == 0)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  if (n->kind == CKPT_NODE_CBLOB) {
    const ckpt_blob_meta_t *b = &m->blobs[n->u.blob];
    return verify_stored(ck, m->n_chunks + n->u.blob, b->fqn, b->rank,
                         b->file, b->file_offset, b->length, b->checksum);
  }
  const ckpt_tensor_meta_t *t = &m->tensors[n->u.tensor];
  for (uint32_t i = 0; i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
    if (!chunk_touches(t, c, off, size))
      continue;
    int rc = verify_stored(ck, t->first_chunk + i, t->fqn, c->rank, c->file,
                           c->file_offset, c->length, c->checksum);
    if (rc)
      return rc;
  }
  return 0;
}

uint64_t ckpt__committed_size(const ckpt_ckpt_t *ck, const ckpt_node_t *n) {
  const ckpt_metadata_t *m = ck->meta;
  if (n->kind == CKPT_NODE_CBLOB)
    return m->blobs[n->u.blob].length;
  const ckpt_tensor_meta_t *t = &m->tensors[n->u.tensor];
  uint64_t numel = 0;
  ckpt_dims_numel(t->shape, t->ndim, &numel);
  return numel * ckpt_dtype_size(t->dtype);
}

ssize_t ckpt__committed_read(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                             const ckpt_node_t *n, char *buf, size_t size,
                             uint64_t off) {
  (void)fs;
  uint64_t total = ckpt__committed_size(ck, n);
  if (off >= total)
    return 0;
  if (size > total - off)
    size = (size_t)(total - off);
  const ckpt_metadata_t *m = ck->meta;
  if (n->kind == CKPT_NODE_CBLOB) {
    const ckpt_blob_meta_t *b = &m->blobs[n->u.blob];
    int fd = data_fd(ck, b->rank, b->file);
    if (fd < 0)
      return fd;
    int rc = pread_full(fd, buf, size, b->file_offset + off);
    return rc ? rc : (ssize_t)size;
  }
  const ckpt_tensor_meta_t *t = &m->tensors[n->u.tensor];
  for (uint32_t i = 0; i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
    if (!chunk_touches(t, c, off, size))
      continue;
    int rc = read_chunk(ck, t, c, buf, off, size);
    if (rc)
      return rc;
  }
  return (ssize_t)size;
}
