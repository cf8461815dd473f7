/*
 * test_metadb.c - unit tests of store/metadb.c (the SQLite .metadata).
 *
 * Round trips (publish, load, compare every field), the durable publish
 * (no temporary file left, stale ones replaced, nothing published on
 * failure), the stored text (compact JSON, hex checksums, ISO time,
 * rollback journal) and loads of damaged files, each of which must fail
 * with a message naming the problem. The tests edit databases with SQLite
 * directly. A group fixture owns a temporary directory; each test works in
 * its own subdirectory of it. Two tests fork a child: one to limit the
 * file size (a write error), one that, run as root, drops to the nobody
 * user (65534) to meet a read-only directory.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "metadb.h"

#define CREATED_AT INT64_C(1796205780) /* 2026-12-02T10:03:00Z */

/* ----- Fixture: a temporary directory ----- */

static int group_setup(void **state) {
  char *dir = strdup("/tmp/test_metadb.XXXXXX");
  if (dir == NULL || mkdtemp(dir) == NULL)
    return -1;
  *state = dir;
  return 0;
}

static int remove_entry(const char *path, const struct stat *sb, int flag,
                        struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int group_teardown(void **state) {
  char *dir = *state;
  int rc = nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  free(dir);
  return rc;
}

/* path = <fixture dir>/<name>[/<file>]; the directory is created. */
static void test_path(void **state, const char *name, const char *file,
                      char *path) {
  assert_true(snprintf(path, PATH_MAX, "%s/%s", (const char *)*state, name) <
              PATH_MAX);
  assert_true(mkdir(path, 0755) == 0 || errno == EEXIST);
  if (file != NULL) {
    size_t n = strlen(path);
    assert_true(snprintf(path + n, PATH_MAX - n, "/%s", file) <
                (int)(PATH_MAX - n));
  }
}

static bool exists(const char *dir, const char *file) {
  char path[PATH_MAX];
  struct stat sb;
  assert_true(snprintf(path, sizeof(path), "%s/%s", dir, file) < PATH_MAX);
  return stat(path, &sb) == 0;
}

static void write_file(const char *path, const void *data, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, data, n), (ssize_t)n);
  assert_int_equal(close(fd), 0);
}

static void db_exec(const char *path, const char *sql) {
  sqlite3 *db = NULL;
  assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
  char *msg = NULL;
  if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
    fail_msg("%s: %s", sql, msg);
  assert_int_equal(sqlite3_close(db), SQLITE_OK);
}

/* The first column of the first row of sql, as text (static buffer). */
static const char *db_query(const char *path, const char *sql) {
  static char out[256];
  sqlite3 *db = NULL;
  sqlite3_stmt *st = NULL;
  assert_int_equal(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL),
                   SQLITE_OK);
  assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK);
  assert_int_equal(sqlite3_step(st), SQLITE_ROW);
  snprintf(out, sizeof(out), "%s", (const char *)sqlite3_column_text(st, 0));
  sqlite3_finalize(st);
  sqlite3_close(db);
  return out;
}

/* ----- Building metadata by hand (in the order the planner produces) ----- */

static void meta_init(ckpt_metadata_t *m, int32_t world_size) {
  memset(m, 0, sizeof(*m));
  m->name = strdup("step-100");
  m->save_id = strdup("5f1d3c2b9a8e7f60");
  m->world_size = world_size;
  m->created_at = CREATED_AT;
}

static int64_t *dup_dims(const int64_t *d, int n) {
  if (n == 0)
    return NULL;
  int64_t *p = malloc((size_t)n * sizeof(*p));
  assert_non_null(p);
  memcpy(p, d, (size_t)n * sizeof(*p));
  return p;
}

/* Tensors must come in fqn order, then their chunks in row-major order. */
static uint32_t add_tensor(ckpt_metadata_t *m, const char *fqn,
                           const char *path, ckpt_dtype_t dt, int ndim,
                           const int64_t *shape) {
  if (m->n_tensors > 0)
    assert_true(strcmp(m->tensors[m->n_tensors - 1].fqn, fqn) < 0);
  m->tensors = realloc(m->tensors, (m->n_tensors + 1) * sizeof(*m->tensors));
  assert_non_null(m->tensors);
  ckpt_tensor_meta_t *t = &m->tensors[m->n_tensors];
  *t = (ckpt_tensor_meta_t){.fqn = strdup(fqn),
                            .path = strdup(path),
                            .dtype = dt,
                            .ndim = ndim,
                            .shape = dup_dims(shape, ndim),
                            .first_chunk = m->n_chunks};
  return m->n_tensors++;
}

