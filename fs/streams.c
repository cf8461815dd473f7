/*
 * streams.c - write-behind of staged files into their future data files.
 *
 * Each checkpoint staged on this rank has io_threads streams, files
 * BACKING_DIR/.staging/NAME.R.K. A staged file whose first write is at
 * offset 0 claims a free stream and is appended there as it is written
 * (staging.c); closing its last write handle releases the stream for the
 * next file, which starts at the next 4 KiB boundary. A file written out
 * of order leaves its stream (its bytes are copied back into segments).
 *
 * At commit, the used streams are hard-linked as BACKING_DIR/NAME/
 * __R_K.distcp and every streamed file is pinned in the plan where it is,
 * so its bytes are written to disk once, while the trainer was still
 * writing. A failed commit removes only the links: the staged data stays
 * in .staging for the retry. A committed checkpoint drops the .staging
 * names; a discarded one removes the files.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fs_int.h"

#define STREAM_ALIGN 4096u
#define SPILL_DIR ".staging"

static void stream_path(const ckpt_streams_t *st, uint32_t k, char *buf,
                        size_t cap) {
  snprintf(buf, cap, "%s/%s.%d.%llu.%u", SPILL_DIR, st->name, st->rank,
           (unsigned long long)st->serial, k);
}

ckpt_streams_t *ckpt__streams_new(int backing_fd, int rank, const char *name,
                                  uint32_t n) {
  static _Atomic uint64_t serials;
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
  st->serial = atomic_fetch_add(&serials, 1);
  snprintf(st->name, sizeof(st->name), "%s", name);
  st->n = n;
  for (uint32_t k = 0; k < n; k++)
    st->s[k].fd = -1;
  return st;
}

void ckpt__streams_free(ckpt_streams_t *st) {
  if (!st)
    return;
  for (uint32_t k = 0; k < st->n; k++) {
    if (st->s[k].fd < 0)
      continue;
    close(st->s[k].fd);
    char path[300];
    stream_path(st, k, path, sizeof(path));
    unlinkat(st->backing_fd, path, 0);
  }
  unlinkat(st->backing_fd, SPILL_DIR, AT_REMOVEDIR); /* if now empty */
  pthread_mutex_destroy(&st->lock);
  free(st->s);
  free(st);
}

void ckpt__streams_unlink(ckpt_streams_t *st) {
  pthread_mutex_lock(&st->lock);
  st->frozen = true;
  st->committed = true;
  for (uint32_t k = 0; k < st->n; k++) {
    if (st->s[k].fd < 0)
      continue;
    char path[300];
    stream_path(st, k, path, sizeof(path));
    unlinkat(st->backing_fd, path, 0);
  }
  unlinkat(st->backing_fd, SPILL_DIR, AT_REMOVEDIR); /* if now empty */
  pthread_mutex_unlock(&st->lock);
}

void ckpt__streams_freeze(ckpt_streams_t *st, bool frozen) {
  pthread_mutex_lock(&st->lock);
  st->frozen = frozen;
  pthread_mutex_unlock(&st->lock);
}

static uint64_t align_up(uint64_t v) {
  return (v + STREAM_ALIGN - 1) / STREAM_ALIGN * STREAM_ALIGN;
}

uint64_t ckpt__streams_used(ckpt_streams_t *st, uint32_t k) {
  pthread_mutex_lock(&st->lock);
  uint64_t used = 0;
  if (k < st->n && st->s[k].fd >= 0) {
    used = st->s[k].end;
    const ckpt_sfile_t *o = st->s[k].owner;
    if (o && o->stream_base + o->size > used)
      used = o->stream_base + o->size;
  }
  pthread_mutex_unlock(&st->lock);
  return used;
}

int ckpt__streams_link(ckpt_streams_t *st, int dirfd, char **err) {
  int rc = 0;
  uint32_t k;
  for (k = 0; k < st->n && rc == 0; k++) {
    if (ckpt__streams_used(st, k) == 0)
      continue;
    char from[300], to[64];
    stream_path(st, k, from, sizeof(from));
    ckpt_data_file_name(st->rank, k, to, sizeof(to));
    unlinkat(dirfd, to, 0);
    if (linkat(st->backing_fd, from, dirfd, to, 0)) {
      rc = -errno;
      *err = ckpt__strdup_printf("rank %d: linking %s as %s: %s", st->rank,
                                 from, to, strerror(errno));
    }
  }
  if (rc) /* undo: the staged data stays in .staging */
    for (uint32_t j = 0; j + 1 < k; j++)
      if (ckpt__streams_used(st, j) > 0) {
        char to[64];
        ckpt_data_file_name(st->rank, j, to, sizeof(to));
        unlinkat(dirfd, to, 0);
      }
  return rc;
}

int ckpt__stream_claim(ckpt_streams_t *st, ckpt_sfile_t *sf) {
  pthread_mutex_lock(&st->lock);
  int rc = -EAGAIN;
  for (uint32_t k = 0; k < st->n && !st->frozen; k++) {
    if (st->s[k].owner)
      continue;
    if (st->s[k].fd < 0) {
      char path[300];
      stream_path(st, k, path, sizeof(path));
      if (mkdirat(st->backing_fd, SPILL_DIR, 0700) && errno != EEXIST)
        break;
      int fd = openat(st->backing_fd, path,
                      O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0)
        break;
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
  if (sf->stream < 0)
    return;
  ckpt__stream_release(sf);
  ckpt_streams_t *st = sf->streams;
  pthread_mutex_lock(&st->lock);
  /* Give the space back, unless the stream file is a committed data file
   * now (its bytes are the checkpoint's). */
  if (!st->committed && sf->size > 0)
    fallocate(st->s[sf->stream].fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
              (off_t)sf->stream_base, (off_t)sf->size);
  pthread_mutex_unlock(&st->lock);
  sf->stream = -1;
}

int ckpt__stream_fd(const ckpt_sfile_t *sf) {
  return sf->streams->s[sf->stream].fd;
}
