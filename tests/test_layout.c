/*
 * test_layout.c - unit tests of planner/layout.c (chunk geometry).
 *
 * ckpt_layout_pieces is checked against a brute-force reference that maps
 * every element of the chunk to its global position, clips each element's
 * bytes to the range and merges what is contiguous, over many random
 * shapes, chunks and byte-granular ranges; named cases pin the shapes that
 * matter (row and column shards, 3-D blocks, 0-d, empty chunks) and the
 * complexity bound.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt_planner.h"

/* ----- Collecting pieces ----- */

typedef struct {
  ckpt_piece_t *p;
  size_t n, cap;
  size_t stop_after; /* cb returns stop_rc after this many pieces (0: never) */
  int stop_rc;
} pieces_t;

static int collect(void *arg, const ckpt_piece_t *p) {
  pieces_t *ps = arg;
  if (ps->n == ps->cap) {
    ps->cap = ps->cap ? 2 * ps->cap : 16;
    ps->p = realloc(ps->p, ps->cap * sizeof(*ps->p));
    assert_non_null(ps->p);
  }
  ps->p[ps->n++] = *p;
  if (ps->stop_after && ps->n == ps->stop_after)
    return ps->stop_rc;
  return 0;
}

/* Append a piece, merging it into the previous one when contiguous in both
 * src and dst. */
static void push_merged(pieces_t *ps, uint64_t src, uint64_t dst,
                        uint64_t len) {
  if (ps->n > 0) {
    ckpt_piece_t *last = &ps->p[ps->n - 1];
    if (last->src + last->len == src && last->dst + last->len == dst) {
      last->len += len;
      return;
    }
  }
  ckpt_piece_t p = {.src = src, .dst = dst, .len = len};
  collect(ps, &p);
}

/* The reference: element by element, in the chunk's row-major order (which
 * is increasing global order). */
static void reference(int ndim, const int64_t *shape, const int64_t *offs,
                      const int64_t *sizes, size_t isz, uint64_t off,
                      uint64_t len, pieces_t *out) {
  uint64_t n = 1;
  for (int j = 0; j < ndim; j++)
    n *= (uint64_t)sizes[j];
  uint64_t end = off + len;
  for (uint64_t e = 0; e < n; e++) {
    uint64_t rem = e, g = 0, stride = 1;
    for (int j = ndim - 1; j >= 0; j--) {
      uint64_t i = rem % (uint64_t)sizes[j];
      rem /= (uint64_t)sizes[j];
      g += ((uint64_t)offs[j] + i) * stride;
      stride *= (uint64_t)shape[j];
    }
    uint64_t a = g * isz, b = a + isz;
    if (a < off)
      a = off;
    if (b > end)
      b = end;
    if (a < b)
      push_merged(out, e * isz + (a - g * isz), a, b - a);
  }
}

static void run(int ndim, const int64_t *shape, const int64_t *offs,
                const int64_t *sizes, size_t isz, uint64_t off, uint64_t len,
                pieces_t *out) {
  out->n = 0;
  assert_int_equal(
      ckpt_layout_pieces(ndim, shape, offs, sizes, isz, off, len, collect, out),
      0);
}

static void check_against_reference(int ndim, const int64_t *shape,
                                    const int64_t *offs, const int64_t *sizes,
                                    size_t isz, uint64_t off, uint64_t len) {
  pieces_t got = {0}, want = {0};
  run(ndim, shape, offs, sizes, isz, off, len, &got);
  reference(ndim, shape, offs, sizes, isz, off, len, &want);
  assert_int_equal(got.n, want.n);
  for (size_t i = 0; i < got.n; i++) {
    assert_int_equal(got.p[i].src, want.p[i].src);
    assert_int_equal(got.p[i].dst, want.p[i].dst);
    assert_int_equal(got.p[i].len, want.p[i].len);
  }

  /* ckpt_layout_span: the chunk bytes from the first piece to the last;
   * ckpt_layout_copy: each piece's bytes from there, nothing else. */
  uint64_t lo = 7, hi = 7;
  ckpt_layout_span(ndim, shape, offs, sizes, isz, off, len, &lo, &hi);
  if (want.n == 0) {
    assert_int_equal(lo, hi);
  } else {
    assert_int_equal(lo, want.p[0].src);
    assert_int_equal(hi, want.p[want.n - 1].src + want.p[want.n - 1].len);
    uint8_t *src = malloc(hi - lo), *out = malloc(len), *exp = malloc(len);
    assert_true(src && out && exp);
    for (uint64_t k = lo; k < hi; k++)
      src[k - lo] = (uint8_t)(k * 131 + 7);
    memset(out, 0xee, len);
    memset(exp, 0xee, len);
    for (size_t i = 0; i < want.n; i++)
      for (uint64_t k = 0; k < want.p[i].len; k++)
        exp[want.p[i].dst - off + k] = (uint8_t)((want.p[i].src + k) * 131 + 7);
    ckpt_layout_copy(ndim, shape, offs, sizes, isz, off, len, src, lo, out);
    assert_memory_equal(out, exp, len);
    free(src);
    free(out);
    free(exp);
  }
  free(got.p);
  free(want.p);
}

