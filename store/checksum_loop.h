/*
 * checksum_loop.h - the XXH3-64 of a file range, read in VERIFY_READ
 * blocks (verify.c), and a file range added to an XXH3 state, from
 * mappings of the file. Included by verify.c (libxxhash) and by
 * xxh3_avx2.c (xxhash inlined, built for AVX2): each gets its own copy,
 * compiled for its instruction set. Needs store_int.h (bus_guard.c).
 */
#ifndef CKPT_CHECKSUM_LOOP_H
#define CKPT_CHECKSUM_LOOP_H

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <setjmp.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define VERIFY_READ ((size_t)1 << 20)
#define HASH_WINDOW ((size_t)4 << 20) /* mapped at a time */

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

/* Add bytes [off, off+len) of fd to st from mappings of the file,
 * HASH_WINDOW bytes at a time: the bytes are hashed where the page cache
 * holds them. A pread copies each byte once more and marks each page
 * accessed (an LRU move under a lock): in a GPT save on tmpfs the drain's
 * copy took 3x the hash's own time, and the mapping took the drain from
 * 54% to 50% of the daemon's CPU. Not MAP_POPULATE: it marks each page
 * accessed, which the hash's own touches should not do (checkpoint data
 * is not promoted on the LRU by being checked). 0; -ENODATA when the file
 * ends first or shrank meanwhile (a fault past its new end is caught:
 * bus_guard.c; an end inside a page reads zeros, so the size is checked
 * again after the hash); -EIO for a fault with the file still long enough
 * (an I/O error); 1 when fd cannot be mapped from *done on (bytes
 * [off, off+*done) are in st: read the rest instead). */
static int update_mapped(XXH3_state_t *st, int fd, uint64_t off,
                         uint64_t len, uint64_t *done) {
  *done = 0;
  if (len == 0)
    return 0;
  /* A range past the end: read, which ends in -ENODATA (a mapping would
   * read the last page's zeros). */
  struct stat fst;
  if (atomic_load(&ckpt__hash_reads_only) || !ckpt__bus_guard_ready() ||
      fstat(fd, &fst) != 0 || off + len > (uint64_t)fst.st_size)
    return 1;
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  while (*done < len) {
    uint64_t pos = off + *done, base = pos - pos % page;
    size_t want = len - *done < HASH_WINDOW ? (size_t)(len - *done) : HASH_WINDOW;
    size_t skip = (size_t)(pos - base), mlen = skip + want;
    const uint8_t *m = mmap(NULL, mlen, PROT_READ, MAP_SHARED,
                            fd, (off_t)base);
    if (m == MAP_FAILED)
      return 1;
    /* VM_SEQ_READ: the unmap then does not mark each page accessed (an
     * LRU move under a lock per page: 6% of the daemon's CPU) */
    (void)madvise((void *)m, mlen, MADV_SEQUENTIAL);
    if (ckpt__hash_mapped_hook)
      ckpt__hash_mapped_hook(fd, pos);
    sigjmp_buf jb;
    if (sigsetjmp(jb, 1)) { /* a fault: past the file's end, or an error */
      munmap((void *)m, mlen);
      return fstat(fd, &fst) == 0 && (uint64_t)fst.st_size >= pos + want
                 ? -EIO
                 : -ENODATA;
    }
    ckpt__bus_guard_arm(&jb, m, mlen);
    XXH_errorcode e = XXH3_64bits_update(st, m + skip, want);
    ckpt__bus_guard_disarm();
    munmap((void *)m, mlen);
    if (e != XXH_OK)
      return -EIO;
    *done += want;
    atomic_fetch_add(&ckpt__hash_mapped_bytes, want);
  }
  /* shrunk to inside a page meanwhile: its bytes past the end read as 0 */
  if (fstat(fd, &fst) != 0)
    return -errno;
  return (uint64_t)fst.st_size < off + len ? -ENODATA : 0;
}

/* update_mapped, else (a file that cannot be mapped) update_loop. */
static int update_from(XXH3_state_t *st, int fd, uint64_t off, uint64_t len,
                       uint8_t *buf, size_t cap) {
  uint64_t done;
  int rc = update_mapped(st, fd, off, len, &done);
  return rc == 1 ? update_loop(st, fd, off + done, len - done, buf, cap, NULL)
                 : rc;
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
