/*
 * test_options.c - fs/daemon/options.c without a mount: sizes
 * (ckpt__parse_size: suffixes, overflow, garbage), and the command line
 * (ckpt__opts_parse over a struct fuse_args made from an argv as main
 * gets it): ckptfs's own -o options parsed and taken out of args, the
 * standard FUSE ones left there for fuse_session_new, /etc/fstab-only
 * ones dropped, and every malformed value an -EINVAL whose message names
 * the option and the value.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"

/* ------------------------------------------------------------------------
 * ckpt__parse_size
 * ---------------------------------------------------------------------- */

static void parse_size_accepts_numbers_and_suffixes(void **state) {
  (void)state;
  static const struct {
    const char *s;
    uint64_t want;
  } good[] = {
      {"0", 0},
      {"4096", 4096},
      {"1k", 1024},
      {"1K", 1024},
      {"1KiB", 1024},
      {"3kb", 3072},
      {"64M", UINT64_C(64) << 20},
      {"64m", UINT64_C(64) << 20},
      {"64MiB", UINT64_C(64) << 20},
      {"64MB", UINT64_C(64) << 20},
      {"64Mi", UINT64_C(64) << 20},
      {"1G", UINT64_C(1) << 30},
      {"1g", UINT64_C(1) << 30},
      {"5GiB", UINT64_C(5) << 30},
      {"2T", UINT64_C(2) << 40},
      {"007", 7},
      {"18446744073709551615", UINT64_MAX},
      {"16777215T", UINT64_C(16777215) << 40}, /* the largest in T */
      {"17179869183G", UINT64_C(17179869183) << 30},
  };
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    uint64_t v = 12345;
    if (ckpt__parse_size(good[i].s, &v) != 0)
      fail_msg("\"%s\" refused", good[i].s);
    if (v != good[i].want)
      fail_msg("\"%s\": got %llu, expected %llu", good[i].s,
               (unsigned long long)v, (unsigned long long)good[i].want);
  }
}

static void parse_size_refuses_garbage_and_overflow(void **state) {
  (void)state;
  static const char *const bad[] = {
      "",  "M", "-1", "+1", " 1", "1 ", "1.5G", "1e6", "0x10", "12abc",
      "1B", "1iB", "1MM", "1MBi", "1Mx", "1P", "1E", "G1", "1,000", "1_000",
      /* overflow: digits, then the suffix's shift */
      "18446744073709551616", "99999999999999999999",
      "184467440737095516150", "16777216T", "17179869184G",
      "18014398509481984K",
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint64_t v = 777;
    int rc = ckpt__parse_size(bad[i], &v);
    if (rc != -EINVAL)
      fail_msg("\"%s\": got %d (value %llu), expected -EINVAL", bad[i], rc,
               (unsigned long long)v);
    assert_int_equal(v, 777); /* untouched */
  }
}

/* ------------------------------------------------------------------------
 * ckpt__opts_parse
 * ---------------------------------------------------------------------- */

/* One parse of argv (NULL-terminated, argv[0] the program): its result,
 * and what it leaves in args. */
typedef struct {
  char *argv[32];
  struct fuse_args args;
  ckpt_opts_t o;
  char *err;
  int rc;
} parse_t;

static parse_t *parse_argv(const char *const *argv) {
  parse_t *p = calloc(1, sizeof(*p));
  assert_non_null(p);
  int argc = 0;
  for (; argv[argc]; argc++) {
    assert_true(argc < 31);
    p->argv[argc] = (char *)argv[argc];
  }
  p->args = (struct fuse_args)FUSE_ARGS_INIT(argc, p->argv);
  p->rc = ckpt__opts_parse(&p->args, &p->o, &p->err);
  /* an error, and only an error, says why */
  assert_true(p->rc == 0 || p->rc == -EINVAL);
  if (p->rc == 0)
    assert_null(p->err);
  else
    assert_non_null(p->err);
  return p;
}

#define PARSE(...) parse_argv((const char *const[]){"ckptfs", __VA_ARGS__, NULL})

static void parse_done(parse_t *p) {
  ckpt__opts_free(&p->o);
  fuse_opt_free_args(&p->args);
  free(p->err);
  free(p);
}

