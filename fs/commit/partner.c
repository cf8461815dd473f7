/*
 * partner.c - partner copies of a save (-o tier_level=partner): the files
 * side of dist's exchange (dist/partner.c makes every MPI call).
 *
 * A rank sends its own data files of the save, __RANK_K.distcp as
 * write_step left them in TIER/.saves/SAVE_ID; its partner rank, on the
 * next node, writes them into its own tier's TIER/.saves/SAVE_ID under the
 * same names and syncs them before its RESULT. That directory becomes
 * TIER/NAME on that node when the checkpoint is published there, so the
 * node's tier holds its own ranks' files and the copies it keeps for the
 * ranks of the previous node. A save that fails removes the copies it
 * received (discard_step), partial ones too.
 *
 * With the first file of each owner rank R, the receiving rank writes a
 * flush record TIER/.flush/SAVE_ID.R marked "partner HOST" (the owner's
 * host), fsynced, so before its RESULT: those copies are flushed from
 * here only if the owner's node cannot (fs/tier/flush.c). R is another node's
 * rank, so its own record is in another tier: no clash. A failed save
 * removes these records with the copies.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "failpoint.h"
#include "commit.h"

/* The copies a save received, by name: removed if the save fails. */
struct ckpt_partner_rx {
  uint32_t n, cap;
  char (*names)[CKPT_DIST_FILE_NAME_MAX];
  uint32_t n_owners, cap_owners;
  int *owners; /* whose flush record this save wrote */
};

int ckpt__partner_files(void *ctx, ckpt_dist_job_t *job, int partner,
                        ckpt_dist_file_t **files, uint32_t *n, char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_view_t v;
  ckpt__save_view(job, &v);
  if (partner < 0) {
    *err = ckpt__strdup_printf(
        "rank %d: tier_level=partner: the %d rank(s) of this world are all "
        "on one node, and a partner copy must be on another node: start the "
        "world on two nodes or more, or mount with tier_level=local",
        v.rank, fs->world_size);
    return -EINVAL;
  }
  ckpt_dist_file_t *f = calloc(v.n_files ? v.n_files : 1, sizeof(*f));
  if (!f)
    return -ENOMEM;
  for (uint32_t k = 0; k < v.n_files; k++) {
    ckpt_data_file_name(v.rank, k, f[k].name, sizeof(f[k].name));
    f[k].size = v.file_bytes[k];
    f[k].fd = ckpt_open_beneath(v.dirfd, f[k].name, O_RDONLY | O_CLOEXEC, 0);
    if (f[k].fd < 0) {
      int rc = f[k].fd;
      *err = ckpt__strdup_printf("rank %d: partner copies: opening %s/%s/%s/"
                                 "%s: %s", v.rank, fs->commit_path,
                                 CKPT_SAVES_DIR, v.save_id, f[k].name,
                                 strerror(-rc));
      while (k-- > 0)
        close(f[k].fd);
      free(f);
      return rc;
    }
  }
  *files = f;
  *n = v.n_files;
  return 0;
}

/* Is name a data file of rank owner (__OWNER_K.distcp)? */
static bool owners_file(const char *name, int owner) {
  int r, used = 0;
  unsigned k;
  char back[CKPT_DIST_FILE_NAME_MAX];
  if (sscanf(name, "__%d_%u.distcp%n", &r, &k, &used) != 2 ||
      name[used] != '\0' || r != owner)
    return false;
  ckpt_data_file_name(r, k, back, sizeof(back));
  return strcmp(back, name) == 0;
}

static int remember(ckpt_partner_rx_t **rxp, const char *name) {
  ckpt_partner_rx_t *rx = *rxp;
  if (!rx && !(rx = *rxp = calloc(1, sizeof(*rx))))
    return -ENOMEM;
  if (rx->n == rx->cap) {
    uint32_t cap = rx->cap ? 2 * rx->cap : 8;
    void *p = realloc(rx->names, cap * sizeof(*rx->names));
    if (!p)
      return -ENOMEM;
    rx->names = p;
    rx->cap = cap;
  }
  snprintf(rx->names[rx->n++], sizeof(rx->names[0]), "%s", name);
  return 0;
}

