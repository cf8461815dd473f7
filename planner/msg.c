/*
 * msg.c - the binary messages that carry plans between ranks.
 *
 * One message per rank per protocol step: the local plan (rank -> coordinator),
 * the rank plan (coordinator -> rank) and the write result (rank ->
 * coordinator). All integers are little-endian; a string is a u32 length
 * and that many bytes, none of them NUL. Each message starts with a 4-byte
 * magic and a u32 version (CKPT_MSG_VERSION), and must end exactly where its
 * last field does. Version 2 added the write-behind fields of the local
 * plan (reservations, pins), version 3 the staged entries' attributes,
 * version 4 the items' explicit FQNs, version 5 the local plan's direct
 * flag (level=shared with a tier), version 6 the entries' link targets
 * and extended attributes; other versions are rejected.
 *
 *   local plan   "CKLP" version  i32 rank  u8 has_errors [str errors]
 *                u8 direct (0/1)
 *                u32 n_reserved  u64 reserved[n_reserved]
 *                u32 n_items, then per item:
 *                  u8 kind  u8 dtype+1 (0: none)  u8 ndim
 *                  i64 dims[3*ndim] (shape, offsets, sizes; each >= 0)
 *                  u64 length  u64 checksum  u32 local_id
 *                  u32 pin_file  [u64 pin_offset unless CKPT_NO_PIN]
 *                  str path
 *                  u8 has_fqn [str fqn: 1..CKPT_FQN_MAX bytes]
 *                u32 n_attrs, then per staged file, directory or link:
 *                  str path  u32 mode  u32 uid  u32 gid  i64 mtime_ns
 *                  u8 has_target [str target]
 *                  u32 n_xattrs, then per attribute:
 *                    str name  u32 len  len bytes (any byte)
 *                (without has_fqn the FQN is derived from the path on
 *                decoding, as the encoder leaves it out then; pins and
 *                reservations are validated by the global plan, not here)
 *   rank plan    "CKRP" version  i32 rank  u32 n_files  u64 file_bytes[n_files]
 *                u32 n_assign, then per assignment:
 *                  u32 local_id  u32 file  u64 file_offset  u64 length
 *                (grouped by file, by offset, not overlapping, inside the
 *                file)
 *   write result "CKWR" version  i32 rank  u64 bytes_written
 *                u8 has_error [str error]
 *
 * Decoders trust nothing: every count is checked against the bytes left
 * before anything is allocated, and a failure frees what was decoded.
 */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "planner_int.h"

#define CKPT_MSG_VERSION 6u

static const char magic_local_plan[4] = {'C', 'K', 'L', 'P'};
static const char magic_rank_plan[4] = {'C', 'K', 'R', 'P'};
static const char magic_write_result[4] = {'C', 'K', 'W', 'R'};

/* Bytes of the smallest encoded item / assignment (count checks). */
#define MIN_ITEM_BYTES (3 + 8 + 8 + 4 + 4 + 4 + 1)
#define ASSIGN_BYTES (4 + 4 + 8 + 8)

/* ------------------------------------------------------------------------
 * Writing.
 * ---------------------------------------------------------------------- */

/* Appends to a buffer; the first failure sticks and later puts do nothing. */
typedef struct {
  ckpt_buf_t *b;
  int rc;
} writer_t;

static void put_bytes(writer_t *w, const void *p, size_t n) {
  if (w->rc == 0)
    w->rc = ckpt_buf_append(w->b, p, n);
}

static void put_uint(writer_t *w, uint64_t v, size_t size) {
  uint8_t le[8];
  for (size_t i = 0; i < size; i++)
    le[i] = (uint8_t)(v >> (8 * i));
  put_bytes(w, le, size);
}

static void put_u8(writer_t *w, uint8_t v) { put_uint(w, v, 1); }
static void put_u32(writer_t *w, uint32_t v) { put_uint(w, v, 4); }
static void put_u64(writer_t *w, uint64_t v) { put_uint(w, v, 8); }
static void put_i32(writer_t *w, int32_t v) { put_uint(w, (uint32_t)v, 4); }
static void put_i64(writer_t *w, int64_t v) { put_uint(w, (uint64_t)v, 8); }

