/*
 * ckptctl_main.c - ckptctl, the administrator's command line over a
 * backing directory (no mount needed), and over an async save of a mount:
 *
 *   ckptctl ls     BACKING_DIR                  checkpoints and their state
 *   ckptctl show   BACKING_DIR NAME             tensors and blobs of one
 *   ckptctl diff   BACKING_DIR A B              what changed between two
 *   ckptctl export BACKING_DIR NAME --safetensors FILE
 *   ckptctl prune  BACKING_DIR --keep N [--dry-run]
 *   ckptctl wait   MOUNT/NAME [--timeout SEC]   follow an async save
 *
 * Every command prints text for people by default and one JSON document
 * with --json (keys listed in the README, "ckptctl"). Exit status: 0 done
 * (diff: identical), 1 the thing asked about is not so (diff: they differ;
 * wait: the save failed; others: something could not be done), 2 usage or
 * an error that stops the command (diff, wait), 3 wait timed out.
 *
 * It reads .metadata through metadb.c and lists and removes checkpoints
 * with catalog.c, as the mount does; safe to run while mounts run.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "catalog.h"
#include "ckpt_views.h"
#include "metadb.h"
#include "store.h"

#define EXIT_NO 1      /* diff: differ; wait: failed; others: not done */
#define EXIT_USAGE 2
#define EXIT_TIMEOUT 3 /* wait */

static const char *prog = "ckptctl";

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", prog);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* ------------------------------------------------------------------------
 * Output helpers: JSON (compact, one document), times, sizes.
 * ---------------------------------------------------------------------- */

typedef struct {
  FILE *f;
  int depth;
  bool first[64];  /* no member written yet at this depth */
  bool after_key;  /* the next value follows a key: no comma */
} json_t;

static void j_sep(json_t *j) {
  if (j->after_key) {
    j->after_key = false;
    return;
  }
  if (!j->first[j->depth])
    fputc(',', j->f);
  j->first[j->depth] = false;
}

/* A JSON string: valid UTF-8 copied, control characters escaped, bytes
 * that are not UTF-8 given as U+FFFD. */
static void j_strn(json_t *j, const char *s, size_t n) {
  j_sep(j);
  FILE *f = j->f;
  fputc('"', f);
  const unsigned char *p = (const unsigned char *)s, *end = p + n;
  while (p < end) {
    unsigned c = *p;
    if (c == '"' || c == '\\') {
      fprintf(f, "\\%c", c);
      p++;
    } else if (c == '\n') {
      fputs("\\n", f), p++;
    } else if (c == '\t') {
      fputs("\\t", f), p++;
    } else if (c < 0x20 || c == 0x7f) {
      fprintf(f, "\\u%04x", c), p++;
    } else if (c < 0x80) {
      fputc((int)c, f), p++;
    } else {
      /* Length of a well-formed sequence (no overlongs, no surrogates). */
      size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                   : c >= 0xe0 && c <= 0xef ? 3
                   : c >= 0xf0 && c <= 0xf4 ? 4
                                            : 0;
      bool ok = len > 0 && (size_t)(end - p) >= len;
      for (size_t k = 1; ok && k < len; k++)
        ok = (p[k] & 0xc0) == 0x80;
      if (ok && len == 3)
        ok = !(c == 0xe0 && p[1] < 0xa0) && !(c == 0xed && p[1] >= 0xa0);
      if (ok && len == 4)
        ok = !(c == 0xf0 && p[1] < 0x90) && !(c == 0xf4 && p[1] >= 0x90);
      if (ok) {
        fwrite(p, 1, len, f);
        p += len;
      } else {
        fputs("\\ufffd", f);
        p++;
      }
    }
  }
  fputc('"', f);
}

static void j_str(json_t *j, const char *s) {
  if (!s) {
    j_sep(j);
    fputs("null", j->f);
  } else {
    j_strn(j, s, strlen(s));
  }
}

static void j_key(json_t *j, const char *k) {
  j_str(j, k);
  fputc(':', j->f);
  j->after_key = true;
}

static void j_open(json_t *j, char c) {
  j_sep(j);
  fputc(c, j->f);
  j->depth++;
  j->first[j->depth] = true;
}

static void j_close(json_t *j, char c) {
  fputc(c, j->f);
  j->depth--;
}

static void j_u64(json_t *j, uint64_t v) {
  j_sep(j);
  fprintf(j->f, "%" PRIu64, v);
}

static void j_i64(json_t *j, int64_t v) {
  j_sep(j);
  fprintf(j->f, "%" PRId64, v);
}

static void j_bool(json_t *j, bool v) {
  j_sep(j);
  fputs(v ? "true" : "false", j->f);
}

static void j_null(json_t *j) {
  j_sep(j);
  fputs("null", j->f);
}

static void j_double(json_t *j, double v) {
  j_sep(j);
  fprintf(j->f, "%.3f", v);
}

static void j_dims(json_t *j, const int64_t *d, int n) {
  j_open(j, '[');
  for (int i = 0; i < n; i++)
    j_i64(j, d[i]);
  j_close(j, ']');
}

static void j_begin(json_t *j) {
  memset(j, 0, sizeof(*j));
  j->f = stdout;
  j->first[0] = true;
}

static void j_end(json_t *j) { fputc('\n', j->f); }

/* "2026-12-02T17:40:00Z" */
static const char *iso_time(int64_t t, char *buf, size_t cap) {
  time_t tt = (time_t)t;
  struct tm tm;
  if (!gmtime_r(&tt, &tm) ||
      strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
    snprintf(buf, cap, "%" PRId64, t);
  return buf;
}

/* "512 B", "1.5 KiB", "3.0 GiB" */
static const char *human_bytes(uint64_t n, char *buf, size_t cap) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB",
                                      "EiB"};
  if (n < 1024) {
    snprintf(buf, cap, "%" PRIu64 " B", n);
    return buf;
  }
  double v = (double)n / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof(units) / sizeof(units[0]))
    v /= 1024, u++;
  snprintf(buf, cap, "%.1f %s", v, units[u]);
  return buf;
}

/* "[4096,1024]" */
static const char *dims_text(const int64_t *d, int n, char *buf, size_t cap) {
  ckpt_dims_format(d, n, CKPT_DIMS_JSON, buf, cap);
  return buf;
}

/* ------------------------------------------------------------------------
 * Loading checkpoints.
 * ---------------------------------------------------------------------- */

/* mountinfo's octal escapes (\040 for a space) undone in place. */
static void unescape(char *s) {
  char *o = s;
  for (char *p = s; *p; p++) {
    if (p[0] == '\\' && p[1] >= '0' && p[1] <= '3' && p[2] >= '0' &&
        p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
      *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
      p += 3;
    } else {
      *o++ = *p;
    }
  }
  *o = '\0';
}

/* Is path itself a ckptfs mount? Then *source (malloc'd) is what it
 * mounts, its BACKING_DIR. */
static bool is_ckptfs_mount(const char *path, char **source) {
  char *real = realpath(path, NULL);
  FILE *f = real ? fopen("/proc/self/mountinfo", "re") : NULL;
  bool found = false;
  char *line = NULL;
  size_t cap = 0;
  while (f && !found && getline(&line, &cap, f) > 0) {
    /* ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [TAGS...] - TYPE SOURCE */
    char *save = NULL, *tok = strtok_r(line, " \n", &save), *mp = NULL;
    for (int i = 0; tok && i < 4; i++)
      mp = tok = strtok_r(NULL, " \n", &save);
    while (tok && strcmp(tok, "-"))
      tok = strtok_r(NULL, " \n", &save);
    char *type = tok ? strtok_r(NULL, " \n", &save) : NULL;
    char *src = type ? strtok_r(NULL, " \n", &save) : NULL;
    if (!mp || !type || !src || strcmp(type, "fuse.ckptfs"))
      continue;
    unescape(mp);
    if (!strcmp(mp, real)) {
      unescape(src);
      *source = strdup(src);
      found = true;
    }
  }
  free(line);
  if (f)
    fclose(f);
  free(real);
  return found;
}

static int open_backing(const char *path) {
  char *source = NULL;
  if (is_ckptfs_mount(path, &source)) {
    fail("%s is a ckptfs mount, not a backing directory: give its "
         "BACKING_DIR, %s", path, source ? source : "(unknown)");
    free(source);
    return -1;
  }
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    fail("cannot open BACKING_DIR %s: %s (give the directory the mounts "
         "store into, the BACKING_DIR of `ckptfs BACKING_DIR MOUNTPOINT`)",
         path, strerror(errno));
  return fd;
}

/* Load BACKING_DIR/name/.metadata whole: 0, or -1 with the reason
 * printed. */
