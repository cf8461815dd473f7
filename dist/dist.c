/*
 * dist.c - the dist thread and the collective save protocol.
 *
 * Saves are queued by the FUSE layer (ckpt_dist_submit) and run one after
 * the other, in submission order, on the dist thread: the only thread that
 * calls MPI (through mpi.c). Rank 0 is the coordinator and runs rounds
 * (coordinator_round); the other ranks are clients (client_save). At world
 * size 1 a round has no clients and no message is ever sent.
 *
 * A round on the coordinator:
 *  1. collect one PLAN per rank (its own from local_step) until every rank
 *     is in or commit_timeout has passed since the round began;
 *  2. fail every rank in the round if a rank is missing, if ranks commit
 *     different names, or if a rank's local step failed;
 *  3. global_step; send each client its PLAN_REPLY (plan or reason);
 *  4. write_step here, collect one RESULT per rank (deadline
 *     commit_timeout after the local writes);
 *  5. finish_step (metadata) unless a rank failed; send the OUTCOME (with
 *     finish_step's payload, for the clients' publish_step);
 *  6. failed after writes: discard_step here, collect DISCARDED, then
 *     discard_step(all_done);
 *  7. done().
 * Every wait has a deadline, so no daemon hangs on a rank that is gone,
 * and a failed round leaves the world ready for the next one.
 *
 * Stopping a rank (ckpt_dist_stop) drains its queue; it leaves the world
 * (MPI_Finalize, which waits for every rank) only in ckpt_dist_destroy,
 * after its unmount. A stopped coordinator tells the clients (STOPPED),
 * whose saves then fail at once instead of waiting for its answer.
 */
#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dist_int.h"

/* ------------------------------------------------------------------------
 * Small helpers: time, frames, message fields.
 * ---------------------------------------------------------------------- */

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Sleep a little while polling; the pause grows to 2 ms: 50 us for the
 * first ~1 ms, 250 us up to ~20 ms (a commit's steps wait that long for
 * the slowest rank: each wait ends at most 250 us late, not 2 ms), then
 * 2 ms (a long wait, for a rank still staging, wakes 500 times a second,
 * not 4000). */
static void pause_poll(unsigned *spins) {
  long ns = *spins < 20 ? 50000L : *spins < 100 ? 250000L : 2000000L;
  (*spins)++;
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

double ckpt_dist_client_wait(double commit_timeout) {
  return 2 * commit_timeout + 30;
}

/* How long a client waits for the coordinator before giving up. */
static double client_wait(const ckpt_dist_t *d) {
  return ckpt_dist_client_wait(d->commit_timeout);
}

/* Tell the caller what job waits for now (what NULL: nothing). */
static void waiting(ckpt_dist_t *d, ckpt_dist_job_t *job, const char *what,
                    double until) {
  if (job && d->ops->waiting)
    d->ops->waiting(d->ctx, job, what, until);
}

static int put_u32(ckpt_buf_t *b, uint32_t v) {
  uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16),
                  (uint8_t)(v >> 24)};
  return ckpt_buf_append(b, x, 4);
}

static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

/* The same, for partner.c. */
double ckpt__now(void) { return now(); }
void ckpt__pause_poll(unsigned *spins) { pause_poll(spins); }
int ckpt__put_u32(ckpt_buf_t *b, uint32_t v) { return put_u32(b, v); }
uint32_t ckpt__get_u32(const uint8_t *p) { return get_u32(p); }
void ckpt__waiting(ckpt_dist_t *d, ckpt_dist_job_t *job, const char *what,
                   double until) {
  waiting(d, job, what, until);
}

/* Append a frame: the payload (rc 0) or the reason (rc < 0). */
static int put_frame(ckpt_buf_t *out, int rc, const char *reason,
                     const ckpt_buf_t *payload) {
  uint8_t tag = rc == 0         ? CKPT__FRAME_OK
                : rc == -EEXIST ? CKPT__FRAME_EXISTS
                                : CKPT__FRAME_FAIL;
  int r = ckpt_buf_append(out, &tag, 1);
  if (r)
    return r;
  if (rc == 0)
    return payload ? ckpt_buf_append(out, payload->data, payload->len) : 0;
  const char *text = reason ? reason : strerror(-rc);
  return ckpt_buf_append(out, text, strlen(text));
}

/* A view of a frame inside a message (not owned). */
typedef struct {
  const uint8_t *p;
  size_t n;
} view_t;

static bool frame_ok(view_t f) { return f.n >= 1 && f.p[0] == CKPT__FRAME_OK; }

/* The error of a failed frame: -EEXIST (committed elsewhere) or -EIO. */
static int frame_rc(view_t f) {
  return f.n >= 1 && f.p[0] == CKPT__FRAME_EXISTS ? -EEXIST : -EIO;
}

static ckpt_buf_t frame_payload(view_t f) {
  ckpt_buf_t b = {.data = (uint8_t *)f.p + 1, .len = f.n - 1, .cap = 0};
  return b;
}

/* Append the reason of a failed frame to reasons, one per line. */
static void add_reason(ckpt_buf_t *reasons, view_t f, int rank) {
  if (reasons->len)
    ckpt_buf_printf(reasons, "\n");
  if (f.n >= 1 && (f.p[0] == CKPT__FRAME_FAIL || f.p[0] == CKPT__FRAME_EXISTS))
    ckpt_buf_printf(reasons, "%.*s", (int)(f.n - 1), (const char *)f.p + 1);
  else
    ckpt_buf_printf(reasons, "rank %d: malformed protocol message", rank);
}

/* Run a step and frame its outcome; a step's reason names its rank. */
static int framed_step(ckpt_dist_t *d, int rc, char *err,
                       const ckpt_buf_t *payload, ckpt_buf_t *out) {
  char *reason = NULL;
  if (rc && err && strncmp(err, "rank ", 5) != 0) {
    if (asprintf(&reason, "rank %d: %s", d->rank, err) < 0)
      reason = NULL;
  }
  int r = put_frame(out, rc, reason ? reason : err, payload);
  if (rc && !err && !reason)
    ckpt_buf_printf(out, " (rank %d)", d->rank);
  free(reason);
  free(err);
  return r;
}

/* "rank 3", "rank 2 and rank 3", "rank 1, rank 2 and rank 3". */
static void put_ranks(ckpt_buf_t *b, const bool *set, int n) {
  int total = 0, seen = 0;
  for (int r = 0; r < n; r++)
    total += set[r];
  for (int r = 0; r < n; r++) {
    if (!set[r])
      continue;
    seen++;
    if (seen > 1)
      ckpt_buf_printf(b, seen == total ? " and " : ", ");
    if (seen > 16 && seen < total) {
      ckpt_buf_printf(b, "%d more", total - seen);
      for (int k = r + 1; k < n; k++)
        if (set[k])
          r = k;
      seen = total - 1;
      continue;
    }
    ckpt_buf_printf(b, "rank %d", r);
  }
}

