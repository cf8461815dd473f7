/*
 * dist_int.h - private to dist/.
 *
 * The protocol (dist.c) runs on the dist thread: the coordinator (rank 0)
 * drives rounds, the other ranks are clients. Messages are point-to-point
 * and never block without a deadline (mpi.c), so a missing or late rank
 * turns into a failed round, not a hang:
 *
 *   tag          direction      body
 *   PLAN         client -> 0    u32 seq, u16 name length, name, frame;
 *                               or u32 seq, u16 0: the client gave up on
 *                               save seq (no answer in time), so a PLAN
 *                               of it that is still on its way is stale
 *   PLAN_REPLY   0 -> client    u32 seq, u32 round, frame (rank plan)
 *   RESULT       client -> 0    u32 round, frame (write result)
 *   OUTCOME      0 -> client    u32 round, frame (empty, or the reason)
 *   DISCARDED    client -> 0    u32 round (its files of a failed save are
 *                               gone)
 *   STOPPED      0 -> client    u32 0 (the coordinator has stopped: no
 *                               save can run any more)
 *   PARTNER      rank <-> rank  u32 round, u8 kind, body (partner.c):
 *                               the partner copies of a round, between a
 *                               rank and its partner
 *
 * A frame is one status byte, CKPT__FRAME_OK followed by the payload or
 * CKPT__FRAME_FAIL followed by the reason text. seq counts a client's
 * saves; round counts the coordinator's. Messages of an older seq or round
 * are stale and dropped; so is a PLAN of a save its client gave up on
 * (the coordinator keeps the last such seq per client): a late message
 * of an abandoned round never counts in a later one.
 */
#ifndef CKPT_DIST_INT_H
#define CKPT_DIST_INT_H

#include <pthread.h>

#include "ckpt_dist.h"

/* CKPT__FRAME_EXISTS: failed because the name was committed elsewhere
 * (the save reports EEXIST on every rank); reason text as for FAIL. */
enum { CKPT__FRAME_OK = 1, CKPT__FRAME_FAIL = 2, CKPT__FRAME_EXISTS = 3 };

enum {
  CKPT__TAG_PLAN = 101,
  CKPT__TAG_PLAN_REPLY,
  CKPT__TAG_RESULT,
  CKPT__TAG_OUTCOME,
  CKPT__TAG_DISCARDED,
  CKPT__TAG_STOPPED,
  CKPT__TAG_PARTNER,
};

typedef struct ckpt__pending ckpt__pending_t; /* an unfinished send */
#define CKPT__SPARES 9 /* partner.c's frames in flight, and one */
/* The sizes of buffer kept: a partner frame's (4 MiB; smaller ones, a
 * file's last frame, are freed) */
#define CKPT__SPARE_MIN ((size_t)1 << 20)
#define CKPT__SPARE_MAX ((size_t)8 << 20)
typedef struct ckpt__recv ckpt__recv_t;       /* an unfinished receive */

struct ckpt_dist {
  int rank;
  int size;
  bool launched;          /* MPI is in use (size may still be 1) */
  const ckpt_save_ops_t *ops;
  void *ctx;
  double commit_timeout;  /* seconds */
  pthread_t thread;
  bool thread_running;
  pthread_mutex_t lock;   /* protects everything below */
  pthread_cond_t cond;
  bool ready;             /* MPI is up: rank and size are known */
  int init_rc;            /* MPI start-up result */
  char *init_err;
  bool started;           /* ops are set: the protocol may run */
  bool stopping;          /* ckpt_dist_stop: drain the queue, then idle */
  bool drained;           /* the dist thread runs no save any more */
  bool leaving;           /* ckpt_dist_destroy: leave the world (MPI) */
  ckpt_dist_job_t *head;  /* queued saves, FIFO */
  ckpt_dist_job_t *tail;
  /* dist thread only: */
  uint32_t seq;           /* client: saves sent */
  uint32_t round;         /* coordinator: rounds run */
  uint32_t *gave_up;      /* coordinator: per client, the last seq it gave
                             up on (NULL until the first round) */
  bool coord_stopped;     /* client: rank 0 sent STOPPED */
  ckpt__pending_t *pending; /* sends not yet completed */
  ckpt__recv_t *abandoned;  /* receives given up on: their buffers stay
                               MPI's until it is finalized */
  /* Partner frames' buffers whose sends completed, kept for the next
   * frames and commits (ckpt__mpi_buf; up to 36 MiB until finalize):
   * memory already mapped instead of fresh pages faulted in for every
   * frame. */
  ckpt_buf_t spare[CKPT__SPARES];
  int nspare;
  void *comm;             /* mpi.c's communicator */
  /* Set before ready, read-only after: */
  int *node_of;           /* per world rank, its node (NULL: world of one) */
  int nodes;              /* nodes of the world */
  /* per world rank, its host's name (gethostname; NULL: world of one,
   * self_host) */
  char (*host)[CKPT_DIST_HOST_MAX];
  char self_host[CKPT_DIST_HOST_MAX];
};

