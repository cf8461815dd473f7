/*
 * ops.c - the FUSE low-level operations of a rank mount: the table, and
 * the session's init.
 *
 * Every callback resolves its inode under fs->lock, takes a reference,
 * and does the slow part (copying data, reading backing files) without
 * the lock. Replies use positive errno. Staged nodes are never cached by
 * the kernel (timeouts 0), since a commit replaces them by the committed
 * view; committed nodes are immutable and cached.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "catalog.h"
#include "metadb.h"
#include "ops_int.h"

void ckpt__op_init(void *userdata, struct fuse_conn_info *conn) {
  ckpt_fs_t *fs = userdata;
  /* Large requests: 1 MiB writes, ~1 MiB reads, and enough readahead requests
   * in flight for the loop's threads to serve a sequential load in
   * parallel (main.c raises the readahead window itself). */
  conn->max_write = (unsigned)CKPT_SEG_SIZE;
  conn->max_read = (unsigned)CKPT_MAX_READ; /* as main.c's max_read= */
  conn->max_background = 32;
  conn->congestion_threshold = 24;
  if (conn->capable & FUSE_CAP_ASYNC_READ)
    conn->want |= FUSE_CAP_ASYNC_READ;
  if (conn->capable & FUSE_CAP_ATOMIC_O_TRUNC)
    conn->want |= FUSE_CAP_ATOMIC_O_TRUNC;
  /* Replies of committed data may be spliced from the data files. */
  if (conn->capable & FUSE_CAP_SPLICE_WRITE)
    conn->want |= FUSE_CAP_SPLICE_WRITE;
#ifdef FUSE_CAP_DIRECT_IO_ALLOW_MMAP
  /* libfuse 3.16+: shared read-only mmap of direct_reads files (np.memmap
   * mode "r"); older ones refuse it (ENODEV), private mmap works. */
  if (conn->capable & FUSE_CAP_DIRECT_IO_ALLOW_MMAP)
    conn->want |= FUSE_CAP_DIRECT_IO_ALLOW_MMAP;
#endif
#ifdef FUSE_CAP_PASSTHROUGH
  /* libfuse 3.16+, kernel 6.9+ and CAP_SYS_ADMIN: staged files written
   * once, straight into their data files (staging.c). By default only
   * where it can work: a daemon without root would be refused at its
   * first file. */
  bool can = geteuid() == 0 || fs->opts.passthrough_set;
  if (fs->opts.passthrough && can &&
      (conn->capable & FUSE_CAP_PASSTHROUGH)) {
    conn->want |= FUSE_CAP_PASSTHROUGH;
    fs->passthrough = true;
#ifdef FUSE_CAP_HANDLE_KILLPRIV_V2
    if (conn->capable & FUSE_CAP_HANDLE_KILLPRIV_V2)
      conn->want |= FUSE_CAP_HANDLE_KILLPRIV_V2;
#endif
  }
#endif
  if (fs->opts.passthrough && !fs->passthrough)
    ckpt__log("passthrough: FUSE passthrough is not available (libfuse %s "
              "needs >= 3.16, a kernel >= 6.9 and root): staged files go "
              "through the daemon, copied once more", fuse_pkgversion());
}

const struct fuse_lowlevel_ops ckpt__fuse_ops = {
    .init = ckpt__op_init,
    .lookup = ckpt__op_lookup,
    .forget = ckpt__op_forget,
    .forget_multi = ckpt__op_forget_multi,
    .getattr = ckpt__op_getattr,
    .setattr = ckpt__op_setattr,
    .mkdir = ckpt__op_mkdir,
    .create = ckpt__op_create,
    .unlink = ckpt__op_unlink,
    .rmdir = ckpt__op_rmdir,
    .rename = ckpt__op_rename,
    .open = ckpt__op_open,
    .flush = ckpt__op_flush,
    .release = ckpt__op_release,
    .read = ckpt__op_read,
    .write = ckpt__op_write,
    .fallocate = ckpt__op_fallocate,
    .symlink = ckpt__op_symlink,
    .readlink = ckpt__op_readlink,
    .link = ckpt__op_link,
    .mknod = ckpt__op_mknod,
    .opendir = ckpt__op_opendir,
    .readdir = ckpt__op_readdir,
    .releasedir = ckpt__op_releasedir,
    .setxattr = ckpt__op_setxattr,
    .getxattr = ckpt__op_getxattr,
    .listxattr = ckpt__op_listxattr,
    .removexattr = ckpt__op_removexattr,
    .statfs = ckpt__op_statfs,
    .access = ckpt__op_access,
    .lseek = ckpt__op_lseek,
};
