/*
 * save.c - one checkpoint save of this rank: the steps that dist runs.
 *
 *   ckpt__save_begin  (FUSE thread) freeze the staged files, queue the job
 *   local_step        hash every staged file, describe it: the local plan
 *   global_step       coordinator: ckpt_plan_global, one plan per rank
 *   write_step        write this rank's items into __R_K.distcp, K <
 *                     io_threads, one worker per file, fsync (sync_files)
 *   finish_step       coordinator: publish .metadata (metadb.c)
 *   publish_step      other ranks, with a tier: another node publishes the
 *                     checkpoint in its own tier too
 *   discard_step      failed save: remove what was written
 *   save_done         every rank: show the committed view, or the reason
 *
 * Every step but ckpt__save_begin runs on the dist thread.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "catalog.h"
#include "failpoint.h"
#include "commit.h"
#include "metadb.h"

/* Bytes gathered into one pwritev. */
#define WRITE_BATCH (8u << 20)

typedef struct ckpt_save {
  ckpt_dist_job_t job;   /* first: dist hands it back */
  ckpt_fs_t *fs;
  ckpt_ckpt_t *ck;       /* referenced */
  int rank;              /* this rank in the save's world: the mount's,
                            0 in a solo save (a world of one) */
  bool replace;          /* replace=TARGET: publish as job.name (TARGET),
                            over a committed TARGET */
  bool sync;             /* a sync commit waits in req */
  ckpt_commit_words_t words; /* as written to .commit: the coordinator's
                            retention words go into .metadata */
  fuse_req_t req;
  size_t reply_size;
  /* A sync writer killed while its save runs (fuse_req_interrupt_func):
   * answered at once with EINTR, so that it leaves the kernel; the save
   * goes on. Lock order: libfuse's lock of req, then reply_lock. */
  pthread_mutex_t reply_lock;
  bool replied;          /* req answered (by the interrupt); reply_lock */
  uint32_t nfiles;
  ckpt_node_t **files;   /* the frozen staged files, referenced */
  char **paths;          /* their paths in the checkpoint */
  ckpt_entry_attr_t *attrs; /* modes, owners, times of the staged files and
                              directories (the checkpoint's own: "") */
  uint32_t n_attrs, cap_attrs;
  uint64_t *checksums;   /* XXH3-64 of each file */
  ckpt_global_plan_t gp; /* coordinator: the global plan */
  bool have_gp;
  ckpt_rank_plan_t rp;   /* this rank's plan */
  bool have_rp;
  int dirfd;             /* ROOT/.saves/SAVE_ID, flock'ed shared, or -1 */
  /* Where the save goes: the tier, or BACKING_DIR (no tier, or a direct
   * save: `level=shared` with a tier, written as a mount without the
   * tier would, no flush) */
  bool direct;
  int root_fd;
  const char *root_path;
  _Atomic int failed_file; /* K of the first data file that failed, or -1 */
  uint64_t *stream_used; /* per stream: bytes its live files use */
  double began;          /* CLOCK_MONOTONIC s of the write to .commit */
  int step_rc;           /* -errno of the first step that failed here */
  ckpt_partner_rx_t *partner_rx; /* partner copies received (partner.c) */
  char *abandoned;       /* job.cancel: why (ckpt__jobs_gone); fs->lock */
} ckpt_save_t;

/* ----- the sync writer's request ----- */

/* Is SIGKILL pending for thread tid (a fatal signal: every thread of a
 * dying process gets it)? /proc/TID/status's SigPnd (the thread's own)
 * or ShdPnd (the process's). */
static bool being_killed(pid_t tid) {
  char path[64], line[160];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
  FILE *f = fopen(path, "re");
  if (!f)
    return true; /* gone already */
  bool killed = false;
  unsigned long long mask;
  while (!killed && fgets(line, sizeof(line), f))
    if ((sscanf(line, "SigPnd: %llx", &mask) == 1 ||
         sscanf(line, "ShdPnd: %llx", &mask) == 1) &&
        (mask & (1ull << (SIGKILL - 1))))
      killed = true;
  fclose(f);
  return killed;
}

/* libfuse calls this (holding req's lock) when the kernel interrupts the
 * writer's write to .commit. A dying writer (SIGKILL, or a fatal signal
 * the kernel turned into one) gets EINTR now: else it would wait in the
 * kernel (state D) until the save ends, up to twice commit_timeout; the
 * save goes on without it, as a commit whose writer left. Any other
 * signal is the writer's to handle once the save ends (answering it
 * EINTR would let the caller's restart of the write commit twice). */
static void commit_interrupted(fuse_req_t req, void *arg) {
  ckpt_save_t *s = arg;
  pid_t tid = fuse_req_ctx(req)->pid;
  if (!being_killed(tid))
    return;
  pthread_mutex_lock(&s->reply_lock);
  bool answer = !s->replied;
  s->replied = true;
  if (answer) /* here: s may be freed once replied is seen */
    ckpt__log("%s/.commit: its writer (thread %d) was killed: answered, "
              "the save goes on", s->ck->name, (int)tid);
  pthread_mutex_unlock(&s->reply_lock);
  if (answer)
    fuse_reply_err(req, EINTR);
}

/* Take the writer's request back from the interrupt: true when it is
 * still unanswered (then it is ours to answer, and no interrupt touches it
 * again), false when the interrupt answered it. */
static bool claim_reply(ckpt_save_t *s) {
  pthread_mutex_lock(&s->reply_lock);
  bool ours = !s->replied;
  s->replied = true;
  pthread_mutex_unlock(&s->reply_lock);
  if (ours) /* waits for a callback running now (it finds replied) */
    fuse_req_interrupt_func(s->req, NULL, NULL);
  return ours;
}

static void save_free(ckpt_fs_t *fs, ckpt_save_t *s) {
  pthread_mutex_lock(&fs->lock);
  for (uint32_t i = 0; i < s->nfiles; i++)
    ckpt__node_unref(fs, s->files[i]);
  if (s->ck->save == s)
    s->ck->save = NULL;
  ckpt__ckpt_unref(fs, s->ck);
  pthread_mutex_unlock(&fs->lock);
  for (uint32_t i = 0; i < s->nfiles; i++)
    free(s->paths[i]);
  free(s->paths);
  free(s->files);
  for (uint32_t i = 0; i < s->n_attrs; i++)
    free(s->attrs[i].path);
  free(s->attrs);
  free(s->checksums);
  free(s->stream_used);
  if (s->have_gp)
    ckpt_global_plan_free(&s->gp);
  if (s->have_rp)
    ckpt_rank_plan_free(&s->rp);
  if (s->dirfd >= 0)
    close(s->dirfd);
  ckpt__partner_rx_free(s->partner_rx);
  free(s->abandoned);
  pthread_mutex_lock(&s->reply_lock); /* an interrupt still inside */
  pthread_mutex_unlock(&s->reply_lock);
  pthread_mutex_destroy(&s->reply_lock);
  free(s);
}

/* Remember what n is (its path: path, owned by the save from now). */
static int keep_attr(ckpt_save_t *s, const ckpt_node_t *n, char *path) {
  if (!path)
    return -ENOMEM;
  if (s->n_attrs == s->cap_attrs) {
    uint32_t cap = s->cap_attrs ? 2 * s->cap_attrs : 64;
    ckpt_entry_attr_t *a = realloc(s->attrs, cap * sizeof(*a));
    if (!a) {
      free(path);
      return -ENOMEM;
    }
    s->attrs = a;
    s->cap_attrs = cap;
  }
  /* nanoseconds since the epoch, within what int64 holds (years
   * 1677..2262: utimensat may set times far beyond) */
  int64_t sec = (int64_t)n->mtime.tv_sec;
  int64_t lim = INT64_MAX / 1000000000 - 1;
  sec = sec > lim ? lim : sec < -lim ? -lim : sec;
  s->attrs[s->n_attrs++] = (ckpt_entry_attr_t){
      path, (uint32_t)n->mode, (uint32_t)n->uid, (uint32_t)n->gid,
      sec * 1000000000 + n->mtime.tv_nsec};
  return 0;
}

/* Collect the staged files below dir (depth first), and what every file
 * and directory is. fs->lock held. */
