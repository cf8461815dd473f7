/*
 * checksum_loop.h - the XXH3-64 of a file range, read in VERIFY_READ
 * blocks (verify.c). Included by verify.c (libxxhash) and by xxh3_avx2.c
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

static int checksum_loop(int fd, uint64_t off, uint64_t len, uint64_t *out,
                         const _Atomic bool *stop) {
  XXH3_state_t *st = XXH3_createState();
  uint8_t *buf = malloc(VERIFY_READ);
  int rc = st && buf && XXH3_64bits_reset(st) == XXH_OK ? 0 : -ENOMEM;
  uint64_t done = 0;
  while (rc == 0 && done < len) {
    if (stop && atomic_load(stop)) {
      rc = -ECANCELED;
      break;
    }
    size_t want = len - done < VERIFY_READ ? (size_t)(len - done) : VERIFY_READ;
    ssize_t r = pread(fd, buf, want, (off_t)(off + done));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      rc = -errno;
    else if (r == 0)
      rc = -ENODATA;
    else if (XXH3_64bits_update(st, buf, (size_t)r) != XXH_OK)
      rc = -EIO;
    else
      done += (uint64_t)r;
  }
  if (rc == 0)
    *out = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  free(buf);
  return rc;
}

#endif
