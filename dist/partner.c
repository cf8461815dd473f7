/*
 * partner.c - partner copies: after its writes, each rank sends its data
 * files to its partner rank (ckpt_dist_partner: the same index among its
 * node's ranks, on the next node) and receives the files of the ranks whose
 * partner it is. Every received file is written and made durable (the
 * caller's partner_close) before the rank sends its RESULT, so a committed
 * save has every rank's data on two nodes.
 *
 * Messages (tag PARTNER; each begins with u32 round, u8 kind):
 *   LIST  sender -> partner  u32 n, n x (u8 name length, name, u64 size):
 *                            the files that follow, in this order
 *   DATA  sender -> partner  u32 file, u64 offset, at most FRAME bytes:
 *                            each file's bytes, in order
 *   STOP  rank -> its peers  (nothing): its exchange failed (its writes, a
 *                            read, a write, a peer gone quiet), and its
 *                            RESULT says why; the peers stop waiting for it
 * A sender keeps at most INFLIGHT frames unfinished (MPI completes a large
 * send only once the receiver takes it), so a slow receiver slows its
 * sender down instead of filling its memory. Frames of another round are
 * stale (a failed round's, still on their way) and dropped. The exchange
 * is done when every frame of ours is handed to MPI (taking them is the
 * partner's part, before its own RESULT) and every file of our senders is
 * written and closed; it fails at commit_timeout or at a peer's STOP.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dist_int.h"

#define HEAD 17 /* a DATA message's round, kind, file, offset */
/* Data bytes per message: with its header (and ckpt_buf's NUL), one
 * buffer of 4 MiB, which ckpt_buf would round up to 8 MiB if larger. */
#define FRAME (((size_t)4 << 20) - HEAD - 1)
#define INFLIGHT 8 /* unfinished DATA sends per sender: 32 MiB */

enum { KIND_LIST = 'L', KIND_DATA = 'D', KIND_STOP = 'S' };

typedef struct {
  char name[CKPT_DIST_FILE_NAME_MAX];
  uint64_t size, got;
  int fd; /* -1: closed (or never opened) */
} rx_file_t;

/* A rank whose partner we are: its files, as they come. */
typedef struct {
  int rank;
  bool listed;    /* its LIST came */
  uint32_t n, complete;
  rx_file_t *files;
  uint64_t total, got;
} sender_t;

typedef struct {
  ckpt_dist_t *d;
  ckpt_dist_job_t *job;
  uint32_t round;
  int me, partner;
  /* ours, to the partner */
  ckpt_dist_file_t *out;
  uint32_t nout;
  bool listed;    /* our LIST is sent */
  uint32_t cur;   /* the file and offset of the next frame */
  uint64_t off, out_total, out_sent;
  /* theirs */
  sender_t *in;
  int nin;
  ckpt_buf_t rbuf;
  ckpt__recv_t *rx; /* a receive under way */
  char *why;        /* the first failure */
} xchg_t;

