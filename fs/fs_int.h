/*
 * fs_int.h - private to fs/: the objects behind one rank mount.
 *
 * A mount is a tree of nodes (one per inode): the root, one directory per
 * checkpoint, and below each checkpoint either its staged files (this
 * rank's writes, held in memory) or its committed view (built from the
 * SQLite metadata). Inode numbers are never reused, so a stale one from the
 * kernel finds nothing (ESTALE) instead of a different file.
 *
 * Checkpoint states and the functions behind each transition:
 *
 *   (none)      -> STAGING     mkdir NAME               [fs_mkdir]
 *   STAGING     -> COMMITTING  write NAME/.commit       [ckpt__save_begin]
 *   FAILED      -> COMMITTING  write NAME/.commit       [ckpt__save_begin]
 *   COMMITTING  -> COMMITTED   the save succeeded       [save_done]
 *   COMMITTING  -> FAILED      the save failed anywhere [save_done]
 *   (backing)   -> COMMITTED   found at mount           [ckpt__fs_load]
 *   any but COMMITTING -> (none)  rmdir NAME            [fs_rmdir]
 *
 * Locks, in acquisition order:
 *   1. ck->freeze (rwlock): data changes of staged files hold it shared,
 *      the freeze at commit holds it exclusive;
 *   2. fs->lock (mutex): the tree, the inode table, node and checkpoint
 *      reference counts, checkpoint states;
 *   3. sf->lock (mutex): the data and xattrs of one staged file.
 */
#ifndef CKPT_FS_INT_H
#define CKPT_FS_INT_H

#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 14)
#include <fuse_lowlevel.h>

#include <pthread.h>
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

/* ------------------------------------------------------------------------
 * Options (options.c).
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
  bool tier_partner;          /* -o tier_level=partner: a commit copies
                                 each rank's data files to its partner
                                 rank's tier before it succeeds */
  uint64_t flush_rate;        /* bytes/s of the flush to BACKING_DIR; 0:
                                 unlimited */
  double partner_grace;       /* seconds a partner copy of a rank whose node
                                 is in the world waits for that node's
                                 flush before this mount flushes it */
} ckpt_opts_t;

/* Parse the command line. Our options are removed from args; what stays is
 * for fuse_session_new. Returns 0, or -EINVAL with *err (malloc'd). */
int ckpt__opts_parse(struct fuse_args *args, ckpt_opts_t *o, char **err);
void ckpt__opts_free(ckpt_opts_t *o);
void ckpt__opts_help(void);
/* "64M", "1G", "4096": bytes; -EINVAL when malformed or overflowing. */
int ckpt__parse_size(const char *s, uint64_t *out);

/* ------------------------------------------------------------------------
 * Staged file data (staging.c): bounded by staging_mem.
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

void ckpt__staging_init(ckpt_staging_t *st, uint64_t limit, int backing_fd);
void ckpt__staging_destroy(ckpt_staging_t *st);

enum {
  CKPT_X_DTYPE,
  CKPT_X_SHAPE,
  CKPT_X_OFFSETS,
  CKPT_X_SIZES,
  CKPT_X_FQN, /* the item's exact FQN, overriding the path's */
  CKPT_X_COUNT
};

/*
 * Write-behind streams of one checkpoint on this rank (streams.c): unnamed
 * files in BACKING_DIR/.staging, K < io_threads. A staged file written
 * front to back from offset 0 claims a free stream; its bytes then go
 * straight into the stream file (the page cache writes them back while the
 * trainer goes on) and take no RAM. At commit each used stream is linked
 * as the data file __R_K.distcp and its files stay where they are (pinned
 * in the plan): the bytes are written once.
 */
typedef struct ckpt_streams {
  pthread_mutex_t lock;   /* protects everything below but committed */
  int backing_fd;
  int rank;
  char id[33];            /* 128 random bits in hex: unique on every node
                             and in every PID namespace (keep names) */
  char name[256];         /* the checkpoint */
  uint32_t n;             /* streams: io_threads, then own ones */
  uint32_t nio;           /* the first nio (io_threads) can be claimed */
  uint32_t cap;           /* entries allocated in s */
  struct ckpt_stream {
    int fd;               /* -1 until first claimed */
    uint64_t end;         /* bytes used by released files */
    struct ckpt_sfile *owner; /* the file appending to it, or NULL */
    bool kept;            /* linked under its keep name (a failed commit) */
    bool own;             /* a passthrough file's own backing file: data
                             file K of that file alone, at offset 0 */
  } *s;                   /* grows (own streams) only while the freeze
                             lock is held for writing: see stream_fd */
  bool frozen;            /* committing: no new claims */
  _Atomic bool committed; /* the streams are data files now: never
                             written or punched again */
} ckpt_streams_t;

/* BACKING_DIR/.staging, created when missing, opened O_PATH beneath
 * BACKING_DIR without following a symlink (ckpt_open_beneath): fd or
 * -errno. Anything else than a directory found there (a symlink put by a
 * user who can write BACKING_DIR) is logged, removed and replaced. */
int ckpt__staging_dir(int backing_fd);
/* An unnamed file (O_TMPFILE) in BACKING_DIR/.staging: fd or -errno. */
int ckpt__staging_tmpfile(int backing_fd);
/* Remove BACKING_DIR/.staging (holding only unnamed files, it is always
 * empty); a daemon creating a file there at once tries again. */
void ckpt__staging_tidy(int backing_fd);
ckpt_streams_t *ckpt__streams_new(int backing_fd, int rank, const char *name,
                                  uint32_t n);
/* Close the streams (a committed checkpoint keeps the data through its
 * links; otherwise it is gone). */
void ckpt__streams_free(ckpt_streams_t *st);
/* frozen: a save begins (rank: the rank its data files are named for,
 * 0 in a solo save) or ended without a commit. */
void ckpt__streams_freeze(ckpt_streams_t *st, bool frozen, int rank);
/* The checkpoint is committed: no new claims, nothing written or punched
 * in the streams any more. */
void ckpt__streams_committed(ckpt_streams_t *st);
/* Link stream K as BACKING_DIR/NAME/__R_K.distcp (dirfd) for every K with
 * used[K] > 0 (the end of its last live file); on failure the links made
 * are removed. */
