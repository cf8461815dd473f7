/*
 * known.c - chunks whose checksum this process computed from their data
 * file's own bytes (a commit: the passthrough files it publishes as data
 * files, hashed where the trainer wrote them), remembered with the data
 * file's identity at the end of the commit's write (device, inode, size,
 * mtime, ctime). A verified read (reader.c) that finds the file unchanged
 * takes such a chunk as checked: its bytes are the ones hashed. Any change
 * of the file since (a write, a truncate, a punched hole, a replacement)
 * moves its ctime, and the chunk is hashed again as before.
 *
 * A small direct-mapped table: a slot taken by another chunk only means
 * that chunk is hashed at its first read, as without the table.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "store.h"

#define KNOWN_SLOTS 16384u /* 1 MiB once the first chunk is added */

typedef struct {
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime, ctime;
  uint64_t pos, len, sum;
  bool used;
} known_t;

static pthread_mutex_t known_lock = PTHREAD_MUTEX_INITIALIZER;
static known_t *known; /* KNOWN_SLOTS, allocated at the first add */

static size_t slot_of(const struct stat *st, uint64_t pos, uint64_t len) {
  uint64_t key[4] = {(uint64_t)st->st_dev, (uint64_t)st->st_ino, pos, len};
  return (size_t)(XXH3_64bits(key, sizeof(key)) % KNOWN_SLOTS);
}

static bool same_file(const known_t *k, const struct stat *st) {
  return k->dev == st->st_dev && k->ino == st->st_ino &&
         k->size == st->st_size &&
         k->mtime.tv_sec == st->st_mtim.tv_sec &&
         k->mtime.tv_nsec == st->st_mtim.tv_nsec &&
         k->ctime.tv_sec == st->st_ctim.tv_sec &&
         k->ctime.tv_nsec == st->st_ctim.tv_nsec;
}

void ckpt_store_known_add(const struct stat *st, uint64_t pos, uint64_t len,
                          uint64_t sum) {
  pthread_mutex_lock(&known_lock);
  if (!known)
    known = calloc(KNOWN_SLOTS, sizeof(*known));
  if (known)
    known[slot_of(st, pos, len)] = (known_t){
        .dev = st->st_dev, .ino = st->st_ino, .size = st->st_size,
        .mtime = st->st_mtim, .ctime = st->st_ctim,
        .pos = pos, .len = len, .sum = sum, .used = true};
  pthread_mutex_unlock(&known_lock);
}

bool ckpt_store_known(int fd, uint64_t pos, uint64_t len, uint64_t sum) {
  struct stat st;
  if (fstat(fd, &st))
    return false;
  pthread_mutex_lock(&known_lock);
  const known_t *k = known ? &known[slot_of(&st, pos, len)] : NULL;
  bool yes = k && k->used && k->pos == pos && k->len == len &&
             k->sum == sum && same_file(k, &st);
  pthread_mutex_unlock(&known_lock);
  return yes;
}

void ckpt_store_known_forget(void) {
  pthread_mutex_lock(&known_lock);
  if (known)
    memset(known, 0, KNOWN_SLOTS * sizeof(*known));
  pthread_mutex_unlock(&known_lock);
}
