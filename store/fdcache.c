/*
 * fdcache.c - the one bounded cache of data file descriptors (store.h).
 *
 * A mount serves every committed checkpoint of BACKING_DIR for as long as
 * it runs, and a tool may read thousands: a descriptor per data file ever
 * read would reach the process's limit (and then every commit fails with
 * "Too many open files"). So descriptors are cached by (checkpoint id,
 * rank, K), at most cap of them; the least recently used one that no read
 * holds is closed to make room, and one held beyond the cap is closed when
 * released. A miss opens BACKING_DIR/NAME again, without following
 * symlinks, and checks that it is still the checkpoint that was loaded
 * (its inode and its save ID), so that a handle of a removed checkpoint
 * never reads another one's bytes. With a near root (a node-local tier,
 * ckpt_fdcache_set_near) NAME is looked for there first, and its lineage
 * checked by save ID: the two copies are different directories. A file
 * in neither (another node's rank, its flush not done yet) is taken from
 * BACKING_DIR/.saves/SAVE_ID once a flush linked it there (only complete,
 * verified copies are linked), waiting for that up to the near root's
 * wait (commit_timeout).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store_int.h"

struct ckpt_fdent {
  uint64_t id;
  int32_t rank;
  uint32_t k;
  int fd;
  uint32_t refs;
  bool stale;        /* replaced (ckpt__fdcache_reopen): in no chain nor
                        list, closed at its last put */
  struct ckpt_fdent *hnext;            /* hash chain */
  struct ckpt_fdent *lprev, *lnext;    /* LRU list of unused entries */
};

struct ckpt_fdcache {
  pthread_mutex_t lock;   /* protects everything below */
  int backing_fd;         /* not owned */
  int near_fd;            /* tried first (a tier), or -1; not owned */
  double near_wait;       /* s a file in no root waits for a flush */
  uint32_t cap;
  uint32_t n;             /* entries (open descriptors) */
  uint64_t next_id;
  struct ckpt_fdent **hash;
  size_t nbuckets;        /* power of two */
  struct ckpt_fdent *lru_head, *lru_tail; /* head: least recently used */
};

static size_t bucket(const ckpt_fdcache_t *c, uint64_t id, int32_t rank,
                     uint32_t k) {
  uint64_t h = id * 0x9E3779B97F4A7C15ull ^ (uint64_t)(uint32_t)rank * 0xC2B2AE3D27D4EB4Full ^ k;
  h ^= h >> 29;
  return (size_t)h & (c->nbuckets - 1);
}

static void lru_remove(ckpt_fdcache_t *c, struct ckpt_fdent *e) {
  if (e->lprev)
    e->lprev->lnext = e->lnext;
  else
    c->lru_head = e->lnext;
  if (e->lnext)
    e->lnext->lprev = e->lprev;
  else
    c->lru_tail = e->lprev;
  e->lprev = e->lnext = NULL;
}

static void lru_push(ckpt_fdcache_t *c, struct ckpt_fdent *e) {
  e->lnext = NULL;
  e->lprev = c->lru_tail;
  if (c->lru_tail)
    c->lru_tail->lnext = e;
  else
    c->lru_head = e;
  c->lru_tail = e;
}

/* Unlink e from its hash chain and close it (unused, c->lock held). */
static void drop(ckpt_fdcache_t *c, struct ckpt_fdent *e) {
  struct ckpt_fdent **p = &c->hash[bucket(c, e->id, e->rank, e->k)];
  while (*p != e)
    p = &(*p)->hnext;
  *p = e->hnext;
  lru_remove(c, e);
  close(e->fd);
  free(e);
  c->n--;
}

/* Close unused entries until fewer than want are open (c->lock held). */
static void shrink(ckpt_fdcache_t *c, uint32_t want) {
  while (c->n >= want && c->lru_head)
    drop(c, c->lru_head);
}

static uint32_t default_cap(void) {
  struct rlimit rl;
  uint64_t cap = CKPT_FDCACHE_MAX;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
      rl.rlim_cur / 4 < cap)
    cap = (uint64_t)rl.rlim_cur / 4;
  return cap < 16 ? 16 : (uint32_t)cap;
}

