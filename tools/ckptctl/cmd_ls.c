/*
 * cmd_ls.c - `ckptctl ls BACKING_DIR`: every checkpoint directory of a
 * backing directory, committed, unfinished or damaged (catalog.c), as a
 * table or one JSON document.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "ckptctl.h"
#include "json.h"

/* A save in flight in .saves is committing: its name is known only once
 * it is published. */
static bool is_save(const ckpt_cat_entry_t *e) {
  return strncmp(e->name, ".saves/", 7) == 0;
}

static const char *state_name(const ckpt_cat_entry_t *e) {
  if (e->mount_state)
    return e->mount_state;
  if (e->state == CKPT_CAT_UNFINISHED && is_save(e) && e->held)
    return "committing";
  return e->state == CKPT_CAT_COMMITTED    ? "committed"
         : e->state == CKPT_CAT_UNFINISHED ? "unfinished"
                                           : "damaged";
}

/* One checkpoint as a JSON object: what .metadata says is null unless it
 * is committed. */
static void ls_entry_json(json_t *j, const ckpt_cat_entry_t *e) {
  const ckpt_metadata_t *m = &e->meta;
  bool ok = e->state == CKPT_CAT_COMMITTED;
  char t[64];
  j_open(j, '{');
  j_key(j, "name"), j_str(j, e->name);
  j_key(j, "state"), j_str(j, state_name(e));
  j_key(j, "created_at");
  ok ? j_str(j, iso_time(m->created_at, t, sizeof(t))) : j_null(j);
  j_key(j, "created_at_unix");
  ok ? j_i64(j, m->created_at) : j_null(j);
  j_key(j, "save_id"), j_str(j, ok ? m->save_id : NULL);
  j_key(j, "world_size");
  ok ? j_i64(j, m->world_size) : j_null(j);
  j_key(j, "tensors");
  ok ? j_u64(j, m->n_tensors) : j_null(j);
  j_key(j, "chunks");
  ok ? j_u64(j, m->n_chunks) : j_null(j);
  j_key(j, "blobs");
  ok ? j_u64(j, m->n_blobs) : j_null(j);
  j_key(j, "bytes");
  ok ? j_u64(j, stored_bytes(m)) : j_null(j);
  j_key(j, "step");
  ok && e->step >= 0 ? j_i64(j, e->step) : j_null(j);
  j_key(j, "protected"), j_bool(j, ok && e->is_protected);
  j_key(j, "metrics");
  j_open(j, '{');
  for (uint32_t i = 0; ok && i < m->n_metrics; i++)
    j_key(j, m->metrics[i].key), j_metric(j, m->metrics[i].value);
  j_close(j, '}');
  j_key(j, "disk_bytes"), j_u64(j, e->disk_bytes);
  j_key(j, "held"), j_bool(j, e->held);
  j_key(j, "error"), j_str(j, e->error);
  j_key(j, "mount"), j_str(j, e->mount);
  if (e->location)
    j_key(j, "location"), j_str(j, e->location);
  j_close(j, '}');
}

static void ls_json(const char *backing, const ckpt_catalog_t *cat) {
  json_t j;
  j_begin(&j);
  j_open(&j, '{');
  j_key(&j, "backing_dir");
  j_str(&j, backing);
  j_key(&j, "checkpoints");
  j_open(&j, '[');
  for (size_t i = 0; i < cat->n; i++)
    ls_entry_json(&j, &cat->e[i]);
  j_close(&j, ']');
  j_close(&j, '}');
  j_end(&j);
}

