/*
 * test_store.c - store/: the bounded cache of data file descriptors, the
 * opens that refuse symlinks, the reader, the flush's compare-and-swap
 * publish (ckpt_store_publish_if), and the .metadata loader's
 * refusals of what an attacker with write access to BACKING_DIR could put
 * there (symlinks, views, triggers, gaps, overlaps, huge indexes).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "metadb.h"
#include "store.h"
#include "store_int.h"

static char *temp_backing(int *fd) {
  char tmpl[] = "/tmp/ckpt-store-XXXXXX";
  assert_non_null(mkdtemp(tmpl));
  *fd = open(tmpl, O_RDONLY | O_DIRECTORY);
  assert_true(*fd >= 0);
  return strdup(tmpl);
}

static void rm_backing(char *b, int bfd) {
  close(bfd);
  char cmd[600];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", b);
  assert_int_equal(system(cmd), 0);
  free(b);
}

static int open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  assert_non_null(d);
  while (readdir(d))
    n++;
  closedir(d);
  return n;
}

/* A committed checkpoint NAME of one int32 tensor "t" of n elements
 * (values i * mult) in `ranks` parts (rows split evenly), published with
 * metadb: part r stored by rank r in its data file 0, or with one_rank by
 * rank 0 in its data file r (as files written once are). */
static ckpt_metadata_t *make_parts(const char *b, const char *name, int64_t n,
                                   int ranks, int32_t mult, bool one_rank) {
  char dir[512], path[600];
  snprintf(dir, sizeof(dir), "%s/%s", b, name);
  assert_int_equal(mkdir(dir, 0700), 0);
  ckpt_metadata_t *m = calloc(1, sizeof(*m));
  m->name = strdup(name);
  m->save_id = strdup("00ff");
  m->world_size = one_rank ? 1 : ranks;
  m->created_at = 1700000000;
  m->n_tensors = 1;
  m->tensors = calloc(1, sizeof(*m->tensors));
  m->tensors[0].fqn = strdup("t");
  m->tensors[0].path = strdup("t");
  m->tensors[0].dtype = CKPT_DTYPE_INT32;
  m->tensors[0].ndim = 1;
  m->tensors[0].shape = malloc(sizeof(int64_t));
  m->tensors[0].shape[0] = n;
  m->tensors[0].n_chunks = (uint32_t)ranks;
  m->n_chunks = (uint32_t)ranks;
  m->chunks = calloc((size_t)ranks, sizeof(*m->chunks));
  int64_t per = n / ranks;
  for (int r = 0; r < ranks; r++) {
    int64_t lo = r * per, len = r == ranks - 1 ? n - lo : per;
    ckpt_chunk_meta_t *c = &m->chunks[r];
    c->tensor = 0;
    c->dims = malloc(2 * sizeof(int64_t));
    c->dims[0] = lo;
    c->dims[1] = len;
    c->rank = one_rank ? 0 : r;
    c->file = one_rank ? (uint32_t)r : 0;
    c->length = (uint64_t)len * 4;
    int32_t *v = malloc((size_t)len * 4 + 1);
    for (int64_t i = 0; i < len; i++)
      v[i] = (int32_t)(lo + i) * mult;
    c->checksum = XXH3_64bits(v, (size_t)len * 4);
    snprintf(path, sizeof(path), "%s/__%d_%u.distcp", dir, c->rank, c->file);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_int_equal(write(fd, v, (size_t)len * 4), len * 4);
    close(fd);
    free(v);
  }
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(dir, m, false, &err), 0);
  return m;
}

static ckpt_metadata_t *make_ckpt(const char *b, const char *name,
                                  int64_t n, int ranks, int32_t mult) {
  return make_parts(b, name, n, ranks, mult, false);
}

static void free_meta(ckpt_metadata_t *m) {
  ckpt_metadata_free(m);
  free(m);
}

static int load(int bfd, const char *name, ckpt_metadata_t *m, char **err) {
  int dfd = ckpt_store_open_dir(bfd, name, O_RDONLY);
  if (dfd < 0)
    return dfd;
  int rc = ckpt_metadb_load_at(dfd, name, m, err);
  close(dfd);
  return rc;
}

