/*
 * fs.h - the bottom of the daemon (fs/core): the mount object every layer
 * works on, its options, counters, staging budget and worker pool.
 *
 * fs/ is in layers, each a directory with one header, each header
 * including the one below it; a layer calls only its own and lower ones
 * (tests/layering.py checks it on every build, docs/code.md maps it):
 *
 *   daemon   main, options, the metrics file, the mount's setup
 *   ops      the FUSE callbacks, by request family
 *   commit   freeze, the save's steps, partner copies, job processes
 *   tier     the flusher, publish, retention of the tier
 *   read     which save a name is (resolve), the committed tree, views,
 *            blocks, loading from BACKING_DIR
 *   journal  the tier's records of unflushed saves, the node's tier lock
 *   stage    staged files: segments, passthrough, streams, the drain
 *   tree     nodes, checkpoints, the inode table, fs->lock
 *   core     this header: struct ckpt_fs, options, counters, the pool
 *
 * Locks, in acquisition order (a lock is taken only while holding locks
 * above it in this list, never one below it):
 *   1. ck->freeze (rwlock): data changes of staged files hold it shared,
 *      the freeze at commit holds it exclusive;
 *   2. the removal lock of ops/ (ops_removal_lock): one removal inside
 *      committed checkpoints at a time;
 *   3. fs->lock (mutex): the tree, the inode table, node and checkpoint
 *      reference counts, checkpoint states;
 *   4. fs->tier_publish (mutex): a commit's publish in the tier, the
 *      flush's check and removal of the tier copy;
 *   5. fs->scan_lock (mutex): the root's listing and the refused list;
 *   6. sf->lock (mutex): the data and xattrs of one staged file;
 *   leaves (nothing taken while held): the pool's, the flusher's queue,
 *   the drain's queue, the jobs' table, the staging budget, the streams',
 *   the resolver's cache.
 * The node's tier lock (TIER/.flush/.lock, flock) is a file lock across
 * mounts: taken with none of the above held but fs->tier_publish.
 * Where a comment says "X held", an assert checks it (CKPT_HELD).
 */
#ifndef CKPT_FS_FS_CORE_H
#define CKPT_FS_FS_CORE_H



#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 14)
#include <fuse_lowlevel.h>

#include <assert.h>
#include <pthread.h>
#include <unistd.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "ckpt_dist.h"

/* The kernel sends the RELEASE of a handle only once it has the replies to
 * every request made on it, so a release may free what the handle's reads
 * used. ThreadSanitizer sees that order through the writes of the replies
 * to /dev/fuse, but not through a reply spliced from a data file (splice
 * is not intercepted): there we tell it, on the checkpoint the node
 * belongs to (freed last): CKPT_SPLICED(ck) just before such a reply,
 * CKPT_RELEASING(ck) in RELEASE before anything is freed. Nothing in other
 * builds. */
#if defined(__SANITIZE_THREAD__)
#define CKPT_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CKPT_UNDER_TSAN 1
#endif
#endif
#ifdef CKPT_UNDER_TSAN
#include <sanitizer/tsan_interface.h>
#define CKPT_SPLICED(ck) __tsan_release(ck)
#define CKPT_RELEASING(ck) __tsan_acquire(ck)
#else
#define CKPT_SPLICED(ck) ((void)(ck))
#define CKPT_RELEASING(ck) ((void)(ck))
#endif
#include "ckpt_planner.h"
#include "metadb.h"
#include "store.h"


/* Does the calling thread hold mutex m? glibc records the owner's thread
 * ID in every mutex it locks; elsewhere this cannot be known (true).
 * CKPT_HELD(m) asserts it where a comment says "m held" (Debug builds,
 * the sanitizers' among them; compiled out with NDEBUG). */
static inline bool ckpt__held(const pthread_mutex_t *m) {
#ifdef __GLIBC__
  return m->__data.__owner == gettid();
#else
  (void)m;
  return true;
#endif
}
#define CKPT_HELD(m) assert(ckpt__held(m))

typedef struct ckpt_node ckpt_node_t;
typedef struct ckpt_ckpt ckpt_ckpt_t;
typedef struct ckpt_fs ckpt_fs_t;

/* ------------------------------------------------------------------------
 * Options (parsed by daemon/options.c).
 * ---------------------------------------------------------------------- */