/* Tell the caller which ranks (set) job waits for, to do what. */
static void waiting_for(ckpt_dist_t *d, ckpt_dist_job_t *job,
                        const bool *set, const char *what, double until) {
  if (!job || !d->ops->waiting)
    return;
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  put_ranks(&b, set, d->size);
  ckpt_buf_printf(&b, " %s", what);
  waiting(d, job, b.len ? (const char *)b.data : what, until);
  ckpt_buf_free(&b);
}

/* Client: has the coordinator said that it stopped (STOPPED)? */
static bool coordinator_stopped(ckpt_dist_t *d) {
  if (!d->coord_stopped) {
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    int from;
    d->coord_stopped = ckpt__mpi_poll(d, 0, CKPT__TAG_STOPPED, &from, &m) == 1;
    ckpt_buf_free(&m);
  }
  return d->coord_stopped;
}

/*
 * Wait for a message of tag (from src, or any rank if src < 0) whose first
 * u32 is key; messages with another key are stale and dropped. Returns 1
 * with *from and out set, 0 at the deadline, -ESHUTDOWN when a client
 * learns that the coordinator stopped, < 0 on error.
 */
static void run_solos(ckpt_dist_t *d);
static void solo_round(ckpt_dist_t *d, ckpt_dist_job_t *job);

static int wait_msg(ckpt_dist_t *d, int src, int tag, uint32_t key,
                    double deadline, int *from, ckpt_buf_t *out) {
  unsigned spins = 0;
  bool last_try = false;
  for (;;) {
    int r = ckpt__mpi_poll(d, src, tag, from, out);
    if (r < 0)
      return r;
    if (r == 1) {
      if (out->len >= 4 && get_u32(out->data) == key)
        return 1;
      continue; /* stale */
    }
    if (last_try)
      return -ESHUTDOWN;
    /* The coordinator sends what it owes a client before STOPPED, and
     * messages of one sender match in order: one more look for it. */
    if (d->rank != 0 && coordinator_stopped(d)) {
      last_try = true;
      continue;
    }
    if (now() >= deadline)
      return 0;
    run_solos(d); /* one rank's own saves do not wait for the world's */
    pause_poll(&spins);
  }
}

/* Client: the reason of a save that the coordinator cannot run. */
static void put_stopped(ckpt_dist_t *d, ckpt_buf_t *reasons,
                        const ckpt_dist_job_t *job) {
  ckpt_buf_printf(reasons, "%s: rank 0 (the coordinator) has stopped; rank "
                  "%d cannot commit before the world is started again",
                  job->name, d->rank);
}

/* A save whose job is gone still takes the plans on their way for this
 * long (seconds): a round that gets every plan meanwhile goes on. */
#define CANCEL_GRACE 2.0

/* The reason of a save whose job is gone (job->cancel). */
static void put_abandoned(ckpt_dist_t *d, ckpt_buf_t *reasons,
                          const ckpt_dist_job_t *job) {
  ckpt_buf_printf(reasons, "rank %d: %s", d->rank, CKPT_DIST_ABANDONED);
  (void)job;
}

/* Client: tell the coordinator that this client gave up on save seq (no
 * answer in time, or its job is gone): a PLAN with no name. */
static void send_gave_up(ckpt_dist_t *d, uint32_t seq) {
  ckpt_buf_t m;
  ckpt_buf_init(&m);
  put_u32(&m, seq);
  uint8_t none[2] = {0, 0};
  ckpt_buf_append(&m, none, 2);
  ckpt__mpi_send(d, 0, CKPT__TAG_PLAN, &m);
}

/* rc: 0, -EEXIST (the name was committed elsewhere), or the -errno of the
 * failure as this rank saw it: its own step's, else -EIO (another rank's,
 * whose reason says why). */
static void job_done(ckpt_dist_t *d, ckpt_dist_job_t *job, int rc,
                     const char *reason) {
  d->ops->done(d->ctx, job, rc,
               rc ? (reason && *reason ? reason : "commit failed") : NULL);
}

/* A rank's writes are done (rc: write_step's): its partner copies, for a
 * job that makes them (partner.c), before its result is sent. When the
 * writes failed, the ranks it exchanges with are told that nothing comes,
 * and write_step's reason stays. */
static int after_writes(ckpt_dist_t *d, ckpt_dist_job_t *job, uint32_t round,
                        int rc, char **err) {
  if (!job->partner || !d->ops->partner_files)
    return rc;
  char *why = NULL;
  int prc = ckpt__partner_exchange(d, job, round, rc == 0, &why);
  if (rc)
    free(why);
  else
    rc = prc, *err = why;
  return rc;
}

/* ------------------------------------------------------------------------
 * Client ranks.
 * ---------------------------------------------------------------------- */

/* A client's save on its way: its buffers, and how far it got. */
typedef struct {
  ckpt_buf_t out;     /* a step's output: the local plan, the write result */
  ckpt_buf_t msg;     /* what is sent to the coordinator */
  ckpt_buf_t reply;   /* the coordinator's PLAN_REPLY, then its OUTCOME */
  ckpt_buf_t reasons; /* why the save failed */
  uint32_t seq;       /* this save's number (PLAN, PLAN_REPLY) */
  uint32_t round;     /* the coordinator's round (RESULT, OUTCOME) */
  bool wrote;         /* write_step ran: a failure discards */
} client_save_t;

/* May the save begin? 0, or the failure with its reason in c->reasons. */
static int client_may_start(ckpt_dist_t *d, ckpt_dist_job_t *job,
                            client_save_t *c) {
  if (coordinator_stopped(d)) {
    put_stopped(d, &c->reasons, job);
    return -ESHUTDOWN;
  }
  if (atomic_load(&job->cancel)) { /* gone before its turn: nothing sent */
    put_abandoned(d, &c->reasons, job);
    return -ECANCELED;
  }
  return 0;
}

/* PLAN: seq, name, local plan frame (a failed local step is sent framed:
 * the coordinator fails the round). */
static int client_send_plan(ckpt_dist_t *d, ckpt_dist_job_t *job,
                            client_save_t *c) {
  char *err = NULL;
  c->seq = ++d->seq;
  size_t nlen = strlen(job->name);
  int rc = d->ops->local_step(d->ctx, job, &c->out, &err);
  put_u32(&c->msg, c->seq);
  uint8_t nl[2] = {(uint8_t)nlen, (uint8_t)(nlen >> 8)};
  ckpt_buf_append(&c->msg, nl, 2);
  ckpt_buf_append(&c->msg, job->name, nlen);
  if ((rc = framed_step(d, rc, err, &c->out, &c->msg)) != 0)
    return rc;
  return ckpt__mpi_send(d, 0, CKPT__TAG_PLAN, &c->msg);
}

