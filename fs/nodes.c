/*
 * nodes.c - the inode table and the tree of one rank mount.
 *
 * Two hash tables index the nodes: by inode number, and by (parent, name)
 * for lookups. Directories also keep their children in a list for readdir.
 * Everything here runs under fs->lock. A node removed from the tree
 * ("detached") lives on while requests or open handles reference it, and
 * is freed by the last ckpt__node_unref.
 */
#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "fs_int.h"

_Static_assert(sizeof(fuse_ino_t) >= sizeof(uint64_t),
               "inode numbers are 64-bit counters");

static size_t hash_ino(uint64_t ino, size_t size) {
  return (size_t)((ino * 0x9E3779B97F4A7C15ull) >> 17) & (size - 1);
}

static size_t hash_name(const ckpt_node_t *parent, const char *name,
                        size_t size) {
  uint64_t h = 1469598103934665603ull ^ (uint64_t)(uintptr_t)parent;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++)
    h = (h ^ *p) * 1099511628211ull;
  return (size_t)(h ^ (h >> 29)) & (size - 1);
}

static void hash_insert_name(ckpt_fs_t *fs, ckpt_node_t *n) {
  if (n->parent) {
    size_t j = hash_name(n->parent, n->name, fs->hash_size);
    n->hnext_name = fs->name_hash[j];
    fs->name_hash[j] = n;
  }
}

static void hash_insert(ckpt_fs_t *fs, ckpt_node_t *n) {
  size_t i = hash_ino(n->ino, fs->hash_size);
  n->hnext_ino = fs->ino_hash[i];
  fs->ino_hash[i] = n;
  hash_insert_name(fs, n);
}

static void hash_remove_ino(ckpt_fs_t *fs, ckpt_node_t *n) {
  ckpt_node_t **pp = &fs->ino_hash[hash_ino(n->ino, fs->hash_size)];
  while (*pp != n)
    pp = &(*pp)->hnext_ino;
  *pp = n->hnext_ino;
}

static void hash_remove_name(ckpt_fs_t *fs, ckpt_node_t *n) {
  if (n->parent) {
    ckpt_node_t **pp =
        &fs->name_hash[hash_name(n->parent, n->name, fs->hash_size)];
    while (*pp != n)
      pp = &(*pp)->hnext_name;
    *pp = n->hnext_name;
  }
}

/* Double both tables when they get crowded. */
static void hash_grow(ckpt_fs_t *fs) {
  size_t size = fs->hash_size * 2;
  ckpt_node_t **ino = calloc(size, sizeof(*ino));
  ckpt_node_t **name = calloc(size, sizeof(*name));
  if (!ino || !name) { /* keep the old tables: slower, still correct */
    free(ino);
    free(name);
    return;
  }
  for (size_t b = 0; b < fs->hash_size; b++) {
    for (ckpt_node_t *n = fs->ino_hash[b], *nx; n; n = nx) {
      nx = n->hnext_ino;
      size_t i = hash_ino(n->ino, size);
      n->hnext_ino = ino[i];
      ino[i] = n;
    }
    for (ckpt_node_t *n = fs->name_hash[b], *nx; n; n = nx) {
      nx = n->hnext_name;
      size_t j = hash_name(n->parent, n->name, size);
      n->hnext_name = name[j];
      name[j] = n;
    }
  }
  free(fs->ino_hash);
  free(fs->name_hash);
  fs->ino_hash = ino;
  fs->name_hash = name;
  fs->hash_size = size;
}

/* A directory's entries changed: its mtime and ctime move (POSIX). Only
 * where entries change by file calls: the root, and staged directories
 * (a committed tree is built once, with the times it was staged with). */
static void dir_changed(ckpt_node_t *d) {
  bool staged = d->kind == CKPT_NODE_ROOT || d->kind == CKPT_NODE_SDIR ||
                (d->kind == CKPT_NODE_CKPT && d->ck &&
                 (d->ck->state == CKPT_STAGING || d->ck->state == CKPT_FAILED));
  if (!staged)
    return;
  clock_gettime(CLOCK_REALTIME, &d->mtime);
  d->ctime = d->mtime;
}

static void link_child(ckpt_node_t *parent, ckpt_node_t *n) {
  parent->nsubdirs += S_ISDIR(n->mode) ? 1 : 0;
  dir_changed(parent);
  n->parent = parent;
  n->prev = NULL;
  n->next = parent->children;
  if (parent->children)
    parent->children->prev = n;
  parent->children = n;
}

