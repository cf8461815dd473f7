/*
 * retain.c - -o tier_keep=N: how many flushed checkpoints a mount's tier
 * keeps (the policy of keep=last:N, by step). Without it the flush removes
 * each tier copy once the checkpoint is on BACKING_DIR; with it the flush
 * calls ckpt__tier_retain after each successful flush instead, which
 * keeps the last N flushed ones (for restarts from the tier) and removes
 * the rest. A tier checkpoint with a flush record is never removed here:
 * unflushed, it may be the only copy (catalog.c, ckpt__tier_evict).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "catalog.h"
#include "fs_int.h"

void ckpt__tier_retain(ckpt_fs_t *fs) {
  if (fs->tier_fd < 0)
    return;
  char **gone = NULL;
  size_t n = 0;
  /* No tier publish meanwhile: a replace= commit may put a newer,
   * unflushed save of a name there. */
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs); /* and the node's other mounts */
  int rc = ckpt__tier_evict(fs->tier_fd, fs->backing_fd, CKPT_FLUSH_DIR,
                            fs->opts.tier_keep, &gone, &n);
  ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
  if (rc)
    ckpt__log("tier_keep=%u: %s: %s%s", fs->opts.tier_keep, fs->tier_path,
              strerror(-rc), n ? " (some were removed)" : "");
  for (size_t i = 0; i < n; i++) {
    ckpt__log("tier_keep=%u: removed %s from the tier (flushed)",
              fs->opts.tier_keep, gone[i]);
    /* The view was bound to the tier's copy (rebind_to_shared leaves it
     * so under tier_keep): bound to BACKING_DIR's now; a lookup that saw
     * the tier's copy before it went says nothing against it
     * (still_stored ignores presences older than load_gen). */
    char id[CKPT_SAVE_ID_LEN + 1] = "";
    pthread_mutex_lock(&fs->lock);
    ckpt_node_t *d = ckpt__ckpt_lookup(fs, gone[i]);
    if (d && d->ck && d->ck->has_stored)
      snprintf(id, sizeof(id), "%s", d->ck->stored.save_id);
    if (d && d->ck)
      d->ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
    pthread_mutex_unlock(&fs->lock);
    if (id[0])
      ckpt__flush_rebind(fs, gone[i], id);
  }
  ckpt__catalog_names_free(gone, n);
}

void ckpt__tier_forget(ckpt_fs_t *fs, const char *name, const char *save_id) {
  char id[CKPT_SAVE_ID_LEN + 1] = "";
  if (fs->tier_fd < 0 || !save_id)
    return;
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs);
  int dfd = ckpt_store_open_dir(fs->tier_fd, name, O_RDONLY);
  int rc = dfd < 0 ? dfd : ckpt_store_save_id(dfd, id);
  if (dfd >= 0)
    close(dfd);
  if (rc == 0 && !strcmp(id, save_id) && !ckpt__flush_unflushed(fs, save_id) &&
      ckpt__checkpoint_remove(fs->tier_fd, name, false) == 0)
    ckpt__log("%s: removed from the tier too (removed from BACKING_DIR)",
              name);
  ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
}
