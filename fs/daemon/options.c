/*
 * options.c - the command line of ckptfs:
 *
 *   ckptfs [-f] [-o OPT[,OPT...]] BACKING_DIR MOUNTPOINT
 *
 * ckptfs's own -o options are parsed and validated here; the standard FUSE
 * options stay in args for fuse_session_new. A malformed value is an error
 * with a message (the caller exits 2, nothing mounted).
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"

enum {
  KEY_STAGING_MEM,
  KEY_COMMIT_TIMEOUT,
  KEY_IO_THREADS,
  KEY_READAHEAD,
  KEY_SYNC_FILES,
  KEY_DIRECT_READS,
  KEY_PASSTHROUGH,
  KEY_VERIFY,
  KEY_VERIFY_SHARED,
  KEY_REPLICA_CHECK,
  KEY_KEEP_LAST,
  KEY_KEEP,
  KEY_TIER_KEEP,
  KEY_SAFETENSORS_SHARD,
  KEY_LOG,
  KEY_METRICS,
  KEY_TIER,
  KEY_FLUSH_RATE,
  KEY_TIER_LEVEL,
  KEY_PARTNER_GRACE,
  KEY_FOREGROUND,
  KEY_HELP,
  KEY_VERSION,
};

static const struct fuse_opt opt_spec[] = {
    FUSE_OPT_KEY("staging_mem=", KEY_STAGING_MEM),
    FUSE_OPT_KEY("commit_timeout=", KEY_COMMIT_TIMEOUT),
    FUSE_OPT_KEY("io_threads=", KEY_IO_THREADS),
    FUSE_OPT_KEY("readahead=", KEY_READAHEAD),
    FUSE_OPT_KEY("sync_files=", KEY_SYNC_FILES),
    FUSE_OPT_KEY("direct_reads=", KEY_DIRECT_READS),
    FUSE_OPT_KEY("passthrough=", KEY_PASSTHROUGH),
    FUSE_OPT_KEY("verify=", KEY_VERIFY),
    FUSE_OPT_KEY("verify_shared=", KEY_VERIFY_SHARED),
    FUSE_OPT_KEY("replica_check=", KEY_REPLICA_CHECK),
    FUSE_OPT_KEY("keep_last=", KEY_KEEP_LAST),
    FUSE_OPT_KEY("keep=", KEY_KEEP),
    FUSE_OPT_KEY("tier_keep=", KEY_TIER_KEEP),
    FUSE_OPT_KEY("safetensors_shard=", KEY_SAFETENSORS_SHARD),
    FUSE_OPT_KEY("log=", KEY_LOG),
    FUSE_OPT_KEY("metrics=", KEY_METRICS),
    FUSE_OPT_KEY("tier=", KEY_TIER),
    FUSE_OPT_KEY("flush_rate=", KEY_FLUSH_RATE),
    FUSE_OPT_KEY("tier_level=", KEY_TIER_LEVEL),
    FUSE_OPT_KEY("partner_grace=", KEY_PARTNER_GRACE),
    FUSE_OPT_KEY("-f", KEY_FOREGROUND),
    FUSE_OPT_KEY("-h", KEY_HELP),
    FUSE_OPT_KEY("--help", KEY_HELP),
    FUSE_OPT_KEY("-V", KEY_VERSION),
    FUSE_OPT_KEY("--version", KEY_VERSION),
    FUSE_OPT_END,
};

/* --help: what ckptfs -h prints. */
static const char help_text[] =
    "usage: ckptfs [-f] [-o OPT[,OPT...]] BACKING_DIR MOUNTPOINT\n"
    "\n"
    "Mount a ckptfs rank: files written under MOUNTPOINT/NAME/ form a\n"
    "checkpoint; `echo sync > MOUNTPOINT/NAME/.commit` saves it to\n"
    "BACKING_DIR. Under mpirun each process is one rank; %r in\n"
    "MOUNTPOINT is replaced by the rank.\n"
    "\n"
    "options:\n"
    "  -f                      stay in the foreground\n"
    "  -h, --help              print this help and exit\n"
    "  -V, --version           print the version and exit\n"
    "  -o staging_mem=SIZE     RAM for staged writes, K/M/G/T suffixes "
    "(default: 25% of RAM)\n"
    "  -o commit_timeout=SEC   how long a commit waits for every rank "
    "(default: 600)\n"
    "  -o io_threads=N         threads writing data files per rank, 1-256 "
    "(default: 4)\n"
    "  -o readahead=SIZE       kernel readahead of the mount, up to 1G; 0 "
    "keeps the\n"
    "                          kernel's (default: 16M; needs root, else "
    "ignored)\n"
    "  -o sync_files=0|1       fsync data and metadata before a commit "
    "succeeds (default: 1)\n"
    "  -o direct_reads=0|1     committed tensors read straight from the "
    "data files'\n"
    "                          cache, not cached twice; 0 allows shared "
    "mmap (default: 1)\n"
    "  -o passthrough=0|1      staged files written and read by FUSE "
    "passthrough\n"
    "                          (kernel >= 6.9, libfuse >= 3.16; needs root): "
    "their bytes\n"
    "                          are written once, never through the daemon; "
    "falls back\n"
    "                          to the daemon's path where unavailable "
    "(default: 1)\n"
    "  -o verify=0|1           check each chunk's XXH3-64 before a read "
    "first serves it\n"
    "                          (again after its data file changed); EIO on "
    "a mismatch\n"
    "                          (default: 1)\n"
    "  -o verify_shared=DIR|none\n"
    "                          chunks verified on this node since it booted, "
    "by any mount\n"
    "                          sharing DIR (mode 0700, the daemon's user's), "
    "are not\n"
    "                          hashed again while their data file is "
    "unchanged\n"
    "                          (default: /run/ckptfs as root, else "
    "$XDG_RUNTIME_DIR/ckptfs)\n"
    "  -o replica_check=error|warn|off\n"
    "                          replicas of one chunk that differ between "
    "ranks (default: error)\n"
    "  -o keep=POLICY          after each commit, remove the committed "
    "checkpoints of\n"
    "                          BACKING_DIR that no rule keeps (ordered by "
    "step): last:N,\n"
    "                          every:K (steps that are multiples of K), "
    "best:M:KEY:min|max\n"
    "                          (by metric KEY), joined by commas; "
    "protected ones and\n"
    "                          the one just committed stay (default: keep "
    "all)\n"
    "  -o keep_last=N          the same as keep=last:N; 0 keeps all\n"
    "                          (default: 0)\n"
    "  -o tier_keep=N          with tier=: keep the last N flushed "
    "checkpoints (by step)\n"
    "                          in the tier too; unflushed ones always stay "
    "(default: 0)\n"
    "  -o safetensors_shard=SIZE\n"
    "                          tensor bytes per file of NAME/.safetensors, "
    "K/M/G suffixes\n"
    "                          (default: 5000000000, save_pretrained's "
    "5GB)\n"
    "  -o log=FILE             append the daemon's log lines to FILE, "
    "%r: the rank\n"
    "                          (default: stderr; syslog once "
    "daemonized)\n"
    "  -o metrics=FILE         write the mount's metrics to FILE (every "
    "2 s and at\n"
    "                          unmount), Prometheus text format; %r: the "
    "rank; its\n"
    "                          directory must exist (default: none)\n"
    "  -o tier=DIR             commit into DIR, a node-local directory on "
