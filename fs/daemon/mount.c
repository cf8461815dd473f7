/*
 * mount.c - the objects of one rank mount set up and torn down: the tree,
 * the staging budget, the descriptor cache, and the tables through which
 * the tree frees what the layers above hang on it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "daemon.h"

int ckpt__fs_init(ckpt_fs_t *fs) {
  ckpt__stage_register();
  ckpt__read_register();
  int rc = ckpt__tree_init(fs);
  if (rc)
    return rc;
  pthread_mutex_init(&fs->scan_lock, NULL);
  pthread_mutex_init(&fs->tier_publish, NULL);
  /* Staged data spills into the commit root: with a tier, passthrough
   * files there are linked into the save, still written once. */
  ckpt__staging_init(&fs->staging, fs->opts.staging_mem, fs->commit_fd);
  if (ckpt_fdcache_new(fs->backing_fd, 0, &fs->fdcache))
    return -ENOMEM;
  /* one rank has all its files in its tier: nothing to wait for */
  ckpt_fdcache_set_near(fs->fdcache, fs->tier_fd,
                        fs->world_size > 1 ? fs->opts.commit_timeout : 0);
  return 0;
}

void ckpt__fs_destroy(ckpt_fs_t *fs) {
  if (fs->root) {
    pthread_mutex_lock(&fs->lock);
    while (fs->root->children) {
      ckpt_node_t *d = fs->root->children;
      ckpt_ckpt_t *ck = d->ck;
      if (ck && (ck->state == CKPT_STAGING || ck->state == CKPT_FAILED)) {
        uint64_t files = 0, bytes = 0;
        ckpt__count_staged(d, &files, &bytes);
        ckpt__log("warning: unmounted with checkpoint %s staged but not "
                  "committed (%llu file%s, %llu bytes)%s: its staged data is "
                  "discarded",
                  ck->name, (unsigned long long)files, files == 1 ? "" : "s",
                  (unsigned long long)bytes,
                  ck->state == CKPT_FAILED ? " (its last commit failed)" : "");
      }
      ckpt__node_detach(fs, d);
      ckpt__ckpt_unref(fs, ck);
    }
    pthread_mutex_unlock(&fs->lock);
  }
  ckpt__tree_destroy(fs);
  ckpt_fdcache_free(fs->fdcache);
  fs->fdcache = NULL;
  ckpt__scan_put(fs->scan);
  fs->scan = NULL;
  for (size_t i = 0; i < fs->nrefused; i++)
    free(fs->refused[i].name);
  free(fs->refused);
  fs->refused = NULL;
  fs->nrefused = 0;
  pthread_mutex_destroy(&fs->scan_lock);
  pthread_mutex_destroy(&fs->tier_publish);
  ckpt__staging_destroy(&fs->staging);
}
