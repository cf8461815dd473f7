/*
 * main.c - ckptctl, the administrator's command line over a backing
 * directory (no mount needed), and over an async save of a mount:
 *
 *   ckptctl ls     BACKING_DIR                  checkpoints and their state
 *   ckptctl show   BACKING_DIR NAME             tensors and blobs of one
 *   ckptctl diff   BACKING_DIR A B              what changed between two
 *   ckptctl export BACKING_DIR NAME --safetensors FILE
 *   ckptctl prune  BACKING_DIR --keep-last N [--keep-every K]
 *                  [--keep-best M --metric KEY [--mode min|max]] [--dry-run]
 *   ckptctl protect|unprotect BACKING_DIR NAME
 *   ckptctl wait   MOUNT/NAME [--timeout SEC]   follow an async save
 *
 * Every command prints text for people by default and one JSON document
 * with --json (keys listed in the README, "ckptctl"). Exit status: 0 done
 * (diff: identical), 1 the thing asked about is not so (diff: they differ;
 * wait: the save failed; others: something could not be done), 2 usage or
 * an error that stops the command (diff, wait), 3 wait timed out
 * (ckptctl.h).
 *
 * It reads .metadata through metadb.c and lists and removes checkpoints
 * with catalog.c, as the mount does; safe to run while mounts run. This
 * file parses the command line and runs the command: one file each
 * (cmd_NAME.c), what they share in common.c.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckptctl.h"

const char *const prog = "ckptctl";

/* ------------------------------------------------------------------------
 * Command lines.
 * ---------------------------------------------------------------------- */

enum { OPT_JSON = 1000, OPT_HELP, OPT_SAFETENSORS, OPT_KEEP, OPT_DRY_RUN,
       OPT_TIMEOUT, OPT_INTERVAL, OPT_CONTENT, OPT_SORT, OPT_DCP,
       OPT_KEEP_LAST, OPT_KEEP_EVERY, OPT_KEEP_BEST, OPT_METRIC, OPT_MODE,
       OPT_LEVEL, OPT_TIER };
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
    {"sort", required_argument, NULL, OPT_SORT},
    {"dcp", required_argument, NULL, OPT_DCP},
    {"keep-last", required_argument, NULL, OPT_KEEP_LAST},
    {"keep-every", required_argument, NULL, OPT_KEEP_EVERY},
    {"keep-best", required_argument, NULL, OPT_KEEP_BEST},
    {"metric", required_argument, NULL, OPT_METRIC},
    {"mode", required_argument, NULL, OPT_MODE},
    {"level", required_argument, NULL, OPT_LEVEL},
    {"tier", required_argument, NULL, OPT_TIER},
    {0, 0, 0, 0}};

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

/* --keep, --keep-last, --keep-every or --keep-best (c) from optarg into
 * a: 0 or EXIT_USAGE (message printed). */
static int parse_count_option(int c, args_t *a) {
  char *end = NULL;
  if (c == OPT_KEEP) {
    errno = 0;
    a->keep = strtoll(optarg, &end, 10);
    if (errno || end == optarg || *end || a->keep < 1 ||
        a->keep > UINT32_MAX)
      return usage_error("--keep '%s': expected a number of checkpoints, "
                         "at least 1 (to remove them all, rm -r them)",
                         optarg);
    return 0;
  }
  errno = 0;
  long long v = strtoll(optarg, &end, 10);
  uint64_t max = c == OPT_KEEP_EVERY ? INT64_MAX : UINT32_MAX;
  if (errno || end == optarg || *end || v < 1 || (uint64_t)v > max)
    return usage_error("--%s '%s': expected a number, at least 1",
                       all_options[c - OPT_JSON].name, optarg);
  if (c == OPT_KEEP_LAST)
    a->policy.last = (uint32_t)v;
  else if (c == OPT_KEEP_EVERY)
    a->policy.every = (uint64_t)v;
  else
    a->policy.best = (uint32_t)v;
  return 0;
}

/* --timeout or --interval (c) from optarg into a: 0 or EXIT_USAGE
 * (message printed). */
static int parse_seconds_option(int c, args_t *a) {
  char *end = NULL;
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
  return 0;
}

/* --metric, --mode, --level or --sort (c), whose value is one of a set of
 * words, from optarg into a: 0 or EXIT_USAGE (message printed). */
