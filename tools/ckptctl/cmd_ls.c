/*
 * cmd_ls.c - `ckptctl ls BACKING_DIR`: every checkpoint directory of a
 * backing directory, committed, unfinished or damaged (catalog.c), as a
 * table or one JSON document.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
  j_key(j, "disk_bytes"), j_u64(j, e->disk_bytes);
  j_key(j, "held"), j_bool(j, e->held);
  j_key(j, "error"), j_str(j, e->error);
  j_key(j, "mount"), j_str(j, e->mount);
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
  printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s\n", w, "NAME", "STATE",
         "CREATED", "WORLD", "TENSORS", "BLOBS", "BYTES");
  for (size_t i = 0; i < cat->n; i++) {
    const ckpt_cat_entry_t *e = &cat->e[i];
    const ckpt_metadata_t *m = &e->meta;
    if (e->state == CKPT_CAT_COMMITTED) {
      printf("%-*s  %-10s  %-20s  %5d  %7u  %6u  %10s\n", w, e->name,
             "committed", iso_time(m->created_at, t, sizeof(t)),
             m->world_size, m->n_tensors, m->n_blobs,
             human_bytes(stored_bytes(m), b, sizeof(b)));
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
    ckpt_cat_entry_t *g = realloc(cat->e, (cat->n + 1) * sizeof(*g));
    if (!g) {
      rc = -ENOMEM;
      break;
    }
    cat->e = g;
    ckpt_cat_entry_t *en = &cat->e[cat->n];
    memset(en, 0, sizeof(*en));
    en->state = CKPT_CAT_UNFINISHED;
    en->name = strdup(de->d_name);
    en->mount = strdup(mp);
    en->mount_state = strdup(state);
    en->error = reason[0] ? strdup(reason) : NULL;
    en->disk_bytes = bytes;
    cat->n++;
    if (!en->name || !en->mount || !en->mount_state)
      rc = -ENOMEM;
  }
  closedir(d);
  return rc;
}

/* How long ls waits for one mount to answer: a daemon that is stopped
 * (SIGSTOP, a debugger) or hung blocks every file call on its mount. */
#define MOUNT_WAIT_S 5

/* One mount read on a thread of its own: ls leaves it behind when it does
 * not answer in time (a blocked FUSE call cannot be interrupted; the
 * thread ends with the process, or frees the job if it ever returns). */
typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t done_cv;
  bool done, abandoned;
  char *mp;
  ckpt_catalog_t found; /* what it stages, before filtering */
  int rc;
} mount_job_t;

/* A reader was left blocked in a mount. */
static atomic_bool left_behind;

static void job_free(mount_job_t *j) {
  ckpt__catalog_free(&j->found);
  pthread_cond_destroy(&j->done_cv);
  pthread_mutex_destroy(&j->lock);
  free(j->mp);
  free(j);
}

static void *mount_reader(void *arg) {
  mount_job_t *j = arg;
  ckpt_catalog_t found = {0};
  int rc = add_mount(&found, 0, j->mp);
  pthread_mutex_lock(&j->lock);
  j->found = found;
  j->rc = rc;
  j->done = true;
  bool abandoned = j->abandoned;
  pthread_cond_signal(&j->done_cv);
  pthread_mutex_unlock(&j->lock);
  if (abandoned)
    job_free(j);
  return NULL;
}

/* add_mount within MOUNT_WAIT_S: 0, -errno, or 1 when the mount did not
 * answer (said on stderr; nothing of it is added). */
static int add_mount_bounded(ckpt_catalog_t *cat, size_t ncommitted,
                             const char *mp) {
  mount_job_t *j = calloc(1, sizeof(*j));
  if (!j || !(j->mp = strdup(mp))) {
    free(j);
    return -ENOMEM;
  }
  pthread_mutex_init(&j->lock, NULL);
  pthread_cond_init(&j->done_cv, NULL);
  pthread_t th;
  int rc = pthread_create(&th, NULL, mount_reader, j);
  if (rc) {
    job_free(j);
    return -rc;
  }
  pthread_detach(th);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += MOUNT_WAIT_S;
  pthread_mutex_lock(&j->lock);
  while (!j->done &&
         pthread_cond_timedwait(&j->done_cv, &j->lock, &until) != ETIMEDOUT)
    ;
  if (!j->done) {
    j->abandoned = true;
    atomic_store(&left_behind, true);
    pthread_mutex_unlock(&j->lock);
    fprintf(stderr,
            "ckptctl: ls: %s does not answer within %d s (its daemon is "
            "stopped or hung?): what it stages is not listed\n",
            mp, MOUNT_WAIT_S);
    return 1;
  }
  pthread_mutex_unlock(&j->lock);
  rc = j->rc;
  /* Keep what BACKING_DIR has not committed yet; move it into cat. */
  for (size_t i = 0; rc == 0 && i < j->found.n; i++) {
    ckpt_cat_entry_t *en = &j->found.e[i];
    if (committed_in(cat, ncommitted, en->name))
      continue;
    ckpt_cat_entry_t *g = realloc(cat->e, (cat->n + 1) * sizeof(*g));
    if (!g) {
      rc = -ENOMEM;
      break;
    }
    cat->e = g;
    cat->e[cat->n++] = *en;
    memset(en, 0, sizeof(*en)); /* moved: freed with cat */
  }
  job_free(j);
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
  if (atomic_load(&left_behind)) {
    /* A reader still blocked in a mount that does not answer: end here,
     * without exit handlers (LeakSanitizer's would wait for ever to stop
     * that thread; exit_group ends it). */
    fflush(stdout);
    fflush(stderr);
    _exit(0);
  }
  return 0;
}
