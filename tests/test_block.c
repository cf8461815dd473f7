/*
 * test_block.c - unit tests of block file names (planner/block.c) and of
 * the walk of a box's own bytes onto the global tensor
 * (ckpt_layout_local_pieces, planner/layout.c), which block file reads
 * use.
 *
 * The walk is checked against a brute-force reference that maps every byte
 * of the box's row-major contents to its global byte and merges what is
 * contiguous, over many random shapes, boxes and byte ranges; named cases
 * pin the column half of a 4096x2048 float32 tensor (one 4 KiB run per
 * row), 3-D interior blocks, empty blocks and the whole tensor.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt_planner.h"

/* ----- Names ----- */

static void split_ok(const char *name, const char *base, const char *sl) {
  const char *b = NULL, *s = NULL;
  size_t blen = 0;
  assert_int_equal(ckpt_block_name_split(name, &b, &blen, &s), 0);
  assert_int_equal(blen, strlen(base));
  assert_memory_equal(b, base, blen);
  assert_string_equal(s, sl);
}

static void test_split(void **state) {
  (void)state;
  split_ok(".w[0:2]", "w", "[0:2]");
  split_ok(".weight[:,1024:]", "weight", "[:,1024:]");
  split_ok(".a[b][1:2]", "a[b]", "[1:2]"); /* the last '[' starts slices */
  split_ok(".x[]", "x", "[]");             /* split; the parse refuses */
  const char *bad[] = {"w[0:2]", ".w", ".[1:2]", ".w[0:2", ".w]", "",
                       ".", "..", ".w0:2]"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    const char *b, *s;
    size_t blen;
    assert_int_equal(ckpt_block_name_split(bad[i], &b, &blen, &s), -EINVAL);
  }
}

static int parse(const char *s, int ndim, const int64_t *shape, int64_t *lo,
                 int64_t *sizes) {
  return ckpt_block_parse(s, strlen(s), ndim, shape, lo, sizes);
}

static void parse_ok(const char *s, int ndim, const int64_t *shape,
                     const int64_t *want_lo, const int64_t *want_sizes) {
  int64_t lo[8], sizes[8];
  memset(lo, 0xff, sizeof(lo));
  memset(sizes, 0xff, sizeof(sizes));
  assert_int_equal(parse(s, ndim, shape, lo, sizes), 0);
  for (int i = 0; i < ndim; i++) {
    assert_int_equal(lo[i], want_lo[i]);
    assert_int_equal(sizes[i], want_sizes[i]);
  }
}

