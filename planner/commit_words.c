/*
 * commit_words.c - what is written to NAME/.commit: "sync" or "async",
 * then modifiers separated by spaces, in any order (SPEC, "Committing"):
 *
 *   solo             this rank publishes NAME alone, as a world of one
 *   replace=TARGET   publish as TARGET, over a committed TARGET
 *
 * Each at most once; a trailing newline is fine. TARGET is a checkpoint
 * name that runs to the next space or the end, so a name holding a space
 * or a newline cannot be a replace target. Anything else is refused with
 * -EINVAL.
 */
#include <errno.h>
#include <string.h>

#include "planner_int.h"

int ckpt_commit_words_parse(const char *buf, size_t len,
                            ckpt_commit_words_t *out) {
  memset(out, 0, sizeof(*out));
  if (len && buf[len - 1] == '\n')
    len--;
  size_t i = 0, word = 0;
  bool seen_solo = false, seen_replace = false;
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
    } else {
      return -EINVAL;
    }
  }
  return word > 0 ? 0 : -EINVAL;
}
