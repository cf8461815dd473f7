/*
 * ops.c - the FUSE low-level operations of a rank mount.
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
#include "ops.h"
#include "metadb.h"

#define COMMITTED_TIMEOUT 1.0 /* seconds the kernel may cache committed
                                 entries and attributes */

/* What an open file or directory handle holds (fi->fh). Every handle is
 * on fs->handles until its release, so that the ones the kernel never
 * released (the mount ended first) are freed at exit. */
typedef struct ckpt_handle {
  ckpt_node_t *node; /* referenced */
  int fd;            /* METADATA: the backing .metadata, else -1 */
  char *text;        /* STATUS text, or the readdir buffer */
  size_t len;
  bool writer;       /* a staged file opened for writing */
  bool pt;           /* a staged file passed through (sf->pt_opens) */
  bool pt_writer;    /* ... open for writing (sf->pt_wopens) */
  bool cpt;          /* committed item read by passthrough (node->cpt) */
  _Atomic uint64_t advised; /* committed node: readahead asked up to here */
  ckpt_fdref_t *pins;  /* committed item: its data files, held open */
  uint32_t npins;
  struct ckpt_handle *prev, *next; /* fs->handles; fs->lock */
} handle_t;

static ckpt_fs_t *fs_of(fuse_req_t req) { return fuse_req_userdata(req); }

static handle_t *handle_of(struct fuse_file_info *fi) {
  return (handle_t *)(uintptr_t)fi->fh;
}

