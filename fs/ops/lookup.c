/*
 * lookup.c - finding names: lookup, getattr, readdir of the tree and of
 * BACKING_DIR's listing (checkpoints committed by other mounts appear,
 * removed ones go), forget, access, statfs.
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

static presence_t presence_at(ckpt_fs_t *fs, int root, const char *name,
                              uint64_t gen) {
  (void)fs;
  presence_t p = {.gen = gen};
  ckpt_entry_t e = ckpt_store_entry(root, name, &p.dir);
  p.not_dir = e == CKPT_ENTRY_OTHER;
  p.committed = e == CKPT_ENTRY_COMMITTED;
  if (!p.committed)
    return p;
  /* Its identity beyond the inode number, which a directory of a removed
   * checkpoint may pass on: its handle, else its save ID (the inode and
   * the save ID of one directory opened once). */
  ckpt_store_dir_handle(root, name, &p.handle);
  if (p.handle.len)
    return p;
  int dfd = ckpt_store_open_dir(root, name, O_PATH);
  if (dfd < 0) {
    p.committed = false; /* gone or replaced meanwhile */
    p.not_dir = dfd == -ENOTDIR || dfd == -ELOOP;
    return p;
  }
  int rc = fstat(dfd, &p.dir) ? -errno : ckpt_store_save_id(dfd, p.save_id);
  close(dfd);
  /* No .metadata any more: being removed. Unreadable: committed, with
   * no save ID (the load says why). */
  p.committed = rc != -ENOENT;
  p.id_unknown = rc != 0 && rc != -ENOENT && rc != -EIO;
  if (rc)
    p.save_id[0] = '\0';
  return p;
}

presence_t ckpt__op_presence(ckpt_fs_t *fs, const char *name) {
  uint64_t gen = atomic_load(&fs->load_gen);
  ckpt_resolved_t r; /* the save of NAME this mount serves (resolve.c) */
  ckpt__resolve(fs, name, &r);
  if (r.stale[0]) /* a kept tier copy of a save NAME is no more */
    ckpt__tier_forget(fs, name, r.stale);
  if (r.superseded) /* an unflushed one NAME changed after: dropped now */
    ckpt__flush_supersede(fs, name, r.superseded_id);
  presence_t p = presence_at(fs, r.root, name, gen);
  /* The tier's copy removed meanwhile (flushed): BACKING_DIR's */
  if (!p.committed && r.root != fs->backing_fd)
    p = presence_at(fs, fs->backing_fd, name, gen);
  return p;
}

/* Is the directory pr found the one of this identity? */
static bool same_checkpoint(const presence_t *pr, dev_t dev, ino_t ino,
                            const ckpt_dir_handle_t *handle,
                            const char *save_id) {
  if (pr->dir.st_dev != dev || pr->dir.st_ino != ino)
    return false;
  if (pr->handle.len)
    return ckpt_dir_handle_same(&pr->handle, handle);
  return pr->id_unknown || !strcmp(pr->save_id, save_id);
}

/* A committed checkpoint whose .metadata vanished from BACKING_DIR (removed
 * through another mount), or whose directory was replaced, leaves this
 * mount's view too. fs->lock held; pr as found before. */
