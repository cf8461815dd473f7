/*
 * commit_words.c - what is written to NAME/.commit: "sync" or "async",
 * then modifiers separated by spaces, in any order (SPEC, "Committing"):
 *
 *   solo             this rank publishes NAME alone, as a world of one
 *   replace=TARGET   publish as TARGET, over a committed TARGET
 *   step=N           the checkpoint's step, for retention (else the last
 *                    run of digits in its name counts)
 *   metric=KEY:VALUE a number retention may rank by (keep=best:...);
 *                    up to CKPT_MAX_METRICS, each KEY once
 *   protect          never removed by a retention policy
 *   level=shared     with -o tier: a sync commit returns once the
 *                    checkpoint is published in BACKING_DIR (the flush)
 *
 * Each at most once (metric= once per KEY); a trailing newline is fine. TARGET is a checkpoint
 * name that runs to the next space or the end, so a name holding a space
 * or a newline cannot be a replace target. Anything else is refused with
 * -EINVAL.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "planner_int.h"

/* "step=N": N a decimal 0 .. INT64_MAX. */
static int step_word(const char *v, size_t n, ckpt_commit_words_t *out) {
  if (n == 0 || n > 19)
    return -EINVAL;
  int64_t x = 0;
  for (size_t i = 0; i < n; i++) {
    if (v[i] < '0' || v[i] > '9')
      return -EINVAL;
    int d = v[i] - '0';
    if (x > (INT64_MAX - d) / 10)
      return -EINVAL;
    x = x * 10 + d;
  }
  out->has_step = true;
  out->step = x;
  return 0;
}

/* "metric=KEY:VALUE", a KEY not seen before. */
static int metric_word(const char *v, size_t n, ckpt_commit_words_t *out) {
  const char *colon = memchr(v, ':', n);
  if (!colon || out->n_metrics == CKPT_MAX_METRICS)
    return -EINVAL;
  size_t kn = (size_t)(colon - v);
  ckpt_metric_t *m = &out->metrics[out->n_metrics];
  if (!ckpt_metric_key_valid(v, kn) ||
      ckpt_metric_value_parse(colon + 1, n - kn - 1, &m->value))
    return -EINVAL;
  memcpy(m->key, v, kn);
  m->key[kn] = '\0';
  for (uint32_t i = 0; i < out->n_metrics; i++)
    if (!strcmp(out->metrics[i].key, m->key))
      return -EINVAL;
  out->n_metrics++;
  return 0;
}

int ckpt_commit_words_parse(const char *buf, size_t len,
                            ckpt_commit_words_t *out) {
  memset(out, 0, sizeof(*out));
  if (len && buf[len - 1] == '\n')
    len--;
  size_t i = 0, word = 0;
  bool seen_solo = false, seen_replace = false, seen_step = false,
       seen_protect = false, seen_level = false;
  if (len == 0 || buf[0] == ' ' || buf[len - 1] == ' ')
    return -EINVAL; /* the word first, nothing after the last */
  while (i < len) {
    if (buf[i] == ' ') {
      i++;
      continue;
    }
    size_t start = i;
    while (i < len && buf[i] != ' ')
      i++;
    const char *w = buf + start;
    size_t n = i - start;
    if (memchr(w, '\0', n) || memchr(w, '\n', n))
      return -EINVAL;
    if (word++ == 0) {
      if (n == 4 && memcmp(w, "sync", 4) == 0)
        out->sync = true;
      else if (!(n == 5 && memcmp(w, "async", 5) == 0))
        return -EINVAL;
    } else if (n == 4 && memcmp(w, "solo", 4) == 0 && !seen_solo) {
      out->solo = seen_solo = true;
    } else if (n > 8 && memcmp(w, "replace=", 8) == 0 && !seen_replace) {
      size_t tn = n - 8;
      if (tn >= sizeof(out->replace))
        return -EINVAL;
      memcpy(out->replace, w + 8, tn);
      out->replace[tn] = '\0';
      if (!ckpt_name_valid(out->replace))
        return -EINVAL;
      seen_replace = true;
    } else if (n >= 5 && memcmp(w, "step=", 5) == 0 && !seen_step) {
      if (step_word(w + 5, n - 5, out))
        return -EINVAL;
      seen_step = true;
    } else if (n >= 7 && memcmp(w, "metric=", 7) == 0) {
      if (metric_word(w + 7, n - 7, out))
        return -EINVAL;
    } else if (n == 7 && memcmp(w, "protect", 7) == 0 && !seen_protect) {
      out->protect = seen_protect = true;
    } else if (n == 12 && memcmp(w, "level=shared", 12) == 0 && !seen_level) {
      out->level_shared = seen_level = true;
    } else {
      return -EINVAL;
    }
  }
  return word > 0 ? 0 : -EINVAL;
}