int ckpt__streams_link(ckpt_streams_t *st, const uint64_t *used, int dirfd,
                       char **err);
/* The commit failed: move the links of the streams out of dirfd, aside
 * in .staging, so that the retry links them again without a copy. */
void ckpt__streams_unlink(ckpt_streams_t *st, int dirfd);
/* The checkpoint is discarded: remove the links kept aside (its streams'
 * data goes when they are closed). */
void ckpt__streams_drop_kept(ckpt_streams_t *st);
/* Claim a free stream for sf (sf->lock held): 0, or -EAGAIN if none. */
int ckpt__stream_claim(ckpt_streams_t *st, struct ckpt_sfile *sf);
/* sf stops appending to its stream (sf->lock held). */
void ckpt__stream_release(struct ckpt_sfile *sf);
/* sf's bytes leave the stream: released and their space punched out
 * (sf->lock held; sf->stream is -1 after). */
void ckpt__stream_drop(struct ckpt_sfile *sf);
int ckpt__stream_fd(const struct ckpt_sfile *sf);
/* A commit begins: the passthrough file sf (its bytes in fd, a file of
 * BACKING_DIR/.staging written by the kernel) becomes a stream of its
 * own, so that the data file K it is linked as holds it at offset 0 and
 * its bytes are never copied (sf->lock held; K >= io_threads). 0 or
 * -errno. */
int ckpt__stream_own(ckpt_streams_t *st, struct ckpt_sfile *sf, int fd);
/* Copy [0, size) of in to out at base (copy_file_range, else through a
 * buffer), data extents only: the holes of a sparse file stay holes, so
 * out's range must read as zeros already (a new file, a punched range).
 * -ESTALE when in ends first. 0 or -errno. */
int ckpt__copy_range(int in, int out, uint64_t base, uint64_t size);
/* sf gives up the stream it claimed without using it: the next file
 * starts where it did; its first len bytes there are punched out
 * (sf->lock held; sf->stream is -1 after). */
void ckpt__stream_abandon(struct ckpt_sfile *sf, uint64_t len);

/* One 1 MiB segment of a staged file: in RAM, spilled, or a hole. */
typedef struct {
  uint8_t *mem;   /* RAM copy, or NULL */
  int64_t spill;  /* offset of its slot in the spill file, or -1 */
} ckpt_seg_t;

typedef struct ckpt_sfile {
  pthread_mutex_t lock;  /* protects everything below */
  ckpt_staging_t *budget;
  uint64_t size;         /* file size in bytes */
  _Atomic uint64_t size_seen; /* the same, for readers that must not wait
                                 for sf->lock (.status under fs->lock) */
  ckpt_seg_t *segs;      /* segment i holds bytes [i << SHIFT, ...) */
  uint32_t nsegs;        /* entries in segs */
  uint32_t seg0_cap;     /* bytes allocated for segs[0].mem (small files
                            grow it up to CKPT_SEG_SIZE); others are full */
  struct ckpt_streams *streams; /* its checkpoint's write-behind streams */
  int32_t stream;        /* K of the stream file holding all its bytes (no
                            segments then), or -1 */
  uint64_t stream_base;  /* where its byte 0 is in that stream file */
  bool stream_owner;     /* it may still append to the stream */
  struct XXH3_state_s *hash; /* XXH3 of bytes [0, hashed) while the file
                                is written front to back, or NULL */
  uint64_t hashed;
  bool hash_broken;      /* written out of order: hash at commit */
  /* FUSE passthrough (write once): the kernel writes the file's bytes
   * straight into pt_fd's file, in BACKING_DIR/.staging, which becomes
   * its data file at commit; the daemon never copies them. */
  _Atomic int pt_fd;     /* that file, held read-only, or -1 (set under
                            lock; read without it by size_seen) */
  int32_t pt_id;         /* its backing id while the file is open, or 0 */
  uint32_t pt_opens;     /* open handles passed through */
  uint32_t pt_wopens;    /* of which open for writing */
  pid_t pt_wpid;         /* the process of the last open for writing */
  bool pt_read_opened;   /* opened read-only once: its backing file is not
                            reused for another file (a read-only mapping
                            may still show it) */
  struct timespec pt_ctim_seen; /* pt_fd's ctime when last looked at: a
                                   change since is a write the daemon
                                   never saw (ckpt__sfile_pt_times) */
  bool pt_sealed;        /* nobody could write it when last checked (by
                            the drain to hash it, by a commit to freeze
                            it); an open for writing unseals it */
  uint32_t pt_gen;       /* unseals so far: a hash computed across one is
                            stale */
  bool pt_hashing;       /* the drain is hashing it (pt_hashed: done) */
  pthread_cond_t pt_hashed;
  char *xattr[CKPT_X_COUNT]; /* raw values as set, NUL-terminated, or NULL */
} ckpt_sfile_t;

ckpt_sfile_t *ckpt__sfile_new(ckpt_staging_t *budget,
                              ckpt_streams_t *streams);
/* The file was closed after writing: it stops appending to its stream. */
void ckpt__sfile_end_stream(ckpt_sfile_t *sf);
/* Passthrough: give the new empty file a memfd of its own (0, -errno). */
int ckpt__sfile_pt_start(ckpt_sfile_t *sf);
/* An empty backing file (a small file's, moved into segments, never
 * opened read-only) goes back to the pool for the next new file, else
 * it is closed. */
void ckpt__staging_pt_recycle(ckpt_staging_t *b, int fd);
/* Undo pt_start when the kernel refused the backing file. */
void ckpt__sfile_pt_abandon(ckpt_sfile_t *sf);
/* Nobody can write the file now (sf->lock held): it is sealed and its
 * size read. 0, or -EBUSY while a handle open for writing or a writable
 * shared mapping (which may outlive the file's last close) exists. */
int ckpt__sfile_pt_seal(ckpt_sfile_t *sf);
/* Is the file's backing file a published data file already (a commit
 * that published but could not be shown)? Then it never changes again:
 * writes get EROFS. sf->lock held. */
