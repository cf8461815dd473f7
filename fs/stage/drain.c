/*
 * drain.c - hashing of passthrough files once they are closed.
 *
 * With passthrough the kernel writes a staged file into a file of its own
 * in BACKING_DIR/.staging, which becomes its data file at commit
 * (staging.c, streams.c): its bytes are written once, by the trainer's
 * own write. Once its last handle is closed, the drain thread hashes it
 * from the page cache (holes as zeros, unread), behind the trainer, so
 * that a commit finds its checksum ready and has nothing to read. A file
 * under CKPT_PT_DRAIN_MIN moves into segments instead, like a file the
 * daemon wrote: a data file of its own per small tensor would cost a
 * descriptor each until the commit and a data file each after it.
 *
 * A move into segments holds the checkpoint's freeze lock shared (a
 * commit waits for it, as for any staged change); a hash does not (a
 * commit never waits for one: it hashes what it finds unhashed itself).
 * The drain gives up when the file is open again by then, or anyone can
 * still write it (a writable shared mapping left after the close: the
 * commit hashes it, or refuses it while the mapping is there). A hash
 * that an open for writing overtook (sf->pt_gen moved) is dropped.
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

#include "stage.h"

/* Writebacks started beside the hashes, at most this many queued (each
 * holds a descriptor); past it the drain starts one itself. */
#define CKPT_WB_QUEUE 8

struct ckpt_drain {
  ckpt_fs_t *fs;
  pthread_t thread, wb_thread;
  pthread_mutex_t lock;   /* protects everything below */
  pthread_cond_t cond, wb_cond;
  ckpt_node_t **q;        /* referenced nodes to drain: a ring of cap, */
  size_t head, n, cap;    /* n of them from head on */
  struct {                /* writebacks to start: a ring of CKPT_WB_QUEUE */
    int fd;               /* owned */
    uint64_t size;
  } wb[CKPT_WB_QUEUE];
  size_t wb_head, wb_n;
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

int ckpt__hash_sparse(int fd, uint64_t size, XXH3_state_t *h, uint8_t *buf,
                      size_t cap) {
  /* As many blocks as bytes: no hole worth skipping, so no SEEK_DATA and
   * SEEK_HOLE (each walks the whole page cache of the file on tmpfs).
   * Should a hole hide behind blocks allocated past the end, it reads as
   * the zeros it would be hashed as. */
  struct stat st;
  if (fstat(fd, &st) == 0 && (uint64_t)st.st_blocks * 512 >= size) {
    int rc = ckpt__hash_fd(h, fd, 0, size, buf, cap);
    return rc == -ENODATA ? -ESTALE : rc;
  }
  uint64_t from, to;
  for (uint64_t pos = 0; pos < size; pos = to) {
    int rc = ckpt__data_extent(fd, pos, size, &from, &to);
    if (rc)
      return rc;
    for (uint64_t k, n = from - pos; n > 0; n -= k) {
      k = n < sizeof(zeros) ? n : sizeof(zeros);
      XXH3_64bits_update(h, zeros, (size_t)k);
    }
    rc = ckpt__hash_fd(h, fd, from, to - from, buf, cap);
    if (rc)
      return rc == -ENODATA ? -ESTALE : rc;
  }
  return 0;
}

/* Start the writeback of closed file fd (size bytes) on the writeback
 * thread, so that it runs beside the hash: SYNC_FILE_RANGE_WRITE blocks
 * while the disk takes the pages (0.47 s for 1 GiB on ext4 here), and a
 * hash after it would wait that long. Where the queue is full, here. */
static void start_writeback(ckpt_drain_t *d, int fd, uint64_t size) {
  int own = -1;
  pthread_mutex_lock(&d->lock);
  if (d->wb_n < CKPT_WB_QUEUE && !d->stop &&
      (own = fcntl(fd, F_DUPFD_CLOEXEC, 0)) >= 0) {
    size_t i = (d->wb_head + d->wb_n++) % CKPT_WB_QUEUE;
    d->wb[i].fd = own;
    d->wb[i].size = size;
    pthread_cond_signal(&d->wb_cond);
  }
  pthread_mutex_unlock(&d->lock);
  if (own < 0)
    (void)sync_file_range(fd, 0, (off_t)size, SYNC_FILE_RANGE_WRITE);
}

static void *writeback_main(void *arg) {
  ckpt_drain_t *d = arg;
  pthread_setname_np(pthread_self(), "ckptfs-wback");
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10); /* as the drain */
  pthread_mutex_lock(&d->lock);
  for (;;) {
    while (d->wb_n == 0 && !d->stop)
      pthread_cond_wait(&d->wb_cond, &d->lock);
    if (d->wb_n == 0)
      break; /* stopped, and nothing left */
    int fd = d->wb[d->wb_head].fd;
    uint64_t size = d->wb[d->wb_head].size;
    d->wb_head = (d->wb_head + 1) % CKPT_WB_QUEUE;
    d->wb_n--;
    bool stop = d->stop; /* stopping: the commit writes what is left */
    pthread_mutex_unlock(&d->lock);
    if (!stop)
      (void)sync_file_range(fd, 0, (off_t)size, SYNC_FILE_RANGE_WRITE);
    close(fd);
    pthread_mutex_lock(&d->lock);
  }
  pthread_mutex_unlock(&d->lock);
  return NULL;
}

