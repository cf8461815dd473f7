/*
 * metadb.c - the SQLite metadata of a committed checkpoint (see metadb.h).
 *
 * The only file of ckptfs that calls SQLite. Publish turns the global
 * plan's ckpt_metadata_t into BACKING_DIR/NAME/.metadata; load reads one
 * back, validating everything a reader of the checkpoint relies on, since
 * the file may have been damaged or written by someone else.
 *
 * Format version 1: the tables of docs/committed.md ("Metadata schema"), plus
 *   checkpoint key  writer = "ckptfs"
 *   index           chunks_fqn ON chunks(fqn), for `sqlite3` users who
 *                   query one tensor's chunks
 *   checkpoint keys of retention, each only when its commit word was
 *   given (older checkpoints have none; a reader treats them as absent):
 *                   step = N (decimal), protect = "1",
 *                   metric.KEY = VALUE (the shortest decimal that
 *                   reads back the same double), one row per metric
 * created_at is ISO-8601 UTC ("2026-12-02T10:03:00Z"), world_size decimal.
 *
 * Workload: one publish per commit, up to about a million chunk rows, all
 * in one transaction through prepared statements; one load per committed
 * checkpoint at mount and after each commit. Chunk rows are unordered in
 * the file; load sorts them in C, since offsets must be compared as numbers
 * and SQLite only sees their JSON text. A connection lives within one call
 * on one thread, so it is opened without SQLite's mutexes (NOMUTEX).
 */
#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "failpoint.h"
#include "metadb.h"
#include "store.h"

/* Longest JSON dims list: 19 digits and a comma per value, brackets, NUL. */
#define DIMS_TEXT_MAX (CKPT_MAX_NDIM * 20 + 3)
#define ISO_TIME_FMT "%Y-%m-%dT%H:%M:%SZ"
#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
/* The checkpoint table's format_version value: "1". */
#define FORMAT_VERSION_TEXT STRINGIFY(CKPT_METADB_FORMAT_VERSION)

static const char schema_sql[] =
    "CREATE TABLE checkpoint(key TEXT PRIMARY KEY, value TEXT);"
    "CREATE TABLE tensors(fqn TEXT PRIMARY KEY, path TEXT, dtype TEXT,"
    " shape TEXT);"
    "CREATE TABLE chunks(fqn TEXT, offsets TEXT, sizes TEXT, rank INTEGER,"
    " file TEXT, file_offset INTEGER, length INTEGER, checksum TEXT);"
    "CREATE TABLE blobs(fqn TEXT PRIMARY KEY, path TEXT, rank INTEGER,"
    " file TEXT, file_offset INTEGER, length INTEGER, checksum TEXT);"
    /* more than SPEC's four (which welcomes more): the staged files' and
     * directories' modes, owners and times, kept by the commit */
    "CREATE TABLE entries(path TEXT PRIMARY KEY, mode INTEGER, uid INTEGER,"
    " gid INTEGER, mtime_ns INTEGER, target TEXT);"
    /* the other extended attributes of the staged entries (user.*) */
    "CREATE TABLE xattrs(path TEXT, name TEXT, value BLOB,"
    " PRIMARY KEY(path, name));";
/* Built after the rows are in: cheaper than maintaining it per insert. */
static const char index_sql[] = "CREATE INDEX chunks_fqn ON chunks(fqn);";

/* Set *err (malloc'd) unless an earlier, more precise reason is there;
 * returns rc. */
static int set_err(char **err, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int set_err(char **err, int rc, const char *fmt, ...) {
  assert(rc < 0);
  if (*err == NULL) {
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(err, fmt, ap) < 0)
      *err = NULL;
    va_end(ap);
  }
  return rc;
}

/* The negative errno behind SQLite result code src on db: the system's
 * when the VFS saw one, -EIO for errors of SQLite's own. SQLite records
 * the errno of most failed system calls, but not of those while
 * committing (3.40: a failed write in COMMIT leaves sqlite3_system_errno()
 * at 0), so callers may pass sys: errno right after the call, cleared
 * before it (0 if unknown). */
static int db_errno(sqlite3 *db, int src, int sys) {
  switch (src & 0xff) {
  case SQLITE_FULL:
    return -ENOSPC;
  case SQLITE_NOMEM:
    return -ENOMEM;
  case SQLITE_IOERR:
  case SQLITE_CANTOPEN: {
    int e = db != NULL ? sqlite3_system_errno(db) : 0;
    if (e <= 0)
      e = sys;
    return e > 0 ? -e : -EIO;
  }
  default:
    return -EIO;
  }
}

/* Report SQLite failure src on db (sys as for db_errno) while `doing`
 * path. */
static int db_fail(sqlite3 *db, int src, int sys, char **err, const char *doing,
                   const char *path) {
  int rc = db_errno(db, src, sys);
  if (rc == -EIO)
    return set_err(err, rc, "%s %s: %s", doing, path, sqlite3_errmsg(db));
  return set_err(err, rc, "%s %s: %s (%s)", doing, path, sqlite3_errmsg(db),
                 strerror(-rc));
}

/* ------------------------------------------------------------------------
 * Publishing.
 * ---------------------------------------------------------------------- */

/* State of one publish: the database being written and text scratch space
 * that the statements' SQLITE_STATIC bindings point into until the next
 * bind of the same parameter. */
typedef struct {
  sqlite3 *db;
  const char *path; /* the .metadata.tmp being written, for messages */
  char **err;
  char dims_a[DIMS_TEXT_MAX]; /* shape, or a chunk's offsets */
  char dims_b[DIMS_TEXT_MAX]; /* a chunk's sizes */
  char file[32];              /* "__R_K.distcp" */
  char checksum[17];          /* 16 hex digits */
} writer_t;

/* Every SQLite call of the writer clears errno before it and passes errno
 * after it as sys (see db_errno). */
static int wfail(writer_t *w, int src, int sys) {
  return db_fail(w->db, src, sys, w->err, "writing", w->path);
}

static int exec(writer_t *w, const char *sql) {
  errno = 0;
  int src = sqlite3_exec(w->db, sql, NULL, NULL, NULL);
  return src == SQLITE_OK ? 0 : wfail(w, src, errno);
}

static int prepare(writer_t *w, const char *sql, sqlite3_stmt **st) {
  errno = 0;
  int src = sqlite3_prepare_v2(w->db, sql, -1, st, NULL);
  return src == SQLITE_OK ? 0 : wfail(w, src, errno);
}

/* Run an INSERT whose parameters are bound (bind_rc: their OR'ed results)
 * and make the statement ready for the next row. */
static int insert_row(writer_t *w, sqlite3_stmt *st, int bind_rc) {
  errno = 0;
  int src = bind_rc != SQLITE_OK ? bind_rc : sqlite3_step(st);
  int sys = errno;
  sqlite3_reset(st);
  return src == SQLITE_DONE ? 0 : wfail(w, src, sys);
}

static int bind_text(sqlite3_stmt *st, int i, const char *s) {
  return sqlite3_bind_text(st, i, s, -1, SQLITE_STATIC);
}

static const char *format_dims(char *buf, const int64_t *d, int ndim) {
  int n = ckpt_dims_format(d, ndim, CKPT_DIMS_JSON, buf, DIMS_TEXT_MAX);
  assert(n >= 0 && n < DIMS_TEXT_MAX);
  (void)n;
  return buf;
}

/* Bind the storage columns shared by chunks and blobs, from parameter i
 * on: rank, file, file_offset, length, checksum. *bind_rc gets the OR of
 * the binds' results. */
static int bind_storage(writer_t *w, sqlite3_stmt *st, int i, const char *fqn,
                        int32_t rank, uint32_t file, uint64_t file_offset,
                        uint64_t length, uint64_t checksum, int *bind_rc) {
  if (file_offset > INT64_MAX || length > INT64_MAX)
    return set_err(w->err, -EOVERFLOW,
                   "writing %s: %s: file_offset %" PRIu64 " or length %" PRIu64
                   " beyond SQLite's integers",
                   w->path, fqn, file_offset, length);
  ckpt_data_file_name(rank, file, w->file, sizeof(w->file));
  snprintf(w->checksum, sizeof(w->checksum), "%016" PRIx64, checksum);
  *bind_rc |= sqlite3_bind_int64(st, i, rank) | bind_text(st, i + 1, w->file) |
              sqlite3_bind_int64(st, i + 2, (int64_t)file_offset) |
              sqlite3_bind_int64(st, i + 3, (int64_t)length) |
              bind_text(st, i + 4, w->checksum);
  return 0;
}

/* The retention keys of m through st (INSERT INTO checkpoint). */
static int insert_retention(writer_t *w, sqlite3_stmt *st,
                            const ckpt_metadata_t *m) {
  char key[CKPT_METRIC_KEY_MAX + 8], val[40];
  int rc = 0;
  if (m->has_step) {
    snprintf(val, sizeof(val), "%" PRId64, m->step);
    rc = insert_row(w, st, bind_text(st, 1, "step") | bind_text(st, 2, val));
  }
  if (rc == 0 && m->protect)
    rc = insert_row(w, st,
                    bind_text(st, 1, "protect") | bind_text(st, 2, "1"));
  if (rc == 0 && m->replaces)
    rc = insert_row(w, st, bind_text(st, 1, "replaces") |
                               bind_text(st, 2, m->replaces));
  if (rc == 0 && m->commit_ns > 0) {
    snprintf(val, sizeof(val), "%" PRId64, m->commit_ns);
    rc = insert_row(w, st,
                    bind_text(st, 1, "commit_ns") | bind_text(st, 2, val));
  }
  for (uint32_t i = 0; rc == 0 && i < m->n_metrics; i++) {
    snprintf(key, sizeof(key), "metric.%s", m->metrics[i].key);
    ckpt_metric_format(m->metrics[i].value, val, sizeof(val));
    rc = insert_row(w, st, bind_text(st, 1, key) | bind_text(st, 2, val));
  }
  return rc;
}

