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
#include "tree.h"

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
  CKPT_HELD(&fs->lock);
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
  CKPT_HELD(&fs->lock);
  for (ckpt_node_t *n = fs->ino_hash[hash_ino(ino, fs->hash_size)]; n;
       n = n->hnext_ino)
    if (n->ino == ino)
      return n;
  return NULL;
}

ckpt_node_t *ckpt__node_by_ino(ckpt_fs_t *fs, uint64_t ino) {
  CKPT_HELD(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  return n && n->attached ? n : NULL;
}

ckpt_node_t *ckpt__node_child(ckpt_fs_t *fs, ckpt_node_t *dir,
                              const char *name) {
  CKPT_HELD(&fs->lock);
  for (ckpt_node_t *n = fs->name_hash[hash_name(dir, name, fs->hash_size)];
       n; n = n->hnext_name)
    if (n->parent == dir && strcmp(n->name, name) == 0)
      return n;
  return NULL;
}

void ckpt__node_ref(ckpt_node_t *n) { n->refs++; }

/* ------------------------------------------------------------------------
 * What the layers above hang on nodes and checkpoints, freed through the
 * tables they set (the tree calls nothing above itself).
 * ---------------------------------------------------------------------- */

static const ckpt_kind_ops_t *kinds[CKPT_NODE_KINDS];
static void (*releases[4])(ckpt_ckpt_t *ck);
static size_t nreleases;

void ckpt__tree_set_kind(ckpt_node_kind_t kind, const ckpt_kind_ops_t *ops) {
  assert((size_t)kind < CKPT_NODE_KINDS);
  kinds[kind] = ops;
}

void ckpt__tree_on_release(void (*fn)(ckpt_ckpt_t *ck)) {
  for (size_t i = 0; i < nreleases; i++)
    if (releases[i] == fn)
      return;
  assert(nreleases < sizeof(releases) / sizeof(releases[0]));
  releases[nreleases++] = fn;
}

static void node_free(ckpt_fs_t *fs, ckpt_node_t *n) {
  assert(!n->attached && n->refs == 0 && !n->children);
  hash_remove_ino(fs, n);
  if (kinds[n->kind] && kinds[n->kind]->free_node)
    kinds[n->kind]->free_node(n);
  if (n->kind == CKPT_NODE_SLINK)
    free(n->u.target);
  ckpt__xlist_free(&n->xl);
  if (n->ck)
    ckpt__ckpt_unref(fs, n->ck);
  free(n->name);
  free(n);
}

void ckpt__node_unref(ckpt_fs_t *fs, ckpt_node_t *n) {
  CKPT_HELD(&fs->lock);
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
  CKPT_HELD(&fs->lock);
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
  CKPT_HELD(&fs->lock);
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
  CKPT_HELD(&fs->lock);
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
  for (size_t i = 0; i < nreleases; i++)
    releases[i](ck);
  free(ck->removed);
  free(ck->reason);
  free(ck->tier.why);
  free(ck->lost);
  free(ck->waiting);
  pthread_rwlock_destroy(&ck->freeze);
  free(ck);
}

ckpt_node_t *ckpt__ckpt_lookup(ckpt_fs_t *fs, const char *name) {
  CKPT_HELD(&fs->lock);
  ckpt_node_t *n = ckpt__node_child(fs, fs->root, name);
  return n && n->kind == CKPT_NODE_CKPT ? n : NULL;
}

/* ------------------------------------------------------------------------
 * The mount.
 * ---------------------------------------------------------------------- */

int ckpt__tree_init(ckpt_fs_t *fs) {
  pthread_mutex_init(&fs->lock, NULL);
  fs->hash_size = 1024;
  fs->ino_hash = calloc(fs->hash_size, sizeof(*fs->ino_hash));
  fs->name_hash = calloc(fs->hash_size, sizeof(*fs->name_hash));
  fs->next_ino = FUSE_ROOT_ID + 1;
  if (!fs->ino_hash || !fs->name_hash)
    return -ENOMEM;
  pthread_mutex_lock(&fs->lock);
  fs->root = ckpt__node_new(fs, NULL, "", CKPT_NODE_ROOT, S_IFDIR | 0755,
                            NULL);
  pthread_mutex_unlock(&fs->lock);
  return fs->root ? 0 : -ENOMEM;
}

void ckpt__tree_destroy(ckpt_fs_t *fs) {
  if (fs->root) {
    assert(!fs->root->children); /* detached by the layers above */
    fs->root->attached = false;
    hash_remove_ino(fs, fs->root);
    free(fs->root->name);
    free(fs->root);
    fs->root = NULL;
  }
  free(fs->ino_hash);
  free(fs->name_hash);
  fs->ino_hash = fs->name_hash = NULL;
  pthread_mutex_destroy(&fs->lock);
}