"another\n"
    "                          filesystem than BACKING_DIR (tmpfs, NVMe; "
"private to\n"
    "                          the daemon's user), shared by the ranks of a "
"node, and\n"
    "                          copy each checkpoint to BACKING_DIR in the "
"background;\n"
    "                          `sync level=shared` commits go to "
"BACKING_DIR directly\n"
    "                          (default: none)\n"
    "  -o flush_rate=SIZE      bytes per second that copy may use, K/M/G "
"suffixes; 0:\n"
    "                          unlimited (default: 0)\n"
    "  -o tier_level=local|partner\n"
    "                          what a commit waits for: the node's tier "
"(local), or\n"
    "                          also a copy of each rank's data in the tier "
"of its\n"
    "                          partner rank on the next node (partner; "
"needs tier=\n"
    "                          and a world on two nodes or more) "
"(default: local)\n"
    "  -o partner_grace=SEC    a partner copy of a rank whose node is in "
"the world\n"
    "                          is flushed from here only if that node has "
"not\n"
    "                          flushed it SEC seconds after this mount "
"took it\n"
    "                          (default: 120)\n"
    "  -o allow_other, -o default_permissions, -o auto_unmount, ...\n"
    "                          standard FUSE mount options (default: off)\n"
    "  -o rw|ro, nodev, nosuid, noexec, noatime, ...\n"
    "                          kernel mount flags (default: rw)\n"
    "  -o noauto, nofail, _netdev, user, users, x-*, ...\n"
    "                          /etc/fstab-only options: ignored\n"
    "\n"
    "/etc/fstab: BACKING_DIR MOUNTPOINT fuse.ckptfs OPTIONS 0 0 (mount(8)\n"
    "runs mount.fuse3, which runs `ckptfs BACKING_DIR MOUNTPOINT -o OPTIONS`\n"
    "with ckptfs found in /usr/local/bin, /usr/bin or /bin).\n";

