/*
 * cmd_diff.c - `ckptctl diff BACKING_DIR A B`: the tensors and blobs added
 * in B, removed from A and changed (dtype, shape, data, chunks, path),
 * from the two .metadata alone; with --content, tensors stored in
 * differently shaped chunks are read whole from both and compared.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "ckptctl.h"
#include "json.h"
#include "metadb.h"

enum {
  WHY_DTYPE = 1,   /* tensors */
  WHY_SHAPE = 2,
  WHY_CHUNKS = 4,  /* stored in other chunks: contents not compared */
  WHY_DATA = 8,    /* a chunk's (or the blob's) checksum or length */
  WHY_PATH = 16,   /* the same FQN from another path */
};

static const char *const why_names[] = {"dtype", "shape", "chunks", "data",
                                        "path"};

static unsigned tensor_changes(const ckpt_metadata_t *ma,
                               const ckpt_tensor_meta_t *a,
                               const ckpt_metadata_t *mb,
                               const ckpt_tensor_meta_t *b,
                               uint32_t *ndiff) {
  unsigned why = 0;
  *ndiff = 0;
  if (strcmp(a->path, b->path))
    why |= WHY_PATH;
  if (a->dtype != b->dtype)
    why |= WHY_DTYPE;
  if (a->ndim != b->ndim ||
      memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof(*a->shape)))
    why |= WHY_SHAPE;
  if (why & (WHY_DTYPE | WHY_SHAPE))
    return why;
  if (a->n_chunks != b->n_chunks)
    return why | WHY_CHUNKS;
  /* Both groups are sorted by offsets: compare them pairwise. */
  for (uint32_t i = 0; i < a->n_chunks; i++) {
    const ckpt_chunk_meta_t *ca = &ma->chunks[a->first_chunk + i];
    const ckpt_chunk_meta_t *cb = &mb->chunks[b->first_chunk + i];
    if (memcmp(ca->dims, cb->dims, 2 * (size_t)a->ndim * sizeof(*ca->dims)))
      return why | WHY_CHUNKS;
    if (ca->checksum != cb->checksum || ca->length != cb->length)
      (*ndiff)++;
  }
  return *ndiff ? why | WHY_DATA : why;
}

typedef struct {
  json_t j;
  bool json;
  uint32_t added, removed, changed, unchanged;
  const int8_t *same; /* --content, by A's tensor index: 1 the contents
                         are equal, 0 not, -1 not compared; or NULL */
} diff_t;

static void diff_one(diff_t *d, char op, const char *kind, const char *fqn,
                     unsigned why, const char *detail) {
  if (op == '+')
    d->added++;
  else if (op == '-')
    d->removed++;
  else
    d->changed++;
  if (!d->json) {
    printf("%c %s %s%s%s\n", op, kind, fqn, detail[0] ? ": " : "", detail);
    return;
  }
  j_open(&d->j, '{');
  j_key(&d->j, "kind"), j_str(&d->j, kind);
  j_key(&d->j, "fqn"), j_str(&d->j, fqn);
  if (op == '~') {
    j_key(&d->j, "reasons");
    j_open(&d->j, '[');
    for (unsigned k = 0; k < sizeof(why_names) / sizeof(why_names[0]); k++)
      if (why & (1u << k))
        j_str(&d->j, why_names[k]);
    j_close(&d->j, ']');
    j_key(&d->j, "detail"), j_str(&d->j, detail);
  }
  j_close(&d->j, '}');
}

/* A tensor only in one of A and B: "DTYPE [SHAPE]". */
static void diff_tensor_only(diff_t *d, char op, const ckpt_tensor_meta_t *t) {
  char detail[2200], dims[1024];
  snprintf(detail, sizeof(detail), "%s %s", ckpt_dtype_name(t->dtype),
           dims_text(t->shape, t->ndim, dims, sizeof(dims)));
  diff_one(d, op, "tensor", t->fqn, 0, detail);
}

