/*
 * streams.c - write-behind of staged files into their future data files.
 *
 * Each checkpoint staged on this rank has io_threads streams: unnamed
 * files (O_TMPFILE) in BACKING_DIR/.staging. A staged file whose first
 * write is at offset 0 claims a free stream and is appended there as it is
 * written (staging.c); closing it releases the stream for the next file,
 * which starts at the next 4 KiB boundary. A file written out of order
 * leaves its stream (its bytes are copied back into segments).
 *
 * At commit, the used streams are linked as BACKING_DIR/NAME/__R_K.distcp
 * (linkat through /proc/self/fd) and every streamed file is pinned in the
 * plan where it is, so its bytes are written to disk once, while the
 * trainer was still writing. A failed commit moves the links aside, to
 * BACKING_DIR/.staging/.keep-ID-K (ID: 128 random bits of these streams,
 * so that no other daemon, on any node or in any PID namespace, picks the
 * same name): the staged data stays in the open streams, and the retry
 * moves them back. (A stream once linked cannot be linked again after its
 * last name is gone, and copying it would need its size in free space a
 * second time: after ENOSPC, that is what is missing.)
 *
 * Every stream is held with a shared flock for as long as it is open, so
 * that a starting mount's cleanup of .staging, which removes only the
 * files it can lock exclusively, leaves a live mount's kept links alone
 * and removes those of a daemon that is gone (a crash leaves nothing else
 * behind: the streams are unnamed until then). .staging is always opened
 * beneath BACKING_DIR without following a symlink (ckpt__staging_dir).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "stage.h"

#define STREAM_ALIGN 4096u

/* 128 bits for the keep names: from getrandom, else (no entropy yet, a
 * kernel before 3.17) the time, the pid and an address, which still
 * differ between the daemons of one node. */
static void new_id(char out[33]) {
  uint64_t r[2] = {0, 0};
  ssize_t got;
  do
    got = getrandom(r, sizeof(r), GRND_NONBLOCK);
  while (got < 0 && errno == EINTR);
  if (got != (ssize_t)sizeof(r)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r[0] ^= (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    r[1] ^= ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)out;
  }
  snprintf(out, 33, "%016llx%016llx", (unsigned long long)r[0],
           (unsigned long long)r[1]);
}

ckpt_streams_t *ckpt__streams_new(int backing_fd, int rank, const char *name,
                                  uint32_t n) {
  ckpt_streams_t *st = calloc(1, sizeof(*st));
  if (!st)
    return NULL;
  st->s = calloc(n, sizeof(*st->s));
  if (!st->s) {
    free(st);
    return NULL;
  }
  pthread_mutex_init(&st->lock, NULL);
  st->backing_fd = backing_fd;
  st->rank = rank;
  snprintf(st->name, sizeof(st->name), "%s", name);
  new_id(st->id);
  st->n = st->nio = st->cap = n;
  for (uint32_t k = 0; k < n; k++)
    st->s[k].fd = -1;
  return st;
}

/* The name in .staging stream k is kept under after a failed commit. */
static void keep_name(const ckpt_streams_t *st, uint32_t k, char *buf,
                      size_t cap) {
  snprintf(buf, cap, ".keep-%s-%u", st->id, k);
}

/* BACKING_DIR/.staging as it is (O_PATH), or -1. */
static int staging_fd(const ckpt_streams_t *st) {
  int fd = ckpt_open_beneath(st->backing_fd, CKPT_STAGING_DIR,
                             O_PATH | O_DIRECTORY, 0);
  return fd >= 0 ? fd : -1;
}

