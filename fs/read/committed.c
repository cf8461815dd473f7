/*
 * committed.c - a committed checkpoint's tree: the nodes of its items and
 * directories built from its metadata, with the permissions, owners and
 * times of the staged entries they were; and the committed kinds' entries
 * in the tree's tables.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "catalog.h"
#include "read.h"

static void free_block(ckpt_node_t *n) { ckpt__block_free(n->u.block); }

static void release_views(ckpt_ckpt_t *ck) {
  ckpt__views_free(ck->views);
  ck->views = NULL;
}

void ckpt__read_register(void) {
  static const ckpt_kind_ops_t block = {.free_node = free_block};
  ckpt__tree_set_kind(CKPT_NODE_CBLOCK, &block);
  ckpt__tree_on_release(release_views);
}

/* A component of a stored path that may appear in the tree: a name a
 * staged entry could have had there (top: directly under the checkpoint). */
static bool component_ok(const char *s, size_t len, bool top) {
  return ckpt_entry_name_check(s, len, top) == 0;
}

/* What the staged entry at path (its first len bytes) was, read-only:
 * committed node n keeps its permissions (write bits cleared), owner and
 * time; without an entry (a checkpoint saved before they were kept), the
 * old read-only defaults and the creation time. */
static void apply_entry(const ckpt_metadata_t *meta, ckpt_node_t *n,
                        const char *path, size_t len, struct timespec when) {
  char buf[4096];
  const ckpt_entry_attr_t *e = NULL;
  if (len < sizeof(buf)) {
    memcpy(buf, path, len);
    buf[len] = '\0';
    e = ckpt_metadata_entry(meta, buf);
  }
  mode_t type = n->mode & S_IFMT;
  if (e && (e->mode & S_IFMT) == type) {
    n->mode = type | (type == S_IFLNK ? 0777 : (e->mode & 0555));
    n->entry = (uint32_t)(e - meta->entries) + 1;
    n->uid = e->uid;
    n->gid = e->gid;
    n->mtime.tv_sec = e->mtime_ns / 1000000000;
    n->mtime.tv_nsec = e->mtime_ns % 1000000000;
    if (n->mtime.tv_nsec < 0)
      n->mtime.tv_sec--, n->mtime.tv_nsec += 1000000000;
  } else {
    n->mtime = when;
  }
  n->ctime = n->atime = n->mtime;
}

void ckpt__committed_shared(ckpt_ckpt_t *ck, ckpt_node_t *n) {
  n->mode = S_ISDIR(n->mode) ? S_IFDIR | ck->shared_dmode
                             : S_IFREG | ck->shared_fmode;
  n->uid = ck->dir->uid;
  n->gid = ck->dir->gid;
}

/* Which classes of a node owned by uid:gid could reach entry e's bytes:
 * read a file, or search a directory (list the checkpoint directory), as
 * 0444 read bits. A class the entry's owner or group is not gets only what
 * the entry gives others. */
static mode_t reach(const ckpt_entry_attr_t *e, uid_t uid, gid_t gid,
                    bool top) {
  mode_t p = (mode_t)e->mode & 0777;
  mode_t want = S_ISDIR(e->mode) ? (top ? 0555 : 0111) : 0444;
  bool other = (p & want & 0007) == (want & 0007);
  bool group = e->gid == gid ? (p & want & 0070) == (want & 0070) : other;
  bool user = e->uid == uid ? (p & want & 0700) == (want & 0700) : other;
  return (mode_t)((user ? 0400 : 0) | (group ? 0040 : 0) | (other ? 0004 : 0));
}

/* The permissions .metadata and the views (owned by the checkpoint
 * directory's owner) may give: no class gets more than it could reach in
 * the staged tree, through every directory and every file (a view holds
 * the bytes of every tensor). */
static void shared_modes(ckpt_ckpt_t *ck, const ckpt_metadata_t *meta) {
  mode_t f = 0444;
  for (uint32_t i = 0; i < meta->n_entries; i++) {
    const ckpt_entry_attr_t *e = &meta->entries[i];
    f &= reach(e, ck->dir->uid, ck->dir->gid, e->path[0] == '\0');
  }
  ck->shared_fmode = f;
  ck->shared_dmode = f | (f >> 2); /* read and search where read */
}

/* The node of an item at path (kind CTENSOR or CBLOB), or of a directory
 * (kind CDIR: found if there already), with the directories above it. */
static ckpt_node_t *add_committed_path(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                                       const char *path,
                                       ckpt_node_kind_t kind) {
  ckpt_node_t *dir = ck->dir;
  const char *p = path;
  struct timespec when = {.tv_sec = ck->meta->created_at};
  for (;;) {
    const char *slash = strchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    if (!component_ok(p, len, dir == ck->dir))
      return NULL;
    char name[256];
    memcpy(name, p, len);
    name[len] = '\0';
    ckpt_node_t *child = ckpt__node_child(fs, dir, name);
    if (!slash && kind == CKPT_NODE_CDIR && child)
      return child->kind == CKPT_NODE_CDIR ? child : NULL;
    if (!slash) {
      if (child)
        return NULL; /* two items at one path */
      child = ckpt__node_new(fs, dir, name, kind,
                             kind == CKPT_NODE_CDIR    ? S_IFDIR | 0555
                             : kind == CKPT_NODE_CLINK ? S_IFLNK | 0777
                                                       : S_IFREG | 0444,
                             ck);
      if (child)
        apply_entry(ck->meta, child, path, strlen(path), when);
      return child;
    }
    if (child && child->kind != CKPT_NODE_CDIR)
      return NULL; /* a file where a directory is needed */
    if (!child) {
      child = ckpt__node_new(fs, dir, name, CKPT_NODE_CDIR, S_IFDIR | 0555,
                             ck);
      if (child)
        apply_entry(ck->meta, child, path, (size_t)(slash - path), when);
    }
    if (!child)
      return NULL;
    dir = child;
    p = slash + 1;
  }
}