static int collect_files(ckpt_save_t *s, ckpt_node_t *dir, uint32_t *cap) {
  if (dir->kind == CKPT_NODE_CKPT) {
    int rc = keep_attr(s, dir, strdup(""));
    if (rc)
      return rc;
  }
  for (ckpt_node_t *c = dir->children; c; c = c->next) {
    if (c->kind == CKPT_NODE_SDIR) {
      int rc = keep_attr(s, c, ckpt__node_path(c));
      if (rc == 0)
        rc = collect_files(s, c, cap);
      if (rc)
        return rc;
      continue;
    }
    if (c->kind != CKPT_NODE_SFILE)
      continue;
    ckpt__sfile_pt_times(c->u.sf, &c->mtime, NULL); /* the kernel's writes' */
    if (s->nfiles == *cap) {
      uint32_t ncap = *cap ? *cap * 2 : 64;
      ckpt_node_t **f = realloc(s->files, ncap * sizeof(*f));
      if (!f)
        return -ENOMEM;
      s->files = f;
      char **p = realloc(s->paths, ncap * sizeof(*p));
      if (!p)
        return -ENOMEM;
      s->paths = p;
      *cap = ncap;
    }
    s->paths[s->nfiles] = ckpt__node_path(c);
    if (!s->paths[s->nfiles])
      return -ENOMEM;
    int rc = keep_attr(s, c, strdup(s->paths[s->nfiles]));
    if (rc) {
      free(s->paths[s->nfiles]);
      return rc;
    }
    ckpt__node_ref(c);
    s->files[s->nfiles++] = c;
  }
  return 0;
}

static int by_path(const void *a, const void *b, void *paths) {
  char **p = paths;
  return strcmp(p[*(const uint32_t *)a], p[*(const uint32_t *)b]);
}

/* The collected files in the order of their paths (the children lists are
 * newest first): data files of their own are numbered in this order, the
 * order in which a load reads them and its checks ahead follow. */
static int sort_files(ckpt_save_t *s) {
  uint32_t n = s->nfiles;
  if (n < 2)
    return 0; /* none or one: also s->files may be NULL */
  uint32_t *ix = malloc(n * sizeof(*ix));
  ckpt_node_t **f = malloc(n * sizeof(*f));
  char **p = malloc(n * sizeof(*p));
  if (!ix || !f || !p) {
    free(ix), free(f), free(p);
    return -ENOMEM;
  }
  for (uint32_t i = 0; i < n; i++)
    ix[i] = i;
  qsort_r(ix, n, sizeof(*ix), by_path, s->paths);
  for (uint32_t i = 0; i < n; i++) {
    f[i] = s->files[ix[i]];
    p[i] = s->paths[ix[i]];
  }
  memcpy(s->files, f, n * sizeof(*f));
  memcpy(s->paths, p, n * sizeof(*p));
  free(ix), free(f), free(p);
  return 0;
}

/* Is a passthrough file below dir still writable? fs->lock held. */
static bool any_writable(ckpt_node_t *dir) {
  for (ckpt_node_t *c = dir->children; c; c = c->next) {
    if (c->kind == CKPT_NODE_SDIR && any_writable(c))
      return true;
    if (c->kind == CKPT_NODE_SFILE && ckpt__sfile_pt_writable(c->u.sf))
      return true;
  }
  return false;
}

/* The kernel lets go of a passthrough file's backing file only once the
 * daemon has answered its RELEASE, which comes after close(2) returned:
 * a commit right after the last close may find the file writable for a
 * moment. Wait for that, holding no lock between looks (the RELEASE needs
 * fs->lock), up to 2 s; the freeze then checks for good. */
static void wait_for_releases(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  for (int i = 0; i < 2000; i++) {
    pthread_mutex_lock(&fs->lock);
    bool busy = ck->dir && ck->state != CKPT_COMMITTING &&
                ck->state != CKPT_COMMITTED && any_writable(ck->dir);
    pthread_mutex_unlock(&fs->lock);
    if (!busy)
      return;
    usleep(1000);
  }
}

int ckpt__save_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                     const ckpt_commit_words_t *words, fuse_req_t req,
                     size_t reply_size) {
  if (fs->passthrough)
    wait_for_releases(fs, ck);
  ckpt_save_t *s = calloc(1, sizeof(*s));
  if (!s)
    return -ENOMEM;
  s->fs = fs;
  s->ck = ck;
  s->sync = words->sync;
  s->words = *words;
  s->rank = words->solo ? 0 : fs->rank;
  s->job.solo = words->solo;
  /* a solo save is one rank's own, at the local level */
  s->job.partner = fs->opts.tier_partner && !words->solo;
  s->replace = words->replace[0] != '\0';
  s->direct = fs->tier_fd >= 0 && words->level_shared;
  s->root_fd = s->direct ? fs->backing_fd : fs->commit_fd;
  s->root_path = s->direct ? fs->backing_path : fs->commit_path;
  /* a solo save is one rank's own, at the local level; a direct one
   * needs no partner copies */
  s->job.partner = s->job.partner && !s->direct;
  s->req = req;
  s->reply_size = reply_size;
  pthread_mutex_init(&s->reply_lock, NULL);
  s->dirfd = -1;
  s->failed_file = -1;
  s->job.user = s;
  s->began = ckpt__mono_now();

  /* Freeze: no data change of this checkpoint is in progress once we hold
   * the freeze lock, and none starts after the state change. */
  atomic_store(&ck->freezing, true);
  pthread_rwlock_wrlock(&ck->freeze);
  pthread_mutex_lock(&fs->lock);
  /* under the freeze lock: a staged checkpoint may be renamed until now;
   * with replace=TARGET it is published as TARGET */
  snprintf(s->job.name, sizeof(s->job.name), "%s",
           s->replace ? words->replace : ck->name);
  int rc = 0;
  bool freeze_failed = false;
  ckpt_node_t *busy = NULL; /* the file still writable, referenced */
  char *busy_path = NULL;
  uint32_t cap = 0;
  ckpt_node_t *target = s->replace && strcmp(words->replace, ck->name)
                            ? ckpt__ckpt_lookup(fs, words->replace)
                            : NULL;
  if (target && target->ck->state != CKPT_COMMITTED) {
    /* another checkpoint staged here under that name: not replaced */
    ckpt__log("%s/.commit: refused replace=%s: a checkpoint of that name is "
              "staged on this mount (commit or remove it first)", ck->name,
              words->replace);
    rc = -EEXIST;
  } else if (ck->state == CKPT_COMMITTING)
    rc = -EBUSY;
  else if (ck->state == CKPT_COMMITTED)
    rc = -EROFS;
  else if (!ck->dir)
    rc = -ENOENT; /* removed (rmdir) while its .commit was open */
  else if ((rc = collect_files(s, ck->dir, &cap)) == 0)
    rc = sort_files(s);
  /* Passthrough files: the kernel writes them without the daemon, and
   * each large one becomes its data file as it is. So nobody may be able
   * to write one any more (a handle open for writing, a writable shared
   * mapping left after a close): else the commit fails at once with
   * EBUSY, naming the file and the process. */
  for (uint32_t i = 0; rc == 0 && i < s->nfiles; i++) {
    ckpt_sfile_t *sf = s->files[i]->u.sf;
    int e = ckpt__sfile_pt_freeze(sf);
    if (e == 0) {
      /* written once: its backing file is its data file */
      pthread_mutex_lock(&sf->lock);
      if (sf->pt_fd >= 0 && sf->stream < 0 && sf->size >= CKPT_PT_DRAIN_MIN &&
          ck->streams)
        e = ckpt__stream_own(ck->streams, sf, sf->pt_fd);
      pthread_mutex_unlock(&sf->lock);
    }
    if (e == 0)
      continue;
    ck->state = CKPT_FAILED;
    freeze_failed = true;
    free(ck->reason);
    if (e == -EBUSY) {
      /* who holds it is looked up in /proc once the locks are dropped
       * (reading another process's maps may wait on it) */
      busy = s->files[i];
      ckpt__node_ref(busy);
      busy_path = strdup(s->paths[i]);
      ck->reason = ckpt__strdup_printf(
          "rank %d: %s is still open for writing: what it writes would "
          "change the committed bytes; close it (or unmap it), then commit "
          "again", s->rank, s->paths[i]);
    } else if (e == -EFBIG)
      ck->reason = ckpt__strdup_printf(
          "rank %d: %s is larger than a staged file may be (%llu bytes): "
          "%s", s->rank, s->paths[i], (unsigned long long)CKPT_MAX_FILE,
          strerror(-e));
    else
      ck->reason = ckpt__strdup_printf(
          "rank %d: %s: cannot freeze it for the commit: %s", s->rank,
          s->paths[i], strerror(-e));
    if (!busy)
      ckpt__log("%s: %s", ck->name, ck->reason);
    rc = e;
  }
  if (rc == 0) {
    ck->state = CKPT_COMMITTING;
    if (s->replace && strcmp(s->job.name, ck->name)) /* held until done */
      snprintf(ck->replacing, sizeof(ck->replacing), "%s", s->job.name);
    if (ck->streams)
      ckpt__streams_freeze(ck->streams, true, s->rank);
    free(ck->reason);
    ck->reason = NULL;
    free(ck->waiting);
    ck->waiting = strdup("its turn (a mount runs its saves one after the "
                         "other)");
    ck->waiting_until = 0;
    atomic_store(&ck->bytes_total, 0);
    atomic_store(&ck->bytes_done, 0);
    ck->save = s;
    ck->refs++;
  } else {
    for (uint32_t i = 0; i < s->nfiles; i++)
      ckpt__node_unref(fs, s->files[i]);
  }
  pthread_mutex_unlock(&fs->lock);
  atomic_store(&ck->freezing, false);
  pthread_rwlock_unlock(&ck->freeze);
  if (busy) {
    char *who = ckpt__sfile_pt_who(busy->u.sf, busy->ino);
    char *why = ckpt__strdup_printf(
        "rank %d: %s is still %s: what it writes would change the committed "
        "bytes; close it (or unmap it), then commit again", s->rank,
        busy_path ? busy_path : "a file", who ? who : "open for writing");
    pthread_mutex_lock(&fs->lock);
    if (why && ck->state == CKPT_FAILED) {
      free(ck->reason);
      ck->reason = why;
      why = NULL;
    }
    ckpt__log("%s: %s", ck->name, ck->reason ? ck->reason : "busy");
    ckpt__node_unref(fs, busy);
    pthread_mutex_unlock(&fs->lock);
    free(why);
    free(who);
    free(busy_path);
  }
  if (rc) {
    for (uint32_t i = 0; i < s->nfiles; i++)
      free(s->paths[i]);
    free(s->paths);
    free(s->files);
    for (uint32_t i = 0; i < s->n_attrs; i++)
      free(s->attrs[i].path);
    free(s->attrs);
    pthread_mutex_destroy(&s->reply_lock);
    free(s);
    if (freeze_failed) /* a commit that failed before its save began */
      ckpt__metrics_commit(fs, CKPT_COMMIT_FAILED,
                           ckpt__metrics_classify(rc, NULL), -1);
    return rc;
  }
  /* from here the writer may be killed: answered at once (above) */
  if (s->req)
    fuse_req_interrupt_func(s->req, commit_interrupted, s);
  if (ckpt_dist_submit(fs->dist, &s->job) == 0)
    return 0;
  /* the caller answers the writer, unless the interrupt did (then as if
   * answered: 0 with a sync writer means "replied") */
  bool answered = s->req && !claim_reply(s);
  ckpt__metrics_commit(fs, CKPT_COMMIT_FAILED, CKPT_FAIL_OTHER, -1);
  /* The daemon stops (SIGTERM, unmount): no save starts any more. */
  pthread_mutex_lock(&fs->lock);
  ck->state = CKPT_FAILED;
  ck->replacing[0] = '\0';
  free(ck->waiting);
  ck->waiting = NULL;
  ck->reason = strdup("the mount is stopping (SIGTERM or unmount): no new "
                      "save can start; commit again after it is mounted "
                      "again");
  pthread_mutex_unlock(&fs->lock);
  if (ck->streams)
    ckpt__streams_freeze(ck->streams, false, 0);
  save_free(fs, s);
  return answered ? 0 : -EIO;
}

