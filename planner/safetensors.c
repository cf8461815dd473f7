/*
 * safetensors.c - the safetensors layout of a list of tensors: header
 * bytes, shards, where each tensor's bytes go, and the shard index.
 *
 * The format and the choices made here are described in ckpt_views.h. The
 * caller (the .safetensors view of a committed checkpoint, ckptctl export)
 * builds the plan once per checkpoint and keeps it: reads then only locate
 * offsets (ckpt_st_find, a binary search). Work is O(n log n) in the number
 * of tensors, memory O(header bytes + n).
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "planner_int.h"

/* Indexed by ckpt_dtype_t; NULL: safetensors has no such dtype. */
static const char *const st_names[CKPT_DTYPE_COUNT] = {
    [CKPT_DTYPE_BOOL] = "BOOL",         [CKPT_DTYPE_UINT8] = "U8",
    [CKPT_DTYPE_INT8] = "I8",           [CKPT_DTYPE_INT16] = "I16",
    [CKPT_DTYPE_INT32] = "I32",         [CKPT_DTYPE_INT64] = "I64",
    [CKPT_DTYPE_FLOAT16] = "F16",       [CKPT_DTYPE_BFLOAT16] = "BF16",
    [CKPT_DTYPE_FLOAT32] = "F32",       [CKPT_DTYPE_FLOAT64] = "F64",
    [CKPT_DTYPE_COMPLEX64] = "C64",     [CKPT_DTYPE_COMPLEX128] = NULL,
    [CKPT_DTYPE_FLOAT8_E4M3FN] = "F8_E4M3",
    [CKPT_DTYPE_FLOAT8_E5M2] = "F8_E5M2",
};

const char *ckpt_st_dtype_name(ckpt_dtype_t dt) {
  if ((int)dt < 0 || dt >= CKPT_DTYPE_COUNT)
    return NULL;
  return st_names[dt];
}

/* ----- JSON text ----- */

/* Length of the valid UTF-8 sequence at s[0..n) (n > 0), or 0 if the bytes
 * there are not one: RFC 3629, no overlong forms, no surrogates, at most
 * U+10FFFF. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
  unsigned c = s[0];
  if (c < 0x80)
    return 1;
  size_t len;
  unsigned lo = 0x80, hi = 0xBF; /* range of the second byte */
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0)
      lo = 0xA0; /* overlong */
    else if (c == 0xED)
      hi = 0x9F; /* surrogates */
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0)
      lo = 0x90; /* overlong */
    else if (c == 0xF4)
      hi = 0x8F; /* beyond U+10FFFF */
  } else {
    return 0;
  }
  if (n < len || s[1] < lo || s[1] > hi)
    return 0;
  for (size_t i = 2; i < len; i++)
    if (s[i] < 0x80 || s[i] > 0xBF)
      return 0;
  return len;
}

static bool utf8_valid(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  while (n > 0) {
    size_t k = utf8_seq(p, n);
    if (k == 0)
      return false;
    p += k;
    n -= k;
  }
  return true;
}

/* Append s as a JSON string: '"' and '\\' escaped, control characters as
 * \b \f \n \r \t or \u00XX, other bytes as they are; a byte that does not
 * start a valid UTF-8 sequence becomes U+FFFD (names are checked before,
 * so only the left_out list ever has one). */
static int json_string(ckpt_buf_t *b, const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  int rc = ckpt_buf_append(b, "\"", 1);
  while (rc == 0 && n > 0) {
    unsigned c = p[0];
    size_t k = utf8_seq(p, n);
    if (k == 0) {
      rc = ckpt_buf_append(b, "\xEF\xBF\xBD", 3);
      k = 1;
    } else if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      rc = ckpt_buf_append(b, esc, 2);
    } else if (c < 0x20) {
      static const char short_esc[0x20] = {
          ['\b'] = 'b', ['\f'] = 'f', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't'};
      if (short_esc[c] != 0) {
        char esc[2] = {'\\', short_esc[c]};
        rc = ckpt_buf_append(b, esc, 2);
      } else {
        rc = ckpt_buf_printf(b, "\\u%04x", c);
      }
    } else {
      rc = ckpt_buf_append(b, p, k);
    }
    p += k;
    n -= k;
  }
  if (rc == 0)
    rc = ckpt_buf_append(b, "\"", 1);
  return rc;
}

/* ----- The plan ----- */

/* Why tensor t is left out, or NULL when safetensors can hold it. */
static const char *left_out_reason(const ckpt_st_tensor_t *t) {
  if (ckpt_st_dtype_name(t->dtype) == NULL)
    return "dtype";
  if (!utf8_valid(t->name))
    return "name";
  if (strcmp(t->name, "__metadata__") == 0)
    return "reserved";
  return NULL;
}

/* Sort key of the file order inside a shard. */
typedef struct {
  size_t index;    /* input index */
  size_t itemsize;
} order_key_t;

static int cmp_order(const void *a, const void *b) {
  const order_key_t *x = a, *y = b;
  if (x->itemsize != y->itemsize)
    return x->itemsize > y->itemsize ? -1 : 1;
  return (x->index > y->index) - (x->index < y->index);
}

