/*
 * journal.h - fs/journal: the tier's journal of unflushed saves
 * (TIER/.flush/SAVE_ID.R, whose life tier/flush.c's head tells) and the
 * node's lock on its tier. Below: stage, tree, core.
 */
#ifndef CKPT_FS_JOURNAL_H
#define CKPT_FS_JOURNAL_H

#include "stage.h"

#define CKPT_FLUSH_DIR ".flush"

/* The lines of a record after its first three: the shared publish is
 * under way (step 4); the tier is not the coordinator's node's; a partner
 * record ("partner HOST\n", the owner's host). */
#define CKPT_REC_PUBLISHING "publishing\n"
#define CKPT_REC_REMOTE "remote\n"
#define CKPT_REC_PARTNER "partner "

/* Journal the flush of rank's files of save_id (NAME name, replace) in
 * the tier: the record, fsynced, once they are written (before the
 * rank's RESULT, so before any publish). remote: the tier is not the
 * coordinator's node's (there the checkpoint is published from the
 * OUTCOME, if this node gets it). partner_host: NULL for this mount's
 * own rank; else rank is another node's, whose data files this tier
 * keeps as partner copies, and partner_host is its host's name (flushed
 * from here only when that node cannot: flush.c). */
int ckpt__flush_record(ckpt_fs_t *fs, const char *save_id, int rank,
                       const char *name, bool replace, bool remote,
                       const char *partner_host, char **err);
/* Drop rank's record of a save that failed. */
void ckpt__flush_unrecord(ckpt_fs_t *fs, const char *save_id, int rank);
/* The node's lock on its tier (TIER/.flush/.lock, flock exclusive),
 * held by every mount of the node while it publishes in the tier or
 * removes from it: fd, or -errno. ckpt__tier_unlock(fd) lets go. */
int ckpt__tier_lock(ckpt_fs_t *fs);
void ckpt__tier_unlock(int fd);

/* Does a flush record name save_id, of any rank (its checkpoint is not
 * all in the shared store yet), or can that not be known now? false
 * without a tier. */
bool ckpt__flush_unflushed(ckpt_fs_t *fs, const char *save_id);

/* The bytes of the data files of rank (-1: every rank's) in checkpoint
 * directory dirfd. */
uint64_t ckpt__flush_bytes(int dirfd, int rank);

/* The records' directory TIER/.flush (created if create): fd or -errno. */
int ckpt__journal_open(ckpt_fs_t *fs, bool create);
/* rank's record name of save_id ("SAVE_ID.R") into out. */
void ckpt__journal_name(const char *save_id, int rank, char *out, size_t n);
/* Split a record's name; false when it is no record's. */
bool ckpt__journal_parse_name(const char *rec,
                              char id[CKPT_SAVE_ID_LEN + 1], int *rank);
/* Is rec a record of save_id (any rank)? */
bool ckpt__journal_of(const char *rec, const char *save_id);
/* Remove record rec, durably. */
void ckpt__journal_remove(ckpt_fs_t *fs, const char *rec);
/* In the records' directory dfd: 1 if a record of save_id is there, 0 if
 * none, -errno when that cannot be known. */
int ckpt__journal_any(int dfd, const char *save_id);
/* Known to have no record of save_id. */
bool ckpt__journal_none(int dfd, const char *save_id);
/* Is name a data file's (__R_K.distcp)? Its rank and K. */
bool ckpt__data_file_name(const char *name, int32_t *rank, uint32_t *k);

#endif /* CKPT_FS_JOURNAL_H */
