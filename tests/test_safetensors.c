/*
 * test_safetensors.c - unit tests of planner/safetensors.c and planner/npy.c
 * (the file formats of the checkpoint views).
 *
 * Exact header bytes for small cases (checked against the format's spec
 * and, for .npy, against what numpy 1.24's np.save writes), the alignment
 * of every tensor, sharding edge cases, JSON escaping of any name bytes,
 * what is left out, the index json, and the offset lookup of reads.
 */
#include <setjmp.h>
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt_planner.h"

/* ----- Helpers ----- */

static uint64_t le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

/* The JSON text of shard k (without the length prefix, padding kept). */
static char *json_of(const ckpt_st_plan_t *p, uint32_t k) {
  const ckpt_st_shard_t *sh = &p->shards[k];
  size_t n = (size_t)sh->header_len - 8;
  char *s = malloc(n + 1);
  assert_non_null(s);
  memcpy(s, sh->header + 8, n);
  s[n] = '\0';
  return s;
}

/* Invariants every plan must hold: prefix = JSON length, 8-aligned data,
 * JSON starts with '{' and ends with '}' and spaces, tensors contiguous
 * from the data start to the end of the file, each aligned to its item
 * size, every kept tensor exactly once. */
static void check_plan(const ckpt_st_plan_t *p, const ckpt_st_tensor_t *t,
                       size_t n) {
  assert_int_equal(p->n_tensors, n);
  assert_true(p->n_shards >= 1);
  size_t seen = 0, kept = 0;
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++)
    if (p->place[i].shard != CKPT_ST_LEFT_OUT)
      kept++;
  assert_int_equal(kept, p->n_kept);
  assert_int_equal(n - kept, p->n_left_out);
  for (uint32_t k = 0; k < p->n_shards; k++) {
    const ckpt_st_shard_t *sh = &p->shards[k];
    assert_int_equal(sh->header_len % 8, 0);
    assert_int_equal(le64(sh->header), sh->header_len - 8);
    assert_int_equal(sh->header[8], '{');
    size_t e = (size_t)sh->header_len - 1;
    while (sh->header[e] == ' ')
      e--;
    assert_int_equal(sh->header[e], '}');
    assert_true(sh->header_len - 1 - e < 8);
    assert_int_equal(sh->first, seen);
    uint64_t at = sh->header_len;
    for (size_t j = sh->first; j < sh->first + sh->count; j++) {
      size_t i = p->order[j];
      assert_true(i < n);
      assert_int_equal(p->place[i].shard, k);
      assert_int_equal(p->place[i].offset, at);
      assert_int_equal(p->place[i].offset % ckpt_dtype_size(t[i].dtype), 0);
      at += p->place[i].length;
    }
    assert_int_equal(at, sh->file_size);
    assert_int_equal(sh->file_size - sh->header_len, sh->data_len);
    total += sh->data_len;
    seen += sh->count;
  }
  assert_int_equal(seen, p->n_kept);
  assert_int_equal(total, p->total_size);
}

/* ----- safetensors: exact bytes ----- */

static void test_single_tensor_exact_bytes(void **state) {
  (void)state;
  const int64_t shape[] = {1, 2, 3};
  ckpt_st_tensor_t t[] = {{"attn.0", CKPT_DTYPE_FLOAT32, 3, shape}};
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 1, 0, &p), 0);
  check_plan(&p, t, 1);
  assert_int_equal(p.n_shards, 1);
  const char *want = "{\"__metadata__\":{\"format\":\"pt\"},\"attn.0\":{"
                     "\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":"
                     "[0,24]}} ";
  assert_int_equal(p.shards[0].header_len, 8 + 96);
  const uint8_t prefix[8] = {96, 0, 0, 0, 0, 0, 0, 0};
  assert_memory_equal(p.shards[0].header, prefix, 8);
  char *js = json_of(&p, 0);
  assert_string_equal(js, want);
  free(js);
  assert_int_equal(p.place[0].offset, 104);
  assert_int_equal(p.place[0].length, 24);
  assert_int_equal(p.shards[0].file_size, 128);
  char name[64];
  assert_int_equal(ckpt_st_shard_name(&p, 0, name, sizeof(name)), 17);
  assert_string_equal(name, "model.safetensors");
  ckpt_st_plan_free(&p);
}