void ckpt_st_plan_free(ckpt_st_plan_t *p) {
  if (p == NULL)
    return;
  for (uint32_t k = 0; p->shards != NULL && k < p->n_shards; k++)
    free(p->shards[k].header);
  free(p->shards);
  free(p->place);
  free(p->order);
  memset(p, 0, sizeof(*p));
}

/* The __metadata__ entry (with its trailing comma when tensors follow it
 * is added by the caller): {"format":"pt"[,"ckptfs.left_out":"[..]"]}. */
static int metadata_json(const ckpt_st_tensor_t *t, size_t n,
                         const ckpt_st_plan_t *p, ckpt_buf_t *out) {
  int rc = ckpt_buf_printf(out, "\"__metadata__\":{\"format\":\"pt\"");
  if (rc == 0 && p->n_left_out > 0) {
    ckpt_buf_t list;
    ckpt_buf_init(&list);
    rc = ckpt_buf_append(&list, "[", 1);
    size_t listed = 0;
    for (size_t i = 0; rc == 0 && i < n; i++) {
      if (p->place[i].shard != CKPT_ST_LEFT_OUT)
        continue;
      if (listed++ > 0)
        rc = ckpt_buf_append(&list, ",", 1);
      if (rc == 0)
        rc = json_string(&list, t[i].name);
    }
    if (rc == 0)
      rc = ckpt_buf_append(&list, "]", 1);
    if (rc == 0)
      rc = ckpt_buf_printf(out, ",\"ckptfs.left_out\":");
    if (rc == 0)
      rc = json_string(out, (const char *)list.data);
    ckpt_buf_free(&list);
  }
  if (rc == 0)
    rc = ckpt_buf_append(out, "}", 1);
  return rc;
}

/* Build shard k's header from its tensors (order[first..first+count),
 * already sorted) and set their places. */
static int build_header(const ckpt_st_tensor_t *t, size_t n,
                        ckpt_st_plan_t *p, uint32_t k) {
  ckpt_st_shard_t *sh = &p->shards[k];
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  /* Room for the 8-byte length, filled in at the end. */
  int rc = ckpt_buf_append(&b, "\0\0\0\0\0\0\0\0{", 9);
  if (rc == 0)
    rc = metadata_json(t, n, p, &b);
  uint64_t data = 0;
  for (size_t j = sh->first; rc == 0 && j < sh->first + sh->count; j++) {
    const ckpt_st_tensor_t *ti = &t[p->order[j]];
    uint64_t len = p->place[p->order[j]].length;
    rc = ckpt_buf_append(&b, ",", 1);
    if (rc == 0)
      rc = json_string(&b, ti->name);
    if (rc == 0)
      rc = ckpt_buf_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[",
                           ckpt_st_dtype_name(ti->dtype));
    for (int d = 0; rc == 0 && d < ti->ndim; d++)
      rc = ckpt_buf_printf(&b, "%s%lld", d ? "," : "",
                           (long long)ti->shape[d]);
    if (rc == 0)
      rc = ckpt_buf_printf(&b, "],\"data_offsets\":[%llu,%llu]}",
                           (unsigned long long)data,
                           (unsigned long long)(data + len));
    p->place[p->order[j]].offset = data; /* made absolute below */
    data += len;
  }
  if (rc == 0)
    rc = ckpt_buf_append(&b, "}", 1);
  while (rc == 0 && b.len % 8 != 0)
    rc = ckpt_buf_append(&b, " ", 1);
  if (rc < 0) {
    ckpt_buf_free(&b);
    return rc;
  }
  uint64_t nhdr = b.len - 8;
  for (int i = 0; i < 8; i++)
    b.data[i] = (uint8_t)(nhdr >> (8 * i));
  sh->header_len = b.len;
  sh->data_len = data;
  if (data > UINT64_MAX - sh->header_len) {
    ckpt_buf_free(&b);
    return -EOVERFLOW;
  }
  sh->file_size = sh->header_len + data;
  for (size_t j = sh->first; j < sh->first + sh->count; j++)
    p->place[p->order[j]].offset += sh->header_len;
  sh->header = b.data; /* ownership moves to the shard */
  return 0;
}

