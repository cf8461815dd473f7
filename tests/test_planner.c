/*
 * test_planner.c - unit tests of the planner: buffers, dtypes, dimension
 * lists, names, local and global plans, binary messages.
 *
 * The global plan is checked on every validation failure (asserting the
 * text names the FQN, path, ranks and numbers), on dedup and balancing, on
 * the data file layout (a consistency check runs on every valid plan) and
 * on the chunk layouts that matter: 0-d, empty, row/column/block grids,
 * uneven splits, irregular (brick) layouts that take the sweep, and a large
 * grid that would expose quadratic behaviour only through being correct.
 * Messages are round-tripped and every truncation of a valid message must
 * fail cleanly (ASan builds catch leaks and overreads).
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt_planner.h"

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static void assert_contains(const char *hay, const char *needle) {
  if (hay == NULL || strstr(hay, needle) == NULL) {
    print_error("expected to find\n  %s\nin\n  %s\n", needle,
                hay != NULL ? hay : "(null)");
    fail();
  }
}

static size_t count_lines(const char *s) {
  size_t n = s != NULL && *s != '\0';
  for (; s != NULL && *s != '\0'; s++)
    n += *s == '\n';
  return n;
}

/* ------------------------------------------------------------------------
 * Buffers.
 * ---------------------------------------------------------------------- */

static void test_buf(void **state) {
  (void)state;
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  char *s = ckpt_buf_steal(&b);
  assert_string_equal(s, "");
  free(s);

  assert_int_equal(ckpt_buf_append(&b, "ab", 2), 0);
  assert_int_equal(ckpt_buf_printf(&b, "-%d-%s", 42, "x"), 0);
  for (int i = 0; i < 1000; i++)
    assert_int_equal(ckpt_buf_printf(&b, "%c", 'a' + i % 26), 0);
  assert_int_equal(b.len, 7 + 1000);
  assert_memory_equal(b.data, "ab-42-xabc", 10);
  assert_int_equal(b.data[b.len], '\0');
  assert_int_equal(ckpt_buf_reserve(&b, SIZE_MAX), -ENOMEM);
  s = ckpt_buf_steal(&b);
  assert_int_equal(strlen(s), 1007);
  assert_null(b.data);
  assert_int_equal(b.len, 0);
  free(s);
  ckpt_buf_free(&b);
}

/* ------------------------------------------------------------------------
 * Dtypes.
 * ---------------------------------------------------------------------- */

static const struct {
  const char *name;
  size_t size;
} canonical[CKPT_DTYPE_COUNT] = {
    {"bool", 1},          {"uint8", 1},       {"int8", 1},
    {"int16", 2},         {"int32", 4},       {"int64", 8},
    {"float16", 2},       {"bfloat16", 2},    {"float32", 4},
    {"float64", 8},       {"complex64", 8},   {"complex128", 16},
    {"float8_e4m3fn", 1}, {"float8_e5m2", 1},
};

static void expect_dtype(const char *s, ckpt_dtype_t want) {
  ckpt_dtype_t dt = CKPT_DTYPE_INVALID;
  int rc = ckpt_dtype_parse(s, strlen(s), &dt);
  if (rc != 0 || dt != want) {
    print_error("dtype '%s': rc %d, %d, expected %d\n", s, rc, dt, want);
    fail();
  }
}

static void test_dtype_canonical(void **state) {
  (void)state;
  char torch[64];
  for (int i = 0; i < CKPT_DTYPE_COUNT; i++) {
    assert_string_equal(ckpt_dtype_name((ckpt_dtype_t)i), canonical[i].name);
    assert_int_equal(ckpt_dtype_size((ckpt_dtype_t)i), canonical[i].size);
    expect_dtype(canonical[i].name, (ckpt_dtype_t)i);
    snprintf(torch, sizeof(torch), "torch.%s", canonical[i].name);
    expect_dtype(torch, (ckpt_dtype_t)i);
  }
  assert_null(ckpt_dtype_name(CKPT_DTYPE_INVALID));
  assert_null(ckpt_dtype_name(CKPT_DTYPE_COUNT));
  assert_int_equal(ckpt_dtype_size(CKPT_DTYPE_INVALID), 0);
  assert_int_equal(ckpt_dtype_size(CKPT_DTYPE_COUNT), 0);
}

static void test_dtype_aliases(void **state) {
  (void)state;
  static const struct {
    const char *s;
    ckpt_dtype_t dt;
  } aliases[] = {
      {"torch.half", CKPT_DTYPE_FLOAT16},
      {"torch.float", CKPT_DTYPE_FLOAT32},
      {"torch.double", CKPT_DTYPE_FLOAT64},
      {"torch.short", CKPT_DTYPE_INT16},
      {"torch.int", CKPT_DTYPE_INT32},
      {"torch.long", CKPT_DTYPE_INT64},
      {"torch.cfloat", CKPT_DTYPE_COMPLEX64},
      {"torch.cdouble", CKPT_DTYPE_COMPLEX128},
      {"bool_", CKPT_DTYPE_BOOL},
      {"half", CKPT_DTYPE_FLOAT16},
      {"single", CKPT_DTYPE_FLOAT32},
      {"double", CKPT_DTYPE_FLOAT64},
      {"BOOL", CKPT_DTYPE_BOOL},
      {"U8", CKPT_DTYPE_UINT8},
      {"I8", CKPT_DTYPE_INT8},
      {"I16", CKPT_DTYPE_INT16},
      {"I32", CKPT_DTYPE_INT32},
      {"I64", CKPT_DTYPE_INT64},
      {"F16", CKPT_DTYPE_FLOAT16},
      {"BF16", CKPT_DTYPE_BFLOAT16},
      {"F32", CKPT_DTYPE_FLOAT32},
      {"F64", CKPT_DTYPE_FLOAT64},
      {"C64", CKPT_DTYPE_COMPLEX64},
      {"F8_E4M3", CKPT_DTYPE_FLOAT8_E4M3FN},
      {"F8_E5M2", CKPT_DTYPE_FLOAT8_E5M2},
      {" float32 ", CKPT_DTYPE_FLOAT32},
      {"\tF32\n", CKPT_DTYPE_FLOAT32},
      {"torch.bfloat16\n", CKPT_DTYPE_BFLOAT16},
  };
  for (size_t i = 0; i < N_OF(aliases); i++)
    expect_dtype(aliases[i].s, aliases[i].dt);

  /* numpy type strings, with every accepted byte-order prefix */
  static const struct {
    const char *s;
    ckpt_dtype_t dt;
  } types[] = {
      {"b1", CKPT_DTYPE_BOOL},      {"?", CKPT_DTYPE_BOOL},
      {"u1", CKPT_DTYPE_UINT8},     {"i1", CKPT_DTYPE_INT8},
      {"i2", CKPT_DTYPE_INT16},     {"i4", CKPT_DTYPE_INT32},
      {"i8", CKPT_DTYPE_INT64},     {"f2", CKPT_DTYPE_FLOAT16},
      {"f4", CKPT_DTYPE_FLOAT32},   {"f8", CKPT_DTYPE_FLOAT64},
      {"c8", CKPT_DTYPE_COMPLEX64}, {"c16", CKPT_DTYPE_COMPLEX128},
  };
  static const char *prefixes[] = {"", "<", "=", "|"};
  char s[16];
  for (size_t i = 0; i < N_OF(types); i++) {
    for (size_t j = 0; j < N_OF(prefixes); j++) {
      snprintf(s, sizeof(s), "%s%s", prefixes[j], types[i].s);
      expect_dtype(s, types[i].dt);
    }
  }
}

static void test_dtype_bad(void **state) {
  (void)state;
  static const char *bad[] = {
      "",
      " ",
      "float",
      "int",
      "long",
      ">f4",
      ">i1",
      ">b1",
      "<",
      "<<f4",
      "f3",
      "c4",
      "FLOAT32",
      "Float32",
      "fp32",
      "torch.",
      "torch.fp8",
      "torch.bfloat",
      "torch.torch.float32",
      "torch.F32",
      "torch.<f4",
      "float32x",
      "float32\n\n",
      "\nfloat32",
      "f 4",
      "uint16",
      "complex32",
      "F8_E4M3FN",
      "c128",
  };
  ckpt_dtype_t dt = CKPT_DTYPE_FLOAT64;
  for (size_t i = 0; i < N_OF(bad); i++) {
    if (ckpt_dtype_parse(bad[i], strlen(bad[i]), &dt) != -EINVAL) {
      print_error("dtype '%s' was accepted\n", bad[i]);
      fail();
    }
  }
  assert_int_equal(dt, CKPT_DTYPE_FLOAT64); /* untouched on failure */
  /* Embedded NUL, and a length that cuts the name. */
  assert_int_equal(ckpt_dtype_parse("float32\0x", 9, &dt), -EINVAL);
  assert_int_equal(ckpt_dtype_parse("f4\0", 3, &dt), -EINVAL);
  assert_int_equal(ckpt_dtype_parse("float32", 5, &dt), -EINVAL);
  assert_int_equal(ckpt_dtype_parse("float32", 0, &dt), -EINVAL);
  assert_int_equal(ckpt_dtype_parse("int8", 3, &dt), -EINVAL);
  assert_int_equal(ckpt_dtype_parse("int8x", 4, &dt), 0);
  assert_int_equal(dt, CKPT_DTYPE_INT8);
}

/* ------------------------------------------------------------------------
 * Dimension lists.
 * ---------------------------------------------------------------------- */

static void test_dims_parse_good(void **state) {
  (void)state;
  static const struct {
    const char *s;
    int ndim;
    int64_t d[3];
  } good[] = {
      {"4096,1024", 2, {4096, 1024}},
      {"[4096, 1024]", 2, {4096, 1024}},
      {" [ 4 ,5 ] ", 2, {4, 5}},
      {"", 0, {0}},
      {"[]", 0, {0}},
      {"[ ]", 0, {0}},
      {"  ", 0, {0}},
      {"\n", 0, {0}},
      {"7", 1, {7}},
      {"[7]", 1, {7}},
      {"7\n", 1, {7}},
      {"[1,2,3]\n", 3, {1, 2, 3}},
      {"0,0", 2, {0, 0}},
      {"007", 1, {7}},
      {"\t1 ,\t2", 2, {1, 2}},
      {"9223372036854775807", 1, {INT64_MAX}},
  };
  for (size_t i = 0; i < N_OF(good); i++) {
    ckpt_dims_t d;
    memset(&d, 0xa5, sizeof(d));
    int rc = ckpt_dims_parse(good[i].s, strlen(good[i].s), &d);
    if (rc != 0 || d.ndim != good[i].ndim) {
      print_error("dims '%s': rc %d ndim %d\n", good[i].s, rc, d.ndim);
      fail();
    }
    for (int k = 0; k < d.ndim; k++)
      assert_int_equal(d.d[k], good[i].d[k]);
  }
}

static void test_dims_parse_bad(void **state) {
  (void)state;
  static const char *bad[] = {
      "-4",
      "4,-1",
      "4,x",
      "4,,5",
      "[4",
      "4]",
      "4,",
      "[4,]",
      ",4",
      "4 5",
      "+4",
      "[",
      "]",
      "[[4]]",
      "[4]]",
      "4\n\n",
      "4.0",
      "0x10",
      "1e3",
      "4;5",
      "[4],",
      "(4,5)",
      "4 ,",
      "\n4",
      "9223372036854775808",
      "18446744073709551616",
      "99999999999999999999999999999999",
  };
  ckpt_dims_t d = {.ndim = 3};
  for (size_t i = 0; i < N_OF(bad); i++) {
    if (ckpt_dims_parse(bad[i], strlen(bad[i]), &d) != -EINVAL) {
      print_error("dims '%s' was accepted\n", bad[i]);
      fail();
    }
  }
  assert_int_equal(d.ndim, 3); /* untouched on failure */
  assert_int_equal(ckpt_dims_parse("4\0,5", 4, &d), -EINVAL);
  assert_int_equal(ckpt_dims_parse("[4]\0", 4, &d), -EINVAL);
}

static void test_dims_parse_ndim_limit(void **state) {
  (void)state;
  char s[4 * (CKPT_MAX_NDIM + 2)];
  size_t n = 0;
  for (int i = 0; i < CKPT_MAX_NDIM; i++)
    n += (size_t)snprintf(s + n, sizeof(s) - n, "%s%d", i ? "," : "", i % 10);
  ckpt_dims_t d;
  assert_int_equal(ckpt_dims_parse(s, n, &d), 0);
  assert_int_equal(d.ndim, CKPT_MAX_NDIM);
  assert_int_equal(d.d[CKPT_MAX_NDIM - 1], (CKPT_MAX_NDIM - 1) % 10);
  n += (size_t)snprintf(s + n, sizeof(s) - n, ",1");
  assert_int_equal(ckpt_dims_parse(s, n, &d), -EINVAL);
}

static void test_dims_format(void **state) {
  (void)state;
  int64_t d[] = {4096, 1024, 0, INT64_MAX};
  char buf[128];
  assert_int_equal(ckpt_dims_format(d, 2, CKPT_DIMS_CSV, buf, sizeof(buf)), 9);
  assert_string_equal(buf, "4096,1024");
  assert_int_equal(ckpt_dims_format(d, 2, CKPT_DIMS_JSON, buf, sizeof(buf)),
                   11);
  assert_string_equal(buf, "[4096,1024]");
  assert_int_equal(ckpt_dims_format(d, 0, CKPT_DIMS_CSV, buf, sizeof(buf)), 0);
  assert_string_equal(buf, "");
  assert_int_equal(ckpt_dims_format(d, 0, CKPT_DIMS_JSON, buf, sizeof(buf)), 2);
  assert_string_equal(buf, "[]");
  assert_int_equal(ckpt_dims_format(d, 4, CKPT_DIMS_JSON, buf, sizeof(buf)),
                   33);
  assert_string_equal(buf, "[4096,1024,0,9223372036854775807]");
  /* snprintf semantics: truncated, NUL-terminated, full length returned */
  assert_int_equal(ckpt_dims_format(d, 2, CKPT_DIMS_JSON, buf, 5), 11);
  assert_string_equal(buf, "[409");
  assert_int_equal(ckpt_dims_format(d, 2, CKPT_DIMS_JSON, buf, 1), 11);
  assert_string_equal(buf, "");
  assert_int_equal(ckpt_dims_format(d, 2, CKPT_DIMS_JSON, NULL, 0), 11);
  /* what is formatted parses back */
  ckpt_dims_t back;
  int n = ckpt_dims_format(d, 4, CKPT_DIMS_CSV, buf, sizeof(buf));
  assert_int_equal(ckpt_dims_parse(buf, (size_t)n, &back), 0);
  assert_int_equal(back.ndim, 4);
  assert_memory_equal(back.d, d, sizeof(d));
}

static void test_dims_numel(void **state) {
  (void)state;
  uint64_t n = 7;
  int64_t a[] = {4096, 1024};
  assert_int_equal(ckpt_dims_numel(a, 2, &n), 0);
  assert_int_equal(n, 4096 * 1024);
  assert_int_equal(ckpt_dims_numel(NULL, 0, &n), 0);
  assert_int_equal(n, 1);
  int64_t zero[] = {INT64_MAX, INT64_MAX, 0, INT64_MAX};
  assert_int_equal(ckpt_dims_numel(zero, 4, &n), 0);
  assert_int_equal(n, 0);
  int64_t over[] = {(int64_t)1 << 32, (int64_t)1 << 32};
  assert_int_equal(ckpt_dims_numel(over, 2, &n), -EOVERFLOW);
  int64_t max[] = {4294967295, 4294967297}; /* 2^64 - 1 */
  assert_int_equal(ckpt_dims_numel(max, 2, &n), 0);
  assert_true(n == UINT64_MAX);
  int64_t neg[] = {4, -1};
  assert_int_equal(ckpt_dims_numel(neg, 2, &n), -EINVAL);
}

/* ------------------------------------------------------------------------
 * Names, FQNs, data file names.
 * ---------------------------------------------------------------------- */

static void test_names(void **state) {
  (void)state;
  char long_name[300];
  memset(long_name, 'a', sizeof(long_name));
  long_name[255] = '\0';
  assert_true(ckpt_name_valid(long_name));
  long_name[255] = 'a';
  long_name[256] = '\0';
  assert_false(ckpt_name_valid(long_name));

  static const char *good[] = {"a",        "step-100", "ckpt_1.0",
                               "A.b-c_9",  "a.",       "0",
                               "epoch=0-step=100",     "a b",
                               "a\nb",     "\xc3\xa9", "a*", "-\t", "~x", "a:b"};
  for (size_t i = 0; i < N_OF(good); i++)
    assert_true(ckpt_name_valid(good[i]));
  static const char *bad[] = {"", ".hidden", ".", "..", "a/b", "/", "a/"};
  for (size_t i = 0; i < N_OF(bad); i++)
    assert_false(ckpt_name_valid(bad[i]));
}