/* Resolve and reference ino; NULL if it is gone. */
static ckpt_node_t *get_node(ckpt_fs_t *fs, fuse_ino_t ino) {
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
static ckpt_node_t *get_node_any(ckpt_fs_t *fs, fuse_ino_t ino) {
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
static ckpt_node_t *node_of(ckpt_fs_t *fs, fuse_ino_t ino,
                            struct fuse_file_info *fi) {
  if (fi && fi->fh)
    return handle_of(fi)->node;
  return ckpt__node_by_ino_any(fs, ino);
}

static void put_node(ckpt_fs_t *fs, ckpt_node_t *n) {
  pthread_mutex_lock(&fs->lock);
  ckpt__node_unref(fs, n);
  pthread_mutex_unlock(&fs->lock);
}

static bool is_committed_kind(ckpt_node_kind_t k) {
  return k == CKPT_NODE_CDIR || k == CKPT_NODE_CTENSOR ||
         k == CKPT_NODE_CBLOB || k == CKPT_NODE_METADATA ||
         k == CKPT_NODE_CBLOCK || ckpt__is_view_kind(k);
}

/* May the staged contents of ck change? 0, -EBUSY or -EROFS. fs->lock. */
static int staged_writable(const ckpt_ckpt_t *ck) {
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
 * staged_change_end. -EBUSY / -EROFS when the staged data cannot change. */
static int staged_change_begin(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  pthread_rwlock_rdlock(&ck->freeze);
  pthread_mutex_lock(&fs->lock);
  int rc = staged_writable(ck);
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    pthread_rwlock_unlock(&ck->freeze);
  return rc;
}

static void staged_change_end(ckpt_ckpt_t *ck) {
  pthread_rwlock_unlock(&ck->freeze);
}

/* The longest path inside a checkpoint ("model/layer0/weight"), as the
 * longest path Linux takes: it bounds the depth of a staged tree (walked
 * recursively at commit) and the length of an FQN. */
#define CKPT_PATH_MAX 4095

/* Length of the path of a new entry `name` in staged directory p (fs->lock
 * held): "a/b" + "/" + name. */
static size_t new_path_len(const ckpt_node_t *p, const char *name) {
  size_t len = strlen(name);
  for (; p && p->kind != CKPT_NODE_CKPT; p = p->parent)
    len += strlen(p->name) + 1;
  return len;
}

/* Length of the longest path below dir, relative to dir ("x/y": 3), 0 if
 * it is empty; without recursion. fs->lock held. */
static size_t subtree_path_len(const ckpt_node_t *dir) {
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
static bool may_change(fuse_req_t req) {
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  return ctx->uid == 0 || ctx->uid == getuid();
}

/* Set-user-ID and set-group-ID are the filesystem's to clear (fs_init
 * takes FUSE_CAP_HANDLE_KILLPRIV_V2 with passthrough: the kernel then
 * asks no GETXATTR of security.capability before each passed-through
 * write, which cost ~50 us per 1 MiB write), as the VFS would: on a write
 * or truncation by a process without CAP_FSETID, and on a chown. A
 * passed-through write is not seen here: its file loses the bits when it
 * is opened for writing. Only files carrying a bit pay for the look at
 * the writer's capabilities. */
static bool has_suidgid(mode_t m) {
  return S_ISREG(m) && ((m & S_ISUID) || (m & (S_ISGID | S_IXGRP)) ==
                                             (S_ISGID | S_IXGRP));
}

static void kill_suidgid(ckpt_node_t *n) { /* fs->lock held */
  if (has_suidgid(n->mode))
    n->mode &= ~(mode_t)(S_ISUID | ((n->mode & S_IXGRP) ? S_ISGID : 0));
}

/* Does the process behind req lack CAP_FSETID? (Unknown: it does.) */
static bool lacks_fsetid(fuse_req_t req) {
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
static void write_kills_suidgid(ckpt_fs_t *fs, fuse_req_t req, ckpt_node_t *n) {
  pthread_mutex_lock(&fs->lock);
  bool has = has_suidgid(n->mode);
  pthread_mutex_unlock(&fs->lock);
  if (!has || !lacks_fsetid(req))
    return;
  pthread_mutex_lock(&fs->lock);
  kill_suidgid(n);
  clock_gettime(CLOCK_REALTIME, &n->ctime);
  pthread_mutex_unlock(&fs->lock);
}

/* At most the first 64 bytes of p[0..n) for a log line: bytes that are
 * not printable ASCII as \xHH (a value could forge lines), "..." when cut. */
static void log_text(char *out, size_t cap, const char *p, size_t n) {
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
 * .status
 * ---------------------------------------------------------------------- */

/* The .status text of ck. fs->lock held. */
/* Seconds a write of the flush may take before .status calls the store
 * stalled. */
#define FLUSH_STALL_S 5.0

/* .status of a committed checkpoint with -o tier: where it is, how far
 * its flush got and what it waits for (docs/tiers.md). fs->lock held. */
static const char *tier_lines(const ckpt_ckpt_t *ck, char *buf, size_t n) {
  if (!ck->tier.tiered)
    return "";
  char stalled[160] = "";
  uint64_t busy = atomic_load(&ck->tier.busy_since);
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  double for_s = busy ? ((double)ts.tv_sec + ts.tv_nsec * 1e-9) - busy * 1e-9
                      : 0;
  if (!ck->tier.why && for_s >= FLUSH_STALL_S)
    snprintf(stalled, sizeof(stalled),
             "flush waiting: BACKING_DIR has not answered a write for %.0f s "
             "(slow, full or down); the copy goes on when it does\n", for_s);
  snprintf(buf, n, "location %s\nflush bytes %llu of %llu\n%s%s%s",
           atomic_load(&ck->tier.flushed) ? "shared"
           : ck->tier.partner             ? "partner"
                                          : "local",
           (unsigned long long)atomic_load(&ck->tier.done),
           (unsigned long long)atomic_load(&ck->tier.total),
           ck->tier.why ? ck->tier.why : "", ck->tier.why ? "\n" : "",
           stalled);
  return buf;
}

/* fs->lock held. */
static char *status_text(ckpt_fs_t *fs, const ckpt_ckpt_t *ck) {
  char lines[1200];
  switch (ck->state) {
  case CKPT_STAGING: {
    uint64_t files = 0, bytes = 0;
    if (ck->dir) /* NULL: removed (rmdir), while .status was open */
      ckpt__count_staged(ck->dir, &files, &bytes);
    /* who stages it: a job process alive (a dead one's saves are gone);
     * no line when no job declared itself (ckpt-umount's advice differs) */
    char job[CKPT_JOB_LABEL_MAX + 64] = "";
    char label[CKPT_JOB_LABEL_MAX];
    if (ck->job && ckpt__job_label(fs, ck->job, label, sizeof(label)))
      snprintf(job, sizeof(job), "job %d alive%s%s\n", (int)ck->job,
               *label ? ": " : "", label);
    /* a full tier: staged writes fail (ENOSPC); say what to do */
    char full[CKPT_TIER_FULL_MAX] = "";
    ckpt__tier_full_line(fs, full, sizeof(full));
    return ckpt__strdup_printf("staging\nfiles %llu\nbytes %llu\n%s%s",
                               (unsigned long long)files,
                               (unsigned long long)bytes, job, full);
  }
  case CKPT_COMMITTING: {
    char left[48] = "";
    if (ck->waiting && ck->waiting_until > 0) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      double s = ck->waiting_until - ((double)ts.tv_sec + ts.tv_nsec * 1e-9);
      snprintf(left, sizeof(left), ", %.0f s left", s > 0 ? s : 0);
    }
    return ckpt__strdup_printf(
        "committing\nbytes %llu of %llu\n%s%s%s%s",
        (unsigned long long)atomic_load(&ck->bytes_done),
        (unsigned long long)atomic_load(&ck->bytes_total),
        ck->waiting ? "waiting for " : "", ck->waiting ? ck->waiting : "",
        left, ck->waiting ? "\n" : "");
  }
  case CKPT_COMMITTED:
    if (ck->removing) /* the first line stays one of the four states */
      return strdup("committed\nremoving: the checkpoint was removed as a "
                    "whole (its .metadata), so it is gone for every other "
                    "mount; rmdir NAME (rm -r) removes its data\n");
    uint32_t t = ck->meta ? ck->meta->n_tensors : 0, nt = t;
    uint32_t nb = ck->meta ? ck->meta->n_blobs : 0;
    for (uint32_t i = 0, all = t + nb; ck->removed && i < all; i++) {
      if (ck->removed[i] && i < t) /* removed inside it since loaded */
        nt--;
      else if (ck->removed[i])
        nb--;
    }
    char *note = ck->tier.tiered ? ckpt__resolve_note(ck->name) : NULL;
    char *text = ckpt__strdup_printf(
        "committed\ntensors %u\nblobs %u\nworld_size %d\n%s%s%s%s%s%s",
        nt, nb,
        ck->meta ? ck->meta->world_size : 0, ck->lost ? "lost: " : "",
        ck->lost ? ck->lost : "", ck->lost ? "\n" : "",
        tier_lines(ck, lines, sizeof(lines)), note ? note : "",
        note ? "\n" : "");
    free(note);
    return text;
  case CKPT_FAILED:
    return ckpt__strdup_printf("failed\n%s\n",
                               ck->reason ? ck->reason : "unknown error");
  }
  return NULL;
}

/* ------------------------------------------------------------------------
 * Attributes and entries.
 * ---------------------------------------------------------------------- */

/* A staged file's data changed: mtime and ctime move (POSIX). */
static void touch_data(ckpt_fs_t *fs, ckpt_node_t *n) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  pthread_mutex_lock(&fs->lock);
  n->mtime = n->ctime = now;
  pthread_mutex_unlock(&fs->lock);
}

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

/* fs->lock held. */
static void fill_attr(ckpt_fs_t *fs, ckpt_node_t *n, struct stat *st) {
  (void)fs;
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
  switch (n->kind) {
  case CKPT_NODE_SFILE:
    st->st_size = (off_t)ckpt__sfile_size(n->u.sf);
    /* written by the kernel */
    ckpt__sfile_pt_times(n->u.sf, &st->st_mtim, &n->ctime);
    st->st_ctim = n->ctime;
    break;
  case CKPT_NODE_CTENSOR:
  case CKPT_NODE_CBLOB:
    st->st_size = (off_t)ckpt_stored_size(&n->ck->stored, ckpt__node_item(n));
    break;
  case CKPT_NODE_STATUS: {
    char *t = status_text(fs, n->ck);
    st->st_size = t ? (off_t)strlen(t) : 0;
    free(t);
    break;
  }
  case CKPT_NODE_METADATA: {
    struct stat bst;
    char path[300];
    snprintf(path, sizeof(path), "%s/%s", n->ck->name, CKPT_METADATA_FILE);
    if (fstatat(loaded_root(fs, n->ck), path, &bst,
                AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(bst.st_mode))
      st->st_size = bst.st_size;
    break;
  }
  case CKPT_NODE_VNPY:
  case CKPT_NODE_VST:
  case CKPT_NODE_VINDEX:
    st->st_size = (off_t)ckpt__view_size(n);
    break;
  case CKPT_NODE_CBLOCK:
    st->st_size = (off_t)n->u.block->bytes;
    break;
  default:
    break;
  }
  /* st_size <= INT64_MAX (metadb bounds every size): no overflow here. */
  st->st_blocks = st->st_size / 512 + (st->st_size % 512 != 0);
}

static double node_timeout(const ckpt_node_t *n) {
  return is_committed_kind(n->kind) ? COMMITTED_TIMEOUT : 0.0;
}

/* fs->lock held. */
static void fill_entry(ckpt_fs_t *fs, ckpt_node_t *n, struct fuse_entry_param *e) {
  memset(e, 0, sizeof(*e));
  e->ino = n->ino;
  e->generation = 1;
  fill_attr(fs, n, &e->attr);
  e->attr_timeout = e->entry_timeout = node_timeout(n);
}

/* Open BACKING_DIR/NAME/.metadata of committed ck for reading: never
 * through a symlink, only a regular file, only in the directory that was
 * loaded. fd or -errno. */
static int open_metadata(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
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

/* Where BACKING_DIR/NAME stands, looked up before fs->lock is taken (no
 * system call under it). */
typedef ckpt_presence_t presence_t;

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

static presence_t presence(ckpt_fs_t *fs, const char *name) {
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
static bool still_stored(ckpt_fs_t *fs, ckpt_node_t *dir,
                         const presence_t *pr) {
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

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
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
  double now = mono_now();
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
    sc->pr[i] = presence(fs, sc->names[i]);
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

static void fs_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_lookup);
  ckpt_fs_t *fs = fs_of(req);
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
    pr = presence(fs, name);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *n = p ? ckpt__node_child(fs, p, name) : NULL;
  if (n && p->kind == CKPT_NODE_ROOT && !still_stored(fs, n, &pr))
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
    rc = ESTALE;
  else if ((!n || n->kind == CKPT_NODE_CBLOCK) && ckpt__block_name(p, name))
    rc = -ckpt__block_lookup(fs, p, name, &n); /* a block file */
  else if (!n || n->hidden)
    rc = ENOENT;
  else if (n->kind == CKPT_NODE_VROOT && ckpt__views_populate(fs, n) < 0)
    rc = ENOMEM; /* a view is filled at its first lookup */
  if (rc == 0)
    fill_entry(fs, n, &e);
  pthread_mutex_unlock(&fs->lock);
  if (rc) {
    fuse_reply_err(req, rc);
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

static void fs_getattr(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_getattr);
  ckpt_fs_t *fs = fs_of(req);
  struct stat st;
  double timeout = 0;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = fi && fi->fh ? handle_of(fi)->node
                                : ckpt__node_by_ino_any(fs, ino);
  if (n) {
    fill_attr(fs, n, &st);
    timeout = node_timeout(n);
  }
  pthread_mutex_unlock(&fs->lock);
  if (!n)
    fuse_reply_err(req, ESTALE);
  else
    fuse_reply_attr(req, &st, timeout);
}

static void fs_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr,
                       int to_set, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_setattr);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = node_of(fs, ino, fi);
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
  } else if (is_committed_kind(n->kind) || n->kind == CKPT_NODE_STATUS) {
    rc = -EROFS;
  } else {
    bool changing = (rc = staged_change_begin(fs, n->ck)) == 0;
    if (rc == 0 && (to_set & FUSE_SET_ATTR_SIZE)) {
      if (n->kind != CKPT_NODE_SFILE)
        rc = -EISDIR;
      else
        rc = ckpt__sfile_truncate(n->u.sf, (uint64_t)attr->st_size);
      if (rc == 0)
        write_kills_suidgid(fs, req, n);
    }
    if (rc == 0) {
      pthread_mutex_lock(&fs->lock);
      if (to_set & FUSE_SET_ATTR_MODE)
        n->mode = (n->mode & S_IFMT) | (attr->st_mode & 07777);
      else if (to_set & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))
        kill_suidgid(n); /* a chown (the kernel asks, KILLPRIV_V2) */
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
      staged_change_end(n->ck);
  }
  if (rc) {
    fuse_reply_err(req, -rc);
  } else {
    struct stat st;
    pthread_mutex_lock(&fs->lock);
    fill_attr(fs, n, &st);
    pthread_mutex_unlock(&fs->lock);
    fuse_reply_attr(req, &st, node_timeout(n));
  }
  put_node(fs, n);
}

/* ------------------------------------------------------------------------
 * Namespace changes.
 * ---------------------------------------------------------------------- */

/* A new name in staged directory p: any file name (dot-files too), but
 * directly under the checkpoint not one ckptfs serves there itself:
 * 0, -EPERM (reserved, logged), -EINVAL or -ENAMETOOLONG. */
static int check_name(const ckpt_node_t *p, const char *name) {
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
    log_text(shown, sizeof(shown), name, strlen(name));
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
  if (p->kind == CKPT_NODE_ROOT)
    return -EPERM;
  if (p->kind != CKPT_NODE_CKPT && p->kind != CKPT_NODE_SDIR)
    return is_committed_kind(p->kind) ? -EROFS : -ENOTDIR;
  int rc = staged_writable(p->ck);
  if (rc)
    return rc;
  if ((rc = check_name(p, name)) != 0)
    return rc;
  if (new_path_len(p, name) > CKPT_PATH_MAX)
    return -ENAMETOOLONG;
  return ckpt__node_child(fs, p, name) ? -EEXIST : 0;
}

/* Is name the TARGET of a replace= commit in flight on this mount? It is
 * taken meanwhile: no mkdir or rename may stage a checkpoint under it.
 * fs->lock held. */
static bool being_replaced(ckpt_fs_t *fs, const char *name) {
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
  if (being_replaced(fs, name))
    return -EBUSY;
  ckpt_node_t *old = ckpt__ckpt_lookup(fs, name);
  if (old && still_stored(fs, old, pr))
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

static void fs_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name,
                     mode_t mode) {
  ckpt__metrics_request(req, CKPT_OP_mkdir);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  ckpt_node_t *n = NULL;
  int rc;
  presence_t pr = {.committed = false};
  pid_t job = 0; /* a job process's: abandoned if it exits (jobs.c) */
  if (parent == FUSE_ROOT_ID) {
    pr = presence(fs, name);
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
    fill_entry(fs, n, &e);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else
    fuse_reply_entry(req, &e);
}

/* Put h on fs->handles. fs->lock held. */
static void track_handle(ckpt_fs_t *fs, handle_t *h) {
  fs->commit_handles += h->node->kind == CKPT_NODE_COMMIT;
  h->prev = NULL;
  h->next = fs->handles;
  if (h->next)
    h->next->prev = h;
  fs->handles = h;
}

/* Take h off fs->handles and drop its node. fs->lock held. */
static void untrack_handle(ckpt_fs_t *fs, handle_t *h) {
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
static void put_pins(handle_t *h) {
  for (uint32_t i = 0; i < h->npins; i++)
    ckpt_fdref_put(&h->pins[i]);
  h->npins = 0;
}

static void free_handle(handle_t *h) {
  put_pins(h);
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
    put_pins(h);
    if (h->cpt && --h->node->cpt->opens == 0) { /* before the node goes */
      ckpt_fdref_put(&h->node->cpt->ref);
      free(h->node->cpt);
      h->node->cpt = NULL;
    }
    untrack_handle(fs, h);
    free_handle(h);
  }
  pthread_mutex_unlock(&fs->lock);
}

static handle_t *new_handle(ckpt_node_t *n) {
  handle_t *h = calloc(1, sizeof(*h));
  if (h) {
    h->node = n;
    h->fd = -1;
  }
  return h;
}

/* Staged files opened write-only skip the kernel's page cache: each write
 * request carries the trainer's own pages, copied once, into staging or
 * its stream, instead of first into cache pages the mount never reads
 * back (and that would double the memory a save takes). O_RDWR keeps the
 * cache, so a shared writable mmap (np.memmap "w+") still works. */
static bool writes_direct(const ckpt_node_t *n,
                          const struct fuse_file_info *fi) {
  return n->kind == CKPT_NODE_SFILE && (fi->flags & O_ACCMODE) == O_WRONLY;
}

/* A new empty staged file name in staged directory p, owned by the caller
 * (create, mknod). fs->lock held. */
static int new_staged_file(ckpt_fs_t *fs, ckpt_node_t *p, const char *name,
                           mode_t mode, const struct fuse_ctx *ctx,
                           ckpt_node_t **out) {
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
  n->uid = ctx->uid;
  n->gid = ctx->gid;
  *out = n;
  return 0;
}

/* Pass an open of staged file n through to its backing file
 * (fi->backing_id): every open of a passthrough file must be, with one
 * backing id while any is open. A new empty file opened write-only
 * (create) gets its backing file here. An open for writing (the freeze
 * lock held shared by the caller, or a create) unseals the file, under
 * the same hold of sf->lock as the open is counted, so that a drain's
 * hash across it is dropped. 0, or -errno for an open of a passthrough
 * file that cannot be passed through (a file that never was one stays on
 * the daemon's path). */
static int pt_open(fuse_req_t req, ckpt_node_t *n, handle_t *h,
                   struct fuse_file_info *fi, bool start) {
#ifdef FUSE_CAP_PASSTHROUGH
  ckpt_fs_t *fs = fs_of(req);
  ckpt_sfile_t *sf = n->u.sf;
  if (!fs->passthrough || n->kind != CKPT_NODE_SFILE)
    return 0;
  if ((fi->flags & O_DIRECT) && !ckpt__sfile_pt_open(sf)) {
    /* through the daemon (into the same backing file): O_DIRECT passed
     * through would take the backing filesystem's alignment rules (ext4:
     * EINVAL for an unaligned write). Only while no handle is passed
     * through: the kernel wants every open of an inode in passthrough
     * mode passed through (then the backing filesystem's rules apply). */
    fi->direct_io = 1;
    return 0;
  }
  if (sf->pt_fd < 0 && (!start || ckpt__sfile_pt_start(sf) != 0))
    return 0;
  bool writing = (fi->flags & O_ACCMODE) != O_RDONLY;
  int rc = 0;
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd < 0) { /* moved into segments: the daemon's path now */
    pthread_mutex_unlock(&sf->lock);
    return 0;
  }
  if (writing && ckpt__sfile_pt_committed(sf))
    rc = -EROFS; /* its backing file is a published data file */
  if (rc == 0 && sf->pt_opens == 0) {
    int id = fuse_passthrough_open(req, sf->pt_fd);
    if (id > 0)
      sf->pt_id = id;
    else
      rc = -EIO;
  }
  if (rc == 0) {
    sf->pt_opens++;
    if (writing) {
      ckpt__sfile_pt_thaw(sf);
      sf->pt_wopens++;
      sf->pt_wpid = fuse_req_ctx(req)->pid;
    } else {
      sf->pt_read_opened = true;
    }
    fi->backing_id = sf->pt_id;
    fi->direct_io = 0;
    fi->keep_cache = 0;
    h->pt = true;
    h->pt_writer = writing;
  }
  pthread_mutex_unlock(&sf->lock);
  if (rc && start) { /* the kernel refused: this file stays on our path */
    ckpt__sfile_pt_abandon(sf);
    rc = 0;
    /* Without CAP_SYS_ADMIN every backing file is refused: say it once. */
    bool was = true;
    if (atomic_compare_exchange_strong(&fs->passthrough, &was, false))
      ckpt__log("passthrough: the kernel refused a backing file (needs "
                "CAP_SYS_ADMIN): staged files go through the daemon");
  }
  return rc;
#else
  (void)req, (void)n, (void)h, (void)fi, (void)start;
  return 0;
#endif
}

/* A committed tensor or blob that is a whole data file (written once by
 * passthrough: each large staged file is one) is read by FUSE passthrough
 * too, straight from the data file's page cache without a request to the
 * daemon. Its checksum is checked first, here (the daemon sees none of
 * the reads after this), and again at a later open when the data file
 * changed on disk (pin_files' recheck). Anything else, or a chunk that is
 * damaged (its reads then get EIO), stays on the daemon's path. */
#define CKPT_PT_READ_MIN CKPT_PT_DRAIN_MIN
static void pt_open_committed(fuse_req_t req, ckpt_node_t *n, handle_t *h,
                              struct fuse_file_info *fi) {
#ifdef FUSE_CAP_PASSTHROUGH
  ckpt_fs_t *fs = fs_of(req);
  if (!fs->passthrough || !fs->opts.direct_reads || (fi->flags & O_DIRECT) ||
      (n->kind != CKPT_NODE_CTENSOR && n->kind != CKPT_NODE_CBLOB))
    return; /* O_DIRECT: the daemon's path, any alignment */
  const ckpt_stored_t *s = &n->ck->stored;
  ckpt_item_t it = ckpt__node_item(n);
  uint64_t size = ckpt_stored_size(s, it);
  ckpt_fdref_t ref;
  uint64_t pos;
  size_t len;
  struct stat st;
  if (size < CKPT_PT_READ_MIN || size > SIZE_MAX ||
      ckpt_stored_span(s, it, (size_t)size, 0, &ref, &pos, &len) != 1)
    return;
  /* checked before the kernel serves a byte (a no-op once checked, until
   * its data file changes: pin_files' recheck); no hold of fs->lock */
  bool whole = pos == 0 && len == size && fstat(ref.fd, &st) == 0 &&
               (uint64_t)st.st_size == size;
  if (!whole || ckpt_stored_verify(s, it, (size_t)size, 0) != 0) {
    ckpt_fdref_put(&ref);
    return; /* the daemon's path: EIO for a damaged chunk */
  }
  struct ckpt_node_pt *p = NULL;
  pthread_mutex_lock(&fs->lock);
  if (n->cpt) {
    /* The kernel takes one backing file per inode, and fails (EIO) an
     * open of another mode while the inode has one: this open shares it
     * if it is the data file just verified (same inode), or if it is
     * unchanged since it was verified itself, when the backing file was
     * made (the data file may be another one by now: a tier's copy
     * flushed to BACKING_DIR and the tier's removed). Unchanged: same
     * size, mtime and ctime; with a tier, a file unlinked since (the
     * flush removes the tier's copy: that unlink is its ctime's change)
     * needs the same size and mtime. Else (changed on disk since its own
     * check) this open goes through the daemon, which the kernel fails
     * with EIO. */
    struct stat now;
    const struct stat *was = &n->cpt->was;
    bool same = fstat(n->cpt->ref.fd, &now) == 0 &&
                now.st_dev == st.st_dev && now.st_ino == st.st_ino;
    bool unchanged =
        !same && fstat(n->cpt->ref.fd, &now) == 0 &&
        now.st_dev == was->st_dev && now.st_ino == was->st_ino &&
        now.st_size == was->st_size &&
        now.st_mtim.tv_sec == was->st_mtim.tv_sec &&
        now.st_mtim.tv_nsec == was->st_mtim.tv_nsec &&
        ((now.st_ctim.tv_sec == was->st_ctim.tv_sec &&
          now.st_ctim.tv_nsec == was->st_ctim.tv_nsec) ||
         (fs->tier_fd >= 0 && now.st_nlink == 0 && was->st_nlink > 0));
    if (same || unchanged) {
      p = n->cpt;
      p->opens++;
      pthread_mutex_unlock(&fs->lock);
    } else {
      pthread_mutex_unlock(&fs->lock);
      ckpt__log("%s: a data file changed on disk since an open handle's "
                "passthrough backing file was checked: this open fails "
                "(EIO) until those handles are closed", n->ck->name);
    }
    ckpt_fdref_put(&ref);
  } else if ((p = calloc(1, sizeof(*p))) != NULL &&
             (p->id = fuse_passthrough_open(req, ref.fd)) > 0) {
    p->opens = 1;
    p->ref = ref;
    p->was = st;
    n->cpt = p;
    pthread_mutex_unlock(&fs->lock);
  } else {
    pthread_mutex_unlock(&fs->lock);
    ckpt_fdref_put(&ref);
    free(p);
    p = NULL;
  }
  if (!p)
    return;
  h->cpt = true;
  fi->backing_id = p->id;
  fi->direct_io = 0;
  fi->keep_cache = 0;
#else
  (void)req, (void)n, (void)h, (void)fi;
#endif
}

static void pt_release(fuse_req_t req, handle_t *h) {
#ifdef FUSE_CAP_PASSTHROUGH
  if (h->cpt) {
    ckpt_fs_t *fs = fs_of(req);
    pthread_mutex_lock(&fs->lock);
    struct ckpt_node_pt *p = h->node->cpt;
    bool last = --p->opens == 0;
    if (last) {
      fuse_passthrough_close(req, p->id);
      h->node->cpt = NULL;
    }
    pthread_mutex_unlock(&fs->lock);
    h->cpt = false;
    if (last) {
      ckpt_fdref_put(&p->ref);
      free(p);
    }
  }
  if (!h->pt)
    return;
  ckpt_sfile_t *sf = h->node->u.sf;
  pthread_mutex_lock(&sf->lock);
  bool last = --sf->pt_opens == 0;
  struct stat st;
  if (h->pt_writer) {
    sf->pt_wopens--;
    /* the kernel's writes, as far as the daemon can tell: the file's
     * size when a handle that could write it is closed */
    if (sf->pt_fd >= 0 && fstat(sf->pt_fd, &st) == 0)
      atomic_fetch_add_explicit(&fs_of(req)->metrics.bytes_staged,
                                (uint64_t)st.st_size, memory_order_relaxed);
  }
  if (last && sf->pt_id > 0) {
    fuse_passthrough_close(req, sf->pt_id);
    sf->pt_id = 0;
  }
  last = last && sf->pt_fd >= 0;
  pthread_mutex_unlock(&sf->lock);
  if (last) /* closed: hashed while the trainer goes on */
    ckpt__drain_add(fs_of(req)->drain, h->node);
#else
  (void)req, (void)h;
#endif
}

/* A handle whose open reply could not be sent: released here. */
static void drop_handle(fuse_req_t req, handle_t *h) {
  ckpt_fs_t *fs = fs_of(req);
  pt_release(req, h);
  put_pins(h);
  pthread_mutex_lock(&fs->lock);
  untrack_handle(fs, h);
  pthread_mutex_unlock(&fs->lock);
  free_handle(h);
}

static void fs_create(fuse_req_t req, fuse_ino_t parent, const char *name,
                      mode_t mode, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_create);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  ckpt_node_t *n = NULL;
  handle_t *h = NULL;
  int rc;
  /* a new file with set-ID bits, passed through: its writes unseen here */
  bool kill = has_suidgid(S_IFREG | (mode & 07777)) && lacks_fsetid(req);
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
  if (rc == 0 && !(h = new_handle(n)))
    rc = -ENOMEM;
  if (rc == 0) {
    ckpt__node_ref(n);
    track_handle(fs, h);
    h->writer = n->kind == CKPT_NODE_SFILE;
    fi->fh = (uintptr_t)h;
    fi->direct_io = n->kind == CKPT_NODE_COMMIT || writes_direct(n, fi);
    if (writes_direct(n, fi))
      pt_open(req, n, h, fi, true); /* else the daemon's path */
    if (kill && h->pt)
      kill_suidgid(n);
    fill_entry(fs, n, &e);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc)
    fuse_reply_err(req, -rc);
  else if (fuse_reply_create(req, &e, fi))
    drop_handle(req, h); /* the opener is gone: no release will come */
}

/* Committed ck is removed as a whole (unlink of NAME/.metadata, the first
 * entry rm -r NAME removes, or rmdir NAME), for every mount: its .metadata
 * is unlinked from BACKING_DIR durably now (also when another mount's
 * removal inside it made a later version of it), the rest of its entries
 * stay in this mount for rm -r to remove (each unlink then only hides
 * one), and rmdir NAME removes its data (or the next mount start does).
 * fs->lock held. */
/* In the tier only, its flush to BACKING_DIR under way: not removed,
 * neither whole nor inside (the flush would publish it again). */
static bool unflushed(ckpt_ckpt_t *ck) {
  return ck->tier.tiered && !atomic_load(&ck->tier.flushed);
}

static int start_removal(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  if (ck->removing)
    return 0;
  if (ck->state != CKPT_COMMITTED || !ck->has_stored)
    return -EROFS;
  if (unflushed(ck) && !atomic_load(&ck->tier.failed))
    return -EBUSY;
  if (unflushed(ck)) {
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

/* What removing committed node n (a tensor, a blob, an empty directory)
 * takes out of its checkpoint's metadata. fs->lock held. */
static int removal_of(const ckpt_node_t *n, ckpt_removal_t *r) {
  const ckpt_metadata_t *m = n->ck->meta;
  memset(r, 0, sizeof(*r));
  r->dir = n->kind == CKPT_NODE_CDIR;
  r->blob = n->kind == CKPT_NODE_CBLOB;
  if (n->kind == CKPT_NODE_CTENSOR)
    r->fqn = strdup(m->tensors[n->u.tensor].fqn);
  else if (r->blob)
    r->fqn = strdup(m->blobs[n->u.blob].fqn);
  r->path = ckpt__node_path(n);
  return r->path && (r->dir || r->fqn) ? 0 : -ENOMEM;
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
  else if (unflushed(ck))
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
    if (n->kind == CKPT_NODE_CTENSOR)
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

static void fs_unlink(fuse_req_t req, fuse_ino_t parent, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_unlink);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
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
  else if (is_committed_kind(n->kind))
    ckpt__node_ref(entry = n);
  else if ((rc = staged_writable(n->ck)) == 0)
    ckpt__node_detach(fs, n);
  pthread_mutex_unlock(&fs->lock);
  if (entry) {
    rc = remove_entry(fs, entry);
    put_node(fs, entry);
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
    if (rc == 0 && unflushed(ck)) /* a solo save's files are rank 0's */
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

static void fs_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_rmdir);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
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
  else if ((rc = staged_writable(n->ck)) == 0)
    ckpt__node_detach(fs, n);
  pthread_mutex_unlock(&fs->lock);
  if (entry) {
    rc = remove_entry(fs, entry);
    put_node(fs, entry);
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
  if (being_replaced(fs, newname))
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

static void fs_rename(fuse_req_t req, fuse_ino_t parent, const char *name,
                      fuse_ino_t newparent, const char *newname,
                      unsigned int flags) {
  ckpt__metrics_request(req, CKPT_OP_rename);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  int rc = 0;
  presence_t pr = {.committed = false};
  if (parent == FUSE_ROOT_ID && newparent == FUSE_ROOT_ID)
    pr = presence(fs, newname);
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
    put_node(fs, n);
    fuse_reply_err(req, -rc);
    return;
  } else if (p->kind == CKPT_NODE_ROOT || np->kind == CKPT_NODE_ROOT)
    rc = -EPERM; /* a checkpoint into a checkpoint, a file to the root */
  else if (is_committed_kind(n->kind) || is_committed_kind(np->kind))
    rc = -EROFS;
  else if (n->ck != np->ck)
    rc = -EXDEV;
  else if (n->kind == CKPT_NODE_COMMIT || n->kind == CKPT_NODE_STATUS)
    rc = -EPERM;
  else if (flags & ~(unsigned)RENAME_NOREPLACE)
    rc = -EINVAL;
  else if ((rc = staged_writable(n->ck)) != 0 || (rc = check_name(np, newname)))
    ;
  else if (is_ancestor(n, np))
    rc = -EINVAL;
  else if (new_path_len(np, newname) +
               (n->children ? 1 + subtree_path_len(n) : 0) >
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

/* ------------------------------------------------------------------------
 * Files.
 * ---------------------------------------------------------------------- */

static int by_rank_file(const void *a, const void *b) {
  const int64_t *x = a, *y = b;
  return (*x > *y) - (*x < *y);
}

/* Hold open the data files that committed item node n reads (a tensor,
 * its .npy view or a block file: its chunks' files; a blob: its file; a
 * file of the .safetensors view: the files of its tensors), so that this
 * handle reads the bytes it was opened on for as long as it is open, even
 * after the checkpoint was replaced (replace=) or removed by another
 * mount: the files may go from BACKING_DIR, the open descriptors keep
 * them. Best effort: a file that cannot be opened now is not held (the
 * read reports it). With verify, each is compared with the file its
 * chunks were checked on (one fstat): changed on disk, they are checked
 * again. */
static void pin_files(handle_t *h, const ckpt_node_t *n) {
  const ckpt_ckpt_t *ck = n->ck;
  if (!ck->has_stored || !ck->meta)
    return;
  const ckpt_metadata_t *m = ck->meta;
  const size_t *tensors = NULL;
  size_t nt = 0, one = 0;
  uint32_t count = 0;
  if (n->kind == CKPT_NODE_CBLOB) {
    count = 1;
  } else if (n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_VNPY ||
             n->kind == CKPT_NODE_CBLOCK) {
    one = n->kind == CKPT_NODE_CBLOCK ? n->u.block->tensor : n->u.tensor;
    tensors = &one, nt = 1;
  } else if (n->kind == CKPT_NODE_VST) {
    nt = ckpt__view_shard_tensors(n, &tensors);
  }
  for (size_t j = 0; j < nt; j++)
    count += m->tensors[tensors[j]].n_chunks;
  int64_t *keys = count ? malloc(count * sizeof(*keys)) : NULL;
  if (!keys)
    return;
  if (n->kind == CKPT_NODE_CBLOB) {
    const ckpt_blob_meta_t *b = &m->blobs[n->u.blob];
    keys[0] = (int64_t)b->rank << 32 | b->file;
  }
  uint32_t at = 0;
  for (size_t j = 0; j < nt; j++) {
    const ckpt_tensor_meta_t *t = &m->tensors[tensors[j]];
    for (uint32_t i = 0; i < t->n_chunks; i++) {
      const ckpt_chunk_meta_t *c = &m->chunks[t->first_chunk + i];
      keys[at++] = (int64_t)c->rank << 32 | c->file;
    }
  }
  qsort(keys, count, sizeof(*keys), by_rank_file);
  uint32_t distinct = 0;
  for (uint32_t i = 0; i < count; i++)
    if (i == 0 || keys[i] != keys[i - 1])
      keys[distinct++] = keys[i];
  h->pins = calloc(distinct, sizeof(*h->pins));
  for (uint32_t i = 0; h->pins && i < distinct; i++) {
    int32_t rank = (int32_t)(keys[i] >> 32);
    uint32_t k = (uint32_t)keys[i];
    if (ckpt_stored_fd(&ck->stored, rank, k, &h->pins[h->npins]) == 0)
      ckpt_stored_recheck(&ck->stored, rank, k, &h->pins[h->npins++]);
  }
  free(keys);
}

static void fs_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_open);
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = get_node(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int acc = fi->flags & O_ACCMODE;
  bool writing = acc != O_RDONLY || (fi->flags & O_TRUNC);
  int rc = 0;
  handle_t *h = new_handle(n);
  if (!h) {
    rc = -ENOMEM;
  } else if (writing && !may_change(req)) {
    rc = -EACCES;
  } else if (S_ISDIR(n->mode)) {
    rc = -EISDIR;
  } else if (n->kind == CKPT_NODE_COMMIT) {
    rc = acc == O_RDONLY ? -EACCES : 0;
    fi->direct_io = 1;
  } else if (n->kind == CKPT_NODE_STATUS) {
    pthread_mutex_lock(&fs->lock);
    h->text = writing ? NULL : status_text(fs, n->ck);
    pthread_mutex_unlock(&fs->lock);
    rc = writing ? -EACCES : h->text ? 0 : -ENOMEM;
    h->len = h->text ? strlen(h->text) : 0;
    fi->direct_io = 1;
  } else if (is_committed_kind(n->kind)) {
    if (writing)
      rc = -EROFS;
    else if (n->kind == CKPT_NODE_METADATA &&
             (h->fd = open_metadata(fs, n->ck)) < 0)
      rc = h->fd;
    else
      pin_files(h, n);
    fi->keep_cache = 1;
    /* Tensors and blobs: each read spliced from the data file's page
     * cache straight into the reader's buffer, not first into a second
     * cache of the same bytes (see direct_reads in options.c). */
    fi->direct_io = fs->opts.direct_reads && n->kind != CKPT_NODE_METADATA &&
                    !ckpt__is_view_kind(n->kind); /* views: mmap works */
    if (rc == 0)
      pt_open_committed(req, n, h, fi); /* a whole data file: straight */
  } else if (writing) { /* a staged file */
    if ((rc = staged_change_begin(fs, n->ck)) == 0) {
      if (fi->flags & O_TRUNC) {
        rc = ckpt__sfile_truncate(n->u.sf, 0);
        if (rc == 0)
          touch_data(fs, n);
      }
      /* truncated, or passed through (its writes unseen here) */
      if (rc == 0 && n->kind == CKPT_NODE_SFILE &&
          ((fi->flags & O_TRUNC) || (acc != O_RDONLY && n->u.sf->pt_fd >= 0)))
        write_kills_suidgid(fs, req, n);
      staged_change_end(n->ck);
    }
    h->writer = true;
    fi->direct_io = writes_direct(n, fi);
  }
  if (rc == 0 && n->kind == CKPT_NODE_SFILE && n->u.sf->pt_fd >= 0) {
    /* A passthrough file: every open is. One for writing unseals it
     * while no commit can begin. */
    if (!writing)
      rc = pt_open(req, n, h, fi, false);
    else if ((rc = staged_change_begin(fs, n->ck)) == 0) {
      rc = pt_open(req, n, h, fi, false);
      staged_change_end(n->ck);
    }
  }
  if (rc) {
    free(h ? h->text : NULL);
    free(h);
    put_node(fs, n);
    fuse_reply_err(req, -rc);
    return;
  }
  pthread_mutex_lock(&fs->lock);
  track_handle(fs, h); /* the node reference moves into the handle */
  pthread_mutex_unlock(&fs->lock);
  fi->fh = (uintptr_t)h;
  if (fuse_reply_open(req, fi))
    drop_handle(req, h); /* the opener is gone: no release will come */
}

/* Reply with a copy of handle memory: once the reply is written, the
 * caller may close the file and a release on another thread free the
 * handle while fuse_reply_buf still returns (sanitizers check the buffer
 * after writev). */
static void reply_copy(fuse_req_t req, const char *p, size_t n) {
  char *copy = malloc(n ? n : 1);
  if (!copy) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  memcpy(copy, p, n);
  fuse_reply_buf(req, copy, n);
  free(copy);
}

/* close(2) of a staged file written through this handle: the file ends
 * its write-behind stream, so that the next file can use it. (RELEASE may
 * come later than the trainer's next create; FLUSH comes within close.) */
static void fs_flush(fuse_req_t req, fuse_ino_t ino,
                     struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_flush);
  (void)ino;
  handle_t *h = handle_of(fi);
  if (h->writer)
    ckpt__sfile_end_stream(h->node->u.sf);
  fuse_reply_err(req, 0);
}

static void release_handle(fuse_req_t req, struct fuse_file_info *fi) {
  ckpt_fs_t *fs = fs_of(req);
  handle_t *h = handle_of(fi);
  if (h->node->ck)
    CKPT_RELEASING(h->node->ck);
  pt_release(req, h);
  put_pins(h);
  pthread_mutex_lock(&fs->lock);
  untrack_handle(fs, h);
  pthread_mutex_unlock(&fs->lock);
  free_handle(h);
  fuse_reply_err(req, 0);
}

static void tier_full_said(ckpt_fs_t *fs, ckpt_ckpt_t *ck);

static void fs_release(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi) {
  (void)ino;
  ckpt__metrics_request(req, CKPT_OP_release);
  ckpt_fs_t *fs = fs_of(req);
  /* a passthrough write's ENOSPC never reaches the daemon: a staged file
   * closed while the tier is full is the moment to say it */
  ckpt_node_t *n = handle_of(fi)->node;
  if (fs->tier_fd >= 0 && n->kind == CKPT_NODE_SFILE && n->ck) {
    char line[CKPT_TIER_FULL_MAX];
    ckpt__tier_full_line(fs, line, sizeof(line));
    if (line[0])
      tier_full_said(fs, n->ck);
  }
  release_handle(req, fi);
}

static void fs_releasedir(fuse_req_t req, fuse_ino_t ino,
                          struct fuse_file_info *fi) {
  (void)ino;
  ckpt__metrics_request(req, CKPT_OP_releasedir);
  release_handle(req, fi);
}

#define READ_AHEAD ((uint64_t)8 << 20)

/* Direct reads come one request at a time, each spliced from the data
 * file as it is read: without help the disk reads each request only when
 * it is asked for. Ask the kernel to read the next READ_AHEAD bytes of the
 * node's run behind this one, in the background, and again halfway. */
static void read_ahead(handle_t *h, uint64_t from) {
  uint64_t done = atomic_load(&h->advised);
  if (from + READ_AHEAD / 2 <= done)
    return;
  if (from < done)
    from = done;
  ckpt_fdref_t ref;
  uint64_t pos;
  size_t len;
  if (ckpt_stored_span(&h->node->ck->stored, ckpt__node_item(h->node),
                       READ_AHEAD, from, &ref, &pos, &len) == 1) {
    if (atomic_compare_exchange_strong(&h->advised, &done, from + len))
      posix_fadvise(ref.fd, (off_t)pos, (off_t)len, POSIX_FADV_WILLNEED);
    ckpt_fdref_put(&ref);
  }
}

static void fs_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_read);
  (void)ino;
  ckpt_fs_t *fs = fs_of(req);
  handle_t *h = handle_of(fi);
  ckpt_node_t *n = h->node;
  if (n->kind == CKPT_NODE_STATUS) {
    size_t o = (uint64_t)off < h->len ? (size_t)off : h->len;
    reply_copy(req, h->text + o, size < h->len - o ? size : h->len - o);
    return;
  }
  if (ckpt__is_view_kind(n->kind)) {
    ckpt__view_read(req, n, size, (uint64_t)off);
    return;
  }
  if (n->kind == CKPT_NODE_CBLOCK) {
    ckpt__block_read(req, n, size, (uint64_t)off);
    return;
  }
  if (n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_CBLOB) {
    const ckpt_stored_t *cs = &n->ck->stored;
    int bad = ckpt_stored_verify(cs, ckpt__node_item(n), size, (uint64_t)off);
    if (bad) {
      fuse_reply_err(req, -bad);
      return;
    }
    /* One contiguous run of a data file (a blob, a row shard): spliced
     * from the file's page cache, no copy here. */
    ckpt_fdref_t ref;
    uint64_t pos;
    size_t len;
    int rc = ckpt_stored_span(cs, ckpt__node_item(n), size, (uint64_t)off,
                              &ref, &pos, &len);
    if (rc < 0) {
      fuse_reply_err(req, -rc);
      return;
    }
    if (rc == 1) {
      if (fs->opts.direct_reads)
        read_ahead(h, (uint64_t)off + len);
      struct fuse_bufvec bv = FUSE_BUFVEC_INIT(len);
      bv.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK | FUSE_BUF_FD_RETRY;
      bv.buf[0].fd = ref.fd;
      bv.buf[0].pos = (off_t)pos;
      CKPT_SPLICED(n->ck);
      ckpt__metrics_read(req, len);
      fuse_reply_data(req, &bv, FUSE_BUF_SPLICE_MOVE);
      ckpt_fdref_put(&ref); /* the reply has been written */
      return;
    }
  }
  char *buf = malloc(size ? size : 1);
  if (!buf) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  ssize_t r;
  switch (n->kind) {
  case CKPT_NODE_SFILE:
    r = ckpt__sfile_read(n->u.sf, buf, size, (uint64_t)off);
    break;
  case CKPT_NODE_CTENSOR:
  case CKPT_NODE_CBLOB:
    r = ckpt_stored_read(&n->ck->stored, ckpt__node_item(n), buf, size,
                         (uint64_t)off);
    if (r > 0)
      ckpt__metrics_read(req, (uint64_t)r);
    break;
  case CKPT_NODE_METADATA:
    r = pread(h->fd, buf, size, off);
    if (r < 0)
      r = -errno;
    break;
  default:
    r = -EBADF;
  }
  if (r < 0)
    fuse_reply_err(req, (int)-r);
  else
    fuse_reply_buf(req, buf, (size_t)r);
  free(buf);
}

/* "sync" or "async", with an optional trailing newline. */

/* A staged write of ck failed with ENOSPC and the mount has a tier: the
 * log says so once per checkpoint, with what to do (nothing staged is
 * lost; its .status says the same while the tier is full). */
static void tier_full_said(ckpt_fs_t *fs, ckpt_ckpt_t *ck) {
  char line[CKPT_TIER_FULL_MAX] = "";
  ckpt__tier_full_line(fs, line, sizeof(line));
  pthread_mutex_lock(&fs->lock);
  bool said = ck->tier_full_said;
  ck->tier_full_said = true;
  pthread_mutex_unlock(&fs->lock);
  if (!said)
    ckpt__log("%s: a staged write got ENOSPC: %s", ck->name,
              line[0] ? line : "the tier is full\n");
}

static void fs_write(fuse_req_t req, fuse_ino_t ino, const char *buf,
                     size_t size, off_t off, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_write);
  (void)ino;
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = handle_of(fi)->node;
  ssize_t rc;
  if (n->kind == CKPT_NODE_COMMIT) {
    ckpt_commit_words_t words;
    rc = ckpt_commit_words_parse(buf, size, &words);
    if (rc) {
      char shown[300];
      log_text(shown, sizeof(shown), buf, size);
      ckpt__log("%s/.commit: refused the write of %zu byte(s) \"%s\": write "
                "\"sync\" or \"async\", optionally followed by \"solo\" "
                "and \"replace=TARGET\" (a trailing newline is fine)",
                n->ck->name, size, shown);
    }
    bool sync = words.sync;
    /* committed by a job process: its save (jobs.c) */
    pid_t job = rc == 0 ? ckpt__job_of(fs, fuse_req_ctx(req)->pid) : 0;
    if (job) {
      pthread_mutex_lock(&fs->lock);
      n->ck->job = job;
      pthread_mutex_unlock(&fs->lock);
    }
    if (rc == 0)
      rc = ckpt__save_begin(fs, n->ck, &words, sync ? req : NULL, size);
    if (rc == 0 && sync)
      return; /* replied by the dist thread when the save ends */
    if (rc == 0)
      fuse_reply_write(req, size);
    else
      fuse_reply_err(req, (int)-rc);
    return;
  }
  if (n->kind != CKPT_NODE_SFILE) {
    fuse_reply_err(req, is_committed_kind(n->kind) ? EROFS : EBADF);
    return;
  }
  if ((rc = staged_change_begin(fs, n->ck)) == 0) {
    rc = ckpt__sfile_write(n->u.sf, buf, size, (uint64_t)off);
    if (rc == -ENOSPC && fs->tier_fd >= 0)
      tier_full_said(fs, n->ck);
    if (rc > 0) {
      write_kills_suidgid(fs, req, n);
      touch_data(fs, n);
      atomic_fetch_add_explicit(&fs->metrics.bytes_staged, (uint64_t)rc,
                                memory_order_relaxed);
    }
    staged_change_end(n->ck);
  }
  if (rc < 0)
    fuse_reply_err(req, (int)-rc);
  else
    fuse_reply_write(req, (size_t)rc);
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
      if (!still_stored(fs, c, &pr))
        continue;
    }
    st.st_ino = c->ino;
    st.st_mode = c->mode;
    rc = add_dirent(req, b, c->name, &st);
  }
  return rc;
}

static void fs_opendir(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_opendir);
  ckpt_fs_t *fs = fs_of(req);
  int rc = 0;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino(fs, ino);
  if (!n)
    rc = -ESTALE;
  else if (!S_ISDIR(n->mode))
    rc = -ENOTDIR;
  handle_t *h = rc == 0 ? new_handle(n) : NULL;
  if (rc == 0 && !h)
    rc = -ENOMEM;
  if (rc == 0) {
    ckpt__node_ref(n);
    track_handle(fs, h);
  }
  pthread_mutex_unlock(&fs->lock);
  if (rc) {
    fuse_reply_err(req, -rc);
    return;
  }
  fi->fh = (uintptr_t)h;
  fuse_reply_open(req, fi);
}