static void test_empty(void **state) {
  (void)state;
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(NULL, 0, 1000, &p), 0);
  check_plan(&p, NULL, 0);
  assert_int_equal(p.n_shards, 1);
  assert_int_equal(p.shards[0].header_len, 40); /* JSON of 32, no pad */
  char *js = json_of(&p, 0);
  assert_string_equal(js, "{\"__metadata__\":{\"format\":\"pt\"}}");
  free(js);
  assert_int_equal(p.shards[0].file_size, 40);
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_st_index_json(&p, NULL, 0, &b), 0);
  assert_string_equal((char *)b.data,
                      "{\n  \"metadata\": {\n    \"total_size\": 0\n  },\n"
                      "  \"weight_map\": {}\n}\n");
  ckpt_buf_free(&b);
  ckpt_st_plan_free(&p);
}

/* Tensors of mixed item sizes: largest first inside the file, ties in the
 * caller's order; 0-d and zero-sized tensors. */
static void test_alignment_order(void **state) {
  (void)state;
  const int64_t s3[] = {3}, s2[] = {2}, s1[] = {1}, s0[] = {4, 0};
  ckpt_st_tensor_t t[] = {
      {"a", CKPT_DTYPE_UINT8, 1, s3},   {"b", CKPT_DTYPE_FLOAT32, 1, s2},
      {"c", CKPT_DTYPE_INT16, 1, s1},   {"d", CKPT_DTYPE_FLOAT64, 0, NULL},
      {"e", CKPT_DTYPE_INT64, 2, s0},   {"f", CKPT_DTYPE_BFLOAT16, 1, s3},
  };
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 6, 0, &p), 0);
  check_plan(&p, t, 6);
  /* d(8) e(0) b(8) c(2) f(6) a(3) */
  const size_t want[] = {3, 4, 1, 2, 5, 0};
  assert_memory_equal(p.order, want, sizeof(want));
  char *js = json_of(&p, 0);
  assert_string_equal(
      js, "{\"__metadata__\":{\"format\":\"pt\"},"
          "\"d\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]},"
          "\"e\":{\"dtype\":\"I64\",\"shape\":[4,0],\"data_offsets\":[8,8]},"
          "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
          "\"c\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[16,18]},"
          "\"f\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[18,24]},"
          "\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[24,27]}}"
          "  ");
  free(js);
  assert_int_equal(p.total_size, 27);
  ckpt_st_plan_free(&p);
}

static void test_every_dtype_name(void **state) {
  (void)state;
  const char *want[CKPT_DTYPE_COUNT] = {
      "BOOL", "U8",  "I8",  "I16", "I32", "I64",     "F16",
      "BF16", "F32", "F64", "C64", NULL,  "F8_E4M3", "F8_E5M2"};
  for (int d = 0; d < CKPT_DTYPE_COUNT; d++) {
    const char *got = ckpt_st_dtype_name((ckpt_dtype_t)d);
    if (want[d] == NULL) {
      assert_null(got);
    } else {
      assert_non_null(got);
      assert_string_equal(got, want[d]);
      /* ckptfs itself accepts the names it writes. */
      ckpt_dtype_t back;
      assert_int_equal(ckpt_dtype_parse(got, strlen(got), &back), 0);
      assert_int_equal(back, d);
    }
  }
  assert_null(ckpt_st_dtype_name(CKPT_DTYPE_INVALID));
  assert_null(ckpt_st_dtype_name(CKPT_DTYPE_COUNT));
}

/* ----- Escaping and what is left out ----- */