static void test_commit_words(void **state) {
  (void)state;
  ckpt_commit_words_t w;
  assert_int_equal(ckpt_commit_words_parse("sync", 4, &w), 0);
  assert_true(w.sync);
  assert_false(w.solo);
  assert_string_equal(w.replace, "");
  assert_int_equal(ckpt_commit_words_parse("async\n", 6, &w), 0);
  assert_false(w.sync);
  const char *s = "sync replace=step-12 solo\n";
  assert_int_equal(ckpt_commit_words_parse(s, strlen(s), &w), 0);
  assert_true(w.sync && w.solo);
  assert_string_equal(w.replace, "step-12");
  s = "async  solo  replace=epoch=0-step=100";
  assert_int_equal(ckpt_commit_words_parse(s, strlen(s), &w), 0);
  assert_true(!w.sync && w.solo);
  assert_string_equal(w.replace, "epoch=0-step=100");
  static const char *bad[] = {
      "",          "\n",          "Sync",           "sync\n\n",
      "sync now",  "solo",        "sync solo solo", "sync replace=",
      "sync replace=.x", "sync replace=a replace=b", "sync\nsolo",
      "sync replace=a/b", "syncsolo", " sync", "sync ", "sync solo \n"};
  for (size_t i = 0; i < N_OF(bad); i++)
    assert_int_equal(ckpt_commit_words_parse(bad[i], strlen(bad[i]), &w),
                     -EINVAL);
  assert_int_equal(ckpt_commit_words_parse("sync\0", 5, &w), -EINVAL);
  char longer[300] = "sync replace=";
  memset(longer + 13, 'x', 256);
  longer[269] = '\0';
  assert_int_equal(ckpt_commit_words_parse(longer, strlen(longer), &w), -EINVAL);
  longer[13 + 255] = '\0';
  assert_int_equal(ckpt_commit_words_parse(longer, strlen(longer), &w), 0);
  assert_int_equal((int)strlen(w.replace), 255);
}

static void test_retention_words(void **state) {
  (void)state;
  ckpt_commit_words_t w;
  const char *s = "sync step=1200 metric=loss:0.25 protect metric=acc:-1e-3\n";
  assert_int_equal(ckpt_commit_words_parse(s, strlen(s), &w), 0);
  assert_true(w.sync && w.has_step && w.protect);
  assert_int_equal(w.step, 1200);
  assert_int_equal(w.n_metrics, 2);
  assert_string_equal(w.metrics[0].key, "loss");
  assert_true(w.metrics[0].value == 0.25);
  assert_string_equal(w.metrics[1].key, "acc");
  assert_true(w.metrics[1].value == -1e-3);
  s = "async replace=x step=0 solo";
  assert_int_equal(ckpt_commit_words_parse(s, strlen(s), &w), 0);
  assert_true(w.has_step && w.step == 0 && !w.protect && w.n_metrics == 0);
  s = "sync level=shared replace=x";
  assert_int_equal(ckpt_commit_words_parse(s, strlen(s), &w), 0);
  assert_true(w.sync && w.level_shared);
  s = "sync step=9223372036854775807";
  assert_int_equal(ckpt_commit_words_parse(s, strlen(s), &w), 0);
  assert_true(w.step == INT64_MAX);
  static const char *bad[] = {
      "sync step=", "sync step=-1", "sync step=+1", "sync step=1.5",
      "sync step=9223372036854775808", "sync step=1 step=1", "sync Step=1",
      "sync metric=", "sync metric=loss", "sync metric=loss:", "sync metric=:1",
      "sync metric=loss:nan", "sync metric=loss:inf", "sync metric=loss:1e999",
      "sync metric=loss:0x1p3", "sync metric=loss: 1", "sync metric=l/s:1",
      "sync metric=a:1 metric=a:2", "sync protect protect", "sync protected",
      "sync metric=loss:1:2", "sync level=shared level=shared",
      "sync level=partner", "sync level=", "sync level=Shared"};
  for (size_t i = 0; i < N_OF(bad); i++)
    assert_int_equal(ckpt_commit_words_parse(bad[i], strlen(bad[i]), &w),
                     -EINVAL);
  /* up to CKPT_MAX_METRICS, each key once; a 64-byte key, not 65 */
  char many[2048] = "sync";
  for (int i = 0; i < CKPT_MAX_METRICS; i++)
    snprintf(many + strlen(many), sizeof(many) - strlen(many),
             " metric=m%d:%d", i, i);
  assert_int_equal(ckpt_commit_words_parse(many, strlen(many), &w), 0);
  assert_int_equal(w.n_metrics, CKPT_MAX_METRICS);
  strcat(many, " metric=one:1");
  assert_int_equal(ckpt_commit_words_parse(many, strlen(many), &w), -EINVAL);
  char key[100] = "sync metric=";
  memset(key + 12, 'k', 64);
  strcpy(key + 76, ":1");
  assert_int_equal(ckpt_commit_words_parse(key, strlen(key), &w), 0);
  memset(key + 12, 'k', 65);
  strcpy(key + 77, ":1");
  assert_int_equal(ckpt_commit_words_parse(key, strlen(key), &w), -EINVAL);
}

static void test_step_from_name(void **state) {
  (void)state;
  assert_int_equal(ckpt_step_from_name("epoch=3-step=1200"), 1200);
  assert_int_equal(ckpt_step_from_name("checkpoint-500"), 500);
  assert_int_equal(ckpt_step_from_name("step_0042.ckpt"), 42);
  assert_int_equal(ckpt_step_from_name("7"), 7);
  assert_int_equal(ckpt_step_from_name("latest"), -1);
  assert_int_equal(ckpt_step_from_name("s-99999999999999999999"), -1);
  assert_int_equal(ckpt_step_from_name("s-9223372036854775807"), INT64_MAX);
}

static void test_keep_policy(void **state) {
  (void)state;
  ckpt_keep_policy_t p;
  const char *s = "last:5,every:1000,best:3:loss:min";
  assert_int_equal(ckpt_keep_policy_parse(s, strlen(s), &p), 0);
  assert_int_equal(p.last, 5);
  assert_int_equal(p.every, 1000);
  assert_int_equal(p.best, 3);
  assert_string_equal(p.metric, "loss");
  assert_false(p.maximize);
  assert_true(ckpt_keep_policy_active(&p));
  char text[160];
  ckpt_keep_policy_format(&p, text, sizeof(text));
  assert_string_equal(text, s);
  s = "best:1:val.acc:max,last:2";
  assert_int_equal(ckpt_keep_policy_parse(s, strlen(s), &p), 0);
  assert_true(p.maximize && p.best == 1 && p.last == 2 && p.every == 0);
  ckpt_keep_policy_format(&p, text, sizeof(text));
  assert_string_equal(text, "last:2,best:1:val.acc:max");
  s = "every:7";
  assert_int_equal(ckpt_keep_policy_parse(s, strlen(s), &p), 0);
  ckpt_keep_policy_format(&p, text, sizeof(text));
  assert_string_equal(text, "every:7");
  static const char *bad[] = {
      "", ",", "last:", "last:0", "last:-1", "last:4294967296", "last:1,",
      ",last:1", "last:1,last:2", "first:1", "every:0", "every:x",
      "best:1:loss", "best:1:loss:avg", "best:0:loss:min", "best:1::min",
      "best:1:a b:min", "last:1 ", "LAST:1", "best:1:loss:min:x"};
  for (size_t i = 0; i < N_OF(bad); i++) {
    assert_int_equal(ckpt_keep_policy_parse(bad[i], strlen(bad[i]), &p),
                     -EINVAL);
    assert_false(ckpt_keep_policy_active(&p)); /* nothing half-set */
  }
  double v;
  assert_int_equal(ckpt_metric_value_parse("1e-05", 5, &v), 0);
  ckpt_metric_format(v, text, sizeof(text));
  assert_string_equal(text, "1e-05");
  ckpt_metric_format(0.1 + 0.2, text, sizeof(text));
  assert_int_equal(ckpt_metric_value_parse(text, strlen(text), &v), 0);
  assert_true(v == 0.1 + 0.2); /* reads back the same double */
}

static void test_entry_name_check(void **state) {
  (void)state;
  static const struct {
    const char *name;
    int top, inside;
  } cases[] = {
      {"w", 0, 0},
      {".tmp0ENsvo", 0, 0},
      {".hidden", 0, 0},
      {"a b=c", 0, 0},
      {".commit", -EPERM, 0},
      {".status", -EPERM, 0},
      {".metadata", -EPERM, 0},
      {".metadata.tmp", 0, 0},
      {".npy", -EPERM, 0},
      {".safetensors", -EPERM, 0},
      {".w[0:2]", -EPERM, 0},
      {"w[0:2]", 0, 0},
      {".", -EINVAL, -EINVAL},
      {"..", -EINVAL, -EINVAL},
      {"...", 0, 0},
      {"", -EINVAL, -EINVAL},
      {"a/b", -EINVAL, -EINVAL},
  };
  for (size_t i = 0; i < N_OF(cases); i++) {
    size_t len = strlen(cases[i].name);
    assert_int_equal(ckpt_entry_name_check(cases[i].name, len, true),
                     cases[i].top);
    assert_int_equal(ckpt_entry_name_check(cases[i].name, len, false),
                     cases[i].inside);
  }
  char name[257];
  memset(name, 'x', 256);
  name[256] = '\0';
  assert_int_equal(ckpt_entry_name_check(name, 255, true), 0);
  assert_int_equal(ckpt_entry_name_check(name, 256, true), -ENAMETOOLONG);
  assert_int_equal(ckpt_entry_name_check("a\0b", 3, false), -EINVAL);
}

static void test_fqn(void **state) {
  (void)state;
  static const char *cases[][2] = {
      {"model/layer0/weight", "model.layer0.weight"},
      {"w", "w"},
      {"a.b/c", "a.b.c"},
      {"optim/state/0/exp_avg", "optim.state.0.exp_avg"},
  };
  for (size_t i = 0; i < N_OF(cases); i++) {
    char *f = ckpt_fqn_from_path(cases[i][0]);
    assert_string_equal(f, cases[i][1]);
    free(f);
  }
}

static void test_data_file_names(void **state) {
  (void)state;
  char buf[64];
  int32_t r;
  uint32_t k;
  assert_int_equal(ckpt_data_file_name(3, 12, buf, sizeof(buf)), 13);
  assert_string_equal(buf, "__3_12.distcp");
  assert_int_equal(ckpt_data_file_name(3, 12, buf, 4), 13);
  assert_string_equal(buf, "__3");
  assert_int_equal(ckpt_data_file_name(INT32_MAX, UINT32_MAX, buf, sizeof(buf)),
                   (int)strlen("__2147483647_4294967295.distcp"));

  static const struct {
    const char *s;
    int32_t r;
    uint32_t k;
  } good[] = {{"__0_0.distcp", 0, 0},
              {"__3_12.distcp", 3, 12},
              {"__2147483647_4294967295.distcp", INT32_MAX, UINT32_MAX}};
  for (size_t i = 0; i < N_OF(good); i++) {
    assert_int_equal(ckpt_data_file_parse(good[i].s, &r, &k), 0);
    assert_int_equal(r, good[i].r);
    assert_int_equal(k, good[i].k);
    ckpt_data_file_name(r, k, buf, sizeof(buf));
    assert_string_equal(buf, good[i].s);
  }
  static const char *bad[] = {
      "",
      ".metadata",
      "__3_12.distcpx",
      "__3_12.distc",
      "_3_12.distcp",
      "__3_.distcp",
      "___12.distcp",
      "__-1_0.distcp",
      "__+1_0.distcp",
      "__03_1.distcp",
      "__3_01.distcp",
      "__2147483648_0.distcp",
      "__1_4294967296.distcp",
      "__1_2",
      "__1_2_3.distcp",
      "__1 _2.distcp",
      "__1_2.distcp/",
  };
  for (size_t i = 0; i < N_OF(bad); i++) {
    if (ckpt_data_file_parse(bad[i], &r, &k) != -EINVAL) {
      print_error("data file name '%s' was accepted\n", bad[i]);
      fail();
    }
  }
}

/* ------------------------------------------------------------------------
 * Local plans.
 * ---------------------------------------------------------------------- */

static void test_local_plan(void **state) {
  (void)state;
  ckpt_local_plan_t lp;
  ckpt_local_plan_init(&lp, 5);
  int64_t shape[] = {8, 4}, off[] = {4, 0}, size[] = {4, 4};
  assert_int_equal(ckpt_local_plan_add_tensor(&lp, "m/w", CKPT_DTYPE_FLOAT32, 2,
                                              shape, NULL, NULL, 128, 1, 7),
                   0);
  assert_int_equal(ckpt_local_plan_add_tensor(&lp, "m/v", CKPT_DTYPE_INT8, 2,
                                              shape, off, size, 16, 2, 8),
                   0);
  assert_int_equal(ckpt_local_plan_add_bytes(&lp, "rng", 10, 3, 9), 0);
  int64_t many[CKPT_MAX_NDIM + 1] = {0};
  assert_int_equal(ckpt_local_plan_add_tensor(&lp, "x", CKPT_DTYPE_INT8,
                                              CKPT_MAX_NDIM + 1, many, NULL,
                                              NULL, 0, 0, 0),
                   -EINVAL);
  assert_int_equal(lp.rank, 5);
  assert_int_equal(lp.n_items, 3);
  const ckpt_write_item_t *w = &lp.items[0];
  assert_string_equal(w->fqn, "m.w");
  assert_string_equal(w->path, "m/w");
  int64_t want_w[] = {8, 4, 0, 0, 8, 4};
  assert_memory_equal(w->dims, want_w, sizeof(want_w));
  int64_t want_v[] = {8, 4, 4, 0, 4, 4};
  assert_memory_equal(lp.items[1].dims, want_v, sizeof(want_v));
  assert_int_equal(lp.items[2].kind, CKPT_ITEM_BYTES);
  assert_int_equal(lp.items[2].ndim, 0);
  assert_int_equal(lp.items[2].local_id, 9);

  assert_null(lp.errors);
  assert_int_equal(
      ckpt_local_plan_add_error(&lp, "m/x: missing %s", "user.ckpt.shape"), 0);
  assert_int_equal(ckpt_local_plan_add_error(&lp, "m/y: bad %d\n", 2), 0);
  assert_string_equal(lp.errors, "m/x: missing user.ckpt.shape\nm/y: bad 2");
  ckpt_local_plan_free(&lp);
  assert_int_equal(lp.n_items, 0);
  assert_null(lp.errors);
  assert_int_equal(lp.rank, 5);
}

/* ------------------------------------------------------------------------
 * Global plans: helpers.
 * ---------------------------------------------------------------------- */

typedef struct {
  int32_t n;
  ckpt_local_plan_t lp[64];
  ckpt_plan_opts_t opts;
  ckpt_global_plan_t gp;
} world_t;

static world_t *world_new(int32_t n) {
  world_t *w = calloc(1, sizeof(*w));
  assert_non_null(w);
  assert_true(n <= (int32_t)N_OF(w->lp));
  w->n = n;
  for (int32_t r = 0; r < n; r++)
    ckpt_local_plan_init(&w->lp[r], r);
  w->opts.io_threads = 4;
  w->opts.replica_check = CKPT_REPLICA_ERROR;
  return w;
}

static void world_free(world_t *w) {
  for (int32_t r = 0; r < w->n; r++)
    ckpt_local_plan_free(&w->lp[r]);
  ckpt_global_plan_free(&w->gp);
  free(w);
}

/* A chunk of the right length; checksum derived from the chunk unless
 * given (non-zero). */
static void chunk_len(world_t *w, int32_t r, const char *path, ckpt_dtype_t dt,
                      int ndim, const int64_t *shape, const int64_t *off,
                      const int64_t *size, uint64_t length, uint64_t checksum) {
  ckpt_local_plan_t *lp = &w->lp[r];
  assert_int_equal(ckpt_local_plan_add_tensor(lp, path, dt, ndim, shape, off,
                                              size, length, checksum,
                                              1000 + lp->n_items),
                   0);
}

static uint64_t chunk_bytes(ckpt_dtype_t dt, int ndim, const int64_t *shape,
                            const int64_t *size) {
  uint64_t n;
  assert_int_equal(ckpt_dims_numel(size != NULL ? size : shape, ndim, &n), 0);
  return n * ckpt_dtype_size(dt);
}

static void chunk(world_t *w, int32_t r, const char *path, ckpt_dtype_t dt,
                  int ndim, const int64_t *shape, const int64_t *off,
                  const int64_t *size) {
  uint64_t sum = 0x9e37;
  for (int k = 0; k < ndim; k++)
    sum = sum * 131 + (uint64_t)(off != NULL ? off[k] : 0) * 7 +
          (uint64_t)(size != NULL ? size[k] : shape[k]);
  chunk_len(w, r, path, dt, ndim, shape, off, size,
            chunk_bytes(dt, ndim, shape, size), sum);
}

static void blob(world_t *w, int32_t r, const char *path, uint64_t length,
                 uint64_t checksum) {
  ckpt_local_plan_t *lp = &w->lp[r];
  assert_int_equal(
      ckpt_local_plan_add_bytes(lp, path, length, checksum, 1000 + lp->n_items),
      0);
}

/* Items get local_id 1000 + their index (see chunk_len and blob). */
static const ckpt_write_item_t *find_item(const world_t *w, int32_t r,
                                          uint32_t local_id) {
  if (local_id < 1000 || local_id - 1000 >= w->lp[r].n_items)
    return NULL;
  return &w->lp[r].items[local_id - 1000];
}

/* The assignment of rank r at file/off of the item fqn (zero-length items
 * can share an offset); NULL if none. Assignments are sorted by (file,
 * offset), which check_valid_plan verifies first. */
static const ckpt_assignment_t *find_assign(const world_t *w, int32_t r,
                                            uint32_t file, uint64_t off,
                                            const char *fqn,
                                            const int64_t *dims) {
  const ckpt_rank_plan_t *rp = &w->gp.ranks[r];
  uint32_t lo = 0, hi = rp->n_assign;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    const ckpt_assignment_t *a = &rp->assign[mid];
    if (a->file < file || (a->file == file && a->file_offset < off))
      lo = mid + 1;
    else
      hi = mid;
  }
  for (; lo < rp->n_assign && rp->assign[lo].file == file &&
         rp->assign[lo].file_offset == off;
       lo++) {
    const ckpt_assignment_t *a = &rp->assign[lo];
    const ckpt_write_item_t *it = find_item(w, r, a->local_id);
    if (strcmp(it->fqn, fqn) == 0 &&
        (dims == NULL || memcmp(ckpt_item_offsets(it), dims,
                                2 * (size_t)it->ndim * sizeof(*dims)) == 0))
      return a;
  }
  return NULL;
}