static void fail(xchg_t *x, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Remember the first failure (later ones follow from it). */
static void fail(xchg_t *x, const char *fmt, ...) {
  if (x->why)
    return;
  va_list ap;
  va_start(ap, fmt);
  if (vasprintf(&x->why, fmt, ap) < 0)
    x->why = NULL;
  va_end(ap);
  if (!x->why)
    x->why = strdup("partner copies failed");
}

static void put_u64(ckpt_buf_t *b, uint64_t v) {
  ckpt__put_u32(b, (uint32_t)v);
  ckpt__put_u32(b, (uint32_t)(v >> 32));
}

static uint64_t get_u64(const uint8_t *p) {
  return (uint64_t)ckpt__get_u32(p) | (uint64_t)ckpt__get_u32(p + 4) << 32;
}

static void head(ckpt_buf_t *b, uint32_t round, uint8_t kind) {
  ckpt__put_u32(b, round);
  ckpt_buf_append(b, &kind, 1);
}

/* Every rank we exchange with: the partner and our senders. */
static bool is_peer(const xchg_t *x, int rank) {
  if (rank == x->partner)
    return true;
  for (int i = 0; i < x->nin; i++)
    if (x->in[i].rank == rank)
      return true;
  return false;
}

static sender_t *sender_of(xchg_t *x, int rank) {
  for (int i = 0; i < x->nin; i++)
    if (x->in[i].rank == rank)
      return &x->in[i];
  return NULL;
}

/* Tell every peer that our exchange stopped. */
static void tell_stop(xchg_t *x) {
  for (int r = 0; r < x->d->size; r++) {
    if (r == x->me || !is_peer(x, r))
      continue;
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    head(&m, x->round, KIND_STOP);
    ckpt__mpi_send(x->d, r, CKPT__TAG_PARTNER, &m);
  }
}

/* ---- sending ---------------------------------------------------------- */

static int send_list(xchg_t *x) {
  ckpt_buf_t m;
  ckpt_buf_init(&m);
  head(&m, x->round, KIND_LIST);
  ckpt__put_u32(&m, x->nout);
  for (uint32_t i = 0; i < x->nout; i++) {
    uint8_t len = (uint8_t)strnlen(x->out[i].name, sizeof(x->out[i].name) - 1);
    ckpt_buf_append(&m, &len, 1);
    ckpt_buf_append(&m, x->out[i].name, len);
    put_u64(&m, x->out[i].size);
    x->out_total += x->out[i].size;
  }
  x->listed = true;
  int rc = ckpt__mpi_send(x->d, x->partner, CKPT__TAG_PARTNER, &m);
  if (rc)
    fail(x, "rank %d: partner copies: sending the list of its files to rank "
         "%d: %s", x->me, x->partner, strerror(-rc));
  return rc;
}

/* Read len bytes of file f at off into the end of m. */
static int read_frame(xchg_t *x, const ckpt_dist_file_t *f, uint64_t off,
                      size_t len, ckpt_buf_t *m) {
  int rc = ckpt_buf_reserve(m, len);
  for (size_t done = 0; rc == 0 && done < len;) {
    ssize_t r = pread(f->fd, m->data + m->len, len - done,
                      (off_t)(off + done));
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      rc = r < 0 ? -errno : -EIO;
      fail(x, "rank %d: partner copies: reading %s at %llu: %s", x->me,
           f->name, (unsigned long long)(off + done),
           r < 0 ? strerror(errno) : "shorter than the size written");
      break;
    }
    m->len += (size_t)r;
    done += (size_t)r;
  }
  return rc;
}

/* Hand our next frames to MPI while fewer than INFLIGHT are unfinished.
 * *busy: something was sent. */
static int send_some(xchg_t *x, bool *busy) {
  if (!x->listed) {
    *busy = true;
    return send_list(x);
  }
  while (x->cur < x->nout &&
         ckpt__mpi_pending(x->d, CKPT__TAG_PARTNER, x->round) < INFLIGHT) {
    const ckpt_dist_file_t *f = &x->out[x->cur];
    if (x->off >= f->size) {
      x->cur++, x->off = 0;
      continue;
    }
    size_t len = f->size - x->off < FRAME ? (size_t)(f->size - x->off) : FRAME;
    ckpt_buf_t m;
    ckpt_buf_init(&m);
    ckpt__mpi_buf(x->d, &m, HEAD + len); /* memory already mapped */
    int rc = ckpt_buf_reserve(&m, HEAD + len);
    if (rc) {
      fail(x, "rank %d: partner copies: out of memory", x->me);
      return rc;
    }
    head(&m, x->round, KIND_DATA);
    ckpt__put_u32(&m, x->cur);
    put_u64(&m, x->off);
    rc = read_frame(x, f, x->off, len, &m);
    if (rc) {
      ckpt_buf_free(&m);
      return rc;
    }
    rc = ckpt__mpi_send(x->d, x->partner, CKPT__TAG_PARTNER, &m);
    if (rc) {
      fail(x, "rank %d: partner copies: sending %s to rank %d: %s", x->me,
           f->name, x->partner, strerror(-rc));
      return rc;
    }
    x->off += len;
    x->out_sent += len;
    *busy = true;
  }
  return 0;
}

