/*
 * ckpt_dist.h - the collective save protocol of ckptfs.
 *
 * dist owns one thread per daemon that runs every save, in submission
 * order, through DCP's protocol:
 *
 *   all ranks     local_step   -> local plan message
 *   gather to the coordinator (rank 0)
 *   coordinator   global_step  -> one plan message per rank (or a reason)
 *   scatter
 *   all ranks     write_step   -> write result message
 *   all ranks     partner copies (a job with partner set): each rank's
 *                 files to its partner rank, the files of the ranks it
 *                 is the partner of from them, written and synced here
 *   gather to the coordinator
 *   coordinator   finish_step  -> publish the metadata (or a reason),
 *                                 and the outcome's payload
 *   broadcast of the outcome
 *   other ranks   publish_step (optional) with the outcome's payload
 *   all ranks     done(rc, reason)
 *
 * A step that fails on any rank fails the save on every rank, with the
 * reasons of every failing rank. When a save fails after its writes may
 * have begun, every rank runs discard_step(all_done=false) to remove what
 * it wrote, and then the coordinator runs discard_step(all_done=true) to
 * remove what is shared.
 *
 * Steps run on the dist thread, never on a FUSE thread; the thread that
 * runs them is the only one that calls MPI. At world size 1 no MPI call is
 * made at all.
 */
#ifndef CKPT_DIST_H
#define CKPT_DIST_H

#include <stdatomic.h>
#include <stdbool.h>

#include "ckpt_planner.h"

/* The reason of a save cancelled because its job is gone. */
#define CKPT_DIST_ABANDONED                                                 \
  "abandoned: the job that wrote it is gone (it exited before every rank " \
  "committed this checkpoint)"

typedef struct ckpt_dist ckpt_dist_t;
typedef struct ckpt_dist_job ckpt_dist_job_t;

/* One save, queued by the caller; owned by the caller until done(). */
struct ckpt_dist_job {
  char name[256];        /* checkpoint name, the same on every rank */
  bool solo;             /* this rank alone, as a world of one: its steps
                            run here, no message is sent or awaited */
  bool partner;          /* copy each rank's data files to its partner
                            rank before its result (partner_files) */
  void *user;            /* the caller's save state */
  /* Set by the caller when the job that wrote the save is gone (its
   * process exited before every rank committed it): a save whose plans
   * are not all in 2 s later fails on every rank, as abandoned (the clients'
   * cancel travels to the coordinator as a gave-up PLAN, which fails the
   * round there); once every plan is in, the save goes on. */
  _Atomic bool cancel;
  ckpt_dist_job_t *next; /* queue link, owned by dist */
};

/* A data file of this rank for its partner (partner_files). */
#define CKPT_DIST_FILE_NAME_MAX 64
typedef struct {
  char name[CKPT_DIST_FILE_NAME_MAX]; /* the owner's file name */
  int fd;                             /* open for reading */
  uint64_t size;                      /* bytes sent: [0, size) */
} ckpt_dist_file_t;

/*
 * The caller's side of the protocol. Steps return 0, or a negative errno
 * with *err set to a malloc'd reason (which dist frees).
 */