bool ckpt__sfile_pt_committed(const ckpt_sfile_t *sf);
/* Could anyone write the passthrough file now (an open handle for writing
 * not released yet, a writable mapping)? Not for a sealed one. Takes
 * sf->lock. */
bool ckpt__sfile_pt_writable(ckpt_sfile_t *sf);
/* ckpt__sfile_pt_seal for a commit's freeze, taking sf->lock. */
int ckpt__sfile_pt_freeze(ckpt_sfile_t *sf);
/* The file may change again (an open for writing, a failed commit): it is
 * unsealed and its hash dropped (sf->lock held). */
void ckpt__sfile_pt_thaw(ckpt_sfile_t *sf);
/* Who could write the file (fino: its inode in the mount) when a seal
 * failed: "open for writing by process PID (COMM)", "mapped writable and
 * shared by process PID (COMM)"; a string to free, or NULL. */
char *ckpt__sfile_pt_who(ckpt_sfile_t *sf, uint64_t fino);
/* The file's bytes are somewhere else now: it stops being a passthrough
 * file (sf->lock held). Returns its backing file, for the caller to
 * close once it holds no lock (freeing gigabytes takes a while). */
int ckpt__sfile_pt_detach(ckpt_sfile_t *sf);
/* A sealed, closed passthrough file below CKPT_PT_DRAIN_MIN: its bytes
 * move into segments (sf->lock held). Returns the backing file, to close
 * as above, or -errno (the file stays as it was). */
int ckpt__sfile_pt_absorb(ckpt_sfile_t *sf);
/* The next data extent of fd in [pos, end): [*from, *to), *from == end
 * when none is left (SEEK_DATA/SEEK_HOLE; where the filesystem has none,
 * all of it). -ESTALE when fd ends before end. */
int ckpt__data_extent(int fd, uint64_t pos, uint64_t end, uint64_t *from,
                      uint64_t *to);
/* The largest staged file: 1 TiB. Its segment index (16 bytes per MiB)
 * stays small, and a commit never has to hash and store more than this
 * for one file: a pwrite at a wild offset gets EFBIG instead of a huge
 * index and a commit that writes the holes as terabytes of zeros. The
 * kernel's writes into a passthrough file are not checked: a commit of
 * one larger than this fails (EFBIG), and the drain leaves it alone. */
#define CKPT_MAX_FILE ((uint64_t)1 << 40)
/* Passthrough needs this much free in BACKING_DIR (or staging_mem, if
 * smaller) when a file is created (staging.c). */
#define CKPT_PT_MIN_FREE ((uint64_t)1 << 30)
/* A passthrough file with open handles? */
bool ckpt__sfile_pt_open(ckpt_sfile_t *sf);
/* Closed passthrough files of at least this size stay where the kernel
 * wrote them (their data file), hashed by the drain; smaller ones move
 * into segments (drain.c), packed with others into a shared data file. */
#define CKPT_PT_DRAIN_MIN (64u << 10)
/* A passthrough file's mtime is its backing file's (the kernel's writes
 * set it): *mtime becomes that. With ctime (the node's, fs->lock held),
 * and the file not sealed: if the backing file's ctime moved since the
 * last look (a write the daemon never saw), *ctime moves past it
 * (ckpt__ctime_moved). Setting the mtime sets the backing file's. No-ops
 * otherwise. */
void ckpt__sfile_pt_times(ckpt_sfile_t *sf, struct timespec *mtime,
                          struct timespec *ctime);
/* The same ctime rule for st, pt_fd's stat (sf->lock held; sealed or
 * not): the drain's, for a file it takes in. */
void ckpt__sfile_pt_ctime(ckpt_sfile_t *sf, const struct stat *st,
                          struct timespec *ctime);
void ckpt__sfile_pt_set_mtime(ckpt_sfile_t *sf, const struct timespec *t);
void ckpt__sfile_free(ckpt_sfile_t *sf);
/* Copy buf into the file at off; -ENOSPC beyond staging_mem, -EFBIG beyond
 * the largest offset. Returns bytes written or a negative errno. */
ssize_t ckpt__sfile_write(ckpt_sfile_t *sf, const void *buf, size_t n,
                          uint64_t off);
/* Copy up to n bytes at off into buf; returns bytes read or -errno. */
ssize_t ckpt__sfile_read(ckpt_sfile_t *sf, void *buf, size_t n, uint64_t off);
int ckpt__sfile_truncate(ckpt_sfile_t *sf, uint64_t size);
uint64_t ckpt__sfile_size(ckpt_sfile_t *sf);
/* What a piece of a staged file's contents is, for ckpt__sfile_walk. */
typedef enum {
  CKPT_WALK_KEPT,      /* p stays valid until the file changes */
  CKPT_WALK_TRANSIENT, /* p is valid during the call only (spilled data
                        * read into a bounce buffer) */
  CKPT_WALK_HOLE,      /* never written: n zero bytes, p is NULL */
} ckpt_walk_piece_t;

/* Call fn on each piece of the contents in order; stops at a non-zero
 * return. Caller freezes sf. */
int ckpt__sfile_walk(ckpt_sfile_t *sf,
                     int (*fn)(void *arg, const void *p, size_t n,
                               ckpt_walk_piece_t kind),
                     void *arg);
/* The same once a hash the drain is computing is done (takes sf->lock):
 * what a commit asks. */
int ckpt__sfile_checksum_wait(ckpt_sfile_t *sf, uint64_t *out);
/* The XXH3-64 of the contents if it was computed while the file was
 * written front to back: 0, or -EAGAIN (walk and hash it). */
int ckpt__sfile_checksum(ckpt_sfile_t *sf, uint64_t *out);
/* Zero bytes [off, off+len) of the file (not past its end): whole
 * segments become holes again. 0 or -errno. */
int ckpt__sfile_zero(ckpt_sfile_t *sf, uint64_t off, uint64_t len);
/* The size without waiting for sf->lock (a write may hold it while the
 * page cache throttles it): as of the last change. A passthrough file's
 * is its memfd's (its lock is only ever held briefly). */
