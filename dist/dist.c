/*
 * dist.c - the dist thread and the save protocol runner.
 *
 * Saves are queued by the FUSE layer (ckpt_dist_submit) and run one after
 * the other, in submission order, on the dist thread. Each protocol step
 * exchanges framed messages through the transport (dist_int.h); a step that
 * fails anywhere turns into a FAIL frame that travels the same way, so every
 * rank reaches the end of the protocol and learns the same outcome.
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"

/* ------------------------------------------------------------------------
 * Frames.
 * ---------------------------------------------------------------------- */

/* Wrap a step's outcome: payload (rc 0) or reason (rc < 0). */
static int frame(int rc, const char *reason, int rank, const ckpt_buf_t *payload,
                 ckpt_buf_t *out) {
  out->len = 0;
  if (rc == 0) {
    uint8_t tag = CKPT__FRAME_OK;
    int r = ckpt_buf_append(out, &tag, 1);
    return r ? r : ckpt_buf_append(out, payload->data, payload->len);
  }
  uint8_t tag = CKPT__FRAME_FAIL;
  int r = ckpt_buf_append(out, &tag, 1);
  if (r)
    return r;
  if (reason)
    return ckpt_buf_append(out, reason, strlen(reason));
  return ckpt_buf_printf(out, "rank %d: %s", rank, strerror(-rc));
}

static bool frame_ok(const ckpt_buf_t *f) {
  return f->len >= 1 && f->data[0] == CKPT__FRAME_OK;
}

/* Append the reason of a FAIL frame (or of a malformed one) to reasons. */
static void collect_reason(const ckpt_buf_t *f, int rank, ckpt_buf_t *reasons) {
  if (reasons->len)
    ckpt_buf_printf(reasons, "\n");
  if (f->len >= 1 && f->data[0] == CKPT__FRAME_FAIL)
    ckpt_buf_printf(reasons, "%.*s", (int)(f->len - 1),
                    (const char *)f->data + 1);
  else
    ckpt_buf_printf(reasons, "rank %d: malformed protocol message", rank);
}

/* The payload of an OK frame, as a view (not owned). */
static ckpt_buf_t payload_of(const ckpt_buf_t *f) {
  ckpt_buf_t v = {.data = f->data + 1, .len = f->len - 1, .cap = 0};
  return v;
}

static ckpt_buf_t *buf_array(int n) {
  return n > 0 ? calloc((size_t)n, sizeof(ckpt_buf_t)) : NULL;
}

static void buf_array_free(ckpt_buf_t *a, int n) {
  if (!a)
    return;
  for (int i = 0; i < n; i++)
    ckpt_buf_free(&a[i]);
  free(a);
}

/* ------------------------------------------------------------------------
 * The protocol.
 * ---------------------------------------------------------------------- */

/* Prefix a step's own reason with the rank unless it already names one. */
static char *ranked_reason(int rank, char *err) {
  if (!err)
    return NULL;
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  if (strncmp(err, "rank", 4) != 0)
    ckpt_buf_printf(&b, "rank %d: ", rank);
  ckpt_buf_printf(&b, "%s", err);
  free(err);
  return ckpt_buf_steal(&b);
}

/*
 * Run one save:
 *  1. every rank: local_step; gather the frames at the coordinator;
 *  2. coordinator: global_step unless a rank failed; scatter the plans (or
 *     the reason, to every rank);
 *  3. every rank: write_step; gather the result frames;
 *  4. coordinator: finish_step unless a rank failed; broadcast the outcome;
 *  5. on failure after step 3 began: discard_step everywhere, a gather so
 *     that every rank is done, and discard_step(all_done) at the
 *     coordinator;
 *  6. every rank: done().
 */
