/*
 * flush.c - the background flush of a node-local tier (-o tier=DIR) to
 * BACKING_DIR.
 *
 * With a tier, a commit publishes into TIER (same layout as BACKING_DIR)
 * and returns; this thread then copies each such checkpoint to BACKING_DIR
 * and publishes it there exactly as a commit without the tier would have,
 * so that every other mount and tool sees the same thing. First slice:
 * one rank, its own files; the tier copy is removed once flushed (reads
 * go to BACKING_DIR from then on).
 *
 * The journal: TIER/.flush/SAVE_ID ("name NAME\nreplace 0|1\n") exists
 * while the checkpoint of that save is unflushed. Its life, in order:
 *   1. finish_step writes and fsyncs it, then publishes TIER/NAME
 *      (ckpt__flush_record; a torn one cannot name a published save);
 *   2. each data file of TIER/NAME is copied into an O_TMPFILE of
 *      BACKING_DIR/.staging under the token bucket of -o flush_rate,
 *      fsynced, every chunk's XXH3 checked in the copy against the
 *      .metadata, and only then linked into BACKING_DIR/.saves/SAVE_ID
 *      (held, so no starting mount removes it; a file already linked
 *      there by an earlier run is complete and kept);
 *   3. .metadata is copied (.metadata.tmp, fsync, rename, fsync);
 *   4. the record gets a "publishing" line (fsynced), then the same
 *      no-replace publish as a commit (ckpt__publish_save);
 *   5. the record is removed and .flush fsynced; then the tier copy.
 * A crash anywhere leaves the record; the next mount (ckpt__flush_recover)
 * drops it if BACKING_DIR/NAME already has SAVE_ID (crash after 4),
 * TIER/NAME does not (never published), or it says "publishing" and
 * BACKING_DIR/.saves/SAVE_ID is gone (published, then removed by a user
 * before the record went); else the flush resumes. A tier
 * checkpoint without a record is flushed already or was removed by a user
 * from BACKING_DIR: it is removed, never published again.
 *
 * Workload: one checkpoint at a time, large sequential copies; the thread
 * runs at nice 10 and the idle I/O class, so that training does not wait
 * for it.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "failpoint.h"
#include "fs_int.h"

#define FLUSH_STEP ((size_t)8 << 20) /* bytes per read and write */
#define BACKOFF_FIRST 1.0            /* seconds, doubled up to ... */
#define BACKOFF_MAX 60.0
/* The line a record gets before the shared publish (step 4). */
#define PUBLISHING "publishing\n"

typedef struct flush_job {
  char name[256];
  char save_id[CKPT_SAVE_ID_LEN + 1];
  bool replace;
  bool publishing;  /* the record says the shared publish was under way */
  char backing[PATH_MAX]; /* the BACKING_DIR it goes to (absolute) */
  struct flush_job *next;
} flush_job_t;

struct ckpt_flush {
  ckpt_fs_t *fs;
  pthread_t thread;
  bool started;           /* thread runs */
  pthread_mutex_t lock;   /* protects everything below */
  pthread_cond_t cond;    /* a job queued, or stop */
  flush_job_t *head, *tail;
  bool stop;
  double next_at;         /* token bucket: when the next step may start
                             (CLOCK_MONOTONIC s); flush thread only */
};

/* ------------------------------------------------------------------------
 * Records.
 * ---------------------------------------------------------------------- */

static int open_records(ckpt_fs_t *fs, bool create) {
  if (create && mkdirat(fs->tier_fd, CKPT_FLUSH_DIR, 0700) == 0 &&
      fsync(fs->tier_fd))
    return -errno;
  return ckpt_open_beneath(fs->tier_fd, CKPT_FLUSH_DIR,
                           O_RDONLY | O_DIRECTORY, 0);
}