bool ckpt__op_still_stored(ckpt_fs_t *fs, ckpt_node_t *dir,
                         const presence_t *pr) {
  CKPT_HELD(&fs->lock);
  if (dir->ck->state != CKPT_COMMITTED || dir->ck->removing ||
      dir->ck->rewriting)
    return true; /* removing: kept until rmdir NAME, so that rm -r ends;
                    rewriting: its new version is this mount's own */
  /* Loaded (by a commit of this world) after pr was looked up: pr may
   * predate the publish, it says nothing against it. */
  if (dir->ck->load_gen > pr->gen)
    return true;
  const ckpt_stored_t *s = &dir->ck->stored;
  if (pr->committed && dir->ck->has_stored &&
      same_checkpoint(pr, s->dev, s->ino, &s->handle, s->save_id))
    return true;
  ckpt_ckpt_t *ck = dir->ck;
  ckpt__node_detach(fs, dir);
  ckpt__ckpt_unref(fs, ck);
  return false;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The names of BACKING_DIR and, with a tier, of the tier (unflushed
 * checkpoints), sorted and unique. 0 or -errno. */
static int root_names(ckpt_fs_t *fs, char ***names, size_t *n) {
  int rc = ckpt__catalog_names(fs->backing_fd, names, n);
  char **tn;
  size_t nt;
  if (rc || fs->tier_fd < 0 || ckpt__catalog_names(fs->tier_fd, &tn, &nt))
    return rc;
  char **all = realloc(*names, (*n + nt + 1) * sizeof(*all));
  if (!all) {
    ckpt__catalog_names_free(tn, nt);
    return 0; /* BACKING_DIR's only, this time */
  }
  if (nt) /* an empty listing has no array at all */
    memcpy(all + *n, tn, nt * sizeof(*tn));
  free(tn); /* the names moved */
  size_t total = *n + nt, u = 0;
  qsort(all, total, sizeof(*all), by_name);
  for (size_t i = 0; i < total; i++) {
    if (u && !strcmp(all[u - 1], all[i]))
      free(all[i]);
    else
      all[u++] = all[i];
  }
  *names = all;
  *n = u;
  return 0;
}

/* BACKING_DIR's entries with their presence: the last listing while
 * BACKING_DIR's mtime is unchanged and it is younger than
 * CKPT_SCAN_MAX_AGE, else a new one (one fstatat per entry, without
 * fs->lock). A reference for the caller (ckpt__scan_put), or NULL when
 * BACKING_DIR cannot be listed. */
static ckpt_scan_t *root_scan(ckpt_fs_t *fs) {
  struct stat bst;
  bool have = fstat(fs->backing_fd, &bst) == 0;
  double now = ckpt__mono_now();
  pthread_mutex_lock(&fs->scan_lock);
  ckpt_scan_t *sc = fs->scan;
  if (sc && have && now - sc->at < CKPT_SCAN_MAX_AGE &&
      sc->mtime.tv_sec == bst.st_mtim.tv_sec &&
      sc->mtime.tv_nsec == bst.st_mtim.tv_nsec) {
    sc->refs++;
    pthread_mutex_unlock(&fs->scan_lock);
    return sc;
  }
  pthread_mutex_unlock(&fs->scan_lock);
  sc = calloc(1, sizeof(*sc));
  if (!sc || root_names(fs, &sc->names, &sc->n)) {
    free(sc);
    return NULL;
  }
  sc->pr = calloc(sc->n ? sc->n : 1, sizeof(*sc->pr));
  if (!sc->pr) {
    sc->refs = 1;
    ckpt__scan_put(sc);
    return NULL;
  }
  uint64_t gen = atomic_load(&fs->load_gen); /* before any lookup */
  for (size_t i = 0; i < sc->n; i++) {
    sc->pr[i] = ckpt__op_presence(fs, sc->names[i]);
    sc->pr[i].gen = gen;
  }
  sc->gen = gen;
  sc->mtime = bst.st_mtim;
  sc->at = now;
  sc->refs = 2; /* the caller's and the cache's */
  pthread_mutex_lock(&fs->scan_lock);
  ckpt__scan_put(fs->scan);
  fs->scan = sc;
  pthread_mutex_unlock(&fs->scan_lock);
  return sc;
}

static void scan_put(ckpt_fs_t *fs, ckpt_scan_t *sc) {
  pthread_mutex_lock(&fs->scan_lock);
  ckpt__scan_put(sc);
  pthread_mutex_unlock(&fs->scan_lock);
}

/* The presence of c's name in sc (sc NULL: not known, assume present). */
static presence_t scan_lookup(const ckpt_scan_t *sc, ckpt_node_t *c) {
  presence_t none = {.committed = false};
  if (!sc) {
    none.committed = c->ck->has_stored;
    if (c->ck->has_stored) {
      none.dir.st_dev = c->ck->stored.dev;
      none.dir.st_ino = c->ck->stored.ino;
      none.handle = c->ck->stored.handle;
      strcpy(none.save_id, c->ck->stored.save_id);
    }
    return none;
  }
  const char *key = c->name;
  char **hit = sc->n ? bsearch(&key, sc->names, sc->n, sizeof(*sc->names),
                               by_name)
                     : NULL; /* an empty listing has no array at all */
  none.gen = sc->gen; /* not listed, as of that listing */
  return hit ? sc->pr[hit - sc->names] : none;
}

/* Was this directory of name refused before? (fs->scan_lock held) */
static bool refused_before(ckpt_fs_t *fs, const char *name,
                           const presence_t *pr) {
  CKPT_HELD(&fs->scan_lock);
  for (size_t i = 0; i < fs->nrefused; i++)
    if (!strcmp(fs->refused[i].name, name))
      return same_checkpoint(pr, fs->refused[i].dev, fs->refused[i].ino,
                             &fs->refused[i].handle,
                             fs->refused[i].save_id);
  return false;
}

/* Show checkpoint name, committed in BACKING_DIR by another mount (pr:
 * its presence). A refused one is logged once and not tried again while
 * it is the same directory. Without fs->lock. */
static void load_committed(ckpt_fs_t *fs, const char *name,
                           const presence_t *pr) {
  pthread_mutex_lock(&fs->scan_lock);
  bool skip = refused_before(fs, name, pr);
  pthread_mutex_unlock(&fs->scan_lock);
  if (skip)
    return;
  char *err = NULL;
  /* ENOENT: a removal inside it on another mount exchanged the directory
   * opened for a later version and removed it meanwhile: load that one. */
  int rc = ckpt__fs_load_one(fs, name, &err);
  for (int i = 0; i < 3 && rc == -ENOENT; i++) {
    free(err);
    err = NULL;
    rc = ckpt__fs_load_one(fs, name, &err);
  }
  if (rc == 0) {
    free(err);
    return;
  }
  ckpt__log("not showing checkpoint %s: %s (left in place; see "
            "ckptfs-fsck)", name, err ? err : "unknown error");
  free(err);
  pthread_mutex_lock(&fs->scan_lock);
  size_t i = 0;
  while (i < fs->nrefused && strcmp(fs->refused[i].name, name))
    i++;
  if (i == fs->nrefused) {
    ckpt_refused_t *grown =
        realloc(fs->refused, (fs->nrefused + 1) * sizeof(*grown));
    char *copy = strdup(name);
    if (grown)
      fs->refused = grown;
    if (grown && copy)
      fs->refused[fs->nrefused++].name = copy;
    else
      free(copy), i = SIZE_MAX;
  }
  if (i != SIZE_MAX) {
    fs->refused[i].dev = pr->dir.st_dev;
    fs->refused[i].ino = pr->dir.st_ino;
    fs->refused[i].handle = pr->handle;
    strcpy(fs->refused[i].save_id, pr->save_id);
  }
  pthread_mutex_unlock(&fs->scan_lock);
}

/* Show the checkpoints of sc committed by other mounts that this mount
 * does not know yet. */
static void load_new(ckpt_fs_t *fs, const ckpt_scan_t *sc) {
  if (!sc)
    return;
  bool *todo = calloc(sc->n ? sc->n : 1, sizeof(*todo));
  if (!todo)
    return;
  size_t n = 0;
  pthread_mutex_lock(&fs->lock);
  for (size_t i = 0; i < sc->n; i++)
    if (sc->pr[i].committed && !ckpt__ckpt_lookup(fs, sc->names[i]))
      todo[i] = true, n++;
  pthread_mutex_unlock(&fs->lock);
  for (size_t i = 0; n && i < sc->n; i++)
    if (todo[i])
      load_committed(fs, sc->names[i], &sc->pr[i]);
  free(todo);
}

void ckpt__op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_lookup);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  struct fuse_entry_param e;
  int rc = 0;
  /* FUSE passes names up to 1024 bytes; no file here has a longer one
   * than NAME_MAX. Every call on a path looks its names up first, so this
   * is what stat, open, mkdir, unlink, rename... return for one. */
  if (strlen(name) > NAME_MAX) {
    fuse_reply_err(req, ENAMETOOLONG);
    return;
  }
  presence_t pr = {.committed = false};
  bool root = parent == FUSE_ROOT_ID;
  if (root)
    pr = ckpt__op_presence(fs, name);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *n = p ? ckpt__node_child(fs, p, name) : NULL;
  if (n && p->kind == CKPT_NODE_ROOT && !ckpt__op_still_stored(fs, n, &pr))
    n = NULL;
  if (root && p && !n && pr.committed) {
    /* Committed by another mount: shown from now on. */
    pthread_mutex_unlock(&fs->lock);
    load_committed(fs, name, &pr);
    pthread_mutex_lock(&fs->lock);
    p = ckpt__node_by_ino(fs, parent);
    n = p ? ckpt__node_child(fs, p, name) : NULL;
  }
  if (!p)
    rc = -ESTALE;
  else if ((!n || n->kind == CKPT_NODE_CBLOCK) && ckpt__block_name(p, name))
    rc = ckpt__block_lookup(fs, p, name, &n); /* a block file */
  else if (!n || n->hidden)
    rc = -ENOENT;
  else if (n->kind == CKPT_NODE_VROOT && ckpt__views_populate(fs, n) < 0)
    rc = -ENOMEM; /* a view is filled at its first lookup */
  if (rc == 0)
    ckpt__op_fill_entry(fs, n, &e);
  pthread_mutex_unlock(&fs->lock);
  if (rc) {
    fuse_reply_err(req, -rc); /* replies take positive errno */
  } else if (fuse_reply_entry(req, &e) != 0) {
    /* The kernel never saw this lookup (interrupted): it will never
     * forget it either. Only block files count lookups. */
    pthread_mutex_lock(&fs->lock);
    ckpt_node_t *b = ckpt__node_by_ino_any(fs, e.ino);
    if (b)
      ckpt__block_forget(fs, b, 1);
    pthread_mutex_unlock(&fs->lock);
  }
}