/* Load checkpoint name into l and set s up on it with a new cache. */
static void open_stored(int bfd, const char *name, ckpt_metadata_t *l,
                        ckpt_fdcache_t **cache, ckpt_stored_t *s, bool verify) {
  char *err = NULL;
  assert_int_equal(load(bfd, name, l, &err), 0);
  assert_int_equal(ckpt_fdcache_new(bfd, 0, cache), 0);
  int dfd = ckpt_store_open_dir(bfd, name, O_PATH);
  assert_int_equal(ckpt_stored_init(s, *cache, name, dfd, l, verify), 0);
  close(dfd);
}

/* 300 checkpoints read through one cache of 16: at most 16 descriptors
 * stay open, and every read is right. */
static void fdcache_is_bounded(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  enum { N = 300 };
  ckpt_fdcache_t *cache;
  assert_int_equal(ckpt_fdcache_new(bfd, 16, &cache), 0);
  static ckpt_stored_t s[N];
  static ckpt_metadata_t *mm[N], loaded[N];
  int before = open_fds();
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "c%03d", i);
    mm[i] = make_ckpt(b, name, 64, 2, i + 1);
    char *err = NULL;
    assert_int_equal(load(bfd, name, &loaded[i], &err), 0);
    int dfd = ckpt_store_open_dir(bfd, name, O_PATH);
    assert_int_equal(ckpt_stored_init(&s[i], cache, name, dfd, &loaded[i],
                                      i % 2 == 0), 0);
    close(dfd);
  }
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < N; i++) {
      int32_t v[64];
      ckpt_item_t it = {false, 0};
      assert_int_equal(ckpt_stored_verify(&s[i], it, sizeof(v), 0), 0);
      assert_int_equal(ckpt_stored_read(&s[i], it, v, sizeof(v), 0),
                       (ssize_t)sizeof(v));
      for (int k = 0; k < 64; k++)
        assert_int_equal(v[k], k * (i + 1));
      assert_true(ckpt_fdcache_open(cache) <= 16);
    }
  }
  assert_true(open_fds() <= before + 16);
  /* A held descriptor beyond the cap stays valid until released. */
  ckpt_fdref_t refs[20];
  for (int i = 0; i < 20; i++)
    assert_int_equal(ckpt_stored_fd(&s[i], 1, 0, &refs[i]), 0);
  for (int i = 0; i < 20; i++) {
    struct stat st;
    assert_int_equal(fstat(refs[i].fd, &st), 0);
    ckpt_fdref_put(&refs[i]);
  }
  assert_true(ckpt_fdcache_open(cache) <= 16);
  for (int i = 0; i < N; i++) {
    ckpt_stored_destroy(&s[i]);
    ckpt_metadata_free(&loaded[i]);
    free_meta(mm[i]);
  }
  ckpt_fdcache_free(cache);
  assert_int_equal(open_fds(), before);
  rm_backing(b, bfd);
}

/* The sweep closes idle descriptors of data files removed since (their
 * space would stay in use), never one held, nor one of a file still there. */
static void fdcache_sweep_lets_removed_files_go(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  ckpt_metadata_t *m = make_ckpt(b, "a", 64, 2, 3), l;
  ckpt_fdcache_t *cache;
  ckpt_stored_t s;
  open_stored(bfd, "a", &l, &cache, &s, false);
  ckpt_fdref_t r0, r1;
  assert_int_equal(ckpt_stored_fd(&s, 0, 0, &r0), 0);
  assert_int_equal(ckpt_stored_fd(&s, 1, 0, &r1), 0);
  ckpt_fdref_put(&r1); /* idle, cached */
  assert_int_equal(ckpt_fdcache_open(cache), 2);
  assert_int_equal(ckpt_fdcache_sweep(cache), 0); /* both still named */
  char p0[PATH_MAX], p1[PATH_MAX], name[64];
  ckpt_data_file_name(0, 0, name, sizeof(name));
  snprintf(p0, sizeof(p0), "%s/a/%s", b, name);
  ckpt_data_file_name(1, 0, name, sizeof(name));
  snprintf(p1, sizeof(p1), "%s/a/%s", b, name);
  assert_int_equal(unlink(p0), 0);
  assert_int_equal(unlink(p1), 0);
  assert_int_equal(ckpt_fdcache_sweep(cache), 1); /* rank 1's, idle */
  assert_int_equal(ckpt_fdcache_open(cache), 1);
  struct stat st;
  assert_int_equal(fstat(r0.fd, &st), 0); /* the held one stays */
  ckpt_fdref_put(&r0);
  assert_int_equal(ckpt_fdcache_sweep(cache), 1);
  assert_int_equal(ckpt_fdcache_open(cache), 0);
  ckpt_stored_destroy(&s);
  ckpt_metadata_free(&l);
  free_meta(m);
  ckpt_fdcache_free(cache);
  rm_backing(b, bfd);
}