/* ----- Random cases ----- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(uint64_t n) { /* uniform-ish in [0, n) */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return n ? rng_state % n : 0;
}

static void test_random_vs_reference(void **state) {
  (void)state;
  static const size_t itemsizes[] = {1, 2, 4, 8, 16};
  for (int iter = 0; iter < 20000; iter++) {
    int ndim = (int)rnd(5); /* 0..4 */
    int64_t shape[4], offs[4], sizes[4];
    uint64_t numel = 1;
    for (int j = 0; j < ndim; j++) {
      shape[j] = (int64_t)rnd(7) + (rnd(20) == 0 ? 0 : 1); /* rarely 0 */
      offs[j] = (int64_t)rnd((uint64_t)shape[j] + 1);
      sizes[j] = (int64_t)rnd((uint64_t)(shape[j] - offs[j]) + 1);
      if (rnd(3) == 0) { /* full dimensions are the interesting case */
        offs[j] = 0;
        sizes[j] = shape[j];
      }
      numel *= (uint64_t)shape[j];
    }
    size_t isz = itemsizes[rnd(5)];
    uint64_t total = numel * isz;
    for (int q = 0; q < 8; q++) {
      uint64_t off = rnd(total + 4);
      uint64_t len = rnd(total + 4 - off + 1);
      check_against_reference(ndim, shape, offs, sizes, isz, off, len);
    }
    check_against_reference(ndim, shape, offs, sizes, isz, 0, total);

    /* The extent is where the pieces of the whole tensor begin and end. */
    uint64_t first, end;
    ckpt_layout_extent(ndim, shape, offs, sizes, isz, &first, &end);
    pieces_t all = {0};
    run(ndim, shape, offs, sizes, isz, 0, total, &all);
    if (all.n == 0) {
      assert_int_equal(first, end);
    } else {
      assert_int_equal(first, all.p[0].dst);
      assert_int_equal(end, all.p[all.n - 1].dst + all.p[all.n - 1].len);
    }
    free(all.p);
  }
}

/* ----- Named cases ----- */

static void test_row_shard_is_one_piece(void **state) {
  (void)state;
  const int64_t shape[] = {8, 5}, offs[] = {2, 0}, sizes[] = {3, 5};
  pieces_t ps = {0};
  run(2, shape, offs, sizes, 4, 0, 8 * 5 * 4, &ps);
  assert_int_equal(ps.n, 1);
  assert_int_equal(ps.p[0].src, 0);
  assert_int_equal(ps.p[0].dst, 2 * 5 * 4);
  assert_int_equal(ps.p[0].len, 3 * 5 * 4);

  /* A range starting mid-element and ending mid-element is clipped. */
  run(2, shape, offs, sizes, 4, 41, 10, &ps);
  assert_int_equal(ps.n, 1);
  assert_int_equal(ps.p[0].src, 1);
  assert_int_equal(ps.p[0].dst, 41);
  assert_int_equal(ps.p[0].len, 10);
  free(ps.p);
}