static void ls_text(const char *backing, const ckpt_catalog_t *cat) {
  char t[64], b[32];
  if (cat->n == 0) {
    printf("%s: no checkpoints\n", backing);
    return;
  }
  int w = 4;
  for (size_t i = 0; i < cat->n; i++)
    if ((int)strlen(cat->e[i].name) > w)
      w = (int)strlen(cat->e[i].name);
  bool tiered = false;
  for (size_t i = 0; i < cat->n; i++)
    tiered |= cat->e[i].location != NULL;
  printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s  %s%s\n", w, "NAME", "STATE",
         "CREATED", "WORLD", "TENSORS", "BLOBS", "BYTES",
         tiered ? "LOCATION     " : "", "STEP");
  for (size_t i = 0; i < cat->n; i++) {
    const ckpt_cat_entry_t *e = &cat->e[i];
    const ckpt_metadata_t *m = &e->meta;
    if (e->state == CKPT_CAT_COMMITTED) {
      char step[32] = "-";
      if (e->step >= 0)
        snprintf(step, sizeof(step), "%lld", (long long)e->step);
      char loc[16] = "";
      if (tiered)
        snprintf(loc, sizeof(loc), "%-11s  ", e->location ? e->location : "-");
      printf("%-*s  %-10s  %-20s  %5d  %7u  %6u  %10s  %s%s%s\n", w, e->name,
             "committed", iso_time(m->created_at, t, sizeof(t)),
             m->world_size, m->n_tensors, m->n_blobs,
             human_bytes(stored_bytes(m), b, sizeof(b)), loc, step,
             e->is_protected ? " protected" : "");
    } else if (e->mount) {
      printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s  (on %s%s%s)\n", w,
             e->name, state_name(e), "-", "-", "-", "-",
             human_bytes(e->disk_bytes, b, sizeof(b)), e->mount,
             e->error ? ": " : "", e->error ? e->error : "");
    } else {
      printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s  %s\n", w, e->name,
             state_name(e), "-", "-", "-", "-",
             human_bytes(e->disk_bytes, b, sizeof(b)),
             e->state == CKPT_CAT_DAMAGED ? e->error
             : e->held && is_save(e)
                 ? "(a save being written; named at its commit)"
             : e->held ? "(a save in flight holds it)"
                       : "(interrupted save: the next mount removes it)");
    }
  }
}

/* Names with numbers in them by the numbers' values: step-8 < step-10. */
static int natural_cmp(const char *x, const char *y) {
  while (*x && *y) {
    if (isdigit((unsigned char)*x) && isdigit((unsigned char)*y)) {
      while (*x == '0' && isdigit((unsigned char)x[1]))
        x++;
      while (*y == '0' && isdigit((unsigned char)y[1]))
        y++;
      size_t nx = 0, ny = 0;
      while (isdigit((unsigned char)x[nx]))
        nx++;
      while (isdigit((unsigned char)y[ny]))
        ny++;
      if (nx != ny)
        return nx < ny ? -1 : 1;
      int c = strncmp(x, y, nx);
      if (c)
        return c;
      x += nx, y += ny;
      continue;
    }
    if (*x != *y)
      return (unsigned char)*x < (unsigned char)*y ? -1 : 1;
    x++, y++;
  }
  return *x ? 1 : *y ? -1 : 0;
}

static int by_name(const void *pa, const void *pb) {
  const ckpt_cat_entry_t *a = pa, *b = pb;
  int c = natural_cmp(a->name, b->name);
  return c ? c : strcmp(a->name, b->name);
}

/* Committed ones by creation (created_at, then .metadata's mtime), then
 * the others by name. */
static int by_time(const void *pa, const void *pb) {
  const ckpt_cat_entry_t *a = pa, *b = pb;
  bool ca = a->state == CKPT_CAT_COMMITTED, cb = b->state == CKPT_CAT_COMMITTED;
  if (ca != cb)
    return ca ? -1 : 1;
  if (ca) {
    if (a->meta.created_at != b->meta.created_at)
      return a->meta.created_at < b->meta.created_at ? -1 : 1;
    if (a->mtime.tv_sec != b->mtime.tv_sec)
      return a->mtime.tv_sec < b->mtime.tv_sec ? -1 : 1;
    if (a->mtime.tv_nsec != b->mtime.tv_nsec)
      return a->mtime.tv_nsec < b->mtime.tv_nsec ? -1 : 1;
  }
  return by_name(pa, pb);
}

