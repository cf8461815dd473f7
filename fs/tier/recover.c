/*
 * recover.c - the flush records left by earlier mounts: read, checked at\n * mount (ckpt__flush_check), recovered (ckpt__flush_recover) and queued.
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
 * Records.
 * ---------------------------------------------------------------------- */

/* Read record rec: its save, rank, name, replace flag, BACKING_DIR and
 * publishing mark. 0, -EINVAL when torn or malformed, -EPERM when it is
 * not a regular file of the daemon's user (planted: never trusted, even
 * in a tier checked private at mount), -errno. */
int ckpt__tier_read_record(int dfd, const char *rec, flush_job_t *j) {
  char save_id[CKPT_SAVE_ID_LEN + 1];
  int rank;
  if (!ckpt__journal_parse_name(rec, save_id, &rank))
    return -EINVAL;
  int fd = openat(dfd, rec, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0)
    return -errno;
  struct stat st;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & S_IWOTH)) {
    close(fd);
    return -EPERM;
  }
  char buf[PATH_MAX + 400 + CKPT_DIST_HOST_MAX];
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
  j->remote = !strncmp(buf + used, CKPT_REC_REMOTE, strlen(CKPT_REC_REMOTE));
  if (j->remote)
    used += (int)strlen(CKPT_REC_REMOTE);
  j->partner = !strncmp(buf + used, CKPT_REC_PARTNER, strlen(CKPT_REC_PARTNER));
  if (j->partner) {
    const char *h = buf + used + strlen(CKPT_REC_PARTNER), *nl = strchr(h, '\n');
    if (!nl || nl == h || nl - h >= CKPT_DIST_HOST_MAX)
      return -EINVAL;
    snprintf(j->host, sizeof(j->host), "%.*s", (int)(nl - h), h);
    used = (int)(nl + 1 - buf);
  }
  j->publishing = !strcmp(buf + used, CKPT_REC_PUBLISHING);
  if (!j->publishing && buf[used])
    return -EINVAL;
  j->replace = replace == 1;
  snprintf(j->save_id, sizeof(j->save_id), "%s", save_id);
  snprintf(j->rec, sizeof(j->rec), "%s", rec);
  j->rank = rank;
  j->held = -1;
  return 0;
}

/* Is this mount its node's lowest rank in the current world? */
static bool node_lowest(const ckpt_fs_t *fs) {
  int node = ckpt_dist_node_of(fs->dist, fs->rank);
  for (int r = 0; r < fs->rank; r++)
    if (ckpt_dist_node_of(fs->dist, r) == node)
      return false;
  return true;
}

/* Is record rank (partner: a partner record) this mount's to flush? Its
 * own rank's; and a rank that is not on this node in the current world
 * (a world started again with fewer ranks, or other nodes) and every
 * partner record: the node's lowest rank's. */
bool ckpt__tier_mine(const ckpt_fs_t *fs, int rank, bool partner) {
  if (fs->world_size <= 1)
    return true;
  if (!fs->dist)
    return rank == fs->rank && !partner;
  if (partner)
    return node_lowest(fs);
  if (rank == fs->rank)
    return true;
  int node = ckpt_dist_node_of(fs->dist, fs->rank);
  if (rank < fs->world_size && ckpt_dist_node_of(fs->dist, rank) == node)
    return false; /* that rank's own mount */
  return node_lowest(fs); /* a lower rank of this node adopts it */
}

/* The save ID of root/name: 0, -ENOENT (no such checkpoint or no
 * .metadata: out ""), or another -errno (out "": unknown). */