static void fs_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_readdir);
  (void)ino;
  handle_t *h = handle_of(fi);
  if (off == 0 || !h->text) {
    /* A snapshot of the entries at each pass from the start: a rewinddir
     * (or a listing through an fd opened earlier) sees the directory as
     * it is now. */
    ckpt_fs_t *fs = fs_of(req);
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
  reply_copy(req, h->text + start, end - start);
}

/* ------------------------------------------------------------------------
 * Extended attributes.
 * ---------------------------------------------------------------------- */

static void reply_xattr_value(fuse_req_t req, const char *v, size_t len,
                              size_t size) {
  if (size == 0)
    fuse_reply_xattr(req, len);
  else if (size < len)
    fuse_reply_err(req, ERANGE);
  else
    fuse_reply_buf(req, v, len);
}

/* Say why a user.ckpt.* value was refused, with the valid forms. */
static void log_refused_xattr(ckpt_fs_t *fs, ckpt_node_t *n, const char *name,
                              const char *value, size_t size) {
  pthread_mutex_lock(&fs->lock);
  char *path = ckpt__node_path(n);
  pthread_mutex_unlock(&fs->lock);
  const char *want;
  char dtypes[512] = "";
  if (strcmp(name, "user.ckpt.dtype") == 0) {
    size_t off = 0;
    for (int d = 0; d < CKPT_DTYPE_COUNT && off < sizeof(dtypes); d++)
      off += (size_t)snprintf(dtypes + off, sizeof(dtypes) - off, "%s%s",
                              d ? ", " : "", ckpt_dtype_name((ckpt_dtype_t)d));
    want = dtypes;
  } else if (strcmp(name, "user.ckpt.fqn") == 0) {
    want = "the item's FQN: 1 to 4096 bytes, no NUL";
  } else {
    want = "comma-separated whole numbers (4096,1024; empty for a scalar), "
           "as many as the shape's, with offsets + sizes within the shape";
  }
  char shown[300];
  log_text(shown, sizeof(shown), value, size);
  ckpt__log("%s/%s: refused %s=\"%s\": valid: %s", n->ck->name,
            path ? path : "?", name, shown, want);
  free(path);
}