void ckpt__opts_help(void) { fputs(help_text, stdout); }

/* Options meant for mount(8), systemd or the mount.fuse3 helper that can
 * reach the daemon when it is run by hand or by another helper; libfuse
 * would refuse them. Other FUSE filesystems (sshfs) drop them too. */
static bool fstab_only(const char *arg) {
  static const char *const names[] = {"auto",  "noauto", "nofail", "_netdev",
                                      "user",  "nouser", "users",  "owner",
                                      "group", "defaults"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (!strcmp(arg, names[i]))
      return true;
  return !strncmp(arg, "x-", 2) || !strncmp(arg, "comment=", 8);
}

int ckpt__parse_size(const char *s, uint64_t *out) {
  if (!*s || *s < '0' || *s > '9')
    return -EINVAL;
  uint64_t v = 0;
  const char *p = s;
  for (; *p >= '0' && *p <= '9'; p++) {
    uint64_t d = (uint64_t)(*p - '0');
    if (v > (UINT64_MAX - d) / 10)
      return -EINVAL;
    v = v * 10 + d;
  }
  unsigned shift = 0;
  switch (*p) {
  case '\0':
    break;
  case 'k': case 'K': shift = 10; break;
  case 'm': case 'M': shift = 20; break;
  case 'g': case 'G': shift = 30; break;
  case 't': case 'T': shift = 40; break;
  default:
    return -EINVAL;
  }
  if (shift) {
    p++;
    if (*p == 'i' || *p == 'I')
      p++;
    if (*p == 'b' || *p == 'B')
      p++;
  }
  if (*p || (shift && v > (UINT64_MAX >> shift)))
    return -EINVAL;
  *out = v << shift;
  return 0;
}

static int parse_uint(const char *s, uint64_t max, uint64_t *out) {
  if (!*s || *s < '0' || *s > '9')
    return -EINVAL;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end || v > max)
    return -EINVAL;
  *out = v;
  return 0;
}

typedef struct {
  ckpt_opts_t *o;
  char *err; /* first problem */
  int nonopts;
  /* -o keep=last:5,every:1000: the option parser splits at the commas,
   * so the rules after the first come as options of their own; they are
   * gathered here and parsed at the end. */
  char keep[512];
  bool keep_open; /* the last option was keep= or one of its rules */
} parse_state_t;

