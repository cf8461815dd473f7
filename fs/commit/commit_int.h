/*
 * commit_int.h - private to fs/commit: a save in flight, shared by save.c
 * (the freeze, the end of a save) and steps.c (the steps dist runs).
 */
#ifndef CKPT_COMMIT_INT_H
#define CKPT_COMMIT_INT_H

#include "commit.h"

/* Bytes gathered into one pwritev. */
#define WRITE_BATCH (8u << 20)

typedef struct ckpt_save {
  ckpt_dist_job_t job;   /* first: dist hands it back */
  ckpt_fs_t *fs;
  ckpt_ckpt_t *ck;       /* referenced */
  int rank;              /* this rank in the save's world: the mount's,
                            0 in a solo save (a world of one) */
  bool replace;          /* replace=TARGET: publish as job.name (TARGET),
                            over a committed TARGET */
  bool sync;             /* a sync commit waits in req */
  ckpt_commit_words_t words; /* as written to .commit: the coordinator's
                            retention words go into .metadata */
  fuse_req_t req;
  size_t reply_size;
  /* A sync writer killed while its save runs (fuse_req_interrupt_func):
   * answered at once with EINTR, so that it leaves the kernel; the save
   * goes on. Lock order: libfuse's lock of req, then reply_lock. */
  pthread_mutex_t reply_lock;
  bool replied;          /* req answered (by the interrupt); reply_lock */
  uint32_t nfiles;
  ckpt_node_t **files;   /* the frozen staged files, referenced */
  char **paths;          /* their paths in the checkpoint */
  ckpt_entry_attr_t *attrs; /* modes, owners, times of the staged files and
                              directories (the checkpoint's own: "") */
  uint32_t n_attrs, cap_attrs;
  uint64_t *checksums;   /* XXH3-64 of each file */
  ckpt_global_plan_t gp; /* coordinator: the global plan */
  bool have_gp;
  ckpt_rank_plan_t rp;   /* this rank's plan */
  bool have_rp;
  int dirfd;             /* ROOT/.saves/SAVE_ID, flock'ed shared, or -1 */
  /* Where the save goes: the tier, or BACKING_DIR (no tier, or a direct
   * save: `level=shared` with a tier, written as a mount without the
   * tier would, no flush) */
  bool direct;
  int root_fd;
  const char *root_path;
  _Atomic int failed_file; /* K of the first data file that failed, or -1 */
  uint64_t *stream_used; /* per stream: bytes its live files use */
  double began;          /* CLOCK_MONOTONIC s of the write to .commit */
  ckpt_partner_rx_t *partner_rx; /* partner copies received (partner.c) */
  char *abandoned;       /* job.cancel: why (ckpt__jobs_gone); fs->lock */
} ckpt_save_t;

int ckpt__cm_local_step(void *ctx, ckpt_dist_job_t *job, ckpt_buf_t *out,
                      char **err);
int ckpt__cm_global_step(void *ctx, ckpt_dist_job_t *job, const ckpt_buf_t *plans,
                       int n, ckpt_buf_t *rank_plans, char **err);
bool ckpt__cm_remote_node(ckpt_fs_t *fs, const ckpt_dist_job_t *job);
int ckpt__cm_write_step(void *ctx, ckpt_dist_job_t *job,
                      const ckpt_buf_t *plan, ckpt_buf_t *out, char **err);
int ckpt__cm_finish_step(void *ctx, ckpt_dist_job_t *job,
                       const ckpt_buf_t *results, int n, ckpt_buf_t *outcome,
                       char **err);
void ckpt__cm_publish_step(void *ctx, ckpt_dist_job_t *job,
                         const ckpt_buf_t *outcome);
void ckpt__cm_discard_step(void *ctx, ckpt_dist_job_t *job, bool all_done);
bool ckpt__cm_yield_to_winner(ckpt_fs_t *fs, ckpt_ckpt_t *ck, const char *name,
                            const char *reason);

#endif /* CKPT_COMMIT_INT_H */