static void unlink_child(ckpt_node_t *n) {
  n->parent->nsubdirs -= S_ISDIR(n->mode) && n->parent->nsubdirs ? 1 : 0;
  dir_changed(n->parent);
  if (n->prev)
    n->prev->next = n->next;
  else
    n->parent->children = n->next;
  if (n->next)
    n->next->prev = n->prev;
  n->next = n->prev = NULL;
}

ckpt_node_t *ckpt__node_new(ckpt_fs_t *fs, ckpt_node_t *parent,
                            const char *name, ckpt_node_kind_t kind,
                            mode_t mode, ckpt_ckpt_t *ck) {
  ckpt_node_t *n = calloc(1, sizeof(*n));
  if (!n)
    return NULL;
  n->name = strdup(name);
  if (!n->name) {
    free(n);
    return NULL;
  }
  if (fs->nnodes + 1 > fs->hash_size)
    hash_grow(fs);
  n->ino = kind == CKPT_NODE_ROOT ? FUSE_ROOT_ID : fs->next_ino++;
  n->kind = kind;
  n->mode = mode;
  n->uid = getuid();
  n->gid = getgid();
  clock_gettime(CLOCK_REALTIME, &n->mtime);
  n->ctime = n->atime = n->mtime;
  n->ck = ck;
  if (ck)
    ck->refs++;
  if (parent)
    link_child(parent, n);
  hash_insert(fs, n);
  n->attached = true;
  fs->nnodes++;
  return n;
}

ckpt_node_t *ckpt__node_by_ino_any(ckpt_fs_t *fs, uint64_t ino) {
  for (ckpt_node_t *n = fs->ino_hash[hash_ino(ino, fs->hash_size)]; n;
       n = n->hnext_ino)
    if (n->ino == ino)
      return n;
  return NULL;
}

ckpt_node_t *ckpt__node_by_ino(ckpt_fs_t *fs, uint64_t ino) {
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  return n && n->attached ? n : NULL;
}

ckpt_node_t *ckpt__node_child(ckpt_fs_t *fs, ckpt_node_t *dir,
                              const char *name) {
  for (ckpt_node_t *n = fs->name_hash[hash_name(dir, name, fs->hash_size)];
       n; n = n->hnext_name)
    if (n->parent == dir && strcmp(n->name, name) == 0)
      return n;
  return NULL;
}

void ckpt__node_ref(ckpt_node_t *n) { n->refs++; }

static void node_free(ckpt_fs_t *fs, ckpt_node_t *n) {
  assert(!n->attached && n->refs == 0 && !n->children);
  hash_remove_ino(fs, n);
  if (n->kind == CKPT_NODE_SFILE)
    ckpt__sfile_free(n->u.sf);
  if (n->kind == CKPT_NODE_CBLOCK)
    ckpt__block_free(n->u.block);
  if (n->ck)
    ckpt__ckpt_unref(fs, n->ck);
  free(n->name);
  free(n);
}

void ckpt__node_unref(ckpt_fs_t *fs, ckpt_node_t *n) {
  assert(n->refs > 0);
  if (--n->refs == 0 && !n->attached)
    node_free(fs, n);
}

static void detach_one(ckpt_fs_t *fs, ckpt_node_t *n) {
  /* Out of the tree, but still found by inode number (for fstat of an
   * open file) until freed. */
  hash_remove_name(fs, n);
  if (n->parent)
    unlink_child(n);
  n->parent = NULL;
  n->attached = false;
  /* A removed checkpoint's directory: its .status and .commit may still be
   * open (and fstat'ed or written), and must not reach the node freed here. */
  if (n->kind == CKPT_NODE_CKPT && n->ck && n->ck->dir == n)
    n->ck->dir = NULL;
  fs->nnodes--;
  if (n->refs == 0)
    node_free(fs, n);
}

void ckpt__node_detach(ckpt_fs_t *fs, ckpt_node_t *n) {
  assert(n->attached && n->kind != CKPT_NODE_ROOT);
  /* Leaves first, without recursion: a tree may be thousands of
   * directories deep (a committed path from any .metadata). */
  for (ckpt_node_t *c = n;;) {
    while (c->children)
      c = c->children;
    if (c == n)
      break;
    ckpt_node_t *up = c->parent;
    detach_one(fs, c);
    c = up;
  }
  detach_one(fs, n);
}

