/*
 * test_cover.c - planner/cover.c: do boxes cover a tensor exactly? Checked
 * against a brute-force count of every element on small random layouts,
 * plus the large and adversarial layouts the loader must stay fast on.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_planner.h"

/* Brute force: 0 exact, 1 overlap, 2 gap. */
static int brute(int ndim, const int64_t *shape, size_t n,
                 const int64_t *const *box) {
  uint64_t numel = 1;
  for (int k = 0; k < ndim; k++)
    numel *= (uint64_t)shape[k];
  uint8_t *seen = calloc(numel + 1, 1);
  int res = 0;
  for (size_t i = 0; i < n && res == 0; i++) {
    int64_t cur[CKPT_MAX_NDIM];
    bool empty = false;
    for (int k = 0; k < ndim; k++) {
      cur[k] = box[i][k];
      empty |= box[i][ndim + k] == 0;
    }
    if (empty)
      continue;
    for (;;) {
      uint64_t at = 0;
      for (int k = 0; k < ndim; k++)
        at = at * (uint64_t)shape[k] + (uint64_t)cur[k];
      if (seen[at]++) {
        res = 1;
        break;
      }
      int k = ndim - 1;
      while (k >= 0 && ++cur[k] == box[i][k] + box[i][ndim + k]) {
        cur[k] = box[i][k];
        k--;
      }
      if (k < 0)
        break;
    }
  }
  for (uint64_t e = 0; res == 0 && e < numel; e++)
    if (!seen[e])
      res = 2;
  free(seen);
  return res;
}

static void random_layouts_match_brute_force(void **state) {
  (void)state;
  srand(12345);
  int64_t store[40][2 * CKPT_MAX_NDIM];
  const int64_t *box[40];
  for (int trial = 0; trial < 20000; trial++) {
    int ndim = 1 + rand() % 3;
    int64_t shape[3];
    for (int k = 0; k < ndim; k++)
      shape[k] = 1 + rand() % 5;
    size_t n = (size_t)(rand() % 8);
    /* half the time: a grid split (exact), then maybe disturbed */
    for (size_t i = 0; i < n; i++) {
      for (int k = 0; k < ndim; k++) {
        int64_t o = rand() % (shape[k] + 1);
        int64_t s = rand() % (shape[k] - o + 1);
        store[i][k] = o;
        store[i][ndim + k] = s;
      }
      box[i] = store[i];
    }
    if (trial % 2 == 0 && ndim == 1) { /* a partition of [0, shape) */
      int64_t at = 0;
      n = 0;
      while (at < shape[0]) {
        int64_t s = 1 + rand() % (shape[0] - at);
        store[n][0] = at;
        store[n][1] = s;
        box[n] = store[n];
        n++;
        at += s;
      }
    }
    ckpt_cover_t res;
    assert_int_equal(ckpt_cover_check(ndim, shape, n, box, &res), 0);
    int want = brute(ndim, shape, n, box);
    if ((int)res.kind != want)
      fail_msg("trial %d: ndim %d n %zu: got %d, brute force %d", trial, ndim,
               n, (int)res.kind, want);
  }
}

/* A million row shards of a [1000000, 4] tensor: exact, quickly; with one
 * row missing: a gap at that row. */
static void large_row_split(void **state) {
  (void)state;
  enum { N = 1000000 };
  int64_t shape[2] = {N, 4};
  int64_t *store = malloc((size_t)N * 4 * sizeof(int64_t));
  const int64_t **box = malloc((size_t)N * sizeof(*box));
  for (size_t i = 0; i < N; i++) {
    int64_t *b = store + 4 * i;
    b[0] = (int64_t)i, b[1] = 0, b[2] = 1, b[3] = 4;
    box[i] = b;
  }
  ckpt_cover_t res;
  /* The grid: 2m + 2 cut points in dimension 0, 1 cell per row. */
  assert_int_equal(ckpt_cover_check(2, shape, N, box, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_EXACT);
  box[777] = box[778]; /* row 777 missing, row 778 twice */
  assert_int_equal(ckpt_cover_check(2, shape, N, box, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_OVERLAP);
  free(box);
  free(store);
}

/* Adversarial: many boxes all spanning dimension 0's start, each one
 * column wide, on an irregular grid (no small grid): the sweep's
 * comparisons grow quadratically, so it stops at its budget (-E2BIG)
 * instead of running for hours; with a budget that suffices it answers. */
static void adversarial_layout_is_bounded(void **state) {
  (void)state;
  enum { N = 200000 };
  int64_t shape[3] = {N, (int64_t)N * 2, 7};
  int64_t *store = malloc((size_t)N * 6 * sizeof(int64_t));
  const int64_t **box = malloc((size_t)N * sizeof(*box));
  for (size_t i = 0; i < N; i++) {
    int64_t *b = store + 6 * i;
    b[0] = 0, b[1] = (int64_t)(2 * i), b[2] = (int64_t)(i % 7);
    b[3] = N - (int64_t)i, b[4] = 1, b[5] = 1;
    box[i] = b;
  }
  ckpt_cover_t res;
  assert_int_equal(ckpt_cover_check_budget(3, shape, N, box, 1000000, &res),
                   -E2BIG);
  assert_int_equal(ckpt_cover_check_budget(3, shape, 2000, box,
                                           (uint64_t)1 << 32, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_GAP);
  free(box);
  free(store);
}

static void scalars_and_empty(void **state) {
  (void)state;
  ckpt_cover_t res;
  int64_t none[1] = {0};
  const int64_t *one[2] = {none, none};
  assert_int_equal(ckpt_cover_check(0, NULL, 1, one, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_EXACT);
  assert_int_equal(ckpt_cover_check(0, NULL, 2, one, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_OVERLAP);
  assert_int_equal(ckpt_cover_check(0, NULL, 0, one, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_GAP);
  int64_t shape0[1] = {0};
  assert_int_equal(ckpt_cover_check(1, shape0, 0, one, &res), 0);
  assert_int_equal(res.kind, CKPT_COVER_EXACT); /* nothing to cover */
  int64_t shape[1] = {4}, out[2] = {3, 2};
  const int64_t *bad[1] = {out};
  assert_int_equal(ckpt_cover_check(1, shape, 1, bad, &res), -EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(random_layouts_match_brute_force),
      cmocka_unit_test(large_row_split),
      cmocka_unit_test(adversarial_layout_is_bounded),
      cmocka_unit_test(scalars_and_empty),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
