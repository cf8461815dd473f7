/*
 * ops.h - fs/ops: the FUSE low-level callbacks of a rank mount, one file
 * per request family. Below: commit and everything under it.
 */
#ifndef CKPT_FS_OPS_H
#define CKPT_FS_OPS_H

#include "commit.h"

/* ------------------------------------------------------------------------
 * FUSE operations (ops.c).
 * ---------------------------------------------------------------------- */
extern const struct fuse_lowlevel_ops ckpt__fuse_ops;
/* Free the handles the kernel did not release before the session ended
 * (call after the FUSE loop, before ckpt__fs_destroy). */
void ckpt__release_handles(ckpt_fs_t *fs);

/* Drop a reference to a listing of BACKING_DIR (fs->scan_lock held). */
void ckpt__scan_put(ckpt_scan_t *sc);

#endif /* CKPT_FS_OPS_H */
