/*
 * dims_fuzzer.c - fuzz the parsers of user-visible values: dimension lists,
 * dtypes, checkpoint names, data file names and the words of .commit.
 *
 * Whatever parses must format back to text that parses to the same value
 * (dims in both styles, dtypes through their canonical name, data file
 * names through ckpt_data_file_name).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_planner.h"
#include "fuzz.h"

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

static void fuzz_dims(const char *s, size_t n) {
  static const ckpt_dims_style_t styles[] = {CKPT_DIMS_CSV, CKPT_DIMS_JSON};
  char text[CKPT_MAX_NDIM * 21 + 3];
  ckpt_dims_t d, back;
  uint64_t numel;

  if (ckpt_dims_parse(s, n, &d) < 0)
    return;
  CHECK(d.ndim >= 0 && d.ndim <= CKPT_MAX_NDIM);
  for (size_t i = 0; i < sizeof(styles) / sizeof(styles[0]); i++) {
    int len = ckpt_dims_format(d.d, d.ndim, styles[i], text, sizeof(text));
    CHECK(len >= 0 && (size_t)len < sizeof(text));
    CHECK(ckpt_dims_parse(text, (size_t)len, &back) == 0);
    CHECK(back.ndim == d.ndim &&
          memcmp(back.d, d.d, (size_t)d.ndim * sizeof(d.d[0])) == 0);
  }
  int rc = ckpt_dims_numel(d.d, d.ndim, &numel);
  CHECK(rc == 0 || rc == -EOVERFLOW);
}

static void fuzz_dtype(const char *s, size_t n) {
  ckpt_dtype_t dt, back;
  if (ckpt_dtype_parse(s, n, &dt) < 0)
    return;
  const char *name = ckpt_dtype_name(dt);
  CHECK(name != NULL && ckpt_dtype_size(dt) > 0);
  CHECK(ckpt_dtype_parse(name, strlen(name), &back) == 0 && back == dt);
}

/* What .commit accepts parses to a name that is valid, once more the same. */
static void fuzz_commit_words(const char *s, size_t n) {
  ckpt_commit_words_t w;
  if (ckpt_commit_words_parse(s, n, &w) < 0)
    return;
  CHECK(w.replace[0] == '\0' || ckpt_name_valid(w.replace));
  CHECK(!memchr(w.replace, ' ', strlen(w.replace)));
  CHECK(!w.has_step || w.step >= 0);
  CHECK(w.n_metrics <= CKPT_MAX_METRICS);
  for (uint32_t i = 0; i < w.n_metrics; i++) {
    CHECK(ckpt_metric_key_valid(w.metrics[i].key, strlen(w.metrics[i].key)));
    CHECK(w.metrics[i].value - w.metrics[i].value == 0); /* finite */
  }
}

/* A keep= policy that parses formats to text that parses the same. */
static void fuzz_keep_policy(const char *s, size_t n) {
  ckpt_keep_policy_t p, q;
  char text[256];
  if (ckpt_keep_policy_parse(s, n, &p) < 0)
    return;
  CHECK(ckpt_keep_policy_active(&p));
  int len = ckpt_keep_policy_format(&p, text, sizeof(text));
  CHECK(len > 0 && (size_t)len < sizeof(text));
  CHECK(ckpt_keep_policy_parse(text, (size_t)len, &q) == 0);
  CHECK(memcmp(&p, &q, sizeof(p)) == 0);
}

/* name: NUL-terminated. */
static void fuzz_names(const char *name) {
  char text[64];
  int32_t rank;
  uint32_t k;
  (void)ckpt_name_valid(name);
  if (ckpt_data_file_parse(name, &rank, &k) < 0)
    return;
  int len = ckpt_data_file_name(rank, k, text, sizeof(text));
  CHECK(len > 0 && (size_t)len < sizeof(text) && strcmp(text, name) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *s = (const char *)data;
  fuzz_dims(s, size);
  fuzz_dtype(s, size);
  fuzz_commit_words(s, size);
  fuzz_keep_policy(s, size);
  char *name = malloc(size + 1);
  if (name == NULL)
    return 0;
  memcpy(name, data, size);
  name[size] = '\0';
  fuzz_names(name);
  free(name);
  return 0;
}