/* Whether rank r writes behind: it reserved bytes or pinned items. */
static bool write_behind(const world_t *w, int32_t r) {
  const ckpt_local_plan_t *lp = &w->lp[r];
  for (uint32_t k = 0; k < lp->n_reserved; k++)
    if (lp->reserved[k] > 0)
      return true;
  for (uint32_t i = 0; i < lp->n_items; i++)
    if (lp->items[i].pin_file != CKPT_NO_PIN)
      return true;
  return false;
}

static uint64_t reserved_at(const ckpt_local_plan_t *lp, uint32_t k) {
  return k < lp->n_reserved ? lp->reserved[k] : 0;
}

/* The rank plan of a rank writing behind: assignments by file, by offset,
 * without overlap, inside the file; kept pinned items where they are; the
 * others appended after the reservation of their file (packed, or aligned
 * when large); each file as long as its reservation or its last item; the
 * last file the last one holding an item or a reservation. */
static void check_write_behind(const world_t *w, int32_t r) {
  const ckpt_local_plan_t *lp = &w->lp[r];
  const ckpt_rank_plan_t *rp = &w->gp.ranks[r];
  uint32_t last = 0; /* 1 + last file holding something */
  for (uint32_t k = 0; k < lp->n_reserved; k++)
    last = lp->reserved[k] > 0 ? k + 1 : last;
  /* beyond io_threads: only files of reservations and pins */
  assert_true(rp->n_files <= (w->opts.io_threads > last ? w->opts.io_threads : last));
  for (uint32_t i = 0; i < rp->n_assign; i++) {
    const ckpt_write_item_t *it = find_item(w, r, rp->assign[i].local_id);
    assert_true(rp->assign[i].file < w->opts.io_threads ||
                (it->pin_file == rp->assign[i].file && reserved_at(lp, it->pin_file) > 0));
  }
  uint64_t end = 0;
  for (uint32_t i = 0; i < rp->n_assign; i++) {
    const ckpt_assignment_t *a = &rp->assign[i];
    const ckpt_assignment_t *prev = i > 0 ? &rp->assign[i - 1] : NULL;
    assert_true(a->file < rp->n_files);
    if (prev == NULL || prev->file != a->file) {
      assert_true(prev == NULL || prev->file < a->file);
      end = 0;
    }
    assert_true(a->file_offset >= end);
    const ckpt_write_item_t *it = find_item(w, r, a->local_id);
    assert_non_null(it);
    assert_int_equal(it->length, a->length);
    uint64_t res = reserved_at(lp, a->file);
    if (it->pin_file != CKPT_NO_PIN) {
      assert_int_equal(a->file, it->pin_file);
      assert_int_equal(a->file_offset, it->pin_offset);
      assert_true(a->file_offset + a->length <= res);
    } else {
      uint64_t from = end > res ? end : res;
      if (a->length >= 65536) {
        assert_int_equal(a->file_offset % 4096, 0);
        assert_true(a->file_offset >= from && a->file_offset < from + 4096);
      } else {
        assert_true(a->file_offset == from);
      }
    }
    end = a->file_offset + a->length;
    last = a->file + 1 > last ? a->file + 1 : last;
  }
  assert_int_equal(rp->n_files, last);
  for (uint32_t k = 0; k < rp->n_files; k++) {
    uint64_t want = reserved_at(lp, k);
    for (uint32_t i = 0; i < rp->n_assign; i++) {
      const ckpt_assignment_t *a = &rp->assign[i];
      if (a->file == k && a->file_offset + a->length > want)
        want = a->file_offset + a->length;
    }
    assert_int_equal(rp->file_bytes[k], want);
  }
}

/*
 * Everything a valid plan promises: each rank plan's assignments grouped by
 * file, by offset, without overlap, inside the file, the last one ending
 * the file; large items aligned; every file used; each assignment naming an
 * item of that rank (check_write_behind for the ranks writing behind); meta
 * sorted and every chunk/blob matching exactly one assignment; the
 * assignments covering meta exactly.
 */
static void check_valid_plan(const world_t *w) {
  const ckpt_global_plan_t *gp = &w->gp;
  if (gp->errors != NULL) {
    print_error("unexpected plan errors:\n%s\n", gp->errors);
    fail();
  }
  assert_int_equal(gp->world_size, w->n);
  assert_int_equal(gp->meta.world_size, w->n);
  uint64_t n_assign = 0;
  for (int32_t r = 0; r < w->n; r++) {
    const ckpt_rank_plan_t *rp = &gp->ranks[r];
    assert_int_equal(rp->rank, r);
    if (write_behind(w, r)) {
      check_write_behind(w, r);
      n_assign += rp->n_assign;
      continue;
    }
    assert_true(rp->n_files <= w->opts.io_threads);
    assert_true(rp->n_files <= rp->n_assign);
    uint64_t end = 0;
    for (uint32_t i = 0; i < rp->n_assign; i++) {
      const ckpt_assignment_t *a = &rp->assign[i];
      const ckpt_assignment_t *prev = i > 0 ? &rp->assign[i - 1] : NULL;
      assert_true(a->file < rp->n_files);
      if (prev == NULL || prev->file != a->file) {
        assert_true(prev == NULL || prev->file + 1 == a->file);
        if (prev != NULL)
          assert_true(end == rp->file_bytes[prev->file]);
        end = 0;
      }
      assert_true(a->file_offset >= end);
      if (a->length >= 65536) /* aligned, else packed */
        assert_int_equal(a->file_offset % 4096, 0);
      else
        assert_true(a->file_offset == end);
      end = a->file_offset + a->length;
      const ckpt_write_item_t *it = find_item(w, r, a->local_id);
      assert_non_null(it);
      assert_int_equal(it->length, a->length);
    }
    if (rp->n_assign > 0) {
      assert_true(rp->assign[rp->n_assign - 1].file + 1 == rp->n_files);
      assert_true(end == rp->file_bytes[rp->n_files - 1]);
    }
    n_assign += rp->n_assign;
  }

  const ckpt_metadata_t *m = &gp->meta;
  assert_int_equal(n_assign, (uint64_t)m->n_chunks + m->n_blobs);
  uint32_t next_chunk = 0;
  for (uint32_t t = 0; t < m->n_tensors; t++) {
    const ckpt_tensor_meta_t *tm = &m->tensors[t];
    if (t > 0)
      assert_true(strcmp(m->tensors[t - 1].fqn, tm->fqn) < 0);
    assert_int_equal(tm->first_chunk, next_chunk);
    next_chunk += tm->n_chunks;
    for (uint32_t c = tm->first_chunk; c < tm->first_chunk + tm->n_chunks;
         c++) {
      const ckpt_chunk_meta_t *cm = &m->chunks[c];
      assert_int_equal(cm->tensor, t);
      if (c > tm->first_chunk) { /* offsets in row-major order */
        const int64_t *a = m->chunks[c - 1].dims, *b = cm->dims;
        int k = 0;
        while (k < 2 * tm->ndim && a[k] == b[k])
          k++;
        assert_true(k < 2 * tm->ndim && a[k] < b[k]);
      }
      const ckpt_assignment_t *a = find_assign(
          w, cm->rank, cm->file, cm->file_offset, tm->fqn, cm->dims);
      assert_non_null(a);
      assert_int_equal(a->length, cm->length);
      const ckpt_write_item_t *it = find_item(w, cm->rank, a->local_id);
      assert_string_equal(it->fqn, tm->fqn);
      assert_int_equal(it->checksum, cm->checksum);
    }
  }
  assert_int_equal(next_chunk, m->n_chunks);
  for (uint32_t b = 0; b < m->n_blobs; b++) {
    const ckpt_blob_meta_t *bm = &m->blobs[b];
    if (b > 0)
      assert_true(strcmp(m->blobs[b - 1].fqn, bm->fqn) < 0);
    const ckpt_assignment_t *a =
        find_assign(w, bm->rank, bm->file, bm->file_offset, bm->fqn, NULL);
    assert_non_null(a);
    assert_int_equal(a->length, bm->length);
    const ckpt_write_item_t *it = find_item(w, bm->rank, a->local_id);
    assert_string_equal(it->fqn, bm->fqn);
    if (!it->fqn_explicit) /* else the lowest rank's path (test_plan_fqn) */
      assert_string_equal(it->path, bm->path);
    assert_int_equal(it->checksum, bm->checksum);
  }
}

static void plan_ok(world_t *w) {
  ckpt_global_plan_free(&w->gp);
  assert_int_equal(ckpt_plan_global(w->lp, w->n, &w->opts, &w->gp), 0);
  check_valid_plan(w);
}

/* Plan, expect errors, and that each expected line is among them. */
static void plan_fails(world_t *w, const char *const *lines, size_t n) {
  ckpt_global_plan_free(&w->gp);
  assert_int_equal(ckpt_plan_global(w->lp, w->n, &w->opts, &w->gp), 0);
  assert_non_null(w->gp.errors);
  for (size_t i = 0; i < n; i++)
    assert_contains(w->gp.errors, lines[i]);
  /* nothing to write, nothing to publish */
  for (int32_t r = 0; r < w->n; r++) {
    assert_int_equal(w->gp.ranks[r].rank, r);
    assert_int_equal(w->gp.ranks[r].n_files, 0);
    assert_int_equal(w->gp.ranks[r].n_assign, 0);
  }
  assert_int_equal(
      w->gp.meta.n_tensors + w->gp.meta.n_chunks + w->gp.meta.n_blobs, 0);
}

#define PLAN_FAILS(w, ...)                                                     \
  do {                                                                         \
    static const char *const lines_[] = {__VA_ARGS__};                         \
    plan_fails(w, lines_, N_OF(lines_));                                       \
  } while (0)

/* Bytes each rank writes. */
static uint64_t rank_bytes(const world_t *w, int32_t r) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < w->gp.ranks[r].n_assign; i++)
    sum += w->gp.ranks[r].assign[i].length;
  return sum;
}

#define F32 CKPT_DTYPE_FLOAT32
#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

/* ------------------------------------------------------------------------
 * Global plans: valid layouts.
 * ---------------------------------------------------------------------- */

static void test_plan_empty(void **state) {
  (void)state;
  world_t *w = world_new(3);
  plan_ok(w);
  assert_null(w->gp.warnings);
  assert_int_equal(w->gp.meta.n_tensors, 0);
  assert_null(w->gp.meta.name);
  assert_null(w->gp.meta.save_id);
  world_free(w);
}

static void test_plan_row_shards_and_blob(void **state) {
  (void)state;
  world_t *w = world_new(2);
  chunk(w, 1, "model/w", F32, 2, DIMS(8, 4), DIMS(4, 0), DIMS(4, 4));
  chunk(w, 0, "model/w", F32, 2, DIMS(8, 4), DIMS(0, 0), DIMS(4, 4));
  blob(w, 0, "extra/rng", 10, 77);
  chunk(w, 1, "model/b", F32, 1, DIMS(4), NULL, NULL);
  plan_ok(w);
  const ckpt_metadata_t *m = &w->gp.meta;
  assert_int_equal(m->n_tensors, 2);
  assert_string_equal(m->tensors[0].fqn, "model.b");
  assert_string_equal(m->tensors[1].fqn, "model.w");
  assert_string_equal(m->tensors[1].path, "model/w");
  assert_int_equal(m->tensors[1].dtype, F32);
  assert_int_equal(m->tensors[1].ndim, 2);
  assert_int_equal(m->tensors[1].shape[0], 8);
  assert_int_equal(m->tensors[1].n_chunks, 2);
  const ckpt_chunk_meta_t *c = &m->chunks[m->tensors[1].first_chunk];
  assert_int_equal(c[0].rank, 0);
  assert_int_equal(c[0].dims[0], 0);
  assert_int_equal(c[1].rank, 1);
  assert_int_equal(c[1].dims[0], 4);
  assert_int_equal(c[1].length, 64);
  assert_int_equal(m->n_blobs, 1);
  assert_string_equal(m->blobs[0].fqn, "extra.rng");
  assert_int_equal(m->blobs[0].rank, 0);
  assert_int_equal(m->blobs[0].length, 10);
  assert_int_equal(m->blobs[0].checksum, 77);
  assert_int_equal(rank_bytes(w, 0), 64 + 10);
  assert_int_equal(rank_bytes(w, 1), 64 + 16);
  world_free(w);
}

static void test_plan_scalar(void **state) {
  (void)state;
  world_t *w = world_new(3);
  chunk(w, 0, "step", CKPT_DTYPE_INT64, 0, NULL, NULL, NULL);
  chunk(w, 1, "step", CKPT_DTYPE_INT64, 0, NULL, NULL, NULL);
  chunk(w, 2, "lr", CKPT_DTYPE_FLOAT64, 0, NULL, NULL, NULL);
  plan_ok(w);
  const ckpt_metadata_t *m = &w->gp.meta;
  assert_int_equal(m->n_tensors, 2);
  assert_int_equal(m->n_chunks, 2);
  assert_int_equal(m->tensors[1].ndim, 0);
  assert_null(m->tensors[1].shape);
  assert_null(m->chunks[1].dims);
  assert_int_equal(m->chunks[1].length, 8);
  assert_int_equal(m->chunks[1].rank, 0); /* replicated: lowest rank */
  world_free(w);

  w = world_new(1);
  chunk_len(w, 0, "step", CKPT_DTYPE_INT64, 0, NULL, NULL, NULL, 4, 1);
  PLAN_FAILS(w, "step (step): rank 0 wrote 4 bytes, 8 expected (sizes "
                "scalar x int64)");
  world_free(w);
}

static void test_plan_zero_size(void **state) {
  (void)state;
  world_t *w = world_new(2);
  /* an empty tensor, on two ranks with different empty chunks */
  chunk(w, 0, "empty", F32, 2, DIMS(0, 5), NULL, NULL);
  chunk(w, 1, "empty", F32, 2, DIMS(0, 5), DIMS(0, 2), DIMS(0, 3));
  /* a full tensor plus an empty chunk inside it */
  chunk(w, 0, "w", F32, 2, DIMS(4, 4), DIMS(0, 0), DIMS(2, 4));
  chunk(w, 1, "w", F32, 2, DIMS(4, 4), DIMS(2, 0), DIMS(2, 4));
  chunk(w, 1, "w", F32, 2, DIMS(4, 4), DIMS(2, 0), DIMS(0, 4));
  blob(w, 1, "nothing", 0, 0);
  plan_ok(w);
  const ckpt_metadata_t *m = &w->gp.meta;
  assert_int_equal(m->n_tensors, 2);
  assert_int_equal(m->tensors[0].n_chunks, 2);
  assert_int_equal(m->tensors[1].n_chunks, 3);
  assert_int_equal(m->chunks[0].length, 0);
  assert_int_equal(m->n_blobs, 1);
  assert_int_equal(m->blobs[0].length, 0);
  /* zero-length items are assigned too */
  assert_int_equal(w->gp.ranks[1].n_assign, 4);
  world_free(w);

  /* an empty chunk still must lie inside the shape */
  w = world_new(1);
  chunk(w, 0, "w", F32, 2, DIMS(4, 4), NULL, NULL);
  chunk(w, 0, "w", F32, 2, DIMS(4, 4), DIMS(5, 0), DIMS(0, 4));
  PLAN_FAILS(w, "w (w): chunk of rank 0 offsets [5,0] sizes [0,4] lies "
                "outside shape [4,4]");
  world_free(w);
}

/* A grid of blocks: cuts[k] lists the boundaries of dimension k. */
static void add_grid(world_t *w, const char *path, int ndim,
                     const int64_t *const *cuts, const int *n_cuts,
                     size_t skip) {
  int64_t shape[8], off[8], size[8];
  int idx[8] = {0};
  size_t count = 0;
  for (int k = 0; k < ndim; k++)
    shape[k] = cuts[k][n_cuts[k] - 1];
  for (;;) {
    for (int k = 0; k < ndim; k++) {
      off[k] = cuts[k][idx[k]];
      size[k] = cuts[k][idx[k] + 1] - off[k];
    }
    if (count != skip)
      chunk(w, (int32_t)(count % (size_t)w->n), path, F32, ndim, shape, off,
            size);
    count++;
    int k = ndim - 1;
    while (k >= 0 && ++idx[k] == n_cuts[k] - 1)
      idx[k--] = 0;
    if (k < 0)
      break;
  }
}

static void test_plan_grids(void **state) {
  (void)state;
  world_t *w = world_new(4);
  /* 2-D blocks, uneven (torch.chunk-like) in both dimensions */
  const int64_t rows[] = {0, 3, 6, 9, 10}, cols[] = {0, 4, 8, 11};
  const int64_t *c2[] = {rows, cols};
  add_grid(w, "blocks", 2, c2, (int[]){5, 4}, SIZE_MAX);
  /* column shards */
  const int64_t one[] = {0, 16}, quarter[] = {0, 2, 4, 6, 8};
  const int64_t *cc[] = {one, quarter};
  add_grid(w, "cols", 2, cc, (int[]){2, 5}, SIZE_MAX);
  /* 3-D blocks */
  const int64_t a[] = {0, 1, 2}, b[] = {0, 5, 7}, c[] = {0, 3, 6, 9};
  const int64_t *c3[] = {a, b, c};
  add_grid(w, "cube", 3, c3, (int[]){3, 3, 4}, SIZE_MAX);
  /* 1-D flat shards, uneven */
  const int64_t flat[] = {0, 100, 200, 250, 251};
  const int64_t *c1[] = {flat};
  add_grid(w, "flat", 1, c1, (int[]){5}, SIZE_MAX);
  plan_ok(w);
  assert_int_equal(w->gp.meta.n_tensors, 4);
  assert_int_equal(w->gp.meta.tensors[0].n_chunks, 12);
  assert_int_equal(w->gp.meta.tensors[2].n_chunks, 12);
  world_free(w);

  /* the same blocks with one missing: the gap is named */
  w = world_new(4);
  add_grid(w, "blocks", 2, c2, (int[]){5, 4}, 5);
  PLAN_FAILS(w, "blocks (blocks): chunks cover 101 of 110 elements (gap at "
                "offsets [3,8] sizes [3,3]), ranks 0-3");
  world_free(w);

  w = world_new(4);
  add_grid(w, "cube", 3, c3, (int[]){3, 3, 4}, 11);
  PLAN_FAILS(w, "cube (cube): chunks cover 120 of 126 elements (gap at "
                "offsets [1,5,6] sizes [1,2,3])");
  world_free(w);
}

