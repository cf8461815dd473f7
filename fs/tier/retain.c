/*
 * retain.c - -o tier_keep=N: how many flushed checkpoints a mount's tier
 * keeps (the policy of keep=last:N, by step). Without it the flush removes
 * each tier copy once the checkpoint is on BACKING_DIR; with it the flush
 * calls ckpt__tier_retain after each successful flush instead, which
 * keeps the last N flushed ones (for restarts from the tier) and removes
 * the rest. A tier checkpoint with a flush record is never removed here:
 * unflushed, it may be the only copy (catalog.c, ckpt__tier_evict).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "catalog.h"
#include "tier.h"

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

/* The save key of ROOT/NAME: 0, -ENOENT (no committed checkpoint there)
 * or another -errno (not known now). */
static int key_at(int root, const char *name, char id[CKPT_SAVE_ID_LEN + 1]) {
  int dfd = ckpt_store_open_dir(root, name, O_RDONLY);
  if (dfd < 0)
    return dfd == -ENOTDIR || dfd == -ELOOP ? -ENOENT : dfd;
  int rc = ckpt_store_save_id(dfd, id);
  close(dfd);
  return rc;
}

void ckpt__tier_forget(ckpt_fs_t *fs, const char *name, const char *save_id) {
  char id[CKPT_SAVE_ID_LEN + 1] = "", shared[CKPT_SAVE_ID_LEN + 1] = "";
  if (fs->tier_fd < 0 || !save_id)
    return;
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs);
  /* Looked at again under the node's lock, every answer positive: the
   * copy is save_id, no record of it (its flush may have published it
   * just now), and BACKING_DIR/NAME another save or none */
  int src = lock < 0 ? lock : key_at(fs->backing_fd, name, shared);
  bool stale = lock >= 0 && key_at(fs->tier_fd, name, id) == 0 &&
               !strcmp(id, save_id) && !ckpt__flush_unflushed(fs, save_id) &&
               (src == -ENOENT || (src == 0 && strcmp(shared, save_id)));
  if (stale && ckpt__checkpoint_remove(fs->tier_fd, name, false) == 0)
    ckpt__log("%s: its tier copy (save %s) removed: BACKING_DIR's %s is %s%s",
              name, save_id, name, src ? "gone" : "save ", src ? "" : shared);
  if (lock >= 0)
    ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
}

/* -o keep= (or keep_last=N), coordinator, after name was committed:
 * remove the committed checkpoints of BACKING_DIR that no rule of the
 * policy keeps (catalog.c; name is always kept), .metadata first and
 * durably, as rm -r through a mount does. Other ranks' views drop them at
 * their next lookup or listing (still_stored in ops.c). A checkpoint a
 * writer still holds is left for the next commit. */
void ckpt__keep_policy(ckpt_fs_t *fs, const char *name) {
  const ckpt_keep_policy_t *p = &fs->opts.keep;
  /* Cheap first: no .metadata is read while only last:N could remove
   * and there are at most N. */
  char **names;
  size_t n, committed = 0;
  if (!p->every && !p->best &&
      ckpt__catalog_names(fs->backing_fd, &names, &n) == 0) {
    for (size_t i = 0; i < n; i++)
      committed += ckpt__already_committed(fs, names[i]);
    ckpt__catalog_names_free(names, n);
    if (committed <= p->last)
      return;
  }
  ckpt_catalog_t cat;
  int rc = ckpt__catalog_scan(fs->backing_fd, false, &cat);
  if (rc) {
    ckpt__log("%s: cannot list %s: %s", fs->opts.keep_text,
              fs->backing_path, strerror(-rc));
    return;
  }
  bool *old = calloc(cat.n ? cat.n : 1, sizeof(*old));
  if (old && ckpt__catalog_select_prunable(fs->backing_fd, &cat, p, name,
                                           old, NULL))
    for (size_t i = 0; i < cat.n; i++) {
      if (!old[i])
        continue;
      /* said first: a daemon killed during the removal (its .metadata goes
       * first) leaves a checkpoint gone for every mount, and the why */
      ckpt__log("%s: removing %s (step %lld): not kept by the policy",
                fs->opts.keep_text, cat.e[i].name, (long long)cat.e[i].step);
      rc = ckpt__checkpoint_remove(fs->backing_fd, cat.e[i].name, true);
      if (rc == 0 && fs->tier_fd >= 0) /* its flushed copy kept there */
        ckpt__tier_forget(fs, cat.e[i].name, cat.e[i].meta.save_id);
      if (rc)
        ckpt__log("%s: not removing %s: %s", fs->opts.keep_text,
                  cat.e[i].name, strerror(-rc));
      else
        ckpt__log("%s: removed %s (step %lld)", fs->opts.keep_text,
                  cat.e[i].name, (long long)cat.e[i].step);
    }
  free(old);
  ckpt__catalog_free(&cat);
}
