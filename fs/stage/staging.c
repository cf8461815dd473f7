/*
 * staging.c - the data and xattrs of staged files.
 *
 * A staged file is an array of 1 MiB segments, allocated on first write
 * (unwritten ranges are holes that read as zeros). Small files would waste
 * most of a segment, so segment 0 starts at the size written and doubles up
 * to a full segment. Segments live in RAM while the mount's budget
 * (staging_mem) allows, and in slots of the spill file beyond it: RAM is a
 * hard bound, a write never fails for lack of it. Full segments return to a
 * pool when freed and are reused by the next checkpoint.
 *
 * While a file is written front to back (the common case: a tensor written
 * in order), its XXH3-64 is computed on the way, so that a commit does not
 * read the data once more to hash it.
 *
 * Workload: trainers write large tensors sequentially in 1 MiB requests,
 * and many small tensors once; reads of staged data are rare.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <xxhash.h>

#include "stage.h"
#include "stage_int.h"

/* Segment 0 of a small file starts this small: a trainer may stage a
 * million tiny files (counters, RNG states, scalars). */
#define SEG0_MIN 64u
/* A first write of at least this many bytes at offset 0 starts a stream. */
#define CKPT_STREAM_MIN (64u << 10)
#define SPILL_DIR CKPT_STAGING_DIR

const char *const ckpt__xattr_names[CKPT_X_COUNT] = {
    [CKPT_X_DTYPE] = "user.ckpt.dtype",
    [CKPT_X_SHAPE] = "user.ckpt.shape",
    [CKPT_X_OFFSETS] = "user.ckpt.offsets",
    [CKPT_X_SIZES] = "user.ckpt.sizes",
    [CKPT_X_FQN] = "user.ckpt.fqn",
};

/* ------------------------------------------------------------------------
 * The mount's staging memory: budget, segment pool, spill file.
 * ---------------------------------------------------------------------- */

void ckpt__staging_init(ckpt_staging_t *st, uint64_t limit, int backing_fd) {
  memset(st, 0, sizeof(*st));
  st->limit = limit;
  st->backing_fd = backing_fd;
  st->spill_fd = -1;
  /* Passthrough: a backing file per staged file, at most half the
   * descriptors */
  struct rlimit rl;
  st->pt_max = 512;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    st->pt_max = (uint32_t)(rl.rlim_cur / 2 < UINT32_MAX ? rl.rlim_cur / 2
                                                          : UINT32_MAX);
  pthread_mutex_init(&st->lock, NULL);
}

void ckpt__staging_destroy(ckpt_staging_t *st) {
  for (uint32_t i = 0; i < st->npool; i++)
    free(st->pool[i]);
  free(st->pool);
  for (uint32_t i = 0; i < st->pt_npool; i++)
    close(st->pt_pool[i]);
  free(st->pt_pool);
  free(st->free_slots);
  if (st->spill_fd >= 0)
    close(st->spill_fd);
  pthread_mutex_destroy(&st->lock);
}

static bool budget_take(ckpt_staging_t *b, uint64_t n) {
  uint64_t cur = atomic_load(&b->used);
  do {
    if (cur + n > b->limit || cur + n < cur)
      return false;
  } while (!atomic_compare_exchange_weak(&b->used, &cur, cur + n));
  return true;
}

static void budget_give(ckpt_staging_t *b, uint64_t n) {
  atomic_fetch_sub(&b->used, n);
}

/* A full segment of RAM (contents undefined), or NULL beyond the budget. */
static uint8_t *segment_get(ckpt_staging_t *b) {
  pthread_mutex_lock(&b->lock);
  uint8_t *p = b->npool ? b->pool[--b->npool] : NULL;
  pthread_mutex_unlock(&b->lock);
  if (p || !budget_take(b, CKPT_SEG_SIZE))
    return p;
  p = malloc(CKPT_SEG_SIZE);
  if (!p)
    budget_give(b, CKPT_SEG_SIZE);
  return p;
}

static void segment_put(ckpt_staging_t *b, uint8_t *p) {
  pthread_mutex_lock(&b->lock);
  if (b->npool == b->cap_pool) {
    uint32_t cap = b->cap_pool ? 2 * b->cap_pool : 64;
    uint8_t **np = realloc(b->pool, cap * sizeof(*np));
    if (!np) { /* cannot pool it: give it back */
      pthread_mutex_unlock(&b->lock);
      free(p);
      budget_give(b, CKPT_SEG_SIZE);
      return;
    }
    b->pool = np;
    b->cap_pool = cap;
  }
  b->pool[b->npool++] = p;
  pthread_mutex_unlock(&b->lock);
}

