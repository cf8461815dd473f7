/*
 * kinds.c - what each kind of node is to the request families: a table
 * of its operations (read, seek, attributes, allocation) that the
 * callbacks dispatch through, as a VFS inode's operations, and the
 * attributes and entries replied for a node.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ops_int.h"

/* The root committed ck was loaded from: the tier while TIER/NAME is that
 * directory, else BACKING_DIR (one stat; the resolver decides which save
 * NAME is at lookups, this only finds the loaded one's files). May be
 * called with fs->lock held. */
static int loaded_root(ckpt_fs_t *fs, const ckpt_ckpt_t *ck) {
  struct stat st;
  if (fs->tier_fd >= 0 && ck->has_stored &&
      fstatat(fs->tier_fd, ck->name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      st.st_dev == ck->stored.dev && st.st_ino == ck->stored.ino)
    return fs->tier_fd;
  return fs->backing_fd;
}

/* The bytes committed item n takes in its data file: when it is the
 * whole of its own data file (a large file written once, or alone in
 * one), that file's allocation (fstatat: nothing is opened, so a stat
 * holds no data file); else its size. fs->lock held. */
static uint64_t committed_allocated(ckpt_fs_t *fs, ckpt_node_t *n) {
  if (n->allocated)
    return n->allocated - 1;
  const ckpt_stored_t *s = &n->ck->stored;
  ckpt_item_t it = ckpt__node_item(n);
  uint64_t size = ckpt_stored_size(s, it), bytes = size, pos;
  int32_t rank;
  uint32_t file;
  char name[64], path[512];
  struct stat st;
  if (ckpt_stored_run(s, it, &rank, &file, &pos) == 1 && pos == 0 &&
      ckpt_data_file_name(rank, file, name, sizeof(name)) < (int)sizeof(name) &&
      snprintf(path, sizeof(path), "%s/%s", n->ck->name, name) <
          (int)sizeof(path) &&
      fstatat(loaded_root(fs, n->ck), path, &st,
              AT_SYMLINK_NOFOLLOW) == 0 &&
      S_ISREG(st.st_mode) && (uint64_t)st.st_size == size &&
      (uint64_t)st.st_blocks * 512 < size)
    bytes = (uint64_t)st.st_blocks * 512;
  n->allocated = bytes + 1;
  return bytes;
}

static uint64_t staged_allocated(ckpt_fs_t *fs, ckpt_node_t *n) {
  (void)fs;
  return ckpt__sfile_allocated(n->u.sf);
}

/* The size and times of a staged file: a passthrough file's are its
 * backing file's (written by the kernel). fs->lock held. */
static void staged_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
  st->st_size = (off_t)ckpt__sfile_size(n->u.sf);
  ckpt__sfile_pt_times(n->u.sf, &st->st_mtim, &n->ctime);
  st->st_ctim = n->ctime;
  /* one inode under each of its names (hard links) */
  st->st_ino = n->u.sf->ino ? n->u.sf->ino : n->ino;
  st->st_nlink = ckpt__sfile_nlink(n->u.sf);
}

static void committed_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
  st->st_size = (off_t)ckpt_stored_size(&n->ck->stored, ckpt__node_item(n));
}

static void status_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  char *t = ckpt__op_status_text(fs, n->ck);
  st->st_size = t ? (off_t)strlen(t) : 0;
  free(t);
}

static void metadata_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  struct stat bst;
  char path[300];
  snprintf(path, sizeof(path), "%s/%s", n->ck->name, CKPT_METADATA_FILE);
  if (fstatat(loaded_root(fs, n->ck), path, &bst, AT_SYMLINK_NOFOLLOW) == 0 &&
      S_ISREG(bst.st_mode))
    st->st_size = bst.st_size;
}

static void view_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
  st->st_size = (off_t)ckpt__view_size(n);
}

static void block_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
  st->st_size = (off_t)n->u.block->bytes;
}

static void slink_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
  st->st_size = (off_t)strlen(n->u.target);
}

static void clink_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
  const char *t = n->entry ? n->ck->meta->entries[n->entry - 1].target : NULL;
  st->st_size = t ? (off_t)strlen(t) : 0;
}

#define COMMITTED_ITEM                                                      \
  .committed = true, .read = ckpt__op_read_committed,                       \
  .seek = ckpt__op_seek_committed, .attr = committed_attr,                  \
  .allocated = committed_allocated
#define VIEW_FILE .committed = true, .read = ckpt__op_read_view, .attr = view_attr

