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
  ckpt_buf_t msg; /* kept alive until the send completes */
  ckpt__pending_t *next;
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
  return 0;
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
  if (d->comm) {
    MPI_Comm_free((MPI_Comm *)d->comm);
    free(d->comm);
    d->comm = NULL;
  }
  MPI_Finalize();
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

int ckpt__mpi_poll(ckpt_dist_t *d, int src, int tag, int *from,
                   ckpt_buf_t *out) {
  ckpt__mpi_progress(d);
  int flag = 0;
  MPI_Message m;
  MPI_Status st;
  if (MPI_Improbe(src < 0 ? MPI_ANY_SOURCE : src, tag, comm_of(d), &flag, &m,
                  &st) != MPI_SUCCESS)
    return -EIO;
  if (!flag)
    return 0;
  int count = 0;
  MPI_Get_count(&st, MPI_BYTE, &count);
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
      ckpt_buf_free(&p->msg);
      free(p);
    } else {
      pp = &p->next;
    }
  }
  return d->pending == NULL;
}