/* A tensor in both, A's ta (index ia) and B's tb: changed or unchanged. */
static void diff_tensor_both(diff_t *d, const ckpt_metadata_t *ma,
                             uint32_t ia, const ckpt_metadata_t *mb,
                             const ckpt_tensor_meta_t *tb) {
  char detail[2200], da[1024], db[1024];
  const ckpt_tensor_meta_t *ta = &ma->tensors[ia];
  uint32_t ndiff;
  unsigned why = tensor_changes(ma, ta, mb, tb, &ndiff);
  bool whole = (why & WHY_CHUNKS) && d->same && d->same[ia] >= 0;
  if (whole) /* compared whole (--content) */
    why = (why & ~(unsigned)WHY_CHUNKS) | (d->same[ia] ? 0 : WHY_DATA);
  if (!why) {
    d->unchanged++;
    return;
  }
  size_t at = 0;
  detail[0] = '\0';
  if (why & WHY_DTYPE)
    at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                           "dtype %s -> %s, ", ckpt_dtype_name(ta->dtype),
                           ckpt_dtype_name(tb->dtype));
  if ((why & WHY_SHAPE) && at < sizeof(detail))
    at += (size_t)snprintf(
        detail + at, sizeof(detail) - at, "shape %s -> %s, ",
        dims_text(ta->shape, ta->ndim, da, sizeof(da)),
        dims_text(tb->shape, tb->ndim, db, sizeof(db)));
  if ((why & WHY_CHUNKS) && at < sizeof(detail))
    at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                           "stored in other chunks (%u -> %u; contents "
                           "not compared, see --content), ",
                           ta->n_chunks, tb->n_chunks);
  if ((why & WHY_DATA) && whole && at < sizeof(detail))
    at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                           "data: the contents differ (compared whole: "
                           "%u -> %u chunks), ",
                           ta->n_chunks, tb->n_chunks);
  else if ((why & WHY_DATA) && at < sizeof(detail))
    at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                           "data: %u of %u chunks differ, ", ndiff,
                           ta->n_chunks);
  if ((why & WHY_PATH) && at < sizeof(detail))
    at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                           "path %s -> %s, ", ta->path, tb->path);
  if (at >= 2 && at < sizeof(detail))
    detail[at - 2] = '\0';
  diff_one(d, '~', "tensor", ta->fqn, why, detail);
}

/* The tensors of diff_pass. */
static void diff_tensors(diff_t *d, char op, const ckpt_metadata_t *ma,
                         const ckpt_metadata_t *mb) {
  uint32_t i = 0, k = 0;
  while (i < ma->n_tensors || k < mb->n_tensors) {
    int c = i == ma->n_tensors   ? 1
            : k == mb->n_tensors ? -1
                                 : strcmp(ma->tensors[i].fqn,
                                          mb->tensors[k].fqn);
    if (c < 0) {
      const ckpt_tensor_meta_t *t = &ma->tensors[i++];
      if (op == '-')
        diff_tensor_only(d, '-', t);
    } else if (c > 0) {
      const ckpt_tensor_meta_t *t = &mb->tensors[k++];
      if (op == '+')
        diff_tensor_only(d, '+', t);
    } else {
      if (op == '~')
        diff_tensor_both(d, ma, i, mb, &mb->tensors[k]);
      i++, k++;
    }
  }
}

/* The blobs of diff_pass. */
static void diff_blobs(diff_t *d, char op, const ckpt_metadata_t *ma,
                       const ckpt_metadata_t *mb) {
  char detail[2200];
  uint32_t i = 0, k = 0;
  while (i < ma->n_blobs || k < mb->n_blobs) {
    int c = i == ma->n_blobs   ? 1
            : k == mb->n_blobs ? -1
                               : strcmp(ma->blobs[i].fqn, mb->blobs[k].fqn);
    if (c < 0) {
      const ckpt_blob_meta_t *b = &ma->blobs[i++];
      if (op == '-') {
        snprintf(detail, sizeof(detail), "%" PRIu64 " bytes", b->length);
        diff_one(d, '-', "blob", b->fqn, 0, detail);
      }
    } else if (c > 0) {
      const ckpt_blob_meta_t *b = &mb->blobs[k++];
      if (op == '+') {
        snprintf(detail, sizeof(detail), "%" PRIu64 " bytes", b->length);
        diff_one(d, '+', "blob", b->fqn, 0, detail);
      }
    } else {
      const ckpt_blob_meta_t *ba = &ma->blobs[i++], *bb = &mb->blobs[k++];
      unsigned why = (ba->checksum != bb->checksum ||
                      ba->length != bb->length ? WHY_DATA : 0) |
                     (strcmp(ba->path, bb->path) ? WHY_PATH : 0);
      if (op != '~')
        continue;
      if (!why) {
        d->unchanged++;
        continue;
      }
      if (why & WHY_DATA)
        snprintf(detail, sizeof(detail), "data: %" PRIu64 " -> %" PRIu64
                 " bytes, checksum %016" PRIx64 " -> %016" PRIx64,
                 ba->length, bb->length, ba->checksum, bb->checksum);
      else
        snprintf(detail, sizeof(detail), "path %s -> %s", ba->path, bb->path);
      diff_one(d, '~', "blob", ba->fqn, why, detail);
    }
  }
}

/* One pass of the sorted lists of A and B for op: '+' in B only, '-' in A
 * only, '~' in both but different (counting the unchanged). */
static void diff_pass(diff_t *d, char op, const ckpt_metadata_t *ma,
                      const ckpt_metadata_t *mb) {
  diff_tensors(d, op, ma, mb);
  diff_blobs(d, op, ma, mb);
}

static int hash_sink(void *arg, const uint8_t *p, size_t n, uint64_t at) {
  (void)at;
  return XXH3_64bits_update(arg, p, n) == XXH_OK ? 0 : -1;
}