/* A rule of keep= that came as an option of its own (see keep_open). */
static bool keep_rule(const char *arg) {
  return !strncmp(arg, "last:", 5) || !strncmp(arg, "every:", 6) ||
         !strncmp(arg, "best:", 5);
}

/* Remember the first problem: "invalid NAME 'VALUE': expected WHAT". */
static int bad(parse_state_t *ps, const char *name, const char *val,
               const char *what) {
  if (!ps->err)
    ps->err = ckpt__strdup_printf("invalid %s '%s': expected %s", name, val,
                                  what);
  return 0; /* keep parsing; the error is reported after */
}

#define NOT_MINE 2 /* an opt_* function's: not one of its keys */

/* Where things go: staging_mem, log, metrics, verify_shared, tier,
 * flush_rate, tier_level. NOT_MINE for another key. */
static int opt_storage(parse_state_t *ps, int key, const char *val) {
  ckpt_opts_t *o = ps->o;
  uint64_t v;
  switch (key) {
  case KEY_STAGING_MEM:
    if (ckpt__parse_size(val, &v) || v == 0)
      return bad(ps, "staging_mem", val, "a size like 512M or 4G");
    o->staging_mem = v;
    return 0;
  case KEY_LOG:
    if (!*val)
      return bad(ps, "log", val, "a file name");
    free(o->log_file);
    o->log_file = strdup(val);
    return 0;
  case KEY_METRICS: {
    /* a file name: not empty, not a directory's (FILE.tmp.PID is made
     * next to it, then renamed over it) */
    size_t n = strlen(val);
    const char *base = strrchr(val, '/');
    base = base ? base + 1 : val;
    if (!n || val[n - 1] == '/' || !strcmp(base, ".") || !strcmp(base, ".."))
      return bad(ps, "metrics", val, "a file name, like /var/lib/"
                 "node_exporter/ckptfs.prom");
    free(o->metrics_file);
    o->metrics_file = strdup(val);
    return 0;
  }
  case KEY_VERIFY_SHARED:
    if (!*val)
      return bad(ps, "verify_shared", val, "a directory, or none");
    free(o->verify_shared);
    o->verify_shared = strdup(val);
    return 0;
  case KEY_TIER:
    if (!*val)
      return bad(ps, "tier", val, "a directory");
    free(o->tier_dir);
    o->tier_dir = strdup(val);
    return 0;
  case KEY_FLUSH_RATE:
    if (ckpt__parse_size(val, &v))
      return bad(ps, "flush_rate", val, "bytes per second like 200M, or 0");
    o->flush_rate = v;
    return 0;
  case KEY_TIER_LEVEL:
    if (strcmp(val, "local") && strcmp(val, "partner"))
      return bad(ps, "tier_level", val, "local or partner");
    o->tier_partner = !strcmp(val, "partner");
    return 0;
  default:
    return NOT_MINE;
  }
}

/* How the mount runs: commit_timeout, partner_grace, io_threads,
 * readahead, the 0/1 flags, replica_check, safetensors_shard. NOT_MINE for another key. */
