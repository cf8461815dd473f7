/*
 * catalog.h - the checkpoints of a backing directory, as an administrator
 * sees them: listing (committed, unfinished, damaged), pruning the oldest
 * committed ones, and removing one durably.
 *
 * Shared by the offline tools (ckptctl, ckptfs-fsck) and the mount's
 * keep_last (on the dist thread, after a commit). No FUSE and no MPI here;
 * .metadata is read through metadb.c.
 */
#ifndef CKPT_CATALOG_H
#define CKPT_CATALOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "ckpt_planner.h"

typedef enum {
  CKPT_CAT_COMMITTED,  /* .metadata loads */
  CKPT_CAT_UNFINISHED, /* no .metadata: a save in flight or interrupted */
  CKPT_CAT_DAMAGED,    /* .metadata is there but does not load */
} ckpt_cat_state_t;

typedef struct {
  char *name;             /* owned */
  ckpt_cat_state_t state;
  struct timespec mtime;  /* committed: .metadata's mtime; orders checkpoints
                             of one created_at second */
  bool held;              /* unfinished: a writer holds its flock */
  uint64_t disk_bytes;    /* sizes of the files in BACKING_DIR/NAME
                             (scanned with full; else 0) */
  char *error;            /* damaged: why (owned) */
  ckpt_metadata_t meta;   /* committed: the header (name, save_id,
                             world_size, created_at), or all of it when
                             scanned with full */
  char *mount;            /* not in BACKING_DIR yet: the local mount that
                             stages it (ckptctl ls), or NULL; owned */
  char *mount_state;      /* then the first line of its .status; owned */
  /* committed, for retention: */
  int64_t step;           /* step=N recorded at commit, else the last run
                             of digits in the name, else -1 */
  bool is_protected;      /* the protect marker (ckptctl protect) if set,
                             else the commit word protect */
  const char *location;   /* ckptctl ls --tier: "shared", "shared+tier",
                             "tier" (a static string), or NULL */
} ckpt_cat_entry_t;

typedef struct {
  size_t n;
  ckpt_cat_entry_t *e;    /* owned, sorted by name */
} ckpt_catalog_t;

/* The names in BACKING_DIR that are checkpoint names and directories (not
 * symlinks), sorted. *names (and each name) malloc'd. 0 or -errno. */
int ckpt__catalog_names(int backing_fd, char ***names, size_t *n);
void ckpt__catalog_names_free(char **names, size_t n);

/* Describe every checkpoint directory of BACKING_DIR. full: load each .metadata whole (tensors,
 * chunks, blobs) and sum the sizes of its files; else only its header.
 * 0 or -errno (BACKING_DIR cannot be listed). */
int ckpt__catalog_scan(int backing_fd, bool full,
                       ckpt_catalog_t *out);
void ckpt__catalog_free(ckpt_catalog_t *c);

/* The saves in flight or interrupted in BACKING_DIR/.saves, appended to
 * c as UNFINISHED entries named ".saves/SAVE_ID" (held: a save in flight,
 * that is committing; disk_bytes: what it wrote so far). 0 or -errno. */
int ckpt__catalog_saves(int backing_fd, ckpt_catalog_t *c);

/* Which committed entries lie beyond the keep newest (created_at, then
 * .metadata's mtime, then name): remove[i] set for those. The entry named
 * keep_name (NULL: none) is always kept and counts as one of the keep.
 * Unfinished and damaged entries are never selected. Returns how many are
 * selected. keep 0 selects nothing (keep all). */
size_t ckpt__catalog_select_old(const ckpt_catalog_t *c, uint32_t keep,
                                const char *keep_name, bool *remove);

/* Why a policy keeps a committed entry (bits of why[i]); 0: removed. */
enum {
  CKPT_KEPT_LAST = 1,      /* one of the last N by step */
  CKPT_KEPT_EVERY = 2,     /* its step is a multiple of K */
  CKPT_KEPT_BEST = 4,      /* one of the best M by the metric */
  CKPT_KEPT_UNRANKED = 8,  /* best: it has no value of the metric, so it
                              cannot be ranked (kept, as Orbax does) */
  CKPT_KEPT_PROTECTED = 16,
  CKPT_KEPT_CURRENT = 32,  /* keep_name: just committed */
  CKPT_KEPT_NO_POLICY = 64 /* the policy has no rule: all kept */
};
/* "last", "every", "best", ... joined by "+" into buf: why's bits. */
const char *ckpt__catalog_why_text(unsigned why, char *buf, size_t cap);