/* Wait for the PLAN_REPLY of save c->seq until `until`; wait_msg's result.
 * Its job gone meanwhile (cancel): the coordinator is told (a gave-up
 * PLAN; *told), and its answer decides: the round fails for every rank
 * while plans are missing; a round that had every plan goes on. */
static int client_poll_reply(ckpt_dist_t *d, ckpt_dist_job_t *job,
                             client_save_t *c, double until, bool *told) {
  double cancel_at = 0;
  int from;
  for (;;) {
    double step = *told ? until : now() + 0.05;
    int rc = wait_msg(d, 0, CKPT__TAG_PLAN_REPLY, c->seq,
                      step < until ? step : until, &from, &c->reply);
    if (rc != 0 || now() >= until)
      return rc;
    if (!*told && cancel_at == 0 && atomic_load(&job->cancel))
      cancel_at = now();
    /* after a grace: the other ranks' plans may be on their way */
    if (!*told && cancel_at > 0 && now() >= cancel_at + CANCEL_GRACE) {
      send_gave_up(d, c->seq);
      *told = true;
    }
  }
}

/* PLAN_REPLY: seq, round, rank plan frame. 0 with *plan (in c->reply), or
 * the failure with its reason in c->reasons. */
static int client_plan_reply(ckpt_dist_t *d, ckpt_dist_job_t *job,
                             client_save_t *c, view_t *plan) {
  double until = now() + client_wait(d);
  waiting(d, job, "rank 0 (the coordinator): it plans once every rank "
          "committed this checkpoint", until);
  bool told = false;
  int rc = client_poll_reply(d, job, c, until, &told);
  if (rc == -ESHUTDOWN) {
    put_stopped(d, &c->reasons, job);
    return rc;
  }
  if (rc <= 0 || c->reply.len < 8) {
    ckpt_buf_printf(&c->reasons, "rank %d: no answer from the coordinator "
                    "(rank 0) within %.0f s", d->rank, client_wait(d));
    /* Our PLAN may still be on its way (a link down): say that we gave
     * up on it, behind it, so that it never counts in a later round. */
    if (!told)
      send_gave_up(d, c->seq);
    return -ETIMEDOUT;
  }
  c->round = get_u32(c->reply.data + 4);
  *plan = (view_t){c->reply.data + 8, c->reply.len - 8};
  if (!frame_ok(*plan)) {
    add_reason(&c->reasons, *plan, 0);
    return frame_rc(*plan);
  }
  return 0;
}

/* The writes of rank plan frame f, then RESULT: round, write result
 * frame. */
static int client_send_result(ckpt_dist_t *d, ckpt_dist_job_t *job,
                              client_save_t *c, view_t f) {
  char *err = NULL;
  c->wrote = true;
  waiting(d, job, NULL, 0);
  ckpt_buf_t plan = frame_payload(f);
  c->out.len = 0;
  int rc = d->ops->write_step(d->ctx, job, &plan, &c->out, &err);
  rc = after_writes(d, job, c->round, rc, &err);
  c->msg.len = 0;
  put_u32(&c->msg, c->round);
  if ((rc = framed_step(d, rc, err, &c->out, &c->msg)) != 0)
    return rc;
  return ckpt__mpi_send(d, 0, CKPT__TAG_RESULT, &c->msg);
}

/* OUTCOME: round, frame. Once its RESULT is sent, the coordinator
 * alone decides: giving up here (and removing our files) while it
 * publishes would commit a checkpoint without our data. It answers, or
 * says it stopped (STOPPED), or dies and the launcher ends the world.
 * 0 with *outcome (in c->reply), or the failure with its reason. */
static int client_outcome(ckpt_dist_t *d, ckpt_dist_job_t *job,
                          client_save_t *c, view_t *outcome) {
  int from;
  waiting(d, job, "rank 0 (the coordinator): it publishes once every "
          "rank has written its part", 0);
  int rc = wait_msg(d, 0, CKPT__TAG_OUTCOME, c->round, INFINITY, &from,
                    &c->reply);
  if (rc == -ESHUTDOWN) {
    put_stopped(d, &c->reasons, job);
    return rc;
  }
  if (rc <= 0 || c->reply.len < 4) {
    ckpt_buf_printf(&c->reasons, "rank %d: no outcome from the coordinator "
                    "(rank 0)", d->rank);
    return rc < 0 ? rc : -EIO;
  }
  *outcome = (view_t){c->reply.data + 4, c->reply.len - 4};
  if (!frame_ok(*outcome)) {
    add_reason(&c->reasons, *outcome, 0);
    return frame_rc(*outcome);
  }
  return 0;
}

/* The save failed (rc): what this rank wrote goes (DISCARDED tells the
 * coordinator), and the job is done with the reasons. */
static void client_failed(ckpt_dist_t *d, ckpt_dist_job_t *job,
                          client_save_t *c, int rc) {
  if (c->reasons.len == 0)
    ckpt_buf_printf(&c->reasons, "rank %d: %s", d->rank, strerror(-rc));
  waiting(d, job, NULL, 0);
  if (c->wrote) {
    d->ops->discard_step(d->ctx, job, false);
    c->msg.len = 0;
    put_u32(&c->msg, c->round);
    ckpt__mpi_send(d, 0, CKPT__TAG_DISCARDED, &c->msg);
  }
  job_done(d, job, rc, (const char *)c->reasons.data);
}

/* A client's save: PLAN, PLAN_REPLY, writes, RESULT, OUTCOME; each step
 * runs once the one before it succeeded. */
static void client_save(ckpt_dist_t *d, ckpt_dist_job_t *job) {
  client_save_t c = {.seq = 0, .round = 0, .wrote = false};
  ckpt_buf_init(&c.out);
  ckpt_buf_init(&c.msg);
  ckpt_buf_init(&c.reply);
  ckpt_buf_init(&c.reasons);
  view_t f = {NULL, 0}; /* the rank plan, then the outcome (in c.reply) */
  int rc = client_may_start(d, job, &c);
  if (rc == 0)
    rc = client_send_plan(d, job, &c);
  if (rc == 0)
    rc = client_plan_reply(d, job, &c, &f);
  if (rc == 0)
    rc = client_send_result(d, job, &c, f);
  if (rc == 0)
    rc = client_outcome(d, job, &c, &f);
  if (rc == 0) {
    if (d->ops->publish_step) {
      ckpt_buf_t payload = frame_payload(f);
      d->ops->publish_step(d->ctx, job, &payload);
    }
    job_done(d, job, 0, NULL);
  } else {
    client_failed(d, job, &c, rc);
  }
  ckpt_buf_free(&c.out);
  ckpt_buf_free(&c.msg);
  ckpt_buf_free(&c.reply);
  ckpt_buf_free(&c.reasons);
}