static void put_str(writer_t *w, const char *s) {
  size_t n = strlen(s);
  if (n > UINT32_MAX && w->rc == 0)
    w->rc = -EINVAL;
  put_u32(w, (uint32_t)n);
  put_bytes(w, s, n);
}

/* An optional string: u8 present, then the string. */
static void put_opt_str(writer_t *w, const char *s) {
  put_u8(w, s != NULL);
  if (s != NULL)
    put_str(w, s);
}

static void put_header(writer_t *w, const char magic[4]) {
  put_bytes(w, magic, 4);
  put_u32(w, CKPT_MSG_VERSION);
}

/* Finish an encoding: on failure the buffer is back to its length before. */
static int finish(writer_t *w, size_t start) {
  if (w->rc < 0)
    w->b->len = start;
  return w->rc;
}

/* ------------------------------------------------------------------------
 * Reading.
 * ---------------------------------------------------------------------- */

/* Reads from the bytes left; the first failure sticks and later gets
 * return zeros. */
typedef struct {
  const uint8_t *p;
  size_t left;
  int rc;
} reader_t;

static const uint8_t *get_bytes(reader_t *r, size_t n) {
  if (r->rc < 0 || n > r->left) {
    r->rc = -EINVAL;
    return NULL;
  }
  const uint8_t *p = r->p;
  r->p += n;
  r->left -= n;
  return p;
}

