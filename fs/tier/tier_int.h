/*
 * tier_int.h - private to fs/tier: the flusher's jobs and queue, shared by
 * flush.c (the thread and its steps), copy.c (the verified copy) and
 * recover.c (the records left by earlier mounts).
 */
#ifndef CKPT_TIER_INT_H
#define CKPT_TIER_INT_H

#include "tier.h"

#define FLUSH_STEP ((size_t)8 << 20) /* bytes per read and write */
#define BACKOFF_FIRST 1.0            /* seconds, doubled up to ... */
#define BACKOFF_MAX 60.0

typedef struct flush_job {
  char name[256];
  char save_id[CKPT_SAVE_ID_LEN + 1];
  int rank;         /* whose files: the record's R */
  char rec[CKPT_SAVE_ID_LEN + 16]; /* the record's name in .flush */
  bool replace;
  bool publishing;  /* the record says the shared publish was under way */
  bool remote;      /* the tier is not the coordinator's node's: its
                       checkpoint is published here from the OUTCOME */
  bool partner;     /* a partner record: rank's copies, kept here for
                       another node (host), flushed only when it cannot */
  char host[CKPT_DIST_HOST_MAX];
  bool taken;       /* partner: this mount flushes them (its turn came) */
  bool dropped;     /* partner: over, the owner's node flushed them */
  double queued_at; /* CLOCK_MONOTONIC s this mount queued it */
  char backing[PATH_MAX]; /* the BACKING_DIR it goes to (absolute) */
  /* waiting for other ranks' files (step 4): */
  bool copied;      /* this rank's files and .metadata are linked */
  int held;         /* BACKING_DIR/.saves/SAVE_ID, held, or -1 */
  double not_before; /* CLOCK_MONOTONIC s of its next try */
  double backoff;
  bool superseded;  /* its publish found BACKING_DIR/NAME changed since
                       its commit (a later save, or removed): never
                       published (resolve.c's rule) */
  struct flush_job *next;
} flush_job_t;

struct ckpt_flush {
  ckpt_fs_t *fs;
  pthread_t thread;
  bool started;           /* thread runs */
  pthread_mutex_t lock;   /* protects everything below */
  pthread_cond_t cond;    /* a job queued, or stop */
  flush_job_t *head, *tail;
  bool stop;
  double next_at;         /* token bucket: when the next step may start
                             (CLOCK_MONOTONIC s); flush thread only */
};

bool ckpt__tier_published(ckpt_fs_t *fs, const flush_job_t *j);
int ckpt__tier_partner_turn(ckpt_flush_t *f, flush_job_t *j, int src,
                        char **err);
int ckpt__tier_flush_one(ckpt_flush_t *f, flush_job_t *j, char **err);
bool ckpt__tier_transient(int rc);
int ckpt__tier_read_record(int dfd, const char *rec, flush_job_t *j);
bool ckpt__tier_mine(const ckpt_fs_t *fs, int rank, bool partner);
int ckpt__tier_save_id_of(int root_fd, const char *name,
                      char out[CKPT_SAVE_ID_LEN + 1]);
void ckpt__tier_save_id_at(int root_fd, const char *name,
                       char out[CKPT_SAVE_ID_LEN + 1]);
void ckpt__tier_each_record(ckpt_fs_t *fs,
                        void (*fn)(ckpt_fs_t *fs, int dfd, const char *id,
                                   void *arg),
                        void *arg);
bool ckpt__tier_saves_dir_exists(int root_fd, const char *save_id);
void ckpt__tier_recover_record(ckpt_fs_t *fs, int dfd, const char *id,
                           void *arg);
ckpt_ckpt_t *ckpt__tier_tree_ckpt(ckpt_fs_t *fs, const char *name,
                              const char *save_id);
void ckpt__tier_set_why(ckpt_fs_t *fs, const flush_job_t *j, char *why);
int ckpt__tier_link_tmpfile(ckpt_flush_t *f, const ckpt_metadata_t *m, int fd,
                        int dirfd, const char *name, int32_t rank,
                        uint32_t k, off_t size);
int ckpt__tier_copy_metadata(ckpt_flush_t *f, const flush_job_t *j, int src,
                         int held, char **err);
int ckpt__tier_copy_data(ckpt_flush_t *f, const flush_job_t *j,
                     const ckpt_metadata_t *m, int src, int held,
                     bool *staged, char **err);

#endif /* CKPT_TIER_INT_H */