/* The XXH3 of closed file fd (size bytes) into a new *h. Its data file
 * once committed: with sync_files its writeback starts now, beside the
 * hash (start_writeback), so that the commit's flush finds little left
 * (what a plain directory's syncfs would also write). 0 or -errno. */
static int hash_closed(ckpt_drain_t *d, int fd, uint64_t size,
                       XXH3_state_t **h, uint8_t *buf, size_t cap) {
  if (d->fs->opts.sync_files && size)
    start_writeback(d, fd, size);
  *h = XXH3_createState();
  int rc = *h && XXH3_64bits_reset(*h) == XXH_OK ? 0 : -ENOMEM;
  return rc ? rc : ckpt__hash_sparse(fd, size, *h, buf, cap);
}

/* Hash a closed passthrough file where it is, or move a small one into
 * segments. The seal first: it fails while anyone can write the file
 * (true: try again in a moment). Only the move changes the file (it
 * holds the freeze lock shared, like any staged change); a hash starts
 * only while no commit has begun (a commit hashes what it finds unhashed
 * itself: it never waits for the drain's queue), runs without the freeze
 * lock, and is kept if no open for writing came meanwhile (a commit that
 * began meanwhile waits for this one hash: sf->pt_hashing). */
static bool drain_one(ckpt_drain_t *d, ckpt_node_t *n, uint8_t *buf,
                      size_t cap) {
  ckpt_fs_t *fs = d->fs;
  ckpt_sfile_t *sf = n->u.sf;
  ckpt_ckpt_t *ck = n->ck;
  if (!ck || atomic_load(&ck->freezing))
    return false;
  struct stat st;
  pthread_mutex_lock(&sf->lock);
  bool small = sf->pt_fd >= 0 && sf->stream < 0 &&
               fstat(sf->pt_fd, &st) == 0 &&
               (uint64_t)st.st_size < CKPT_PT_DRAIN_MIN;
  pthread_mutex_unlock(&sf->lock);
  bool held = small && begin_change(fs, n);
  if (small && !held)
    return false;
  if (!held) {
    /* no commit has begun (one that begins now freezes the file after
     * this seal: both take sf->lock) */
    pthread_mutex_lock(&fs->lock);
    bool ok = n->attached && !atomic_load(&ck->freezing) &&
              (ck->state == CKPT_STAGING || ck->state == CKPT_FAILED);
    if (ok)
      pthread_mutex_lock(&sf->lock);
    pthread_mutex_unlock(&fs->lock);
    if (!ok)
      return false;
  } else {
    /* fs->lock too: the node's mtime is set with the move, so that a
     * utime (setattr, under fs->lock) is never overwritten by the time
     * read before it */
    pthread_mutex_lock(&fs->lock);
    pthread_mutex_lock(&sf->lock);
  }
  int fd = atomic_load(&sf->pt_fd), backing = -1;
  int seal = fd >= 0 && sf->pt_opens == 0 ? ckpt__sfile_pt_seal(sf) : -1;
  bool go = seal == 0;
  if (seal == -EBUSY) { /* closed, but the kernel may not have let go of
                           its backing file yet: again in a moment */
    pthread_mutex_unlock(&sf->lock);
    if (held) {
      pthread_mutex_unlock(&fs->lock);
      pthread_rwlock_unlock(&ck->freeze);
    }
    return true;
  }
  bool reuse = false;
  if (go && held && sf->size < CKPT_PT_DRAIN_MIN && sf->stream < 0) {
    if (fstat(fd, &st) == 0) { /* the kernel's writes set the backing
                                  file's */
      n->mtime = st.st_mtim;
      ckpt__sfile_pt_ctime(sf, &st, &n->ctime);
    }
    backing = ckpt__sfile_pt_absorb(sf);
    reuse = !sf->pt_read_opened;
    go = false;
  }
  if (go && (held || (!sf->hash_broken && sf->hashed == sf->size)))
    go = false; /* small after all (it grew back: next time), or hashed */
  uint64_t size = sf->size;
  uint32_t gen = sf->pt_gen;
  fd = go ? dup(fd) : -1;
  go = go && fd >= 0;
  sf->pt_hashing = go; /* a commit beginning meanwhile waits for it */
  pthread_mutex_unlock(&sf->lock);
  if (held) {
    pthread_mutex_unlock(&fs->lock);
    pthread_rwlock_unlock(&ck->freeze);
  }
  if (backing >= 0 && reuse) /* for the next new file */
    ckpt__staging_pt_recycle(sf->budget, backing);
  else if (backing >= 0)
    close(backing);
  if (!go)
    return false;
  XXH3_state_t *h = NULL;
  int rc = hash_closed(d, fd, size, &h, buf, cap);
  close(fd);

  pthread_mutex_lock(&sf->lock);
  /* Nobody could write it since the seal (no open for writing came: the
   * generation is the same; a commit that froze it meanwhile waits for
   * this hash, pt_hashing, and reads it under sf->lock). */
  if (rc == 0 && sf->pt_sealed && sf->pt_gen == gen && sf->size == size) {
    XXH3_freeState(sf->hash);
    sf->hash = h;
    h = NULL;
    sf->hashed = size;
    sf->hash_broken = false;
    atomic_fetch_add(&fs->metrics.bytes_drained, size);
  }
  sf->pt_hashing = false;
  pthread_cond_broadcast(&sf->pt_hashed);
  pthread_mutex_unlock(&sf->lock);
  XXH3_freeState(h);
  return false;
}