void ckpt__op_getattr(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_getattr);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  struct stat st;
  double timeout = 0;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = fi && fi->fh ? ckpt__op_handle_of(fi)->node
                                : ckpt__node_by_ino_any(fs, ino);
  if (n) {
    ckpt__op_fill_attr(fs, n, &st);
    timeout = ckpt__op_node_timeout(n);
  }
  pthread_mutex_unlock(&fs->lock);
  if (!n)
    fuse_reply_err(req, ESTALE);
  else
    fuse_reply_attr(req, &st, timeout);
}

/* ------------------------------------------------------------------------
 * Directories: a snapshot of the entries at each readdir from offset 0.
 * ---------------------------------------------------------------------- */

static int add_dirent(fuse_req_t req, ckpt_buf_t *b, const char *name,
                      const struct stat *st) {
  size_t need = fuse_add_direntry(req, NULL, 0, name, NULL, 0);
  int rc = ckpt_buf_reserve(b, need);
  if (rc)
    return rc;
  fuse_add_direntry(req, (char *)b->data + b->len, need, name, st,
                    (off_t)(b->len + need));
  b->len += need;
  return 0;
}

/* The entries of directory n into b; sc: BACKING_DIR's entries when n is
 * the root. fs->lock held. */
static int list_dir(fuse_req_t req, ckpt_fs_t *fs, ckpt_node_t *n,
                    const ckpt_scan_t *sc, ckpt_buf_t *b) {
  CKPT_HELD(&fs->lock);
  struct stat st = {.st_ino = n->ino, .st_mode = S_IFDIR};
  int rc = add_dirent(req, b, ".", &st);
  st.st_ino = n->parent ? n->parent->ino : n->ino;
  if (rc == 0)
    rc = add_dirent(req, b, "..", &st);
  for (ckpt_node_t *c = n->children, *nx; c && rc == 0; c = nx) {
    nx = c->next;
    if (c->hidden || c->kind == CKPT_NODE_COMMIT ||
        c->kind == CKPT_NODE_STATUS || c->kind == CKPT_NODE_VROOT ||
        c->kind == CKPT_NODE_CBLOCK)
      continue;
    if (n->kind == CKPT_NODE_ROOT && c->ck->state == CKPT_COMMITTED) {
      presence_t pr = scan_lookup(sc, c);
      if (!ckpt__op_still_stored(fs, c, &pr))
        continue;
    }
    st.st_ino = c->ino;
    st.st_mode = c->mode;
    rc = add_dirent(req, b, c->name, &st);
  }
  return rc;
}

