/* Unit tests of catalog.c: listing a backing directory, choosing the old
 * checkpoints to prune, removing one (not while a writer holds it). */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "catalog.h"
#include "store.h"
#include "metadb.h"

static ckpt_cat_entry_t entry(const char *name, ckpt_cat_state_t st,
                              int64_t created, long mtime_ns) {
  ckpt_cat_entry_t e = {.name = (char *)name, .state = st};
  e.meta.created_at = created;
  e.mtime.tv_sec = 1000;
  e.mtime.tv_nsec = mtime_ns;
  return e;
}

static void select_old_keeps_the_newest(void **state) {
  (void)state;
  ckpt_cat_entry_t e[] = {
      entry("a", CKPT_CAT_COMMITTED, 300, 5), /* 0: newest */
      entry("b", CKPT_CAT_COMMITTED, 100, 9), /* 1: oldest */
      entry("c", CKPT_CAT_COMMITTED, 200, 1), /* 2: same second as d, older */
      entry("d", CKPT_CAT_COMMITTED, 200, 2), /* 3 */
      entry("u", CKPT_CAT_UNFINISHED, 0, 0),  /* never selected */
      entry("x", CKPT_CAT_DAMAGED, 0, 0),
  };
  ckpt_catalog_t c = {.n = 6, .e = e};
  bool rm[6];
  assert_int_equal(ckpt__catalog_select_old(&c, 2, NULL, rm), 2);
  assert_false(rm[0]);
  assert_true(rm[1]);
  assert_true(rm[2]); /* the .metadata mtime orders one created_at second */
  assert_false(rm[3]);
  assert_false(rm[4]);
  assert_false(rm[5]);

  assert_int_equal(ckpt__catalog_select_old(&c, 0, NULL, rm), 0); /* keep all */
  for (int i = 0; i < 6; i++)
    assert_false(rm[i]);
  assert_int_equal(ckpt__catalog_select_old(&c, 10, NULL, rm), 0);

  /* The one just committed is kept even if it is not the newest, and it
   * counts as one of the kept. */
  assert_int_equal(ckpt__catalog_select_old(&c, 2, "b", rm), 2);
  assert_false(rm[0]);
  assert_false(rm[1]);
  assert_true(rm[2]);
  assert_true(rm[3]);
  assert_int_equal(ckpt__catalog_select_old(&c, 1, "a", rm), 3);
  assert_false(rm[0]);
}

/* A temporary BACKING_DIR. */
static char *temp_backing(int *fd) {
  char tmpl[] = "/tmp/ckpt-catalog-XXXXXX";
  assert_non_null(mkdtemp(tmpl));
  *fd = open(tmpl, O_RDONLY | O_DIRECTORY);
  assert_true(*fd >= 0);
  return strdup(tmpl);
}

static void publish(const char *backing, const char *name, int64_t created) {
  char dir[512];
  snprintf(dir, sizeof(dir), "%s/%s", backing, name);
  assert_int_equal(mkdir(dir, 0700), 0);
  ckpt_metadata_t m = {.name = (char *)name, .save_id = "0123abcd",
                       .world_size = 3, .created_at = created};
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(dir, &m, false, &err), 0);
  assert_null(err);
}

static void scan_and_remove(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  char path[600];
  publish(b, "c1", 1000);
  publish(b, "c2", 2000);
  snprintf(path, sizeof(path), "%s/unf", b);
  assert_int_equal(mkdir(path, 0700), 0);
  snprintf(path, sizeof(path), "%s/unf/__0_0.distcp", b);
  int f = open(path, O_WRONLY | O_CREAT, 0600);
  assert_int_equal(write(f, "12345", 5), 5);
  close(f);
  snprintf(path, sizeof(path), "%s/bad", b);
  assert_int_equal(mkdir(path, 0700), 0);
  snprintf(path, sizeof(path), "%s/bad/.metadata", b);
  f = open(path, O_WRONLY | O_CREAT, 0600);
  assert_int_equal(write(f, "garbage", 7), 7);
  close(f);
  /* Not checkpoints: a symlink to one, a file, a reserved name. */
  snprintf(path, sizeof(path), "%s/link", b);
  assert_int_equal(symlink("c1", path), 0);
  snprintf(path, sizeof(path), "%s/file", b);
  close(open(path, O_WRONLY | O_CREAT, 0600));
  snprintf(path, sizeof(path), "%s/.staging", b);
  assert_int_equal(mkdir(path, 0700), 0);

  ckpt_catalog_t c;
  assert_int_equal(ckpt__catalog_scan(bfd, false, &c), 0);
  assert_int_equal(c.n, 4);
  assert_string_equal(c.e[0].name, "bad");
  assert_int_equal(c.e[0].state, CKPT_CAT_DAMAGED);
  assert_non_null(c.e[0].error);
  assert_string_equal(c.e[1].name, "c1");
  assert_int_equal(c.e[1].state, CKPT_CAT_COMMITTED);
  assert_int_equal(c.e[1].meta.created_at, 1000);
  assert_int_equal(c.e[1].meta.world_size, 3);
  assert_int_equal(c.e[1].meta.n_tensors, 0);
  assert_string_equal(c.e[2].name, "c2");
  assert_string_equal(c.e[3].name, "unf");
  assert_int_equal(c.e[3].state, CKPT_CAT_UNFINISHED);
  assert_false(c.e[3].held);
  assert_int_equal(c.e[3].disk_bytes, 0); /* only with full */
  ckpt__catalog_free(&c);

  /* A writer's shared flock: held, and not removed while it is. */
  snprintf(path, sizeof(path), "%s/unf", b);
  int w = open(path, O_RDONLY | O_DIRECTORY);
  assert_int_equal(flock(w, LOCK_SH), 0);
  assert_int_equal(ckpt__catalog_scan(bfd, true, &c), 0);
  assert_true(c.e[3].held);
  assert_int_equal(c.e[3].disk_bytes, 5);
  assert_int_equal(c.e[1].meta.n_tensors, 0); /* loaded whole: none */
  ckpt__catalog_free(&c);
  assert_int_equal(ckpt__checkpoint_remove(bfd, "unf", true), -EBUSY);
  assert_int_equal(access(path, F_OK), 0);
  close(w);

  /* Removal: .metadata and data gone, the directory too; twice is fine. */
  assert_int_equal(ckpt__checkpoint_remove(bfd, "c1", true), 0);
  snprintf(path, sizeof(path), "%s/c1", b);
  assert_int_equal(access(path, F_OK), -1);
  assert_int_equal(ckpt__checkpoint_remove(bfd, "c1", true), 0);
  assert_int_equal(ckpt__checkpoint_remove(bfd, "unf", true), 0);

  char **names;
  size_t n;
  assert_int_equal(ckpt__catalog_names(bfd, &names, &n), 0);
  assert_int_equal(n, 2);
  assert_string_equal(names[0], "bad");
  assert_string_equal(names[1], "c2");
  ckpt__catalog_names_free(names, n);

  close(bfd);
  char cmd[600];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", b);
  assert_int_equal(system(cmd), 0);
  free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(select_old_keeps_the_newest),
      cmocka_unit_test(scan_and_remove),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
