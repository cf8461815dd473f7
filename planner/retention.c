/*
 * retention.c - the values retention is stated in (ckpt_planner.h): a
 * checkpoint's step when none was recorded at commit (from its name),
 * metric keys and values (commit word metric=KEY:VALUE, .metadata), and
 * the policy of -o keep= and ckptctl prune ("last:5,every:1000,
 * best:3:loss:min"). Which checkpoints a policy keeps is chosen in
 * store/catalog.c, where the checkpoints are.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "planner_int.h"

int64_t ckpt_step_from_name(const char *name) {
  size_t n = strlen(name), end = n;
  while (end > 0 && !(name[end - 1] >= '0' && name[end - 1] <= '9'))
    end--;
  if (end == 0)
    return -1;
  size_t start = end;
  while (start > 0 && name[start - 1] >= '0' && name[start - 1] <= '9')
    start--;
  int64_t v = 0;
  for (size_t i = start; i < end; i++) {
    int d = name[i] - '0';
    if (v > (INT64_MAX - d) / 10)
      return -1; /* too long a run to be a step */
    v = v * 10 + d;
  }
  return v;
}

bool ckpt_metric_key_valid(const char *key, size_t len) {
  if (len == 0 || len > CKPT_METRIC_KEY_MAX)
    return false;
  for (size_t i = 0; i < len; i++) {
    char c = key[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
          (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-'))
      return false;
  }
  return true;
}

int ckpt_metric_value_parse(const char *s, size_t len, double *out) {
  char text[64];
  if (len == 0 || len >= sizeof(text))
    return -EINVAL;
  /* strtod also takes hex, inf, nan and leading spaces: a metric is
   * written as a decimal (0.25, -3, 1e-4) and nothing else. */
  for (size_t i = 0; i < len; i++)
    if (!strchr("0123456789+-.eE", s[i]))
      return -EINVAL;
  memcpy(text, s, len);
  text[len] = '\0';
  char *end = NULL;
  double v = strtod(text, &end);
  if (end != text + len || !isfinite(v))
    return -EINVAL;
  *out = v;
  return 0;
}

static int by_key(const void *a, const void *b) {
  return strcmp(((const ckpt_metric_t *)a)->key,
                ((const ckpt_metric_t *)b)->key);
}

int ckpt_metadata_set_retention(ckpt_metadata_t *m,
                                const ckpt_commit_words_t *w) {
  m->has_step = w->has_step;
  m->step = w->step;
  m->protect = w->protect;
  free(m->metrics);
  m->metrics = NULL;
  m->n_metrics = 0;
  if (w->n_metrics == 0)
    return 0;
  m->metrics = malloc(w->n_metrics * sizeof(*m->metrics));
  if (!m->metrics)
    return -ENOMEM;
  memcpy(m->metrics, w->metrics, w->n_metrics * sizeof(*m->metrics));
  m->n_metrics = w->n_metrics;
  qsort(m->metrics, m->n_metrics, sizeof(*m->metrics), by_key);
  return 0;
}

int ckpt_metric_format(double v, char *buf, size_t cap) {
  char t[40];
  snprintf(t, sizeof(t), "%.15g", v);
  if (strtod(t, NULL) != v)
    snprintf(t, sizeof(t), "%.17g", v);
  return snprintf(buf, cap, "%s", t);
}

bool ckpt_keep_policy_active(const ckpt_keep_policy_t *p) {
  return p->last || p->every || p->best;
}

/* A number >= 1 of at most max, from s[0..n). */
static int count(const char *s, size_t n, uint64_t max, uint64_t *out) {
  if (n == 0 || n > 20)
    return -EINVAL;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] < '0' || s[i] > '9')
      return -EINVAL;
    uint64_t d = (uint64_t)(s[i] - '0');
    if (v > (max - d) / 10)
      return -EINVAL;
    v = v * 10 + d;
  }
  if (v == 0)
    return -EINVAL;
  *out = v;
  return 0;
}

/* One rule, s[0..n): last:N, every:K or best:M:KEY:min|max. */
static int rule(const char *s, size_t n, ckpt_keep_policy_t *p) {
  const char *colon = memchr(s, ':', n);
  if (!colon)
    return -EINVAL;
  size_t kn = (size_t)(colon - s);
  const char *v = colon + 1;
  size_t vn = n - kn - 1;
  uint64_t x;
  if (kn == 4 && !memcmp(s, "last", 4) && !p->last) {
    if (count(v, vn, UINT32_MAX, &x))
      return -EINVAL;
    p->last = (uint32_t)x;
  } else if (kn == 5 && !memcmp(s, "every", 5) && !p->every) {
    if (count(v, vn, INT64_MAX, &x))
      return -EINVAL;
    p->every = x;
  } else if (kn == 4 && !memcmp(s, "best", 4) && !p->best) {
    const char *c2 = memchr(v, ':', vn);           /* M:KEY:MODE */
    const char *c3 = c2 ? memchr(c2 + 1, ':', vn - (size_t)(c2 + 1 - v))
                        : NULL;
    if (!c3 || count(v, (size_t)(c2 - v), UINT32_MAX, &x))
      return -EINVAL;
    const char *key = c2 + 1, *mode = c3 + 1;
    size_t keyn = (size_t)(c3 - key), moden = vn - (size_t)(mode - v);
    if (!ckpt_metric_key_valid(key, keyn))
      return -EINVAL;
    if (moden == 3 && !memcmp(mode, "min", 3))
      p->maximize = false;
    else if (moden == 3 && !memcmp(mode, "max", 3))
      p->maximize = true;
    else
      return -EINVAL;
    memcpy(p->metric, key, keyn);
    p->metric[keyn] = '\0';
    p->best = (uint32_t)x;
  } else {
    return -EINVAL;
  }
  return 0;
}

int ckpt_keep_policy_parse(const char *s, size_t len,
                           ckpt_keep_policy_t *out) {
  memset(out, 0, sizeof(*out));
  if (memchr(s, '\0', len))
    return -EINVAL;
  size_t i = 0;
  while (i <= len) {
    const char *comma = memchr(s + i, ',', len - i);
    size_t end = comma ? (size_t)(comma - s) : len;
    if (rule(s + i, end - i, out)) {
      memset(out, 0, sizeof(*out));
      return -EINVAL;
    }
    i = end + 1;
  }
  return 0;
}

int ckpt_keep_policy_format(const ckpt_keep_policy_t *p, char *buf,
                            size_t cap) {
  char last[32] = "", every[40] = "", best[128] = "";
  if (p->last)
    snprintf(last, sizeof(last), "last:%u", p->last);
  if (p->every)
    snprintf(every, sizeof(every), "%severy:%llu", p->last ? "," : "",
             (unsigned long long)p->every);
  if (p->best)
    snprintf(best, sizeof(best), "%sbest:%u:%s:%s",
             p->last || p->every ? "," : "", p->best, p->metric,
             p->maximize ? "max" : "min");
  return snprintf(buf, cap, "%s%s%s", last, every, best);
}