int ckpt_fdcache_new(int backing_fd, uint32_t cap, ckpt_fdcache_t **out) {
  ckpt_fdcache_t *c = calloc(1, sizeof(*c));
  if (!c)
    return -ENOMEM;
  c->backing_fd = backing_fd;
  c->near_fd = -1;
  c->cap = cap ? cap : default_cap();
  c->nbuckets = 64;
  while (c->nbuckets < 2 * (size_t)c->cap)
    c->nbuckets *= 2;
  if (!(c->hash = calloc(c->nbuckets, sizeof(*c->hash)))) {
    free(c);
    return -ENOMEM;
  }
  c->next_id = 1;
  pthread_mutex_init(&c->lock, NULL);
  *out = c;
  return 0;
}

void ckpt_fdcache_free(ckpt_fdcache_t *c) {
  if (!c)
    return;
  for (size_t b = 0; b < c->nbuckets; b++) {
    for (struct ckpt_fdent *e = c->hash[b], *nx; e; e = nx) {
      nx = e->hnext;
      close(e->fd);
      free(e);
    }
  }
  free(c->hash);
  pthread_mutex_destroy(&c->lock);
  free(c);
}

void ckpt_fdcache_set_near(ckpt_fdcache_t *c, int near_fd, double wait) {
  c->near_fd = near_fd;
  c->near_wait = wait;
}

uint32_t ckpt_fdcache_open(ckpt_fdcache_t *c) {
  pthread_mutex_lock(&c->lock);
  uint32_t n = c->n;
  pthread_mutex_unlock(&c->lock);
  return n;
}

uint64_t ckpt__fdcache_new_id(ckpt_fdcache_t *c) {
  pthread_mutex_lock(&c->lock);
  uint64_t id = c->next_id++;
  pthread_mutex_unlock(&c->lock);
  return id;
}

uint32_t ckpt_fdcache_sweep(ckpt_fdcache_t *c) {
  uint32_t closed = 0;
  pthread_mutex_lock(&c->lock);
  for (struct ckpt_fdent *e = c->lru_head, *nx; e; e = nx) {
    nx = e->lnext;
    struct stat st;
    if (fstat(e->fd, &st) == 0 && st.st_nlink == 0) {
      drop(c, e);
      closed++;
    }
  }
  pthread_mutex_unlock(&c->lock);
  return closed;
}

void ckpt__fdcache_forget(ckpt_fdcache_t *c, uint64_t id) {
  pthread_mutex_lock(&c->lock);
  for (size_t b = 0; b < c->nbuckets; b++) {
    for (struct ckpt_fdent *e = c->hash[b], *nx; e; e = nx) {
      nx = e->hnext;
      if (e->id == id && e->refs == 0)
        drop(c, e);
    }
  }
  pthread_mutex_unlock(&c->lock);
}

/* Open data file K of rank R of s: fd or -errno. */
static int open_data_file_once(const ckpt_stored_t *s, int backing_fd,
                               int32_t rank, uint32_t k) {
  char name[64];
  ckpt_data_file_name(rank, k, name, sizeof(name));
  int dfd = ckpt_store_open_dir(backing_fd, s->name, O_PATH);
  if (dfd < 0) {
    ckpt__log("%s: cannot open its directory: %s", s->name, strerror(-dfd));
    return dfd;
  }
  int fd = ckpt_stored_same_lineage(s, dfd);
  if (fd == -ESTALE) {
    ckpt__log("%s: not reading %s of another checkpoint", s->name, name);
  } else if (fd == 0) {
    fd = ckpt_store_open_file(dfd, name);
    if (fd < 0)
      ckpt__log("%s: cannot open %s: %s", s->name, name, strerror(-fd));
  }
  close(dfd);
  return fd;
}

/* The near root (a tier) has the file while its checkpoint is there:
 * fd, or -ENOENT (not there, or another checkpoint of the name: quietly,
 * the shared store is tried next) or -errno. */
static int open_near(const ckpt_stored_t *s, int near_fd, int32_t rank,
                     uint32_t k) {
  char name[64];
  ckpt_data_file_name(rank, k, name, sizeof(name));
  int dfd = ckpt_store_open_dir(near_fd, s->name, O_PATH);
  if (dfd < 0)
    return dfd == -ENOENT || dfd == -ELOOP || dfd == -ENOTDIR ? -ENOENT : dfd;
  /* by save ID: the copy in BACKING_DIR is another directory */
  int fd = ckpt_stored_same_lineage(s, dfd) ? -ENOENT
                                            : ckpt_store_open_file(dfd, name);
  close(dfd);
  return fd;
}

/* BACKING_DIR/NAME's file; quietly -ENOENT when NAME is not there (not
 * flushed yet: *there false) or the file is not. */
