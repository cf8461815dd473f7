/*
 * read.h - fs/read: what a committed name is and how it is read. Which
 * save of NAME this mount serves (resolve.c), the committed tree built
 * from a .metadata (committed.c, load.c), the generated views and block
 * files. Below: journal, stage, tree, core.
 */
#ifndef CKPT_FS_READ_H
#define CKPT_FS_READ_H

#include "journal.h"

/* ------------------------------------------------------------------------
 * Loading BACKING_DIR's checkpoints (load.c, committed.c).
 * ---------------------------------------------------------------------- */

/* Load every committed checkpoint of BACKING_DIR (those refused are
 * logged with the reason, and left where they are). */
int ckpt__fs_load(ckpt_fs_t *fs);
/* Load BACKING_DIR/name/.metadata into the tree (state COMMITTED). */
int ckpt__fs_load_one(ckpt_fs_t *fs, const char *name, char **err);
/* The same, in place of staged, a staged checkpoint of that name still
 * listed (its commit lost to this one): under one hold of fs->lock the
 * staged one leaves the tree (as rm -r NAME would make it) and the
 * committed one enters it, with lost (moved; NULL: none) as its .status
 * "lost:" line, so that no lookup sees NAME as neither. -ESTALE when
 * staged is not listed any more (left as it is). */
int ckpt__fs_load_instead(ckpt_fs_t *fs, ckpt_ckpt_t *staged, char *lost,
                          char **err);

/* Replace ck's children by the committed view of meta (takes ownership). */
int ckpt__ckpt_set_committed(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                             ckpt_metadata_t *meta, int dirfd, char **err);

/* A committed node n of ck (a view, .metadata): the shared permissions
 * and the checkpoint directory's owner. fs->lock held. */
void ckpt__committed_shared(ckpt_ckpt_t *ck, ckpt_node_t *n);

/* Does the tier's checkpoint directory dirfd hold a data file of a rank
 * of another node than this mount's (a partner copy: the checkpoint was
 * committed at level partner)? */
bool ckpt__partner_copies_in(ckpt_fs_t *fs, int dirfd);

/* The committed kinds' entries in the tree's tables (committed.c). */
void ckpt__read_register(void);

/* ------------------------------------------------------------------------
 * Which save of NAME this mount serves (resolve.c, whose head states the
 * rule): BACKING_DIR's, or this node's tier copy while it is that save or
 * the node's unflushed save of NAME that nothing on BACKING_DIR
 * superseded. No lock needed (looks in the directories; may be called
 * with fs->lock held).
 * ---------------------------------------------------------------------- */
typedef struct {
  int root;         /* where NAME is served from: fs->tier_fd or
                       fs->backing_fd */
  char stale[CKPT_SAVE_ID_LEN + 1]; /* a kept tier copy of a save NAME is
                                       no more (to drop), or "" */
  bool superseded;  /* the tier's unflushed save of NAME was superseded on
                       BACKING_DIR (ckpt__flush_supersede drops it) */
  char superseded_id[CKPT_SAVE_ID_LEN + 1]; /* its save key */
} ckpt_resolved_t;
void ckpt__resolve(ckpt_fs_t *fs, const char *name, ckpt_resolved_t *out);
/* ckpt__resolve's root. */
int ckpt__root_of(ckpt_fs_t *fs, const char *name);
/* "tier full: ...\n" when the tier has less than CKPT_TIER_FULL_FREE
 * bytes free, with what to do; else "". No lock needed. */
#define CKPT_TIER_FULL_FREE ((uint64_t)64 << 20)
#define CKPT_TIER_FULL_MAX 512
void ckpt__tier_full_line(ckpt_fs_t *fs, char *buf, size_t size);
/* For a commit of NAME into the tier: the saves it replaces (the
 * "replaces" of its .metadata): "none" for a plain commit; for replace=,
 * BACKING_DIR/NAME's save key or "none" (left out when it cannot be read
 * now), the tier's unflushed save of NAME that it replaces in the tier,
 * and "earlier". NULL without a tier; else malloc'd. */