/* Where s is in what the parse left in args, or -1. */
static int arg_at(const parse_t *p, const char *s) {
  for (int i = 0; i < p->args.argc; i++)
    if (strcmp(p->args.argv[i], s) == 0)
      return i;
  return -1;
}

/* Does any argument left contain s? */
static bool args_mention(const parse_t *p, const char *s) {
  for (int i = 0; i < p->args.argc; i++)
    if (strstr(p->args.argv[i], s))
      return true;
  return false;
}

/* The parse failed, saying "invalid NAME 'VALUE': expected ...". */
static void assert_invalid(const parse_t *p, const char *name,
                           const char *val) {
  char want[256];
  snprintf(want, sizeof(want), "invalid %s '%s': expected ", name, val);
  if (p->rc != -EINVAL)
    fail_msg("%s=%s: got %d, expected -EINVAL", name, val, p->rc);
  if (strncmp(p->err, want, strlen(want)) != 0)
    fail_msg("%s=%s: message \"%s\", expected it to start \"%s\"", name, val,
             p->err, want);
}

/* Only the two directories: the defaults, nothing left but argv[0]. */
static void defaults(void **state) {
  (void)state;
  parse_t *p = PARSE("/backing", "/mnt/%r");
  assert_int_equal(p->rc, 0);
  assert_string_equal(p->o.backing_dir, "/backing");
  assert_string_equal(p->o.mountpoint, "/mnt/%r");
  assert_true(p->o.staging_mem > 0);
  assert_true(p->o.commit_timeout == 600.0);
  assert_true(p->o.partner_grace == 120.0);
  assert_int_equal(p->o.io_threads, 4);
  assert_int_equal(p->o.readahead, UINT64_C(16) << 20);
  assert_true(p->o.sync_files);
  assert_true(p->o.direct_reads);
  assert_true(p->o.verify);
  assert_true(p->o.passthrough);
  assert_false(p->o.passthrough_set);
  assert_int_equal(p->o.replica_check, CKPT_REPLICA_ERROR);
  assert_int_equal(p->o.safetensors_shard, UINT64_C(5000000000));
  assert_int_equal(p->o.keep.last, 0);
  assert_int_equal(p->o.keep.every, 0);
  assert_int_equal(p->o.keep.best, 0);
  assert_string_equal(p->o.keep_text, "");
  assert_int_equal(p->o.tier_keep, 0);
  assert_null(p->o.tier_dir);
  assert_null(p->o.log_file);
  assert_null(p->o.metrics_file);
  assert_false(p->o.foreground);
  assert_false(p->o.show_help);
  assert_false(p->o.tier_partner);
  assert_int_equal(p->o.flush_rate, 0);
  assert_int_equal(p->args.argc, 1);
  assert_string_equal(p->args.argv[0], "ckptfs");
  parse_done(p);
}

/* ckptfs's options are parsed and leave args; FUSE's stay there, in the
 * order libfuse wants them (-o OPTS first). */
static void own_options_parsed_fuse_options_kept(void **state) {
  (void)state;
  parse_t *p = PARSE("-o",
                     "staging_mem=64M,io_threads=8,allow_other,"
                     "commit_timeout=2.5,verify=0,passthrough=0",
                     "-f", "-d", "/b", "-o",
                     "keep_last=5,tier=/t,tier_keep=3,default_permissions",
                     "/m");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.staging_mem, UINT64_C(64) << 20);
  assert_int_equal(p->o.io_threads, 8);
  assert_true(p->o.commit_timeout == 2.5);
  assert_false(p->o.verify);
  assert_false(p->o.passthrough);
  assert_true(p->o.passthrough_set);
  assert_int_equal(p->o.keep.last, 5);
  assert_string_equal(p->o.keep_text, "keep_last=5");
  assert_string_equal(p->o.tier_dir, "/t");
  assert_int_equal(p->o.tier_keep, 3);
  assert_true(p->o.foreground);
  assert_string_equal(p->o.backing_dir, "/b");
  assert_string_equal(p->o.mountpoint, "/m");
  /* left: ckptfs -o allow_other,default_permissions -d */
  assert_int_equal(p->args.argc, 4);
  int o = arg_at(p, "-o");
  assert_int_equal(o, 1);
  assert_string_equal(p->args.argv[o + 1], "allow_other,default_permissions");
  assert_int_equal(arg_at(p, "-d"), 3);
  assert_int_equal(arg_at(p, "-f"), -1);
  assert_false(args_mention(p, "staging_mem"));
  assert_false(args_mention(p, "tier"));
  assert_false(args_mention(p, "/b"));
  assert_false(args_mention(p, "/m"));
  parse_done(p);
}

