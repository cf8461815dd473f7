/*
 * ops_int.h - private to fs/ops: what its request families share.
 */
#ifndef CKPT_FS_OPS_INT_H
#define CKPT_FS_OPS_INT_H

#include "ops.h"

#define COMMITTED_TIMEOUT 1.0 /* seconds the kernel may cache committed
                                 entries and attributes */

/* What an open file or directory handle holds (fi->fh). Every handle is
 * on fs->handles until its release, so that the ones the kernel never
 * released (the mount ended first) are freed at exit. */
typedef struct ckpt_handle {
  ckpt_node_t *node; /* referenced */
  int fd;            /* METADATA: the backing .metadata, else -1 */
  char *text;        /* STATUS text, or the readdir buffer */
  size_t len;
  bool writer;       /* a staged file opened for writing */
  bool pt;           /* a staged file passed through (sf->pt_opens) */
  bool pt_writer;    /* ... open for writing (sf->pt_wopens) */
  bool cpt;          /* committed item read by passthrough (node->cpt) */
  _Atomic uint64_t advised; /* committed node: readahead asked up to here */
  ckpt_fdref_t *pins;  /* committed item: its data files, held open */
  uint32_t npins;
  struct ckpt_handle *prev, *next; /* fs->handles; fs->lock */
} handle_t;

/* The longest path inside a checkpoint ("model/layer0/weight"), as the
 * longest path Linux takes: it bounds the depth of a staged tree (walked
 * recursively at commit) and the length of an FQN. */
#define CKPT_PATH_MAX 4095

/* Where BACKING_DIR/NAME stands, looked up before fs->lock is taken (no
 * system call under it). */
typedef ckpt_presence_t presence_t;

/* kinds.c: what each kind of node does for the I/O requests (NULL: not
 * that request's; the callbacks answer for it). */
typedef struct {
  bool committed;      /* read-only, cached by the kernel */
  /* Serve a read of handle h (replies to req). */
  void (*read)(fuse_req_t req, handle_t *h, size_t size, uint64_t off);
  /* SEEK_DATA or SEEK_HOLE from off: the offset or -errno. */
  int64_t (*seek)(ckpt_node_t *n, uint64_t off, int whence);
  /* st_size, and times that differ from the node's. fs->lock held. */
  void (*attr)(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st);
  /* Bytes the contents take (st_blocks); NULL: its size. fs->lock held. */
  uint64_t (*allocated)(ckpt_fs_t *fs, ckpt_node_t *n);
} ckpt_op_kind_t;
const ckpt_op_kind_t *ckpt__op_kind(const ckpt_node_t *n);

/* common.c */
bool ckpt__op_writes_direct(const ckpt_node_t *n,
                          const struct fuse_file_info *fi);
void ckpt__op_reply_copy(fuse_req_t req, const char *p, size_t n);
void ckpt__op_fill_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st);
void ckpt__op_fill_entry(ckpt_fs_t *fs, ckpt_node_t *n, struct fuse_entry_param *e);
void ckpt__op_free_handle(handle_t *h);
ckpt_fs_t *ckpt__op_fs_of(fuse_req_t req);
ckpt_node_t *ckpt__op_get_node(ckpt_fs_t *fs, fuse_ino_t ino);
ckpt_node_t *ckpt__op_get_node_any(ckpt_fs_t *fs, fuse_ino_t ino);
handle_t *ckpt__op_handle_of(struct fuse_file_info *fi);
bool ckpt__op_has_suidgid(mode_t m);
bool ckpt__op_is_committed_kind(ckpt_node_kind_t k);
void ckpt__op_kill_suidgid(ckpt_node_t *n);
bool ckpt__op_lacks_fsetid(fuse_req_t req);
void ckpt__op_log_text(char *out, size_t cap, const char *p, size_t n);
bool ckpt__op_may_change(fuse_req_t req);
bool ckpt__op_may_write_node(const struct fuse_ctx *ctx, const ckpt_node_t *n);
bool ckpt__op_may_search_node(const struct fuse_ctx *ctx, const ckpt_node_t *n);
handle_t *ckpt__op_new_handle(ckpt_node_t *n);
size_t ckpt__op_new_path_len(const ckpt_node_t *p, const char *name);
ckpt_node_t *ckpt__op_node_of(ckpt_fs_t *fs, fuse_ino_t ino,
                            struct fuse_file_info *fi);
double ckpt__op_node_timeout(const ckpt_node_t *n);
int ckpt__op_open_metadata(ckpt_fs_t *fs, ckpt_ckpt_t *ck);
void ckpt__op_put_node(ckpt_fs_t *fs, ckpt_node_t *n);
void ckpt__op_put_pins(handle_t *h);
int ckpt__op_staged_change_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck);
void ckpt__op_staged_change_end(ckpt_ckpt_t *ck);
int ckpt__op_staged_writable(const ckpt_ckpt_t *ck);
size_t ckpt__op_subtree_path_len(const ckpt_node_t *dir);
void ckpt__op_touch_data(ckpt_fs_t *fs, ckpt_node_t *n);
void ckpt__op_track_handle(ckpt_fs_t *fs, handle_t *h);
void ckpt__op_untrack_handle(ckpt_fs_t *fs, handle_t *h);
void ckpt__op_write_kills_suidgid(ckpt_fs_t *fs, fuse_req_t req, ckpt_node_t *n);