typedef struct {
  uint64_t staging_mem;       /* bytes of RAM for staged data */
  double commit_timeout;      /* seconds */
  uint32_t io_threads;        /* data files written per rank */
  uint64_t readahead;         /* the mount's kernel readahead, bytes; 0: as is */
  bool sync_files;            /* fsync data and metadata at commit */
  bool direct_reads;          /* committed tensors bypass the mount's cache */
  bool passthrough;           /* staged files written by FUSE passthrough */
  bool passthrough_set;       /* ... asked for explicitly (-o passthrough=) */
  bool verify;                /* check each chunk's XXH3 before serving it */
  uint64_t safetensors_shard; /* tensor bytes per NAME/.safetensors shard */
  ckpt_replica_check_t replica_check;
  ckpt_keep_policy_t keep;    /* -o keep= (keep_last=N: last:N): what
                                 the coordinator keeps of BACKING_DIR after
                                 each commit; no rule: all */
  char keep_text[160];        /* that option as given, for log lines */
  uint32_t tier_keep;         /* -o tier_keep=N: flushed checkpoints kept
                                 in the tier; 0: none (removed once
                                 flushed) */
  bool foreground;            /* -f */
  bool show_help;             /* -h / --help */
  bool show_version;          /* -V / --version */
  char *backing_dir;          /* owned */
  char *mountpoint;           /* owned, %r not yet replaced */
  char *log_file;             /* owned, -o log=FILE (%r not replaced), or
                                 NULL */
  char *metrics_file;         /* owned, -o metrics=FILE (%r not replaced),
                                 or NULL */
  char *tier_dir;             /* owned, -o tier=DIR, or NULL */
  char *verify_shared;        /* owned, -o verify_shared=DIR|none, or NULL:
                                 the default (fs/daemon/main.c) */
  bool tier_partner;          /* -o tier_level=partner: a commit copies
                                 each rank's data files to its partner
                                 rank's tier before it succeeds */
  uint64_t flush_rate;        /* bytes/s of the flush to BACKING_DIR; 0:
                                 unlimited */
  double partner_grace;       /* seconds a partner copy of a rank whose node
                                 is in the world waits for that node's
                                 flush before this mount flushes it */
} ckpt_opts_t;

/* ------------------------------------------------------------------------
 * The staging budget (stage/staging.c): bounded by staging_mem.
 * ---------------------------------------------------------------------- */

#define CKPT_SEG_SHIFT 20 /* 1 MiB segments */
#define CKPT_SEG_SIZE ((uint64_t)1 << CKPT_SEG_SHIFT)
/* The largest read request: libfuse splices a reply only when header, data
 * and three pages of slack fit in a pipe of pipe-max-size (1 MiB by
 * default) and copies it through a fresh buffer otherwise. */
#define CKPT_MAX_READ (CKPT_SEG_SIZE - 16384)

typedef struct ckpt_staging ckpt_staging_t; /* the mount's memory budget */

/*
 * The staged data of a mount: RAM up to staging_mem (1 MiB segments, kept
 * in a pool once allocated, so that a training loop does not pay fresh page
 * faults at every checkpoint), and beyond it slots of an unnamed spill file
 * in BACKING_DIR/.staging/ (O_TMPFILE: nothing is left behind, even after a
 * crash). A write never fails for lack of RAM.
 */
struct ckpt_staging {
  uint64_t limit;          /* staging_mem */
  _Atomic uint64_t used;   /* bytes of RAM held: in use and pooled */
  int backing_fd;          /* BACKING_DIR, for the spill file */
  pthread_mutex_t lock;    /* protects everything below */
  uint8_t **pool;          /* free full segments */
  uint32_t npool, cap_pool;
  int spill_fd;            /* -1 until the first spill */
  int64_t *free_slots;     /* offsets of free slots in the spill file */
  uint32_t nfree, cap_free;
  int64_t spill_end;       /* the spill file's size */
  uint64_t spill_used;     /* bytes of slots in use */
  /* passthrough: staged files holding a backing file, at most pt_max (half the
   * open files limit at start), so that a million small files cannot
   * exhaust the daemon's descriptors; the others take the daemon's path */
  _Atomic uint32_t pt_files;
  uint32_t pt_max;
  _Atomic bool pt_full_said; /* logged that pt_max was reached */
  int *pt_pool;            /* empty backing files (read-only descriptors)
                              ready for new staged files: a create then
                              makes none (under lock) */
  uint32_t pt_npool;
};

/* ------------------------------------------------------------------------
 * The listing of BACKING_DIR the root serves (ops/).
 * ---------------------------------------------------------------------- */