static int load_named(int backing_fd, const char *backing, const char *name,
                      ckpt_metadata_t *m) {
  if (!ckpt_name_valid(name)) {
    fail("'%s' is not a checkpoint name ([A-Za-z0-9_.-]+, not starting "
         "with '.'); `%s ls %s` lists them",
         name, prog, backing);
    return -1;
  }
  struct stat st;
  if (fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW) ||
      !S_ISDIR(st.st_mode)) {
    fail("no checkpoint %s in %s; `%s ls %s` lists them", name, backing,
         prog, backing);
    return -1;
  }
  char rel[300];
  snprintf(rel, sizeof(rel), "%s/%s", name, CKPT_METADATA_FILE);
  if (faccessat(backing_fd, rel, F_OK, AT_SYMLINK_NOFOLLOW)) {
    fail("%s is not committed (no %s: a save in flight or interrupted); "
         "wait for its commit, or let the next mount remove it",
         name, CKPT_METADATA_FILE);
    return -1;
  }
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s/%s/%s", backing, name, CKPT_METADATA_FILE);
  char *err = NULL;
  int dfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
  int rc = dfd < 0 ? dfd : ckpt_metadb_load_at(dfd, path, m, &err);
  if (dfd >= 0)
    close(dfd);
  if (rc) {
    fail("%s: damaged %s: %s; run ckptfs-fsck %s %s", name,
         CKPT_METADATA_FILE, err ? err : strerror(-rc), backing, name);
    free(err);
    return -1;
  }
  return 0;
}

static uint64_t tensor_bytes(const ckpt_metadata_t *m,
                             const ckpt_tensor_meta_t *t) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < t->n_chunks; i++)
    sum += m->chunks[t->first_chunk + i].length;
  return sum;
}

static uint64_t stored_bytes(const ckpt_metadata_t *m) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < m->n_chunks; i++)
    sum += m->chunks[i].length;
  for (uint32_t i = 0; i < m->n_blobs; i++)
    sum += m->blobs[i].length;
  return sum;
}

static int by_rank(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* The distinct ranks holding t's chunks, sorted, into ranks (cap n_chunks);
 * returns how many. */
static uint32_t tensor_ranks(const ckpt_metadata_t *m,
                             const ckpt_tensor_meta_t *t, int32_t *ranks) {
  for (uint32_t i = 0; i < t->n_chunks; i++)
    ranks[i] = m->chunks[t->first_chunk + i].rank;
  if (t->n_chunks > 1)
    qsort(ranks, t->n_chunks, sizeof(*ranks), by_rank);
  uint32_t n = 0;
  for (uint32_t i = 0; i < t->n_chunks; i++)
    if (n == 0 || ranks[n - 1] != ranks[i])
      ranks[n++] = ranks[i];
  return n;
}

/* "0-3,5" */
static void ranks_text(const int32_t *r, uint32_t n, char *buf, size_t cap) {
  size_t at = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < n && at < cap;) {
    uint32_t j = i;
    while (j + 1 < n && r[j + 1] == r[j] + 1)
      j++;
    at += (size_t)snprintf(buf + at, cap - at, "%s%d", i ? "," : "", r[i]);
    if (j > i && at < cap)
      at += (size_t)snprintf(buf + at, cap - at, "%s%d", j > i + 1 ? "-" : ",",
                             r[j]);
    i = j + 1;
  }
}

/* ------------------------------------------------------------------------
 * Command lines.
 * ---------------------------------------------------------------------- */

enum { OPT_JSON = 1000, OPT_HELP, OPT_SAFETENSORS, OPT_KEEP, OPT_DRY_RUN,
       OPT_TIMEOUT, OPT_INTERVAL, OPT_CONTENT };
#define OPTBIT(o) (1u << ((o) - OPT_JSON))

/* Every option of every command; each command takes --json, --help and
 * those of its mask. */
static const struct option all_options[] = {
    {"json", no_argument, NULL, OPT_JSON},
    {"help", no_argument, NULL, OPT_HELP},
    {"safetensors", required_argument, NULL, OPT_SAFETENSORS},
    {"keep", required_argument, NULL, OPT_KEEP},
    {"dry-run", no_argument, NULL, OPT_DRY_RUN},
    {"timeout", required_argument, NULL, OPT_TIMEOUT},
    {"interval", required_argument, NULL, OPT_INTERVAL},
    {"content", no_argument, NULL, OPT_CONTENT},
    {0, 0, 0, 0}};

typedef struct {
  bool json;
  const char *safetensors;
  long long keep;      /* -1: not given */
  bool dry_run;
  bool content;        /* diff: compare differently chunked tensors */
  double timeout;      /* seconds; 0: none */
  double interval;     /* seconds */
  char *pos[4];        /* positional arguments */
  int npos;
} args_t;

typedef struct {
  const char *name;
  int (*run)(const args_t *a, int backing_fd);
  int npos;          /* positional arguments it takes */
  bool backing;      /* pos[0] is BACKING_DIR, opened for run */
  int error_exit;    /* exit status when BACKING_DIR cannot be opened */
  unsigned options;  /* OPTBIT of its options besides --json and --help */
  unsigned required; /* OPTBIT of those it needs */
  const char *summary;
  const char *help;  /* usage and options */
} command_t;

static const command_t *current;

static int usage_error(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s %s: ", prog, current->name);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n%.*s(`%s %s --help` lists the options)\n",
          (int)(strchr(current->help, '\n') + 1 - current->help),
          current->help, prog, current->name);
  va_end(ap);
  return EXIT_USAGE;
}

/* Parse argv (argv[0] is the command) for the current command. 0, 1
 * (--help printed) or EXIT_USAGE (message printed). */
static int parse_args(int argc, char **argv, args_t *a) {
  memset(a, 0, sizeof(*a));
  a->keep = -1;
  a->interval = 0.1;
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, ":h", all_options, NULL)) != -1) {
    char *end = NULL;
    if (c >= OPT_SAFETENSORS && !(current->options & OPTBIT(c)))
      return usage_error("--%s is not an option of this command",
                         all_options[c - OPT_JSON].name);
    switch (c) {
    case 'h':
    case OPT_HELP:
      fputs(current->help, stdout);
      return 1;
    case OPT_JSON:
      a->json = true;
      break;
    case OPT_SAFETENSORS:
      a->safetensors = optarg;
      break;
    case OPT_KEEP:
      errno = 0;
      a->keep = strtoll(optarg, &end, 10);
      if (errno || end == optarg || *end || a->keep < 1 ||
          a->keep > UINT32_MAX)
        return usage_error("--keep '%s': expected a number of checkpoints, "
                           "at least 1 (to remove them all, rm -r them)",
                           optarg);
      break;
    case OPT_DRY_RUN:
      a->dry_run = true;
      break;
    case OPT_CONTENT:
      a->content = true;
      break;
    case OPT_TIMEOUT:
    case OPT_INTERVAL: {
      errno = 0;
      double v = strtod(optarg, &end);
      if (errno || end == optarg || *end || !(v > 0) || v > 1e9)
        return usage_error("%s '%s': expected seconds > 0",
                           c == OPT_TIMEOUT ? "--timeout" : "--interval",
                           optarg);
      if (c == OPT_TIMEOUT)
        a->timeout = v;
      else
        a->interval = v;
      break;
    }
    case ':':
      return usage_error("option %s needs a value", argv[optind - 1]);
    default:
      return usage_error("unknown option '%s'", argv[optind - 1]);
    }
  }
  for (int i = optind; i < argc; i++) {
    if (a->npos == current->npos)
      return usage_error("unexpected argument '%s'", argv[i]);
    a->pos[a->npos++] = argv[i];
  }
  if (a->npos < current->npos)
    return usage_error("missing arguments");
  if ((current->required & OPTBIT(OPT_SAFETENSORS)) && !a->safetensors)
    return usage_error("--safetensors FILE is required (the only format so "
                       "far)");
  if ((current->required & OPTBIT(OPT_KEEP)) && a->keep < 0)
    return usage_error("--keep N is required: how many of the newest "
                       "committed checkpoints to keep");
  return 0;
}

/* ------------------------------------------------------------------------
 * ls
 * ---------------------------------------------------------------------- */

static const char *state_name(ckpt_cat_state_t s) {
  return s == CKPT_CAT_COMMITTED    ? "committed"
         : s == CKPT_CAT_UNFINISHED ? "unfinished"
                                    : "damaged";
}