void ckpt__op_opendir(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_opendir);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  int rc = 0;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino(fs, ino);
  if (!n)
    rc = -ESTALE;
  else if (!S_ISDIR(n->mode))
    rc = -ENOTDIR;
  handle_t *h = rc == 0 ? ckpt__op_new_handle(n) : NULL;
  if (rc == 0 && !h)
    rc = -ENOMEM;
  if (rc == 0) {
    ckpt__node_ref(n);
    ckpt__op_track_handle(fs, h);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc) {
    fuse_reply_err(req, -rc);
    return;
  }
  fi->fh = (uintptr_t)h;
  fuse_reply_open(req, fi);
}

void ckpt__op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_readdir);
  (void)ino;
  handle_t *h = ckpt__op_handle_of(fi);
  if (off == 0 || !h->text) {
    /* A snapshot of the entries at each pass from the start: a rewinddir
     * (or a listing through an fd opened earlier) sees the directory as
     * it is now. */
    ckpt_fs_t *fs = ckpt__op_fs_of(req);
    ckpt_buf_t b;
    ckpt_buf_init(&b);
    ckpt_scan_t *sc = NULL;
    if (h->node->kind == CKPT_NODE_ROOT) {
      sc = root_scan(fs);
      load_new(fs, sc); /* committed by other mounts meanwhile */
    }
    pthread_mutex_lock(&fs->lock);
    int rc = list_dir(req, fs, h->node, sc, &b);
    pthread_mutex_unlock(&fs->lock);
    if (sc)
      scan_put(fs, sc);
    if (rc) {
      ckpt_buf_free(&b);
      fuse_reply_err(req, -rc);
      return;
    }
    free(h->text);
    h->len = b.len;
    h->text = ckpt_buf_steal(&b);
  }
  /* Entries end on offsets we gave; send whole entries up to size. */
  size_t start = (uint64_t)off < h->len ? (size_t)off : h->len;
  size_t end = start;
  while (end < h->len) {
    const struct fuse_dirent {
      uint64_t ino, off;
      uint32_t namelen, type;
    } *d = (const void *)(h->text + end);
    size_t next = (size_t)d->off;
    if (next - start > size)
      break;
    end = next;
  }
  ckpt__op_reply_copy(req, h->text + start, end - start);
}

