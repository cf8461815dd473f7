/*
 * store.h - the backing directory: its layout, the opens that refuse
 * symlinks, the scan for unfinished saves, removal, and the one reader of
 * committed chunks with its one bounded cache of data file descriptors.
 *
 * Everything below BACKING_DIR is untrusted: another user may own it, and
 * several mounts and tools use it at once. So every open under it refuses
 * symlinks, a checkpoint directory is pinned by its save ID (and its
 * device and inode) when it is loaded, and the reader never reads beyond
 * what its .metadata says
 * (the loader, metadb.c, checks that the chunks of a tensor cover it
 * exactly).
 *
 * Layout of BACKING_DIR (docs/committed.md, "Backing directory"):
 *
 *   NAME/                 one checkpoint (ckpt_name_valid)
 *   NAME/.metadata        SQLite metadata: its presence is the commit
 *   NAME/.metadata.tmp    being written (removed by the next mount)
 *   NAME/__R_K.distcp     data file K of rank R
 *   .staging/             unnamed spill and stream files of live mounts
 *   .saves/ID/            a save in flight: its data files and .metadata,
 *                         renamed to NAME at the commit (never replacing)
 *
 * No FUSE and no MPI here: the offline tools link this library alone.
 */
#ifndef CKPT_STORE_H
#define CKPT_STORE_H

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "ckpt_planner.h"

#define CKPT_METADATA_FILE ".metadata"
#define CKPT_METADATA_TMP ".metadata.tmp"
#define CKPT_STAGING_DIR ".staging"
#define CKPT_SAVES_DIR ".saves"

/* ------------------------------------------------------------------------
 * Small helpers (util.c).
 * ---------------------------------------------------------------------- */