/* ------------------------------------------------------------------------
 * The coordinator.
 * ---------------------------------------------------------------------- */

typedef struct {
  bool in;         /* its PLAN (or result) arrived */
  bool abandoned;  /* then its client gave up on it: its job is gone, or it
                      waited too long (the round fails) */
  uint32_t seq;    /* the client's save number */
  char name[256];  /* the checkpoint it commits */
  ckpt_buf_t msg;  /* the message; the frame starts at frame_off */
  size_t frame_off;
} arrival_t;

static view_t arrival_frame(const arrival_t *a) {
  return (view_t){a->msg.data + a->frame_off, a->msg.len - a->frame_off};
}

/* Parse a PLAN message into a. */
static bool take_plan(arrival_t *a, ckpt_buf_t *msg) {
  if (msg->len < 6)
    return false;
  size_t nlen = (size_t)msg->data[4] | (size_t)msg->data[5] << 8;
  if (nlen >= sizeof(a->name) || msg->len < 6 + nlen + 1)
    return false;
  ckpt_buf_free(&a->msg);
  a->in = true;
  a->abandoned = false;
  a->seq = get_u32(msg->data);
  memcpy(a->name, msg->data + 6, nlen);
  a->name[nlen] = '\0';
  a->msg = *msg;
  a->frame_off = 6 + nlen;
  ckpt_buf_init(msg);
  return true;
}

/*
 * A PLAN-tag message from client `from` (1 <= from < size): a plan, taken
 * into plans[from] (a newer one supersedes an older), unless it is of a
 * save the client gave up on; or the client saying that it gave up on a
 * save, which drops that save's plan from plans. Returns true when
 * plans[from] changed.
 */
static bool take_plan_msg(ckpt_dist_t *d, arrival_t *plans, int from,
                          ckpt_buf_t *msg) {
  if (!d->gave_up && !(d->gave_up = calloc((size_t)d->size, sizeof(uint32_t))))
    return false;
  if (msg->len < 6)
    return false;
  uint32_t seq = get_u32(msg->data);
  bool abandon = msg->data[4] == 0 && msg->data[5] == 0;
  if (abandon) {
    if (seq > d->gave_up[from])
      d->gave_up[from] = seq;
    if (plans && plans[from].in && plans[from].seq == seq) {
      plans[from].abandoned = true; /* the round fails; it gets the reply */
      return true;
    }
    if (plans && plans[from].in && plans[from].seq < seq) {
      ckpt_buf_free(&plans[from].msg); /* an older save's, superseded */
      plans[from].in = false;
    }
    /* Not in this round: its client may still wait for an answer (a
     * cancel waits for one) */
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    put_u32(&m, seq);
    put_u32(&m, 0);
    char why[160];
    snprintf(why, sizeof(why), "rank %d: %s", from, CKPT_DIST_ABANDONED);
    put_frame(&m, -ECANCELED, why, NULL);
    ckpt__mpi_send(d, from, CKPT__TAG_PLAN_REPLY, &m);
    return plans != NULL;
  }
  if (seq <= d->gave_up[from])
    return false; /* late: its client no longer waits for it */
  return plans && take_plan(&plans[from], msg);
}

/* Coordinator: which ranks' plans are not in, for .status. */
static void report_plans(ckpt_dist_t *d, ckpt_dist_job_t *job,
                         const arrival_t *plans, double until) {
  bool *set = calloc((size_t)d->size, sizeof(*set));
  if (!set)
    return;
  for (int r = 0; r < d->size; r++)
    set[r] = !plans[r].in;
  waiting_for(d, job, set, "to commit this checkpoint (commit_timeout)",
              until);
  free(set);
}

/* The coordinator's own local plan, as an arrival. */
static void own_plan(ckpt_dist_t *d, ckpt_dist_job_t *job, arrival_t *a) {
  ckpt_buf_t out;
  ckpt_buf_init(&out);
  char *err = NULL;
  int rc = d->ops->local_step(d->ctx, job, &out, &err);
  a->in = true;
  snprintf(a->name, sizeof(a->name), "%s", job->name);
  a->frame_off = 0;
  a->msg.len = 0;
  framed_step(d, rc, err, &out, &a->msg);
  ckpt_buf_free(&out);
}

static bool is_stopping(ckpt_dist_t *d) {
  pthread_mutex_lock(&d->lock);
  bool stopping = d->stopping;
  pthread_mutex_unlock(&d->lock);
  return stopping;
}

/* The first solo job queued (anywhere in the queue), or NULL. */
static ckpt_dist_job_t *pop_solo(ckpt_dist_t *d) {
  pthread_mutex_lock(&d->lock);
  ckpt_dist_job_t *prev = NULL, *job = d->head;
  while (job && !job->solo)
    prev = job, job = job->next;
  if (job) {
    if (prev)
      prev->next = job->next;
    else
      d->head = job->next;
    if (d->tail == job)
      d->tail = prev;
  }
  pthread_mutex_unlock(&d->lock);
  return job;
}

static ckpt_dist_job_t *pop_job(ckpt_dist_t *d) {
  pthread_mutex_lock(&d->lock);
  ckpt_dist_job_t *job = d->head;
  if (job) {
    d->head = job->next;
    if (!d->head)
      d->tail = NULL;
  }
  pthread_mutex_unlock(&d->lock);
  return job;
}

/* Step 2: who is missing, and do the names agree? Fills reasons. */
static void check_arrivals(ckpt_dist_t *d, const arrival_t *a,
                           ckpt_buf_t *reasons) {
  int n = d->size;
  bool *set = calloc((size_t)n, sizeof(*set));
  if (!set) {
    ckpt_buf_printf(reasons, "rank 0: out of memory");
    return;
  }
  const char *name = NULL;
  bool differ = false;
  for (int r = 0; r < n; r++) {
    if (!a[r].in)
      continue;
    if (!name)
      name = a[r].name;
    else if (strcmp(name, a[r].name) != 0)
      differ = true;
  }
  if (differ) {
    ckpt_buf_printf(reasons, "ranks commit different checkpoints at once:");
    for (int r = 0; r < n; r++) {
      if (!a[r].in)
        continue;
      bool first = true;
      for (int k = 0; k < r; k++)
        first &= !(a[k].in && strcmp(a[k].name, a[r].name) == 0);
      if (!first)
        continue;
      for (int k = 0; k < n; k++)
        set[k] = a[k].in && strcmp(a[k].name, a[r].name) == 0;
      ckpt_buf_printf(reasons, " ");
      put_ranks(reasons, set, n);
      ckpt_buf_printf(reasons, " '%s';", a[r].name);
    }
    reasons->len--; /* the last ';' */
    reasons->data[reasons->len] = '\0';
  }
  bool missing = false;
  for (int r = 0; r < n; r++)
    missing |= (set[r] = !a[r].in);
  if (missing) {
    if (reasons->len)
      ckpt_buf_printf(reasons, "\n");
    put_ranks(reasons, set, n);
    ckpt_buf_printf(reasons, " did not commit %s within %g s (commit_timeout)",
                    name ? name : "?", d->commit_timeout);
  }
  free(set);
}

