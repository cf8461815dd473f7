/*
 * plan.c - local plans, the global plan and the structures they produce.
 *
 * The global plan is DCP's create_global_plan + dedup_save_plans +
 * _validate_global_plan, made linear-logarithmic and stricter. Workload: up
 * to millions of chunks from thousands of ranks, run once per commit on the
 * coordinator; the whole plan must take well under a second per million
 * chunks. Steps (ckpt_plan_global):
 *
 *  1. every item becomes a ref; FQNs are interned in a hash table, the
 *     distinct FQNs sorted, and the refs sorted by (FQN position, offsets,
 *     sizes, rank). A group is the refs of one FQN; a set is the refs of
 *     identical chunks (same FQN, offsets and sizes): the replicas. A bytes
 *     item is a set of its own group, replicated when several ranks have it.
 *  2. each rank's reservations and pins are validated (check_pins: inside
 *     io_threads files and the reservations, no overlap, through a sort of
 *     the rank's pins); then each group (path, kind, dtype, shape, bounds,
 *     lengths, replica contents), then its kept chunks are checked for
 *     overlap and exact coverage on a grid of the distinct cut points of
 *     every dimension (a sweep along dimension 0 when that grid would be
 *     large); then the committed paths (check_paths: a tensor shows at
 *     the path of its chunk at the smallest offsets, a bytes item at its
 *     lowest rank's; no two FQNs at one path, no path under another).
 *     Problems are reported one per line (pins in rank order, the
 *     groups in FQN order, then path clashes), at most MAX_PROBLEM_LINES
 *     lines plus a count of the rest.
 *  3. only a valid plan goes on: sets held by one rank stay there, then
 *     replicated sets, largest first, go to the holder with the fewest
 *     bytes so far (ties: lowest rank) among those that have the set
 *     pinned if any do;
 *  4. each rank's kept pinned items stay where they are; the other items
 *     are spread over its data files (largest first into the least full
 *     file, through a heap, loads starting at the reservations) and laid
 *     out in FQN order after the reservations;
 *  5. the metadata is built from the sets and their assignments.
 */
#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "planner_int.h"

/* ------------------------------------------------------------------------
 * Freeing.
 * ---------------------------------------------------------------------- */

void ckpt__write_item_free(ckpt_write_item_t *it) {
  free(it->fqn);
  free(it->path);
  free(it->dims);
}

void ckpt_metadata_free(ckpt_metadata_t *m) {
  if (m == NULL)
    return;
  free(m->name);
  free(m->save_id);
  for (uint32_t i = 0; i < m->n_tensors; i++) {
    free(m->tensors[i].fqn);
    free(m->tensors[i].path);
    free(m->tensors[i].shape);
  }
  free(m->tensors);
  for (uint32_t i = 0; i < m->n_chunks; i++)
    free(m->chunks[i].dims);
  free(m->chunks);
  for (uint32_t i = 0; i < m->n_blobs; i++) {
    free(m->blobs[i].fqn);
    free(m->blobs[i].path);
  }
  free(m->blobs);
  for (uint32_t i = 0; i < m->n_entries; i++)
    ckpt_entry_attr_free(&m->entries[i]);
  free(m->entries);
  free(m->metrics);
  free(m->replaces);
  memset(m, 0, sizeof(*m));
}

bool ckpt_metadata_metric(const ckpt_metadata_t *m, const char *key,
                          double *v) {
  for (uint32_t i = 0; i < m->n_metrics; i++)
    if (strcmp(m->metrics[i].key, key) == 0) {
      *v = m->metrics[i].value;
      return true;
    }
  return false;
}

void ckpt_entry_attr_free(ckpt_entry_attr_t *e) {
  free(e->path);
  free(e->target);
  for (uint32_t i = 0; i < e->n_xattrs; i++) {
    free(e->xattrs[i].name);
    free(e->xattrs[i].value);
  }
  free(e->xattrs);
  memset(e, 0, sizeof(*e));
}

int ckpt_entry_attr_copy(ckpt_entry_attr_t *dst, const ckpt_entry_attr_t *src) {
  *dst = (ckpt_entry_attr_t){.path = strdup(src->path),
                             .mode = src->mode,
                             .uid = src->uid,
                             .gid = src->gid,
                             .mtime_ns = src->mtime_ns};
  bool ok = dst->path != NULL;
  if (ok && src->target)
    ok = (dst->target = strdup(src->target)) != NULL;
  if (ok && src->n_xattrs)
    ok = (dst->xattrs = calloc(src->n_xattrs, sizeof(*dst->xattrs))) != NULL;
  for (uint32_t i = 0; ok && i < src->n_xattrs; i++) {
    const ckpt_xattr_t *x = &src->xattrs[i];
    ckpt_xattr_t *y = &dst->xattrs[dst->n_xattrs++];
    y->len = x->len;
    ok = (y->name = strdup(x->name)) != NULL &&
         (x->len == 0 || (y->value = malloc(x->len)) != NULL);
    if (ok && x->len)
      memcpy(y->value, x->value, x->len);
  }
  if (!ok)
    ckpt_entry_attr_free(dst);
  return ok ? 0 : -ENOMEM;
}

bool ckpt_xattr_name_ok(const char *name, size_t len) {
  return len > 5 && len <= CKPT_XATTR_NAME_MAX &&
         memcmp(name, "user.", 5) == 0 &&
         !(len >= 10 && memcmp(name, "user.ckpt.", 10) == 0) &&
         memchr(name, '\0', len) == NULL;
}

static int check_xattrs(const ckpt_entry_attr_t *e) {
  if (e->n_xattrs > CKPT_XATTR_COUNT_MAX)
    return -ENOSPC;
  uint64_t total = 0;
  for (uint32_t i = 0; i < e->n_xattrs; i++) {
    const ckpt_xattr_t *x = &e->xattrs[i];
    if (!x->name || !ckpt_xattr_name_ok(x->name, strlen(x->name)) ||
        (x->len && !x->value) ||
        (i > 0 && strcmp(e->xattrs[i - 1].name, x->name) >= 0))
      return -EINVAL;
    if (x->len > CKPT_XATTR_VALUE_MAX)
      return -E2BIG;
    total += strlen(x->name) + x->len;
  }
  return total > CKPT_XATTR_TOTAL_MAX ? -ENOSPC : 0;
}

int ckpt_entry_attr_check(const ckpt_entry_attr_t *e) {
  uint32_t type = e->mode & 0170000;
  size_t tlen = e->target ? strlen(e->target) : 0;
  if (!e->path || strlen(e->path) > 4095 ||
      (type != 0100000 && type != 0040000 && type != 0120000) ||
      (e->mode & ~(0170000u | 07777u)))
    return -EINVAL;
  if (type == 0120000 ? tlen == 0 || tlen > CKPT_LINK_TARGET_MAX
                      : e->target && (type == 0040000 || tlen == 0 ||
                                      tlen > 4095))
    return -EINVAL;
  return check_xattrs(e);
}

static int entry_cmp(const void *a, const void *b) {
  const ckpt_entry_attr_t *x = a, *y = b;
  return strcmp(x->path, y->path);
}

const ckpt_entry_attr_t *ckpt_metadata_entry(const ckpt_metadata_t *m,
                                             const char *path) {
  if (!m || m->n_entries == 0)
    return NULL;
  ckpt_entry_attr_t key = {.path = (char *)path};
  return bsearch(&key, m->entries, m->n_entries, sizeof(key), entry_cmp);
}

/* qsort with ties kept in their order: sort (entry, position) pairs. */
typedef struct {
  ckpt_entry_attr_t e;
  uint32_t pos;
} entry_pos_t;

static int entry_pos_cmp(const void *a, const void *b) {
  const entry_pos_t *x = a, *y = b;
  int c = strcmp(x->e.path, y->e.path);
  return c ? c : x->pos < y->pos ? -1 : x->pos > y->pos;
}

void ckpt_entries_merge(ckpt_entry_attr_t *e, uint32_t *n) {
  if (*n < 2)
    return;
  entry_pos_t *t = malloc(*n * sizeof(*t));
  if (t) {
    for (uint32_t i = 0; i < *n; i++)
      t[i] = (entry_pos_t){e[i], i};
    qsort(t, *n, sizeof(*t), entry_pos_cmp);
    for (uint32_t i = 0; i < *n; i++)
      e[i] = t[i].e;
    free(t);
  } else {
    qsort(e, *n, sizeof(*e), entry_cmp); /* the owner then of any of them */
  }
  uint32_t out = 0;
  for (uint32_t i = 0; i < *n; i++) {
    if (out > 0 && strcmp(e[out - 1].path, e[i].path) == 0) {
      ckpt_entry_attr_t *k = &e[out - 1];
      if ((k->mode & 0170000) == (e[i].mode & 0170000)) {
        k->mode &= (e[i].mode | 0170000);
        if (e[i].mtime_ns > k->mtime_ns)
          k->mtime_ns = e[i].mtime_ns;
      }
      ckpt_entry_attr_free(&e[i]);
      continue;
    }
    e[out++] = e[i];
  }
  *n = out;
}

void ckpt_rank_plan_free(ckpt_rank_plan_t *rp) {
  if (rp == NULL)
    return;
  free(rp->file_bytes);
  free(rp->assign);
  memset(rp, 0, sizeof(*rp));
}

/* ------------------------------------------------------------------------
 * Local plans.
 * ---------------------------------------------------------------------- */

void ckpt_local_plan_init(ckpt_local_plan_t *lp, int32_t rank) {
  assert(lp != NULL);
  memset(lp, 0, sizeof(*lp));
  lp->rank = rank;
}

void ckpt_local_plan_free(ckpt_local_plan_t *lp) {
  if (lp == NULL)
    return;
  for (uint32_t i = 0; i < lp->n_items; i++)
    ckpt__write_item_free(&lp->items[i]);
  free(lp->items);
  free(lp->errors);
  free(lp->reserved);
  for (uint32_t i = 0; i < lp->n_attrs; i++)
    ckpt_entry_attr_free(&lp->attrs[i]);
  free(lp->attrs);
  ckpt_local_plan_init(lp, lp->rank);
}

int ckpt_local_plan_add_attr(ckpt_local_plan_t *lp, const char *path,
                             uint32_t mode, uint32_t uid, uint32_t gid,
                             int64_t mtime_ns) {
  assert(path != NULL);
  ckpt_entry_attr_t e = {(char *)path, mode, uid, gid, mtime_ns, NULL, 0,
                         NULL};
  if ((mode & 0170000) == 0120000)
    return -EINVAL; /* a link has a target: ckpt_local_plan_add_entry */
  return ckpt_local_plan_add_entry(lp, &e);
}