static int opt_tuning(parse_state_t *ps, int key, const char *val) {
  ckpt_opts_t *o = ps->o;
  uint64_t v;
  switch (key) {
  case KEY_COMMIT_TIMEOUT: {
    char *end;
    errno = 0;
    double t = strtod(val, &end);
    if (!*val || *end || errno || !(t > 0) || t > 1e9)
      return bad(ps, "commit_timeout", val, "seconds > 0");
    o->commit_timeout = t;
    return 0;
  }
  case KEY_PARTNER_GRACE: {
    char *end;
    errno = 0;
    double t = strtod(val, &end);
    if (!*val || *end || errno || !(t >= 0) || t > 1e9)
      return bad(ps, "partner_grace", val, "seconds >= 0");
    o->partner_grace = t;
    return 0;
  }
  case KEY_IO_THREADS:
    if (parse_uint(val, 256, &v) || v == 0)
      return bad(ps, "io_threads", val, "1 to 256");
    o->io_threads = (uint32_t)v;
    return 0;
  case KEY_READAHEAD:
    if (ckpt__parse_size(val, &v) || v > ((uint64_t)1 << 30))
      return bad(ps, "readahead", val, "a size up to 1G, like 16M, or 0");
    o->readahead = v;
    return 0;
  case KEY_SYNC_FILES:
  case KEY_DIRECT_READS:
  case KEY_PASSTHROUGH:
  case KEY_VERIFY: {
    bool *flag = key == KEY_SYNC_FILES     ? &o->sync_files
                 : key == KEY_DIRECT_READS ? &o->direct_reads
                 : key == KEY_PASSTHROUGH  ? &o->passthrough
                                           : &o->verify;
    if (strcmp(val, "0") && strcmp(val, "1"))
      return bad(ps, key == KEY_SYNC_FILES     ? "sync_files"
                     : key == KEY_DIRECT_READS ? "direct_reads"
                     : key == KEY_PASSTHROUGH  ? "passthrough"
                                               : "verify",
                 val, "0 or 1");
    *flag = val[0] == '1';
    if (key == KEY_PASSTHROUGH)
      o->passthrough_set = true;
    return 0;
  }
  case KEY_REPLICA_CHECK:
    if (!strcmp(val, "error"))
      o->replica_check = CKPT_REPLICA_ERROR;
    else if (!strcmp(val, "warn"))
      o->replica_check = CKPT_REPLICA_WARN;
    else if (!strcmp(val, "off"))
      o->replica_check = CKPT_REPLICA_OFF;
    else
      return bad(ps, "replica_check", val, "error, warn or off");
    return 0;
  case KEY_SAFETENSORS_SHARD:
    if (ckpt__parse_size(val, &v) || v == 0)
      return bad(ps, "safetensors_shard", val, "a size like 500M or 5G");
    o->safetensors_shard = v;
    return 0;
  default:
    return NOT_MINE;
  }
}

/* What is kept: keep=, keep_last=, tier_keep=. NOT_MINE for another key. */
static int opt_retention(parse_state_t *ps, int key, const char *val) {
  ckpt_opts_t *o = ps->o;
  uint64_t v;
  switch (key) {
  case KEY_KEEP_LAST:
  case KEY_KEEP:
    if (o->keep_text[0])
      return bad(ps, key == KEY_KEEP ? "keep" : "keep_last", val,
                 "one retention option (keep= or keep_last=), once");
    if (key == KEY_KEEP_LAST) {
      if (parse_uint(val, UINT32_MAX, &v))
        return bad(ps, "keep_last", val,
                   "a number of checkpoints, 0 for all");
      o->keep.last = (uint32_t)v;
    } else {
      snprintf(ps->keep, sizeof(ps->keep), "%s", val); /* parsed at the end */
    }
    snprintf(o->keep_text, sizeof(o->keep_text), "%s=%s",
             key == KEY_KEEP ? "keep" : "keep_last", val);
    return 0;
  case KEY_TIER_KEEP:
    if (parse_uint(val, UINT32_MAX, &v))
      return bad(ps, "tier_keep", val, "a number of checkpoints, or 0");
    o->tier_keep = (uint32_t)v;
    return 0;
  default:
    return NOT_MINE;
  }
}