/* ------------------------------------------------------------------------
 * local_step: checksums and the local plan.
 * ---------------------------------------------------------------------- */

static const uint8_t zeros[64 * 1024];

static int hash_piece(void *arg, const void *p, size_t n, ckpt_walk_piece_t kind) {
  if (kind != CKPT_WALK_HOLE)
    return XXH3_64bits_update(arg, p, n) == XXH_OK ? 0 : -EIO;
  for (size_t k; n > 0; n -= k) {
    k = n < sizeof(zeros) ? n : sizeof(zeros);
    if (XXH3_64bits_update(arg, zeros, k) != XXH_OK)
      return -EIO;
  }
  return 0;
}

/* The checksum of staged file i: kept while it was written in order, else
 * computed now. */
static int hash_file(void *arg, uint32_t i) {
  ckpt_save_t *s = arg;
  /* the drain may be hashing a passthrough file: its result, not a
   * second pass */
  if (ckpt__sfile_checksum_wait(s->files[i]->u.sf, &s->checksums[i]) == 0)
    return 0;
  XXH3_state_t *st = XXH3_createState();
  if (!st)
    return -ENOMEM;
  XXH3_64bits_reset(st);
  int rc = ckpt__sfile_walk(s->files[i]->u.sf, hash_piece, st);
  s->checksums[i] = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return rc;
}

/* Describe staged file i in lp (or record why it cannot be saved; the
 * planner prefixes each recorded problem with "rank R: "). */
static int describe_file(ckpt_save_t *s, uint32_t i, ckpt_local_plan_t *lp) {
  ckpt_sfile_t *sf = s->files[i]->u.sf;
  const char *path = s->paths[i];
  char *const *x = sf->xattr;
  uint64_t len = sf->size;
  if (!x[CKPT_X_DTYPE]) {
    for (int k = CKPT_X_SHAPE; k <= CKPT_X_SIZES; k++)
      if (x[k])
        return ckpt_local_plan_add_error(
            lp, "%s: %s is set but user.ckpt.dtype is missing", path,
            ckpt__xattr_names[k]);
    return ckpt_local_plan_add_bytes(lp, path, len, s->checksums[i], i);
  }
  if (!x[CKPT_X_SHAPE])
    return ckpt_local_plan_add_error(
        lp, "%s: user.ckpt.dtype is set but user.ckpt.shape is missing",
        path);
  ckpt_dtype_t dt;
  ckpt_dims_t shape, offs, sizes;
  bool has_offs = x[CKPT_X_OFFSETS] != NULL, has_sizes = x[CKPT_X_SIZES];
  /* Values were validated by setxattr; parse them again for the plan. */
  if (ckpt_dtype_parse(x[CKPT_X_DTYPE], strlen(x[CKPT_X_DTYPE]), &dt) ||
      ckpt_dims_parse(x[CKPT_X_SHAPE], strlen(x[CKPT_X_SHAPE]), &shape) ||
      (has_offs && ckpt_dims_parse(x[CKPT_X_OFFSETS],
                                   strlen(x[CKPT_X_OFFSETS]), &offs)) ||
      (has_sizes &&
       ckpt_dims_parse(x[CKPT_X_SIZES], strlen(x[CKPT_X_SIZES]), &sizes)))
    return ckpt_local_plan_add_error(lp, "%s: invalid xattrs", path);
  bool nonzero = false;
  for (int k = 0; has_offs && k < offs.ndim; k++)
    nonzero |= offs.d[k] != 0;
  if (nonzero && !has_sizes)
    return ckpt_local_plan_add_error(
        lp, "%s: user.ckpt.offsets is %s but user.ckpt.sizes is missing",
        path, x[CKPT_X_OFFSETS]);
  if ((has_offs && offs.ndim != shape.ndim) ||
      (has_sizes && sizes.ndim != shape.ndim))
    return ckpt_local_plan_add_error(
        lp, "%s: offsets/sizes have %d/%d dimensions, shape %s has %d", path,
        has_offs ? offs.ndim : shape.ndim,
        has_sizes ? sizes.ndim : shape.ndim, x[CKPT_X_SHAPE], shape.ndim);
  return ckpt_local_plan_add_tensor(lp, path, dt, shape.ndim, shape.d,
                                    has_offs ? offs.d : NULL,
                                    has_sizes ? sizes.d : NULL, len,
                                    s->checksums[i], i);
}

static int local_step(void *ctx, ckpt_dist_job_t *job, ckpt_buf_t *out,
                      char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  ckpt_local_plan_t lp;
  ckpt__save_waiting(fs, job, NULL, 0);
  ckpt_local_plan_init(&lp, s->rank);
  lp.direct = s->direct; /* the coordinator checks that every rank agrees */
  s->checksums = calloc(s->nfiles ? s->nfiles : 1, sizeof(*s->checksums));
  int rc = s->checksums ? 0 : -ENOMEM;
  if (rc == 0)
    rc = ckpt__pool_run(fs->pool, s->nfiles, hash_file, s);
  for (uint32_t i = 0; rc == 0 && i < s->nfiles; i++) {
    uint32_t before = lp.n_items;
    rc = describe_file(s, i, &lp);
    ckpt_sfile_t *sf = s->files[i]->u.sf;
    /* user.ckpt.fqn: the item's exact FQN instead of the path's. */
    const char *fqn = sf->xattr[CKPT_X_FQN];
    if (rc == 0 && lp.n_items > before && fqn)
      rc = ckpt_local_plan_set_fqn(&lp, before, fqn, strlen(fqn));
    /* Written behind already: its bytes stay where they are (in the
     * tier: a direct save writes them anew, read from the stream) */
    if (rc == 0 && lp.n_items > before && sf->stream >= 0 && !s->direct)
      rc = ckpt_local_plan_pin(&lp, before, (uint32_t)sf->stream,
                               sf->stream_base);
  }
  /* Each stream holds its live files up to the end of the last one:
   * that much of data file K is written already. */
  uint32_t nstreams = s->ck->streams ? s->ck->streams->n : 0;
  s->stream_used = calloc(nstreams ? nstreams : 1, sizeof(*s->stream_used));
  if (!s->stream_used && rc == 0)
    rc = -ENOMEM;
  for (uint32_t i = 0; rc == 0 && i < s->nfiles; i++) {
    const ckpt_sfile_t *sf = s->files[i]->u.sf;
    if (sf->stream >= 0 && sf->stream_base + sf->size > s->stream_used[sf->stream])
      s->stream_used[sf->stream] = sf->stream_base + sf->size;
  }
  if (s->direct) /* nothing of its data files is written yet */
    memset(s->stream_used, 0, (nstreams ? nstreams : 1) * sizeof(*s->stream_used));
  for (uint32_t k = 0; rc == 0 && k < nstreams; k++)
    if (s->stream_used[k])
      rc = ckpt_local_plan_reserve(&lp, k, s->stream_used[k]);
  /* What the staged files and directories are: the commit keeps it. */
  for (uint32_t i = 0; rc == 0 && i < s->n_attrs; i++) {
    const ckpt_entry_attr_t *a = &s->attrs[i];
    rc = ckpt_local_plan_add_attr(&lp, a->path, a->mode, a->uid, a->gid,
                                  a->mtime_ns);
  }
  if (rc == 0)
    rc = ckpt_msg_encode_local_plan(&lp, out);
  if (rc)
    *err = ckpt__strdup_printf("rank %d: building the local plan: %s",
                               s->rank, strerror(-rc));
  ckpt_local_plan_free(&lp);
  ckpt_failpoint("local_plan");
  return rc;
}

