/*
 * drain.c - write-behind of passthrough files.
 *
 * With passthrough=1 the kernel writes a staged file into a memfd of its
 * own (staging.c). Once its last handle is closed, the drain thread copies
 * it into a free write-behind stream (streams.c) and hashes it on the
 * way; the file is then a streamed file like any other, its memfd is
 * closed, and the commit finds its bytes where the data file needs them.
 * So the trainer's copy and this one overlap (it writes the next file
 * meanwhile), the memory of the memfds is given back as the save goes on,
 * and a sync commit has little left to do.
 *
 * A drain holds the checkpoint's freeze lock shared (a commit waits for
 * it, as for any staged change) and gives up, leaving the file in its
 * memfd, when the file is opened again meanwhile (pt_gen changes) or no
 * stream is free.
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

/* Copy and hash a closed passthrough file into a stream. */
static void drain_one(ckpt_fs_t *fs, ckpt_node_t *n) {
  ckpt_sfile_t *sf = n->u.sf;
  if (!n->ck || !begin_change(fs, n))
    return;
  pthread_mutex_lock(&sf->lock);
  struct stat st;
  int fd = atomic_load(&sf->pt_fd);
  bool go = fd >= 0 && sf->pt_opens == 0 && !sf->pt_sealed &&
            sf->stream < 0 && sf->streams && fstat(fd, &st) == 0 &&
            (uint64_t)st.st_size >= CKPT_PT_DRAIN_MIN &&
            ckpt__stream_claim(sf->streams, sf) == 0;
  uint64_t gen = sf->pt_gen, size = go ? (uint64_t)st.st_size : 0;
  uint64_t base = sf->stream_base;
  int out = go ? ckpt__stream_fd(sf) : -1;
  fd = go ? dup(fd) : -1;
  if (go && fd < 0) {
    ckpt__stream_abandon(sf, 0);
    go = false;
  }
  pthread_mutex_unlock(&sf->lock);
  if (!go) {
    pthread_rwlock_unlock(&n->ck->freeze);
    return;
  }
  /* Outside the lock: the kernel may open, write or truncate it
   * meanwhile (then pt_gen moves and this copy is dropped). So the copy
   * is the kernel's (a short one stops it), and the hash reads the copy:
   * the stream, which only this file writes while it owns it. */
  int rc = ckpt__copy_range(fd, out, base, size);
  close(fd);
  XXH3_state_t *h = rc ? NULL : XXH3_createState();
  void *p = MAP_FAILED;
  if (rc == 0 && (!h || XXH3_64bits_reset(h) != XXH_OK))
    rc = -ENOMEM;
  /* mmap's offset is in pages (4 KiB stream alignment may be less) */
  uint64_t skew = base % (uint64_t)sysconf(_SC_PAGESIZE);
  if (rc == 0 && (p = mmap(NULL, (size_t)(size + skew), PROT_READ, MAP_SHARED,
                           out, (off_t)(base - skew))) == MAP_FAILED)
    rc = -errno;
  if (rc == 0)
    XXH3_64bits_update(h, (const char *)p + skew, (size_t)size);
  if (p != MAP_FAILED)
    munmap(p, (size_t)(size + skew));

  int memfd = -1;
  pthread_mutex_lock(&fs->lock);
  pthread_mutex_lock(&sf->lock);
  if (rc == 0 && n->attached && sf->pt_gen == gen && sf->pt_opens == 0 && !sf->pt_sealed &&
      fstat(atomic_load(&sf->pt_fd), &st) == 0 &&
      (uint64_t)st.st_size == size) {
    XXH3_freeState(sf->hash);
    sf->hash = h;
    h = NULL;
    sf->hashed = size;
    sf->hash_broken = false;
    sf->size = size;
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