int ckpt__staging_dir(int backing_fd) {
  /* A starting mount may remove .staging between our mkdir and open, and
   * whoever can write BACKING_DIR may put a symlink there: try again. */
  for (int attempt = 0; attempt < 5; attempt++) {
    if (mkdirat(backing_fd, SPILL_DIR, 0700) && errno != EEXIST)
      return -errno;
    int dfd = ckpt_open_beneath(backing_fd, SPILL_DIR, O_PATH | O_DIRECTORY,
                                0);
    if (dfd == -ENOENT)
      continue;
    if (dfd != -ELOOP && dfd != -ENOTDIR)
      return dfd;
    /* Never written through: the name is ours, what is there is not. */
    struct stat st;
    bool link = fstatat(backing_fd, SPILL_DIR, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                S_ISLNK(st.st_mode);
    ckpt__log("BACKING_DIR/%s is %s, not a directory: refused (nothing is "
              "written through it); removing it and making a directory",
              SPILL_DIR, link ? "a symbolic link" : "something else");
    unlinkat(backing_fd, SPILL_DIR, 0);
  }
  return -ELOOP;
}

int ckpt__staging_tmpfile(int backing_fd) {
  /* .staging may go between our open of it and of the file: again. */
  for (int attempt = 0; attempt < 5; attempt++) {
    int dfd = ckpt__staging_dir(backing_fd);
    if (dfd < 0)
      return dfd;
    int fd = ckpt_open_beneath(dfd, ".", O_TMPFILE | O_RDWR, 0600);
    close(dfd);
    if (fd != -ENOENT)
      return fd;
  }
  return -ENOENT;
}

void ckpt__staging_tidy(int backing_fd) {
  /* Only unnamed files live there: it is empty whenever it exists. */
  unlinkat(backing_fd, SPILL_DIR, AT_REMOVEDIR);
}

/* The unnamed spill file in BACKING_DIR/.staging. b->lock held. */
static int spill_open(ckpt_staging_t *b) {
  CKPT_HELD(&b->lock);
  if (b->spill_fd >= 0)
    return 0;
  int fd = ckpt__staging_tmpfile(b->backing_fd);
  if (fd < 0)
    return fd;
  b->spill_fd = fd;
  return 0;
}

/* A zeroed slot of the spill file: its offset, or a negative errno. */
static int64_t slot_get(ckpt_staging_t *b) {
  pthread_mutex_lock(&b->lock);
  int64_t off;
  int rc = spill_open(b);
  if (rc) {
    off = rc;
  } else if (b->nfree) {
    off = b->free_slots[--b->nfree];
  } else {
    off = b->spill_end;
    b->spill_end += (int64_t)CKPT_SEG_SIZE;
  }
  if (off >= 0)
    b->spill_used += CKPT_SEG_SIZE;
  pthread_mutex_unlock(&b->lock);
  return off;
}

static void slot_put(ckpt_staging_t *b, int64_t off) {
  pthread_mutex_lock(&b->lock);
  b->spill_used -= CKPT_SEG_SIZE;
  if (b->spill_used == 0) {
    /* Nothing spilled any more: give the disk space back at once. */
    if (ftruncate(b->spill_fd, 0) == 0) {
      b->spill_end = 0;
      b->nfree = 0;
      pthread_mutex_unlock(&b->lock);
      return;
    }
  }
  /* A free slot reads as zeros when it is reused. */
  if (fallocate(b->spill_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off,
                (off_t)CKPT_SEG_SIZE) == 0) {
    if (b->nfree == b->cap_free) {
      uint32_t cap = b->cap_free ? 2 * b->cap_free : 64;
      int64_t *nf = realloc(b->free_slots, cap * sizeof(*nf));
      if (nf) {
        b->free_slots = nf;
        b->cap_free = cap;
      }
    }
    if (b->nfree < b->cap_free)
      b->free_slots[b->nfree++] = off;
  } /* else the slot is lost until the spill file empties */
  pthread_mutex_unlock(&b->lock);
}

/* ------------------------------------------------------------------------
 * Segments of a file.
 * ---------------------------------------------------------------------- */

ckpt_sfile_t *ckpt__sfile_new(ckpt_staging_t *budget,
                              ckpt_streams_t *streams) {
  ckpt_sfile_t *sf = calloc(1, sizeof(*sf));
  if (!sf)
    return NULL;
  pthread_mutex_init(&sf->lock, NULL);
  pthread_cond_init(&sf->pt_hashed, NULL);
  sf->budget = budget;
  sf->streams = streams;
  sf->stream = -1;
  sf->pt_fd = -1;
  return sf;
}

void ckpt__sfile_end_stream(ckpt_sfile_t *sf) {
  pthread_mutex_lock(&sf->lock);
  ckpt__stream_release(sf);
  pthread_mutex_unlock(&sf->lock);
}

static uint64_t mem_cap(const ckpt_sfile_t *sf, uint32_t i) {
  return i == 0 ? sf->seg0_cap : CKPT_SEG_SIZE;
}

/* Bytes of segment i that hold data (RAM or spill); beyond: zeros. */
static uint64_t seg_have(const ckpt_sfile_t *sf, uint32_t i) {
  if (i >= sf->nsegs)
    return 0;
  if (sf->segs[i].spill >= 0)
    return CKPT_SEG_SIZE;
  return sf->segs[i].mem ? mem_cap(sf, i) : 0;
}

static void drop_segment(ckpt_sfile_t *sf, uint32_t i) {
  ckpt_seg_t *g = &sf->segs[i];
  if (g->mem) {
    if (mem_cap(sf, i) == CKPT_SEG_SIZE) {
      segment_put(sf->budget, g->mem);
    } else {
      budget_give(sf->budget, mem_cap(sf, i));
      free(g->mem);
    }
    g->mem = NULL;
  }
  if (g->spill >= 0) {
    slot_put(sf->budget, g->spill);
    g->spill = -1;
  }
  if (i == 0)
    sf->seg0_cap = 0;
}

static void drop_segments(ckpt_sfile_t *sf, uint32_t from) {
  for (uint32_t i = from; i < sf->nsegs; i++)
    drop_segment(sf, i);
}

void ckpt__sfile_free(ckpt_sfile_t *sf) {
  if (!sf)
    return;
  pthread_mutex_lock(&sf->lock); /* nobody else has sf: for the asserts */
  ckpt__stream_drop(sf);
  pthread_mutex_unlock(&sf->lock);
  drop_segments(sf, 0);
  if (sf->pt_fd >= 0) {
    close(sf->pt_fd);
    ckpt__stg_pt_fd_give(sf->budget);
  }
  free(sf->segs);
  XXH3_freeState(sf->hash);
  for (int i = 0; i < CKPT_X_COUNT; i++)
    free(sf->xattr[i]);
  ckpt__xlist_free(&sf->other);
  pthread_cond_destroy(&sf->pt_hashed);
  pthread_mutex_destroy(&sf->lock);
  free(sf);
}

static int grow_index(ckpt_sfile_t *sf, uint32_t nsegs) {
  if (nsegs <= sf->nsegs)
    return 0;
  uint32_t cap = sf->nsegs ? sf->nsegs : 1;
  while (cap < nsegs)
    cap *= 2;
  ckpt_seg_t *s = realloc(sf->segs, cap * sizeof(*s));
  if (!s)
    return -ENOMEM;
  for (uint32_t i = sf->nsegs; i < cap; i++)
    s[i] = (ckpt_seg_t){.mem = NULL, .spill = -1};
  sf->segs = s;
  sf->nsegs = cap;
  return 0;
}

/* Move segment i to a spill slot (its RAM, if any, is copied and freed). */
static int spill_segment(ckpt_sfile_t *sf, uint32_t i) {
  int64_t off = slot_get(sf->budget);
  if (off < 0)
    return (int)off;
  ckpt_seg_t *g = &sf->segs[i];
  if (g->mem) {
    uint64_t n = mem_cap(sf, i);
    if (pwrite(sf->budget->spill_fd, g->mem, n, off) != (ssize_t)n) {
      int e = errno ? errno : EIO;
      slot_put(sf->budget, off);
      return -e;
    }
    drop_segment(sf, i);
  }
  g->spill = off;
  return 0;
}

/* Make segment i hold at least `need` bytes (need <= CKPT_SEG_SIZE): grow
 * its RAM, or spill it when the budget is spent. */
static int ensure_segment(ckpt_sfile_t *sf, uint32_t i, uint64_t need) {
  ckpt_seg_t *g = &sf->segs[i];
  if (g->spill >= 0)
    return 0;
  uint64_t cap = g->mem ? mem_cap(sf, i) : 0;
  if (cap >= need)
    return 0;
  if (i > 0 || need > CKPT_SEG_SIZE / 2) {
    /* A full segment: from the pool or the budget, else spilled. */
    uint8_t *p = segment_get(sf->budget);
    if (!p)
      return spill_segment(sf, i);
    if (cap)
      memcpy(p, g->mem, cap);
    memset(p + cap, 0, CKPT_SEG_SIZE - cap);
    if (g->mem) {
      budget_give(sf->budget, cap);
      free(g->mem);
    }
    g->mem = p;
    if (i == 0)
      sf->seg0_cap = (uint32_t)CKPT_SEG_SIZE;
    return 0;
  }
  /* Segment 0 of a small file doubles from SEG0_MIN. */
  uint64_t want = cap ? cap : SEG0_MIN;
  while (want < need)
    want *= 2;
  if (!budget_take(sf->budget, want - cap))
    return spill_segment(sf, i);
  uint8_t *p = realloc(g->mem, want);
  if (!p) {
    budget_give(sf->budget, want - cap);
    return -ENOMEM;
  }
  memset(p + cap, 0, want - cap);
  g->mem = p;
  sf->seg0_cap = (uint32_t)want;
  return 0;
}

/* Keep the running hash while writes come in order. sf->lock held. */
static void hash_write(ckpt_sfile_t *sf, const void *buf, size_t n,
                       uint64_t off) {
  CKPT_HELD(&sf->lock);
  if (sf->hash_broken)
    return;
  if (off != sf->hashed) {
    sf->hash_broken = true;
    return;
  }
  if (!sf->hash) {
    sf->hash = XXH3_createState();
    if (!sf->hash || XXH3_64bits_reset(sf->hash) != XXH_OK) {
      sf->hash_broken = true;
      return;
    }
  }
  XXH3_64bits_update(sf->hash, buf, n);
  sf->hashed += n;
}

/* Write into the segments (RAM or spill). sf->lock held. Returns bytes
 * written or a negative errno. */
static ssize_t write_segments(ckpt_sfile_t *sf, const void *buf, size_t n,
                              uint64_t off) {
  CKPT_HELD(&sf->lock);
  uint32_t last = (uint32_t)((off + n - 1) >> CKPT_SEG_SHIFT);
  int rc = grow_index(sf, last + 1);
  /* A file that grows past segment 0 needs it whole. */
  if (rc == 0 && last > 0 && seg_have(sf, 0) && seg_have(sf, 0) < CKPT_SEG_SIZE)
    rc = ensure_segment(sf, 0, CKPT_SEG_SIZE);
  size_t done = 0;
  while (rc == 0 && done < n) {
    uint64_t pos = off + done;
    uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
    uint64_t in = pos & (CKPT_SEG_SIZE - 1);
    size_t chunk = n - done;
    if (chunk > CKPT_SEG_SIZE - in)
      chunk = (size_t)(CKPT_SEG_SIZE - in);
    rc = ensure_segment(sf, i, last > 0 ? CKPT_SEG_SIZE : in + chunk);
    if (rc)
      break;
    const uint8_t *src = (const uint8_t *)buf + done;
    if (sf->segs[i].mem) {
      memcpy(sf->segs[i].mem + in, src, chunk);
    } else if (pwrite(sf->budget->spill_fd, src, chunk,
                      sf->segs[i].spill + (off_t)in) != (ssize_t)chunk) {
      rc = -(errno ? errno : EIO);
      break;
    }
    done += chunk;
  }
  if (off + done > sf->size) {
    sf->size = off + done;
    atomic_store_explicit(&sf->size_seen, sf->size, memory_order_relaxed);
  }
  return done ? (ssize_t)done : rc;
}

/* Read [off, off+n) of the stream (n > 0); past its end: zeros. */
static int stream_read(ckpt_sfile_t *sf, void *buf, size_t n, uint64_t off) {
  ssize_t r = pread(ckpt__stream_fd(sf), buf, n,
                    (off_t)(sf->stream_base + off));
  if (r < 0)
    return -errno;
  memset((uint8_t *)buf + r, 0, n - (size_t)r);
  return 0;
}

/* The file leaves its stream: its bytes move into segments. sf->lock. */
static int unstream(ckpt_sfile_t *sf) {
  if (sf->stream < 0)
    return 0;
  uint8_t *bounce = malloc(CKPT_SEG_SIZE);
  if (!bounce)
    return -ENOMEM;
  uint64_t size = sf->size;
  int rc = 0;
  for (uint64_t pos = 0; pos < size && rc == 0; pos += CKPT_SEG_SIZE) {
    size_t n = size - pos < CKPT_SEG_SIZE ? (size_t)(size - pos)
                                          : (size_t)CKPT_SEG_SIZE;
    rc = stream_read(sf, bounce, n, pos);
    if (rc == 0) {
      ssize_t w = write_segments(sf, bounce, n, pos);
      rc = w < 0 ? (int)w : 0;
    }
  }
  free(bounce);
  if (rc) {
    drop_segments(sf, 0);
    return rc;
  }
  ckpt__stream_drop(sf);
  sf->size = size;
  atomic_store_explicit(&sf->size_seen, sf->size, memory_order_relaxed);
  return 0;
}

/* Append to the stream; 0 when the write does not fit there. sf->lock. */
static ssize_t stream_write(ckpt_sfile_t *sf, const void *buf, size_t n,
                            uint64_t off) {
  if (sf->stream < 0 && sf->size == 0 && off == 0 && sf->streams &&
      n >= CKPT_STREAM_MIN)
    ckpt__stream_claim(sf->streams, sf);
  if (sf->stream < 0)
    return 0;
  if (!sf->stream_owner || off != sf->size ||
      atomic_load(&sf->streams->committed)) {
    int rc = unstream(sf);
    return rc ? rc : 0;
  }
  size_t done = 0;
  while (done < n) {
    ssize_t w = pwrite(ckpt__stream_fd(sf), (const uint8_t *)buf + done,
                       n - done, (off_t)(sf->stream_base + off + done));
    if (w <= 0) {
      if (w < 0 && errno == EINTR)
        continue;
      break;
    }
    done += (size_t)w;
  }
  if (done == n) {
    sf->size = off + done;
    atomic_store_explicit(&sf->size_seen, sf->size, memory_order_relaxed);
    return (ssize_t)done;
  }
  /* The backing filesystem is full or failing: staging goes on in RAM
   * (and the commit will report the backing filesystem's error). */
  ckpt__log("write-behind failed (%s): staging in memory", strerror(errno));
  int rc = unstream(sf);
  return rc ? rc : 0;
}

/* A closed passthrough file too small to drain into a stream: its bytes
 * move into segments, like a file the daemon wrote, and its backing file
 * (one descriptor per file) goes. */
int ckpt__sfile_pt_absorb(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  uint64_t size = sf->size; /* sealed: read at the seal */
  uint8_t *buf = malloc(size ? (size_t)size : 1);
  if (!buf)
    return -ENOMEM;
  ssize_t r = size ? pread(sf->pt_fd, buf, (size_t)size, 0) : 0;
  int rc = r == (ssize_t)size ? 0 : r < 0 ? -errno : -ESTALE;
  drop_segments(sf, 0);
  sf->size = 0;
  sf->hashed = 0;
  sf->hash_broken = false;
  if (sf->hash)
    XXH3_64bits_reset(sf->hash);
  if (rc == 0 && size > 0) {
    ssize_t w = write_segments(sf, buf, (size_t)size, 0);
    rc = w == (ssize_t)size ? 0 : w < 0 ? (int)w : -EIO;
    if (rc == 0)
      hash_write(sf, buf, (size_t)size, 0);
  }
  free(buf);
  sf->size = size;
  atomic_store_explicit(&sf->size_seen, size, memory_order_relaxed);
  if (rc) { /* it stays in its backing file */
    drop_segments(sf, 0);
    sf->hash_broken = true;
    return rc;
  }
  return ckpt__sfile_pt_detach(sf);
}

ssize_t ckpt__sfile_write(ckpt_sfile_t *sf, const void *buf, size_t n,
                          uint64_t off) {
  if (n == 0)
    return 0;
  if (off > CKPT_MAX_FILE || n > CKPT_MAX_FILE - off)
    return -EFBIG;
  pthread_mutex_lock(&sf->lock);
  /* Not passed through (a copy_file_range, say): into its backing file
   * all the same. */
  if (sf->pt_fd >= 0) {
    int fd = ckpt__stg_pt_rw(sf);
    ssize_t r = fd;
    if (fd >= 0 && (r = pwrite(fd, buf, n, (off_t)off)) < 0)
      r = -errno;
    if (fd >= 0)
      close(fd);
    if (r >= 0)
      ckpt__stg_pt_refresh(sf);
    pthread_mutex_unlock(&sf->lock);
    return r;
  }
  ssize_t r = stream_write(sf, buf, n, off);
  if (r == 0)
    r = write_segments(sf, buf, n, off);
  if (r > 0)
    hash_write(sf, buf, (size_t)r, off);
  pthread_mutex_unlock(&sf->lock);
  return r;
}

/* Copy [in, in+n) of segment i (n within the segment) to dst. */
static int seg_copy_out(ckpt_sfile_t *sf, uint32_t i, uint64_t in, size_t n,
                        uint8_t *dst) {
  uint64_t have = seg_have(sf, i);
  size_t from = in < have ? (size_t)(have - in < n ? have - in : n) : 0;
  if (from && sf->segs[i].mem) {
    memcpy(dst, sf->segs[i].mem + in, from);
  } else if (from) {
    /* The spill file may end inside the slot: the rest reads as zeros. */
    ssize_t r = pread(sf->budget->spill_fd, dst, from,
                      sf->segs[i].spill + (off_t)in);
    if (r < 0)
      return -errno;
    from = (size_t)r;
  }
  memset(dst + from, 0, n - from);
  return 0;
}

ssize_t ckpt__sfile_read(ckpt_sfile_t *sf, void *buf, size_t n, uint64_t off) {
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd >= 0) {
    ssize_t r = pread(sf->pt_fd, buf, n, (off_t)off);
    pthread_mutex_unlock(&sf->lock);
    return r < 0 ? -errno : r;
  }
  size_t total = 0;
  int rc = 0;
  if (off < sf->size) {
    if (n > sf->size - off)
      n = (size_t)(sf->size - off);
    if (sf->stream >= 0 && n > 0) {
      rc = stream_read(sf, buf, n, off);
      total = n;
    }
    while (total < n && rc == 0) {
      uint64_t pos = off + total;
      uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
      uint64_t in = pos & (CKPT_SEG_SIZE - 1);
      size_t chunk = n - total;
      if (chunk > CKPT_SEG_SIZE - in)
        chunk = (size_t)(CKPT_SEG_SIZE - in);
      rc = seg_copy_out(sf, i, in, chunk, (uint8_t *)buf + total);
      total += chunk;
    }
  }
  pthread_mutex_unlock(&sf->lock);
  return rc ? rc : (ssize_t)total;
}

