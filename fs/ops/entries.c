/*
 * entries.c - making entries: mkdir (a checkpoint, or a staged
 * directory), create and mknod of staged files, setattr, fallocate, and
 * the refusal of what a checkpoint cannot hold (symlinks, links, devices).
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

void ckpt__op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr,
                       int to_set, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_setattr);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__op_node_of(fs, ino, fi);
  if (n)
    ckpt__node_ref(n);
  pthread_mutex_unlock(&fs->lock);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int rc = 0;
  if (n->kind == CKPT_NODE_COMMIT) {
    /* `echo sync > .commit` truncates first: nothing to do. */
  } else if (n->kind == CKPT_NODE_ROOT) {
    rc = -EPERM;
  } else if (ckpt__op_is_committed_kind(n->kind) || n->kind == CKPT_NODE_STATUS) {
    rc = -EROFS;
  } else {
    bool changing = (rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0;
    if (rc == 0 && (to_set & FUSE_SET_ATTR_SIZE)) {
      if (n->kind != CKPT_NODE_SFILE)
        rc = -EISDIR;
      else
        rc = ckpt__sfile_truncate(n->u.sf, (uint64_t)attr->st_size);
      if (rc == 0)
        ckpt__op_write_kills_suidgid(fs, req, n);
    }
    if (rc == 0) {
      pthread_mutex_lock(&fs->lock);
      if (to_set & FUSE_SET_ATTR_MODE)
        n->mode = (n->mode & S_IFMT) | (attr->st_mode & 07777);
      else if (to_set & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))
        ckpt__op_kill_suidgid(n); /* a chown (the kernel asks, KILLPRIV_V2) */
      if (to_set & FUSE_SET_ATTR_UID)
        n->uid = attr->st_uid;
      if (to_set & FUSE_SET_ATTR_GID)
        n->gid = attr->st_gid;
      if (to_set & FUSE_SET_ATTR_MTIME)
        n->mtime = attr->st_mtim;
      if (to_set & (FUSE_SET_ATTR_MTIME_NOW | FUSE_SET_ATTR_SIZE))
        clock_gettime(CLOCK_REALTIME, &n->mtime);
      if (n->kind == CKPT_NODE_SFILE &&
          (to_set & (FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW |
                     FUSE_SET_ATTR_SIZE)))
        ckpt__sfile_pt_set_mtime(n->u.sf, &n->mtime);
      if (to_set & FUSE_SET_ATTR_ATIME)
        n->atime = attr->st_atim;
      if (to_set & FUSE_SET_ATTR_ATIME_NOW)
        clock_gettime(CLOCK_REALTIME, &n->atime);
      clock_gettime(CLOCK_REALTIME, &n->ctime);
      pthread_mutex_unlock(&fs->lock);
    }
    if (changing)
      ckpt__op_staged_change_end(n->ck);
  }
  if (rc) {
    fuse_reply_err(req, -rc);
  } else {
    struct stat st;
    pthread_mutex_lock(&fs->lock);
    ckpt__op_fill_attr(fs, n, &st);
    pthread_mutex_unlock(&fs->lock);
    fuse_reply_attr(req, &st, ckpt__op_node_timeout(n));
  }
  ckpt__op_put_node(fs, n);
}

/* ------------------------------------------------------------------------
 * Namespace changes.
 * ---------------------------------------------------------------------- */

/* A new name in staged directory p: any file name (dot-files too), but
 * directly under the checkpoint not one ckptfs serves there itself:
 * 0, -EPERM (reserved, logged), -EINVAL or -ENAMETOOLONG. */
int ckpt__op_check_name(const ckpt_node_t *p, const char *name) {
  int32_t rank;
  uint32_t k;
  if (p->kind == CKPT_NODE_CKPT && ckpt_data_file_parse(name, &rank, &k) == 0) {
    /* Stock DCP's FileSystemWriter: its .metadata, a pickle that stock
     * dcp.load reads by that name, cannot be served where .metadata is the
     * checkpoint's SQLite database, so it is stopped before its first
     * data file, with nothing half-written. */
    ckpt__log("%s/%s: refused: this is stock DCP's FileSystemWriter "
              "(dcp.save(checkpoint_id=PATH)), whose pickled .metadata "
              "cannot be served here; save with "
              "storage_writer=ckptfs.dcp.Writer(mount) and load with "
              "ckptfs.dcp.Reader(mount) (stock DCP with ckptfs's storage), "
              "or import a DCP directory with ckptctl import-dcp",
              p->ck->name, name);
    return -EPERM;
  }
  int rc = ckpt_entry_name_check(name, strlen(name),
                                 p->kind == CKPT_NODE_CKPT);
  if (rc == -EPERM) {
    char shown[300];
    ckpt__op_log_text(shown, sizeof(shown), name, strlen(name));
    ckpt__log("%s/%s: refused: reserved name (ckptfs serves .commit, "
              ".status, .metadata, .npy, .safetensors and block files "
              ".NAME[...] directly under a checkpoint; any other name is "
              "allowed, and these are inside its directories)",
              p->ck->name, shown);
  }
  return rc;
}

