/*
 * save.c - one checkpoint save of this rank: the steps that dist runs.
 *
 *   ckpt__save_begin  (FUSE thread) freeze the staged files, queue the job
 *   ckpt__cm_local_step        hash every staged file, describe it: the local plan
 *   ckpt__cm_global_step       coordinator: ckpt_plan_global, one plan per rank
 *   ckpt__cm_write_step        write this rank's items into __R_K.distcp, K <
 *                     io_threads, one worker per file, fsync (sync_files)
 *   ckpt__cm_finish_step       coordinator: publish .metadata (metadb.c)
 *   ckpt__cm_publish_step      other ranks, with a tier: another node publishes the
 *                     checkpoint in its own tier too
 *   ckpt__cm_discard_step      failed save: remove what was written
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
#include "commit_int.h"
#include "metadb.h"

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

/* The staged files' list, paths and entries collect_files made. */
static void free_collected(ckpt_save_t *s) {
  for (uint32_t i = 0; i < s->nfiles; i++)
    free(s->paths[i]);
  free(s->paths);
  free(s->files);
  for (uint32_t i = 0; i < s->n_attrs; i++)
    ckpt_entry_attr_free(&s->attrs[i]);
  free(s->attrs);
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
  free_collected(s);
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
  ckpt_entry_attr_t *e = &s->attrs[s->n_attrs++];
  *e = (ckpt_entry_attr_t){.path = path,
                           .mode = (uint32_t)n->mode,
                           .uid = (uint32_t)n->uid,
                           .gid = (uint32_t)n->gid,
                           .mtime_ns = sec * 1000000000 + n->mtime.tv_nsec};
  /* what a link holds, and the other xattrs (a file's are its sf's) */
  int rc = 0;
  if (n->kind == CKPT_NODE_SLINK && !(e->target = strdup(n->u.target)))
    rc = -ENOMEM;
  else if (n->kind == CKPT_NODE_SFILE)
    rc = ckpt__sfile_xattrs_copy(n->u.sf, e);
  else
    rc = ckpt__xlist_copy_out(&n->xl, e);
  return rc;
}

/* A staged file with several names (hard links) is stored under its
 * oldest name in the tree (the lowest inode number: the one it was
 * created with while that is there); each other name is kept as an entry
 * whose target is that name. 1 when c is such another name, 0 when not,
 * or -ENOMEM. fs->lock held. */
