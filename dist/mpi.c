/*
 * mpi.c - every MPI call of ckptfs, made on the dist thread only
 * (MPI_THREAD_FUNNELED: this thread also initializes and finalizes MPI).
 *
 * Sends are nonblocking and tracked until MPI completes them, so a rank
 * that stopped listening never blocks the sender; receives poll with
 * MPI_Improbe/MPI_Mrecv so that every wait has a deadline in dist.c.
 */
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"

struct ckpt__pending {
  MPI_Request req;
  int tag;
  ckpt_buf_t msg; /* kept alive until the send completes */
  ckpt__pending_t *next;
};

struct ckpt__recv {
  MPI_Request req;
  ckpt_buf_t buf; /* MPI writes into it until the receive completes */
  ckpt__recv_t *next; /* abandoned list */
};

static MPI_Comm comm_of(ckpt_dist_t *d) { return *(MPI_Comm *)d->comm; }

bool ckpt__mpi_launched(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") ||
         getenv("PMI_RANK");
}

static char *mpi_error(const char *what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
    snprintf(text, sizeof(text), "MPI error %d", code);
  char *s = NULL;
  if (asprintf(&s, "%s: %s", what, text) < 0)
    s = NULL;
  return s;
}

/* Every rank's host name (d->self_host, gathered): a node of an earlier
 * world is known by it in this one. */
static int host_map(ckpt_dist_t *d, char **err) {
  d->host = calloc((size_t)d->size, sizeof(*d->host));
  if (!d->host) {
    *err = strdup("out of memory");
    return -ENOMEM;
  }
  int rc = MPI_Allgather(d->self_host, CKPT_DIST_HOST_MAX, MPI_CHAR, d->host,
                         CKPT_DIST_HOST_MAX, MPI_CHAR, comm_of(d));
  if (rc != MPI_SUCCESS) {
    *err = mpi_error("MPI_Allgather", rc);
    return -EIO;
  }
  for (int r = 0; r < d->size; r++)
    d->host[r][CKPT_DIST_HOST_MAX - 1] = '\0';
  return 0;
}

/* Which ranks share a node (the ranks MPI lets share memory): node k is
 * the k-th distinct node in the order of its lowest world rank. */
static int node_map(ckpt_dist_t *d, char **err) {
  MPI_Comm node;
  int rc = MPI_Comm_split_type(*(MPI_Comm *)d->comm, MPI_COMM_TYPE_SHARED,
                               d->rank, MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS) {
    *err = mpi_error("MPI_Comm_split_type", rc);
    return -EIO;
  }
  int low = d->rank;
  rc = MPI_Allreduce(MPI_IN_PLACE, &low, 1, MPI_INT, MPI_MIN, node);
  MPI_Comm_free(&node);
  int *lows = calloc((size_t)d->size, sizeof(*lows));
  d->node_of = calloc((size_t)d->size, sizeof(*d->node_of));
  if (!lows || !d->node_of) {
    free(lows);
    *err = strdup("out of memory");
    return -ENOMEM;
  }
  if (rc == MPI_SUCCESS)
    rc = MPI_Allgather(&low, 1, MPI_INT, lows, 1, MPI_INT,
                       *(MPI_Comm *)d->comm);
  if (rc != MPI_SUCCESS) {
    free(lows);
    *err = mpi_error("MPI_Allgather", rc);
    return -EIO;
  }
  /* A node's lowest rank is where it first appears in rank order. */
  d->nodes = 0;
  for (int r = 0; r < d->size; r++)
    d->node_of[r] = lows[r] == r ? d->nodes++ : d->node_of[lows[r]];
  free(lows);
  return host_map(d, err);
}

int ckpt__mpi_init(ckpt_dist_t *d, char **err) {
  int provided = 0;
  int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS) {
    *err = mpi_error("MPI_Init_thread", rc);
    return -EIO;
  }
  MPI_Comm *comm = malloc(sizeof(*comm));
  if (!comm) {
    *err = strdup("out of memory");
    return -ENOMEM;
  }
  /* A communicator of our own, whose errors come back as codes. */
  MPI_Comm_dup(MPI_COMM_WORLD, comm);
  MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(*comm, &d->rank);
  MPI_Comm_size(*comm, &d->size);
  d->comm = comm;
  return node_map(d, err);
}