/* A brick wall: rows of one element, each split at its own columns, so
 * the grid of cut points is too large and the sweep checks it. */
static void add_bricks(world_t *w, const char *path, int rows, int per_row,
                       int64_t width, int extra_dim, int64_t shift_bad) {
  for (int i = 0; i < rows; i++) {
    int64_t start = 0;
    for (int j = 0; j < per_row; j++) {
      int64_t end = j == per_row - 1
                        ? width
                        : (j + 1) * (width / per_row) + (i * 7 + j) % 5;
      int64_t s = start;
      if (i == rows / 2 && j == 1)
        s += shift_bad; /* < 0: overlap, > 0: gap */
      if (extra_dim) {
        chunk(w, (i + j) % w->n, path, F32, 3, DIMS(rows, 2, width),
              DIMS(i, 0, s), DIMS(1, 2, end - s));
      } else {
        chunk(w, (i + j) % w->n, path, F32, 2, DIMS(rows, width), DIMS(i, s),
              DIMS(1, end - s));
      }
      start = end;
    }
  }
}

static void test_plan_bricks(void **state) {
  (void)state;
  for (int extra = 0; extra < 2; extra++) {
    world_t *w = world_new(3);
    add_bricks(w, "wall", 40, 10, 1000, extra, 0);
    plan_ok(w);
    assert_int_equal(w->gp.meta.chunks[0].rank, 0);
    assert_int_equal(w->gp.meta.n_chunks, 400);
    world_free(w);

    w = world_new(3);
    add_bricks(w, "wall", 40, 10, 1000, extra, -1);
    PLAN_FAILS(w, "wall (wall): chunks overlap: rank 2 offsets [20,0");
    assert_contains(w->gp.errors, "and rank 0 offsets [20,");
    world_free(w);

    w = world_new(3);
    add_bricks(w, "wall", 40, 10, 1000, extra, 2);
    if (extra)
      PLAN_FAILS(w, "wall (wall): chunks cover 79996 of 80000 elements "
                    "(gap), ranks 0,1,2");
    else
      PLAN_FAILS(w, "wall (wall): chunks cover 39998 of 40000 elements "
                    "(gap), ranks 0,1,2");
    world_free(w);
  }
}

static void test_plan_large_grid(void **state) {
  (void)state;
  /* 100k chunks: a quadratic check would not finish in the test timeout */
  enum { R = 250, C = 400 };
  for (int missing = 0; missing < 2; missing++) {
    world_t *w = world_new(4);
    for (int i = 0; i < R; i++) {
      for (int j = 0; j < C; j++) {
        if (missing && i == 123 && j == 321)
          continue;
        chunk(w, (i * C + j) % 4, "big/w", CKPT_DTYPE_BFLOAT16, 2,
              DIMS(R * 2, C * 3), DIMS(2 * i, 3 * j), DIMS(2, 3));
      }
    }
    if (!missing) {
      plan_ok(w);
      assert_int_equal(w->gp.meta.n_chunks, R * C);
      const ckpt_chunk_meta_t *last = &w->gp.meta.chunks[R * C - 1];
      assert_int_equal(last->dims[0], 2 * (R - 1));
      assert_int_equal(last->dims[1], 3 * (C - 1));
      for (int32_t r = 0; r < 4; r++)
        assert_int_equal(rank_bytes(w, r), R * C / 4 * 12);
    } else {
      PLAN_FAILS(w, "big.w (big/w): chunks cover 599994 of 600000 elements "
                    "(gap at offsets [246,963] sizes [2,3]), ranks 0-3");
    }
    world_free(w);
  }
}

/* ------------------------------------------------------------------------
 * Global plans: validation failures.
 * ---------------------------------------------------------------------- */

static void test_plan_bad_length(void **state) {
  (void)state;
  world_t *w = world_new(2);
  chunk(w, 0, "layer/short_tensor", F32, 2, DIMS(8, 4), DIMS(0, 0), DIMS(4, 4));
  chunk_len(w, 1, "layer/short_tensor", F32, 2, DIMS(8, 4), DIMS(4, 0),
            DIMS(4, 4), 60, 1);
  PLAN_FAILS(w, "layer.short_tensor (layer/short_tensor): rank 1 wrote 60 "
                "bytes, 64 expected (sizes 4x4 x float32)");
  assert_int_equal(count_lines(w->gp.errors), 1);
  world_free(w);
}

static void test_plan_overlap(void **state) {
  (void)state;
  world_t *w = world_new(2);
  chunk(w, 0, "overlapping/w", F32, 2, DIMS(8, 2), DIMS(0, 0), DIMS(4, 2));
  chunk(w, 1, "overlapping/w", F32, 2, DIMS(8, 2), DIMS(3, 0), DIMS(4, 2));
  PLAN_FAILS(w, "overlapping.w (overlapping/w): chunks overlap: rank 0 "
                "offsets [0,0] sizes [4,2] and rank 1 offsets [3,0] sizes "
                "[4,2]");
  world_free(w);

  /* same offsets, different sizes */
  w = world_new(2);
  chunk(w, 0, "w", F32, 1, DIMS(8), DIMS(0), DIMS(8));
  chunk(w, 1, "w", F32, 1, DIMS(8), DIMS(0), DIMS(4));
  PLAN_FAILS(w, "w (w): chunks overlap: rank 1 offsets [0] sizes [4] and "
                "rank 0 offsets [0] sizes [8]");
  world_free(w);
}

static void test_plan_gap(void **state) {
  (void)state;
  world_t *w = world_new(3);
  for (int32_t r = 0; r < 3; r++)
    chunk(w, r, "w", F32, 1, DIMS(16), DIMS(4 * r), DIMS(4));
  PLAN_FAILS(w, "w (w): chunks cover 12 of 16 elements (gap at offsets [12] "
                "sizes [4]), ranks 0,1,2");
  world_free(w);

  /* only empty chunks: all of it is a gap */
  w = world_new(1);
  chunk(w, 0, "w", F32, 2, DIMS(2, 3), DIMS(0, 0), DIMS(0, 3));
  PLAN_FAILS(w, "w (w): chunks cover 0 of 6 elements (gap at offsets [0,0] "
                "sizes [2,3]), rank 0");
  world_free(w);
}

static void test_plan_outside(void **state) {
  (void)state;
  world_t *w = world_new(4);
  chunk(w, 0, "w", F32, 1, DIMS(5), DIMS(0), DIMS(4));
  chunk(w, 3, "w", F32, 1, DIMS(5), DIMS(4), DIMS(2));
  PLAN_FAILS(w, "w (w): chunk of rank 3 offsets [4] sizes [2] lies outside "
                "shape [5]");
  /* no coverage verdict on a tensor whose chunks are out of bounds */
  assert_int_equal(count_lines(w->gp.errors), 1);
  world_free(w);

  /* offsets + sizes beyond INT64_MAX */
  w = world_new(1);
  chunk_len(w, 0, "w", F32, 1, DIMS(INT64_MAX), DIMS(INT64_MAX - 1),
            DIMS(INT64_MAX), 0, 0);
  PLAN_FAILS(w, "w (w): shape [9223372036854775807] x float32 is larger "
                "than 2^64 bytes");
  world_free(w);

  w = world_new(1);
  chunk_len(w, 0, "w", F32, 1, DIMS(10), DIMS(9), DIMS(INT64_MAX), 0, 0);
  PLAN_FAILS(w, "w (w): chunk of rank 0 offsets [9] sizes "
                "[9223372036854775807] lies outside shape [10]");
  world_free(w);
}

static void test_plan_disagreements(void **state) {
  (void)state;
  world_t *w = world_new(3);
  chunk(w, 0, "w", F32, 1, DIMS(4), DIMS(0), DIMS(2));
  chunk(w, 2, "w", CKPT_DTYPE_FLOAT64, 1, DIMS(4), DIMS(2), DIMS(2));
  PLAN_FAILS(w, "w (w): dtype disagrees: rank 0 float32, rank 2 float64");
  world_free(w);

  w = world_new(4);
  chunk(w, 0, "w", F32, 2, DIMS(4, 4), DIMS(0, 0), DIMS(1, 4));
  chunk(w, 1, "w", F32, 2, DIMS(4, 4), DIMS(1, 0), DIMS(1, 4));
  chunk(w, 2, "w", F32, 2, DIMS(4, 5), DIMS(2, 0), DIMS(2, 5));
  chunk(w, 3, "w", F32, 1, DIMS(16), DIMS(12), DIMS(4));
  PLAN_FAILS(w, "w (w): shape disagrees: ranks 0,1 [4,4], rank 2 [4,5], "
                "rank 3 [16]");
  world_free(w);

  w = world_new(2);
  chunk(w, 0, "a/b.c", F32, 1, DIMS(4), NULL, NULL);
  chunk(w, 1, "a.b/c", F32, 1, DIMS(4), NULL, NULL);
  PLAN_FAILS(w, "a.b.c: two paths for one FQN: a/b.c (rank 0) and a.b/c "
                "(rank 1)");
  world_free(w);

  w = world_new(3);
  chunk(w, 0, "w", F32, 1, DIMS(4), NULL, NULL);
  blob(w, 1, "w", 16, 5);
  blob(w, 2, "w", 16, 5);
  PLAN_FAILS(w, "w (w): tensor on rank 0 but bytes item on ranks 1,2");
  world_free(w);
}

static void test_plan_replicas(void **state) {
  (void)state;
  static const ckpt_replica_check_t modes[] = {
      CKPT_REPLICA_ERROR, CKPT_REPLICA_WARN, CKPT_REPLICA_OFF};
  const char *line = "w (w): replicas differ: ranks 0,1,3 checksum "
                     "0123456789abcdef, rank 2 checksum fedcba9876543210";
  for (size_t i = 0; i < N_OF(modes); i++) {
    world_t *w = world_new(4);
    w->opts.replica_check = modes[i];
    for (int32_t r = 0; r < 4; r++)
      chunk_len(w, r, "w", F32, 1, DIMS(4), NULL, NULL, 16,
                r == 2 ? 0xfedcba9876543210ull : 0x0123456789abcdefull);
    if (modes[i] == CKPT_REPLICA_ERROR) {
      static const char *const lines[] = {
          "w (w): replicas differ: ranks 0,1,3 checksum 0123456789abcdef, "
          "rank 2 checksum fedcba9876543210"};
      plan_fails(w, lines, 1);
      assert_null(w->gp.warnings);
    } else {
      plan_ok(w);
      assert_int_equal(w->gp.meta.n_chunks, 1);
      if (modes[i] == CKPT_REPLICA_WARN)
        assert_string_equal(w->gp.warnings, line);
      else
        assert_null(w->gp.warnings);
    }
    world_free(w);
  }

  /* a replicated shard of a sharded tensor names the chunk */
  world_t *w = world_new(3);
  chunk(w, 0, "w", F32, 1, DIMS(4), DIMS(0), DIMS(2));
  chunk_len(w, 1, "w", F32, 1, DIMS(4), DIMS(0), DIMS(2), 8, 0xab);
  chunk(w, 2, "w", F32, 1, DIMS(4), DIMS(2), DIMS(2));
  PLAN_FAILS(w, "w (w): replicas of chunk offsets [0] sizes [2] differ: "
                "rank 0 checksum");
  assert_contains(w->gp.errors, ", rank 1 checksum 00000000000000ab");
  world_free(w);
}

static void test_plan_bytes_replicas(void **state) {
  (void)state;
  world_t *w = world_new(3);
  for (int32_t r = 0; r < 3; r++)
    blob(w, r, "optim/config", 100, 42);
  plan_ok(w);
  assert_int_equal(w->gp.meta.n_blobs, 1);
  assert_int_equal(rank_bytes(w, 0) + rank_bytes(w, 1) + rank_bytes(w, 2), 100);
  world_free(w);

  w = world_new(3);
  blob(w, 0, "rng", 10, 1);
  blob(w, 1, "rng", 12, 1);
  blob(w, 2, "rng", 10, 1);
  PLAN_FAILS(w, "rng (rng): replicas differ: ranks 0,2 10 bytes checksum "
                "0000000000000001, rank 1 12 bytes checksum "
                "0000000000000001");
  world_free(w);
}

static void test_plan_local_errors_and_cap(void **state) {
  (void)state;
  world_t *w = world_new(2);
  assert_int_equal(ckpt_local_plan_add_error(
                       &w->lp[1], "%s", "model/x: missing user.ckpt.shape"),
                   0);
  assert_int_equal(ckpt_local_plan_add_error(&w->lp[1], "model/y: second"), 0);
  PLAN_FAILS(w, "rank 1: model/x: missing user.ckpt.shape\n"
                "rank 1: model/y: second");
  world_free(w);

  /* 60 problems: 50 lines, then the count of the rest, in FQN order */
  w = world_new(1);
  char path[32];
  for (int i = 59; i >= 0; i--) {
    snprintf(path, sizeof(path), "t%02d", i);
    chunk_len(w, 0, path, F32, 1, DIMS(4), NULL, NULL, 15, 0);
  }
  PLAN_FAILS(w, "t00 (t00): rank 0 wrote 15 bytes, 16 expected",
             "t49 (t49): rank 0 wrote 15 bytes", "\n... and 10 more problems");
  assert_int_equal(count_lines(w->gp.errors), 51);
  assert_true(strstr(w->gp.errors, "t50") == NULL);
  assert_true(strstr(w->gp.errors, "t01") > strstr(w->gp.errors, "t00"));
  world_free(w);

  /* a newline in a name does not break the one-problem-per-line rule */
  w = world_new(1);
  chunk_len(w, 0, "a\nb", F32, 1, DIMS(4), NULL, NULL, 1, 0);
  PLAN_FAILS(w, "a?b (a?b): rank 0 wrote 1 bytes");
  assert_int_equal(count_lines(w->gp.errors), 1);
  world_free(w);
}

static void test_plan_invalid_items(void **state) {
  (void)state;
  world_t *w = world_new(2);
  chunk_len(w, 1, "w", F32, 2, DIMS(4, -1), NULL, NULL, 0, 0);
  chunk_len(w, 0, "v", (ckpt_dtype_t)99, 1, DIMS(4), NULL, NULL, 4, 0);
  PLAN_FAILS(w, "v (v): rank 0 gave an invalid dtype (99)",
             "w (w): rank 1 gave a negative dimension: shape [4,-1] offsets "
             "[0,0] sizes [4,-1]");
  world_free(w);
}

static void test_plan_unusable(void **state) {
  (void)state;
  world_t *w = world_new(2);
  ckpt_global_plan_t gp;
  assert_int_equal(ckpt_plan_global(w->lp, 0, &w->opts, &gp), -EINVAL);
  assert_null(gp.ranks);
  assert_int_equal(ckpt_plan_global(w->lp, 2, NULL, &gp), -EINVAL);
  w->opts.io_threads = 0;
  assert_int_equal(ckpt_plan_global(w->lp, 2, &w->opts, &gp), -EINVAL);
  w->opts.io_threads = 1;
  w->lp[1].rank = 0;
  assert_int_equal(ckpt_plan_global(w->lp, 2, &w->opts, &gp), -EINVAL);
  w->lp[1].rank = 1;
  blob(w, 0, "x", 1, 1);
  w->lp[0].items[0].ndim = 1; /* a bytes item with dimensions */
  assert_int_equal(ckpt_plan_global(w->lp, 2, &w->opts, &gp), -EINVAL);
  w->lp[0].items[0].ndim = 0;
  w->lp[0].items[0].kind = (ckpt_item_kind_t)7;
  assert_int_equal(ckpt_plan_global(w->lp, 2, &w->opts, &gp), -EINVAL);
  world_free(w);
}

/* ------------------------------------------------------------------------
 * Global plans: dedup, balance, files.
 * ---------------------------------------------------------------------- */

static void test_plan_dedup_balance(void **state) {
  (void)state;
  world_t *w = world_new(4);
  blob(w, 0, "unique0", 100, 1);
  /* replicated on every rank, largest first: 80 -> r1, 60 -> r2, 40 -> r3,
   * then 20 -> r3 (40 is the smallest total) */
  static const uint64_t sizes[] = {20, 60, 80, 40};
  char path[16];
  for (size_t i = 0; i < N_OF(sizes); i++) {
    snprintf(path, sizeof(path), "rep%zu", i);
    for (int32_t r = 0; r < 4; r++)
      blob(w, r, path, sizes[i], 9);
  }
  plan_ok(w);
  assert_int_equal(rank_bytes(w, 0), 100);
  assert_int_equal(rank_bytes(w, 1), 80);
  assert_int_equal(rank_bytes(w, 2), 60);
  assert_int_equal(rank_bytes(w, 3), 60);
  world_free(w);

  /* ties go to the lowest rank; only holders are candidates */
  w = world_new(4);
  chunk(w, 2, "a", F32, 1, DIMS(4), NULL, NULL);
  chunk(w, 3, "a", F32, 1, DIMS(4), NULL, NULL);
  chunk(w, 3, "b", F32, 1, DIMS(4), NULL, NULL);
  chunk(w, 1, "b", F32, 1, DIMS(4), NULL, NULL);
  plan_ok(w);
  assert_int_equal(w->gp.meta.chunks[0].rank, 2);
  assert_int_equal(w->gp.meta.chunks[1].rank, 1);
  assert_int_equal(rank_bytes(w, 0), 0);
  assert_int_equal(rank_bytes(w, 3), 0);
  world_free(w);

  /* many replicated tensors: every rank within one item of the mean */
  w = world_new(8);
  uint64_t total = 0, largest = 0;
  for (int i = 0; i < 200; i++) {
    snprintf(path, sizeof(path), "t%03d", i);
    int64_t n = 1 + (i * 37) % 101;
    for (int32_t r = 0; r < 8; r++)
      chunk(w, r, path, F32, 1, DIMS(n), NULL, NULL);
    total += (uint64_t)n * 4;
    largest = (uint64_t)n * 4 > largest ? (uint64_t)n * 4 : largest;
  }
  plan_ok(w);
  for (int32_t r = 0; r < 8; r++) {
    uint64_t b = rank_bytes(w, r);
    assert_true(b + largest >= total / 8 && b <= total / 8 + largest);
  }
  world_free(w);
}