static int cmd_ls(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_catalog_t cat;
  int rc = ckpt__catalog_scan(bfd, true, &cat);
  if (rc) {
    fail("cannot list %s: %s", backing, strerror(-rc));
    return EXIT_NO;
  }
  char t[64], b[32];
  if (a->json) {
    json_t j;
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "backing_dir");
    j_str(&j, backing);
    j_key(&j, "checkpoints");
    j_open(&j, '[');
    for (size_t i = 0; i < cat.n; i++) {
      const ckpt_cat_entry_t *e = &cat.e[i];
      const ckpt_metadata_t *m = &e->meta;
      bool ok = e->state == CKPT_CAT_COMMITTED;
      j_open(&j, '{');
      j_key(&j, "name"), j_str(&j, e->name);
      j_key(&j, "state"), j_str(&j, state_name(e->state));
      j_key(&j, "created_at");
      ok ? j_str(&j, iso_time(m->created_at, t, sizeof(t))) : j_null(&j);
      j_key(&j, "created_at_unix");
      ok ? j_i64(&j, m->created_at) : j_null(&j);
      j_key(&j, "save_id"), j_str(&j, ok ? m->save_id : NULL);
      j_key(&j, "world_size");
      ok ? j_i64(&j, m->world_size) : j_null(&j);
      j_key(&j, "tensors");
      ok ? j_u64(&j, m->n_tensors) : j_null(&j);
      j_key(&j, "chunks");
      ok ? j_u64(&j, m->n_chunks) : j_null(&j);
      j_key(&j, "blobs");
      ok ? j_u64(&j, m->n_blobs) : j_null(&j);
      j_key(&j, "bytes");
      ok ? j_u64(&j, stored_bytes(m)) : j_null(&j);
      j_key(&j, "disk_bytes"), j_u64(&j, e->disk_bytes);
      j_key(&j, "held"), j_bool(&j, e->held);
      j_key(&j, "error"), j_str(&j, e->error);
      j_close(&j, '}');
    }
    j_close(&j, ']');
    j_close(&j, '}');
    j_end(&j);
  } else if (cat.n == 0) {
    printf("%s: no checkpoints\n", backing);
  } else {
    int w = 4;
    for (size_t i = 0; i < cat.n; i++)
      if ((int)strlen(cat.e[i].name) > w)
        w = (int)strlen(cat.e[i].name);
    printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s\n", w, "NAME", "STATE",
           "CREATED", "WORLD", "TENSORS", "BLOBS", "BYTES");
    for (size_t i = 0; i < cat.n; i++) {
      const ckpt_cat_entry_t *e = &cat.e[i];
      const ckpt_metadata_t *m = &e->meta;
      if (e->state == CKPT_CAT_COMMITTED) {
        printf("%-*s  %-10s  %-20s  %5d  %7u  %6u  %10s\n", w, e->name,
               "committed", iso_time(m->created_at, t, sizeof(t)),
               m->world_size, m->n_tensors, m->n_blobs,
               human_bytes(stored_bytes(m), b, sizeof(b)));
      } else {
        printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s  %s\n", w, e->name,
               state_name(e->state), "-", "-", "-", "-",
               human_bytes(e->disk_bytes, b, sizeof(b)),
               e->state == CKPT_CAT_DAMAGED ? e->error
               : e->held ? "(a save in flight holds it)"
                         : "(interrupted save: the next mount removes it)");
      }
    }
  }
  ckpt__catalog_free(&cat);
  return 0;
}

/* ------------------------------------------------------------------------
 * show
 * ---------------------------------------------------------------------- */

static int cmd_show(const args_t *a, int bfd) {
  const char *backing = a->pos[0], *name = a->pos[1];
  ckpt_metadata_t m;
  if (load_named(bfd, backing, name, &m))
    return EXIT_NO;
  int32_t *ranks = calloc(m.n_chunks ? m.n_chunks : 1, sizeof(*ranks));
  if (!ranks) {
    fail("out of memory");
    ckpt_metadata_free(&m);
    return EXIT_NO;
  }
  char t[64], b[32], dims[1024], rtext[256];
  if (a->json) {
    json_t j;
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "name"), j_str(&j, name);
    j_key(&j, "created_at"), j_str(&j, iso_time(m.created_at, t, sizeof(t)));
    j_key(&j, "created_at_unix"), j_i64(&j, m.created_at);
    j_key(&j, "save_id"), j_str(&j, m.save_id);
    j_key(&j, "world_size"), j_i64(&j, m.world_size);
    j_key(&j, "bytes"), j_u64(&j, stored_bytes(&m));
    j_key(&j, "tensors");
    j_open(&j, '[');
    for (uint32_t i = 0; i < m.n_tensors; i++) {
      const ckpt_tensor_meta_t *tm = &m.tensors[i];
      uint32_t nr = tensor_ranks(&m, tm, ranks);
      j_open(&j, '{');
      j_key(&j, "fqn"), j_str(&j, tm->fqn);
      j_key(&j, "path"), j_str(&j, tm->path);
      j_key(&j, "dtype"), j_str(&j, ckpt_dtype_name(tm->dtype));
      j_key(&j, "shape"), j_dims(&j, tm->shape, tm->ndim);
      j_key(&j, "chunks"), j_u64(&j, tm->n_chunks);
      j_key(&j, "ranks");
      j_open(&j, '[');
      for (uint32_t r = 0; r < nr; r++)
        j_i64(&j, ranks[r]);
      j_close(&j, ']');
      j_key(&j, "bytes"), j_u64(&j, tensor_bytes(&m, tm));
      j_close(&j, '}');
    }
    j_close(&j, ']');
    j_key(&j, "blobs");
    j_open(&j, '[');
    for (uint32_t i = 0; i < m.n_blobs; i++) {
      const ckpt_blob_meta_t *bm = &m.blobs[i];
      j_open(&j, '{');
      j_key(&j, "fqn"), j_str(&j, bm->fqn);
      j_key(&j, "path"), j_str(&j, bm->path);
      j_key(&j, "rank"), j_i64(&j, bm->rank);
      j_key(&j, "bytes"), j_u64(&j, bm->length);
      j_close(&j, '}');
    }
    j_close(&j, ']');
    j_close(&j, '}');
    j_end(&j);
  } else {
    printf("%s: committed %s, world size %d, %u tensors in %u chunks, "
           "%u blobs, %s (%" PRIu64 " bytes)\n",
           name, iso_time(m.created_at, t, sizeof(t)), m.world_size,
           m.n_tensors, m.n_chunks, m.n_blobs,
           human_bytes(stored_bytes(&m), b, sizeof(b)), stored_bytes(&m));
    int w = 6, wd = 5;
    for (uint32_t i = 0; i < m.n_tensors; i++) {
      const ckpt_tensor_meta_t *tm = &m.tensors[i];
      if ((int)strlen(tm->fqn) > w)
        w = (int)strlen(tm->fqn);
      int l = (int)strlen(dims_text(tm->shape, tm->ndim, dims, sizeof(dims)));
      if (l > wd)
        wd = l;
    }
    for (uint32_t i = 0; i < m.n_blobs; i++)
      if ((int)strlen(m.blobs[i].fqn) > w)
        w = (int)strlen(m.blobs[i].fqn);
    if (m.n_tensors) {
      printf("\n%-*s  %-13s  %-*s  %6s  %-8s  %12s\n", w, "TENSOR", "DTYPE",
             wd, "SHAPE", "CHUNKS", "RANKS", "BYTES");
      for (uint32_t i = 0; i < m.n_tensors; i++) {
        const ckpt_tensor_meta_t *tm = &m.tensors[i];
        ranks_text(ranks, tensor_ranks(&m, tm, ranks), rtext, sizeof(rtext));
        printf("%-*s  %-13s  %-*s  %6u  %-8s  %12" PRIu64 "\n", w, tm->fqn,
               ckpt_dtype_name(tm->dtype), wd,
               dims_text(tm->shape, tm->ndim, dims, sizeof(dims)),
               tm->n_chunks, rtext, tensor_bytes(&m, tm));
      }
    }
    if (m.n_blobs) {
      printf("\n%-*s  %5s  %12s\n", w, "BLOB", "RANK", "BYTES");
      for (uint32_t i = 0; i < m.n_blobs; i++)
        printf("%-*s  %5d  %12" PRIu64 "\n", w, m.blobs[i].fqn,
               m.blobs[i].rank, m.blobs[i].length);
    }
  }
  free(ranks);
  ckpt_metadata_free(&m);
  return 0;
}

/* ------------------------------------------------------------------------
 * Reading whole tensors from the data files (export, diff --content).
 * ---------------------------------------------------------------------- */

/* The export assembles each tensor window by window (EXPORT_WINDOW bytes
 * of the global tensor in memory, then one write): for every chunk that
 * touches the window, one read of the chunk bytes the window needs, then
 * the copies (ckpt_layout_pieces, as a mount's reads do). A chunk's bytes
 * land in the global tensor in their own order, so window after window
 * each chunk is read front to back, and its XXH3-64 is computed on the
 * way: every chunk is read once, however it is sharded (a column shard of
 * 4-byte rows costs memcpys, not a write each). */