/* Data files that are symlinks, a directory replaced under the reader, a
 * rank beyond the world: EIO, never someone else's bytes. */
static void reader_refuses_what_moved(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  ckpt_metadata_t *m = make_ckpt(b, "a", 64, 2, 1), *m2 = make_ckpt(b, "z", 64, 2, 7);
  ckpt_metadata_t l = {0};
  char path[600], other[600];
  ckpt_fdcache_t *cache;
  ckpt_stored_t s;
  open_stored(bfd, "a", &l, &cache, &s, false);
  ckpt_item_t it = {false, 0};
  int32_t v[64];
  /* rank 1's data file becomes a symlink to another checkpoint's */
  snprintf(path, sizeof(path), "%s/a/__1_0.distcp", b);
  snprintf(other, sizeof(other), "%s/z/__1_0.distcp", b);
  assert_int_equal(unlink(path), 0);
  assert_int_equal(symlink(other, path), 0);
  assert_int_equal(ckpt_stored_read(&s, it, v, sizeof(v), 0), -EIO);
  /* the checkpoint directory replaced by another one of the same name */
  snprintf(path, sizeof(path), "%s/a", b);
  snprintf(other, sizeof(other), "%s/a.old", b);
  assert_int_equal(rename(path, other), 0);
  snprintf(other, sizeof(other), "%s/z", b);
  assert_int_equal(rename(other, path), 0);
  assert_int_equal(ckpt_stored_read(&s, it, v, sizeof(v), 0), -EIO);
  ckpt_fdref_t ref;
  assert_int_equal(ckpt_stored_fd(&s, 2, 0, &ref), -ERANGE); /* no rank 2 */
  ckpt_stored_destroy(&s);
  ckpt_fdcache_free(cache);
  ckpt_metadata_free(&l);
  free_meta(m);
  free_meta(m2);
  rm_backing(b, bfd);
}

/* Until chunk i is no longer unchecked (the threads checking ahead of
 * the reader): its state, or UNCHECKED after 10 s. */
static uint8_t checked_state(const ckpt_stored_t *s, uint32_t i) {
  for (int k = 0; k < 10000; k++) {
    uint8_t v = atomic_load(&s->verified[i]);
    if (v == CKPT_CHUNK_GOOD || v == CKPT_CHUNK_BAD)
      return v;
    usleep(1000);
  }
  return atomic_load(&s->verified[i]);
}

/* A load reads one data file per tensor of a checkpoint written once: a
 * read of the first checks the rank's next data files ahead of the reader
 * (their damage found there too), not only what follows in its own file. */