static void test_plan_files(void **state) {
  (void)state;
  world_t *w = world_new(1);
  w->opts.io_threads = 3;
  /* largest first into the least full file:
   * e 100k -> f0, d 70k -> f1, c 50k -> f2, b 30k -> f2 (50k),
   * a 10 -> f1 (70k), z 0 -> f1 (70010 < 80k) */
  blob(w, 0, "e", 102400, 1);
  blob(w, 0, "d", 71680, 2);
  blob(w, 0, "c", 51200, 3);
  blob(w, 0, "b", 30720, 4);
  blob(w, 0, "a", 10, 5);
  blob(w, 0, "z", 0, 6);
  plan_ok(w);
  const ckpt_rank_plan_t *rp = &w->gp.ranks[0];
  assert_int_equal(rp->n_files, 3);
  assert_int_equal(rp->n_assign, 6);
  /* file 0: e; file 1 in FQN order: a (10 bytes at 0), d (aligned to
   * 4096), z (packed after d); file 2: b then c, both small: packed */
  static const struct {
    const char *fqn;
    uint32_t file;
    uint64_t off;
  } want[] = {{"e", 0, 0},     {"a", 1, 0}, {"d", 1, 4096},
              {"z", 1, 75776}, {"b", 2, 0}, {"c", 2, 30720}};
  for (size_t i = 0; i < N_OF(want); i++) {
    const ckpt_assignment_t *a = &rp->assign[i];
    assert_string_equal(find_item(w, 0, a->local_id)->fqn, want[i].fqn);
    assert_int_equal(a->file, want[i].file);
    assert_int_equal(a->file_offset, want[i].off);
  }
  assert_int_equal(rp->file_bytes[0], 102400);
  assert_int_equal(rp->file_bytes[1], 75776);
  assert_int_equal(rp->file_bytes[2], 81920);
  world_free(w);

  /* more threads than items: only the files used */
  w = world_new(2);
  w->opts.io_threads = 16;
  blob(w, 0, "x", 5, 1);
  blob(w, 0, "y", 6, 1);
  blob(w, 1, "y", 6, 1);
  plan_ok(w);
  assert_int_equal(w->gp.ranks[0].n_files, 1);
  assert_int_equal(w->gp.ranks[1].n_files, 1);
  world_free(w);

  /* a rank with nothing to write has no files */
  w = world_new(3);
  blob(w, 1, "x", 5, 1);
  plan_ok(w);
  assert_int_equal(w->gp.ranks[0].n_files, 0);
  assert_null(w->gp.ranks[0].assign);
  assert_int_equal(w->gp.ranks[1].n_files, 1);
  world_free(w);

  /* many items over several files: balanced by bytes */
  w = world_new(1);
  w->opts.io_threads = 4;
  char path[16];
  for (int i = 0; i < 100; i++) {
    snprintf(path, sizeof(path), "p%03d", i);
    blob(w, 0, path, 1000 + (uint64_t)(i * 7919) % 90000, 1);
  }
  plan_ok(w);
  rp = &w->gp.ranks[0];
  assert_int_equal(rp->n_files, 4);
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint32_t k = 0; k < 4; k++) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < rp->n_assign; i++)
      sum += rp->assign[i].file == k ? rp->assign[i].length : 0;
    lo = sum < lo ? sum : lo;
    hi = sum > hi ? sum : hi;
  }
  assert_true(hi - lo <= 91000);
  world_free(w);
}

/* ------------------------------------------------------------------------
 * Global plans: write-behind (reservations and pinned items).
 * ---------------------------------------------------------------------- */

/* Pin the last item added to rank r. */
static void pin_last(world_t *w, int32_t r, uint32_t file, uint64_t off) {
  ckpt_local_plan_t *lp = &w->lp[r];
  assert_int_equal(ckpt_local_plan_pin(lp, lp->n_items - 1, file, off), 0);
}

static void reserve(world_t *w, int32_t r, uint32_t file, uint64_t bytes) {
  assert_int_equal(ckpt_local_plan_reserve(&w->lp[r], file, bytes), 0);
}

/* The assignment of rank r for the item named fqn (first one). */
static const ckpt_assignment_t *assign_of(const world_t *w, int32_t r,
                                          const char *fqn) {
  const ckpt_rank_plan_t *rp = &w->gp.ranks[r];
  for (uint32_t i = 0; i < rp->n_assign; i++) {
    if (strcmp(find_item(w, r, rp->assign[i].local_id)->fqn, fqn) == 0)
      return &rp->assign[i];
  }
  return NULL;
}

static void expect_at(const world_t *w, int32_t r, const char *fqn,
                      uint32_t file, uint64_t off) {
  const ckpt_assignment_t *a = assign_of(w, r, fqn);
  if (a == NULL) {
    print_error("%s not assigned to rank %d\n", fqn, (int)r);
    fail();
  }
  if (a->file != file || a->file_offset != off) {
    print_error("%s: file %u offset %llu, want file %u offset %llu\n", fqn,
                (unsigned)a->file, (unsigned long long)a->file_offset,
                (unsigned)file, (unsigned long long)off);
    fail();
  }
}

static void test_local_plan_pins(void **state) {
  (void)state;
  ckpt_local_plan_t lp;
  ckpt_local_plan_init(&lp, 2);
  assert_int_equal(ckpt_local_plan_add_bytes(&lp, "a", 10, 1, 1), 0);
  assert_int_equal(ckpt_local_plan_add_tensor(&lp, "b", CKPT_DTYPE_INT8, 1,
                                              DIMS(4), NULL, NULL, 4, 2, 2),
                   0);
  assert_int_equal(lp.items[0].pin_file, CKPT_NO_PIN);
  assert_int_equal(lp.items[1].pin_file, CKPT_NO_PIN);
  assert_int_equal(ckpt_local_plan_pin(&lp, 1, 3, 4096), 0);
  assert_int_equal(lp.items[1].pin_file, 3);
  assert_int_equal(lp.items[1].pin_offset, 4096);
  assert_int_equal(ckpt_local_plan_pin(&lp, 2, 0, 0), -EINVAL);
  assert_int_equal(ckpt_local_plan_pin(&lp, UINT32_MAX, 0, 0), -EINVAL);
  assert_int_equal(ckpt_local_plan_pin(&lp, 1, CKPT_NO_PIN, 7), 0);
  assert_int_equal(lp.items[1].pin_file, CKPT_NO_PIN);

  assert_int_equal(lp.n_reserved, 0);
  assert_null(lp.reserved);
  assert_int_equal(ckpt_local_plan_reserve(&lp, 2, 500), 0);
  assert_int_equal(lp.n_reserved, 3);
  assert_int_equal(lp.reserved[0], 0);
  assert_int_equal(lp.reserved[1], 0);
  assert_int_equal(lp.reserved[2], 500);
  assert_int_equal(ckpt_local_plan_reserve(&lp, 0, 7), 0);
  assert_int_equal(ckpt_local_plan_reserve(&lp, 2, 600), 0);
  assert_int_equal(lp.n_reserved, 3);
  assert_int_equal(lp.reserved[0], 7);
  assert_int_equal(lp.reserved[2], 600);
  assert_int_equal(ckpt_local_plan_reserve(&lp, CKPT_NO_PIN, 1), -EINVAL);
  ckpt_local_plan_free(&lp);
  assert_int_equal(lp.n_reserved, 0);
  assert_null(lp.reserved);
  assert_int_equal(lp.n_items, 0);
  assert_int_equal(lp.rank, 2);
}

static void test_plan_pins_respected(void **state) {
  (void)state;
  /* pinned items stay, exact offsets; the others are appended after the
   * reservation of the least full file */
  world_t *w = world_new(1);
  w->opts.io_threads = 2;
  reserve(w, 0, 0, 1000);
  blob(w, 0, "a", 100, 1);
  pin_last(w, 0, 0, 0);
  blob(w, 0, "b", 300, 2);
  pin_last(w, 0, 0, 200);
  chunk(w, 0, "t", F32, 1, DIMS(8), NULL, NULL); /* 32 bytes */
  pin_last(w, 0, 0, 600);
  blob(w, 0, "c", 50, 3);
  blob(w, 0, "d", 100000, 4);
  plan_ok(w);
  /* loads [1000, 0]: d -> file 1 at 0, then c -> file 0 (1000 < 100000) */
  const ckpt_rank_plan_t *rp = &w->gp.ranks[0];
  assert_int_equal(rp->n_files, 2);
  assert_int_equal(rp->n_assign, 5);
  expect_at(w, 0, "a", 0, 0);
  expect_at(w, 0, "b", 0, 200);
  expect_at(w, 0, "t", 0, 600);
  expect_at(w, 0, "c", 0, 1000);
  expect_at(w, 0, "d", 1, 0);
  assert_int_equal(rp->file_bytes[0], 1050);
  assert_int_equal(rp->file_bytes[1], 100000);
  /* grouped by file, by offset */
  static const char *const order[] = {"a", "b", "t", "c", "d"};
  for (size_t i = 0; i < N_OF(order); i++)
    assert_string_equal(find_item(w, 0, rp->assign[i].local_id)->fqn,
                        order[i]);
  /* meta follows the assignment */
  assert_int_equal(w->gp.meta.n_chunks, 1);
  assert_int_equal(w->gp.meta.chunks[0].file, 0);
  assert_int_equal(w->gp.meta.chunks[0].file_offset, 600);
  assert_int_equal(w->gp.meta.n_blobs, 4);
  assert_string_equal(w->gp.meta.blobs[1].fqn, "b");
  assert_int_equal(w->gp.meta.blobs[1].file_offset, 200);
  world_free(w);

  /* files up to the last one holding something, empty ones included */
  w = world_new(2);
  reserve(w, 0, 2, 100);
  blob(w, 0, "x", 100, 1);
  pin_last(w, 0, 2, 0);
  reserve(w, 1, 0, 64); /* nothing kept, the file still exists */
  reserve(w, 1, 3, 0);
  plan_ok(w);
  const ckpt_rank_plan_t *r0 = &w->gp.ranks[0], *r1 = &w->gp.ranks[1];
  assert_int_equal(r0->n_files, 3);
  assert_int_equal(r0->file_bytes[0], 0);
  assert_int_equal(r0->file_bytes[1], 0);
  assert_int_equal(r0->file_bytes[2], 100);
  assert_int_equal(r0->n_assign, 1);
  expect_at(w, 0, "x", 2, 0);
  assert_int_equal(r1->n_files, 1);
  assert_int_equal(r1->file_bytes[0], 64);
  assert_int_equal(r1->n_assign, 0);

  /* the plan's rank plans are valid messages */
  for (int32_t r = 0; r < 2; r++) {
    ckpt_buf_t msg;
    ckpt_rank_plan_t back;
    ckpt_buf_init(&msg);
    assert_int_equal(ckpt_msg_encode_rank_plan(&w->gp.ranks[r], &msg), 0);
    assert_int_equal(ckpt_msg_decode_rank_plan(msg.data, msg.len, &back), 0);
    ckpt_rank_plan_free(&back);
    ckpt_buf_free(&msg);
  }
  world_free(w);

  /* pins that touch are fine; so is a zero-length pin at the end */
  w = world_new(1);
  reserve(w, 0, 1, 200);
  blob(w, 0, "p", 100, 1);
  pin_last(w, 0, 1, 100);
  blob(w, 0, "q", 100, 2);
  pin_last(w, 0, 1, 0);
  blob(w, 0, "z", 0, 3);
  pin_last(w, 0, 1, 200);
  blob(w, 0, "u", 10, 4);
  plan_ok(w);
  expect_at(w, 0, "q", 1, 0);
  expect_at(w, 0, "p", 1, 100);
  expect_at(w, 0, "z", 1, 200);
  expect_at(w, 0, "u", 0, 0);
  assert_int_equal(w->gp.ranks[0].n_files, 2);
  assert_int_equal(w->gp.ranks[0].file_bytes[0], 10);
  assert_int_equal(w->gp.ranks[0].file_bytes[1], 200);
  world_free(w);
}

static void test_plan_pins_append_aligned(void **state) {
  (void)state;
  /* one file: appended in FQN order after the (unaligned) reservation,
   * small items packed, large ones aligned */
  world_t *w = world_new(1);
  w->opts.io_threads = 1;
  reserve(w, 0, 0, 5000);
  blob(w, 0, "old", 4000, 1);
  pin_last(w, 0, 0, 1000);
  blob(w, 0, "a", 10, 2);
  blob(w, 0, "e", 70000, 3);
  blob(w, 0, "f", 10, 4);
  plan_ok(w);
  expect_at(w, 0, "old", 0, 1000);
  expect_at(w, 0, "a", 0, 5000);
  expect_at(w, 0, "e", 0, 8192);
  expect_at(w, 0, "f", 0, 78192);
  assert_int_equal(w->gp.ranks[0].n_files, 1);
  assert_int_equal(w->gp.ranks[0].file_bytes[0], 78202);
  world_free(w);

  /* a large first item after an aligned reservation is not moved */
  w = world_new(1);
  w->opts.io_threads = 1;
  reserve(w, 0, 0, 8192);
  blob(w, 0, "big", 65536, 1);
  plan_ok(w);
  expect_at(w, 0, "big", 0, 8192);
  assert_int_equal(w->gp.ranks[0].file_bytes[0], 8192 + 65536);
  world_free(w);
}

static void test_plan_pins_balance(void **state) {
  (void)state;
  /* loads start at the reservations: [3000, 0, 1000];
   * p0 -> f1 (1000), p1 -> f1 (tie with f2, lowest K; 2000), p2 -> f2
   * (2000), p3 -> f1 (tie, 3000) */
  world_t *w = world_new(1);
  w->opts.io_threads = 3;
  reserve(w, 0, 0, 3000);
  reserve(w, 0, 2, 1000);
  char path[8];
  for (int i = 0; i < 4; i++) {
    snprintf(path, sizeof(path), "p%d", i);
    blob(w, 0, path, 1000, (uint64_t)i);
  }
  plan_ok(w);
  const ckpt_rank_plan_t *rp = &w->gp.ranks[0];
  assert_int_equal(rp->n_files, 3);
  expect_at(w, 0, "p0", 1, 0);
  expect_at(w, 0, "p1", 1, 1000);
  expect_at(w, 0, "p3", 1, 2000);
  expect_at(w, 0, "p2", 2, 1000);
  assert_int_equal(rp->file_bytes[0], 3000);
  assert_int_equal(rp->file_bytes[1], 3000);
  assert_int_equal(rp->file_bytes[2], 2000);
  world_free(w);

  /* many items: the files end within one item of each other */
  w = world_new(1);
  w->opts.io_threads = 4;
  reserve(w, 0, 0, 500000);
  reserve(w, 0, 3, 200000);
  for (int i = 0; i < 100; i++) {
    snprintf(path, sizeof(path), "q%03d", i);
    blob(w, 0, path, 1000 + (uint64_t)(i * 7919) % 30000, 1);
  }
  plan_ok(w);
  rp = &w->gp.ranks[0];
  assert_int_equal(rp->n_files, 4);
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint32_t k = 0; k < 4; k++) {
    lo = rp->file_bytes[k] < lo ? rp->file_bytes[k] : lo;
    hi = rp->file_bytes[k] > hi ? rp->file_bytes[k] : hi;
  }
  assert_true(hi - lo <= 31000 + 4096);
  world_free(w);

  /* zero reservations change nothing: same plan as without */
  world_t *a = world_new(2), *b = world_new(2);
  a->opts.io_threads = b->opts.io_threads = 3;
  for (int i = 0; i < 20; i++) {
    snprintf(path, sizeof(path), "z%02d", i);
    blob(a, i % 2, path, 100 + (uint64_t)i * 9000, 1);
    blob(b, i % 2, path, 100 + (uint64_t)i * 9000, 1);
  }
  reserve(b, 0, 2, 0);
  reserve(b, 1, 7, 0); /* zero beyond io_threads: no error either */
  plan_ok(a);
  plan_ok(b);
  for (int32_t r = 0; r < 2; r++) {
    const ckpt_rank_plan_t *x = &a->gp.ranks[r], *y = &b->gp.ranks[r];
    assert_int_equal(x->n_files, y->n_files);
    assert_int_equal(x->n_assign, y->n_assign);
    assert_memory_equal(x->file_bytes, y->file_bytes,
                        x->n_files * sizeof(uint64_t));
    assert_memory_equal(x->assign, y->assign,
                        x->n_assign * sizeof(ckpt_assignment_t));
  }
  world_free(a);
  world_free(b);
}