static int insert_checkpoint(writer_t *w, const ckpt_metadata_t *m) {
  char world[16], created[32];
  struct tm tm;
  time_t t = (time_t)m->created_at;
  if (gmtime_r(&t, &tm) == NULL ||
      strftime(created, sizeof(created), ISO_TIME_FMT, &tm) == 0)
    return set_err(w->err, -EOVERFLOW,
                   "writing %s: created_at %" PRId64
                   " is not a representable time",
                   w->path, m->created_at);
  snprintf(world, sizeof(world), "%" PRId32, m->world_size);
  const char *const kv[][2] = {
      {"format_version", FORMAT_VERSION_TEXT},
      {"name", m->name},
      {"save_id", m->save_id},
      {"world_size", world},
      {"created_at", created},
      {"writer", "ckptfs"},
  };

  sqlite3_stmt *st = NULL;
  int rc = prepare(w, "INSERT INTO checkpoint(key, value) VALUES (?, ?)", &st);
  for (size_t i = 0; rc == 0 && i < sizeof(kv) / sizeof(kv[0]); i++)
    rc = insert_row(w, st,
                    bind_text(st, 1, kv[i][0]) | bind_text(st, 2, kv[i][1]));
  if (rc == 0)
    rc = insert_retention(w, st, m);
  sqlite3_finalize(st);
  return rc;
}

static int insert_tensors(writer_t *w, const ckpt_metadata_t *m) {
  sqlite3_stmt *st = NULL;
  int rc = prepare(w,
                   "INSERT INTO tensors(fqn, path, dtype, shape)"
                   " VALUES (?, ?, ?, ?)",
                   &st);
  for (uint32_t i = 0; rc == 0 && i < m->n_tensors; i++) {
    const ckpt_tensor_meta_t *t = &m->tensors[i];
    assert(t->fqn != NULL && t->path != NULL);
    assert(ckpt_dtype_name(t->dtype) != NULL);
    rc = insert_row(
        w, st,
        bind_text(st, 1, t->fqn) | bind_text(st, 2, t->path) |
            bind_text(st, 3, ckpt_dtype_name(t->dtype)) |
            bind_text(st, 4, format_dims(w->dims_a, t->shape, t->ndim)));
  }
  sqlite3_finalize(st);
  return rc;
}

