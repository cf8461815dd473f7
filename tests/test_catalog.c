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
#include <math.h>

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

/* A committed entry for the policy: step (-1: none), loss (NAN: none). */
static ckpt_metric_t loss_metric[16];
static ckpt_cat_entry_t stepped(const char *name, int64_t step,
                                int64_t created, double loss, bool prot) {
  ckpt_cat_entry_t e = entry(name, CKPT_CAT_COMMITTED, created, 0);
  e.step = step;
  e.is_protected = prot;
  if (loss == loss) {
    static int next;
    ckpt_metric_t *m = &loss_metric[next++ % 16];
    snprintf(m->key, sizeof(m->key), "loss");
    m->value = loss;
    e.meta.metrics = m;
    e.meta.n_metrics = 1;
  }
  return e;
}

/* Which of c's entries policy text keeps, as a string of k (kept) and r
 * (removed) in c's order, with keep_name. */
static const char *verdicts(const ckpt_catalog_t *c, const char *text,
                            const char *keep_name, unsigned *why) {
  static char out[32];
  ckpt_keep_policy_t p;
  assert_int_equal(ckpt_keep_policy_parse(text, strlen(text), &p), 0);
  bool rm[16];
  size_t n = ckpt__catalog_select_policy(c, &p, keep_name, rm, why);
  size_t count = 0;
  for (size_t i = 0; i < c->n; i++) {
    out[i] = rm[i] ? 'r' : 'k';
    count += rm[i];
  }
  out[c->n] = '\0';
  assert_int_equal(n, count);
  return out;
}