static uint64_t get_uint(reader_t *r, size_t size) {
  const uint8_t *p = get_bytes(r, size);
  uint64_t v = 0;
  for (size_t i = 0; p != NULL && i < size; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static uint8_t get_u8(reader_t *r) { return (uint8_t)get_uint(r, 1); }
static uint32_t get_u32(reader_t *r) { return (uint32_t)get_uint(r, 4); }
static uint64_t get_u64(reader_t *r) { return get_uint(r, 8); }
static int32_t get_i32(reader_t *r) { return (int32_t)get_u32(r); }
static int64_t get_i64(reader_t *r) { return (int64_t)get_u64(r); }

static void fail(reader_t *r) { r->rc = -EINVAL; }

/* A string without NUL: points into the message, *len bytes. */
static const char *get_str(reader_t *r, size_t *len) {
  *len = get_u32(r);
  const char *s = (const char *)get_bytes(r, *len);
  if (s != NULL && memchr(s, '\0', *len) != NULL) {
    fail(r);
    s = NULL;
  }
  return s;
}

/* An optional string, copied (NULL when absent). */
static char *get_opt_str(reader_t *r) {
  uint8_t present = get_u8(r);
  if (present > 1)
    fail(r);
  if (r->rc < 0 || !present)
    return NULL;
  size_t len;
  const char *s = get_str(r, &len);
  char *c = s != NULL ? strndup(s, len) : NULL;
  if (s != NULL && c == NULL)
    r->rc = -ENOMEM;
  return c;
}

static void get_header(reader_t *r, const char magic[4]) {
  const uint8_t *m = get_bytes(r, 4);
  if (m != NULL && (memcmp(m, magic, 4) != 0 || get_u32(r) != CKPT_MSG_VERSION))
    fail(r);
}

/* The message must end here. */
static int get_end(reader_t *r) {
  if (r->rc == 0 && r->left != 0)
    fail(r);
  return r->rc;
}

/* ------------------------------------------------------------------------
 * Local plan.
 * ---------------------------------------------------------------------- */

static void put_entry(writer_t *w, const ckpt_entry_attr_t *a) {
  put_str(w, a->path);
  put_u32(w, a->mode);
  put_u32(w, a->uid);
  put_u32(w, a->gid);
  put_i64(w, a->mtime_ns);
  put_opt_str(w, a->target);
  put_u32(w, a->n_xattrs);
  for (uint32_t k = 0; k < a->n_xattrs; k++) {
    put_str(w, a->xattrs[k].name);
    put_u32(w, a->xattrs[k].len);
    if (a->xattrs[k].len)
      put_bytes(w, a->xattrs[k].value, a->xattrs[k].len);
  }
}

int ckpt_msg_encode_local_plan(const ckpt_local_plan_t *lp, ckpt_buf_t *out) {
  assert(lp != NULL && out != NULL);
  writer_t w = {.b = out};
  size_t start = out->len;

  put_header(&w, magic_local_plan);
  put_i32(&w, lp->rank);
  put_opt_str(&w, lp->errors);
  put_u8(&w, lp->direct);
  put_u32(&w, lp->n_reserved);
  for (uint32_t k = 0; k < lp->n_reserved; k++)
    put_u64(&w, lp->reserved[k]);
  put_u32(&w, lp->n_items);
  for (uint32_t i = 0; i < lp->n_items; i++) {
    const ckpt_write_item_t *it = &lp->items[i];
    assert(it->ndim >= 0 && it->ndim <= CKPT_MAX_NDIM);
    put_u8(&w, (uint8_t)it->kind);
    put_u8(&w, (uint8_t)(it->dtype + 1));
    put_u8(&w, (uint8_t)it->ndim);
    for (int k = 0; k < 3 * it->ndim; k++)
      put_i64(&w, it->dims[k]);
    put_u64(&w, it->length);
    put_u64(&w, it->checksum);
    put_u32(&w, it->local_id);
    put_u32(&w, it->pin_file);
    if (it->pin_file != CKPT_NO_PIN)
      put_u64(&w, it->pin_offset);
    put_str(&w, it->path);
    put_u8(&w, it->fqn_explicit);
    if (it->fqn_explicit) {
      if (!ckpt_fqn_valid(it->fqn, strlen(it->fqn)) && w.rc == 0)
        w.rc = -EINVAL;
      put_str(&w, it->fqn);
    }
  }
  put_u32(&w, lp->n_attrs);
  for (uint32_t i = 0; i < lp->n_attrs; i++)
    put_entry(&w, &lp->attrs[i]);
  return finish(&w, start);
}

/* One item; kind, dtype and dims must be those a valid plan can hold. */
static void get_item(reader_t *r, ckpt_local_plan_t *lp) {
  int64_t dims[3 * CKPT_MAX_NDIM];
  uint8_t kind = get_u8(r);
  ckpt_dtype_t dtype = (ckpt_dtype_t)(get_u8(r) - 1);
  uint8_t ndim = get_u8(r);
  bool tensor = kind == CKPT_ITEM_TENSOR;
  if (r->rc < 0 || kind > CKPT_ITEM_BYTES || ndim > CKPT_MAX_NDIM ||
      (tensor ? ckpt_dtype_size(dtype) == 0
              : dtype != CKPT_DTYPE_INVALID || ndim != 0)) {
    fail(r);
    return;
  }
  for (int k = 0; k < 3 * ndim; k++) {
    dims[k] = get_i64(r);
    if (dims[k] < 0)
      fail(r);
  }
  uint64_t length = get_u64(r), checksum = get_u64(r);
  uint32_t local_id = get_u32(r), pin_file = get_u32(r);
  uint64_t pin_offset = pin_file != CKPT_NO_PIN ? get_u64(r) : 0;
  size_t len;
  const char *path = get_str(r, &len);
  uint8_t has_fqn = get_u8(r);
  size_t fqn_len = 0;
  const char *fqn = has_fqn == 1 ? get_str(r, &fqn_len) : NULL;
  if (has_fqn > 1 || (has_fqn == 1 && fqn != NULL &&
                      !ckpt_fqn_valid(fqn, fqn_len)))
    fail(r);
  if (r->rc == 0)
    r->rc = ckpt__local_plan_push(lp, path, len, (ckpt_item_kind_t)kind, dtype,
                                  ndim, dims, length, checksum, local_id);
  if (r->rc == 0 && has_fqn == 1)
    r->rc = ckpt_local_plan_set_fqn(lp, lp->n_items - 1, fqn, fqn_len);
  if (r->rc == 0 && pin_file != CKPT_NO_PIN)
    r->rc = ckpt_local_plan_pin(lp, lp->n_items - 1, pin_file, pin_offset);
}

/* A string of at most max bytes, copied (NULL and r->rc set otherwise). */
static char *get_str_copy(reader_t *r, size_t max) {
  size_t len;
  const char *s = get_str(r, &len);
  if (s == NULL || len > max) {
    fail(r);
    return NULL;
  }
  char *c = strndup(s, len);
  if (c == NULL)
    r->rc = -ENOMEM;
  return c;
}

/* One entry's extended attributes into e (checked by add_entry). */
static void get_xattrs(reader_t *r, ckpt_entry_attr_t *e) {
  uint32_t n = get_u32(r);
  if (r->rc < 0 || n > CKPT_XATTR_COUNT_MAX || n > r->left / 8) {
    fail(r);
    return;
  }
  if (n > 0 && !(e->xattrs = calloc(n, sizeof(*e->xattrs)))) {
    r->rc = -ENOMEM;
    return;
  }
  for (uint32_t k = 0; k < n && r->rc == 0; k++) {
    ckpt_xattr_t *x = &e->xattrs[e->n_xattrs++];
    x->name = get_str_copy(r, CKPT_XATTR_NAME_MAX);
    x->len = get_u32(r);
    const uint8_t *v = x->len <= CKPT_XATTR_VALUE_MAX ? get_bytes(r, x->len)
                                                      : NULL;
    if (r->rc == 0 && v == NULL)
      fail(r);
    if (r->rc == 0 && x->len && !(x->value = malloc(x->len)))
      r->rc = -ENOMEM;
    if (r->rc == 0 && x->len)
      memcpy(x->value, v, x->len);
  }
}

/* One staged entry, appended to lp (ckpt_local_plan_add_entry checks it). */
static void get_entry(reader_t *r, ckpt_local_plan_t *lp) {
  ckpt_entry_attr_t e = {.path = get_str_copy(r, 4095)};
  e.mode = get_u32(r);
  e.uid = get_u32(r);
  e.gid = get_u32(r);
  e.mtime_ns = get_i64(r);
  uint8_t has_target = get_u8(r);
  if (has_target > 1)
    fail(r);
  if (has_target == 1 && r->rc == 0)
    e.target = get_str_copy(r, 4095);
  if (r->rc == 0)
    get_xattrs(r, &e);
  if (r->rc == 0)
    r->rc = ckpt_local_plan_add_entry(lp, &e);
  ckpt_entry_attr_free(&e);
}

int ckpt_msg_decode_local_plan(const void *p, size_t n, ckpt_local_plan_t *lp) {
  assert((p != NULL || n == 0) && lp != NULL);
  reader_t r = {.p = p, .left = n};

  ckpt_local_plan_init(lp, 0);
  get_header(&r, magic_local_plan);
  lp->rank = get_i32(&r);
  if (lp->rank < 0)
    fail(&r);
  lp->errors = get_opt_str(&r);
  uint8_t direct = get_u8(&r);
  if (direct > 1)
    fail(&r);
  lp->direct = direct == 1;
  uint32_t n_reserved = get_u32(&r);
  if (n_reserved > r.left / 8)
    fail(&r);
  if (r.rc == 0 && n_reserved > 0) {
    lp->reserved = malloc(n_reserved * sizeof(*lp->reserved));
    if (lp->reserved == NULL)
      r.rc = -ENOMEM;
  }
  for (uint32_t k = 0; k < n_reserved && r.rc == 0; k++)
    lp->reserved[lp->n_reserved++] = get_u64(&r);
  uint32_t n_items = get_u32(&r);
  if (n_items > r.left / MIN_ITEM_BYTES)
    fail(&r);
  for (uint32_t i = 0; i < n_items && r.rc == 0; i++)
    get_item(&r, lp);
  uint32_t n_attrs = get_u32(&r);
  /* path length, mode, uid, gid, mtime, has_target, n_xattrs */
  if (n_attrs > r.left / 29)
    fail(&r);
  for (uint32_t i = 0; i < n_attrs && r.rc == 0; i++)
    get_entry(&r, lp);
  int rc = get_end(&r);
  if (rc < 0)
    ckpt_local_plan_free(lp);
  return rc;
}

/* ------------------------------------------------------------------------
 * Rank plan.
 * ---------------------------------------------------------------------- */

int ckpt_msg_encode_rank_plan(const ckpt_rank_plan_t *rp, ckpt_buf_t *out) {
  assert(rp != NULL && out != NULL);
  writer_t w = {.b = out};
  size_t start = out->len;

  put_header(&w, magic_rank_plan);
  put_i32(&w, rp->rank);
  put_u32(&w, rp->n_files);
  for (uint32_t k = 0; k < rp->n_files; k++)
    put_u64(&w, rp->file_bytes[k]);
  put_u32(&w, rp->n_assign);
  for (uint32_t i = 0; i < rp->n_assign; i++) {
    const ckpt_assignment_t *a = &rp->assign[i];
    put_u32(&w, a->local_id);
    put_u32(&w, a->file);
    put_u64(&w, a->file_offset);
    put_u64(&w, a->length);
  }
  put_str(&w, rp->save_id);
  return finish(&w, start);
}

int ckpt_msg_decode_rank_plan(const void *p, size_t n, ckpt_rank_plan_t *rp) {
  assert((p != NULL || n == 0) && rp != NULL);
  reader_t r = {.p = p, .left = n};

  memset(rp, 0, sizeof(*rp));
  get_header(&r, magic_rank_plan);
  rp->rank = get_i32(&r);
  uint32_t n_files = get_u32(&r);
  if (rp->rank < 0 || n_files > r.left / 8)
    fail(&r);
  if (r.rc == 0 && n_files > 0) {
    rp->file_bytes = malloc(n_files * sizeof(*rp->file_bytes));
    if (rp->file_bytes == NULL)
      r.rc = -ENOMEM;
  }
  for (uint32_t k = 0; k < n_files && r.rc == 0; k++)
    rp->file_bytes[rp->n_files++] = get_u64(&r);

  uint32_t n_assign = get_u32(&r);
  if (n_assign > r.left / ASSIGN_BYTES)
    fail(&r);
  if (r.rc == 0 && n_assign > 0) {
    rp->assign = malloc(n_assign * sizeof(*rp->assign));
    if (rp->assign == NULL)
      r.rc = -ENOMEM;
  }
  uint64_t end = 0; /* of the previous assignment in its file */
  for (uint32_t i = 0; i < n_assign && r.rc == 0; i++) {
    ckpt_assignment_t a = {.local_id = get_u32(&r),
                           .file = get_u32(&r),
                           .file_offset = get_u64(&r),
                           .length = get_u64(&r)};
    const ckpt_assignment_t *prev = i > 0 ? &rp->assign[i - 1] : NULL;
    if (prev == NULL || a.file != prev->file)
      end = 0;
    /* In a known file, after the previous one, inside the file. */
    if (a.file >= rp->n_files || (prev != NULL && a.file < prev->file) ||
        a.file_offset < end || a.length > rp->file_bytes[a.file] ||
        a.file_offset > rp->file_bytes[a.file] - a.length) {
      fail(&r);
      break;
    }
    end = a.file_offset + a.length;
    rp->assign[rp->n_assign++] = a;
  }
  /* The save id: empty (a plan not yet given to a save) or valid. */
  size_t id_len = 0;
  const char *id = get_str(&r, &id_len);
  if (id != NULL && id_len == CKPT_SAVE_ID_LEN) {
    memcpy(rp->save_id, id, id_len);
    rp->save_id[id_len] = '\0';
    if (!ckpt_save_id_valid(rp->save_id))
      fail(&r);
  } else if (id_len != 0) {
    fail(&r);
  }
  int rc = get_end(&r);
  if (rc < 0)
    ckpt_rank_plan_free(rp);
  return rc;
}

/* ------------------------------------------------------------------------
 * Write result.
 * ---------------------------------------------------------------------- */

void ckpt_write_result_free(ckpt_write_result_t *wr) {
  if (wr == NULL)
    return;
  free(wr->error);
  memset(wr, 0, sizeof(*wr));
}

int ckpt_msg_encode_write_result(const ckpt_write_result_t *wr,
                                 ckpt_buf_t *out) {
  assert(wr != NULL && out != NULL);
  writer_t w = {.b = out};
  size_t start = out->len;

  put_header(&w, magic_write_result);
  put_i32(&w, wr->rank);
  put_u64(&w, wr->bytes_written);
  put_opt_str(&w, wr->error);
  return finish(&w, start);
}

int ckpt_msg_decode_write_result(const void *p, size_t n,
                                 ckpt_write_result_t *wr) {
  assert((p != NULL || n == 0) && wr != NULL);
  reader_t r = {.p = p, .left = n};

  memset(wr, 0, sizeof(*wr));
  get_header(&r, magic_write_result);
  wr->rank = get_i32(&r);
  if (wr->rank < 0)
    fail(&r);
  wr->bytes_written = get_u64(&r);
  wr->error = get_opt_str(&r);
  int rc = get_end(&r);
  if (rc < 0)
    ckpt_write_result_free(wr);
  return rc;
}