static void checks_ahead_cross_data_files(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  enum { PARTS = 5, N = PARTS * 1024 };
  ckpt_metadata_t *m = make_parts(b, "w", N, PARTS, 3, true);
  char path[600];
  /* one byte of data file 3 flipped after the checkpoint was published */
  snprintf(path, sizeof(path), "%s/w/__0_3.distcp", b);
  int fd = open(path, O_RDWR);
  uint8_t x;
  assert_int_equal(pread(fd, &x, 1, 100), 1);
  x ^= 0x10;
  assert_int_equal(pwrite(fd, &x, 1, 100), 1);
  close(fd);
  ckpt_metadata_t l = {0};
  ckpt_fdcache_t *cache;
  ckpt_stored_t s;
  open_stored(bfd, "w", &l, &cache, &s, true);
  ckpt_item_t it = {false, 0};
  int32_t v[N / PARTS];
  /* the first part only, as the mount serves it: its own check, the
   * others' by the threads */
  assert_int_equal(ckpt_stored_verify(&s, it, sizeof(v), 0), 0);
  assert_int_equal(ckpt_stored_read(&s, it, v, sizeof(v), 0), (ssize_t)sizeof(v));
  assert_int_equal(v[7], 7 * 3);
  uint32_t seen = 0;
  for (uint32_t i = 0; i < l.n_chunks; i++) {
    const ckpt_chunk_meta_t *c = &l.chunks[i];
    assert_int_equal(c->rank, 0);
    assert_int_equal(checked_state(&s, i),
                     c->file == 3 ? CKPT_CHUNK_BAD : CKPT_CHUNK_GOOD);
    seen |= 1u << c->file;
  }
  assert_int_equal(seen, (1u << PARTS) - 1);
  /* what the check found is what a read of it gets */
  assert_int_equal(ckpt_stored_verify(&s, it, sizeof(v), 3 * sizeof(v)), -EIO);
  assert_int_equal(ckpt_stored_verify(&s, it, sizeof(v), 4 * sizeof(v)), 0);
  assert_int_equal(ckpt_stored_read(&s, it, v, sizeof(v), 4 * sizeof(v)),
                   (ssize_t)sizeof(v));
  assert_int_equal(v[0], 4 * (N / PARTS) * 3);
  ckpt_stored_destroy(&s);
  ckpt_fdcache_free(cache);
  ckpt_metadata_free(&l);
  free_meta(m);
  rm_backing(b, bfd);
}

/* Run sql on BACKING_DIR/name/.metadata. */
static void tamper(const char *b, const char *name, const char *sql) {
  char path[600];
  snprintf(path, sizeof(path), "%s/%s/.metadata", b, name);
  sqlite3 *db;
  assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
  char *msg = NULL;
  int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
  if (rc != SQLITE_OK)
    fail_msg("%s: %s", sql, msg);
  sqlite3_close(db);
}

/* Load a tampered copy: refused with a message containing want. */
static void refused(const char *sql, const char *want) {
  int bfd;
  char *b = temp_backing(&bfd);
  ckpt_metadata_t *m = make_ckpt(b, "c", 1024, 2, 1);
  tamper(b, "c", sql);
  ckpt_metadata_t l = {0};
  char *err = NULL;
  int rc = load(bfd, "c", &l, &err);
  if (rc == 0)
    fail_msg("%s: loaded, must be refused (%s)", sql, want);
  assert_non_null(err);
  if (!strstr(err, want))
    fail_msg("%s: '%s' does not say '%s'", sql, err, want);
  free(err);
  free_meta(m);
  rm_backing(b, bfd);
}

static void loader_refuses_hostile_metadata(void **state) {
  (void)state;
  refused("UPDATE tensors SET shape='[4096]'", "cover 1024 of 4096");
  refused("INSERT INTO chunks SELECT fqn, '[100]', '[512]', rank, file,"
          " 0, 2048, checksum FROM chunks WHERE rank = 0",
          "chunks overlap");
  refused("DROP TABLE tensors;"
          " CREATE VIEW tensors(fqn, path, dtype, shape) AS"
          " WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r)"
          " SELECT 't' || x, 't' || x, 'int32', '[1]' FROM r",
          "unexpected schema object: view tensors");
  refused("CREATE TRIGGER x AFTER INSERT ON chunks BEGIN SELECT 1; END",
          "unexpected schema object: trigger");
  refused("CREATE TABLE extra(a)", "unexpected schema object: table extra");
  refused("UPDATE checkpoint SET value='200000000' WHERE key='world_size'",
          "is not a world size");
  refused("UPDATE chunks SET file='__0_268435455.distcp' WHERE rank = 0",
          "data files per rank");
  refused("UPDATE chunks SET file_offset=9223372036854775000 WHERE rank = 0",
          "overflows");
  refused("ALTER TABLE checkpoint ADD COLUMN g GENERATED ALWAYS AS (1)",
          "generated column");
}