static void test_parse(void **state) {
  (void)state;
  int64_t sh[] = {4096, 2048};
  parse_ok("[:,1024:]", 2, sh, (int64_t[]){0, 1024}, (int64_t[]){4096, 1024});
  parse_ok("[:,:1024]", 2, sh, (int64_t[]){0, 0}, (int64_t[]){4096, 1024});
  parse_ok("[1:3]", 2, sh, (int64_t[]){1, 0}, (int64_t[]){2, 2048});
  parse_ok("[:]", 2, sh, (int64_t[]){0, 0}, (int64_t[]){4096, 2048});
  parse_ok("[0:4096,0:2048]", 2, sh, (int64_t[]){0, 0},
           (int64_t[]){4096, 2048});
  parse_ok("[7:7,5:9]", 2, sh, (int64_t[]){7, 5}, (int64_t[]){0, 4});
  parse_ok("[4096:,2048:]", 2, sh, (int64_t[]){4096, 2048},
           (int64_t[]){0, 0});
  parse_ok("[007:010]", 2, sh, (int64_t[]){7, 0}, (int64_t[]){3, 2048});
  int64_t sh3[] = {10, 0, 6};
  parse_ok("[2:5,:,1:2]", 3, sh3, (int64_t[]){2, 0, 1},
           (int64_t[]){3, 0, 1});

  int64_t lo[4], sizes[4];
  /* Out of range. */
  assert_int_equal(parse("[5:4]", 2, sh, lo, sizes), -ERANGE);
  assert_int_equal(parse("[0:4097]", 2, sh, lo, sizes), -ERANGE);
  assert_int_equal(parse("[4097:]", 2, sh, lo, sizes), -ERANGE);
  assert_int_equal(parse("[:,2049]", 2, sh, lo, sizes), -EINVAL);
  assert_int_equal(parse("[:,:2049]", 2, sh, lo, sizes), -ERANGE);
  assert_int_equal(parse("[99999999999999999999999:]", 2, sh, lo, sizes),
                   -ERANGE);
  assert_int_equal(parse("[:99999999999999999999999]", 2, sh, lo, sizes),
                   -ERANGE);
  /* Malformed. */
  const char *bad[] = {"[]",      "[1]",     "[1:2,]",   "[1:2,3:4,5:6]",
                       "[ 1:2]",  "[1 :2]",  "[-1:2]",   "[1:2:3]",
                       "[1:2::]", "[,1:2]",  "[1:2,,]",  "[a:b]",
                       "[1:+2]",  "(1:2)",   "[1:2",     "1:2]",
                       "[1:2]x",  "[::]",    "[1:2][3:4]", "[0x1:2]"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
    assert_int_equal(parse(bad[i], 2, sh, lo, sizes), -EINVAL);
  /* A 0-d tensor has no blocks. */
  assert_int_equal(parse("[:]", 0, sh, lo, sizes), -EINVAL);
  assert_int_equal(parse("[]", 0, sh, lo, sizes), -EINVAL);
}

/* ----- The walk of a box's bytes ----- */

typedef struct {
  ckpt_piece_t *p;
  size_t n, cap;
} pieces_t;

static int collect(void *arg, const ckpt_piece_t *p) {
  pieces_t *ps = arg;
  if (ps->n == ps->cap) {
    ps->cap = ps->cap ? 2 * ps->cap : 16;
    ps->p = realloc(ps->p, ps->cap * sizeof(*ps->p));
    assert_non_null(ps->p);
  }
  ps->p[ps->n++] = *p;
  return 0;
}

/* Reference: every byte of [off, off+len) of the box's contents mapped to
 * its global byte, merged where both are contiguous. */
static void reference(int ndim, const int64_t *shape, const int64_t *lo,
                      const int64_t *sizes, size_t isz, uint64_t off,
                      uint64_t len, pieces_t *out) {
  uint64_t numel = 1;
  for (int j = 0; j < ndim; j++)
    numel *= (uint64_t)sizes[j];
  uint64_t total = numel * isz;
  for (uint64_t b = off; b < off + len && b < total; b++) {
    uint64_t e = b / isz, rem = e, g = 0, stride = 1;
    for (int j = ndim - 1; j >= 0; j--) {
      uint64_t i = rem % (uint64_t)sizes[j];
      rem /= (uint64_t)sizes[j];
      g += ((uint64_t)lo[j] + i) * stride;
      stride *= (uint64_t)shape[j];
    }
    uint64_t gb = g * isz + b % isz;
    if (out->n && out->p[out->n - 1].src + out->p[out->n - 1].len == b &&
        out->p[out->n - 1].dst + out->p[out->n - 1].len == gb) {
      out->p[out->n - 1].len++;
    } else {
      ckpt_piece_t p = {.src = b, .dst = gb, .len = 1};
      collect(out, &p);
    }
  }
}

static void check(int ndim, const int64_t *shape, const int64_t *lo,
                  const int64_t *sizes, size_t isz, uint64_t off,
                  uint64_t len) {
  pieces_t got = {0}, want = {0};
  assert_int_equal(ckpt_layout_local_pieces(ndim, shape, lo, sizes, isz, off,
                                            len, collect, &got),
                   0);
  reference(ndim, shape, lo, sizes, isz, off, len, &want);
  assert_int_equal(got.n, want.n);
  for (size_t i = 0; i < got.n; i++) {
    assert_int_equal(got.p[i].src, want.p[i].src);
    assert_int_equal(got.p[i].dst, want.p[i].dst);
    assert_int_equal(got.p[i].len, want.p[i].len);
  }
  free(got.p);
  free(want.p);
}

static void test_column_half(void **state) {
  (void)state;
  int64_t sh[] = {4096, 2048}, lo[] = {0, 1024}, sz[] = {4096, 1024};
  pieces_t got = {0};
  /* One 1 MiB read request: 256 rows, one 4 KiB run each. */
  assert_int_equal(ckpt_layout_local_pieces(2, sh, lo, sz, 4, 1 << 20,
                                            1 << 20, collect, &got),
                   0);
  assert_int_equal(got.n, 256);
  for (size_t i = 0; i < got.n; i++) {
    assert_int_equal(got.p[i].src, (1 << 20) + i * 4096);
    assert_int_equal(got.p[i].dst, (256 + i) * 8192 + 4096);
    assert_int_equal(got.p[i].len, 4096);
  }
  free(got.p);
  /* Unaligned: starts and ends inside rows. */
  check(2, (int64_t[]){64, 32}, (int64_t[]){0, 16}, (int64_t[]){64, 16}, 4,
        100, 1000);
  /* A row block is one run; the whole tensor one run. */
  got = (pieces_t){0};
  ckpt_layout_local_pieces(2, sh, (int64_t[]){10, 0}, (int64_t[]){20, 2048},
                           4, 0, UINT64_MAX, collect, &got);
  assert_int_equal(got.n, 1);
  assert_int_equal(got.p[0].dst, 10 * 8192);
  assert_int_equal(got.p[0].len, 20 * 8192);
  free(got.p);
}

static void test_named_shapes(void **state) {
  (void)state;
  /* 3-D interior block. */
  int64_t sh3[] = {6, 7, 5};
  check(3, sh3, (int64_t[]){1, 2, 1}, (int64_t[]){3, 4, 3}, 2, 0, 1000);
  check(3, sh3, (int64_t[]){1, 2, 0}, (int64_t[]){3, 4, 5}, 8, 13, 77);
  check(3, sh3, (int64_t[]){0, 0, 0}, (int64_t[]){6, 7, 5}, 1, 0, 210);
  /* 1-D. */
  check(1, (int64_t[]){100}, (int64_t[]){37}, (int64_t[]){50}, 4, 3, 150);
  /* Empty boxes and ranges: nothing. */
  check(2, (int64_t[]){8, 8}, (int64_t[]){3, 3}, (int64_t[]){0, 5}, 4, 0,
        100);
  check(2, (int64_t[]){8, 8}, (int64_t[]){3, 3}, (int64_t[]){2, 5}, 4, 40,
        100); /* starts at the end */
  check(2, (int64_t[]){8, 8}, (int64_t[]){3, 3}, (int64_t[]){2, 5}, 4, 10,
        0);
}

static void test_random(void **state) {
  (void)state;
  srand(12345);
  for (int iter = 0; iter < 3000; iter++) {
    int ndim = 1 + rand() % 4;
    int64_t shape[4], lo[4], sizes[4];
    uint64_t numel = 1;
    for (int j = 0; j < ndim; j++) {
      shape[j] = 1 + rand() % 7;
      lo[j] = rand() % (shape[j] + 1);
      sizes[j] = rand() % (shape[j] - lo[j] + 1);
      numel *= (uint64_t)sizes[j];
    }
    size_t isz = (size_t)1 << (rand() % 3);
    uint64_t total = numel * isz;
    uint64_t off = (uint64_t)rand() % (total + 3);
    uint64_t len = (uint64_t)rand() % (total + 5);
    check(ndim, shape, lo, sizes, isz, off, len);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_split),
      cmocka_unit_test(test_parse),
      cmocka_unit_test(test_column_half),
      cmocka_unit_test(test_named_shapes),
      cmocka_unit_test(test_random),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