/* Checks for a new entry `name` in directory p (fs->lock held). */
static int can_add(ckpt_fs_t *fs, ckpt_node_t *p, const char *name) {
  CKPT_HELD(&fs->lock);
  if (p->kind == CKPT_NODE_ROOT)
    return -EPERM;
  if (p->kind != CKPT_NODE_CKPT && p->kind != CKPT_NODE_SDIR)
    return ckpt__op_is_committed_kind(p->kind) ? -EROFS : -ENOTDIR;
  int rc = ckpt__op_staged_writable(p->ck);
  if (rc)
    return rc;
  if ((rc = ckpt__op_check_name(p, name)) != 0)
    return rc;
  if (ckpt__op_new_path_len(p, name) > CKPT_PATH_MAX)
    return -ENAMETOOLONG;
  return ckpt__node_child(fs, p, name) ? -EEXIST : 0;
}

/* Is name the TARGET of a replace= commit in flight on this mount? It is
 * taken meanwhile: no mkdir or rename may stage a checkpoint under it.
 * fs->lock held. */
bool ckpt__op_being_replaced(ckpt_fs_t *fs, const char *name) {
  CKPT_HELD(&fs->lock);
  for (ckpt_node_t *c = fs->root->children; c; c = c->next)
    if (c->ck && strcmp(c->ck->replacing, name) == 0)
      return true;
  return false;
}

static int mkdir_checkpoint(ckpt_fs_t *fs, const char *name,
                            const presence_t *pr, ckpt_node_t **out) {
  if (name[0] == '.')
    return -EPERM;
  if (strlen(name) > 255)
    return -ENAMETOOLONG;
  if (!ckpt_name_valid(name))
    return -EINVAL;
  if (ckpt__op_being_replaced(fs, name))
    return -EBUSY;
  ckpt_node_t *old = ckpt__ckpt_lookup(fs, name);
  if (old && ckpt__op_still_stored(fs, old, pr))
    return -EEXIST;
  if (pr->committed)
    return -EEXIST; /* committed by another world sharing BACKING_DIR */
  /* Something else has the name in BACKING_DIR (a file, a symlink): the
   * commit could not create the directory, so refuse the name now. */
  if (pr->not_dir)
    return -EEXIST;
  ckpt_ckpt_t *ck = ckpt__ckpt_new(fs, name);
  if (!ck)
    return -ENOMEM;
  ck->streams = ckpt__streams_new(fs->commit_fd, fs->rank, name,
                                  fs->opts.io_threads);
  *out = ck->dir;
  return 0;
}