static int open_shared(const ckpt_stored_t *s, int backing_fd, int32_t rank,
                       uint32_t k, bool *there) {
  struct stat st;
  char name[64];
  ckpt_data_file_name(rank, k, name, sizeof(name));
  *there = !(fstatat(backing_fd, s->name, &st, AT_SYMLINK_NOFOLLOW) &&
             errno == ENOENT);
  if (!*there)
    return -ENOENT;
  int dfd = ckpt_store_open_dir(backing_fd, s->name, O_PATH);
  if (dfd < 0)
    return dfd == -ENOENT ? -ENOENT : dfd;
  int fd = ckpt_stored_same_lineage(s, dfd);
  if (fd == 0)
    fd = ckpt_store_open_file(dfd, name);
  close(dfd);
  return fd;
}

/* BACKING_DIR/.saves/SAVE_ID's file: linked there by a flush once copied
 * and verified (flush.c), before the checkpoint is published. */
static int open_flushed(const ckpt_stored_t *s, int backing_fd, int32_t rank,
                        uint32_t k) {
  char path[CKPT_SAVE_ID_LEN + 96];
  const char *id = s->meta ? s->meta->save_id : NULL;
  if (!id || !ckpt_save_id_valid(id))
    return -ENOENT;
  snprintf(path, sizeof(path), "%s/%s/", CKPT_SAVES_DIR, id);
  ckpt_data_file_name(rank, k, path + strlen(path), 64);
  int fd = ckpt_store_open_file(backing_fd, path);
  return fd == -ENOTDIR || fd == -ELOOP ? -ENOENT : fd;
}

/* With a near root: the tier's copy, BACKING_DIR's, the file a flush
 * linked already; and when none has it and the checkpoint is not
 * published in BACKING_DIR yet, the same again every 50 ms up to
 * c->near_wait s (another node's flush), then EIO, logged. Published
 * without the file: ENOENT, as without a near root. */
