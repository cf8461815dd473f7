/*
 * dims.c - dimension lists (shape, offsets, sizes), names and FQNs.
 *
 * Lists come from users through xattrs ("4096,1024" or "[4096, 1024]") and
 * go to the metadata as compact JSON ("[4096,1024]"); both directions are
 * strict and overflow-safe. Also here: checkpoint names, the FQN of a path
 * and the names of data files (__R_K.distcp).
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "planner_int.h"

/* ------------------------------------------------------------------------
 * Dimension lists.
 * ---------------------------------------------------------------------- */

static bool is_blank(char c) { return c == ' ' || c == '\t'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static size_t skip_blanks(const char *s, size_t i, size_t len) {
  while (i < len && is_blank(s[i]))
    i++;
  return i;
}

/* Parse an unsigned decimal (no sign) of at most max value at s[*i].
 * Advances *i past the digits. */
static int parse_uint(const char *s, size_t *i, size_t len, uint64_t max,
                      uint64_t *out) {
  size_t j = *i;
  uint64_t v = 0;
  if (j >= len || !is_digit(s[j]))
    return -EINVAL;
  for (; j < len && is_digit(s[j]); j++) {
    uint64_t digit = (uint64_t)(s[j] - '0');
    if (v > (max - digit) / 10)
      return -EINVAL;
    v = v * 10 + digit;
  }
  *i = j;
  *out = v;
  return 0;
}

int ckpt_dims_parse(const char *s, size_t len, ckpt_dims_t *out) {
  assert(out != NULL && (s != NULL || len == 0));
  ckpt_dims_t dims = {.ndim = 0};
  size_t i = 0;

  ckpt__trim_value(&s, &len);
  if (len > 0 && s[0] == '[') {
    if (s[len - 1] != ']')
      return -EINVAL;
    i = skip_blanks(s, 1, len - 1);
    len--; /* the closing bracket */
  }
  if (i < len) {
    for (;;) {
      uint64_t v;
      if (dims.ndim == CKPT_MAX_NDIM ||
          parse_uint(s, &i, len, (uint64_t)CKPT_DIM_MAX, &v) < 0)
        return -EINVAL;
      dims.d[dims.ndim++] = (int64_t)v;
      i = skip_blanks(s, i, len);
      if (i == len)
        break;
      if (s[i] != ',')
        return -EINVAL;
      i = skip_blanks(s, i + 1, len);
    }
  }
  *out = dims;
  return 0;
}

/* Decimal digits of v, written backwards ending at end; returns the start. */
static char *format_u64(uint64_t v, char *end) {
  do {
    *--end = (char)('0' + v % 10);
    v /= 10;
  } while (v != 0);
  return end;
}

int ckpt_dims_format(const int64_t *d, int ndim, ckpt_dims_style_t style,
                     char *buf, size_t cap) {
  assert(ndim >= 0 && ndim <= CKPT_MAX_NDIM && (d != NULL || ndim == 0));
  assert(buf != NULL || cap == 0);
  char num[24];
  size_t n = 0; /* length of the full text */

/* Append one character, or as much as fits while counting the rest. */
#define PUT(c)                                                                 \
  do {                                                                         \
    if (n + 1 < cap)                                                           \
      buf[n] = (c);                                                            \
    n++;                                                                       \
  } while (0)

  if (style == CKPT_DIMS_JSON)
    PUT('[');
  for (int i = 0; i < ndim; i++) {
    if (i > 0)
      PUT(',');
    assert(d[i] >= 0);
    char *end = num + sizeof(num);
    for (const char *p = format_u64((uint64_t)d[i], end); p < end; p++)
      PUT(*p);
  }
  if (style == CKPT_DIMS_JSON)
    PUT(']');
#undef PUT
  if (cap > 0)
    buf[n < cap ? n : cap - 1] = '\0';
  return (int)n;
}

int ckpt_dims_numel(const int64_t *d, int ndim, uint64_t *out) {
  assert(ndim >= 0 && (d != NULL || ndim == 0) && out != NULL);
  /* A zero dimension makes the product 0 however large the others are:
   * an empty tensor is valid whatever its other extents. */
  for (int i = 0; i < ndim; i++) {
    if (d[i] < 0)
      return -EINVAL;
    if (d[i] == 0) {
      *out = 0;
      return 0;
    }
  }
  uint64_t p = 1;
  for (int i = 0; i < ndim; i++) {
    if (__builtin_mul_overflow(p, (uint64_t)d[i], &p))
      return -EOVERFLOW;
  }
  *out = p;
  return 0;
}

/* ------------------------------------------------------------------------
 * Names and FQNs.
 * ---------------------------------------------------------------------- */

bool ckpt_name_valid(const char *name) {
  assert(name != NULL);
  size_t n = strnlen(name, 256);
  return n > 0 && n <= 255 && name[0] != '.' && !memchr(name, '/', n);
}

/* The names ckptfs serves directly under a checkpoint itself. */
static const char *const reserved_top[] = {".commit", ".status", ".metadata",
                                           ".npy", ".safetensors"};

int ckpt_entry_name_check(const char *name, size_t len, bool top) {
  assert(name != NULL);
  if (len == 0 || memchr(name, '/', len) || memchr(name, '\0', len) ||
      (len == 1 && name[0] == '.') ||
      (len == 2 && name[0] == '.' && name[1] == '.'))
    return -EINVAL;
  if (len > 255)
    return -ENAMETOOLONG;
  if (!top || name[0] != '.')
    return 0;
  for (size_t i = 0; i < sizeof(reserved_top) / sizeof(*reserved_top); i++)
    if (strlen(reserved_top[i]) == len && memcmp(reserved_top[i], name, len) == 0)
      return -EPERM;
  if (name[len - 1] == ']') /* a block file's name: ".w[0:2]" */
    return -EPERM;
  return 0;
}

bool ckpt_save_id_valid(const char *id) {
  assert(id != NULL);
  size_t n = 0;
  for (; id[n] != '\0'; n++)
    if (n == CKPT_SAVE_ID_LEN ||
        !(is_digit(id[n]) || (id[n] >= 'a' && id[n] <= 'f')))
      return false;
  return n == CKPT_SAVE_ID_LEN;
}

char *ckpt_fqn_from_path(const char *path) {
  assert(path != NULL);
  char *fqn = strdup(path);
  if (fqn == NULL)
    return NULL;
  for (char *p = fqn; *p != '\0'; p++) {
    if (*p == '/')
      *p = '.';
  }
  return fqn;
}

bool ckpt_fqn_valid(const char *fqn, size_t len) {
  return fqn != NULL && len >= 1 && len <= CKPT_FQN_MAX &&
         memchr(fqn, '\0', len) == NULL;
}

int ckpt_data_file_name(int32_t rank, uint32_t k, char *buf, size_t cap) {
  assert(rank >= 0 && (buf != NULL || cap == 0));
  return snprintf(buf, cap, "__%d_%u.distcp", (int)rank, (unsigned)k);
}

/* A canonical decimal (no leading zero unless "0") of at most max. */
static int parse_canonical(const char *s, size_t *i, size_t len, uint64_t max,
                           uint64_t *out) {
  size_t start = *i;
  int rc = parse_uint(s, i, len, max, out);
  if (rc == 0 && s[start] == '0' && *i - start > 1)
    rc = -EINVAL;
  return rc;
}

int ckpt_data_file_parse(const char *name, int32_t *rank, uint32_t *k) {
  assert(name != NULL && rank != NULL && k != NULL);
  static const char suffix[] = ".distcp";
  size_t len = strlen(name);
  size_t i = 2;
  uint64_t r, kk;

  if (len < 2 || name[0] != '_' || name[1] != '_' ||
      parse_canonical(name, &i, len, INT32_MAX, &r) < 0 || i >= len ||
      name[i] != '_')
    return -EINVAL;
  i++;
  if (parse_canonical(name, &i, len, UINT32_MAX, &kk) < 0 ||
      strcmp(name + i, suffix) != 0)
    return -EINVAL;
  *rank = (int32_t)r;
  *k = (uint32_t)kk;
  return 0;
}