/* The node of the item at path (a file's first name), or NULL. */
static ckpt_node_t *item_node(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                              const char *path) {
  ckpt_node_t *dir = ck->dir;
  char name[256];
  for (const char *p = path;;) {
    const char *slash = strchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    if (len >= sizeof(name) || !dir)
      return NULL;
    memcpy(name, p, len);
    name[len] = '\0';
    ckpt_node_t *c = ckpt__node_child(fs, dir, name);
    if (!slash)
      return c && (c->kind == CKPT_NODE_CTENSOR || c->kind == CKPT_NODE_CBLOB)
                 ? c
                 : NULL;
    dir = c && c->kind == CKPT_NODE_CDIR ? c : NULL;
    p = slash + 1;
  }
}

/* The other names of files (hard links: entries of regular files whose
 * target is the first name): nodes of the same item, showing its inode
 * number and their count. */
static void add_hard_links(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  const ckpt_metadata_t *meta = ck->meta;
  for (uint32_t i = 0; i < meta->n_entries; i++) {
    const ckpt_entry_attr_t *e = &meta->entries[i];
    if (!S_ISREG(e->mode) || !e->target)
      continue;
    ckpt_node_t *first = item_node(fs, ck, e->target);
    ckpt_node_t *n = first ? add_committed_path(fs, ck, e->path, first->kind)
                           : NULL;
    if (!n) {
      ckpt__log("%s: cannot show %s, a name of %s (bad or conflicting path, "
                "or no such item)", ck->name, e->path, e->target);
      continue;
    }
    n->u = first->u;
    n->st_ino = first->ino;
    first->st_nlink = first->st_nlink ? first->st_nlink + 1 : 2;
  }
  /* every name shows the count */
  for (uint32_t i = 0; i < meta->n_entries; i++) {
    const ckpt_entry_attr_t *e = &meta->entries[i];
    ckpt_node_t *n = S_ISREG(e->mode) && e->target
                         ? item_node(fs, ck, e->path) : NULL;
    ckpt_node_t *first = n ? ckpt__node_by_ino(fs, n->st_ino) : NULL;
    if (first)
      n->st_nlink = first->st_nlink;
  }
}

int ckpt__ckpt_set_committed(ckpt_fs_t *fs, ckpt_ckpt_t *ck,
                             ckpt_metadata_t *meta, int dirfd, char **err) {
  /* The reader: no descriptor is kept; the directory is pinned by its
   * identity (a directory of this name with another inode is not it). */
  int rc = ckpt_stored_init(&ck->stored, fs->fdcache, ck->name, dirfd, meta,
                            fs->opts.verify);
  if (rc) {
    ckpt_stored_destroy(&ck->stored);
    *err = ckpt__strdup_printf("setting up its reader: %s", strerror(-rc));
    return rc;
  }
  ck->has_stored = true;
  ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;

  /* Drop the staged view, keep .commit and .status. */
  for (ckpt_node_t *c = ck->dir->children, *nx; c; c = nx) {
    nx = c->next;
    if (c->kind != CKPT_NODE_COMMIT && c->kind != CKPT_NODE_STATUS)
      ckpt__node_detach(fs, c);
  }
  ck->meta = meta;
  /* Committed from here on: building its tree leaves the times it was
   * staged with (dir_changed). */
  ck->state = CKPT_COMMITTED;
  struct timespec when = {.tv_sec = meta->created_at};
  ck->dir->mode = S_IFDIR | 0555;
  apply_entry(meta, ck->dir, "", 0, when);
  shared_modes(ck, meta);
  for (uint32_t i = 0; i < meta->n_tensors + meta->n_blobs; i++) {
    bool tensor = i < meta->n_tensors;
    const char *path = tensor ? meta->tensors[i].path
                              : meta->blobs[i - meta->n_tensors].path;
    ckpt_node_t *n = add_committed_path(
        fs, ck, path, tensor ? CKPT_NODE_CTENSOR : CKPT_NODE_CBLOB);
    if (!n) {
      ckpt__log("%s: cannot show %s (bad or conflicting path)", ck->name,
                path);
      continue;
    }
    if (tensor)
      n->u.tensor = i;
    else
      n->u.blob = i - meta->n_tensors;
  }
  /* Directories that hold no item (staged empty) are kept too, and the
   * symbolic links. */
  for (uint32_t i = 0; i < meta->n_entries; i++) {
    const ckpt_entry_attr_t *e = &meta->entries[i];
    bool dir = S_ISDIR(e->mode), link = S_ISLNK(e->mode);
    if ((dir || link) && e->path[0] != '\0' &&
        !add_committed_path(fs, ck, e->path,
                            dir ? CKPT_NODE_CDIR : CKPT_NODE_CLINK))
      ckpt__log("%s: cannot show %s %s (bad or conflicting path)", ck->name,
                dir ? "directory" : "link", e->path);
  }
  add_hard_links(fs, ck);
  ckpt_node_t *md = ckpt__node_new(fs, ck->dir, CKPT_METADATA_FILE,
                                   CKPT_NODE_METADATA, S_IFREG | 0444, ck);
  if (md) {
    ckpt__committed_shared(ck, md);
    md->mtime = md->ctime = md->atime = when;
  }
  if (ckpt__views_attach(fs, ck) < 0) /* the checkpoint is whole without */
    ckpt__log("%s: no .npy and .safetensors views (out of memory)", ck->name);
  return 0;
}