static int parse_word_option(int c, args_t *a) {
  switch (c) {
  case OPT_METRIC:
    if (!ckpt_metric_key_valid(optarg, strlen(optarg)))
      return usage_error("--metric '%s': expected a metric key (letters, "
                         "digits, _ . -; as in metric=KEY:VALUE)", optarg);
    snprintf(a->policy.metric, sizeof(a->policy.metric), "%s", optarg);
    break;
  case OPT_MODE:
    if (strcmp(optarg, "min") && strcmp(optarg, "max"))
      return usage_error("--mode '%s': expected min or max", optarg);
    a->mode = optarg;
    a->policy.maximize = !strcmp(optarg, "max");
    break;
  case OPT_LEVEL:
    a->level = !strcmp(optarg, "local")     ? 1
               : !strcmp(optarg, "partner") ? 2
               : !strcmp(optarg, "shared")  ? 3
                                            : -1;
    if (a->level < 0)
      return usage_error("--level '%s': expected local, partner or shared",
                         optarg);
    break;
  default: /* OPT_SORT */
    if (!strcmp(optarg, "time"))
      a->sort = SORT_TIME;
    else if (!strcmp(optarg, "name"))
      a->sort = SORT_NAME;
    else if (!strcmp(optarg, "size"))
      a->sort = SORT_SIZE;
    else
      return usage_error("--sort '%s': expected time, name or size", optarg);
    break;
  }
  return 0;
}

/* Option c of getopt_long (optarg its value) into a: 0, 1 (--help
 * printed) or EXIT_USAGE (message printed). */
static int parse_option(int c, char **argv, args_t *a) {
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
  case OPT_DCP:
    a->dcp = optarg;
    break;
  case OPT_KEEP:
  case OPT_KEEP_LAST:
  case OPT_KEEP_EVERY:
  case OPT_KEEP_BEST:
    return parse_count_option(c, a);
  case OPT_METRIC:
  case OPT_MODE:
  case OPT_LEVEL:
  case OPT_SORT:
    return parse_word_option(c, a);
  case OPT_TIER:
    a->tier = optarg;
    break;
  case OPT_DRY_RUN:
    a->dry_run = true;
    break;
  case OPT_CONTENT:
    a->content = true;
    break;
  case OPT_TIMEOUT:
  case OPT_INTERVAL:
    return parse_seconds_option(c, a);
  case ':':
    return usage_error("option %s needs a value", argv[optind - 1]);
  default:
    return usage_error("unknown option '%s'", argv[optind - 1]);
  }
  return 0;
}

/* prune: the policy its options state, checked whole. */
static int policy_args(args_t *a) {
  if (a->keep >= 0 && a->policy.last)
    return usage_error("--keep N is --keep-last N: give one of them");
  if (a->keep >= 0)
    a->policy.last = (uint32_t)a->keep;
  if (a->policy.best && !a->policy.metric[0])
    return usage_error("--keep-best M needs --metric KEY: the metric to "
                       "rank by");
  if (!a->policy.best && (a->policy.metric[0] || a->mode))
    return usage_error("--metric and --mode go with --keep-best M");
  if (!ckpt_keep_policy_active(&a->policy))
    return usage_error("a rule is required: --keep-last N, --keep-every K "
                       "or --keep-best M (what to keep)");
  return 0;
}

/* Parse argv (argv[0] is the command) for the current command. 0, 1
 * (--help printed) or EXIT_USAGE (message printed). */
static int parse_args(int argc, char **argv, args_t *a) {
  memset(a, 0, sizeof(*a));
  a->keep = -1;
  a->interval = 0.1;
  optind = 1;
  opterr = 0;
  int c, rc;
  while ((c = getopt_long(argc, argv, ":h", all_options, NULL)) != -1)
    if ((rc = parse_option(c, argv, a)))
      return rc;
  for (int i = optind; i < argc; i++) {
    if (a->npos == current->npos)
      return usage_error("unexpected argument '%s'", argv[i]);
    a->pos[a->npos++] = argv[i];
  }
  if (a->npos < current->npos)
    return usage_error("missing arguments");
  if ((current->required & OPTBIT(OPT_SAFETENSORS)) && !a->safetensors &&
      !a->dcp)
    return usage_error("--safetensors FILE or --dcp DIR is required");
  if (a->safetensors && a->dcp)
    return usage_error("--safetensors and --dcp: one format at a time");
  if (current->options & OPTBIT(OPT_KEEP_LAST))
    return policy_args(a);
  return 0;
}

/* ------------------------------------------------------------------------
 * main
 * ---------------------------------------------------------------------- */