void ckpt__mpi_finalize(ckpt_dist_t *d) {
  /* Sends still pending go to ranks that stopped listening: drop them. */
  while (d->pending) {
    ckpt__pending_t *p = d->pending;
    d->pending = p->next;
    int done = 0;
    MPI_Test(&p->req, &done, MPI_STATUS_IGNORE);
    if (!done) {
      MPI_Cancel(&p->req);
      MPI_Request_free(&p->req);
    }
    ckpt_buf_free(&p->msg);
    free(p);
  }
  /* Receives given up on: their requests go; their buffers only once MPI
   * can no longer write into them. */
  for (ckpt__recv_t *r = d->abandoned; r; r = r->next)
    if (r->req != MPI_REQUEST_NULL)
      MPI_Request_free(&r->req);
  if (d->comm) {
    MPI_Comm_free((MPI_Comm *)d->comm);
    free(d->comm);
    d->comm = NULL;
  }
  MPI_Finalize();
  while (d->nspare > 0)
    ckpt_buf_free(&d->spare[--d->nspare]);
  while (d->abandoned) {
    ckpt__recv_t *r = d->abandoned;
    d->abandoned = r->next;
    ckpt_buf_free(&r->buf);
    free(r);
  }
}

void ckpt__mpi_abort(ckpt_dist_t *d, int code) {
  (void)d;
  MPI_Abort(MPI_COMM_WORLD, code);
}

int ckpt__mpi_send(ckpt_dist_t *d, int dest, int tag, ckpt_buf_t *msg) {
  if (msg->len > INT_MAX) {
    ckpt_buf_free(msg);
    return -EMSGSIZE;
  }
  ckpt__pending_t *p = calloc(1, sizeof(*p));
  if (!p) {
    ckpt_buf_free(msg);
    return -ENOMEM;
  }
  p->tag = tag;
  p->msg = *msg;
  ckpt_buf_init(msg);
  int rc = MPI_Isend(p->msg.data, (int)p->msg.len, MPI_BYTE, dest, tag,
                     comm_of(d), &p->req);
  if (rc != MPI_SUCCESS) {
    ckpt_buf_free(&p->msg);
    free(p);
    return -EIO;
  }
  p->next = d->pending;
  d->pending = p;
  ckpt__mpi_progress(d);
  return 0;
}

/* A message of tag from src (any rank if src < 0) there now: 1 with *m,
 * *st and its byte *count, 0 if none, -EIO. Sends progress first. */
static int probe(ckpt_dist_t *d, int src, int tag, MPI_Message *m,
                 MPI_Status *st, int *count) {
  ckpt__mpi_progress(d);
  int flag = 0;
  if (MPI_Improbe(src < 0 ? MPI_ANY_SOURCE : src, tag, comm_of(d), &flag, m,
                  st) != MPI_SUCCESS)
    return -EIO;
  if (!flag)
    return 0;
  *count = 0;
  MPI_Get_count(st, MPI_BYTE, count);
  return 1;
}

int ckpt__mpi_poll(ckpt_dist_t *d, int src, int tag, int *from,
                   ckpt_buf_t *out) {
  MPI_Message m;
  MPI_Status st;
  int count, got = probe(d, src, tag, &m, &st, &count);
  if (got <= 0)
    return got;
  out->len = 0;
  int rc = ckpt_buf_reserve(out, (size_t)count + 1);
  if (rc) {
    MPI_Mrecv(NULL, 0, MPI_BYTE, &m, MPI_STATUS_IGNORE); /* drop it */
    return rc;
  }
  if (MPI_Mrecv(out->data, count, MPI_BYTE, &m, MPI_STATUS_IGNORE) !=
      MPI_SUCCESS)
    return -EIO;
  out->len = (size_t)count;
  *from = st.MPI_SOURCE;
  return 1;
}