/* Each of the other options, with a good value. */
static void other_options_values(void **state) {
  (void)state;
  parse_t *p = PARSE("/b", "/m", "-o",
                     "readahead=0,sync_files=0,direct_reads=0,verify=1,"
                     "passthrough=1,replica_check=warn,"
                     "safetensors_shard=500M,log=/var/log/ckpt.%r.log,"
                     "metrics=/run/m.prom,tier=/nvme,flush_rate=200M,"
                     "tier_level=partner,partner_grace=0,io_threads=256,"
                     "commit_timeout=1e3,staging_mem=1T");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.readahead, 0);
  assert_false(p->o.sync_files);
  assert_false(p->o.direct_reads);
  assert_true(p->o.verify);
  assert_true(p->o.passthrough);
  assert_true(p->o.passthrough_set);
  assert_int_equal(p->o.replica_check, CKPT_REPLICA_WARN);
  assert_int_equal(p->o.safetensors_shard, UINT64_C(500) << 20);
  assert_string_equal(p->o.log_file, "/var/log/ckpt.%r.log");
  assert_string_equal(p->o.metrics_file, "/run/m.prom");
  assert_string_equal(p->o.tier_dir, "/nvme");
  assert_int_equal(p->o.flush_rate, UINT64_C(200) << 20);
  assert_true(p->o.tier_partner);
  assert_true(p->o.partner_grace == 0.0);
  assert_int_equal(p->o.io_threads, 256);
  assert_true(p->o.commit_timeout == 1000.0);
  assert_int_equal(p->o.staging_mem, UINT64_C(1) << 40);
  assert_int_equal(p->args.argc, 1);
  parse_done(p);
  p = PARSE("/b", "/m", "-o", "replica_check=off,readahead=1G");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.replica_check, CKPT_REPLICA_OFF);
  assert_int_equal(p->o.readahead, UINT64_C(1) << 30);
  parse_done(p);
  /* the last of an option given twice wins */
  p = PARSE("-o", "io_threads=2", "/b", "/m", "-o", "io_threads=3");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.io_threads, 3);
  parse_done(p);
}

/* keep=: its rules come split at the commas and are put together again;
 * an option after them is FUSE's again. */
static void keep_policy_rules(void **state) {
  (void)state;
  parse_t *p = PARSE("/b", "/m", "-o",
                     "keep=last:5,every:1000,best:3:loss:min,allow_other");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.keep.last, 5);
  assert_int_equal(p->o.keep.every, 1000);
  assert_int_equal(p->o.keep.best, 3);
  assert_string_equal(p->o.keep.metric, "loss");
  assert_false(p->o.keep.maximize);
  assert_string_equal(p->o.keep_text, "keep=last:5,every:1000,best:3:loss:min");
  assert_int_equal(p->args.argc, 3);
  assert_string_equal(p->args.argv[2], "allow_other");
  parse_done(p);
  p = PARSE("/b", "/m", "-o", "keep=best:2:acc:max");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.keep.last, 0);
  assert_int_equal(p->o.keep.best, 2);
  assert_string_equal(p->o.keep.metric, "acc");
  assert_true(p->o.keep.maximize);
  parse_done(p);
  /* keep_last=0: keep all */
  p = PARSE("/b", "/m", "-o", "keep_last=0");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->o.keep.last, 0);
  assert_string_equal(p->o.keep_text, "keep_last=0");
  parse_done(p);
}

/* A malformed value: -EINVAL, "invalid NAME 'VALUE': expected ...", and
 * the option keeps its default. */