void ckpt__node_move(ckpt_fs_t *fs, ckpt_node_t *n, ckpt_node_t *newparent,
                     const char *newname) {
  assert(n->attached);
  char *name = strdup(newname);
  if (!name)
    return; /* the caller checked; keep the old name on ENOMEM */
  hash_remove_name(fs, n);
  unlink_child(n);
  free(n->name);
  n->name = name;
  link_child(newparent, n);
  /* Only the name changes: n stays where it is in the inode table (a
   * second insertion there would make its chain a cycle). */
  hash_insert_name(fs, n);
  clock_gettime(CLOCK_REALTIME, &n->ctime);
}

char *ckpt__node_path(const ckpt_node_t *n) {
  size_t len = 0;
  for (const ckpt_node_t *p = n; p && p->kind != CKPT_NODE_CKPT; p = p->parent)
    len += strlen(p->name) + 1;
  char *path = malloc(len ? len : 1);
  if (!path)
    return NULL;
  path[len ? len - 1 : 0] = '\0';
  size_t end = len ? len - 1 : 0;
  for (const ckpt_node_t *p = n; p && p->kind != CKPT_NODE_CKPT;
       p = p->parent) {
    size_t l = strlen(p->name);
    end -= l;
    memcpy(path + end, p->name, l);
    if (end)
      path[--end] = '/';
  }
  return path;
}

/* ------------------------------------------------------------------------
 * Checkpoints.
 * ---------------------------------------------------------------------- */

ckpt_ckpt_t *ckpt__ckpt_new(ckpt_fs_t *fs, const char *name) {
  ckpt_ckpt_t *ck = calloc(1, sizeof(*ck));
  if (!ck)
    return NULL;
  snprintf(ck->name, sizeof(ck->name), "%s", name);
  /* A commit must not wait behind a stream of staged changes (each
   * takes the lock shared): writers first. */
  pthread_rwlockattr_t ra;
  pthread_rwlockattr_init(&ra);
  pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  pthread_rwlock_init(&ck->freeze, &ra);
  pthread_rwlockattr_destroy(&ra);
  ck->refs = 1; /* listed in the root */
  ck->state = CKPT_STAGING;
  ck->dir = ckpt__node_new(fs, fs->root, name, CKPT_NODE_CKPT, S_IFDIR | 0755,
                           ck);
  if (!ck->dir ||
      !ckpt__node_new(fs, ck->dir, ".commit", CKPT_NODE_COMMIT,
                      S_IFREG | 0200, ck) ||
      !ckpt__node_new(fs, ck->dir, ".status", CKPT_NODE_STATUS,
                      S_IFREG | 0444, ck)) {
    if (ck->dir)
      ckpt__node_detach(fs, ck->dir);
    ckpt__ckpt_unref(fs, ck);
    return NULL;
  }
  return ck;
}

void ckpt__ckpt_unref(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  (void)fs;
  assert(ck->refs > 0);
  if (--ck->refs)
    return;
  assert(!ck->save);
  /* The reader first: its checks ahead of the reader use meta. */
  if (ck->has_stored)
    ckpt_stored_destroy(&ck->stored);
  if (ck->meta) {
    ckpt_metadata_free(ck->meta);
    free(ck->meta);
  }
  ckpt__views_free(ck->views);
  free(ck->removed);
  free(ck->reason);
  free(ck->tier.why);
  free(ck->lost);
  free(ck->waiting);
  ckpt__streams_free(ck->streams);
  pthread_rwlock_destroy(&ck->freeze);
  free(ck);
}

ckpt_node_t *ckpt__ckpt_lookup(ckpt_fs_t *fs, const char *name) {
  ckpt_node_t *n = ckpt__node_child(fs, fs->root, name);
  return n && n->kind == CKPT_NODE_CKPT ? n : NULL;
}

/* A component of a stored path that may appear in the tree: a name a
 * staged entry could have had there (top: directly under the checkpoint). */
static bool component_ok(const char *s, size_t len, bool top) {
  return ckpt_entry_name_check(s, len, top) == 0;
}