/* Send every client in the round (a[r].in) a message built by put. */
static void send_all(ckpt_dist_t *d, const arrival_t *a, int tag,
                     uint32_t round, int rc, const char *reason,
                     const ckpt_buf_t *payloads) {
  for (int r = 1; r < d->size; r++) {
    if (!a[r].in)
      continue;
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    if (tag == CKPT__TAG_PLAN_REPLY)
      put_u32(&m, a[r].seq);
    put_u32(&m, round);
    put_frame(&m, rc, reason, payloads ? &payloads[r] : NULL);
    ckpt__mpi_send(d, r, tag, &m);
  }
}

/* send_all with one payload for every client. */
static void send_all_same(ckpt_dist_t *d, const arrival_t *a, int tag,
                          uint32_t round, int rc, const char *reason,
                          const ckpt_buf_t *payload) {
  for (int r = 1; r < d->size; r++) {
    if (!a[r].in)
      continue;
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    put_u32(&m, round);
    put_frame(&m, rc, reason, payload);
    ckpt__mpi_send(d, r, tag, &m);
  }
}

/* Coordinator: which clients of expect are not in got, for .status. */
static void report_collect(ckpt_dist_t *d, ckpt_dist_job_t *job,
                           const arrival_t *expect, const arrival_t *got,
                           const char *what, double until) {
  bool *set = calloc((size_t)d->size, sizeof(*set));
  if (!set)
    return;
  for (int r = 1; r < d->size; r++)
    set[r] = expect[r].in && !got[r].in;
  waiting_for(d, job, set, what, until);
  free(set);
}

/*
 * Collect one message of tag and this round from every client with in[r]
 * (arrivals a[r] get the message); false when some did not come in time.
 * what: what the missing ranks are to do, for .status.
 */
static bool collect(ckpt_dist_t *d, ckpt_dist_job_t *job, int tag,
                    uint32_t round, double deadline, const arrival_t *expect,
                    arrival_t *got, const char *what) {
  int n = d->size, missing = 0;
  for (int r = 1; r < n; r++)
    missing += expect[r].in && !got[r].in;
  ckpt_buf_t m;
  ckpt_buf_init(&m);
  if (missing > 0)
    report_collect(d, job, expect, got, what, deadline);
  while (missing > 0) {
    int from;
    int rc = wait_msg(d, -1, tag, round, deadline, &from, &m);
    if (rc <= 0)
      break;
    if (from <= 0 || from >= n || !expect[from].in || got[from].in)
      continue;
    ckpt_buf_free(&got[from].msg);
    got[from].msg = m;
    got[from].frame_off = 4;
    got[from].in = true;
    ckpt_buf_init(&m);
    missing--;
    if (missing > 0)
      report_collect(d, job, expect, got, what, deadline);
  }
  ckpt_buf_free(&m);
  waiting(d, job, NULL, 0);
  return missing == 0;
}

static void free_arrivals(arrival_t *a, int n) {
  if (!a)
    return;
  for (int r = 0; r < n; r++)
    ckpt_buf_free(&a[r].msg);
  free(a);
}

/* A round on its way on the coordinator. */
typedef struct {
  ckpt_dist_job_t *job;   /* its own save (NULL until one is queued) */
  uint32_t round;
  arrival_t *plans;       /* [size]: each rank's PLAN */
  arrival_t *results;     /* [size]: each rank's RESULT, then DISCARDED */
  ckpt_buf_t *rank_plans; /* [size]: global_step's plan for each rank */
  ckpt_buf_t reasons;     /* why the round fails (empty: it does not) */
  int fail_rc;            /* -EEXIST: committed elsewhere; else the
                             failure (-EIO, or a step's own -errno): the
                             frames to the clients carry only which */
  int own_rc;             /* this rank's own write step's -errno, or 0:
                             its save's done gets it */
  char *err;              /* a step's reason, not yet framed or freed */
} round_t;

/* Do the names of the plans of ranks 1.. differ from rank 0's? */
static bool names_differ(const arrival_t *plans, int n) {
  bool differ = false;
  for (int r = 1; r < n; r++)
    differ |= strcmp(plans[r].name, plans[0].name) != 0;
  return differ;
}

/* How step 1 ended. */
enum { GATHERED, GATHER_STOPPED, GATHER_NOBODY };

/* 1. every rank's PLAN, until all are in or the deadline. Messages
 * that have arrived are taken before the round is judged complete: a
 * stale plan is followed by its client's giving up on it. GATHER_STOPPED:
 * this rank stops without a save of its own; GATHER_NOBODY: the round's
 * only plan was given up on, and nobody waits for an answer. */
static int gather_plans(ckpt_dist_t *d, round_t *rd, ckpt_buf_t *first,
                        int first_from) {
  int n = d->size, result = GATHERED;
  arrival_t *plans = rd->plans;
  ckpt_buf_t m;
  ckpt_buf_init(&m);
  if (first && first_from > 0 && first_from < n)
    take_plan_msg(d, plans, first_from, first);
  double deadline = now() + d->commit_timeout;
  if (rd->job) {
    own_plan(d, rd->job, &plans[0]);
    report_plans(d, rd->job, plans, deadline);
  }
  unsigned spins = 0;
  double differ_until = 0; /* names differ: a moment for late messages */
  double cancel_at = 0;    /* when its own job was found gone */
  for (;;) {
    int from;
    int got = n > 1 ? ckpt__mpi_poll(d, -1, CKPT__TAG_PLAN, &from, &m) : 0;
    if (got == 1) {
      if (from > 0 && from < n && take_plan_msg(d, plans, from, &m))
        report_plans(d, rd->job, plans, deadline);
      continue;
    }
    int in = 0;
    /* Its own job gone: the round still takes the plans on their way
     * (CANCEL_GRACE), then fails if some are missing */
    if (rd->job && cancel_at == 0 && atomic_load(&rd->job->cancel))
      cancel_at = now();
    bool gone = cancel_at > 0 && now() >= cancel_at + CANCEL_GRACE;
    for (int r = 0; r < n; r++) {
      in += plans[r].in;
      gone |= plans[r].in && plans[r].abandoned;
    }
    if (!rd->job && in == 0) {
      result = GATHER_NOBODY;
      break;
    }
    if (gone)
      break; /* a rank's job is gone before every rank committed */
    if (in == n) {
      if (!names_differ(plans, n))
        break;
      if (differ_until == 0)
        differ_until = now() + 1.0;
      if (now() >= differ_until)
        break;
    }
    if (now() >= deadline)
      break;
    if (!rd->job && (rd->job = pop_job(d)) != NULL) {
      if (rd->job->solo) { /* not this round's: a world of its own */
        solo_round(d, rd->job);
        rd->job = NULL;
        continue;
      }
      own_plan(d, rd->job, &plans[0]);
      report_plans(d, rd->job, plans, deadline);
      continue;
    }
    run_solos(d); /* one rank's own saves do not wait for the world's */
    if (!rd->job && is_stopping(d)) {
      result = GATHER_STOPPED; /* our own PLAN will never come */
      break;
    }
    pause_poll(&spins);
  }
  ckpt_buf_free(&m);
  if (result != GATHER_NOBODY)
    waiting(d, rd->job, NULL, 0);
  return result;
}