/* ------------------------------------------------------------------------
 * global_step (coordinator).
 * ---------------------------------------------------------------------- */

static char *new_save_id(void) {
  uint8_t r[16];
  if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    memcpy(r, &ts, sizeof(r) < sizeof(ts) ? sizeof(r) : sizeof(ts));
  }
  char *id = malloc(33);
  if (id)
    for (int i = 0; i < 16; i++)
      snprintf(id + 2 * i, 3, "%02x", r[i]);
  return id;
}

/* The item a client commits to abort a save on every rank (python/ckptfs
 * _abort_commit): ABORT_PATH at the checkpoint's top, a float32 tensor of
 * shape [1] with no bytes, which no save can hold (so that a ckptfs that
 * does not know it fails the save too); its user.ckpt.fqn, when given, is
 * the rank's reason. */
#define ABORT_PATH "_ckptfs_abort"
#define ABORT_REASON_MAX 300

static bool is_abort_item(const ckpt_write_item_t *it) {
  return it->kind == CKPT_ITEM_TENSOR && it->length == 0 &&
         it->dtype == CKPT_DTYPE_FLOAT32 && it->ndim == 1 &&
         strcmp(it->path, ABORT_PATH) == 0;
}

/* Why the save fails when some rank aborted it: "rank R aborted the save:
 * REASON", one line per such rank, the client's item never named (the
 * planner would say "_ckptfs_abort (...): rank R wrote 0 bytes, 4
 * expected"). NULL when no rank aborted (or out of memory). */
static char *aborted_by(const ckpt_local_plan_t *locals, int n) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  int rc = 0;
  for (int r = 0; r < n && rc == 0; r++) {
    for (uint32_t i = 0; i < locals[r].n_items; i++) {
      const ckpt_write_item_t *it = &locals[r].items[i];
      if (!is_abort_item(it))
        continue;
      char why[ABORT_REASON_MAX + 4] = "";
      if (it->fqn_explicit && it->fqn) {
        size_t k = 0;
        for (const char *c = it->fqn; *c && k < ABORT_REASON_MAX; c++, k++)
          why[k] = (unsigned char)*c < 0x20 || *c == 0x7f ? '?' : *c;
        if (it->fqn[k])
          memcpy(why + k, "...", 4);
        else
          why[k] = '\0';
      }
      rc = ckpt_buf_printf(&b, "%srank %d aborted the save: %s",
                           b.len ? "\n" : "", (int)locals[r].rank,
                           why[0] ? why : "it failed before its commit");
      break;
    }
  }
  if (rc || b.len == 0) {
    ckpt_buf_free(&b);
    return NULL;
  }
  return ckpt_buf_steal(&b);
}

static int global_step(void *ctx, ckpt_dist_job_t *job, const ckpt_buf_t *plans,
                       int n, ckpt_buf_t *rank_plans, char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  if (!s->replace && ckpt__already_committed(fs, job->name)) {
    int root = ckpt__root_of(fs, job->name);
    *err = ckpt__committed_elsewhere(root, root == fs->tier_fd ? fs->tier_path
                                                         : fs->backing_path,
                               job->name);
    return -EEXIST;
  }
  ckpt_local_plan_t *locals = calloc((size_t)n, sizeof(*locals));
  if (!locals)
    return -ENOMEM;
  int rc = 0;
  for (int r = 0; r < n && rc == 0; r++) {
    rc = ckpt_msg_decode_local_plan(plans[r].data, plans[r].len, &locals[r]);
    if (rc)
      *err = ckpt__strdup_printf("rank %d: malformed local plan", r);
    else if (locals[r].rank != r)
      rc = -EINVAL, *err = ckpt__strdup_printf(
                        "rank %d: local plan claims rank %d", r,
                        locals[r].rank);
  }
  ckpt_plan_opts_t opts = {.io_threads = fs->opts.io_threads,
                           .replica_check = fs->opts.replica_check};
  if (rc == 0 && (*err = aborted_by(locals, n)) != NULL)
    rc = -ECANCELED; /* not a refusal of what was staged: metrics "other" */
  /* Where the save goes is one decision: a direct save's files and a
   * tier save's would end up in two places */
  for (int r = 1; r < n && rc == 0; r++)
    if (locals[r].direct != locals[0].direct) {
      rc = -EINVAL;
      *err = ckpt__strdup_printf(
          "ranks 0 and %d wrote different level= words to .commit (%s and "
          "%s): every rank of a world commits with the same words; nothing "
          "was written", r, locals[0].direct ? "level=shared" : "none",
          locals[r].direct ? "level=shared" : "none");
    }
  if (rc == 0)
    rc = ckpt_plan_global(locals, n, &opts, &s->gp);
  if (rc == 0) {
    s->have_gp = true;
    if (s->gp.warnings)
      ckpt__log("%s: %s", job->name, s->gp.warnings);
    if (s->gp.errors) {
      *err = strdup(s->gp.errors);
      rc = -EINVAL;
    }
  }
  if (rc == 0) {
    s->gp.meta.name = strdup(job->name);
    s->gp.meta.save_id = new_save_id();
    s->gp.meta.created_at = (int64_t)time(NULL);
    if (!s->gp.meta.name || !s->gp.meta.save_id ||
        ckpt_metadata_set_retention(&s->gp.meta, &s->words))
      rc = -ENOMEM;
  }
  if (rc == 0 && (rc = ckpt_store_save_dir_hold(s->root_fd,
                                                s->gp.meta.save_id, true,
                                                &s->dirfd)) != 0)
    *err = ckpt__strdup_printf("rank 0: creating %s/%s/%s: %s",
                               s->root_path, CKPT_SAVES_DIR,
                               s->gp.meta.save_id, strerror(-rc));
  for (int r = 0; r < n && rc == 0; r++) {
    snprintf(s->gp.ranks[r].save_id, sizeof(s->gp.ranks[r].save_id), "%s",
             s->gp.meta.save_id);
    rc = ckpt_msg_encode_rank_plan(&s->gp.ranks[r], &rank_plans[r]);
  }
  for (int r = 0; r < n; r++)
    ckpt_local_plan_free(&locals[r]);
  free(locals);
  ckpt_failpoint("global_plan");
  return rc;
}

/* ------------------------------------------------------------------------
 * write_step: one worker per data file.
 * ---------------------------------------------------------------------- */

typedef struct {
  ckpt_save_t *s;
  int fd;
  const char *file;     /* name, for errors */
  bool fresh;           /* the file was empty: holes need no writes */
  struct iovec iov[IOV_MAX];
  int niov;
  uint64_t batch_off;   /* file offset of iov[0] */
  uint64_t batch_len;
  uint64_t counted;     /* bytes added to ck->bytes_done */
  int err;              /* errno of a failed write */
} writer_t;

/* Progress of .status: n more bytes of w's file are done. */
static void count_done(writer_t *w, uint64_t n) {
  w->counted += n;
  atomic_fetch_add(&w->s->ck->bytes_done, n);
}

/* A stream file already holds most of its bytes: they are done once they
 * are on disk. Sync it in steps so that .status moves meanwhile (the
 * fsync after it then has little left to do), or count them at once
 * without sync_files. */
#define STREAM_SYNC_STEP (64ULL << 20)
static int settle_stream(writer_t *w, uint64_t size, bool sync) {
  for (uint64_t off = 0; off < size; off += STREAM_SYNC_STEP) {
    uint64_t len = size - off < STREAM_SYNC_STEP ? size - off : STREAM_SYNC_STEP;
    if (sync && sync_file_range(w->fd, (off_t)off, (off_t)len,
                                SYNC_FILE_RANGE_WAIT_BEFORE |
                                    SYNC_FILE_RANGE_WRITE |
                                    SYNC_FILE_RANGE_WAIT_AFTER) &&
        errno != ENOSYS && errno != EINVAL && errno != ESPIPE) {
      w->err = errno;
      return -errno;
    }
    if (!sync)
      len = size;
    uint64_t left = size > w->counted ? size - w->counted : 0;
    count_done(w, len < left ? len : left);
    if (!sync)
      break;
  }
  return 0;
}