static const command_t commands[] = {
    {"ls", cmd_ls, 1, true, EXIT_NO, OPTBIT(OPT_SORT) | OPTBIT(OPT_TIER), 0,
     "list the checkpoints of BACKING_DIR",
     "usage: ckptctl ls [--json] [--sort time|name|size] [--tier DIR] "
     "BACKING_DIR\n"
     "\n"
     "List every checkpoint directory of BACKING_DIR: name, state\n"
     "(committed; unfinished: no .metadata, a save in flight or\n"
     "interrupted; damaged: .metadata does not load), creation time (ISO\n"
     "8601, UTC), world size, tensors, blobs, stored bytes.\n"
     "\n"
     "options:\n"
     "  --sort KEY   time: oldest committed first, then the others by name;\n"
     "               name: by name, numbers in names by value (step-8 before\n"
     "               step-10); size: largest first (default: time)\n"
     "  --tier DIR   also the node-local tier DIR of a mount (-o tier=DIR):\n"
     "               a LOCATION column, shared (BACKING_DIR only),\n"
     "               shared+tier (flushed, kept in the tier) or tier (not\n"
     "               flushed yet) (default: BACKING_DIR only)\n"
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
    {"export", cmd_export, 2, true, EXIT_NO,
     OPTBIT(OPT_SAFETENSORS) | OPTBIT(OPT_DCP), OPTBIT(OPT_SAFETENSORS),
     "write a checkpoint as one safetensors file or a DCP directory",
     "usage: ckptctl export [--json] BACKING_DIR NAME --safetensors FILE\n"
     "       ckptctl export BACKING_DIR NAME --dcp DIR\n"
     "\n"
     "Write committed checkpoint NAME as one consolidated safetensors file:\n"
     "every tensor whole, assembled from its chunks, each chunk's checksum\n"
     "verified on the way (a damaged chunk fails the export and nothing is\n"
     "left). Written to FILE.tmp, synced, then renamed to FILE (replacing\n"
     "it). Blobs and tensors safetensors cannot hold (complex128, names\n"
     "that are not UTF-8) are left out and listed.\n"
     "\n"
     "--dcp DIR writes it as stock PyTorch DCP does (one __0_0.distcp of\n"
     "torch.save'd tensors and bytes items, a pickled .metadata), so that\n"
     "torch.distributed.checkpoint.load(checkpoint_id=DIR) reads it; it runs\n"
     "the ckptfs Python package (python -P -s -m ckptfs.dcp, from /) in\n"
     "$CKPTFS_PYTHON, else the interpreter the package's ckptfs-dcp on\n"
     "PATH names in its #! line, else python3; it needs Python >= 3.11 and\n"
     "torch 2.x; files are created in DIR without following symlinks\n"
     "(docs/pytorch.md).\n"
     "\n"
     "options:\n"
     "  --safetensors FILE  the safetensors file to write (default: none;\n"
     "                      this or --dcp is required)\n"
     "  --dcp DIR           the DCP directory to write (default: none)\n"
     "  --json              one JSON document (default: off)\n"
     "  -h, --help          this help\n"},
    {"import-dcp", cmd_import_dcp, 3, false, EXIT_NO, 0, 0,
     "bring a stock PyTorch DCP checkpoint into BACKING_DIR",
     "usage: ckptctl import-dcp [--json] DCP_DIR BACKING_DIR NAME\n"
     "\n"
     "Import the checkpoint that torch.distributed.checkpoint.save wrote\n"
     "to DCP_DIR (FileSystemWriter) as committed checkpoint NAME of\n"
     "BACKING_DIR, bit for bit: every tensor whole, assembled by DCP's own\n"
     "reader (chunks of any stride, from any number of ranks), every\n"
     "bytes/object item's stored bytes unchanged. BACKING_DIR is mounted\n"
     "for the duration (one rank) with the ckptfs beside ckptctl\n"
     "($CKPTFS_BIN). Runs the ckptfs Python package (python -P -s -m\n"
     "ckptfs.dcp, from /) in $CKPTFS_PYTHON, else the interpreter the\n"
     "package's ckptfs-dcp on PATH names in its #! line, else python3; it\n"
     "needs Python >= 3.11 and torch 2.x. DCP_DIR may belong to anyone: its\n"
     ".metadata is read by a restricted unpickler (DCP's classes only) and\n"
     "its items only as regular files named plainly in it, never through a\n"
     "symlink; anything else is refused before NAME is created\n"
     "(docs/pytorch.md).\n"
     "\n"
     "options:\n"
     "  --json       one JSON document: name, from, to, format (default: "
     "off)\n"
     "  -h, --help   this help\n"},
    {"prune", cmd_prune, 1, true, EXIT_NO,
     OPTBIT(OPT_KEEP) | OPTBIT(OPT_DRY_RUN) | OPTBIT(OPT_KEEP_LAST) |
         OPTBIT(OPT_KEEP_EVERY) | OPTBIT(OPT_KEEP_BEST) | OPTBIT(OPT_METRIC) |
         OPTBIT(OPT_MODE),
     0, "remove the committed checkpoints a retention policy does not keep",
     "usage: ckptctl prune [--json] [--dry-run] [--keep-last N]\n"
     "           [--keep-every K] [--keep-best M --metric KEY [--mode "
     "min|max]] BACKING_DIR\n"
     "\n"
     "Remove the committed checkpoints of BACKING_DIR that no rule keeps,\n"
     "each as `rm -r` through a mount does: .metadata first and durably,\n"
     "then the data. Checkpoints are ordered by step (step=N recorded at\n"
     "commit, else the last number in the name; none: oldest), then by\n"
     "creation time. Protected ones (commit word protect, ckptctl protect)\n"
     "are kept. Unfinished saves and damaged checkpoints are neither\n"
     "counted nor touched; a checkpoint a writer still holds is skipped.\n"
     "The same policy as the mount option -o keep=last:N,every:K,\n"
     "best:M:KEY:min|max. Mounts drop removed checkpoints from their view\n"
     "at once. At least one rule is required.\n"
     "\n"
     "options:\n"
     "  --keep-last N   keep the last N by step (default: none)\n"
     "  --keep N        the same as --keep-last N (default: none)\n"
     "  --keep-every K  keep every checkpoint whose step is a multiple of K\n"
     "                  (default: none)\n"
     "  --keep-best M   keep the M best by --metric, and every checkpoint\n"
     "                  without that metric, which cannot be ranked\n"
     "                  (default: none)\n"
     "  --metric KEY    the metric of --keep-best, as in the commit word\n"
     "                  metric=KEY:VALUE; needed by --keep-best\n"
     "                  (default: none)\n"
     "  --mode min|max  lowest or highest is best (default: min)\n"
     "  --dry-run       only print what would be removed, and why each\n"
     "                  other one is kept (default: off)\n"
     "  --json          one JSON document (default: off)\n"
     "  -h, --help      this help\n"},
    {"protect", cmd_protect, 2, true, EXIT_NO, 0, 0,
     "mark a checkpoint so that no retention policy removes it",
     "usage: ckptctl protect [--json] BACKING_DIR NAME\n"
     "\n"
     "Mark committed checkpoint NAME protected: -o keep= and ckptctl prune\n"
     "keep it whatever their rules say (rm -r still removes it). Written\n"
     "as BACKING_DIR/NAME/.protected, atomically and durably.\n"
     "\n"
     "options:\n"
     "  --json       one JSON document (default: off)\n"
     "  -h, --help   this help\n"},
    {"unprotect", cmd_unprotect, 2, true, EXIT_NO, 0, 0,
     "undo protect (also of a commit's protect word)",
     "usage: ckptctl unprotect [--json] BACKING_DIR NAME\n"
     "\n"
     "Mark committed checkpoint NAME not protected, also when its commit\n"
     "said protect: retention policies treat it as any other again.\n"
     "\n"
     "options:\n"
     "  --json       one JSON document (default: off)\n"
     "  -h, --help   this help\n"},
    {"wait", cmd_wait, 1, false, EXIT_USAGE,
     OPTBIT(OPT_TIMEOUT) | OPTBIT(OPT_INTERVAL) | OPTBIT(OPT_LEVEL), 0,
     "follow an async save until it ends",
     "usage: ckptctl wait [--json] [--timeout SEC] [--interval SEC] "
     "[--level L] MOUNTPOINT/NAME\n"
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
     "  --level L       with -o tier: wait on until the checkpoint is at\n"
     "                  level L (local, partner or shared: its .status\n"
     "                  location); a flush that failed for good is exit 1\n"
     "                  (default: committed at the mount's own level)\n"
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
    fprintf(to, "  %-10s %s\n", commands[i].name, commands[i].summary);
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

/* Run command c on argv (argv[0] its name): its exit status. */
static int run_command(const command_t *c, int argc, char **argv) {
  current = c;
  args_t a;
  int rc = parse_args(argc, argv, &a);
  if (rc)
    return rc == 1 ? 0 : rc;
  int bfd = c->backing ? open_backing(a.pos[0]) : -1;
  if (c->backing && bfd < 0)
    return c->error_exit;
  rc = c->run(&a, bfd);
  if (bfd >= 0)
    close(bfd);
  return rc;
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
    if (!strcmp(argv[1], commands[i].name))
      return run_command(&commands[i], argc - 1, argv + 1);
  fprintf(stderr, "%s: unknown command '%s'\n\n", prog, argv[1]);
  usage(stderr);
  return EXIT_USAGE;
}
