/*
 * dtype.c - tensor element types: names, aliases and item sizes.
 *
 * One canonical name per dtype (PyTorch's, without "torch."), plus the
 * spellings other tools write: torch.X (with torch's own short aliases such
 * as torch.half), numpy names and array-interface type strings ("<f4",
 * "|b1"; '>' is refused, data is little-endian), and safetensors names
 * ("F32", "BF16"). Lookups are linear in tables of a few dozen entries.
 */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "planner_int.h"

typedef struct {
  const char *name;
  ckpt_dtype_t dt;
} alias_t;

/* Indexed by ckpt_dtype_t. */
static const struct {
  const char *name;
  size_t size;
} canonical[CKPT_DTYPE_COUNT] = {
    [CKPT_DTYPE_BOOL] = {"bool", 1},
    [CKPT_DTYPE_UINT8] = {"uint8", 1},
    [CKPT_DTYPE_INT8] = {"int8", 1},
    [CKPT_DTYPE_INT16] = {"int16", 2},
    [CKPT_DTYPE_INT32] = {"int32", 4},
    [CKPT_DTYPE_INT64] = {"int64", 8},
    [CKPT_DTYPE_FLOAT16] = {"float16", 2},
    [CKPT_DTYPE_BFLOAT16] = {"bfloat16", 2},
    [CKPT_DTYPE_FLOAT32] = {"float32", 4},
    [CKPT_DTYPE_FLOAT64] = {"float64", 8},
    [CKPT_DTYPE_COMPLEX64] = {"complex64", 8},
    [CKPT_DTYPE_COMPLEX128] = {"complex128", 16},
    [CKPT_DTYPE_FLOAT8_E4M3FN] = {"float8_e4m3fn", 1},
    [CKPT_DTYPE_FLOAT8_E5M2] = {"float8_e5m2", 1},
};

/* Valid only after "torch." (bare "float" means float64 to numpy). */
static const alias_t torch_aliases[] = {
    {"half", CKPT_DTYPE_FLOAT16},     {"float", CKPT_DTYPE_FLOAT32},
    {"double", CKPT_DTYPE_FLOAT64},   {"short", CKPT_DTYPE_INT16},
    {"int", CKPT_DTYPE_INT32},        {"long", CKPT_DTYPE_INT64},
    {"cfloat", CKPT_DTYPE_COMPLEX64}, {"cdouble", CKPT_DTYPE_COMPLEX128},
};

/* numpy names that are not canonical names, and safetensors names. */
static const alias_t other_aliases[] = {
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
};

/* numpy array-interface type strings, after an optional '<', '=' or '|'. */
static const alias_t type_strings[] = {
    {"b1", CKPT_DTYPE_BOOL},      {"?", CKPT_DTYPE_BOOL},
    {"u1", CKPT_DTYPE_UINT8},     {"i1", CKPT_DTYPE_INT8},
    {"i2", CKPT_DTYPE_INT16},     {"i4", CKPT_DTYPE_INT32},
    {"i8", CKPT_DTYPE_INT64},     {"f2", CKPT_DTYPE_FLOAT16},
    {"f4", CKPT_DTYPE_FLOAT32},   {"f8", CKPT_DTYPE_FLOAT64},
    {"c8", CKPT_DTYPE_COMPLEX64}, {"c16", CKPT_DTYPE_COMPLEX128},
};

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static bool same(const char *s, size_t len, const char *name) {
  return strlen(name) == len && memcmp(s, name, len) == 0;
}

static bool lookup(const alias_t *tab, size_t n, const char *s, size_t len,
                   ckpt_dtype_t *out) {
  for (size_t i = 0; i < n; i++) {
    if (same(s, len, tab[i].name)) {
      *out = tab[i].dt;
      return true;
    }
  }
  return false;
}

static bool lookup_canonical(const char *s, size_t len, ckpt_dtype_t *out) {
  for (int i = 0; i < CKPT_DTYPE_COUNT; i++) {
    if (same(s, len, canonical[i].name)) {
      *out = (ckpt_dtype_t)i;
      return true;
    }
  }
  return false;
}

void ckpt__trim_value(const char **s, size_t *len) {
  const char *p = *s;
  size_t n = *len;
  if (n > 0 && p[n - 1] == '\n')
    n--;
  while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t'))
    n--;
  while (n > 0 && (*p == ' ' || *p == '\t')) {
    p++;
    n--;
  }
  *s = p;
  *len = n;
}

int ckpt_dtype_parse(const char *s, size_t len, ckpt_dtype_t *out) {
  assert(out != NULL && (s != NULL || len == 0));
  static const char torch_prefix[] = "torch.";
  const size_t tp = sizeof(torch_prefix) - 1;
  ckpt_dtype_t dt = CKPT_DTYPE_INVALID;
  bool ok;

  ckpt__trim_value(&s, &len);
  if (len > tp && memcmp(s, torch_prefix, tp) == 0) {
    ok = lookup_canonical(s + tp, len - tp, &dt) ||
         lookup(torch_aliases, N_OF(torch_aliases), s + tp, len - tp, &dt);
  } else {
    ok = lookup_canonical(s, len, &dt) ||
         lookup(other_aliases, N_OF(other_aliases), s, len, &dt);
    if (!ok && len > 0) {
      size_t skip = (s[0] == '<' || s[0] == '=' || s[0] == '|') ? 1 : 0;
      ok = lookup(type_strings, N_OF(type_strings), s + skip, len - skip, &dt);
    }
  }
  if (!ok)
    return -EINVAL;
  *out = dt;
  return 0;
}

const char *ckpt_dtype_name(ckpt_dtype_t dt) {
  if (dt < 0 || dt >= CKPT_DTYPE_COUNT)
    return NULL;
  return canonical[dt].name;
}

size_t ckpt_dtype_size(ckpt_dtype_t dt) {
  if (dt < 0 || dt >= CKPT_DTYPE_COUNT)
    return 0;
  return canonical[dt].size;
}