static void test_escaping(void **state) {
  (void)state;
  const int64_t s1[] = {1};
  ckpt_st_tensor_t t[] = {
      {"q\"b\\s/", CKPT_DTYPE_UINT8, 1, s1},
      {"c\n\t\r\b\f\x01\x1f\x7f", CKPT_DTYPE_UINT8, 1, s1},
      {"caf\xc3\xa9.\xe2\x82\xac.\xf0\x9f\x98\x80", CKPT_DTYPE_UINT8, 1, s1},
  };
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 3, 0, &p), 0);
  check_plan(&p, t, 3);
  assert_int_equal(p.n_left_out, 0);
  char *js = json_of(&p, 0);
  assert_non_null(strstr(js, "\"q\\\"b\\\\s/\":{"));
  assert_non_null(strstr(js, "\"c\\n\\t\\r\\b\\f\\u0001\\u001f\x7f\":{"));
  assert_non_null(
      strstr(js, "\"caf\xc3\xa9.\xe2\x82\xac.\xf0\x9f\x98\x80\":{"));
  /* No raw control character anywhere in the JSON. */
  for (const char *c = js; *c; c++)
    assert_true((unsigned char)*c >= 0x20);
  free(js);
  ckpt_st_plan_free(&p);
}

static void test_left_out(void **state) {
  (void)state;
  const int64_t s2[] = {2};
  ckpt_st_tensor_t t[] = {
      {"w", CKPT_DTYPE_FLOAT32, 1, s2},
      {"z", CKPT_DTYPE_COMPLEX128, 1, s2},          /* no safetensors dtype */
      {"bad\xff\xfe", CKPT_DTYPE_FLOAT32, 1, s2},   /* not UTF-8 */
      {"ov\xc0\xaf", CKPT_DTYPE_FLOAT32, 1, s2},    /* overlong '/' */
      {"sur\xed\xa0\x80", CKPT_DTYPE_FLOAT32, 1, s2}, /* a surrogate */
      {"cut\xe2\x82", CKPT_DTYPE_FLOAT32, 1, s2},   /* truncated */
      {"__metadata__", CKPT_DTYPE_FLOAT32, 1, s2},  /* the reserved key */
      {"v", CKPT_DTYPE_COMPLEX64, 1, s2},
  };
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 8, 0, &p), 0);
  check_plan(&p, t, 8);
  assert_int_equal(p.n_left_out, 6);
  for (size_t i = 1; i <= 6; i++)
    assert_int_equal(p.place[i].shard, CKPT_ST_LEFT_OUT);
  assert_int_equal(p.n_kept, 2);
  assert_int_equal(p.total_size, 8 + 16);
  char *js = json_of(&p, 0);
  assert_non_null(strstr(
      js, "{\"__metadata__\":{\"format\":\"pt\",\"ckptfs.left_out\":"
          "\"[\\\"z\\\",\\\"bad\xef\xbf\xbd\xef\xbf\xbd\\\",\\\"ov\xef\xbf\xbd"
          "\xef\xbf\xbd\\\",\\\"sur\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\\\","
          "\\\"cut\xef\xbf\xbd\xef\xbf\xbd\\\",\\\"__metadata__\\\"]\"},"));
  /* complex64 (8 bytes) comes first, then the float32. */
  assert_non_null(strstr(js, "\"v\":{\"dtype\":\"C64\",\"shape\":[2],"
                             "\"data_offsets\":[0,16]},\"w\":{\"dtype\":"
                             "\"F32\",\"shape\":[2],\"data_offsets\":"
                             "[16,24]}}"));
  free(js);
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_st_index_json(&p, t, 8, &b), 0);
  assert_string_equal((char *)b.data,
                      "{\n  \"metadata\": {\n    \"total_size\": 24\n  },\n"
                      "  \"weight_map\": {\n"
                      "    \"v\": \"model.safetensors\",\n"
                      "    \"w\": \"model.safetensors\"\n  }\n}\n");
  ckpt_buf_free(&b);
  ckpt_st_plan_free(&p);
}

/* Decode the JSON string at *p (just after its opening quote) into out
 * (cap bytes), checking it on the way: no raw control characters, only
 * JSON's escapes, \u of a BMP non-surrogate; *p ends after the closing
 * quote. Returns the decoded length. */
