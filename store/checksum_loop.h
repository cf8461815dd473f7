/*
 * checksum_loop.h - the XXH3-64 of a file range, read in VERIFY_READ
 * blocks (verify.c), and a file range added to an XXH3 state. Included by verify.c (libxxhash) and by xxh3_avx2.c
 * (xxhash inlined, built for AVX2): each gets its own copy, compiled for
 * its instruction set.
 */
#ifndef CKPT_CHECKSUM_LOOP_H
#define CKPT_CHECKSUM_LOOP_H

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define VERIFY_READ ((size_t)1 << 20)

/* Add bytes [off, off+len) of fd to st, read through buf (cap bytes) in
 * steps: 0, -ENODATA when the file ends first, -ECANCELED once *stop is
 * set (stop may be NULL), or -errno. */
static int update_loop(XXH3_state_t *st, int fd, uint64_t off, uint64_t len,
                       uint8_t *buf, size_t cap, const _Atomic bool *stop) {
  for (uint64_t done = 0; done < len;) {
    if (stop && atomic_load(stop))
      return -ECANCELED;
    size_t want = len - done < cap ? (size_t)(len - done) : cap;
    ssize_t r = pread(fd, buf, want, (off_t)(off + done));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -errno;
    if (r == 0)
      return -ENODATA;
    if (XXH3_64bits_update(st, buf, (size_t)r) != XXH_OK)
      return -EIO;
    done += (uint64_t)r;
  }
  return 0;
}

static int checksum_loop(int fd, uint64_t off, uint64_t len, uint64_t *out,
                         const _Atomic bool *stop) {
  XXH3_state_t *st = XXH3_createState();
  uint8_t *buf = malloc(VERIFY_READ);
  int rc = st && buf && XXH3_64bits_reset(st) == XXH_OK ? 0 : -ENOMEM;
  if (rc == 0)
    rc = update_loop(st, fd, off, len, buf, VERIFY_READ, stop);
  if (rc == 0)
    *out = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  free(buf);
  return rc;
}

#endif