static int flush_batch(writer_t *w) {
  uint64_t off = w->batch_off;
  struct iovec *iov = w->iov;
  int niov = w->niov;
  while (niov > 0) {
    ssize_t r = pwritev(w->fd, iov, niov, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      w->err = errno;
      return -errno;
    }
    if (r == 0) {
      w->err = EIO;
      return -EIO;
    }
    off += (uint64_t)r;
    count_done(w, (uint64_t)r);
    ckpt_failpoint("write_data");
    while (niov > 0 && (size_t)r >= iov->iov_len) {
      r -= (ssize_t)iov->iov_len;
      iov++, niov--;
    }
    if (niov > 0) {
      iov->iov_base = (char *)iov->iov_base + r;
      iov->iov_len -= (size_t)r;
    }
  }
  w->batch_off += w->batch_len;
  w->batch_len = 0;
  w->niov = 0;
  return 0;
}

/* Add n bytes at p to the batch, writing the batch first when full. */
static int append_iov(writer_t *w, const void *p, size_t n) {
  if (w->niov == IOV_MAX || w->batch_len >= WRITE_BATCH) {
    int rc = flush_batch(w);
    if (rc)
      return rc;
  }
  w->iov[w->niov].iov_base = (void *)p;
  w->iov[w->niov].iov_len = n;
  w->niov++;
  w->batch_len += n;
  return 0;
}

/* The next n bytes of a data file are zeros (a hole of a staged file):
 * skipped in a fresh file, which ftruncate extends with holes; written
 * over old bytes of a reused stream file. */
static int add_zeros(writer_t *w, size_t n) {
  if (w->fresh) {
    int rc = flush_batch(w);
    if (rc)
      return rc;
    w->batch_off += n;
    count_done(w, n);
    return 0;
  }
  for (size_t k; n > 0; n -= k) {
    k = n < sizeof(zeros) ? n : sizeof(zeros);
    int rc = append_iov(w, zeros, k);
    if (rc)
      return rc;
  }
  return 0;
}

static int add_piece(void *arg, const void *p, size_t n, ckpt_walk_piece_t kind) {
  writer_t *w = arg;
  if (kind == CKPT_WALK_HOLE)
    return add_zeros(w, n);
  int rc = append_iov(w, p, n);
  /* A spilled piece sits in a buffer reused for the next one. */
  return rc == 0 && kind == CKPT_WALK_TRANSIENT ? flush_batch(w) : rc;
}

static int write_file(void *arg, uint32_t k) {
  ckpt_save_t *s = arg;
  ckpt_fs_t *fs = s->fs;
  char name[64];
  ckpt_data_file_name(s->rank, k, name, sizeof(name));
  writer_t *w = calloc(1, sizeof(*w));
  if (!w)
    return -ENOMEM;
  w->s = s;
  w->file = name;
  /* A stream file linked as this data file holds the pinned items. */
  bool streamed = s->ck->streams && k < s->ck->streams->n &&
                  s->stream_used[k] > 0; /* (never in a direct save) */
  /* The save's own directory: a data file there is ours or nothing. */
  int injected = ckpt_failpoint_error("write_open");
  if (injected)
    w->fd = -1, errno = -injected;
  else if ((w->fd = ckpt_open_beneath(s->dirfd, name,
                                      O_WRONLY |
                                          (streamed ? 0 : O_CREAT | O_EXCL),
                                      0600)) < 0)
    errno = -w->fd, w->fd = -1;
  w->fresh = !streamed;
  int rc = w->fd < 0 ? -(w->err = errno) : 0;
  for (uint32_t a = 0; rc == 0 && a < s->rp.n_assign; a++) {
    const ckpt_assignment_t *as = &s->rp.assign[a];
    const ckpt_sfile_t *sf = s->files[as->local_id]->u.sf;
    if (as->file != k || as->length == 0 ||
        (streamed && sf->stream == (int32_t)k &&
         sf->stream_base == as->file_offset))
      continue; /* nothing, or already there */
    if (as->file_offset != w->batch_off + w->batch_len &&
        (rc = flush_batch(w)) == 0)
      w->batch_off = as->file_offset;
    if (rc == 0)
      rc = ckpt__sfile_walk(s->files[as->local_id]->u.sf, add_piece, w);
  }
  if (rc == 0)
    rc = flush_batch(w);
  if (rc == 0 && ftruncate(w->fd, (off_t)s->rp.file_bytes[k]))
    rc = -(w->err = errno);
  if (rc == 0 && streamed)
    rc = settle_stream(w, s->rp.file_bytes[k], fs->opts.sync_files);
  if (rc == 0 && fs->opts.sync_files && fsync(w->fd))
    rc = -(w->err = errno);
  if (w->fd >= 0 && close(w->fd) && rc == 0)
    rc = -(w->err = errno);
  if (rc) {
    ckpt__log("%s: writing %s: %s", s->job.name, name,
              strerror(w->err ? w->err : -rc));
    int none = -1;
    atomic_compare_exchange_strong(&s->failed_file, &none, (int)k);
  }
  int e = rc ? (w->err ? -w->err : rc) : 0;
  free(w);
  return e;
}

/* Why a commit into the tier cannot be: the tier is full (need: bytes
 * this rank still writes there), and what to do. */
static char *tier_full(ckpt_fs_t *fs, const ckpt_save_t *s, uint64_t need) {
  struct statvfs tv;
  uint64_t avail = fstatvfs(fs->tier_fd, &tv) == 0
                       ? (uint64_t)tv.f_bavail * tv.f_frsize
                       : 0;
  return ckpt__strdup_printf(
      "rank %d: the tier %s is full: %.1f MiB free, this rank writes %.1f "
      "MiB of %s there; not committed, nothing is lost: it stays staged. "
      "Commit it again with `sync level=shared` (written to BACKING_DIR "
      "directly, as a mount without the tier would), or make room in the "
      "tier (a lower tier_keep, or `ckptctl wait --level shared` until "
      "earlier checkpoints are flushed out of it) and commit again",
      s->rank, fs->tier_path, (double)avail / 1048576.0,
      (double)need / 1048576.0, s->job.name);
}

/* Is this rank on another node than the coordinator's (which publishes
 * the save in its own tier: the commit point)? */
static bool remote_node(ckpt_fs_t *fs, const ckpt_dist_job_t *job) {
  return !job->solo && fs->world_size > 1 && fs->dist &&
         ckpt_dist_node_of(fs->dist, fs->rank) !=
             ckpt_dist_node_of(fs->dist, 0);
}