uint64_t ckpt__sfile_size_seen(ckpt_sfile_t *sf);
/* Validate and set one user.ckpt.* xattr (EINVAL on bad values, checked
 * against the other xattrs already set); -ENOTSUP for other names.
 * CKPT_XATTR_META sets several at once, all or none (staging.c's
 * split_meta says how); it is never stored or listed itself. */
#define CKPT_XATTR_META "user.ckpt.meta"
int ckpt__sfile_setxattr(ckpt_sfile_t *sf, const char *name, const char *val,
                         size_t len, int flags);
/* Copy the value into buf (size 0: only the length). -ENODATA if unset. */
int ckpt__sfile_getxattr(ckpt_sfile_t *sf, const char *name, char *buf,
                         size_t size);
int ckpt__sfile_removexattr(ckpt_sfile_t *sf, const char *name);
/* The names of the set xattrs, NUL-separated (listxattr format). */
int ckpt__sfile_listxattr(ckpt_sfile_t *sf, char *buf, size_t size);
/* Index of a user.ckpt.* name, or -1. */
int ckpt__xattr_index(const char *name);
extern const char *const ckpt__xattr_names[CKPT_X_COUNT];

/* ------------------------------------------------------------------------
 * Nodes and checkpoints (nodes.c).
 * ---------------------------------------------------------------------- */
typedef enum {
  CKPT_NODE_ROOT,
  CKPT_NODE_CKPT,     /* MOUNTPOINT/NAME */
  CKPT_NODE_SDIR,     /* staged directory */
  CKPT_NODE_SFILE,    /* staged file */
  CKPT_NODE_CDIR,     /* committed directory */
  CKPT_NODE_CTENSOR,  /* committed tensor (the whole global tensor) */
  CKPT_NODE_CBLOB,    /* committed bytes item */
  CKPT_NODE_COMMIT,   /* NAME/.commit */
  CKPT_NODE_STATUS,   /* NAME/.status */
  CKPT_NODE_METADATA, /* NAME/.metadata */
  /* Views of a committed checkpoint (views.c), read-only: */
  CKPT_NODE_VROOT,    /* NAME/.npy, NAME/.safetensors (not listed) */
  CKPT_NODE_VDIR,     /* a directory below NAME/.npy */
  CKPT_NODE_VNPY,     /* NAME/.npy/PATH.npy of a tensor */
  CKPT_NODE_VST,      /* a file of NAME/.safetensors */
  CKPT_NODE_VINDEX,   /* NAME/.safetensors/model.safetensors.index.json */
  CKPT_NODE_CBLOCK,   /* DIR/.N[a:b,...]: a block of committed tensor N
                         (blocks.c); made at lookup, not listed, freed
                         when the kernel forgets it */
} ckpt_node_kind_t;

typedef enum {
  CKPT_STAGING,
  CKPT_COMMITTING,
  CKPT_COMMITTED,
  CKPT_FAILED,
} ckpt_state_t;

typedef struct ckpt_node ckpt_node_t;
typedef struct ckpt_ckpt ckpt_ckpt_t;
typedef struct ckpt_fs ckpt_fs_t;

struct ckpt_node {
  uint64_t ino;
  ckpt_node_kind_t kind;
  char *name;             /* owned; "" for the root */
  ckpt_node_t *parent;    /* NULL for the root and detached nodes */
  ckpt_ckpt_t *ck;        /* owning checkpoint (NULL for the root); each
                             live node holds a reference on it */
  ckpt_node_t *children;  /* directories: first child */
  ckpt_node_t *next;      /* sibling list */
  ckpt_node_t *prev;
  ckpt_node_t *hnext_ino; /* inode hash chain */
  ckpt_node_t *hnext_name; /* (parent, name) hash chain */
  uint32_t refs;          /* requests and open handles; protected by
                             fs->lock */
  bool attached;          /* in the tree and the hash tables */
  bool hidden;            /* committed view: unlinked in this mount */
  mode_t mode;            /* type and permission bits */
  uid_t uid;
  gid_t gid;
  struct timespec mtime;
  struct timespec ctime;
  struct timespec atime;
  uint32_t nsubdirs;      /* directory: child directories (st_nlink - 2) */
  uint64_t nlookup;       /* CBLOCK: lookups the kernel has not forgotten;
                             fs->lock */
  struct ckpt_node_pt *cpt; /* CTENSOR, CBLOB read by passthrough: the one
                             backing file all its open handles share (the
                             kernel allows one per inode), or NULL;
                             fs->lock */
  union {
    ckpt_sfile_t *sf;     /* SFILE */
    uint32_t tensor;      /* CTENSOR, VNPY: index into ck->meta->tensors */
    uint32_t shard;       /* VST: the safetensors file */
    uint32_t blob;        /* CBLOB: index into ck->meta->blobs */
    struct ckpt_block *block; /* CBLOCK (owned) */
  } u;
};

struct ckpt_node_pt {
  int32_t id;             /* backing id */
  uint32_t opens;         /* handles using it */
  ckpt_fdref_t ref;       /* the data file, held */
  struct stat was;        /* its fstat when verified and made the backing
                             file: a later open shares it only if it is
                             the open's data file or unchanged since */
};

/* Where a committed checkpoint is, for .status (ck->tier). */
typedef struct ckpt_tier_state {
  bool tiered;                 /* the mount has a tier: .status says where */
  _Atomic bool flushed;        /* in BACKING_DIR (flushed, or loaded from
                                  there) */
  bool partner;                /* its tier copy holds partner copies:
                                  committed at level partner */
  _Atomic uint64_t done, total; /* bytes of its data files copied */
  _Atomic uint64_t busy_since; /* CLOCK_MONOTONIC ns when the flush began a
                                  write or fsync on BACKING_DIR not yet
                                  returned (0: none): a stalled store */
  _Atomic bool failed;         /* its flush failed for good in this mount:
                                  it may be removed (from the tier only) */
  char *why;                   /* "flush waiting: ..." or "flush failed:
                                  ...", or NULL; fs->lock */
} ckpt_tier_state_t;

