/*
 * verify.c - checksums of stored bytes, for the mount's verification
 * (reader.c) and the offline checker ckptfs-fsck (tools/fsck.c).
 */
#include <xxhash.h>

#include "store_int.h"
#include "checksum_loop.h"
#include "store.h"

#ifdef CKPT_XXH3_AVX2
int ckpt__stored_checksum_avx2(int fd, uint64_t off, uint64_t len,
                               uint64_t *out, const _Atomic bool *stop);
int ckpt__hash_fd_avx2(void *state, int fd, uint64_t off, uint64_t len,
                       void *buf, size_t cap);
#endif

int ckpt__hash_fd(XXH3_state_t *st, int fd, uint64_t off, uint64_t len,
                  void *buf, size_t cap) {
#ifdef CKPT_XXH3_AVX2
  /* st is libxxhash's: the inlined build shares its struct only when the
   * library is the version of the header both were compiled with */
  if (__builtin_cpu_supports("avx2") &&
      XXH_versionNumber() == XXH_VERSION_NUMBER)
    return ckpt__hash_fd_avx2(st, fd, off, len, buf, cap);
#endif
  return update_from(st, fd, off, len, buf, cap);
}

int ckpt__stored_checksum_stop(int fd, uint64_t off, uint64_t len,
                               uint64_t *out, const _Atomic bool *stop) {
#ifdef CKPT_XXH3_AVX2
  if (__builtin_cpu_supports("avx2"))
    return ckpt__stored_checksum_avx2(fd, off, len, out, stop);
#endif
  return checksum_loop(fd, off, len, out, stop);
}

int ckpt__stored_checksum(int fd, uint64_t off, uint64_t len, uint64_t *out) {
  return ckpt__stored_checksum_stop(fd, off, len, out, NULL);
}