#define EXPORT_WINDOW ((size_t)16 << 20)

typedef struct {
  uint8_t *win;        /* EXPORT_WINDOW: the window being assembled */
  uint8_t *src;        /* EXPORT_WINDOW: one chunk's bytes for it */
} window_t;

/* Per chunk while it is read: its hash and how far. */
typedef struct {
  XXH3_state_t *hash;  /* NULL until its first window */
  uint64_t used;       /* chunk bytes read and hashed */
} chunk_read_t;

static int write_full(int fd, const void *p, size_t n, uint64_t off) {
  const char *c = p;
  while (n > 0) {
    ssize_t r = pwrite(fd, c, n, (off_t)off);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -errno;
    if (r == 0)
      return -EIO;
    c += r, n -= (size_t)r, off += (uint64_t)r;
  }
  return 0;
}

/* Read exactly n bytes at off: 0, -ENODATA when the file ends first, or
 * -errno. */
static int read_full(int fd, void *buf, size_t n, uint64_t off) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -errno;
    if (r == 0)
      return -ENODATA;
    got += (size_t)r;
  }
  return 0;
}

/* The data files of one checkpoint, through the store's reader. */
typedef struct {
  const char *backing, *name;
  ckpt_fdcache_t *cache;
  ckpt_stored_t s;
  bool open;
} data_files_t;

/* Set df up for checkpoint name (holding m) of BACKING_DIR bfd: 0, or -1
 * with the reason printed. */
static int df_open(data_files_t *df, int bfd, const ckpt_metadata_t *m) {
  int dfd = ckpt_store_open_dir(bfd, df->name, O_RDONLY);
  if (dfd < 0) {
    fail("cannot open %s/%s: %s", df->backing, df->name, strerror(-dfd));
    return -1;
  }
  int rc = ckpt_fdcache_new(bfd, 0, &df->cache);
  if (rc == 0)
    rc = ckpt_stored_init(&df->s, df->cache, df->name, dfd, m, false);
  close(dfd);
  if (rc) {
    fail("%s: %s", df->name, strerror(-rc));
    return -1;
  }
  df->open = true;
  return 0;
}

static void df_close(data_files_t *df) {
  if (df->open)
    ckpt_stored_destroy(&df->s);
  ckpt_fdcache_free(df->cache);
  df->cache = NULL;
  df->open = false;
}

/* What a chunk is called in messages: "tensor FQN chunk at [OFFSETS]
 * (rank R, __R_K.distcp)". */
static void chunk_what(const ckpt_tensor_meta_t *t, const ckpt_chunk_meta_t *ch,
                       char *buf, size_t cap) {
  char offs[512], file[64];
  ckpt_dims_format(ch->dims, t->ndim, CKPT_DIMS_JSON, offs, sizeof(offs));
  ckpt_data_file_name(ch->rank, ch->file, file, sizeof(file));
  snprintf(buf, cap, "tensor %s chunk at %s (rank %d, %s)", t->fqn, offs,
           ch->rank, file);
}

/* Where an assembled window goes: sink(arg, bytes, n, at) with at its
 * offset in the tensor, windows in order; 0, or -1 with the reason
 * printed. */
typedef int (*sink_fn)(void *arg, const uint8_t *p, size_t n, uint64_t at);

/* Assemble tensor t from its chunks, window by window, into sink,
 * verifying every chunk's checksum (see window_t). 0, or -1 with the
 * reason printed (the sink may have seen part of the tensor then). */
static int assemble_tensor(data_files_t *df, const ckpt_metadata_t *m,
                           const ckpt_tensor_meta_t *t, window_t *w,
                           sink_fn sink, void *arg) {
  size_t isz = ckpt_dtype_size(t->dtype);
  uint64_t numel = 0;
  ckpt_dims_numel(t->shape, t->ndim, &numel);
  uint64_t total = numel * isz;
  chunk_read_t *cr = calloc(t->n_chunks ? t->n_chunks : 1, sizeof(*cr));
  char what[PATH_MAX + 700];
  int rc = cr ? 0 : -ENOMEM, bad = 0;
  if (rc)
    fail("out of memory");
  for (uint64_t at = 0; rc == 0 && at < total; at += EXPORT_WINDOW) {
    size_t len = total - at < EXPORT_WINDOW ? (size_t)(total - at)
                                            : EXPORT_WINDOW;
    for (uint32_t i = 0; rc == 0 && i < t->n_chunks; i++) {
      const ckpt_chunk_meta_t *ch = &m->chunks[t->first_chunk + i];
      const int64_t *offs = ch->dims, *sizes = ch->dims + t->ndim;
      uint64_t lo, hi;
      ckpt_layout_span(t->ndim, t->shape, offs, sizes, isz, at, len, &lo,
                       &hi);
      if (lo >= hi)
        continue; /* not in this window */
      chunk_what(t, ch, what, sizeof(what));
      if (lo != cr[i].used || hi > ch->length) {
        fail("%s: %s: its length (%" PRIu64 " bytes) does not match its "
             "sizes; the checkpoint is damaged", df->name, what, ch->length);
        rc = -EIO;
        break;
      }
      if (!cr[i].hash) {
        if (!(cr[i].hash = XXH3_createState()) ||
            XXH3_64bits_reset(cr[i].hash) != XXH_OK) {
          fail("out of memory");
          rc = -ENOMEM;
          break;
        }
      }
      ckpt_fdref_t ref;
      int fd = ckpt_stored_fd(&df->s, ch->rank, ch->file, &ref);
      if (fd == 0)
        fd = ref.fd;
      size_t n = (size_t)(hi - lo);
      rc = fd < 0 ? fd : read_full(fd, w->src, n, ch->file_offset + lo);
      ckpt_fdref_put(&ref);
      if (rc) {
        fail("%s: %s: %s; the checkpoint is damaged, nothing exported "
             "(ckptfs-fsck %s %s lists every problem)",
             df->name, what,
             rc == -ENODATA ? "the data file is truncated"
             : fd < 0       ? (rc == -ENOENT ? "cannot open the data file: "
                                               "it is missing"
                                             : "cannot open the data file")
                            : strerror(-rc),
             df->backing, df->name);
        break;
      }
      XXH3_64bits_update(cr[i].hash, w->src, n);
      cr[i].used = hi;
      ckpt_layout_copy(t->ndim, t->shape, offs, sizes, isz, at, len, w->src,
                       lo, w->win);
    }
    if (rc == 0 && sink(arg, w->win, len, at))
      rc = -EIO;
  }
  /* Every chunk read whole: its checksum. Each mismatch is reported. */
  for (uint32_t i = 0; rc == 0 && i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *ch = &m->chunks[t->first_chunk + i];
    chunk_what(t, ch, what, sizeof(what));
    uint64_t got = XXH3_64bits(NULL, 0);
    if (cr[i].hash)
      got = XXH3_64bits_digest(cr[i].hash);
    if (cr[i].used != ch->length) {
      fail("%s: %s: its length (%" PRIu64 " bytes) does not match its "
           "sizes; the checkpoint is damaged", df->name, what, ch->length);
      bad++;
    } else if (got != ch->checksum) {
      fail("%s: %s at %" PRIu64 ": checksum mismatch (stored %016" PRIx64
           ", data %016" PRIx64 "); the checkpoint is damaged, nothing "
           "exported (ckptfs-fsck %s %s lists every problem)",
           df->name, what, ch->file_offset, ch->checksum, got, df->backing,
           df->name);
      bad++;
    }
  }
  for (uint32_t i = 0; cr && i < t->n_chunks; i++)
    XXH3_freeState(cr[i].hash);
  free(cr);
  return rc || bad ? -1 : 0;
}

/* ------------------------------------------------------------------------
 * diff
 * ---------------------------------------------------------------------- */

enum {
  WHY_DTYPE = 1,   /* tensors */
  WHY_SHAPE = 2,
  WHY_CHUNKS = 4,  /* stored in other chunks: contents not compared */
  WHY_DATA = 8,    /* a chunk's (or the blob's) checksum or length */
  WHY_PATH = 16,   /* the same FQN from another path */
};

static const char *const why_names[] = {"dtype", "shape", "chunks", "data",
                                        "path"};