/* Which committed entries policy p removes: remove[i] set for those, and
 * (why non-NULL) why[i] the reasons each other committed entry is kept.
 * Entries are ordered by step (those without one first), then created_at,
 * .metadata's mtime and name. A committed entry is kept when one rule
 * keeps it: the last p->last, those whose step is a multiple of
 * p->every, the p->best best by metric p->metric (lowest first, or
 * highest with maximize; ties: the later one) and every one without a
 * value of it, every protected one, and keep_name (NULL: none). Unfinished
 * and damaged entries are never selected. Returns how many are selected. */
size_t ckpt__catalog_select_policy(const ckpt_catalog_t *c,
                                   const ckpt_keep_policy_t *p,
                                   const char *keep_name, bool *remove,
                                   unsigned *why);

/* The same, for a policy that removes them (-o keep=, ckptctl prune):
 * each selected entry is first loaded whole, and one that is refused
 * (a gap, an overlap, ...) becomes DAMAGED with its reason and is never
 * selected: a damaged checkpoint is reported, not removed. why: as
 * above, or NULL. */
size_t ckpt__catalog_select_prunable(int backing_fd, ckpt_catalog_t *c,
                                     const ckpt_keep_policy_t *p,
                                     const char *keep_name, bool *remove,
                                     unsigned *why);

/* The protect marker of a committed checkpoint: BACKING_DIR/NAME/.protected
 * holding "1" (protected) or "0" (not, whatever its commit said), written
 * by ckptctl protect/unprotect. */
#define CKPT_PROTECT_FILE ".protected"
/* The marker in checkpoint directory dfd: 1, 0, or -1 when there is none
 * (or it cannot be read). */
int ckpt__protect_read(int dfd);
/* Set the marker of committed checkpoint name to on, atomically and
 * durably: .protected.tmp written and fsynced, renamed over .protected,
 * the directory fsynced; under an exclusive flock of the directory, so
 * that an entry removal (which carries the marker into its new version)
 * does not run meanwhile. 0, -ENOENT (not committed) or -errno. */
int ckpt__checkpoint_protect(int backing_fd, const char *name, bool on);

/* Delete BACKING_DIR/name (committed or not):
 *  1. with if_idle, take an exclusive flock on the directory without
 *     waiting: -EBUSY when a writer holds it;
 *  2. unlink .metadata and fsync the directory: from here on the
 *     checkpoint is gone for every mount, and a crash leaves only an
 *     unfinished save, which the next mount removes;
 *  3. remove the data files and the directory, fsync BACKING_DIR.
 * 0 (also when it does not exist) or -errno. */
int ckpt__checkpoint_remove(int backing_fd, const char *name, bool if_idle);

/* -o tier_keep=N (fs/tier/retain.c): of the checkpoints of a node-local tier
 * (tier_fd) that are flushed, keep the last keep by step and remove the
 * others (as ckpt__checkpoint_remove). Flushed: no flush record of its
 * save in tier_fd/records_dir (an entry named SAVE_ID or SAVE_ID.SOMETHING)
 * and BACKING_DIR/NAME (backing_fd) carries the same save ID. A tier
 * checkpoint without a record whose BACKING_DIR/NAME is another save or
 * none is stale (a copy of a save NAME is no more: fs/read/resolve.c) and
 * removed too, whatever keep; an unflushed one (a record names it: it may
 * be the only copy) is neither counted nor touched, and nothing is
 * removed when the records cannot be listed. The caller holds off tier
 * publishes meanwhile. *removed (malloc'd names, NULL when none; may be
 * NULL itself) and *n_removed say what went. 0 or -errno. */
int ckpt__tier_evict(int tier_fd, int backing_fd, const char *records_dir,
                     uint32_t keep, char ***removed, size_t *n_removed);

#endif /* CKPT_CATALOG_H */
