/*
 * failpoint.h - named points of the save protocol where a test can make
 * this daemon die, to prove what a crash there leaves behind.
 *
 * CKPTFS_FAILPOINT=NAME[:N][@RANK][=ERR] in the daemon's environment: the N-th
 * time (default 1st) that rank RANK (default: every rank) passes the point
 * NAME, the daemon kills itself with SIGKILL: no handler, no cleanup, no
 * unmount, as after a crash or the OOM killer. With =ERR (EIO, ENOSPC,
 * EISDIR, EACCES, EROFS or a number) the operation at an error point fails
 * with that errno instead, once, as a failing backing filesystem would.
 * Unset (production), a point costs one load and a branch. The names (in
 * protocol order):
 *
 *   local_plan       the local plan is built, not yet sent
 *   global_plan      coordinator: the global plan is made, not yet sent
 *   write_begin      the rank's plan arrived, its data files are not written
 *   write_open       (error point) opening one of the rank's data files
 *   write_data       one batch of data bytes is in a data file (use :N)
 *   write_done       the data files are complete (and synced), unreported
 *   metadata_tmp     coordinator: .metadata.tmp is complete, not renamed
 *   metadata_rename  coordinator: the save's directory is renamed to NAME
 *                    (the commit point), BACKING_DIR not synced
 *   metadata_synced  coordinator: published and synced, ranks not told
 *   committed        the committed view is shown, the writer not answered
 *   discard          a failed save is about to remove what it wrote
 *   reader_init      (error point) setting up the reader of a committed
 *                    checkpoint this mount shows (at start or a lookup)
 *
 * Removal of one entry inside a committed checkpoint (store/removal.c):
 *   remove_linked    the new version's directory holds its data file links
 *   remove_metadata  ... and its complete .metadata; not exchanged yet
 *   remove_exchanged the new version is NAME, the old one in .saves (not
 *                    synced)
 *   remove_old       synced; the old version is about to be removed
 *
 * The flush of a tier (fs/tier/flush.c, -o tier=DIR):
 *   flush_copy       (also an error point) one data file is being copied
 *                    into BACKING_DIR/.saves/ID, not linked
 *   flush_marked     the copy is complete and the record marked
 *                    'publishing'; not published yet
 *   flush_published  the checkpoint is published in BACKING_DIR and
 *                    synced; its flush record is not removed yet
 *   tier_publish     a rank of another node than the coordinator's has the
 *                    OUTCOME (committed); its node's tier publish not begun
 *
 * Partner copies (fs/commit/partner.c, -o tier_level=partner):
 *   partner_open     (error point) a partner copy of another rank's data
 *                    file is being made in this rank's tier
 *   partner_synced   one received partner copy is complete and synced
 *                    (use :N), the exchange not done
 */
#ifndef CKPT_FAILPOINT_H
#define CKPT_FAILPOINT_H

/* Read CKPTFS_FAILPOINT for this rank; 0, or -EINVAL with *why set if the
 * variable is malformed (the daemon refuses to start). */
int ckpt_failpoint_setup(int rank, const char **why);

/* Die here if the configured point is NAME and its count is reached. */
void ckpt_failpoint(const char *name);

/* An error point: -ERR if the configured point is NAME with =ERR and its
 * count is reached (once), else 0. */
int ckpt_failpoint_error(const char *name);

#endif
