/*
 * json.h - ckptctl's JSON writer: one compact document on stdout, written
 * value by value (j_open/j_close for objects and arrays, j_key before each
 * member's value; commas are placed by the writer).
 */
#ifndef CKPTCTL_JSON_H
#define CKPTCTL_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
  FILE *f;
  int depth;
  bool first[64];  /* no member written yet at this depth */
  bool after_key;  /* the next value follows a key: no comma */
} json_t;

/* Start a document on stdout; j_end ends its line. */
void j_begin(json_t *j);
void j_end(json_t *j);

/* c is '{' or '[', and its closing '}' or ']'. */
void j_open(json_t *j, char c);
void j_close(json_t *j, char c);

/* A member's key; its value comes next. */
void j_key(json_t *j, const char *k);

/* Strings: valid UTF-8 copied, control characters escaped, bytes that are
 * not UTF-8 given as U+FFFD. j_str(j, NULL) writes null. */
void j_strn(json_t *j, const char *s, size_t n);
void j_str(json_t *j, const char *s);

void j_u64(json_t *j, uint64_t v);
void j_i64(json_t *j, int64_t v);
void j_bool(json_t *j, bool v);
void j_null(json_t *j);
void j_double(json_t *j, double v); /* three decimals */
void j_metric(json_t *j, double v); /* exact: reads back as v (finite) */
void j_dims(json_t *j, const int64_t *d, int n); /* [d0,d1,...] */

#endif