void ckpt__op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name,
                     mode_t mode) {
  ckpt__metrics_request(req, CKPT_OP_mkdir);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  ckpt_node_t *n = NULL;
  int rc;
  presence_t pr = {.committed = false};
  pid_t job = 0; /* a job process's: abandoned if it exits (jobs.c) */
  if (parent == FUSE_ROOT_ID) {
    pr = ckpt__op_presence(fs, name);
    job = ckpt__job_of(fs, ctx->pid);
  }
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  if (!p)
    rc = -ESTALE;
  else if (p->kind == CKPT_NODE_ROOT) {
    if ((rc = mkdir_checkpoint(fs, name, &pr, &n)) == 0) {
      n->mode = S_IFDIR | (mode & 07777); /* the commit keeps it */
      n->ck->job = job;
    }
  } else if ((rc = can_add(fs, p, name)) == 0)
    rc = (n = ckpt__node_new(fs, p, name, CKPT_NODE_SDIR,
                             S_IFDIR | (mode & 07777), p->ck))
             ? 0
             : -ENOMEM;
  if (rc == 0) {
    n->uid = ctx->uid;
    n->gid = ctx->gid;
    ckpt__op_fill_entry(fs, n, &e);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    fuse_reply_entry(req, &e);
}

/* user.ckpt.mkdirs on staged directory dir: mkdir -p of many directories
 * in one request (a new directory costs a LOOKUP, a MKDIR and a LOOKUP
 * each otherwise). The value is MODE NUL, then records PATH NUL, PATH
 * relative to dir; MODE (octal, at most 07777) is every new directory's,
 * owned by the caller as a MKDIR's. Directories already there are kept;
 * made in order, the first that fails ends it with its error (logged),
 * those made before it stay. */
int ckpt__op_mkdirs(ckpt_fs_t *fs, ckpt_node_t *dir, const char *value,
                    size_t size, const struct fuse_ctx *ctx) {
  if (size == 0 || value[size - 1] != '\0')
    return -EINVAL;
  char *endp;
  unsigned long mode = strtoul(value, &endp, 8);
  if (value[0] < '0' || value[0] > '7' || *endp != '\0' || endp - value > 5 ||
      mode > 07777)
    return -EINVAL;
  int rc = ckpt__op_staged_change_begin(fs, dir->ck);
  if (rc)
    return rc;
  const char *end = value + size;
  for (const char *p = endp + 1; rc == 0 && p < end; p += strlen(p) + 1) {
    pthread_mutex_lock(&fs->lock);
    ckpt_node_t *n = dir;
    if (!dir->attached) /* removed, still open: nothing may be made in it */
      rc = -ENOENT;
    for (const char *c = p; rc == 0 && *c;) {
      const char *slash = strchr(c, '/');
      size_t len = slash ? (size_t)(slash - c) : strlen(c);
      char name[NAME_MAX + 1];
      if (len == 0 || len > NAME_MAX || (len == 1 && c[0] == '.') ||
          (len == 2 && c[0] == '.' && c[1] == '.')) {
        rc = -EINVAL;
        break;
      }
      memcpy(name, c, len);
      name[len] = '\0';
      ckpt_node_t *child = NULL;
      if (!ckpt__op_may_search_node(ctx, n)) {
        rc = -EACCES; /* as a path through n would be */
      } else if ((child = ckpt__node_child(fs, n, name)) &&
                 child->kind != CKPT_NODE_SDIR) {
        rc = slash && slash[1] ? -ENOTDIR : -EEXIST; /* as mkdir -p */
      } else if (!child && !ckpt__op_may_write_node(ctx, n)) {
        rc = -EACCES; /* as a mkdir in n would be */
      } else if (!child && (rc = can_add(fs, n, name)) == 0) {
        /* as mkdir(2): no set-ID bits from the mode */
        child = ckpt__node_new(fs, n, name, CKPT_NODE_SDIR,
                               S_IFDIR | ((mode_t)mode & 01777), n->ck);
        if (child) {
          child->uid = ctx->uid;
          child->gid = ctx->gid;
        } else {
          rc = -ENOMEM;
        }
      }
      if (rc == 0)
        n = child;
      c = slash ? slash + 1 : c + len;
    }
    pthread_mutex_unlock(&fs->lock);
    if (rc == 0 && *p == '\0')
      rc = -EINVAL; /* an empty path */
    if (rc) {
      char shown[300];
      ckpt__op_log_text(shown, sizeof(shown), p, strlen(p));
      ckpt__log("%s: user.ckpt.mkdirs: \"%s\": %s", dir->ck->name, shown,
                strerror(-rc));
    }
  }
  ckpt__op_staged_change_end(dir->ck);
  return rc;
}

/* A new empty staged file name in staged directory p, owned by the caller
 * (create, mknod). fs->lock held. */
static int new_staged_file(ckpt_fs_t *fs, ckpt_node_t *p, const char *name,
                           mode_t mode, const struct fuse_ctx *ctx,
                           ckpt_node_t **out) {
  CKPT_HELD(&fs->lock);
  int rc = can_add(fs, p, name);
  if (rc)
    return rc;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fs->staging, p->ck->streams);
  ckpt_node_t *n = sf ? ckpt__node_new(fs, p, name, CKPT_NODE_SFILE,
                                       S_IFREG | (mode & 07777), p->ck)
                      : NULL;
  if (!n) {
    ckpt__sfile_free(sf);
    return -ENOMEM;
  }
  n->u.sf = sf;
  ckpt__sfile_add_name(sf, n); /* the first: never EMLINK */
  n->uid = ctx->uid;
  n->gid = ctx->gid;
  *out = n;
  return 0;
}