static void test_plan_pins_dedup(void **state) {
  (void)state;
  /* rank 2 is the most loaded, but it has x pinned: it keeps x */
  world_t *w = world_new(3);
  for (int32_t r = 0; r < 3; r++)
    blob(w, r, "x", 100, 5);
  blob(w, 2, "heavy", 1000, 6);
  reserve(w, 2, 0, 100);
  w->lp[2].items[0].pin_file = 0;
  w->lp[2].items[0].pin_offset = 0;
  plan_ok(w);
  assert_int_equal(w->gp.meta.blobs[1].rank, 2);
  assert_string_equal(w->gp.meta.blobs[1].fqn, "x");
  expect_at(w, 2, "x", 0, 0);
  expect_at(w, 2, "heavy", 1, 0);
  assert_int_equal(rank_bytes(w, 0), 0);
  assert_int_equal(rank_bytes(w, 1), 0);
  world_free(w);

  /* two pinned holders: the least loaded of them; the other pin is
   * dropped and its bytes stay dead space in its file */
  w = world_new(3);
  for (int32_t r = 0; r < 3; r++)
    blob(w, r, "x", 100, 5);
  blob(w, 2, "heavy", 1000, 6);
  blob(w, 1, "light", 10, 7);
  for (int32_t r = 1; r < 3; r++) {
    reserve(w, r, 0, 100);
    assert_int_equal(ckpt_local_plan_pin(&w->lp[r], 0, 0, 0), 0);
  }
  plan_ok(w);
  assert_int_equal(w->gp.meta.blobs[2].rank, 1);
  assert_string_equal(w->gp.meta.blobs[2].fqn, "x");
  expect_at(w, 1, "x", 0, 0);
  expect_at(w, 1, "light", 1, 0);
  const ckpt_rank_plan_t *r2 = &w->gp.ranks[2];
  assert_null(assign_of(w, 2, "x"));
  assert_int_equal(r2->n_assign, 1);
  expect_at(w, 2, "heavy", 1, 0);
  assert_int_equal(r2->n_files, 2);
  assert_int_equal(r2->file_bytes[0], 100);
  assert_int_equal(r2->file_bytes[1], 1000);
  world_free(w);

  /* a replicated chunk: meta names the pinned copy */
  w = world_new(2);
  chunk(w, 0, "t", F32, 1, DIMS(4), NULL, NULL);
  chunk(w, 1, "t", F32, 1, DIMS(4), NULL, NULL);
  reserve(w, 1, 1, 48);
  pin_last(w, 1, 1, 32);
  plan_ok(w);
  assert_int_equal(w->gp.meta.chunks[0].rank, 1);
  assert_int_equal(w->gp.meta.chunks[0].file, 1);
  assert_int_equal(w->gp.meta.chunks[0].file_offset, 32);
  assert_int_equal(w->gp.ranks[1].n_files, 2);
  assert_int_equal(w->gp.ranks[1].file_bytes[0], 0);
  assert_int_equal(w->gp.ranks[1].file_bytes[1], 48);
  assert_int_equal(rank_bytes(w, 0), 0);
  world_free(w);
}

static void test_plan_pins_invalid(void **state) {
  (void)state;
  /* outside the reservation, none or too small */
  world_t *w = world_new(2);
  blob(w, 1, "x/y", 100, 1);
  pin_last(w, 1, 2, 4096);
  blob(w, 1, "x/z", 100, 2);
  reserve(w, 1, 3, 4100);
  pin_last(w, 1, 3, 4096);
  blob(w, 1, "x/w", 10, 3);
  pin_last(w, 1, 3, UINT64_MAX - 5); /* offset + length overflows */
  PLAN_FAILS(w,
             "rank 1: x.y (x/y) pinned at file 2 offset 4096 length 100 "
             "outside its 0 reserved bytes",
             "rank 1: x.z (x/z) pinned at file 3 offset 4096 length 100 "
             "outside its 4100 reserved bytes",
             "rank 1: x.w (x/w) pinned at file 3 offset 18446744073709551610 "
             "length 10 outside its 4100 reserved bytes");
  assert_int_equal(count_lines(w->gp.errors), 3);
  world_free(w);

  /* overlapping pins, also nested ones */
  w = world_new(1);
  reserve(w, 0, 0, 1000);
  blob(w, 0, "a", 100, 1);
  pin_last(w, 0, 0, 0);
  blob(w, 0, "b", 100, 2);
  pin_last(w, 0, 0, 50);
  blob(w, 0, "c", 500, 3);
  pin_last(w, 0, 0, 400);
  blob(w, 0, "d", 10, 4);
  pin_last(w, 0, 0, 600);
  blob(w, 0, "e", 0, 5);
  pin_last(w, 0, 0, 700);
  blob(w, 0, "f", 10, 6);
  pin_last(w, 0, 0, 900); /* after c: fine */
  PLAN_FAILS(w,
             "rank 0: b (b) pinned at file 0 offset 50 length 100 overlaps "
             "a (a) at offset 0 length 100",
             "rank 0: d (d) pinned at file 0 offset 600 length 10 overlaps "
             "c (c) at offset 400 length 500",
             "rank 0: e (e) pinned at file 0 offset 700 length 0 overlaps "
             "c (c) at offset 400 length 500");
  assert_int_equal(count_lines(w->gp.errors), 3);
  world_free(w);

  /* files beyond the last pinnable one, pinned or reserved */
  w = world_new(1);
  w->opts.io_threads = 4;
  reserve(w, 0, CKPT_MAX_PIN_FILE, 10);
  blob(w, 0, "c", 10, 1);
  pin_last(w, 0, CKPT_MAX_PIN_FILE, 0);
  reserve(w, 0, CKPT_MAX_PIN_FILE + 3, 10);
  reserve(w, 0, CKPT_MAX_PIN_FILE + 5, 0); /* nothing reserved: no problem */
  PLAN_FAILS(w, "rank 0: 10 bytes reserved in file 1048576, beyond file 1048575",
             "rank 0: 10 bytes reserved in file 1048579, beyond file 1048575",
             "rank 0: c (c) pinned at file 1048576 offset 0 length 10 beyond "
             "file 1048575");
  assert_int_equal(count_lines(w->gp.errors), 3);
  world_free(w);

  /* files of their own beyond io_threads (passthrough files): pinned
   * there; the other items are balanced over the io_threads files */
  w = world_new(1);
  w->opts.io_threads = 2;
  blob(w, 0, "own", 100, 1);
  pin_last(w, 0, 5, 0);
  reserve(w, 0, 5, 100);
  blob(w, 0, "x", 10, 2);
  blob(w, 0, "y", 20, 3);
  blob(w, 0, "z", 30, 4);
  plan_ok(w);
  assert_int_equal(w->gp.ranks[0].n_files, 6);
  assert_int_equal(w->gp.ranks[0].file_bytes[5], 100);
  assert_int_equal(w->gp.ranks[0].file_bytes[0] + w->gp.ranks[0].file_bytes[1], 60);
  for (uint32_t k = 2; k < 5; k++)
    assert_int_equal(w->gp.ranks[0].file_bytes[k], 0);
  for (uint32_t a = 0; a < w->gp.ranks[0].n_assign; a++) {
    const ckpt_assignment_t *as = &w->gp.ranks[0].assign[a];
    assert_true(as->length == 100 ? as->file == 5 && as->file_offset == 0
                                  : as->file < 2);
  }
  world_free(w);

  /* pin problems come after the ranks' own errors, before the FQNs' */
  w = world_new(2);
  assert_int_equal(ckpt_local_plan_add_error(&w->lp[1], "own problem"), 0);
  blob(w, 0, "q", 10, 1);
  pin_last(w, 0, 0, 0);
  chunk_len(w, 0, "t", F32, 1, DIMS(4), NULL, NULL, 15, 1);
  ckpt_global_plan_free(&w->gp);
  assert_int_equal(ckpt_plan_global(w->lp, w->n, &w->opts, &w->gp), 0);
  assert_non_null(w->gp.errors);
  const char *own = strstr(w->gp.errors, "rank 1: own problem");
  const char *pin = strstr(w->gp.errors, "rank 0: q (q) pinned");
  const char *len = strstr(w->gp.errors, "t (t): rank 0 wrote 15 bytes");
  assert_non_null(own);
  assert_non_null(pin);
  assert_non_null(len);
  assert_true(pin > own && len > pin);
  world_free(w);

  /* a reservation array that is missing: unusable */
  w = world_new(1);
  w->lp[0].n_reserved = 2;
  assert_int_equal(ckpt_plan_global(w->lp, w->n, &w->opts, &w->gp), -EINVAL);
  w->lp[0].n_reserved = 0;
  world_free(w);
}

/* ------------------------------------------------------------------------
 * Messages.
 * ---------------------------------------------------------------------- */

static void assert_local_plans_equal(const ckpt_local_plan_t *a,
                                     const ckpt_local_plan_t *b) {
  assert_int_equal(a->rank, b->rank);
  assert_int_equal(a->n_items, b->n_items);
  if (a->errors == NULL)
    assert_null(b->errors);
  else
    assert_string_equal(a->errors, b->errors);
  for (uint32_t i = 0; i < a->n_items; i++) {
    const ckpt_write_item_t *x = &a->items[i], *y = &b->items[i];
    assert_string_equal(x->fqn, y->fqn);
    assert_string_equal(x->path, y->path);
    assert_int_equal(x->kind, y->kind);
    assert_int_equal(x->dtype, y->dtype);
    assert_int_equal(x->ndim, y->ndim);
    if (x->ndim > 0)
      assert_memory_equal(x->dims, y->dims,
                          3 * (size_t)x->ndim * sizeof(int64_t));
    assert_int_equal(x->length, y->length);
    assert_true(x->checksum == y->checksum);
    assert_int_equal(x->local_id, y->local_id);
    assert_int_equal(x->pin_file, y->pin_file);
    assert_true(x->pin_offset == y->pin_offset);
  }
  assert_int_equal(a->n_reserved, b->n_reserved);
  if (a->n_reserved > 0)
    assert_memory_equal(a->reserved, b->reserved,
                        a->n_reserved * sizeof(uint64_t));
}

static void make_local_plan(ckpt_local_plan_t *lp) {
  ckpt_local_plan_init(lp, 3);
  int64_t big[3 * CKPT_MAX_NDIM];
  for (int k = 0; k < 3 * CKPT_MAX_NDIM; k++)
    big[k] = k % 3 == 0 ? INT64_MAX : k;
  assert_int_equal(ckpt_local_plan_add_tensor(
                       lp, "model/w", CKPT_DTYPE_BFLOAT16, 2, DIMS(8, 4),
                       DIMS(4, 0), DIMS(4, 4), 32, 0xfedcba9876543210ull, 1),
                   0);
  assert_int_equal(ckpt_local_plan_add_tensor(lp, "s", CKPT_DTYPE_INT64, 0,
                                              NULL, NULL, NULL, 8, 0, 2),
                   0);
  assert_int_equal(ckpt_local_plan_add_tensor(
                       lp, "many/dims", CKPT_DTYPE_FLOAT8_E5M2, CKPT_MAX_NDIM,
                       big, big + CKPT_MAX_NDIM, big + 2 * CKPT_MAX_NDIM,
                       UINT64_MAX, UINT64_MAX, UINT32_MAX),
                   0);
  assert_int_equal(ckpt_local_plan_add_bytes(lp, "optim/é/cfg", 123, 7, 4), 0);
  assert_int_equal(ckpt_local_plan_add_bytes(lp, "", 0, 0, 0), 0);
  assert_int_equal(ckpt_local_plan_add_error(lp, "x: missing dtype"), 0);
  /* write-behind: pins (also absurd ones: not checked here) and
   * reservations, zero ones included */
  assert_int_equal(ckpt_local_plan_pin(lp, 0, 1, 4096), 0);
  assert_int_equal(ckpt_local_plan_pin(lp, 2, UINT32_MAX - 1, UINT64_MAX), 0);
  assert_int_equal(ckpt_local_plan_pin(lp, 4, 0, 0), 0);
  assert_int_equal(ckpt_local_plan_reserve(lp, 1, 8192), 0);
  assert_int_equal(ckpt_local_plan_reserve(lp, 3, UINT64_MAX), 0);
}

/* Every strict prefix of msg, and msg plus a byte, fail to decode; so does
 * each byte flipped, or decodes to something that encodes back the same. */
typedef int (*decode_fn)(const void *p, size_t n, void *out);

static int decode_lp(const void *p, size_t n, void *out) {
  return ckpt_msg_decode_local_plan(p, n, out);
}
static int decode_rp(const void *p, size_t n, void *out) {
  return ckpt_msg_decode_rank_plan(p, n, out);
}
static int decode_wr(const void *p, size_t n, void *out) {
  return ckpt_msg_decode_write_result(p, n, out);
}

static void free_lp(void *x) { ckpt_local_plan_free(x); }
static void free_rp(void *x) { ckpt_rank_plan_free(x); }
static void free_wr(void *x) { ckpt_write_result_free(x); }

static void check_malformed(const ckpt_buf_t *msg, decode_fn decode,
                            void (*release)(void *)) {
  union {
    ckpt_local_plan_t lp;
    ckpt_rank_plan_t rp;
    ckpt_write_result_t wr;
  } out;
  for (size_t n = 0; n < msg->len; n++) {
    /* exactly n bytes, so that ASan sees any overread */
    uint8_t *exact = malloc(n > 0 ? n : 1);
    assert_non_null(exact);
    memcpy(exact, msg->data, n);
    assert_int_equal(decode(exact, n, &out), -EINVAL);
    free(exact);
  }
  uint8_t *copy = malloc(msg->len + 1);
  assert_non_null(copy);
  memcpy(copy, msg->data, msg->len);
  copy[msg->len] = 0;
  assert_int_equal(decode(copy, msg->len + 1, &out), -EINVAL);
  for (size_t i = 0; i < msg->len; i++) {
    for (int bit = 0; bit < 8; bit += 3) {
      copy[i] ^= (uint8_t)(1u << bit);
      if (decode(copy, msg->len, &out) == 0)
        release(&out);
      copy[i] ^= (uint8_t)(1u << bit);
    }
  }
  free(copy);
}

static void test_msg_local_plan(void **state) {
  (void)state;
  ckpt_local_plan_t lp, back;
  ckpt_buf_t msg, again;
  make_local_plan(&lp);
  ckpt_buf_init(&msg);
  ckpt_buf_init(&again);
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_local_plans_equal(&lp, &back);
  assert_int_equal(ckpt_msg_encode_local_plan(&back, &again), 0);
  assert_int_equal(again.len, msg.len);
  assert_memory_equal(again.data, msg.data, msg.len);
  ckpt_local_plan_free(&back);
  check_malformed(&msg, decode_lp, free_lp);

  /* without pins and reservations */
  ckpt_local_plan_free(&lp);
  make_local_plan(&lp);
  for (uint32_t i = 0; i < lp.n_items; i++)
    assert_int_equal(ckpt_local_plan_pin(&lp, i, CKPT_NO_PIN, 0), 0);
  free(lp.reserved);
  lp.reserved = NULL;
  lp.n_reserved = 0;
  msg.len = 0;
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_local_plans_equal(&lp, &back);
  assert_int_equal(back.n_reserved, 0);
  assert_null(back.reserved);
  for (uint32_t i = 0; i < back.n_items; i++)
    assert_int_equal(back.items[i].pin_file, CKPT_NO_PIN);
  ckpt_local_plan_free(&back);
  check_malformed(&msg, decode_lp, free_lp);

  /* without errors, without items */
  ckpt_local_plan_free(&lp);
  ckpt_local_plan_init(&lp, 0);
  msg.len = 0;
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_local_plans_equal(&lp, &back);
  ckpt_local_plan_free(&back);
  assert_int_equal(ckpt_msg_decode_local_plan(NULL, 0, &back), -EINVAL);
  ckpt_local_plan_free(&lp);
  ckpt_buf_free(&msg);
  ckpt_buf_free(&again);
}

/* Patch a little-endian value into msg at off. */
static void patch(ckpt_buf_t *msg, size_t off, uint64_t v, size_t size) {
  for (size_t i = 0; i < size; i++)
    msg->data[off + i] = (uint8_t)(v >> (8 * i));
}

/* Staged entries' attributes: carried by the local plan, merged by the
 * global plan (permissions every rank allows, the lowest rank's owner,
 * the latest time), refused when neither a file nor a directory. */
/* Links and extended attributes of entries: checked, carried by the
 * local plan's message byte for byte, merged with the owner's. */
