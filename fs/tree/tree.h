/*
 * tree.h - fs/tree: the nodes of one rank mount (one per inode), its
 * checkpoints, the inode table and fs->lock. Below it only fs/core.
 *
 * A mount is a tree of nodes: the root, one directory per checkpoint, and
 * below each checkpoint either its staged files (this rank's writes) or
 * its committed view (built from the SQLite metadata). Inode numbers are
 * never reused, so a stale one from the kernel finds nothing (ESTALE)
 * instead of a different file.
 *
 * Checkpoint states and the functions behind each transition:
 *
 *   (none)      -> STAGING     mkdir NAME               [ops: fs_mkdir]
 *   STAGING     -> COMMITTING  write NAME/.commit       [ckpt__save_begin]
 *   FAILED      -> COMMITTING  write NAME/.commit       [ckpt__save_begin]
 *   COMMITTING  -> COMMITTED   the save succeeded       [commit: save_done]
 *   COMMITTING  -> FAILED      the save failed anywhere [commit: save_done]
 *   (backing)   -> COMMITTED   found at mount           [ckpt__fs_load]
 *   any but COMMITTING -> (none)  rmdir NAME            [ops: fs_rmdir]
 */
#ifndef CKPT_FS_TREE_H
#define CKPT_FS_TREE_H

#include "fs.h"

typedef struct ckpt_sfile ckpt_sfile_t;
typedef struct ckpt_streams ckpt_streams_t;

/* ------------------------------------------------------------------------
 * Nodes and checkpoints (nodes.c): fs->lock held for every call.
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
  CKPT_NODE_SLINK,    /* staged symbolic link */
  CKPT_NODE_CLINK,    /* committed symbolic link */
} ckpt_node_kind_t;

/* Extended attributes other than ckptfs's own (user.* but user.ckpt.*)
 * of a staged entry, sorted by name (xlist.c). */
typedef struct {
  uint32_t n;
  ckpt_xattr_t *v;
} ckpt_xlist_t;

typedef enum {
  CKPT_STAGING,
  CKPT_COMMITTING,
  CKPT_COMMITTED,
  CKPT_FAILED,
} ckpt_state_t;


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
  uint64_t allocated;     /* CTENSOR, CBLOB: bytes its data takes in the
                             data files, plus 1 (0: not looked at yet);
                             fs->lock */
  struct ckpt_node_pt *cpt; /* CTENSOR, CBLOB read by passthrough: the one
                             backing file all its open handles share (the
                             kernel allows one per inode), or NULL;
                             fs->lock */
  ckpt_xlist_t xl;        /* SDIR, CKPT while staged: its other xattrs
                             (a file's are its sf's); fs->lock */
  uint64_t st_ino;        /* committed file with hard links: the inode
                             number all its names show (0: its own) */
  uint32_t st_nlink;      /* ... and their count (0: one) */
  uint32_t entry;         /* committed kinds: 1 + the index of the entries
                             row (ck->meta) of what it was, or 0 */
  union {
    char *target;         /* SLINK: what the link holds (owned) */
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

#define CKPT_NODE_KINDS ((size_t)CKPT_NODE_CLINK + 1)

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

/* The item a committed tensor or blob node reads. */
static inline ckpt_item_t ckpt__node_item(const ckpt_node_t *n) {
  ckpt_item_t it = {n->kind == CKPT_NODE_CBLOB,
                    n->kind == CKPT_NODE_CBLOB ? n->u.blob : n->u.tensor};
  return it;
}

/* Views are generated files and directories (read/views.c). */
static inline bool ckpt__is_view_kind(ckpt_node_kind_t k) {
  return k >= CKPT_NODE_VROOT && k <= CKPT_NODE_VINDEX;
}

/* What the layers above hang on nodes and checkpoints is freed through
 * the tables they set before the first node (ckpt__stage_register,
 * ckpt__read_register): the tree calls nothing above itself. */
typedef struct {
  void (*free_node)(ckpt_node_t *n); /* n->u's payload, at the last unref */
} ckpt_kind_ops_t;
void ckpt__tree_set_kind(ckpt_node_kind_t kind, const ckpt_kind_ops_t *ops);

/* ------------------------------------------------------------------------
 * Extended attributes (xlist.c): the caller holds the lock that protects
 * the list. Names must pass ckpt_xattr_name_ok.
 * ---------------------------------------------------------------------- */
/* Set name to len bytes of val: XATTR_CREATE / XATTR_REPLACE as
 * setxattr(2) (-EEXIST, -ENODATA); -E2BIG, -ENOSPC past the bounds
 * (ckpt_planner.h); 0 or -ENOMEM. */
int ckpt__xlist_set(ckpt_xlist_t *l, const char *name, const void *val,
                    size_t len, int flags);
int ckpt__xlist_remove(ckpt_xlist_t *l, const char *name);
void ckpt__xlist_free(ckpt_xlist_t *l);
/* A copy of l's attributes into e (e->n_xattrs, e->xattrs): 0, -ENOMEM. */
int ckpt__xlist_copy_out(const ckpt_xlist_t *l, ckpt_entry_attr_t *e);
/* getxattr of name in v[n]: its length (size 0), or copied into buf of
 * size bytes; -ENODATA, -ERANGE. */
int ckpt__xattrs_get(const ckpt_xattr_t *v, uint32_t n, const char *name,
                     void *buf, size_t size);
/* The names of v[n], each with its NUL, appended to b: 0 or -ENOMEM. */
int ckpt__xattrs_names(const ckpt_xattr_t *v, uint32_t n, ckpt_buf_t *b);
/* fn(ck) at a checkpoint's last reference (at most 4). */
void ckpt__tree_on_release(void (*fn)(ckpt_ckpt_t *ck));
/* The root and the inode table (fs->opts set); fs->lock initialized. */
int ckpt__tree_init(ckpt_fs_t *fs);
/* Every checkpoint detached first. */
void ckpt__tree_destroy(ckpt_fs_t *fs);

#endif /* CKPT_FS_TREE_H */