/* Create (or find) the directories of path and the file node at its end. */
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
  bool dir = S_ISDIR(n->mode);
  if (e && S_ISDIR(e->mode) == dir) {
    n->mode = (dir ? S_IFDIR : S_IFREG) | (e->mode & 0555);
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
                             kind == CKPT_NODE_CDIR ? S_IFDIR | 0555
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
  /* Directories that hold no item (staged empty) are kept too. */
  for (uint32_t i = 0; i < meta->n_entries; i++) {
    const ckpt_entry_attr_t *e = &meta->entries[i];
    if (S_ISDIR(e->mode) && e->path[0] != '\0' &&
        !add_committed_path(fs, ck, e->path, CKPT_NODE_CDIR))
      ckpt__log("%s: cannot show directory %s (bad or conflicting path)",
                ck->name, e->path);
  }
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

/* ------------------------------------------------------------------------
 * The mount.
 * ---------------------------------------------------------------------- */

void ckpt__scan_put(ckpt_scan_t *sc) {
  if (!sc || --sc->refs)
    return;
  ckpt__catalog_names_free(sc->names, sc->n);
  free(sc->pr);
  free(sc);
}

int ckpt__fs_init(ckpt_fs_t *fs) {
  pthread_mutex_init(&fs->lock, NULL);
  pthread_mutex_init(&fs->scan_lock, NULL);
  pthread_mutex_init(&fs->tier_publish, NULL);
  fs->hash_size = 1024;
  fs->ino_hash = calloc(fs->hash_size, sizeof(*fs->ino_hash));
  fs->name_hash = calloc(fs->hash_size, sizeof(*fs->name_hash));
  fs->next_ino = FUSE_ROOT_ID + 1;
  /* Staged data spills into the commit root: with a tier, passthrough
   * files there are linked into the save, still written once. */
  ckpt__staging_init(&fs->staging, fs->opts.staging_mem, fs->commit_fd);
  if (!fs->ino_hash || !fs->name_hash ||
      ckpt_fdcache_new(fs->backing_fd, 0, &fs->fdcache))
    return -ENOMEM;
  /* one rank has all its files in its tier: nothing to wait for */
  ckpt_fdcache_set_near(fs->fdcache, fs->tier_fd,
                        fs->world_size > 1 ? fs->opts.commit_timeout : 0);
  fs->root = ckpt__node_new(fs, NULL, "", CKPT_NODE_ROOT, S_IFDIR | 0755,
                            NULL);
  return fs->root ? 0 : -ENOMEM;
}

void ckpt__count_staged(const ckpt_node_t *dir, uint64_t *files,
                        uint64_t *bytes) {
  for (const ckpt_node_t *c = dir->children; c; c = c->next) {
    if (c->kind == CKPT_NODE_SDIR) {
      ckpt__count_staged(c, files, bytes);
    } else if (c->kind == CKPT_NODE_SFILE) {
      (*files)++;
      *bytes += ckpt__sfile_size_seen(c->u.sf);
    }
  }
}

void ckpt__fs_destroy(ckpt_fs_t *fs) {
  if (fs->root) {
    while (fs->root->children) {
      ckpt_node_t *d = fs->root->children;
      ckpt_ckpt_t *ck = d->ck;
      if (ck && (ck->state == CKPT_STAGING || ck->state == CKPT_FAILED)) {
        uint64_t files = 0, bytes = 0;
        ckpt__count_staged(d, &files, &bytes);
        ckpt__log("warning: unmounted with checkpoint %s staged but not "
                  "committed (%llu file%s, %llu bytes)%s: its staged data is "
                  "discarded",
                  ck->name, (unsigned long long)files, files == 1 ? "" : "s",
                  (unsigned long long)bytes,
                  ck->state == CKPT_FAILED ? " (its last commit failed)" : "");
      }
      ckpt__node_detach(fs, d);
      ckpt__ckpt_unref(fs, ck);
    }
    fs->root->attached = false;
    hash_remove_ino(fs, fs->root);
    free(fs->root->name);
    free(fs->root);
    fs->root = NULL;
  }
  free(fs->ino_hash);
  free(fs->name_hash);
  ckpt_fdcache_free(fs->fdcache);
  fs->fdcache = NULL;
  ckpt__scan_put(fs->scan);
  fs->scan = NULL;
  for (size_t i = 0; i < fs->nrefused; i++)
    free(fs->refused[i].name);
  free(fs->refused);
  fs->refused = NULL;
  fs->nrefused = 0;
  pthread_mutex_destroy(&fs->scan_lock);
  pthread_mutex_destroy(&fs->tier_publish);
  ckpt__staging_destroy(&fs->staging);
  pthread_mutex_destroy(&fs->lock);
}
