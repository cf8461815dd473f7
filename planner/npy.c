/*
 * npy.c - NumPy .npy headers (format described in ckpt_views.h).
 *
 * The header is what np.save writes (numpy/lib/format.py of numpy 1.24):
 * the dict's repr with sorted keys and a trailing ", ", spare spaces so
 * that the first axis may grow to 21 digits in place, then spaces and a
 * newline up to a multiple of 64 bytes (ARRAY_ALIGN). Version 1.0 when
 * HEADER_LEN fits 16 bits, else 2.0.
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "planner_int.h"

/* Indexed by ckpt_dtype_t. */
static const char *const npy_descr[CKPT_DTYPE_COUNT] = {
    [CKPT_DTYPE_BOOL] = "|b1",      [CKPT_DTYPE_UINT8] = "|u1",
    [CKPT_DTYPE_INT8] = "|i1",      [CKPT_DTYPE_INT16] = "<i2",
    [CKPT_DTYPE_INT32] = "<i4",     [CKPT_DTYPE_INT64] = "<i8",
    [CKPT_DTYPE_FLOAT16] = "<f2",   [CKPT_DTYPE_BFLOAT16] = "<u2",
    [CKPT_DTYPE_FLOAT32] = "<f4",   [CKPT_DTYPE_FLOAT64] = "<f8",
    [CKPT_DTYPE_COMPLEX64] = "<c8", [CKPT_DTYPE_COMPLEX128] = "<c16",
    [CKPT_DTYPE_FLOAT8_E4M3FN] = "|u1",
    [CKPT_DTYPE_FLOAT8_E5M2] = "|u1",
};

#define NPY_ALIGN 64            /* ARRAY_ALIGN */
#define NPY_GROWTH_DIGITS 21    /* GROWTH_AXIS_MAX_DIGITS */

const char *ckpt_npy_descr(ckpt_dtype_t dt) {
  if ((int)dt < 0 || dt >= CKPT_DTYPE_COUNT)
    return NULL;
  return npy_descr[dt];
}

int ckpt_npy_header(ckpt_dtype_t dt, int ndim, const int64_t *shape,
                    ckpt_buf_t *out) {
  assert(out != NULL);
  const char *descr = ckpt_npy_descr(dt);
  if (descr == NULL || ndim < 0 || ndim > CKPT_MAX_NDIM ||
      (ndim > 0 && shape == NULL))
    return -EINVAL;
  for (int d = 0; d < ndim; d++)
    if (shape[d] < 0)
      return -EINVAL;

  /* The dict, as Python's repr of each value. */
  ckpt_buf_t h;
  ckpt_buf_init(&h);
  int rc = ckpt_buf_printf(&h,
                           "{'descr': '%s', 'fortran_order': False, "
                           "'shape': (",
                           descr);
  for (int d = 0; rc == 0 && d < ndim; d++)
    rc = ckpt_buf_printf(&h, "%s%lld", d ? ", " : "", (long long)shape[d]);
  if (rc == 0)
    rc = ckpt_buf_printf(&h, "%s), }", ndim == 1 ? "," : "");
  if (rc == 0 && ndim > 0) {
    int digits = snprintf(NULL, 0, "%lld", (long long)shape[0]);
    for (int i = digits; rc == 0 && i < NPY_GROWTH_DIGITS; i++)
      rc = ckpt_buf_append(&h, " ", 1);
  }
  if (rc < 0)
    goto out;

  /* Prefix: magic (6), version (2), HEADER_LEN (2 or 4). */
  size_t hlen = h.len + 1; /* the final newline */
  size_t prefix = 10;
  size_t pad = NPY_ALIGN - (prefix + hlen) % NPY_ALIGN;
  if (hlen + pad > 0xFFFF) {
    prefix = 12;
    pad = NPY_ALIGN - (prefix + hlen) % NPY_ALIGN;
  }
  uint64_t total = hlen + pad;
  uint8_t pre[12] = {0x93, 'N', 'U', 'M', 'P', 'Y', prefix == 10 ? 1 : 2, 0};
  for (size_t i = 0; i < prefix - 8; i++)
    pre[8 + i] = (uint8_t)(total >> (8 * i));
  rc = ckpt_buf_append(out, pre, prefix);
  if (rc == 0)
    rc = ckpt_buf_append(out, h.data, h.len);
  for (size_t i = 0; rc == 0 && i < pad; i++)
    rc = ckpt_buf_append(out, " ", 1);
  if (rc == 0)
    rc = ckpt_buf_append(out, "\n", 1);
out:
  ckpt_buf_free(&h);
  return rc;
}