static unsigned tensor_changes(const ckpt_metadata_t *ma,
                               const ckpt_tensor_meta_t *a,
                               const ckpt_metadata_t *mb,
                               const ckpt_tensor_meta_t *b,
                               uint32_t *ndiff) {
  unsigned why = 0;
  *ndiff = 0;
  if (strcmp(a->path, b->path))
    why |= WHY_PATH;
  if (a->dtype != b->dtype)
    why |= WHY_DTYPE;
  if (a->ndim != b->ndim ||
      memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof(*a->shape)))
    why |= WHY_SHAPE;
  if (why & (WHY_DTYPE | WHY_SHAPE))
    return why;
  if (a->n_chunks != b->n_chunks)
    return why | WHY_CHUNKS;
  /* Both groups are sorted by offsets: compare them pairwise. */
  for (uint32_t i = 0; i < a->n_chunks; i++) {
    const ckpt_chunk_meta_t *ca = &ma->chunks[a->first_chunk + i];
    const ckpt_chunk_meta_t *cb = &mb->chunks[b->first_chunk + i];
    if (memcmp(ca->dims, cb->dims, 2 * (size_t)a->ndim * sizeof(*ca->dims)))
      return why | WHY_CHUNKS;
    if (ca->checksum != cb->checksum || ca->length != cb->length)
      (*ndiff)++;
  }
  return *ndiff ? why | WHY_DATA : why;
}

typedef struct {
  json_t j;
  bool json;
  uint32_t added, removed, changed, unchanged;
  const int8_t *same; /* --content, by A's tensor index: 1 the contents
                         are equal, 0 not, -1 not compared; or NULL */
} diff_t;

static void diff_one(diff_t *d, char op, const char *kind, const char *fqn,
                     unsigned why, const char *detail) {
  if (op == '+')
    d->added++;
  else if (op == '-')
    d->removed++;
  else
    d->changed++;
  if (!d->json) {
    printf("%c %s %s%s%s\n", op, kind, fqn, detail[0] ? ": " : "", detail);
    return;
  }
  j_open(&d->j, '{');
  j_key(&d->j, "kind"), j_str(&d->j, kind);
  j_key(&d->j, "fqn"), j_str(&d->j, fqn);
  if (op == '~') {
    j_key(&d->j, "reasons");
    j_open(&d->j, '[');
    for (unsigned k = 0; k < sizeof(why_names) / sizeof(why_names[0]); k++)
      if (why & (1u << k))
        j_str(&d->j, why_names[k]);
    j_close(&d->j, ']');
    j_key(&d->j, "detail"), j_str(&d->j, detail);
  }
  j_close(&d->j, '}');
}

/* One pass of the sorted lists of A and B for op: '+' in B only, '-' in A
 * only, '~' in both but different (counting the unchanged). */
static void diff_pass(diff_t *d, char op, const ckpt_metadata_t *ma,
                      const ckpt_metadata_t *mb) {
  char detail[2200], da[1024], db[1024];
  uint32_t i = 0, k = 0;
  while (i < ma->n_tensors || k < mb->n_tensors) {
    int c = i == ma->n_tensors   ? 1
            : k == mb->n_tensors ? -1
                                 : strcmp(ma->tensors[i].fqn,
                                          mb->tensors[k].fqn);
    if (c < 0) {
      const ckpt_tensor_meta_t *t = &ma->tensors[i++];
      if (op == '-') {
        snprintf(detail, sizeof(detail), "%s %s", ckpt_dtype_name(t->dtype),
                 dims_text(t->shape, t->ndim, da, sizeof(da)));
        diff_one(d, '-', "tensor", t->fqn, 0, detail);
      }
    } else if (c > 0) {
      const ckpt_tensor_meta_t *t = &mb->tensors[k++];
      if (op == '+') {
        snprintf(detail, sizeof(detail), "%s %s", ckpt_dtype_name(t->dtype),
                 dims_text(t->shape, t->ndim, db, sizeof(db)));
        diff_one(d, '+', "tensor", t->fqn, 0, detail);
      }
    } else {
      const ckpt_tensor_meta_t *ta = &ma->tensors[i++], *tb = &mb->tensors[k++];
      uint32_t ndiff;
      unsigned why = tensor_changes(ma, ta, mb, tb, &ndiff);
      if (op != '~')
        continue;
      bool whole = (why & WHY_CHUNKS) && d->same && d->same[i - 1] >= 0;
      if (whole) /* compared whole (--content) */
        why = (why & ~(unsigned)WHY_CHUNKS) | (d->same[i - 1] ? 0 : WHY_DATA);
      if (!why) {
        d->unchanged++;
        continue;
      }
      size_t at = 0;
      detail[0] = '\0';
      if (why & WHY_DTYPE)
        at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                               "dtype %s -> %s, ", ckpt_dtype_name(ta->dtype),
                               ckpt_dtype_name(tb->dtype));
      if ((why & WHY_SHAPE) && at < sizeof(detail))
        at += (size_t)snprintf(
            detail + at, sizeof(detail) - at, "shape %s -> %s, ",
            dims_text(ta->shape, ta->ndim, da, sizeof(da)),
            dims_text(tb->shape, tb->ndim, db, sizeof(db)));
      if ((why & WHY_CHUNKS) && at < sizeof(detail))
        at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                               "stored in other chunks (%u -> %u; contents "
                               "not compared, see --content), ",
                               ta->n_chunks, tb->n_chunks);
      if ((why & WHY_DATA) && whole && at < sizeof(detail))
        at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                               "data: the contents differ (compared whole: "
                               "%u -> %u chunks), ",
                               ta->n_chunks, tb->n_chunks);
      else if ((why & WHY_DATA) && at < sizeof(detail))
        at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                               "data: %u of %u chunks differ, ", ndiff,
                               ta->n_chunks);
      if ((why & WHY_PATH) && at < sizeof(detail))
        at += (size_t)snprintf(detail + at, sizeof(detail) - at,
                               "path %s -> %s, ", ta->path, tb->path);
      if (at >= 2 && at < sizeof(detail))
        detail[at - 2] = '\0';
      diff_one(d, '~', "tensor", ta->fqn, why, detail);
    }
  }
  i = k = 0;
  while (i < ma->n_blobs || k < mb->n_blobs) {
    int c = i == ma->n_blobs   ? 1
            : k == mb->n_blobs ? -1
                               : strcmp(ma->blobs[i].fqn, mb->blobs[k].fqn);
    if (c < 0) {
      const ckpt_blob_meta_t *b = &ma->blobs[i++];
      if (op == '-') {
        snprintf(detail, sizeof(detail), "%" PRIu64 " bytes", b->length);
        diff_one(d, '-', "blob", b->fqn, 0, detail);
      }
    } else if (c > 0) {
      const ckpt_blob_meta_t *b = &mb->blobs[k++];
      if (op == '+') {
        snprintf(detail, sizeof(detail), "%" PRIu64 " bytes", b->length);
        diff_one(d, '+', "blob", b->fqn, 0, detail);
      }
    } else {
      const ckpt_blob_meta_t *ba = &ma->blobs[i++], *bb = &mb->blobs[k++];
      unsigned why = (ba->checksum != bb->checksum ||
                      ba->length != bb->length ? WHY_DATA : 0) |
                     (strcmp(ba->path, bb->path) ? WHY_PATH : 0);
      if (op != '~')
        continue;
      if (!why) {
        d->unchanged++;
        continue;
      }
      if (why & WHY_DATA)
        snprintf(detail, sizeof(detail), "data: %" PRIu64 " -> %" PRIu64
                 " bytes, checksum %016" PRIx64 " -> %016" PRIx64,
                 ba->length, bb->length, ba->checksum, bb->checksum);
      else
        snprintf(detail, sizeof(detail), "path %s -> %s", ba->path, bb->path);
      diff_one(d, '~', "blob", ba->fqn, why, detail);
    }
  }
}

static int hash_sink(void *arg, const uint8_t *p, size_t n, uint64_t at) {
  (void)at;
  return XXH3_64bits_update(arg, p, n) == XXH_OK ? 0 : -1;
}

/* XXH3-64 of tensor t read whole: 0, or -1 with the reason printed. */
static int tensor_digest(data_files_t *df, const ckpt_metadata_t *m,
                         const ckpt_tensor_meta_t *t, window_t *w,
                         uint64_t *out) {
  XXH3_state_t *h = XXH3_createState();
  int rc = h && XXH3_64bits_reset(h) == XXH_OK ? 0 : -1;
  if (rc)
    fail("out of memory");
  else
    rc = assemble_tensor(df, m, t, w, hash_sink, h);
  if (rc == 0)
    *out = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return rc;
}

/* --content: same[i] for every tensor i of A that B stores in other
 * chunks (same dtype and shape): whether the contents are equal. 0, or -1
 * with the reason printed. */