static void run_save(ckpt_dist_t *d, ckpt_dist_job_t *job) {
  const ckpt_save_ops_t *ops = d->ops;
  const ckpt__transport_t *t = d->transport;
  bool coord = d->rank == 0;
  int n = d->size;
  ckpt_buf_t mine, framed, step_out;
  ckpt_buf_t *all = coord ? buf_array(n) : NULL;
  ckpt_buf_t *outs = coord ? buf_array(n) : NULL;
  ckpt_buf_t reasons;
  char *err = NULL;
  bool wrote = false;
  int rc;

  ckpt_buf_init(&mine);
  ckpt_buf_init(&framed);
  ckpt_buf_init(&step_out);
  ckpt_buf_init(&reasons);
  if (coord && (!all || !outs)) {
    rc = -ENOMEM;
    goto out;
  }

  /* 1. local plans */
  rc = ops->local_step(d->ctx, job, &step_out, &err);
  err = ranked_reason(d->rank, err);
  if ((rc = frame(rc, err, d->rank, &step_out, &framed)) != 0)
    goto out;
  free(err), err = NULL;
  if ((rc = t->gather(d, &framed, all, &err)) != 0)
    goto out;

  /* 2. global plan */
  if (coord) {
    for (int r = 0; r < n; r++)
      if (!frame_ok(&all[r]))
        collect_reason(&all[r], r, &reasons);
    if (reasons.len == 0) {
      ckpt_buf_t *views = buf_array(n);
      ckpt_buf_t *plans = buf_array(n);
      if (!views || !plans) {
        rc = -ENOMEM;
      } else {
        for (int r = 0; r < n; r++)
          views[r] = payload_of(&all[r]);
        rc = ops->global_step(d->ctx, job, views, n, plans, &err);
      }
      free(views); /* views do not own their data */
      for (int r = 0; r < n && rc == 0; r++)
        rc = frame(0, NULL, r, &plans[r], &outs[r]);
      buf_array_free(plans, n);
      if (rc != 0)
        ckpt_buf_printf(&reasons, "%s", err ? err : strerror(-rc));
      free(err), err = NULL;
    }
    if (reasons.len)
      for (int r = 0; r < n; r++)
        frame(-EIO, (const char *)reasons.data, r, NULL, &outs[r]);
  }
  if ((rc = t->scatter(d, outs, &mine, &err)) != 0)
    goto out;
  if (!frame_ok(&mine)) {
    reasons.len = 0;
    collect_reason(&mine, 0, &reasons);
    rc = -EIO;
    goto out;
  }

  /* 3. writes */
  wrote = true;
  ckpt_buf_t plan = payload_of(&mine);
  step_out.len = 0;
  rc = ops->write_step(d->ctx, job, &plan, &step_out, &err);
  err = ranked_reason(d->rank, err);
  if ((rc = frame(rc, err, d->rank, &step_out, &framed)) != 0)
    goto out;
  free(err), err = NULL;
  if ((rc = t->gather(d, &framed, all, &err)) != 0)
    goto out;

  /* 4. metadata and outcome */
  framed.len = 0;
  if (coord) {
    for (int r = 0; r < n; r++)
      if (!frame_ok(&all[r]))
        collect_reason(&all[r], r, &reasons);
    if (reasons.len == 0) {
      ckpt_buf_t *views = buf_array(n);
      if (!views) {
        rc = -ENOMEM;
      } else {
        for (int r = 0; r < n; r++)
          views[r] = payload_of(&all[r]);
        rc = ops->finish_step(d->ctx, job, views, n, &err);
        free(views);
      }
      if (rc != 0)
        ckpt_buf_printf(&reasons, "%s", err ? err : strerror(-rc));
      free(err), err = NULL;
    }
    ckpt_buf_t empty = {0};
    frame(reasons.len ? -EIO : 0, (const char *)reasons.data, 0, &empty,
          &framed);
  }
  if ((rc = t->bcast(d, &framed, &err)) != 0)
    goto out;
  if (!frame_ok(&framed)) {
    reasons.len = 0;
    collect_reason(&framed, 0, &reasons);
    rc = -EIO;
  }

out:
  if (rc != 0 && reasons.len == 0)
    ckpt_buf_printf(&reasons, "rank %d: %s", d->rank,
                    err ? err : strerror(-rc));
  free(err);
  if (rc != 0 && wrote) {
    /* 5. nothing of a failed save may stay behind */
    ops->discard_step(d->ctx, job, false);
    ckpt_buf_t empty = {0}, *sink = coord ? buf_array(n) : NULL;
    char *gerr = NULL;
    if (t->gather(d, &empty, sink, &gerr) == 0 && coord)
      ops->discard_step(d->ctx, job, true);
    free(gerr);
    buf_array_free(sink, n);
  }
  /* 6. */
  ops->done(d->ctx, job, rc ? -EIO : 0,
            rc ? (const char *)reasons.data : NULL);
  ckpt_buf_free(&mine);
  ckpt_buf_free(&framed);
  ckpt_buf_free(&step_out);
  ckpt_buf_free(&reasons);
  buf_array_free(all, n);
  buf_array_free(outs, n);
}

