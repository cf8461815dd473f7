/*
 * load.c - the mount's side of BACKING_DIR: loading committed
 * checkpoints into the tree (from BACKING_DIR or this node's tier, as the
 * resolver says), deleting one, and what the tier holds (partner copies,
 * a full tier). The layout, the scan for unfinished saves and the reads
 * of committed data are the store's (store/).
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "catalog.h"
#include "read.h"

/* BACKING_DIR's copy first: a tier copy left by a crash in between has
 * no flush record and no shared copy, and the next mount removes it. */
int ckpt__storage_remove(ckpt_fs_t *fs, const char *name) {
  int rc = ckpt__checkpoint_remove(fs->backing_fd, name, false);
  if (fs->tier_fd >= 0) {
    int trc = ckpt__checkpoint_remove(fs->tier_fd, name, false);
    rc = rc ? rc : trc == -ENOENT ? 0 : trc;
  }
  return rc;
}

/* Where the checkpoint of meta, loaded from root (dfd), stands in the
 * tier's flush (looked up before fs->lock is taken). */
typedef struct {
  bool flushed;
  bool partner; /* committed at level partner (fs/commit/partner.c) */
  uint64_t total;
} tier_look_t;

static tier_look_t tier_look(ckpt_fs_t *fs, const ckpt_metadata_t *meta,
                             int root, int dfd) {
  tier_look_t t = {.flushed = true};
  if (fs->tier_fd < 0)
    return t;
  /* with several ranks, this rank's files: the ones its flush copies */
  t.total = ckpt__flush_bytes(dfd, fs->world_size > 1 ? fs->rank : -1);
  t.flushed = root != fs->tier_fd ||
              !ckpt__flush_unflushed(fs, meta->save_id);
  t.partner = root == fs->tier_fd && ckpt__partner_copies_in(fs, dfd);
  return t;
}

/* fs->lock held. */
static void set_tier_state(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                           const tier_look_t *t) {
  CKPT_HELD(&fs->lock);
  ck->tier.tiered = fs->tier_fd >= 0;
  atomic_store(&ck->tier.flushed, t->flushed);
  ck->tier.partner = t->partner;
  atomic_store(&ck->tier.total, t->total);
  atomic_store(&ck->tier.done, t->flushed ? t->total : 0);
}

/* Show committed checkpoint name; with staged (a staged checkpoint of
 * that name, still listed), in its place, under the same hold of
 * fs->lock, with lost (moved) as the committed one's .status note. */
static int load_one(ckpt_fs_t *fs, const char *name, ckpt_ckpt_t *staged,
                    char *lost, char **err) {
  int root = ckpt__root_of(fs, name); /* the tier's copy while there */
  int dfd = ckpt_store_open_dir(root, name, O_RDONLY);
  if (dfd < 0) {
    free(lost);
    *err = ckpt__strdup_printf("opening %s: %s%s", name, strerror(-dfd),
                               dfd == -ELOOP || dfd == -ENOTDIR
                                   ? " (not a directory: refused)"
                                   : "");
    return dfd;
  }
  ckpt_metadata_t *meta = calloc(1, sizeof(*meta));
  if (!meta) {
    free(lost);
    close(dfd);
    *err = strdup("out of memory");
    return -ENOMEM;
  }
  char display[300];
  snprintf(display, sizeof(display), "%s/%s", name, CKPT_METADATA_FILE);
  int rc = ckpt_metadb_load_at(dfd, display, meta, err);
  if (rc) {
    free(lost);
    close(dfd);
    free(meta);
    return rc;
  }
  tier_look_t tier = tier_look(fs, meta, root, dfd);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *dir = ckpt__ckpt_lookup(fs, name);
  if (staged && (!staged->dir || dir != staged->dir)) {
    rc = -ESTALE; /* removed meanwhile: not ours to replace */
  } else if (staged) {
    /* The staged one leaves as rm -r NAME would make it. */
    ckpt__streams_drop_kept(staged->streams);
    ckpt__node_detach(fs, staged->dir);
    ckpt__ckpt_unref(fs, staged);
    dir = NULL;
  }
  ckpt_ckpt_t *ck = NULL;
  if (rc == 0 && !(ck = dir ? dir->ck : ckpt__ckpt_new(fs, name)))
    rc = -ENOMEM;
  else if (rc == 0 && ck->meta)
    rc = -EEXIST; /* already shown */
  else if (rc == 0)
    rc = ckpt__ckpt_set_committed(fs, ck, meta, dfd, err);
  if (rc == 0)
    set_tier_state(fs, ck, &tier);
  if (rc && rc != -EEXIST && ck && !dir) {
    /* Made here for it: not shown at all (an empty staging checkpoint of
     * that name would hide it; the next lookup tries again). */
    ckpt__node_detach(fs, ck->dir);
    ckpt__ckpt_unref(fs, ck);
  }
  if (rc == 0 && lost) {
    ck->lost = lost;
    lost = NULL;
  }
  pthread_mutex_unlock(&fs->lock);
  free(lost);
  close(dfd);
  if (rc) {
    if (rc != -EEXIST && !*err)
      *err = strdup(strerror(-rc));
    ckpt_metadata_free(meta);
    free(meta);
    return rc == -EEXIST ? 0 : rc;
  }
  return 0;
}