static bool all_sent(const xchg_t *x) {
  return x->listed && x->cur >= x->nout;
}

/* ---- receiving -------------------------------------------------------- */

static int close_file(xchg_t *x, sender_t *s, rx_file_t *f, bool ok) {
  char *err = NULL;
  int fd = f->fd;
  f->fd = -1;
  int rc = x->d->ops->partner_close(x->d->ctx, x->job, fd, ok, &err);
  if (rc && ok)
    fail(x, "rank %d: partner copies: %s of rank %d: %s", x->me, f->name,
         s->rank, err ? err : strerror(-rc));
  free(err);
  if (rc == 0 && ok)
    s->complete++;
  return rc;
}

static int take_list(xchg_t *x, sender_t *s, const uint8_t *p, size_t n) {
  if (s->listed || n < 4)
    return 0; /* a second list of one round: not ours to follow */
  uint32_t count = ckpt__get_u32(p);
  p += 4, n -= 4;
  if (count > n / 9) {
    fail(x, "rank %d: partner copies: a malformed file list from rank %d",
         x->me, s->rank);
    return -EPROTO;
  }
  s->files = calloc(count ? count : 1, sizeof(*s->files));
  if (!s->files) {
    fail(x, "rank %d: partner copies: out of memory", x->me);
    return -ENOMEM;
  }
  s->listed = true;
  for (uint32_t i = 0; i < count; i++)
    s->files[i].fd = -1;
  for (uint32_t i = 0; i < count; i++) {
    uint8_t len = n ? p[0] : 0;
    if (n < 1u + len + 8 || len == 0 || len >= CKPT_DIST_FILE_NAME_MAX ||
        memchr(p + 1, '\0', len)) {
      fail(x, "rank %d: partner copies: a malformed file list from rank %d",
           x->me, s->rank);
      return -EPROTO;
    }
    rx_file_t *f = &s->files[i];
    memcpy(f->name, p + 1, len);
    f->size = get_u64(p + 1 + len);
    p += 1 + len + 8, n -= 1u + len + 8;
    s->n = i + 1;
    s->total += f->size;
    char *err = NULL;
    int fd = x->d->ops->partner_open(x->d->ctx, x->job, s->rank, f->name,
                                     f->size, &err);
    if (fd < 0) {
      fail(x, "rank %d: partner copies: %s of rank %d: %s", x->me, f->name,
           s->rank, err ? err : strerror(-fd));
      free(err);
      return fd;
    }
    f->fd = fd;
    if (f->size == 0 && close_file(x, s, f, true))
      return -EIO;
  }
  return 0;
}

static int take_data(xchg_t *x, sender_t *s, const uint8_t *p, size_t n) {
  if (!s->listed || n < 12) {
    fail(x, "rank %d: partner copies: data from rank %d before its list",
         x->me, s->rank);
    return -EPROTO;
  }
  uint32_t i = ckpt__get_u32(p);
  uint64_t off = get_u64(p + 4);
  p += 12, n -= 12;
  rx_file_t *f = i < s->n ? &s->files[i] : NULL;
  if (!f || f->fd < 0 || off != f->got || n > f->size - f->got) {
    fail(x, "rank %d: partner copies: data from rank %d out of place (file "
         "%u, offset %llu)", x->me, s->rank, i, (unsigned long long)off);
    return -EPROTO;
  }
  for (size_t done = 0; done < n;) {
    ssize_t r = pwrite(f->fd, p + done, n - done, (off_t)(off + done));
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      int e = r < 0 ? errno : EIO;
      fail(x, "rank %d: partner copies: writing %s of rank %d: %s", x->me,
           f->name, s->rank, strerror(e));
      return -e;
    }
    done += (size_t)r;
  }
  f->got += n;
  s->got += n;
  if (f->got == f->size && close_file(x, s, f, true))
    return -EIO;
  return 0;
}

