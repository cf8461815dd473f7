/*
 * buf.c - a growable byte buffer.
 *
 * Used to build binary messages and multi-line texts (plan errors). The
 * buffer always keeps one spare byte after the data and a NUL in it, so
 * that its contents can be taken as a C string at any time.
 */
#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_planner.h"

void ckpt_buf_init(ckpt_buf_t *b) {
  assert(b != NULL);
  b->data = NULL;
  b->len = 0;
  b->cap = 0;
}

void ckpt_buf_free(ckpt_buf_t *b) {
  if (b == NULL)
    return;
  free(b->data);
  ckpt_buf_init(b);
}

int ckpt_buf_reserve(ckpt_buf_t *b, size_t extra) {
  assert(b != NULL);
  /* Room for the data plus the terminating NUL. */
  if (extra > SIZE_MAX - 1 - b->len)
    return -ENOMEM;
  size_t need = b->len + extra + 1;
  if (need <= b->cap)
    return 0;
  size_t cap = b->cap < 64 ? 64 : b->cap;
  while (cap < need)
    cap = cap > SIZE_MAX / 2 ? need : cap * 2;
  uint8_t *p = realloc(b->data, cap);
  if (p == NULL)
    return -ENOMEM;
  b->data = p;
  b->cap = cap;
  b->data[b->len] = '\0';
  return 0;
}

int ckpt_buf_append(ckpt_buf_t *b, const void *p, size_t n) {
  assert(b != NULL && (p != NULL || n == 0));
  int rc = ckpt_buf_reserve(b, n);
  if (rc < 0)
    return rc;
  if (n > 0)
    memcpy(b->data + b->len, p, n);
  b->len += n;
  b->data[b->len] = '\0';
  return 0;
}

int ckpt_buf_printf(ckpt_buf_t *b, const char *fmt, ...) {
  assert(b != NULL && fmt != NULL);
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0)
    return -EINVAL;
  int rc = ckpt_buf_reserve(b, (size_t)n);
  if (rc < 0)
    return rc;
  va_start(ap, fmt);
  vsnprintf((char *)b->data + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
  return 0;
}

char *ckpt_buf_steal(ckpt_buf_t *b) {
  assert(b != NULL);
  if (ckpt_buf_reserve(b, 0) < 0)
    return NULL;
  char *s = (char *)b->data;
  ckpt_buf_init(b);
  return s;
}