/* XXH3-64 of tensor t read whole: 0, or -1 with the reason printed. */
static int tensor_digest(data_files_t *df, const ckpt_metadata_t *m,
                         const ckpt_tensor_meta_t *t, window_t *w,
                         uint64_t *out) {
  XXH3_state_t *h = XXH3_createState();
  int rc = h && XXH3_64bits_reset(h) == XXH_OK ? 0 : -1;
  if (rc)
    fail("out of memory");
  else
    rc = assemble_tensor(df, m, t, w, hash_sink, h);
  if (rc == 0)
    *out = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return rc;
}

/* --content: same[i] for every tensor i of A that B stores in other
 * chunks (same dtype and shape): whether the contents are equal. 0, or -1
 * with the reason printed. */
static int compare_contents(int bfd, const char *backing, const char *na,
                            const ckpt_metadata_t *ma, const char *nb,
                            const ckpt_metadata_t *mb, int8_t *same) {
  data_files_t da = {.backing = backing, .name = na};
  data_files_t db = {.backing = backing, .name = nb};
  window_t w = {.win = malloc(EXPORT_WINDOW), .src = malloc(EXPORT_WINDOW)};
  int rc = 0;
  if (!w.win || !w.src) {
    fail("out of memory");
    rc = -1;
  } else if (df_open(&da, bfd, ma) || df_open(&db, bfd, mb)) {
    rc = -1;
  }
  for (uint32_t i = 0, k = 0; rc == 0 && i < ma->n_tensors;) {
    int c = k == mb->n_tensors
                ? -1
                : strcmp(ma->tensors[i].fqn, mb->tensors[k].fqn);
    if (c != 0) {
      c < 0 ? i++ : k++;
      continue;
    }
    const ckpt_tensor_meta_t *ta = &ma->tensors[i], *tb = &mb->tensors[k];
    uint32_t ndiff;
    unsigned why = tensor_changes(ma, ta, mb, tb, &ndiff);
    uint64_t ha, hb;
    if ((why & WHY_CHUNKS) &&
        (rc = tensor_digest(&da, ma, ta, &w, &ha)) == 0 &&
        (rc = tensor_digest(&db, mb, tb, &w, &hb)) == 0)
      same[i] = ha == hb;
    i++, k++;
  }
  df_close(&da);
  df_close(&db);
  free(w.win);
  free(w.src);
  return rc;
}

/* --content: the same[] of compare_contents for A and B, malloc'd; or
 * NULL with the reason printed. */
static int8_t *content_same(int bfd, const args_t *a, const ckpt_metadata_t *ma,
                            const ckpt_metadata_t *mb) {
  int8_t *same = malloc(ma->n_tensors ? ma->n_tensors : 1);
  if (same)
    memset(same, -1, ma->n_tensors ? ma->n_tensors : 1);
  if (!same || compare_contents(bfd, a->pos[0], a->pos[1], ma, a->pos[2],
                                mb, same)) {
    if (!same)
      fail("out of memory");
    free(same);
    return NULL;
  }
  return same;
}

int cmd_diff(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_metadata_t ma, mb;
  if (load_named(bfd, backing, a->pos[1], &ma))
    return EXIT_USAGE;
  if (load_named(bfd, backing, a->pos[2], &mb)) {
    ckpt_metadata_free(&ma);
    return EXIT_USAGE;
  }
  diff_t d = {.json = a->json};
  int8_t *same = NULL;
  if (a->content && !(same = content_same(bfd, a, &ma, &mb))) {
    ckpt_metadata_free(&ma);
    ckpt_metadata_free(&mb);
    return EXIT_USAGE;
  }
  d.same = same;
  if (a->json) {
    j_begin(&d.j);
    j_open(&d.j, '{');
    j_key(&d.j, "a"), j_str(&d.j, a->pos[1]);
    j_key(&d.j, "b"), j_str(&d.j, a->pos[2]);
  } else {
    printf("--- %s\n+++ %s\n", a->pos[1], a->pos[2]);
  }
  static const char ops[3] = {'+', '-', '~'};
  static const char *const keys[3] = {"added", "removed", "changed"};
  for (int p = 0; p < 3; p++) {
    if (a->json) {
      j_key(&d.j, keys[p]);
      j_open(&d.j, '[');
    }
    diff_pass(&d, ops[p], &ma, &mb);
    if (a->json)
      j_close(&d.j, ']');
  }
  bool identical = d.added + d.removed + d.changed == 0;
  if (a->json) {
    j_key(&d.j, "unchanged"), j_u64(&d.j, d.unchanged);
    j_key(&d.j, "identical"), j_bool(&d.j, identical);
    j_close(&d.j, '}');
    j_end(&d.j);
  } else {
    printf("%u unchanged, %u added, %u removed, %u changed%s\n", d.unchanged,
           d.added, d.removed, d.changed, identical ? ": identical" : "");
  }
  free(same);
  ckpt_metadata_free(&ma);
  ckpt_metadata_free(&mb);
  return identical ? 0 : EXIT_NO;
}
