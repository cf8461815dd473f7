/*
 * ckpt_planner.h - the pure planning logic of ckptfs.
 *
 * Everything here is plain computation on memory: no I/O, no FUSE, no MPI,
 * no SQLite. It is what DCP's planner does (local plan, global plan with
 * dedup and validation, assignment of items to data files) plus the parsers
 * of the user-visible values (dtypes, shape/offsets/sizes lists, names) and
 * the binary messages that carry plans between ranks.
 *
 * Conventions: functions return 0 on success and a negative errno on
 * failure (-EINVAL for bad input, -ENOMEM, -EOVERFLOW). Strings in structs
 * are owned by the struct and released by its _free function.
 */
#ifndef CKPT_PLANNER_H
#define CKPT_PLANNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Most dimensions a tensor may have (PyTorch's own limit is 64). */
#define CKPT_MAX_NDIM 64

/* Largest dimension value accepted in a list (fits int64 with room). */
#define CKPT_DIM_MAX INT64_MAX

/* ------------------------------------------------------------------------
 * Growable byte buffer (messages, text).
 * ---------------------------------------------------------------------- */
typedef struct {
  uint8_t *data; /* owned; NUL-terminated when used as text */
  size_t len;    /* bytes used */
  size_t cap;    /* bytes allocated */
} ckpt_buf_t;