static int write_step(void *ctx, ckpt_dist_job_t *job,
                      const ckpt_buf_t *plan, ckpt_buf_t *out, char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  int rc = ckpt_msg_decode_rank_plan(plan->data, plan->len, &s->rp);
  if (rc) {
    *err = ckpt__strdup_printf("rank %d: malformed plan from the coordinator",
                               s->rank);
    return rc;
  }
  s->have_rp = true;
  for (uint32_t a = 0; a < s->rp.n_assign; a++)
    if (s->rp.assign[a].local_id >= s->nfiles ||
        s->rp.assign[a].file >= s->rp.n_files) {
      *err = ckpt__strdup_printf("rank %d: plan names an unknown item",
                                 s->rank);
      return -EINVAL;
    }
  uint64_t total = 0;
  for (uint32_t k = 0; k < s->rp.n_files; k++)
    total += s->rp.file_bytes[k];
  atomic_store(&s->ck->bytes_total, total);

  if (!ckpt_save_id_valid(s->rp.save_id)) {
    *err = ckpt__strdup_printf("rank %d: the plan names no save", s->rank);
    return -EINVAL;
  }
  /* The coordinator made and holds the save's directory (global_step);
   * every other rank joins it: one that does not see it has a BACKING_DIR
   * of its own. With a tier, each node has its own: the first rank of
   * the node to get here makes it. */
  if (s->dirfd < 0 &&
      (rc = ckpt_store_save_dir_hold(s->root_fd, s->rp.save_id,
                                     fs->tier_fd >= 0 && !s->direct,
                                     &s->dirfd)) != 0) {
    if (rc == -ENOENT)
      *err = ckpt__strdup_printf(
          "rank %d: BACKING_DIR %s is not the coordinator's (rank 0 made "
          "%s/%s there, this rank does not see it): every rank of a world "
          "must mount one BACKING_DIR shared by all nodes (and write the "
          "same level= word to .commit); nothing was "
          "written", s->rank, s->root_path, CKPT_SAVES_DIR,
          s->rp.save_id);
    else
      *err = ckpt__strdup_printf("rank %d: opening %s/%s/%s: %s", s->rank,
                                 s->root_path, CKPT_SAVES_DIR,
                                 s->rp.save_id, strerror(-rc));
    return rc == -ENOENT ? -EXDEV : rc;
  }
  /* A tier too full for this rank's files: said before anything is
   * written, with what to do (the rest of the node's ranks write there
   * too: a write that finds it full says the same) */
  uint64_t streamed = 0;
  for (uint32_t k = 0; s->ck->streams && !s->direct && k < s->ck->streams->n;
       k++)
    streamed += s->stream_used[k];
  struct statvfs tv;
  if (fs->tier_fd >= 0 && !s->direct && fstatvfs(fs->tier_fd, &tv) == 0 &&
      total > streamed &&
      (uint64_t)tv.f_bavail * tv.f_frsize < total - streamed) {
    *err = tier_full(fs, s, total - streamed);
    return -ENOSPC;
  }
  if (s->ck->streams && !s->direct &&
      (rc = ckpt__streams_link(s->ck->streams, s->stream_used, s->dirfd,
                               err)) != 0)
    return rc;
  ckpt_failpoint("write_begin");
  rc = ckpt__pool_run(fs->pool, s->rp.n_files, write_file, s);
  if (rc) {
    char name[64] = "data files";
    int k = atomic_load(&s->failed_file);
    if (k >= 0)
      ckpt_data_file_name(s->rank, (uint32_t)k, name, sizeof(name));
    *err = rc == -ENOSPC && fs->tier_fd >= 0 && !s->direct
               ? tier_full(fs, s, total - streamed)
               : ckpt__strdup_printf("rank %d: writing %s/%s/%s: %s",
                                     s->rank, s->root_path, job->name, name,
                                     strerror(-rc));
    return rc;
  }
  /* With a tier: this rank's files are to be flushed from now on, even if
   * this node never publishes the checkpoint (flush.c). */
  if (fs->tier_fd >= 0 && !s->direct &&
      (rc = ckpt__flush_record(fs, s->rp.save_id, s->rank, job->name,
                               s->replace, remote_node(fs, job), NULL,
                               err)) != 0)
    return rc;
  ckpt_failpoint("write_done");
  ckpt_write_result_t wr = {.rank = s->rank, .bytes_written = total};
  return ckpt_msg_encode_write_result(&wr, out);
}

/* ------------------------------------------------------------------------
 * finish_step (coordinator), discard_step, done.
 * ---------------------------------------------------------------------- */

/* *err names the held directory by /proc/self/fd/N: give its path. */
static void name_held_dir(char **err, const char *held, const char *dir) {
  char *at;
  while (!strstr(dir, held) && (at = strstr(*err, held)) != NULL) {
    char *named = ckpt__strdup_printf("%.*s%s%s", (int)(at - *err), *err, dir,
                                      at + strlen(held));
    if (!named)
      return;
    free(*err);
    *err = named;
  }
}

/* The .metadata in dirfd, appended to out (for the other nodes' tiers). */
static int read_metadata(int dirfd, ckpt_buf_t *out) {
  int fd = ckpt_store_open_file(dirfd, CKPT_METADATA_FILE);
  if (fd < 0)
    return fd;
  char buf[65536];
  ssize_t r;
  int rc = 0;
  while (rc == 0 && (r = read(fd, buf, sizeof(buf))) != 0)
    rc = r < 0 ? (errno == EINTR ? 0 : -errno)
               : ckpt_buf_append(out, buf, (size_t)r);
  close(fd);
  return rc;
}

/* Do ranks of other nodes than this one's take part in job? */
static bool other_nodes(ckpt_fs_t *fs, const ckpt_dist_job_t *job) {
  return !job->solo && fs->world_size > 1 && fs->dist &&
         ckpt_dist_nodes(fs->dist) > 1;
}

static int finish_step(void *ctx, ckpt_dist_job_t *job,
                       const ckpt_buf_t *results, int n, ckpt_buf_t *outcome,
                       char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  for (int r = 0; r < n; r++) {
    ckpt_write_result_t wr;
    int rc = ckpt_msg_decode_write_result(results[r].data, results[r].len,
                                          &wr);
    uint64_t want = 0;
    for (uint32_t k = 0; rc == 0 && k < s->gp.ranks[r].n_files; k++)
      want += s->gp.ranks[r].file_bytes[k];
    if (rc == 0 && (wr.rank != r || wr.bytes_written != want)) {
      *err = ckpt__strdup_printf("rank %d: wrote %llu bytes, %llu planned", r,
                                 (unsigned long long)wr.bytes_written,
                                 (unsigned long long)want);
      rc = -EIO;
    } else if (rc) {
      *err = ckpt__strdup_printf("rank %d: malformed write result", r);
    }
    ckpt_write_result_free(&wr);
    if (rc)
      return rc;
  }
  /* .metadata into the save's own directory, then the directory is
   * renamed to NAME without replacing anything: of concurrent saves of
   * one NAME, from any mount, exactly one gets there (the commit point). */
  char dir[PATH_MAX], held[64];
  snprintf(dir, sizeof(dir), "%s/%s/%s", s->root_path, CKPT_SAVES_DIR,
           s->gp.meta.save_id);
  /* Written through the held directory itself, not by its path: a symlink
   * put in place of .saves must not take .metadata elsewhere. */
  snprintf(held, sizeof(held), "/proc/self/fd/%d", s->dirfd);
  bool via_fd = s->dirfd >= 0 && access(held, F_OK) == 0;
  /* Into a tier: what it replaces, so that its flush publishes it only
   * while NAME on BACKING_DIR is still that (resolve.c) */
  free(s->gp.meta.replaces);
  s->gp.meta.replaces =
      s->direct ? NULL : ckpt__resolve_replaces(fs, job->name, s->replace);
  /* the commit point's time: of two saves of NAME, the later one stays */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  s->gp.meta.commit_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
  /* A tier copy of NAME that this mount does not serve (kept of a save
   * NAME is no more, or superseded): in the way of a plain commit, so
   * exchanged like a replace's (its flush record, if any, then finds it
   * gone and drops it). */
  ckpt_resolved_t was = {.root = fs->backing_fd};
  if (fs->tier_fd >= 0 && !s->direct)
    ckpt__resolve(fs, job->name, &was);
  int rc = ckpt_metadb_publish(via_fd ? held : dir, &s->gp.meta,
                               fs->opts.sync_files, err);
  if (rc && via_fd && *err)
    name_held_dir(err, held, dir);
  /* the other nodes publish the same bytes in their tiers */
  if (rc == 0 && fs->tier_fd >= 0 && !s->direct && other_nodes(fs, job) &&
      (rc = read_metadata(s->dirfd, outcome)) != 0)
    *err = ckpt__strdup_printf("reading %s/%s back: %s", dir,
                               CKPT_METADATA_FILE, strerror(-rc));
  if (rc == 0) {
    ckpt_publish_t p = {.root_fd = s->root_fd,
                        .root_path = s->root_path,
                        .held_fd = s->dirfd,
                        .save_id = s->gp.meta.save_id,
                        .name = job->name,
                        .replace = s->replace || was.stale[0] ||
                                   was.superseded};
    int lock = -1;
    if (fs->tier_fd >= 0) {
      pthread_mutex_lock(&fs->tier_publish);
      lock = ckpt__tier_lock(fs);
    }
    rc = ckpt__publish_save(fs, &p, err);
    if (fs->tier_fd >= 0) {
      ckpt__tier_unlock(lock);
      pthread_mutex_unlock(&fs->tier_publish);
    }
  }
  return rc;
}

/* held/.metadata from bytes: through .metadata.tmp.R (R: rank), synced,
 * linked (another rank of the node may have linked it first: the same
 * bytes). 0 or -errno. */