/* status.c */
char *ckpt__op_status_text(ckpt_fs_t *fs, const ckpt_ckpt_t *ck);

/* lookup.c */
void ckpt__op_access(fuse_req_t req, fuse_ino_t ino, int mask);
void ckpt__op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup);
void ckpt__op_forget_multi(fuse_req_t req, size_t count,
                            struct fuse_forget_data *forgets);
void ckpt__op_getattr(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi);
void ckpt__op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name);
void ckpt__op_opendir(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi);
void ckpt__op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi);
void ckpt__op_statfs(fuse_req_t req, fuse_ino_t ino);
presence_t ckpt__op_presence(ckpt_fs_t *fs, const char *name);
bool ckpt__op_still_stored(ckpt_fs_t *fs, ckpt_node_t *dir,
                         const presence_t *pr);

/* entries.c */
bool ckpt__op_being_replaced(ckpt_fs_t *fs, const char *name);
int ckpt__op_check_name(const ckpt_node_t *p, const char *name);
/* user.ckpt.mkdirs on staged directory dir (entries.c). 0 or -errno. */
int ckpt__op_mkdirs(ckpt_fs_t *fs, ckpt_node_t *dir, const char *value,
                    size_t size, const struct fuse_ctx *ctx);
void ckpt__op_create(fuse_req_t req, fuse_ino_t parent, const char *name,
                      mode_t mode, struct fuse_file_info *fi);
void ckpt__op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode,
                         off_t offset, off_t length,
                         struct fuse_file_info *fi);
void ckpt__op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent,
                    const char *newname);
void ckpt__op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name,
                     mode_t mode);
void ckpt__op_mknod(fuse_req_t req, fuse_ino_t parent, const char *name,
                     mode_t mode, dev_t rdev);
void ckpt__op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr,
                       int to_set, struct fuse_file_info *fi);
void ckpt__op_symlink(fuse_req_t req, const char *link, fuse_ino_t parent,
                       const char *name);
void ckpt__op_readlink(fuse_req_t req, fuse_ino_t ino);

/* remove.c */
void ckpt__op_rename(fuse_req_t req, fuse_ino_t parent, const char *name,
                      fuse_ino_t newparent, const char *newname,
                      unsigned int flags);
void ckpt__op_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name);
void ckpt__op_unlink(fuse_req_t req, fuse_ino_t parent, const char *name);
bool ckpt__op_unflushed(ckpt_ckpt_t *ck);

/* io.c */
void ckpt__op_read_staged(fuse_req_t req, handle_t *h, size_t size,
                          uint64_t off);
void ckpt__op_read_committed(fuse_req_t req, handle_t *h, size_t size,
                             uint64_t off);
void ckpt__op_read_metadata(fuse_req_t req, handle_t *h, size_t size,
                            uint64_t off);
void ckpt__op_read_status(fuse_req_t req, handle_t *h, size_t size,
                          uint64_t off);
void ckpt__op_read_view(fuse_req_t req, handle_t *h, size_t size,
                        uint64_t off);
void ckpt__op_read_block(fuse_req_t req, handle_t *h, size_t size,
                         uint64_t off);
int64_t ckpt__op_seek_staged(ckpt_node_t *n, uint64_t off, int whence);
int64_t ckpt__op_seek_committed(ckpt_node_t *n, uint64_t off, int whence);
void ckpt__op_lseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence,
                    struct fuse_file_info *fi);
void ckpt__op_drop_handle(fuse_req_t req, handle_t *h);
void ckpt__op_flush(fuse_req_t req, fuse_ino_t ino,
                     struct fuse_file_info *fi);
void ckpt__op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void ckpt__op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi);
void ckpt__op_release(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi);
void ckpt__op_releasedir(fuse_req_t req, fuse_ino_t ino,
                          struct fuse_file_info *fi);
void ckpt__op_write(fuse_req_t req, fuse_ino_t ino, const char *buf,
                     size_t size, off_t off, struct fuse_file_info *fi);
int ckpt__op_pt_open(fuse_req_t req, ckpt_node_t *n, handle_t *h,
                   struct fuse_file_info *fi, bool start);

/* xattr.c */
void ckpt__op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                        size_t size);
void ckpt__op_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size);
void ckpt__op_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name);
void ckpt__op_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                        const char *value, size_t size, int flags);

/* ops.c */
void ckpt__op_init(void *userdata, struct fuse_conn_info *conn);

#endif /* CKPT_FS_OPS_INT_H */
