/*
 * drain.c - write-behind of passthrough files.
 *
 * With passthrough=1 the kernel writes a staged file into a memfd of its
 * own (staging.c). Once its last handle is closed, the drain thread copies
 * it into a free write-behind stream (streams.c) and hashes it on the
 * way (holes stay holes, in the stream as in the hash's reads); the file
 * is then a streamed file like any other, its memfd is closed, and the
 * commit finds its bytes where the data file needs them. A file under
 * CKPT_PT_DRAIN_MIN goes into segments instead, like a file the daemon
 * wrote: a stream would align it to 4 KiB, and its memfd would hold a
 * descriptor until the commit (thousands of small files exhausted them).
 * So the trainer's copy and this one overlap (it writes the next file
 * meanwhile), the memory of the memfds is given back as the save goes on,
 * and a sync commit has little left to do.
 *
 * A drain holds the checkpoint's freeze lock shared (a commit waits for
 * it, as for any staged change) and gives up, leaving the file in its
 * memfd, when the file is open again by then, was changed meanwhile (any
 * change thaws a copy of the sealed memfd), a writable shared mapping of
 * it exists, or no stream is free.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "fs_int.h"

struct ckpt_drain {
  ckpt_fs_t *fs;
  pthread_t thread;
  pthread_mutex_t lock;   /* protects everything below */
  pthread_cond_t cond;
  ckpt_node_t **q;        /* referenced nodes to drain */
  size_t n, cap;
  bool stop;
};

/* Is n's staged data changeable now (and n still there)? Then hold its
 * checkpoint's freeze lock shared. */
static bool begin_change(ckpt_fs_t *fs, ckpt_node_t *n) {
  ckpt_ckpt_t *ck = n->ck;
  pthread_rwlock_rdlock(&ck->freeze);
  pthread_mutex_lock(&fs->lock);
  bool ok = n->attached &&
            (ck->state == CKPT_STAGING || ck->state == CKPT_FAILED);
  pthread_mutex_unlock(&fs->lock);
  if (!ok)
    pthread_rwlock_unlock(&ck->freeze);
  return ok;
}

static const uint8_t zeros[64 * 1024];

/* XXH3 of [0, size) of fd into h: its data extents read through a
 * mapping, its holes hashed as zeros without reading them (a hole of a
 * memfd read through a mapping would get pages). 0 or -errno. */
static int hash_sparse(int fd, uint64_t size, XXH3_state_t *h) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), from, to;
  for (uint64_t pos = 0; pos < size; pos = to) {
    int rc = ckpt__data_extent(fd, pos, size, &from, &to);
    if (rc)
      return rc;
    for (uint64_t k, n = from - pos; n > 0; n -= k) {
      k = n < sizeof(zeros) ? n : sizeof(zeros);
      XXH3_64bits_update(h, zeros, (size_t)k);
    }
    if (to == from)
      continue;
    uint64_t skew = from % page; /* mmap's offset is in pages */
    void *p = mmap(NULL, (size_t)(to - from + skew), PROT_READ, MAP_SHARED,
                   fd, (off_t)(from - skew));
    if (p == MAP_FAILED)
      return -errno;
    XXH3_64bits_update(h, (const char *)p + skew, (size_t)(to - from));
    munmap(p, (size_t)(to - from + skew));
  }
  return 0;
}

/* Copy and hash n's sealed memfd (size bytes) into its claimed stream.
 * No lock held: the seal keeps the memfd as it is. */
static int copy_to_stream(int fd, int out, uint64_t base, uint64_t size,
                          XXH3_state_t **hp) {
  /* The copy skips the holes: they must read as zeros in the stream too
   * (a range of it an earlier file left may hold old bytes). */
  struct stat st;
  if (fstat(out, &st))
    return -errno;
  if ((uint64_t)st.st_size > base &&
      fallocate(out, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)base,
                (off_t)((uint64_t)st.st_size - base < size
                            ? (uint64_t)st.st_size - base
                            : size)))
    return -errno;
  int rc = ckpt__copy_range(fd, out, base, size);
  XXH3_state_t *h = rc ? NULL : XXH3_createState();
  if (rc == 0 && (!h || XXH3_64bits_reset(h) != XXH_OK))
    rc = -ENOMEM;
  if (rc == 0)
    rc = hash_sparse(fd, size, h);
  if (rc)
    XXH3_freeState(h);
  else
    *hp = h;
  return rc;
}

/* Drain a closed passthrough file: into segments when small, else copied
 * and hashed into a stream.
 *
 * The memfd is sealed first. The copy then reads a file nobody can
 * change (an open for writing meanwhile thaws a copy of its own, and the
 * drain gives up), and the seal is refused while a writable shared
 * mapping of the memfd exists: such a mapping outlives the file's last
 * close (mmap, close, write through it, munmap), and writes into the
 * memfd only, so the file must stay there. */
