/*
 * staged.c - what a staged checkpoint holds (files and bytes, for .status,
 * the metrics and the unmount warning), and the staged kinds' entries in
 * the tree's tables.
 */
#include "stage.h"

static void free_sfile(ckpt_node_t *n) { ckpt__sfile_free(n->u.sf); }

static void release_streams(ckpt_ckpt_t *ck) {
  ckpt__streams_free(ck->streams);
  ck->streams = NULL;
}

void ckpt__stage_register(void) {
  static const ckpt_kind_ops_t sfile = {.free_node = free_sfile};
  ckpt__tree_set_kind(CKPT_NODE_SFILE, &sfile);
  ckpt__tree_on_release(release_streams);
}

void ckpt__count_staged(const ckpt_node_t *dir, uint64_t *files,
                        uint64_t *bytes) {
  for (const ckpt_node_t *c = dir->children; c; c = c->next) {
    if (c->kind == CKPT_NODE_SDIR) {
      ckpt__count_staged(c, files, bytes);
    } else if (c->kind == CKPT_NODE_SFILE) {
      (*files)++;
      *bytes += ckpt__sfile_size_seen(c->u.sf);
    }
  }
}

void ckpt__ckpt_staged_size(const ckpt_ckpt_t *ck, uint64_t *files,
                            uint64_t *bytes) {
  *files = *bytes = 0;
  if (ck->dir)
    ckpt__count_staged(ck->dir, files, bytes);
}