static size_t json_decode(const char **p, char *out, size_t cap) {
  size_t n = 0;
  const unsigned char *s = (const unsigned char *)*p;
  for (;;) {
    unsigned c = *s++;
    assert_true(c >= 0x20); /* also catches the end of the text */
    if (c == '"')
      break;
    if (c == '\\') {
      c = *s++;
      const char *esc = strchr("\"\\/bfnrt", (int)c);
      if (c == 'u') {
        unsigned v = 0;
        for (int i = 0; i < 4; i++) {
          unsigned h = *s++;
          assert_non_null(strchr("0123456789abcdefABCDEF", (int)h));
          v = v * 16 + (h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
        }
        assert_true(v < 0x20); /* we only escape control characters */
        c = v;
      } else {
        assert_true(c != 0 && esc != NULL);
        c = (unsigned char)"\"\\/\b\f\n\r\t"[esc - "\"\\/bfnrt"];
      }
    }
    assert_true(n < cap);
    out[n++] = (char)c;
  }
  *p = (const char *)s;
  return n;
}

/* Is s valid UTF-8? Decodes each code point and checks its value (the
 * shortest form, not a surrogate, at most U+10FFFF). */
static bool is_utf8(const char *str) {
  const unsigned char *s = (const unsigned char *)str;
  while (*s) {
    unsigned c = *s++, need, cp, min;
    if (c < 0x80)
      continue;
    if ((c & 0xE0) == 0xC0)
      need = 1, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0)
      need = 2, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0)
      need = 3, cp = c & 0x07, min = 0x10000;
    else
      return false;
    for (unsigned i = 0; i < need; i++, s++) {
      if ((*s & 0xC0) != 0x80)
        return false;
      cp = cp << 6 | (*s & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
  }
  return true;
}

/* Names of random bytes: every kept one comes back from the header's JSON
 * exactly, and the ones left out are exactly those that are not UTF-8. */
static void test_random_names_roundtrip(void **state) {
  (void)state;
  srand(12345);
  enum { N = 300 };
  static char names[N][40];
  ckpt_st_tensor_t t[N];
  const int64_t d1[] = {1};
  for (int i = 0; i < N; i++) {
    int len = 1 + rand() % 30;
    for (int j = 0; j < len; j++) {
      int r = rand() % 4;
      names[i][j] = (char)(r == 0 ? 1 + rand() % 31          /* control */
                           : r == 1 ? 0x80 + rand() % 128    /* high bytes */
                           : r == 2 ? "\"\\/{}:,"[rand() % 8]
                                    : 'a' + rand() % 26);
    }
    snprintf(names[i] + len, 8, "%03d", i); /* unique */
    t[i] = (ckpt_st_tensor_t){names[i], CKPT_DTYPE_UINT8, 1, d1};
  }
  /* a few well-formed multi-byte sequences too */
  snprintf(names[0], sizeof(names[0]), "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80x");
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, N, 0, &p), 0);
  check_plan(&p, t, N);
  char *js = json_of(&p, 0);
  const char *q = strstr(js, "\"ckptfs.left_out\":\"");
  size_t found = 0;
  if (q != NULL) /* skip the left_out string: checked for validity only */
    q += strlen("\"ckptfs.left_out\":\""), json_decode(&q, (char[1 << 16]){0},
                                                      1 << 16);
  else
    q = js;
  for (size_t j = 0; j < p.n_kept; j++) {
    size_t i = p.order[j];
    const char *k = strstr(q, ",\"");
    assert_non_null(k);
    k += 2;
    char got[256];
    size_t n = json_decode(&k, got, sizeof(got));
    assert_int_equal(n, strlen(t[i].name));
    assert_memory_equal(got, t[i].name, n);
    assert_int_equal(*k, ':');
    q = strstr(k, "]}"); /* the end of this tensor's entry */
    assert_non_null(q);
    found++;
  }
  assert_int_equal(found, p.n_kept);
  assert_true(p.n_left_out > 0 && p.n_kept > 0);
  for (int i = 0; i < N; i++)
    assert_int_equal(p.place[i].shard == CKPT_ST_LEFT_OUT, !is_utf8(names[i]));
  free(js);
  ckpt_st_plan_free(&p);
}

/* ----- Sharding ----- */

