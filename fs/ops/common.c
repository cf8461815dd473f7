/*
 * common.c - what every request family of ops/ shares: a request's node
 * (resolved and referenced under fs->lock), the checks before a staged
 * change, attributes and entries as replied, and the open handles.
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

ckpt_fs_t *ckpt__op_fs_of(fuse_req_t req) { return fuse_req_userdata(req); }

handle_t *ckpt__op_handle_of(struct fuse_file_info *fi) {
  return (handle_t *)(uintptr_t)fi->fh;
}

/* Resolve and reference ino; NULL if it is gone. */
ckpt_node_t *ckpt__op_get_node(ckpt_fs_t *fs, fuse_ino_t ino) {
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino(fs, ino);
  if (n)
    ckpt__node_ref(n);
  pthread_mutex_unlock(&fs->lock);
  return n;
}

/* Also a node detached while something still holds it: the kernel sends
 * no handle with fchmod, fchown, futimens and the f*xattr calls, so an
 * open file that was unlinked (or a removed directory still open) is
 * found by its inode alone, as getattr finds it. */
ckpt_node_t *ckpt__op_get_node_any(ckpt_fs_t *fs, fuse_ino_t ino) {
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  if (n)
    ckpt__node_ref(n);
  pthread_mutex_unlock(&fs->lock);
  return n;
}

/* The node of a setattr, which may come with an open handle (ftruncate):
 * the handle's node, which lives on after unlink or commit detached it
 * from the tree, else the node of ino, detached ones included (fchmod
 * and futimens come without a handle). fs->lock held. */
ckpt_node_t *ckpt__op_node_of(ckpt_fs_t *fs, fuse_ino_t ino,
                            struct fuse_file_info *fi) {
  CKPT_HELD(&fs->lock);
  if (fi && fi->fh)
    return ckpt__op_handle_of(fi)->node;
  return ckpt__node_by_ino_any(fs, ino);
}

void ckpt__op_put_node(ckpt_fs_t *fs, ckpt_node_t *n) {
  pthread_mutex_lock(&fs->lock);
  ckpt__node_unref(fs, n);
  pthread_mutex_unlock(&fs->lock);
}

/* May the staged contents of ck change? 0, -EBUSY or -EROFS. fs->lock. */
int ckpt__op_staged_writable(const ckpt_ckpt_t *ck) {
  switch (ck->state) {
  case CKPT_STAGING:
  case CKPT_FAILED:
    return 0;
  case CKPT_COMMITTING:
    return -EBUSY;
  case CKPT_COMMITTED:
    return -EROFS;
  }
  return -EIO;
}

/* Begin a change of ck's staged data: holds the freeze lock shared (a
 * commit cannot freeze meanwhile) when it returns 0; then end it with
 * ckpt__op_staged_change_end. -EBUSY / -EROFS when the staged data cannot change. */
int ckpt__op_staged_change_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  pthread_rwlock_rdlock(&ck->freeze);
  pthread_mutex_lock(&fs->lock);
  int rc = ckpt__op_staged_writable(ck);
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    pthread_rwlock_unlock(&ck->freeze);
  return rc;
}

void ckpt__op_staged_change_end(ckpt_ckpt_t *ck) {
  pthread_rwlock_unlock(&ck->freeze);
}

/* Length of the path of a new entry `name` in staged directory p (fs->lock
 * held): "a/b" + "/" + name. */
size_t ckpt__op_new_path_len(const ckpt_node_t *p, const char *name) {
  size_t len = strlen(name);
  for (; p && p->kind != CKPT_NODE_CKPT; p = p->parent)
    len += strlen(p->name) + 1;
  return len;
}

/* Length of the longest path below dir, relative to dir ("x/y": 3), 0 if
 * it is empty; without recursion. fs->lock held. */
size_t ckpt__op_subtree_path_len(const ckpt_node_t *dir) {
  size_t best = 0, base = 0;
  const ckpt_node_t *n = dir->children;
  while (n) {
    size_t len = base + strlen(n->name);
    if (len > best)
      best = len;
    if (n->children) {
      base = len + 1;
      n = n->children;
      continue;
    }
    while (!n->next) {
      n = n->parent;
      if (n == dir)
        return best;
      base -= strlen(n->name) + 1;
    }
    n = n->next;
  }
  return best;
}