static void test_column_shard(void **state) {
  (void)state;
  /* Column 1..2 of a 4x4 float64 tensor: one 16-byte piece per row. */
  const int64_t shape[] = {4, 4}, offs[] = {0, 1}, sizes[] = {4, 2};
  pieces_t ps = {0};
  run(2, shape, offs, sizes, 8, 0, 128, &ps);
  assert_int_equal(ps.n, 4);
  for (size_t i = 0; i < 4; i++) {
    assert_int_equal(ps.p[i].src, i * 16);
    assert_int_equal(ps.p[i].dst, i * 32 + 8);
    assert_int_equal(ps.p[i].len, 16);
  }
  /* Bytes 44..73: the tail of row 1's piece and the head of row 2's. */
  run(2, shape, offs, sizes, 8, 44, 30, &ps);
  assert_int_equal(ps.n, 2);
  assert_int_equal(ps.p[0].src, 16 + 4);
  assert_int_equal(ps.p[0].dst, 44);
  assert_int_equal(ps.p[0].len, 12);
  assert_int_equal(ps.p[1].src, 32);
  assert_int_equal(ps.p[1].dst, 72);
  assert_int_equal(ps.p[1].len, 2);
  free(ps.p);
}

static void test_3d_block(void **state) {
  (void)state;
  /* Block [1:3, 2:4, 0:5] of a 4x6x5 int16 tensor: the last dimension is
   * full, so the two rows of dimension 1 merge: one piece per i0. */
  const int64_t shape[] = {4, 6, 5}, offs[] = {1, 2, 0}, sizes[] = {2, 2, 5};
  pieces_t ps = {0};
  run(3, shape, offs, sizes, 2, 0, 4 * 6 * 5 * 2, &ps);
  assert_int_equal(ps.n, 2);
  for (size_t i = 0; i < 2; i++) {
    assert_int_equal(ps.p[i].src, i * 20);
    assert_int_equal(ps.p[i].dst, ((1 + i) * 30 + 2 * 5) * 2);
    assert_int_equal(ps.p[i].len, 20);
  }
  free(ps.p);
  check_against_reference(3, shape, offs, sizes, 2, 0, 240);
  const int64_t offs2[] = {1, 2, 1}, sizes2[] = {2, 3, 3};
  check_against_reference(3, shape, offs2, sizes2, 2, 0, 240);
  check_against_reference(3, shape, offs2, sizes2, 2, 77, 101);
}

static void test_scalar(void **state) {
  (void)state;
  pieces_t ps = {0};
  run(0, NULL, NULL, NULL, 8, 0, 8, &ps);
  assert_int_equal(ps.n, 1);
  assert_int_equal(ps.p[0].src, 0);
  assert_int_equal(ps.p[0].dst, 0);
  assert_int_equal(ps.p[0].len, 8);
  run(0, NULL, NULL, NULL, 8, 3, 2, &ps);
  assert_int_equal(ps.n, 1);
  assert_int_equal(ps.p[0].src, 3);
  assert_int_equal(ps.p[0].len, 2);
  run(0, NULL, NULL, NULL, 8, 8, 100, &ps);
  assert_int_equal(ps.n, 0);
  uint64_t first, end;
  ckpt_layout_extent(0, NULL, NULL, NULL, 8, &first, &end);
  assert_int_equal(first, 0);
  assert_int_equal(end, 8);
  free(ps.p);
}

static void test_zero_size_dims(void **state) {
  (void)state;
  const int64_t shape[] = {3, 0, 4}, offs[] = {0, 0, 0}, sizes[] = {3, 0, 4};
  pieces_t ps = {0};
  run(3, shape, offs, sizes, 4, 0, UINT64_MAX, &ps);
  assert_int_equal(ps.n, 0);
  uint64_t first = 1, end = 2;
  ckpt_layout_extent(3, shape, offs, sizes, 4, &first, &end);
  assert_int_equal(first, end);

  /* An empty chunk of a non-empty tensor. */
  const int64_t shape2[] = {3, 4}, offs2[] = {1, 2}, sizes2[] = {2, 0};
  run(2, shape2, offs2, sizes2, 4, 0, 48, &ps);
  assert_int_equal(ps.n, 0);
  ckpt_layout_extent(2, shape2, offs2, sizes2, 4, &first, &end);
  assert_int_equal(first, end);
  free(ps.p);
}

