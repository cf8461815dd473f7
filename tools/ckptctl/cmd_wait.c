/*
 * cmd_wait.c - `ckptctl wait MOUNTPOINT/NAME`: follow an async save
 * through NAME/.status on a mount until it is committed or failed: a
 * progress bar on a terminal, a line per change otherwise, or one JSON
 * document at the end.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckptctl.h"
#include "json.h"

/* One wait, between reads of .status. */
typedef struct {
  const args_t *a;
  const char *dir;      /* MOUNTPOINT/NAME */
  char base[PATH_MAX];  /* dir without trailing slashes */
  const char *name;     /* NAME, for messages: the last component */
  bool tty;             /* text on a terminal: the progress bar */
  double start, last_line;
  char state[32], last_state[32];
  char *text;           /* the .status last read */
  uint64_t done, total, last_done;
} wait_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_s(double s) {
  struct timespec ts = {.tv_sec = (time_t)s,
                        .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* The .status text of the checkpoint directory: malloc'd, or NULL with
 * errno set. */
static char *read_status(const char *dir) {
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s/.status", dir);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return NULL;
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  char tmp[4096];
  ssize_t r;
  while ((r = read(fd, tmp, sizeof(tmp))) != 0) {
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 || ckpt_buf_append(&b, tmp, (size_t)r)) {
      int e = r < 0 ? errno : ENOMEM;
      close(fd);
      ckpt_buf_free(&b);
      errno = e;
      return NULL;
    }
  }
  close(fd);
  if (ckpt_buf_append(&b, "", 1)) {
    ckpt_buf_free(&b);
    errno = ENOMEM;
    return NULL;
  }
  return ckpt_buf_steal(&b);
}

static void draw_bar(const char *name, uint64_t done, uint64_t total,
                     double elapsed) {
  char a[32], b[32];
  int width = 30;
  double f = total ? (double)done / (double)total : 0;
  if (f > 1)
    f = 1;
  int fill = (int)(f * width);
  printf("\r%s: committing [", name);
  for (int i = 0; i < width; i++)
    putchar(i < fill ? '#' : '.');
  printf("] %3d%% %s of %s, %.0f s\033[K", (int)(f * 100),
         human_bytes(done, a, sizeof(a)), human_bytes(total, b, sizeof(b)),
         elapsed);
  fflush(stdout);
}

static void wait_init(wait_t *w, const args_t *a) {
  memset(w, 0, sizeof(*w));
  w->a = a;
  w->dir = a->pos[0];
  snprintf(w->base, sizeof(w->base), "%s", w->dir);
  for (size_t n = strlen(w->base); n > 1 && w->base[n - 1] == '/';)
    w->base[--n] = '\0';
  const char *name = strrchr(w->base, '/');
  w->name = name && name[1] ? name + 1 : w->base;
  w->tty = !a->json && isatty(STDOUT_FILENO);
  w->start = now_s();
  w->last_line = -1;
  w->last_done = UINT64_MAX;
}

/* Read .status again: its first line into w->state, its "bytes D of T"
 * line into w->done and w->total. 0, or -1 with the reason printed. */
static int poll_status(wait_t *w) {
  free(w->text);
  w->text = read_status(w->dir);
  if (!w->text) {
    struct stat st;
    if (errno == ENOENT && stat(w->dir, &st) == 0)
      fail("%s has no .status: not a checkpoint directory of a ckptfs "
           "mount (give MOUNTPOINT/NAME)", w->dir);
    else
      fail("cannot read %s/.status: %s (give MOUNTPOINT/NAME of a "
           "checkpoint in a mounted ckptfs)", w->dir, strerror(errno));
    return -1;
  }
  size_t l = strcspn(w->text, "\n");
  snprintf(w->state, sizeof(w->state), "%.*s", (int)(l < 31 ? l : 31),
           w->text);
  unsigned long long d = 0, t = 0;
  const char *p = strstr(w->text, "\nbytes ");
  if (p && sscanf(p, "\nbytes %llu of %llu", &d, &t) == 2)
    w->done = d, w->total = t;
  return 0;
}

/* While the save goes on, el seconds in: the bar on a terminal, else a
 * line when the state changes (or, at most each second, the bytes). */
static void show_progress(wait_t *w, double el) {
  const char *state = w->state, *name = w->name;
  if (w->tty && !strcmp(state, "committing")) {
    draw_bar(name, w->done, w->total, el);
  } else if (!w->a->json &&
             (strcmp(state, w->last_state) ||
              (w->done != w->last_done && el - w->last_line >= 1))) {
    if (w->tty)
      printf("\r\033[K");
    if (!strcmp(state, "committing") && w->total == 0)
      printf("%s: committing: planning, every rank must commit\n", name);
    else if (!strcmp(state, "committing"))
      printf("%s: committing: %llu of %llu bytes written\n", name,
             (unsigned long long)w->done, (unsigned long long)w->total);
    else
      printf("%s: %s%s\n", name, state,
             !strcmp(state, "staging") ? " (waiting for the commit)" : "");
    fflush(stdout);
    w->last_line = el;
    w->last_done = w->done;
  }
}

/* The JSON document of a wait that ended: state, the last state read,
 * reason (NULL: null), bytes, el seconds. */
static void wait_json(const char *dir, const char *state,
                      const char *last_state, const char *reason,
                      uint64_t done, uint64_t total, double el) {
  json_t j;
  j_begin(&j);
  j_open(&j, '{');
  j_key(&j, "checkpoint"), j_str(&j, dir);
  j_key(&j, "state"), j_str(&j, state);
  j_key(&j, "last_state"), j_str(&j, last_state);
  j_key(&j, "reason"), j_str(&j, reason);
  j_key(&j, "bytes_done"), j_u64(&j, done);
  j_key(&j, "bytes_total"), j_u64(&j, total);
  j_key(&j, "elapsed"), j_double(&j, el);
  j_close(&j, '}');
  j_end(&j);
}

/* --timeout passed, el seconds in: EXIT_TIMEOUT, reported. */
static int wait_timeout(const wait_t *w, double el) {
  if (w->tty)
    putchar('\n');
  if (w->a->json)
    wait_json(w->dir, "timeout", w->state, NULL, w->done, w->total, el);
  fail("%s: still %s after %g s (--timeout)", w->name, w->state,
       w->a->timeout);
  return EXIT_TIMEOUT;
}

/* "tensors 3\nblobs 1\nworld_size 2" -> "tensors 3, blobs 1, ..." */
static void print_committed(const char *name, const char *summary,
                            double el) {
  printf("%s: committed (", name);
  for (const char *q = summary; *q; q++)
    if (*q == '\n')
      fputs(", ", stdout);
    else
      putchar(*q == '_' ? ' ' : *q);
  printf(") after %.1f s\n", el);
}

/* The save ended (w->state committed or failed): 0 or EXIT_NO, reported;
 * the rest of .status is the summary or the reason. */
static int wait_end(wait_t *w) {
  double el = now_s() - w->start;
  bool ok = !strcmp(w->state, "committed");
  const char *rest = strchr(w->text, '\n');
  rest = rest ? rest + 1 : "";
  char *reason = strdup(rest);
  if (reason) { /* drop the trailing newline */
    size_t n = strlen(reason);
    while (n && reason[n - 1] == '\n')
      reason[--n] = '\0';
  }
  if (w->tty && w->last_state[0] && !strcmp(w->last_state, "committing")) {
    if (ok)
      draw_bar(w->name, w->total, w->total, el);
    putchar('\n');
  }
  if (w->a->json) {
    wait_json(w->dir, w->state, w->state, ok ? NULL : reason,
              ok ? w->total : w->done, w->total, el);
  } else if (ok) {
    print_committed(w->name, reason ? reason : "", el);
  } else {
    printf("%s: failed after %.1f s\n", w->name, el);
    fail("%s: the save failed: %s", w->name, reason ? reason : "");
  }
  free(reason);
  return ok ? 0 : EXIT_NO;
}

/* The level of a committed checkpoint's .status: 3 (shared) without a
 * location line (no tier: every commit ends on BACKING_DIR). */
static int location_level(const char *text) {
  const char *p = strstr(text, "\nlocation ");
  if (!p)
    return 3;
  p += strlen("\nlocation ");
  return !strncmp(p, "shared", 6) ? 3 : !strncmp(p, "partner", 7) ? 2 : 1;
}

/* Committed, waiting for --level: a line when the location or the flush's
 * bytes change (at most each second); true once there. *failed: the
 * flush failed for good (the reason printed). */
static bool at_level(wait_t *w, double el, bool *failed) {
  if (location_level(w->text) >= w->a->level)
    return true;
  const char *f = strstr(w->text, "\nflush failed: ");
  if (f) {
    *failed = true;
    fail("%s: committed, but its flush failed: %.*s", w->name,
         (int)strcspn(f + 16, "\n"), f + 16);
    return false;
  }
  unsigned long long d = 0, t = 0;
  const char *p = strstr(w->text, "\nflush bytes ");
  if (p)
    sscanf(p, "\nflush bytes %llu of %llu", &d, &t);
  if (!w->a->json && (w->done != d || w->last_line < 0) &&
      el - w->last_line >= 1) {
    const char *loc = strstr(w->text, "\nlocation ");
    printf("%s: committed, location %.*s, flush %llu of %llu bytes\n",
           w->name, loc ? (int)strcspn(loc + 10, "\n") : 0,
           loc ? loc + 10 : "", d, t);
    fflush(stdout);
    w->last_line = el;
  }
  w->done = d, w->total = t;
  return false;
}

int cmd_wait(const args_t *a, int bfd) {
  (void)bfd;
  wait_t w;
  wait_init(&w, a);
  int status;
  for (;;) {
    if (poll_status(&w))
      return EXIT_USAGE;
    double el = now_s() - w.start;
    if (!strcmp(w.state, "failed"))
      break;
    if (!strcmp(w.state, "committed")) {
      bool failed = false;
      if (!a->level || at_level(&w, el, &failed))
        break;
      if (failed) {
        if (a->json)
          wait_json(w.dir, "flush failed", w.state, NULL, w.done, w.total,
                    el);
        free(w.text);
        return EXIT_NO;
      }
    } else {
      show_progress(&w, el);
    }
    snprintf(w.last_state, sizeof(w.last_state), "%s", w.state);
    if (a->timeout > 0 && el >= a->timeout) {
      status = wait_timeout(&w, el);
      free(w.text);
      return status;
    }
    sleep_s(a->interval);
  }
  status = wait_end(&w);
  free(w.text);
  return status;
}
