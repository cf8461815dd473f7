/*
 * remove.c - removing and renaming: unlink, rmdir and rename of staged
 * entries and checkpoints, and removals inside committed checkpoints (a
 * new version of the .metadata, published once per removal).
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

/* Committed ck is removed as a whole (unlink of NAME/.metadata, the first
 * entry rm -r NAME removes, or rmdir NAME), for every mount: its .metadata
 * is unlinked from BACKING_DIR durably now (also when another mount's
 * removal inside it made a later version of it), the rest of its entries
 * stay in this mount for rm -r to remove (each unlink then only hides
 * one), and rmdir NAME removes its data (or the next mount start does).
 * fs->lock held. */
/* In the tier only, its flush to BACKING_DIR under way: not removed,
 * neither whole nor inside (the flush would publish it again). */
bool ckpt__op_unflushed(ckpt_ckpt_t *ck) {
  return ck->tier.tiered && !atomic_load(&ck->tier.flushed);
}

static int start_removal(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  if (ck->removing)
    return 0;
  if (ck->state != CKPT_COMMITTED || !ck->has_stored)
    return -EROFS;
  if (ckpt__op_unflushed(ck) && !atomic_load(&ck->tier.failed))
    return -EBUSY;
  if (ckpt__op_unflushed(ck)) {
    /* Its flush failed for good: in the tier only, for this mount only
     * (rmdir NAME removes it and its record; BACKING_DIR's NAME, if any,
     * is another save's and stays). */
    ckpt__log("%s: removed as a whole (its flush to BACKING_DIR failed: "
              "from the tier only)", ck->name);
    ck->removing = true;
    return 0;
  }
  int rc = ckpt_store_unpublish(fs->backing_fd, &ck->stored);
  if (rc == -ESTALE) {
    /* Replaced by another checkpoint of the name, or being removed by
     * another mount: ours is gone, and NAME is not ours to remove. */
    ck->gone = true;
    rc = 0;
  }
  if (rc)
    return rc;
  ckpt__log("%s: removed as a whole (its .metadata) for every mount",
            ck->name);
  ck->removing = true;
  return 0;
}

/* Removals inside committed checkpoints, one at a time in this mount
 * (each publishes a new version; see remove_entry). */
static pthread_mutex_t removal_lock = PTHREAD_MUTEX_INITIALIZER;

/* What removing committed node n (a tensor, a blob, an empty directory,
 * a link) takes out of its checkpoint's metadata. fs->lock held. */
static int removal_of(const ckpt_node_t *n, ckpt_removal_t *r) {
  const ckpt_metadata_t *m = n->ck->meta;
  memset(r, 0, sizeof(*r));
  /* a link, or another name of a file: its entries row only */
  r->dir = n->kind == CKPT_NODE_CDIR || n->kind == CKPT_NODE_CLINK ||
           n->st_ino != 0;
  r->blob = n->kind == CKPT_NODE_CBLOB;
  if (r->dir)
    ;
  else if (n->st_nlink > 1) { /* the first name of a file with others */
    ckpt__log("%s/%s: not removed: the file has %u names (hard links); its "
              "bytes are stored under this one: remove the others first",
              n->ck->name, n->name, n->st_nlink);
    return -EPERM;
  }
  else if (n->kind == CKPT_NODE_CTENSOR)
    r->fqn = strdup(m->tensors[n->u.tensor].fqn);
  else if (r->blob)
    r->fqn = strdup(m->blobs[n->u.blob].fqn);
  r->path = ckpt__node_path(n);
  return r->path && (r->dir || r->fqn) ? 0 : -ENOMEM;
}

/* Committed n, another name of a file, is gone: the first name's count
 * of names goes down by one, and so do the other names' (found by the
 * inode number they show). fs->lock held. */
static void set_names(ckpt_node_t *dir, uint64_t ino, uint32_t k) {
  for (ckpt_node_t *c = dir->children; c; c = c->next) {
    if (c->kind == CKPT_NODE_CDIR)
      set_names(c, ino, k);
    else if (c->st_ino == ino && !c->hidden)
      c->st_nlink = k;
  }
}

static void unname(ckpt_fs_t *fs, ckpt_node_t *n) {
  CKPT_HELD(&fs->lock);
  ckpt_node_t *first = ckpt__node_by_ino(fs, n->st_ino);
  uint32_t k = first && first->st_nlink > 1 ? first->st_nlink - 1 : 1;
  if (first)
    first->st_nlink = k;
  n->st_nlink = 0;
  n->hidden = true;
  set_names(n->ck->dir, n->st_ino, k);
}

