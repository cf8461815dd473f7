/*
 * metrics.c - -o metrics=FILE: the mount's counters in the Prometheus text
 * exposition format, written every CKPT_METRICS_PERIOD seconds and once
 * more at unmount, the node_exporter textfile collector's way: into a new
 * FILE.tmp.PID.RANDOM in the same directory, then renamed over FILE, so
 * that a reader always finds a whole file.
 *
 * That directory may belong to another user (node_exporter's textfile
 * directory belongs to its service user), who can plant any name in it.
 * So the daemon (root) works through one descriptor of the directory and
 * only ever creates a name that did not exist (O_CREAT | O_EXCL, which
 * never follows a symlink, | O_NOFOLLOW | O_NONBLOCK for a FIFO), with a
 * random suffix it does not reuse; rename(2) replaces whatever FILE is
 * without following it. Nothing in the directory is read or truncated.
 *
 * The counters are atomics bumped where things happen (save.c, ops.c,
 * views.c, blocks.c; verify failures in the store's reader). Only the
 * staged gauges need fs->lock: taken for one checkpoint at a time.
 *
 * The thread that writes them runs in every mount, with or without
 * -o metrics: it also closes the cached descriptors of data files that
 * were removed (a checkpoint removed through another mount, by keep_last
 * or ckptctl prune), which would keep their space in use in BACKING_DIR.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "daemon.h"

static const char *const outcome_names[CKPT_COMMIT_OUTCOMES] = {
    "committed", "failed", "lost"};
#define CKPT_OP_NAME(op) #op,
static const char *const op_names[CKPT_OPS] = {CKPT_FUSE_OPS(CKPT_OP_NAME)};
#undef CKPT_OP_NAME
static const char *const reason_names[CKPT_FAIL_REASONS] = {
    "timeout", "no_space", "io", "invalid", "exists", "other"};

/* ----- the text ----- */

typedef struct {
  FILE *f;
  char labels[PATH_MAX + 64]; /* rank="R",mount="M" */
} out_t;

/* v as a label value: backslash, double quote and newline escaped. */
static void label_value(char *dst, size_t cap, const char *v) {
  size_t n = 0;
  for (; *v && n + 3 < cap; v++) {
    if (*v == '\\' || *v == '"') {
      dst[n++] = '\\';
      dst[n++] = *v;
    } else if (*v == '\n') {
      dst[n++] = '\\';
      dst[n++] = 'n';
    } else {
      dst[n++] = *v;
    }
  }
  dst[n] = '\0';
}

static void head(out_t *o, const char *name, const char *type,
                 const char *help) {
  fprintf(o->f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* name{labels[,extra]} value */
static void sample(out_t *o, const char *name, const char *extra,
                   unsigned long long v) {
  fprintf(o->f, "%s{%s%s%s} %llu\n", name, o->labels, extra ? "," : "",
          extra ? extra : "", v);
}

static void counter(out_t *o, const char *name, const char *help,
                    _Atomic uint64_t *v) {
  head(o, name, "counter", help);
  sample(o, name, NULL, (unsigned long long)atomic_load(v));
}

static void gauge(out_t *o, const char *name, const char *help, uint64_t v) {
  head(o, name, "gauge", help);
  sample(o, name, NULL, (unsigned long long)v);
}

/* Staged checkpoints (staging, committing, failed: their staged data is
 * held) and their bytes. fs->lock is taken for one checkpoint at a time,
 * each held by a reference meanwhile. */
static void staged_now(ckpt_fs_t *fs, uint64_t *ckpts, uint64_t *bytes) {
  *ckpts = *bytes = 0;
  ckpt_ckpt_t **list = NULL;
  size_t n = 0, cap = 0;
  pthread_mutex_lock(&fs->lock);
  for (ckpt_node_t *d = fs->root ? fs->root->children : NULL; d; d = d->next) {
    ckpt_ckpt_t *ck = d->ck;
    if (!ck || d->kind != CKPT_NODE_CKPT || ck->state == CKPT_COMMITTED)
      continue;
    if (n == cap) {
      size_t ncap = cap ? 2 * cap : 16;
      ckpt_ckpt_t **l = realloc(list, ncap * sizeof(*l));
      if (!l)
        break;
      list = l;
      cap = ncap;
    }
    ck->refs++;
    list[n++] = ck;
  }
  pthread_mutex_unlock(&fs->lock);
  for (size_t i = 0; i < n; i++) {
    pthread_mutex_lock(&fs->lock);
    if (list[i]->dir && list[i]->state != CKPT_COMMITTED) {
      uint64_t files, b;
      ckpt__ckpt_staged_size(list[i], &files, &b);
      (*ckpts)++;
      *bytes += b;
    }
    ckpt__ckpt_unref(fs, list[i]);
    pthread_mutex_unlock(&fs->lock);
  }
  free(list);
}

/* Resident bytes of this process (/proc/self/statm), or 0. */
static uint64_t rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "re");
  unsigned long long size = 0, resident = 0;
  if (!f)
    return 0;
  if (fscanf(f, "%llu %llu", &size, &resident) != 2)
    resident = 0;
  fclose(f);
  long page = sysconf(_SC_PAGESIZE);
  return (uint64_t)resident * (uint64_t)(page > 0 ? page : 4096);
}