static void add_chunk(ckpt_metadata_t *m, uint32_t tensor,
                      const int64_t *offsets, const int64_t *sizes,
                      int32_t rank, uint32_t file, uint64_t file_offset,
                      uint64_t checksum) {
  ckpt_tensor_meta_t *t = &m->tensors[tensor];
  assert_int_equal(tensor, m->n_tensors - 1);
  if (m->n_chunks % 1024 == 0) {
    m->chunks = realloc(m->chunks, (m->n_chunks + 1024) * sizeof(*m->chunks));
    assert_non_null(m->chunks);
  }
  uint64_t numel;
  assert_int_equal(ckpt_dims_numel(sizes, t->ndim, &numel), 0);
  ckpt_chunk_meta_t *c = &m->chunks[m->n_chunks++];
  *c = (ckpt_chunk_meta_t){.tensor = tensor,
                           .rank = rank,
                           .file = file,
                           .file_offset = file_offset,
                           .length = numel * ckpt_dtype_size(t->dtype),
                           .checksum = checksum};
  if (t->ndim > 0) {
    c->dims = malloc(2 * (size_t)t->ndim * sizeof(int64_t));
    assert_non_null(c->dims);
    memcpy(c->dims, offsets, (size_t)t->ndim * sizeof(int64_t));
    memcpy(c->dims + t->ndim, sizes, (size_t)t->ndim * sizeof(int64_t));
  }
  t->n_chunks++;
}

static void add_blob(ckpt_metadata_t *m, const char *fqn, const char *path,
                     int32_t rank, uint64_t length, uint64_t checksum) {
  if (m->n_blobs > 0)
    assert_true(strcmp(m->blobs[m->n_blobs - 1].fqn, fqn) < 0);
  m->blobs = realloc(m->blobs, (m->n_blobs + 1) * sizeof(*m->blobs));
  assert_non_null(m->blobs);
  m->blobs[m->n_blobs++] = (ckpt_blob_meta_t){.fqn = strdup(fqn),
                                              .path = strdup(path),
                                              .rank = rank,
                                              .file = 1,
                                              .file_offset = 4096,
                                              .length = length,
                                              .checksum = checksum};
}

/* A small checkpoint with every kind of entry: shards, replicas' kept
 * copies on several ranks, a 0-d scalar, a tensor with a zero dimension,
 * more than ten row shards (numeric, not text, order) and blobs. */
static void meta_small(ckpt_metadata_t *m) {
  meta_init(m, 4);
  const int64_t s_w[] = {4, 3}, s_rows[] = {12, 2}, s_empty[] = {3, 0, 5};
  const int64_t s_cube[] = {2, 2, 2};
  uint32_t t;

  t = add_tensor(m, "empty", "empty", CKPT_DTYPE_INT64, 3, s_empty);
  add_chunk(m, t, (int64_t[]){0, 0, 0}, s_empty, 3, 0, 0, 0x2d06800538d394c2);
  t = add_tensor(m, "model.cube", "model/cube", CKPT_DTYPE_BFLOAT16, 3, s_cube);
  for (int64_t i = 0; i < 2; i++)
    for (int64_t j = 0; j < 2; j++)
      add_chunk(m, t, (int64_t[]){i, j, 0}, (int64_t[]){1, 1, 2},
                (int32_t)(i * 2 + j), 0, 64, 0xffffffffffffffffu);
  t = add_tensor(m, "model.layer0.weight", "model/layer0/weight",
                 CKPT_DTYPE_FLOAT32, 2, s_w);
  add_chunk(m, t, (int64_t[]){0, 0}, (int64_t[]){4, 1}, 1, 0, 0, 0x1);
  add_chunk(m, t, (int64_t[]){0, 1}, (int64_t[]){4, 2}, 2, 0, 16, 0xabcdef);
  t = add_tensor(m, "rows", "rows", CKPT_DTYPE_FLOAT8_E5M2, 2, s_rows);
  for (int64_t i = 0; i < 12; i++)
    add_chunk(m, t, (int64_t[]){i, 0}, (int64_t[]){1, 2}, (int32_t)(i % 4),
              (uint32_t)i, (uint64_t)i * 1000, (uint64_t)i << 60);
  t = add_tensor(m, "step", "step", CKPT_DTYPE_INT64, 0, NULL);
  add_chunk(m, t, NULL, NULL, 0, 3, 1u << 30, 0x0123456789abcdef);

  add_blob(m, "optim.config", "optim/config", 0, 123, 42);
  add_blob(m, "rng", "rng", 3, 0, 0);
}