/* Where BACKING_DIR/NAME stands, looked up without fs->lock (ops.c). */
typedef struct {
  bool committed;  /* a directory with .metadata */
  bool not_dir;    /* something else than a directory (a file, a symlink) */
  struct stat dir; /* its identity, when committed */
  uint64_t gen;    /* fs->load_gen before it was looked up: a checkpoint
                      loaded since then is newer than this look */
  /* When committed, what tells it from a checkpoint whose directory got
   * the inode number of a removed one: its handle (the inode's
   * generation), or where the filesystem gives none, its save ID ("" if
   * its .metadata does not load; id_unknown: it could not be read now,
   * out of descriptors or memory, trust the inode). */
  ckpt_dir_handle_t handle;
  char save_id[CKPT_SAVE_ID_LEN + 1];
  bool id_unknown;
} ckpt_presence_t;

/* The entries of BACKING_DIR as the root was last listed (ops.c): reused
 * while BACKING_DIR's mtime is unchanged and it is less than
 * CKPT_SCAN_MAX_AGE seconds old, so that listings cost one stat and a
 * checkpoint committed or removed by another mount shows within that. */
#define CKPT_SCAN_MAX_AGE 1.0
typedef struct ckpt_scan {
  char **names;           /* sorted */
  ckpt_presence_t *pr;    /* by name */
  size_t n;
  struct timespec mtime;  /* BACKING_DIR's, when listed */
  double at;              /* CLOCK_MONOTONIC seconds, when listed */
  uint64_t gen;           /* fs->load_gen before it was listed */
  uint32_t refs;          /* fs->scan_lock */
} ckpt_scan_t;

/* A checkpoint of BACKING_DIR whose .metadata was refused: not loaded
 * again (nor logged again) while it is the same directory. */
typedef struct {
  char *name;
  dev_t dev;
  ino_t ino;
  ckpt_dir_handle_t handle;
  char save_id[CKPT_SAVE_ID_LEN + 1];
} ckpt_refused_t;

/* ------------------------------------------------------------------------
 * Metrics (metrics.c): counters bumped where things happen (atomics, no
 * lock), and the thread of -o metrics=FILE that writes them out.
 * ---------------------------------------------------------------------- */
typedef enum {
  CKPT_COMMIT_COMMITTED,
  CKPT_COMMIT_FAILED,
  CKPT_COMMIT_LOST, /* another mount committed NAME first (EEXIST) */
  CKPT_COMMIT_OUTCOMES
} ckpt_commit_outcome_t;

typedef enum {
  CKPT_FAIL_TIMEOUT,
  CKPT_FAIL_NO_SPACE,
  CKPT_FAIL_IO,
  CKPT_FAIL_INVALID,
  CKPT_FAIL_EXISTS,
  CKPT_FAIL_OTHER,
  CKPT_FAIL_REASONS
} ckpt_fail_reason_t;

#define CKPT_DURATION_BUCKETS 12 /* finite upper bounds, then +Inf */

/* The FUSE requests the daemon serves, counted per opcode: what a save
 * costs in round trips (ckptfs_fuse_requests_total{op}). */
#define CKPT_FUSE_OPS(X)                                                      \
  X(lookup) X(forget) X(getattr) X(setattr) X(mkdir) X(create) X(unlink)      \
  X(rmdir) X(rename) X(open) X(flush) X(release) X(read) X(write)             \
  X(fallocate) X(symlink) X(link) X(mknod) X(opendir) X(readdir)              \
  X(releasedir) X(setxattr) X(getxattr) X(listxattr) X(removexattr)           \
  X(statfs) X(access) X(lseek) X(readlink)
#define CKPT_OP_ENUM(op) CKPT_OP_##op,
typedef enum { CKPT_FUSE_OPS(CKPT_OP_ENUM) CKPT_OPS } ckpt_fuse_op_t;
#undef CKPT_OP_ENUM

typedef struct {
  _Atomic uint64_t commits[CKPT_COMMIT_OUTCOMES];
  _Atomic uint64_t failures[CKPT_FAIL_REASONS];
  _Atomic uint64_t duration[CKPT_DURATION_BUCKETS + 1]; /* per bucket, not
                                                          cumulative */
  _Atomic uint64_t duration_us; /* their sum, microseconds */
  _Atomic uint64_t bytes_staged;    /* written into staged files */
  _Atomic uint64_t bytes_committed; /* written by this rank's saves */
  _Atomic uint64_t bytes_read;      /* served from committed checkpoints */
  _Atomic uint64_t bytes_drained;   /* closed staged files the drain hashed */
  _Atomic uint64_t requests[CKPT_OPS]; /* FUSE requests served, by opcode */
} ckpt_metrics_t;