int ckpt__sfile_truncate(ckpt_sfile_t *sf, uint64_t size) {
  if (size > CKPT_MAX_FILE)
    return -EFBIG;
  pthread_mutex_lock(&sf->lock);
  int rc = 0;
  if (sf->pt_fd >= 0) {
    int fd = ckpt__stg_pt_rw(sf);
    rc = fd < 0 ? fd : ftruncate(fd, (off_t)size) ? -errno : 0;
    if (fd >= 0)
      close(fd);
    if (rc == 0)
      rc = ckpt__stg_pt_refresh(sf);
    pthread_mutex_unlock(&sf->lock);
    return rc;
  }
  if (sf->stream >= 0 && size == 0) {
    /* Written again from the start: in the same place while it owns the
     * stream, else it may claim a stream anew. */
    if (!sf->stream_owner || atomic_load(&sf->streams->committed))
      ckpt__stream_drop(sf);
    sf->size = 0;
    atomic_store_explicit(&sf->size_seen, sf->size, memory_order_relaxed);
  } else if (sf->stream >= 0 && (rc = unstream(sf)) != 0) {
    pthread_mutex_unlock(&sf->lock);
    return rc;
  }
  if (size < sf->size) {
    /* Free whole segments past the end, zero the tail of the last one so
     * that growing the file again reads zeros. */
    uint32_t keep = (uint32_t)((size + CKPT_SEG_SIZE - 1) >> CKPT_SEG_SHIFT);
    if (keep < sf->nsegs)
      drop_segments(sf, keep);
    uint32_t i = (uint32_t)(size >> CKPT_SEG_SHIFT);
    uint64_t in = size & (CKPT_SEG_SIZE - 1);
    /* Segment 0 of a small file may end before `in` (the file grew by
     * truncate or by writes to later segments only). */
    uint64_t have = in ? seg_have(sf, i) : 0;
    if (in < have && sf->segs[i].mem)
      memset(sf->segs[i].mem + in, 0, have - in);
    else if (in < have &&
             fallocate(sf->budget->spill_fd,
                       FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                       sf->segs[i].spill + (off_t)in, (off_t)(have - in)))
      rc = -errno;
  }
  if (size == 0) {
    /* Written again from the start: the running hash starts over. */
    sf->hash_broken = false;
    sf->hashed = 0;
    if (sf->hash)
      XXH3_64bits_reset(sf->hash);
  } else if (size < sf->hashed) {
    sf->hash_broken = true;
  }
  sf->size = size;
  atomic_store_explicit(&sf->size_seen, sf->size, memory_order_relaxed);
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

int ckpt__sfile_zero(ckpt_sfile_t *sf, uint64_t off, uint64_t len) {
  pthread_mutex_lock(&sf->lock);
  int rc = sf->pt_fd >= 0 ? ckpt__stg_pt_refresh(sf) : 0;
  if (rc)
    goto out;
  uint64_t end = off + len < sf->size ? off + len : sf->size;
  if (sf->pt_fd >= 0) {
    int fd = off < end ? ckpt__stg_pt_rw(sf) : -1;
    if (fd >= 0 && fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                             (off_t)off, (off_t)(end - off)))
      rc = -errno;
    else if (off < end && fd < 0)
      rc = fd;
    if (fd >= 0)
      close(fd);
    goto out;
  }
  if (off >= end)
    goto out;
  if (sf->stream >= 0 && (rc = unstream(sf)) != 0)
    goto out;
  for (uint64_t pos = off; pos < end && rc == 0;) {
    uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
    uint64_t in = pos & (CKPT_SEG_SIZE - 1);
    uint64_t n = end - pos < CKPT_SEG_SIZE - in ? end - pos : CKPT_SEG_SIZE - in;
    uint64_t have = seg_have(sf, i);
    if (in == 0 && n == CKPT_SEG_SIZE && i < sf->nsegs) {
      drop_segment(sf, i); /* a whole segment: a hole again */
    } else if (in < have) {
      uint64_t m = have - in < n ? have - in : n;
      if (sf->segs[i].mem)
        memset(sf->segs[i].mem + in, 0, (size_t)m);
      else if (fallocate(sf->budget->spill_fd,
                         FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                         sf->segs[i].spill + (off_t)in, (off_t)m))
        rc = -errno;
    }
    pos += n;
  }
  if (off < sf->hashed)
    sf->hash_broken = true;
out:
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

uint64_t ckpt__sfile_allocated(ckpt_sfile_t *sf) {
  pthread_mutex_lock(&sf->lock);
  uint64_t bytes = 0;
  struct stat st;
  if (sf->pt_fd >= 0) {
    if (fstat(sf->pt_fd, &st) == 0)
      bytes = (uint64_t)st.st_blocks * 512;
  } else if (sf->stream >= 0) {
    bytes = sf->size; /* a run of its stream file, written in full */
  } else {
    for (uint32_t i = 0; i < sf->nsegs; i++)
      bytes += seg_have(sf, i);
  }
  pthread_mutex_unlock(&sf->lock);
  return bytes;
}

/* SEEK_DATA and SEEK_HOLE over the segments: a segment neither in RAM nor
 * spilled is a hole; the end of the file is one. sf->lock held. */
static int64_t seg_seek(const ckpt_sfile_t *sf, uint64_t off, int whence) {
  for (uint64_t i = off >> CKPT_SEG_SHIFT; i << CKPT_SEG_SHIFT < sf->size;
       i++) {
    bool data = seg_have(sf, (uint32_t)i) > 0;
    if (data == (whence == SEEK_DATA))
      return (int64_t)(i << CKPT_SEG_SHIFT > off ? i << CKPT_SEG_SHIFT : off);
  }
  return whence == SEEK_DATA ? -ENXIO : (int64_t)sf->size;
}

int64_t ckpt__sfile_seek(ckpt_sfile_t *sf, uint64_t off, int whence) {
  if (whence != SEEK_DATA && whence != SEEK_HOLE)
    return -EINVAL;
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd >= 0 && !sf->pt_sealed)
    ckpt__stg_pt_refresh(sf);
  int64_t r;
  if (off >= sf->size) {
    r = -ENXIO;
  } else if (sf->pt_fd >= 0) {
    off_t o = lseek(sf->pt_fd, (off_t)off, whence);
    r = o < 0 ? -errno : (int64_t)o;
  } else if (sf->stream >= 0) {
    r = whence == SEEK_DATA ? (int64_t)off : (int64_t)sf->size;
  } else {
    r = seg_seek(sf, off, whence);
  }
  pthread_mutex_unlock(&sf->lock);
  return r;
}