/* A checkpoint is a tree of tensors and bytes items: no symbolic or hard
 * links, device nodes, FIFOs or sockets. EPERM is what POSIX says for a
 * filesystem that does not support the kind of node (the kernel's answer
 * for an operation the daemon lacks, ENOSYS, reads as a bug). */
/* A checkpoint holds regular files and directories only: anything else is
 * refused with EPERM and a line saying so (cp -a of a tree with a symlink
 * otherwise fails without a word of why). */
static void refuse_node(fuse_req_t req, fuse_ino_t parent, const char *name,
                        const char *what) {
  ckpt_fs_t *fs = fs_of(req);
  char shown[300], ck[300] = "";
  log_text(shown, sizeof(shown), name, strlen(name));
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  if (p && p->ck)
    log_text(ck, sizeof(ck), p->ck->name, strlen(p->ck->name));
  pthread_mutex_unlock(&fs->lock);
  ckpt__log("%s (in %s): refused: a %s; a checkpoint holds regular files "
            "and directories only (cp -L copies what links point to)",
            shown, ck[0] ? ck : "the mount's root", what);
  fuse_reply_err(req, EPERM);
}

static void fs_symlink(fuse_req_t req, const char *link, fuse_ino_t parent,
                       const char *name) {
  ckpt__metrics_request(req, CKPT_OP_symlink);
  (void)link;
  refuse_node(req, parent, name, "symbolic link");
}