int ckpt__fs_load_one(ckpt_fs_t *fs, const char *name, char **err) {
  return load_one(fs, name, NULL, NULL, err);
}

int ckpt__fs_load_instead(ckpt_fs_t *fs, ckpt_ckpt_t *staged, char *lost,
                          char **err) {
  return load_one(fs, staged->name, staged, lost, err);
}

/* The committed checkpoints of root. */
static int load_root(ckpt_fs_t *fs, int root) {
  char **names;
  size_t n;
  int rc = ckpt__catalog_names(root, &names, &n);
  if (rc)
    return rc;
  for (size_t i = 0; i < n; i++) {
    if (!ckpt_store_committed(root, names[i], NULL))
      continue;
    char *err = NULL;
    if (ckpt__fs_load_one(fs, names[i], &err))
      ckpt__log("not showing checkpoint %s: %s (left in place; see "
                "ckptfs-fsck)", names[i], err ? err : "unknown error");
    free(err);
  }
  ckpt__catalog_names_free(names, n);
  return 0;
}

/* The tier's (unflushed) and BACKING_DIR's: load_one takes the tier's copy
 * of a name in both. */
int ckpt__fs_load(ckpt_fs_t *fs) {
  int rc = fs->tier_fd >= 0 ? load_root(fs, fs->tier_fd) : 0;
  int brc = load_root(fs, fs->backing_fd);
  return rc ? rc : brc;
}

void ckpt__tier_full_line(ckpt_fs_t *fs, char *buf, size_t size) {
  struct statvfs v;
  buf[0] = '\0';
  if (fs->tier_fd < 0 || fstatvfs(fs->tier_fd, &v))
    return;
  uint64_t free = (uint64_t)v.f_bavail * v.f_frsize;
  if (free >= CKPT_TIER_FULL_FREE)
    return;
  snprintf(buf, size,
           "tier full: %s has %llu MiB free: staged writes fail with ENOSPC "
           "(nothing staged is lost); commit what is staged with `sync "
           "level=shared` (written to BACKING_DIR directly), or make room "
           "in the tier (a lower tier_keep, `ckptctl wait --level shared`)\n",
           fs->tier_path, (unsigned long long)(free >> 20));
}

bool ckpt__partner_copies_in(ckpt_fs_t *fs, int dirfd) {
  DIR *d = ckpt_opendir_at(dirfd);
  if (!d)
    return false;
  int own = ckpt_dist_node_of(fs->dist, fs->rank);
  bool found = false;
  struct dirent *e;
  while (!found && (e = readdir(d)) != NULL) {
    int r, used = 0;
    unsigned k;
    found = sscanf(e->d_name, "__%d_%u.distcp%n", &r, &k, &used) == 2 &&
            e->d_name[used] == '\0' && ckpt_dist_node_of(fs->dist, r) != own;
  }
  closedir(d);
  return found;
}
