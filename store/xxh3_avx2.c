/*
 * xxh3_avx2.c - the checksum loop with XXH3 inlined and built for AVX2
 * (CMakeLists.txt: -mavx2 for this file on x86-64). Debian's libxxhash is
 * built for SSE2 only: on an AVX2 CPU this hashes at ~1.5x its speed
 * (27-31 against 18-20 GB/s on the AMD EPYC VM of docs/benchmark.md).
 * verify.c calls it only when the CPU has AVX2.
 */
#include "store.h"

#ifdef CKPT_XXH3_AVX2
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "store_int.h"
#include "checksum_loop.h"

int ckpt__stored_checksum_avx2(int fd, uint64_t off, uint64_t len,
                               uint64_t *out, const _Atomic bool *stop);
int ckpt__stored_checksum_avx2(int fd, uint64_t off, uint64_t len,
                               uint64_t *out, const _Atomic bool *stop) {
  return checksum_loop(fd, off, len, out, stop);
}

/* state: libxxhash's XXH3_state_t, the same struct as the inlined one
 * (one xxhash.h) */
int ckpt__hash_fd_avx2(void *state, int fd, uint64_t off, uint64_t len,
                       void *buf, size_t cap);
int ckpt__hash_fd_avx2(void *state, int fd, uint64_t off, uint64_t len,
                       void *buf, size_t cap) {
  return update_from(state, fd, off, len, buf, cap);
}
#else
typedef int ckpt_no_avx2_t; /* not an empty translation unit */
#endif