/* One message of the PARTNER tag from rank from. */
static int take(xchg_t *x, int from, const ckpt_buf_t *m) {
  if (m->len < 5 || ckpt__get_u32(m->data) != x->round || !is_peer(x, from))
    return 0; /* stale: a failed round's, or of no peer of ours */
  const uint8_t *p = m->data + 5;
  size_t n = m->len - 5;
  uint8_t kind = m->data[4];
  if (kind == KIND_STOP) { /* its own reason reaches the coordinator */
    fail(x, "rank %d: partner copies stopped: rank %d failed", x->me, from);
    return -ECANCELED;
  }
  sender_t *s = sender_of(x, from);
  if (!s)
    return 0;
  if (kind == KIND_LIST)
    return take_list(x, s, p, n);
  if (kind == KIND_DATA)
    return take_data(x, s, p, n);
  return 0;
}

/* Take what has come. *busy: something did. */
static int receive_some(xchg_t *x, bool *busy) {
  for (int k = 0; k < 8; k++) {
    if (!x->rx) {
      int r = ckpt__mpi_recv_start(x->d, -1, CKPT__TAG_PARTNER, &x->rbuf,
                                   &x->rx);
      if (r <= 0) {
        if (r < 0)
          fail(x, "rank %d: partner copies: receiving: %s", x->me,
               strerror(-r));
        return r;
      }
    }
    int from = -1;
    int r = ckpt__mpi_recv_done(x->d, x->rx, &from, &x->rbuf);
    if (r == 0)
      return 0;
    x->rx = NULL;
    if (r < 0) {
      fail(x, "rank %d: partner copies: receiving: %s", x->me, strerror(-r));
      return r;
    }
    *busy = true;
    if ((r = take(x, from, &x->rbuf)) != 0)
      return r;
  }
  return 0;
}

static bool all_received(const xchg_t *x) {
  for (int i = 0; i < x->nin; i++)
    if (!x->in[i].listed || x->in[i].complete < x->in[i].n)
      return false;
  return true;
}

/* ---- the exchange ----------------------------------------------------- */

static int node_of(const xchg_t *x, int rank) {
  return ckpt_dist_node_of(x->d, rank);
}

/* What is missing at the deadline, into why. */
static void fail_late(xchg_t *x) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  ckpt_buf_printf(&b, "rank %d: partner copies not done within %g s "
                  "(commit_timeout):", x->me, x->d->commit_timeout);
  const char *sep = " ";
  for (int i = 0; i < x->nin; i++) {
    const sender_t *s = &x->in[i];
    if (!s->listed)
      ckpt_buf_printf(&b, "%snothing came from rank %d (node %d)", sep,
                      s->rank, node_of(x, s->rank));
    else if (s->complete < s->n)
      ckpt_buf_printf(&b, "%s%llu of %llu bytes came from rank %d (node %d)",
                      sep, (unsigned long long)s->got,
                      (unsigned long long)s->total, s->rank,
                      node_of(x, s->rank));
    else
      continue;
    sep = "; ";
  }
  if (!all_sent(x))
    ckpt_buf_printf(&b, "%sat most %llu of this rank's %llu bytes reached "
                    "rank %d (node %d)", sep,
                    (unsigned long long)x->out_sent,
                    (unsigned long long)x->out_total, x->partner,
                    node_of(x, x->partner));
  fail(x, "%s", b.len ? (const char *)b.data : "partner copies timed out");
  ckpt_buf_free(&b);
}