static void fs_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent,
                    const char *newname) {
  ckpt__metrics_request(req, CKPT_OP_link);
  (void)ino;
  refuse_node(req, newparent, newname, "hard link");
}

/* mknod(2) of a regular file makes an empty staged file (as creat would);
 * other kinds of node are refused. */
static void fs_mknod(fuse_req_t req, fuse_ino_t parent, const char *name,
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
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  struct fuse_entry_param e;
  int rc;
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *p = ckpt__node_by_ino(fs, parent);
  ckpt_node_t *n = NULL;
  if (!p)
    rc = -ESTALE;
  else if ((rc = new_staged_file(fs, p, name, mode, ctx, &n)) == 0)
    fill_entry(fs, n, &e); /* as mkdir: nodes live while attached */
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
static void fs_fallocate(fuse_req_t req, fuse_ino_t ino, int mode,
                         off_t offset, off_t length,
                         struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_fallocate);
  (void)ino;
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = handle_of(fi)->node;
  int rc = 0;
  const int known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE |
                    FALLOC_FL_ZERO_RANGE;
  if (n->kind != CKPT_NODE_SFILE)
    rc = is_committed_kind(n->kind) ? -EROFS : -EBADF;
  else if (mode & ~known)
    rc = -EOPNOTSUPP; /* COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE */
  else if ((mode & FALLOC_FL_PUNCH_HOLE) &&
           (!(mode & FALLOC_FL_KEEP_SIZE) || (mode & FALLOC_FL_ZERO_RANGE)))
    rc = -EINVAL; /* as the kernel requires */
  else if (offset < 0 || length <= 0)
    rc = -EINVAL;
  else if ((uint64_t)offset + (uint64_t)length > ((uint64_t)1 << 40))
    rc = -EFBIG;
  if (rc == 0 && (rc = staged_change_begin(fs, n->ck)) == 0) {
    uint64_t end = (uint64_t)offset + (uint64_t)length;
    if (mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE))
      rc = ckpt__sfile_zero(n->u.sf, (uint64_t)offset, (uint64_t)length);
    if (rc == 0 && !(mode & FALLOC_FL_KEEP_SIZE) &&
        end > ckpt__sfile_size(n->u.sf))
      rc = ckpt__sfile_truncate(n->u.sf, end);
    if (rc == 0)
      touch_data(fs, n);
    staged_change_end(n->ck);
  }
  fuse_reply_err(req, -rc);
}