struct ckpt_ckpt {
  char name[256];
  ckpt_state_t state;     /* protected by fs->lock */
  pthread_rwlock_t freeze; /* see the lock order above; writers first */
  _Atomic bool freezing;  /* a commit wants the freeze lock: the drain
                             leaves its files to the commit */
  uint32_t refs;          /* 1 while listed + 1 per live node; fs->lock */
  ckpt_node_t *dir;       /* the NAME directory node; NULL once removed */
  char *reason;           /* FAILED: why; fs->lock */
  _Atomic uint64_t bytes_total; /* COMMITTING: bytes this rank writes */
  _Atomic uint64_t bytes_done;
  char *waiting;          /* COMMITTING: what the save waits for, or NULL;
                             fs->lock */
  double waiting_until;   /* its deadline (CLOCK_MONOTONIC s), 0: none */
  struct ckpt_save *save; /* in-flight save, or NULL */
  bool tier_full_said;    /* staged: a write's ENOSPC in a full tier was
                             logged, with what to do; fs->lock */
  pid_t job;              /* the job process (jobs.c) whose save this is:
                             it made NAME or committed it; 0: none;
                             fs->lock */
  ckpt_streams_t *streams; /* staged: write-behind streams, or NULL */
  /* COMMITTED: */
  ckpt_metadata_t *meta;  /* owned */
  ckpt_stored_t stored;   /* the reader's view of it (store.h) */
  bool has_stored;        /* stored is set up */
  uint64_t load_gen;      /* fs->load_gen when it was loaded */
  bool removing;          /* COMMITTED: an entry inside was removed, so the
                             checkpoint's .metadata is gone from
                             BACKING_DIR (for every mount); this mount keeps
                             the rest until rmdir NAME; fs->lock */
  char replacing[256];    /* COMMITTING with replace=TARGET: TARGET, which
                             no mkdir or rename may take meanwhile; else
                             "" (fs->lock) */
  char *lost;             /* COMMITTED: this mount's own commit of NAME
                             lost to this checkpoint (EEXIST): what became
                             of its staged files (.status, "lost:"); fs->lock */
  bool gone;              /* removing: BACKING_DIR/NAME was another
                             checkpoint already (or being removed by
                             another mount): rmdir NAME leaves it alone */
  bool *removed;          /* COMMITTED: items of meta removed since it was
                             loaded (n_tensors, then n_blobs), or NULL;
                             ops.c's removal lock and fs->lock */
  bool rewriting;         /* COMMITTED: a removal inside it is publishing a
                             new version: listings keep it meanwhile;
                             fs->lock */
  struct ckpt_views *views; /* the views' state (views.c), or NULL */
  /* COMMITTED: the read-only permission bits of files and directories
   * that belong to no single staged entry (.metadata, the views): what
   * every staged file and the checkpoint directory allowed */
  mode_t shared_fmode, shared_dmode;
  ckpt_tier_state_t tier;  /* COMMITTED with -o tier: its flush */
};

/* The files staged in ck and their bytes. fs->lock held (ops.c). */
void ckpt__ckpt_staged_size(const ckpt_ckpt_t *ck, uint64_t *files,
                            uint64_t *bytes);

/* A committed node n of ck (a view, .metadata): the shared permissions
 * and the checkpoint directory's owner. fs->lock held. */
void ckpt__committed_shared(ckpt_ckpt_t *ck, ckpt_node_t *n);

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
  X(statfs) X(access)
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
/* Write fs's metrics to base in the directory dir_fd, in the Prometheus
 * text format (a new base.tmp.PID.RANDOM made with O_EXCL | O_NOFOLLOW,
 * renamed over base): 0 or -errno. */
int ckpt__metrics_write(ckpt_fs_t *fs, int dir_fd, const char *base);
/* The daemon's periodic thread, every CKPT_METRICS_PERIOD seconds: writes
 * the metrics to path (when not NULL: -o metrics) and closes the cached
 * descriptors of data files removed since (ckpt_fdcache_sweep); stop
 * writes the metrics one last time and joins. */
#define CKPT_METRICS_PERIOD 2.0
typedef struct ckpt_metrics_writer ckpt_metrics_writer_t;
int ckpt__metrics_start(ckpt_fs_t *fs, const char *path,
                        ckpt_metrics_writer_t **out);
void ckpt__metrics_stop(ckpt_metrics_writer_t *w);
/* CLOCK_MONOTONIC, in seconds. */
double ckpt__mono_now(void);

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

/* ------------------------------------------------------------------------
 * Job processes (jobs.c): a process that declared itself a job of the
 * mount (setxattr MOUNTPOINT user.ckpt.job LABEL) is watched; when it
 * exits without "end", its saves that are not committed are abandoned
 * (ckpt__jobs_gone).
 * ---------------------------------------------------------------------- */
#define CKPT_JOB_XATTR "user.ckpt.job"
#define CKPT_JOB_LABEL_MAX 128
typedef struct ckpt_jobs ckpt_jobs_t;
int ckpt__jobs_start(ckpt_fs_t *fs);
void ckpt__jobs_stop(ckpt_fs_t *fs);
/* setxattr user.ckpt.job by thread tid: declare its process a job (value
 * its label), or "end" it. 0 or -errno. */
int ckpt__job_declare(ckpt_fs_t *fs, pid_t tid, const char *value,
                      size_t size);
/* The job process of thread tid (its tgid), or 0 if it is none. No lock
 * held (reads /proc). */
pid_t ckpt__job_of(ckpt_fs_t *fs, pid_t tid);
pid_t ckpt__tgid_of(pid_t tid);
/* Is job process tgid alive (watched)? Its label into buf. Any lock may
 * be held (jobs.c's lock is a leaf). */
bool ckpt__job_label(ckpt_fs_t *fs, pid_t tgid, char *buf, size_t size);
/* Job process tgid (label) exited without "end": abandon its saves that
 * are not committed (save.c). Called by the watcher, no lock held. */
void ckpt__jobs_gone(ckpt_fs_t *fs, pid_t tgid, const char *label);

/* The drain thread: closed passthrough files hashed where they are. */
typedef struct ckpt_drain ckpt_drain_t;
int ckpt__drain_start(ckpt_fs_t *fs, ckpt_drain_t **out);
/* Stop it (before the nodes go): queued files stay in their memfds. */
void ckpt__drain_stop(ckpt_drain_t *d);
/* Drain n (a staged file whose last passthrough handle was closed). */
void ckpt__drain_add(ckpt_drain_t *d, ckpt_node_t *n);

