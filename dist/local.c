/*
 * local.c - the transport of a world of one rank: every collective is the
 * identity, no MPI call is made.
 */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "dist_int.h"

static int copy_buf(const ckpt_buf_t *src, ckpt_buf_t *dst) {
  dst->len = 0;
  return ckpt_buf_append(dst, src->data, src->len);
}

static int local_gather(ckpt_dist_t *d, const ckpt_buf_t *mine,
                        ckpt_buf_t *all, char **err) {
  assert(d->size == 1);
  (void)d;
  (void)err;
  return copy_buf(mine, &all[0]);
}

static int local_scatter(ckpt_dist_t *d, const ckpt_buf_t *all,
                         ckpt_buf_t *mine, char **err) {
  assert(d->size == 1);
  (void)d;
  (void)err;
  return copy_buf(&all[0], mine);
}

static int local_bcast(ckpt_dist_t *d, ckpt_buf_t *msg, char **err) {
  assert(d->size == 1);
  (void)d;
  (void)msg;
  (void)err;
  return 0;
}

const ckpt__transport_t ckpt__local_transport = {
    .gather = local_gather,
    .scatter = local_scatter,
    .bcast = local_bcast,
};
