/*
 * dist_int.h - private to dist/: the transport under the save protocol.
 *
 * The protocol runner (dist.c) moves framed messages through a transport:
 * the world of one (local.c) or, under a launcher, MPI. A frame is one
 * status byte (CKPT__FRAME_OK or CKPT__FRAME_FAIL) followed by the payload
 * (OK) or the reason text (FAIL).
 */
#ifndef CKPT_DIST_INT_H
#define CKPT_DIST_INT_H

#include <pthread.h>

#include "ckpt_dist.h"

enum { CKPT__FRAME_OK = 1, CKPT__FRAME_FAIL = 2 };

typedef struct {
  /* Every rank gives mine; the coordinator receives all[size]. */
  int (*gather)(ckpt_dist_t *d, const ckpt_buf_t *mine, ckpt_buf_t *all,
                char **err);
  /* The coordinator gives all[size]; every rank receives mine. */
  int (*scatter)(ckpt_dist_t *d, const ckpt_buf_t *all, ckpt_buf_t *mine,
                 char **err);
  /* The coordinator's msg reaches every rank. */
  int (*bcast)(ckpt_dist_t *d, ckpt_buf_t *msg, char **err);
} ckpt__transport_t;

struct ckpt_dist {
  int rank;
  int size;
  bool launched;
  const ckpt__transport_t *transport;
  const ckpt_save_ops_t *ops;
  void *ctx;
  double commit_timeout; /* seconds */
  pthread_t thread;
  bool started;
  pthread_mutex_t lock;  /* protects head, tail, stopping */
  pthread_cond_t cond;
  ckpt_dist_job_t *head; /* queued saves, FIFO */
  ckpt_dist_job_t *tail;
  bool stopping;
};

extern const ckpt__transport_t ckpt__local_transport;

#endif /* CKPT_DIST_INT_H */