/* The flush record of owner's copies, once per owner and save. */
static int record_owner(ckpt_fs_t *fs, const ckpt_save_view_t *v, int owner,
                        char **err) {
  ckpt_partner_rx_t *rx = *v->rx;
  for (uint32_t i = 0; rx && i < rx->n_owners; i++)
    if (rx->owners[i] == owner)
      return 0;
  if (!rx && !(rx = *v->rx = calloc(1, sizeof(*rx))))
    return -ENOMEM;
  if (rx->n_owners == rx->cap_owners) {
    uint32_t cap = rx->cap_owners ? 2 * rx->cap_owners : 4;
    void *p = realloc(rx->owners, cap * sizeof(*rx->owners));
    if (!p)
      return -ENOMEM;
    rx->owners = p;
    rx->cap_owners = cap;
  }
  int rc = ckpt__flush_record(fs, v->save_id, owner, v->name, v->replace,
                              v->remote,
                              ckpt_dist_node_name(fs->dist, owner), err);
  if (rc == 0)
    rx->owners[rx->n_owners++] = owner;
  return rc;
}

int ckpt__partner_open(void *ctx, ckpt_dist_job_t *job, int owner,
                       const char *name, uint64_t size, char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_view_t v;
  ckpt__save_view(job, &v);
  if (!owners_file(name, owner)) {
    *err = ckpt__strdup_printf("rank %d: rank %d sent a file named '%s', "
                               "not one of its data files", v.rank, owner,
                               name);
    return -EPROTO;
  }
  int rc = record_owner(fs, &v, owner, err);
  if (rc)
    return rc;
  rc = ckpt_failpoint_error("partner_open");
  int fd = rc ? rc
              : ckpt_open_beneath(v.dirfd, name,
                                  O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
                                  0600);
  /* Only a file made here is ours to remove again. */
  if (fd >= 0 && (rc = remember(v.rx, name)) != 0) {
    close(fd);
    unlinkat(v.dirfd, name, 0);
    fd = rc;
  }
  /* All of its room now: a full tier fails here, not midway. */
  if (fd >= 0 && size > 0 && fallocate(fd, 0, 0, (off_t)size) &&
      errno != EOPNOTSUPP && errno != ENOSYS) {
    rc = -errno;
    close(fd);
    fd = rc;
  }
  if (fd < 0)
    *err = ckpt__strdup_printf("writing its copy into %s/%s/%s/%s: %s",
                               fs->commit_path, CKPT_SAVES_DIR, v.save_id,
                               name, strerror(-fd));
  return fd;
}

int ckpt__partner_close(void *ctx, ckpt_dist_job_t *job, int fd, bool ok,
                        char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_view_t v;
  ckpt__save_view(job, &v);
  /* The file and its name in the save's directory, durable before this
   * rank reports its part done. */
  int rc = 0;
  if (ok && fs->opts.sync_files && (fsync(fd) || fsync(v.dirfd)))
    rc = -errno;
  if (close(fd) && ok && rc == 0)
    rc = -errno;
  if (rc)
    *err = ckpt__strdup_printf("syncing its copy in %s/%s/%s: %s",
                               fs->commit_path, CKPT_SAVES_DIR, v.save_id,
                               strerror(-rc));
  else if (ok)
    ckpt_failpoint("partner_synced");
  return rc;
}

void ckpt__partner_discard(ckpt_fs_t *fs, ckpt_partner_rx_t **rxp, int dirfd,
                           const char *save_id) {
  ckpt_partner_rx_t *rx = *rxp;
  for (uint32_t i = 0; rx && dirfd >= 0 && i < rx->n; i++)
    unlinkat(dirfd, rx->names[i], 0);
  for (uint32_t i = 0; rx && i < rx->n_owners; i++)
    ckpt__flush_unrecord(fs, save_id, rx->owners[i]);
  ckpt__partner_rx_free(rx);
  *rxp = NULL;
}

void ckpt__partner_rx_free(ckpt_partner_rx_t *rx) {
  if (!rx)
    return;
  free(rx->names);
  free(rx->owners);
  free(rx);
}