bool ckpt__mpi_progress(ckpt_dist_t *d) {
  for (ckpt__pending_t **pp = &d->pending; *pp;) {
    ckpt__pending_t *p = *pp;
    int done = 0;
    MPI_Test(&p->req, &done, MPI_STATUS_IGNORE);
    if (done) {
      *pp = p->next;
      /* a partner frame's buffer (no other message's: a plan or the
       * .metadata may be far larger, and is sent once) */
      if (p->tag == CKPT__TAG_PARTNER && p->msg.cap >= CKPT__SPARE_MIN &&
          p->msg.cap <= CKPT__SPARE_MAX && d->nspare < CKPT__SPARES) {
        p->msg.len = 0;
        d->spare[d->nspare++] = p->msg;
      } else {
        ckpt_buf_free(&p->msg);
      }
      free(p);
    } else {
      pp = &p->next;
    }
  }
  return d->pending == NULL;
}

int ckpt__mpi_pending(ckpt_dist_t *d, int tag, uint32_t key) {
  ckpt__mpi_progress(d);
  int n = 0;
  for (ckpt__pending_t *p = d->pending; p; p = p->next) {
    const uint8_t *m = p->msg.data;
    n += p->tag == tag && p->msg.len >= 4 &&
         ((uint32_t)m[0] | (uint32_t)m[1] << 8 | (uint32_t)m[2] << 16 |
          (uint32_t)m[3] << 24) == key;
  }
  return n;
}

void ckpt__mpi_buf(ckpt_dist_t *d, ckpt_buf_t *b, size_t size) {
  for (int i = d->nspare - 1; i >= 0; i--)
    if (d->spare[i].cap > size) { /* (and its NUL) */
      ckpt_buf_free(b);
      *b = d->spare[i];
      d->spare[i] = d->spare[--d->nspare];
      return;
    }
}

int ckpt__mpi_recv_start(ckpt_dist_t *d, int src, int tag, ckpt_buf_t *buf,
                         ckpt__recv_t **out) {
  MPI_Message m;
  MPI_Status st;
  int count, got = probe(d, src, tag, &m, &st, &count);
  if (got <= 0)
    return got;
  ckpt__recv_t *r = calloc(1, sizeof(*r));
  if (r) {
    r->buf = *buf;
    ckpt_buf_init(buf);
    r->buf.len = 0;
  }
  /* (reserve keeps a byte for a NUL: a 4 MiB frame fits 4 MiB) */
  if (!r || ckpt_buf_reserve(&r->buf, (size_t)count)) {
    MPI_Mrecv(NULL, 0, MPI_BYTE, &m, MPI_STATUS_IGNORE); /* drop it */
    if (r) {
      *buf = r->buf;
      free(r);
    }
    return -ENOMEM;
  }
  if (MPI_Imrecv(r->buf.data, count, MPI_BYTE, &m, &r->req) != MPI_SUCCESS) {
    *buf = r->buf;
    free(r);
    return -EIO;
  }
  r->buf.len = (size_t)count;
  *out = r;
  return 1;
}

int ckpt__mpi_recv_done(ckpt_dist_t *d, ckpt__recv_t *r, int *from,
                        ckpt_buf_t *buf) {
  ckpt__mpi_progress(d);
  int done = 0;
  MPI_Status st;
  int rc = MPI_Test(&r->req, &done, &st);
  if (rc == MPI_SUCCESS && !done)
    return 0;
  ckpt_buf_free(buf);
  *buf = r->buf;
  free(r);
  if (rc != MPI_SUCCESS) {
    buf->len = 0;
    return -EIO;
  }
  *from = st.MPI_SOURCE;
  return 1;
}

void ckpt__mpi_recv_abandon(ckpt_dist_t *d, ckpt__recv_t *r) {
  r->next = d->abandoned;
  d->abandoned = r;
}
