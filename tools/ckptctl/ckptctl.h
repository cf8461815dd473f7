/*
 * ckptctl.h - private to tools/ckptctl/: what the command files share.
 *
 *   main.c         argument dispatch, usage, the exit codes below
 *   common.c       messages, times and sizes, loading checkpoints, reading
 *                  whole tensors from the data files (diff --content,
 *                  export)
 *   json.c         the JSON writer (json.h)
 *   cmd_NAME.c     one command each: ls, show, diff, export, prune, wait
 */
#ifndef CKPTCTL_H
#define CKPTCTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt_planner.h"
#include "store.h"

#define EXIT_NO 1      /* diff: differ; wait: failed; others: not done */
#define EXIT_USAGE 2
#define EXIT_TIMEOUT 3 /* wait */

extern const char *const prog; /* "ckptctl", for messages */

/* The parsed command line of one command (main.c). */
typedef struct {
  bool json;
  const char *safetensors;
  const char *dcp;     /* export --dcp DIR */
  long long keep;      /* -1: not given */
  ckpt_keep_policy_t policy; /* prune: --keep (as --keep-last),
                                --keep-last/-every/-best, --metric, --mode */
  const char *mode;    /* prune --mode, or NULL */
  const char *tier;    /* ls --tier DIR, or NULL */
  bool dry_run;
  bool content;        /* diff: compare differently chunked tensors */
  enum { SORT_TIME, SORT_NAME, SORT_SIZE } sort; /* ls */
  double timeout;      /* seconds; 0: none */
  double interval;     /* seconds */
  int level;           /* wait --level: 0 none (committed), 1 local,
                          2 partner, 3 shared */
  char *pos[4];        /* positional arguments */
  int npos;
} args_t;

/* The commands: the exit status. backing_fd is BACKING_DIR (a->pos[0])
 * opened, or -1 for wait. */
int cmd_ls(const args_t *a, int backing_fd);
int cmd_show(const args_t *a, int backing_fd);
int cmd_diff(const args_t *a, int backing_fd);
int cmd_export(const args_t *a, int backing_fd);
int cmd_prune(const args_t *a, int backing_fd);
int cmd_wait(const args_t *a, int backing_fd);
/* protect / unprotect NAME (cmd_prune.c) */
int cmd_protect(const args_t *a, int backing_fd);
int cmd_unprotect(const args_t *a, int backing_fd);
int cmd_import_dcp(const args_t *a, int backing_fd);
/* export --dcp (cmd_dcp.c): run by cmd_export. */
int export_dcp(const args_t *a);

/* ------------------------------------------------------------------------
 * Messages, times, sizes (common.c).
 * ---------------------------------------------------------------------- */

/* "ckptctl: MESSAGE\n" on stderr. */
void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* mountinfo's octal escapes (\040 for a space) undone in place; s. */
char *mountinfo_unescape(char *s);

/* "2026-12-02T17:40:00Z" */
const char *iso_time(int64_t t, char *buf, size_t cap);
/* "512 B", "1.5 KiB", "3.0 GiB" */
const char *human_bytes(uint64_t n, char *buf, size_t cap);
/* "[4096,1024]" */
const char *dims_text(const int64_t *d, int n, char *buf, size_t cap);

/* ------------------------------------------------------------------------
 * Loading checkpoints (common.c).
 * ---------------------------------------------------------------------- */

/* BACKING_DIR path opened: the fd, or -1 with the reason printed (also
 * when path is a ckptfs mount rather than its backing directory). */
int open_backing(const char *path);

/* Load BACKING_DIR/name/.metadata whole: 0, or -1 with the reason
 * printed. */
int load_named(int backing_fd, const char *backing, const char *name,
               ckpt_metadata_t *m);

/* The bytes stored for m's chunks and blobs. */
uint64_t stored_bytes(const ckpt_metadata_t *m);

/* ------------------------------------------------------------------------
 * Reading whole tensors from the data files (common.c; export, diff
 * --content).
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

/* The data files of one checkpoint, through the store's reader. */
typedef struct {
  const char *backing, *name;
  ckpt_fdcache_t *cache;
  ckpt_stored_t s;
  bool open;
} data_files_t;

/* Set df up for checkpoint name (holding m) of BACKING_DIR bfd: 0, or -1
 * with the reason printed. */
int df_open(data_files_t *df, int bfd, const ckpt_metadata_t *m);
void df_close(data_files_t *df);

/* Where an assembled window goes: sink(arg, bytes, n, at) with at its
 * offset in the tensor, windows in order; 0, or -1 with the reason
 * printed. */
typedef int (*sink_fn)(void *arg, const uint8_t *p, size_t n, uint64_t at);

/* Assemble tensor t from its chunks, window by window, into sink,
 * verifying every chunk's checksum (see window_t). 0, or -1 with the
 * reason printed (the sink may have seen part of the tensor then). */
int assemble_tensor(data_files_t *df, const ckpt_metadata_t *m,
                    const ckpt_tensor_meta_t *t, window_t *w, sink_fn sink,
                    void *arg);

#endif