/* ------------------------------------------------------------------------
 * The flush of a tier (flush.c): each checkpoint committed into TIER is
 * copied to BACKING_DIR in the background and published there as a
 * commit would have (TIER/.flush/<save_id>.<rank> names each rank's
 * files until then).
 * ---------------------------------------------------------------------- */
#define CKPT_FLUSH_DIR ".flush"
/* -o tier_keep=N (retain.c): after a successful flush, in place of the
 * removal of the flushed tier copy: keep the last N flushed checkpoints of
 * the tier (by step), remove the other flushed ones; never one with a
 * record. */
void ckpt__tier_retain(ckpt_fs_t *fs);
/* -o keep= (save.c): remove the committed checkpoints of BACKING_DIR the
 * policy does not keep, name (just committed or flushed) always kept. Run
 * by the coordinator after each commit; with a tier, the flush may run it
 * again once name is published on BACKING_DIR. */
void ckpt__keep_policy(ckpt_fs_t *fs, const char *name);
/* NAME was removed from BACKING_DIR: its flushed copy (save_id, no flush
 * record) goes from the tier too (retain.c). */
void ckpt__tier_forget(ckpt_fs_t *fs, const char *name, const char *save_id);
/* The view of NAME (save_id) reads BACKING_DIR's copy from now on, if
 * that is the save and the tier keeps no copy of it (flush.c). */
void ckpt__flush_rebind(ckpt_fs_t *fs, const char *name, const char *save_id);
typedef struct ckpt_flush ckpt_flush_t;
/* Journal the flush of rank's files of save_id (NAME name, replace) in
 * the tier: the record, fsynced, once they are written (before the
 * rank's RESULT, so before any publish). remote: the tier is not the
 * coordinator's node's (there the checkpoint is published from the
 * OUTCOME, if this node gets it). partner_host: NULL for this mount's
 * own rank; else rank is another node's, whose data files this tier
 * keeps as partner copies, and partner_host is its host's name (flushed
 * from here only when that node cannot: flush.c). */
int ckpt__flush_record(ckpt_fs_t *fs, const char *save_id, int rank,
                       const char *name, bool replace, bool remote,
                       const char *partner_host, char **err);
/* Drop rank's record of a save that failed. */
void ckpt__flush_unrecord(ckpt_fs_t *fs, const char *save_id, int rank);
/* The node's lock on its tier (TIER/.flush/.lock, flock exclusive),
 * held by every mount of the node while it publishes in the tier or
 * removes from it: fd, or -errno. ckpt__tier_unlock(fd) lets go. */
int ckpt__tier_lock(ckpt_fs_t *fs);
void ckpt__tier_unlock(int fd);
/* At mount: -EBUSY with *err when a record of the tier goes to another
 * BACKING_DIR than backing (absolute; this mount would not flush it). */
int ckpt__flush_check(ckpt_fs_t *fs, const char *backing, char **err);
/* At mount, before ckpt__fs_load: records of checkpoints already flushed
 * or gone are dropped, tier checkpoints with neither record nor shared
 * copy (removed by a user) are removed. */
void ckpt__flush_recover(ckpt_fs_t *fs);
/* Start the thread; it queues every record left by earlier mounts. */
int ckpt__flush_start(ckpt_fs_t *fs, ckpt_flush_t **out);
/* Queue the tier checkpoint name (just committed). */
void ckpt__flush_add(ckpt_flush_t *f, const char *name, const char *save_id,
                     int rank);
/* Stop it: a copy under way is abandoned (the record stays). */
void ckpt__flush_stop(ckpt_flush_t *f);
/* The tier's unflushed save save_id of name was found superseded (a
 * later change of BACKING_DIR/NAME: resolve.c): checked again under the
 * node's lock, its records and tier copy go at once, so that no flush
 * publishes it (were NAME removed later, it would come back), and the
 * log and NAME's .status say so. No lock held. */
void ckpt__flush_supersede(ckpt_fs_t *fs, const char *name,
                           const char *save_id);
/* Does a flush record name save_id, of any rank (its checkpoint is not
 * all in the shared store yet), or can that not be known now? false
 * without a tier. */
bool ckpt__flush_unflushed(ckpt_fs_t *fs, const char *save_id);
/* Remove tier checkpoint name whose flush failed for good, if it is
 * still save_id, and this mount's record of it (of rank: fs->rank, or 0
 * for a solo save, a world of one): it is never published. fs->lock may
 * be held. 0 or -errno. */
int ckpt__flush_drop(ckpt_fs_t *fs, const char *name, const char *save_id,
                     int rank);
/* The bytes of the data files of rank (-1: every rank's) in checkpoint
 * directory dirfd. */
uint64_t ckpt__flush_bytes(int dirfd, int rank);

/* Drop a reference to a listing of BACKING_DIR (fs->scan_lock held). */
void ckpt__scan_put(ckpt_scan_t *sc);

/* Staged files below directory dir and their bytes. fs->lock held. */
void ckpt__count_staged(const ckpt_node_t *dir, uint64_t *files,
                        uint64_t *bytes);
/* Create the root; fs->opts and backing_fd must be set. */
int ckpt__fs_init(ckpt_fs_t *fs);
void ckpt__fs_destroy(ckpt_fs_t *fs);

/* All of these require fs->lock. */
ckpt_node_t *ckpt__node_new(ckpt_fs_t *fs, ckpt_node_t *parent,
                            const char *name, ckpt_node_kind_t kind,
                            mode_t mode, ckpt_ckpt_t *ck);
/* The attached node of ino, or NULL. */
ckpt_node_t *ckpt__node_by_ino(ckpt_fs_t *fs, uint64_t ino);
/* Also a detached node that is still referenced (an open file that was
 * unlinked or replaced at commit): for getattr only. */
ckpt_node_t *ckpt__node_by_ino_any(ckpt_fs_t *fs, uint64_t ino);
ckpt_node_t *ckpt__node_child(ckpt_fs_t *fs, ckpt_node_t *dir,
                              const char *name);