static int keep_link(ckpt_save_t *s, ckpt_node_t *c) {
  const ckpt_sfile_t *sf = c->u.sf;
  ckpt_node_t *first = c;
  for (uint32_t i = 0; i < sf->nnames; i++)
    if (sf->names[i]->attached && sf->names[i]->ino < first->ino)
      first = sf->names[i];
  if (first == c)
    return 0;
  int rc = keep_attr(s, c, ckpt__node_path(c));
  if (rc)
    return rc;
  ckpt_entry_attr_t *e = &s->attrs[s->n_attrs - 1];
  return (e->target = ckpt__node_path(first)) ? 1 : -ENOMEM;
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
    if (c->kind == CKPT_NODE_SLINK) {
      int rc = keep_attr(s, c, ckpt__node_path(c));
      if (rc)
        return rc;
      continue;
    }
    if (c->kind != CKPT_NODE_SFILE)
      continue;
    ckpt__sfile_pt_times(c->u.sf, &c->mtime, NULL); /* the kernel's writes' */
    int rc = keep_link(s, c);
    if (rc < 0)
      return rc;
    if (rc == 1)
      continue;
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
    rc = keep_attr(s, c, strdup(s->paths[s->nfiles]));
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

/* A save of ck as words say, not started. */
static ckpt_save_t *save_new(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                             const ckpt_commit_words_t *words, fuse_req_t req,
                             size_t reply_size) {
  ckpt_save_t *s = calloc(1, sizeof(*s));
  if (!s)
    return NULL;
  s->fs = fs;
  s->ck = ck;
  s->sync = words->sync;
  s->words = *words;
  s->rank = words->solo ? 0 : fs->rank;
  s->job.solo = words->solo;
  s->replace = words->replace[0] != '\0';
  s->direct = fs->tier_fd >= 0 && words->level_shared;
  s->root_fd = s->direct ? fs->backing_fd : fs->commit_fd;
  s->root_path = s->direct ? fs->backing_path : fs->commit_path;
  /* a solo save is one rank's own, at the local level; a direct one
   * needs no partner copies */
  s->job.partner = fs->opts.tier_partner && !words->solo && !s->direct;
  s->req = req;
  s->reply_size = reply_size;
  pthread_mutex_init(&s->reply_lock, NULL);
  s->dirfd = -1;
  s->failed_file = -1;
  s->job.user = s;
  s->began = ckpt__mono_now();
  return s;
}

/* Why ck cannot be committed now (its state, a replace= target staged
 * here), else its staged files collected into s. fs->lock held. */
static int check_and_collect(ckpt_save_t *s, const ckpt_commit_words_t *words) {
  ckpt_fs_t *fs = s->fs;
  ckpt_ckpt_t *ck = s->ck;
  uint32_t cap = 0;
  ckpt_node_t *target = s->replace && strcmp(words->replace, ck->name)
                            ? ckpt__ckpt_lookup(fs, words->replace)
                            : NULL;
  if (target && target->ck->state != CKPT_COMMITTED) {
    /* another checkpoint staged here under that name: not replaced */
    ckpt__log("%s/.commit: refused replace=%s: a checkpoint of that name is "
              "staged on this mount (commit or remove it first)", ck->name,
              words->replace);
    return -EEXIST;
  }
  if (ck->state == CKPT_COMMITTING)
    return -EBUSY;
  if (ck->state == CKPT_COMMITTED)
    return -EROFS;
  if (!ck->dir)
    return -ENOENT; /* removed (rmdir) while its .commit was open */
  int rc = collect_files(s, ck->dir, &cap);
  return rc ? rc : sort_files(s);
}

/* Passthrough files: the kernel writes them without the daemon, and
 * each large one becomes its data file as it is. So nobody may be able
 * to write one any more (a handle open for writing, a writable shared
 * mapping left after a close): else the commit fails at once with
 * EBUSY, naming the file and the process (*busy, referenced, and
 * *busy_path: looked up in /proc by the caller once the locks are
 * dropped, as reading another process's maps may wait on it). ck is
 * FAILED then, with its reason. fs->lock and the freeze lock held. */
static int freeze_files(ckpt_save_t *s, ckpt_node_t **busy,
                        char **busy_path) {
  ckpt_ckpt_t *ck = s->ck;
  for (uint32_t i = 0; i < s->nfiles; i++) {
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
    free(ck->reason);
    if (e == -EBUSY) {
      *busy = s->files[i];
      ckpt__node_ref(*busy);
      *busy_path = strdup(s->paths[i]);
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
    if (!*busy)
      ckpt__log("%s: %s", ck->name, ck->reason);
    return e;
  }
  return 0;
}

/* ck is COMMITTING with save s, waiting for its turn. fs->lock held. */
static void mark_committing(ckpt_save_t *s) {
  ckpt_ckpt_t *ck = s->ck;
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
}

/* The commit failed on busy, a file someone can still write: its reason
 * names who (from /proc). No lock held. */
static void name_busy_writer(ckpt_save_t *s, ckpt_node_t *busy,
                             char *busy_path) {
  ckpt_fs_t *fs = s->fs;
  ckpt_ckpt_t *ck = s->ck;
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

/* Free s, a save that never started (its files unreferenced already). */
static void free_unstarted(ckpt_save_t *s) {
  free_collected(s);
  pthread_mutex_destroy(&s->reply_lock);
  free(s);
}

/* dist refused the save: the daemon stops (SIGTERM, unmount), no save
 * starts any more. 0 if the interrupt answered the writer, else -EIO. */
static int refuse_stopping(ckpt_save_t *s) {
  ckpt_fs_t *fs = s->fs;
  ckpt_ckpt_t *ck = s->ck;
  /* the caller answers the writer, unless the interrupt did (then as if
   * answered: 0 with a sync writer means "replied") */
  bool answered = s->req && !claim_reply(s);
  ckpt__metrics_commit(fs, CKPT_COMMIT_FAILED, CKPT_FAIL_OTHER, -1);
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

int ckpt__save_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                     const ckpt_commit_words_t *words, fuse_req_t req,
                     size_t reply_size) {
  if (fs->passthrough)
    wait_for_releases(fs, ck);
  ckpt_save_t *s = save_new(fs, ck, words, req, reply_size);
  if (!s)
    return -ENOMEM;
  /* Freeze: no data change of this checkpoint is in progress once we hold
   * the freeze lock, and none starts after the state change. */
  atomic_store(&ck->freezing, true);
  pthread_rwlock_wrlock(&ck->freeze);
  pthread_mutex_lock(&fs->lock);
  /* under the freeze lock: a staged checkpoint may be renamed until now;
   * with replace=TARGET it is published as TARGET */
  snprintf(s->job.name, sizeof(s->job.name), "%s",
           s->replace ? words->replace : ck->name);
  ckpt_node_t *busy = NULL; /* the file still writable, referenced */
  char *busy_path = NULL;
  bool freeze_failed = false;
  int rc = check_and_collect(s, words);
  if (rc == 0) {
    rc = freeze_files(s, &busy, &busy_path);
    freeze_failed = rc != 0;
  }
  if (rc == 0) {
    mark_committing(s);
  } else {
    for (uint32_t i = 0; i < s->nfiles; i++)
      ckpt__node_unref(fs, s->files[i]);
  }
  pthread_mutex_unlock(&fs->lock);
  atomic_store(&ck->freezing, false);
  pthread_rwlock_unlock(&ck->freeze);
  if (busy)
    name_busy_writer(s, busy, busy_path);
  if (rc) {
    free_unstarted(s);
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
  return refuse_stopping(s);
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
        ckpt__cm_yield_to_winner(fs, ck, job->name, reason ? reason : ""))
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
                       ckpt__metrics_classify(rc, reason),
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
                          .remote = ckpt__cm_remote_node(s->fs, job)};
}

const ckpt_save_ops_t ckpt__save_ops = {
    .local_step = ckpt__cm_local_step,
    .global_step = ckpt__cm_global_step,
    .write_step = ckpt__cm_write_step,
    .finish_step = ckpt__cm_finish_step,
    .publish_step = ckpt__cm_publish_step,
    .discard_step = ckpt__cm_discard_step,
    .partner_files = ckpt__partner_files,
    .partner_open = ckpt__partner_open,
    .partner_close = ckpt__partner_close,
    .done = save_done,
    .waiting = ckpt__save_waiting,
};