static int insert_chunks(writer_t *w, const ckpt_metadata_t *m) {
  sqlite3_stmt *st = NULL;
  int rc = prepare(w,
                   "INSERT INTO chunks(fqn, offsets, sizes, rank, file,"
                   " file_offset, length, checksum)"
                   " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   &st);
  for (uint32_t i = 0; rc == 0 && i < m->n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &m->chunks[i];
    assert(c->tensor < m->n_tensors);
    const ckpt_tensor_meta_t *t = &m->tensors[c->tensor];
    int brc =
        bind_text(st, 1, t->fqn) |
        bind_text(st, 2, format_dims(w->dims_a, c->dims, t->ndim)) |
        bind_text(st, 3, format_dims(w->dims_b, c->dims + t->ndim, t->ndim));
    rc = bind_storage(w, st, 4, t->fqn, c->rank, c->file, c->file_offset,
                      c->length, c->checksum, &brc);
    if (rc == 0)
      rc = insert_row(w, st, brc);
  }
  sqlite3_finalize(st);
  return rc;
}

static int insert_blobs(writer_t *w, const ckpt_metadata_t *m) {
  sqlite3_stmt *st = NULL;
  int rc = prepare(w,
                   "INSERT INTO blobs(fqn, path, rank, file, file_offset,"
                   " length, checksum) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   &st);
  for (uint32_t i = 0; rc == 0 && i < m->n_blobs; i++) {
    const ckpt_blob_meta_t *b = &m->blobs[i];
    assert(b->fqn != NULL && b->path != NULL);
    int brc = bind_text(st, 1, b->fqn) | bind_text(st, 2, b->path);
    rc = bind_storage(w, st, 3, b->fqn, b->rank, b->file, b->file_offset,
                      b->length, b->checksum, &brc);
    if (rc == 0)
      rc = insert_row(w, st, brc);
  }
  sqlite3_finalize(st);
  return rc;
}

static int insert_xattrs(writer_t *w, const ckpt_entry_attr_t *e,
                         sqlite3_stmt *st) {
  int rc = 0;
  for (uint32_t k = 0; rc == 0 && k < e->n_xattrs; k++) {
    const ckpt_xattr_t *x = &e->xattrs[k];
    int brc = bind_text(st, 1, e->path) | bind_text(st, 2, x->name) |
              sqlite3_bind_blob(st, 3, x->len ? (const void *)x->value : "",
                                (int)x->len, SQLITE_STATIC);
    rc = insert_row(w, st, brc);
  }
  return rc;
}

static int insert_entries(writer_t *w, const ckpt_metadata_t *m) {
  sqlite3_stmt *st = NULL, *xst = NULL;
  int rc = prepare(w,
                   "INSERT INTO entries(path, mode, uid, gid, mtime_ns, target)"
                   " VALUES (?, ?, ?, ?, ?, ?)",
                   &st);
  if (rc == 0)
    rc = prepare(w, "INSERT INTO xattrs(path, name, value) VALUES (?, ?, ?)",
                 &xst);
  for (uint32_t i = 0; rc == 0 && i < m->n_entries; i++) {
    const ckpt_entry_attr_t *e = &m->entries[i];
    int brc = bind_text(st, 1, e->path) |
              sqlite3_bind_int64(st, 2, (sqlite3_int64)e->mode) |
              sqlite3_bind_int64(st, 3, (sqlite3_int64)e->uid) |
              sqlite3_bind_int64(st, 4, (sqlite3_int64)e->gid) |
              sqlite3_bind_int64(st, 5, (sqlite3_int64)e->mtime_ns) |
              (e->target ? bind_text(st, 6, e->target)
                         : sqlite3_bind_null(st, 6));
    rc = insert_row(w, st, brc);
    if (rc == 0)
      rc = insert_xattrs(w, e, xst);
  }
  sqlite3_finalize(st);
  sqlite3_finalize(xst);
  return rc;
}

/* Fill the empty database w->db with m, in one transaction. The rollback
 * journal (never WAL) keeps the file readable by `sqlite3 -readonly` on a
 * read-only mount; synchronous=OFF because the caller fsyncs the closed
 * file itself. */
static int write_database(writer_t *w, const ckpt_metadata_t *m) {
  int rc = exec(w, "PRAGMA journal_mode=DELETE; PRAGMA synchronous=OFF;"
                   " BEGIN;");
  if (rc == 0)
    rc = exec(w, schema_sql);
  if (rc == 0)
    rc = insert_checkpoint(w, m);
  if (rc == 0)
    rc = insert_tensors(w, m);
  if (rc == 0)
    rc = insert_chunks(w, m);
  if (rc == 0)
    rc = insert_blobs(w, m);
  if (rc == 0)
    rc = insert_entries(w, m);
  if (rc == 0)
    rc = exec(w, index_sql);
  if (rc == 0)
    rc = exec(w, "COMMIT;");
  return rc;
}

/* fsync (when sync) and close fd, an open file or directory at path. */
static int finish_fd(int fd, bool sync, const char *path, char **err) {
  int rc = 0;
  if (sync && fsync(fd) < 0)
    rc = set_err(err, -errno, "fsync %s: %s", path, strerror(errno));
  if (close(fd) < 0 && rc == 0)
    rc = set_err(err, -errno, "closing %s: %s", path, strerror(errno));
  return rc;
}

static int unlink_stale(const char *path, char **err) {
  if (unlink(path) < 0 && errno != ENOENT)
    return set_err(err, -errno, "removing stale %s: %s", path, strerror(errno));
  return 0;
}

/*
 * The durable publish protocol (metadb.h):
 *  1. remove a stale .metadata.tmp (and its rollback journal, which SQLite
 *     would otherwise take for a hot journal of the new file); create
 *     .metadata.tmp ourselves, so that a failure carries the system's own
 *     reason (SQLite retries a failed create read-only and reports that
 *     attempt's errno), and keep that descriptor; SQLite fills the empty
 *     file in one transaction and closes its connection;
 *  2. (sync) fsync .metadata.tmp through the kept descriptor, closed only
 *     now that SQLite holds no locks on the file: the contents are durable
 *     before the name;
 *  3. rename .metadata.tmp to .metadata: the atomic switch; a crash before
 *     it leaves no .metadata, after it the complete one;
 *  4. (sync) fsync the checkpoint directory, making the rename durable.
 * On any failure nothing stays published: .metadata.tmp is removed, and so
 * is .metadata when step 4 fails (the rename may not be durable, and the
 * caller reports the commit as failed).
 */
int ckpt_metadb_publish(const char *ckpt_dir, const ckpt_metadata_t *m,
                        bool sync, char **err) {
  assert(ckpt_dir != NULL && m != NULL && err != NULL);
  assert(m->name != NULL && m->save_id != NULL && m->world_size > 0);
  *err = NULL;
  writer_t w = {.err = err};
  char tmp[PATH_MAX], journal[PATH_MAX], dst[PATH_MAX];
  bool renamed = false;
  int rc = 0, src, fd = -1;

  if ((size_t)snprintf(tmp, sizeof(tmp), "%s/%s", ckpt_dir,
                       CKPT_METADATA_TMP) >= sizeof(tmp) ||
      (size_t)snprintf(journal, sizeof(journal), "%s-journal", tmp) >=
          sizeof(journal) ||
      (size_t)snprintf(dst, sizeof(dst), "%s/%s", ckpt_dir,
                       CKPT_METADATA_FILE) >= sizeof(dst))
    return set_err(err, -ENAMETOOLONG, "publishing in %s: %s", ckpt_dir,
                   strerror(ENAMETOOLONG));
  w.path = tmp;

  /* 1. */
  if ((rc = unlink_stale(tmp, err)) < 0 ||
      (rc = unlink_stale(journal, err)) < 0)
    goto cleanup;
  fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    rc = set_err(err, -errno, "creating %s: %s", tmp, strerror(errno));
    goto cleanup;
  }
  errno = 0;
  src = sqlite3_open_v2(tmp, &w.db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX,
                        NULL);
  if (src != SQLITE_OK) {
    rc = wfail(&w, src, errno);
    goto cleanup;
  }
  if ((rc = write_database(&w, m)) < 0)
    goto cleanup;
  src = sqlite3_close(w.db);
  w.db = NULL;
  if (src != SQLITE_OK) {
    rc = set_err(err, -EIO, "closing %s: %s", tmp, sqlite3_errstr(src));
    goto cleanup;
  }
  /* 2. */
  rc = finish_fd(fd, sync, tmp, err);
  fd = -1;
  if (rc < 0)
    goto cleanup;
  /* 3. */
  ckpt_failpoint("metadata_tmp");
  if (rename(tmp, dst) < 0) {
    rc = set_err(err, -errno, "renaming %s to %s: %s", tmp, dst,
                 strerror(errno));
    goto cleanup;
  }
  renamed = true;
  /* 4. */
  if (sync) {
    int dfd = open(ckpt_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
      rc = set_err(err, -errno, "opening %s: %s", ckpt_dir, strerror(errno));
    else
      rc = finish_fd(dfd, true, ckpt_dir, err);
  }

cleanup:
  sqlite3_close(w.db); /* before closing fd: SQLite's locks die with it */
  if (fd >= 0)
    close(fd);
  if (rc < 0) {
    unlink(renamed ? dst : tmp);
    unlink(journal);
  }
  return rc;
}

/* ------------------------------------------------------------------------
 * Loading.
 * ---------------------------------------------------------------------- */

typedef struct {
  sqlite3 *db;
  const char *path; /* the .metadata, for messages */
  char **err;
  ckpt_metadata_t *m;
  int dirfd;        /* open .metadata in this directory, or -1: path */
  int fd;           /* our own descriptor of the .metadata, or -1 */
  struct timespec deadline; /* queries are interrupted past it */
  bool timed_out;
  bool has_entries; /* the optional entries table is there */
  bool has_target;  /* ... with its target column (links) */
  bool has_xattrs;  /* the optional xattrs table is there */
} loader_t;

/* Where a row being checked is, for messages. */
typedef struct {
  const char *table;
  uint64_t n;      /* 1-based row number in the order read */
  const char *fqn; /* once known, else NULL */
} row_t;

static int lfail(loader_t *ld, int src) {
  return db_fail(ld->db, src, 0, ld->err, "reading", ld->path);
}

static int nomem(loader_t *ld) {
  return set_err(ld->err, -ENOMEM, "reading %s: %s", ld->path,
                 strerror(ENOMEM));
}

static int row_fail(loader_t *ld, const row_t *r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int row_fail(loader_t *ld, const row_t *r, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (r->fqn != NULL)
    return set_err(ld->err, -EINVAL, "%s: %s row %" PRIu64 " (%.200s): %s",
                   ld->path, r->table, r->n, r->fqn, msg);
  return set_err(ld->err, -EINVAL, "%s: %s row %" PRIu64 ": %s", ld->path,
                 r->table, r->n, msg);
}

static int lprepare(loader_t *ld, const char *sql, sqlite3_stmt **st) {
  int src = sqlite3_prepare_v2(ld->db, sql, -1, st, NULL);
  return src == SQLITE_OK ? 0 : lfail(ld, src);
}

/* Step st: 1 with a row, 0 when done, or a negative errno. */
static int next_row(loader_t *ld, sqlite3_stmt *st) {
  int src = sqlite3_step(st);
  if (src == SQLITE_ROW)
    return 1;
  return src == SQLITE_DONE ? 0 : lfail(ld, src);
}

/* Text of column i (its length in *len when len is not NULL); NULL, with
 * the error reported, for an SQL NULL. */
static const char *col_text(loader_t *ld, sqlite3_stmt *st, int i,
                            const row_t *r, size_t *len) {
  if (sqlite3_column_type(st, i) == SQLITE_NULL) {
    row_fail(ld, r, "%s is NULL", sqlite3_column_name(st, i));
    return NULL;
  }
  const char *s = (const char *)sqlite3_column_text(st, i);
  if (s == NULL) {
    nomem(ld);
    return NULL;
  }
  size_t n = (size_t)sqlite3_column_bytes(st, i);
  if (strlen(s) != n) { /* a NUL inside would cut the text short */
    row_fail(ld, r, "%s holds a NUL byte", sqlite3_column_name(st, i));
    return NULL;
  }
  if (len != NULL)
    *len = n;
  return s;
}

static int col_int(loader_t *ld, sqlite3_stmt *st, int i, const row_t *r,
                   int64_t min, int64_t max, int64_t *out) {
  if (sqlite3_column_type(st, i) != SQLITE_INTEGER)
    return row_fail(ld, r, "%s is not an integer", sqlite3_column_name(st, i));
  int64_t v = sqlite3_column_int64(st, i);
  if (v < min || v > max)
    return row_fail(ld, r,
                    "%s %" PRId64 " is not in [%" PRId64 ", %" PRId64 "]",
                    sqlite3_column_name(st, i), v, min, max);
  *out = v;
  return 0;
}

static int col_strdup(loader_t *ld, sqlite3_stmt *st, int i, const row_t *r,
                      char **out) {
  const char *s = col_text(ld, st, i, r, NULL);
  if (s == NULL)
    return -EINVAL;
  if ((*out = strdup(s)) == NULL)
    return nomem(ld);
  return 0;
}

static int col_dims(loader_t *ld, sqlite3_stmt *st, int i, const row_t *r,
                    ckpt_dims_t *d) {
  size_t len;
  const char *s = col_text(ld, st, i, r, &len);
  if (s == NULL)
    return -EINVAL;
  if (ckpt_dims_parse(s, len, d) < 0)
    return row_fail(ld, r, "%s '%.64s' is not a list of dimensions",
                    sqlite3_column_name(st, i), s);
  return 0;
}

/* A copy of d's values (NULL for 0-d): the arrays of ckpt_metadata_t. */
static int64_t *dims_dup(const int64_t *d, int n) {
  int64_t *p = NULL;
  if (n > 0 && (p = malloc((size_t)n * sizeof(*p))) != NULL)
    memcpy(p, d, (size_t)n * sizeof(*p));
  return p;
}

static int parse_checksum(const char *s, uint64_t *out) {
  uint64_t v = 0;
  size_t i = 0;
  for (; s[i] != '\0'; i++) {
    char c = s[i];
    int x = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
            : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                   : -1;
    if (x < 0 || i == 16)
      return -EINVAL;
    v = v << 4 | (uint64_t)x;
  }
  if (i != 16)
    return -EINVAL;
  *out = v;
  return 0;
}

/* Read the storage columns shared by chunks and blobs, from column i on:
 * rank, file, file_offset, length, checksum. */
static int col_storage(loader_t *ld, sqlite3_stmt *st, int i, const row_t *r,
                       int32_t *rank, uint32_t *file, uint64_t *file_offset,
                       uint64_t *length, uint64_t *checksum) {
  int64_t rk = 0, off = 0, len = 0;
  int rc;
  if ((rc = col_int(ld, st, i, r, 0, ld->m->world_size - 1, &rk)) < 0 ||
      (rc = col_int(ld, st, i + 2, r, 0, INT64_MAX, &off)) < 0 ||
      (rc = col_int(ld, st, i + 3, r, 0, INT64_MAX, &len)) < 0)
    return rc;
  const char *name = col_text(ld, st, i + 1, r, NULL);
  const char *sum = col_text(ld, st, i + 4, r, NULL);
  if (name == NULL || sum == NULL)
    return -EINVAL;
  int32_t frank;
  if (ckpt_data_file_parse(name, &frank, file) < 0)
    return row_fail(ld, r, "file '%.64s' is not of the form __R_K.distcp",
                    name);
  if (frank != rk)
    return row_fail(ld, r, "file %s is not of rank %" PRId64, name, rk);
  if (*file > CKPT_METADB_MAX_FILE)
    return row_fail(ld, r, "file %s: more than %d data files per rank",
                    name, CKPT_METADB_MAX_FILE + 1);
  if (len > INT64_MAX - off)
    return row_fail(ld, r, "file_offset %" PRId64 " + length %" PRId64
                    " overflows", off, len);
  if (parse_checksum(sum, checksum) < 0)
    return row_fail(ld, r, "checksum '%.64s' is not 16 hex digits", sum);
  *rank = (int32_t)rk;
  *file_offset = (uint64_t)off;
  *length = (uint64_t)len;
  return 0;
}

/* Allocate as many zeroed entries of size bytes as table has rows. */
static int alloc_rows(loader_t *ld, const char *table, size_t size, void **arr,
                      uint32_t *count) {
  char sql[64];
  snprintf(sql, sizeof(sql), "SELECT count(*) FROM %s", table);
  *arr = NULL;
  *count = 0;
  sqlite3_stmt *st = NULL;
  int rc = lprepare(ld, sql, &st);
  if (rc == 0 && (rc = next_row(ld, st)) == 1) {
    int64_t n = sqlite3_column_int64(st, 0);
    if (n > UINT32_MAX) {
      rc = set_err(ld->err, -EOVERFLOW, "%s: %" PRId64 " rows in %s", ld->path,
                   n, table);
    } else if (n > 0 && (*arr = calloc((size_t)n, size)) == NULL) {
      rc = nomem(ld);
    } else {
      *count = (uint32_t)n;
      rc = 0;
    }
  }
  sqlite3_finalize(st);
  return rc;
}

static bool entry_path_ok(const char *p);

/* A committed item's path: one a mount could have staged, relative, its
 * components names a staged entry could have had (entry_path_ok). It
 * need not spell the FQN: an item with user.ckpt.fqn sits at any path. */
static int col_path(loader_t *ld, sqlite3_stmt *st, int i, const row_t *r,
                    char **out) {
  int rc = col_strdup(ld, st, i, r, out);
  if (rc == 0 && (**out == '\0' || !entry_path_ok(*out)))
    rc = row_fail(ld, r, "path '%.64s' is not a checkpoint path", *out);
  else if (rc == 0 && r->fqn[0] == '\0')
    rc = row_fail(ld, r, "fqn is empty");
  else if (rc == 0 && strlen(r->fqn) > CKPT_FQN_MAX)
    rc = row_fail(ld, r, "fqn is longer than %d bytes", CKPT_FQN_MAX);
  return rc;
}

/* Index of the tensor named fqn in the sorted tensors, or -1. */
static int64_t find_tensor(const ckpt_metadata_t *m, const char *fqn) {
  uint32_t lo = 0, hi = m->n_tensors;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    int c = strcmp(m->tensors[mid].fqn, fqn);
    if (c == 0)
      return mid;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -1;
}

static int by_metric_key(const void *a, const void *b) {
  return strcmp(((const ckpt_metric_t *)a)->key,
                ((const ckpt_metric_t *)b)->key);
}

/* A retention key of the checkpoint table (step, protect, metric.KEY):
 * 1 when key is not one, else 0 or a negative errno. */
static int load_retention(loader_t *ld, const row_t *r, const char *key,
                          const char *val) {
  ckpt_metadata_t *m = ld->m;
  if (!strcmp(key, "step")) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(val, &end, 10);
    if (m->has_step)
      return row_fail(ld, r, "key step appears twice");
    if (errno || end == val || *end || v < 0 || !isdigit((unsigned char)*val))
      return row_fail(ld, r, "step '%.32s' is not a step number", val);
    m->has_step = true;
    m->step = v;
    return 0;
  }
  if (!strcmp(key, "commit_ns")) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(val, &end, 10);
    if (m->commit_ns)
      return row_fail(ld, r, "key commit_ns appears twice");
    if (errno || end == val || *end || v <= 0 || !isdigit((unsigned char)*val))
      return row_fail(ld, r, "commit_ns '%.32s' is not a time", val);
    m->commit_ns = v;
    return 0;
  }
  if (!strcmp(key, "replaces")) {
    if (m->replaces)
      return row_fail(ld, r, "key replaces appears twice");
    if (!*val) /* "none" says no checkpoint: empty says nothing */
      return row_fail(ld, r, "replaces is empty");
    for (const char *c = val; *c; c++)
      if (!isalnum((unsigned char)*c) && !strchr(" #-_", *c))
        return row_fail(ld, r, "replaces '%.80s' is not a list of save keys",
                        val);
    if (!(m->replaces = strdup(val)))
      return nomem(ld);
    return 0;
  }
  if (!strcmp(key, "protect")) {
    if (strcmp(val, "1") && strcmp(val, "0"))
      return row_fail(ld, r, "protect '%.32s' is not 0 or 1", val);
    m->protect = !strcmp(val, "1");
    return 0;
  }
  if (strncmp(key, "metric.", 7))
    return 1;
  const char *k = key + 7;
  double v;
  if (!ckpt_metric_key_valid(k, strlen(k)))
    return row_fail(ld, r, "'%.80s' is not a metric key", key);
  if (ckpt_metric_value_parse(val, strlen(val), &v))
    return row_fail(ld, r, "%.80s '%.32s' is not a finite number", key, val);
  for (uint32_t i = 0; i < m->n_metrics; i++)
    if (!strcmp(m->metrics[i].key, k))
      return row_fail(ld, r, "key %.80s appears twice", key);
  if (m->n_metrics == CKPT_MAX_METRICS)
    return row_fail(ld, r, "more than %d metrics", CKPT_MAX_METRICS);
  ckpt_metric_t *grown =
      realloc(m->metrics, (m->n_metrics + 1) * sizeof(*grown));
  if (!grown)
    return nomem(ld);
  m->metrics = grown;
  snprintf(grown[m->n_metrics].key, sizeof(grown->key), "%s", k);
  grown[m->n_metrics++].value = v;
  qsort(m->metrics, m->n_metrics, sizeof(*m->metrics), by_metric_key);
  return 0;
}

static int load_checkpoint(loader_t *ld) {
  enum { K_FORMAT, K_NAME, K_SAVE_ID, K_WORLD, K_CREATED, N_KEYS };
  static const char *const keys[N_KEYS] = {
      [K_FORMAT] = "format_version", [K_NAME] = "name",
      [K_SAVE_ID] = "save_id",       [K_WORLD] = "world_size",
      [K_CREATED] = "created_at",
  };
  ckpt_metadata_t *m = ld->m;
  bool seen[N_KEYS] = {false};
  row_t r = {.table = "checkpoint"};
  sqlite3_stmt *st = NULL;
  int rc = lprepare(ld, "SELECT key, value FROM checkpoint", &st);
  while (rc == 0 && (rc = next_row(ld, st)) == 1) {
    r.n++;
    rc = 0;
    const char *key = col_text(ld, st, 0, &r, NULL);
    const char *val = key != NULL ? col_text(ld, st, 1, &r, NULL) : NULL;
    if (val == NULL) {
      rc = -EINVAL;
      break;
    }
    int k = 0;
    while (k < N_KEYS && strcmp(key, keys[k]) != 0)
      k++;
    if (k == N_KEYS) { /* keys of later writers are welcome */
      rc = load_retention(ld, &r, key, val);
      if (rc == 1)
        rc = 0;
      if (rc)
        break;
      continue;
    }
    r.fqn = keys[k];
    if (seen[k]) {
      rc = row_fail(ld, &r, "key appears twice");
      break;
    }
    seen[k] = true;
    char *end = NULL;
    struct tm tm = {0};
    long long v;
    switch (k) {
    case K_FORMAT:
      if (strcmp(val, FORMAT_VERSION_TEXT) != 0)
        rc = row_fail(ld, &r, "format version '%.32s' is not %s", val,
                      FORMAT_VERSION_TEXT);
      break;
    case K_NAME:
      rc = col_strdup(ld, st, 1, &r, &m->name);
      break;
    case K_SAVE_ID:
      rc = col_strdup(ld, st, 1, &r, &m->save_id);
      break;
    case K_WORLD:
      errno = 0;
      v = strtoll(val, &end, 10);
      if (errno != 0 || end == val || *end != '\0' || v < 1 ||
          v > CKPT_METADB_MAX_WORLD)
        rc = row_fail(ld, &r,
                      "'%.32s' is not a world size (1 to %d ranks)", val,
                      CKPT_METADB_MAX_WORLD);
      m->world_size = (int32_t)v;
      break;
    case K_CREATED:
      end = strptime(val, ISO_TIME_FMT, &tm);
      if (end == NULL || *end != '\0')
        rc = row_fail(ld, &r, "'%.32s' is not an ISO-8601 UTC time", val);
      m->created_at = (int64_t)timegm(&tm);
      break;
    }
    r.fqn = NULL;
  }
  sqlite3_finalize(st);
  for (int k = 0; rc == 0 && k < N_KEYS; k++) {
    if (!seen[k])
      rc = set_err(ld->err, -EINVAL, "%s: checkpoint key %s is missing",
                   ld->path, keys[k]);
  }
  return rc;
}

static int load_tensors(loader_t *ld) {
  ckpt_metadata_t *m = ld->m;
  void *rows;
  int rc = alloc_rows(ld, "tensors", sizeof(*m->tensors), &rows, &m->n_tensors);
  m->tensors = rows; /* with n_tensors set: ckpt_metadata_free releases them */
  row_t r = {.table = "tensors"};
  sqlite3_stmt *st = NULL;
  if (rc == 0)
    rc = lprepare(ld,
                  "SELECT fqn, path, dtype, shape FROM tensors"
                  " ORDER BY fqn COLLATE BINARY",
                  &st);
  while (rc == 0 && (rc = next_row(ld, st)) == 1) {
    if (r.n == m->n_tensors) {
      rc = row_fail(ld, &r, "more rows than counted");
      break;
    }
    ckpt_tensor_meta_t *t = &m->tensors[r.n++];
    size_t len;
    const char *dt;
    ckpt_dims_t shape;
    uint64_t numel, bytes;
    if ((rc = col_strdup(ld, st, 0, &r, &t->fqn)) < 0)
      break;
    r.fqn = t->fqn;
    if ((rc = col_path(ld, st, 1, &r, &t->path)) < 0 ||
        (rc = col_dims(ld, st, 3, &r, &shape)) < 0)
      break;
    if ((dt = col_text(ld, st, 2, &r, &len)) == NULL) {
      rc = -EINVAL;
    } else if (ckpt_dtype_parse(dt, len, &t->dtype) < 0) {
      rc = row_fail(ld, &r, "dtype '%.32s' is unknown", dt);
    } else if (ckpt_dims_numel(shape.d, shape.ndim, &numel) < 0 ||
               __builtin_mul_overflow(numel, ckpt_dtype_size(t->dtype),
                                      &bytes) ||
               bytes > INT64_MAX) {
      rc = row_fail(ld, &r, "shape is too large");
    } else if (r.n > 1 && strcmp(t[-1].fqn, t->fqn) == 0) {
      rc = row_fail(ld, &r, "fqn appears twice");
    } else if (shape.ndim > 0 &&
               (t->shape = dims_dup(shape.d, shape.ndim)) == NULL) {
      rc = nomem(ld);
    }
    t->ndim = shape.ndim;
    r.fqn = NULL;
  }
  sqlite3_finalize(st);
  return rc;
}

/* Check one chunk row's offsets and sizes against its tensor and set
 * c->dims. */
static int chunk_dims(loader_t *ld, const row_t *r, const ckpt_tensor_meta_t *t,
                      const ckpt_dims_t *offs, const ckpt_dims_t *sizes,
                      ckpt_chunk_meta_t *c) {
  if (offs->ndim != t->ndim || sizes->ndim != t->ndim)
    return row_fail(ld, r,
                    "offsets and sizes of %d and %d dimensions, the"
                    " shape has %d",
                    offs->ndim, sizes->ndim, t->ndim);
  for (int j = 0; j < t->ndim; j++) {
    if (offs->d[j] > t->shape[j] || sizes->d[j] > t->shape[j] - offs->d[j])
      return row_fail(ld, r,
                      "dimension %d: [%" PRId64 ", +%" PRId64
                      ") is outside the shape (%" PRId64 ")",
                      j, offs->d[j], sizes->d[j], t->shape[j]);
  }
  uint64_t numel;
  ckpt_dims_numel(sizes->d, sizes->ndim, &numel); /* within the shape */
  uint64_t want = numel * ckpt_dtype_size(t->dtype);
  if (c->length != want)
    return row_fail(ld, r, "length %" PRIu64 ", %" PRIu64 " expected",
                    c->length, want);
  if (t->ndim == 0)
    return 0;
  if ((c->dims = malloc(2 * (size_t)t->ndim * sizeof(int64_t))) == NULL)
    return nomem(ld);
  memcpy(c->dims, offs->d, (size_t)t->ndim * sizeof(int64_t));
  memcpy(c->dims + t->ndim, sizes->d, (size_t)t->ndim * sizeof(int64_t));
  return 0;
}

static int load_chunks(loader_t *ld) {
  ckpt_metadata_t *m = ld->m;
  void *rows;
  int rc = alloc_rows(ld, "chunks", sizeof(*m->chunks), &rows, &m->n_chunks);
  m->chunks = rows; /* with n_chunks set: ckpt_metadata_free releases them */
  row_t r = {.table = "chunks"};
  sqlite3_stmt *st = NULL;
  if (rc == 0)
    rc = lprepare(ld,
                  "SELECT fqn, offsets, sizes, rank, file, file_offset,"
                  " length, checksum FROM chunks",
                  &st);
  while (rc == 0 && (rc = next_row(ld, st)) == 1) {
    /* The last row's fqn was SQLite's text of that row, gone with the
     * step: this row's errors must not print it */
    r.fqn = NULL;
    if (r.n == m->n_chunks) {
      rc = row_fail(ld, &r, "more rows than counted");
      break;
    }
    ckpt_chunk_meta_t *c = &m->chunks[r.n++];
    ckpt_dims_t offs, sizes;
    int64_t ti;
    const char *fqn = col_text(ld, st, 0, &r, NULL);
    if (fqn == NULL) {
      rc = -EINVAL;
      break;
    }
    r.fqn = fqn;
    if ((ti = find_tensor(m, fqn)) < 0) {
      rc = row_fail(ld, &r, "not a tensor of the tensors table");
      break;
    }
    c->tensor = (uint32_t)ti;
    r.fqn = m->tensors[ti].fqn; /* the loaded copy: lives as long as m */
    if ((rc = col_dims(ld, st, 1, &r, &offs)) < 0 ||
        (rc = col_dims(ld, st, 2, &r, &sizes)) < 0 ||
        (rc = col_storage(ld, st, 3, &r, &c->rank, &c->file, &c->file_offset,
                          &c->length, &c->checksum)) < 0 ||
        (rc = chunk_dims(ld, &r, &m->tensors[ti], &offs, &sizes, c)) < 0)
      break;
  }
  sqlite3_finalize(st);
  return rc;
}

static int load_blobs(loader_t *ld) {
  ckpt_metadata_t *m = ld->m;
  void *rows;
  int rc = alloc_rows(ld, "blobs", sizeof(*m->blobs), &rows, &m->n_blobs);
  m->blobs = rows; /* with n_blobs set: ckpt_metadata_free releases them */
  row_t r = {.table = "blobs"};
  sqlite3_stmt *st = NULL;
  if (rc == 0)
    rc = lprepare(ld,
                  "SELECT fqn, path, rank, file, file_offset, length, checksum"
                  " FROM blobs ORDER BY fqn COLLATE BINARY",
                  &st);
  while (rc == 0 && (rc = next_row(ld, st)) == 1) {
    r.fqn = NULL; /* the last row's, until this one's is read */
    if (r.n == m->n_blobs) {
      rc = row_fail(ld, &r, "more rows than counted");
      break;
    }
    ckpt_blob_meta_t *b = &m->blobs[r.n++];
    if ((rc = col_strdup(ld, st, 0, &r, &b->fqn)) < 0)
      break;
    r.fqn = b->fqn;
    if ((rc = col_path(ld, st, 1, &r, &b->path)) < 0 ||
        (rc = col_storage(ld, st, 2, &r, &b->rank, &b->file, &b->file_offset,
                          &b->length, &b->checksum)) < 0)
      break;
    if (r.n > 1 && strcmp(b[-1].fqn, b->fqn) == 0)
      rc = row_fail(ld, &r, "fqn appears twice");
    else if (find_tensor(m, b->fqn) >= 0)
      rc = row_fail(ld, &r, "fqn is also a tensor");
  }
  sqlite3_finalize(st);
  return rc;
}

/* A relative path of a checkpoint's namespace ("" is the checkpoint
 * itself): each component a name a staged entry could have had there
 * (ckpt_entry_name_check: not "." or "..", at most 255 bytes, and not a
 * name ckptfs serves directly under the checkpoint). */
static bool entry_path_ok(const char *p) {
  if (*p == '\0')
    return true;
  for (bool top = true;; top = false) {
    const char *slash = strchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    if (ckpt_entry_name_check(p, len, top) != 0)
      return false;
    if (!slash)
      return true;
    p = slash + 1;
  }
}

/* One row of the xattrs table into its entry (rows come by path, name). */
static int load_xattr(loader_t *ld, sqlite3_stmt *st, row_t *r) {
  ckpt_metadata_t *m = ld->m;
  const char *path = col_text(ld, st, 0, r, NULL);
  size_t nlen = 0;
  const char *name = path ? col_text(ld, st, 1, r, &nlen) : NULL;
  if (!name)
    return -EINVAL;
  ckpt_entry_attr_t *e = (ckpt_entry_attr_t *)ckpt_metadata_entry(m, path);
  if (!e)
    return row_fail(ld, r, "path '%.64s' has no entries row", path);
  if (!ckpt_xattr_name_ok(name, nlen))
    return row_fail(ld, r, "name '%.64s' is not a user.* name ckptfs keeps",
                    name);
  int t = sqlite3_column_type(st, 2);
  int len = sqlite3_column_bytes(st, 2);
  if (t != SQLITE_BLOB || len > CKPT_XATTR_VALUE_MAX ||
      e->n_xattrs >= CKPT_XATTR_COUNT_MAX)
    return row_fail(ld, r, "value of %.64s is not a blob within the bounds "
                    "(%d values, %d bytes)", name, CKPT_XATTR_COUNT_MAX,
                    CKPT_XATTR_VALUE_MAX);
  if (e->n_xattrs % 8 == 0) {
    ckpt_xattr_t *v = realloc(e->xattrs, (e->n_xattrs + 8) * sizeof(*v));
    if (!v)
      return nomem(ld);
    e->xattrs = v;
  }
  ckpt_xattr_t *x = &e->xattrs[e->n_xattrs];
  *x = (ckpt_xattr_t){.name = strdup(name), .len = (uint32_t)len};
  if (!x->name || (len && !(x->value = malloc((size_t)len)))) {
    free(x->name);
    return nomem(ld);
  }
  e->n_xattrs++;
  if (len)
    memcpy(x->value, sqlite3_column_blob(st, 2), (size_t)len);
  return ckpt_entry_attr_check(e) < 0
             ? row_fail(ld, r, "the attributes of '%.64s' are past the bounds"
                        " or twice", path)
             : 0;
}

/* The optional xattrs table: the entries' other extended attributes. */
static int load_xattrs(loader_t *ld) {
  if (!ld->has_xattrs)
    return 0;
  row_t r = {.table = "xattrs"};
  sqlite3_stmt *st = NULL;
  int rc = lprepare(ld,
                    "SELECT path, name, value FROM xattrs ORDER BY path"
                    " COLLATE BINARY, name COLLATE BINARY",
                    &st);
  while (rc == 0 && (rc = next_row(ld, st)) == 1) {
    r.n++;
    rc = load_xattr(ld, st, &r);
  }
  sqlite3_finalize(st);
  return rc;
}

/* The optional entries table: modes, owners and times of what was staged. */
static int load_entries(loader_t *ld) {
  ckpt_metadata_t *m = ld->m;
  if (!ld->has_entries)
    return 0;
  void *rows;
  int rc = alloc_rows(ld, "entries", sizeof(*m->entries), &rows,
                      &m->n_entries);
  m->entries = rows;
  row_t r = {.table = "entries"};
  sqlite3_stmt *st = NULL;
  if (rc == 0)
    rc = lprepare(ld,
                  ld->has_target
                      ? "SELECT path, mode, uid, gid, mtime_ns, target FROM"
                        " entries ORDER BY path COLLATE BINARY"
                      : "SELECT path, mode, uid, gid, mtime_ns, NULL FROM"
                        " entries ORDER BY path COLLATE BINARY",
                  &st);
  while (rc == 0 && (rc = next_row(ld, st)) == 1) {
    if (r.n == m->n_entries) {
      rc = row_fail(ld, &r, "more rows than counted");
      break;
    }
    ckpt_entry_attr_t *e = &m->entries[r.n++];
    int64_t mode, uid, gid, mtime;
    if ((rc = col_strdup(ld, st, 0, &r, &e->path)) < 0 ||
        (rc = col_int(ld, st, 1, &r, 0, 0177777, &mode)) < 0 ||
        (rc = col_int(ld, st, 2, &r, 0, UINT32_MAX, &uid)) < 0 ||
        (rc = col_int(ld, st, 3, &r, 0, UINT32_MAX, &gid)) < 0 ||
        (rc = col_int(ld, st, 4, &r, INT64_MIN, INT64_MAX, &mtime)) < 0)
      break;
    e->mode = (uint32_t)mode, e->uid = (uint32_t)uid, e->gid = (uint32_t)gid;
    e->mtime_ns = mtime;
    if (sqlite3_column_type(st, 5) != SQLITE_NULL &&
        (rc = col_strdup(ld, st, 5, &r, &e->target)) < 0)
      break;
    uint32_t type = e->mode & 0170000;
    if (!entry_path_ok(e->path))
      rc = row_fail(ld, &r, "path '%.64s' is not a checkpoint path", e->path);
    else if (ckpt_entry_attr_check(e) < 0)
      rc = row_fail(ld, &r, "mode %o%s is not a file, a directory or a "
                    "link with its target", e->mode,
                    e->target ? " with a target" : "");
    else if (type == 0100000 && e->target && !entry_path_ok(e->target))
      rc = row_fail(ld, &r, "hard link to '%.64s', not a checkpoint path",
                    e->target);
    else if (r.n > 1 && strcmp(e[-1].path, e->path) == 0)
      rc = row_fail(ld, &r, "path appears twice");
  }
  sqlite3_finalize(st);
  if (rc == 0)
    m->n_entries = (uint32_t)r.n;
  if (rc == 0)
    rc = load_xattrs(ld);
  return rc;
}

typedef struct {
  const char *path, *fqn;
} item_path_t;

static int cmp_item_path(const void *a, const void *b) {
  return strcmp(((const item_path_t *)a)->path,
                ((const item_path_t *)b)->path);
}

/* By path, then FQN (messages name the two items in one order). */
static int cmp_item_path_fqn(const void *a, const void *b) {
  int c = cmp_item_path(a, b);
  return c ? c
           : strcmp(((const item_path_t *)a)->fqn,
                    ((const item_path_t *)b)->fqn);
}

/* The committed tree is built from the items' paths: no path twice, and
 * none that another one needs as a directory (the FQNs are unique, but an
 * item with user.ckpt.fqn may sit at any path). */
static int check_paths(loader_t *ld) {
  const ckpt_metadata_t *m = ld->m;
  size_t n = (size_t)m->n_tensors + m->n_blobs;
  if (n < 2)
    return 0;
  item_path_t *v = malloc(n * sizeof(*v));
  if (!v)
    return nomem(ld);
  for (uint32_t i = 0; i < m->n_tensors; i++)
    v[i] = (item_path_t){m->tensors[i].path, m->tensors[i].fqn};
  for (uint32_t i = 0; i < m->n_blobs; i++)
    v[m->n_tensors + i] = (item_path_t){m->blobs[i].path, m->blobs[i].fqn};
  qsort(v, n, sizeof(*v), cmp_item_path_fqn);
  int rc = 0;
  for (size_t i = 1; rc == 0 && i < n; i++)
    if (strcmp(v[i - 1].path, v[i].path) == 0)
      rc = set_err(ld->err, -EINVAL,
                   "%s: path '%.64s' is the path of two items (%.64s and "
                   "%.64s)",
                   ld->path, v[i].path, v[i - 1].fqn, v[i].fqn);
  char buf[4096];
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const char *path = v[i].path;
    for (const char *sl = strchr(path, '/'); rc == 0 && sl;
         sl = strchr(sl + 1, '/')) {
      size_t len = (size_t)(sl - path);
      if (len >= sizeof(buf))
        break;
      memcpy(buf, path, len);
      buf[len] = '\0';
      item_path_t key = {.path = buf};
      const item_path_t *f = bsearch(&key, v, n, sizeof(*v), cmp_item_path);
      if (f)
        rc = set_err(ld->err, -EINVAL,
                     "%s: path '%.64s' of %.64s is also a directory of "
                     "'%.64s' (%.64s)",
                     ld->path, f->path, f->fqn, path, v[i].fqn);
    }
  }
  free(v);
  return rc;
}