void ckpt__node_ref(ckpt_node_t *n);
void ckpt__node_unref(ckpt_fs_t *fs, ckpt_node_t *n);
/* Remove n (and its subtree) from the tree; freed when unreferenced. */
void ckpt__node_detach(ckpt_fs_t *fs, ckpt_node_t *n);
void ckpt__node_move(ckpt_fs_t *fs, ckpt_node_t *n, ckpt_node_t *newparent,
                     const char *newname);
/* Relative path of n inside its checkpoint ("model/layer0/weight"). */
char *ckpt__node_path(const ckpt_node_t *n);
ckpt_ckpt_t *ckpt__ckpt_new(ckpt_fs_t *fs, const char *name);
void ckpt__ckpt_unref(ckpt_fs_t *fs, ckpt_ckpt_t *ck);
/* The checkpoint directory NAME in the root, or NULL. */
ckpt_node_t *ckpt__ckpt_lookup(ckpt_fs_t *fs, const char *name);
/* Replace ck's children by the committed view of meta (takes ownership). */
int ckpt__ckpt_set_committed(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                             ckpt_metadata_t *meta, int dirfd, char **err);

/* ------------------------------------------------------------------------
 * Backing storage (storage.c).
 * ---------------------------------------------------------------------- */
typedef struct ckpt_pool ckpt_pool_t;
int ckpt__pool_new(uint32_t nthreads, ckpt_pool_t **out);
void ckpt__pool_free(ckpt_pool_t *p);
/* Run fn(arg, i) for i in [0, n) on the pool's threads; wait for all.
 * Returns the first non-zero result. */
int ckpt__pool_run(ckpt_pool_t *p, uint32_t n, int (*fn)(void *arg,
                                                         uint32_t i),
                   void *arg);

/* Load every committed checkpoint of BACKING_DIR (those refused are
 * logged with the reason, and left where they are). */
int ckpt__fs_load(ckpt_fs_t *fs);
/* Load BACKING_DIR/name/.metadata into the tree (state COMMITTED). */
int ckpt__fs_load_one(ckpt_fs_t *fs, const char *name, char **err);
/* The same, in place of staged, a staged checkpoint of that name still
 * listed (its commit lost to this one): under one hold of fs->lock the
 * staged one leaves the tree (as rm -r NAME would make it) and the
 * committed one enters it, with lost (moved; NULL: none) as its .status
 * "lost:" line, so that no lookup sees NAME as neither. -ESTALE when
 * staged is not listed any more (left as it is). */
int ckpt__fs_load_instead(ckpt_fs_t *fs, ckpt_ckpt_t *staged, char *lost,
                          char **err);
/* ------------------------------------------------------------------------
 * Which save of NAME this mount serves (resolve.c, whose head states the
 * rule): BACKING_DIR's, or this node's tier copy while it is that save or
 * the node's unflushed save of NAME that nothing on BACKING_DIR
 * superseded. No lock needed (looks in the directories; may be called
 * with fs->lock held).
 * ---------------------------------------------------------------------- */
typedef struct {
  int root;         /* where NAME is served from: fs->tier_fd or
                       fs->backing_fd */
  char stale[CKPT_SAVE_ID_LEN + 1]; /* a kept tier copy of a save NAME is
                                       no more (to drop), or "" */
  bool superseded;  /* the tier's unflushed save of NAME was superseded on
                       BACKING_DIR (ckpt__flush_supersede drops it) */
  char superseded_id[CKPT_SAVE_ID_LEN + 1]; /* its save key */
} ckpt_resolved_t;
void ckpt__resolve(ckpt_fs_t *fs, const char *name, ckpt_resolved_t *out);
/* ckpt__resolve's root. */
int ckpt__root_of(ckpt_fs_t *fs, const char *name);
/* "tier full: ...\n" when the tier has less than CKPT_TIER_FULL_FREE
 * bytes free, with what to do; else "". No lock needed. */
#define CKPT_TIER_FULL_FREE ((uint64_t)64 << 20)
#define CKPT_TIER_FULL_MAX 512
void ckpt__tier_full_line(ckpt_fs_t *fs, char *buf, size_t size);
/* For a commit of NAME into the tier: the saves it replaces (the
 * "replaces" of its .metadata): "none" for a plain commit; for replace=,
 * BACKING_DIR/NAME's save key or "none" (left out when it cannot be read
 * now), the tier's unflushed save of NAME that it replaces in the tier,
 * and "earlier". NULL without a tier; else malloc'd. */
char *ckpt__resolve_replaces(ckpt_fs_t *fs, const char *name, bool replace);
/* The flush of save_id of name found NAME changed after its commit (why):
 * NAME's .status says so from now on (ckpt__resolve_note). */
void ckpt__resolve_superseded(ckpt_fs_t *fs, const char *name,
                              const char *save_id, const char *why);
/* The "superseded: ..." line of name, malloc'd, or NULL. */
char *ckpt__resolve_note(const char *name);
/* Delete BACKING_DIR/name (and the tier's): .metadata first and durably,
 * then the data. */
int ckpt__storage_remove(ckpt_fs_t *fs, const char *name);
/* The item a committed tensor or blob node reads. */
static inline ckpt_item_t ckpt__node_item(const ckpt_node_t *n) {
  ckpt_item_t it = {n->kind == CKPT_NODE_CBLOB,
                    n->kind == CKPT_NODE_CBLOB ? n->u.blob : n->u.tensor};
  return it;
}

/* ------------------------------------------------------------------------
 * Views of a committed checkpoint (views.c): NAME/.npy and
 * NAME/.safetensors, files generated from the stored chunks on the fly.
 * ---------------------------------------------------------------------- */
static inline bool ckpt__is_view_kind(ckpt_node_kind_t k) {
  return k >= CKPT_NODE_VROOT && k <= CKPT_NODE_VINDEX;
}
/* Add the (empty) view directories to committed ck. fs->lock held. */
int ckpt__views_attach(ckpt_fs_t *fs, ckpt_ckpt_t *ck);
/* Fill view directory vroot at its first lookup. fs->lock held. */
int ckpt__views_populate(ckpt_fs_t *fs, ckpt_node_t *vroot);
void ckpt__views_free(struct ckpt_views *v);
/* The tensors of view file n (a .safetensors shard, CKPT_NODE_VST), in
 * file order: their count, *out pointing to their indices. */