static int compare_contents(int bfd, const char *backing, const char *na,
                            const ckpt_metadata_t *ma, const char *nb,
                            const ckpt_metadata_t *mb, int8_t *same) {
  data_files_t da = {.backing = backing, .name = na};
  data_files_t db = {.backing = backing, .name = nb};
  window_t w = {.win = malloc(EXPORT_WINDOW), .src = malloc(EXPORT_WINDOW)};
  int rc = 0;
  if (!w.win || !w.src) {
    fail("out of memory");
    rc = -1;
  } else if (df_open(&da, bfd, ma) || df_open(&db, bfd, mb)) {
    rc = -1;
  }
  for (uint32_t i = 0, k = 0; rc == 0 && i < ma->n_tensors;) {
    int c = k == mb->n_tensors
                ? -1
                : strcmp(ma->tensors[i].fqn, mb->tensors[k].fqn);
    if (c != 0) {
      c < 0 ? i++ : k++;
      continue;
    }
    const ckpt_tensor_meta_t *ta = &ma->tensors[i], *tb = &mb->tensors[k];
    uint32_t ndiff;
    unsigned why = tensor_changes(ma, ta, mb, tb, &ndiff);
    uint64_t ha, hb;
    if ((why & WHY_CHUNKS) &&
        (rc = tensor_digest(&da, ma, ta, &w, &ha)) == 0 &&
        (rc = tensor_digest(&db, mb, tb, &w, &hb)) == 0)
      same[i] = ha == hb;
    i++, k++;
  }
  df_close(&da);
  df_close(&db);
  free(w.win);
  free(w.src);
  return rc;
}

static int cmd_diff(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_metadata_t ma, mb;
  if (load_named(bfd, backing, a->pos[1], &ma))
    return EXIT_USAGE;
  if (load_named(bfd, backing, a->pos[2], &mb)) {
    ckpt_metadata_free(&ma);
    return EXIT_USAGE;
  }
  diff_t d = {.json = a->json};
  int8_t *same = NULL;
  if (a->content) {
    same = malloc(ma.n_tensors ? ma.n_tensors : 1);
    if (same)
      memset(same, -1, ma.n_tensors ? ma.n_tensors : 1);
    if (!same || compare_contents(bfd, backing, a->pos[1], &ma, a->pos[2],
                                  &mb, same)) {
      if (!same)
        fail("out of memory");
      free(same);
      ckpt_metadata_free(&ma);
      ckpt_metadata_free(&mb);
      return EXIT_USAGE;
    }
    d.same = same;
  }
  if (a->json) {
    j_begin(&d.j);
    j_open(&d.j, '{');
    j_key(&d.j, "a"), j_str(&d.j, a->pos[1]);
    j_key(&d.j, "b"), j_str(&d.j, a->pos[2]);
  } else {
    printf("--- %s\n+++ %s\n", a->pos[1], a->pos[2]);
  }
  static const char ops[3] = {'+', '-', '~'};
  static const char *const keys[3] = {"added", "removed", "changed"};
  for (int p = 0; p < 3; p++) {
    if (a->json) {
      j_key(&d.j, keys[p]);
      j_open(&d.j, '[');
    }
    diff_pass(&d, ops[p], &ma, &mb);
    if (a->json)
      j_close(&d.j, ']');
  }
  bool identical = d.added + d.removed + d.changed == 0;
  if (a->json) {
    j_key(&d.j, "unchanged"), j_u64(&d.j, d.unchanged);
    j_key(&d.j, "identical"), j_bool(&d.j, identical);
    j_close(&d.j, '}');
    j_end(&d.j);
  } else {
    printf("%u unchanged, %u added, %u removed, %u changed%s\n", d.unchanged,
           d.added, d.removed, d.changed, identical ? ": identical" : "");
  }
  free(same);
  ckpt_metadata_free(&ma);
  ckpt_metadata_free(&mb);
  return identical ? 0 : EXIT_NO;
}

/* ------------------------------------------------------------------------
 * prune
 * ---------------------------------------------------------------------- */

static int cmd_prune(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_catalog_t cat;
  int rc = ckpt__catalog_scan(bfd, false, &cat);
  if (rc) {
    fail("cannot list %s: %s", backing, strerror(-rc));
    return EXIT_NO;
  }
  bool *old = calloc(cat.n ? cat.n : 1, sizeof(*old));
  int *result = calloc(cat.n ? cat.n : 1, sizeof(*result));
  if (!old || !result) {
    fail("out of memory");
    free(old), free(result);
    ckpt__catalog_free(&cat);
    return EXIT_NO;
  }
  ckpt__catalog_select_old(&cat, (uint32_t)a->keep, NULL, old);
  int failed = 0;
  for (size_t i = 0; i < cat.n; i++)
    if (old[i] && !a->dry_run &&
        (result[i] = ckpt__checkpoint_remove(bfd, cat.e[i].name, true)))
      failed++;

  char t[64];
  json_t j;
  if (a->json) {
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "backing_dir"), j_str(&j, backing);
    j_key(&j, "keep"), j_i64(&j, a->keep);
    j_key(&j, "dry_run"), j_bool(&j, a->dry_run);
  }
  /* Pass 0: removed (or would be), 1: kept, 2: skipped, 3: failed. */
  static const char *const keys[4] = {"removed", "kept", "skipped",
                                      "errors"};
  for (int pass = 0; pass < 4; pass++) {
    if (a->json) {
      j_key(&j, keys[pass]);
      j_open(&j, '[');
    }
    for (size_t i = 0; i < cat.n; i++) {
      const ckpt_cat_entry_t *e = &cat.e[i];
      bool committed = e->state == CKPT_CAT_COMMITTED;
      int which = !committed ? 2 : !old[i] ? 1 : result[i] ? 3 : 0;
      if (which != pass)
        continue;
      const char *why = NULL;
      if (pass == 2)
        why = e->state == CKPT_CAT_DAMAGED
                  ? "damaged .metadata (check it with ckptfs-fsck)"
              : e->held ? "unfinished save, a writer holds it"
                        : "unfinished save (the next mount removes it)";
      else if (pass == 3)
        why = result[i] == -EBUSY ? "busy: a save holds it; try again"
                                  : strerror(-result[i]);
      if (a->json) {
        j_open(&j, '{');
        j_key(&j, "name"), j_str(&j, e->name);
        j_key(&j, "created_at");
        committed ? j_str(&j, iso_time(e->meta.created_at, t, sizeof(t)))
                  : j_null(&j);
        if (why)
          j_key(&j, pass == 3 ? "error" : "reason"), j_str(&j, why);
        j_close(&j, '}');
        continue;
      }
      static const char *const verbs[4] = {"removed", "kept", "skipped",
                                           "FAILED"};
      printf("%-12s  %s%s%s%s%s\n",
             pass == 0 && a->dry_run ? "would remove" : verbs[pass], e->name,
             committed ? "  " : "",
             committed ? iso_time(e->meta.created_at, t, sizeof(t)) : "",
             why ? ": " : "", why ? why : "");
    }
    if (a->json)
      j_close(&j, ']');
  }
  if (a->json) {
    j_close(&j, '}');
    j_end(&j);
  }
  if (failed)
    fail("%d checkpoints could not be removed (see above)", failed);
  free(old);
  free(result);
  ckpt__catalog_free(&cat);
  return failed ? EXIT_NO : 0;
}

/* ------------------------------------------------------------------------
 * export
 * ---------------------------------------------------------------------- */

typedef struct {
  int fd;
  uint64_t base;    /* the tensor's byte 0 in the file */
  const char *file; /* for messages */
} write_sink_t;

static int write_sink(void *arg, const uint8_t *p, size_t n, uint64_t at) {
  write_sink_t *ws = arg;
  int rc = write_full(ws->fd, p, n, ws->base + at);
  if (rc)
    fail("writing %s: %s", ws->file, strerror(-rc));
  return rc ? -1 : 0;
}

/* fsync the directory holding path. */
static int sync_parent(const char *path) {
  char dir[PATH_MAX];
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, sizeof(dir), ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  int rc = fsync(fd) ? -errno : 0;
  close(fd);
  return rc;
}