static void loader_refuses_symlinks(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  ckpt_metadata_t *m = make_ckpt(b, "c", 64, 1, 1);
  char path[600], target[600];
  snprintf(path, sizeof(path), "%s/c/.metadata", b);
  snprintf(target, sizeof(target), "%s/c/.metadata.real", b);
  assert_int_equal(rename(path, target), 0);
  assert_int_equal(symlink(target, path), 0);
  ckpt_metadata_t l = {0};
  char *err = NULL;
  assert_int_equal(load(bfd, "c", &l, &err), -ELOOP);
  assert_non_null(strstr(err, "symbolic link"));
  free(err);
  err = NULL;
  assert_int_equal(ckpt_metadb_load(path, &l, &err), -ELOOP);
  free(err);
  /* a symlinked checkpoint directory is not opened */
  snprintf(path, sizeof(path), "%s/d", b);
  snprintf(target, sizeof(target), "%s/c", b);
  assert_int_equal(symlink(target, path), 0);
  assert_true(ckpt_store_open_dir(bfd, "d", O_RDONLY) < 0);
  free_meta(m);
  rm_backing(b, bfd);
}

/* ckpt_open_beneath, with openat2 and with the walk: no symlink anywhere
 * in the path, nothing outside. */
static void open_beneath_refuses_symlinks(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  char p[600], q[600];
  snprintf(p, sizeof(p), "%s/d", b);
  assert_int_equal(mkdir(p, 0700), 0);
  snprintf(p, sizeof(p), "%s/d/f", b);
  close(open(p, O_WRONLY | O_CREAT, 0600));
  snprintf(p, sizeof(p), "%s/ld", b);
  assert_int_equal(symlink("d", p), 0);
  snprintf(p, sizeof(p), "%s/d/lf", b);
  assert_int_equal(symlink("f", p), 0);
  snprintf(p, sizeof(p), "%s/out", b);
  assert_int_equal(symlink("/tmp", p), 0);
  for (int walk = 0; walk < 2; walk++) {
    ckpt__open_beneath_force_walk(walk);
    int fd = ckpt_open_beneath(bfd, "d/f", O_RDONLY, 0);
    assert_true(fd >= 0);
    close(fd);
    fd = ckpt_open_beneath(bfd, "d", O_PATH | O_DIRECTORY, 0);
    assert_true(fd >= 0);
    int fd2 = ckpt_open_beneath(fd, ".", O_TMPFILE | O_RDWR, 0600);
    assert_true(fd2 >= 0);
    close(fd2);
    close(fd);
    fd = ckpt_open_beneath(bfd, "ld/f", O_RDONLY, 0);
    assert_true(fd == -ELOOP || fd == -ENOTDIR);
    assert_int_equal(ckpt_open_beneath(bfd, "d/lf", O_RDONLY, 0), -ELOOP);
    fd = ckpt_open_beneath(bfd, "ld", O_RDONLY | O_DIRECTORY, 0);
    assert_true(fd == -ELOOP || fd == -ENOTDIR);
    fd = ckpt_open_beneath(bfd, "out", O_TMPFILE | O_RDWR, 0600);
    assert_true(fd == -ELOOP || fd == -ENOTDIR);
    fd = ckpt_open_beneath(bfd, "out/x", O_WRONLY | O_CREAT | O_EXCL, 0600);
    assert_true(fd == -ELOOP || fd == -ENOTDIR);
    assert_int_equal(ckpt_open_beneath(bfd, "../x", O_RDONLY, 0), -EINVAL);
    assert_int_equal(ckpt_open_beneath(bfd, "d/../d/f", O_RDONLY, 0),
                     -EINVAL);
    assert_int_equal(ckpt_open_beneath(bfd, "/etc/passwd", O_RDONLY, 0),
                     -EINVAL);
    assert_int_equal(ckpt_open_beneath(bfd, "d//f", O_RDONLY, 0), -EINVAL);
    assert_int_equal(ckpt_open_beneath(bfd, "", O_RDONLY, 0), -EINVAL);
    /* created beneath, mode as asked */
    snprintf(q, sizeof(q), "new%d", walk);
    fd = ckpt_open_beneath(bfd, q, O_WRONLY | O_CREAT | O_EXCL, 0640);
    assert_true(fd >= 0);
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0640 & ~umask(022));
    umask(022);
    close(fd);
  }
  ckpt__open_beneath_force_walk(false);
  rm_backing(b, bfd);
}

