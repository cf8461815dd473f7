/*
 * retain.c - -o tier_keep=N: how many flushed checkpoints a mount's tier
 * keeps (the policy of keep=last:N, by step). Without it the flush removes
 * each tier copy once the checkpoint is on BACKING_DIR; with it the flush
 * calls ckpt__tier_retain after each successful flush instead, which
 * keeps the last N flushed ones (for restarts from the tier) and removes
 * the rest. A tier checkpoint with a flush record is never removed here:
 * unflushed, it may be the only copy (catalog.c, ckpt__tier_evict).
 */
#include <stdlib.h>
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
    /* A lookup that saw the tier's copy before it went says nothing
     * against BACKING_DIR's (still_stored ignores presences older than
     * load_gen), as when the flush removes a tier copy itself. */
    pthread_mutex_lock(&fs->lock);
    ckpt_node_t *d = ckpt__ckpt_lookup(fs, gone[i]);
    if (d && d->ck)
      d->ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
    pthread_mutex_unlock(&fs->lock);
  }
  ckpt__catalog_names_free(gone, n);
}
