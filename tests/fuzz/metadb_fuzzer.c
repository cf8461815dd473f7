/*
 * metadb_fuzzer.c - fuzz the .metadata reader (store/metadb.c): whatever a
 * damaged or hostile .metadata holds, ckpt_metadb_check and
 * ckpt_metadb_load return 0 or an error with a message, and what loads
 * is consistent (chunk rows point at their tensor, ranks inside the
 * world, lists as long as the tensor's ndim, every tensor covered by its
 * chunks' elements exactly; retention keys, present or not, sane).
 *
 * Input: either a raw SQLite file (it starts with "SQLite format 3"), or
 * rows to insert into a database with the real schema, one per line:
 * a table letter (c checkpoint, t tensors, k chunks, b blobs, e entries)
 * and its
 * columns separated by tabs; a column that is a decimal integer is bound
 * as INTEGER, "~" as NULL, anything else as TEXT. A line "s" followed by
 * SQL changes the schema (a view, a trigger, another table, a generated
 * column, a dropped table: what a hostile BACKING_DIR could hold); it runs
 * for at most a million SQLite steps here, the loader must then refuse or
 * load it in bounded time.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sqlite3.h>

#include "ckpt_planner.h"
#include "fuzz.h"
#include "metadb.h"

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

static const char schema[] =
    "CREATE TABLE checkpoint(key TEXT PRIMARY KEY, value TEXT);"
    "CREATE TABLE tensors(fqn TEXT PRIMARY KEY, path TEXT, dtype TEXT, "
    "shape TEXT);"
    "CREATE TABLE chunks(fqn TEXT, offsets TEXT, sizes TEXT, rank INTEGER, "
    "file TEXT, file_offset INTEGER, length INTEGER, checksum TEXT);"
    "CREATE INDEX chunks_fqn ON chunks(fqn);"
    "CREATE TABLE blobs(fqn TEXT PRIMARY KEY, path TEXT, rank INTEGER, "
    "file TEXT, file_offset INTEGER, length INTEGER, checksum TEXT);"
    "CREATE TABLE entries(path TEXT PRIMARY KEY, mode INTEGER, uid INTEGER, "
    "gid INTEGER, mtime_ns INTEGER);";

static void bind_field(sqlite3_stmt *st, int col, const char *f, size_t n) {
  char *end;
  char buf[32];
  if (n == 1 && f[0] == '~') {
    sqlite3_bind_null(st, col);
    return;
  }
  if (n > 0 && n < sizeof(buf)) {
    memcpy(buf, f, n);
    buf[n] = '\0';
    long long v = strtoll(buf, &end, 10);
    if (*end == '\0' && (buf[0] == '-' || (buf[0] >= '0' && buf[0] <= '9'))) {
      sqlite3_bind_int64(st, col, v);
      return;
    }
  }
  sqlite3_bind_text(st, col, f, (int)n, SQLITE_TRANSIENT);
}

static int steps;
static int too_long(void *arg) {
  (void)arg;
  return ++steps > 1000; /* a million steps */
}