/* Is dirfd/name the file of descriptor fd? */
static bool same_file(int dirfd, const char *name, int fd) {
  struct stat a, b;
  return fstatat(dirfd, name, &a, AT_SYMLINK_NOFOLLOW) == 0 &&
         fstat(fd, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

void ckpt__streams_drop_kept(ckpt_streams_t *st) {
  if (!st)
    return;
  pthread_mutex_lock(&st->lock);
  int sfd = -1;
  for (uint32_t k = 0; k < st->n; k++) {
    if (st->s[k].kept) {
      char kept[128];
      keep_name(st, k, kept, sizeof(kept));
      if (sfd < 0)
        sfd = staging_fd(st);
      if (sfd >= 0 && same_file(sfd, kept, st->s[k].fd))
        unlinkat(sfd, kept, 0);
      st->s[k].kept = false;
    }
  }
  if (sfd >= 0)
    close(sfd);
  pthread_mutex_unlock(&st->lock);
}

void ckpt__streams_free(ckpt_streams_t *st) {
  if (!st)
    return;
  ckpt__streams_drop_kept(st);
  for (uint32_t k = 0; k < st->n; k++)
    if (st->s[k].fd >= 0)
      close(st->s[k].fd);
  ckpt__staging_tidy(st->backing_fd);
  pthread_mutex_destroy(&st->lock);
  free(st->s);
  free(st);
}

void ckpt__streams_committed(ckpt_streams_t *st) {
  pthread_mutex_lock(&st->lock);
  st->frozen = true;
  atomic_store(&st->committed, true);
  /* A passthrough file's own stream is its data file now, read through
   * the store: its descriptor goes (a staged checkpoint stays in memory
   * while the kernel remembers its inodes: thousands of large files
   * would hold thousands of descriptors). */
  for (uint32_t k = st->nio; k < st->n; k++)
    if (st->s[k].own && st->s[k].fd >= 0) {
      close(st->s[k].fd);
      st->s[k].fd = -1;
    }
  pthread_mutex_unlock(&st->lock);
}

void ckpt__streams_freeze(ckpt_streams_t *st, bool frozen, int rank) {
  pthread_mutex_lock(&st->lock);
  st->frozen = frozen;
  if (frozen) /* read by link and unlink, on the dist thread, after this */
    st->rank = rank;
  pthread_mutex_unlock(&st->lock);
}

static uint64_t align_up(uint64_t v) {
  return (v + STREAM_ALIGN - 1) / STREAM_ALIGN * STREAM_ALIGN;
}

/* Copy [from, to) of in to out at base + from: the kernel's copy where it
 * can (copy_file_range: a memfd to a tmpfs stream), else through a buffer
 * (another filesystem: EXDEV). A short read gives -ESTALE. */
static int copy_extent(int in, int out, uint64_t base, uint64_t from,
                       uint64_t to) {
  loff_t pos = (loff_t)from, at = (loff_t)(base + from);
  while ((uint64_t)pos < to) {
    ssize_t w = copy_file_range(in, &pos, out, &at,
                                (size_t)(to - (uint64_t)pos), 0);
    if (w < 0 && errno == EINTR)
      continue;
    if (w == 0)
      return -ESTALE;
    if (w < 0 && (errno == EXDEV || errno == EINVAL || errno == ENOSYS ||
                  errno == EOPNOTSUPP))
      break;
    if (w < 0)
      return -errno;
  }
  size_t cap = (size_t)1 << 20;
  char *buf = (uint64_t)pos < to ? malloc(cap) : NULL;
  if ((uint64_t)pos < to && !buf)
    return -ENOMEM;
  int rc = 0;
  while (rc == 0 && (uint64_t)pos < to) {
    size_t want = to - (uint64_t)pos < cap ? (size_t)(to - (uint64_t)pos) : cap;
    ssize_t r = pread(in, buf, want, pos);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      rc = r < 0 ? -errno : -ESTALE;
      break;
    }
    for (ssize_t done = 0; rc == 0 && done < r;) {
      ssize_t w = pwrite(out, buf + done, (size_t)(r - done),
                         (off_t)(base + (uint64_t)pos + (uint64_t)done));
      if (w < 0 && errno == EINTR)
        continue;
      if (w <= 0)
        rc = w < 0 ? -errno : -EIO;
      else
        done += w;
    }
    pos += r;
  }
  free(buf);
  return rc;
}

/* Copy [0, size) of in to out at base, data extents only: the holes of a
 * sparse file stay holes (out's range must read as zeros already: a new
 * file, or a range punched). In shorter than size gives -ESTALE. */
int ckpt__copy_range(int in, int out, uint64_t base, uint64_t size) {
  uint64_t pos = 0, from, to;
  while (pos < size) {
    int rc = ckpt__data_extent(in, pos, size, &from, &to);
    if (rc == 0 && from < size)
      rc = copy_extent(in, out, base, from, to);
    if (rc)
      return rc;
    pos = to;
  }
  return 0;
}

/* Copy the first len bytes of stream fd into a new file dirfd/to. */
static int copy_stream(int fd, uint64_t len, int dirfd, const char *to) {
  int out = ckpt_open_beneath(dirfd, to, O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (out < 0)
    return out;
  int rc = ckpt__copy_range(fd, out, 0, len);
  if (close(out) && rc == 0)
    rc = -errno;
  if (rc)
    unlinkat(dirfd, to, 0);
  return rc;
}

int ckpt__streams_link(ckpt_streams_t *st, const uint64_t *used, int dirfd,
                       char **err) {
  int rc = 0, sfd = -1;
  uint32_t k;
  for (k = 0; k < st->n && rc == 0; k++) {
    if (used[k] == 0)
      continue;
    char from[64], to[64], kept[128];
    snprintf(from, sizeof(from), "/proc/self/fd/%d", st->s[k].fd);
    ckpt_data_file_name(st->rank, k, to, sizeof(to));
    unlinkat(dirfd, to, 0);
    /* Kept aside by a failed commit: moved back, not copied. */
    keep_name(st, k, kept, sizeof(kept));
    if (st->s[k].kept && sfd < 0)
      sfd = staging_fd(st);
    if (st->s[k].kept && sfd >= 0 && same_file(sfd, kept, st->s[k].fd) &&
        renameat(sfd, kept, dirfd, to) == 0) {
      st->s[k].kept = false;
      continue;
    }
    st->s[k].kept = false;
    if (linkat(AT_FDCWD, from, dirfd, to, AT_SYMLINK_FOLLOW) == 0)
      continue;
    /* An unnamed file can be linked once only: when its kept name was
     * lost (another mount's cleanup), the retry copies the stream. */
    if (errno == ENOENT)
      rc = copy_stream(st->s[k].fd, used[k], dirfd, to);
    else
      rc = -errno;
    if (rc)
      *err = ckpt__strdup_printf("rank %d: storing the write-behind stream "
                                 "%u as %s: %s", st->rank, k, to,
                                 strerror(-rc));
  }
  if (sfd >= 0)
    close(sfd);
  if (rc) /* undo: the staged data stays in the streams */
    ckpt__streams_unlink(st, dirfd);
  return rc;
}

void ckpt__streams_unlink(ckpt_streams_t *st, int dirfd) {
  int sfd = -1;
  for (uint32_t k = 0; k < st->n; k++) {
    if (st->s[k].fd < 0)
      continue;
    char to[64], kept[128];
    ckpt_data_file_name(st->rank, k, to, sizeof(to));
    if (!same_file(dirfd, to, st->s[k].fd))
      continue; /* not linked (or someone else's file): not ours */
    keep_name(st, k, kept, sizeof(kept));
    if (sfd < 0)
      sfd = ckpt__staging_dir(st->backing_fd);
    if (sfd >= 0 && renameat(dirfd, to, sfd, kept) == 0)
      st->s[k].kept = true;
    else
      unlinkat(dirfd, to, 0);
  }
  if (sfd >= 0)
    close(sfd);
}

int ckpt__stream_claim(ckpt_streams_t *st, ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  pthread_mutex_lock(&st->lock);
  int rc = -EAGAIN;
  for (uint32_t k = 0; k < st->nio && !st->frozen; k++) {
    if (st->s[k].owner)
      continue;
    if (st->s[k].fd < 0) {
      int fd = ckpt__staging_tmpfile(st->backing_fd);
      if (fd < 0)
        break;
      /* Held while open: the cleanup of a starting mount leaves its keep
       * name alone (where flock works; elsewhere it cannot lock it
       * either, and leaves every kept link). */
      flock(fd, LOCK_SH);
      st->s[k].fd = fd;
    }
    st->s[k].owner = sf;
    sf->stream = (int32_t)k;
    sf->stream_base = align_up(st->s[k].end);
    sf->stream_owner = true;
    rc = 0;
    break;
  }
  pthread_mutex_unlock(&st->lock);
  return rc;
}

void ckpt__stream_release(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  if (sf->stream < 0 || !sf->stream_owner)
    return;
  ckpt_streams_t *st = sf->streams;
  pthread_mutex_lock(&st->lock);
  struct ckpt_stream *s = &st->s[sf->stream];
  if (s->owner == sf) {
    if (sf->stream_base + sf->size > s->end)
      s->end = sf->stream_base + sf->size;
    s->owner = NULL;
  }
  pthread_mutex_unlock(&st->lock);
  sf->stream_owner = false;
}

void ckpt__stream_drop(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  if (sf->stream < 0)
    return;
  ckpt__stream_release(sf);
  ckpt_streams_t *st = sf->streams;
  pthread_mutex_lock(&st->lock);
  struct ckpt_stream *k = &st->s[sf->stream];
  if (k->own && !atomic_load(&st->committed)) {
    /* a passthrough file's own file (held read-only: no punch): its link
     * kept by a failed commit and its descriptor go, and its space with
     * the file's own descriptor */
    if (k->kept) {
      char kept[128];
      keep_name(st, (uint32_t)sf->stream, kept, sizeof(kept));
      int sfd = staging_fd(st);
      if (sfd >= 0 && k->fd >= 0 && same_file(sfd, kept, k->fd))
        unlinkat(sfd, kept, 0);
      if (sfd >= 0)
        close(sfd);
      k->kept = false;
    }
    if (k->fd >= 0)
      close(k->fd);
    k->fd = -1;
  } else if (!atomic_load(&st->committed) && sf->size > 0) {
    /* Give the space back, unless the stream file is a committed data
     * file now (its bytes are the checkpoint's). */
    fallocate(k->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
              (off_t)sf->stream_base, (off_t)sf->size);
  }
  pthread_mutex_unlock(&st->lock);
  sf->stream = -1;
}

void ckpt__stream_abandon(ckpt_sfile_t *sf, uint64_t len) {
  CKPT_HELD(&sf->lock);
  if (sf->stream < 0)
    return;
  ckpt_streams_t *st = sf->streams;
  pthread_mutex_lock(&st->lock);
  struct ckpt_stream *s = &st->s[sf->stream];
  if (s->owner == sf)
    s->owner = NULL; /* s->end stays: the next file writes over it */
  if (!atomic_load(&st->committed) && len > 0)
    fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
              (off_t)sf->stream_base, (off_t)len);
  pthread_mutex_unlock(&st->lock);
  sf->stream = -1;
  sf->stream_owner = false;
}

int ckpt__stream_fd(const ckpt_sfile_t *sf) {
  /* under the lock: a commit beginning may grow s (ckpt__stream_own) */
  ckpt_streams_t *st = sf->streams;
  pthread_mutex_lock(&st->lock);
  int fd = st->s[sf->stream].fd;
  pthread_mutex_unlock(&st->lock);
  return fd;
}

int ckpt__stream_own(ckpt_streams_t *st, ckpt_sfile_t *sf, int fd) {
  CKPT_HELD(&sf->lock);
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0)
    return -errno;
  pthread_mutex_lock(&st->lock);
  if (st->n == st->cap) {
    uint32_t cap = st->cap * 2 > st->n + 16 ? st->cap * 2 : st->n + 16;
    struct ckpt_stream *s = cap < CKPT_MAX_PIN_FILE
                                ? realloc(st->s, cap * sizeof(*s))
                                : NULL;
    if (!s) {
      pthread_mutex_unlock(&st->lock);
      close(own);
      return -ENOMEM;
    }
    st->s = s;
    st->cap = cap;
  }
  uint32_t k = st->n++;
  /* held like every stream (the cleanup of a starting mount leaves its
   * keep name alone) */
  flock(own, LOCK_SH);
  st->s[k] = (struct ckpt_stream){.fd = own, .own = true};
  sf->stream = (int32_t)k;
  sf->stream_base = 0;
  sf->stream_owner = false;
  pthread_mutex_unlock(&st->lock);
  return 0;
}