/* Open descriptors of this process (/proc/self/fd, less the one reading
 * it), or 0. */
static uint64_t open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d)
    return 0;
  uint64_t n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n > 0 ? n - 1 : 0;
}

static void write_commits(out_t *o, ckpt_metrics_t *m) {
  char extra[64];
  head(o, "ckptfs_commits_total", "counter",
       "Commits of this rank that ended, by outcome (lost: another mount "
       "committed the name first).");
  for (int i = 0; i < CKPT_COMMIT_OUTCOMES; i++) {
    snprintf(extra, sizeof(extra), "outcome=\"%s\"", outcome_names[i]);
    sample(o, "ckptfs_commits_total", extra,
           (unsigned long long)atomic_load(&m->commits[i]));
  }
  head(o, "ckptfs_commit_failures_total", "counter",
       "Failed commits of this rank, by class of reason.");
  for (int i = 0; i < CKPT_FAIL_REASONS; i++) {
    snprintf(extra, sizeof(extra), "reason=\"%s\"", reason_names[i]);
    sample(o, "ckptfs_commit_failures_total", extra,
           (unsigned long long)atomic_load(&m->failures[i]));
  }
  head(o, "ckptfs_commit_duration_seconds", "histogram",
       "Seconds from the write to .commit to the save's end on this rank.");
  unsigned long long cum = 0;
  for (int b = 0; b <= CKPT_DURATION_BUCKETS; b++) {
    cum += (unsigned long long)atomic_load(&m->duration[b]);
    if (b < CKPT_DURATION_BUCKETS)
      snprintf(extra, sizeof(extra), "le=\"%g\"", ckpt__duration_le[b]);
    else
      snprintf(extra, sizeof(extra), "le=\"+Inf\"");
    sample(o, "ckptfs_commit_duration_seconds_bucket", extra, cum);
  }
  fprintf(o->f, "ckptfs_commit_duration_seconds_sum{%s} %.6f\n", o->labels,
          (double)atomic_load(&m->duration_us) * 1e-6);
  sample(o, "ckptfs_commit_duration_seconds_count", NULL, cum);
}

static void write_requests(out_t *o, ckpt_metrics_t *m) {
  char extra[64];
  head(o, "ckptfs_fuse_requests_total", "counter",
       "FUSE requests the daemon served, by opcode.");
  for (int i = 0; i < CKPT_OPS; i++) {
    snprintf(extra, sizeof(extra), "op=\"%s\"", op_names[i]);
    sample(o, "ckptfs_fuse_requests_total", extra,
           (unsigned long long)atomic_load(&m->requests[i]));
  }
}

static void write_all(ckpt_fs_t *fs, out_t *o) {
  ckpt_metrics_t *m = &fs->metrics;
  write_commits(o, m);
  write_requests(o, m);
  counter(o, "ckptfs_bytes_staged_total",
          "Bytes written into staged files (passthrough: sizes at close).",
          &m->bytes_staged);
  counter(o, "ckptfs_bytes_committed_total",
          "Bytes this rank wrote into data files at its commits.",
          &m->bytes_committed);
  counter(o, "ckptfs_bytes_read_total",
          "Bytes the daemon served from committed checkpoints.",
          &m->bytes_read);
  counter(o, "ckptfs_drain_hashed_bytes_total",
          "Bytes of closed staged files hashed where they are before "
          "their commit (the commit hashes what is left).",
          &m->bytes_drained);
  head(o, "ckptfs_verify_failures_total", "counter",
       "Chunks and blobs that verify=1 found damaged.");
  sample(o, "ckptfs_verify_failures_total", NULL,
         (unsigned long long)ckpt_store_verify_failures());
  uint64_t hashed, known;
  ckpt_store_verify_bytes(&hashed, &known);
  head(o, "ckptfs_verify_bytes_total", "counter",
       "Bytes of chunks and blobs verify=1 checked: hashed, or known "
       "(hashed from their data file by this mount's commit, the file "
       "unchanged since).");
  sample(o, "ckptfs_verify_bytes_total", "how=\"hashed\"",
         (unsigned long long)hashed);
  sample(o, "ckptfs_verify_bytes_total", "how=\"known\"",
         (unsigned long long)known);
  uint64_t ckpts, bytes;
  staged_now(fs, &ckpts, &bytes);
  gauge(o, "ckptfs_staged_checkpoints",
        "Checkpoints staged on this mount, not committed (staging, "
        "committing or failed).", ckpts);
  gauge(o, "ckptfs_staged_bytes", "Bytes of the staged checkpoints' files.",
        bytes);
  gauge(o, "ckptfs_resident_memory_bytes",
        "Resident memory of the daemon (/proc/self/statm).", rss_bytes());
  gauge(o, "ckptfs_open_fds", "Open file descriptors of the daemon.",
        open_fds());
}