static void drain_one(ckpt_fs_t *fs, ckpt_node_t *n) {
  ckpt_sfile_t *sf = n->u.sf;
  if (!n->ck || !begin_change(fs, n))
    return;
  pthread_mutex_lock(&sf->lock);
  struct stat st;
  int fd = atomic_load(&sf->pt_fd), memfd = -1;
  bool go = fd >= 0 && sf->pt_opens == 0 && sf->stream < 0 &&
            fstat(fd, &st) == 0;
  ino_t ino = go ? st.st_ino : 0;
  bool small = go && (uint64_t)st.st_size < CKPT_PT_DRAIN_MIN;
  if (go && !small)
    go = sf->streams && ckpt__stream_claim(sf->streams, sf) == 0;
  if (go && ckpt__sfile_pt_seal(sf) != 0) {
    ckpt__stream_abandon(sf, 0);
    go = false;
  }
  if (go && small) {
    memfd = ckpt__sfile_pt_absorb(sf);
    go = false;
  }
  uint64_t size = sf->size;
  uint64_t base = sf->stream_base;
  int out = go ? ckpt__stream_fd(sf) : -1;
  fd = go ? dup(fd) : -1;
  if (go && fd < 0) {
    ckpt__stream_abandon(sf, 0);
    go = false;
  }
  pthread_mutex_unlock(&sf->lock);
  if (!go) {
    if (memfd >= 0)
      close(memfd);
    pthread_rwlock_unlock(&n->ck->freeze);
    return;
  }
  XXH3_state_t *h = NULL;
  int rc = copy_to_stream(fd, out, base, size, &h);
  close(fd);

  pthread_mutex_lock(&fs->lock);
  pthread_mutex_lock(&sf->lock);
  /* Still the sealed memfd copied (any change thaws a fresh copy first,
   * unsealed), not open (a reader that came and went changed nothing),
   * still in the tree. */
  if (rc == 0 && n->attached && sf->pt_opens == 0 && sf->pt_sealed &&
      fstat(atomic_load(&sf->pt_fd), &st) == 0 && st.st_ino == ino) {
    XXH3_freeState(sf->hash);
    sf->hash = h;
    h = NULL;
    sf->hashed = size;
    sf->hash_broken = false;
    atomic_store_explicit(&sf->size_seen, size, memory_order_relaxed);
    ckpt__stream_release(sf); /* the stream goes on after it */
    n->mtime = st.st_mtim;    /* the kernel's writes set the memfd's */
    memfd = ckpt__sfile_pt_detach(sf);
  } else {
    ckpt__stream_abandon(sf, size);
  }
  pthread_mutex_unlock(&sf->lock);
  pthread_mutex_unlock(&fs->lock);
  if (memfd >= 0)
    close(memfd);
  XXH3_freeState(h);
  pthread_rwlock_unlock(&n->ck->freeze);
}

static void *drain_main(void *arg) {
  ckpt_drain_t *d = arg;
  /* Behind the trainer: on a busy machine its writes come first (the
   * commit copies what was not drained yet). */
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
  pthread_mutex_lock(&d->lock);
  for (;;) {
    while (d->n == 0 && !d->stop)
      pthread_cond_wait(&d->cond, &d->lock);
    if (d->stop)
      break;
    ckpt_node_t *n = d->q[0];
    memmove(d->q, d->q + 1, --d->n * sizeof(*d->q));
    pthread_mutex_unlock(&d->lock);
    drain_one(d->fs, n);
    pthread_mutex_lock(&d->fs->lock);
    ckpt__node_unref(d->fs, n);
    pthread_mutex_unlock(&d->fs->lock);
    pthread_mutex_lock(&d->lock);
  }
  pthread_mutex_unlock(&d->lock);
  return NULL;
}

int ckpt__drain_start(ckpt_fs_t *fs, ckpt_drain_t **out) {
  ckpt_drain_t *d = calloc(1, sizeof(*d));
  if (!d)
    return -ENOMEM;
  d->fs = fs;
  pthread_mutex_init(&d->lock, NULL);
  pthread_cond_init(&d->cond, NULL);
  int rc = pthread_create(&d->thread, NULL, drain_main, d);
  if (rc) {
    pthread_cond_destroy(&d->cond);
    pthread_mutex_destroy(&d->lock);
    free(d);
    return -rc;
  }
  *out = d;
  return 0;
}

void ckpt__drain_stop(ckpt_drain_t *d) {
  if (!d)
    return;
  pthread_mutex_lock(&d->lock);
  d->stop = true;
  pthread_cond_signal(&d->cond);
  pthread_mutex_unlock(&d->lock);
  pthread_join(d->thread, NULL);
  pthread_mutex_lock(&d->fs->lock);
  for (size_t i = 0; i < d->n; i++)
    ckpt__node_unref(d->fs, d->q[i]);
  pthread_mutex_unlock(&d->fs->lock);
  free(d->q);
  pthread_cond_destroy(&d->cond);
  pthread_mutex_destroy(&d->lock);
  free(d);
}

void ckpt__drain_add(ckpt_drain_t *d, ckpt_node_t *n) {
  if (!d)
    return;
  pthread_mutex_lock(&d->fs->lock);
  ckpt__node_ref(n);
  pthread_mutex_unlock(&d->fs->lock);
  pthread_mutex_lock(&d->lock);
  if (d->n == d->cap) {
    size_t cap = d->cap ? d->cap * 2 : 16;
    ckpt_node_t **q = realloc(d->q, cap * sizeof(*q));
    if (!q) { /* not drained: the commit copies it from its memfd */
      pthread_mutex_unlock(&d->lock);
      pthread_mutex_lock(&d->fs->lock);
      ckpt__node_unref(d->fs, n);
      pthread_mutex_unlock(&d->fs->lock);
      return;
    }
    d->q = q;
    d->cap = cap;
  }
  d->q[d->n++] = n;
  pthread_cond_signal(&d->cond);
  pthread_mutex_unlock(&d->lock);
}