/* 2. everyone, one name, every local step fine; else false, with the
 * reasons. stopped: this rank stops (gather_plans). */
static bool plans_agree(ckpt_dist_t *d, round_t *rd, bool stopped) {
  int n = d->size;
  const arrival_t *plans = rd->plans;
  ckpt_buf_t *reasons = &rd->reasons;
  if (stopped) {
    for (int r = 1; r < n && reasons->len == 0; r++)
      if (plans[r].in)
        ckpt_buf_printf(reasons, "%s: rank 0 (the coordinator) has stopped",
                        plans[r].name);
    return false;
  }
  bool all_in = true;
  for (int r = 0; r < n; r++)
    all_in &= plans[r].in && !plans[r].abandoned;
  if (rd->job && atomic_load(&rd->job->cancel) && !all_in)
    ckpt_buf_printf(reasons, "rank 0: %s", CKPT_DIST_ABANDONED);
  for (int r = 1; r < n; r++)
    if (plans[r].in && plans[r].abandoned)
      ckpt_buf_printf(reasons, "%srank %d: %s", reasons->len ? "; " : "", r,
                      CKPT_DIST_ABANDONED);
  if (reasons->len)
    return false;
  check_arrivals(d, plans, reasons);
  for (int r = 0; r < n && reasons->len == 0; r++)
    if (!frame_ok(arrival_frame(&plans[r])))
      for (int k = r; k < n; k++)
        if (!frame_ok(arrival_frame(&plans[k])))
          add_reason(reasons, arrival_frame(&plans[k]), k);
  return reasons->len == 0;
}

/* 3. the global plan, scattered; else false, with the reasons. */
static bool scatter_plans(ckpt_dist_t *d, round_t *rd) {
  int n = d->size;
  ckpt_buf_t *views = calloc((size_t)n, sizeof(*views));
  if (!views) {
    ckpt_buf_printf(&rd->reasons, "rank 0: out of memory");
    return false;
  }
  for (int r = 0; r < n; r++)
    views[r] = frame_payload(arrival_frame(&rd->plans[r]));
  int rc = d->ops->global_step(d->ctx, rd->job, views, n, rd->rank_plans,
                               &rd->err);
  free(views);
  if (rc) {
    ckpt_buf_printf(&rd->reasons, "%s", rd->err ? rd->err : strerror(-rc));
    free(rd->err), rd->err = NULL;
    rd->fail_rc = rc;
    return false;
  }
  send_all(d, rd->plans, CKPT__TAG_PLAN_REPLY, rd->round, 0, NULL,
           rd->rank_plans);
  return true;
}

/* 4. writes everywhere, one RESULT per rank; the reasons of late or failed
 * ranks. */
static void gather_results(ckpt_dist_t *d, round_t *rd) {
  int n = d->size;
  ckpt_dist_job_t *job = rd->job;
  arrival_t *results = rd->results;
  ckpt_buf_t own_result;
  ckpt_buf_init(&own_result);
  int rc = d->ops->write_step(d->ctx, job, &rd->rank_plans[0], &own_result,
                              &rd->err);
  rc = after_writes(d, job, rd->round, rc, &rd->err);
  rd->own_rc = rc;
  results[0].in = true;
  framed_step(d, rc, rd->err, &own_result, &results[0].msg);
  rd->err = NULL;
  ckpt_buf_free(&own_result);
  if (!collect(d, job, CKPT__TAG_RESULT, rd->round, now() + d->commit_timeout,
               rd->plans, results, "to finish writing (commit_timeout)")) {
    bool *late = calloc((size_t)n, sizeof(*late));
    for (int r = 0; late && r < n; r++)
      late[r] = !results[r].in;
    if (late)
      put_ranks(&rd->reasons, late, n);
    ckpt_buf_printf(&rd->reasons, " did not finish writing %s%s within %g s "
                    "(commit_timeout)", job->name,
                    job->partner ? " and its partner copies" : "",
                    d->commit_timeout);
    free(late);
  }
  for (int r = 0; r < n; r++)
    if (results[r].in && !frame_ok(arrival_frame(&results[r])))
      add_reason(&rd->reasons, arrival_frame(&results[r]), r);
}

/* 5. the metadata, and the outcome for everyone; true when committed. */
static bool send_outcome(ckpt_dist_t *d, round_t *rd) {
  int n = d->size;
  ckpt_buf_t outcome;
  ckpt_buf_init(&outcome);
  if (rd->reasons.len == 0) {
    ckpt_buf_t *views = calloc((size_t)n, sizeof(*views));
    if (!views) {
      ckpt_buf_printf(&rd->reasons, "rank 0: out of memory");
    } else {
      for (int r = 0; r < n; r++)
        views[r] = frame_payload(arrival_frame(&rd->results[r]));
      int rc = d->ops->finish_step(d->ctx, rd->job, views, n, &outcome,
                                   &rd->err);
      free(views);
      if (rc)
        ckpt_buf_printf(&rd->reasons, "%s",
                        rd->err ? rd->err : strerror(-rc));
      if (rc)
        rd->fail_rc = rc;
      free(rd->err), rd->err = NULL;
    }
  }
  send_all_same(d, rd->plans, CKPT__TAG_OUTCOME, rd->round,
                rd->reasons.len ? rd->fail_rc : 0,
                (const char *)rd->reasons.data, &outcome);
  ckpt_buf_free(&outcome);
  return rd->reasons.len == 0;
}

/* 6. a failed save leaves nothing behind. A rank that missed the RESULT
 * deadline is not waited for again: if it died, that would hold every
 * rank's answer for another commit_timeout; if it is only slow, it gets
 * the OUTCOME sent above and removes its own files. */