int ckpt_st_plan(const ckpt_st_tensor_t *t, size_t n, uint64_t shard_bytes,
                 ckpt_st_plan_t *out) {
  assert(out != NULL && (t != NULL || n == 0));
  memset(out, 0, sizeof(*out));
  out->n_tensors = n;
  int rc = -ENOMEM;
  order_key_t *keys = NULL;
  out->place = calloc(n ? n : 1, sizeof(*out->place));
  out->order = calloc(n ? n : 1, sizeof(*out->order));
  /* At most one shard per kept tensor, and at least one. */
  out->shards = calloc(n ? n : 1, sizeof(*out->shards));
  keys = calloc(n ? n : 1, sizeof(*keys));
  if (!out->place || !out->order || !out->shards || !keys)
    goto fail;

  /* 1. Sizes, and what is left out. */
  for (size_t i = 0; i < n; i++) {
    const ckpt_st_tensor_t *ti = &t[i];
    size_t itemsize = ckpt_dtype_size(ti->dtype);
    rc = -EINVAL;
    if (ti->name == NULL || itemsize == 0 || ti->ndim < 0 ||
        ti->ndim > CKPT_MAX_NDIM || (ti->ndim > 0 && ti->shape == NULL))
      goto fail;
    uint64_t numel;
    rc = ckpt_dims_numel(ti->shape, ti->ndim, &numel);
    if (rc < 0)
      goto fail;
    rc = -EOVERFLOW;
    if (numel > UINT64_MAX / itemsize)
      goto fail;
    out->place[i].length = numel * itemsize;
    if (left_out_reason(ti) != NULL) {
      out->place[i].shard = CKPT_ST_LEFT_OUT;
      out->n_left_out++;
    }
  }

  /* 2. Shards: the kept tensors in the caller's order. */
  uint32_t k = 0;
  uint64_t cur = 0;
  size_t pos = 0;
  out->shards[0].first = 0;
  for (size_t i = 0; i < n; i++) {
    if (out->place[i].shard == CKPT_ST_LEFT_OUT)
      continue;
    uint64_t len = out->place[i].length;
    ckpt_st_shard_t *sh = &out->shards[k];
    if (shard_bytes > 0 && sh->count > 0 &&
        (len > shard_bytes || cur > shard_bytes - len)) {
      k++;
      out->shards[k].first = pos;
      cur = 0;
      sh = &out->shards[k];
    }
    rc = -EOVERFLOW;
    if (cur > UINT64_MAX - len || out->total_size > UINT64_MAX - len)
      goto fail;
    cur += len;
    out->total_size += len;
    out->place[i].shard = k;
    keys[pos].index = i;
    keys[pos].itemsize = ckpt_dtype_size(t[i].dtype);
    pos++;
    sh->count++;
  }
  out->n_kept = pos;
  out->n_shards = k + 1;

  /* 3. File order inside each shard, then each header. */
  for (uint32_t s = 0; s < out->n_shards; s++) {
    ckpt_st_shard_t *sh = &out->shards[s];
    if (sh->count > 1)
      qsort(keys + sh->first, sh->count, sizeof(*keys), cmp_order);
    for (size_t j = sh->first; j < sh->first + sh->count; j++)
      out->order[j] = keys[j].index;
  }
  for (uint32_t s = 0; s < out->n_shards; s++) {
    rc = build_header(t, n, out, s);
    if (rc < 0)
      goto fail;
  }
  free(keys);
  return 0;

fail:
  free(keys);
  ckpt_st_plan_free(out);
  return rc;
}

int ckpt_st_shard_name(const ckpt_st_plan_t *p, uint32_t k, char *buf,
                       size_t cap) {
  assert(p != NULL && k < p->n_shards);
  if (p->n_shards == 1)
    return snprintf(buf, cap, "model.safetensors");
  return snprintf(buf, cap, "model-%05u-of-%05u.safetensors",
                  (unsigned)k + 1, (unsigned)p->n_shards);
}

static int cmp_name(const void *a, const void *b) {
  const ckpt_st_tensor_t *const *x = a, *const *y = b;
  return strcmp((*x)->name, (*y)->name);
}

int ckpt_st_index_json(const ckpt_st_plan_t *p, const ckpt_st_tensor_t *t,
                       size_t n, ckpt_buf_t *out) {
  assert(p != NULL && out != NULL && n == p->n_tensors);
  const ckpt_st_tensor_t **byname = calloc(n ? n : 1, sizeof(*byname));
  if (byname == NULL)
    return -ENOMEM;
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (p->place[i].shard != CKPT_ST_LEFT_OUT)
      byname[m++] = &t[i];
  /* strcmp order of valid UTF-8 is code point order, as sort_keys. */
  qsort(byname, m, sizeof(*byname), cmp_name);
  int rc = ckpt_buf_printf(out,
                           "{\n  \"metadata\": {\n    \"total_size\": %llu\n"
                           "  },\n  \"weight_map\": {",
                           (unsigned long long)p->total_size);
  char file[64];
  for (size_t j = 0; rc == 0 && j < m; j++) {
    size_t i = (size_t)(byname[j] - t);
    ckpt_st_shard_name(p, p->place[i].shard, file, sizeof(file));
    rc = ckpt_buf_printf(out, "%s\n    ", j ? "," : "");
    if (rc == 0)
      rc = json_string(out, t[i].name);
    if (rc == 0)
      rc = ckpt_buf_printf(out, ": \"%s\"", file);
  }
  if (rc == 0)
    rc = ckpt_buf_printf(out, "%s}\n}\n", m ? "\n  " : "");
  free(byname);
  return rc;
}

size_t ckpt_st_find(const ckpt_st_plan_t *p, uint32_t k, uint64_t off) {
  assert(p != NULL && k < p->n_shards);
  const ckpt_st_shard_t *sh = &p->shards[k];
  size_t lo = sh->first, hi = sh->first + sh->count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const ckpt_st_place_t *pl = &p->place[p->order[mid]];
    if (pl->offset + pl->length <= off)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}
