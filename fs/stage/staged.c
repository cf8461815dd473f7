/*
 * staged.c - what a staged checkpoint holds (files and bytes, for .status,
 * the metrics and the unmount warning), and the staged kinds' entries in
 * the tree's tables.
 */
#include <errno.h>
#include "stage.h"

static void free_sfile(ckpt_node_t *n) {
  if (ckpt__sfile_drop_name(n->u.sf, n))
    ckpt__sfile_free(n->u.sf);
}

int ckpt__sfile_add_name(ckpt_sfile_t *sf, ckpt_node_t *n) {
  if (sf->nnames == CKPT_SFILE_NAMES_MAX)
    return -EMLINK;
  if (sf->nnames == 0)
    sf->ino = n->ino;
  sf->names[sf->nnames++] = n;
  return 0;
}

bool ckpt__sfile_drop_name(ckpt_sfile_t *sf, ckpt_node_t *n) {
  for (uint32_t i = 0; i < sf->nnames; i++)
    if (sf->names[i] == n) {
      sf->names[i] = sf->names[--sf->nnames];
      break;
    }
  return sf->nnames == 0;
}

uint32_t ckpt__sfile_nlink(const ckpt_sfile_t *sf) {
  uint32_t k = 0;
  for (uint32_t i = 0; i < sf->nnames; i++)
    k += sf->names[i]->attached;
  return k;
}

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