/* The class of a failed save's error: rc (-errno, as the save saw it
 * here; 0 when unknown) first, else the words of reason. */
ckpt_fail_reason_t ckpt__metrics_classify(int rc, const char *reason);
/* One commit ended; seconds < 0: it never started (refused at freeze). */
void ckpt__metrics_commit(ckpt_fs_t *fs, ckpt_commit_outcome_t outcome,
                          ckpt_fail_reason_t reason, double seconds);
/* n bytes of a committed checkpoint are served to req (before its
 * reply). */
void ckpt__metrics_read(fuse_req_t req, uint64_t n);
/* req, a request of opcode op, arrived (each callback of ops.c, first). */
void ckpt__metrics_request(fuse_req_t req, ckpt_fuse_op_t op);

/* The upper bounds of ckptfs_commit_duration_seconds, in seconds. */
extern const double ckpt__duration_le[CKPT_DURATION_BUCKETS];

/* CLOCK_MONOTONIC, in seconds. */
double ckpt__mono_now(void);
/* The same in nanoseconds. */
uint64_t ckpt__mono_ns(void);

/* ------------------------------------------------------------------------
 * The worker pool (pool.c).
 * ---------------------------------------------------------------------- */

typedef struct ckpt_pool ckpt_pool_t;
int ckpt__pool_new(uint32_t nthreads, ckpt_pool_t **out);
void ckpt__pool_free(ckpt_pool_t *p);
/* Run fn(arg, i) for i in [0, n) on the pool's threads; wait for all.
 * Returns the first non-zero result. */
int ckpt__pool_run(ckpt_pool_t *p, uint32_t n, int (*fn)(void *arg,
                                                         uint32_t i),
                   void *arg);

/* ------------------------------------------------------------------------
 * The mount.
 * ---------------------------------------------------------------------- */

struct ckpt_fs {
  ckpt_opts_t opts;
  int backing_fd;          /* BACKING_DIR, O_DIRECTORY */
  char *backing_path;      /* absolute */
  int tier_fd;             /* -o tier=DIR, O_DIRECTORY, or -1 */
  char *tier_path;         /* absolute, or NULL */
  /* Where commits and staging go: the tier when there is one, else
   * BACKING_DIR (the same descriptor and string, not owned). */
  int commit_fd;
  const char *commit_path;
  struct ckpt_flush *flush; /* -o tier: the flush thread (flush.c) */
  pthread_mutex_t tier_publish; /* -o tier: held by a commit's publish in
                                   the tier and by the flush while it checks
                                   and removes the tier's copy, so that it
                                   removes only the save it flushed; after
                                   fs->lock when both are held (no
                                   fs->lock taken while it is held) */
  ckpt_dist_t *dist;
  int rank;
  int world_size;
  struct fuse_session *se;
  ckpt_staging_t staging;
  pthread_mutex_t lock;    /* see the lock order above */
  ckpt_node_t *root;
  uint64_t next_ino;
  ckpt_node_t **ino_hash;  /* buckets */
  ckpt_node_t **name_hash;
  size_t hash_size;        /* buckets in each table (power of two) */
  size_t nnodes;
  struct ckpt_pool *pool;  /* io_threads workers */
  ckpt_fdcache_t *fdcache; /* data file descriptors of committed reads */
  _Atomic uint64_t load_gen; /* counts checkpoints loaded into the tree */
  pthread_mutex_t scan_lock; /* protects scan and refused */
  ckpt_scan_t *scan;       /* the last listing of BACKING_DIR, or NULL */
  ckpt_refused_t *refused;
  size_t nrefused;
  struct ckpt_handle *handles; /* open file and directory handles (ops.c);
                                  fs->lock */
  uint32_t commit_handles; /* of those, open .commit files; fs->lock */
  ckpt_save_ops_t save_ops;
  _Atomic bool passthrough; /* passthrough=1 and the kernel granted it
                              (cleared when it refuses a backing file) */
  struct ckpt_drain *drain; /* passthrough=1: the drain thread (drain.c) */
  ckpt_metrics_t metrics;  /* metrics.c */
  char *mount_path;        /* MOUNTPOINT, %r replaced (a metrics label) */
  struct ckpt_jobs *jobs;  /* the job processes' watcher (jobs.c) */
};

#endif /* CKPT_FS_FS_CORE_H */