char *ckpt__strdup_printf(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
/* One line "ckptfs: ..." to the log: stderr, unless ckpt__log_to said
 * otherwise; a message with newlines is one such line per line of it,
 * each with the prefix. A message is written whole (one write). */
void ckpt__log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Where ckpt__log goes from now on: the file path (appended to, created
 * 0600; each line then starts with the UTC time and the pid, and "rank R"
 * when rank >= 0), or syslog (daemon facility) when path is NULL and
 * use_syslog, else stderr. Returns 0 or -errno (the log stays where it
 * was). Call before threads log. */
int ckpt__log_to(const char *path, bool use_syslog, int rank);
/* Open dirfd/relpath (flags and mode as openat(2); O_CLOEXEC always)
 * resolving every component beneath dirfd and following no symbolic link
 * at all, the last one included: openat2(RESOLVE_BENEATH|
 * RESOLVE_NO_SYMLINKS), or where the kernel lacks it (before 5.6, or a
 * seccomp filter that answers EPERM) a walk opening each component with
 * O_NOFOLLOW. relpath: components separated by single slashes, none empty,
 * "." or ".." (or "." alone, dirfd itself). fd, or -errno: -ELOOP (or
 * -ENOTDIR) when a component is a symbolic link, -EINVAL for a path that
 * would leave dirfd. Every open under BACKING_DIR goes through it. */
int ckpt_open_beneath(int dirfd, const char *relpath, int flags, mode_t mode);
/* A directory stream of dirfd's directory on a descriptor of its own (a
 * dup of dirfd would share its position): NULL with errno set. */
DIR *ckpt_opendir_at(int dirfd);
/* Are a and b (fstat) the same version of one file: device, inode, size,
 * mtime and ctime? (util.c) */
bool ckpt__same_version(const struct stat *a, const struct stat *b);
/* Read exactly n bytes at off: 0, -EIO when the file ends first, -errno. */
int ckpt__pread_full(int fd, void *buf, size_t n, uint64_t off);
/* XXH3-64 of bytes [off, off+len) of fd: 0, -ENODATA when the file ends
 * first, or -errno of the read (verify.c). */
int ckpt__stored_checksum(int fd, uint64_t off, uint64_t len, uint64_t *out);
/* Add bytes [off, off+len) of fd to XXH3 state st (libxxhash's), with
 * XXH3 built for AVX2 where the CPU has it (1.3x faster than libxxhash's
 * SSE2 build here): from mappings of the file where
 * ckpt_store_hash_mapped_init was called, else read through buf (cap
 * bytes) in steps. 0, -ENODATA when the file ends first (also when it
 * shrank during the hash), -EIO for an I/O error on a mapped page, or
 * -errno of the read. */
struct XXH3_state_s;
/* Let ckpt__hash_fd hash from mappings: installs a SIGBUS handler
 * (bus_guard.c) for a file that shrinks under the mapping, chained to
 * the one before it. Once, before any thread hashes. 0 or -errno. */
int ckpt_store_hash_mapped_init(void);
int ckpt__hash_fd(struct XXH3_state_s *st, int fd, uint64_t off,
                  uint64_t len, void *buf, size_t cap);
/* Chunks known to match their data file (known.c): remember bytes
 * [pos, pos+len) of the file st describes (as it is now, after its last
 * write, which nobody else can make: a commit's own sealed staging file)
 * as having XXH3-64 sum. */
void ckpt_store_known_add(const struct stat *st, uint64_t pos, uint64_t len,
                          uint64_t sum);
/* The same for a chunk a verified read hashed (the file described by st
 * before and after the hash): remembered unless the file changed in the
 * last 2 s (a change within the clock tick of that stat could leave its
 * ctime as it was: git's racy index rule). */
void ckpt_store_known_hashed(const struct stat *st, uint64_t pos,
                             uint64_t len, uint64_t sum);
/* Were bytes [pos, pos+len) of fd remembered with checksum sum, and is
 * the file unchanged since (device, inode, size, mtime, ctime)? */
bool ckpt_store_known(int fd, uint64_t pos, uint64_t len, uint64_t sum);
/* Forget what this process remembers (tests: as a new process would). */
void ckpt_store_known_forget(void);
/* Share what is known with the other processes of this node that share
 * dir (made if missing; it and its entry for this boot must be private
 * to this user: ckpt_store_check_private): each chunk is then hashed once
 * per boot and change of its data file, whichever daemon hashes it (a
 * verified read remembers what it hashed: reader.c). Records of earlier
 * boots are removed. 0, or -errno with *why (malloc'd). */
int ckpt_store_known_share(const char *dir, char **why);
/* Share no more (tests). */
void ckpt_store_known_unshare(void);
/* The same, given up (-ECANCELED) once *stop is set (checked between
 * reads of 1 MiB); stop may be NULL. */
int ckpt__stored_checksum_stop(int fd, uint64_t off, uint64_t len,
                               uint64_t *out, const _Atomic bool *stop);

/* ------------------------------------------------------------------------
 * Layout (layout.c).
 * ---------------------------------------------------------------------- */
/* Open BACKING_DIR/name, a checkpoint directory: O_DIRECTORY, never
 * through a symlink. flags: O_RDONLY or O_PATH (plus O_CLOEXEC always).
 * fd or -errno (-ELOOP / -ENOTDIR for a symlink). */
int ckpt_store_open_dir(int backing_fd, const char *name, int flags);
/* Open the regular file dirfd/file read-only, never through a symlink:
 * fd, or -errno (-ELOOP for a symlink, -EINVAL for anything but a regular
 * file). */
int ckpt_store_open_file(int dirfd, const char *file);
/* Is there a .metadata entry (of any type: a symlink there is a damaged
 * checkpoint, not an unfinished save) in checkpoint directory dirfd? */
bool ckpt_store_has_metadata(int dirfd);
/* Is BACKING_DIR/name a committed checkpoint: a directory (not a
 * symlink) with a .metadata entry? *dir gets the directory's stat (its
 * identity) when it is. For callers that must not open the directory
 * (listing, lookups): two fstatat calls. */
bool ckpt_store_committed(int backing_fd, const char *name, struct stat *dir);
/* What BACKING_DIR/name is, without following a symlink (two fstatat
 * calls at most); *dir as above when COMMITTED. */
typedef enum {
  CKPT_ENTRY_NONE,       /* nothing, or not a checkpoint name */
  CKPT_ENTRY_OTHER,      /* a file, a symlink, ...: not a directory */
  CKPT_ENTRY_UNFINISHED, /* a directory without .metadata */
  CKPT_ENTRY_COMMITTED,  /* a directory with .metadata */
} ckpt_entry_t;
ckpt_entry_t ckpt_store_entry(int backing_fd, const char *name,
                              struct stat *dir);
/* Create (create) or join BACKING_DIR/.saves/save_id, the save's own
 * directory, and hold it with a shared flock (a starting mount removes
 * only the ones nobody holds). 0 with *out, or -errno: -ENOENT when
 * joining a directory that is not there (the coordinator creates it: a
 * rank that does not see it does not share BACKING_DIR). */
int ckpt_store_save_dir_hold(int backing_fd, const char *save_id, bool create,
                             int *out);
/* The commit point: rename BACKING_DIR/.saves/save_id to BACKING_DIR/name,
 * never replacing anything there: renameat2(RENAME_NOREPLACE), or where
 * the filesystem lacks it (NFS, some FUSE filesystems) rename(2), which
 * no POSIX filesystem lets replace a non-empty directory (and a committed
 * checkpoint is never empty). 0, -EEXIST when name exists (committed by
 * someone else), or -errno. */
int ckpt_store_publish(int backing_fd, const char *save_id, const char *name);
/* The commit point of a save that replaces (`replace=NAME`): exchange
 * BACKING_DIR/.saves/save_id and BACKING_DIR/name in one step
 * (renameat2(RENAME_EXCHANGE)): name is the new checkpoint, and the old
 * one is at .saves/save_id, where the caller removes it (a crash leaves it
 * to the next mount's cleanup of unheld save directories: exactly one of
 * the two is ever NAME, whole). Where name does not exist, a plain publish
 * (*replaced false). 0; -EEXIST when name is a file or a symlink;
 * -EOPNOTSUPP when the filesystem cannot exchange; or -errno. */
int ckpt_store_publish_replace(int backing_fd, const char *save_id,
                               const char *name, bool *replaced);
/* Undo a replace whose durability failed: exchange the two back. */
/* The flush of a tier's save (fs/tier/flush.c): publish .saves/save_id as
 * name only while name is one of the saves its commit replaced
 * (ckpt_store_replaces_ok: replaces and commit_ns as in its .metadata,
 * ckpt_metadata_t's): exchanged with it, or published without
 * replacing where there is none and "none" is listed. Under an exclusive
 * flock of name's directory, as every replace and removal inside takes
 * it, so that nothing changes name between the look and the exchange.
 * 0 (*replaced: an old checkpoint is now at .saves/save_id); -ESTALE
 * when name is another save, committed after this one (*now: its save
 * key, "" for none); -EEXIST when name is not a checkpoint; -EOPNOTSUPP
 * or -errno. */
int ckpt_store_publish_if(int backing_fd, const char *save_id,
                          const char *name, const char *replaces,
                          int64_t commit_ns, bool *replaced,
                          char now[CKPT_SAVE_ID_LEN + 1]);
/* Is key (a save key, "" for no checkpoint) one of replaces? */
bool ckpt_store_replaces_has(const char *replaces, const char *key);
int ckpt_store_unreplace(int backing_fd, const char *save_id,
                         const char *name);
/* fsync BACKING_DIR/.saves (an exchange changed it too). */
int ckpt_store_sync_saves(int backing_fd);
/* Remove BACKING_DIR/.saves/save_id (a failed or lost save's own files),
 * and .saves when it is empty. */
void ckpt_store_save_dir_remove(int backing_fd, const char *save_id);
/* The same, only if no one holds it (a save or a flush publishing it):
 * 0, -EBUSY (held: kept) or -errno. */
int ckpt_store_save_dir_remove_unheld(int root_fd, const char *save_id);
/* Does a save or flush hold root/.saves/save_id now? */
bool ckpt_store_save_dir_held(int root_fd, const char *save_id);
/* Start removing committed checkpoint s for every mount: unlink its
 * .metadata and fsync the directory (from then on it is an unfinished
 * save), if BACKING_DIR/NAME is still that checkpoint
 * (ckpt_stored_same_dir). 0 (also when NAME is gone), -ESTALE when it is
 * another checkpoint or its .metadata is gone already (removed by
 * another mount: not this caller's to remove), or -errno. */
struct ckpt_stored;
int ckpt_store_unpublish(int backing_fd, const struct ckpt_stored *s);
/* Remove every entry of directory parent_fd/name, then the directory
 * (never following symlinks). 0 or the first -errno. */
int ckpt__remove_tree(int parent_fd, const char *name);
/* The same for a directory held open as dfd: its entries are removed
 * through dfd, and parent_fd/name only if it is that directory, now empty
 * (a directory exchanged in under the name meanwhile is left whole). */
int ckpt__remove_held_tree(int parent_fd, const char *name, int dfd);
/* At mount: remove unfinished saves (directories without .metadata, and
 * those of .saves, that no writer holds), stale .metadata.tmp files and
 * .staging. keep_fd (a directory, or -1): a .saves/ID is kept when keep_fd
 * has an entry ID (a tier's flush records: a flush resumes into it). */
void ckpt_store_cleanup(int backing_fd, int keep_fd);
/* Is the directory open at root_fd (path: its name, for *why) private to
 * this process's user: owned by the effective uid and writable by no
 * other user (no write bit for others, none for a group other than the
 * effective gid)? With whole, so is every entry beneath it (owner and
 * write bits; symlinks by owner only), so that nothing there can have
 * been planted by another user. 0, or -EPERM (-errno) with *why (malloc'd)
 * naming the first entry that is not. A tier must be (fs/daemon/main.c). */
int ckpt_store_check_private(int root_fd, const char *path, bool whole,
                             char **why);

/* ------------------------------------------------------------------------
 * Data file descriptors (fdcache.c): one cache per process, shared by all
 * checkpoints, at most cap descriptors open (least recently used ones are
 * closed; those in use are closed when released). Thread-safe.
 * ---------------------------------------------------------------------- */
typedef struct ckpt_fdcache ckpt_fdcache_t;

/* cap 0: a quarter of RLIMIT_NOFILE's soft limit, at least 16 and at most
 * CKPT_FDCACHE_MAX (data files are opened in a few microseconds: a miss
 * costs little, a descriptor per checkpoint ever read costs the limit).
 * 0 or -ENOMEM. */
#define CKPT_FDCACHE_MAX 256
int ckpt_fdcache_new(int backing_fd, uint32_t cap, ckpt_fdcache_t **out);
void ckpt_fdcache_free(ckpt_fdcache_t *c);
/* A root tried before backing_fd when a data file is opened (a node-local
 * tier; -1: none, the default): a checkpoint is read from there while it
 * is there, else from backing_fd. Its lineage is checked by save ID, as
 * the directories differ. Not owned; set before the first read. A data
 * file in neither is taken from backing_fd/.saves/SAVE_ID once a flush
 * linked it there, waited for up to wait seconds (then EIO). */
void ckpt_fdcache_set_near(ckpt_fdcache_t *c, int near_fd, double wait);
/* Descriptors open now (for tests and the bench). */
uint32_t ckpt_fdcache_open(ckpt_fdcache_t *c);
/* Close the unused descriptors of data files that have no name left
 * (st_nlink 0: their checkpoint was removed, through another mount, by
 * keep_last or ckptctl prune): a cached descriptor would keep a removed
 * file's space in use in BACKING_DIR until evicted. Descriptors a read
 * or an open file holds stay. The number closed. */
uint32_t ckpt_fdcache_sweep(ckpt_fdcache_t *c);

/* The kernel's file handle of a directory (name_to_handle_at): on ext4,
 * XFS, btrfs, tmpfs, NFS... its inode number and generation, so that a
 * directory given the number of a removed one has another handle. One
 * system call: what listings compare, where reading the save ID of every
 * checkpoint would cost a SQLite open each. len 0: the filesystem gives
 * none (then the save ID is read). */
#define CKPT_HANDLE_MAX 128
typedef struct {
  uint32_t len;
  int type;
  unsigned char b[CKPT_HANDLE_MAX];
} ckpt_dir_handle_t;
/* The handle of dirfd/name (name "": dirfd itself), never following a
 * symlink; len 0 when there is none. */
void ckpt_store_dir_handle(int dirfd, const char *name,
                           ckpt_dir_handle_t *out);
bool ckpt_dir_handle_same(const ckpt_dir_handle_t *a,
                          const ckpt_dir_handle_t *b);

/* A committed checkpoint as the reader knows it. */
typedef struct ckpt_stored {
  char name[256];
  uint64_t id;                /* unique in its cache (ckpt_stored_init) */
  dev_t dev;                  /* the directory loaded: a directory of the */
  ino_t ino;                  /* same name but another inode is not it */
  char save_id[CKPT_SAVE_ID_LEN + 1]; /* its save: nor is one of the same
                                 inode (a filesystem reuses the number of
                                 a removed directory) holding another save;
                                 a save ID longer than a ckptfs one (another
                                 tool's) as "#" and its XXH3-64 */
  ckpt_dir_handle_t handle;   /* the directory's, when loaded */
  const ckpt_metadata_t *meta; /* not owned */
  ckpt_fdcache_t *cache;      /* not owned */
  _Atomic uint8_t *verified;  /* with verify: CKPT_CHUNK_* of each chunk,
                                 then each blob; else NULL (owned) */
  struct ckpt_seen *seen;     /* with verify: each data file as it was when
                                 its chunks were checked, by (rank, file)
                                 (owned, n_seen; reader.c) */
  uint32_t n_seen;
} ckpt_stored_t;

/* Chunks and blobs found damaged by verify in this process, so far (each
 * counted once per loaded checkpoint). */
uint64_t ckpt_store_verify_failures(void);
/* Bytes of chunks and blobs verify checked in this process, so far: hashed,
 * and known (hashed from their data file by this process's commit, the
 * file unchanged since: ckpt_store_known). */
void ckpt_store_verify_bytes(uint64_t *hashed, uint64_t *known);

/* What verify knows of a stored chunk or blob (CHECKING: one thread is
 * hashing it, the others wait for its verdict). */
enum {
  CKPT_CHUNK_UNCHECKED,
  CKPT_CHUNK_GOOD,
  CKPT_CHUNK_BAD,
  CKPT_CHUNK_CHECKING
};

/* Set s up for checkpoint directory dirfd (its identity is taken from it)
 * holding meta. verify: check each chunk's XXH3-64 before it is first
 * served. 0 or -errno. */
int ckpt_stored_init(ckpt_stored_t *s, ckpt_fdcache_t *cache,
                     const char *name, int dirfd, const ckpt_metadata_t *meta,
                     bool verify);
/* Close s's descriptors and free what it owns (not meta). */
void ckpt_stored_destroy(ckpt_stored_t *s);

/* The save ID of the .metadata in checkpoint directory dirfd (its header
 * only: one small table) into out, as ckpt_stored_t keeps it: 0, or
 * -errno (-ENOENT: no .metadata; -EIO: one that does not load). */
int ckpt_store_save_id(int dirfd, char out[CKPT_SAVE_ID_LEN + 1]);
/* The same, and *replaces: the saves its commit replaced, when it
 * recorded them (a commit into a tier: ckpt_metadata_t's; NULL else),
 * malloc'd; *commit_ns: when it was committed (ns since the epoch; to
 * the second for an older save). Either may be NULL. */
int ckpt_store_save_look(int dirfd, char out[CKPT_SAVE_ID_LEN + 1],
                         char **replaces, int64_t *commit_ns);
/* May a save committed at commit_ns whose commit replaced `replaces`
 * take the place of save `now` (its key, "" for none) committed at
 * now_ns? Yes if now is listed, or for a replace= ("earlier" listed) if
 * now was committed before it. */
bool ckpt_store_replaces_ok(const char *replaces, int64_t commit_ns,
                            const char *now, int64_t now_ns);
/* Is directory dirfd (opened by s's name) still the checkpoint s was
 * loaded from: the same device, inode and save ID? 0, -ESTALE when it is
 * another one (logged with what), or -errno. A directory whose .metadata
 * is gone is not it either (-ESTALE): removed, for every mount. */
int ckpt_stored_same_dir(const ckpt_stored_t *s, int dirfd);
/* The same, or a later version of it made by removals inside it (its data
 * files are hard links of the same files; an item removed since reads as
 * its punched range or not at all): 0, -ESTALE or -errno. What reads
 * use, so that removals elsewhere never fail reads of what stays. */
int ckpt_stored_same_lineage(const ckpt_stored_t *s, int dirfd);

/* A data file descriptor in use: valid until ckpt_fdref_put. */
typedef struct {
  int fd;
  struct ckpt_fdent *e;
  ckpt_fdcache_t *c;
  bool fresh; /* opened by this call, not taken from the cache */
} ckpt_fdref_t;

/* The descriptor of data file K of rank R of s: 0, or -errno: why the
 * file cannot be opened (-ENOENT, -ELOOP for a symlink, -EINVAL for
 * something else than a regular file, -ESTALE when the checkpoint
 * directory was replaced since it was loaded, -ERANGE for a rank beyond
 * the world; logged), -EMFILE, -ENOMEM. The readers below turn all but
 * the last two into -EIO: a committed checkpoint with missing data is
 * damaged. */
int ckpt_stored_fd(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                   ckpt_fdref_t *ref);
void ckpt_fdref_put(ckpt_fdref_t *ref);
/* With verify, at each open of a committed file: has data file K of rank
 * R (ref: its descriptor, held) changed on disk since its chunks were
 * checked? One fstat: another inode, size, mtime or ctime, or no link
 * left (replaced by rename: then *ref moves to the file the name holds
 * now, when it is still this checkpoint's). If so, its chunks and blobs
 * are checked again before their next byte is served (logged). Without
 * verify: nothing. */
void ckpt_stored_recheck(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                         ckpt_fdref_t *ref);

/* Item i of s: tensor i, or with blob, blob i. */
typedef struct {
  bool blob;
  uint32_t i;
} ckpt_item_t;

/* Bytes of an item (a tensor's bytes fit: metadb checks them). */
uint64_t ckpt_stored_size(const ckpt_stored_t *s, ckpt_item_t it);
/* Read [off, off+size) of an item (clipped to its size) into buf: bytes
 * read or -errno (-EIO for missing or short data). */
ssize_t ckpt_stored_read(const ckpt_stored_t *s, ckpt_item_t it, void *buf,
                         size_t size, uint64_t off);
/* When the whole of an item is one contiguous run of one data file (a
 * blob; a tensor stored as one chunk): 1 with that file (rank, K) and
 * where the run starts in it; else 0. Opens nothing. */
int ckpt_stored_run(const ckpt_stored_t *s, ckpt_item_t it, int32_t *rank,
                    uint32_t *file, uint64_t *pos);
/* When [off, off+size) of an item (clipped) is one contiguous run of one
 * data file: 1 with *ref, *pos and *len set (release *ref), so that it can
 * be spliced. 0 when it must be assembled by ckpt_stored_read, < 0 on
 * error. */
int ckpt_stored_span(const ckpt_stored_t *s, ckpt_item_t it, size_t size,
                     uint64_t off, ckpt_fdref_t *ref, uint64_t *pos,
                     size_t *len);
/* Read bytes [off, off+size) (clipped) of the row-major contents of the
 * box [lo, lo+sizes) of tensor `tensor` (a block file) into buf. Each
 * chunk's part is gathered with few large reads: the stored runs of one
 * request that lie close together (gaps up to CKPT_GATHER_GAP) are read by
 * one preadv, straight into buf, the gaps into a scratch buffer. With
 * verify, every chunk read from is checked first (-EIO when damaged).
 * Bytes read or -errno (-EIO for missing or short data). */
#define CKPT_GATHER_GAP ((size_t)16 << 10)
ssize_t ckpt_stored_read_box(const ckpt_stored_t *s, uint32_t tensor,
                             const int64_t *lo, const int64_t *sizes,
                             void *buf, size_t size, uint64_t off);
/* With verify: check the XXH3-64 of every chunk (or the blob) that
 * [off, off+size) touches, once per chunk: 0, or -EIO when one does not
 * match (logged with its FQN, rank and file). Without: 0. */
int ckpt_stored_verify(const ckpt_stored_t *s, ckpt_item_t it, size_t size,
                       uint64_t off);

/* ------------------------------------------------------------------------
 * Removal of one entry inside a committed checkpoint (removal.c).
 * ---------------------------------------------------------------------- */
/* What goes: a tensor or a blob (its rows and its entries row), or an
 * empty directory or a symbolic link (dir: its entries row only). */
typedef struct {
  bool dir;
  bool blob;        /* else a tensor (when !dir) */
  const char *fqn;  /* the item's */
  const char *path; /* its path in the checkpoint (the entries row) */
} ckpt_removal_t;

/* The identity of a new version, for ckpt_stored_rebind. */
typedef struct {
  dev_t dev;
  ino_t ino;
  ckpt_dir_handle_t handle;
  char save_id[CKPT_SAVE_ID_LEN + 1];
} ckpt_version_t;

/*
 * Remove entry r of committed checkpoint BACKING_DIR/NAME (s->name) for
 * every mount: a new version of it is built in .saves/NEW (hard links of
 * the data files it still uses, a copy of .metadata without r's rows and
 * with a new save ID) and exchanged with NAME (renameat2 RENAME_EXCHANGE),
 * both directories fsynced (sync), then the old version is removed from
 * .saves and r's byte ranges are punched out of the data files the new
 * version still uses (where the filesystem can). All under an exclusive
 * flock of NAME's directory, so removals, replaces and whole removals from
 * any mount go one at a time, each on the version it holds.
 * removed: items of s->meta already gone from the version s is bound to
 * (n_tensors flags, then n_blobs), or NULL.
 * Returns 0 with *out set when the version s is bound to was the current
 * one (rebind s to *out: it is the new version, s->meta less r and
 * removed); 1 when NAME had changed meanwhile (removed from the current
 * version, or already gone from it: s is stale, reload NAME); -ENOENT when
 * NAME is no committed checkpoint any more; -EOPNOTSUPP when the
 * filesystem cannot exchange directories; or -errno with *err.
 */
int ckpt_store_remove_entry(int backing_fd, const ckpt_stored_t *s,
                            const bool *removed, const ckpt_removal_t *r,
                            bool sync, ckpt_version_t *out, char **err);
/* s identifies version v from now on (its data files are the same
 * inodes: descriptors open stay valid; idle cached ones are dropped). */
void ckpt_stored_rebind(ckpt_stored_t *s, const ckpt_version_t *v);

#endif /* CKPT_STORE_H */
