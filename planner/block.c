/*
 * block.c - the names of block files: ".N[a0:b0,a1:b1,...]" (ckpt_planner.h).
 *
 * A lookup of such a name in a committed checkpoint gives a read-only file
 * whose content is that block of tensor N in row-major order; the bytes
 * are mapped by ckpt_layout_local_pieces. Pure text and arithmetic here.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ckpt_planner.h"

int ckpt_block_name_split(const char *name, const char **base,
                          size_t *base_len, const char **slices) {
  size_t len = strlen(name);
  if (len < 4 || name[0] != '.' || name[len - 1] != ']')
    return -EINVAL;
  const char *open = NULL;
  for (size_t i = len - 1; i > 0; i--)
    if (name[i] == '[') {
      open = name + i;
      break;
    }
  if (open == NULL || open == name + 1) /* no '[', or an empty N */
    return -EINVAL;
  *base = name + 1;
  *base_len = (size_t)(open - name - 1);
  *slices = open;
  return 0;
}

/* A bound: digits up to a delimiter. *present false when there are none.
 * Values beyond INT64_MAX saturate (they are out of range anyway). */
static void parse_bound(const char **p, const char *end, bool *present,
                        int64_t *v) {
  *present = false;
  *v = 0;
  while (*p < end && **p >= '0' && **p <= '9') {
    int d = **p - '0';
    *v = *v > (INT64_MAX - d) / 10 ? INT64_MAX : *v * 10 + d;
    *present = true;
    (*p)++;
  }
}

int ckpt_block_parse(const char *s, size_t len, int ndim,
                     const int64_t *shape, int64_t *lo, int64_t *sizes) {
  if (ndim < 1 || ndim > CKPT_MAX_NDIM || len < 2 || s[0] != '[' ||
      s[len - 1] != ']')
    return -EINVAL;
  const char *p = s + 1, *end = s + len - 1;
  int n = 0;
  bool out_of_range = false;
  for (;;) {
    if (n == ndim)
      return -EINVAL; /* more slices than dimensions */
    bool has_a, has_b;
    int64_t a, b;
    parse_bound(&p, end, &has_a, &a);
    if (p == end || *p != ':')
      return -EINVAL; /* an index, not a slice, or junk */
    p++;
    parse_bound(&p, end, &has_b, &b);
    if (!has_a)
      a = 0;
    if (!has_b)
      b = shape[n];
    if (a > b || b > shape[n])
      out_of_range = true;
    lo[n] = a;
    sizes[n] = out_of_range ? 0 : b - a;
    n++;
    if (p == end)
      break;
    if (*p != ',' || p + 1 == end)
      return -EINVAL; /* junk, or a trailing comma */
    p++;
  }
  if (out_of_range)
    return -ERANGE;
  for (; n < ndim; n++) {
    lo[n] = 0;
    sizes[n] = shape[n];
  }
  return 0;
}