static uint64_t entry_bytes(const ckpt_cat_entry_t *e) {
  return e->state == CKPT_CAT_COMMITTED ? stored_bytes(&e->meta)
                                        : e->disk_bytes;
}

static int by_size(const void *pa, const void *pb) {
  uint64_t x = entry_bytes(pa), y = entry_bytes(pb);
  if (x != y)
    return x > y ? -1 : 1;
  return by_time(pa, pb);
}

static bool committed_in(const ckpt_catalog_t *cat, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (cat->e[i].state == CKPT_CAT_COMMITTED && !strcmp(cat->e[i].name, name))
      return true;
  return false;
}

/* Append an entry staged on mount mp: 0 or -ENOMEM. */
static int add_staged(ckpt_catalog_t *cat, const char *name, const char *mp,
                      const char *state, const char *reason, uint64_t bytes) {
  ckpt_cat_entry_t *g = realloc(cat->e, (cat->n + 1) * sizeof(*g));
  if (!g)
    return -ENOMEM;
  cat->e = g;
  ckpt_cat_entry_t *en = &cat->e[cat->n++];
  memset(en, 0, sizeof(*en));
  en->state = CKPT_CAT_UNFINISHED;
  en->name = strdup(name);
  en->mount = strdup(mp);
  en->mount_state = strdup(state);
  en->error = reason[0] ? strdup(reason) : NULL;
  en->disk_bytes = bytes;
  return en->name && en->mount && en->mount_state ? 0 : -ENOMEM;
}

/* Add what mount mp stages (or commits) that BACKING_DIR has not yet:
 * each NAME with its .status state, bytes and (failed) reason. */
