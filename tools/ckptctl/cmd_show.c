/*
 * cmd_show.c - `ckptctl show BACKING_DIR NAME`: the tensors (dtype,
 * global shape, chunks, ranks holding them, bytes) and the blobs of one
 * committed checkpoint, as tables or one JSON document.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "catalog.h"
#include "ckptctl.h"
#include "json.h"
#include "metadb.h"

static uint64_t tensor_bytes(const ckpt_metadata_t *m,
                             const ckpt_tensor_meta_t *t) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < t->n_chunks; i++)
    sum += m->chunks[t->first_chunk + i].length;
  return sum;
}

static int by_rank(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* The distinct ranks holding t's chunks, sorted, into ranks (cap n_chunks);
 * returns how many. */
static uint32_t tensor_ranks(const ckpt_metadata_t *m,
                             const ckpt_tensor_meta_t *t, int32_t *ranks) {
  for (uint32_t i = 0; i < t->n_chunks; i++)
    ranks[i] = m->chunks[t->first_chunk + i].rank;
  if (t->n_chunks > 1)
    qsort(ranks, t->n_chunks, sizeof(*ranks), by_rank);
  uint32_t n = 0;
  for (uint32_t i = 0; i < t->n_chunks; i++)
    if (n == 0 || ranks[n - 1] != ranks[i])
      ranks[n++] = ranks[i];
  return n;
}

/* "0-3,5" */
static void ranks_text(const int32_t *r, uint32_t n, char *buf, size_t cap) {
  size_t at = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < n && at < cap;) {
    uint32_t j = i;
    while (j + 1 < n && r[j + 1] == r[j] + 1)
      j++;
    at += (size_t)snprintf(buf + at, cap - at, "%s%d", i ? "," : "", r[i]);
    if (j > i && at < cap)
      at += (size_t)snprintf(buf + at, cap - at, "%s%d", j > i + 1 ? "-" : ",",
                             r[j]);
    i = j + 1;
  }
}

/* What retention sees of a checkpoint (catalog.h): its step, whether
 * that was recorded at commit, and whether it is protected. */
typedef struct {
  int64_t step; /* -1: none */
  bool recorded;
  bool is_protected;
} retention_t;

static retention_t retention_of(int bfd, const char *name,
                                const ckpt_metadata_t *m) {
  retention_t r = {m->has_step ? m->step : ckpt_step_from_name(name),
                   m->has_step, m->protect};
  int dfd = ckpt_store_open_dir(bfd, name, O_RDONLY);
  int mark = dfd >= 0 ? ckpt__protect_read(dfd) : -1;
  if (dfd >= 0)
    close(dfd);
  if (mark >= 0)
    r.is_protected = mark == 1;
  return r;
}

static void retention_json(json_t *j, const ckpt_metadata_t *m,
                           const retention_t *r) {
  j_key(j, "step");
  r->step >= 0 ? j_i64(j, r->step) : j_null(j);
  j_key(j, "step_recorded"), j_bool(j, r->recorded);
  j_key(j, "protected"), j_bool(j, r->is_protected);
  j_key(j, "metrics");
  j_open(j, '{');
  for (uint32_t i = 0; i < m->n_metrics; i++)
    j_key(j, m->metrics[i].key), j_metric(j, m->metrics[i].value);
  j_close(j, '}');
}

/* ranks: scratch for tensor_ranks (n_chunks of m). */
static void show_json(const char *name, const ckpt_metadata_t *m,
                      const retention_t *rt, int32_t *ranks) {
  char t[64];
  json_t j;
  j_begin(&j);
  j_open(&j, '{');
  j_key(&j, "name"), j_str(&j, name);
  j_key(&j, "created_at"), j_str(&j, iso_time(m->created_at, t, sizeof(t)));
  j_key(&j, "created_at_unix"), j_i64(&j, m->created_at);
  j_key(&j, "save_id"), j_str(&j, m->save_id);
  j_key(&j, "world_size"), j_i64(&j, m->world_size);
  j_key(&j, "bytes"), j_u64(&j, stored_bytes(m));
  retention_json(&j, m, rt);
  j_key(&j, "tensors");
  j_open(&j, '[');
  for (uint32_t i = 0; i < m->n_tensors; i++) {
    const ckpt_tensor_meta_t *tm = &m->tensors[i];
    uint32_t nr = tensor_ranks(m, tm, ranks);
    j_open(&j, '{');
    j_key(&j, "fqn"), j_str(&j, tm->fqn);
    j_key(&j, "path"), j_str(&j, tm->path);
    j_key(&j, "dtype"), j_str(&j, ckpt_dtype_name(tm->dtype));
    j_key(&j, "shape"), j_dims(&j, tm->shape, tm->ndim);
    j_key(&j, "chunks"), j_u64(&j, tm->n_chunks);
    j_key(&j, "ranks");
    j_open(&j, '[');
    for (uint32_t r = 0; r < nr; r++)
      j_i64(&j, ranks[r]);
    j_close(&j, ']');
    j_key(&j, "bytes"), j_u64(&j, tensor_bytes(m, tm));
    j_close(&j, '}');
  }
  j_close(&j, ']');
  j_key(&j, "blobs");
  j_open(&j, '[');
  for (uint32_t i = 0; i < m->n_blobs; i++) {
    const ckpt_blob_meta_t *bm = &m->blobs[i];
    j_open(&j, '{');
    j_key(&j, "fqn"), j_str(&j, bm->fqn);
    j_key(&j, "path"), j_str(&j, bm->path);
    j_key(&j, "rank"), j_i64(&j, bm->rank);
    j_key(&j, "bytes"), j_u64(&j, bm->length);
    j_close(&j, '}');
  }
  j_close(&j, ']');
  j_close(&j, '}');
  j_end(&j);
}