static void test_sharding(void **state) {
  (void)state;
  /* float32 sizes in bytes: 40, 60, 100 (exactly the shard), 8, 250
   * (larger than a shard), 0, 4, 96 */
  const int64_t d10[] = {10}, d15[] = {15}, d25[] = {25}, d2[] = {2},
                d62[] = {62, 1}, d0[] = {0}, d1[] = {1}, d24[] = {24};
  ckpt_st_tensor_t t[] = {
      {"t0", CKPT_DTYPE_FLOAT32, 1, d10}, {"t1", CKPT_DTYPE_FLOAT32, 1, d15},
      {"t2", CKPT_DTYPE_FLOAT32, 1, d25}, {"t3", CKPT_DTYPE_FLOAT32, 1, d2},
      {"t4", CKPT_DTYPE_FLOAT32, 2, d62}, {"t5", CKPT_DTYPE_FLOAT32, 1, d0},
      {"t6", CKPT_DTYPE_FLOAT32, 1, d1},  {"t7", CKPT_DTYPE_FLOAT32, 1, d24},
  };
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 8, 100, &p), 0);
  check_plan(&p, t, 8);
  /* [t0 t1] (100, exactly full) [t2] (100) [t3] [t4] (248, alone)
   * [t5 t6 t7] (0 + 4 + 96 = 100) */
  assert_int_equal(p.n_shards, 5);
  const uint32_t want[] = {0, 0, 1, 2, 3, 4, 4, 4};
  for (size_t i = 0; i < 8; i++)
    assert_int_equal(p.place[i].shard, want[i]);
  assert_int_equal(p.shards[3].data_len, 248);
  assert_int_equal(p.total_size, 40 + 60 + 100 + 8 + 248 + 0 + 4 + 96);
  char name[64];
  ckpt_st_shard_name(&p, 0, name, sizeof(name));
  assert_string_equal(name, "model-00001-of-00005.safetensors");
  ckpt_st_shard_name(&p, 4, name, sizeof(name));
  assert_string_equal(name, "model-00005-of-00005.safetensors");

  ckpt_buf_t b;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_st_index_json(&p, t, 8, &b), 0);
  assert_string_equal(
      (char *)b.data,
      "{\n  \"metadata\": {\n    \"total_size\": 556\n  },\n"
      "  \"weight_map\": {\n"
      "    \"t0\": \"model-00001-of-00005.safetensors\",\n"
      "    \"t1\": \"model-00001-of-00005.safetensors\",\n"
      "    \"t2\": \"model-00002-of-00005.safetensors\",\n"
      "    \"t3\": \"model-00003-of-00005.safetensors\",\n"
      "    \"t4\": \"model-00004-of-00005.safetensors\",\n"
      "    \"t5\": \"model-00005-of-00005.safetensors\",\n"
      "    \"t6\": \"model-00005-of-00005.safetensors\",\n"
      "    \"t7\": \"model-00005-of-00005.safetensors\"\n  }\n}\n");
  ckpt_buf_free(&b);
  ckpt_st_plan_free(&p);

  /* The first tensor larger than a shard: alone in the first shard. */
  ckpt_st_tensor_t u[] = {{"big", CKPT_DTYPE_FLOAT32, 2, d62},
                          {"small", CKPT_DTYPE_FLOAT32, 1, d1}};
  assert_int_equal(ckpt_st_plan(u, 2, 100, &p), 0);
  check_plan(&p, u, 2);
  assert_int_equal(p.n_shards, 2);
  assert_int_equal(p.place[0].shard, 0);
  assert_int_equal(p.place[1].shard, 1);
  ckpt_st_plan_free(&p);

  /* Everything fits: one file named model.safetensors. */
  assert_int_equal(ckpt_st_plan(t, 8, 556, &p), 0);
  check_plan(&p, t, 8);
  assert_int_equal(p.n_shards, 1);
  ckpt_st_plan_free(&p);
  assert_int_equal(ckpt_st_plan(t, 8, 555, &p), 0);
  assert_int_equal(p.n_shards, 2);
  ckpt_st_plan_free(&p);

  /* shard_bytes 1: every tensor alone (an empty one too: its shard's
   * bytes are already beyond 1, as save_pretrained's rule has it). */
  assert_int_equal(ckpt_st_plan(t, 8, 1, &p), 0);
  check_plan(&p, t, 8);
  assert_int_equal(p.n_shards, 8);
  for (size_t i = 0; i < 8; i++)
    assert_int_equal(p.place[i].shard, i);
  ckpt_st_plan_free(&p);
}