/* Row-major order of chunks: by tensor, then offsets, then sizes (which
 * only differ between empty chunks at the same place). */
static int cmp_chunks(const void *pa, const void *pb, void *arg) {
  const ckpt_tensor_meta_t *tensors = arg;
  const ckpt_chunk_meta_t *a = pa, *b = pb;
  if (a->tensor != b->tensor)
    return a->tensor < b->tensor ? -1 : 1;
  int n = 2 * tensors[a->tensor].ndim;
  for (int j = 0; j < n; j++) {
    if (a->dims[j] != b->dims[j])
      return a->dims[j] < b->dims[j] ? -1 : 1;
  }
  return 0;
}

/* Sort the chunks into tensor groups and point each tensor at its own. */
static void group_chunks(ckpt_metadata_t *m) {
  if (m->n_chunks > 1)
    qsort_r(m->chunks, m->n_chunks, sizeof(*m->chunks), cmp_chunks, m->tensors);
  uint32_t c = 0;
  for (uint32_t t = 0; t < m->n_tensors; t++) {
    m->tensors[t].first_chunk = c;
    while (c < m->n_chunks && m->chunks[c].tensor == t)
      c++;
    m->tensors[t].n_chunks = c - m->tensors[t].first_chunk;
  }
}

/* The "file:" URI of path opened read-only and immutable: no locks, no
 * journal lookups, so that it also works on a read-only location. */