static int add_mount(ckpt_catalog_t *cat, size_t ncommitted, const char *mp) {
  DIR *d = opendir(mp);
  if (!d)
    return 0; /* not ours to read, or gone */
  int rc = 0;
  struct dirent *de;
  while (rc == 0 && (de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.' || committed_in(cat, ncommitted, de->d_name))
      continue;
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/%s/.status", mp, de->d_name);
    FILE *f = fopen(path, "r");
    if (!f)
      continue;
    char line[512], state[32] = "", reason[512] = "";
    unsigned long long bytes = 0, v;
    for (int k = 0; fgets(line, sizeof(line), f); k++) {
      line[strcspn(line, "\n")] = '\0';
      if (k == 0)
        snprintf(state, sizeof(state), "%.31s", line);
      else if (sscanf(line, "bytes %llu", &v) == 1)
        bytes = v;
      else if (k == 1 && !strcmp(state, "failed"))
        snprintf(reason, sizeof(reason), "%.511s", line);
    }
    fclose(f);
    if (strcmp(state, "staging") && strcmp(state, "committing") &&
        strcmp(state, "failed"))
      continue;
    rc = add_staged(cat, de->d_name, mp, state, reason, bytes);
  }
  closedir(d);
  return rc;
}

/* How long ls waits for one mount to answer: a daemon that is stopped
 * (SIGSTOP, a debugger) or hung blocks every file call on its mount, and a
 * call the daemon has read cannot even be killed until it answers. */
#define MOUNT_WAIT_S 5

/* Child: read mount mp and write what it stages to fd, one entry as
 * NAME\0STATE\0BYTES\0REASON\0. Never returns. */
static void mount_reader(const char *mp, int fd) {
  /* The caller's output must not wait for this process, which may stay
   * blocked in the mount after ls has ended. */
  int null = open("/dev/null", O_RDWR);
  if (null >= 0) {
    dup2(null, STDIN_FILENO);
    dup2(null, STDOUT_FILENO);
    dup2(null, STDERR_FILENO);
  }
  ckpt_catalog_t found = {0};
  int rc = add_mount(&found, 0, mp);
  FILE *f = rc == 0 ? fdopen(fd, "w") : NULL;
  for (size_t i = 0; f && i < found.n; i++) {
    const ckpt_cat_entry_t *en = &found.e[i];
    fprintf(f, "%s%c%s%c%llu%c%s%c", en->name, 0, en->mount_state, 0,
            (unsigned long long)en->disk_bytes, 0, en->error ? en->error : "",
            0);
  }
  _exit(f && fflush(f) == 0 ? 0 : 1);
}

/* The next NUL-terminated field of buf[*pos, len), or NULL. */
static const char *next_field(const char *buf, size_t len, size_t *pos) {
  const char *p = buf + *pos;
  const char *z = *pos < len ? memchr(p, 0, len - *pos) : NULL;
  if (!z)
    return NULL;
  *pos = (size_t)(z - buf) + 1;
  return p;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* add_mount in a child process, waited for MOUNT_WAIT_S: 0, -errno, or 1
 * when the mount did not answer (said on stderr; nothing of it is added,
 * and the child is left to end when the daemon answers, if ever). */
static int add_mount_bounded(ckpt_catalog_t *cat, size_t ncommitted,
                             const char *mp) {
  int p[2];
  if (pipe2(p, O_CLOEXEC))
    return -errno;
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    close(p[0]);
    close(p[1]);
    return -e;
  }
  if (pid == 0) {
    close(p[0]);
    mount_reader(mp, p[1]);
  }
  close(p[1]);
  char *buf = NULL;
  size_t len = 0, cap = 0;
  int rc = 0;
  bool answered = false;
  double deadline = now_s() + MOUNT_WAIT_S;
  while (rc == 0) {
    double left = deadline - now_s();
    struct pollfd pf = {.fd = p[0], .events = POLLIN};
    int n = left > 0 ? poll(&pf, 1, (int)(left * 1000) + 1) : 0;
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break; /* the deadline, or poll failed: not answered */
    if (len == cap) {
      char *g = realloc(buf, cap ? cap * 2 : 4096);
      if (!g) {
        rc = -ENOMEM;
        break;
      }
      buf = g;
      cap = cap ? cap * 2 : 4096;
    }
    ssize_t r = read(p[0], buf + len, cap - len);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      answered = r == 0;
      break;
    }
    len += (size_t)r;
  }
  close(p[0]);
  int status = 0;
  if (answered && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
      WEXITSTATUS(status) == 0) {
    /* What BACKING_DIR has not committed yet. */
    size_t pos = 0;
    const char *name, *state, *bytes, *reason;
    while (rc == 0 && (name = next_field(buf, len, &pos)) &&
           (state = next_field(buf, len, &pos)) &&
           (bytes = next_field(buf, len, &pos)) &&
           (reason = next_field(buf, len, &pos))) {
      if (!committed_in(cat, ncommitted, name))
        rc = add_staged(cat, name, mp, state, reason,
                        strtoull(bytes, NULL, 10));
    }
  } else if (rc == 0) {
    if (answered)
      fprintf(stderr, "ckptctl: ls: cannot read %s: what it stages is not "
                      "listed\n", mp);
    else
      fprintf(stderr,
              "ckptctl: ls: %s does not answer within %d s (its daemon is "
              "stopped or hung?): what it stages is not listed\n",
              mp, MOUNT_WAIT_S);
    rc = 1;
  }
  /* Not answered: not waited for (it may never end); reaped with ls. */
  free(buf);
  return rc;
}

/* Checkpoints staged or being committed through the ckptfs mounts of
 * this host over BACKING_DIR (mountinfo: type fuse.ckptfs, source
 * BACKING_DIR): they are in no file of BACKING_DIR yet. */