static int cmd_export(const args_t *a, int bfd) {
  const char *backing = a->pos[0], *name = a->pos[1], *file = a->safetensors;
  ckpt_metadata_t m;
  if (load_named(bfd, backing, name, &m))
    return EXIT_NO;
  int status = EXIT_NO, out_fd = -1;
  char tmp[PATH_MAX];
  bool tmp_made = false;
  data_files_t df = {.backing = backing, .name = name};
  window_t w = {.win = malloc(EXPORT_WINDOW), .src = malloc(EXPORT_WINDOW)};
  ckpt_st_tensor_t *st = calloc(m.n_tensors ? m.n_tensors : 1, sizeof(*st));
  ckpt_st_plan_t plan = {0};
  if (!w.win || !w.src || !st) {
    fail("out of memory");
    goto out;
  }
  if (df_open(&df, bfd, &m))
    goto out;
  for (uint32_t i = 0; i < m.n_tensors; i++)
    st[i] = (ckpt_st_tensor_t){.name = m.tensors[i].fqn,
                               .dtype = m.tensors[i].dtype,
                               .ndim = m.tensors[i].ndim,
                               .shape = m.tensors[i].shape};
  int rc = ckpt_st_plan(st, m.n_tensors, 0, &plan);
  if (rc) {
    fail("%s: cannot lay out a safetensors file: %s", name, strerror(-rc));
    goto out;
  }
  if (snprintf(tmp, sizeof(tmp), "%s.tmp", file) >= (int)sizeof(tmp)) {
    fail("%s: name too long", file);
    goto out;
  }
  out_fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    fail("cannot create %s: %s", tmp, strerror(errno));
    goto out;
  }
  tmp_made = true;
  const ckpt_st_shard_t *sh = &plan.shards[0];
  if ((rc = write_full(out_fd, sh->header, (size_t)sh->header_len, 0)) ||
      (ftruncate(out_fd, (off_t)sh->file_size) && (rc = -errno))) {
    fail("writing %s: %s", tmp, strerror(-rc));
    goto out;
  }
  for (size_t k = 0; k < plan.n_kept; k++) {
    size_t i = plan.order[k];
    write_sink_t ws = {.fd = out_fd, .base = plan.place[i].offset,
                       .file = tmp};
    if (assemble_tensor(&df, &m, &m.tensors[i], &w, write_sink, &ws))
      goto out;
  }
  if (fsync(out_fd)) {
    fail("syncing %s: %s", tmp, strerror(errno));
    goto out;
  }
  rc = close(out_fd) ? -errno : 0;
  out_fd = -1;
  if (rc || rename(tmp, file)) {
    fail("%s %s: %s", rc ? "closing" : "renaming to", rc ? tmp : file,
         strerror(rc ? -rc : errno));
    goto out;
  }
  tmp_made = false;
  sync_parent(file);
  status = 0;
  uint64_t blob_bytes = 0;
  for (uint32_t i = 0; i < m.n_blobs; i++)
    blob_bytes += m.blobs[i].length;
  if (a->json) {
    json_t j;
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "name"), j_str(&j, name);
    j_key(&j, "file"), j_str(&j, file);
    j_key(&j, "format"), j_str(&j, "safetensors");
    j_key(&j, "bytes"), j_u64(&j, sh->file_size);
    j_key(&j, "header_bytes"), j_u64(&j, sh->header_len);
    j_key(&j, "tensors"), j_u64(&j, plan.n_kept);
    j_key(&j, "left_out");
    j_open(&j, '[');
    for (uint32_t i = 0; i < m.n_tensors; i++)
      if (plan.place[i].shard == CKPT_ST_LEFT_OUT)
        j_str(&j, m.tensors[i].fqn);
    j_close(&j, ']');
    j_key(&j, "blobs_left_out");
    j_open(&j, '[');
    for (uint32_t i = 0; i < m.n_blobs; i++)
      j_str(&j, m.blobs[i].fqn);
    j_close(&j, ']');
    j_close(&j, '}');
    j_end(&j);
  } else {
    char b[32];
    printf("%s: wrote %s: %zu tensors, %s (%" PRIu64 " bytes), every chunk's "
           "checksum verified\n",
           name, file, plan.n_kept, human_bytes(sh->file_size, b, sizeof(b)),
           sh->file_size);
    for (uint32_t i = 0; i < m.n_tensors; i++)
      if (plan.place[i].shard == CKPT_ST_LEFT_OUT)
        printf("left out: tensor %s (%s has no safetensors dtype, or the "
               "name is not UTF-8)\n",
               m.tensors[i].fqn, ckpt_dtype_name(m.tensors[i].dtype));
    if (m.n_blobs)
      printf("left out: %u blobs, %" PRIu64 " bytes (safetensors holds "
             "tensors only; read them through a mount)\n",
             m.n_blobs, blob_bytes);
  }

out:
  if (out_fd >= 0)
    close(out_fd);
  if (tmp_made && unlink(tmp) == 0 && status)
    fprintf(stderr, "%s: removed the partial %s\n", prog, tmp);
  df_close(&df);
  ckpt_st_plan_free(&plan);
  free(st);
  free(w.win);
  free(w.src);
  ckpt_metadata_free(&m);
  return status;
}

/* ------------------------------------------------------------------------
 * wait
 * ---------------------------------------------------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The .status text of the checkpoint directory: malloc'd, or NULL with
 * errno set. */
static char *read_status(const char *dir) {
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s/.status", dir);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return NULL;
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  char tmp[4096];
  ssize_t r;
  while ((r = read(fd, tmp, sizeof(tmp))) != 0) {
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 || ckpt_buf_append(&b, tmp, (size_t)r)) {
      int e = r < 0 ? errno : ENOMEM;
      close(fd);
      ckpt_buf_free(&b);
      errno = e;
      return NULL;
    }
  }
  close(fd);
  if (ckpt_buf_append(&b, "", 1)) {
    ckpt_buf_free(&b);
    errno = ENOMEM;
    return NULL;
  }
  return ckpt_buf_steal(&b);
}

static void draw_bar(const char *name, uint64_t done, uint64_t total,
                     double elapsed) {
  char a[32], b[32];
  int width = 30;
  double f = total ? (double)done / (double)total : 0;
  if (f > 1)
    f = 1;
  int fill = (int)(f * width);
  printf("\r%s: committing [", name);
  for (int i = 0; i < width; i++)
    putchar(i < fill ? '#' : '.');
  printf("] %3d%% %s of %s, %.0f s\033[K", (int)(f * 100),
         human_bytes(done, a, sizeof(a)), human_bytes(total, b, sizeof(b)),
         elapsed);
  fflush(stdout);
}

static int cmd_wait(const args_t *a, int bfd) {
  (void)bfd;
  const char *dir = a->pos[0];
  char base[PATH_MAX]; /* NAME, for messages: the last component */
  snprintf(base, sizeof(base), "%s", dir);
  for (size_t n = strlen(base); n > 1 && base[n - 1] == '/';)
    base[--n] = '\0';
  const char *name = strrchr(base, '/');
  name = name && name[1] ? name + 1 : base;
  bool tty = !a->json && isatty(STDOUT_FILENO);
  double start = now_s(), last_line = -1;
  char state[32] = "", last_state[32] = "";
  char *text = NULL;
  uint64_t done = 0, total = 0, last_done = UINT64_MAX;
  int status;
  for (;;) {
    free(text);
    text = read_status(dir);
    if (!text) {
      struct stat st;
      if (errno == ENOENT && stat(dir, &st) == 0)
        fail("%s has no .status: not a checkpoint directory of a ckptfs "
             "mount (give MOUNTPOINT/NAME)", dir);
      else
        fail("cannot read %s/.status: %s (give MOUNTPOINT/NAME of a "
             "checkpoint in a mounted ckptfs)", dir, strerror(errno));
      return EXIT_USAGE;
    }
    size_t l = strcspn(text, "\n");
    snprintf(state, sizeof(state), "%.*s", (int)(l < 31 ? l : 31), text);
    unsigned long long d = 0, t = 0;
    const char *p = strstr(text, "\nbytes ");
    if (p && sscanf(p, "\nbytes %llu of %llu", &d, &t) == 2)
      done = d, total = t;
    double el = now_s() - start;
    if (!strcmp(state, "committed") || !strcmp(state, "failed"))
      break;
    if (tty && !strcmp(state, "committing")) {
      draw_bar(name, done, total, el);
    } else if (!a->json && (strcmp(state, last_state) ||
                           (done != last_done && el - last_line >= 1))) {
      if (tty)
        printf("\r\033[K");
      if (!strcmp(state, "committing") && total == 0)
        printf("%s: committing: planning, every rank must commit\n", name);
      else if (!strcmp(state, "committing"))
        printf("%s: committing: %llu of %llu bytes written\n", name,
               (unsigned long long)done, (unsigned long long)total);
      else
        printf("%s: %s%s\n", name, state,
               !strcmp(state, "staging") ? " (waiting for the commit)" : "");
      fflush(stdout);
      last_line = el;
      last_done = done;
    }
    snprintf(last_state, sizeof(last_state), "%s", state);
    if (a->timeout > 0 && el >= a->timeout) {
      if (tty)
        putchar('\n');
      if (a->json) {
        json_t j;
        j_begin(&j);
        j_open(&j, '{');
        j_key(&j, "checkpoint"), j_str(&j, dir);
        j_key(&j, "state"), j_str(&j, "timeout");
        j_key(&j, "last_state"), j_str(&j, state);
        j_key(&j, "reason"), j_null(&j);
        j_key(&j, "bytes_done"), j_u64(&j, done);
        j_key(&j, "bytes_total"), j_u64(&j, total);
        j_key(&j, "elapsed"), j_double(&j, el);
        j_close(&j, '}');
        j_end(&j);
      }
      fail("%s: still %s after %g s (--timeout)", name, state, a->timeout);
      free(text);
      return EXIT_TIMEOUT;
    }
    struct timespec ts = {.tv_sec = (time_t)a->interval,
                          .tv_nsec = (long)((a->interval - (double)(time_t)a->interval) * 1e9)};
    nanosleep(&ts, NULL);
  }
  double el = now_s() - start;
  bool ok = !strcmp(state, "committed");
  const char *rest = strchr(text, '\n');
  rest = rest ? rest + 1 : "";
  char *reason = strdup(rest);
  if (reason) { /* drop the trailing newline */
    size_t n = strlen(reason);
    while (n && reason[n - 1] == '\n')
      reason[--n] = '\0';
  }
  if (tty && last_state[0] && !strcmp(last_state, "committing")) {
    if (ok)
      draw_bar(name, total, total, el);
    putchar('\n');
  }
  if (a->json) {
    json_t j;
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "checkpoint"), j_str(&j, dir);
    j_key(&j, "state"), j_str(&j, state);
    j_key(&j, "last_state"), j_str(&j, state);
    j_key(&j, "reason");
    ok ? j_null(&j) : j_str(&j, reason);
    j_key(&j, "bytes_done"), j_u64(&j, ok ? total : done);
    j_key(&j, "bytes_total"), j_u64(&j, total);
    j_key(&j, "elapsed"), j_double(&j, el);
    j_close(&j, '}');
    j_end(&j);
  } else if (ok) {
    /* "tensors 3\nblobs 1\nworld_size 2" -> "tensors 3, blobs 1, ..." */
    printf("%s: committed (", name);
    for (const char *q = reason ? reason : ""; *q; q++)
      if (*q == '\n')
        fputs(", ", stdout);
      else
        putchar(*q == '_' ? ' ' : *q);
    printf(") after %.1f s\n", el);
  } else {
    printf("%s: failed after %.1f s\n", name, el);
    fail("%s: the save failed: %s", name, reason ? reason : "");
  }
  status = ok ? 0 : EXIT_NO;
  free(reason);
  free(text);
  return status;
}