static int open_nearest(const ckpt_fdcache_t *c, const ckpt_stored_t *s,
                        int32_t rank, uint32_t k) {
  double until = -1;
  for (;;) {
    bool published = false;
    int fd = open_near(s, c->near_fd, rank, k);
    for (int attempt = 0; attempt < 3 && fd == -ENOENT; attempt++) {
      fd = open_shared(s, c->backing_fd, rank, k, &published);
      if (!published)
        break;
    }
    if (fd == -ENOENT && published)
      return fd;
    if (fd == -ENOENT)
      fd = open_flushed(s, c->backing_fd, rank, k);
    if (fd != -ENOENT)
      return fd;
    /* Nowhere, and not in this node's tier either: removed (from
     * BACKING_DIR after its flush), not a flush still to come */
    if (faccessat(c->near_fd, s->name, F_OK, AT_SYMLINK_NOFOLLOW))
      return -ENOENT;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    char name[64];
    ckpt_data_file_name(rank, k, name, sizeof(name));
    if (until < 0) {
      until = now + c->near_wait;
      if (c->near_wait > 0)
        ckpt__log("%s: %s is not in this node's tier nor in BACKING_DIR "
                  "yet: waiting up to %.0f s for its flush", s->name, name,
                  c->near_wait);
    }
    if (now >= until) {
      ckpt__log("%s: %s is in no copy this node reaches (its tier, "
                "BACKING_DIR/%s, BACKING_DIR/%s/%s): EIO", s->name, name,
                s->name, CKPT_SAVES_DIR, s->meta ? s->meta->save_id : "?");
      return -EIO;
    }
    struct timespec pause = {0, 50 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
}

/* A removal inside the checkpoint on another mount may exchange the
 * directory just opened for a later version and remove it before the
 * file is opened in it: then the later version has it (or not: ENOENT
 * again, an item removed since). With a near root, the nearest copy. */
static int open_data_file(const ckpt_fdcache_t *c, const ckpt_stored_t *s,
                          int32_t rank, uint32_t k) {
  if (c->near_fd >= 0)
    return open_nearest(c, s, rank, k);
  int fd = -ENOENT;
  for (int attempt = 0; attempt < 3 && fd == -ENOENT; attempt++)
    fd = open_data_file_once(s, c->backing_fd, rank, k);
  return fd;
}

/* Under c->lock: the entry of data file K of rank R of s, with one more
 * reference. fd was just opened for it: when another thread opened it
 * meanwhile, that entry is used and fd closed; else fd gets a new entry
 * (*added). NULL (fd closed) when out of memory. */
static struct ckpt_fdent *share_or_add(ckpt_fdcache_t *c,
                                       const ckpt_stored_t *s, int32_t rank,
                                       uint32_t k, int fd, bool *added) {
  *added = false;
  size_t b = bucket(c, s->id, rank, k);
  for (struct ckpt_fdent *o = c->hash[b]; o; o = o->hnext) {
    if (o->id == s->id && o->rank == rank && o->k == k) {
      if (o->refs++ == 0)
        lru_remove(c, o);
      close(fd);
      return o;
    }
  }
  struct ckpt_fdent *e = calloc(1, sizeof(*e));
  if (!e) {
    close(fd);
    return NULL;
  }
  e->id = s->id, e->rank = rank, e->k = k, e->fd = fd, e->refs = 1;
  e->hnext = c->hash[b];
  c->hash[b] = e;
  c->n++;
  *added = true;
  return e;
}

int ckpt_stored_fd(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                   ckpt_fdref_t *ref) {
  ckpt_fdcache_t *c = s->cache;
  ref->fd = -1;
  ref->e = NULL;
  ref->c = c;
  ref->fresh = false;
  if (rank < 0 || rank >= s->meta->world_size)
    return -ERANGE;
  size_t b = bucket(c, s->id, rank, k);
  pthread_mutex_lock(&c->lock);
  for (struct ckpt_fdent *e = c->hash[b]; e; e = e->hnext) {
    if (e->id == s->id && e->rank == rank && e->k == k) {
      if (e->refs++ == 0)
        lru_remove(c, e);
      ref->fd = e->fd;
      ref->e = e;
      pthread_mutex_unlock(&c->lock);
      return 0;
    }
  }
  shrink(c, c->cap);
  pthread_mutex_unlock(&c->lock);

  int fd = open_data_file(c, s, rank, k);
  if (fd == -EMFILE || fd == -ENFILE) { /* make room and try once more */
    pthread_mutex_lock(&c->lock);
    shrink(c, 1);
    pthread_mutex_unlock(&c->lock);
    fd = open_data_file(c, s, rank, k);
  }
  if (fd < 0)
    return fd;
  bool added;
  pthread_mutex_lock(&c->lock);
  struct ckpt_fdent *e = share_or_add(c, s, rank, k, fd, &added);
  pthread_mutex_unlock(&c->lock);
  if (!e)
    return -ENOMEM;
  ref->fd = e->fd;
  ref->e = e;
  ref->fresh = added;
  return 0;
}

void ckpt_fdref_put(ckpt_fdref_t *ref) {
  if (!ref->e)
    return;
  ckpt_fdcache_t *c = ref->c;
  pthread_mutex_lock(&c->lock);
  struct ckpt_fdent *e = ref->e;
  if (--e->refs == 0 && e->stale) {
    close(e->fd);
    free(e);
    c->n--;
  } else if (e->refs == 0) {
    lru_push(c, e);
    if (c->n > c->cap)
      drop(c, e);
  }
  pthread_mutex_unlock(&c->lock);
  ref->e = NULL;
  ref->fd = -1;
}

int ckpt__fdcache_reopen(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                         ckpt_fdref_t *ref) {
  ckpt_fdcache_t *c = s->cache;
  int fd = open_data_file(c, s, rank, k);
  if (fd < 0)
    return fd;
  struct stat now, was;
  if (fstat(fd, &now) || fstat(ref->fd, &was) ||
      (now.st_dev == was.st_dev && now.st_ino == was.st_ino)) {
    close(fd);
    return 0;
  }
  pthread_mutex_lock(&c->lock);
  struct ckpt_fdent *old = ref->e;
  if (!old->stale) { /* out of its chain: lookups find the new one */
    struct ckpt_fdent **p = &c->hash[bucket(c, old->id, old->rank, old->k)];
    while (*p && *p != old)
      p = &(*p)->hnext;
    if (*p)
      *p = old->hnext;
    old->hnext = NULL;
    old->stale = true;
  }
  bool added;
  struct ckpt_fdent *e = share_or_add(c, s, rank, k, fd, &added);
  pthread_mutex_unlock(&c->lock);
  if (!e)
    return -ENOMEM;
  ckpt_fdref_put(ref);
  ref->fd = e->fd;
  ref->e = e;
  ref->c = c;
  return 1;
}