void ckpt__op_create(fuse_req_t req, fuse_ino_t parent, const char *name,
                      mode_t mode, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_create);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  ckpt_node_t *n = NULL;
  handle_t *h = NULL;
  int rc;
  /* a new file with set-ID bits, passed through: its writes unseen here */
  bool kill = ckpt__op_has_suidgid(S_IFREG | (mode & 07777)) && ckpt__op_lacks_fsetid(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  if (!p) {
    rc = -ESTALE;
  } else if (p->kind == CKPT_NODE_CKPT && strcmp(name, ".commit") == 0) {
    n = ckpt__node_child(fs, p, name); /* `echo sync > .commit` */
    rc = n ? 0 : -ENOENT;
  } else {
    rc = new_staged_file(fs, p, name, mode, ctx, &n);
  }
  if (rc == 0 && !(h = ckpt__op_new_handle(n)))
    rc = -ENOMEM;
  if (rc == 0) {
    ckpt__node_ref(n);
    ckpt__op_track_handle(fs, h);
    h->writer = n->kind == CKPT_NODE_SFILE;
    fi->fh = (uintptr_t)h;
    fi->direct_io = n->kind == CKPT_NODE_COMMIT || ckpt__op_writes_direct(n, fi);
    if (n->kind == CKPT_NODE_SFILE && (fi->flags & O_ACCMODE) != O_RDONLY)
      ckpt__op_pt_open(req, n, h, fi, true); /* else the daemon's path */
    if (kill && h->pt)
      ckpt__op_kill_suidgid(n);
    ckpt__op_fill_entry(fs, n, &e);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else if (fuse_reply_create(req, &e, fi))
    ckpt__op_drop_handle(req, h); /* the opener is gone: no release will come */
}

/* A checkpoint holds regular files, directories and symbolic links:
 * device nodes, FIFOs and sockets are refused with EPERM (what POSIX says
 * for a filesystem that does not support the kind of node; the kernel's
 * answer for an operation the daemon lacks, ENOSYS, reads as a bug) and
 * a line saying so. */
static void refuse_node(fuse_req_t req, fuse_ino_t parent, const char *name,
                        const char *what) {
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  char shown[300], ck[300] = "";
  ckpt__op_log_text(shown, sizeof(shown), name, strlen(name));
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  if (p && p->ck)
    ckpt__op_log_text(ck, sizeof(ck), p->ck->name, strlen(p->ck->name));
  pthread_mutex_unlock(&fs->lock);
  ckpt__log("%s (in %s): refused: a %s; a checkpoint holds regular files, "
            "directories and links only", shown,
            ck[0] ? ck : "the mount's root", what);
  fuse_reply_err(req, EPERM);
}

/* A symbolic link in a staged checkpoint: kept as written (any target,
 * inside the checkpoint or not, dangling or not: the daemon never
 * follows it) and committed as a link. */
void ckpt__op_symlink(fuse_req_t req, const char *link, fuse_ino_t parent,
                       const char *name) {
  ckpt__metrics_request(req, CKPT_OP_symlink);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  size_t tlen = strlen(link);
  char *target = tlen && tlen <= CKPT_LINK_TARGET_MAX ? strdup(link) : NULL;
  int rc = tlen == 0                       ? -ENOENT
           : tlen > CKPT_LINK_TARGET_MAX   ? -ENAMETOOLONG
           : !target                       ? -ENOMEM
                                           : 0;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = rc ? NULL : ckpt__node_by_ino(fs, parent), *n = NULL;
  if (rc == 0 && !p)
    rc = -ESTALE;
  if (rc == 0 && (rc = can_add(fs, p, name)) == 0 &&
      !(n = ckpt__node_new(fs, p, name, CKPT_NODE_SLINK, S_IFLNK | 0777,
                           p->ck)))
    rc = -ENOMEM;
  if (rc == 0) {
    n->u.target = target;
    target = NULL;
    n->uid = ctx->uid;
    n->gid = ctx->gid;
    ckpt__op_fill_entry(fs, n, &e);
  }
  pthread_mutex_unlock(&fs->lock);
  free(target);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    fuse_reply_entry(req, &e);
}

void ckpt__op_readlink(fuse_req_t req, fuse_ino_t ino) {
  ckpt__metrics_request(req, CKPT_OP_readlink);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  char *copy = NULL;
  int rc = 0;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  const char *t = !n                          ? NULL
                  : n->kind == CKPT_NODE_SLINK ? n->u.target
                  : n->kind == CKPT_NODE_CLINK && n->entry
                      ? n->ck->meta->entries[n->entry - 1].target
                      : NULL;
  if (!n)
    rc = -ESTALE;
  else if (!t)
    rc = -EINVAL; /* not a link */
  else if (!(copy = strdup(t)))
    rc = -ENOMEM;
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    fuse_reply_readlink(req, copy);
  free(copy);
}

/* Whether staged file n may get a name in directory np. fs->lock held. */
static int can_link(ckpt_fs_t *fs, ckpt_node_t *n, ckpt_node_t *np,
                    const char *name) {
  if (ckpt__op_is_committed_kind(n->kind) ||
      ckpt__op_is_committed_kind(np->kind))
    return -EROFS;
  if (n->kind != CKPT_NODE_SFILE)
    return -EPERM; /* links of links, of .commit, .status: not kept */
  if (np->ck != n->ck)
    return -EXDEV; /* two checkpoints are two trees */
  return can_add(fs, np, name);
}

/* A hard link in a staged checkpoint: another name of the same staged
 * file (its bytes, xattrs and inode number); the commit stores the bytes
 * once, under the first name, and keeps the others as its names. */
void ckpt__op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent,
                    const char *newname) {
  ckpt__metrics_request(req, CKPT_OP_link);
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  struct fuse_entry_param e;
  int rc;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino(fs, ino);
  ckpt_node_t *np = ckpt__node_by_ino(fs, newparent), *m = NULL;
  if (!n || !np)
    rc = -ESTALE;
  else if ((rc = can_link(fs, n, np, newname)) == 0 &&
           n->u.sf->nnames == CKPT_SFILE_NAMES_MAX)
    rc = -EMLINK;
  else if (rc == 0 && !(m = ckpt__node_new(fs, np, newname, CKPT_NODE_SFILE,
                                           n->mode, n->ck)))
    rc = -ENOMEM;
  if (rc == 0) {
    m->u.sf = n->u.sf;
    ckpt__sfile_add_name(n->u.sf, m);
    m->uid = n->uid;
    m->gid = n->gid;
    m->mtime = n->mtime;
    clock_gettime(CLOCK_REALTIME, &n->ctime);
    m->ctime = n->ctime;
    ckpt__op_fill_entry(fs, m, &e);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    fuse_reply_entry(req, &e);
}

/* mknod(2) of a regular file makes an empty staged file (as creat would);
 * other kinds of node are refused. */
void ckpt__op_mknod(fuse_req_t req, fuse_ino_t parent, const char *name,
                     mode_t mode, dev_t rdev) {
  ckpt__metrics_request(req, CKPT_OP_mknod);
  (void)rdev;
  if (!S_ISREG(mode)) {
    refuse_node(req, parent, name,
                S_ISFIFO(mode)   ? "FIFO"
                : S_ISSOCK(mode) ? "socket"
                                 : "device node");
    return;
  }
  if (!ckpt__op_may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  int rc;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *n = NULL;
  if (!p)
    rc = -ESTALE;
  else if ((rc = new_staged_file(fs, p, name, mode, ctx, &n)) == 0)
    ckpt__op_fill_entry(fs, n, &e); /* as mkdir: nodes live while attached */
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    fuse_reply_entry(req, &e);
}

/* fallocate(2) of a staged file: allocation is a no-op here (RAM and the
 * spill file are used as bytes are written), but its effects on the
 * bytes are kept: mode 0 and ZERO_RANGE extend the file unless
 * KEEP_SIZE, PUNCH_HOLE and ZERO_RANGE make the range read as zeros. */
void ckpt__op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode,
                         off_t offset, off_t length,
                         struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_fallocate);
  (void)ino;
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_handle_of(fi)->node;
  int rc = 0;
  const int known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE |
                    FALLOC_FL_ZERO_RANGE;
  if (n->kind != CKPT_NODE_SFILE)
    rc = ckpt__op_is_committed_kind(n->kind) ? -EROFS : -EBADF;
  else if (mode & ~known)
    rc = -EOPNOTSUPP; /* COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE */
  else if ((mode & FALLOC_FL_PUNCH_HOLE) &&
           (!(mode & FALLOC_FL_KEEP_SIZE) || (mode & FALLOC_FL_ZERO_RANGE)))
    rc = -EINVAL; /* as the kernel requires */
  else if (offset < 0 || length <= 0)
    rc = -EINVAL;
  else if ((uint64_t)offset + (uint64_t)length > ((uint64_t)1 << 40))
    rc = -EFBIG;
  if (rc == 0 && (rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
    uint64_t end = (uint64_t)offset + (uint64_t)length;
    if (mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE))
      rc = ckpt__sfile_zero(n->u.sf, (uint64_t)offset, (uint64_t)length);
    if (rc == 0 && !(mode & FALLOC_FL_KEEP_SIZE) &&
        end > ckpt__sfile_size(n->u.sf))
      rc = ckpt__sfile_truncate(n->u.sf, end);
    if (rc == 0)
      ckpt__op_touch_data(fs, n);
    ckpt__op_staged_change_end(n->ck);
  }
  fuse_reply_err(req, -rc);
}