/* Remove entry n inside committed checkpoint n->ck for every mount: a new
 * version of the checkpoint without it is published (as a replace is)
 * before this returns, and this mount shows that version at once: its
 * tree stays (so that an rm -r in progress goes on with the same inodes),
 * n is hidden and the reader is bound to the new directory. When another
 * mount changed the checkpoint meanwhile, n is removed from that version
 * and this mount's view of it is reloaded at the next lookup of NAME.
 * n referenced; fs->lock not held. 0 or -errno. */
static int remove_entry(ckpt_fs_t *fs, ckpt_node_t *n) {
  pthread_mutex_lock(&removal_lock);
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = n->ck;
  ckpt_removal_t r = {0};
  int rc = 0;
  if (!n->attached || n->hidden)
    rc = -ENOENT;
  else if (ck->removing)
    n->hidden = true, rc = 1; /* the whole checkpoint goes already */
  else if (ck->state != CKPT_COMMITTED || !ck->has_stored)
    rc = -EROFS;
  else if (ckpt__op_unflushed(ck))
    rc = -EBUSY;
  else if (!ck->removed &&
           !(ck->removed = calloc((size_t)ck->meta->n_tensors +
                                      ck->meta->n_blobs + 1,
                                  sizeof(*ck->removed))))
    rc = -ENOMEM;
  else
    rc = removal_of(n, &r);
  if (rc == 0)
    ck->rewriting = true;
  pthread_mutex_unlock(&fs->lock);
  if (rc) {
    free((char *)r.fqn);
    free((char *)r.path);
    pthread_mutex_unlock(&removal_lock);
    return rc == 1 ? 0 : rc;
  }
  ckpt_version_t v;
  char *err = NULL;
  rc = ckpt_store_remove_entry(fs->backing_fd, &ck->stored, ck->removed, &r,
                               fs->opts.sync_files, &v, &err);
  pthread_mutex_lock(&fs->lock);
  ck->rewriting = false;
  if (rc == 0) {
    ckpt_stored_rebind(&ck->stored, &v);
    /* Listings made before the exchange must not take it for another's. */
    ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
  }
  if (rc == 0 || rc == 1 || rc == -ENOENT) {
    if (n->st_ino)
      unname(fs, n);
    else if (n->kind == CKPT_NODE_CTENSOR)
      ck->removed[n->u.tensor] = true;
    else if (n->kind == CKPT_NODE_CBLOB)
      ck->removed[ck->meta->n_tensors + n->u.blob] = true;
    n->hidden = true;
    ckpt__log("%s: removed %s from the checkpoint for every mount%s",
              ck->name, r.path,
              rc == 0    ? " (a new version of it)"
              : rc == 1  ? " (it had changed: this mount reloads it)"
                         : " (the checkpoint is gone)");
    rc = 0;
  } else {
    ckpt__log("%s: cannot remove %s: %s", ck->name, r.path,
              err ? err : strerror(-rc));
  }
  pthread_mutex_unlock(&fs->lock);
  pthread_mutex_unlock(&removal_lock);
  free(err);
  free((char *)r.fqn);
  free((char *)r.path);
  return rc == -EOPNOTSUPP ? -EROFS : rc;
}

void ckpt__op_unlink(fuse_req_t req, fuse_ino_t parent, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_unlink);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  int rc = 0;
  ckpt_node_t *entry = NULL;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *n = p ? ckpt__node_child(fs, p, name) : NULL;
  if (!p)
    rc = -ESTALE;
  else if (!n || n->hidden)
    rc = -ENOENT;
  else if (S_ISDIR(n->mode))
    rc = -EISDIR;
  else if (n->kind == CKPT_NODE_COMMIT || n->kind == CKPT_NODE_STATUS)
    rc = -EPERM;
  else if (n->kind == CKPT_NODE_METADATA &&
           (rc = start_removal(fs, n->ck)) == 0)
    n->hidden = true; /* the checkpoint as a whole: rm -r NAME lists
                         .metadata first, so it removes the checkpoint
                         once, not one new version per entry */
  else if (ckpt__is_view_kind(n->kind) || n->kind == CKPT_NODE_CBLOCK)
    rc = -EROFS; /* not an entry of the checkpoint */
  else if (ckpt__op_is_committed_kind(n->kind))
    ckpt__node_ref(entry = n);
  else if ((rc = ckpt__op_staged_writable(n->ck)) == 0)
    ckpt__node_detach(fs, n);
  pthread_mutex_unlock(&fs->lock);
  if (entry) {
    rc = remove_entry(fs, entry);
    ckpt__op_put_node(fs, entry);
  }
  fuse_reply_err(req, -rc);
}