static void assert_meta_equal(const ckpt_metadata_t *a,
                              const ckpt_metadata_t *b) {
  assert_string_equal(a->name, b->name);
  assert_string_equal(a->save_id, b->save_id);
  assert_int_equal(a->world_size, b->world_size);
  assert_int_equal(a->created_at, b->created_at);
  assert_int_equal(a->n_tensors, b->n_tensors);
  for (uint32_t i = 0; i < a->n_tensors; i++) {
    const ckpt_tensor_meta_t *x = &a->tensors[i], *y = &b->tensors[i];
    assert_string_equal(x->fqn, y->fqn);
    assert_string_equal(x->path, y->path);
    assert_int_equal(x->dtype, y->dtype);
    assert_int_equal(x->ndim, y->ndim);
    if (x->ndim > 0)
      assert_memory_equal(x->shape, y->shape, (size_t)x->ndim * 8);
    assert_int_equal(x->first_chunk, y->first_chunk);
    assert_int_equal(x->n_chunks, y->n_chunks);
  }
  assert_int_equal(a->n_chunks, b->n_chunks);
  for (uint32_t i = 0; i < a->n_chunks; i++) {
    const ckpt_chunk_meta_t *x = &a->chunks[i], *y = &b->chunks[i];
    int ndim = a->tensors[x->tensor].ndim;
    assert_int_equal(x->tensor, y->tensor);
    if (ndim > 0)
      assert_memory_equal(x->dims, y->dims, 2 * (size_t)ndim * 8);
    assert_int_equal(x->rank, y->rank);
    assert_int_equal(x->file, y->file);
    assert_int_equal(x->file_offset, y->file_offset);
    assert_int_equal(x->length, y->length);
    assert_int_equal(x->checksum, y->checksum);
  }
  assert_int_equal(a->n_blobs, b->n_blobs);
  for (uint32_t i = 0; i < a->n_blobs; i++) {
    const ckpt_blob_meta_t *x = &a->blobs[i], *y = &b->blobs[i];
    assert_string_equal(x->fqn, y->fqn);
    assert_string_equal(x->path, y->path);
    assert_int_equal(x->rank, y->rank);
    assert_int_equal(x->file, y->file);
    assert_int_equal(x->file_offset, y->file_offset);
    assert_int_equal(x->length, y->length);
    assert_int_equal(x->checksum, y->checksum);
  }
}

static void publish_ok(const char *dir, const ckpt_metadata_t *m, bool sync) {
  char *err = NULL;
  int rc = ckpt_metadb_publish(dir, m, sync, &err);
  if (rc != 0)
    fail_msg("publish: %d %s", rc, err);
  assert_null(err);
}

/* Load path, expecting failure with a message containing want. */
static void load_fails(const char *path, const char *want) {
  ckpt_metadata_t got;
  char *err = NULL;
  int rc = ckpt_metadb_load(path, &got, &err);
  if (rc == 0)
    fail_msg("loaded, expected failure with '%s'", want);
  assert_true(rc < 0);
  assert_non_null(err);
  if (strstr(err, want) == NULL)
    fail_msg("message '%s' lacks '%s'", err, want);
  assert_int_equal(got.n_tensors + got.n_chunks + got.n_blobs, 0);
  free(err);
}

static void load_equal(const char *path, const ckpt_metadata_t *want) {
  ckpt_metadata_t got;
  char *err = NULL;
  int rc = ckpt_metadb_load(path, &got, &err);
  if (rc != 0)
    fail_msg("load: %d %s", rc, err);
  assert_null(err);
  assert_meta_equal(want, &got);
  ckpt_metadata_free(&got);
}

/* ----- Round trips ----- */

static void test_round_trip(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "round_trip", NULL, dir);
  test_path(state, "round_trip", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_small(&m);
  publish_ok(dir, &m, true);
  load_equal(path, &m);

  /* Row order in the file does not matter: load sorts. */
  db_exec(path, "CREATE TABLE t AS SELECT * FROM chunks ORDER BY random();"
                "DELETE FROM chunks; INSERT INTO chunks SELECT * FROM t;"
                "DROP TABLE t;");
  load_equal(path, &m);
  ckpt_metadata_free(&m);
}

