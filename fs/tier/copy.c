/*
 * copy.c - the flush's verified copy of a tier checkpoint into BACKING_DIR:\n * data files into O_TMPFILEs of BACKING_DIR/.staging under the token\n * bucket of flush_rate, fsynced, every chunk's XXH3 checked, then linked\n * into the save's directory; the .metadata likewise.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "failpoint.h"
#include "tier_int.h"

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
ckpt_ckpt_t *ckpt__tier_tree_ckpt(ckpt_fs_t *fs, const char *name,
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
void ckpt__tier_set_why(ckpt_fs_t *fs, const flush_job_t *j, char *why) {
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = ckpt__tier_tree_ckpt(fs, j->name, j->save_id);
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
  if (j->partner)
    return; /* another rank's bytes: not in this rank's total */
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = ckpt__tier_tree_ckpt(fs, j->name, j->save_id);
  if (ck)
    atomic_fetch_add(&ck->tier.done, n);
  pthread_mutex_unlock(&fs->lock);
}

/* The flush begins (on) or ended (off) a write or fsync on BACKING_DIR:
 * .status tells a store that stopped answering (tier_lines in ops.c). */
static void store_busy(ckpt_fs_t *fs, const flush_job_t *j, bool on) {
  uint64_t now = ckpt__mono_ns();
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = ckpt__tier_tree_ckpt(fs, j->name, j->save_id);
  if (ck)
    atomic_store(&ck->tier.busy_since, on ? now : 0);
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

/* Copy fd in to fd out, [0, size), under the token bucket. *writing:
 * whether the write (BACKING_DIR's side) failed, else the read. */
static int copy_bytes(ckpt_flush_t *f, const flush_job_t *j, int in, int out,
                      uint64_t size, bool count, bool *writing) {
  size_t step = FLUSH_STEP;
  if (f->fs->opts.flush_rate && f->fs->opts.flush_rate / 4 < step)
    step = f->fs->opts.flush_rate / 4 ? (size_t)(f->fs->opts.flush_rate / 4)
                                      : 4096; /* smooth at low rates */
  *writing = false;
  char *buf = malloc(step);
  if (!buf)
    return -ENOMEM;
  int rc = 0;
  for (uint64_t off = 0; rc == 0 && off < size; off += step) {
    size_t n = size - off < step ? (size_t)(size - off) : step;
    if (!take_tokens(f, n))
      rc = -ECANCELED;
    else if ((rc = ckpt__pread_full(in, buf, n, off)) == 0) {
      store_busy(f->fs, j, true);
      if ((errno = 0, pwrite(out, buf, n, (off_t)off)) != (ssize_t)n)
        rc = errno ? -errno : -ENOSPC; /* short: the store is full */
      *writing = rc != 0;
      store_busy(f->fs, j, false);
    }
    if (rc == 0 && count)
      count_done(f->fs, j, n);
  }
  free(buf);
  return rc;
}

/* Tries of staging_file, and its first pause (doubled at each). */
#define STAGING_TRIES 4
#define STAGING_PAUSE 0.02

/* An unnamed file in BACKING_DIR/.staging for the copy of file: fd, or
 * -errno with *err. The other mounts on BACKING_DIR (this node's ranks,
 * other nodes) remove .staging whenever it is empty (ckpt__staging_tidy),
 * so that it may go between ckpt__staging_tmpfile's open of it and of the
 * file: ENOENT (ELOOP from ckpt__staging_dir once it lost that race each
 * time), tried again after a short pause; still lost: -EAGAIN, a race
 * that the job retries later in this mount (transient). */
static int staging_file(ckpt_flush_t *f, const flush_job_t *j,
                        const char *file, char **err) {
  ckpt_fs_t *fs = f->fs;
  int fd = -ENOENT;
  double pause = STAGING_PAUSE;
  for (int t = 0; t < STAGING_TRIES; t++, pause *= 2) {
    if (t && !sleep_until(f, ckpt__mono_now() + pause))
      return -ECANCELED; /* unmount: the record resumes it */
    fd = ckpt__staging_tmpfile(fs->backing_fd);
    if (fd >= 0 || (fd != -ENOENT && fd != -ELOOP))
      break;
  }
  if (fd >= 0)
    return fd;
  struct stat st;
  bool alive = fstat(fs->backing_fd, &st) == 0 && st.st_nlink > 0;
  bool raced = alive && (fd == -ENOENT || fd == -ELOOP);
  *err = ckpt__strdup_printf(
      "creating the copy of %s/%s in %s/%s: %s%s", j->name, file,
      fs->backing_path, CKPT_STAGING_DIR, strerror(-fd),
      raced ? " (the directory removed by another mount each time: "
              "retried)"
            : !alive ? " (BACKING_DIR removed)" : "");
  return raced ? -EAGAIN : fd;
}

static bool copied_already(ckpt_flush_t *f, const ckpt_metadata_t *m,
                           int held, const char *name, int32_t rank,
                           uint32_t k, off_t size);

/* Link the O_TMPFILE fd (a verified copy of data file (rank, k), size
 * bytes) as dirfd/name. A file that another flusher linked meanwhile (the
 * owner's and a partner's copies racing) is a verified copy too: kept,
 * and both count as done. Else a file already there is not a complete
 * copy (copy_file checked it): replaced. -EAGAIN when another flusher
 * linked one each time (racing: retried later). */
int ckpt__tier_link_tmpfile(ckpt_flush_t *f, const ckpt_metadata_t *m, int fd,
                        int dirfd, const char *name, int32_t rank,
                        uint32_t k, off_t size) {
  char from[64];
  snprintf(from, sizeof(from), "/proc/self/fd/%d", fd);
  for (int tries = 0; tries < 3; tries++) {
    if (linkat(AT_FDCWD, from, dirfd, name, AT_SYMLINK_FOLLOW) == 0)
      return 0;
    if (errno != EEXIST)
      return -errno;
    if (copied_already(f, m, dirfd, name, rank, k, size))
      return 0; /* another flusher's */
    if (unlinkat(dirfd, name, 0) && errno != ENOENT)
      return -errno;
  }
  return -EAGAIN;
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

/* Copy data file name (rank, k) of the tier's src into held, verified.
 * Every failure says its step in *err. */
static int copy_file(ckpt_flush_t *f, const flush_job_t *j,
                     const ckpt_metadata_t *m, int src, int held,
                     const char *name, int32_t rank, uint32_t k,
                     char **err) {
  ckpt_fs_t *fs = f->fs;
  struct stat st;
  const char *step = "opening the tier's copy of";
  int in = ckpt_store_open_file(src, name), out = -1;
  int rc = in < 0 ? in : 0;
  if (rc == 0 && fstat(in, &st)) {
    rc = -errno;
    step = "reading the tier's copy of";
  }
  if (rc == 0 &&
      copied_already(f, m, held, name, rank, k, st.st_size)) {
    count_done(fs, j, (uint64_t)st.st_size); /* linked by an earlier run */
    close(in);
    return 0;
  }
  if (rc == 0 && (out = staging_file(f, j, name, err)) < 0) {
    rc = out;
    step = NULL; /* *err says it */
  }
  if (rc == 0 && (rc = ckpt_failpoint_error("flush_copy")) != 0)
    step = "copying (failpoint flush_copy)";
  bool writing = false;
  if (rc == 0 &&
      (rc = copy_bytes(f, j, in, out, (uint64_t)st.st_size, true,
                       &writing)) != 0)
    step = writing ? "writing the copy (in BACKING_DIR/.staging) of"
                   : "reading the tier's copy of";
  if (rc == 0)
    ckpt_failpoint("flush_copy");
  if (rc == 0 && fs->opts.sync_files) {
    store_busy(fs, j, true);
    if (fsync(out)) {
      rc = -errno;
      step = "syncing the copy (in BACKING_DIR/.staging) of";
    }
    store_busy(fs, j, false);
  }
  char what[600];
  snprintf(what, sizeof(what), "%s/%s", j->name, name);
  if (rc == 0 && (rc = verify_copy(f, m, rank, k, out, what)) != 0)
    step = "verifying the copy against the .metadata of";
  if (rc == 0 &&
      (rc = ckpt__tier_link_tmpfile(f, m, out, held, name, rank, k, st.st_size)) != 0)
    step = rc == -EAGAIN ? "linking the copy (another flusher's linked "
                           "each time: retried) of"
                         : "linking the copy into BACKING_DIR/" CKPT_SAVES_DIR
                           "/SAVE_ID of";
  if (rc && step && !*err)
    *err = ckpt__strdup_printf("%s %s (to %s/%s/%s): %s", step, what,
                               fs->backing_path, CKPT_SAVES_DIR, j->save_id,
                               strerror(-rc));
  if (out >= 0)
    close(out);
  if (in >= 0)
    close(in);
  return rc;
}

/* Copy src/.metadata to held/.metadata: through .metadata.tmp.R, synced,
 * then linked (flushers of other ranks do the same with the same bytes:
 * the first link stays). Every failure says its step in *err. */
int ckpt__tier_copy_metadata(ckpt_flush_t *f, const flush_job_t *j, int src,
                         int held, char **err) {
  struct stat st;
  char tmp[64];
  snprintf(tmp, sizeof(tmp), "%s.%d", CKPT_METADATA_TMP, j->rank);
  unlinkat(held, tmp, 0); /* of a run killed before its link */
  if (fstatat(held, CKPT_METADATA_FILE, &st, AT_SYMLINK_NOFOLLOW) == 0)
    return 0; /* linked by another rank's flusher */
  const char *step = "opening the tier's";
  int in = ckpt_store_open_file(src, CKPT_METADATA_FILE), out = -1;
  int rc = in < 0 ? in : 0;
  if (rc == 0 && fstat(in, &st)) {
    rc = -errno;
    step = "reading the tier's";
  }
  if (rc == 0 &&
      (out = openat(held, tmp,
                    O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                    0600)) < 0) {
    rc = -errno;
    step = "creating the copy (" CKPT_METADATA_TMP ".R) of";
  }
  /* the mode the commit gave it in the tier */
  if (rc == 0 && fchmod(out, st.st_mode & 0777)) {
    rc = -errno;
    step = "setting the mode of the copy of";
  }
  /* not counted in .status's flush bytes (data files only) */
  bool writing = false;
  if (rc == 0 &&
      (rc = copy_bytes(f, j, in, out, (uint64_t)st.st_size, false,
                       &writing)) != 0)
    step = writing ? "writing the copy of" : "reading the tier's";
  if (rc == 0 && f->fs->opts.sync_files && fsync(out)) {
    rc = -errno;
    step = "syncing the copy of";
  }
  if (out >= 0)
    close(out);
  if (in >= 0)
    close(in);
  if (rc == 0 && linkat(held, tmp, held, CKPT_METADATA_FILE, 0) &&
      errno != EEXIST) {
    rc = -errno;
    step = "linking the copy of";
  }
  unlinkat(held, tmp, 0);
  if (rc == 0 && f->fs->opts.sync_files && fsync(held)) {
    rc = -errno;
    step = "syncing the directory of the copy of";
  }
  if (rc && !*err)
    *err = ckpt__strdup_printf("%s %s/%s (to %s/%s/%s): %s", step, j->name,
                               CKPT_METADATA_FILE, f->fs->backing_path,
                               CKPT_SAVES_DIR, j->save_id, strerror(-rc));
  return rc;
}

/* Copy every data file of j's rank in src into held. A file of another
 * rank in src is either that rank's (its own mount flushes it) or a
 * partner copy (level partner), which its partner record's job copies
 * only when the owner's node cannot (ckpt__tier_partner_turn). *staged: a file was
 * made in BACKING_DIR/.staging (to be tidied). */
int ckpt__tier_copy_data(ckpt_flush_t *f, const flush_job_t *j,
                     const ckpt_metadata_t *m, int src, int held,
                     bool *staged, char **err) {
  DIR *d = ckpt_opendir_at(src);
  if (!d) {
    int e = errno;
    *err = ckpt__strdup_printf("listing the tier's copy of %s: %s",
                               j->name, strerror(e));
    return -e;
  }
  int rc = 0;
  struct dirent *e;
  int32_t rank;
  uint32_t k;
  while (rc == 0 && (e = readdir(d)) != NULL)
    if (ckpt__data_file_name(e->d_name, &rank, &k) && rank == j->rank) {
      *staged = true;
      rc = copy_file(f, j, m, src, held, e->d_name, rank, k, err);
    }
  closedir(d);
  return rc;
}