static const ckpt_op_kind_t kinds[CKPT_NODE_KINDS] = {
    /* directories are listed and looked in, not read */
    [CKPT_NODE_ROOT] = {0},
    [CKPT_NODE_CKPT] = {0},
    [CKPT_NODE_SDIR] = {0},
    [CKPT_NODE_SFILE] = {.read = ckpt__op_read_staged,
                         .seek = ckpt__op_seek_staged, .attr = staged_attr,
                         .allocated = staged_allocated},
    [CKPT_NODE_CDIR] = {.committed = true},
    [CKPT_NODE_CTENSOR] = {COMMITTED_ITEM},
    [CKPT_NODE_CBLOB] = {COMMITTED_ITEM},
    [CKPT_NODE_COMMIT] = {0}, /* written, never read */
    [CKPT_NODE_STATUS] = {.read = ckpt__op_read_status,
                          .attr = status_attr},
    [CKPT_NODE_METADATA] = {.committed = true,
                            .read = ckpt__op_read_metadata,
                            .attr = metadata_attr},
    [CKPT_NODE_VROOT] = {.committed = true},
    [CKPT_NODE_VDIR] = {.committed = true},
    [CKPT_NODE_VNPY] = {VIEW_FILE},
    [CKPT_NODE_VST] = {VIEW_FILE},
    [CKPT_NODE_VINDEX] = {VIEW_FILE},
    [CKPT_NODE_CBLOCK] = {.committed = true,
                          .read = ckpt__op_read_block, .attr = block_attr},
    /* links are read by readlink, never opened (the kernel follows them) */
    [CKPT_NODE_SLINK] = {.attr = slink_attr},
    [CKPT_NODE_CLINK] = {.committed = true, .attr = clink_attr},
};

const ckpt_op_kind_t *ckpt__op_kind(const ckpt_node_t *n) {
  return &kinds[n->kind];
}

bool ckpt__op_is_committed_kind(ckpt_node_kind_t k) {
  return kinds[k].committed;
}

/* fs->lock held. */
void ckpt__op_fill_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  CKPT_HELD(&fs->lock);
  const ckpt_op_kind_t *k = &kinds[n->kind];
  memset(st, 0, sizeof(*st));
  st->st_ino = n->ino;
  st->st_mode = n->mode;
  /* A directory: itself, its "." and each child directory's ".."; a file
   * unlinked while open: no name left. */
  st->st_nlink = S_ISDIR(n->mode) ? 2 + n->nsubdirs : n->attached ? 1 : 0;
  st->st_uid = n->uid;
  st->st_gid = n->gid;
  st->st_blksize = (blksize_t)CKPT_SEG_SIZE;
  st->st_mtim = n->mtime;
  st->st_atim = n->atime;
  st->st_ctim = n->ctime;
  if (n->st_ino) /* a committed hard link: its file's first name's */
    st->st_ino = n->st_ino;
  if (n->st_nlink)
    st->st_nlink = n->st_nlink;
  if (k->attr)
    k->attr(fs, n, st);
  /* st_size <= INT64_MAX (metadb bounds every size): no overflow here.
   * What the bytes take where they are: holes take nothing, so that cp
   * and tar -S find a sparse file sparse. */
  uint64_t bytes = k->allocated ? k->allocated(fs, n) : (uint64_t)st->st_size;
  st->st_blocks = (blkcnt_t)(bytes / 512 + (bytes % 512 != 0));
}

double ckpt__op_node_timeout(const ckpt_node_t *n) {
  return ckpt__op_is_committed_kind(n->kind) ? COMMITTED_TIMEOUT : 0.0;
}

/* fs->lock held. */
void ckpt__op_fill_entry(ckpt_fs_t *fs, ckpt_node_t *n, struct fuse_entry_param *e) {
  CKPT_HELD(&fs->lock);
  memset(e, 0, sizeof(*e));
  e->ino = n->ino;
  e->generation = 1;
  ckpt__op_fill_attr(fs, n, &e->attr);
  e->attr_timeout = e->entry_timeout = ckpt__op_node_timeout(n);
}

/* Open BACKING_DIR/NAME/.metadata of committed ck for reading: never
 * through a symlink, only a regular file, only in the directory that was
 * loaded. fd or -errno. */
int ckpt__op_open_metadata(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  int dfd = ckpt_store_open_dir(loaded_root(fs, ck), ck->name, O_PATH);
  if (dfd < 0)
    return dfd == -ELOOP || dfd == -ENOTDIR ? -EIO : dfd;
  /* -ESTALE: replaced since it was loaded */
  int fd =
      ck->has_stored ? ckpt_stored_same_lineage(&ck->stored, dfd) : -ESTALE;
  if (fd == 0)
    fd = ckpt_store_open_file(dfd, CKPT_METADATA_FILE);
  close(dfd);
  if (fd == -ELOOP || fd == -EINVAL) {
    ckpt__log("%s: %s is not a regular file any more: not serving it",
              ck->name, CKPT_METADATA_FILE);
    fd = -EIO;
  }
  return fd;
}