int ckpt_local_plan_add_entry(ckpt_local_plan_t *lp,
                              const ckpt_entry_attr_t *e) {
  assert(lp != NULL && e != NULL);
  int rc = ckpt_entry_attr_check(e);
  if (rc)
    return rc;
  if (lp->n_attrs == lp->cap_attrs) {
    uint32_t cap = lp->cap_attrs ? 2 * lp->cap_attrs : 16;
    ckpt_entry_attr_t *a = realloc(lp->attrs, cap * sizeof(*a));
    if (!a)
      return -ENOMEM;
    lp->attrs = a;
    lp->cap_attrs = cap;
  }
  if ((rc = ckpt_entry_attr_copy(&lp->attrs[lp->n_attrs], e)) == 0)
    lp->n_attrs++;
  return rc;
}

int ckpt_local_plan_set_fqn(ckpt_local_plan_t *lp, uint32_t index,
                            const char *fqn, size_t len) {
  assert(lp != NULL);
  if (index >= lp->n_items || !ckpt_fqn_valid(fqn, len))
    return -EINVAL;
  char *copy = strndup(fqn, len);
  if (copy == NULL)
    return -ENOMEM;
  free(lp->items[index].fqn);
  lp->items[index].fqn = copy;
  lp->items[index].fqn_explicit = true;
  return 0;
}

int ckpt_local_plan_pin(ckpt_local_plan_t *lp, uint32_t index, uint32_t file,
                        uint64_t offset) {
  assert(lp != NULL);
  if (index >= lp->n_items)
    return -EINVAL;
  lp->items[index].pin_file = file;
  lp->items[index].pin_offset = file == CKPT_NO_PIN ? 0 : offset;
  return 0;
}

int ckpt_local_plan_reserve(ckpt_local_plan_t *lp, uint32_t file,
                            uint64_t bytes) {
  assert(lp != NULL);
  if (file == CKPT_NO_PIN)
    return -EINVAL;
  if (file >= lp->n_reserved) {
    uint64_t *r = realloc(lp->reserved, ((size_t)file + 1) * sizeof(*r));
    if (r == NULL)
      return -ENOMEM;
    memset(r + lp->n_reserved, 0,
           ((size_t)file + 1 - lp->n_reserved) * sizeof(*r));
    lp->reserved = r;
    lp->n_reserved = file + 1;
  }
  lp->reserved[file] = bytes;
  return 0;
}

int ckpt__local_plan_push(ckpt_local_plan_t *lp, const char *path,
                          size_t path_len, ckpt_item_kind_t kind,
                          ckpt_dtype_t dtype, int ndim, const int64_t *dims,
                          uint64_t length, uint64_t checksum,
                          uint32_t local_id) {
  assert(lp != NULL && path != NULL);
  assert(ndim >= 0 && ndim <= CKPT_MAX_NDIM && (dims != NULL || ndim == 0));
  ckpt_write_item_t it = {.kind = kind,
                          .dtype = dtype,
                          .ndim = ndim,
                          .length = length,
                          .checksum = checksum,
                          .local_id = local_id,
                          .pin_file = CKPT_NO_PIN,
                          .pin_offset = 0};
  if (lp->n_items == UINT32_MAX)
    return -ENOMEM;
  if (lp->n_items == lp->cap_items) {
    uint32_t cap = lp->cap_items < 8                ? 8
                   : lp->cap_items > UINT32_MAX / 2 ? UINT32_MAX
                                                    : lp->cap_items * 2;
    ckpt_write_item_t *items = realloc(lp->items, (size_t)cap * sizeof(*items));
    if (items == NULL)
      return -ENOMEM;
    lp->items = items;
    lp->cap_items = cap;
  }
  it.path = strndup(path, path_len);
  it.fqn = it.path != NULL ? ckpt_fqn_from_path(it.path) : NULL;
  if (ndim > 0) {
    it.dims = malloc(3 * (size_t)ndim * sizeof(int64_t));
    if (it.dims != NULL)
      memcpy(it.dims, dims, 3 * (size_t)ndim * sizeof(int64_t));
  }
  if (it.path == NULL || it.fqn == NULL || (ndim > 0 && it.dims == NULL)) {
    ckpt__write_item_free(&it);
    return -ENOMEM;
  }
  lp->items[lp->n_items++] = it;
  return 0;
}

int ckpt_local_plan_add_tensor(ckpt_local_plan_t *lp, const char *path,
                               ckpt_dtype_t dtype, int ndim,
                               const int64_t *shape, const int64_t *offsets,
                               const int64_t *sizes, uint64_t length,
                               uint64_t checksum, uint32_t local_id) {
  assert(shape != NULL || ndim <= 0);
  int64_t dims[3 * CKPT_MAX_NDIM];
  if (ndim < 0 || ndim > CKPT_MAX_NDIM)
    return -EINVAL;
  for (int i = 0; i < ndim; i++) {
    dims[i] = shape[i];
    dims[ndim + i] = offsets != NULL ? offsets[i] : 0;
    dims[2 * ndim + i] = sizes != NULL ? sizes[i] : shape[i];
  }
  return ckpt__local_plan_push(lp, path, strlen(path), CKPT_ITEM_TENSOR, dtype,
                               ndim, dims, length, checksum, local_id);
}

int ckpt_local_plan_add_bytes(ckpt_local_plan_t *lp, const char *path,
                              uint64_t length, uint64_t checksum,
                              uint32_t local_id) {
  return ckpt__local_plan_push(lp, path, strlen(path), CKPT_ITEM_BYTES,
                               CKPT_DTYPE_INVALID, 0, NULL, length, checksum,
                               local_id);
}

int ckpt_local_plan_add_error(ckpt_local_plan_t *lp, const char *fmt, ...) {
  assert(lp != NULL && fmt != NULL);
  char *msg = NULL;
  va_list ap;
  va_start(ap, fmt);
  int n = vasprintf(&msg, fmt, ap);
  va_end(ap);
  if (n < 0)
    return -ENOMEM;
  while (n > 0 && msg[n - 1] == '\n')
    msg[--n] = '\0';
  size_t old = lp->errors != NULL ? strlen(lp->errors) : 0;
  char *p = realloc(lp->errors, old + 1 + (size_t)n + 1);
  if (p == NULL) {
    free(msg);
    return -ENOMEM;
  }
  if (old > 0)
    p[old++] = '\n';
  memcpy(p + old, msg, (size_t)n + 1);
  lp->errors = p;
  free(msg);
  return 0;
}

/* ------------------------------------------------------------------------
 * The global plan: state and problem reports.
 * ---------------------------------------------------------------------- */

#define MAX_PROBLEM_LINES 50
#define ALIGN_MIN_LEN ((uint64_t)64 * 1024) /* items this large are aligned */
#define ALIGN ((uint64_t)4096)
#define NONE UINT32_MAX

/* One staged item of one rank. */
typedef struct {
  const ckpt_write_item_t *it;
  uint32_t gpos; /* position of the item's FQN among the sorted FQNs */
  int32_t rank;
} ref_t;

/* Problem lines of one kind (errors or warnings). */
typedef struct {
  ckpt_buf_t buf;
  uint32_t lines; /* lines in buf */
  uint64_t more;  /* problems beyond MAX_PROBLEM_LINES */
} report_t;

typedef struct {
  const ckpt_plan_opts_t *opts;
  const ckpt_local_plan_t *locals;
  int32_t world;
  bool any_pin; /* some item of some rank is pinned */
  uint32_t n_refs;
  ref_t *refs; /* sorted as in step 1 */
  uint32_t n_groups;
  uint32_t *group_first; /* n_groups + 1: refs of group g */
  uint32_t *group_set;   /* n_groups + 1: sets of group g */
  uint32_t n_sets;
  uint32_t *set_first; /* n_sets + 1: refs of set s */
  uint32_t *keeper;    /* per set: the ref whose copy is kept */
  uint32_t *set_file;  /* per set: data file K of the keeper */
  uint64_t *set_off;   /* per set: offset in that file */
  report_t errors;
  report_t warnings;
  ckpt_buf_t msg; /* the problem line being built */
  int rc;         /* first failure while building lines (-ENOMEM) */
} plan_t;