static void malformed_values(void **state) {
  (void)state;
  static const struct {
    const char *opt, *name, *val;
  } cases[] = {
      {"staging_mem=0", "staging_mem", "0"},
      {"staging_mem=lots", "staging_mem", "lots"},
      {"staging_mem=1.5G", "staging_mem", "1.5G"},
      {"staging_mem=", "staging_mem", ""},
      {"staging_mem=99999999999999999999", "staging_mem",
       "99999999999999999999"},
      {"io_threads=0", "io_threads", "0"},
      {"io_threads=257", "io_threads", "257"},
      {"io_threads=8x", "io_threads", "8x"},
      {"io_threads=-1", "io_threads", "-1"},
      {"io_threads=", "io_threads", ""},
      {"commit_timeout=0", "commit_timeout", "0"},
      {"commit_timeout=-5", "commit_timeout", "-5"},
      {"commit_timeout=abc", "commit_timeout", "abc"},
      {"commit_timeout=", "commit_timeout", ""},
      {"commit_timeout=10s", "commit_timeout", "10s"},
      {"commit_timeout=nan", "commit_timeout", "nan"},
      {"commit_timeout=inf", "commit_timeout", "inf"},
      {"commit_timeout=2e9", "commit_timeout", "2e9"},
      {"verify=2", "verify", "2"},
      {"verify=yes", "verify", "yes"},
      {"verify=", "verify", ""},
      {"passthrough=true", "passthrough", "true"},
      {"passthrough=01", "passthrough", "01"},
      {"sync_files=on", "sync_files", "on"},
      {"direct_reads=-1", "direct_reads", "-1"},
      {"keep_last=x", "keep_last", "x"},
      {"keep_last=-1", "keep_last", "-1"},
      {"keep_last=4294967296", "keep_last", "4294967296"},
      {"keep=bogus", "keep", "bogus"},
      {"keep=last:0", "keep", "last:0"},
      {"keep=", "keep", ""},
      {"keep=last:2,last:3", "keep", "last:2,last:3"},
      {"tier_keep=x", "tier_keep", "x"},
      {"tier_keep=-2", "tier_keep", "-2"},
      {"readahead=2G", "readahead", "2G"},
      {"readahead=1025M", "readahead", "1025M"},
      {"replica_check=maybe", "replica_check", "maybe"},
      {"tier_level=remote", "tier_level", "remote"},
      {"safetensors_shard=0", "safetensors_shard", "0"},
      {"flush_rate=fast", "flush_rate", "fast"},
      {"partner_grace=-1", "partner_grace", "-1"},
      {"log=", "log", ""},
      {"metrics=", "metrics", ""},
      {"metrics=/tmp/", "metrics", "/tmp/"},
      {"metrics=/tmp/..", "metrics", "/tmp/.."},
      {"tier=", "tier", ""},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    parse_t *p = PARSE("-o", cases[i].opt, "/b", "/m");
    assert_invalid(p, cases[i].name, cases[i].val);
    /* no option of ours is left for libfuse */
    if (args_mention(p, cases[i].name))
      fail_msg("%s: left in args", cases[i].opt);
    parse_done(p);
  }
  /* the default stays where a value is refused */
  parse_t *p = PARSE("-o", "io_threads=0,commit_timeout=-1,verify=x", "/b",
                     "/m");
  assert_int_equal(p->o.io_threads, 4);
  assert_true(p->o.commit_timeout == 600.0);
  assert_true(p->o.verify);
  /* the first problem is the one reported */
  assert_invalid(p, "io_threads", "0");
  parse_done(p);
}

/* Combinations refused: two retention options, tier_keep or
 * tier_level=partner without tier, the directories missing or one too
 * many, -o without its options. */