char *ckpt__resolve_replaces(ckpt_fs_t *fs, const char *name, bool replace);
/* The flush of save_id of name found NAME changed after its commit (why):
 * NAME's .status says so from now on (ckpt__resolve_note). */
void ckpt__resolve_superseded(ckpt_fs_t *fs, const char *name,
                              const char *save_id, const char *why);
/* The "superseded: ..." line of name, malloc'd, or NULL. */
char *ckpt__resolve_note(const char *name);
/* Delete BACKING_DIR/name (and the tier's): .metadata first and durably,
 * then the data. */
int ckpt__storage_remove(ckpt_fs_t *fs, const char *name);

/* NAME is committed in BACKING_DIR, or this mount serves the tier's copy
 * of it (resolve.c). */
bool ckpt__already_committed(ckpt_fs_t *fs, const char *name);

/* ------------------------------------------------------------------------
 * Views of a committed checkpoint (views.c): NAME/.npy and
 * NAME/.safetensors, files generated from the stored chunks on the fly.
 * ---------------------------------------------------------------------- */
/* Add the (empty) view directories to committed ck. fs->lock held. */
int ckpt__views_attach(ckpt_fs_t *fs, ckpt_ckpt_t *ck);
/* Fill view directory vroot at its first lookup. fs->lock held. */
int ckpt__views_populate(ckpt_fs_t *fs, ckpt_node_t *vroot);
void ckpt__views_free(struct ckpt_views *v);
/* The tensors of view file n (a .safetensors shard, CKPT_NODE_VST), in
 * file order: their count, *out pointing to their indices. */
size_t ckpt__view_shard_tensors(const ckpt_node_t *n, const size_t **out);
/* st_size of a view file. fs->lock held. */
uint64_t ckpt__view_size(const ckpt_node_t *n);
/* Serve a read of view file n (replies to req). */
void ckpt__view_read(fuse_req_t req, ckpt_node_t *n,
                     size_t size, uint64_t off);

/* ------------------------------------------------------------------------
 * Block files of a committed checkpoint (blocks.c): DIR/.N[a0:b0,...].
 * ---------------------------------------------------------------------- */
typedef struct ckpt_block {
  uint32_t tensor;  /* index into ck->meta->tensors */
  int ndim;
  uint64_t bytes;   /* the block's size */
  int64_t dims[];   /* lo[ndim], then sizes[ndim] */
} ckpt_block_t;

/* Is block b of committed ck one contiguous run of its tensor's bytes?
 * Then true, with *off where the run starts in the tensor. */
bool ckpt__block_run(const ckpt_ckpt_t *ck, const ckpt_block_t *b,
                     uint64_t *off);
/* Is name in dir a block file name to resolve (dir a directory of a
 * committed checkpoint, name ".N[...]")? fs->lock held. */
bool ckpt__block_name(const ckpt_node_t *dir, const char *name);
/* The block node of name in dir: the one made before, or a new one. 0
 * with *out, -ENOENT (no tensor N, a 0-d one, a malformed name or bounds
 * outside the shape) or -ENOMEM. Counts the lookup. fs->lock held. */
int ckpt__block_lookup(ckpt_fs_t *fs, ckpt_node_t *dir, const char *name,
                       ckpt_node_t **out);
/* The kernel forgot nlookup lookups of n: a block node it no longer
 * knows leaves the tree (freed once unreferenced). fs->lock held. */
void ckpt__block_forget(ckpt_fs_t *fs, ckpt_node_t *n, uint64_t nlookup);
void ckpt__block_free(ckpt_block_t *b);
/* Reply to req with [pos, pos+len) of the data file ref holds, spliced
 * from its page cache (no copy here), counted as read; ref released. */
void ckpt__reply_spliced(fuse_req_t req, ckpt_ckpt_t *ck, ckpt_fdref_t *ref,
                         uint64_t pos, size_t len);
/* Serve a read of block file n (replies to req). */
void ckpt__block_read(fuse_req_t req, ckpt_node_t *n, size_t size,
                      uint64_t off);

#endif /* CKPT_FS_READ_H */