/* A new temporary name beside base in dir_fd, created here and by no one
 * before (see the header): its descriptor and name, or -errno. */
static int create_temp(int dir_fd, const char *base, char *tmp, size_t size) {
  for (int attempt = 0; attempt < 8; attempt++) {
    uint64_t r = 0;
    if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r)) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      r = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^
          ((uint64_t)attempt << 56);
    }
    if ((size_t)snprintf(tmp, size, "%s.tmp.%ld.%016llx", base,
                         (long)getpid(), (unsigned long long)r) >= size)
      return -ENAMETOOLONG;
    int fd = openat(dir_fd, tmp,
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK |
                        O_CLOEXEC,
                    0644);
    if (fd >= 0 || errno != EEXIST)
      return fd >= 0 ? fd : -errno;
  }
  return -EEXIST;
}

int ckpt__metrics_write(ckpt_fs_t *fs, int dir_fd, const char *base) {
  char tmp[NAME_MAX + 1];
  int fd = create_temp(dir_fd, base, tmp, sizeof(tmp));
  if (fd < 0)
    return fd;
  out_t o = {.f = fdopen(fd, "w")};
  if (!o.f) {
    int e = errno;
    close(fd);
    unlinkat(dir_fd, tmp, 0);
    return -e;
  }
  char mount[PATH_MAX];
  label_value(mount, sizeof(mount), fs->mount_path ? fs->mount_path : "");
  snprintf(o.labels, sizeof(o.labels), "rank=\"%d\",mount=\"%s\"", fs->rank,
           mount);
  write_all(fs, &o);
  int rc = ferror(o.f) ? -EIO : 0;
  if (fclose(o.f) && rc == 0)
    rc = -errno;
  if (rc == 0 && renameat(dir_fd, tmp, dir_fd, base))
    rc = -errno;
  if (rc)
    unlinkat(dir_fd, tmp, 0);
  return rc;
}

/* ----- the periodic thread ----- */

struct ckpt_metrics_writer {
  ckpt_fs_t *fs;
  char *path;          /* NULL without -o metrics */
  int dir_fd;          /* path's directory (-1 without -o metrics) */
  const char *base;    /* path's last component, in path */
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond; /* CLOCK_MONOTONIC */
  bool stop;
  int last_err;        /* the last failure logged (logged once) */
};

static void write_logged(ckpt_metrics_writer_t *w) {
  if (!w->path)
    return;
  int rc = ckpt__metrics_write(w->fs, w->dir_fd, w->base);
  if (rc && rc != w->last_err)
    ckpt__log("metrics: cannot write %s: %s", w->path, strerror(-rc));
  else if (!rc && w->last_err)
    ckpt__log("metrics: %s written again", w->path);
  w->last_err = rc;
}

static void *writer_main(void *arg) {
  ckpt_metrics_writer_t *w = arg;
  pthread_mutex_lock(&w->lock);
  while (!w->stop) {
    pthread_mutex_unlock(&w->lock);
    write_logged(w);
    ckpt_fdcache_sweep(w->fs->fdcache);
    pthread_mutex_lock(&w->lock);
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)CKPT_METRICS_PERIOD;
    while (!w->stop &&
           pthread_cond_timedwait(&w->cond, &w->lock, &until) != ETIMEDOUT)
      ;
  }
  pthread_mutex_unlock(&w->lock);
  write_logged(w); /* the last counts, at unmount */
  return NULL;
}

int ckpt__metrics_start(ckpt_fs_t *fs, const char *path,
                        ckpt_metrics_writer_t **out) {
  ckpt_metrics_writer_t *w = calloc(1, sizeof(*w));
  if (!w || (path && !(w->path = strdup(path)))) {
    free(w);
    return -ENOMEM;
  }
  w->fs = fs;
  w->dir_fd = -1;
  if (path) {
    /* path is absolute (main.c): its directory, opened once */
    char *slash = strrchr(w->path, '/');
    *slash = '\0';
    w->dir_fd = open(slash == w->path ? "/" : w->path,
                     O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    *slash = '/';
    w->base = slash + 1;
    if (w->dir_fd < 0 || !*w->base) {
      int e = w->dir_fd < 0 ? errno : EINVAL;
      free(w->path);
      free(w);
      return -e;
    }
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&w->cond, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&w->lock, NULL);
  int rc = pthread_create(&w->thread, NULL, writer_main, w);
  if (rc) {
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    if (w->dir_fd >= 0)
      close(w->dir_fd);
    free(w->path);
    free(w);
    return -rc;
  }
  *out = w;
  return 0;
}

void ckpt__metrics_stop(ckpt_metrics_writer_t *w) {
  if (!w)
    return;
  pthread_mutex_lock(&w->lock);
  w->stop = true;
  pthread_cond_signal(&w->cond);
  pthread_mutex_unlock(&w->lock);
  pthread_join(w->thread, NULL);
  pthread_cond_destroy(&w->cond);
  pthread_mutex_destroy(&w->lock);
  if (w->dir_fd >= 0)
    close(w->dir_fd);
  free(w->path);
  free(w);
}