static void test_round_trip_empty(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "empty", NULL, dir);
  test_path(state, "empty", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_init(&m, 1);
  publish_ok(dir, &m, false);
  load_equal(path, &m);
  ckpt_metadata_free(&m);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A million chunks (1000 tensors of 1000 row shards) publish and load in
 * a few seconds. Under a sanitizer, a tenth of them: the million takes a
 * minute there (SQLite instrumented), and what the sanitizer checks is
 * the same code on fewer rows. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MILLION_TENSORS 100
#else
#define MILLION_TENSORS 1000
#endif
static void test_million_chunks(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "million", NULL, dir);
  test_path(state, "million", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_init(&m, 8);
  const int64_t shape[] = {1000, 16}, sizes[] = {1, 16};
  for (int i = 0; i < MILLION_TENSORS; i++) {
    char fqn[64];
    snprintf(fqn, sizeof(fqn), "model.layers.%03d.weight", i);
    uint32_t t = add_tensor(&m, fqn, fqn, CKPT_DTYPE_FLOAT32, 2, shape);
    for (int64_t r = 0; r < 1000; r++)
      add_chunk(&m, t, (int64_t[]){r, 0}, sizes, (int32_t)(r % 8),
                (uint32_t)(r % 4), (uint64_t)(i * 1000 + r) * 64,
                (uint64_t)(i * 1000 + r) * 0x9e3779b97f4a7c15u);
  }
  double t0 = now();
  publish_ok(dir, &m, true);
  double t1 = now();
  load_equal(path, &m);
  double t2 = now();
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  printf("  %d,000 chunks: publish %.2f s, load+compare %.2f s, %.1f MB\n",
         MILLION_TENSORS, t1 - t0, t2 - t1, (double)sb.st_size / 1e6);
  ckpt_metadata_free(&m);
}

/* ----- The stored text ----- */

static void test_stored_text(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "text", NULL, dir);
  test_path(state, "text", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_small(&m);
  publish_ok(dir, &m, true);

  static const char *const cases[][2] = {
      {"SELECT value FROM checkpoint WHERE key='format_version'", "1"},
      {"SELECT value FROM checkpoint WHERE key='name'", "step-100"},
      {"SELECT value FROM checkpoint WHERE key='save_id'", "5f1d3c2b9a8e7f60"},
      {"SELECT value FROM checkpoint WHERE key='world_size'", "4"},
      {"SELECT value FROM checkpoint WHERE key='created_at'",
       "2026-12-02T10:03:00Z"},
      {"SELECT value FROM checkpoint WHERE key='writer'", "ckptfs"},
      {"SELECT dtype||' '||shape FROM tensors WHERE fqn='model.layer0.weight'",
       "float32 [4,3]"},
      {"SELECT path FROM tensors WHERE fqn='model.layer0.weight'",
       "model/layer0/weight"},
      {"SELECT dtype||' '||shape FROM tensors WHERE fqn='step'", "int64 []"},
      {"SELECT offsets||sizes||file||checksum FROM chunks"
       " WHERE fqn='model.layer0.weight' AND rank=2",
       "[0,1][4,2]__2_0.distcp0000000000abcdef"},
      {"SELECT file_offset||' '||length FROM chunks WHERE fqn='rows'"
       " AND offsets='[11,0]'",
       "11000 2"},
      {"SELECT checksum FROM chunks WHERE fqn='model.cube' LIMIT 1",
       "ffffffffffffffff"},
      {"SELECT offsets||sizes FROM chunks WHERE fqn='step'", "[][]"},
      {"SELECT rank||file||file_offset||' '||length||checksum FROM blobs"
       " WHERE fqn='optim.config'",
       "0__0_1.distcp4096 123000000000000002a"},
      {"SELECT count(*) FROM chunks", "20"},
      {"SELECT count(*) FROM sqlite_master WHERE name='chunks_fqn'", "1"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    assert_string_equal(db_query(path, cases[i][0]), cases[i][1]);
  ckpt_metadata_free(&m);
}

/* Rollback journal, never WAL: `sqlite3 -readonly` must read it through a
 * read-only mount. */
static void test_journal_mode(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "journal", NULL, dir);
  test_path(state, "journal", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_small(&m);
  publish_ok(dir, &m, true);
  assert_string_equal(db_query(path, "PRAGMA journal_mode"), "delete");
  /* File format read/write versions: 1 = legacy (rollback), 2 = WAL. */
  unsigned char hdr[20];
  int fd = open(path, O_RDONLY);
  assert_true(fd >= 0);
  assert_int_equal(read(fd, hdr, sizeof(hdr)), sizeof(hdr));
  close(fd);
  assert_int_equal(hdr[18], 1);
  assert_int_equal(hdr[19], 1);
  assert_false(exists(dir, CKPT_METADATA_FILE "-wal"));
  assert_false(exists(dir, CKPT_METADATA_FILE "-journal"));
  ckpt_metadata_free(&m);
}

/* ----- Atomic publish ----- */

static void test_publish_replaces_stale_tmp(void **state) {
  char dir[PATH_MAX], tmp[PATH_MAX], journal[PATH_MAX], path[PATH_MAX];
  test_path(state, "stale", NULL, dir);
  test_path(state, "stale", CKPT_METADATA_TMP, tmp);
  test_path(state, "stale", CKPT_METADATA_TMP "-journal", journal);
  test_path(state, "stale", CKPT_METADATA_FILE, path);
  write_file(tmp, "half a database from a crash", 28);
  write_file(journal, "and its journal", 15);
  ckpt_metadata_t m;
  meta_small(&m);
  publish_ok(dir, &m, true);
  assert_false(exists(dir, CKPT_METADATA_TMP));
  assert_false(exists(dir, CKPT_METADATA_TMP "-journal"));
  load_equal(path, &m);

  /* Publishing again replaces the file. */
  free(m.name);
  m.name = strdup("renamed");
  publish_ok(dir, &m, true);
  assert_false(exists(dir, CKPT_METADATA_TMP));
  load_equal(path, &m);
  ckpt_metadata_free(&m);
}

static void test_publish_missing_dir(void **state) {
  char dir[PATH_MAX];
  test_path(state, "missing", "no/such/dir", dir);
  ckpt_metadata_t m;
  meta_small(&m);
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(dir, &m, true, &err), -ENOENT);
  assert_non_null(err);
  assert_non_null(strstr(err, CKPT_METADATA_TMP));
  assert_non_null(strstr(err, strerror(ENOENT)));
  free(err);
  ckpt_metadata_free(&m);
}

static void test_publish_dir_is_file(void **state) {
  char file[PATH_MAX];
  test_path(state, "notdir", "file", file);
  write_file(file, "x", 1);
  ckpt_metadata_t m;
  meta_small(&m);
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(file, &m, true, &err), -ENOTDIR);
  assert_non_null(err);
  assert_non_null(strstr(err, strerror(ENOTDIR)));
  free(err);
  ckpt_metadata_free(&m);
}

/* A failure after .metadata.tmp exists removes it and publishes nothing. */
static void test_publish_failure_leaves_nothing(void **state) {
  char dir[PATH_MAX], tmp[PATH_MAX];
  test_path(state, "fails", NULL, dir);
  test_path(state, "fails", CKPT_METADATA_TMP, tmp);
  write_file(tmp, "stale", 5);
  ckpt_metadata_t m;
  meta_small(&m);
  m.blobs[1].length = UINT64_MAX; /* not storable as an SQLite integer */
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(dir, &m, true, &err), -EOVERFLOW);
  assert_non_null(err);
  assert_non_null(strstr(err, "rng"));
  assert_false(exists(dir, CKPT_METADATA_FILE));
  assert_false(exists(dir, CKPT_METADATA_TMP));
  assert_false(exists(dir, CKPT_METADATA_TMP "-journal"));
  free(err);
  ckpt_metadata_free(&m);
}

