/*
 * commit.h - fs/commit: a commit of a staged checkpoint. The freeze and
 * the save's steps run by dist's protocol (save.c, steps.c), partner
 * copies (partner.c), job processes whose saves are abandoned when they
 * exit (jobs.c). Below: tier, read, journal, stage, tree, core.
 */
#ifndef CKPT_FS_COMMIT_H
#define CKPT_FS_COMMIT_H

#include "tier.h"

/* ------------------------------------------------------------------------
 * Saves (save.c).
 * ---------------------------------------------------------------------- */
/* Freeze ck and queue its save, as the words written to .commit say
 * (sync or async, solo, replace=TARGET). req is replied when the save ends
 * (sync) or at once (async, req replied by the caller). Returns 0 or
 * -errno. */
int ckpt__save_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                     const ckpt_commit_words_t *words, fuse_req_t req,
                     size_t reply_size);
/* What the save of job waits for (dist's waiting op): shown by .status. */
void ckpt__save_waiting(void *ctx, ckpt_dist_job_t *job, const char *what,
                        double until);
extern const ckpt_save_ops_t ckpt__save_ops;
/* What partner.c needs of a save (save.c). */
typedef struct ckpt_partner_rx ckpt_partner_rx_t;
typedef struct {
  int dirfd;                /* ROOT/.saves/SAVE_ID, held */
  int rank;                 /* the rank in the save's world */
  const char *save_id;
  uint32_t n_files;         /* this rank's data files __RANK_K.distcp */
  const uint64_t *file_bytes;
  ckpt_partner_rx_t **rx;   /* the partner copies received */
  const char *name;         /* the checkpoint's */
  bool replace;             /* a replace= commit */
  bool remote;              /* not the coordinator's node (flush records) */
} ckpt_save_view_t;
void ckpt__save_view(ckpt_dist_job_t *job, ckpt_save_view_t *v);

/* ------------------------------------------------------------------------
 * Partner copies (partner.c, -o tier_level=partner): dist's partner ops.
 * Each rank's data files go to its partner rank's tier, into the save's
 * own TIER/.saves/SAVE_ID there, under the owner's names.
 * ---------------------------------------------------------------------- */
int ckpt__partner_files(void *ctx, ckpt_dist_job_t *job, int partner,
                        ckpt_dist_file_t **files, uint32_t *n, char **err);
int ckpt__partner_open(void *ctx, ckpt_dist_job_t *job, int owner,
                       const char *name, uint64_t size, char **err);
int ckpt__partner_close(void *ctx, ckpt_dist_job_t *job, int fd, bool ok,
                        char **err);
/* A failed save: remove the partner copies it received (dirfd: the save's
 * directory) and their flush records, and forget them. */
void ckpt__partner_discard(ckpt_fs_t *fs, ckpt_partner_rx_t **rx, int dirfd,
                           const char *save_id);
void ckpt__partner_rx_free(ckpt_partner_rx_t *rx);

/* ------------------------------------------------------------------------
 * Job processes (jobs.c): a process that declared itself a job of the
 * mount (setxattr MOUNTPOINT user.ckpt.job LABEL) is watched; when it
 * exits without "end", its saves that are not committed are abandoned
 * (ckpt__jobs_gone).
 * ---------------------------------------------------------------------- */
#define CKPT_JOB_XATTR "user.ckpt.job"
#define CKPT_JOB_LABEL_MAX 128
typedef struct ckpt_jobs ckpt_jobs_t;
int ckpt__jobs_start(ckpt_fs_t *fs);
void ckpt__jobs_stop(ckpt_fs_t *fs);
/* setxattr user.ckpt.job by thread tid: declare its process a job (value
 * its label), or "end" it. 0 or -errno. */
int ckpt__job_declare(ckpt_fs_t *fs, pid_t tid, const char *value,
                      size_t size);
/* The job process of thread tid (its tgid), or 0 if it is none. No lock
 * held (reads /proc). */
pid_t ckpt__job_of(ckpt_fs_t *fs, pid_t tid);
pid_t ckpt__tgid_of(pid_t tid);
/* Is job process tgid alive (watched)? Its label into buf. Any lock may
 * be held (jobs.c's lock is a leaf). */
bool ckpt__job_label(ckpt_fs_t *fs, pid_t tgid, char *buf, size_t size);
/* Job process tgid (label) exited without "end": abandon its saves that
 * are not committed (save.c). Called by the watcher, no lock held. */
void ckpt__jobs_gone(ckpt_fs_t *fs, pid_t tgid, const char *label);

#endif /* CKPT_FS_COMMIT_H */