static int opt_proc(void *data, const char *arg, int key,
                    struct fuse_args *outargs) {
  (void)outargs;
  parse_state_t *ps = data;
  ckpt_opts_t *o = ps->o;
  bool rule = key == FUSE_OPT_KEY_OPT && ps->keep_open && keep_rule(arg);
  ps->keep_open = (key == KEY_KEEP || rule) && !ps->err;
  if (rule) {
    size_t n = strlen(ps->keep);
    snprintf(ps->keep + n, sizeof(ps->keep) - n, ",%s", arg);
    return 0;
  }
  const char *val = strchr(arg, '=');
  val = val ? val + 1 : "";
  int rc = opt_storage(ps, key, val);
  if (rc == NOT_MINE)
    rc = opt_tuning(ps, key, val);
  if (rc == NOT_MINE)
    rc = opt_retention(ps, key, val);
  if (rc != NOT_MINE)
    return rc;
  switch (key) {
  case KEY_FOREGROUND:
    o->foreground = true;
    return 0;
  case KEY_HELP:
    o->show_help = true;
    return 0;
  case KEY_VERSION:
    o->show_version = true;
    return 0;
  case FUSE_OPT_KEY_NONOPT:
    ps->nonopts++;
    if (!o->backing_dir)
      o->backing_dir = strdup(arg);
    else if (!o->mountpoint)
      o->mountpoint = strdup(arg);
    else
      return bad(ps, "argument", arg, "only BACKING_DIR and MOUNTPOINT");
    return 0;
  default:
    if (key == FUSE_OPT_KEY_OPT && fstab_only(arg))
      return 0; /* dropped */
    return 1; /* a FUSE option: keep it */
  }
}

static uint64_t default_staging_mem(void) {
  long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || psize <= 0)
    return (uint64_t)1 << 30;
  return (uint64_t)pages * (uint64_t)psize / 4;
}

int ckpt__opts_parse(struct fuse_args *args, ckpt_opts_t *o, char **err) {
  memset(o, 0, sizeof(*o));
  o->staging_mem = default_staging_mem();
  o->commit_timeout = 600;
  o->partner_grace = 120;
  o->io_threads = 4;
  o->readahead = (uint64_t)16 << 20;
  o->sync_files = true;
  o->direct_reads = true;
  o->verify = true;
  o->passthrough = true;
  o->replica_check = CKPT_REPLICA_ERROR;
  o->safetensors_shard = UINT64_C(5000000000); /* save_pretrained's "5GB" */
  parse_state_t ps = {.o = o};
  if (fuse_opt_parse(args, &ps, opt_spec, opt_proc) == -1 && !ps.err)
    ps.err = strdup("cannot parse the options");
  if (!ps.err && o->keep_text[0] == 'k' && !strncmp(o->keep_text, "keep=", 5)) {
    if (ckpt_keep_policy_parse(ps.keep, strlen(ps.keep), &o->keep))
      bad(&ps, "keep", ps.keep,
          "rules last:N, every:K, best:M:KEY:min|max joined by commas, "
          "each at most once, like last:5,every:1000,best:3:loss:min");
    /* for log lines only: a longer policy is cut */
    snprintf(o->keep_text, sizeof(o->keep_text), "keep=%.*s",
             (int)sizeof(o->keep_text) - 6, ps.keep);
  }
  if (!ps.err && o->tier_keep && !o->tier_dir)
    ps.err = strdup("tier_keep=N needs tier=DIR: it is how many flushed "
                    "checkpoints that tier keeps");
  if (!ps.err && !o->show_help && !o->show_version &&
      (!o->backing_dir || !o->mountpoint))
    ps.err = strdup("missing BACKING_DIR or MOUNTPOINT "
                    "(usage: ckptfs [-f] [-o OPT,...] BACKING_DIR "
                    "MOUNTPOINT)");
  if (!ps.err && o->tier_partner && !o->tier_dir)
    ps.err = strdup("tier_level=partner needs tier=DIR: partner copies are "
                    "kept in the tier of the partner's node");
  if (ps.err) {
    *err = ps.err;
    return -EINVAL;
  }
  return 0;
}

void ckpt__opts_free(ckpt_opts_t *o) {
  free(o->backing_dir);
  free(o->mountpoint);
  free(o->log_file);
  free(o->metrics_file);
  free(o->tier_dir);
  free(o->verify_shared);
  o->backing_dir = o->mountpoint = o->log_file = o->metrics_file = NULL;
  o->tier_dir = o->verify_shared = NULL;
}