static int link_metadata(int held, int rank, const ckpt_buf_t *bytes,
                         bool sync) {
  char tmp[64];
  snprintf(tmp, sizeof(tmp), "%s.%d", CKPT_METADATA_TMP, rank);
  int fd = openat(held, tmp,
                  O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  int rc = fd < 0 ? -errno : 0;
  for (size_t off = 0; rc == 0 && off < bytes->len;) {
    ssize_t w = write(fd, bytes->data + off, bytes->len - off);
    if (w > 0)
      off += (size_t)w;
    else if (w == 0 || errno != EINTR)
      rc = w < 0 ? -errno : -ENOSPC;
  }
  if (rc == 0 && sync && fsync(fd))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (rc == 0 && linkat(held, tmp, held, CKPT_METADATA_FILE, 0) &&
      errno != EEXIST)
    rc = -errno;
  unlinkat(held, tmp, 0);
  if (rc == 0 && sync && fsync(held))
    rc = -errno;
  return rc;
}

/* A node other than the coordinator's: publish the committed checkpoint
 * in this node's tier too, from the coordinator's .metadata (outcome), as
 * the coordinator did in its own: of the node's ranks the first does it
 * (under the node's lock; the others find TIER/NAME of this save). If it
 * fails, the flush records still flush this node's files (from
 * TIER/.saves/SAVE_ID); the log says so. */
static void publish_step(void *ctx, ckpt_dist_job_t *job,
                         const ckpt_buf_t *outcome) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  if (fs->tier_fd < 0 || s->direct || s->dirfd < 0 || !s->have_rp ||
      !remote_node(fs, job))
    return; /* the coordinator published in this node's tier */
  ckpt_failpoint("tier_publish");
  char *err = NULL, id[CKPT_SAVE_ID_LEN + 1] = "";
  int rc = outcome->len ? 0 : -EBADMSG; /* no .metadata in the OUTCOME */
  ckpt_resolved_t was; /* a tier copy not served is exchanged (finish_step) */
  ckpt__resolve(fs, job->name, &was);
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs);
  int dfd = rc ? -1 : ckpt_store_open_dir(fs->tier_fd, job->name, O_RDONLY);
  bool done = dfd >= 0 && ckpt_store_save_id(dfd, id) == 0 &&
              !strcmp(id, s->rp.save_id);
  if (dfd >= 0)
    close(dfd);
  if (rc == 0 && !done)
    rc = link_metadata(s->dirfd, s->rank, outcome, fs->opts.sync_files);
  if (rc == 0 && !done) {
    ckpt_publish_t p = {.root_fd = fs->tier_fd,
                        .root_path = fs->tier_path,
                        .held_fd = s->dirfd,
                        .save_id = s->rp.save_id,
                        .name = job->name,
                        .replace = s->replace || was.stale[0] ||
                                   was.superseded};
    rc = ckpt__publish_save(fs, &p, &err);
  }
  ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
  if (rc)
    ckpt__log("tier: %s: committed, but not published in this node's tier "
              "%s: %s; its files are flushed from %s/%s/%s", job->name,
              fs->tier_path, err ? err : strerror(-rc), fs->tier_path,
              CKPT_SAVES_DIR, s->rp.save_id);
  free(err);
}

static void discard_step(void *ctx, ckpt_dist_job_t *job, bool all_done) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  ckpt_failpoint("discard");
  if (!all_done) {
    if (s->ck->streams && s->dirfd >= 0 && !s->direct) /* kept aside for
                                                          the retry */
      ckpt__streams_unlink(s->ck->streams, s->dirfd);
    for (uint32_t k = 0; s->have_rp && s->dirfd >= 0 && k < s->rp.n_files;
         k++) {
      char name[64];
      ckpt_data_file_name(s->rank, k, name, sizeof(name));
      unlinkat(s->dirfd, name, 0);
    }
    ckpt__partner_discard(fs, &s->partner_rx, s->dirfd, s->rp.save_id);
    if (fs->tier_fd >= 0 && !s->direct && s->have_rp) {
      ckpt__flush_unrecord(fs, s->rp.save_id, s->rank);
      /* another node's save directory: its last rank removes it */
      char path[CKPT_SAVE_ID_LEN + 16];
      snprintf(path, sizeof(path), "%s/%s", CKPT_SAVES_DIR, s->rp.save_id);
      if (s->rank != 0)
        unlinkat(fs->tier_fd, path, AT_REMOVEDIR);
    }
    return;
  }
  /* Coordinator, every rank done: the save's own directory goes (never
   * anything by the checkpoint's name: that is someone else's). */
  if (s->have_gp && s->gp.meta.save_id) {
    ckpt_store_save_dir_remove(s->root_fd, s->gp.meta.save_id);
    if (fs->opts.sync_files)
      fsync(s->root_fd);
  }
}

void ckpt__save_waiting(void *ctx, ckpt_dist_job_t *job, const char *what,
                        double until) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  char *copy = what ? strdup(what) : NULL;
  pthread_mutex_lock(&fs->lock);
  free(s->ck->waiting);
  s->ck->waiting = copy;
  s->ck->waiting_until = copy ? until : 0;
  pthread_mutex_unlock(&fs->lock);
}

/* This mount's commit of NAME lost to a save of another mount (EEXIST):
 * NAME is that checkpoint now, here as on every other mount (SPEC: a
 * checkpoint committed through any mount is seen by every other). Its
 * staged files are discarded, as rm -r NAME would (keeping them under
 * NAME would serve them as NAME, and rm -r NAME of the committed one
 * would then remove the winner's for every mount); .status ("lost:") and
 * the log say so. False when NAME in BACKING_DIR is not a committed
 * checkpoint (a file, an unfinished save): then it stays staged, failed,
 * for the trainer to commit again. */
static bool yield_to_winner(ckpt_fs_t *fs, ckpt_ckpt_t *ck, const char *name,
                            const char *reason) {
  if (strcmp(ck->name, name) || !ckpt__already_committed(fs, name))
    return false;
  uint64_t files, bytes;
  pthread_mutex_lock(&fs->lock);
  ckpt__ckpt_staged_size(ck, &files, &bytes);
  pthread_mutex_unlock(&fs->lock);
  char *note = ckpt__strdup_printf(
      "this mount's commit of %s failed: %s; its staged files of %s (%llu "
      "files, %llu bytes) were discarded, and %s shows that checkpoint",
      name, reason, name, (unsigned long long)files,
      (unsigned long long)bytes, name);
  char *copy = note ? strdup(note) : NULL;
  char *err = NULL;
  int rc = ckpt__fs_load_instead(fs, ck, copy, &err);
  pthread_mutex_lock(&fs->lock);
  bool discarded = ck->dir == NULL; /* else it stays staged, failed */
  if (discarded) { /* an open .status of it says the same */
    ck->state = CKPT_FAILED;
    free(ck->reason);
    ck->reason = note ? note : strdup(reason);
    note = NULL;
  }
  pthread_mutex_unlock(&fs->lock);
  free(note);
  if (discarded)
    ckpt__log("%s: this mount's staged files (%llu files, %llu bytes) were "
              "discarded: %s; %s", name, (unsigned long long)files,
              (unsigned long long)bytes, reason,
              rc ? "that checkpoint cannot be shown either"
                 : "showing that checkpoint");
  if (rc)
    ckpt__log("%s: not showing the checkpoint committed elsewhere: %s", name,
              err ? err : strerror(-rc));
  free(err);
  return discarded;
}

/* ------------------------------------------------------------------------
 * Abandoned saves: the job that wrote them is gone (jobs.c).
 * ---------------------------------------------------------------------- */

/* ck (staged, or its save just failed as abandoned) leaves the mount as
 * rm -r NAME would make it: its name is free for the restarted job; the
 * log says why. */
static void abandon_staged(ckpt_fs_t *fs, ckpt_ckpt_t *ck, const char *why) {
  uint64_t files = 0, bytes = 0;
  pthread_mutex_lock(&fs->lock);
  bool go = ck->dir && ck->state != CKPT_COMMITTING &&
            ck->state != CKPT_COMMITTED;
  if (go) {
    ckpt__ckpt_staged_size(ck, &files, &bytes);
    ck->state = CKPT_FAILED;
    free(ck->reason);
    ck->reason = strdup(why);
    ck->job = 0;
    ckpt__streams_drop_kept(ck->streams);
    ckpt__node_detach(fs, ck->dir);
    ckpt__ckpt_unref(fs, ck);
  }
  pthread_mutex_unlock(&fs->lock);
  if (!go)
    return;
  ckpt__staging_tidy(fs->commit_fd);
  ckpt__log("%s: %s: its staged files (%llu files, %llu bytes) were "
            "discarded; the name is free", ck->name, why,
            (unsigned long long)files, (unsigned long long)bytes);
}

static char *abandoned_why(pid_t tgid, const char *label) {
  return ckpt__strdup_printf("abandoned: the job that wrote it is gone "
                             "(process %d%s%s exited before every rank "
                             "committed it)",
                             (int)tgid, label && *label ? ", " : "",
                             label ? label : "");
}

void ckpt__jobs_gone(ckpt_fs_t *fs, pid_t tgid, const char *label) {
  char *why = abandoned_why(tgid, label);
  size_t n = 0, cap = 0;
  ckpt_ckpt_t **staged = NULL;
  int cancelled = 0;
  pthread_mutex_lock(&fs->lock);
  for (ckpt_node_t *c = fs->root->children; c; c = c->next) {
    ckpt_ckpt_t *ck = c->kind == CKPT_NODE_CKPT ? c->ck : NULL;
    if (!ck || ck->job != tgid || ck->state == CKPT_COMMITTED)
      continue;
    if (ck->state == CKPT_COMMITTING) {
      if (ck->save && !atomic_exchange(&ck->save->job.cancel, true)) {
        ck->save->abandoned = why ? strdup(why) : NULL;
        cancelled++;
      }
      continue;
    }
    if (n == cap) {
      size_t ncap = cap ? 2 * cap : 8;
      ckpt_ckpt_t **more = realloc(staged, ncap * sizeof(*more));
      if (!more)
        break;
      staged = more, cap = ncap;
    }
    ck->refs++;
    staged[n++] = ck;
  }
  pthread_mutex_unlock(&fs->lock);
  if (cancelled || n)
    ckpt__log("job: process %d%s%s exited without \"end\": abandoning its "
              "%zu staged and %d committing save(s)", (int)tgid,
              label && *label ? ": " : "", label ? label : "", n, cancelled);
  for (size_t i = 0; i < n; i++) {
    abandon_staged(fs, staged[i], why ? why : "abandoned");
    pthread_mutex_lock(&fs->lock);
    ckpt__ckpt_unref(fs, staged[i]);
    pthread_mutex_unlock(&fs->lock);
  }
  free(staged);
  free(why);
}