static void select_policy_orders_by_step(void **state) {
  (void)state;
  /* Name, creation time and step orders all differ. */
  ckpt_cat_entry_t e[] = {
      stepped("a", 3000, 100, 0.9, false),  /* 0 */
      stepped("b", 500, 200, 0.1, false),   /* 1: best loss */
      stepped("c", 1000, 300, 0.5, false),  /* 2: multiple of 1000 */
      stepped("d", 2500, 400, 0.95, true),  /* 3: protected */
      stepped("e", 1750, 500, 0.6, false),  /* 4 */
      stepped("f", 7100, 600, 0.8, false),  /* 5 */
      stepped("g", 1200, 700, 0.3, false),  /* 6: second best loss */
      stepped("h", -1, 800, NAN, false),    /* 7: no step, no loss */
      entry("u", CKPT_CAT_UNFINISHED, 0, 0),
      entry("x", CKPT_CAT_DAMAGED, 0, 0),
  };
  ckpt_catalog_t c = {.n = 10, .e = e};
  unsigned why[16];
  /* last:2 by step: a (3000) and f (7100), not the newest by time (g, h)
   * nor the last by name; the protected d stays; h (no step) is oldest. */
  assert_string_equal(verdicts(&c, "last:2", NULL, why), "krrkrkrrkk");
  assert_int_equal(why[0], CKPT_KEPT_LAST);
  assert_int_equal(why[3], CKPT_KEPT_PROTECTED);
  assert_int_equal(why[8], 0); /* not committed: not judged */
  /* every:1000: c; 3000 too; a step-less one never */
  assert_string_equal(verdicts(&c, "every:1000", NULL, why), "krkkrrrrkk");
  assert_int_equal(why[0], CKPT_KEPT_EVERY);
  /* best:2 by min loss: b and g; h has no loss: kept, unranked */
  assert_string_equal(verdicts(&c, "best:2:loss:min", NULL, why),
                      "rkrkrrkkkk");
  assert_int_equal(why[7], CKPT_KEPT_UNRANKED);
  assert_int_equal(why[1], CKPT_KEPT_BEST);
  /* max: a (0.9) and d (0.95, protected as well) */
  assert_string_equal(verdicts(&c, "best:2:loss:max", NULL, why),
                      "krrkrrrkkk");
  assert_int_equal(why[3], CKPT_KEPT_BEST | CKPT_KEPT_PROTECTED);
  /* a metric nobody has: every one unranked, all kept */
  assert_string_equal(verdicts(&c, "best:1:acc:max", NULL, why),
                      "kkkkkkkkkk");
  /* the rules together, and the one just committed */
  assert_string_equal(
      verdicts(&c, "last:2,every:1000,best:1:loss:min", "e", why),
      "kkkkkkrkkk");
  assert_int_equal(why[0], CKPT_KEPT_LAST | CKPT_KEPT_EVERY);
  assert_int_equal(why[4], CKPT_KEPT_CURRENT);
  char text[64];
  assert_string_equal(ckpt__catalog_why_text(why[0], text, sizeof(text)),
                      "last+every");
  /* ties of step: created_at orders them */
  e[5].step = 3000;
  assert_string_equal(verdicts(&c, "last:1", NULL, why), "rrrkrkrrkk");
  /* no rule: all kept */
  ckpt_keep_policy_t none = {0};
  bool rm[16];
  assert_int_equal(ckpt__catalog_select_policy(&c, &none, NULL, rm, why), 0);
  assert_int_equal(why[0], CKPT_KEPT_NO_POLICY);
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

/* Retention keys through a scan: the step recorded or from the name, the
 * commit word protect, and the marker of ckptctl protect over it. */
static void scan_retention_and_protect(void **state) {
  (void)state;
  int bfd;
  char *b = temp_backing(&bfd);
  char dir[600];
  ckpt_metric_t ms[] = {{"loss", 0.25}, {"acc", 1e-5}};
  const char *names[] = {"epoch=3-step=1200", "rec-7", "plain"};
  for (int i = 0; i < 3; i++) {
    snprintf(dir, sizeof(dir), "%s/%s", b, names[i]);
    assert_int_equal(mkdir(dir, 0700), 0);
    ckpt_metadata_t m = {.name = (char *)names[i], .save_id = "0123abcd",
                         .world_size = 1, .created_at = 1000};
    if (i == 1)
      m.has_step = true, m.step = 42, m.protect = true, m.metrics = ms,
      m.n_metrics = 2;
    char *err = NULL;
    assert_int_equal(ckpt_metadb_publish(dir, &m, false, &err), 0);
  }
  ckpt_catalog_t c;
  assert_int_equal(ckpt__catalog_scan(bfd, false, &c), 0);
  assert_int_equal(c.n, 3);
  assert_string_equal(c.e[0].name, "epoch=3-step=1200");
  assert_int_equal(c.e[0].step, 1200);
  assert_false(c.e[0].meta.has_step);
  assert_false(c.e[0].is_protected);
  assert_int_equal(c.e[1].step, -1); /* plain: no digits */
  assert_string_equal(c.e[2].name, "rec-7");
  assert_int_equal(c.e[2].step, 42); /* recorded wins over the name */
  assert_true(c.e[2].is_protected);
  assert_int_equal(c.e[2].meta.n_metrics, 2);
  assert_string_equal(c.e[2].meta.metrics[0].key, "acc"); /* sorted */
  double v;
  assert_true(ckpt_metadata_metric(&c.e[2].meta, "loss", &v));
  assert_true(v == 0.25);
  ckpt__catalog_free(&c);

  /* The marker overrides the commit word both ways. */
  assert_int_equal(ckpt__checkpoint_protect(bfd, "rec-7", false), 0);
  assert_int_equal(ckpt__checkpoint_protect(bfd, "plain", true), 0);
  assert_int_equal(ckpt__checkpoint_protect(bfd, "nosuch", true), -ENOENT);
  assert_int_equal(ckpt__catalog_scan(bfd, false, &c), 0);
  assert_true(c.e[1].is_protected);
  assert_false(c.e[2].is_protected);
  ckpt__catalog_free(&c);
  snprintf(dir, sizeof(dir), "%s/plain/%s.tmp", b, CKPT_PROTECT_FILE);
  assert_int_equal(access(dir, F_OK), -1); /* renamed, not left */
  /* An unfinished save (no .metadata) cannot be marked. */
  snprintf(dir, sizeof(dir), "%s/unf", b);
  assert_int_equal(mkdir(dir, 0700), 0);
  assert_int_equal(ckpt__checkpoint_protect(bfd, "unf", true), -ENOENT);
  close(bfd);
  char cmd[600];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", b);
  assert_int_equal(system(cmd), 0);
  free(b);
}

/* NAME with save ID id and step (recorded) into root. */
static void publish_save(const char *root, const char *name, const char *id,
                         int64_t step) {
  char dir[600];
  snprintf(dir, sizeof(dir), "%s/%s", root, name);
  assert_int_equal(mkdir(dir, 0700), 0);
  ckpt_metadata_t m = {.name = (char *)name, .save_id = (char *)id,
                       .world_size = 1, .created_at = 1000,
                       .has_step = true, .step = step};
  char *err = NULL;
  assert_int_equal(ckpt_metadb_publish(dir, &m, false, &err), 0);
}

static bool present(const char *root, const char *name) {
  char p[600];
  snprintf(p, sizeof(p), "%s/%s", root, name);
  return access(p, F_OK) == 0;
}

/* tier_keep: only flushed tier checkpoints (no record, BACKING_DIR's
 * save) count and go; the last N of them by step stay. Stale ones (no
 * record, and BACKING_DIR's NAME another save or none: fs/read/resolve.c) go
 * whatever N; unflushed ones (a record) always stay. */
static void tier_evict_keeps_unflushed(void **state) {
  (void)state;
  int tfd, bfd;
  char *t = temp_backing(&tfd), *b = temp_backing(&bfd);
  /* flushed: s1 (step 100), s2 (300), s3 (200); z: flushed, step 50 */
  publish_save(t, "s1", "aa01", 100), publish_save(b, "s1", "aa01", 100);
  publish_save(t, "s2", "aa02", 300), publish_save(b, "s2", "aa02", 300);
  publish_save(t, "s3", "aa03", 200), publish_save(b, "s3", "aa03", 200);
  publish_save(t, "z", "aa09", 50), publish_save(b, "z", "aa09", 50);
  /* unflushed: u1 has a record of rank 1 (and is the newest step), u2 a
   * record of an older mount (SAVE_ID alone); stale: u3 is not in
   * BACKING_DIR (removed there), u4 is another save there (a replace
   * since) */
  publish_save(t, "u1", "bb01", 900);
  publish_save(t, "u2", "bb02", 10), publish_save(b, "u2", "bb02", 10);
  publish_save(t, "u3", "bb03", 20);
  publish_save(t, "u4", "bb04", 30), publish_save(b, "u4", "cc04", 30);
  char p[600];
  snprintf(p, sizeof(p), "%s/.flush", t);
  assert_int_equal(mkdir(p, 0700), 0);
  snprintf(p, sizeof(p), "%s/.flush/bb01.1", t);
  close(open(p, O_WRONLY | O_CREAT, 0600));
  snprintf(p, sizeof(p), "%s/.flush/bb02", t);
  close(open(p, O_WRONLY | O_CREAT, 0600));
  /* a record of another save whose ID begins the same: not s1's */
  snprintf(p, sizeof(p), "%s/.flush/aa01x", t);
  close(open(p, O_WRONLY | O_CREAT, 0600));

  char **gone;
  size_t n;
  assert_int_equal(ckpt__tier_evict(tfd, bfd, ".flush", 2, &gone, &n), 0);
  assert_int_equal(n, 4); /* z (50), s1 (100), stale u3, u4; s3, s2 stay */
  assert_false(present(t, "z"));
  assert_false(present(t, "s1"));
  assert_false(present(t, "u3") || present(t, "u4"));
  assert_true(present(t, "s2") && present(t, "s3"));
  assert_true(present(b, "s1") && present(b, "z")); /* BACKING_DIR's stay */
  assert_true(present(b, "u4"));
  assert_true(present(t, "u1") && present(t, "u2"));
  ckpt__catalog_names_free(gone, n);
  /* again: nothing more */
  assert_int_equal(ckpt__tier_evict(tfd, bfd, ".flush", 2, NULL, &n), 0);
  assert_int_equal(n, 0);
  /* 0: every flushed one goes, still no unflushed one */
  assert_int_equal(ckpt__tier_evict(tfd, bfd, ".flush", 0, NULL, &n), 0);
  assert_int_equal(n, 2);
  assert_false(present(t, "s2") || present(t, "s3"));
  assert_true(present(t, "u1") && present(t, "u2"));
  /* records that cannot be listed: nothing removed */
  publish_save(t, "s5", "aa05", 500), publish_save(b, "s5", "aa05", 500);
  snprintf(p, sizeof(p), "%s/.flush", t);
  char q[600];
  snprintf(q, sizeof(q), "%s/.flush-moved", t);
  assert_int_equal(rename(p, q), 0);
  assert_int_equal(symlink(q, p), 0);
  assert_true(ckpt__tier_evict(tfd, bfd, ".flush", 0, NULL, &n) < 0);
  assert_true(present(t, "s5"));
  close(tfd), close(bfd);
  char cmd[1300];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s' '%s'", t, b);
  assert_int_equal(system(cmd), 0);
  free(t), free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(tier_evict_keeps_unflushed),
      cmocka_unit_test(select_old_keeps_the_newest),
      cmocka_unit_test(select_policy_orders_by_step),
      cmocka_unit_test(scan_retention_and_protect),
      cmocka_unit_test(scan_and_remove),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