/* The FQN of a committed tensor or bytes item. */
static const char *committed_fqn(const ckpt_node_t *n) {
  const ckpt_metadata_t *m = n->ck->meta;
  return n->kind == CKPT_NODE_CTENSOR ? m->tensors[n->u.tensor].fqn
                                      : m->blobs[n->u.blob].fqn;
}

/* Is the FQN of a committed item the one its path gives ('/' -> '.')? */
static bool committed_fqn_derived(const ckpt_node_t *n) {
  const ckpt_metadata_t *m = n->ck->meta;
  const char *path = n->kind == CKPT_NODE_CTENSOR
                         ? m->tensors[n->u.tensor].path
                         : m->blobs[n->u.blob].path;
  const char *fqn = committed_fqn(n);
  for (; *path && *fqn; path++, fqn++)
    if (*fqn != (*path == '/' ? '.' : *path))
      return false;
  return *path == '\0' && *fqn == '\0';
}

/* A committed checkpoint's directory tells what retention sees of it:
 * user.ckpt.step (recorded at commit, else from the name),
 * user.ckpt.metric.KEY per metric, user.ckpt.protected (0 or 1: the
 * marker of ckptctl protect, else the commit word). false when n is not
 * such a directory. */
#define METRIC_XATTR "user.ckpt.metric."
static bool committed_ckpt(ckpt_fs_t *fs, const ckpt_node_t *n) {
  if (n->kind != CKPT_NODE_CKPT)
    return false;
  pthread_mutex_lock(&fs->lock);
  bool yes = n->ck->state == CKPT_COMMITTED && n->ck->meta;
  pthread_mutex_unlock(&fs->lock);
  return yes;
}