static char *immutable_uri(const char *path) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  /* "file://" + an absolute path leaves the URI authority empty. */
  int rc = ckpt_buf_printf(&b, "file:%s", path[0] == '/' ? "//" : "");
  for (const char *p = path; rc == 0 && *p != '\0'; p++) {
    if (*p == '%' || *p == '?' || *p == '#')
      rc = ckpt_buf_printf(&b, "%%%02X", (unsigned)(unsigned char)*p);
    else
      rc = ckpt_buf_append(&b, p, 1);
  }
  if (rc == 0)
    rc = ckpt_buf_printf(&b, "?mode=ro&immutable=1");
  char *uri = rc == 0 ? ckpt_buf_steal(&b) : NULL;
  ckpt_buf_free(&b);
  return uri;
}

/* Interrupt a statement of the loader past its deadline (a .metadata is
 * untrusted: however it was made, loading it ends). */
static int past_deadline(void *arg) {
  loader_t *ld = arg;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (now.tv_sec > ld->deadline.tv_sec ||
      (now.tv_sec == ld->deadline.tv_sec &&
       now.tv_nsec >= ld->deadline.tv_nsec)) {
    ld->timed_out = true;
    return 1;
  }
  return 0;
}

/* Does sql hold word (ASCII, any case) as a token of its own? */
static bool has_word(const char *sql, const char *word) {
  size_t n = strlen(word);
  for (const char *p = sql; *p; p++) {
    if (strncasecmp(p, word, n) != 0)
      continue;
    bool before = p > sql && (isalnum((unsigned char)p[-1]) || p[-1] == '_');
    bool after = isalnum((unsigned char)p[n]) || p[n] == '_';
    if (!before && !after)
      return true;
  }
  return false;
}

