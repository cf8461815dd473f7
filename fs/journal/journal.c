/*
 * journal.c - the tier's journal: TIER/.flush/SAVE_ID.R exists while rank
 * R's files of that save are in the tier and not yet in BACKING_DIR
 * (flush.c's head tells the record's life), and the node's lock on its
 * tier. What reads it: the resolver (is the tier copy unflushed?), the
 * loader, the flusher and the commit that writes the records.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "catalog.h"
#include "journal.h"

/* The directory of records, opened beneath the tier (created first when
 * create): fd or -errno. */
int ckpt__journal_open(ckpt_fs_t *fs, bool create) {
  if (create && mkdirat(fs->tier_fd, CKPT_FLUSH_DIR, 0700) == 0 &&
      fsync(fs->tier_fd))
    return -errno;
  return ckpt_open_beneath(fs->tier_fd, CKPT_FLUSH_DIR,
                           O_RDONLY | O_DIRECTORY, 0);
}

/* The name of rank's record of save_id. */
void ckpt__journal_name(const char *save_id, int rank, char *out, size_t n) {
  snprintf(out, n, "%s.%d", save_id, rank);
}

/* Split a record's name: SAVE_ID.R, or SAVE_ID (an older mount's: rank
 * 0). false when it is no record's. */
bool ckpt__journal_parse_name(const char *rec,
                              char id[CKPT_SAVE_ID_LEN + 1], int *rank) {
  size_t len = strlen(rec);
  if (len < CKPT_SAVE_ID_LEN)
    return false;
  snprintf(id, CKPT_SAVE_ID_LEN + 1, "%.*s", CKPT_SAVE_ID_LEN, rec);
  if (!ckpt_save_id_valid(id))
    return false;
  const char *tail = rec + CKPT_SAVE_ID_LEN;
  if (!*tail) {
    *rank = 0;
    return true;
  }
  char *end;
  long r = tail[0] == '.' && tail[1] >= '0' && tail[1] <= '9'
               ? strtol(tail + 1, &end, 10)
               : -1;
  if (r < 0 || r > INT_MAX || *end)
    return false;
  *rank = (int)r;
  return true;
}

/* Is rec a record of save_id? */
bool ckpt__journal_of(const char *rec, const char *save_id) {
  char id[CKPT_SAVE_ID_LEN + 1];
  int rank;
  return ckpt__journal_parse_name(rec, id, &rank) && !strcmp(id, save_id);
}

int ckpt__flush_record(ckpt_fs_t *fs, const char *save_id, int rank,
                       const char *name, bool replace, bool remote,
                       const char *partner_host, char **err) {
  /* a host that is unknown or cannot be written: a node no world has, so
   * the copies are flushed from here at once (flush.c) */
  if (partner_host && (!partner_host[0] || strchr(partner_host, '\n')))
    partner_host = "?";
  char rec[CKPT_SAVE_ID_LEN + 16];
  ckpt__journal_name(save_id, rank, rec, sizeof(rec));
  int dfd = ckpt__journal_open(fs, true);
  int fd = dfd < 0 ? dfd
                   : openat(dfd, rec,
                            O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  int rc = dfd < 0 ? dfd : fd < 0 ? -errno : 0;
  if (rc == 0 && dprintf(fd, "name %s\nreplace %d\nbacking %s\n%s%s%s%s",
                         name, replace, fs->backing_path,
                         remote ? CKPT_REC_REMOTE : "", partner_host ? CKPT_REC_PARTNER : "",
                         partner_host ? partner_host : "",
                         partner_host ? "\n" : "") < 0)
    rc = -errno;
  if (rc == 0 && (fsync(fd) || fsync(dfd)))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (rc && fd >= 0)
    unlinkat(dfd, rec, 0);
  if (dfd >= 0)
    close(dfd);
  if (rc)
    *err = ckpt__strdup_printf("writing %s/%s/%s: %s", fs->tier_path,
                               CKPT_FLUSH_DIR, rec, strerror(-rc));
  return rc;
}

/* Remove record rec. */
void ckpt__journal_remove(ckpt_fs_t *fs, const char *rec) {
  int dfd = ckpt__journal_open(fs, false);
  if (dfd < 0)
    return;
  if (unlinkat(dfd, rec, 0) == 0)
    fsync(dfd);
  close(dfd);
}

void ckpt__flush_unrecord(ckpt_fs_t *fs, const char *save_id, int rank) {
  char rec[CKPT_SAVE_ID_LEN + 16];
  ckpt__journal_name(save_id, rank, rec, sizeof(rec));
  ckpt__journal_remove(fs, rec);
}

int ckpt__tier_lock(ckpt_fs_t *fs) {
  int dfd = ckpt__journal_open(fs, true);
  int fd = dfd < 0 ? dfd
                   : openat(dfd, ".lock", O_RDONLY | O_CREAT | O_CLOEXEC |
                                              O_NOFOLLOW, 0600);
  int rc = dfd < 0 ? dfd : fd < 0 ? -errno : 0;
  if (dfd >= 0)
    close(dfd);
  while (rc == 0 && flock(fd, LOCK_EX))
    if (errno != EINTR) {
      rc = -errno;
      close(fd);
    }
  return rc ? rc : fd;
}

void ckpt__tier_unlock(int fd) {
  if (fd >= 0)
    close(fd); /* lets go of the flock */
}

/* Records of save_id in .flush (dfd): 1 some, 0 none, -errno unknown. */
int ckpt__journal_any(int dfd, const char *save_id) {
  if (dfd == -ENOENT) /* no .flush: no records */
    return 0;
  if (dfd < 0)
    return dfd;
  DIR *d = ckpt_opendir_at(dfd);
  if (!d)
    return -errno;
  int found = 0;
  struct dirent *e;
  errno = 0;
  while (!found && (e = readdir(d)) != NULL)
    found = ckpt__journal_of(e->d_name, save_id);
  if (!found && errno)
    found = -errno;
  closedir(d);
  return found;
}

/* Does a record name save_id (of any rank), or may one (the records
 * cannot be read now: EMFILE, EIO)? Unknown counts as unflushed, so that
 * nothing is removed on a failed look. */
static bool has_record(ckpt_fs_t *fs, const char *save_id) {
  int dfd = ckpt__journal_open(fs, false);
  bool has = save_id[0] && ckpt__journal_any(dfd, save_id) != 0;
  if (dfd >= 0)
    close(dfd);
  return has;
}

/* Is there positively no record of save_id (not: one unknown)? */
bool ckpt__journal_none(int dfd, const char *save_id) {
  return ckpt__journal_any(dfd, save_id) == 0;
}

bool ckpt__flush_unflushed(ckpt_fs_t *fs, const char *save_id) {
  return fs->tier_fd >= 0 && has_record(fs, save_id);
}

uint64_t ckpt__flush_bytes(int dirfd, int only) {
  DIR *d = ckpt_opendir_at(dirfd);
  if (!d)
    return 0;
  uint64_t sum = 0;
  struct dirent *e;
  struct stat st;
  int32_t rank;
  uint32_t k;
  while ((e = readdir(d)) != NULL)
    if (ckpt__data_file_name(e->d_name, &rank, &k) && (only < 0 || rank == only) &&
        fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode))
      sum += (uint64_t)st.st_size;
  closedir(d);
  return sum;
}

/* Is name a data file __R_K.distcp? Its R and K. */
bool ckpt__data_file_name(const char *name, int32_t *rank, uint32_t *k) {
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