static void reply_ckpt_xattr(fuse_req_t req, ckpt_fs_t *fs,
                             const ckpt_node_t *n, const char *name,
                             size_t size) {
  const ckpt_metadata_t *m = n->ck->meta;
  char v[48];
  double x;
  int len = -1;
  if (strcmp(name, "user.ckpt.step") == 0) {
    int64_t step = m->has_step ? m->step : ckpt_step_from_name(n->ck->name);
    if (step >= 0)
      len = snprintf(v, sizeof(v), "%lld", (long long)step);
  } else if (strcmp(name, "user.ckpt.protected") == 0) {
    /* the mark is BACKING_DIR's (a tier's copy has none) */
    int dfd = ckpt_store_open_dir(fs->backing_fd, n->ck->name, O_RDONLY);
    int mark = dfd >= 0 ? ckpt__protect_read(dfd) : -1;
    if (dfd >= 0)
      close(dfd);
    len = snprintf(v, sizeof(v), "%d", mark >= 0 ? mark : m->protect);
  } else if (strncmp(name, METRIC_XATTR, strlen(METRIC_XATTR)) == 0 &&
             ckpt_metadata_metric(m, name + strlen(METRIC_XATTR), &x)) {
    len = ckpt_metric_format(x, v, sizeof(v));
  }
  if (len < 0)
    fuse_reply_err(req, ENODATA);
  else
    reply_xattr_value(req, v, (size_t)len, size);
}

/* setxattr user.ckpt.protected 1 or 0 on a committed checkpoint's
 * directory: ckptctl protect / unprotect (catalog.c), on BACKING_DIR. */
static int set_protected(ckpt_fs_t *fs, const ckpt_node_t *n,
                         const char *value, size_t size) {
  if (size && value[size - 1] == '\n')
    size--;
  if (size != 1 || (value[0] != '0' && value[0] != '1'))
    return -EINVAL;
  int rc = ckpt__checkpoint_protect(fs->backing_fd, n->ck->name,
                                    value[0] == '1');
  if (rc == -ENOENT && fs->tier_fd >= 0)
    rc = -EAGAIN; /* in the tier only: not flushed yet */
  if (rc)
    ckpt__log("%s: user.ckpt.protected=%c refused: %s%s", n->ck->name,
              value[0], strerror(-rc),
              rc == -EAGAIN ? " (not flushed to BACKING_DIR yet; try again "
                              "once it is)" : "");
  else
    ckpt__log("%s: %s", n->ck->name,
              value[0] == '1' ? "protected" : "no longer protected");
  return rc;
}

static void list_ckpt_xattrs(fuse_req_t req, const ckpt_node_t *n,
                             size_t size) {
  const ckpt_metadata_t *m = n->ck->meta;
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  bool step = m->has_step || ckpt_step_from_name(n->ck->name) >= 0;
  int rc = step ? ckpt_buf_append(&b, "user.ckpt.step", 15) : 0;
  if (rc == 0)
    rc = ckpt_buf_append(&b, "user.ckpt.protected", 20);
  for (uint32_t i = 0; rc == 0 && i < m->n_metrics; i++)
    rc = ckpt_buf_printf(&b, METRIC_XATTR "%s", m->metrics[i].key) < 0
             ? -ENOMEM
             : ckpt_buf_append(&b, "", 1);
  if (rc)
    fuse_reply_err(req, ENOMEM);
  else
    reply_xattr_value(req, (const char *)b.data, b.len, size);
  ckpt_buf_free(&b);
}

static void fs_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                        const char *value, size_t size, int flags) {
  ckpt__metrics_request(req, CKPT_OP_setxattr);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int rc;
  if (n->kind == CKPT_NODE_ROOT && strcmp(name, CKPT_JOB_XATTR) == 0) {
    rc = ckpt__job_declare(fs, fuse_req_ctx(req)->pid, value, size);
  } else if (is_committed_kind(n->kind)) {
    rc = -EROFS;
  } else if (committed_ckpt(fs, n) &&
             strcmp(name, "user.ckpt.protected") == 0) {
    rc = set_protected(fs, n, value, size);
  } else if (committed_ckpt(fs, n)) {
    rc = -EROFS;
  } else if (n->kind != CKPT_NODE_SFILE) {
    rc = -ENOTSUP;
  } else {
    if ((rc = staged_change_begin(fs, n->ck)) == 0) {
      rc = ckpt__sfile_setxattr(n->u.sf, name, value, size, flags);
      staged_change_end(n->ck);
    }
    if (rc == -EINVAL)
      log_refused_xattr(fs, n, name, value, size);
  }
  put_node(fs, n);
  fuse_reply_err(req, -rc);
}

/* The root tells the mount's world, so that a trainer can check its own
 * world size and rank against the mount's before staging anything. */
static const char root_xattrs[] = "user.ckpt.world_size\0user.ckpt.rank";

static void reply_root_xattr(fuse_req_t req, const ckpt_fs_t *fs,
                             const char *name, size_t size) {
  char v[16];
  int len;
  if (strcmp(name, "user.ckpt.world_size") == 0)
    len = snprintf(v, sizeof(v), "%d", fs->world_size);
  else if (strcmp(name, "user.ckpt.rank") == 0)
    len = snprintf(v, sizeof(v), "%d", fs->rank);
  else {
    fuse_reply_err(req, ENODATA);
    return;
  }
  reply_xattr_value(req, v, (size_t)len, size);
}