/* The sort of the index is by bytes (code points), not the input order. */
static void test_index_sorted_and_escaped(void **state) {
  (void)state;
  const int64_t d1[] = {1};
  ckpt_st_tensor_t t[] = {{"b\"x", CKPT_DTYPE_UINT8, 1, d1},
                          {"B", CKPT_DTYPE_UINT8, 1, d1},
                          {"\xc3\xa9", CKPT_DTYPE_UINT8, 1, d1},
                          {"a", CKPT_DTYPE_UINT8, 1, d1}};
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 4, 2, &p), 0);
  check_plan(&p, t, 4);
  assert_int_equal(p.n_shards, 2);
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_st_index_json(&p, t, 4, &b), 0);
  assert_string_equal((char *)b.data,
                      "{\n  \"metadata\": {\n    \"total_size\": 4\n  },\n"
                      "  \"weight_map\": {\n"
                      "    \"B\": \"model-00001-of-00002.safetensors\",\n"
                      "    \"a\": \"model-00002-of-00002.safetensors\",\n"
                      "    \"b\\\"x\": \"model-00001-of-00002.safetensors\",\n"
                      "    \"\xc3\xa9\": \"model-00002-of-00002.safetensors\"\n"
                      "  }\n}\n");
  ckpt_buf_free(&b);
  ckpt_st_plan_free(&p);
}

/* ----- Reads: ckpt_st_find ----- */

static void test_find(void **state) {
  (void)state;
  const int64_t d3[] = {3}, d0[] = {0}, d2[] = {2};
  ckpt_st_tensor_t t[] = {{"a", CKPT_DTYPE_UINT8, 1, d3},
                          {"e", CKPT_DTYPE_UINT8, 1, d0},
                          {"b", CKPT_DTYPE_UINT8, 1, d2}};
  ckpt_st_plan_t p;
  assert_int_equal(ckpt_st_plan(t, 3, 0, &p), 0);
  check_plan(&p, t, 3);
  uint64_t h = p.shards[0].header_len;
  assert_int_equal(ckpt_st_find(&p, 0, 0), 0);     /* in the header */
  assert_int_equal(ckpt_st_find(&p, 0, h), 0);     /* a */
  assert_int_equal(ckpt_st_find(&p, 0, h + 2), 0); /* a */
  /* h + 3: "e" is empty, so the read starts in b */
  assert_int_equal(p.order[ckpt_st_find(&p, 0, h + 3)], 2);
  assert_int_equal(p.order[ckpt_st_find(&p, 0, h + 4)], 2);
  assert_int_equal(ckpt_st_find(&p, 0, h + 5), 3); /* end of file */
  assert_int_equal(ckpt_st_find(&p, 0, UINT64_MAX), 3);
  ckpt_st_plan_free(&p);
}

/* ----- Errors ----- */

static void test_errors(void **state) {
  (void)state;
  ckpt_st_plan_t p;
  const int64_t neg[] = {-1}, big[] = {INT64_MAX, 4};
  ckpt_st_tensor_t bad_dtype[] = {{"x", CKPT_DTYPE_INVALID, 0, NULL}};
  assert_int_equal(ckpt_st_plan(bad_dtype, 1, 0, &p), -EINVAL);
  ckpt_st_plan_free(&p); /* safe after a failure */
  ckpt_st_tensor_t bad_dim[] = {{"x", CKPT_DTYPE_UINT8, 1, neg}};
  assert_int_equal(ckpt_st_plan(bad_dim, 1, 0, &p), -EINVAL);
  ckpt_st_tensor_t bad_ndim[] = {{"x", CKPT_DTYPE_UINT8, 65, neg}};
  assert_int_equal(ckpt_st_plan(bad_ndim, 1, 0, &p), -EINVAL);
  ckpt_st_tensor_t huge[] = {{"x", CKPT_DTYPE_FLOAT64, 2, big}};
  assert_int_equal(ckpt_st_plan(huge, 1, 0, &p), -EOVERFLOW);
  /* Each fits, the sum does not. */
  const int64_t half[] = {INT64_MAX};
  ckpt_st_tensor_t two[] = {{"x", CKPT_DTYPE_INT16, 1, half},
                            {"y", CKPT_DTYPE_INT16, 1, half}};
  assert_int_equal(ckpt_st_plan(two, 2, 0, &p), -EOVERFLOW);
  /* In different shards each file fits, but total_size does not. */
  assert_int_equal(ckpt_st_plan(two, 2, UINT64_C(1) << 62, &p), -EOVERFLOW);
}