static void test_entry_links_xattrs(void **state) {
  (void)state;
  ckpt_xattr_t xs[2] = {{"user.a", (uint8_t *)"\0\1\377", 3},
                        {"user.b", NULL, 0}};
  ckpt_entry_attr_t ln = {"d/ln", 0120777, 1, 2, 3, "../x/../../out", 0, NULL};
  ckpt_entry_attr_t hl = {"d/f2", 0100644, 1, 2, 3, "f1", 2, xs};
  ckpt_entry_attr_t dir = {"d", 040755, 1, 2, 3, NULL, 2, xs};
  assert_int_equal(ckpt_entry_attr_check(&ln), 0);
  assert_int_equal(ckpt_entry_attr_check(&hl), 0);
  assert_int_equal(ckpt_entry_attr_check(&dir), 0);
  /* a link without a target, a directory with one, bad names, bounds */
  ckpt_entry_attr_t bad = ln;
  bad.target = NULL;
  assert_int_equal(ckpt_entry_attr_check(&bad), -EINVAL);
  bad = dir;
  bad.target = "x";
  assert_int_equal(ckpt_entry_attr_check(&bad), -EINVAL);
  ckpt_xattr_t own = {"user.ckpt.dtype", NULL, 0}, sys = {"trusted.a", NULL, 0};
  ckpt_xattr_t unsorted[2] = {xs[1], xs[0]};
  ckpt_xattr_t *bads[] = {&own, &sys, unsorted};
  uint32_t nbads[] = {1, 1, 2};
  for (int i = 0; i < 3; i++) {
    bad = dir;
    bad.xattrs = bads[i], bad.n_xattrs = nbads[i];
    assert_int_equal(ckpt_entry_attr_check(&bad), -EINVAL);
  }
  static uint8_t big[CKPT_XATTR_VALUE_MAX + 1];
  ckpt_xattr_t huge = {"user.h", big, CKPT_XATTR_VALUE_MAX + 1};
  bad = dir;
  bad.xattrs = &huge, bad.n_xattrs = 1;
  assert_int_equal(ckpt_entry_attr_check(&bad), -E2BIG);
  ckpt_xattr_t two[2] = {{"user.h1", big, CKPT_XATTR_VALUE_MAX},
                         {"user.h2", big, CKPT_XATTR_VALUE_MAX}};
  bad.xattrs = two, bad.n_xattrs = 2;
  assert_int_equal(ckpt_entry_attr_check(&bad), -ENOSPC);
  /* the message keeps every byte */
  ckpt_local_plan_t lp, back;
  ckpt_buf_t msg;
  ckpt_buf_init(&msg);
  ckpt_local_plan_init(&lp, 0);
  assert_int_equal(ckpt_local_plan_add_entry(&lp, &ln), 0);
  assert_int_equal(ckpt_local_plan_add_entry(&lp, &hl), 0);
  assert_int_equal(ckpt_local_plan_add_entry(&lp, &dir), 0);
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_int_equal(back.n_attrs, 3);
  assert_string_equal(back.attrs[0].target, "../x/../../out");
  assert_int_equal(back.attrs[0].mode, 0120777);
  assert_string_equal(back.attrs[1].target, "f1");
  assert_null(back.attrs[2].target);
  assert_int_equal(back.attrs[2].n_xattrs, 2);
  assert_string_equal(back.attrs[2].xattrs[0].name, "user.a");
  assert_int_equal(back.attrs[2].xattrs[0].len, 3);
  assert_memory_equal(back.attrs[2].xattrs[0].value, "\0\1\377", 3);
  assert_int_equal(back.attrs[2].xattrs[1].len, 0);
  ckpt_local_plan_free(&back);
  /* every shorter message is refused (and frees what it decoded) */
  for (size_t n = 0; n < msg.len; n++)
    assert_int_equal(ckpt_msg_decode_local_plan(msg.data, n, &back), -EINVAL);
  ckpt_local_plan_free(&lp);
  ckpt_buf_free(&msg);
}

static void test_entry_attrs(void **state) {
  (void)state;
  ckpt_local_plan_t lp[2], back;
  ckpt_buf_t msg;
  ckpt_buf_init(&msg);
  for (int r = 0; r < 2; r++) {
    ckpt_local_plan_init(&lp[r], r);
    assert_int_equal(ckpt_local_plan_add_tensor(&lp[r], "m/w",
                                                CKPT_DTYPE_FLOAT32, 1, DIMS(4),
                                                r ? DIMS(2) : DIMS(0),
                                                DIMS(2), 8, 1, 0),
                     0);
    assert_int_equal(ckpt_local_plan_add_attr(&lp[r], "", 040750, 10 + r,
                                              20 + r, 100 + r), 0);
    assert_int_equal(ckpt_local_plan_add_attr(&lp[r], "m", 040700 | (r ? 0 : 055),
                                              10 + r, 20 + r, 7), 0);
    assert_int_equal(ckpt_local_plan_add_attr(&lp[r], "m/w",
                                              r ? 0100640 : 0100604, 10 + r,
                                              20 + r, r ? 5 : 9), 0);
  }
  assert_int_equal(ckpt_local_plan_add_attr(&lp[0], "x", 0120777, 0, 0, 0),
                   -EINVAL); /* a symlink */
  assert_int_equal(ckpt_local_plan_add_attr(&lp[0], "x", 0104755, 0, 0, 0),
                   0); /* setuid bits are kept here, dropped at commit */
  lp[0].n_attrs--; /* not part of the rest */
  free(lp[0].attrs[lp[0].n_attrs].path);
  assert_int_equal(ckpt_msg_encode_local_plan(&lp[1], &msg), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_int_equal(back.n_attrs, 3);
  assert_string_equal(back.attrs[2].path, "m/w");
  assert_int_equal(back.attrs[2].mode, 0100640);
  assert_int_equal(back.attrs[2].uid, 11);
  assert_int_equal(back.attrs[2].gid, 21);
  assert_int_equal(back.attrs[2].mtime_ns, 5);
  ckpt_local_plan_free(&back);

  ckpt_global_plan_t gp;
  ckpt_plan_opts_t opts = {.io_threads = 1};
  assert_int_equal(ckpt_plan_global(lp, 2, &opts, &gp), 0);
  assert_null(gp.errors);
  assert_int_equal(gp.meta.n_entries, 3);
  const ckpt_entry_attr_t *e = ckpt_metadata_entry(&gp.meta, "m/w");
  assert_non_null(e);
  assert_int_equal(e->mode, 0100600); /* 0604 & 0640 */
  assert_int_equal(e->uid, 10);       /* rank 0's */
  assert_int_equal(e->mtime_ns, 9);   /* the latest */
  e = ckpt_metadata_entry(&gp.meta, "m");
  assert_int_equal(e->mode, 040700);
  e = ckpt_metadata_entry(&gp.meta, "");
  assert_int_equal(e->mode, 040750);
  assert_int_equal(e->mtime_ns, 101);
  assert_null(ckpt_metadata_entry(&gp.meta, "nothing"));
  ckpt_global_plan_free(&gp);
  for (int r = 0; r < 2; r++)
    ckpt_local_plan_free(&lp[r]);
  ckpt_buf_free(&msg);
}

static void test_msg_local_plan_invalid(void **state) {
  (void)state;
  ckpt_local_plan_t lp, back;
  ckpt_buf_t msg;
  ckpt_buf_init(&msg);
  ckpt_local_plan_init(&lp, 1);
  assert_int_equal(ckpt_local_plan_add_tensor(&lp, "w", CKPT_DTYPE_FLOAT32, 1,
                                              DIMS(4), NULL, NULL, 16, 1, 2),
                   0);
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  /* layout: magic 0, version 4, rank 8, has_errors 12, direct 13,
   * n_reserved 14, n_items 18, kind 22, dtype 23, ndim 24, dims 25..,
   * length 49, checksum 57, id 65, pin_file 69, path 73, has_fqn 78,
   * n_attrs 79 */
  assert_int_equal(msg.len, 73 + 4 + 1 + 1 + 4);
  static const struct {
    size_t off, size;
    uint64_t v;
  } bad[] = {
      {0, 1, 'X'},           /* magic */
      {4, 4, 1},             /* version 1 (no write-behind fields) */
      {4, 4, 2},             /* version 2 (no entry attributes) */
      {4, 4, 3},             /* version 3 (no explicit FQNs) */
      {4, 4, 4},             /* version 4 (no direct flag) */
      {4, 4, 5},             /* version 5 (no link targets or xattrs) */
      {4, 4, 7},             /* a future version */
      {8, 4, UINT32_MAX},    /* negative rank */
      {12, 1, 2},            /* has_errors not 0/1 */
      {13, 1, 2},            /* direct not 0/1 */
      {14, 4, 1},            /* reservations beyond the message */
      {14, 4, UINT32_MAX},   /* absurd count */
      {18, 4, 2},            /* more items than bytes */
      {18, 4, UINT32_MAX},   /* absurd count */
      {22, 1, 2},            /* kind */
      {23, 1, 0},            /* tensor without dtype */
      {23, 1, 15},           /* unknown dtype */
      {24, 1, 65},           /* too many dims */
      {24, 1, 2},            /* dims beyond the message */
      {25, 8, (uint64_t)-1}, /* negative shape */
      {69, 4, 0},            /* pinned: offset, then path beyond the end */
      {73, 4, 2},            /* path beyond the message */
      {77, 1, 0},            /* NUL in the path */
      {78, 1, 2},            /* has_fqn not 0/1 */
      {78, 1, 1},            /* an explicit FQN beyond the message */
      {79, 4, 1},            /* an attribute beyond the message */
      {79, 4, UINT32_MAX},   /* absurd count */
  };
  for (size_t i = 0; i < N_OF(bad); i++) {
    ckpt_buf_t copy;
    ckpt_buf_init(&copy);
    assert_int_equal(ckpt_buf_append(&copy, msg.data, msg.len), 0);
    patch(&copy, bad[i].off, bad[i].v, bad[i].size);
    if (ckpt_msg_decode_local_plan(copy.data, copy.len, &back) != -EINVAL) {
      print_error("patch %zu was accepted\n", i);
      fail();
    }
    ckpt_buf_free(&copy);
  }
  /* a bytes item with a dtype or dimensions */
  msg.data[21] = CKPT_ITEM_BYTES;
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back),
                   -EINVAL);
  ckpt_buf_free(&msg);
  ckpt_local_plan_free(&lp);
}

/* ------------------------------------------------------------------------
 * Explicit FQNs (user.ckpt.fqn).
 * ---------------------------------------------------------------------- */

/* Give the last item added to rank r the explicit FQN fqn. */
static void set_fqn(world_t *w, int32_t r, const char *fqn) {
  ckpt_local_plan_t *lp = &w->lp[r];
  assert_int_equal(
      ckpt_local_plan_set_fqn(lp, lp->n_items - 1, fqn, strlen(fqn)), 0);
}

/* Each local plan through the message encoder and decoder. */
static void world_roundtrip(world_t *w) {
  for (int32_t r = 0; r < w->n; r++) {
    ckpt_buf_t msg;
    ckpt_local_plan_t back;
    ckpt_buf_init(&msg);
    assert_int_equal(ckpt_msg_encode_local_plan(&w->lp[r], &msg), 0);
    assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
    assert_int_equal(back.n_items, w->lp[r].n_items);
    for (uint32_t i = 0; i < back.n_items; i++) {
      assert_string_equal(back.items[i].fqn, w->lp[r].items[i].fqn);
      assert_string_equal(back.items[i].path, w->lp[r].items[i].path);
      assert_int_equal(back.items[i].fqn_explicit,
                       w->lp[r].items[i].fqn_explicit);
    }
    ckpt_local_plan_free(&w->lp[r]);
    w->lp[r] = back;
    ckpt_buf_free(&msg);
  }
}

static const ckpt_tensor_meta_t *tensor_of(const world_t *w, const char *fqn) {
  for (uint32_t t = 0; t < w->gp.meta.n_tensors; t++)
    if (strcmp(w->gp.meta.tensors[t].fqn, fqn) == 0)
      return &w->gp.meta.tensors[t];
  return NULL;
}

static void test_fqn_valid(void **state) {
  (void)state;
  char big[CKPT_FQN_MAX + 2];
  memset(big, 'x', sizeof(big));
  assert_true(ckpt_fqn_valid("a..b", 4));
  assert_true(ckpt_fqn_valid("x/y", 3));
  assert_true(ckpt_fqn_valid(".hidden", 7));
  assert_true(ckpt_fqn_valid("\n\"\\", 3));
  assert_true(ckpt_fqn_valid(big, CKPT_FQN_MAX));
  assert_false(ckpt_fqn_valid(big, CKPT_FQN_MAX + 1));
  assert_false(ckpt_fqn_valid("", 0));
  assert_false(ckpt_fqn_valid("a\0b", 3));
  ckpt_local_plan_t lp;
  ckpt_local_plan_init(&lp, 0);
  assert_int_equal(ckpt_local_plan_set_fqn(&lp, 0, "a", 1), -EINVAL);
  assert_int_equal(ckpt_local_plan_add_bytes(&lp, "p", 1, 2, 3), 0);
  assert_int_equal(ckpt_local_plan_set_fqn(&lp, 0, "", 0), -EINVAL);
  assert_int_equal(ckpt_local_plan_set_fqn(&lp, 0, big, CKPT_FQN_MAX + 1),
                   -EINVAL);
  assert_string_equal(lp.items[0].fqn, "p");
  assert_false(lp.items[0].fqn_explicit);
  assert_int_equal(ckpt_local_plan_set_fqn(&lp, 0, "a/b", 3), 0);
  assert_string_equal(lp.items[0].fqn, "a/b");
  assert_true(lp.items[0].fqn_explicit);
  ckpt_local_plan_free(&lp);
}

/* Several chunks of one FQN on one rank, each with an explicit FQN: a
 * valid cover commits, through the messages; the tensor shows at the
 * path of its chunk at the origin. */
static void test_plan_fqn_one_rank_chunks(void **state) {
  (void)state;
  world_t *w = world_new(1);
  w->opts.io_threads = 2;
  chunk(w, 0, "w.2", F32, 2, DIMS(6, 4), DIMS(4, 0), DIMS(2, 4));
  set_fqn(w, 0, "model.w");
  chunk(w, 0, "w.0", F32, 2, DIMS(6, 4), DIMS(0, 0), DIMS(2, 4));
  set_fqn(w, 0, "model.w");
  chunk(w, 0, "w.1", F32, 2, DIMS(6, 4), DIMS(2, 0), DIMS(2, 4));
  set_fqn(w, 0, "model.w");
  blob(w, 0, "cfg", 10, 7);
  set_fqn(w, 0, "a..b");
  world_roundtrip(w);
  plan_ok(w);
  const ckpt_metadata_t *m = &w->gp.meta;
  assert_int_equal(m->n_tensors, 1);
  assert_string_equal(m->tensors[0].fqn, "model.w");
  assert_string_equal(m->tensors[0].path, "w.0");
  assert_int_equal(m->tensors[0].n_chunks, 3);
  assert_int_equal(m->n_chunks, 3);
  for (uint32_t c = 0; c < 3; c++) {
    assert_int_equal(m->chunks[c].rank, 0);
    assert_int_equal(m->chunks[c].dims[0], 2 * c);
  }
  assert_int_equal(m->n_blobs, 1);
  assert_string_equal(m->blobs[0].fqn, "a..b");
  assert_string_equal(m->blobs[0].path, "cfg");
  assert_int_equal(w->gp.ranks[0].n_assign, 4);

  /* overlapping chunks of one rank are refused */
  chunk(w, 0, "w.3", F32, 2, DIMS(6, 4), DIMS(1, 0), DIMS(2, 4));
  set_fqn(w, 0, "model.w");
  PLAN_FAILS(w, "model.w (w.0): chunks overlap: rank 0 offsets [0,0] sizes "
                "[2,4] and rank 0 offsets [1,0] sizes [2,4]");
  world_free(w);

  /* the same chunk twice on one rank */
  w = world_new(1);
  chunk(w, 0, "a", F32, 1, DIMS(4), DIMS(0), DIMS(4));
  set_fqn(w, 0, "t");
  chunk(w, 0, "b", F32, 1, DIMS(4), DIMS(0), DIMS(4));
  set_fqn(w, 0, "t");
  PLAN_FAILS(w, "t (a): rank 0 holds chunk offsets [0] sizes [4] twice: a "
                "and b");
  world_free(w);
  /* the same in the other local plan order: the same message */
  w = world_new(1);
  chunk(w, 0, "b", F32, 1, DIMS(4), DIMS(0), DIMS(4));
  set_fqn(w, 0, "t");
  chunk(w, 0, "a", F32, 1, DIMS(4), DIMS(0), DIMS(4));
  set_fqn(w, 0, "t");
  PLAN_FAILS(w, "t (a): rank 0 holds chunk offsets [0] sizes [4] twice: a "
                "and b");
  world_free(w);

  /* a gap between one rank's chunks */
  w = world_new(1);
  chunk(w, 0, "a", F32, 1, DIMS(6), DIMS(0), DIMS(2));
  set_fqn(w, 0, "t");
  chunk(w, 0, "b", F32, 1, DIMS(6), DIMS(4), DIMS(2));
  set_fqn(w, 0, "t");
  PLAN_FAILS(w, "t (a): chunks cover 4 of 6 elements (gap at offsets [2] "
                "sizes [2])");
  world_free(w);
}

/* Without an explicit FQN on each, the old rules hold: one path per FQN;
 * bytes items are one per rank. */
static void test_plan_fqn_duplicates(void **state) {
  (void)state;
  /* implicit: two paths for one FQN */
  world_t *w = world_new(1);
  chunk(w, 0, "a/b", F32, 1, DIMS(4), DIMS(0), DIMS(2));
  chunk(w, 0, "a.b", F32, 1, DIMS(4), DIMS(2), DIMS(2));
  PLAN_FAILS(w, "a.b: two paths for one FQN: a.b (rank 0) and a/b (rank 0)");
  world_free(w);

  /* one explicit, one implicit: still two paths */
  w = world_new(2);
  chunk(w, 0, "x", F32, 1, DIMS(4), DIMS(0), DIMS(2));
  set_fqn(w, 0, "a.b");
  chunk(w, 1, "a/b", F32, 1, DIMS(4), DIMS(2), DIMS(2));
  PLAN_FAILS(w, "a.b: two paths for one FQN: x (rank 0) and a/b (rank 1)");
  world_free(w);

  /* bytes: two on one rank, explicit or not */
  w = world_new(1);
  blob(w, 0, "p", 3, 1);
  set_fqn(w, 0, "cfg");
  blob(w, 0, "q", 3, 1);
  set_fqn(w, 0, "cfg");
  PLAN_FAILS(w, "cfg: rank 0 holds two bytes items for one FQN: p and q");
  world_free(w);
  w = world_new(1);
  blob(w, 0, "p", 3, 1);
  blob(w, 0, "p", 3, 1);
  PLAN_FAILS(w, "p: rank 0 holds two bytes items for one FQN: p and p");
  world_free(w);

  /* a FQN that is a tensor on one rank and bytes on another */
  w = world_new(2);
  chunk(w, 0, "x", F32, 1, DIMS(4), NULL, NULL);
  set_fqn(w, 0, "k");
  blob(w, 1, "y", 3, 1);
  set_fqn(w, 1, "k");
  PLAN_FAILS(w, "tensor on rank 0 but bytes item on rank 1");
  world_free(w);
}