uint64_t ckpt__sfile_size(ckpt_sfile_t *sf) {
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd >= 0 && !sf->pt_sealed) /* sealed: read at the freeze; a
                                           commit reads it unlocked */
    ckpt__stg_pt_refresh(sf);
  uint64_t s = sf->size;
  pthread_mutex_unlock(&sf->lock);
  return s;
}

int ckpt__sfile_checksum_wait(ckpt_sfile_t *sf, uint64_t *out) {
  pthread_mutex_lock(&sf->lock);
  while (sf->pt_hashing)
    pthread_cond_wait(&sf->pt_hashed, &sf->lock);
  int rc = ckpt__sfile_checksum(sf, out);
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

int ckpt__sfile_checksum(ckpt_sfile_t *sf, uint64_t *out) {
  if (sf->hash_broken || sf->hashed != sf->size)
    return -EAGAIN;
  *out = sf->hash ? XXH3_64bits_digest(sf->hash) : XXH3_64bits(NULL, 0);
  return 0;
}

int ckpt__sfile_walk(ckpt_sfile_t *sf,
                     int (*fn)(void *arg, const void *p, size_t n,
                               ckpt_walk_piece_t kind),
                     void *arg) {
  uint8_t *bounce = NULL;
  uint64_t pos = 0;
  int rc = 0;
  if (sf->pt_fd >= 0) { /* frozen: sealed, its size read at the freeze */
    /* Its data read in steps (not mapped: the daemon's memory stays
     * bounded), its holes as holes. */
    for (uint64_t from, to; rc == 0 && pos < sf->size; pos = to) {
      rc = ckpt__data_extent(sf->pt_fd, pos, sf->size, &from, &to);
      if (rc == 0 && from > pos)
        rc = fn(arg, NULL, (size_t)(from - pos), CKPT_WALK_HOLE);
      for (uint64_t at = from; rc == 0 && at < to;) {
        if (!bounce && !(bounce = malloc(CKPT_SEG_SIZE)))
          return -ENOMEM;
        size_t n = to - at < CKPT_SEG_SIZE ? (size_t)(to - at) : CKPT_SEG_SIZE;
        ssize_t r = pread(sf->pt_fd, bounce, n, (off_t)at);
        if (r < 0 && errno == EINTR)
          continue;
        rc = r < 0 ? -errno : r == 0 ? -ESTALE : 0;
        if (rc == 0)
          rc = fn(arg, bounce, (size_t)r, CKPT_WALK_TRANSIENT);
        at += r > 0 ? (uint64_t)r : 0;
      }
    }
    free(bounce);
    return rc;
  }
  while (sf->stream >= 0 && pos < sf->size && rc == 0) {
    if (!bounce && !(bounce = malloc(CKPT_SEG_SIZE)))
      return -ENOMEM;
    size_t n = sf->size - pos < CKPT_SEG_SIZE ? (size_t)(sf->size - pos)
                                              : (size_t)CKPT_SEG_SIZE;
    rc = stream_read(sf, bounce, n, pos);
    if (rc == 0)
      rc = fn(arg, bounce, n, CKPT_WALK_TRANSIENT);
    pos += n;
  }
  while (pos < sf->size && rc == 0) {
    uint32_t i = (uint32_t)(pos >> CKPT_SEG_SHIFT);
    uint64_t in = pos & (CKPT_SEG_SIZE - 1);
    uint64_t chunk = sf->size - pos;
    if (chunk > CKPT_SEG_SIZE - in)
      chunk = CKPT_SEG_SIZE - in;
    uint64_t have = seg_have(sf, i);
    if (in >= have) { /* a hole, to the end of the segment */
      rc = fn(arg, NULL, (size_t)chunk, CKPT_WALK_HOLE);
      pos += chunk;
      continue;
    }
    uint64_t n = have - in < chunk ? have - in : chunk;
    if (sf->segs[i].mem) {
      rc = fn(arg, sf->segs[i].mem + in, (size_t)n, CKPT_WALK_KEPT);
    } else {
      if (!bounce && !(bounce = malloc(CKPT_SEG_SIZE)))
        return -ENOMEM;
      rc = seg_copy_out(sf, i, in, (size_t)n, bounce);
      if (rc == 0)
        rc = fn(arg, bounce, (size_t)n, CKPT_WALK_TRANSIENT);
    }
    pos += n;
  }
  free(bounce);
  return rc;
}