/* ------------------------------------------------------------------------
 * The dist thread and its queue.
 * ---------------------------------------------------------------------- */

static void *dist_main(void *arg) {
  ckpt_dist_t *d = arg;
  pthread_mutex_lock(&d->lock);
  for (;;) {
    while (!d->head && !d->stopping)
      pthread_cond_wait(&d->cond, &d->lock);
    ckpt_dist_job_t *job = d->head;
    if (!job)
      break; /* stopping, and the queue is drained */
    d->head = job->next;
    if (!d->head)
      d->tail = NULL;
    pthread_mutex_unlock(&d->lock);
    run_save(d, job);
    pthread_mutex_lock(&d->lock);
  }
  pthread_mutex_unlock(&d->lock);
  return NULL;
}

int ckpt_dist_init(ckpt_dist_t **out, char **err) {
  ckpt_dist_t *d = calloc(1, sizeof(*d));
  if (!d) {
    *err = strdup("out of memory");
    return -ENOMEM;
  }
  pthread_mutex_init(&d->lock, NULL);
  pthread_cond_init(&d->cond, NULL);
  d->rank = 0;
  d->size = 1;
  d->launched = false;
  d->transport = &ckpt__local_transport;
  *out = d;
  return 0;
}

int ckpt_dist_rank(const ckpt_dist_t *d) { return d->rank; }
int ckpt_dist_size(const ckpt_dist_t *d) { return d->size; }
bool ckpt_dist_launched(const ckpt_dist_t *d) { return d->launched; }

int ckpt_dist_start(ckpt_dist_t *d, const ckpt_save_ops_t *ops, void *ctx,
                    double commit_timeout) {
  assert(!d->started);
  d->ops = ops;
  d->ctx = ctx;
  d->commit_timeout = commit_timeout;
  int rc = pthread_create(&d->thread, NULL, dist_main, d);
  if (rc)
    return -rc;
  d->started = true;
  return 0;
}

void ckpt_dist_submit(ckpt_dist_t *d, ckpt_dist_job_t *job) {
  assert(d->started);
  job->next = NULL;
  pthread_mutex_lock(&d->lock);
  if (d->tail)
    d->tail->next = job;
  else
    d->head = job;
  d->tail = job;
  pthread_cond_signal(&d->cond);
  pthread_mutex_unlock(&d->lock);
}

void ckpt_dist_stop(ckpt_dist_t *d) {
  if (!d->started)
    return;
  pthread_mutex_lock(&d->lock);
  d->stopping = true;
  pthread_cond_signal(&d->cond);
  pthread_mutex_unlock(&d->lock);
  pthread_join(d->thread, NULL);
  d->started = false;
}

void ckpt_dist_destroy(ckpt_dist_t *d) {
  if (!d)
    return;
  ckpt_dist_stop(d);
  pthread_mutex_destroy(&d->lock);
  pthread_cond_destroy(&d->cond);
  free(d);
}