static void discard_round(ckpt_dist_t *d, round_t *rd) {
  int n = d->size;
  arrival_t *plans = rd->plans, *results = rd->results;
  d->ops->discard_step(d->ctx, rd->job, false);
  for (int r = 1; r < n; r++)
    plans[r].in = plans[r].in && results[r].in;
  for (int r = 0; r < n; r++)
    ckpt_buf_free(&results[r].msg), results[r].in = false;
  collect(d, rd->job, CKPT__TAG_DISCARDED, rd->round,
          now() + d->commit_timeout, plans, results,
          "to remove what they wrote of the failed save");
  d->ops->discard_step(d->ctx, rd->job, true);
  job_done(d, rd->job, rd->own_rc ? rd->own_rc : rd->fail_rc,
           (const char *)rd->reasons.data);
}

/* A round failed before its writes: nothing was written; tell the
 * clients, fail our own save. */
static void fail_unwritten(ckpt_dist_t *d, round_t *rd) {
  if (rd->plans)
    send_all(d, rd->plans, CKPT__TAG_PLAN_REPLY, rd->round, rd->fail_rc,
             (const char *)rd->reasons.data, NULL);
  if (rd->job)
    job_done(d, rd->job, rd->own_rc ? rd->own_rc : rd->fail_rc,
           (const char *)rd->reasons.data);
}

/* Steps 2 to 6, once the plans are in (stopped: GATHER_STOPPED): the
 * round fails before anything is written, or writes and then commits or
 * discards. */
static void after_plans(ckpt_dist_t *d, round_t *rd, bool stopped) {
  if (!plans_agree(d, rd, stopped) || !scatter_plans(d, rd)) {
    fail_unwritten(d, rd);
    return;
  }
  gather_results(d, rd);
  if (send_outcome(d, rd))
    job_done(d, rd->job, 0, NULL);
  else
    discard_round(d, rd);
}

/* One round; job is the coordinator's own save (NULL: a client's PLAN came
 * first, in first/first_from). */
static void coordinator_round(ckpt_dist_t *d, ckpt_dist_job_t *job,
                              ckpt_buf_t *first, int first_from) {
  int n = d->size;
  round_t rd = {.job = job, .fail_rc = -EIO, .err = NULL};
  rd.round = ++d->round;
  rd.plans = calloc((size_t)n, sizeof(*rd.plans));
  rd.results = calloc((size_t)n, sizeof(*rd.results));
  rd.rank_plans = calloc((size_t)n, sizeof(*rd.rank_plans));
  ckpt_buf_init(&rd.reasons);
  if (!rd.plans || !rd.results || !rd.rank_plans) {
    ckpt_buf_printf(&rd.reasons, "rank 0: out of memory");
    fail_unwritten(d, &rd);
  } else {
    int gathered = gather_plans(d, &rd, first, first_from);
    if (gathered != GATHER_NOBODY) /* else nobody waits for an answer */
      after_plans(d, &rd, gathered == GATHER_STOPPED);
  }
  free_arrivals(rd.plans, n);
  free_arrivals(rd.results, n);
  if (rd.rank_plans)
    for (int r = 0; r < n; r++)
      ckpt_buf_free(&rd.rank_plans[r]);
  free(rd.rank_plans);
  ckpt_buf_free(&rd.reasons);
}

/* A solo save (`sync solo`): this rank alone is the world of one that
 * saves, whatever its rank: the steps of a round run here, in order, and
 * no other rank is asked or told anything. */
static void solo_round(ckpt_dist_t *d, ckpt_dist_job_t *job) {
  const ckpt_save_ops_t *ops = d->ops;
  ckpt_buf_t plan, rank_plan, result;
  ckpt_buf_init(&plan);
  ckpt_buf_init(&rank_plan);
  ckpt_buf_init(&result);
  char *err = NULL;
  int rc = ops->local_step(d->ctx, job, &plan, &err);
  if (rc == 0)
    rc = ops->global_step(d->ctx, job, &plan, 1, &rank_plan, &err);
  bool wrote = false;
  if (rc == 0) {
    wrote = true;
    rc = ops->write_step(d->ctx, job, &rank_plan, &result, &err);
  }
  ckpt_buf_t outcome; /* no other rank to tell */
  ckpt_buf_init(&outcome);
  if (rc == 0)
    rc = ops->finish_step(d->ctx, job, &result, 1, &outcome, &err);
  ckpt_buf_free(&outcome);
  if (rc && wrote) {
    ops->discard_step(d->ctx, job, false);
    ops->discard_step(d->ctx, job, true);
  }
  job_done(d, job, rc, err ? err : (rc ? strerror(-rc) : NULL));
  free(err);
  ckpt_buf_free(&plan);
  ckpt_buf_free(&rank_plan);
  ckpt_buf_free(&result);
}

/* Run every solo job queued now: called while a round waits for other
 * ranks, so that a rank's own saves (configs, tokenizers from rank 0) are
 * neither held up by the world's commits nor taken for its plan. */
static void run_solos(ckpt_dist_t *d) {
  ckpt_dist_job_t *job;
  while ((job = pop_solo(d)) != NULL)
    solo_round(d, job);
}

/* The coordinator stops: tell every client, and give the messages a moment
 * to leave before MPI_Finalize cancels what is still pending. */
static void tell_stopped(ckpt_dist_t *d) {
  for (int r = 1; r < d->size; r++) {
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    put_u32(&m, 0);
    ckpt__mpi_send(d, r, CKPT__TAG_STOPPED, &m);
  }
  double end = now() + 2;
  unsigned spins = 0;
  while (!ckpt__mpi_progress(d) && now() < end)
    pause_poll(&spins);
}

/* ------------------------------------------------------------------------
 * The dist thread.
 * ---------------------------------------------------------------------- */

/* Wait on d->cond for at most 2 ms. d->lock held. */
static void idle_wait(ckpt_dist_t *d) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += 2000000;
  if (ts.tv_nsec >= 1000000000L)
    ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  pthread_cond_timedwait(&d->cond, &d->lock, &ts);
}