static void put(plan_t *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Append to the line being built; a failure is kept in p->rc. */
static void put(plan_t *p, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  int n = vasprintf(&s, fmt, ap);
  va_end(ap);
  int rc = n < 0 ? -ENOMEM : ckpt_buf_append(&p->msg, s, (size_t)n);
  if (rc < 0 && p->rc == 0)
    p->rc = rc;
  free(s);
}

/* Whether a new line fits into r; counts it either way. */
static bool want(report_t *r) {
  if (r->lines >= MAX_PROBLEM_LINES) {
    r->more++;
    return false;
  }
  r->lines++;
  return true;
}

/* Start a line about group item it: "fqn (path): ". */
static bool begin(plan_t *p, report_t *r, const ckpt_write_item_t *it) {
  if (!want(r))
    return false;
  put(p, "%s (%s): ", it->fqn, it->path);
  return true;
}

/* End the line being built: control characters (a newline in a file name)
 * become '?', so that every problem stays on one line. */
static void emit(plan_t *p, report_t *r) {
  for (size_t i = 0; i < p->msg.len; i++) {
    if (p->msg.data[i] < 0x20 || p->msg.data[i] == 0x7f)
      p->msg.data[i] = '?';
  }
  int rc = 0;
  if (r->buf.len > 0)
    rc = ckpt_buf_append(&r->buf, "\n", 1);
  if (rc == 0)
    rc = ckpt_buf_append(&r->buf, p->msg.data, p->msg.len);
  if (rc < 0 && p->rc == 0)
    p->rc = rc;
  p->msg.len = 0;
}

/* "[4,-1]": any values, also the invalid ones being reported. */
static void put_dims(plan_t *p, const int64_t *d, int ndim) {
  put(p, "[");
  for (int i = 0; i < ndim; i++)
    put(p, "%s%lld", i > 0 ? "," : "", (long long)d[i]);
  put(p, "]");
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* "rank 2" or "ranks 0,1,3" or "ranks 0-63,65": the distinct ranks of n
 * refs, runs of four or more as ranges. */
static void put_ranks(plan_t *p, const ref_t *refs, size_t n) {
  int32_t *r = malloc(n * sizeof(*r));
  if (r == NULL) {
    p->rc = -ENOMEM;
    return;
  }
  for (size_t i = 0; i < n; i++)
    r[i] = refs[i].rank;
  qsort(r, n, sizeof(*r), cmp_i32);
  size_t m = 0;
  for (size_t i = 0; i < n; i++) {
    if (m == 0 || r[m - 1] != r[i])
      r[m++] = r[i];
  }
  put(p, "rank%s ", m > 1 ? "s" : "");
  for (size_t i = 0; i < m;) {
    size_t j = i;
    while (j + 1 < m && r[j + 1] == r[j] + 1)
      j++;
    if (j >= i + 3) {
      put(p, "%s%d-%d", i > 0 ? "," : "", (int)r[i], (int)r[j]);
    } else {
      j = i;
      put(p, "%s%d", i > 0 ? "," : "", (int)r[i]);
    }
    i = j + 1;
  }
  free(r);
}

/* ------------------------------------------------------------------------
 * Describing values that should agree: "ranks 0,1 float32, rank 2 float64".
 * ---------------------------------------------------------------------- */

typedef struct {
  int (*cmp)(const ref_t *a, const ref_t *b); /* by value only */
  int (*sort)(const void *a, const void *b);  /* by value, then rank */
  void (*put_value)(plan_t *p, const ckpt_write_item_t *it);
} value_kind_t;

static int cmp_rank(const ref_t *a, const ref_t *b) {
  return (a->rank > b->rank) - (a->rank < b->rank);
}

static int cmp_dtype(const ref_t *a, const ref_t *b) {
  return (a->it->dtype > b->it->dtype) - (a->it->dtype < b->it->dtype);
}

static int cmp_dims(const int64_t *a, int na, const int64_t *b, int nb) {
  if (na != nb)
    return (na > nb) - (na < nb);
  for (int i = 0; i < na; i++) {
    if (a[i] != b[i])
      return (a[i] > b[i]) - (a[i] < b[i]);
  }
  return 0;
}

static int cmp_shape(const ref_t *a, const ref_t *b) {
  return cmp_dims(ckpt_item_shape(a->it), a->it->ndim, ckpt_item_shape(b->it),
                  b->it->ndim);
}

static int cmp_content(const ref_t *a, const ref_t *b) {
  const ckpt_write_item_t *x = a->it, *y = b->it;
  if (x->length != y->length)
    return (x->length > y->length) - (x->length < y->length);
  return (x->checksum > y->checksum) - (x->checksum < y->checksum);
}

static int sort_dtype(const void *a, const void *b) {
  int c = cmp_dtype(a, b);
  return c != 0 ? c : cmp_rank(a, b);
}

static int sort_shape(const void *a, const void *b) {
  int c = cmp_shape(a, b);
  return c != 0 ? c : cmp_rank(a, b);
}

static int sort_content(const void *a, const void *b) {
  int c = cmp_content(a, b);
  return c != 0 ? c : cmp_rank(a, b);
}

static void put_dtype(plan_t *p, const ckpt_write_item_t *it) {
  put(p, "%s", ckpt_dtype_name(it->dtype));
}

static void put_shape(plan_t *p, const ckpt_write_item_t *it) {
  put_dims(p, ckpt_item_shape(it), it->ndim);
}

static void put_checksum(plan_t *p, const ckpt_write_item_t *it) {
  put(p, "checksum %016llx", (unsigned long long)it->checksum);
}

static void put_length_checksum(plan_t *p, const ckpt_write_item_t *it) {
  put(p, "%llu bytes checksum %016llx", (unsigned long long)it->length,
      (unsigned long long)it->checksum);
}

static const value_kind_t by_dtype = {cmp_dtype, sort_dtype, put_dtype};
static const value_kind_t by_shape = {cmp_shape, sort_shape, put_shape};
static const value_kind_t by_checksum = {cmp_content, sort_content,
                                         put_checksum};
static const value_kind_t by_content = {cmp_content, sort_content,
                                        put_length_checksum};

/* Whether the n refs all have the same value. */
static bool agree(const ref_t *refs, size_t n, const value_kind_t *vk) {
  for (size_t i = 1; i < n; i++) {
    if (vk->cmp(&refs[0], &refs[i]) != 0)
      return false;
  }
  return true;
}

typedef struct {
  size_t start, end; /* refs with one value, sorted by rank */
  int32_t rank;      /* the lowest of them */
} run_t;

static int cmp_run(const void *a, const void *b) {
  int32_t x = ((const run_t *)a)->rank, y = ((const run_t *)b)->rank;
  return (x > y) - (x < y);
}

/* Append the values of n refs grouped by value, the group with the lowest
 * rank first: "ranks 0,1,3 checksum 01.., rank 2 checksum fe..". */
static void put_values(plan_t *p, const ref_t *refs, size_t n,
                       const value_kind_t *vk) {
  ref_t *h = malloc(n * sizeof(*h));
  run_t *runs = malloc(n * sizeof(*runs));
  if (h == NULL || runs == NULL) {
    p->rc = -ENOMEM;
    goto out;
  }
  memcpy(h, refs, n * sizeof(*h));
  qsort(h, n, sizeof(*h), vk->sort);
  size_t n_runs = 0;
  for (size_t i = 0; i < n; i++) {
    if (i == 0 || vk->cmp(&h[i - 1], &h[i]) != 0)
      runs[n_runs++] = (run_t){.start = i, .rank = h[i].rank};
    runs[n_runs - 1].end = i + 1;
  }
  qsort(runs, n_runs, sizeof(*runs), cmp_run);
  for (size_t i = 0; i < n_runs; i++) {
    if (i > 0)
      put(p, ", ");
    put_ranks(p, h + runs[i].start, runs[i].end - runs[i].start);
    put(p, " ");
    vk->put_value(p, h[runs[i].start].it);
  }
out:
  free(runs);
  free(h);
}

/* ------------------------------------------------------------------------
 * Step 1: refs, groups and sets.
 * ---------------------------------------------------------------------- */

/* FNV-1a, 64 bits. */
static uint64_t hash_str(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s != '\0'; s++)
    h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

typedef struct {
  const char *fqn;
  uint32_t id;
} fqn_entry_t;

static int cmp_fqn_entry(const void *a, const void *b) {
  return strcmp(((const fqn_entry_t *)a)->fqn, ((const fqn_entry_t *)b)->fqn);
}

/* Set refs[i].gpos to the position of the ref's FQN among the sorted
 * distinct FQNs; p->n_groups to their count. */
static int number_fqns(plan_t *p) {
  size_t cap = 16;
  while (cap < 2 * (size_t)p->n_refs)
    cap *= 2;
  uint32_t *table = calloc(cap, sizeof(*table)); /* group id + 1; 0: free */
  fqn_entry_t *groups = malloc((p->n_refs + 1) * sizeof(*groups));
  uint32_t *pos = malloc((p->n_refs + 1) * sizeof(*pos));
  uint32_t n = 0;
  int rc = -ENOMEM;

  if (table == NULL || groups == NULL || pos == NULL)
    goto out;
  for (uint32_t i = 0; i < p->n_refs; i++) {
    const char *fqn = p->refs[i].it->fqn;
    size_t h = (size_t)hash_str(fqn) & (cap - 1);
    while (table[h] != 0 && strcmp(groups[table[h] - 1].fqn, fqn) != 0)
      h = (h + 1) & (cap - 1);
    if (table[h] == 0) {
      groups[n] = (fqn_entry_t){.fqn = fqn, .id = n};
      table[h] = ++n;
    }
    p->refs[i].gpos = table[h] - 1;
  }
  qsort(groups, n, sizeof(*groups), cmp_fqn_entry);
  for (uint32_t g = 0; g < n; g++)
    pos[groups[g].id] = g;
  for (uint32_t i = 0; i < p->n_refs; i++)
    p->refs[i].gpos = pos[p->refs[i].gpos];
  p->n_groups = n;
  rc = 0;
out:
  free(pos);
  free(groups);
  free(table);
  return rc;
}

/* Offsets then sizes of two chunks of equal ndim. */
static int cmp_chunk(const ckpt_write_item_t *a, const ckpt_write_item_t *b) {
  return cmp_dims(ckpt_item_offsets(a), 2 * a->ndim, ckpt_item_offsets(b),
                  2 * b->ndim);
}

static int cmp_ref(const void *pa, const void *pb) {
  const ref_t *a = pa, *b = pb;
  if (a->gpos != b->gpos)
    return a->gpos > b->gpos ? 1 : -1;
  int c = cmp_chunk(a->it, b->it);
  if (c == 0)
    c = cmp_rank(a, b);
  if (c == 0) /* items of one rank, in local plan order */
    c = (a->it > b->it) - (a->it < b->it);
  return c;
}

/* Build the sorted refs, the groups and the sets. */
static int build_sets(plan_t *p, const ckpt_local_plan_t *locals) {
  uint32_t k = 0;
  for (int32_t r = 0; r < p->world; r++) {
    for (uint32_t i = 0; i < locals[r].n_items; i++)
      p->refs[k++] = (ref_t){.it = &locals[r].items[i], .rank = r};
  }
  int rc = number_fqns(p);
  if (rc < 0)
    return rc;
  qsort(p->refs, p->n_refs, sizeof(*p->refs), cmp_ref);

  p->group_first = malloc((p->n_groups + 1) * sizeof(uint32_t));
  p->group_set = malloc((p->n_groups + 1) * sizeof(uint32_t));
  p->set_first = malloc((p->n_refs + 1) * sizeof(uint32_t));
  if (p->group_first == NULL || p->group_set == NULL || p->set_first == NULL)
    return -ENOMEM;
  uint32_t g = 0, s = 0;
  for (uint32_t i = 0; i < p->n_refs; i++) {
    const ref_t *prev = i > 0 ? &p->refs[i - 1] : NULL, *cur = &p->refs[i];
    bool new_group = prev == NULL || prev->gpos != cur->gpos;
    if (new_group) {
      p->group_first[g] = i;
      p->group_set[g++] = s;
    }
    if (new_group || cmp_chunk(prev->it, cur->it) != 0)
      p->set_first[s++] = i;
  }
  assert(g == p->n_groups);
  p->group_first[g] = p->n_refs;
  p->group_set[g] = s;
  p->set_first[s] = p->n_refs;
  p->n_sets = s;
  return 0;
}

/* ------------------------------------------------------------------------
 * Step 2: validation.
 * ---------------------------------------------------------------------- */

/* Each line a rank reported itself, as "rank R: line". */
static void check_local_errors(plan_t *p, const ckpt_local_plan_t *lp) {
  const char *s = lp->errors;
  while (s != NULL && *s != '\0') {
    const char *nl = strchr(s, '\n');
    size_t len = nl != NULL ? (size_t)(nl - s) : strlen(s);
    if (len > 0 && want(&p->errors)) {
      put(p, "rank %d: %.*s", (int)lp->rank, (int)len, s);
      emit(p, &p->errors);
    }
    s += len + (nl != NULL);
  }
}

/* Bytes reserved at the start of data file k of a rank. */
static uint64_t reserved_of(const ckpt_local_plan_t *lp, uint32_t k) {
  return k < lp->n_reserved ? lp->reserved[k] : 0;
}

static bool pinned(const ckpt_write_item_t *it) {
  return it->pin_file != CKPT_NO_PIN;
}

/* A pinned item of one rank, for sorting by where it lies. */
typedef struct {
  uint32_t file;
  uint64_t off, len;
  const ckpt_write_item_t *it;
} pin_t;

static int cmp_pin(const void *pa, const void *pb) {
  const pin_t *a = pa, *b = pb;
  if (a->file != b->file)
    return a->file > b->file ? 1 : -1;
  if (a->off != b->off)
    return a->off > b->off ? 1 : -1;
  if (a->len != b->len)
    return a->len > b->len ? 1 : -1;
  return (a->it > b->it) - (a->it < b->it);
}

/* "rank R: fqn (path) pinned at file K offset O length L" */
static void put_pin(plan_t *p, int32_t rank, const pin_t *pin) {
  put(p, "rank %d: %s (%s) pinned at file %u offset %llu length %llu",
      (int)rank, pin->it->fqn, pin->it->path, (unsigned)pin->file,
      (unsigned long long)pin->off, (unsigned long long)pin->len);
}

/* Write-behind: the reservations and pins of one rank. Every reservation
 * lies in a file K < CKPT_MAX_PIN_FILE; every pin in such a file, inside
 * the bytes reserved in that file; no two pins overlap. */
static void check_pins(plan_t *p, const ckpt_local_plan_t *lp) {
  uint32_t n_pins = 0;
  for (uint32_t k = CKPT_MAX_PIN_FILE; k < lp->n_reserved; k++) {
    if (lp->reserved[k] > 0 && want(&p->errors)) {
      put(p, "rank %d: %llu bytes reserved in file %u, beyond file %u",
          (int)lp->rank, (unsigned long long)lp->reserved[k], (unsigned)k,
          (unsigned)CKPT_MAX_PIN_FILE - 1);
      emit(p, &p->errors);
    }
  }
  for (uint32_t i = 0; i < lp->n_items; i++)
    n_pins += pinned(&lp->items[i]);
  if (n_pins == 0)
    return;
  p->any_pin = true;
  pin_t *pins = malloc(n_pins * sizeof(*pins));
  if (pins == NULL) {
    p->rc = -ENOMEM;
    return;
  }
  uint32_t n = 0;
  for (uint32_t i = 0; i < lp->n_items; i++) {
    const ckpt_write_item_t *it = &lp->items[i];
    if (!pinned(it))
      continue;
    pin_t pin = {.file = it->pin_file,
                 .off = it->pin_offset,
                 .len = it->length,
                 .it = it};
    uint64_t res = reserved_of(lp, pin.file);
    if (pin.file < CKPT_MAX_PIN_FILE && pin.off <= res &&
        pin.len <= res - pin.off) {
      pins[n++] = pin;
      continue;
    }
    if (!want(&p->errors))
      continue;
    put_pin(p, lp->rank, &pin);
    if (pin.file >= CKPT_MAX_PIN_FILE)
      put(p, " beyond file %u", (unsigned)CKPT_MAX_PIN_FILE - 1);
    else
      put(p, " outside its %llu reserved bytes", (unsigned long long)res);
    emit(p, &p->errors);
  }
  qsort(pins, n, sizeof(*pins), cmp_pin);
  /* Sorted by offset: a pin overlaps an earlier one iff it starts before
   * the furthest end so far in its file. */
  const pin_t *far = NULL;
  for (uint32_t i = 0; i < n; i++) {
    const pin_t *cur = &pins[i];
    if (far != NULL && far->file == cur->file &&
        cur->off < far->off + far->len) {
      if (want(&p->errors)) {
        put_pin(p, lp->rank, cur);
        put(p, " overlaps %s (%s) at offset %llu length %llu", far->it->fqn,
            far->it->path, (unsigned long long)far->off,
            (unsigned long long)far->len);
        emit(p, &p->errors);
      }
      if (cur->off + cur->len <= far->off + far->len)
        continue;
    }
    if (far == NULL || far->file != cur->file ||
        cur->off + cur->len > far->off + far->len)
      far = cur;
  }
  free(pins);
}

/* The ref with the lowest rank among n (ties: the smallest path, then
 * first in local plan order), so that messages do not depend on the order
 * a rank listed its files in. */
static const ref_t *lowest(const ref_t *refs, size_t n) {
  const ref_t *best = &refs[0];
  for (size_t i = 1; i < n; i++) {
    int c = cmp_rank(&refs[i], best);
    if (c == 0)
      c = strcmp(refs[i].it->path, best->it->path);
    if (c < 0 || (c == 0 && refs[i].it < best->it))
      best = &refs[i];
  }
  return best;
}

/* By rank, then path, then local plan order. */
static int cmp_rank_path(const void *pa, const void *pb) {
  const ref_t *a = pa, *b = pb;
  int c = cmp_rank(a, b);
  if (c == 0)
    c = strcmp(a->it->path, b->it->path);
  return c != 0 ? c : (a->it > b->it) - (a->it < b->it);
}

/* One bytes item of a FQN per rank. (Tensor chunks of one FQN on one
 * rank are several chunks: at one path when one of them has no explicit
 * FQN, at any paths when all have one; the same chunk twice is found by
 * check_chunks.) */
static bool check_one_per_rank(plan_t *p, const ref_t *refs, size_t n) {
  if (n < 2 || refs[0].it->kind == CKPT_ITEM_TENSOR)
    return true;
  ref_t *h = malloc(n * sizeof(*h));
  if (h == NULL) {
    p->rc = -ENOMEM;
    return false;
  }
  memcpy(h, refs, n * sizeof(*h));
  qsort(h, n, sizeof(*h), cmp_rank_path);
  bool ok = true;
  for (size_t i = 1; i < n && ok; i++) {
    if (h[i].rank != h[i - 1].rank)
      continue;
    ok = false;
    const ckpt_write_item_t *x = h[i - 1].it, *y = h[i].it;
    if (want(&p->errors)) {
      put(p, "%s: rank %d holds two bytes items for one FQN: %s and %s",
          x->fqn, (int)h[i].rank, x->path, y->path);
      emit(p, &p->errors);
    }
  }
  free(h);
  return ok;
}

/* One kind for a FQN; one path unless every item has an explicit FQN; one
 * bytes item per rank. */
static bool check_path_kind(plan_t *p, const ref_t *refs, size_t n) {
  const ref_t *a = lowest(refs, n), *b = NULL;
  bool all_explicit = true;
  for (size_t i = 0; i < n; i++)
    all_explicit &= refs[i].it->fqn_explicit;
  for (size_t i = 0; i < n && !all_explicit; i++) {
    if (strcmp(refs[i].it->path, a->it->path) != 0 &&
        (b == NULL || refs[i].rank < b->rank ||
         (refs[i].rank == b->rank &&
          strcmp(refs[i].it->path, b->it->path) < 0)))
      b = &refs[i];
  }
  if (b != NULL) {
    if (want(&p->errors)) {
      put(p, "%s: two paths for one FQN: %s (rank %d) and %s (rank %d)",
          a->it->fqn, a->it->path, (int)a->rank, b->it->path, (int)b->rank);
      emit(p, &p->errors);
    }
    return false;
  }
  size_t n_tensors = 0;
  for (size_t i = 0; i < n; i++)
    n_tensors += refs[i].it->kind == CKPT_ITEM_TENSOR;
  if (n_tensors == 0 || n_tensors == n)
    return check_one_per_rank(p, refs, n);
  if (begin(p, &p->errors, a->it)) {
    /* Split the refs by kind to name the ranks of each. */
    ref_t *split = malloc(n * sizeof(*split));
    if (split == NULL) {
      p->rc = -ENOMEM;
      return false;
    }
    size_t t = 0, o = n_tensors;
    for (size_t i = 0; i < n; i++) {
      if (refs[i].it->kind == CKPT_ITEM_TENSOR)
        split[t++] = refs[i];
      else
        split[o++] = refs[i];
    }
    put(p, "tensor on ");
    put_ranks(p, split, n_tensors);
    put(p, " but bytes item on ");
    put_ranks(p, split + n_tensors, n - n_tensors);
    emit(p, &p->errors);
    free(split);
  }
  return false;
}

/* A tensor's chunks: valid dtype and dimensions on every rank, one dtype,
 * one shape, and a size that fits. Sets *numel. */
static bool check_tensor(plan_t *p, const ref_t *refs, size_t n,
                         uint64_t *numel) {
  bool ok = true;
  for (size_t i = 0; i < n; i++) {
    const ckpt_write_item_t *it = refs[i].it;
    bool negative = false;
    for (int k = 0; k < 3 * it->ndim; k++)
      negative |= it->dims[k] < 0;
    if (ckpt_dtype_size(it->dtype) == 0 && begin(p, &p->errors, it)) {
      put(p, "rank %d gave an invalid dtype (%d)", (int)refs[i].rank,
          (int)it->dtype);
      emit(p, &p->errors);
    }
    if (negative && begin(p, &p->errors, it)) {
      put(p, "rank %d gave a negative dimension: shape ", (int)refs[i].rank);
      put_dims(p, ckpt_item_shape(it), it->ndim);
      put(p, " offsets ");
      put_dims(p, ckpt_item_offsets(it), it->ndim);
      put(p, " sizes ");
      put_dims(p, ckpt_item_sizes(it), it->ndim);
      emit(p, &p->errors);
    }
    ok &= ckpt_dtype_size(it->dtype) != 0 && !negative;
  }
  if (!ok)
    return false;

  const ckpt_write_item_t *a = lowest(refs, n)->it;
  static const struct {
    const value_kind_t *vk;
    const char *what;
  } same[] = {{&by_dtype, "dtype"}, {&by_shape, "shape"}};
  for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++) {
    if (agree(refs, n, same[i].vk))
      continue;
    if (begin(p, &p->errors, a)) {
      put(p, "%s disagrees: ", same[i].what);
      put_values(p, refs, n, same[i].vk);
      emit(p, &p->errors);
    }
    return false;
  }

  uint64_t bytes;
  if (ckpt_dims_numel(ckpt_item_shape(a), a->ndim, numel) < 0 ||
      __builtin_mul_overflow(*numel, ckpt_dtype_size(a->dtype), &bytes)) {
    if (begin(p, &p->errors, a)) {
      put(p, "shape ");
      put_dims(p, ckpt_item_shape(a), a->ndim);
      put(p, " x %s is larger than 2^64 bytes", ckpt_dtype_name(a->dtype));
      emit(p, &p->errors);
    }
    return false;
  }
  return true;
}

/* The copies of one item (a set) must have the same content. */
static void check_replicas(plan_t *p, const ref_t *refs, size_t n, bool whole) {
  if (p->opts->replica_check == CKPT_REPLICA_OFF || agree(refs, n, &by_content))
    return;
  report_t *r =
      p->opts->replica_check == CKPT_REPLICA_ERROR ? &p->errors : &p->warnings;
  const ckpt_write_item_t *it = refs[0].it;
  if (!begin(p, r, it))
    return;
  if (whole) {
    put(p, "replicas differ: ");
  } else {
    put(p, "replicas of chunk offsets ");
    put_dims(p, ckpt_item_offsets(it), it->ndim);
    put(p, " sizes ");
    put_dims(p, ckpt_item_sizes(it), it->ndim);
    put(p, " differ: ");
  }
  bool same_length = true;
  for (size_t i = 1; i < n; i++)
    same_length &= refs[i].it->length == it->length;
  put_values(p, refs, n, same_length ? &by_checksum : &by_content);
  emit(p, r);
}

/* Bounds, lengths and replica contents of the sets [s0, s1) of a tensor.
 * Returns whether every chunk lies inside the shape. */
static bool check_chunks(plan_t *p, uint32_t s0, uint32_t s1) {
  bool in_bounds = true;
  for (uint32_t s = s0; s < s1; s++) {
    const ref_t *refs = &p->refs[p->set_first[s]];
    size_t n = p->set_first[s + 1] - p->set_first[s];
    const ckpt_write_item_t *it = refs[0].it;
    const int64_t *shape = ckpt_item_shape(it), *off = ckpt_item_offsets(it),
                  *size = ckpt_item_sizes(it);
    bool inside = true, whole = true;
    for (int k = 0; k < it->ndim; k++) {
      inside &= off[k] <= shape[k] && size[k] <= shape[k] - off[k];
      whole &= off[k] == 0 && size[k] == shape[k];
    }
    if (!inside) {
      in_bounds = false;
      if (begin(p, &p->errors, it)) {
        put(p, "chunk of ");
        put_ranks(p, refs, n);
        put(p, " offsets ");
        put_dims(p, off, it->ndim);
        put(p, " sizes ");
        put_dims(p, size, it->ndim);
        put(p, " lies outside shape ");
        put_dims(p, shape, it->ndim);
        emit(p, &p->errors);
      }
      continue;
    }
    uint64_t expected;
    ckpt_dims_numel(size, it->ndim, &expected); /* <= numel of shape */
    expected *= ckpt_dtype_size(it->dtype);
    for (size_t i = 0; i < n; i++) {
      if (refs[i].it->length == expected || !begin(p, &p->errors, it))
        continue;
      put(p, "rank %d wrote %llu bytes, %llu expected (sizes ",
          (int)refs[i].rank, (unsigned long long)refs[i].it->length,
          (unsigned long long)expected);
      for (int k = 0; k < it->ndim; k++)
        put(p, "%s%lld", k > 0 ? "x" : "", (long long)size[k]);
      put(p, "%s x %s)", it->ndim == 0 ? "scalar" : "",
          ckpt_dtype_name(it->dtype));
      emit(p, &p->errors);
    }
    /* A set's refs are in rank order: the same chunk twice on one rank
     * (explicit FQNs at two paths) is neither a replica nor a shard. */
    for (size_t i = 1; i < n; i++) {
      if (refs[i].rank != refs[i - 1].rank ||
          !begin(p, &p->errors, lowest(refs, n)->it))
        continue;
      put(p, "rank %d holds chunk offsets ", (int)refs[i].rank);
      put_dims(p, off, it->ndim);
      put(p, " sizes ");
      put_dims(p, size, it->ndim);
      const char *x = refs[i - 1].it->path, *y = refs[i].it->path;
      if (strcmp(x, y) > 0) {
        const char *t = x;
        x = y;
        y = t;
      }
      put(p, " twice: %s and %s", x, y);
      emit(p, &p->errors);
      in_bounds = false; /* no cover check on top */
      break;
    }
    check_replicas(p, refs, n, whole);
  }
  return in_bounds;
}

/* ------------------------------------------------------------------------
 * Step 2, continued: overlap and coverage of a tensor's kept chunks.
 * ---------------------------------------------------------------------- */

/* The chunk (first copy) of set s. */
static const ckpt_write_item_t *set_item(const plan_t *p, uint32_t s) {
  return p->refs[p->set_first[s]].it;
}

/* "ranks 0,1 offsets [0,0] sizes [4,2]" */
static void put_chunk(plan_t *p, uint32_t s) {
  const ckpt_write_item_t *it = set_item(p, s);
  put_ranks(p, &p->refs[p->set_first[s]],
            p->set_first[s + 1] - p->set_first[s]);
  put(p, " offsets ");
  put_dims(p, ckpt_item_offsets(it), it->ndim);
  put(p, " sizes ");
  put_dims(p, ckpt_item_sizes(it), it->ndim);
}

static void report_overlap(plan_t *p, uint32_t sa, uint32_t sb) {
  if (!begin(p, &p->errors, set_item(p, sa)))
    return;
  put(p, "chunks overlap: ");
  put_chunk(p, sa);
  put(p, " and ");
  put_chunk(p, sb);
  emit(p, &p->errors);
}

/* gap_off/gap_size: a region no chunk covers, or NULL when not known. */
static void report_gap(plan_t *p, uint32_t g, uint64_t covered, uint64_t numel,
                       const int64_t *gap_off, const int64_t *gap_size) {
  const ref_t *refs = &p->refs[p->group_first[g]];
  const ckpt_write_item_t *it = refs[0].it;
  if (!begin(p, &p->errors, it))
    return;
  put(p, "chunks cover %llu of %llu elements (gap", (unsigned long long)covered,
      (unsigned long long)numel);
  if (gap_off != NULL) {
    put(p, " at offsets ");
    put_dims(p, gap_off, it->ndim);
    put(p, " sizes ");
    put_dims(p, gap_size, it->ndim);
  }
  put(p, "), ");
  put_ranks(p, refs, p->group_first[g + 1] - p->group_first[g]);
  emit(p, &p->errors);
}

static uint64_t volume(const ckpt_write_item_t *it) {
  uint64_t v;
  ckpt_dims_numel(ckpt_item_sizes(it), it->ndim, &v); /* in bounds */
  return v;
}

/* Sort n non-negative values: LSD radix, 8 bits a pass, skipping the
 * passes where every value has the same byte; tmp holds n values. */
static void sort_cuts(int64_t *a, int64_t *tmp, size_t n) {
  if (n <= 64) { /* insertion sort: most tensors have few chunks */
    for (size_t i = 1; i < n; i++) {
      int64_t v = a[i];
      size_t j = i;
      for (; j > 0 && a[j - 1] > v; j--)
        a[j] = a[j - 1];
      a[j] = v;
    }
    return;
  }
  for (int shift = 0; shift < 64; shift += 8) {
    size_t count[257] = {0};
    for (size_t i = 0; i < n; i++)
      count[((uint64_t)a[i] >> shift & 0xff) + 1]++;
    if (count[((uint64_t)a[0] >> shift & 0xff) + 1] == n)
      continue;
    for (int b = 0; b < 256; b++)
      count[b + 1] += count[b];
    for (size_t i = 0; i < n; i++)
      tmp[count[(uint64_t)a[i] >> shift & 0xff]++] = a[i];
    memcpy(a, tmp, n * sizeof(*a));
  }
}

/* Index of v in the sorted distinct values a[0..n-1] (v is among them). */
static size_t find_cut(const int64_t *a, size_t n, int64_t v) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (a[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  assert(lo < n && a[lo] == v);
  return lo;
}

/*
 * Check the non-empty chunks ne[0..m-1] (sets, in offsets order) of group g
 * on a grid: per dimension the sorted distinct cut points (0, the extent,
 * every chunk's start and end) split the tensor into cells; each chunk
 * marks the cells it spans. A cell marked twice is an overlap, a cell never
 * marked a gap. Costs O(m log m + cells); returns 1 without checking when
 * the grid would exceed 4m + 64 cells (irregular layouts), else 0 or
 * -ENOMEM.
 */
static int cover_grid(plan_t *p, uint32_t g, const uint32_t *ne, size_t m,
                      uint64_t numel) {
  const ckpt_write_item_t *t = p->refs[p->group_first[g]].it;
  const int ndim = t->ndim;
  const size_t per = 2 * m + 2; /* cut points per dimension, at most */
  const uint64_t limit = 4 * (uint64_t)m + 64;
  size_t nc[CKPT_MAX_NDIM], lo[CKPT_MAX_NDIM], hi[CKPT_MAX_NDIM],
      cur[CKPT_MAX_NDIM];
  uint32_t *owner = NULL;
  uint64_t cells = 1;
  int rc = -ENOMEM;
  /* ndim lists of cut points, then room to sort one */
  int64_t *cuts = malloc(((size_t)ndim + 1) * per * sizeof(*cuts));
  if (cuts == NULL)
    goto out;
  for (int k = 0; k < ndim; k++) {
    int64_t *c = cuts + (size_t)k * per;
    size_t j = 0;
    c[j++] = 0;
    c[j++] = ckpt_item_shape(t)[k];
    for (size_t i = 0; i < m; i++) {
      const ckpt_write_item_t *it = set_item(p, ne[i]);
      c[j++] = ckpt_item_offsets(it)[k];
      c[j++] = ckpt_item_offsets(it)[k] + ckpt_item_sizes(it)[k];
    }
    sort_cuts(c, cuts + (size_t)ndim * per, j);
    nc[k] = 1;
    for (size_t i = 1; i < j; i++) {
      if (c[i] != c[nc[k] - 1])
        c[nc[k]++] = c[i];
    }
    /* numel > 0, so every extent is > 0 and nc[k] >= 2. */
    if (__builtin_mul_overflow(cells, nc[k] - 1, &cells) || cells > limit) {
      rc = 1;
      goto out;
    }
  }
  owner = malloc(cells * sizeof(*owner));
  if (owner == NULL)
    goto out;
  memset(owner, 0xff, cells * sizeof(*owner));
  rc = 0;
  for (size_t i = 0; i < m; i++) {
    const ckpt_write_item_t *it = set_item(p, ne[i]);
    for (int k = 0; k < ndim; k++) {
      const int64_t *c = cuts + (size_t)k * per, o = ckpt_item_offsets(it)[k];
      lo[k] = cur[k] = find_cut(c, nc[k], o);
      hi[k] = find_cut(c, nc[k], o + ckpt_item_sizes(it)[k]);
    }
    for (;;) {
      size_t cell = 0;
      for (int k = 0; k < ndim; k++)
        cell = cell * (nc[k] - 1) + cur[k];
      if (owner[cell] != NONE) {
        report_overlap(p, ne[owner[cell]], ne[i]);
        goto out;
      }
      owner[cell] = (uint32_t)i;
      int k = ndim - 1;
      while (k >= 0 && ++cur[k] == hi[k]) {
        cur[k] = lo[k];
        k--;
      }
      if (k < 0)
        break;
    }
  }
  for (size_t cell = 0; cell < cells; cell++) {
    if (owner[cell] != NONE)
      continue;
    int64_t gap_off[CKPT_MAX_NDIM], gap_size[CKPT_MAX_NDIM];
    size_t rest = cell;
    for (int k = ndim - 1; k >= 0; k--) {
      const int64_t *c = cuts + (size_t)k * per;
      size_t idx = rest % (nc[k] - 1);
      rest /= nc[k] - 1;
      gap_off[k] = c[idx];
      gap_size[k] = c[idx + 1] - c[idx];
    }
    uint64_t covered = 0;
    for (size_t i = 0; i < m; i++)
      covered += volume(set_item(p, ne[i]));
    report_gap(p, g, covered, numel, gap_off, gap_size);
    break;
  }
out:
  free(owner);
  free(cuts);
  return rc;
}

/* Start and end of chunk ne[i] in dimension k. */
static int64_t lo_of(const plan_t *p, const uint32_t *ne, size_t i, int k) {
  return ckpt_item_offsets(set_item(p, ne[i]))[k];
}
static int64_t hi_of(const plan_t *p, const uint32_t *ne, size_t i, int k) {
  const ckpt_write_item_t *it = set_item(p, ne[i]);
  return ckpt_item_offsets(it)[k] + ckpt_item_sizes(it)[k];
}

/* First of the active chunks (sorted by start in dimension 1) that starts
 * at or after v there. */
static size_t first_from(const plan_t *p, const uint32_t *ne,
                         const uint32_t *active, size_t n, int64_t v) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (lo_of(p, ne, active[mid], 1) < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/*
 * The same check for any layout of ndim >= 2 (the grid always suffices for
 * fewer): a sweep along dimension 0 over the chunks in start order. The
 * active chunks (those spanning the current start, so pairwise meeting in
 * dimension 0) are kept sorted by their start in dimension 1; a new chunk
 * is compared with those that start before its end there, from the
 * latest. In 2-D the active chunks cannot meet in dimension 1 either (else
 * they would overlap), so the first that ends before the new chunk starts
 * ends the search: O(m log m) plus moving indices. In more dimensions the
 * search goes on (slower only for irregular many-dimensional layouts).
 * Without overlap, the chunks cover the tensor exactly when their volumes
 * add up to its numel.
 */
static int cover_sweep(plan_t *p, uint32_t g, const uint32_t *ne, size_t m,
                       uint64_t numel) {
  const int ndim = set_item(p, ne[0])->ndim;
  uint32_t *active = malloc((m + 1) * sizeof(*active));
  size_t n_active = 0;
  int64_t min_end = INT64_MAX; /* of the active chunks in dimension 0 */
  uint64_t covered = 0;
  assert(ndim >= 2);
  if (active == NULL)
    return -ENOMEM;
  for (size_t i = 0; i < m; i++) {
    const int64_t start = lo_of(p, ne, i, 0);
    if (min_end <= start) { /* drop the chunks that end before start */
      size_t kept = 0;
      min_end = INT64_MAX;
      for (size_t j = 0; j < n_active; j++) {
        int64_t end = hi_of(p, ne, active[j], 0);
        if (end > start) {
          active[kept++] = active[j];
          min_end = end < min_end ? end : min_end;
        }
      }
      n_active = kept;
    }
    /* The active chunks that start before chunk i ends in dimension 1,
     * and where chunk i goes among them. */
    size_t before = first_from(p, ne, active, n_active, hi_of(p, ne, i, 1));
    size_t at = first_from(p, ne, active, before, lo_of(p, ne, i, 1));
    for (size_t j = before; j-- > 0;) {
      size_t a = active[j];
      bool meet = hi_of(p, ne, a, 1) > lo_of(p, ne, i, 1);
      if (!meet && ndim == 2)
        break;
      for (int k = 2; k < ndim && meet; k++)
        meet = lo_of(p, ne, a, k) < hi_of(p, ne, i, k) &&
               lo_of(p, ne, i, k) < hi_of(p, ne, a, k);
      if (meet) {
        report_overlap(p, ne[a], ne[i]);
        goto out;
      }
    }
    memmove(active + at + 1, active + at, (n_active - at) * sizeof(*active));
    active[at] = (uint32_t)i;
    n_active++;
    min_end = hi_of(p, ne, i, 0) < min_end ? hi_of(p, ne, i, 0) : min_end;
    covered += volume(set_item(p, ne[i]));
  }
  if (covered != numel)
    report_gap(p, g, covered, numel, NULL, NULL);
out:
  free(active);
  return 0;
}

/* Overlap and exact coverage of the sets [s0, s1) of group g, a tensor of
 * numel > 0 elements whose chunks all lie inside its shape. Empty chunks
 * occupy nothing. */
static int check_cover(plan_t *p, uint32_t g, uint64_t numel) {
  uint32_t s0 = p->group_set[g], s1 = p->group_set[g + 1];
  uint32_t *ne = malloc((s1 - s0) * sizeof(*ne));
  size_t m = 0;
  if (ne == NULL)
    return -ENOMEM;
  for (uint32_t s = s0; s < s1; s++) {
    if (volume(set_item(p, s)) > 0)
      ne[m++] = s;
  }
  int rc = cover_grid(p, g, ne, m, numel);
  if (rc == 1)
    rc = cover_sweep(p, g, ne, m, numel);
  free(ne);
  return rc;
}

static void check_group(plan_t *p, uint32_t g) {
  const ref_t *refs = &p->refs[p->group_first[g]];
  size_t n = p->group_first[g + 1] - p->group_first[g];
  uint64_t numel;
  if (!check_path_kind(p, refs, n))
    return;
  if (refs[0].it->kind == CKPT_ITEM_BYTES) {
    check_replicas(p, refs, n, true);
    return;
  }
  if (!check_tensor(p, refs, n, &numel))
    return;
  if (check_chunks(p, p->group_set[g], p->group_set[g + 1]) && numel > 0) {
    int rc = check_cover(p, g, numel);
    if (rc < 0 && p->rc == 0)
      p->rc = rc;
  }
}

/* ------------------------------------------------------------------------
 * Step 2, continued: the committed paths.
 * ---------------------------------------------------------------------- */

/* The item whose path group g shows at once committed: for a tensor the
 * chunk with the smallest offsets (ties: lowest rank, then path), for a
 * bytes item its lowest rank's. */
static const ckpt_write_item_t *shown_item(const plan_t *p, uint32_t g) {
  const ref_t *refs = &p->refs[p->group_first[g]];
  size_t n = p->group_first[g + 1] - p->group_first[g];
  const ref_t *best = &refs[0];
  for (size_t i = 1; i < n; i++) {
    const ref_t *r = &refs[i];
    int c = 0;
    if (r->it->kind == CKPT_ITEM_TENSOR && best->it->kind == CKPT_ITEM_TENSOR &&
        r->it->ndim == best->it->ndim)
      c = cmp_dims(ckpt_item_offsets(r->it), r->it->ndim,
                   ckpt_item_offsets(best->it), best->it->ndim);
    if (c == 0)
      c = cmp_rank(r, best);
    if (c == 0)
      c = strcmp(r->it->path, best->it->path);
    if (c < 0)
      best = r;
  }
  return best->it;
}

typedef struct {
  const char *path;
  const ckpt_write_item_t *it;
} shown_t;

static int cmp_shown(const void *a, const void *b) {
  return strcmp(((const shown_t *)a)->path, ((const shown_t *)b)->path);
}

/* The committed paths of all FQNs: no path twice, and none that another
 * one needs as a directory. */
static void check_paths(plan_t *p) {
  if (p->n_groups < 2)
    return;
  shown_t *v = malloc(p->n_groups * sizeof(*v));
  char *prefix = NULL;
  if (v == NULL) {
    p->rc = -ENOMEM;
    return;
  }
  for (uint32_t g = 0; g < p->n_groups; g++) {
    const ckpt_write_item_t *it = shown_item(p, g);
    v[g] = (shown_t){.path = it->path, .it = it};
  }
  qsort(v, p->n_groups, sizeof(*v), cmp_shown);
  for (uint32_t i = 1; i < p->n_groups; i++) {
    if (strcmp(v[i - 1].path, v[i].path) != 0 || !want(&p->errors))
      continue;
    put(p, "%s: two FQNs at one committed path: %s and %s", v[i].path,
        v[i - 1].it->fqn, v[i].it->fqn);
    emit(p, &p->errors);
  }
  for (uint32_t i = 0; i < p->n_groups; i++) {
    const char *path = v[i].path;
    for (const char *sl = strchr(path, '/'); sl; sl = strchr(sl + 1, '/')) {
      size_t len = (size_t)(sl - path);
      char *np = realloc(prefix, len + 1);
      if (np == NULL) {
        p->rc = -ENOMEM;
        goto out;
      }
      prefix = np;
      memcpy(prefix, path, len);
      prefix[len] = '\0';
      shown_t key = {.path = prefix};
      const shown_t *f =
          bsearch(&key, v, p->n_groups, sizeof(*v), cmp_shown);
      if (f == NULL)
        continue;
      if (want(&p->errors)) {
        put(p, "%s: committed path of %s is also a directory of %s (%s)",
            f->path, f->it->fqn, path, v[i].it->fqn);
        emit(p, &p->errors);
      }
      break;
    }
  }
out:
  free(prefix);
  free(v);
}

/* ------------------------------------------------------------------------
 * Steps 3 and 4: who keeps each set, and where it goes.
 * ---------------------------------------------------------------------- */

typedef struct {
  uint64_t len;
  uint32_t set;
} sized_t;

/* Largest first, then in set (FQN, offsets) order. */
static int cmp_sized(const void *pa, const void *pb) {
  const sized_t *a = pa, *b = pb;
  if (a->len != b->len)
    return a->len < b->len ? 1 : -1;
  return (a->set > b->set) - (a->set < b->set);
}

static uint64_t sat_add(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* Step 3: choose the keeper of every set. */
static int dedup(plan_t *p) {
  uint64_t *total = calloc((size_t)p->world, sizeof(*total));
  sized_t *rep = malloc((p->n_sets + 1) * sizeof(*rep));
  size_t n_rep = 0;
  int rc = -ENOMEM;
  if (total == NULL || rep == NULL)
    goto out;
  for (uint32_t s = 0; s < p->n_sets; s++) {
    const ref_t *r = &p->refs[p->set_first[s]];
    if (p->set_first[s + 1] - p->set_first[s] > 1) {
      rep[n_rep++] = (sized_t){.len = r->it->length, .set = s};
    } else {
      p->keeper[s] = p->set_first[s];
      total[r->rank] = sat_add(total[r->rank], r->it->length);
    }
  }
  qsort(rep, n_rep, sizeof(*rep), cmp_sized);
  for (size_t i = 0; i < n_rep; i++) {
    uint32_t s = rep[i].set, best = p->set_first[s];
    uint32_t end = p->set_first[s + 1];
    /* Holders that have the set pinned (its bytes already written) are
     * the only candidates if there are any. */
    bool only_pinned = false;
    for (uint32_t j = best; p->any_pin && j < end && !only_pinned; j++)
      only_pinned = pinned(p->refs[j].it);
    while (only_pinned && !pinned(p->refs[best].it))
      best++;
    /* The holders are in rank order: the first smallest total wins. */
    for (uint32_t j = best + 1; j < end; j++) {
      if (total[p->refs[j].rank] < total[p->refs[best].rank] &&
          (!only_pinned || pinned(p->refs[j].it)))
        best = j;
    }
    p->keeper[s] = best;
    total[p->refs[best].rank] =
        sat_add(total[p->refs[best].rank], p->refs[best].it->length);
  }
  rc = 0;
out:
  free(rep);
  free(total);
  return rc;
}

/* Min-heap of data files by (bytes, K). */
typedef struct {
  uint32_t *k;     /* heap of file numbers */
  uint64_t *bytes; /* per file */
  uint32_t n;
} file_heap_t;

static bool file_less(const file_heap_t *h, uint32_t a, uint32_t b) {
  return h->bytes[a] < h->bytes[b] || (h->bytes[a] == h->bytes[b] && a < b);
}

/* Move the file at heap position i down to its place (after the top file
 * grew, or to build the heap). */
static void file_heap_down(file_heap_t *h, uint32_t i) {
  for (;;) {
    uint32_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < h->n && file_less(h, h->k[l], h->k[m]))
      m = l;
    if (r < h->n && file_less(h, h->k[r], h->k[m]))
      m = r;
    if (m == i)
      return;
    uint32_t t = h->k[i];
    h->k[i] = h->k[m];
    h->k[m] = t;
    i = m;
  }
}

/* How step 4 goes for one rank (assign_rank): the counts its buffers are
 * sized by and the files its items can go to. */
typedef struct {
  uint32_t n_pin;    /* kept items that are pinned */
  uint32_t n_un;     /* kept items that are not */
  uint32_t n_res;    /* 1 + the last file with bytes reserved */
  uint32_t n_res_io; /* the same, among the io_threads files */
  uint32_t t;        /* files balanced over (the io_threads ones) */
  uint32_t cap;      /* files there can be: those and the files of pins
                      * and reservations beyond them */
} rank_shape_t;

/* The shape of step 4 for one rank keeping sets[0..n-1], with the
 * reservations and pins of lp. */
static void rank_shape(const plan_t *p, const uint32_t *sets, uint32_t n,
                       const ckpt_local_plan_t *lp, rank_shape_t *sh) {
  uint32_t io = p->opts->io_threads, n_pin = 0, n_res = 0, n_res_io = 0;
  uint32_t pin_end = 0; /* 1 + the last file holding a pin */
  for (uint32_t k = 0; k < lp->n_reserved; k++) {
    n_res = lp->reserved[k] > 0 ? k + 1 : n_res;
    n_res_io = lp->reserved[k] > 0 && k < io ? k + 1 : n_res_io;
  }
  for (uint32_t i = 0; p->any_pin && i < n; i++) {
    const ckpt_write_item_t *it = p->refs[p->keeper[sets[i]]].it;
    if (pinned(it)) {
      n_pin++;
      pin_end = it->pin_file + 1 > pin_end ? it->pin_file + 1 : pin_end;
    }
  }
  uint32_t n_un = n - n_pin;
  uint32_t t = n_res_io > 0 ? io : io < n_un ? io : n_un;
  uint32_t cap = t;
  if (n_res > 0 || n_pin > 0) {
    cap = io > n_res ? io : n_res;
    cap = cap > pin_end ? cap : pin_end;
  }
  *sh = (rank_shape_t){.n_pin = n_pin,
                       .n_un = n_un,
                       .n_res = n_res,
                       .n_res_io = n_res_io,
                       .t = t,
                       .cap = cap};
}

/* Split the kept sets sets[0..n-1] into the pinned items (to pins, their
 * set placed where the pin is) and the others (to order), both in set
 * order. */
static void split_pinned(plan_t *p, const uint32_t *sets, uint32_t n,
                         sized_t *order, pin_t *pins) {
  uint32_t u = 0, q = 0;
  for (uint32_t i = 0; i < n; i++) {
    const ckpt_write_item_t *it = p->refs[p->keeper[sets[i]]].it;
    if (p->any_pin && pinned(it)) {
      pins[q++] = (pin_t){.file = it->pin_file,
                          .off = it->pin_offset,
                          .len = it->length,
                          .it = it};
      p->set_file[sets[i]] = it->pin_file;
      p->set_off[sets[i]] = it->pin_offset;
    } else {
      order[u++] = (sized_t){.len = it->length, .set = sets[i]};
    }
  }
}

/* Give each unpinned item of order (largest first) the least full of the
 * sh->t balanced files, loads starting at the reservations; rp->n_files
 * becomes 1 + the last file reserved or chosen. heap holds sh->t files;
 * rp->file_bytes (sh->cap of them) is used for the loads. */
static void balance_unpinned(plan_t *p, const ckpt_local_plan_t *lp,
                             const rank_shape_t *sh, const sized_t *order,
                             uint32_t *heap, ckpt_rank_plan_t *rp) {
  file_heap_t h = {.k = heap, .bytes = rp->file_bytes, .n = sh->t};
  for (uint32_t k = 0; k < sh->t; k++) {
    heap[k] = k;
    h.bytes[k] = reserved_of(lp, k);
  }
  for (uint32_t i = sh->t / 2; sh->n_res_io > 0 && i-- > 0;)
    file_heap_down(&h, i);
  rp->n_files = sh->n_res;
  for (uint32_t i = 0; i < sh->n_un; i++) {
    uint32_t k = heap[0];
    p->set_file[order[i].set] = k;
    rp->n_files = k + 1 > rp->n_files ? k + 1 : rp->n_files;
    h.bytes[k] = sat_add(h.bytes[k], order[i].len);
    file_heap_down(&h, 0);
  }
}

/* Count the pins[0..n_pin-1] of each file K in first[K + 1] and keep the
 * files holding them in rp->n_files. */
static void count_pins(const pin_t *pins, uint32_t n_pin, uint32_t *first,
                       ckpt_rank_plan_t *rp) {
  for (uint32_t i = 0; i < n_pin; i++) {
    /* inside the reservation (checked), so no change to file_bytes */
    rp->n_files = pins[i].file + 1 > rp->n_files ? pins[i].file + 1
                                                 : rp->n_files;
    first[pins[i].file + 1]++;
  }
}

/* Append the unpinned items of sets[0..n-1], in set order, to the files
 * chosen for them (rp->file_bytes: the bytes so far), aligning the large
 * ones; count them per file K in first[K + 1]. 0, or -EINVAL if a file
 * would pass 2^64 bytes. */
static int place_unpinned(plan_t *p, const uint32_t *sets, uint32_t n,
                          uint32_t *first, ckpt_rank_plan_t *rp) {
  for (uint32_t i = 0; i < n; i++) {
    uint32_t s = sets[i], k = p->set_file[s];
    const ckpt_write_item_t *it = p->refs[p->keeper[s]].it;
    if (p->any_pin && pinned(it))
      continue;
    uint64_t len = it->length, off = rp->file_bytes[k];
    if (len >= ALIGN_MIN_LEN && off % ALIGN != 0 &&
        __builtin_add_overflow(off, ALIGN - off % ALIGN, &off))
      return -EINVAL;
    if (__builtin_add_overflow(off, len, &rp->file_bytes[k]))
      return -EINVAL;
    p->set_off[s] = off;
    first[k + 1]++;
  }
  return 0;
}

/* Fill rp->assign from the per-file counts in first: file by file, the
 * pins (sorted) and then the other items of sets[0..n-1] in set order. */
static void fill_assignments(const plan_t *p, const uint32_t *sets,
                             uint32_t n, const rank_shape_t *sh,
                             const pin_t *pins, uint32_t *first,
                             ckpt_rank_plan_t *rp) {
  for (uint32_t k = 0; k < sh->cap; k++)
    first[k + 1] += first[k];
  for (uint32_t i = 0; i < sh->n_pin; i++)
    rp->assign[first[pins[i].file]++] =
        (ckpt_assignment_t){.local_id = pins[i].it->local_id,
                            .file = pins[i].file,
                            .file_offset = pins[i].off,
                            .length = pins[i].len};
  for (uint32_t i = 0; i < n; i++) {
    uint32_t s = sets[i], k = p->set_file[s];
    const ref_t *r = &p->refs[p->keeper[s]];
    if (p->any_pin && pinned(r->it))
      continue;
    rp->assign[first[k]++] = (ckpt_assignment_t){.local_id = r->it->local_id,
                                                 .file = k,
                                                 .file_offset = p->set_off[s],
                                                 .length = r->it->length};
  }
  rp->n_assign = n;
}

/*
 * Step 4 for one rank: its kept sets sets[0..n-1] (in set order) go to
 * data files.
 *
 * Without write-behind (no reservation, no pin) the items go largest first
 * into the least full file (ties: lowest K). Since an untouched file is
 * never chosen before a lower-numbered one, the files used are 0..u-1:
 * dropping the unused ones needs no renumbering. Inside each file the
 * items follow set order; those of ALIGN_MIN_LEN bytes or more start at a
 * multiple of ALIGN.
 *
 * With write-behind, file K starts with its reserved bytes: kept pinned
 * items stay where they are (inside them), the other items are balanced
 * over all io_threads files with loads starting at the reservations, and
 * appended after them as above. Files up to the last one holding an item
 * or a reservation are kept, empty ones included. In each file the pinned
 * items (by offset) come before the appended ones.
 */
static int assign_rank(plan_t *p, const uint32_t *sets, uint32_t n,
                       const ckpt_local_plan_t *lp, ckpt_rank_plan_t *rp) {
  rank_shape_t sh;
  rank_shape(p, sets, n, lp, &sh);
  sized_t *order = malloc((sh.n_un + 1) * sizeof(*order));
  pin_t *pins = malloc((sh.n_pin + 1) * sizeof(*pins));
  uint32_t *heap = malloc((sh.t + 1) * sizeof(*heap));
  uint32_t *first = calloc((size_t)sh.cap + 1, sizeof(*first));
  int rc = -ENOMEM;

  rp->file_bytes = calloc(sh.cap + 1, sizeof(*rp->file_bytes));
  rp->assign = malloc((n + 1) * sizeof(*rp->assign));
  if (order == NULL || pins == NULL || heap == NULL || first == NULL ||
      rp->file_bytes == NULL || rp->assign == NULL)
    goto out;
  split_pinned(p, sets, n, order, pins);
  qsort(order, sh.n_un, sizeof(*order), cmp_sized);
  qsort(pins, sh.n_pin, sizeof(*pins), cmp_pin);
  balance_unpinned(p, lp, &sh, order, heap, rp);
  for (uint32_t k = 0; k < sh.cap; k++)
    rp->file_bytes[k] = reserved_of(lp, k);
  count_pins(pins, sh.n_pin, first, rp);
  rc = place_unpinned(p, sets, n, first, rp); /* -EINVAL: past 2^64 */
  if (rc != 0)
    goto out;
  fill_assignments(p, sets, n, &sh, pins, first, rp);
  rc = 0;
out:
  free(first);
  free(heap);
  free(pins);
  free(order);
  return rc;
}

/* Whether a rank has bytes reserved in some file (then it has files even
 * when it keeps nothing). */
static bool has_reserved(const ckpt_local_plan_t *lp) {
  for (uint32_t k = 0; k < lp->n_reserved; k++) {
    if (lp->reserved[k] > 0)
      return true;
  }
  return false;
}

/* Step 4 for every rank. */
static int assign_files(plan_t *p, ckpt_rank_plan_t *ranks) {
  uint32_t *first = calloc((size_t)p->world + 1, sizeof(*first));
  uint32_t *sets = malloc((p->n_sets + 1) * sizeof(*sets));
  int rc = -ENOMEM;
  if (first == NULL || sets == NULL)
    goto out;
  for (uint32_t s = 0; s < p->n_sets; s++)
    first[p->refs[p->keeper[s]].rank + 1]++;
  for (int32_t r = 0; r < p->world; r++)
    first[r + 1] += first[r];
  for (uint32_t s = 0; s < p->n_sets; s++)
    sets[first[p->refs[p->keeper[s]].rank]++] = s;
  rc = 0;
  for (int32_t r = 0; r < p->world && rc == 0; r++) {
    uint32_t start = r > 0 ? first[r - 1] : 0;
    if (first[r] > start || has_reserved(&p->locals[r]))
      rc = assign_rank(p, sets + start, first[r] - start, &p->locals[r],
                       &ranks[r]);
  }
out:
  free(sets);
  free(first);
  return rc;
}

/* ------------------------------------------------------------------------
 * Step 5: the metadata.
 * ---------------------------------------------------------------------- */

static int64_t *dup_dims(const int64_t *d, size_t n) {
  int64_t *c = malloc(n * sizeof(*c));
  if (c != NULL)
    memcpy(c, d, n * sizeof(*c));
  return c;
}

static int build_meta(plan_t *p, ckpt_metadata_t *m) {
  uint32_t n_tensors = 0, n_blobs = 0, n_chunks = 0;
  for (uint32_t g = 0; g < p->n_groups; g++) {
    bool tensor = p->refs[p->group_first[g]].it->kind == CKPT_ITEM_TENSOR;
    n_tensors += tensor;
    n_blobs += !tensor;
    n_chunks += tensor ? p->group_set[g + 1] - p->group_set[g] : 0;
  }
  m->tensors = calloc((size_t)n_tensors + 1, sizeof(*m->tensors));
  m->chunks = calloc((size_t)n_chunks + 1, sizeof(*m->chunks));
  m->blobs = calloc((size_t)n_blobs + 1, sizeof(*m->blobs));
  if (m->tensors == NULL || m->chunks == NULL || m->blobs == NULL)
    return -ENOMEM;

  for (uint32_t g = 0; g < p->n_groups; g++) {
    uint32_t s0 = p->group_set[g], s1 = p->group_set[g + 1];
    const ckpt_write_item_t *it = p->refs[p->group_first[g]].it;
    const char *path = shown_item(p, g)->path;
    size_t nd = (size_t)it->ndim;
    if (it->kind == CKPT_ITEM_BYTES) {
      const ref_t *k = &p->refs[p->keeper[s0]];
      ckpt_blob_meta_t *b = &m->blobs[m->n_blobs++];
      *b = (ckpt_blob_meta_t){.fqn = strdup(it->fqn),
                              .path = strdup(path),
                              .rank = k->rank,
                              .file = p->set_file[s0],
                              .file_offset = p->set_off[s0],
                              .length = k->it->length,
                              .checksum = k->it->checksum};
      if (b->fqn == NULL || b->path == NULL)
        return -ENOMEM;
      continue;
    }
    ckpt_tensor_meta_t *t = &m->tensors[m->n_tensors++];
    *t = (ckpt_tensor_meta_t){.fqn = strdup(it->fqn),
                              .path = strdup(path),
                              .dtype = it->dtype,
                              .ndim = it->ndim,
                              .first_chunk = m->n_chunks,
                              .n_chunks = s1 - s0};
    if (t->fqn == NULL || t->path == NULL ||
        (nd > 0 && (t->shape = dup_dims(ckpt_item_shape(it), nd)) == NULL))
      return -ENOMEM;
    for (uint32_t s = s0; s < s1; s++) {
      const ref_t *k = &p->refs[p->keeper[s]];
      ckpt_chunk_meta_t *c = &m->chunks[m->n_chunks++];
      *c = (ckpt_chunk_meta_t){.tensor = m->n_tensors - 1,
                               .rank = k->rank,
                               .file = p->set_file[s],
                               .file_offset = p->set_off[s],
                               .length = k->it->length,
                               .checksum = k->it->checksum};
      if (nd > 0 &&
          (c->dims = dup_dims(ckpt_item_offsets(k->it), 2 * nd)) == NULL)
        return -ENOMEM;
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------
 * The global plan.
 * ---------------------------------------------------------------------- */

/* Whether the local plans are usable at all (structure, not content). */
static bool usable(const ckpt_local_plan_t *locals, int32_t n,
                   const ckpt_plan_opts_t *opts, uint32_t *n_refs) {
  uint64_t total = 0;
  if (locals == NULL || n < 1 || opts == NULL || opts->io_threads < 1 ||
      (unsigned)opts->replica_check > CKPT_REPLICA_OFF)
    return false;
  for (int32_t r = 0; r < n; r++) {
    const ckpt_local_plan_t *lp = &locals[r];
    if (lp->rank != r || (lp->n_items > 0 && lp->items == NULL) ||
        (lp->n_reserved > 0 && lp->reserved == NULL))
      return false;
    for (uint32_t i = 0; i < lp->n_items; i++) {
      const ckpt_write_item_t *it = &lp->items[i];
      if (it->fqn == NULL || it->path == NULL || it->ndim < 0 ||
          it->ndim > CKPT_MAX_NDIM || (it->ndim > 0 && it->dims == NULL) ||
          (it->kind != CKPT_ITEM_TENSOR &&
           (it->kind != CKPT_ITEM_BYTES || it->ndim != 0)))
        return false;
    }
    total += lp->n_items;
  }
  /* Refs, sets and chunks are numbered with uint32_t. */
  if (total >= UINT32_MAX)
    return false;
  *n_refs = (uint32_t)total;
  return true;
}

static void plan_free(plan_t *p) {
  free(p->refs);
  free(p->group_first);
  free(p->group_set);
  free(p->set_first);
  free(p->keeper);
  free(p->set_file);
  free(p->set_off);
  ckpt_buf_free(&p->errors.buf);
  ckpt_buf_free(&p->warnings.buf);
  ckpt_buf_free(&p->msg);
}

/* Take the lines of r as a string (NULL if none), ending with the count of
 * the problems left out. */
static int finish_report(report_t *r, char **out) {
  int rc = 0;
  *out = NULL;
  if (r->lines == 0)
    return 0;
  if (r->more > 0)
    rc = ckpt_buf_printf(&r->buf, "\n... and %llu more problems",
                         (unsigned long long)r->more);
  if (rc == 0 && (*out = ckpt_buf_steal(&r->buf)) == NULL)
    rc = -ENOMEM;
  return rc;
}

/* Is path the path of a tensor or bytes item of m? */
static bool is_item_path(const ckpt_metadata_t *m, const char *path) {
  for (uint32_t i = 0; i < m->n_tensors; i++)
    if (strcmp(m->tensors[i].path, path) == 0)
      return true;
  for (uint32_t i = 0; i < m->n_blobs; i++)
    if (strcmp(m->blobs[i].path, path) == 0)
      return true;
  return false;
}

/* The staged files' and directories' attributes of every rank, merged
 * (ckpt_entries_merge: rank order decides the owner). */
static int build_entries(const ckpt_local_plan_t *locals, int32_t n,
                         ckpt_metadata_t *m) {
  uint64_t total = 0;
  for (int32_t r = 0; r < n; r++)
    total += locals[r].n_attrs;
  if (total == 0)
    return 0;
  if (total > UINT32_MAX)
    return -EINVAL;
  m->entries = calloc((size_t)total, sizeof(*m->entries));
  if (!m->entries)
    return -ENOMEM;
  for (int32_t r = 0; r < n; r++)
    for (uint32_t i = 0; i < locals[r].n_attrs; i++) {
      if (ckpt_entry_attr_copy(&m->entries[m->n_entries], &locals[r].attrs[i]))
        return -ENOMEM; /* the entries so far are freed with m */
      m->n_entries++;
    }
  ckpt_entries_merge(m->entries, &m->n_entries);
  /* A name that is a hard link on one rank and an item of its own on
   * another is the item (its bytes are stored under it). */
  for (uint32_t i = 0; i < m->n_entries; i++) {
    ckpt_entry_attr_t *e = &m->entries[i];
    if ((e->mode & 0170000) == 0100000 && e->target &&
        is_item_path(m, e->path)) {
      free(e->target);
      e->target = NULL;
    }
  }
  return 0;
}

int ckpt_plan_global(const ckpt_local_plan_t *locals, int32_t n,
                     const ckpt_plan_opts_t *opts, ckpt_global_plan_t *out) {
  assert(out != NULL);
  plan_t p = {.opts = opts, .locals = locals, .world = n};
  int rc = -EINVAL;

  memset(out, 0, sizeof(*out));
  if (!usable(locals, n, opts, &p.n_refs))
    goto out;
  rc = -ENOMEM;
  out->world_size = n;
  out->meta.world_size = n;
  out->ranks = calloc((size_t)n, sizeof(*out->ranks));
  p.refs = malloc(((size_t)p.n_refs + 1) * sizeof(*p.refs));
  if (out->ranks == NULL || p.refs == NULL)
    goto out;
  for (int32_t r = 0; r < n; r++)
    out->ranks[r].rank = r;

  if ((rc = build_sets(&p, locals)) < 0)
    goto out;
  for (int32_t r = 0; r < n; r++)
    check_local_errors(&p, &locals[r]);
  for (int32_t r = 0; r < n; r++)
    check_pins(&p, &locals[r]);
  for (uint32_t g = 0; g < p.n_groups; g++)
    check_group(&p, g);
  check_paths(&p);
  if ((rc = p.rc) < 0 || (rc = finish_report(&p.errors, &out->errors)) < 0 ||
      (rc = finish_report(&p.warnings, &out->warnings)) < 0)
    goto out;
  if (out->errors != NULL)
    goto out; /* rc == 0: a plan was computed, and it is invalid */

  rc = -ENOMEM;
  p.keeper = malloc(((size_t)p.n_sets + 1) * sizeof(*p.keeper));
  p.set_file = malloc(((size_t)p.n_sets + 1) * sizeof(*p.set_file));
  p.set_off = malloc(((size_t)p.n_sets + 1) * sizeof(*p.set_off));
  if (p.keeper == NULL || p.set_file == NULL || p.set_off == NULL)
    goto out;
  if ((rc = dedup(&p)) < 0 || (rc = assign_files(&p, out->ranks)) < 0 ||
      (rc = build_meta(&p, &out->meta)) < 0 ||
      (rc = build_entries(locals, n, &out->meta)) < 0)
    goto out;
out:
  plan_free(&p);
  if (rc < 0)
    ckpt_global_plan_free(out);
  return rc;
}

void ckpt_global_plan_free(ckpt_global_plan_t *gp) {
  if (gp == NULL)
    return;
  for (int32_t r = 0; gp->ranks != NULL && r < gp->world_size; r++)
    ckpt_rank_plan_free(&gp->ranks[r]);
  free(gp->ranks);
  ckpt_metadata_free(&gp->meta);
  free(gp->errors);
  free(gp->warnings);
  memset(gp, 0, sizeof(*gp));
}