/* Does dir show any entry (readdir would list it)? fs->lock held. */
static bool has_visible(const ckpt_node_t *dir) {
  for (const ckpt_node_t *c = dir->children; c; c = c->next)
    if (!c->hidden && c->kind != CKPT_NODE_COMMIT &&
        c->kind != CKPT_NODE_STATUS && c->kind != CKPT_NODE_VROOT &&
        c->kind != CKPT_NODE_CBLOCK)
      return true;
  return false;
}

static int rmdir_checkpoint(ckpt_fs_t *fs, ckpt_node_t *dir) {
  ckpt_ckpt_t *ck = dir->ck;
  if (ck->state == CKPT_COMMITTING)
    return -EBUSY;
  if (has_visible(dir))
    return -ENOTEMPTY;
  if (ck->state == CKPT_COMMITTED) {
    /* Only the checkpoint this mount shows: start_removal found out. */
    int rc = start_removal(fs, ck);
    if (rc == 0 && ckpt__op_unflushed(ck)) /* a solo save's files are rank 0's */
      rc = ckpt__flush_drop(fs, ck->name, ck->stored.save_id,
                            ck->stored.meta && ck->stored.meta->world_size == 1
                                ? 0
                                : fs->rank);
    else if (rc == 0 && !ck->gone)
      rc = ckpt__storage_remove(fs, ck->name);
    if (rc)
      return rc;
  }
  /* A save may still hold ck for a moment: its kept stream links go now,
   * so that .staging is empty when rmdir returns. */
  if (ck->state != CKPT_COMMITTED)
    ckpt__streams_drop_kept(ck->streams);
  ckpt__node_detach(fs, dir);
  ckpt__ckpt_unref(fs, ck);
  ckpt__staging_tidy(fs->commit_fd);
  return 0;
}

void ckpt__op_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_rmdir);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  int rc = 0;
  ckpt_node_t *entry = NULL;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *n = p ? ckpt__node_child(fs, p, name) : NULL;
  if (!p)
    rc = -ESTALE;
  else if (!n || n->hidden)
    rc = -ENOENT;
  else if (!S_ISDIR(n->mode))
    rc = -ENOTDIR;
  else if (n->kind == CKPT_NODE_CKPT)
    rc = rmdir_checkpoint(fs, n);
  else if (has_visible(n))
    rc = -ENOTEMPTY;
  else if (n->kind == CKPT_NODE_CDIR)
    ckpt__node_ref(entry = n);
  else if ((rc = ckpt__op_staged_writable(n->ck)) == 0)
    ckpt__node_detach(fs, n);
  pthread_mutex_unlock(&fs->lock);
  if (entry) {
    rc = remove_entry(fs, entry);
    ckpt__op_put_node(fs, entry);
  }
  fuse_reply_err(req, -rc);
}

static bool is_ancestor(const ckpt_node_t *a, const ckpt_node_t *n) {
  for (; n; n = n->parent)
    if (n == a)
      return true;
  return false;
}

/* Rename staged checkpoint dir to the free name newname (the Hugging Face
 * Trainer's `tmp-checkpoint-N` -> `checkpoint-N`). Only this mount's
 * staged checkpoint changes its name: nothing of it is in BACKING_DIR yet
 * (spilled and streamed data is unnamed there). A committed checkpoint
 * keeps its name (EPERM), one being committed too (EBUSY). fs->lock held;
 * pr: presence of newname in BACKING_DIR, read before. */