/* Across ranks: chunks of one FQN at different paths, replicas deduped,
 * the committed path of the origin chunk (ties: lowest rank, then path),
 * a replicated bytes item at its lowest rank's path; clashing committed
 * paths refused. */
static void test_plan_fqn_ranks(void **state) {
  (void)state;
  world_t *w = world_new(3);
  /* rank 0: [2,4) and [4,6) at paths p/1 p/2; rank 1: the origin [0,2) at
   * z; rank 2: a replica of [2,4) at q and of the origin at a */
  chunk(w, 0, "p/1", F32, 1, DIMS(6), DIMS(2), DIMS(2));
  set_fqn(w, 0, "x/y");
  chunk(w, 0, "p/2", F32, 1, DIMS(6), DIMS(4), DIMS(2));
  set_fqn(w, 0, "x/y");
  chunk(w, 1, "z", F32, 1, DIMS(6), DIMS(0), DIMS(2));
  set_fqn(w, 1, "x/y");
  chunk(w, 2, "q", F32, 1, DIMS(6), DIMS(2), DIMS(2));
  set_fqn(w, 2, "x/y");
  chunk(w, 2, "a", F32, 1, DIMS(6), DIMS(0), DIMS(2));
  set_fqn(w, 2, "x/y");
  blob(w, 2, "r2", 5, 9);
  set_fqn(w, 2, "rng");
  blob(w, 1, "zz", 5, 9);
  set_fqn(w, 1, "rng");
  world_roundtrip(w);
  plan_ok(w);
  const ckpt_tensor_meta_t *t = tensor_of(w, "x/y");
  assert_non_null(t);
  assert_string_equal(t->path, "z"); /* origin: ranks 1 and 2, lowest */
  assert_int_equal(t->n_chunks, 3);  /* replicas kept once */
  assert_int_equal(w->gp.meta.n_blobs, 1);
  assert_string_equal(w->gp.meta.blobs[0].path, "zz"); /* rank 1's */
  world_free(w);

  /* ties on one rank (an empty chunk at the origin too): the smaller
   * path, whatever the sizes */
  w = world_new(1);
  chunk(w, 0, "c", F32, 1, DIMS(4), DIMS(0), DIMS(0));
  set_fqn(w, 0, "t");
  chunk(w, 0, "b", F32, 1, DIMS(4), DIMS(0), DIMS(4));
  set_fqn(w, 0, "t");
  plan_ok(w);
  assert_string_equal(w->gp.meta.tensors[0].path, "b");
  world_free(w);

  /* ties between ranks: the lowest rank, whatever the path */
  w = world_new(2);
  chunk(w, 1, "a", F32, 1, DIMS(4), DIMS(0), DIMS(2));
  set_fqn(w, 1, "t");
  chunk(w, 0, "z", F32, 1, DIMS(4), DIMS(0), DIMS(2));
  set_fqn(w, 0, "t");
  chunk(w, 1, "b", F32, 1, DIMS(4), DIMS(2), DIMS(2));
  set_fqn(w, 1, "t");
  plan_ok(w);
  assert_string_equal(w->gp.meta.tensors[0].path, "z");
  world_free(w);

  /* two FQNs at one committed path */
  w = world_new(2);
  chunk(w, 0, "x", F32, 1, DIMS(4), NULL, NULL);
  set_fqn(w, 0, "p");
  blob(w, 1, "x", 3, 1);
  set_fqn(w, 1, "q");
  PLAN_FAILS(w, "x: two FQNs at one committed path: p and q");
  world_free(w);

  /* a committed path that another one needs as a directory */
  w = world_new(2);
  blob(w, 0, "a", 3, 1);
  blob(w, 1, "a/b", 3, 1);
  PLAN_FAILS(w, "a: committed path of a is also a directory of a/b (a.b)");
  world_free(w);
  w = world_new(1);
  chunk(w, 0, "m/w", F32, 1, DIMS(4), NULL, NULL);
  set_fqn(w, 0, "mm");
  blob(w, 0, "m", 3, 1);
  set_fqn(w, 0, "other");
  PLAN_FAILS(w, "m: committed path of other is also a directory of m/w (mm)");
  world_free(w);
}

/* Write-behind: pinned chunks of one FQN on one rank stay where they are. */
static void test_plan_fqn_pins(void **state) {
  (void)state;
  world_t *w = world_new(2);
  w->opts.io_threads = 2;
  reserve(w, 0, 0, 64);
  chunk(w, 0, "w.0", F32, 1, DIMS(12), DIMS(0), DIMS(4));
  set_fqn(w, 0, "w");
  pin_last(w, 0, 0, 0);
  chunk(w, 0, "w.1", F32, 1, DIMS(12), DIMS(4), DIMS(4));
  set_fqn(w, 0, "w");
  pin_last(w, 0, 0, 16);
  chunk(w, 1, "w.2", F32, 1, DIMS(12), DIMS(8), DIMS(4));
  set_fqn(w, 1, "w");
  /* a replica of rank 0's pinned chunk: rank 0 keeps it */
  chunk(w, 1, "w.1", F32, 1, DIMS(12), DIMS(4), DIMS(4));
  set_fqn(w, 1, "w");
  world_roundtrip(w);
  plan_ok(w);
  const ckpt_metadata_t *m = &w->gp.meta;
  assert_int_equal(m->n_chunks, 3);
  assert_int_equal(m->chunks[0].rank, 0);
  assert_int_equal(m->chunks[0].file_offset, 0);
  assert_int_equal(m->chunks[1].rank, 0);
  assert_int_equal(m->chunks[1].file_offset, 16);
  assert_int_equal(m->chunks[2].rank, 1);
  assert_string_equal(m->tensors[0].path, "w.0");
  world_free(w);
}

/* Explicit FQNs through the local plan message: any bytes but NUL. */
static void test_msg_local_plan_fqn(void **state) {
  (void)state;
  ckpt_local_plan_t lp, back;
  ckpt_buf_t msg;
  ckpt_buf_init(&msg);
  ckpt_local_plan_init(&lp, 0);
  char big[301];
  memset(big, 'p', 300);
  big[300] = '\0';
  const char *fqns[] = {"a..b", "x/y", ".hidden.part", "q\"\\\n\x01\x7f\xff",
                        big};
  for (size_t i = 0; i < N_OF(fqns); i++) {
    char path[16];
    snprintf(path, sizeof(path), "f%zu", i);
    assert_int_equal(ckpt_local_plan_add_bytes(&lp, path, i, i, (uint32_t)i),
                     0);
    assert_int_equal(ckpt_local_plan_set_fqn(&lp, (uint32_t)i, fqns[i],
                                             strlen(fqns[i])),
                     0);
  }
  assert_int_equal(ckpt_local_plan_add_bytes(&lp, "plain/x", 1, 1, 9), 0);
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_int_equal(back.n_items, N_OF(fqns) + 1);
  for (size_t i = 0; i < N_OF(fqns); i++) {
    assert_string_equal(back.items[i].fqn, fqns[i]);
    assert_true(back.items[i].fqn_explicit);
  }
  assert_string_equal(back.items[N_OF(fqns)].fqn, "plain.x");
  assert_false(back.items[N_OF(fqns)].fqn_explicit);
  /* encodes back to the same bytes */
  ckpt_buf_t again;
  ckpt_buf_init(&again);
  assert_int_equal(ckpt_msg_encode_local_plan(&back, &again), 0);
  assert_int_equal(again.len, msg.len);
  assert_memory_equal(again.data, msg.data, msg.len);
  ckpt_buf_free(&again);
  ckpt_local_plan_free(&back);
  /* every truncation fails cleanly */
  for (size_t n = 0; n < msg.len; n++)
    assert_int_equal(ckpt_msg_decode_local_plan(msg.data, n, &back), -EINVAL);
  ckpt_local_plan_free(&lp);

  /* an empty explicit FQN and one with a NUL are refused */
  ckpt_local_plan_init(&lp, 0);
  assert_int_equal(ckpt_local_plan_add_bytes(&lp, "f", 0, 0, 0), 0);
  assert_int_equal(ckpt_local_plan_set_fqn(&lp, 0, "ab", 2), 0);
  msg.len = 0;
  assert_int_equal(ckpt_msg_encode_local_plan(&lp, &msg), 0);
  /* ... path "f" (4 + 1 bytes), has_fqn, u32 2, "ab", u32 n_attrs */
  size_t fqn_len_at = msg.len - 4 - 2 - 4;
  assert_int_equal(msg.data[fqn_len_at - 1], 1);
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back), 0);
  assert_string_equal(back.items[0].fqn, "ab");
  ckpt_local_plan_free(&back);
  msg.data[fqn_len_at + 4] = '\0'; /* "\0b" */
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &back),
                   -EINVAL);
  /* length 0, the two bytes then count as n_attrs and more: refused */
  ckpt_buf_t empty;
  ckpt_buf_init(&empty);
  assert_int_equal(ckpt_buf_append(&empty, msg.data, fqn_len_at), 0);
  uint8_t rest[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* fqn length 0, n_attrs 0 */
  assert_int_equal(ckpt_buf_append(&empty, rest, 8), 0);
  assert_int_equal(ckpt_msg_decode_local_plan(empty.data, empty.len, &back),
                   -EINVAL);
  ckpt_buf_free(&empty);
  ckpt_local_plan_free(&lp);
  ckpt_buf_free(&msg);
}

static void test_msg_rank_plan(void **state) {
  (void)state;
  world_t *w = world_new(2);
  w->opts.io_threads = 2;
  blob(w, 0, "a", 100000, 1);
  blob(w, 0, "b", 10, 2);
  blob(w, 0, "c", 0, 3);
  blob(w, 0, "d", 5, 4);
  plan_ok(w);
  ckpt_buf_t msg, again;
  ckpt_buf_init(&msg);
  ckpt_buf_init(&again);
  for (int32_t r = 0; r < 2; r++) {
    const ckpt_rank_plan_t *rp = &w->gp.ranks[r];
    ckpt_rank_plan_t back;
    msg.len = 0;
    again.len = 0;
    assert_int_equal(ckpt_msg_encode_rank_plan(rp, &msg), 0);
    assert_int_equal(ckpt_msg_decode_rank_plan(msg.data, msg.len, &back), 0);
    assert_int_equal(back.rank, rp->rank);
    assert_int_equal(back.n_files, rp->n_files);
    assert_int_equal(back.n_assign, rp->n_assign);
    if (rp->n_files > 0) {
      assert_memory_equal(back.file_bytes, rp->file_bytes,
                          rp->n_files * sizeof(uint64_t));
      assert_memory_equal(back.assign, rp->assign,
                          rp->n_assign * sizeof(ckpt_assignment_t));
    }
    assert_int_equal(ckpt_msg_encode_rank_plan(&back, &again), 0);
    assert_int_equal(again.len, msg.len);
    assert_memory_equal(again.data, msg.data, msg.len);
    ckpt_rank_plan_free(&back);
    check_malformed(&msg, decode_rp, free_rp);
  }

  /* rank 0: n_files 2; file_bytes at 16, 24; n_assign at 32; assignments
   * of 24 bytes from 36: local_id, file, file_offset, length */
  msg.len = 0;
  assert_int_equal(ckpt_msg_encode_rank_plan(&w->gp.ranks[0], &msg), 0);
  assert_int_equal(msg.len, 36 + 4 * 24 + 4); /* + an empty save id */
  static const struct {
    size_t off, size;
    uint64_t v;
  } bad[] = {
      {8, 4, UINT32_MAX},           /* negative rank */
      {12, 4, 1000},                /* files beyond the message */
      {32, 4, 1000},                /* assignments beyond the message */
      {36 + 4, 4, 2},               /* file beyond n_files */
      {36 + 8, 8, 1},               /* ends beyond the file */
      {36 + 16, 8, 200000},         /* longer than the file */
      {36 + 24 + 8, 8, UINT64_MAX}, /* offset overflow */
      {36 + 72 + 4, 4, 0},          /* files out of order */
      {36 + 72 + 8, 8, 5},          /* overlaps the previous item */
  };
  for (size_t i = 0; i < N_OF(bad); i++) {
    ckpt_buf_t copy;
    ckpt_rank_plan_t back;
    ckpt_buf_init(&copy);
    assert_int_equal(ckpt_buf_append(&copy, msg.data, msg.len), 0);
    patch(&copy, bad[i].off, bad[i].v, bad[i].size);
    if (ckpt_msg_decode_rank_plan(copy.data, copy.len, &back) != -EINVAL) {
      print_error("rank plan patch %zu was accepted\n", i);
      fail();
    }
    ckpt_buf_free(&copy);
  }
  ckpt_buf_free(&msg);
  ckpt_buf_free(&again);
  world_free(w);
}

static void test_msg_write_result(void **state) {
  (void)state;
  ckpt_write_result_t results[] = {
      {.rank = 0, .bytes_written = 0, .error = NULL},
      {.rank = 7,
       .bytes_written = UINT64_MAX,
       .error = "__7_0.distcp: No space left on device"},
      {.rank = INT32_MAX, .bytes_written = 1, .error = ""},
  };
  ckpt_buf_t msg, again;
  ckpt_buf_init(&msg);
  ckpt_buf_init(&again);
  for (size_t i = 0; i < N_OF(results); i++) {
    ckpt_write_result_t back;
    msg.len = 0;
    again.len = 0;
    assert_int_equal(ckpt_msg_encode_write_result(&results[i], &msg), 0);
    assert_int_equal(ckpt_msg_decode_write_result(msg.data, msg.len, &back), 0);
    assert_int_equal(back.rank, results[i].rank);
    assert_true(back.bytes_written == results[i].bytes_written);
    if (results[i].error == NULL)
      assert_null(back.error);
    else
      assert_string_equal(back.error, results[i].error);
    assert_int_equal(ckpt_msg_encode_write_result(&back, &again), 0);
    assert_memory_equal(again.data, msg.data, msg.len);
    ckpt_write_result_free(&back);
    check_malformed(&msg, decode_wr, free_wr);
  }
  /* messages of one kind are not taken for another */
  ckpt_local_plan_t lp;
  ckpt_rank_plan_t rp;
  assert_int_equal(ckpt_msg_decode_local_plan(msg.data, msg.len, &lp), -EINVAL);
  assert_int_equal(ckpt_msg_decode_rank_plan(msg.data, msg.len, &rp), -EINVAL);
  /* encoders append */
  size_t before = msg.len;
  assert_int_equal(ckpt_msg_encode_write_result(&results[1], &msg), 0);
  assert_true(msg.len > before);
  ckpt_buf_free(&msg);
  ckpt_buf_free(&again);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_buf),
      cmocka_unit_test(test_dtype_canonical),
      cmocka_unit_test(test_dtype_aliases),
      cmocka_unit_test(test_dtype_bad),
      cmocka_unit_test(test_dims_parse_good),
      cmocka_unit_test(test_dims_parse_bad),
      cmocka_unit_test(test_dims_parse_ndim_limit),
      cmocka_unit_test(test_dims_format),
      cmocka_unit_test(test_dims_numel),
      cmocka_unit_test(test_names),
      cmocka_unit_test(test_entry_name_check),
      cmocka_unit_test(test_commit_words),
      cmocka_unit_test(test_retention_words),
      cmocka_unit_test(test_step_from_name),
      cmocka_unit_test(test_keep_policy),
      cmocka_unit_test(test_fqn),
      cmocka_unit_test(test_data_file_names),
      cmocka_unit_test(test_local_plan),
      cmocka_unit_test(test_local_plan_pins),
      cmocka_unit_test(test_plan_empty),
      cmocka_unit_test(test_plan_row_shards_and_blob),
      cmocka_unit_test(test_plan_scalar),
      cmocka_unit_test(test_plan_zero_size),
      cmocka_unit_test(test_fqn_valid),
      cmocka_unit_test(test_plan_fqn_one_rank_chunks),
      cmocka_unit_test(test_plan_fqn_duplicates),
      cmocka_unit_test(test_plan_fqn_ranks),
      cmocka_unit_test(test_plan_fqn_pins),
      cmocka_unit_test(test_msg_local_plan_fqn),
      cmocka_unit_test(test_plan_grids),
      cmocka_unit_test(test_plan_bricks),
      cmocka_unit_test(test_plan_large_grid),
      cmocka_unit_test(test_plan_bad_length),
      cmocka_unit_test(test_plan_overlap),
      cmocka_unit_test(test_plan_gap),
      cmocka_unit_test(test_plan_outside),
      cmocka_unit_test(test_plan_disagreements),
      cmocka_unit_test(test_plan_replicas),
      cmocka_unit_test(test_plan_bytes_replicas),
      cmocka_unit_test(test_plan_local_errors_and_cap),
      cmocka_unit_test(test_plan_invalid_items),
      cmocka_unit_test(test_plan_unusable),
      cmocka_unit_test(test_plan_dedup_balance),
      cmocka_unit_test(test_plan_files),
      cmocka_unit_test(test_plan_pins_respected),
      cmocka_unit_test(test_plan_pins_append_aligned),
      cmocka_unit_test(test_plan_pins_balance),
      cmocka_unit_test(test_plan_pins_dedup),
      cmocka_unit_test(test_plan_pins_invalid),
      cmocka_unit_test(test_msg_local_plan),
      cmocka_unit_test(test_entry_attrs),
      cmocka_unit_test(test_entry_links_xattrs),
      cmocka_unit_test(test_msg_local_plan_invalid),
      cmocka_unit_test(test_msg_rank_plan),
      cmocka_unit_test(test_msg_write_result),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