/* A write failing inside SQLite (here EFBIG under RLIMIT_FSIZE, as ENOSPC
 * would on a full disk) is reported with the system's text, and leaves
 * nothing. The limit is set in a child process. */
static void test_publish_write_error(void **state) {
  char dir[PATH_MAX];
  test_path(state, "efbig", NULL, dir);
  ckpt_metadata_t m;
  meta_init(&m, 1);
  for (int i = 0; i < 2000; i++) {
    char fqn[32];
    snprintf(fqn, sizeof(fqn), "blob%05d", i);
    add_blob(&m, fqn, fqn, 0, 1, 2);
  }
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) { /* no cmocka asserts in the child: exit codes */
    struct rlimit rl = {.rlim_cur = 32768, .rlim_max = 32768};
    if (signal(SIGXFSZ, SIG_IGN) == SIG_ERR || setrlimit(RLIMIT_FSIZE, &rl) < 0)
      _exit(10);
    char *err = NULL;
    int rc = ckpt_metadb_publish(dir, &m, true, &err);
    if (rc != -EFBIG || strstr(err, strerror(EFBIG)) == NULL ||
        strstr(err, CKPT_METADATA_TMP) == NULL)
      _exit(11);
    _exit(0);
  }
  int status;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  assert_false(exists(dir, CKPT_METADATA_FILE));
  assert_false(exists(dir, CKPT_METADATA_TMP));
  assert_false(exists(dir, CKPT_METADATA_TMP "-journal"));
  ckpt_metadata_free(&m);
}