static void fs_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name,
                        size_t size) {
  ckpt__metrics_request(req, CKPT_OP_getxattr);
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  if (n->kind == CKPT_NODE_ROOT) {
    reply_root_xattr(req, fs, name, size);
  } else if (committed_ckpt(fs, n)) {
    reply_ckpt_xattr(req, fs, n, name, size);
  } else if (n->kind == CKPT_NODE_SFILE) {
    char *buf = size ? malloc(size) : NULL;
    int rc = size && !buf ? -ENOMEM
                          : ckpt__sfile_getxattr(n->u.sf, name, buf, size);
    if (rc < 0)
      fuse_reply_err(req, -rc);
    else if (size == 0)
      fuse_reply_xattr(req, (size_t)rc);
    else
      fuse_reply_buf(req, buf, (size_t)rc);
    free(buf);
  } else if ((n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_CBLOB) &&
             ckpt__xattr_index(name) == CKPT_X_FQN) {
    const char *fqn = committed_fqn(n);
    reply_xattr_value(req, fqn, strlen(fqn), size);
  } else if (n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_CBLOCK) {
    bool blk = n->kind == CKPT_NODE_CBLOCK;
    const ckpt_tensor_meta_t *t =
        &n->ck->meta->tensors[blk ? n->u.block->tensor : n->u.tensor];
    /* A block file's shape is the block's. */
    const int64_t *shape = blk ? n->u.block->dims + t->ndim : t->shape;
    int idx = ckpt__xattr_index(name);
    if (idx == CKPT_X_DTYPE) {
      const char *v = ckpt_dtype_name(t->dtype);
      reply_xattr_value(req, v, strlen(v), size);
    } else if (idx == CKPT_X_SHAPE) {
      int len = ckpt_dims_format(shape, t->ndim, CKPT_DIMS_CSV, NULL, 0);
      char *v = malloc((size_t)len + 1);
      if (!v) {
        fuse_reply_err(req, ENOMEM);
      } else {
        ckpt_dims_format(shape, t->ndim, CKPT_DIMS_CSV, v, (size_t)len + 1);
        reply_xattr_value(req, v, (size_t)len, size);
        free(v);
      }
    } else {
      fuse_reply_err(req, ENODATA);
    }
  } else {
    fuse_reply_err(req, ENODATA);
  }
  put_node(fs, n);
}

static void fs_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  ckpt__metrics_request(req, CKPT_OP_listxattr);
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  if (n->kind == CKPT_NODE_SFILE) {
    char *buf = size ? malloc(size) : NULL;
    int rc = size && !buf ? -ENOMEM
                          : ckpt__sfile_listxattr(n->u.sf, buf, size);
    if (rc < 0)
      fuse_reply_err(req, -rc);
    else if (size == 0)
      fuse_reply_xattr(req, (size_t)rc);
    else
      fuse_reply_buf(req, buf, (size_t)rc);
    free(buf);
  } else if (n->kind == CKPT_NODE_ROOT) {
    reply_xattr_value(req, root_xattrs, sizeof(root_xattrs), size);
  } else if (committed_ckpt(fs, n)) {
    list_ckpt_xattrs(req, n, size);
  } else if (n->kind == CKPT_NODE_CBLOCK) {
    static const char names[] = "user.ckpt.dtype\0user.ckpt.shape";
    reply_xattr_value(req, names, sizeof(names), size);
  } else if (n->kind == CKPT_NODE_CTENSOR || n->kind == CKPT_NODE_CBLOB) {
    /* user.ckpt.fqn is listed where the path does not say the FQN (so
     * that copying the tree keeps it); getxattr answers it always. */
    static const char names[] =
        "user.ckpt.dtype\0user.ckpt.shape\0user.ckpt.fqn";
    const size_t fqn_at = sizeof("user.ckpt.dtype\0user.ckpt.shape");
    bool tensor = n->kind == CKPT_NODE_CTENSOR;
    bool fqn = !committed_fqn_derived(n);
    size_t len = tensor ? (fqn ? sizeof(names) : fqn_at)
                        : (fqn ? sizeof(names) - fqn_at : 0);
    reply_xattr_value(req, tensor ? names : names + fqn_at, len, size);
  } else {
    reply_xattr_value(req, "", 0, size);
  }
  put_node(fs, n);
}

static void fs_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name) {
  ckpt__metrics_request(req, CKPT_OP_removexattr);
  if (!may_change(req)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  ckpt_fs_t *fs = fs_of(req);
  ckpt_node_t *n = get_node_any(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int rc;
  if (n->kind == CKPT_NODE_ROOT && strcmp(name, CKPT_JOB_XATTR) == 0) {
    rc = ckpt__job_declare(fs, fuse_req_ctx(req)->pid, "end", 3);
  } else if (is_committed_kind(n->kind)) {
    rc = -EROFS;
  } else if (n->kind != CKPT_NODE_SFILE) {
    rc = -ENODATA;
  } else {
    if ((rc = staged_change_begin(fs, n->ck)) == 0) {
      rc = ckpt__sfile_removexattr(n->u.sf, name);
      staged_change_end(n->ck);
    }
  }
  put_node(fs, n);
  fuse_reply_err(req, -rc);
}

/* ------------------------------------------------------------------------
 * The mount.
 * ---------------------------------------------------------------------- */

/* The kernel dropped inodes: only block files live by the kernel's
 * lookups (every other node stays in the tree while its entry exists). */
static void fs_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  ckpt__metrics_request(req, CKPT_OP_forget);
  ckpt_fs_t *fs = fs_of(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  if (n)
    ckpt__block_forget(fs, n, nlookup);
  pthread_mutex_unlock(&fs->lock);
  fuse_reply_none(req);
}

static void fs_forget_multi(fuse_req_t req, size_t count,
                            struct fuse_forget_data *forgets) {
  ckpt__metrics_request(req, CKPT_OP_forget); /* a batch: one request */
  ckpt_fs_t *fs = fs_of(req);
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
 * changes to the mounting user and root (may_change), as the requests
 * themselves are; what the kernel cannot know is the execute bit: as in
 * the kernel's generic_permission, a file with no execute bit is not
 * executable even by root, and another caller needs the bit of its class.
 * Committed data and .status cannot be opened for writing (EACCES, as
 * their modes say). */
static void fs_access(fuse_req_t req, fuse_ino_t ino, int mask) {
  ckpt__metrics_request(req, CKPT_OP_access);
  ckpt_fs_t *fs = fs_of(req);
  const struct fuse_ctx *ctx = fuse_req_ctx(req);
  pthread_mutex_lock(&fs->lock);
  ckpt_node_t *n = ckpt__node_by_ino_any(fs, ino);
  mode_t mode = n ? n->mode : 0;
  uid_t uid = n ? n->uid : 0;
  gid_t gid = n ? n->gid : 0;
  bool read_only = n && !S_ISDIR(mode) &&
                   (is_committed_kind(n->kind) || n->kind == CKPT_NODE_STATUS);
  pthread_mutex_unlock(&fs->lock);
  int rc = 0;
  if (!n) {
    rc = ESTALE;
  } else if ((mask & W_OK) && !may_change(req)) {
    rc = EACCES;
  } else if ((mask & W_OK) && read_only) {
    rc = EACCES; /* as its mode says (no write bit): rm then asks, as for
                    any read-only file; EROFS would make it refuse */
  } else if ((mask & X_OK) && !S_ISDIR(mode)) {
    mode_t bit = ctx->uid == 0    ? (S_IXUSR | S_IXGRP | S_IXOTH)
                 : ctx->uid == uid ? S_IXUSR
                 : in_group(req, gid) ? S_IXGRP
                                      : S_IXOTH;
    if (!(mode & bit))
      rc = EACCES;
  }
  fuse_reply_err(req, rc);
}

static void fs_statfs(fuse_req_t req, fuse_ino_t ino) {
  ckpt__metrics_request(req, CKPT_OP_statfs);
  (void)ino;
  ckpt_fs_t *fs = fs_of(req);
  struct statvfs sv;
  if (fstatvfs(fs->backing_fd, &sv))
    fuse_reply_err(req, errno);
  else
    fuse_reply_statfs(req, &sv);
}

static void fs_init(void *userdata, struct fuse_conn_info *conn) {
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
    .init = fs_init,
    .lookup = fs_lookup,
    .forget = fs_forget,
    .forget_multi = fs_forget_multi,
    .getattr = fs_getattr,
    .setattr = fs_setattr,
    .mkdir = fs_mkdir,
    .create = fs_create,
    .unlink = fs_unlink,
    .rmdir = fs_rmdir,
    .rename = fs_rename,
    .open = fs_open,
    .flush = fs_flush,
    .release = fs_release,
    .read = fs_read,
    .write = fs_write,
    .fallocate = fs_fallocate,
    .symlink = fs_symlink,
    .link = fs_link,
    .mknod = fs_mknod,
    .opendir = fs_opendir,
    .readdir = fs_readdir,
    .releasedir = fs_releasedir,
    .setxattr = fs_setxattr,
    .getxattr = fs_getxattr,
    .listxattr = fs_listxattr,
    .removexattr = fs_removexattr,
    .statfs = fs_statfs,
    .access = fs_access,
};

void ckpt__scan_put(ckpt_scan_t *sc) {
  if (!sc || --sc->refs)
    return;
  ckpt__catalog_names_free(sc->names, sc->n);
  free(sc->pr);
  free(sc);
}