/* mpi.c: the only MPI user. Called on the dist thread only. */
bool ckpt__mpi_launched(void);
int ckpt__mpi_init(ckpt_dist_t *d, char **err);
void ckpt__mpi_finalize(ckpt_dist_t *d);
/* Stop every rank of the world (a rank that cannot take part). */
void ckpt__mpi_abort(ckpt_dist_t *d, int code);
/* Send msg to dest without blocking; takes ownership of msg's data. */
int ckpt__mpi_send(ckpt_dist_t *d, int dest, int tag, ckpt_buf_t *msg);
/* Receive one message of tag (from any rank if src < 0) if one is there:
 * 1 with *from and out set, 0 if none, < 0 on error. */
int ckpt__mpi_poll(ckpt_dist_t *d, int src, int tag, int *from,
                   ckpt_buf_t *out);
/* Complete what sends can complete; true when none is pending. */
bool ckpt__mpi_progress(ckpt_dist_t *d);
/* Sends of tag whose message begins with the u32 key, not yet complete. */
int ckpt__mpi_pending(ckpt_dist_t *d, int tag, uint32_t key);
/* An empty buffer for a message of up to size bytes: a spare one when one
 * is large enough, else b untouched (ckpt_buf_reserve grows it). */
void ckpt__mpi_buf(ckpt_dist_t *d, ckpt_buf_t *b, size_t size);
/* Receives that never block (large messages): start receiving one message
 * of tag (from any rank if src < 0) if one has come, into buf (taken, and
 * given back with the message by ckpt__mpi_recv_done): 1 with *r, 0 if
 * none, < 0 on error. */
int ckpt__mpi_recv_start(ckpt_dist_t *d, int src, int tag, ckpt_buf_t *buf,
                         ckpt__recv_t **r);
/* 1: r is complete and freed, buf holds its message from *from; 0: not
 * yet; < 0: it failed (r is freed, buf given back empty). */
int ckpt__mpi_recv_done(ckpt_dist_t *d, ckpt__recv_t *r, int *from,
                        ckpt_buf_t *buf);
/* Give up on r, unfinished: MPI may still write into its buffer, which is
 * freed once MPI is finalized. */
void ckpt__mpi_recv_abandon(ckpt_dist_t *d, ckpt__recv_t *r);

/* dist.c, for partner.c. */
double ckpt__now(void);
void ckpt__pause_poll(unsigned *spins);
int ckpt__put_u32(ckpt_buf_t *b, uint32_t v);
uint32_t ckpt__get_u32(const uint8_t *p);
void ckpt__waiting(ckpt_dist_t *d, ckpt_dist_job_t *job, const char *what,
                   double until);

/* partner.c: the partner copies of job in round, after this rank's writes
 * (wrote: write_step succeeded; if not, the ranks it exchanges with are
 * only told that nothing comes). 0, or -errno with *err (malloc'd). */
int ckpt__partner_exchange(ckpt_dist_t *d, ckpt_dist_job_t *job,
                           uint32_t round, bool wrote, char **err);

#endif /* CKPT_DIST_INT_H */