static int add_local_mounts(const char *backing, ckpt_catalog_t *cat) {
  char *real = realpath(backing, NULL);
  FILE *f = real ? fopen("/proc/self/mountinfo", "r") : NULL;
  if (!f) {
    free(real);
    return 0;
  }
  size_t ncommitted = cat->n;
  int rc = 0;
  char *line = NULL;
  size_t cap = 0;
  while (rc == 0 && getline(&line, &cap, f) > 0) {
    /* ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - TYPE SOURCE */
    char *save = NULL, *mp = NULL, *type = NULL, *source = NULL;
    bool dash = false;
    int field = 0;
    for (char *t = strtok_r(line, " \n", &save); t;
         t = strtok_r(NULL, " \n", &save), field++) {
      if (field == 4)
        mp = t;
      else if (dash && !type)
        type = t;
      else if (dash && !source)
        source = t;
      else if (field > 5 && !strcmp(t, "-"))
        dash = true;
    }
    if (mp && type && source && !strcmp(type, "fuse.ckptfs") &&
        !strcmp(mountinfo_unescape(source), real)) {
      int r = add_mount_bounded(cat, ncommitted, mountinfo_unescape(mp));
      rc = r < 0 ? r : 0; /* 1: skipped, said why */
    }
  }
  free(line);
  fclose(f);
  free(real);
  return rc;
}

/* --tier DIR: each committed checkpoint's location, and the tier's own
 * (not flushed yet, or another save of the name) added to cat. 0 or
 * -errno. */
static int add_tier(const char *dir, ckpt_catalog_t *cat) {
  int tfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (tfd < 0)
    return -errno;
  ckpt_catalog_t tc;
  int rc = ckpt__catalog_scan(tfd, false, &tc);
  close(tfd);
  if (rc)
    return rc;
  size_t n = cat->n;
  for (size_t i = 0; i < n; i++)
    if (cat->e[i].state == CKPT_CAT_COMMITTED)
      cat->e[i].location = "shared";
  for (size_t k = 0; k < tc.n && rc == 0; k++) {
    ckpt_cat_entry_t *t = &tc.e[k];
    if (t->state != CKPT_CAT_COMMITTED)
      continue;
    bool same = false;
    for (size_t i = 0; i < n && !same; i++)
      if (cat->e[i].state == CKPT_CAT_COMMITTED &&
          !strcmp(cat->e[i].name, t->name) &&
          !strcmp(cat->e[i].meta.save_id ? cat->e[i].meta.save_id : "",
                  t->meta.save_id ? t->meta.save_id : "")) {
        cat->e[i].location = "shared+tier";
        same = true;
      }
    if (same)
      continue;
    ckpt_cat_entry_t *e = realloc(cat->e, (cat->n + 1) * sizeof(*e));
    if (!e) {
      rc = -ENOMEM;
      break;
    }
    cat->e = e;
    cat->e[cat->n] = *t; /* moved: tc's copy is cleared */
    cat->e[cat->n++].location = "tier";
    memset(t, 0, sizeof(*t));
  }
  ckpt__catalog_free(&tc);
  return rc;
}

int cmd_ls(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_catalog_t cat;
  int rc = ckpt__catalog_scan(bfd, true, &cat);
  if (rc == 0 && ((rc = ckpt__catalog_saves(bfd, &cat)) != 0 ||
                  (rc = add_local_mounts(backing, &cat)) != 0))
    ckpt__catalog_free(&cat);
  if (rc) {
    fail("cannot list %s: %s", backing, strerror(-rc));
    return EXIT_NO;
  }
  if (a->tier && (rc = add_tier(a->tier, &cat)) != 0) {
    ckpt__catalog_free(&cat);
    fail("cannot list the tier %s: %s", a->tier, strerror(-rc));
    return EXIT_NO;
  }
  if (cat.n > 1)
    qsort(cat.e, cat.n, sizeof(cat.e[0]),
          a->sort == SORT_NAME   ? by_name
          : a->sort == SORT_SIZE ? by_size
                                 : by_time);
  if (a->json)
    ls_json(backing, &cat);
  else
    ls_text(backing, &cat);
  ckpt__catalog_free(&cat);
  return 0;
}