int ckpt__tier_save_id_of(int root_fd, const char *name,
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
void ckpt__tier_save_id_at(int root_fd, const char *name,
                       char out[CKPT_SAVE_ID_LEN + 1]) {
  (void)ckpt__tier_save_id_of(root_fd, name, out);
}

/* Call fn for each record of the tier. */
void ckpt__tier_each_record(ckpt_fs_t *fs,
                        void (*fn)(ckpt_fs_t *fs, int dfd, const char *id,
                                   void *arg),
                        void *arg) {
  int dfd = ckpt__journal_open(fs, false);
  if (dfd < 0)
    return;
  DIR *d = ckpt_opendir_at(dfd);
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
bool ckpt__tier_saves_dir_exists(int root_fd, const char *save_id) {
  char path[CKPT_SAVE_ID_LEN + 16];
  struct stat st;
  snprintf(path, sizeof(path), "%s/%s", CKPT_SAVES_DIR, save_id);
  return fstatat(root_fd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 ||
         errno != ENOENT; /* unknown: keep the record */
}

void ckpt__tier_recover_record(ckpt_fs_t *fs, int dfd, const char *id,
                           void *arg) {
  (void)arg;
  flush_job_t j;
  char tier_id[CKPT_SAVE_ID_LEN + 1], shared_id[CKPT_SAVE_ID_LEN + 1];
  const char *why = NULL;
  int rc = ckpt__tier_read_record(dfd, id, &j), trc = 0;
  const char *sid = j.save_id;
  if (rc == -EINVAL) {
    why = "torn or malformed (its save was never published)";
  } else if (rc == -EPERM) {
    ckpt__log("tier: flush record %s is not a file of the daemon's user: "
              "ignored, left where it is", id);
  } else if (rc) {
    /* EMFILE, EIO...: proves nothing; kept for the next mount */
    ckpt__log("tier: flush record %s unreadable (%s): kept", id,
              strerror(-rc));
  } else {
    trc = ckpt__tier_save_id_of(fs->tier_fd, j.name, tier_id);
    ckpt__tier_save_id_at(fs->backing_fd, j.name, shared_id);
    if (!strcmp(shared_id, sid))
      why = "flushed already";
    else if (trc && trc != -ENOENT)
      ckpt__log("tier: flush record %s: %s/%s unreadable (%s): kept", id,
                fs->tier_path, j.name, strerror(-trc));
    else if (strcmp(tier_id, sid) &&
             ckpt_store_save_dir_held(fs->tier_fd, sid))
      /* a save of another rank of this node under way (a solo save while
       * this mount starts): not ours to judge */
      ckpt__log("tier: flush record %s: its save is being written: kept",
                id);
    else if (strcmp(tier_id, sid) &&
             (!j.remote || !ckpt__tier_saves_dir_exists(fs->tier_fd, sid)))
      /* In the coordinator's tier its publish there is the commit point:
       * never committed. In another node's tier, with its files still in
       * TIER/.saves/SAVE_ID, this node's publish may be all that never
       * happened: the record flushes them once the commit is known. */
      why = "its save was never published in the tier";
    else if (j.publishing && !ckpt__tier_saves_dir_exists(fs->backing_fd, sid))
      /* Published and removed there since, or removed by another
       * mount's cleanup of unfinished saves before the publish: the two
       * cannot be told apart, and the tier's copy may be the only one.
       * Kept: the flush copies it again and publishes it without
       * replacing anything (ckpt__tier_flush_one). */
      ckpt__log("tier: flush record %s (%s): marked publishing, but "
                "neither %s/%s nor %s/%s/%s is this save (published and "
                "removed there since, or removed by another mount before "
                "the publish): kept, flushed again without replacing",
                id, j.name, fs->backing_path, j.name, fs->backing_path,
                CKPT_SAVES_DIR, sid);
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
  if (!o->found && ckpt__tier_read_record(dfd, id, &j) == 0 &&
      strcmp(j.backing, o->backing))
    o->found = ckpt__strdup_printf("%s (checkpoint %s)", j.backing, j.name);
}

int ckpt__flush_check(ckpt_fs_t *fs, const char *backing, char **err) {
  other_t o = {.backing = backing};
  ckpt__tier_each_record(fs, other_backing, &o);
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

void ckpt__flush_recover(ckpt_fs_t *fs) {
  ckpt__tier_each_record(fs, ckpt__tier_recover_record, NULL);
  char **names;
  size_t n;
  int dfd = ckpt__journal_open(fs, false);
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
  /* the node's other mounts (ranks) flush and remove meanwhile */
  int lock = ckpt__tier_lock(fs);
  for (size_t i = 0; i < n; i++) {
    char id[CKPT_SAVE_ID_LEN + 1];
    if (!ckpt_store_committed(fs->tier_fd, names[i], NULL))
      continue; /* unfinished: ckpt_store_cleanup's */
    if (ckpt__tier_save_id_of(fs->tier_fd, names[i], id) || !ckpt__journal_none(dfd, id))
      continue; /* unknown: kept */
    char shared[CKPT_SAVE_ID_LEN + 1];
    if (fs->opts.tier_keep && ckpt__tier_save_id_of(fs->backing_fd, names[i], shared) == 0 &&
        !strcmp(shared, id))
      continue; /* flushed, kept by tier_keep (its turn comes below) */
    /* Flushed (its copy is BACKING_DIR's now) or removed there by a
     * user: either way not to be published again. */
    ckpt__log("tier: removing %s (flushed, or removed from %s)", names[i],
              fs->backing_path);
    ckpt__checkpoint_remove(fs->tier_fd, names[i], false);
  }
  ckpt__tier_unlock(lock);
  ckpt__catalog_names_free(names, n);
  if (dfd >= 0)
    close(dfd);
  if (fs->opts.tier_keep)
    ckpt__tier_retain(fs);
}