/* A read-only location: load works (no journal or lock files needed),
 * publish fails with the system's reason and leaves nothing. As root,
 * permissions do not apply, so a child process drops to nobody. */
static void test_read_only_location(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "readonly", NULL, dir);
  test_path(state, "readonly", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_small(&m);
  publish_ok(dir, &m, true);
  assert_int_equal(chmod((const char *)*state, 0755), 0);
  assert_int_equal(chmod(path, 0444), 0);
  assert_int_equal(chmod(dir, 0555), 0);

  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) { /* no cmocka asserts in the child: exit codes */
    if (geteuid() == 0 && (setgid(65534) < 0 || setuid(65534) < 0))
      _exit(10);
    ckpt_metadata_t got;
    char *err = NULL;
    if (ckpt_metadb_load(path, &got, &err) != 0 || got.n_chunks != m.n_chunks)
      _exit(11);
    ckpt_metadata_free(&got);
    int rc = ckpt_metadb_publish(dir, &m, true, &err);
    if (rc != -EACCES || strstr(err, strerror(EACCES)) == NULL)
      _exit(12);
    _exit(exists(dir, CKPT_METADATA_TMP) ? 13 : 0);
  }
  int status;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  assert_int_equal(chmod(dir, 0755), 0);
  load_equal(path, &m);
  ckpt_metadata_free(&m);
}

/* ----- Loading damaged files ----- */

static void test_load_missing(void **state) {
  char path[PATH_MAX];
  test_path(state, "load_missing", CKPT_METADATA_FILE, path);
  ckpt_metadata_t got;
  char *err = NULL;
  assert_int_equal(ckpt_metadb_load(path, &got, &err), -ENOENT);
  assert_non_null(strstr(err, strerror(ENOENT)));
  free(err);
}

static void test_load_garbage(void **state) {
  char path[PATH_MAX];
  test_path(state, "garbage", CKPT_METADATA_FILE, path);
  unsigned char junk[8192];
  for (size_t i = 0; i < sizeof(junk); i++)
    junk[i] = (unsigned char)(i * 7919 + 13);
  write_file(path, junk, sizeof(junk));
  load_fails(path, "not a database");

  write_file(path, "", 0); /* an empty file is an empty database */
  load_fails(path, "table checkpoint is missing");
}

static void test_load_truncated(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "truncated", NULL, dir);
  test_path(state, "truncated", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_init(&m, 2);
  const int64_t shape[] = {5000, 4}, sizes[] = {1, 4};
  uint32_t t = add_tensor(&m, "big", "big", CKPT_DTYPE_FLOAT64, 2, shape);
  for (int64_t r = 0; r < 5000; r++)
    add_chunk(&m, t, (int64_t[]){r, 0}, sizes, (int32_t)(r % 2), 0,
              (uint64_t)r * 32, (uint64_t)r);
  publish_ok(dir, &m, false);
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  /* Cuts in the tables, and of the last page only (the index). */
  const off_t cuts[] = {sb.st_size / 3, sb.st_size / 2, sb.st_size - 4096, 4096,
                        100};
  for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
    publish_ok(dir, &m, false);
    assert_int_equal(truncate(path, cuts[i]), 0);
    ckpt_metadata_t got;
    char *err = NULL;
    assert_true(ckpt_metadb_load(path, &got, &err) < 0);
    assert_non_null(err);
    assert_non_null(strstr(err, path));
    free(err);
  }
  ckpt_metadata_free(&m);
}

/* Each edit damages a valid database in one way; load must refuse it and
 * say why. */