/* A save's directory held by a save or a flush (a shared flock) is not
 * removed by the flush of a superseded save, nor judged abandoned; once
 * let go it is. */
static void save_dir_remove_unheld_spares_a_held_one(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  const char *id = "0123456789abcdef0123456789abcdef";
  int held = -1;
  assert_int_equal(ckpt_store_save_dir_hold(bfd, id, true, &held), 0);
  int f = openat(held, "__0_0.distcp", O_WRONLY | O_CREAT, 0600);
  assert_true(f >= 0);
  close(f);
  assert_true(ckpt_store_save_dir_held(bfd, id));
  assert_int_equal(ckpt_store_save_dir_remove_unheld(bfd, id), -EBUSY);
  struct stat st;
  assert_int_equal(fstatat(bfd, ".saves/0123456789abcdef0123456789abcdef/"
                           "__0_0.distcp", &st, 0), 0);
  close(held);
  assert_false(ckpt_store_save_dir_held(bfd, id));
  assert_int_equal(ckpt_store_save_dir_remove_unheld(bfd, id), 0);
  assert_int_equal(fstatat(bfd, ".saves", &st, 0), -1);
  assert_int_equal(ckpt_store_save_dir_remove_unheld(bfd, id), -ENOENT);
  rm_backing(b, bfd);
}

/* A committed checkpoint at b/rel (a directory made here) of save id,
 * with no tensor; replaces: its "replaces" key, or NULL. */
static void make_save(const char *b, const char *rel, const char *id,
                      const char *replaces, int64_t commit_ns) {
  char dir[600];
  snprintf(dir, sizeof(dir), "%s/%s", b, rel);
  assert_int_equal(mkdir(dir, 0700), 0);
  ckpt_metadata_t m = {0};
  m.name = strdup("x");
  m.save_id = strdup(id);
  m.world_size = 1;
  m.created_at = 1700000000;
  m.replaces = replaces ? strdup(replaces) : NULL;
  m.commit_ns = commit_ns;
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(dir, &m, false, &err), 0);
  ckpt_metadata_free(&m);
}

/* Make b/name/file (directories as needed), empty. */
static void touch_in(int bfd, const char *name, const char *file) {
  mkdirat(bfd, name, 0700);
  char rel[300];
  snprintf(rel, sizeof(rel), "%s/%s", name, file);
  int f = openat(bfd, rel, O_WRONLY | O_CREAT, 0600);
  assert_true(f >= 0);
  close(f);
}

/* A mount's start removes what an interrupted save or removal left, a
 * NAME without .metadata holding only what the store writes there: data
 * files, .metadata's temporary files, and the .protected marker of a
 * protected checkpoint (rm -r of one killed after its .metadata went left
 * it, and it stayed as "not a checkpoint": the history test's LEFTOVER).
 * A directory with anything else stays, and so does a committed one. */
static void cleanup_removes_unfinished_saves(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  touch_in(bfd, "plain", "__0_0.distcp");
  touch_in(bfd, "protected", "__0_0.distcp");
  touch_in(bfd, "protected", ".protected");
  touch_in(bfd, "marking", ".protected.tmp");
  touch_in(bfd, "mine", "__0_0.distcp");
  touch_in(bfd, "mine", "notes.txt");
  make_save(b, "done", "0123456789abcdef0123456789abcdef", NULL, 1);
  touch_in(bfd, "done", ".protected");
  ckpt_store_cleanup(bfd, -1);
  struct stat st;
  assert_int_equal(fstatat(bfd, "plain", &st, 0), -1);
  assert_int_equal(fstatat(bfd, "protected", &st, 0), -1);
  assert_int_equal(fstatat(bfd, "marking", &st, 0), -1);
  assert_int_equal(fstatat(bfd, "mine/notes.txt", &st, 0), 0);
  assert_int_equal(fstatat(bfd, "done/.protected", &st, 0), 0);
  assert_int_equal(fstatat(bfd, "done/" CKPT_METADATA_FILE, &st, 0), 0);
  rm_backing(b, bfd);
}