/* ------------------------------------------------------------------------
 * main
 * ---------------------------------------------------------------------- */

static const command_t commands[] = {
    {"ls", cmd_ls, 1, true, EXIT_NO, 0, 0,
     "list the checkpoints of BACKING_DIR",
     "usage: ckptctl ls [--json] BACKING_DIR\n"
     "\n"
     "List every checkpoint directory of BACKING_DIR: name, state\n"
     "(committed; unfinished: no .metadata, a save in flight or\n"
     "interrupted; damaged: .metadata does not load), creation time (ISO\n"
     "8601, UTC), world size, tensors, blobs, stored bytes.\n"
     "\n"
     "options:\n"
     "  --json       one JSON document instead of the table (default: off)\n"
     "  -h, --help   this help\n"},
    {"show", cmd_show, 2, true, EXIT_NO, 0, 0,
     "tensors and blobs of one checkpoint",
     "usage: ckptctl show [--json] BACKING_DIR NAME\n"
     "\n"
     "The tensors of committed checkpoint NAME (dtype, global shape,\n"
     "number of chunks, ranks holding them, stored bytes) and its blobs\n"
     "(bytes items: size, rank).\n"
     "\n"
     "options:\n"
     "  --json       one JSON document (default: off)\n"
     "  -h, --help   this help\n"},
    {"diff", cmd_diff, 3, true, EXIT_USAGE, OPTBIT(OPT_CONTENT), 0,
     "what changed between two checkpoints",
     "usage: ckptctl diff [--json] [--content] BACKING_DIR A B\n"
     "\n"
     "Tensors and blobs added in B, removed from A, and changed: dtype,\n"
     "shape, data (a chunk's XXH3-64 checksum differs), chunks (stored\n"
     "in differently shaped chunks: contents not compared), path; plus the\n"
     "number unchanged. Reads only .metadata, unless --content. Exit\n"
     "status 0: identical, 1: they differ, 2: usage or a checkpoint cannot\n"
     "be read.\n"
     "\n"
     "options:\n"
     "  --content    tensors stored in differently shaped chunks (saved at\n"
     "               another world size) are read whole from both and\n"
     "               compared: data or unchanged (default: off)\n"
     "  --json       one JSON document (default: off)\n"
     "  -h, --help   this help\n"},
    {"export", cmd_export, 2, true, EXIT_NO, OPTBIT(OPT_SAFETENSORS),
     OPTBIT(OPT_SAFETENSORS),
     "write a checkpoint as one safetensors file",
     "usage: ckptctl export [--json] BACKING_DIR NAME --safetensors FILE\n"
     "\n"
     "Write committed checkpoint NAME as one consolidated safetensors file:\n"
     "every tensor whole, assembled from its chunks, each chunk's checksum\n"
     "verified on the way (a damaged chunk fails the export and nothing is\n"
     "left). Written to FILE.tmp, synced, then renamed to FILE (replacing\n"
     "it). Blobs and tensors safetensors cannot hold (complex128, names\n"
     "that are not UTF-8) are left out and listed.\n"
     "\n"
     "options:\n"
     "  --safetensors FILE  the file to write (required)\n"
     "  --json              one JSON document (default: off)\n"
     "  -h, --help          this help\n"},
    {"prune", cmd_prune, 1, true, EXIT_NO,
     OPTBIT(OPT_KEEP) | OPTBIT(OPT_DRY_RUN), OPTBIT(OPT_KEEP),
     "remove all but the newest committed checkpoints",
     "usage: ckptctl prune [--json] [--dry-run] --keep N BACKING_DIR\n"
     "\n"
     "Remove the committed checkpoints of BACKING_DIR beyond the N newest\n"
     "(by created_at), each as `rm -r` through a mount does: .metadata\n"
     "first and durably, then the data. Unfinished saves and damaged\n"
     "checkpoints are neither counted nor touched; a checkpoint a writer\n"
     "still holds is skipped. Mounts drop removed checkpoints from their\n"
     "view at once.\n"
     "\n"
     "options:\n"
     "  --keep N     how many of the newest committed checkpoints to keep,\n"
     "               at least 1 (required)\n"
     "  --dry-run    only print what would be removed (default: off)\n"
     "  --json       one JSON document (default: off)\n"
     "  -h, --help   this help\n"},
    {"wait", cmd_wait, 1, false, EXIT_USAGE,
     OPTBIT(OPT_TIMEOUT) | OPTBIT(OPT_INTERVAL), 0, "follow an async save until it ends",
     "usage: ckptctl wait [--json] [--timeout SEC] [--interval SEC] "
     "MOUNTPOINT/NAME\n"
     "\n"
     "Follow NAME/.status on a mount: a progress bar on a terminal, a line\n"
     "per change otherwise, until the save is committed (exit 0) or failed\n"
     "(exit 1, the reason printed). A checkpoint still staging is waited\n"
     "for too. Exit 3 when --timeout passes first, 2 on usage errors or\n"
     "when PATH is not a checkpoint of a mount.\n"
     "\n"
     "options:\n"
     "  --timeout SEC   give up after SEC seconds (default: wait forever)\n"
     "  --interval SEC  how often to read .status (default: 0.1)\n"
     "  --json          one JSON document at the end (default: off)\n"
     "  -h, --help      this help\n"},
};

static void usage(FILE *to) {
  fprintf(to,
          "usage: ckptctl COMMAND [OPTIONS] ARGS\n"
          "\n"
          "The administrator's tool for a ckptfs BACKING_DIR (no mount "
          "needed)\nand for async saves of a mount.\n"
          "\n"
          "commands:\n");
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    fprintf(to, "  %-8s %s\n", commands[i].name, commands[i].summary);
  fprintf(to,
          "\n"
          "options of every command:\n"
          "  --json       one JSON document on stdout (default: text)\n"
          "  -h, --help   the command's own options\n"
          "\n"
          "`ckptctl COMMAND --help` shows the options of each. Exit status: "
          "0 done\n(diff: identical), 1 not done or not so (diff: differ; "
          "wait: the save\nfailed), 2 usage error (diff, wait: also errors), "
          "3 wait timed out.\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return EXIT_USAGE;
  }
  if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
      !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    if (!strcmp(argv[1], commands[i].name)) {
      current = &commands[i];
      args_t a;
      int rc = parse_args(argc - 1, argv + 1, &a);
      if (rc)
        return rc == 1 ? 0 : rc;
      int bfd = current->backing ? open_backing(a.pos[0]) : -1;
      if (current->backing && bfd < 0)
        return current->error_exit;
      rc = current->run(&a, bfd);
      if (bfd >= 0)
        close(bfd);
      return rc;
    }
  fprintf(stderr, "%s: unknown command '%s'\n\n", prog, argv[1]);
  usage(stderr);
  return EXIT_USAGE;
}
