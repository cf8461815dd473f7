/*
 * json.c - ckptctl's JSON writer (json.h): compact, one document, strings
 * always valid UTF-8.
 */
#include <inttypes.h>
#include <string.h>

#include "ckpt_planner.h"
#include "json.h"

static void j_sep(json_t *j) {
  if (j->after_key) {
    j->after_key = false;
    return;
  }
  if (!j->first[j->depth])
    fputc(',', j->f);
  j->first[j->depth] = false;
}

/* A JSON string: valid UTF-8 copied, control characters escaped, bytes
 * that are not UTF-8 given as U+FFFD. */
void j_strn(json_t *j, const char *s, size_t n) {
  j_sep(j);
  FILE *f = j->f;
  fputc('"', f);
  const unsigned char *p = (const unsigned char *)s, *end = p + n;
  while (p < end) {
    unsigned c = *p;
    if (c == '"' || c == '\\') {
      fprintf(f, "\\%c", c);
      p++;
    } else if (c == '\n') {
      fputs("\\n", f), p++;
    } else if (c == '\t') {
      fputs("\\t", f), p++;
    } else if (c < 0x20 || c == 0x7f) {
      fprintf(f, "\\u%04x", c), p++;
    } else if (c < 0x80) {
      fputc((int)c, f), p++;
    } else {
      /* Length of a well-formed sequence (no overlongs, no surrogates). */
      size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                   : c >= 0xe0 && c <= 0xef ? 3
                   : c >= 0xf0 && c <= 0xf4 ? 4
                                            : 0;
      bool ok = len > 0 && (size_t)(end - p) >= len;
      for (size_t k = 1; ok && k < len; k++)
        ok = (p[k] & 0xc0) == 0x80;
      if (ok && len == 3)
        ok = !(c == 0xe0 && p[1] < 0xa0) && !(c == 0xed && p[1] >= 0xa0);
      if (ok && len == 4)
        ok = !(c == 0xf0 && p[1] < 0x90) && !(c == 0xf4 && p[1] >= 0x90);
      if (ok) {
        fwrite(p, 1, len, f);
        p += len;
      } else {
        fputs("\\ufffd", f);
        p++;
      }
    }
  }
  fputc('"', f);
}

void j_str(json_t *j, const char *s) {
  if (!s) {
    j_sep(j);
    fputs("null", j->f);
  } else {
    j_strn(j, s, strlen(s));
  }
}

void j_key(json_t *j, const char *k) {
  j_str(j, k);
  fputc(':', j->f);
  j->after_key = true;
}

void j_open(json_t *j, char c) {
  j_sep(j);
  fputc(c, j->f);
  j->depth++;
  j->first[j->depth] = true;
}

void j_close(json_t *j, char c) {
  fputc(c, j->f);
  j->depth--;
}

void j_u64(json_t *j, uint64_t v) {
  j_sep(j);
  fprintf(j->f, "%" PRIu64, v);
}

void j_i64(json_t *j, int64_t v) {
  j_sep(j);
  fprintf(j->f, "%" PRId64, v);
}

void j_bool(json_t *j, bool v) {
  j_sep(j);
  fputs(v ? "true" : "false", j->f);
}

void j_null(json_t *j) {
  j_sep(j);
  fputs("null", j->f);
}

void j_metric(json_t *j, double v) {
  char t[40];
  ckpt_metric_format(v, t, sizeof(t));
  j_sep(j);
  fputs(t, j->f);
}

void j_double(json_t *j, double v) {
  j_sep(j);
  fprintf(j->f, "%.3f", v);
}

void j_dims(json_t *j, const int64_t *d, int n) {
  j_open(j, '[');
  for (int i = 0; i < n; i++)
    j_i64(j, d[i]);
  j_close(j, ']');
}

void j_begin(json_t *j) {
  memset(j, 0, sizeof(*j));
  j->f = stdout;
  j->first[0] = true;
}

void j_end(json_t *j) { fputc('\n', j->f); }