/* Requests from other users (a mount with -o allow_other) read only: only
 * the mounting user and root change anything. */
bool ckpt__op_may_change(fuse_req_t req) {
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  return ctx->uid == 0 || ctx->uid == getuid();
}

/* May the caller of ctx search directory n (its class's execute bit;
 * root always)? fs->lock held. */
bool ckpt__op_may_search_node(const struct fuse_ctx *ctx, const ckpt_node_t *n) {
  if (ctx->uid == 0)
    return true;
  mode_t x = ctx->uid == n->uid ? S_IXUSR : ctx->gid == n->gid ? S_IXGRP : S_IXOTH;
  return (n->mode & x) != 0;
}

/* May the caller of ctx write n (mode W, and X as well for a directory,
 * whose entries it would change), by n's mode bits as the kernel's
 * default_permissions would check them (root always; the caller's
 * supplementary groups are not known here: only its gid counts)? For the
 * requests that change many entries at once (user.ckpt.metas,
 * user.ckpt.mkdirs), which the kernel checks only on the directory they
 * are set on. fs->lock held. */
bool ckpt__op_may_write_node(const struct fuse_ctx *ctx, const ckpt_node_t *n) {
  if (ctx->uid == 0)
    return true;
  mode_t w = ctx->uid == n->uid ? S_IWUSR : ctx->gid == n->gid ? S_IWGRP : S_IWOTH;
  return (n->mode & w) && (!S_ISDIR(n->mode) || ckpt__op_may_search_node(ctx, n));
}

/* Set-user-ID and set-group-ID are the filesystem's to clear (init
 * takes FUSE_CAP_HANDLE_KILLPRIV_V2 with passthrough: the kernel then
 * asks no GETXATTR of security.capability before each passed-through
 * write, which cost ~50 us per 1 MiB write), as the VFS would: on a write
 * or truncation by a process without CAP_FSETID, and on a chown. A
 * passed-through write is not seen here: its file loses the bits when it
 * is opened for writing. Only files carrying a bit pay for the look at
 * the writer's capabilities. */
bool ckpt__op_has_suidgid(mode_t m) {
  return S_ISREG(m) && ((m & S_ISUID) || (m & (S_ISGID | S_IXGRP)) ==
                                             (S_ISGID | S_IXGRP));
}

void ckpt__op_kill_suidgid(ckpt_node_t *n) { /* fs->lock held */
  if (ckpt__op_has_suidgid(n->mode))
    n->mode &= ~(mode_t)(S_ISUID | ((n->mode & S_IXGRP) ? S_ISGID : 0));
}

/* Does the process behind req lack CAP_FSETID? (Unknown: it does.) */
bool ckpt__op_lacks_fsetid(fuse_req_t req) {
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  char path[64], line[256];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)ctx->pid);
  FILE *f = ctx->pid > 0 ? fopen(path, "re") : NULL;
  unsigned long long eff = 0;
  bool found = false;
  while (f && !found && fgets(line, sizeof(line), f))
    found = sscanf(line, "CapEff: %llx", &eff) == 1;
  if (f)
    fclose(f);
  return !found || !(eff & (1ULL << 4)); /* CAP_FSETID */
}

/* A write or truncation of n by req's process: clear the bits as above. */
void ckpt__op_write_kills_suidgid(ckpt_fs_t *fs, fuse_req_t req, ckpt_node_t *n) {
  pthread_mutex_lock(&fs->lock);
  bool has = ckpt__op_has_suidgid(n->mode);
  pthread_mutex_unlock(&fs->lock);
  if (!has || !ckpt__op_lacks_fsetid(req))
    return;
  pthread_mutex_lock(&fs->lock);
  ckpt__op_kill_suidgid(n);
  clock_gettime(CLOCK_REALTIME, &n->ctime);
  pthread_mutex_unlock(&fs->lock);
}

/* At most the first 64 bytes of p[0..n) for a log line: bytes that are
 * not printable ASCII as \xHH (a value could forge lines), "..." when cut. */