static void test_load_inconsistent(void **state) {
  static const char *const cases[][2] = {
      {"UPDATE tensors SET dtype='float33' WHERE fqn='rows'",
       "tensors row 4 (rows): dtype 'float33' is unknown"},
      {"UPDATE tensors SET shape='[4,' WHERE fqn='model.layer0.weight'",
       "shape '[4,' is not a list of dimensions"},
      {"UPDATE tensors SET shape='[4,-3]' WHERE fqn='model.layer0.weight'",
       "is not a list of dimensions"},
      {"UPDATE tensors SET shape='[4611686018427387904,4]' WHERE fqn='rows'",
       "shape is too large"},
      {"UPDATE tensors SET path=NULL WHERE fqn='rows'", "path is NULL"},
      {"UPDATE tensors SET path='optim/config' WHERE fqn='rows'",
       "path 'optim/config' is the path of two items (optim.config and "
       "rows)"},
      {"UPDATE tensors SET path='rng/x' WHERE fqn='rows'",
       "path 'rng' of rng is also a directory of 'rng/x' (rows)"},
      {"UPDATE tensors SET path='rows', fqn='' WHERE fqn='rows'",
       "fqn is empty"},
      {"UPDATE tensors SET path='model//cube', fqn='model..cube'"
       " WHERE fqn='model.cube'",
       "path 'model//cube' is not a checkpoint path"},
      {"UPDATE tensors SET path='model/../cube', fqn='model...cube'"
       " WHERE fqn='model.cube'",
       "path 'model/../cube' is not a checkpoint path"},
      {"UPDATE tensors SET path='.metadata/cube', fqn='.metadata.cube'"
       " WHERE fqn='model.cube'",
       "path '.metadata/cube' is not a checkpoint path"},
      {"UPDATE tensors SET path='/step', fqn='.step' WHERE fqn='step'",
       "path '/step' is not a checkpoint path"},
      {"UPDATE blobs SET path=CAST(X'726E670078' AS TEXT) WHERE fqn='rng'",
       "path holds a NUL byte"},
      {"UPDATE blobs SET fqn='rng' || printf('%.4100c', 'x') WHERE fqn='rng'",
       "fqn is longer than 4096 bytes"},
      {"UPDATE blobs SET path='rng/' WHERE fqn='rng'",
       "blobs row 2 (rng): path 'rng/' is not a checkpoint path"},
      {"UPDATE chunks SET offsets='[0]' WHERE fqn='model.layer0.weight'",
       "offsets and sizes of 1 and 2 dimensions, the shape has 2"},
      {"UPDATE chunks SET sizes='[1,2,3]' WHERE fqn='step'",
       "offsets and sizes of 0 and 3 dimensions, the shape has 0"},
      {"UPDATE chunks SET offsets='[3,0]' WHERE fqn='model.layer0.weight'",
       "dimension 0: [3, +4) is outside the shape (4)"},
      {"UPDATE chunks SET length=length+1 WHERE fqn='step'",
       "(step): length 9, 8 expected"},
      {"UPDATE chunks SET length=-1 WHERE fqn='step'", "length -1 is not in"},
      {"UPDATE chunks SET file_offset='abc' WHERE fqn='step'",
       "file_offset is not an integer"},
      {"UPDATE chunks SET file='data.bin' WHERE fqn='step'",
       "file 'data.bin' is not of the form __R_K.distcp"},
      {"UPDATE chunks SET file='__01_0.distcp' WHERE fqn='step'",
       "is not of the form"},
      {"UPDATE chunks SET file='__2_3.distcp' WHERE fqn='step'",
       "file __2_3.distcp is not of rank 0"},
      {"UPDATE chunks SET rank=4 WHERE fqn='step'", "rank 4 is not in [0, 3]"},
      {"UPDATE chunks SET fqn='model.nope' WHERE fqn='step'",
       "(model.nope): not a tensor of the tensors table"},
      {"UPDATE chunks SET checksum='xyz' WHERE fqn='step'",
       "checksum 'xyz' is not 16 hex digits"},
      {"UPDATE chunks SET checksum='0123456789abcdef0' WHERE fqn='step'",
       "is not 16 hex digits"},
      {"UPDATE blobs SET rank=7 WHERE fqn='rng'", "(rng): rank 7 is not in"},
      {"UPDATE blobs SET fqn='step', path='step' WHERE fqn='rng'",
       "fqn is also a tensor"},
      {"UPDATE checkpoint SET value='2' WHERE key='format_version'",
       "format version '2' is not 1"},
      {"DELETE FROM checkpoint WHERE key='save_id'",
       "checkpoint key save_id is missing"},
      {"UPDATE checkpoint SET value='0' WHERE key='world_size'",
       "'0' is not a world size"},
      {"UPDATE checkpoint SET value='yesterday' WHERE key='created_at'",
       "'yesterday' is not an ISO-8601 UTC time"},
      {"DROP TABLE blobs", "table blobs is missing"},
      {"ALTER TABLE chunks DROP COLUMN checksum", "no such column: checksum"},
  };
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "inconsistent", NULL, dir);
  test_path(state, "inconsistent", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m;
  meta_small(&m);
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    publish_ok(dir, &m, false);
    db_exec(path, cases[i][0]);
    load_fails(path, cases[i][1]);
  }
  /* Keys of later writers are ignored. */
  publish_ok(dir, &m, false);
  db_exec(path, "INSERT INTO checkpoint VALUES ('comment', 'hello')");
  load_equal(path, &m);
  ckpt_metadata_free(&m);
}