void ckpt_buf_init(ckpt_buf_t *b);
void ckpt_buf_free(ckpt_buf_t *b);
int ckpt_buf_reserve(ckpt_buf_t *b, size_t extra);
int ckpt_buf_append(ckpt_buf_t *b, const void *p, size_t n);
/* printf-style append; keeps data NUL-terminated. */
int ckpt_buf_printf(ckpt_buf_t *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Take ownership of the contents as a NUL-terminated string (never NULL on
 * success); the buffer is left empty. */
char *ckpt_buf_steal(ckpt_buf_t *b);

/* ------------------------------------------------------------------------
 * Dtypes.
 * ---------------------------------------------------------------------- */
typedef enum {
  CKPT_DTYPE_INVALID = -1,
  CKPT_DTYPE_BOOL = 0,
  CKPT_DTYPE_UINT8,
  CKPT_DTYPE_INT8,
  CKPT_DTYPE_INT16,
  CKPT_DTYPE_INT32,
  CKPT_DTYPE_INT64,
  CKPT_DTYPE_FLOAT16,
  CKPT_DTYPE_BFLOAT16,
  CKPT_DTYPE_FLOAT32,
  CKPT_DTYPE_FLOAT64,
  CKPT_DTYPE_COMPLEX64,
  CKPT_DTYPE_COMPLEX128,
  CKPT_DTYPE_FLOAT8_E4M3FN,
  CKPT_DTYPE_FLOAT8_E5M2,
  CKPT_DTYPE_COUNT
} ckpt_dtype_t;

/* Parse a dtype name of len bytes (not NUL-terminated necessarily):
 * canonical names, torch.X, numpy names and type strings (<f4, |b1, ...),
 * safetensors names (F32, BF16, F8_E4M3, ...). Surrounding whitespace and
 * one trailing newline are ignored. Returns 0 or -EINVAL. */
int ckpt_dtype_parse(const char *s, size_t len, ckpt_dtype_t *out);
/* Canonical name ("float32"); NULL for an invalid dtype. */
const char *ckpt_dtype_name(ckpt_dtype_t dt);
/* Item size in bytes; 0 for an invalid dtype. */
size_t ckpt_dtype_size(ckpt_dtype_t dt);

/* ------------------------------------------------------------------------
 * Dimension lists: shape, offsets, sizes.
 * ---------------------------------------------------------------------- */
typedef struct {
  int ndim;                 /* 0 for a 0-d scalar */
  int64_t d[CKPT_MAX_NDIM]; /* each >= 0 */
} ckpt_dims_t;

/* Parse "4096,1024", "[4096, 1024]", "" or "[]" (0-d), with optional
 * whitespace and one trailing newline. Negative numbers, non-digits,
 * overflow, empty elements, more than CKPT_MAX_NDIM: -EINVAL. */
int ckpt_dims_parse(const char *s, size_t len, ckpt_dims_t *out);

typedef enum {
  CKPT_DIMS_CSV,  /* 4096,1024 (empty string for 0-d) */
  CKPT_DIMS_JSON, /* [4096,1024] ([] for 0-d) */
} ckpt_dims_style_t;

/* Format into buf (always NUL-terminated if cap > 0). Returns the length
 * the full text needs (excluding NUL), like snprintf. */
int ckpt_dims_format(const int64_t *d, int ndim, ckpt_dims_style_t style,
                     char *buf, size_t cap);
/* Product of d[0..ndim-1] (1 for ndim 0); -EOVERFLOW beyond UINT64_MAX
 * (a zero dimension makes it 0, however large the others); -EINVAL for a
 * negative dimension. */
int ckpt_dims_numel(const int64_t *d, int ndim, uint64_t *out);

/* ------------------------------------------------------------------------
 * Names and FQNs.
 * ---------------------------------------------------------------------- */
/* A checkpoint name: any file name (1-255 bytes, no '/') not starting
 * with '.' (`epoch=0-step=100`, `a b`, UTF-8). */
bool ckpt_name_valid(const char *name);
/* May a staged entry (file or directory) be named name[0..len)? Any file
 * name: 0; "", ".", "..", a '/' or NUL: -EINVAL; beyond 255 bytes:
 * -ENAMETOOLONG; directly under the checkpoint (top), a name ckptfs serves
 * there itself (.commit, .status, .metadata, .npy, .safetensors, a block
 * file's ".NAME[...]"): -EPERM. */
int ckpt_entry_name_check(const char *name, size_t len, bool top);
/* A metric recorded at commit (metric=KEY:VALUE): KEY is 1 to
 * CKPT_METRIC_KEY_MAX bytes of [A-Za-z0-9_.-], VALUE a finite number. */
#define CKPT_METRIC_KEY_MAX 64
#define CKPT_MAX_METRICS 16
typedef struct {
  char key[CKPT_METRIC_KEY_MAX + 1];
  double value;
} ckpt_metric_t;
bool ckpt_metric_key_valid(const char *key, size_t len);
/* v as the shortest decimal text that reads back as v (%.15g, else
 * %.17g): 0.25, 1e-05. snprintf semantics. */
int ckpt_metric_format(double v, char *buf, size_t cap);
/* A metric's value: a finite decimal or exponent number (strtod's, without
 * hex, inf or nan), len bytes. 0 or -EINVAL. */
int ckpt_metric_value_parse(const char *s, size_t len, double *out);

/* What was written to NAME/.commit (commit_words.c). */
typedef struct {
  bool sync;          /* "sync" (else "async") */
  bool solo;          /* "solo": this rank alone, as a world of one */
  bool level_shared;  /* "level=shared": with a tier, a sync commit returns
                         once published in BACKING_DIR */
  char replace[256];  /* "replace=TARGET": TARGET, or "" */
  /* Retention (docs/saving.md, "Retention"): recorded in .metadata. */
  bool has_step;      /* "step=N" */
  int64_t step;       /* N: 0 to 2^63-1 */
  bool protect;       /* "protect": never removed by a policy */
  uint32_t n_metrics; /* "metric=KEY:VALUE", each KEY at most once */
  ckpt_metric_t metrics[CKPT_MAX_METRICS];
} ckpt_commit_words_t;
/* Parse buf[0..len): 0, or -EINVAL for anything but "sync"/"async" then
 * "solo", "replace=TARGET", "step=N", "protect", "level=shared" (each at
 * most once) and
 * "metric=KEY:VALUE" (up to CKPT_MAX_METRICS, distinct keys), in any
 * order, spaces between (TARGET a checkpoint name without spaces), and a
 * final newline. */
int ckpt_commit_words_parse(const char *buf, size_t len,
                            ckpt_commit_words_t *out);

/* The step of a checkpoint named name when none was recorded at commit:
 * the last run of decimal digits in it ("epoch=3-step=1200" -> 1200,
 * "checkpoint-500" -> 500); -1 when it has none or the run does not fit
 * in an int64. */
int64_t ckpt_step_from_name(const char *name);

/* A retention policy (-o keep=, ckptctl prune): a committed checkpoint is
 * kept when any rule keeps it (catalog.c, ckpt__catalog_select_policy). */
typedef struct {
  uint32_t last;      /* the last N by step; 0: no such rule */
  uint64_t every;     /* every step that is a multiple of K; 0: none */
  uint32_t best;      /* the best M by metric; 0: none */
  char metric[CKPT_METRIC_KEY_MAX + 1]; /* best: the metric's KEY */
  bool maximize;      /* best: highest values are best (else lowest) */
} ckpt_keep_policy_t;
/* Does p keep anything by a rule (else it removes nothing)? */
bool ckpt_keep_policy_active(const ckpt_keep_policy_t *p);
/* Parse "last:5,every:1000,best:3:loss:min" (rules in any order, each at
 * most once, at least one; numbers >= 1; min or max) of len bytes. 0 or
 * -EINVAL. */
int ckpt_keep_policy_parse(const char *s, size_t len,
                           ckpt_keep_policy_t *out);
/* The policy as text, in the form parse takes; snprintf semantics. */
int ckpt_keep_policy_format(const ckpt_keep_policy_t *p, char *buf,
                            size_t cap);
/* FQN of a path relative to the checkpoint ("model/l0/w" -> "model.l0.w").
 * Returns a malloc'd string or NULL on ENOMEM. */
char *ckpt_fqn_from_path(const char *path);
/* Longest explicit FQN (user.ckpt.fqn), in bytes. */
#define CKPT_FQN_MAX 4096
/* An explicit FQN: 1..CKPT_FQN_MAX bytes, none of them NUL (any other
 * byte is fine: '/', '.', empty parts, control bytes). */
bool ckpt_fqn_valid(const char *fqn, size_t len);
/* Name of data file K of rank R: "__R_K.distcp". snprintf semantics. */
int ckpt_data_file_name(int32_t rank, uint32_t k, char *buf, size_t cap);
/* Parse "__R_K.distcp"; -EINVAL if the name is not of that form. */
int ckpt_data_file_parse(const char *name, int32_t *rank, uint32_t *k);

/* ------------------------------------------------------------------------
 * The save plan (after DCP's SavePlan / WriteItem).
 * ---------------------------------------------------------------------- */
typedef enum {
  CKPT_ITEM_TENSOR = 0, /* a chunk of a tensor */
  CKPT_ITEM_BYTES = 1,  /* an opaque blob */
} ckpt_item_kind_t;

/* One item a rank has staged. */
typedef struct {
  char *fqn;             /* owned, e.g. "model.layer0.weight" */
  char *path;            /* owned, relative path: "model/layer0/weight" */
  bool fqn_explicit;     /* fqn was given (user.ckpt.fqn), not derived from
                            the path ('/' -> '.') */
  ckpt_item_kind_t kind;
  ckpt_dtype_t dtype;    /* tensors only */
  int ndim;              /* tensors only */
  int64_t *dims;         /* owned, 3*ndim: shape, then offsets, then sizes */
  uint64_t length;       /* bytes staged */
  uint64_t checksum;     /* XXH3-64 of the staged bytes */
  uint32_t local_id;     /* the rank's own handle for the item */
  /* Write-behind: the item's bytes are already stored in this rank's data
   * file pin_file (K in __R_K.distcp) at pin_offset. CKPT_NO_PIN when not
   * pinned (the default of every add function and of the decoder). */
  uint32_t pin_file;
  uint64_t pin_offset;   /* meaningful only when pin_file != CKPT_NO_PIN */
} ckpt_write_item_t;

/* pin_file of an item whose bytes are not stored yet. */
#define CKPT_NO_PIN UINT32_MAX
/* Pins and reservations lie in data files K < CKPT_MAX_PIN_FILE: a mount
 * gives each large file written by FUSE passthrough a data file of its
 * own (K >= io_threads), bounded by its open files limit. */
#define CKPT_MAX_PIN_FILE (1u << 20)

/* dims is NULL when ndim is 0 (bytes items, scalars): no arithmetic then. */
static inline const int64_t *ckpt_item_shape(const ckpt_write_item_t *it) {
  return it->dims;
}
static inline const int64_t *ckpt_item_offsets(const ckpt_write_item_t *it) {
  return it->ndim > 0 ? it->dims + it->ndim : it->dims;
}
static inline const int64_t *ckpt_item_sizes(const ckpt_write_item_t *it) {
  return it->ndim > 0 ? it->dims + 2 * it->ndim : it->dims;
}

/* One extended attribute of a staged entry other than ckptfs's own
 * user.ckpt.*: a user.* name and its value, kept by the commit. */
typedef struct {
  char *name;     /* owned: "user." and more, at most CKPT_XATTR_NAME_MAX */
  uint8_t *value; /* owned, len bytes (NULL when len is 0) */
  uint32_t len;
} ckpt_xattr_t;

/* Bounds of an entry's other extended attributes: a value (E2BIG past
 * it, as the kernel's own bound), names per entry and bytes of names and
 * values per entry (ENOSPC past them, as a full inode says). */
#define CKPT_XATTR_NAME_MAX 255
#define CKPT_XATTR_VALUE_MAX 65536
#define CKPT_XATTR_COUNT_MAX 64
#define CKPT_XATTR_TOTAL_MAX (65536 + 4096) /* one value of the most, names */
/* The longest symbolic link target (PATH_MAX less its NUL). */
#define CKPT_LINK_TARGET_MAX 4095

/* What one staged file, directory or symbolic link of a checkpoint was:
 * committed, it keeps it (read-only). path is relative to the checkpoint
 * ("" is the checkpoint directory itself). */
typedef struct {
  char *path;       /* owned */
  uint32_t mode;    /* S_IFREG, S_IFDIR or S_IFLNK | permission bits
                       (07777; a link's are 0777) */
  uint32_t uid;
  uint32_t gid;
  int64_t mtime_ns; /* since the epoch */
  char *target;     /* owned or NULL. S_IFLNK: what the link holds, as
                       written (never resolved). S_IFREG: a hard link: the
                       path of the file's first name, whose item holds
                       the bytes (this path has no item of its own). */
  uint32_t n_xattrs;
  ckpt_xattr_t *xattrs; /* owned, sorted by name (strcmp), unique */
} ckpt_entry_attr_t;

/* Free what e owns (not e). */
void ckpt_entry_attr_free(ckpt_entry_attr_t *e);
/* A deep copy of src into *dst: 0 or -ENOMEM (nothing to free then). */
int ckpt_entry_attr_copy(ckpt_entry_attr_t *dst, const ckpt_entry_attr_t *src);
/* Is e one a checkpoint may hold? -EINVAL (a path over 4095 bytes, a type
 * other than a file, directory or link, a link without a target of 1 to
 * CKPT_LINK_TARGET_MAX bytes, a directory with a target, a target holding
 * NUL), -E2BIG / -ENOSPC (extended attributes past the bounds above, or a
 * name outside user.* or inside user.ckpt.*, or unsorted: -EINVAL). */
int ckpt_entry_attr_check(const ckpt_entry_attr_t *e);
/* Is name one an entry's kept extended attribute may have? */
bool ckpt_xattr_name_ok(const char *name, size_t len);

/* The local plan of one rank: every staged item, plus the problems the
 * rank found while building it (e.g. a missing required xattr). */
typedef struct {
  int32_t rank;
  uint32_t n_items;
  uint32_t cap_items;
  ckpt_write_item_t *items; /* owned */
  char *errors;             /* owned, NULL or newline-separated reasons */
  bool direct;              /* the rank's commit words ask its tier to be
                               bypassed (level=shared): every rank of a
                               save must agree */
  /* Write-behind: reserved[K] = bytes at the start of this rank's data file
   * K that the rank has already written (its pinned items live there, the
   * rest of that range is dead space that must not be overwritten). Files
   * K >= n_reserved have nothing reserved. */
  uint32_t n_reserved;
  uint64_t *reserved;       /* owned, n_reserved entries */
  uint32_t n_attrs;         /* its staged files' and directories' */
  uint32_t cap_attrs;
  ckpt_entry_attr_t *attrs; /* owned */
} ckpt_local_plan_t;

void ckpt_local_plan_init(ckpt_local_plan_t *lp, int32_t rank);
void ckpt_local_plan_free(ckpt_local_plan_t *lp);
/* Append a tensor chunk; shape/offsets/sizes are copied. offsets NULL means
 * all zeros, sizes NULL means the shape. Does not validate (the global plan
 * does, so that every problem of every rank is reported together), but for
 * ndim outside 0..CKPT_MAX_NDIM: -EINVAL. */
int ckpt_local_plan_add_tensor(ckpt_local_plan_t *lp, const char *path,
                               ckpt_dtype_t dtype, int ndim,
                               const int64_t *shape, const int64_t *offsets,
                               const int64_t *sizes, uint64_t length,
                               uint64_t checksum, uint32_t local_id);
int ckpt_local_plan_add_bytes(ckpt_local_plan_t *lp, const char *path,
                              uint64_t length, uint64_t checksum,
                              uint32_t local_id);
/* Give item lp->items[index] an explicit FQN (the user.ckpt.fqn xattr):
 * it replaces the one derived from the path, and marks the item
 * fqn_explicit. -EINVAL for an index out of range or a FQN that is not
 * ckpt_fqn_valid, -ENOMEM. */
int ckpt_local_plan_set_fqn(ckpt_local_plan_t *lp, uint32_t index,
                            const char *fqn, size_t len);
/* Pin item lp->items[index]: its bytes are already stored in this rank's
 * data file `file` at `offset` (file CKPT_NO_PIN unpins it). -EINVAL if
 * index is out of range. Not validated here (the global plan does). */
int ckpt_local_plan_pin(ckpt_local_plan_t *lp, uint32_t index, uint32_t file,
                        uint64_t offset);
/* Set reserved[file] = bytes (growing reserved as needed, new entries 0).
 * -EINVAL for file == CKPT_NO_PIN, -ENOMEM. */
int ckpt_local_plan_reserve(ckpt_local_plan_t *lp, uint32_t file,
                            uint64_t bytes);
/* Record what a staged file, directory or link is (a deep copy of e),
 * after ckpt_entry_attr_check: its error, or -ENOMEM. */
int ckpt_local_plan_add_entry(ckpt_local_plan_t *lp,
                              const ckpt_entry_attr_t *e);
/* The same for a file or directory with no target or xattrs. */
int ckpt_local_plan_add_attr(ckpt_local_plan_t *lp, const char *path,
                             uint32_t mode, uint32_t uid, uint32_t gid,
                             int64_t mtime_ns);
/* Record a problem found locally (appended to lp->errors). */
int ckpt_local_plan_add_error(ckpt_local_plan_t *lp, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* What one rank must write: item local_id goes to data file K at offset. */
typedef struct {
  uint32_t local_id;
  uint32_t file;        /* K in __R_K.distcp */
  uint64_t file_offset; /* where the item's bytes start in that file */
  uint64_t length;
} ckpt_assignment_t;

/* A save's id: 32 lowercase hex digits (the metadata's save_id). */
#define CKPT_SAVE_ID_LEN 32
bool ckpt_save_id_valid(const char *id);

typedef struct {
  int32_t rank;
  char save_id[CKPT_SAVE_ID_LEN + 1]; /* the save this plan belongs to
                                         ("" until the coordinator sets
                                         it; last in the message) */
  uint32_t n_files;      /* files K = 0 .. n_files-1 */
  uint64_t *file_bytes;  /* owned, n_files: final size of each file */
  uint32_t n_assign;
  ckpt_assignment_t *assign; /* owned, grouped by file, by file_offset */
} ckpt_rank_plan_t;

void ckpt_rank_plan_free(ckpt_rank_plan_t *rp);

/* ------------------------------------------------------------------------
 * Checkpoint metadata: the in-memory form of the SQLite .metadata.
 * ---------------------------------------------------------------------- */
typedef struct {
  char *fqn;          /* owned */
  char *path;         /* owned */
  ckpt_dtype_t dtype;
  int ndim;
  int64_t *shape;     /* owned, ndim */
  uint32_t first_chunk; /* chunks[first_chunk .. first_chunk+n_chunks-1] */
  uint32_t n_chunks;
} ckpt_tensor_meta_t;

typedef struct {
  uint32_t tensor;      /* index into tensors */
  int64_t *dims;        /* owned, 2*ndim of the tensor: offsets then sizes */
  int32_t rank;         /* rank that stored it */
  uint32_t file;        /* K: stored in __rank_K.distcp */
  uint64_t file_offset;
  uint64_t length;
  uint64_t checksum;    /* XXH3-64 of the stored bytes */
} ckpt_chunk_meta_t;

typedef struct {
  char *fqn;  /* owned */
  char *path; /* owned */
  int32_t rank;
  uint32_t file;
  uint64_t file_offset;
  uint64_t length;
  uint64_t checksum;
} ckpt_blob_meta_t;

typedef struct {
  char *name;          /* owned: checkpoint name */
  char *save_id;       /* owned: unique id of this save (hex) */
  int32_t world_size;
  int64_t created_at;  /* seconds since the epoch, UTC */
  uint32_t n_tensors;
  ckpt_tensor_meta_t *tensors; /* owned, sorted by fqn */
  uint32_t n_chunks;
  ckpt_chunk_meta_t *chunks;   /* owned, grouped by tensor, each group
                                  sorted by offsets (row-major order) */
  uint32_t n_blobs;
  ckpt_blob_meta_t *blobs;     /* owned, sorted by fqn */
  uint32_t n_entries;
  ckpt_entry_attr_t *entries;  /* owned, sorted by path (strcmp), unique:
                                  what the staged files and directories
                                  were (empty for a checkpoint saved
                                  before this was kept) */
  /* Retention, recorded at commit (commit words; absent in checkpoints
   * saved before they were kept): */
  bool has_step;               /* step=N was given */
  int64_t step;
  bool protect;                /* protect was given */
  uint32_t n_metrics;
  ckpt_metric_t *metrics;      /* owned, sorted by key, unique */
  /* A commit into a node-local tier (-o tier): the saves of NAME it
   * replaced, space-separated save keys, "none" for no checkpoint of that
   * name, "earlier" (replace=) for any save of NAME committed before it
   * (commit_ns); its flush publishes it on BACKING_DIR only while NAME
   * there is one of them (fs/read/resolve.c). NULL: not recorded (no tier).
   * Owned. */
  char *replaces;
  /* The commit point's wall-clock time (ns since the epoch, the
   * coordinator's clock): which of two saves of NAME is later. 0: not
   * recorded (an older ckptfs: created_at then, to the second). */
  int64_t commit_ns;
} ckpt_metadata_t;
/* Record the retention words of w (step, protect, metrics) in m.
 * 0 or -ENOMEM. */
int ckpt_metadata_set_retention(ckpt_metadata_t *m,
                                const ckpt_commit_words_t *w);
/* The value of metric key in m: true and *v, or false. */
bool ckpt_metadata_metric(const ckpt_metadata_t *m, const char *key,
                          double *v);

/* The entry of path in m->entries, or NULL. */
const ckpt_entry_attr_t *ckpt_metadata_entry(const ckpt_metadata_t *m,
                                             const char *path);
/* Sort entries by path and merge duplicates (the same path staged on
 * several ranks): the permission bits all of them allow, the owner, link
 * target and extended attributes of the first, the latest time. Entries
 * whose types differ keep the first. Frees what it merges away. */
void ckpt_entries_merge(ckpt_entry_attr_t *e, uint32_t *n);

void ckpt_metadata_free(ckpt_metadata_t *m);

/* Do n boxes cover a tensor of shape[ndim] exactly? box[i] points to the
 * ndim offsets, then the ndim sizes of box i (ckpt_chunk_meta_t.dims).
 * Empty boxes occupy nothing. res says: exact, the first overlap found
 * (boxes a and b), or a gap (gap_off/gap_size when gap_known) with
 * covered elements. Returns 0, -EINVAL (a box outside the shape), -ENOMEM,
 * or -E2BIG: a layout so irregular that checking it would take more than
 * CKPT_COVER_BUDGET comparisons (only hostile input comes close). */
#define CKPT_COVER_BUDGET ((uint64_t)200 * 1000 * 1000)
typedef enum {
  CKPT_COVER_EXACT = 0,
  CKPT_COVER_OVERLAP,
  CKPT_COVER_GAP,
} ckpt_cover_kind_t;
typedef struct {
  ckpt_cover_kind_t kind;
  size_t a, b;        /* OVERLAP: indexes of two boxes that meet */
  uint64_t covered;   /* elements of the non-empty boxes, summed */
  bool gap_known;
  int64_t gap_off[CKPT_MAX_NDIM], gap_size[CKPT_MAX_NDIM];
} ckpt_cover_t;
int ckpt_cover_check(int ndim, const int64_t *shape, size_t n,
                     const int64_t *const *box, ckpt_cover_t *res);
/* The same with another budget of comparisons (tests). */
int ckpt_cover_check_budget(int ndim, const int64_t *shape, size_t n,
                            const int64_t *const *box, uint64_t budget,
                            ckpt_cover_t *res);

/* ------------------------------------------------------------------------
 * The global plan (coordinator).
 * ---------------------------------------------------------------------- */
typedef enum {
  CKPT_REPLICA_ERROR = 0, /* differing replicas fail the commit */
  CKPT_REPLICA_WARN,      /* they are reported as warnings, one is kept */
  CKPT_REPLICA_OFF,       /* not compared */
} ckpt_replica_check_t;

typedef struct {
  uint32_t io_threads;           /* data files per rank, >= 1 */
  ckpt_replica_check_t replica_check;
} ckpt_plan_opts_t;

typedef struct {
  int32_t world_size;
  ckpt_rank_plan_t *ranks; /* owned, world_size entries, rank order */
  ckpt_metadata_t meta;    /* name/save_id/created_at left for the caller */
  char *errors;   /* owned: NULL if the plan is valid, else the reasons,
                     one per line, naming fqn, path, ranks and numbers */
  char *warnings; /* owned: NULL or one per line (replica_check=warn) */
} ckpt_global_plan_t;

/*
 * Build the global plan from every rank's local plan (locals[r].rank == r):
 *  1. errors reported by the ranks themselves are collected;
 *  2. write-behind, per rank: every reservation lies in a file
 *     K < CKPT_MAX_PIN_FILE (a zero one anywhere is no reservation); every
 *     pin lies in a file K < CKPT_MAX_PIN_FILE, inside reserved[K]
 *     (pin_offset + length <= reserved[K]); a rank's pins do not overlap
 *     (a zero-length pin strictly inside another one overlaps it);
 *  3. items are grouped by FQN; a FQN is either bytes or tensor everywhere,
 *     has one dtype and one shape. Paths: when some item of the FQN has
 *     no explicit FQN (fqn_explicit), all its items must have one path;
 *     when all have an explicit one, paths may differ (so several chunks
 *     of one FQN on one rank, which a mount stages as several files, need
 *     an explicit FQN each). One rank holds at most one bytes item of a
 *     FQN, and a chunk (offsets and sizes) at most once. The FQN's
 *     committed path (meta's
 *     path) is, for a tensor, that of the chunk with the smallest offsets
 *     (lexicographic; ties: lowest rank, then path by strcmp); for a
 *     bytes item, that of its lowest rank. Committed paths must not
 *     clash: two FQNs at one path, or a path that is also a directory of
 *     another one, is an error;
 *  4. each chunk: length == prod(sizes) x itemsize, inside the shape;
 *  5. identical chunks (same FQN, offsets and sizes) on several ranks are
 *     replicas: their checksums are compared (replica_check) and one copy
 *     is kept. If some holders have it pinned (its bytes already written),
 *     the copy kept is one of theirs, of the pinned holder with the least
 *     bytes so far; otherwise of the holder with the least bytes so far
 *     (greedy, largest first, after every rank's unique items are counted;
 *     ties: lowest rank);
 *  6. the kept chunks of each tensor must not overlap and must cover it
 *     exactly (O(n log n) in the number of chunks);
 *  7. each rank's kept items are assigned to its data files. Kept pinned
 *     items stay at (pin_file, pin_offset). The others are balanced by
 *     bytes over the io_threads files (largest first into the least full
 *     file; a file's load starts at its reservation) and appended in FQN
 *     order after reserved[K], items of 64 KiB or more at multiples of
 *     4096. n_files is 1 + the last file holding an item or a reservation
 *     (files in between may be empty); file_bytes[K] is the larger of
 *     reserved[K] and the end of its last item. A pinned item that dedup
 *     dropped is not assigned: its bytes stay in the file as dead space.
 *     Without reservations and pins, the files used are 0..n_files-1 and
 *     each ends with its last item;
 *  8. meta lists every tensor with its chunks and every blob, at the file
 *     and offset of their assignment.
 * Returns 0 when a plan was computed (check out->errors), -ENOMEM or
 * -EINVAL for unusable arguments. errors and warnings hold lines separated
 * by '\n' (no trailing one): the ranks' own errors, then the write-behind
 * problems in rank order, then the rest in FQN order, at most 50 and then
 * "... and N more problems". When errors is set, ranks holds world_size
 * empty plans and meta is empty but for world_size.
 */
int ckpt_plan_global(const ckpt_local_plan_t *locals, int32_t n,
                     const ckpt_plan_opts_t *opts, ckpt_global_plan_t *out);
void ckpt_global_plan_free(ckpt_global_plan_t *gp);

/* ------------------------------------------------------------------------
 * Reading a byte range of a stored tensor: chunk geometry.
 * ---------------------------------------------------------------------- */
/* One copy: `len` bytes from chunk-local byte offset `src` to byte `dst` of
 * the global tensor. */
typedef struct {
  uint64_t src;
  uint64_t dst;
  uint64_t len;
} ckpt_piece_t;

/* Byte extent [*first, *end) of the global tensor that the chunk touches
 * (end == first when the chunk is empty). */
void ckpt_layout_extent(int ndim, const int64_t *shape, const int64_t *offsets,
                        const int64_t *sizes, size_t itemsize, uint64_t *first,
                        uint64_t *end);

/* Enumerate, in increasing dst order, the pieces of the chunk that fall in
 * the global byte range [off, off+len). Adjacent pieces that are contiguous
 * in both src and dst are merged. cb returning non-zero stops the walk and
 * that value is returned. Runs in O(ndim * log(runs) + pieces). */
int ckpt_layout_pieces(int ndim, const int64_t *shape, const int64_t *offsets,
                       const int64_t *sizes, size_t itemsize, uint64_t off,
                       uint64_t len,
                       int (*cb)(void *arg, const ckpt_piece_t *p), void *arg);

/* The chunk bytes [*src_first, *src_end) that the global byte range
 * [off, off+len) needs (one contiguous range: the pieces are in chunk
 * order too); *src_first == *src_end when the chunk holds none of it. */
void ckpt_layout_span(int ndim, const int64_t *shape, const int64_t *offsets,
                      const int64_t *sizes, size_t itemsize, uint64_t off,
                      uint64_t len, uint64_t *src_first, uint64_t *src_end);

/* Copy the chunk's part of [off, off+len) from src, which holds chunk
 * bytes from src_base on (at least the span above), to out, which holds
 * the global range from byte off on. */
void ckpt_layout_copy(int ndim, const int64_t *shape, const int64_t *offsets,
                      const int64_t *sizes, size_t itemsize, uint64_t off,
                      uint64_t len, const uint8_t *src, uint64_t src_base,
                      uint8_t *out);

/* The inverse walk: enumerate, in increasing src order, the pieces of
 * bytes [off, off+len) of the chunk's own row-major contents (src: byte
 * offset in the chunk's contents, dst: where those bytes are in the global
 * tensor). A block file's contents are such a box: its pieces are the
 * contiguous global runs a read of it needs. One piece per run touched
 * (consecutive runs are never adjacent globally); O(ndim + pieces). */
int ckpt_layout_local_pieces(int ndim, const int64_t *shape,
                             const int64_t *offsets, const int64_t *sizes,
                             size_t itemsize, uint64_t off, uint64_t len,
                             int (*cb)(void *arg, const ckpt_piece_t *p),
                             void *arg);

/* ------------------------------------------------------------------------
 * Block file names (block.c): ".N[a0:b0,a1:b1,...]" names the block
 * [a0:b0) x [a1:b1) x ... of tensor file N in the same directory.
 * ---------------------------------------------------------------------- */
/* Split a block file name: 0 with *base (N, not NUL-terminated), *base_len
 * and *slices (the text from the last '[' to the closing ']' inclusive),
 * or -EINVAL when name is not of the form ".N[...]" with N non-empty. */
int ckpt_block_name_split(const char *name, const char **base,
                          size_t *base_len, const char **slices);
/* Parse slices "[a0:b0,a1:b1,...]" (len bytes, brackets included) against
 * a tensor of ndim >= 1 dimensions of the given shape: Python slice syntax
 * without steps, decimal digits only, no spaces; an empty start is 0, an
 * empty stop is the dimension's size; 1..ndim slices, the dimensions not
 * sliced are whole. Fills lo[ndim] and sizes[ndim]. 0; -EINVAL when
 * malformed (also for ndim 0); -ERANGE when a bound is outside
 * 0 <= a <= b <= dim. */
int ckpt_block_parse(const char *s, size_t len, int ndim,
                     const int64_t *shape, int64_t *lo, int64_t *sizes);

/* ------------------------------------------------------------------------
 * Binary messages between ranks. Compact, little-endian, versioned, one
 * per rank per protocol step. Decoders validate every length and count
 * against the buffer and return -EINVAL on any malformed input. Encoders
 * append to out. A decoded item's fqn is its explicit one if it had one
 * (fqn_explicit), else derived from its path.
 * ---------------------------------------------------------------------- */
int ckpt_msg_encode_local_plan(const ckpt_local_plan_t *lp, ckpt_buf_t *out);
int ckpt_msg_decode_local_plan(const void *p, size_t n, ckpt_local_plan_t *lp);
int ckpt_msg_encode_rank_plan(const ckpt_rank_plan_t *rp, ckpt_buf_t *out);
int ckpt_msg_decode_rank_plan(const void *p, size_t n, ckpt_rank_plan_t *rp);

/* What a rank reports after writing its data files. */
typedef struct {
  int32_t rank;
  uint64_t bytes_written;
  char *error; /* owned, NULL on success */
} ckpt_write_result_t;

void ckpt_write_result_free(ckpt_write_result_t *wr);
int ckpt_msg_encode_write_result(const ckpt_write_result_t *wr,
                                 ckpt_buf_t *out);
int ckpt_msg_decode_write_result(const void *p, size_t n,
                                 ckpt_write_result_t *wr);

/* File formats of other tools (safetensors, .npy): ckpt_views.h. */
#include "ckpt_views.h"

#endif /* CKPT_PLANNER_H */