size_t ckpt__view_shard_tensors(const ckpt_node_t *n, const size_t **out);
/* st_size of a view file. fs->lock held. */
uint64_t ckpt__view_size(const ckpt_node_t *n);
/* Serve a read of view file n (replies to req). */
void ckpt__view_read(fuse_req_t req, ckpt_node_t *n,
                     size_t size, uint64_t off);

/* ------------------------------------------------------------------------
 * Block files of a committed checkpoint (blocks.c): DIR/.N[a0:b0,...].
 * ---------------------------------------------------------------------- */
typedef struct ckpt_block {
  uint32_t tensor;  /* index into ck->meta->tensors */
  int ndim;
  uint64_t bytes;   /* the block's size */
  int64_t dims[];   /* lo[ndim], then sizes[ndim] */
} ckpt_block_t;

/* Is name in dir a block file name to resolve (dir a directory of a
 * committed checkpoint, name ".N[...]")? fs->lock held. */
bool ckpt__block_name(const ckpt_node_t *dir, const char *name);
/* The block node of name in dir: the one made before, or a new one. 0
 * with *out, -ENOENT (no tensor N, a 0-d one, a malformed name or bounds
 * outside the shape) or -ENOMEM. Counts the lookup. fs->lock held. */
int ckpt__block_lookup(ckpt_fs_t *fs, ckpt_node_t *dir, const char *name,
                       ckpt_node_t **out);
/* The kernel forgot nlookup lookups of n: a block node it no longer
 * knows leaves the tree (freed once unreferenced). fs->lock held. */
void ckpt__block_forget(ckpt_fs_t *fs, ckpt_node_t *n, uint64_t nlookup);
void ckpt__block_free(ckpt_block_t *b);
/* Serve a read of block file n (replies to req). */
void ckpt__block_read(fuse_req_t req, ckpt_node_t *n, size_t size,
                      uint64_t off);

/* ------------------------------------------------------------------------
 * Saves (save.c).
 * ---------------------------------------------------------------------- */
/* Freeze ck and queue its save, as the words written to .commit say
 * (sync or async, solo, replace=TARGET). req is replied when the save ends
 * (sync) or at once (async, req replied by the caller). Returns 0 or
 * -errno. */
int ckpt__save_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                     const ckpt_commit_words_t *words, fuse_req_t req,
                     size_t reply_size);
/* What the save of job waits for (dist's waiting op): shown by .status. */
void ckpt__save_waiting(void *ctx, ckpt_dist_job_t *job, const char *what,
                        double until);
extern const ckpt_save_ops_t ckpt__save_ops;
/* What partner.c needs of a save (save.c). */
typedef struct ckpt_partner_rx ckpt_partner_rx_t;
typedef struct {
  int dirfd;                /* ROOT/.saves/SAVE_ID, held */
  int rank;                 /* the rank in the save's world */
  const char *save_id;
  uint32_t n_files;         /* this rank's data files __RANK_K.distcp */
  const uint64_t *file_bytes;
  ckpt_partner_rx_t **rx;   /* the partner copies received */
  const char *name;         /* the checkpoint's */
  bool replace;             /* a replace= commit */
  bool remote;              /* not the coordinator's node (flush records) */
} ckpt_save_view_t;
void ckpt__save_view(ckpt_dist_job_t *job, ckpt_save_view_t *v);

/* ------------------------------------------------------------------------
 * Partner copies (partner.c, -o tier_level=partner): dist's partner ops.
 * Each rank's data files go to its partner rank's tier, into the save's
 * own TIER/.saves/SAVE_ID there, under the owner's names.
 * ---------------------------------------------------------------------- */
int ckpt__partner_files(void *ctx, ckpt_dist_job_t *job, int partner,
                        ckpt_dist_file_t **files, uint32_t *n, char **err);
int ckpt__partner_open(void *ctx, ckpt_dist_job_t *job, int owner,
                       const char *name, uint64_t size, char **err);
int ckpt__partner_close(void *ctx, ckpt_dist_job_t *job, int fd, bool ok,
                        char **err);
/* A failed save: remove the partner copies it received (dirfd: the save's
 * directory) and their flush records, and forget them. */
void ckpt__partner_discard(ckpt_fs_t *fs, ckpt_partner_rx_t **rx, int dirfd,
                           const char *save_id);
void ckpt__partner_rx_free(ckpt_partner_rx_t *rx);
/* Does the tier's checkpoint directory dirfd hold a data file of a rank
 * of another node than this mount's (a partner copy: the checkpoint was
 * committed at level partner)? */
bool ckpt__partner_copies_in(ckpt_fs_t *fs, int dirfd);
/* A complete save directory ROOT/.saves/SAVE_ID to publish as ROOT/NAME. */
typedef struct {
  int root_fd;           /* BACKING_DIR or the tier */
  const char *root_path; /* for messages */
  int held_fd;           /* .saves/SAVE_ID, held; -1: none */
  const char *save_id;
  const char *name;
  bool replace;          /* replace=NAME: exchanged with the old version */
  bool flush;            /* the tier's flush, not a commit (no failpoints) */
  const char *replaces;  /* the flush of a save that recorded what it
                            replaced: published only while NAME is one of
                            them (ckpt_store_publish_if); -ESTALE with
                            *err saying which save NAME is now */
  int64_t commit_ns;     /* with replaces: when the save was committed */
} ckpt_publish_t;
int ckpt__publish_save(ckpt_fs_t *fs, const ckpt_publish_t *p, char **err);

/* ------------------------------------------------------------------------
 * FUSE operations (ops.c).
 * ---------------------------------------------------------------------- */
extern const struct fuse_lowlevel_ops ckpt__fuse_ops;
/* Free the handles the kernel did not release before the session ended
 * (call after the FUSE loop, before ckpt__fs_destroy). */
void ckpt__release_handles(ckpt_fs_t *fs);

#endif /* CKPT_FS_INT_H */