typedef struct {
  int (*local_step)(void *ctx, ckpt_dist_job_t *job, ckpt_buf_t *plan,
                    char **err);
  /* Coordinator: plans[n] in rank order -> rank_plans[n]. */
  int (*global_step)(void *ctx, ckpt_dist_job_t *job, const ckpt_buf_t *plans,
                     int n, ckpt_buf_t *rank_plans, char **err);
  int (*write_step)(void *ctx, ckpt_dist_job_t *job,
                    const ckpt_buf_t *rank_plan, ckpt_buf_t *result,
                    char **err);
  /* Coordinator: results[n] in rank order. What it appends to outcome
   * goes to every other rank's publish_step. */
  int (*finish_step)(void *ctx, ckpt_dist_job_t *job,
                     const ckpt_buf_t *results, int n, ckpt_buf_t *outcome,
                     char **err);
  /* Optional, every rank but the coordinator, once the save is committed
   * (before done): the coordinator's outcome payload (e.g. the metadata,
   * for a node-local tier of another node). The save is committed
   * whatever it does: it reports its own trouble. */
  void (*publish_step)(void *ctx, ckpt_dist_job_t *job,
                       const ckpt_buf_t *outcome);
  void (*discard_step)(void *ctx, ckpt_dist_job_t *job, bool all_done);
  /* Every rank, last: rc 0 and reason NULL when the save is committed;
   * else -EEXIST (the name was committed elsewhere), or the -errno of the
   * failure as this rank saw it (its own step's; -EIO for another rank's
   * failure, which the reason words), with the reason. */
  void (*done)(void *ctx, ckpt_dist_job_t *job, int rc, const char *reason);
  /* Partner copies, for a job with partner set, on every rank whose
   * write_step succeeded, before its result is sent (the coordinator's
   * too). partner_files: the files to send to rank partner (-1: the world
   * is on one node, there is none): *files, malloc'd, n of them; dist
   * closes each fd and frees the array. partner_open: a file of rank
   * owner comes (name as the owner gave it, size bytes): a descriptor to
   * write it into, or -errno. partner_close: the file is complete (ok:
   * make it durable) or the exchange failed (ok false: close only); fd is
   * closed either way. A received file of a save that then fails is the
   * caller's to remove (discard_step). All three or none. */
  int (*partner_files)(void *ctx, ckpt_dist_job_t *job, int partner,
                       ckpt_dist_file_t **files, uint32_t *n, char **err);
  int (*partner_open)(void *ctx, ckpt_dist_job_t *job, int owner,
                      const char *name, uint64_t size, char **err);
  int (*partner_close)(void *ctx, ckpt_dist_job_t *job, int fd, bool ok,
                       char **err);
  /* Optional: what the save waits for now ("rank 1 and rank 3 to commit
   * NAME", NULL: nothing), and until when (CLOCK_MONOTONIC seconds, 0: no
   * deadline). Called on the dist thread whenever that changes. */
  void (*waiting)(void *ctx, ckpt_dist_job_t *job, const char *what,
                  double until);
} ckpt_save_ops_t;

/*
 * Set up the world: under an MPI launcher (mpirun), the MPI world; else a
 * world of one rank with no MPI at all. Call before any thread is started.
 * Returns 0 or a negative errno with *err set.
 */
int ckpt_dist_init(ckpt_dist_t **out, char **err);
int ckpt_dist_rank(const ckpt_dist_t *d);
int ckpt_dist_size(const ckpt_dist_t *d);
/* True when started by an MPI launcher. */
bool ckpt_dist_launched(const ckpt_dist_t *d);
/* Nodes: ranks that MPI lets share memory (MPI_COMM_TYPE_SHARED) are one
 * node; node k is the k-th in the order of its lowest world rank. A world
 * of one, or without MPI, is node 0 of 1. Fixed after ckpt_dist_init. */
int ckpt_dist_nodes(const ckpt_dist_t *d);
int ckpt_dist_node_of(const ckpt_dist_t *d, int rank); /* -1: no such rank */
/* The rank that keeps a partner copy of rank's data: the rank of the same
 * index among its node's ranks on the next node (node + 1 mod nodes; the
 * index wraps on a node with fewer ranks). -1 with fewer than 2 nodes. */
int ckpt_dist_partner(const ckpt_dist_t *d, int rank);
/* The name of rank's host (its gethostname, gathered at start-up): what
 * says whether a node of an earlier world is in this one (a flush of
 * partner copies, fs/tier/flush.c). "" for no such rank. */
#define CKPT_DIST_HOST_MAX 256
const char *ckpt_dist_node_name(const ckpt_dist_t *d, int rank);

/* Start the dist thread. commit_timeout: seconds a save waits for every
 * rank. A client rank that hears nothing from the coordinator gives up
 * after ckpt_dist_client_wait(commit_timeout) seconds. */
int ckpt_dist_start(ckpt_dist_t *d, const ckpt_save_ops_t *ops, void *ctx,
                    double commit_timeout);
/* Seconds a client rank waits for the coordinator's answer to its plan
 * before giving up: the coordinator waits commit_timeout for every rank,
 * may first finish the discard of a failed save (commit_timeout), and
 * plans (its own checksums, the global plan: the 30 s). */
double ckpt_dist_client_wait(double commit_timeout);
/* Queue a save; it runs after every save queued before it. Returns 0, or
 * -ESHUTDOWN once ckpt_dist_stop was called (the job is not queued). */
int ckpt_dist_submit(ckpt_dist_t *d, ckpt_dist_job_t *job);
/* Run every queued save to its end; no save runs once it returns. The
 * world is not left yet: unmount first, then ckpt_dist_destroy. */
void ckpt_dist_stop(ckpt_dist_t *d);
/* Stop, leave the world and free d. Under MPI, leaving waits until every
 * rank of the world leaves (MPI_Finalize). */
void ckpt_dist_destroy(ckpt_dist_t *d);

#endif /* CKPT_DIST_H */