int ckpt__flush_record(ckpt_fs_t *fs, const char *save_id, const char *name,
                       bool replace, char **err) {
  int dfd = open_records(fs, true);
  int fd = dfd < 0 ? dfd
                   : openat(dfd, save_id,
                            O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  int rc = dfd < 0 ? dfd : fd < 0 ? -errno : 0;
  if (rc == 0 && dprintf(fd, "name %s\nreplace %d\nbacking %s\n", name,
                         replace, fs->backing_path) < 0)
    rc = -errno;
  if (rc == 0 && (fsync(fd) || fsync(dfd)))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (rc && fd >= 0)
    unlinkat(dfd, save_id, 0);
  if (dfd >= 0)
    close(dfd);
  if (rc)
    *err = ckpt__strdup_printf("writing %s/%s/%s: %s", fs->tier_path,
                               CKPT_FLUSH_DIR, save_id, strerror(-rc));
  return rc;
}

void ckpt__flush_unrecord(ckpt_fs_t *fs, const char *save_id) {
  int dfd = open_records(fs, false);
  if (dfd < 0)
    return;
  if (unlinkat(dfd, save_id, 0) == 0)
    fsync(dfd);
  close(dfd);
}

/* Read record save_id: its name, replace flag, BACKING_DIR and publishing
 * mark. 0, -EINVAL when torn or malformed, -errno. */
static int read_record(int dfd, const char *save_id, flush_job_t *j) {
  int fd = openat(dfd, save_id, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return -errno;
  char buf[PATH_MAX + 400];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n < 0)
    return -errno;
  buf[n] = '\0';
  int replace = -1, used = 0;
  memset(j, 0, sizeof(*j));
  if (sscanf(buf, "name %255[^\n]\nreplace %d\nbacking %4095[^\n]\n%n",
             j->name, &replace, j->backing, &used) != 3 ||
      (replace != 0 && replace != 1) || j->backing[0] != '/' ||
      !ckpt_name_valid(j->name) || !ckpt_save_id_valid(save_id))
    return -EINVAL;
  j->publishing = !strcmp(buf + used, PUBLISHING);
  if (!j->publishing && buf[used])
    return -EINVAL;
  j->replace = replace == 1;
  snprintf(j->save_id, sizeof(j->save_id), "%s", save_id);
  return 0;
}

/* The save ID of root/name: 0, -ENOENT (no such checkpoint or no
 * .metadata: out ""), or another -errno (out "": unknown). */
static int save_id_of(int root_fd, const char *name,
                      char out[CKPT_SAVE_ID_LEN + 1]) {
  out[0] = '\0';
  int dfd = ckpt_store_open_dir(root_fd, name, O_RDONLY);
  int rc = dfd < 0 ? dfd : ckpt_store_save_id(dfd, out);
  if (rc)
    out[0] = '\0';
  if (dfd >= 0)
    close(dfd);
  return rc;
}

/* The save ID of root/name, or "" when it has none or it is unknown. */
static void save_id_at(int root_fd, const char *name,
                       char out[CKPT_SAVE_ID_LEN + 1]) {
  (void)save_id_of(root_fd, name, out);
}

/* Call fn for each record of the tier. */
static void each_record(ckpt_fs_t *fs,
                        void (*fn)(ckpt_fs_t *fs, int dfd, const char *id,
                                   void *arg),
                        void *arg) {
  int dfd = open_records(fs, false);
  if (dfd < 0)
    return;
  int lfd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
  if (!d && lfd >= 0)
    close(lfd);
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      fn(fs, dfd, e->d_name, arg);
  if (d)
    closedir(d);
  close(dfd);
}

/* ------------------------------------------------------------------------
 * Recovery at mount.
 * ---------------------------------------------------------------------- */

/* Does root/.saves/save_id exist? */
static bool saves_dir_exists(int root_fd, const char *save_id) {
  char path[CKPT_SAVE_ID_LEN + 16];
  struct stat st;
  snprintf(path, sizeof(path), "%s/%s", CKPT_SAVES_DIR, save_id);
  return fstatat(root_fd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 ||
         errno != ENOENT; /* unknown: keep the record */
}

static void recover_record(ckpt_fs_t *fs, int dfd, const char *id,
                           void *arg) {
  (void)arg;
  flush_job_t j;
  char tier_id[CKPT_SAVE_ID_LEN + 1], shared_id[CKPT_SAVE_ID_LEN + 1];
  const char *why = NULL;
  int rc = read_record(dfd, id, &j), trc = 0;
  if (rc == -EINVAL) {
    why = "torn or malformed (its save was never published)";
  } else if (rc) {
    /* EMFILE, EIO...: proves nothing; kept for the next mount */
    ckpt__log("tier: flush record %s unreadable (%s): kept", id,
              strerror(-rc));
  } else {
    trc = save_id_of(fs->tier_fd, j.name, tier_id);
    save_id_at(fs->backing_fd, j.name, shared_id);
    if (!strcmp(shared_id, id))
      why = "flushed already";
    else if (trc && trc != -ENOENT)
      ckpt__log("tier: flush record %s: %s/%s unreadable (%s): kept", id,
                fs->tier_path, j.name, strerror(-trc));
    else if (strcmp(tier_id, id))
      why = "its save was never published in the tier";
    else if (j.publishing && !saves_dir_exists(fs->backing_fd, id))
      /* Published and removed there since, or removed by another
       * mount's cleanup of unfinished saves before the publish: the two
       * cannot be told apart, and the tier's copy may be the only one.
       * Kept: the flush copies it again and publishes it without
       * replacing anything (flush_one). */
      ckpt__log("tier: flush record %s (%s): marked publishing, but "
                "neither %s/%s nor %s/%s/%s is this save (published and "
                "removed there since, or removed by another mount before "
                "the publish): kept, flushed again without replacing",
                id, j.name, fs->backing_path, j.name, fs->backing_path,
                CKPT_SAVES_DIR, id);
  }
  if (!why)
    return; /* resumed by the thread */
  ckpt__log("tier: dropping flush record %s: %s", id, why);
  if (unlinkat(dfd, id, 0) == 0)
    fsync(dfd);
}

typedef struct {
  const char *backing;
  char *found;
} other_t;

/* A record of another BACKING_DIR: the first one's, in *arg. */
static void other_backing(ckpt_fs_t *fs, int dfd, const char *id,
                          void *arg) {
  (void)fs;
  other_t *o = arg;
  flush_job_t j;
  if (!o->found && read_record(dfd, id, &j) == 0 &&
      strcmp(j.backing, o->backing))
    o->found = ckpt__strdup_printf("%s (checkpoint %s)", j.backing, j.name);
}

int ckpt__flush_check(ckpt_fs_t *fs, const char *backing, char **err) {
  other_t o = {.backing = backing};
  each_record(fs, other_backing, &o);
  char *other = o.found;
  if (!other)
    return 0;
  *err = ckpt__strdup_printf(
      "tier=%s holds a checkpoint not flushed yet to another BACKING_DIR, "
      "%s: mount the tier with that BACKING_DIR first, so that nothing is "
      "lost", fs->tier_path, other);
  free(other);
  return -EBUSY;
}

/* Does a record name save_id? */
static bool has_record(ckpt_fs_t *fs, const char *save_id) {
  int dfd = open_records(fs, false);
  struct stat st;
  bool has = dfd >= 0 && save_id[0] &&
             fstatat(dfd, save_id, &st, AT_SYMLINK_NOFOLLOW) == 0;
  if (dfd >= 0)
    close(dfd);
  return has;
}

/* Is there positively no record of save_id (not: one unknown)? */
static bool no_record(int dfd, const char *save_id) {
  struct stat st;
  if (dfd == -ENOENT) /* no .flush: no records */
    return true;
  return dfd >= 0 && fstatat(dfd, save_id, &st, AT_SYMLINK_NOFOLLOW) &&
         errno == ENOENT;
}

void ckpt__flush_recover(ckpt_fs_t *fs) {
  each_record(fs, recover_record, NULL);
  char **names;
  size_t n;
  int dfd = open_records(fs, false);
  if (dfd < 0 && dfd != -ENOENT) {
    ckpt__log("tier: cannot open %s/%s (%s): no tier checkpoint removed",
              fs->tier_path, CKPT_FLUSH_DIR, strerror(-dfd));
    return;
  }
  if (ckpt__catalog_names(fs->tier_fd, &names, &n)) {
    if (dfd >= 0)
      close(dfd);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    char id[CKPT_SAVE_ID_LEN + 1];
    if (!ckpt_store_committed(fs->tier_fd, names[i], NULL))
      continue; /* unfinished: ckpt_store_cleanup's */
    if (save_id_of(fs->tier_fd, names[i], id) || !no_record(dfd, id))
      continue; /* unknown: kept */
    /* Flushed (its copy is BACKING_DIR's now) or removed there by a
     * user: either way not to be published again. */
    ckpt__log("tier: removing %s (flushed, or removed from %s)", names[i],
              fs->backing_path);
    ckpt__checkpoint_remove(fs->tier_fd, names[i], false);
  }
  ckpt__catalog_names_free(names, n);
  if (dfd >= 0)
    close(dfd);
}

/* ------------------------------------------------------------------------
 * The copy.
 * ---------------------------------------------------------------------- */

/* Wait until t (CLOCK_MONOTONIC s) or stop. false when stopped. */
static bool sleep_until(ckpt_flush_t *f, double t) {
  pthread_mutex_lock(&f->lock);
  while (!f->stop && ckpt__mono_now() < t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double wait = t - ckpt__mono_now();
    if (wait > 0.5)
      wait = 0.5;
    ts.tv_sec += (time_t)wait;
    ts.tv_nsec += (long)((wait - (double)(time_t)wait) * 1e9);
    if (ts.tv_nsec >= 1000000000L)
      ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&f->cond, &f->lock, &ts);
  }
  bool go = !f->stop;
  pthread_mutex_unlock(&f->lock);
  return go;
}

/* The token bucket of -o flush_rate: len bytes may go now once the
 * previous ones' time has passed (no burst: a restart of the flush after
 * an idle spell does not exceed the rate either). */
static bool take_tokens(ckpt_flush_t *f, size_t len) {
  uint64_t rate = f->fs->opts.flush_rate;
  if (!rate)
    return sleep_until(f, 0);
  double now = ckpt__mono_now();
  if (f->next_at < now)
    f->next_at = now;
  if (!sleep_until(f, f->next_at))
    return false;
  f->next_at += (double)len / (double)rate;
  return true;
}

/* The checkpoint of the tree named name, if it is save_id's; fs->lock
 * held. */
static ckpt_ckpt_t *tree_ckpt(ckpt_fs_t *fs, const char *name,
                              const char *save_id) {
  ckpt_node_t *d = ckpt__ckpt_lookup(fs, name);
  ckpt_ckpt_t *ck = d ? d->ck : NULL;
  return ck && ck->state == CKPT_COMMITTED && ck->meta &&
                 !strcmp(ck->meta->save_id, save_id)
             ? ck
             : NULL;
}

/* Is the mount stopping the flush? */
static bool stopping(ckpt_flush_t *f) {
  pthread_mutex_lock(&f->lock);
  bool stop = f->stop;
  pthread_mutex_unlock(&f->lock);
  return stop;
}

/* Set the .status reason of the flush of j (NULL: none). */
static void set_why(ckpt_fs_t *fs, const flush_job_t *j, char *why) {
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = tree_ckpt(fs, j->name, j->save_id);
  if (ck) {
    free(ck->tier.why);
    ck->tier.why = why;
    why = NULL;
  }
  pthread_mutex_unlock(&fs->lock);
  free(why);
}

/* Add n copied bytes to the .status count of j. */
static void count_done(ckpt_fs_t *fs, const flush_job_t *j, uint64_t n) {
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = tree_ckpt(fs, j->name, j->save_id);
  if (ck)
    atomic_fetch_add(&ck->tier.done, n);
  pthread_mutex_unlock(&fs->lock);
}

/* Does every chunk and blob of m stored in data file (rank, k) have its
 * checksum in fd? 0, -EBADMSG (logged: the tier's copy is damaged, which
 * no retry mends) or -errno. */
static int verify_copy(ckpt_flush_t *f, const ckpt_metadata_t *m,
                       int32_t rank, uint32_t k, int fd, const char *what) {
  for (uint32_t i = 0; i < m->n_chunks + m->n_blobs; i++) {
    if (stopping(f))
      return -ECANCELED; /* unmount: the record resumes it */
    bool chunk = i < m->n_chunks;
    const ckpt_chunk_meta_t *c = chunk ? &m->chunks[i] : NULL;
    const ckpt_blob_meta_t *b = chunk ? NULL : &m->blobs[i - m->n_chunks];
    if ((chunk ? c->rank : b->rank) != rank || (chunk ? c->file : b->file) != k)
      continue;
    uint64_t want = chunk ? c->checksum : b->checksum, got;
    int rc = ckpt__stored_checksum(fd, chunk ? c->file_offset : b->file_offset,
                                   chunk ? c->length : b->length, &got);
    if (rc == 0 && got != want)
      rc = -EBADMSG;
    if (rc) {
      if (what) /* NULL: a file of an earlier run, quietly copied again */
        ckpt__log("tier: the copy of %s is not what was committed (%s): "
                  "not published", what, strerror(-rc));
      return rc;
    }
  }
  return 0;
}

/* Copy fd in to fd out, [0, size), under the token bucket. */
static int copy_bytes(ckpt_flush_t *f, const flush_job_t *j, int in, int out,
                      uint64_t size, bool count) {
  size_t step = FLUSH_STEP;
  if (f->fs->opts.flush_rate && f->fs->opts.flush_rate / 4 < step)
    step = f->fs->opts.flush_rate / 4 ? (size_t)(f->fs->opts.flush_rate / 4)
                                      : 4096; /* smooth at low rates */
  char *buf = malloc(step);
  if (!buf)
    return -ENOMEM;
  int rc = 0;
  for (uint64_t off = 0; rc == 0 && off < size; off += step) {
    size_t n = size - off < step ? (size_t)(size - off) : step;
    if (!take_tokens(f, n))
      rc = -ECANCELED;
    else if ((rc = ckpt__pread_full(in, buf, n, off)) == 0 &&
             (errno = 0, pwrite(out, buf, n, (off_t)off)) != (ssize_t)n)
      rc = errno ? -errno : -ENOSPC; /* short: the store is full */
    if (rc == 0 && count)
      count_done(f->fs, j, n);
  }
  free(buf);
  return rc;
}

/* Link the O_TMPFILE fd as dirfd/name. A file already there is not a
 * complete copy (copy_file checked it): replaced. */
static int link_tmpfile(int fd, int dirfd, const char *name) {
  char from[64];
  snprintf(from, sizeof(from), "/proc/self/fd/%d", fd);
  if (linkat(AT_FDCWD, from, dirfd, name, AT_SYMLINK_FOLLOW) == 0)
    return 0;
  if (errno != EEXIST || unlinkat(dirfd, name, 0))
    return -errno;
  return linkat(AT_FDCWD, from, dirfd, name, AT_SYMLINK_FOLLOW) ? -errno
                                                                 : 0;
}

/* Is held/name, of an earlier run, a complete and verified copy of data
 * file (rank, k) of size bytes? */
static bool copied_already(ckpt_flush_t *f, const ckpt_metadata_t *m,
                           int held, const char *name, int32_t rank,
                           uint32_t k, off_t size) {
  struct stat have;
  if (fstatat(held, name, &have, AT_SYMLINK_NOFOLLOW) ||
      !S_ISREG(have.st_mode) || have.st_size != size)
    return false;
  int fd = openat(held, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  bool ok = fd >= 0 && verify_copy(f, m, rank, k, fd, NULL) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

/* Copy data file name (rank, k) of the tier's src into held, verified. */
static int copy_file(ckpt_flush_t *f, const flush_job_t *j,
                     const ckpt_metadata_t *m, int src, int held,
                     const char *name, int32_t rank, uint32_t k) {
  ckpt_fs_t *fs = f->fs;
  struct stat st;
  int in = ckpt_store_open_file(src, name);
  if (in < 0)
    return in;
  int rc = fstat(in, &st) ? -errno : 0;
  if (rc == 0 &&
      copied_already(f, m, held, name, rank, k, st.st_size)) {
    count_done(fs, j, (uint64_t)st.st_size); /* linked by an earlier run */
    close(in);
    return 0;
  }
  int out = rc ? -1 : ckpt__staging_tmpfile(fs->backing_fd);
  if (rc == 0 && out < 0)
    rc = out;
  if (rc == 0)
    rc = ckpt_failpoint_error("flush_copy");
  if (rc == 0)
    rc = copy_bytes(f, j, in, out, (uint64_t)st.st_size, true);
  if (rc == 0)
    ckpt_failpoint("flush_copy");
  if (rc == 0 && fs->opts.sync_files && fsync(out))
    rc = -errno;
  char what[600];
  snprintf(what, sizeof(what), "%s/%s", j->name, name);
  if (rc == 0)
    rc = verify_copy(f, m, rank, k, out, what);
  if (rc == 0)
    rc = link_tmpfile(out, held, name);
  if (out >= 0)
    close(out);
  close(in);
  return rc;
}

/* Copy src/.metadata to held/.metadata: through .metadata.tmp, synced. */
static int copy_metadata(ckpt_flush_t *f, const flush_job_t *j, int src,
                         int held) {
  int in = ckpt_store_open_file(src, CKPT_METADATA_FILE);
  if (in < 0)
    return in;
  struct stat st;
  int out = openat(held, CKPT_METADATA_TMP,
                   O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                   0600);
  /* the mode the commit gave it in the tier */
  int rc = out < 0 || fstat(in, &st) || fchmod(out, st.st_mode & 0777)
               ? -errno
               : 0;
  /* not counted in .status's flush bytes (data files only) */
  if (rc == 0)
    rc = copy_bytes(f, j, in, out, (uint64_t)st.st_size, false);
  if (rc == 0 && f->fs->opts.sync_files && fsync(out))
    rc = -errno;
  if (out >= 0)
    close(out);
  close(in);
  if (rc == 0 && renameat(held, CKPT_METADATA_TMP, held, CKPT_METADATA_FILE))
    rc = -errno;
  if (rc == 0 && f->fs->opts.sync_files && fsync(held))
    rc = -errno;
  return rc;
}

/* Is name a data file __R_K.distcp? Its R and K. */
static bool data_file(const char *name, int32_t *rank, uint32_t *k) {
  int r, used = 0;
  unsigned kk;
  char back[64];
  if (sscanf(name, "__%d_%u.distcp%n", &r, &kk, &used) != 2 ||
      name[used] || r < 0)
    return false;
  ckpt_data_file_name(r, kk, back, sizeof(back));
  *rank = r;
  *k = kk;
  return !strcmp(back, name);
}

/* Copy every data file of src into held. */
static int copy_data(ckpt_flush_t *f, const flush_job_t *j,
                     const ckpt_metadata_t *m, int src, int held) {
  int lfd = openat(src, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
  if (!d) {
    int e = errno;
    if (lfd >= 0)
      close(lfd);
    return -e;
  }
  int rc = 0;
  struct dirent *e;
  int32_t rank;
  uint32_t k;
  while (rc == 0 && (e = readdir(d)) != NULL)
    if (data_file(e->d_name, &rank, &k))
      rc = copy_file(f, j, m, src, held, e->d_name, rank, k);
  closedir(d);
  return rc;
}

/* The reader of j's checkpoint reads BACKING_DIR's copy from now on. */
static void rebind_to_shared(ckpt_fs_t *fs, const flush_job_t *j) {
  ckpt_version_t v = {0};
  int dfd = ckpt_store_open_dir(fs->backing_fd, j->name, O_RDONLY);
  struct stat st;
  bool ok = dfd >= 0 && fstat(dfd, &st) == 0 &&
            ckpt_store_save_id(dfd, v.save_id) == 0 &&
            !strcmp(v.save_id, j->save_id);
  if (dfd >= 0)
    close(dfd);
  if (ok) {
    v.dev = st.st_dev;
    v.ino = st.st_ino;
    ckpt_store_dir_handle(fs->backing_fd, j->name, &v.handle);
  }
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = tree_ckpt(fs, j->name, j->save_id);
  if (ck && ok && ck->has_stored) {
    ckpt_stored_rebind(&ck->stored, &v);
    ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
  }
  if (ck) {
    atomic_store(&ck->tier.flushed, true);
    free(ck->tier.why);
    ck->tier.why = NULL;
  }
  pthread_mutex_unlock(&fs->lock);
}

/* The tier's copy of j, flushed: removed if TIER/NAME is still j's save
 * (a replace= commit may have put a newer one there meanwhile, which is
 * not flushed yet), checked and removed under fs->tier_publish so that no
 * commit publishes in between. */
static void remove_tier_copy(ckpt_fs_t *fs, const flush_job_t *j) {
  char id[CKPT_SAVE_ID_LEN + 1];
  pthread_mutex_lock(&fs->tier_publish);
  save_id_at(fs->tier_fd, j->name, id);
  bool ours = !strcmp(id, j->save_id);
  if (ours)
    ckpt__checkpoint_remove(fs->tier_fd, j->name, false);
  pthread_mutex_unlock(&fs->tier_publish);
  if (!ours) {
    ckpt__log("tier: %s: flushed; the tier holds a newer save of it now "
              "(%s), kept", j->name, id[0] ? id : "none");
    return;
  }
  /* A lookup that saw the tier's copy before it went says nothing against
   * BACKING_DIR's (still_stored ignores presences older than load_gen). */
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = tree_ckpt(fs, j->name, j->save_id);
  if (ck)
    ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
  pthread_mutex_unlock(&fs->lock);
}

/* Step 4 begins: the record says so (fsynced), so that the next mount
 * tells a save published and then removed by a user (no
 * BACKING_DIR/.saves/SAVE_ID left: the publish renamed it) from one that
 * was never published (it is still there). */
static int mark_publishing(ckpt_fs_t *fs, const flush_job_t *j, char **err) {
  int dfd = open_records(fs, false);
  int fd = dfd < 0 ? dfd
                   : openat(dfd, j->save_id,
                            O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW);
  int rc = dfd < 0 ? dfd : fd < 0 ? -errno : 0;
  flush_job_t now;
  if (rc == 0 && (rc = read_record(dfd, j->save_id, &now)) == 0 &&
      !now.publishing) {
    ssize_t w = write(fd, PUBLISHING, strlen(PUBLISHING));
    if (w != (ssize_t)strlen(PUBLISHING))
      rc = w < 0 ? -errno : -ENOSPC; /* short: the tier is full */
  }
  if (rc == 0 && fsync(fd))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (dfd >= 0)
    close(dfd);
  if (rc)
    *err = ckpt__strdup_printf("marking %s/%s/%s: %s", fs->tier_path,
                               CKPT_FLUSH_DIR, j->save_id, strerror(-rc));
  return rc;
}

/* Flush one checkpoint: steps 2-5 of the protocol above. 0 or -errno
 * with *err. */
static int flush_one(ckpt_flush_t *f, const flush_job_t *j, char **err) {
  ckpt_fs_t *fs = f->fs;
  ckpt_metadata_t m = {0};
  int held = -1, src = ckpt_store_open_dir(fs->tier_fd, j->name, O_RDONLY);
  char id[CKPT_SAVE_ID_LEN + 1];
  int rc = src < 0 ? src : ckpt_store_save_id(src, id);
  if (rc == 0 && strcmp(id, j->save_id))
    rc = -ESTALE;
  if (rc == 0)
    rc = ckpt_metadb_load_at(src, j->name, &m, err);
  /* Marked publishing by an earlier run, and BACKING_DIR/.saves/ID gone
   * since (recover_record): published again without replacing anything,
   * so that nothing committed since is replaced by it. */
  bool replace = j->replace;
  flush_job_t rec;
  int rdfd = rc == 0 && replace ? open_records(fs, false) : -1;
  if (rdfd >= 0 && read_record(rdfd, j->save_id, &rec) == 0 &&
      rec.publishing && !saves_dir_exists(fs->backing_fd, j->save_id))
    replace = false;
  if (rdfd >= 0)
    close(rdfd);
  if (rc == 0 && (rc = ckpt_store_save_dir_hold(fs->backing_fd, j->save_id,
                                                true, &held)))
    *err = ckpt__strdup_printf("creating %s/%s/%s: %s", fs->backing_path,
                               CKPT_SAVES_DIR, j->save_id, strerror(-rc));
  if (rc == 0 && (rc = copy_data(f, j, &m, src, held)) == 0)
    rc = copy_metadata(f, j, src, held);
  if (rc && !*err)
    *err = ckpt__strdup_printf("copying %s to %s: %s", j->name,
                               fs->backing_path, strerror(-rc));
  if (rc == 0)
    rc = mark_publishing(fs, j, err);
  if (rc == 0)
    ckpt_failpoint("flush_marked");
  if (rc == 0) {
    ckpt_publish_t p = {.root_fd = fs->backing_fd,
                        .root_path = fs->backing_path,
                        .held_fd = held,
                        .save_id = j->save_id,
                        .name = j->name,
                        .replace = replace,
                        .flush = true};
    rc = ckpt__publish_save(fs, &p, err);
  }
  if (rc == 0) {
    ckpt_failpoint("flush_published");
    ckpt__flush_unrecord(fs, j->save_id);
    rebind_to_shared(fs, j);
    remove_tier_copy(fs, j);
  }
  ckpt__staging_tidy(fs->backing_fd); /* its copies' directory */
  ckpt_metadata_free(&m);
  if (held >= 0)
    close(held);
  if (src >= 0)
    close(src);
  return rc;
}

/* A store that is full, failing or read-only may come back. */
static bool transient(int rc) {
  return rc == -ENOSPC || rc == -EIO || rc == -EROFS || rc == -EDQUOT ||
         rc == -ETIMEDOUT || rc == -ESTALE || rc == -ENOTCONN ||
         rc == -EHOSTDOWN || rc == -ESHUTDOWN || rc == -EAGAIN ||
         rc == -EINTR || rc == -ENOMEM || rc == -EMFILE || rc == -ENFILE;
}

/* Is TIER/NAME known to be another save than j's, or gone (a replace=
 * commit put a newer one in its place, which has its own flush)? Then
 * j's record goes, and its partial copy in BACKING_DIR/.saves/ID: it is
 * never to be published. An error that proves nothing (EMFILE, EIO) is
 * not that. */
static bool superseded(ckpt_fs_t *fs, const flush_job_t *j) {
  char id[CKPT_SAVE_ID_LEN + 1];
  pthread_mutex_lock(&fs->tier_publish);
  int dfd = ckpt_store_open_dir(fs->tier_fd, j->name, O_RDONLY);
  bool other = dfd == -ENOENT ||
               (dfd >= 0 && ckpt_store_save_id(dfd, id) == 0 &&
                strcmp(id, j->save_id));
  if (dfd >= 0)
    close(dfd);
  if (other)
    ckpt__flush_unrecord(fs, j->save_id);
  pthread_mutex_unlock(&fs->tier_publish);
  if (!other)
    return false;
  char shared[CKPT_SAVE_ID_LEN + 1];
  save_id_at(fs->backing_fd, j->name, shared);
  if (strcmp(shared, j->save_id))
    ckpt_store_save_dir_remove(fs->backing_fd, j->save_id);
  ckpt__log("tier: %s: save %s superseded in the tier (by a replace=): not "
            "flushed, its record and partial copy removed", j->name,
            j->save_id);
  return true;
}

/* Flush j until done, stopped or failed for good. */
static void run_job(ckpt_flush_t *f, const flush_job_t *j) {
  ckpt_fs_t *fs = f->fs;
  double backoff = BACKOFF_FIRST;
  for (;;) {
    char *err = NULL;
    double t0 = ckpt__mono_now();
    int rc = flush_one(f, j, &err);
    if (rc == 0) {
      ckpt__log("tier: %s flushed to %s in %.2f s", j->name,
                fs->backing_path, ckpt__mono_now() - t0);
      free(err);
      return;
    }
    if (rc == -ECANCELED) { /* unmount: the record resumes it */
      free(err);
      return;
    }
    if (superseded(fs, j)) {
      free(err);
      return;
    }
    bool again = transient(rc);
    char *why = ckpt__strdup_printf(
        "flush %s: %s%s", again ? "waiting" : "failed",
        err ? err : strerror(-rc),
        again ? "" : " (the tier copy is kept; the next mount retries)");
    if (again) {
      char *more = ckpt__strdup_printf("%s (retry in %.0f s)", why, backoff);
      free(why);
      why = more;
    }
    ckpt__log("tier: %s: %s", j->name, why ? why : "flush failed");
    free(err);
    set_why(fs, j, why);
    pthread_mutex_lock(&fs->lock);
    ckpt_ckpt_t *ck = tree_ckpt(fs, j->name, j->save_id);
    if (ck) /* counted again from the start */
      atomic_store(&ck->tier.done, 0);
    if (ck && !again) /* not retried by this mount: may be removed */
      atomic_store(&ck->tier.failed, true);
    pthread_mutex_unlock(&fs->lock);
    if (!again || !sleep_until(f, ckpt__mono_now() + backoff))
      return;
    backoff = backoff * 2 > BACKOFF_MAX ? BACKOFF_MAX : backoff * 2;
  }
}

static void *flush_main(void *arg) {
  ckpt_flush_t *f = arg;
  /* Low priority: the training's CPU and I/O first. */
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
  syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, 0,
          3 << 13 /* IOPRIO_CLASS_IDLE */);
  pthread_mutex_lock(&f->lock);
  for (;;) {
    while (!f->stop && !f->head)
      pthread_cond_wait(&f->cond, &f->lock);
    if (f->stop)
      break;
    flush_job_t *j = f->head;
    f->head = j->next;
    if (!f->head)
      f->tail = NULL;
    pthread_mutex_unlock(&f->lock);
    run_job(f, j);
    free(j);
    pthread_mutex_lock(&f->lock);
  }
  pthread_mutex_unlock(&f->lock);
  return NULL;
}

/* ------------------------------------------------------------------------
 * The thread's interface.
 * ---------------------------------------------------------------------- */

static void queue(ckpt_flush_t *f, const flush_job_t *tmpl) {
  flush_job_t *j = malloc(sizeof(*j));
  if (!j) {
    ckpt__log("tier: out of memory: %s is flushed by the next mount",
              tmpl->name);
    return;
  }
  *j = *tmpl;
  j->next = NULL;
  pthread_mutex_lock(&f->lock);
  if (f->tail)
    f->tail->next = j;
  else
    f->head = j;
  f->tail = j;
  pthread_cond_signal(&f->cond);
  pthread_mutex_unlock(&f->lock);
}

static void queue_record(ckpt_fs_t *fs, int dfd, const char *id, void *arg) {
  (void)fs;
  flush_job_t j;
  if (read_record(dfd, id, &j) == 0)
    queue(arg, &j);
}

int ckpt__flush_start(ckpt_fs_t *fs, ckpt_flush_t **out) {
  ckpt_flush_t *f = calloc(1, sizeof(*f));
  if (!f)
    return -ENOMEM;
  f->fs = fs;
  pthread_mutex_init(&f->lock, NULL);
  pthread_cond_init(&f->cond, NULL);
  each_record(fs, queue_record, f); /* left by earlier mounts */
  int rc = pthread_create(&f->thread, NULL, flush_main, f);
  f->started = rc == 0;
  if (rc) {
    ckpt__flush_stop(f);
    return -rc;
  }
  *out = f;
  return 0;
}

void ckpt__flush_add(ckpt_flush_t *f, const char *name, const char *save_id) {
  int dfd = open_records(f->fs, false);
  flush_job_t j;
  int rc = dfd < 0 ? dfd : read_record(dfd, save_id, &j);
  if (dfd >= 0)
    close(dfd);
  if (rc == 0 && !strcmp(j.name, name))
    queue(f, &j);
  else
    ckpt__log("tier: %s: no flush record %s (%s): not flushed", name,
              save_id, strerror(rc ? -rc : ESTALE));
}

void ckpt__flush_stop(ckpt_flush_t *f) {
  if (!f)
    return;
  pthread_mutex_lock(&f->lock);
  f->stop = true;
  pthread_cond_broadcast(&f->cond);
  pthread_mutex_unlock(&f->lock);
  if (f->started)
    pthread_join(f->thread, NULL);
  for (flush_job_t *j = f->head, *nx; j; j = nx) {
    nx = j->next;
    free(j);
  }
  pthread_cond_destroy(&f->cond);
  pthread_mutex_destroy(&f->lock);
  free(f);
}

int ckpt__flush_drop(ckpt_fs_t *fs, const char *name, const char *save_id) {
  char id[CKPT_SAVE_ID_LEN + 1];
  pthread_mutex_lock(&fs->tier_publish);
  int rc = save_id_of(fs->tier_fd, name, id);
  if (rc == 0 && strcmp(id, save_id))
    rc = -ESTALE; /* another save of the name now: not ours to remove */
  if (rc == 0)
    rc = ckpt__checkpoint_remove(fs->tier_fd, name, false);
  if (rc == 0 || rc == -ENOENT || rc == -ESTALE)
    ckpt__flush_unrecord(fs, save_id);
  pthread_mutex_unlock(&fs->tier_publish);
  if (rc == 0)
    ckpt__log("tier: %s: removed from the tier, its flush failed: never "
              "published", name);
  return rc == -ENOENT || rc == -ESTALE ? 0 : rc;
}

bool ckpt__flush_unflushed(ckpt_fs_t *fs, const char *save_id) {
  return fs->tier_fd >= 0 && has_record(fs, save_id);
}

uint64_t ckpt__flush_bytes(int dirfd) {
  int lfd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
  if (!d) {
    if (lfd >= 0)
      close(lfd);
    return 0;
  }
  uint64_t sum = 0;
  struct dirent *e;
  struct stat st;
  int32_t rank;
  uint32_t k;
  while ((e = readdir(d)) != NULL)
    if (data_file(e->d_name, &rank, &k) &&
        fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode))
      sum += (uint64_t)st.st_size;
  closedir(d);
  return sum;
}
