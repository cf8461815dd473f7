/*
 * block_fuzzer.c - fuzz the block file name parser (a lookup name that a
 * user or a program picks: ".N[a0:b0,a1:b1,...]") and the pieces a read of
 * such a block is made of.
 *
 * Input: byte 0 picks ndim (1..4), bytes 1..ndim*2 the shape (small, so
 * that every block can be walked), the rest is the name. Whatever parses
 * must lie inside the shape, format back to slices that parse to the same
 * block, and a read of the whole block must enumerate exactly its bytes,
 * each global run inside the tensor, in increasing local order.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_planner.h"
#include "fuzz.h"

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

typedef struct {
  uint64_t next_src; /* local bytes seen so far */
  uint64_t total;    /* bytes of the whole tensor */
} walk_t;

static int piece(void *arg, const ckpt_piece_t *p) {
  walk_t *w = arg;
  CHECK(p->src == w->next_src);
  CHECK(p->len > 0 && p->dst + p->len <= w->total);
  w->next_src += p->len;
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  int ndim = 1 + data[0] % 4;
  if (size < 1 + (size_t)ndim * 2)
    return 0;
  int64_t shape[4], lo[4], sizes[4], lo2[4], sizes2[4];
  uint64_t numel = 1;
  for (int i = 0; i < ndim; i++) {
    shape[i] = (data[1 + 2 * i] | (data[2 + 2 * i] << 8)) % 64;
    numel *= (uint64_t)shape[i];
  }
  size_t off = 1 + (size_t)ndim * 2;
  char *name = malloc(size - off + 1);
  if (name == NULL)
    return 0;
  memcpy(name, data + off, size - off);
  name[size - off] = '\0';

  const char *base, *slices;
  size_t base_len;
  const char *s = name;
  size_t n = strlen(name);
  if (ckpt_block_name_split(name, &base, &base_len, &slices) == 0) {
    CHECK(base_len > 0 && base == name + 1 && slices[0] == '[');
    s = slices;
    n = strlen(slices);
  }
  int rc = ckpt_block_parse(s, n, ndim, shape, lo, sizes);
  CHECK(rc == 0 || rc == -EINVAL || rc == -ERANGE);
  if (rc == 0) {
    char text[4 * 2 * 22 + 8];
    size_t at = 0;
    text[at++] = '[';
    for (int i = 0; i < ndim; i++) {
      CHECK(lo[i] >= 0 && sizes[i] >= 0 && lo[i] + sizes[i] <= shape[i]);
      at += (size_t)snprintf(text + at, sizeof(text) - at, "%s%lld:%lld",
                             i ? "," : "", (long long)lo[i],
                             (long long)(lo[i] + sizes[i]));
    }
    text[at++] = ']';
    CHECK(ckpt_block_parse(text, at, ndim, shape, lo2, sizes2) == 0);
    CHECK(memcmp(lo, lo2, sizeof(lo[0]) * (size_t)ndim) == 0 &&
          memcmp(sizes, sizes2, sizeof(sizes[0]) * (size_t)ndim) == 0);
    uint64_t bn = 1;
    for (int i = 0; i < ndim; i++)
      bn *= (uint64_t)sizes[i];
    walk_t w = {0, numel * 4};
    if (bn > 0) {
      CHECK(ckpt_layout_local_pieces(ndim, shape, lo, sizes, 4, 0, bn * 4,
                                     piece, &w) == 0);
      CHECK(w.next_src == bn * 4);
    }
  }
  free(name);
  return 0;
}