static void *dist_main(void *arg) {
  ckpt_dist_t *d = arg;
  if (d->launched) {
    char *err = NULL;
    int rc = ckpt__mpi_init(d, &err);
    pthread_mutex_lock(&d->lock);
    d->init_rc = rc;
    d->init_err = err;
    d->ready = true;
    pthread_cond_broadcast(&d->cond);
    pthread_mutex_unlock(&d->lock);
    if (rc)
      return NULL;
  }
  /* (after MPI's own threads started: they keep their names) */
  pthread_setname_np(pthread_self(), "ckptfs-dist"); /* top -H, perf */
  /* Wait for the protocol's steps (ckpt_dist_start) or a stop. */
  pthread_mutex_lock(&d->lock);
  while (!d->started && !d->stopping)
    pthread_cond_wait(&d->cond, &d->lock);
  pthread_mutex_unlock(&d->lock);

  ckpt_buf_t first;
  ckpt_buf_init(&first);
  for (;;) {
    ckpt_dist_job_t *job = d->started ? pop_job(d) : NULL;
    if (job) {
      if (job->solo)
        solo_round(d, job);
      else if (d->rank == 0)
        coordinator_round(d, job, NULL, 0);
      else
        client_save(d, job);
      continue;
    }
    int from;
    if (d->started && d->rank == 0 && d->size > 1 &&
        ckpt__mpi_poll(d, -1, CKPT__TAG_PLAN, &from, &first) == 1) {
      coordinator_round(d, NULL, &first, from);
      continue;
    }
    pthread_mutex_lock(&d->lock);
    if (d->stopping && !d->head) {
      pthread_mutex_unlock(&d->lock);
      break;
    }
    if (!d->head) {
      if (d->size > 1) /* keep MPI progressing and rank 0 listening */
        idle_wait(d);
      else
        pthread_cond_wait(&d->cond, &d->lock);
    }
    pthread_mutex_unlock(&d->lock);
    if (d->size > 1)
      ckpt__mpi_progress(d);
  }
  ckpt_buf_free(&first);
  if (d->launched && d->started && d->rank == 0 && d->size > 1)
    tell_stopped(d);
  /* Drained: ckpt_dist_stop returns. Leaving the world waits for
   * ckpt_dist_destroy, which comes after the unmount: MPI_Finalize waits
   * for every rank of the world, and a rank stopped before the others
   * must not keep a mount that no longer answers meanwhile. */
  pthread_mutex_lock(&d->lock);
  d->drained = true;
  pthread_cond_broadcast(&d->cond);
  while (d->launched && !d->leaving)
    pthread_cond_wait(&d->cond, &d->lock);
  pthread_mutex_unlock(&d->lock);
  /* A rank that never started serving (its mount failed) cannot finish
   * the world cleanly: MPI_Finalize would wait for ranks that keep
   * serving. Abort the world instead, so that the launcher reports it. */
  if (d->launched && d->started)
    ckpt__mpi_finalize(d);
  else if (d->launched)
    ckpt__mpi_abort(d, 1);
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
  d->commit_timeout = 600;
  d->launched = ckpt__mpi_launched();
  if (gethostname(d->self_host, sizeof(d->self_host) - 1))
    d->self_host[0] = '\0';
  *out = d;
  if (!d->launched)
    return 0; /* a world of one: no MPI, the thread starts later */
  /* MPI is initialized on the dist thread itself, which then owns it. */
  int rc = pthread_create(&d->thread, NULL, dist_main, d);
  if (rc) {
    *err = strdup("cannot start the dist thread");
    return -rc;
  }
  d->thread_running = true;
  pthread_mutex_lock(&d->lock);
  while (!d->ready)
    pthread_cond_wait(&d->cond, &d->lock);
  pthread_mutex_unlock(&d->lock);
  if (d->init_rc) {
    *err = d->init_err ? d->init_err : strdup("MPI start-up failed");
    d->init_err = NULL;
    pthread_join(d->thread, NULL);
    d->thread_running = false;
    return d->init_rc;
  }
  return 0;
}

int ckpt_dist_rank(const ckpt_dist_t *d) { return d->rank; }
int ckpt_dist_size(const ckpt_dist_t *d) { return d->size; }
bool ckpt_dist_launched(const ckpt_dist_t *d) { return d->launched; }

int ckpt_dist_nodes(const ckpt_dist_t *d) { return d->node_of ? d->nodes : 1; }

int ckpt_dist_node_of(const ckpt_dist_t *d, int rank) {
  if (rank < 0 || rank >= d->size)
    return -1;
  return d->node_of ? d->node_of[rank] : 0;
}

const char *ckpt_dist_node_name(const ckpt_dist_t *d, int rank) {
  if (rank < 0 || rank >= d->size)
    return "";
  return d->host ? d->host[rank] : d->self_host;
}

/* The k-th rank of node n in rank order, -1 if it has fewer. */
static int kth_rank_of(const ckpt_dist_t *d, int n, int k) {
  for (int r = 0; r < d->size; r++)
    if (ckpt_dist_node_of(d, r) == n && k-- == 0)
      return r;
  return -1;
}

int ckpt_dist_partner(const ckpt_dist_t *d, int rank) {
  int n = ckpt_dist_node_of(d, rank), nodes = ckpt_dist_nodes(d);
  if (n < 0 || nodes < 2)
    return -1;
  int k = 0, on_next = 0, next = (n + 1) % nodes;
  for (int r = 0; r < rank; r++)
    k += ckpt_dist_node_of(d, r) == n;
  for (int r = 0; r < d->size; r++)
    on_next += ckpt_dist_node_of(d, r) == next;
  return kth_rank_of(d, next, k % on_next);
}

int ckpt_dist_start(ckpt_dist_t *d, const ckpt_save_ops_t *ops, void *ctx,
                    double commit_timeout) {
  pthread_mutex_lock(&d->lock);
  assert(!d->started);
  d->ops = ops;
  d->ctx = ctx;
  d->commit_timeout = commit_timeout;
  d->started = true;
  pthread_cond_broadcast(&d->cond);
  pthread_mutex_unlock(&d->lock);
  if (d->thread_running)
    return 0;
  int rc = pthread_create(&d->thread, NULL, dist_main, d);
  if (rc)
    return -rc;
  d->thread_running = true;
  return 0;
}

int ckpt_dist_submit(ckpt_dist_t *d, ckpt_dist_job_t *job) {
  job->next = NULL;
  pthread_mutex_lock(&d->lock);
  assert(d->started);
  if (d->stopping) {
    pthread_mutex_unlock(&d->lock);
    return -ESHUTDOWN;
  }
  if (d->tail)
    d->tail->next = job;
  else
    d->head = job;
  d->tail = job;
  pthread_cond_broadcast(&d->cond);
  pthread_mutex_unlock(&d->lock);
  return 0;
}

void ckpt_dist_stop(ckpt_dist_t *d) {
  if (!d || !d->thread_running)
    return;
  pthread_mutex_lock(&d->lock);
  d->stopping = true;
  pthread_cond_broadcast(&d->cond);
  while (!d->drained)
    pthread_cond_wait(&d->cond, &d->lock);
  pthread_mutex_unlock(&d->lock);
}

void ckpt_dist_destroy(ckpt_dist_t *d) {
  if (!d)
    return;
  ckpt_dist_stop(d);
  if (d->thread_running) {
    pthread_mutex_lock(&d->lock);
    d->leaving = true;
    pthread_cond_broadcast(&d->cond);
    pthread_mutex_unlock(&d->lock);
    pthread_join(d->thread, NULL);
    d->thread_running = false;
  }
  free(d->init_err);
  free(d->gave_up);
  free(d->node_of);
  free(d->host);
  pthread_mutex_destroy(&d->lock);
  pthread_cond_destroy(&d->cond);
  free(d);
}