/* The schema objects a .metadata may hold: our four tables (plain ones:
 * no generated column, whose "AS (expr)" would be evaluated at every
 * read; the writer's tables have no AS anywhere) and indexes on them. A view, a trigger, a
 * virtual table or another table would run someone else's SQL inside our
 * queries (a recursive view never ends). full: tensors, chunks and blobs
 * must be there too, else only checkpoint. */
static int check_schema(loader_t *ld, bool full) {
  static const char *const tables[] = {"checkpoint", "tensors", "chunks",
                                       "blobs", "entries", "xattrs"};
  enum { NT = 6 };
  bool seen[NT] = {false};
  sqlite3_stmt *st = NULL;
  int rc = 0, src = sqlite3_prepare_v2(
      ld->db, "SELECT type, name, tbl_name, sql FROM sqlite_master", -1, &st,
      NULL);
  if (src != SQLITE_OK)
    return lfail(ld, src);
  while (rc == 0 && (src = sqlite3_step(st)) == SQLITE_ROW) {
    const char *type = (const char *)sqlite3_column_text(st, 0);
    const char *name = (const char *)sqlite3_column_text(st, 1);
    const char *tbl = (const char *)sqlite3_column_text(st, 2);
    const char *sql = (const char *)sqlite3_column_text(st, 3);
    if (!type || !name || !tbl) {
      rc = set_err(ld->err, -EINVAL, "%s: a schema entry without a name",
                   ld->path);
      break;
    }
    int t = 0;
    while (t < NT && strcmp(tbl, tables[t]) != 0)
      t++;
    if (!strcmp(type, "table") && t < NT && !strcmp(name, tbl) && sql &&
        !strncmp(sql, "CREATE TABLE", 12) && !has_word(sql, "AS")) {
      seen[t] = true;
      if (t == 4)
        ld->has_target = has_word(sql, "target");
    } else if (!strcmp(type, "table") && t < NT && sql &&
               has_word(sql, "AS")) {
      rc = set_err(ld->err, -EINVAL,
                   "%s: table %.64s has a generated column (AS): refused",
                   ld->path, name);
    } else if (!strcmp(type, "index") && t < NT) {
      /* an index of one of our tables: never evaluated by our reads */
    } else {
      rc = set_err(ld->err, -EINVAL,
                   "%s: unexpected schema object: %.16s %.64s (only the "
                   "tables checkpoint, tensors, chunks, blobs, entries, "
                   "xattrs and their indexes are allowed)",
                   ld->path, type, name);
    }
  }
  if (rc == 0 && src != SQLITE_DONE)
    rc = lfail(ld, src);
  sqlite3_finalize(st);
  for (int t = 0; rc == 0 && t < (full ? 4 : 1); t++) {
    if (!seen[t])
      rc = set_err(ld->err, -EINVAL, "%s: table %s is missing", ld->path,
                   tables[t]);
  }
  ld->has_entries = seen[4]; /* optional: older checkpoints lack them */
  ld->has_xattrs = seen[4] && seen[5];
  return rc;
}