/* For .status: whom the exchange waits for. */
static void report(xchg_t *x, double until) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  ckpt_buf_printf(&b, "rank %d (node %d) to take this rank's partner copies",
                  x->partner, node_of(x, x->partner));
  if (x->nin == 1 && x->in[0].rank == x->partner)
    ckpt_buf_printf(&b, " and to send its own");
  for (int i = 0; i < x->nin && !(x->nin == 1 && x->in[0].rank == x->partner);
       i++)
    ckpt_buf_printf(&b, "%srank %d (node %d)%s",
                    i == 0 ? ", and for " : i + 1 < x->nin ? ", " : " and ",
                    x->in[i].rank, node_of(x, x->in[i].rank),
                    i + 1 < x->nin ? "" : " to send theirs");
  ckpt_buf_printf(&b, " (commit_timeout)");
  ckpt__waiting(x->d, x->job, (const char *)b.data, until);
  ckpt_buf_free(&b);
}

static int find_senders(xchg_t *x) {
  int n = 0;
  for (int r = 0; r < x->d->size; r++)
    n += r != x->me && ckpt_dist_partner(x->d, r) == x->me;
  x->in = calloc(n ? (size_t)n : 1, sizeof(*x->in));
  if (!x->in)
    return -ENOMEM;
  for (int r = 0; r < x->d->size; r++)
    if (r != x->me && ckpt_dist_partner(x->d, r) == x->me)
      x->in[x->nin++].rank = r;
  return 0;
}

static void xchg_free(xchg_t *x) {
  for (uint32_t i = 0; i < x->nout; i++)
    if (x->out[i].fd >= 0)
      close(x->out[i].fd);
  free(x->out);
  for (int i = 0; i < x->nin; i++) {
    sender_t *s = &x->in[i];
    for (uint32_t k = 0; k < s->n; k++)
      if (s->files[k].fd >= 0)
        close_file(x, s, &s->files[k], false);
    free(s->files);
  }
  free(x->in);
  if (x->rx) /* a message half-received: MPI keeps its buffer */
    ckpt__mpi_recv_abandon(x->d, x->rx);
  ckpt_buf_free(&x->rbuf);
}

/* How long to wait between looks: not at all while frames move (MPI moves
 * a large message only while it is called), a little while idle. */
static void pause_xchg(xchg_t *x, bool busy, unsigned *spins) {
  if (busy) {
    *spins = 0;
    return;
  }
  if (x->rx || ckpt__mpi_pending(x->d, CKPT__TAG_PARTNER, x->round) > 0) {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
    return;
  }
  ckpt__pause_poll(spins);
}

int ckpt__partner_exchange(ckpt_dist_t *d, ckpt_dist_job_t *job,
                           uint32_t round, bool wrote, char **err) {
  xchg_t x = {.d = d, .job = job, .round = round, .me = d->rank};
  x.partner = ckpt_dist_partner(d, d->rank);
  ckpt_buf_init(&x.rbuf);
  int rc = find_senders(&x);
  if (rc) {
    *err = strdup("partner copies: out of memory");
    return rc;
  }
  if (!wrote) { /* our RESULT says why; the peers stop waiting */
    tell_stop(&x);
    xchg_free(&x);
    return 0;
  }
  char *why = NULL;
  rc = d->ops->partner_files(d->ctx, job, x.partner, &x.out, &x.nout, &why);
  if (rc == 0 && x.partner < 0) {
    rc = -EINVAL;
    free(why);
    why = strdup("partner copies need a world on two nodes or more");
  }
  if (rc) {
    fail(&x, "%s", why ? why : strerror(-rc));
    free(why);
    goto out;
  }
  double deadline = ckpt__now() + d->commit_timeout;
  report(&x, deadline);
  unsigned spins = 0;
  for (;;) {
    bool busy = false;
    if ((rc = send_some(&x, &busy)) != 0 ||
        (rc = receive_some(&x, &busy)) != 0)
      break;
    if (all_sent(&x) && all_received(&x) && !x.rx)
      break;
    if (ckpt__now() >= deadline) {
      fail_late(&x);
      rc = -ETIMEDOUT;
      break;
    }
    pause_xchg(&x, busy, &spins);
  }
  ckpt__waiting(d, job, NULL, 0);
out:
  if (rc)
    tell_stop(&x);
  xchg_free(&x);
  if (rc) {
    *err = x.why;
    return rc;
  }
  free(x.why);
  return 0;
}