/* Build a database at path from the row lines; 0 or -1. */
static int build_db(const char *path, const char *in, size_t size) {
  sqlite3 *db = NULL;
  if (sqlite3_open(path, &db) != SQLITE_OK ||
      sqlite3_exec(db, schema, NULL, NULL, NULL) != SQLITE_OK) {
    sqlite3_close(db);
    return -1;
  }
  static const struct {
    char letter;
    int ncols;
    const char *sql;
  } tables[] = {
      {'c', 2, "INSERT OR REPLACE INTO checkpoint VALUES(?,?)"},
      {'t', 4, "INSERT OR REPLACE INTO tensors VALUES(?,?,?,?)"},
      {'k', 8, "INSERT INTO chunks VALUES(?,?,?,?,?,?,?,?)"},
      {'b', 7, "INSERT OR REPLACE INTO blobs VALUES(?,?,?,?,?,?,?)"},
      {'e', 5, "INSERT OR REPLACE INTO entries VALUES(?,?,?,?,?)"},
  };
  const char *p = in, *end = in + size;
  sqlite3_progress_handler(db, 1000, too_long, NULL);
  while (p < end) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    const char *line_end = nl ? nl : end;
    if (line_end > p && *p == 's') { /* schema change */
      char *sql = strndup(p + 1, (size_t)(line_end - p - 1));
      steps = 0;
      if (sql)
        sqlite3_exec(db, sql, NULL, NULL, NULL);
      free(sql);
      p = nl ? nl + 1 : end;
      continue;
    }
    for (size_t t = 0; t < sizeof(tables) / sizeof(tables[0]); t++) {
      if (line_end == p || *p != tables[t].letter)
        continue;
      sqlite3_stmt *st;
      if (sqlite3_prepare_v2(db, tables[t].sql, -1, &st, NULL) != SQLITE_OK)
        break;
      const char *f = p + 1;
      for (int col = 1; col <= tables[t].ncols; col++) {
        if (f < line_end && *f == '\t')
          f++;
        const char *tab = memchr(f, '\t', (size_t)(line_end - f));
        const char *fe = tab ? tab : line_end;
        bind_field(st, col, f, (size_t)(fe - f));
        f = fe;
      }
      sqlite3_step(st);
      sqlite3_finalize(st);
      break;
    }
    p = nl ? nl + 1 : end;
  }
  sqlite3_close(db);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char dir[] = "/tmp/ckpt-metadb-fuzz-XXXXXX";
  if (!mkdtemp(dir))
    return 0;
  char path[sizeof(dir) + 16];
  snprintf(path, sizeof(path), "%s/.metadata", dir);
  static const char magic[] = "SQLite format 3";
  int ok;
  if (size >= sizeof(magic) - 1 && !memcmp(data, magic, sizeof(magic) - 1)) {
    FILE *f = fopen(path, "wb");
    ok = f && fwrite(data, 1, size, f) == size;
    if (f)
      fclose(f);
  } else {
    ok = build_db(path, (const char *)data, size) == 0;
  }
  if (ok) {
    char *err = NULL;
    int rc = ckpt_metadb_check(path, &err);
    CHECK(rc <= 0 && (rc == 0) == (err == NULL));
    free(err);
    err = NULL;
    ckpt_metadata_t m;
    rc = ckpt_metadb_load(path, &m, &err);
    CHECK(rc <= 0 && (rc == 0) == (err == NULL));
    if (rc == 0) {
      CHECK(m.world_size >= 1);
      for (uint32_t t = 0; t < m.n_tensors; t++) {
        const ckpt_tensor_meta_t *tm = &m.tensors[t];
        CHECK(tm->ndim >= 0 && tm->ndim <= CKPT_MAX_NDIM);
        CHECK((uint64_t)tm->first_chunk + tm->n_chunks <= m.n_chunks);
        uint64_t numel = 0, covered = 0;
        CHECK(ckpt_dims_numel(tm->shape, tm->ndim, &numel) == 0);
        for (uint32_t i = 0; i < tm->n_chunks; i++) {
          const ckpt_chunk_meta_t *c = &m.chunks[tm->first_chunk + i];
          CHECK(c->tensor == t);
          CHECK(c->rank >= 0 && c->rank < m.world_size);
          uint64_t v = 0;
          CHECK(ckpt_dims_numel(tm->ndim ? c->dims + tm->ndim : NULL,
                                tm->ndim, &v) == 0);
          covered += v;
          CHECK(c->file_offset + c->length >= c->file_offset);
        }
        CHECK(covered == numel); /* no gap, and (cover.c) no overlap */
      }
      for (uint32_t b = 0; b < m.n_blobs; b++)
        CHECK(m.blobs[b].rank >= 0 && m.blobs[b].rank < m.world_size);
      /* retention keys, when there: a step >= 0, metrics bounded, sorted
       * by key, unique, each a valid key and a finite value */
      CHECK(!m.has_step || m.step >= 0);
      CHECK(m.n_metrics <= CKPT_MAX_METRICS);
      for (uint32_t i = 0; i < m.n_metrics; i++) {
        const ckpt_metric_t *x = &m.metrics[i];
        CHECK(ckpt_metric_key_valid(x->key, strlen(x->key)));
        CHECK(x->value - x->value == 0); /* finite */
        CHECK(i == 0 || strcmp(m.metrics[i - 1].key, x->key) < 0);
      }
      ckpt_metadata_free(&m);
    }
    free(err);
  }
  unlink(path);
  char journal[sizeof(path) + 16];
  snprintf(journal, sizeof(journal), "%s-journal", path);
  unlink(journal);
  rmdir(dir);
  return 0;
}