static void *drain_main(void *arg) {
  ckpt_drain_t *d = arg;
  pthread_setname_np(pthread_self(), "ckptfs-drain");
  /* Behind the trainer: on a busy machine its writes come first (the
   * commit copies what was not drained yet). */
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
  size_t cap = (size_t)1 << 20;
  uint8_t *buf = malloc(cap);
  pthread_mutex_lock(&d->lock);
  for (;;) {
    while (d->n == 0 && !d->stop)
      pthread_cond_wait(&d->cond, &d->lock);
    if (d->stop)
      break;
    ckpt_node_t *n = d->q[d->head];
    d->head = (d->head + 1) % d->cap;
    d->n--;
    pthread_mutex_unlock(&d->lock);
    /* (without buf: hashed at the commit) the kernel lets go of a
     * closed file's backing file after its RELEASE: a few tries */
    for (int t = 0; buf && drain_one(d, n, buf, cap) && t < 20; t++)
      usleep(1000);
    pthread_mutex_lock(&d->fs->lock);
    ckpt__node_unref(d->fs, n);
    pthread_mutex_unlock(&d->fs->lock);
    pthread_mutex_lock(&d->lock);
  }
  pthread_mutex_unlock(&d->lock);
  free(buf);
  return NULL;
}

int ckpt__drain_start(ckpt_fs_t *fs, ckpt_drain_t **out) {
  ckpt_drain_t *d = calloc(1, sizeof(*d));
  if (!d)
    return -ENOMEM;
  d->fs = fs;
  pthread_mutex_init(&d->lock, NULL);
  pthread_cond_init(&d->cond, NULL);
  pthread_cond_init(&d->wb_cond, NULL);
  int rc = pthread_create(&d->wb_thread, NULL, writeback_main, d);
  if (rc == 0 && (rc = pthread_create(&d->thread, NULL, drain_main, d)) != 0) {
    pthread_mutex_lock(&d->lock);
    d->stop = true;
    pthread_cond_signal(&d->wb_cond);
    pthread_mutex_unlock(&d->lock);
    pthread_join(d->wb_thread, NULL);
  }
  if (rc) {
    pthread_cond_destroy(&d->wb_cond);
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
  pthread_cond_signal(&d->wb_cond);
  pthread_mutex_unlock(&d->lock);
  pthread_join(d->thread, NULL);
  pthread_join(d->wb_thread, NULL); /* the queued descriptors closed */
  pthread_mutex_lock(&d->fs->lock);
  for (size_t i = 0; i < d->n; i++)
    ckpt__node_unref(d->fs, d->q[(d->head + i) % d->cap]);
  pthread_mutex_unlock(&d->fs->lock);
  free(d->q);
  pthread_cond_destroy(&d->wb_cond);
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
    ckpt_node_t **q = malloc(cap * sizeof(*q));
    if (!q) { /* not hashed: the commit hashes it */
      pthread_mutex_unlock(&d->lock);
      pthread_mutex_lock(&d->fs->lock);
      ckpt__node_unref(d->fs, n);
      pthread_mutex_unlock(&d->fs->lock);
      return;
    }
    for (size_t i = 0; i < d->n; i++) /* in order, from 0 */
      q[i] = d->q[(d->head + i) % d->cap];
    free(d->q);
    d->q = q;
    d->head = 0;
    d->cap = cap;
  }
  d->q[(d->head + d->n++) % d->cap] = n;
  pthread_cond_signal(&d->cond);
  pthread_mutex_unlock(&d->lock);
}