void ckpt__op_log_text(char *out, size_t cap, const char *p, size_t n) {
  size_t o = 0;
  for (size_t i = 0; i < n && i < 64 && o + 5 < cap; i++) {
    unsigned char c = (unsigned char)p[i];
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '"')
      out[o++] = (char)c;
    else
      o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
  }
  if (n > 64 && o + 4 < cap)
    memcpy(out + o, "...", 3), o += 3;
  out[o] = '\0';
}

/* ------------------------------------------------------------------------
 * Attributes and entries.
 * ---------------------------------------------------------------------- */

/* A staged file's data changed: mtime and ctime move (POSIX). */
void ckpt__op_touch_data(ckpt_fs_t *fs, ckpt_node_t *n) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  pthread_mutex_lock(&fs->lock);
  n->mtime = n->ctime = now;
  pthread_mutex_unlock(&fs->lock);
}

/* Put h on fs->handles. fs->lock held. */
void ckpt__op_track_handle(ckpt_fs_t *fs, handle_t *h) {
  CKPT_HELD(&fs->lock);
  fs->commit_handles += h->node->kind == CKPT_NODE_COMMIT;
  h->prev = NULL;
  h->next = fs->handles;
  if (h->next)
    h->next->prev = h;
  fs->handles = h;
}

/* Take h off fs->handles and drop its node. fs->lock held. */
void ckpt__op_untrack_handle(ckpt_fs_t *fs, handle_t *h) {
  CKPT_HELD(&fs->lock);
  fs->commit_handles -= h->node->kind == CKPT_NODE_COMMIT;
  if (h->prev)
    h->prev->next = h->next;
  else
    fs->handles = h->next;
  if (h->next)
    h->next->prev = h->prev;
  ckpt__node_unref(fs, h->node);
}

/* Let go of the data files h holds: before its node (and with it, maybe,
 * the checkpoint's reader) goes, so that the cache can close them. */
void ckpt__op_put_pins(handle_t *h) {
  for (uint32_t i = 0; i < h->npins; i++)
    ckpt_fdref_put(&h->pins[i]);
  h->npins = 0;
}

void ckpt__op_free_handle(handle_t *h) {
  ckpt__op_put_pins(h);
  free(h->pins);
  if (h->fd >= 0)
    close(h->fd);
  free(h->text);
  free(h);
}

void ckpt__release_handles(ckpt_fs_t *fs) {
  pthread_mutex_lock(&fs->lock);
  while (fs->handles) {
    handle_t *h = fs->handles;
    ckpt__op_put_pins(h);
    if (h->cpt && --h->node->cpt->opens == 0) { /* before the node goes */
      ckpt_fdref_put(&h->node->cpt->ref);
      free(h->node->cpt);
      h->node->cpt = NULL;
    }
    ckpt__op_untrack_handle(fs, h);
    ckpt__op_free_handle(h);
  }
  pthread_mutex_unlock(&fs->lock);
}

handle_t *ckpt__op_new_handle(ckpt_node_t *n) {
  handle_t *h = calloc(1, sizeof(*h));
  if (h) {
    h->node = n;
    h->fd = -1;
  }
  return h;
}

/* Reply with a copy of handle memory: once the reply is written, the
 * caller may close the file and a release on another thread free the
 * handle while fuse_reply_buf still returns (sanitizers check the buffer
 * after writev). */
void ckpt__op_reply_copy(fuse_req_t req, const char *p, size_t n) {
  char *copy = malloc(n ? n : 1);
  if (!copy) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  memcpy(copy, p, n);
  fuse_reply_buf(req, copy, n);
  free(copy);
}

/* Staged files opened write-only on the daemon's path skip the kernel's
 * page cache: each write request carries the trainer's own pages, copied
 * once, into staging or its stream, instead of first into cache pages the
 * mount never reads back (and that would double the memory a save takes).
 * O_RDWR keeps the cache, so a shared writable mmap (np.memmap "w+")
 * still works. (A file created for writing, read-write too, is passed
 * through where passthrough is on: the kernel writes its backing file.) */
bool ckpt__op_writes_direct(const ckpt_node_t *n,
                          const struct fuse_file_info *fi) {
  return n->kind == CKPT_NODE_SFILE && (fi->flags & O_ACCMODE) == O_WRONLY;
}