/* replace=TARGET committed: the staged checkpoint leaves this mount (its
 * files are TARGET's now), and TARGET is shown anew, at once (an old view
 * of it goes; handles open on it keep reading the old bytes). */
static int show_replaced(ckpt_fs_t *fs, ckpt_ckpt_t *ck, const char *target,
                         char **err) {
  pthread_mutex_lock(&fs->lock);
  ck->state = CKPT_COMMITTED;
  if (ck->dir) {
    ckpt__node_detach(fs, ck->dir);
    ckpt__ckpt_unref(fs, ck);
  }
  ckpt_node_t *old = ckpt__ckpt_lookup(fs, target);
  if (old && old->ck->state == CKPT_COMMITTED) {
    ckpt_ckpt_t *ock = old->ck;
    ckpt__node_detach(fs, old);
    ckpt__ckpt_unref(fs, ock);
  }
  pthread_mutex_unlock(&fs->lock);
  return ckpt__fs_load_one(fs, target, err);
}

static void save_done(void *ctx, ckpt_dist_job_t *job, int rc,
                      const char *reason) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  ckpt_ckpt_t *ck = s->ck;
  char *err = NULL;
  double took = ckpt__mono_now() - s->began;
  ckpt_commit_outcome_t outcome = CKPT_COMMIT_FAILED;
  if (rc == 0) {
    uint64_t wrote = atomic_load(&ck->bytes_done);
    ckpt__log("%s: committed in %.2f s (this rank wrote %llu bytes, %.1f "
              "MB/s)", job->name, took, (unsigned long long)wrote,
              took > 0 ? (double)wrote / 1e6 / took : 0.0);
    atomic_fetch_add(&fs->metrics.bytes_committed, wrote);
    outcome = CKPT_COMMIT_COMMITTED;
    /* Every rank shows the global checkpoint, from the shared metadata. */
    if (s->dirfd >= 0)
      flock(s->dirfd, LOCK_UN);
    if (ck->streams) /* the data files hold the streamed bytes now */
      ckpt__streams_committed(ck->streams);
    if (s->replace && strcmp(ck->name, job->name))
      ckpt__log("%s: published as %s%s", ck->name, job->name,
                " (replace=): the staged name is gone from this mount");
    if (s->replace && strcmp(ck->name, job->name)
            ? show_replaced(fs, ck, job->name, &err)
            : ckpt__fs_load_one(fs, job->name, &err)) {
      ckpt__log("%s: committed, but cannot show it: %s", job->name,
                err ? err : "unknown error");
      pthread_mutex_lock(&fs->lock);
      ck->state = CKPT_FAILED;
      ck->reason = ckpt__strdup_printf("committed, but cannot be shown: %s",
                                       err ? err : "unknown error");
      pthread_mutex_unlock(&fs->lock);
      rc = -EIO;
      outcome = CKPT_COMMIT_FAILED; /* the writer gets EIO */
      s->step_rc = -EIO;
    }
    free(err);
  } else {
    pthread_mutex_lock(&fs->lock);
    free(ck->waiting);
    ck->waiting = NULL;
    pthread_mutex_unlock(&fs->lock);
    ckpt__log("%s: commit failed: %s (after %.2f s)", job->name,
              reason ? reason : "", took);
    /* Lost to another save of NAME: the winner is shown in its place while
     * this one still says committing, so that .status never shows a
     * "failed" NAME that is in fact committed (an async writer polling it
     * would take it for its own failure). */
    if (rc == -EEXIST && !s->replace &&
        yield_to_winner(fs, ck, job->name, reason ? reason : ""))
      outcome = CKPT_COMMIT_LOST;
    else {
      pthread_mutex_lock(&fs->lock);
      ck->state = CKPT_FAILED;
      ck->reason = strdup(reason ? reason : "unknown error");
      char *gone = atomic_load(&job->cancel) && s->abandoned
                       ? strdup(s->abandoned)
                       : NULL;
      pthread_mutex_unlock(&fs->lock);
      if (ck->streams) /* staged again: files may stream anew */
        ckpt__streams_freeze(ck->streams, false, 0);
      /* its job is gone: nobody commits it again */
      if (gone)
        abandon_staged(fs, ck, gone);
      free(gone);
    }
  }
  pthread_mutex_lock(&fs->lock);
  ck->replacing[0] = '\0'; /* TARGET is shown (or the save failed) */
  pthread_mutex_unlock(&fs->lock);
  ckpt__metrics_commit(fs, outcome,
                       ckpt__metrics_classify(rc == -EEXIST ? rc
                                              : s->step_rc ? s->step_rc
                                                           : rc,
                                              reason),
                       took);
  ckpt__staging_tidy(fs->commit_fd);
  /* With a tier the flush applies it, once NAME is on BACKING_DIR */
  if (rc == 0 && s->rank == 0 && ckpt_keep_policy_active(&fs->opts.keep) &&
      (!fs->flush || s->direct))
    ckpt__keep_policy(fs, job->name);
  if (rc == 0)
    ckpt_failpoint("committed");
  /* a writer killed meanwhile was answered by the interrupt */
  if (s->sync && s->req && claim_reply(s)) {
    if (rc == 0)
      fuse_reply_write(s->req, s->reply_size);
    else
      fuse_reply_err(s->req, rc == -EEXIST ? EEXIST : EIO);
  }
  /* The writer has its answer: the copy to BACKING_DIR starts behind it
   * (a direct save, level=shared, is there already). */
  if (rc == 0 && fs->flush && !s->direct)
    ckpt__flush_add(fs->flush, job->name, s->rp.save_id, s->rank);
  save_free(fs, s);
}

/* ------------------------------------------------------------------------
 * The steps as dist runs them: the first failure's errno is kept for the
 * metrics (dist passes only -EIO or -EEXIST to save_done).
 * ---------------------------------------------------------------------- */

static int noted(ckpt_dist_job_t *job, int rc) {
  ckpt_save_t *s = job->user;
  if (rc && !s->step_rc)
    s->step_rc = rc;
  return rc;
}

static int local_noted(void *ctx, ckpt_dist_job_t *job, ckpt_buf_t *out,
                       char **err) {
  return noted(job, local_step(ctx, job, out, err));
}

static int global_noted(void *ctx, ckpt_dist_job_t *job,
                        const ckpt_buf_t *plans, int n,
                        ckpt_buf_t *rank_plans, char **err) {
  return noted(job, global_step(ctx, job, plans, n, rank_plans, err));
}

static int write_noted(void *ctx, ckpt_dist_job_t *job,
                       const ckpt_buf_t *plan, ckpt_buf_t *out, char **err) {
  return noted(job, write_step(ctx, job, plan, out, err));
}

static int finish_noted(void *ctx, ckpt_dist_job_t *job,
                        const ckpt_buf_t *results, int n,
                        ckpt_buf_t *outcome, char **err) {
  return noted(job, finish_step(ctx, job, results, n, outcome, err));
}

void ckpt__save_view(ckpt_dist_job_t *job, ckpt_save_view_t *v) {
  ckpt_save_t *s = job->user;
  *v = (ckpt_save_view_t){.dirfd = s->dirfd,
                          .rank = s->rank,
                          .save_id = s->rp.save_id,
                          .n_files = s->have_rp ? s->rp.n_files : 0,
                          .file_bytes = s->rp.file_bytes,
                          .rx = &s->partner_rx,
                          .name = job->name,
                          .replace = s->replace,
                          .remote = remote_node(s->fs, job)};
}

static int partner_noted(void *ctx, ckpt_dist_job_t *job, int partner,
                         ckpt_dist_file_t **files, uint32_t *n, char **err) {
  return noted(job, ckpt__partner_files(ctx, job, partner, files, n, err));
}

const ckpt_save_ops_t ckpt__save_ops = {
    .local_step = local_noted,
    .global_step = global_noted,
    .write_step = write_noted,
    .finish_step = finish_noted,
    .publish_step = publish_step,
    .discard_step = discard_step,
    .partner_files = partner_noted,
    .partner_open = ckpt__partner_open,
    .partner_close = ckpt__partner_close,
    .done = save_done,
    .waiting = ckpt__save_waiting,
};