/* ----- .npy headers ----- */

static void check_npy(ckpt_dtype_t dt, int ndim, const int64_t *shape,
                      const char *want_dict, size_t want_len) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_npy_header(dt, ndim, shape, &b), 0);
  assert_int_equal(b.len, want_len);
  assert_int_equal(b.len % 64, 0);
  assert_memory_equal(b.data, "\x93NUMPY\x01\x00", 8);
  assert_int_equal(b.data[8] | b.data[9] << 8, want_len - 10);
  assert_memory_equal(b.data + 10, want_dict, strlen(want_dict));
  for (size_t i = 10 + strlen(want_dict); i < b.len - 1; i++)
    assert_int_equal(b.data[i], ' ');
  assert_int_equal(b.data[b.len - 1], '\n');
  ckpt_buf_free(&b);
}

static void test_npy(void **state) {
  (void)state;
  /* The dicts and lengths of np.save in numpy 1.24. */
  const int64_t s23[] = {2, 3}, s5[] = {5}, s0[] = {0, 7};
  check_npy(CKPT_DTYPE_FLOAT32, 2, s23,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            128);
  check_npy(CKPT_DTYPE_FLOAT64, 0, NULL,
            "{'descr': '<f8', 'fortran_order': False, 'shape': (), }", 128);
  check_npy(CKPT_DTYPE_BOOL, 1, s5,
            "{'descr': '|b1', 'fortran_order': False, 'shape': (5,), }",
            128);
  check_npy(CKPT_DTYPE_COMPLEX128, 2, s0,
            "{'descr': '<c16', 'fortran_order': False, 'shape': (0, 7), }",
            128);
  check_npy(CKPT_DTYPE_BFLOAT16, 1, s5,
            "{'descr': '<u2', 'fortran_order': False, 'shape': (5,), }",
            128);
  check_npy(CKPT_DTYPE_FLOAT8_E5M2, 1, s5,
            "{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }",
            128);

  /* Exactly the bytes of np.save(f, np.zeros((2, 3), np.float32)). */
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_npy_header(CKPT_DTYPE_FLOAT32, 2, s23, &b), 0);
  char want[128];
  const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': "
                     "(2, 3), }";
  memset(want, ' ', sizeof(want));
  memcpy(want, "\x93NUMPY\x01\x00\x76\x00", 10);
  memcpy(want + 10, dict, strlen(dict));
  want[127] = '\n';
  assert_int_equal(b.len, 128);
  assert_memory_equal(b.data, want, 128);
  ckpt_buf_free(&b);

  /* A header beyond 65535 bytes needs version 2.0 (64 dimensions cannot
   * make one, so only the version 1.0 path is reachable: check the
   * longest). */
  int64_t many[CKPT_MAX_NDIM];
  for (int d = 0; d < CKPT_MAX_NDIM; d++)
    many[d] = INT64_MAX;
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_npy_header(CKPT_DTYPE_UINT8, CKPT_MAX_NDIM, many, &b),
                   0);
  assert_int_equal(b.data[6], 1);
  assert_int_equal(b.len % 64, 0);
  ckpt_buf_free(&b);

  const int64_t neg[] = {-2};
  ckpt_buf_init(&b);
  assert_int_equal(ckpt_npy_header(CKPT_DTYPE_UINT8, 1, neg, &b), -EINVAL);
  assert_int_equal(ckpt_npy_header(CKPT_DTYPE_INVALID, 0, NULL, &b), -EINVAL);
  assert_int_equal(b.len, 0);
  ckpt_buf_free(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_single_tensor_exact_bytes),
      cmocka_unit_test(test_empty),
      cmocka_unit_test(test_alignment_order),
      cmocka_unit_test(test_every_dtype_name),
      cmocka_unit_test(test_escaping),
      cmocka_unit_test(test_left_out),
      cmocka_unit_test(test_random_names_roundtrip),
      cmocka_unit_test(test_sharding),
      cmocka_unit_test(test_index_sorted_and_escaped),
      cmocka_unit_test(test_find),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_npy),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