static void test_range_outside_or_empty(void **state) {
  (void)state;
  const int64_t shape[] = {10, 10}, offs[] = {2, 3}, sizes[] = {3, 4};
  pieces_t ps = {0};
  run(2, shape, offs, sizes, 4, 0, 0, &ps); /* len 0 */
  assert_int_equal(ps.n, 0);
  run(2, shape, offs, sizes, 4, 0, 4 * 23, &ps); /* before the chunk */
  assert_int_equal(ps.n, 0);
  run(2, shape, offs, sizes, 4, 4 * 47, 1000, &ps); /* after it */
  assert_int_equal(ps.n, 0);
  run(2, shape, offs, sizes, 4, 4 * 27, 4 * 6, &ps); /* in a gap */
  assert_int_equal(ps.n, 0);
  run(2, shape, offs, sizes, 4, 1u << 30, UINT64_MAX, &ps); /* saturates */
  assert_int_equal(ps.n, 0);
  /* off + len overflowing uint64 still reads to the end. */
  run(2, shape, offs, sizes, 4, 4 * 45, UINT64_MAX, &ps);
  assert_int_equal(ps.n, 1);
  assert_int_equal(ps.p[0].dst, 4 * 45);
  assert_int_equal(ps.p[0].len, 8);
  free(ps.p);
}

static void test_callback_stop(void **state) {
  (void)state;
  const int64_t shape[] = {4, 4}, offs[] = {0, 1}, sizes[] = {4, 2};
  pieces_t ps = {.stop_after = 2, .stop_rc = -42};
  assert_int_equal(
      ckpt_layout_pieces(2, shape, offs, sizes, 8, 0, 128, collect, &ps), -42);
  assert_int_equal(ps.n, 2);
  ps.n = 0;
  ps.stop_after = 1;
  ps.stop_rc = 7;
  assert_int_equal(
      ckpt_layout_pieces(2, shape, offs, sizes, 8, 0, 128, collect, &ps), 7);
  assert_int_equal(ps.n, 1);
  free(ps.p);
}

/* A column shard of a [1e7, 4] float32 tensor has 1e7 runs. Many small
 * reads must each cost a binary search, not a scan (a scan would take
 * hours here and hit the test timeout). */
static void test_many_runs_are_searched(void **state) {
  (void)state;
  const int64_t shape[] = {10000000, 4}, offs[] = {0, 2},
                sizes[] = {10000000, 1};
  pieces_t ps = {0};
  for (int i = 0; i < 200000; i++) {
    uint64_t row = rnd(10000000);
    run(2, shape, offs, sizes, 4, row * 16 + 9, 6, &ps); /* bytes 9..14 */
    assert_int_equal(ps.n, 1);
    assert_int_equal(ps.p[0].src, row * 4 + 1);
    assert_int_equal(ps.p[0].dst, row * 16 + 9);
    assert_int_equal(ps.p[0].len, 3);
  }
  /* 1 MiB from the middle: one 4-byte piece per 16-byte row. */
  run(2, shape, offs, sizes, 4, 80000000, 1u << 20, &ps);
  assert_int_equal(ps.n, (1u << 20) / 16);
  assert_int_equal(ps.p[0].dst, 80000000 + 8);
  assert_int_equal(ps.p[0].src, 80000000 / 4);
  free(ps.p);
}

/* Byte positions near 2^63 do not overflow. */
static void test_huge_tensor(void **state) {
  (void)state;
  const int64_t shape[] = {INT64_C(1) << 40, INT64_C(1) << 20};
  const int64_t offs[] = {(INT64_C(1) << 40) - 2, 5}, sizes[] = {2, 3};
  pieces_t ps = {0};
  run(2, shape, offs, sizes, 8, 0, UINT64_MAX, &ps);
  assert_int_equal(ps.n, 2);
  uint64_t row = (UINT64_C(1) << 40) - 1;
  assert_int_equal(ps.p[1].dst, (row * (UINT64_C(1) << 20) + 5) * 8);
  assert_int_equal(ps.p[1].src, 24);
  assert_int_equal(ps.p[1].len, 24);
  uint64_t first, end;
  ckpt_layout_extent(2, shape, offs, sizes, 8, &first, &end);
  assert_int_equal(end, (row * (UINT64_C(1) << 20) + 8) * 8);
  free(ps.p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_vs_reference),
      cmocka_unit_test(test_row_shard_is_one_piece),
      cmocka_unit_test(test_column_shard),
      cmocka_unit_test(test_3d_block),
      cmocka_unit_test(test_scalar),
      cmocka_unit_test(test_zero_size_dims),
      cmocka_unit_test(test_range_outside_or_empty),
      cmocka_unit_test(test_callback_stop),
      cmocka_unit_test(test_many_runs_are_searched),
      cmocka_unit_test(test_huge_tensor),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