/* Open the .metadata read-only and immutable into ld->db, through a
 * descriptor of our own that refused a symlink (SQLite reopens it as
 * /proc/self/fd/N, the same file), with views and triggers off, and a
 * deadline for every query. Then check its schema. 0 or -errno. */
static int open_readonly(loader_t *ld, bool full) {
  ld->fd = -1;
  int fd = ld->dirfd >= 0
               ? ckpt_store_open_file(ld->dirfd, CKPT_METADATA_FILE)
               : ckpt_store_open_file(AT_FDCWD, ld->path);
  if (fd < 0) {
    if (fd == -ELOOP)
      return set_err(ld->err, -ELOOP, "%s is a symbolic link: refused",
                     ld->path);
    if (fd == -EINVAL)
      return set_err(ld->err, -EINVAL, "%s is not a regular file: refused",
                     ld->path);
    return set_err(ld->err, fd, "opening %s: %s", ld->path, strerror(-fd));
  }
  ld->fd = fd;
  char proc[64];
  snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
  /* Without /proc only a path without a symlink at its end will do. */
  int nofollow = 0;
  const char *path = proc;
  if (access(proc, F_OK) != 0) {
    if (ld->dirfd >= 0)
      return set_err(ld->err, -ENOENT,
                     "%s: cannot be opened safely without /proc", ld->path);
    path = ld->path;
    nofollow = SQLITE_OPEN_NOFOLLOW;
  }
  char *uri = immutable_uri(path);
  if (uri == NULL)
    return nomem(ld);
  int src = sqlite3_open_v2(uri, &ld->db,
                            SQLITE_OPEN_READONLY | SQLITE_OPEN_URI |
                                SQLITE_OPEN_NOMUTEX | nofollow,
                            NULL);
  free(uri);
  if (src != SQLITE_OK)
    return lfail(ld, src);
  sqlite3_db_config(ld->db, SQLITE_DBCONFIG_DEFENSIVE, 1, NULL);
  sqlite3_db_config(ld->db, SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0, NULL);
  sqlite3_db_config(ld->db, SQLITE_DBCONFIG_ENABLE_TRIGGER, 0, NULL);
  sqlite3_db_config(ld->db, SQLITE_DBCONFIG_ENABLE_VIEW, 0, NULL);
  sqlite3_db_config(ld->db, SQLITE_DBCONFIG_ENABLE_LOAD_EXTENSION, 0, NULL);
  clock_gettime(CLOCK_MONOTONIC, &ld->deadline);
  ld->deadline.tv_sec += CKPT_METADB_TIME_LIMIT;
  sqlite3_progress_handler(ld->db, 1000, past_deadline, ld);
  return check_schema(ld, full);
}

static void close_loader(loader_t *ld) {
  sqlite3_close(ld->db);
  ld->db = NULL;
  if (ld->fd >= 0)
    close(ld->fd);
  ld->fd = -1;
}

/* A query interrupted past the deadline says so. */
static int timed(loader_t *ld, int rc) {
  if (rc < 0 && ld->timed_out) {
    free(*ld->err);
    *ld->err = NULL;
    return set_err(ld->err, -ETIMEDOUT,
                   "%s: reading it took more than %d s: refused", ld->path,
                   CKPT_METADB_TIME_LIMIT);
  }
  return rc;
}

/* Every tensor is covered exactly by its chunks: no byte of a tensor is
 * read from nowhere (a gap) or from two places (an overlap). */
static int check_cover(loader_t *ld) {
  const ckpt_metadata_t *m = ld->m;
  const int64_t **box = NULL;
  size_t cap = 0;
  int rc = 0;
  for (uint32_t ti = 0; rc == 0 && ti < m->n_tensors; ti++) {
    const ckpt_tensor_meta_t *t = &m->tensors[ti];
    if (t->n_chunks > cap) {
      const int64_t **grown = realloc(box, t->n_chunks * sizeof(*box));
      if (!grown) {
        rc = nomem(ld);
        break;
      }
      box = grown, cap = t->n_chunks;
    }
    for (uint32_t i = 0; i < t->n_chunks; i++)
      box[i] = m->chunks[t->first_chunk + i].dims;
    ckpt_cover_t res;
    int r = ckpt_cover_check(t->ndim, t->shape, t->n_chunks, box, &res);
    char a[DIMS_TEXT_MAX], b[DIMS_TEXT_MAX];
    if (r == -ENOMEM) {
      rc = nomem(ld);
    } else if (r < 0) {
      rc = set_err(ld->err, -EINVAL,
                   "%s: tensor %s: its %" PRIu32 " chunks are laid out too "
                   "irregularly to be checked: refused",
                   ld->path, t->fqn, t->n_chunks);
    } else if (res.kind == CKPT_COVER_OVERLAP) {
      const ckpt_chunk_meta_t *x = &m->chunks[t->first_chunk + res.a];
      const ckpt_chunk_meta_t *y = &m->chunks[t->first_chunk + res.b];
      char c[DIMS_TEXT_MAX], d[DIMS_TEXT_MAX];
      rc = set_err(ld->err, -EINVAL,
                   "%s: tensor %s: chunks overlap: offsets %s sizes %s "
                   "(rank %" PRId32 ") and offsets %s sizes %s (rank %" PRId32
                   ")",
                   ld->path, t->fqn, format_dims(a, x->dims, t->ndim),
                   format_dims(b, x->dims + t->ndim, t->ndim), x->rank,
                   format_dims(c, y->dims, t->ndim),
                   format_dims(d, y->dims + t->ndim, t->ndim), y->rank);
    } else if (res.kind == CKPT_COVER_GAP) {
      uint64_t numel = 0;
      ckpt_dims_numel(t->shape, t->ndim, &numel);
      if (res.gap_known)
        rc = set_err(ld->err, -EINVAL,
                     "%s: tensor %s: its chunks cover %" PRIu64 " of %" PRIu64
                     " elements (gap at offsets %s sizes %s)",
                     ld->path, t->fqn, res.covered, numel,
                     format_dims(a, res.gap_off, t->ndim),
                     format_dims(b, res.gap_size, t->ndim));
      else
        rc = set_err(ld->err, -EINVAL,
                     "%s: tensor %s: its chunks cover %" PRIu64 " of %" PRIu64
                     " elements (a gap)",
                     ld->path, t->fqn, res.covered, numel);
    }
  }
  free(box);
  return rc;
}

static int load(loader_t *ld, ckpt_metadata_t *out) {
  memset(out, 0, sizeof(*out));
  int rc = open_readonly(ld, true);
  if (rc < 0 || (rc = load_checkpoint(ld)) < 0 ||
      (rc = load_tensors(ld)) < 0 || (rc = load_chunks(ld)) < 0 ||
      (rc = load_blobs(ld)) < 0 || (rc = load_entries(ld)) < 0)
    goto cleanup;
  group_chunks(out);
  if ((rc = check_paths(ld)) == 0)
    rc = check_cover(ld);

cleanup:
  rc = timed(ld, rc);
  close_loader(ld);
  if (rc < 0)
    ckpt_metadata_free(out);
  return rc;
}

static int load_header(loader_t *ld, ckpt_metadata_t *out) {
  memset(out, 0, sizeof(*out));
  int rc = open_readonly(ld, false);
  if (rc == 0)
    rc = load_checkpoint(ld);
  rc = timed(ld, rc);
  close_loader(ld);
  if (rc < 0)
    ckpt_metadata_free(out);
  return rc;
}