/* The tables' column widths: *w the names (tensors and blobs), *wd the
 * shapes. */
static void show_widths(const ckpt_metadata_t *m, int *w, int *wd) {
  char dims[1024];
  *w = 6, *wd = 5;
  for (uint32_t i = 0; i < m->n_tensors; i++) {
    const ckpt_tensor_meta_t *tm = &m->tensors[i];
    if ((int)strlen(tm->fqn) > *w)
      *w = (int)strlen(tm->fqn);
    int l = (int)strlen(dims_text(tm->shape, tm->ndim, dims, sizeof(dims)));
    if (l > *wd)
      *wd = l;
  }
  for (uint32_t i = 0; i < m->n_blobs; i++)
    if ((int)strlen(m->blobs[i].fqn) > *w)
      *w = (int)strlen(m->blobs[i].fqn);
}

/* ranks: scratch for tensor_ranks (n_chunks of m). */
static void show_text(const char *name, const ckpt_metadata_t *m,
                      const retention_t *rt, int32_t *ranks) {
  char t[64], b[32], dims[1024], rtext[256];
  printf("%s: committed %s, world size %d, %u tensors in %u chunks, "
         "%u blobs, %s (%" PRIu64 " bytes)\n",
         name, iso_time(m->created_at, t, sizeof(t)), m->world_size,
         m->n_tensors, m->n_chunks, m->n_blobs,
         human_bytes(stored_bytes(m), b, sizeof(b)), stored_bytes(m));
  if (rt->step >= 0)
    printf("step %lld (%s)", (long long)rt->step,
           rt->recorded ? "recorded at commit" : "from the name");
  else
    printf("no step");
  for (uint32_t i = 0; i < m->n_metrics; i++) {
    ckpt_metric_format(m->metrics[i].value, t, sizeof(t));
    printf(", %s %s", m->metrics[i].key, t);
  }
  printf("%s\n", rt->is_protected ? ", protected" : "");
  int w, wd;
  show_widths(m, &w, &wd);
  if (m->n_tensors) {
    printf("\n%-*s  %-13s  %-*s  %6s  %-8s  %12s\n", w, "TENSOR", "DTYPE",
           wd, "SHAPE", "CHUNKS", "RANKS", "BYTES");
    for (uint32_t i = 0; i < m->n_tensors; i++) {
      const ckpt_tensor_meta_t *tm = &m->tensors[i];
      ranks_text(ranks, tensor_ranks(m, tm, ranks), rtext, sizeof(rtext));
      printf("%-*s  %-13s  %-*s  %6u  %-8s  %12" PRIu64 "\n", w, tm->fqn,
             ckpt_dtype_name(tm->dtype), wd,
             dims_text(tm->shape, tm->ndim, dims, sizeof(dims)),
             tm->n_chunks, rtext, tensor_bytes(m, tm));
    }
  }
  if (m->n_blobs) {
    printf("\n%-*s  %5s  %12s\n", w, "BLOB", "RANK", "BYTES");
    for (uint32_t i = 0; i < m->n_blobs; i++)
      printf("%-*s  %5d  %12" PRIu64 "\n", w, m->blobs[i].fqn,
             m->blobs[i].rank, m->blobs[i].length);
  }
}

int cmd_show(const args_t *a, int bfd) {
  const char *backing = a->pos[0], *name = a->pos[1];
  ckpt_metadata_t m;
  if (load_named(bfd, backing, name, &m))
    return EXIT_NO;
  int32_t *ranks = calloc(m.n_chunks ? m.n_chunks : 1, sizeof(*ranks));
  if (!ranks) {
    fail("out of memory");
    ckpt_metadata_free(&m);
    return EXIT_NO;
  }
  retention_t r = retention_of(bfd, name, &m);
  if (a->json)
    show_json(name, &m, &r, ranks);
  else
    show_text(name, &m, &r, ranks);
  free(ranks);
  ckpt_metadata_free(&m);
  return 0;
}
