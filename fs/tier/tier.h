/*
 * tier.h - fs/tier: a node-local tier (-o tier=DIR) flushed to
 * BACKING_DIR in the background (flush.c, copy.c), the publish of a
 * complete save as ROOT/NAME for commits and flushes alike (publish.c),
 * and what is kept (retain.c: tier_keep, keep=). Below: read, journal,
 * stage, tree, core.
 */
#ifndef CKPT_FS_TIER_H
#define CKPT_FS_TIER_H

#include "read.h"

/* -o tier_keep=N (retain.c): after a successful flush, in place of the
 * removal of the flushed tier copy: keep the last N flushed checkpoints of
 * the tier (by step), remove the other flushed ones; never one with a
 * record. */
void ckpt__tier_retain(ckpt_fs_t *fs);
/* -o keep= (save.c): remove the committed checkpoints of BACKING_DIR the
 * policy does not keep, name (just committed or flushed) always kept. Run
 * by the coordinator after each commit; with a tier, the flush may run it
 * again once name is published on BACKING_DIR. */
void ckpt__keep_policy(ckpt_fs_t *fs, const char *name);
/* NAME was removed from BACKING_DIR: its flushed copy (save_id, no flush
 * record) goes from the tier too (retain.c). */
void ckpt__tier_forget(ckpt_fs_t *fs, const char *name, const char *save_id);

/* The view of NAME (save_id) reads BACKING_DIR's copy from now on, if
 * that is the save and the tier keeps no copy of it (flush.c). */
void ckpt__flush_rebind(ckpt_fs_t *fs, const char *name, const char *save_id);
typedef struct ckpt_flush ckpt_flush_t;

/* At mount: -EBUSY with *err when a record of the tier goes to another
 * BACKING_DIR than backing (absolute; this mount would not flush it). */
int ckpt__flush_check(ckpt_fs_t *fs, const char *backing, char **err);
/* At mount, before ckpt__fs_load: records of checkpoints already flushed
 * or gone are dropped, tier checkpoints with neither record nor shared
 * copy (removed by a user) are removed. */
void ckpt__flush_recover(ckpt_fs_t *fs);
/* Start the thread; it queues every record left by earlier mounts. */
int ckpt__flush_start(ckpt_fs_t *fs, ckpt_flush_t **out);
/* Queue the tier checkpoint name (just committed). */
void ckpt__flush_add(ckpt_flush_t *f, const char *name, const char *save_id,
                     int rank);
/* Stop it: a copy under way is abandoned (the record stays). */
void ckpt__flush_stop(ckpt_flush_t *f);
/* The tier's unflushed save save_id of name was found superseded (a
 * later change of BACKING_DIR/NAME: resolve.c): checked again under the
 * node's lock, its records and tier copy go at once, so that no flush
 * publishes it (were NAME removed later, it would come back), and the
 * log and NAME's .status say so. No lock held. */
void ckpt__flush_supersede(ckpt_fs_t *fs, const char *name,
                           const char *save_id);

/* Remove tier checkpoint name whose flush failed for good, if it is
 * still save_id, and this mount's record of it (of rank: fs->rank, or 0
 * for a solo save, a world of one): it is never published. fs->lock may
 * be held. 0 or -errno. */
int ckpt__flush_drop(ckpt_fs_t *fs, const char *name, const char *save_id,
                     int rank);

/* A complete save directory ROOT/.saves/SAVE_ID to publish as ROOT/NAME. */
typedef struct {
  int root_fd;           /* BACKING_DIR or the tier */
  const char *root_path; /* for messages */
  int held_fd;           /* .saves/SAVE_ID, held; -1: none */
  const char *save_id;
  const char *name;
  bool replace;          /* replace=NAME: exchanged with the old version */
  bool flush;            /* the tier's flush, not a commit (no failpoints) */
  const char *replaces;  /* the flush of a save that recorded what it
                            replaced: published only while NAME is one of
                            them (ckpt_store_publish_if); -ESTALE with
                            *err saying which save NAME is now */
  int64_t commit_ns;     /* with replaces: when the save was committed */
} ckpt_publish_t;
int ckpt__publish_save(ckpt_fs_t *fs, const ckpt_publish_t *p, char **err);

/* Why a save of NAME cannot publish in root_fd (root_path), malloc'd:
 * "NAME is already committed elsewhere (save S, ...)" or what is there. */
char *ckpt__committed_elsewhere(int root_fd, const char *root_path,
                                const char *name);

#endif /* CKPT_FS_TIER_H */
