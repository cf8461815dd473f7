/*
 * metadb.h - the SQLite metadata of a committed checkpoint.
 *
 * The only unit of ckptfs that calls SQLite. It runs on the dist thread
 * (publish) and at mount / after a commit (load), never inside a FUSE
 * callback. Schema (docs/committed.md, "Metadata schema"), format_version 1:
 *
 *   checkpoint(key TEXT PRIMARY KEY, value TEXT)
 *       keys: format_version, name, save_id, world_size, created_at
 *   tensors(fqn TEXT PRIMARY KEY, path TEXT, dtype TEXT, shape TEXT)
 *   chunks(fqn TEXT, offsets TEXT, sizes TEXT, rank INTEGER, file TEXT,
 *          file_offset INTEGER, length INTEGER, checksum TEXT)
 *   blobs(fqn TEXT PRIMARY KEY, path TEXT, rank INTEGER, file TEXT,
 *         file_offset INTEGER, length INTEGER, checksum TEXT)
 *   entries(path TEXT PRIMARY KEY, mode INTEGER, uid INTEGER, gid INTEGER,
 *           mtime_ns INTEGER, target TEXT)      (optional; target: newer)
 *   xattrs(path TEXT, name TEXT, value BLOB)    (optional)
 *
 * shape/offsets/sizes are compact JSON arrays, checksum is 16 lowercase hex
 * digits of XXH3-64, file is "__R_K.distcp" relative to the checkpoint
 * directory. The database uses the rollback journal (never WAL), so that
 * `sqlite3 -readonly` can query it through the read-only mount.
 */
#ifndef CKPT_METADB_H
#define CKPT_METADB_H

#include <stdbool.h>

#include "ckpt_planner.h"
#include "store.h"

#define CKPT_METADB_FORMAT_VERSION 1
/* Bounds of what a .metadata may say (it is untrusted): ranks, data files
 * per rank, and the seconds its queries may take. */
#define CKPT_METADB_MAX_WORLD (1 << 20)
#define CKPT_METADB_MAX_FILE ((1 << 20) - 1)
#define CKPT_METADB_TIME_LIMIT 30

/*
 * Publish m as ckpt_dir/.metadata, atomically:
 *  1. write ckpt_dir/.metadata.tmp (removed first if present) in one
 *     transaction;
 *  2. fsync it (when sync);
 *  3. rename it to ckpt_dir/.metadata;
 *  4. fsync ckpt_dir (when sync).
 * A crash at any point leaves either no .metadata or the complete one.
 * On failure .metadata.tmp is removed and *err (malloc'd) says why,
 * including the system's error text. Returns 0 or a negative errno.
 */
int ckpt_metadb_publish(const char *ckpt_dir, const ckpt_metadata_t *m,
                        bool sync, char **err);

/*
 * Load a .metadata file into *out (sorted as ckpt_metadata_t says), checking
 * its consistency: format_version, known dtypes, lists that parse and agree
 * with the tensor's ndim, chunk rows whose fqn is a tensor, file names of
 * the form __R_K.distcp with R == rank. Returns 0, or a negative errno with
 * *err (malloc'd) naming the problem.
 */
int ckpt_metadb_load(const char *metadata_path, ckpt_metadata_t *out,
                     char **err);
/*
 * The same for the .metadata in checkpoint directory dirfd (display names
 * it in messages). Both refuse, with *err saying why: a .metadata that is
 * a symlink or not a regular file; schema objects other than the six
 * tables and their indexes (views, triggers, virtual tables, generated
 * columns); a world size beyond CKPT_METADB_MAX_WORLD, a data file index
 * beyond CKPT_METADB_MAX_FILE, a file_offset + length beyond INT64_MAX; a
 * tensor not covered exactly by its chunks (a gap or an overlap); and
 * queries that run longer than CKPT_METADB_TIME_LIMIT (-ETIMEDOUT).
 */
int ckpt_metadb_load_at(int dirfd, const char *display, ckpt_metadata_t *out,
                        char **err);

/*
 * Only the checkpoint table of a .metadata file (name, save_id, world_size,
 * created_at; no tensors, chunks or blobs): what listing and pruning
 * need, without reading the chunk rows of a large checkpoint.
 */
int ckpt_metadb_load_header(const char *metadata_path, ckpt_metadata_t *out,
                            char **err);
int ckpt_metadb_load_header_at(int dirfd, const char *display,
                               ckpt_metadata_t *out, char **err);

/*
 * SQLite's own integrity check of a .metadata file (b-trees, indexes, free
 * list): 0, or a negative errno with *err (malloc'd) saying what is wrong.
 */
int ckpt_metadb_check(const char *metadata_path, char **err);
int ckpt_metadb_check_at(int dirfd, const char *display, char **err);

/*
 * A new version of a committed checkpoint without one entry: what rows go.
 * tensor_fqn: the tensor's row and its chunks; blob_fqn: the blob's row;
 * entry_path: the entries row (when has_entries: the table exists).
 */
typedef struct {
  const char *tensor_fqn;
  const char *blob_fqn;
  const char *entry_path;
  bool has_entries;
} ckpt_metadb_drop_t;

/*
 * Write dst_dirfd/.metadata as a copy of src_dirfd/.metadata without the
 * rows drop names, with save_id as its save ID, the old one as key
 * previous_save_id and key version one more than before (1 when absent);
 * every other row, key and the schema unchanged. Published like a commit's:
 * .metadata.tmp, fsync (sync), rename, fsync of dst_dirfd (sync). On failure
 * nothing named .metadata stays in dst_dirfd and *err says why.
 */
int ckpt_metadb_rewrite(int src_dirfd, int dst_dirfd, const char *dst_display,
                        const char *save_id, const ckpt_metadb_drop_t *drop,
                        bool sync, char **err);

#endif /* CKPT_METADB_H */