int ckpt_metadb_load(const char *metadata_path, ckpt_metadata_t *out,
                     char **err) {
  assert(metadata_path != NULL && out != NULL && err != NULL);
  *err = NULL;
  loader_t ld = {.path = metadata_path, .err = err, .m = out, .dirfd = -1};
  return load(&ld, out);
}

int ckpt_metadb_load_at(int dirfd, const char *display, ckpt_metadata_t *out,
                        char **err) {
  assert(dirfd >= 0 && display != NULL && out != NULL && err != NULL);
  *err = NULL;
  loader_t ld = {.path = display, .err = err, .m = out, .dirfd = dirfd};
  return load(&ld, out);
}

int ckpt_metadb_load_header(const char *metadata_path, ckpt_metadata_t *out,
                            char **err) {
  assert(metadata_path != NULL && out != NULL && err != NULL);
  *err = NULL;
  loader_t ld = {.path = metadata_path, .err = err, .m = out, .dirfd = -1};
  return load_header(&ld, out);
}

int ckpt_metadb_load_header_at(int dirfd, const char *display,
                               ckpt_metadata_t *out, char **err) {
  assert(dirfd >= 0 && display != NULL && out != NULL && err != NULL);
  *err = NULL;
  loader_t ld = {.path = display, .err = err, .m = out, .dirfd = dirfd};
  return load_header(&ld, out);
}

static int check(loader_t *ld) {
  sqlite3_stmt *st = NULL;
  int rc = open_readonly(ld, false), src;
  if (rc < 0)
    goto cleanup;
  src = sqlite3_prepare_v2(ld->db, "PRAGMA integrity_check(8)", -1, &st, NULL);
  if (src != SQLITE_OK) {
    rc = lfail(ld, src);
    goto cleanup;
  }
  /* One row "ok", or up to 8 rows naming what is wrong. */
  ckpt_buf_t msg;
  ckpt_buf_init(&msg);
  while ((src = sqlite3_step(st)) == SQLITE_ROW) {
    const char *line = (const char *)sqlite3_column_text(st, 0);
    if (line && strcmp(line, "ok"))
      ckpt_buf_printf(&msg, "%s%s", msg.len ? "; " : "", line);
  }
  if (src != SQLITE_DONE) {
    ckpt_buf_free(&msg);
    rc = lfail(ld, src);
  } else if (msg.len) {
    rc = set_err(ld->err, -EINVAL, "%s: integrity check: %s", ld->path,
                 (const char *)msg.data);
    ckpt_buf_free(&msg);
  } else {
    ckpt_buf_free(&msg);
  }

cleanup:
  sqlite3_finalize(st);
  rc = timed(ld, rc);
  close_loader(ld);
  return rc;
}

int ckpt_metadb_check(const char *metadata_path, char **err) {
  assert(metadata_path != NULL && err != NULL);
  *err = NULL;
  loader_t ld = {.path = metadata_path, .err = err, .dirfd = -1};
  return check(&ld);
}

int ckpt_metadb_check_at(int dirfd, const char *display, char **err) {
  assert(dirfd >= 0 && display != NULL && err != NULL);
  *err = NULL;
  loader_t ld = {.path = display, .err = err, .dirfd = dirfd};
  return check(&ld);
}

/* ------------------------------------------------------------------------
 * A new version without one entry (removal inside a committed checkpoint).
 * ---------------------------------------------------------------------- */

/* Copy the whole of open file src into open file dst. */
static int copy_file(int src, int dst) {
  char buf[65536];
  off_t off = 0;
  for (;;) {
    ssize_t n = pread(src, buf, sizeof(buf), off);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return -errno;
    if (n == 0)
      return 0;
    for (ssize_t done = 0; done < n;) {
      ssize_t w = write(dst, buf + done, (size_t)(n - done));
      if (w < 0 && errno == EINTR)
        continue;
      if (w < 0)
        return -errno;
      done += w;
    }
    off += n;
  }
}

static int run_drop(writer_t *w, const char *sql, const char *a,
                    const char *b) {
  sqlite3_stmt *st = NULL;
  int rc = prepare(w, sql, &st);
  if (rc == 0)
    rc = insert_row(w, st,
                    bind_text(st, 1, a) | (b ? bind_text(st, 2, b) : 0));
  sqlite3_finalize(st);
  return rc;
}

/* Does the database hold the xattrs table (checkpoints saved before it
 * was kept do not)? */
static bool has_xattrs_table(writer_t *w) {
  sqlite3_stmt *st = NULL;
  bool yes = prepare(w,
                     "SELECT 1 FROM sqlite_master WHERE type = 'table' AND"
                     " name = 'xattrs'",
                     &st) == 0 &&
             sqlite3_step(st) == SQLITE_ROW;
  sqlite3_finalize(st);
  return yes;
}

/* The edits of a rewrite, in one transaction: the entry's rows go, the
 * checkpoint table gets the new save ID, the one it replaces and the
 * version number; nothing else changes. */
static int drop_rows(writer_t *w, const ckpt_metadb_drop_t *d,
                     const char *save_id) {
  int rc = exec(w, "PRAGMA journal_mode=DELETE; PRAGMA synchronous=OFF;"
                   " BEGIN;");
  if (rc == 0 && d->tensor_fqn)
    rc = run_drop(w, "DELETE FROM tensors WHERE fqn = ?1", d->tensor_fqn,
                  NULL);
  if (rc == 0 && d->tensor_fqn)
    rc = run_drop(w, "DELETE FROM chunks WHERE fqn = ?1", d->tensor_fqn,
                  NULL);
  if (rc == 0 && d->blob_fqn)
    rc = run_drop(w, "DELETE FROM blobs WHERE fqn = ?1", d->blob_fqn, NULL);
  if (rc == 0 && d->entry_path && d->has_entries)
    rc = run_drop(w, "DELETE FROM entries WHERE path = ?1", d->entry_path,
                  NULL);
  if (rc == 0 && d->entry_path && d->has_entries && has_xattrs_table(w))
    rc = run_drop(w, "DELETE FROM xattrs WHERE path = ?1", d->entry_path,
                  NULL);
  if (rc == 0)
    rc = run_drop(w,
                  "INSERT OR REPLACE INTO checkpoint(key, value) VALUES"
                  " ('previous_save_id', (SELECT value FROM checkpoint WHERE"
                  " key = 'save_id')), ('save_id', ?1), ('version',"
                  " (SELECT coalesce((SELECT value FROM checkpoint WHERE"
                  " key = 'version'), 1) + 1))",
                  save_id, NULL);
  if (rc == 0)
    rc = exec(w, "COMMIT;");
  return rc;
}

int ckpt_metadb_rewrite(int src_dirfd, int dst_dirfd, const char *dst_display,
                        const char *save_id, const ckpt_metadb_drop_t *drop,
                        bool sync, char **err) {
  assert(err != NULL && save_id != NULL && drop != NULL);
  *err = NULL;
  writer_t w = {.err = err};
  char tmp[64];
  int rc = 0, src_fd = -1, fd = -1;
  bool renamed = false;
  snprintf(tmp, sizeof(tmp), "/proc/self/fd/%d/%s", dst_dirfd,
           CKPT_METADATA_TMP);
  w.path = dst_display;
  src_fd = ckpt_store_open_file(src_dirfd, CKPT_METADATA_FILE);
  if (src_fd < 0) {
    rc = set_err(err, src_fd, "opening %s of the current version: %s",
                 CKPT_METADATA_FILE, strerror(-src_fd));
    goto cleanup;
  }
  fd = openat(dst_dirfd, CKPT_METADATA_TMP,
              O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    rc = set_err(err, -errno, "creating %s: %s", dst_display,
                 strerror(errno));
    goto cleanup;
  }
  if ((rc = copy_file(src_fd, fd)) < 0) {
    rc = set_err(err, rc, "copying %s into %s: %s", CKPT_METADATA_FILE,
                 dst_display, strerror(-rc));
    goto cleanup;
  }
  errno = 0;
  int src = sqlite3_open_v2(tmp, &w.db,
                            SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL);
  if (src != SQLITE_OK) {
    rc = wfail(&w, src, errno);
    goto cleanup;
  }
  if ((rc = drop_rows(&w, drop, save_id)) < 0)
    goto cleanup;
  src = sqlite3_close(w.db);
  w.db = NULL;
  if (src != SQLITE_OK) {
    rc = set_err(err, -EIO, "closing %s: %s", dst_display,
                 sqlite3_errstr(src));
    goto cleanup;
  }
  rc = finish_fd(fd, sync, dst_display, err);
  fd = -1;
  if (rc < 0)
    goto cleanup;
  if (renameat(dst_dirfd, CKPT_METADATA_TMP, dst_dirfd, CKPT_METADATA_FILE)) {
    rc = set_err(err, -errno, "renaming %s: %s", dst_display,
                 strerror(errno));
    goto cleanup;
  }
  renamed = true;
  if (sync && fsync(dst_dirfd))
    rc = set_err(err, -errno, "fsync of the new version's directory: %s",
                 strerror(errno));

cleanup:
  sqlite3_close(w.db);
  if (fd >= 0)
    close(fd);
  if (src_fd >= 0)
    close(src_fd);
  if (rc < 0) {
    unlinkat(dst_dirfd, renamed ? CKPT_METADATA_FILE : CKPT_METADATA_TMP, 0);
    unlinkat(dst_dirfd, CKPT_METADATA_TMP "-journal", 0);
  }
  return rc;
}