static void refused_combinations(void **state) {
  (void)state;
  parse_t *p = PARSE("-o", "keep=last:2,keep_last=3", "/b", "/m");
  assert_invalid(p, "keep_last", "3");
  assert_non_null(strstr(p->err, "one retention option"));
  parse_done(p);
  p = PARSE("-o", "keep_last=3", "-o", "keep=last:2", "/b", "/m");
  assert_invalid(p, "keep", "last:2");
  parse_done(p);
  p = PARSE("-o", "keep_last=3,keep_last=4", "/b", "/m");
  assert_invalid(p, "keep_last", "4");
  parse_done(p);

  p = PARSE("-o", "tier_keep=2", "/b", "/m");
  assert_int_equal(p->rc, -EINVAL);
  assert_non_null(strstr(p->err, "tier_keep=N needs tier=DIR"));
  parse_done(p);
  p = PARSE("-o", "tier_keep=0", "/b", "/m"); /* none: no tier needed */
  assert_int_equal(p->rc, 0);
  parse_done(p);
  p = PARSE("-o", "tier_level=partner", "/b", "/m");
  assert_int_equal(p->rc, -EINVAL);
  assert_non_null(strstr(p->err, "tier_level=partner needs tier=DIR"));
  parse_done(p);
  p = PARSE("-o", "tier_level=local", "/b", "/m");
  assert_int_equal(p->rc, 0);
  assert_false(p->o.tier_partner);
  parse_done(p);

  p = PARSE("/b");
  assert_int_equal(p->rc, -EINVAL);
  assert_non_null(strstr(p->err, "missing BACKING_DIR or MOUNTPOINT"));
  parse_done(p);
  p = PARSE("-o", "io_threads=2");
  assert_int_equal(p->rc, -EINVAL);
  assert_non_null(strstr(p->err, "missing BACKING_DIR or MOUNTPOINT"));
  parse_done(p);
  p = PARSE("/b", "/m", "/extra");
  assert_invalid(p, "argument", "/extra");
  parse_done(p);
  p = PARSE("/b", "/m", "-o");
  assert_int_equal(p->rc, -EINVAL);
  assert_string_equal(p->err, "cannot parse the options");
  parse_done(p);
}

/* -h and -V need no directories. */
static void help_and_version(void **state) {
  (void)state;
  parse_t *p = PARSE("--help");
  assert_int_equal(p->rc, 0);
  assert_true(p->o.show_help);
  assert_false(p->o.show_version);
  parse_done(p);
  p = PARSE("-h");
  assert_int_equal(p->rc, 0);
  assert_true(p->o.show_help);
  parse_done(p);
  p = PARSE("-V");
  assert_int_equal(p->rc, 0);
  assert_true(p->o.show_version);
  parse_done(p);
  p = PARSE("--version", "/b");
  assert_int_equal(p->rc, 0);
  assert_true(p->o.show_version);
  parse_done(p);
}

/* Options of mount(8) and /etc/fstab that reach the daemon are dropped:
 * libfuse would refuse them. */
static void fstab_only_options_dropped(void **state) {
  (void)state;
  parse_t *p = PARSE("/b", "/m", "-o",
                     "noauto,x-systemd.automount,_netdev,nofail,users,"
                     "comment=ckpt,defaults,ro,nosuid");
  assert_int_equal(p->rc, 0);
  assert_int_equal(p->args.argc, 3);
  assert_string_equal(p->args.argv[1], "-o");
  assert_string_equal(p->args.argv[2], "ro,nosuid");
  parse_done(p);
}

/* ckpt__opts_free frees the strings and may be called again. */
static void opts_free_twice(void **state) {
  (void)state;
  parse_t *p = PARSE("-o", "log=/l,metrics=/m.prom,tier=/t", "/b", "/m");
  assert_int_equal(p->rc, 0);
  ckpt__opts_free(&p->o);
  assert_null(p->o.backing_dir);
  assert_null(p->o.mountpoint);
  assert_null(p->o.log_file);
  assert_null(p->o.metrics_file);
  assert_null(p->o.tier_dir);
  parse_done(p); /* frees them again */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(parse_size_accepts_numbers_and_suffixes),
      cmocka_unit_test(parse_size_refuses_garbage_and_overflow),
      cmocka_unit_test(defaults),
      cmocka_unit_test(own_options_parsed_fuse_options_kept),
      cmocka_unit_test(other_options_values),
      cmocka_unit_test(keep_policy_rules),
      cmocka_unit_test(malformed_values),
      cmocka_unit_test(refused_combinations),
      cmocka_unit_test(help_and_version),
      cmocka_unit_test(fstab_only_options_dropped),
      cmocka_unit_test(opts_free_twice),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