static void key_of(int bfd, const char *name, char out[CKPT_SAVE_ID_LEN + 1]) {
  int dfd = ckpt_store_open_dir(bfd, name, O_RDONLY);
  assert_true(dfd >= 0);
  assert_int_equal(ckpt_store_save_id(dfd, out), 0);
  close(dfd);
}

/* A directory's save ID is read from its .metadata once per version of
 * that file (same device, inode, size, mtime and ctime), and not
 * remembered while the file is under 2 s old (its ctime could not tell a
 * file made in the same clock tick in a reused inode); a .metadata
 * renamed over it, or written in place, is read again. */
static void save_id_read_once_per_metadata_version(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  const char *a = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1";
  const char *n = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb2";
  char key[CKPT_SAVE_ID_LEN + 1];
  make_save(b, "S", a, NULL, 1);
  unsigned long r0 = ckpt__save_id_reads();
  key_of(bfd, "S", key);
  key_of(bfd, "S", key);
  assert_string_equal(key, a);
  assert_int_equal(ckpt__save_id_reads() - r0, 2); /* too new to keep */
  sleep(2);
  key_of(bfd, "S", key);
  key_of(bfd, "S", key);
  key_of(bfd, "S", key);
  assert_string_equal(key, a);
  assert_int_equal(ckpt__save_id_reads() - r0, 3); /* then remembered */
  /* another save's .metadata renamed over it: read */
  make_save(b, "T", n, NULL, 2);
  assert_int_equal(renameat(bfd, "T/" CKPT_METADATA_FILE, bfd,
                            "S/" CKPT_METADATA_FILE), 0);
  key_of(bfd, "S", key);
  assert_string_equal(key, n);
  assert_int_equal(ckpt__save_id_reads() - r0, 4);
  /* written in place (the same bytes): its times moved, read again */
  sleep(2);
  key_of(bfd, "S", key); /* remembered now */
  unsigned long r1 = ckpt__save_id_reads();
  int f = openat(bfd, "S/" CKPT_METADATA_FILE, O_RDWR);
  assert_true(f >= 0);
  char c;
  assert_int_equal(pread(f, &c, 1, 0), 1);
  assert_int_equal(pwrite(f, &c, 1, 0), 1);
  close(f);
  key_of(bfd, "S", key);
  assert_string_equal(key, n);
  assert_int_equal(ckpt__save_id_reads() - r1, 1);
  rm_backing(b, bfd);
}

/* The flush's compare-and-swap (ckpt_store_publish_if): published only
 * while NAME is one of the saves its commit replaced; the replaces list
 * round-trips through .metadata. */