/* Retention keys (step, protect, metric.KEY): written only when given,
 * read back the same; a .metadata without them (older) loads with none;
 * a malformed one is refused. */
static void test_retention_keys(void **state) {
  char dir[PATH_MAX], path[PATH_MAX];
  test_path(state, "retention", NULL, dir);
  test_path(state, "retention", CKPT_METADATA_FILE, path);
  ckpt_metadata_t m, got;
  meta_small(&m);
  publish_ok(dir, &m, false);
  assert_string_equal(db_query(path, "SELECT count(*) FROM checkpoint WHERE"
                                     " key IN ('step', 'protect') OR key"
                                     " LIKE 'metric.%'"),
                      "0");
  char *err = NULL;
  assert_int_equal(ckpt_metadb_load(path, &got, &err), 0);
  assert_false(got.has_step || got.protect || got.n_metrics);
  ckpt_metadata_free(&got);

  ckpt_commit_words_t w = {.has_step = true, .step = 1200, .protect = true,
                           .n_metrics = 2};
  w.metrics[0] = (ckpt_metric_t){"val_loss", 0.1 + 0.2};
  w.metrics[1] = (ckpt_metric_t){"acc", 1e-5};
  assert_int_equal(ckpt_metadata_set_retention(&m, &w), 0);
  publish_ok(dir, &m, false);
  assert_string_equal(
      db_query(path, "SELECT value FROM checkpoint WHERE key='metric.acc'"),
      "1e-05");
  assert_string_equal(
      db_query(path, "SELECT value FROM checkpoint WHERE key='step'"), "1200");
  assert_int_equal(ckpt_metadb_load_header(path, &got, &err), 0);
  assert_true(got.has_step && got.step == 1200 && got.protect);
  assert_int_equal(got.n_metrics, 2);
  assert_string_equal(got.metrics[0].key, "acc"); /* sorted */
  assert_true(got.metrics[1].value == 0.1 + 0.2); /* the same double */
  ckpt_metadata_free(&got);

  static const char *const cases[][2] = {
      {"UPDATE checkpoint SET value='-3' WHERE key='step'",
       "step '-3' is not a step number"},
      {"UPDATE checkpoint SET value='12x' WHERE key='step'",
       "step '12x' is not a step number"},
      {"UPDATE checkpoint SET value='99999999999999999999' WHERE key='step'",
       "is not a step number"},
      {"UPDATE checkpoint SET value='yes' WHERE key='protect'",
       "protect 'yes' is not 0 or 1"},
      {"UPDATE checkpoint SET value='nan' WHERE key='metric.acc'",
       "metric.acc 'nan' is not a finite number"},
      {"UPDATE checkpoint SET key='metric.a b' WHERE key='metric.acc'",
       "'metric.a b' is not a metric key"},
      {"UPDATE checkpoint SET value=NULL WHERE key='metric.acc'",
       "value is NULL"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    publish_ok(dir, &m, false);
    db_exec(path, cases[i][0]);
    load_fails(path, cases[i][1]);
  }
  /* More metrics than CKPT_MAX_METRICS: refused. */
  publish_ok(dir, &m, false);
  db_exec(path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM"
                " n WHERE i < 20) INSERT INTO checkpoint SELECT"
                " 'metric.m' || i, i FROM n");
  load_fails(path, "more than 16 metrics");
  ckpt_metadata_free(&m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_retention_keys),
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_round_trip_empty),
      cmocka_unit_test(test_million_chunks),
      cmocka_unit_test(test_stored_text),
      cmocka_unit_test(test_journal_mode),
      cmocka_unit_test(test_publish_replaces_stale_tmp),
      cmocka_unit_test(test_publish_missing_dir),
      cmocka_unit_test(test_publish_dir_is_file),
      cmocka_unit_test(test_publish_failure_leaves_nothing),
      cmocka_unit_test(test_publish_write_error),
      cmocka_unit_test(test_read_only_location),
      cmocka_unit_test(test_load_missing),
      cmocka_unit_test(test_load_garbage),
      cmocka_unit_test(test_load_truncated),
      cmocka_unit_test(test_load_inconsistent),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
