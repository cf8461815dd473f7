/*
 * stage.h - fs/stage: what a rank writes before its commit. Staged files
 * (1 MiB segments in RAM up to staging_mem, spilled beyond), passthrough
 * files (the kernel writes a backing file directly), write-behind
 * streams (a file written front to back goes straight into a data file),
 * and the drain (closed passthrough files hashed where they are). Below:
 * tree, core.
 */
#ifndef CKPT_FS_STAGE_H
#define CKPT_FS_STAGE_H

#include "tree.h"

/* ------------------------------------------------------------------------
 * Staged file data (staging.c, passthrough.c, sfile_xattr.c).
 * ---------------------------------------------------------------------- */

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

#define CKPT_SFILE_NAMES_MAX 32
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
  ckpt_xlist_t other;    /* its other user.* xattrs (kept by the commit) */
  /* Its names (hard links): the nodes that hold it, attached or not yet
   * freed; fs->lock. The file goes with the last of them. */
  ckpt_node_t *names[CKPT_SFILE_NAMES_MAX];
  uint32_t nnames;
  uint64_t ino;          /* the inode number every name shows: its first's */
} ckpt_sfile_t;

/* Names of one staged file (link(2) past it: EMLINK). fs->lock held for
 * these three. */
int ckpt__sfile_add_name(ckpt_sfile_t *sf, ckpt_node_t *n);
/* n no longer holds sf: true when it was the last name (free sf then). */
bool ckpt__sfile_drop_name(ckpt_sfile_t *sf, ckpt_node_t *n);
/* Its names in the tree (st_nlink). */
uint32_t ckpt__sfile_nlink(const ckpt_sfile_t *sf);

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
/* XXH3 of [0, size) of fd added to h: its data extents hashed by
 * ckpt__hash_fd (from mappings of a window at a time, or read through buf
 * of cap bytes), its holes hashed as zeros without reading them; a file
 * with as many blocks as bytes in one pass, without looking for holes
 * (drain.c). 0 or -errno (-ESTALE: the file ended first). */
int ckpt__hash_sparse(int fd, uint64_t size, struct XXH3_state_s *h,
                      uint8_t *buf, size_t cap);
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
/* Bytes the contents take where they are (st_blocks * 512): the backing
 * file's allocation, a stream's run, or the segments in RAM and spilled
 * (holes take none). Takes sf->lock. */
uint64_t ckpt__sfile_allocated(ckpt_sfile_t *sf);
/* lseek(2)'s SEEK_DATA or SEEK_HOLE (whence) from off: the offset, -ENXIO
 * at or past the end, -EINVAL for another whence. Holes are whole 1 MiB
 * segments never written (or zeroed by fallocate), or the backing file's.
 * Takes sf->lock. */
int64_t ckpt__sfile_seek(ckpt_sfile_t *sf, uint64_t off, int whence);
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
 * against the other xattrs already set); other user.* names are kept as
 * given (ckpt__xlist_set's bounds); -ENOTSUP for the rest.
 * CKPT_XATTR_META sets several at once, all or none (staging.c's
 * split_meta says how); it is never stored or listed itself. */
#define CKPT_XATTR_META "user.ckpt.meta"
/* Set on a staged directory: many files' CKPT_XATTR_META at once
 * (records PATH NUL META NUL; fs/ops/xattr.c). Never stored or listed. */
#define CKPT_XATTR_METAS "user.ckpt.metas"
/* Set on a staged directory: mkdir -p of many directories below it
 * (MODE NUL, then records PATH NUL; fs/ops/entries.c). Never stored. */
#define CKPT_XATTR_MKDIRS "user.ckpt.mkdirs"
int ckpt__sfile_setxattr(ckpt_sfile_t *sf, const char *name, const char *val,
                         size_t len, int flags);
/* Copy the value into buf (size 0: only the length). -ENODATA if unset. */
int ckpt__sfile_getxattr(ckpt_sfile_t *sf, const char *name, char *buf,
                         size_t size);
int ckpt__sfile_removexattr(ckpt_sfile_t *sf, const char *name);
/* The names of the set xattrs, NUL-separated (listxattr format). */
int ckpt__sfile_listxattr(ckpt_sfile_t *sf, char *buf, size_t size);
/* A copy of its other xattrs into e (the commit's entry): 0, -ENOMEM. */
int ckpt__sfile_xattrs_copy(ckpt_sfile_t *sf, ckpt_entry_attr_t *e);
/* Index of a user.ckpt.* name, or -1. */
int ckpt__xattr_index(const char *name);
extern const char *const ckpt__xattr_names[CKPT_X_COUNT];

/* The files staged in ck and their bytes. fs->lock held (ops.c). */
void ckpt__ckpt_staged_size(const ckpt_ckpt_t *ck, uint64_t *files,
                            uint64_t *bytes);

/* Staged files below directory dir and their bytes. fs->lock held. */
void ckpt__count_staged(const ckpt_node_t *dir, uint64_t *files,
                        uint64_t *bytes);

/* The drain thread: closed passthrough files hashed where they are. */
typedef struct ckpt_drain ckpt_drain_t;
int ckpt__drain_start(ckpt_fs_t *fs, ckpt_drain_t **out);
/* Stop it (before the nodes go): queued files stay in their memfds. */
void ckpt__drain_stop(ckpt_drain_t *d);
/* Drain n (a staged file whose last passthrough handle was closed). */
void ckpt__drain_add(ckpt_drain_t *d, ckpt_node_t *n);

/* The staged kinds' entries in the tree's tables (staged.c). */
void ckpt__stage_register(void);

#endif /* CKPT_FS_STAGE_H */