/* ------------------------------------------------------------------------
 * The mount.
 * ---------------------------------------------------------------------- */

/* The kernel dropped inodes: only block files live by the kernel's
 * lookups (every other node stays in the tree while its entry exists). */
void ckpt__op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  ckpt__metrics_request(req, CKPT_OP_forget);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  if (n)
    ckpt__block_forget(fs, n, nlookup);
  pthread_mutex_unlock(&fs->lock);
  fuse_reply_none(req);
}

void ckpt__op_forget_multi(fuse_req_t req, size_t count,
                            struct fuse_forget_data *forgets) {
  ckpt__metrics_request(req, CKPT_OP_forget); /* a batch: one request */
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  pthread_mutex_lock(&fs->lock);
  for (size_t i = 0; i < count; i++) {
    ckpt_node_t *n = ckpt__node_by_ino_any(fs, forgets[i].ino);
    if (n)
      ckpt__block_forget(fs, n, forgets[i].nlookup);
  }
  pthread_mutex_unlock(&fs->lock);
  fuse_reply_none(req);
}

/* Is the caller of req in group gid (primary or supplementary)? */
static bool in_group(fuse_req_t req, gid_t gid) {
  if (fuse_req_ctx(req)->gid == gid)
    return true;
  gid_t groups[64];
  int n = fuse_req_getgroups(req, 64, groups);
  for (int i = 0; i < n && i < 64; i++)
    if (groups[i] == gid)
      return true;
  return false;
}

/* access(2) without -o default_permissions (with it the kernel checks the
 * modes itself and never asks). Reading is open to every caller and
 * changes to the mounting user and root (ckpt__op_may_change), as the requests
 * themselves are; what the kernel cannot know is the execute bit: as in
 * the kernel's generic_permission, a file with no execute bit is not
 * executable even by root, and another caller needs the bit of its class.
 * Committed data and .status cannot be opened for writing (EACCES, as
 * their modes say). */
void ckpt__op_access(fuse_req_t req, fuse_ino_t ino, int mask) {
  ckpt__metrics_request(req, CKPT_OP_access);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  mode_t mode = n ? n->mode : 0;
  uid_t uid = n ? n->uid : 0;
  gid_t gid = n ? n->gid : 0;
  bool read_only = n && !S_ISDIR(mode) &&
                   (ckpt__op_is_committed_kind(n->kind) || n->kind == CKPT_NODE_STATUS);
  pthread_mutex_unlock(&fs->lock);
  int rc = 0;
  if (!n) {
    rc = -ESTALE;
  } else if ((mask & W_OK) && !ckpt__op_may_change(req)) {
    rc = -EACCES;
  } else if ((mask & W_OK) && read_only) {
    rc = -EACCES; /* as its mode says (no write bit): rm then asks, as for
                    any read-only file; EROFS would make it refuse */
  } else if ((mask & X_OK) && !S_ISDIR(mode)) {
    mode_t bit = ctx->uid == 0    ? (S_IXUSR | S_IXGRP | S_IXOTH)
                 : ctx->uid == uid ? S_IXUSR
                 : in_group(req, gid) ? S_IXGRP
                                      : S_IXOTH;
    if (!(mode & bit))
      rc = -EACCES;
  }
  fuse_reply_err(req, -rc);
}

void ckpt__op_statfs(fuse_req_t req, fuse_ino_t ino) {
  ckpt__metrics_request(req, CKPT_OP_statfs);
  (void)ino;
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  struct statvfs sv;
  if (fstatvfs(fs->backing_fd, &sv))
    fuse_reply_err(req, errno);
  else
    fuse_reply_statfs(req, &sv);
}

void ckpt__scan_put(ckpt_scan_t *sc) {
  if (!sc || --sc->refs)
    return;
  ckpt__catalog_names_free(sc->names, sc->n);
  free(sc->pr);
  free(sc);
}