static int rename_checkpoint(ckpt_fs_t *fs, ckpt_node_t *dir,
                             const char *newname, const presence_t *pr,
                             unsigned int flags) {
  CKPT_HELD(&fs->lock);
  ckpt_ckpt_t *ck = dir->ck;
  if (flags & ~(unsigned)RENAME_NOREPLACE)
    return -EINVAL;
  if (ck->state == CKPT_COMMITTED)
    return -EPERM;
  if (ck->state == CKPT_COMMITTING)
    return -EBUSY;
  if (strcmp(dir->name, newname) == 0)
    return 0;
  if (newname[0] == '.')
    return -EPERM;
  if (strlen(newname) > 255)
    return -ENAMETOOLONG;
  if (!ckpt_name_valid(newname))
    return -EINVAL;
  /* Never over another checkpoint, staged or committed, here or by
   * another mount (rename(2) could replace only an empty directory). */
  if (ckpt__node_child(fs, fs->root, newname) || pr->committed || pr->not_dir)
    return -EEXIST;
  if (ckpt__op_being_replaced(fs, newname))
    return -EBUSY;
  char old[sizeof(ck->name)];
  snprintf(old, sizeof(old), "%s", ck->name);
  ckpt__node_move(fs, dir, fs->root, newname);
  if (strcmp(dir->name, newname) != 0)
    return -ENOMEM; /* node_move kept the old name */
  snprintf(ck->name, sizeof(ck->name), "%s", newname);
  ckpt__log("%s: staged checkpoint renamed to %s", old, newname);
  return 0;
}

void ckpt__op_rename(fuse_req_t req, fuse_ino_t parent, const char *name,
                      fuse_ino_t newparent, const char *newname,
                      unsigned int flags) {
  ckpt__metrics_request(req, CKPT_OP_rename);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  int rc = 0;
  presence_t pr = {.committed = false};
  if (parent == FUSE_ROOT_ID && newparent == FUSE_ROOT_ID)
    pr = ckpt__op_presence(fs, newname);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *np = ckpt__node_by_ino(fs, newparent);
  ckpt_node_t *n = p ? ckpt__node_child(fs, p, name) : NULL;
  ckpt_node_t *target = np ? ckpt__node_child(fs, np, newname) : NULL;
  if (!p || !np)
    rc = -ESTALE;
  else if (!n || n->hidden)
    rc = -ENOENT;
  else if (p->kind == CKPT_NODE_ROOT && np->kind == CKPT_NODE_ROOT &&
           n->kind == CKPT_NODE_CKPT) {
    /* The freeze lock first (the lock order), so that no commit begins
     * meanwhile; n's reference keeps its checkpoint. */
    ckpt_ckpt_t *ck = n->ck;
    ckpt__node_ref(n);
    pthread_mutex_unlock(&fs->lock);
    pthread_rwlock_wrlock(&ck->freeze);
    pthread_mutex_lock(&fs->lock);
    rc = ck->dir == n && n->attached
             ? rename_checkpoint(fs, n, newname, &pr, flags)
             : -ENOENT;
    pthread_mutex_unlock(&fs->lock);
    pthread_rwlock_unlock(&ck->freeze);
    ckpt__op_put_node(fs, n);
    fuse_reply_err(req, -rc);
    return;
  } else if (p->kind == CKPT_NODE_ROOT || np->kind == CKPT_NODE_ROOT)
    rc = -EPERM; /* a checkpoint into a checkpoint, a file to the root */
  else if (ckpt__op_is_committed_kind(n->kind) || ckpt__op_is_committed_kind(np->kind))
    rc = -EROFS;
  else if (n->ck != np->ck)
    rc = -EXDEV;
  else if (n->kind == CKPT_NODE_COMMIT || n->kind == CKPT_NODE_STATUS)
    rc = -EPERM;
  else if (flags & ~(unsigned)RENAME_NOREPLACE)
    rc = -EINVAL;
  else if ((rc = ckpt__op_staged_writable(n->ck)) != 0 || (rc = ckpt__op_check_name(np, newname)))
    ;
  else if (is_ancestor(n, np))
    rc = -EINVAL;
  else if (ckpt__op_new_path_len(np, newname) +
               (n->children ? 1 + ckpt__op_subtree_path_len(n) : 0) >
           CKPT_PATH_MAX)
    rc = -ENAMETOOLONG;
  else if (target == n)
    rc = 0;
  else if (target && (flags & RENAME_NOREPLACE))
    rc = -EEXIST;
  else if (target && S_ISDIR(target->mode) != S_ISDIR(n->mode))
    rc = S_ISDIR(target->mode) ? -EISDIR : -ENOTDIR;
  else if (target && S_ISDIR(target->mode) && target->children)
    rc = -ENOTEMPTY;
  if (rc == 0 && target != n) {
    if (target)
      ckpt__node_detach(fs, target);
    ckpt__node_move(fs, n, np, newname);
  }
  pthread_mutex_unlock(&fs->lock);
  fuse_reply_err(req, -rc);
}