static void publish_if_compares_and_swaps(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  const char *a = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
  const char *n1 = "11111111111111111111111111111111";
  const char *n2 = "22222222222222222222222222222222";
  const char *n3 = "33333333333333333333333333333333";
  char now[CKPT_SAVE_ID_LEN + 1], key[CKPT_SAVE_ID_LEN + 1];
  bool replaced;
  assert_true(ckpt_store_replaces_has("none", ""));
  assert_true(ckpt_store_replaces_has(" x  none", ""));
  assert_false(ckpt_store_replaces_has("nonexistent", ""));
  assert_true(ckpt_store_replaces_has("ab cd", "cd"));
  assert_false(ckpt_store_replaces_has("abcd", "cd"));
  assert_false(ckpt_store_replaces_has("cd", "c"));
  assert_false(ckpt_store_replaces_has(NULL, "cd"));
  make_save(b, "X", a, NULL, 1000);
  char saves[600];
  snprintf(saves, sizeof(saves), "%s/.saves", b);
  assert_int_equal(mkdir(saves, 0700), 0);
  /* n1 replaced a: exchanged */
  snprintf(saves, sizeof(saves), ".saves/%s", n1);
  make_save(b, saves, n1, "none aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 2000);
  assert_int_equal(ckpt_store_publish_if(bfd, n1, "X", "none " "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                                         0, &replaced, now), 0);
  assert_true(replaced);
  key_of(bfd, "X", key);
  assert_string_equal(key, n1);
  /* its replaces key loaded back */
  int dfd = ckpt_store_open_dir(bfd, "X", O_RDONLY);
  char *rep = NULL;
  assert_int_equal(ckpt_store_save_look(dfd, key, &rep, NULL), 0);
  close(dfd);
  assert_string_equal(rep, "none aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
  free(rep);
  /* n2 replaced a too, but X is n1 now (later): superseded, X stays */
  snprintf(saves, sizeof(saves), ".saves/%s", n2);
  make_save(b, saves, n2, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 1500);
  assert_int_equal(ckpt_store_publish_if(bfd, n2, "X", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                                         0, &replaced, now), -ESTALE);
  assert_false(replaced);
  assert_string_equal(now, n1);
  key_of(bfd, "X", key);
  assert_string_equal(key, n1);
  /* already published: nothing to do */
  assert_int_equal(ckpt_store_publish_if(bfd, n1, "X", "zz", 0, &replaced, now), 0);
  assert_false(replaced);
  /* a plain commit ("none") of a name that exists: superseded */
  snprintf(saves, sizeof(saves), ".saves/%s", n3);
  make_save(b, saves, n3, "none", 3000);
  assert_int_equal(ckpt_store_publish_if(bfd, n3, "X", "none", 0, &replaced, now), -ESTALE);
  /* ... of a name that does not: published */
  assert_int_equal(ckpt_store_publish_if(bfd, n3, "Y", "none", 0, &replaced, now), 0);
  assert_false(replaced);
  key_of(bfd, "Y", key);
  assert_string_equal(key, n3);
  /* a name removed after the commit that replaced it: superseded */
  assert_int_equal(ckpt_store_publish_if(bfd, n2, "Z", n1, 0, &replaced, now), -ESTALE);
  assert_string_equal(now, "");
  /* not a checkpoint (a file): refused */
  snprintf(saves, sizeof(saves), "%s/F", b);
  close(open(saves, O_WRONLY | O_CREAT, 0600));
  assert_int_equal(ckpt_store_publish_if(bfd, n2, "F", "none", 0, &replaced, now), -EEXIST);
  /* replace= ("earlier"): a save committed before it (n1 at 2000) is
   * replaced although not listed; one committed after it is not */
  assert_true(ckpt_store_replaces_ok("x earlier", 2500, n1, 2000));
  assert_false(ckpt_store_replaces_ok("x earlier", 1500, n1, 2000));
  assert_false(ckpt_store_replaces_ok("x", 2500, n1, 2000));
  assert_false(ckpt_store_replaces_ok("x earlier", 2500, "", 0));
  assert_int_equal(ckpt_store_publish_if(bfd, n2, "X", "x earlier", 1500, &replaced, now),
                   -ESTALE);
  const char *n4 = "44444444444444444444444444444444";
  snprintf(saves, sizeof(saves), ".saves/%s", n4);
  make_save(b, saves, n4, "x earlier", 2500);
  assert_int_equal(ckpt_store_publish_if(bfd, n4, "X", "x earlier", 2500, &replaced, now), 0);
  assert_true(replaced);
  key_of(bfd, "X", key);
  assert_string_equal(key, n4);
  rm_backing(b, bfd);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(fdcache_is_bounded),
      cmocka_unit_test(fdcache_sweep_lets_removed_files_go),
      cmocka_unit_test(reader_refuses_what_moved),
      cmocka_unit_test(checks_ahead_cross_data_files),
      cmocka_unit_test(loader_refuses_hostile_metadata),
      cmocka_unit_test(loader_refuses_symlinks),
      cmocka_unit_test(open_beneath_refuses_symlinks),
      cmocka_unit_test(save_dir_remove_unheld_spares_a_held_one),
      cmocka_unit_test(publish_if_compares_and_swaps),
      cmocka_unit_test(save_id_read_once_per_metadata_version),
      cmocka_unit_test(cleanup_removes_unfinished_saves),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
