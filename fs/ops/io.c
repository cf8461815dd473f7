/*
 * io.c - open, read, write, flush and release: staged files through the
 * daemon or by FUSE passthrough, committed items spliced from their data
 * files or passed through, .status, .metadata and .commit.
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

static void tier_full_said(ckpt_fs_t *fs, ckpt_ckpt_t *ck);

/* Pass an open of staged file n through to its backing file
 * (fi->backing_id): every open of a passthrough file must be, with one
 * backing id while any is open. A new empty file opened write-only
 * (create) gets its backing file here. An open for writing (the freeze
 * lock held shared by the caller, or a create) unseals the file, under
 * the same hold of sf->lock as the open is counted, so that a drain's
 * hash across it is dropped. 0, or -errno for an open of a passthrough
 * file that cannot be passed through (a file that never was one stays on
 * the daemon's path). */
int ckpt__op_pt_open(fuse_req_t req, ckpt_node_t *n, handle_t *h,
                   struct fuse_file_info *fi, bool start) {
#ifdef FUSE_CAP_PASSTHROUGH
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
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
    fi->noflush = 1; /* its writes are the kernel's: close has nothing to
                        tell the daemon (ckpt__op_flush) */
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
 * too, and so is a block file that is such a chunk (a rank's shard, read
 * as `.NAME[a:b]`): straight from the data file's page cache, without a
 * request to the daemon. Its checksum is checked first, here (the daemon sees none of
 * the reads after this), and again at a later open when the data file
 * changed on disk (pin_files' recheck). Anything else, or a chunk that is
 * damaged (its reads then get EIO), stays on the daemon's path. */
#define CKPT_PT_READ_MIN CKPT_PT_DRAIN_MIN
static void pt_open_committed(fuse_req_t req, ckpt_node_t *n, handle_t *h,
                              struct fuse_file_info *fi) {
#ifdef FUSE_CAP_PASSTHROUGH
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  if (!fs->passthrough || !fs->opts.direct_reads || (fi->flags & O_DIRECT) ||
      (n->kind != CKPT_NODE_CTENSOR && n->kind != CKPT_NODE_CBLOB &&
       n->kind != CKPT_NODE_CBLOCK))
    return; /* O_DIRECT: the daemon's path, any alignment */
  const ckpt_stored_t *s = &n->ck->stored;
  ckpt_item_t it = ckpt__node_item(n);
  uint64_t size = 0, off = 0; /* the file's bytes: [off, off+size) of it */
  if (n->kind != CKPT_NODE_CBLOCK) {
    size = ckpt_stored_size(s, it);
  } else if (ckpt__block_run(n->ck, n->u.block, &off)) {
    /* a block file that is one run of its tensor (a rank's own shard,
     * the resharded read of a chunk): straight from that chunk's data
     * file when the chunk is the whole of it (written once) */
    it = (ckpt_item_t){false, n->u.block->tensor};
    size = n->u.block->bytes;
  }
  ckpt_fdref_t ref;
  uint64_t pos;
  size_t len;
  struct stat st;
  if (size < CKPT_PT_READ_MIN || size > SIZE_MAX ||
      ckpt_stored_span(s, it, (size_t)size, off, &ref, &pos, &len) != 1)
    return;
  /* checked before the kernel serves a byte (a no-op once checked, until
   * its data file changes: pin_files' recheck); no hold of fs->lock */
  bool whole = pos == 0 && len == size && fstat(ref.fd, &st) == 0 &&
               (uint64_t)st.st_size == size;
  if (!whole || ckpt_stored_verify(s, it, (size_t)size, off) != 0) {
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
  fi->noflush = 1;
#else
  (void)req, (void)n, (void)h, (void)fi;
#endif
}

static void pt_release(fuse_req_t req, handle_t *h) {
#ifdef FUSE_CAP_PASSTHROUGH
  if (h->cpt) {
    ckpt_fs_t *fs = ckpt__op_fs_of(req);
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
      atomic_fetch_add_explicit(&ckpt__op_fs_of(req)->metrics.bytes_staged,
                                (uint64_t)st.st_size, memory_order_relaxed);
  }
  if (last && sf->pt_id > 0) {
    fuse_passthrough_close(req, sf->pt_id);
    sf->pt_id = 0;
  }
  last = last && sf->pt_fd >= 0;
  pthread_mutex_unlock(&sf->lock);
  if (last) /* closed: hashed while the trainer goes on */
    ckpt__drain_add(ckpt__op_fs_of(req)->drain, h->node);
#else
  (void)req, (void)h;
#endif
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

void ckpt__op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_open);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_get_node(fs, ino);
  if (!n) {
    fuse_reply_err(req, ESTALE);
    return;
  }
  int acc = fi->flags & O_ACCMODE;
  bool writing = acc != O_RDONLY || (fi->flags & O_TRUNC);
  int rc = 0;
  handle_t *h = ckpt__op_new_handle(n);
  if (!h) {
    rc = -ENOMEM;
  } else if (writing && !ckpt__op_may_change(req)) {
    rc = -EACCES;
  } else if (S_ISDIR(n->mode)) {
    rc = -EISDIR;
  } else if (n->kind == CKPT_NODE_COMMIT) {
    rc = acc == O_RDONLY ? -EACCES : 0;
    fi->direct_io = 1;
  } else if (n->kind == CKPT_NODE_STATUS) {
    pthread_mutex_lock(&fs->lock);
    h->text = writing ? NULL : ckpt__op_status_text(fs, n->ck);
    pthread_mutex_unlock(&fs->lock);
    rc = writing ? -EACCES : h->text ? 0 : -ENOMEM;
    h->len = h->text ? strlen(h->text) : 0;
    fi->direct_io = 1;
  } else if (ckpt__op_is_committed_kind(n->kind)) {
    if (writing)
      rc = -EROFS;
    else if (n->kind == CKPT_NODE_METADATA &&
             (h->fd = ckpt__op_open_metadata(fs, n->ck)) < 0)
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
    if ((rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
      if (fi->flags & O_TRUNC) {
        rc = ckpt__sfile_truncate(n->u.sf, 0);
        if (rc == 0)
          ckpt__op_touch_data(fs, n);
      }
      /* truncated, or passed through (its writes unseen here) */
      if (rc == 0 && n->kind == CKPT_NODE_SFILE &&
          ((fi->flags & O_TRUNC) || (acc != O_RDONLY && n->u.sf->pt_fd >= 0)))
        ckpt__op_write_kills_suidgid(fs, req, n);
      ckpt__op_staged_change_end(n->ck);
    }
    h->writer = true;
    fi->direct_io = ckpt__op_writes_direct(n, fi);
  }
  if (rc == 0 && n->kind == CKPT_NODE_SFILE && n->u.sf->pt_fd >= 0) {
    /* A passthrough file: every open is. One for writing unseals it
     * while no commit can begin. */
    if (!writing)
      rc = ckpt__op_pt_open(req, n, h, fi, false);
    else if ((rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
      rc = ckpt__op_pt_open(req, n, h, fi, false);
      ckpt__op_staged_change_end(n->ck);
    }
  }
  if (rc) {
    free(h ? h->text : NULL);
    free(h);
    ckpt__op_put_node(fs, n);
    fuse_reply_err(req, -rc);
    return;
  }
  pthread_mutex_lock(&fs->lock);
  ckpt__op_track_handle(fs, h); /* the node reference moves into the handle */
  pthread_mutex_unlock(&fs->lock);
  fi->fh = (uintptr_t)h;
  if (!h->writer)
    fi->noflush = 1; /* nothing to do at its close (ckpt__op_flush) */
  if (fuse_reply_open(req, fi))
    ckpt__op_drop_handle(req, h); /* the opener is gone: no release will come */
}

/* close(2) of a staged file written through this handle: the file ends
 * its write-behind stream, so that the next file can use it. (RELEASE may
 * come later than the trainer's next create; FLUSH comes within close.)
 * Only such handles get a FLUSH: every other open says noflush (a read,
 * or a passthrough write the daemon never sees), which spares close(2) a
 * request. */
void ckpt__op_flush(fuse_req_t req, fuse_ino_t ino,
                     struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_flush);
  (void)ino;
  handle_t *h = ckpt__op_handle_of(fi);
  if (h->writer)
    ckpt__sfile_end_stream(h->node->u.sf);
  fuse_reply_err(req, 0);
}

static void release_handle(fuse_req_t req, struct fuse_file_info *fi) {
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  handle_t *h = ckpt__op_handle_of(fi);
  if (h->node->ck)
    CKPT_RELEASING(h->node->ck);
  pt_release(req, h);
  ckpt__op_put_pins(h);
  pthread_mutex_lock(&fs->lock);
  ckpt__op_untrack_handle(fs, h);
  pthread_mutex_unlock(&fs->lock);
  ckpt__op_free_handle(h);
  fuse_reply_err(req, 0);
}

void ckpt__op_release(fuse_req_t req, fuse_ino_t ino,
                       struct fuse_file_info *fi) {
  (void)ino;
  ckpt__metrics_request(req, CKPT_OP_release);
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  /* a passthrough write's ENOSPC never reaches the daemon: a staged file
   * closed while the tier is full is the moment to say it */
  ckpt_node_t *n = ckpt__op_handle_of(fi)->node;
  if (fs->tier_fd >= 0 && n->kind == CKPT_NODE_SFILE && n->ck) {
    char line[CKPT_TIER_FULL_MAX];
    ckpt__tier_full_line(fs, line, sizeof(line));
    if (line[0])
      tier_full_said(fs, n->ck);
  }
  release_handle(req, fi);
}

void ckpt__op_releasedir(fuse_req_t req, fuse_ino_t ino,
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

/* Reply with bytes [off, off+size) read by r (a kind's reader into a
 * buffer): bytes read or -errno. */
static void reply_read(fuse_req_t req, size_t size,
                       ssize_t (*r)(fuse_req_t req, handle_t *h, char *buf,
                                    size_t size, uint64_t off),
                       handle_t *h, uint64_t off) {
  char *buf = malloc(size ? size : 1);
  if (!buf) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  ssize_t n = r(req, h, buf, size, off);
  if (n < 0)
    fuse_reply_err(req, (int)-n);
  else
    fuse_reply_buf(req, buf, (size_t)n);
  free(buf);
}

static ssize_t sfile_pread(fuse_req_t req, handle_t *h, char *buf,
                           size_t size, uint64_t off) {
  (void)req;
  return ckpt__sfile_read(h->node->u.sf, buf, size, off);
}

static ssize_t stored_pread(fuse_req_t req, handle_t *h, char *buf,
                            size_t size, uint64_t off) {
  ckpt_node_t *n = h->node;
  ssize_t r = ckpt_stored_read(&n->ck->stored, ckpt__node_item(n), buf, size,
                               off);
  if (r > 0)
    ckpt__metrics_read(req, (uint64_t)r);
  return r;
}

static ssize_t metadata_pread(fuse_req_t req, handle_t *h, char *buf,
                              size_t size, uint64_t off) {
  (void)req;
  ssize_t r = pread(h->fd, buf, size, (off_t)off);
  return r < 0 ? -errno : r;
}

void ckpt__op_read_staged(fuse_req_t req, handle_t *h, size_t size,
                          uint64_t off) {
  reply_read(req, size, sfile_pread, h, off);
}

void ckpt__op_read_metadata(fuse_req_t req, handle_t *h, size_t size,
                            uint64_t off) {
  reply_read(req, size, metadata_pread, h, off);
}

void ckpt__op_read_status(fuse_req_t req, handle_t *h, size_t size,
                          uint64_t off) {
  size_t o = off < h->len ? (size_t)off : h->len;
  ckpt__op_reply_copy(req, h->text + o, size < h->len - o ? size : h->len - o);
}

/* A committed tensor or blob: verified first; one contiguous run of a
 * data file (a blob, a row shard) is spliced from the file's page cache,
 * no copy here; anything else is assembled. */
void ckpt__op_read_committed(fuse_req_t req, handle_t *h, size_t size,
                             uint64_t off) {
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = h->node;
  const ckpt_stored_t *cs = &n->ck->stored;
  int rc = ckpt_stored_verify(cs, ckpt__node_item(n), size, off);
  ckpt_fdref_t ref;
  uint64_t pos;
  size_t len;
  if (rc == 0)
    rc = ckpt_stored_span(cs, ckpt__node_item(n), size, off, &ref, &pos, &len);
  if (rc < 0) {
    fuse_reply_err(req, -rc);
    return;
  }
  if (rc == 0) {
    reply_read(req, size, stored_pread, h, off);
    return;
  }
  if (fs->opts.direct_reads)
    read_ahead(h, off + len);
  ckpt__reply_spliced(req, n->ck, &ref, pos, len);
}

void ckpt__op_read_view(fuse_req_t req, handle_t *h, size_t size,
                        uint64_t off) {
  ckpt__view_read(req, h->node, size, off);
}

void ckpt__op_read_block(fuse_req_t req, handle_t *h, size_t size,
                         uint64_t off) {
  ckpt__block_read(req, h->node, size, off);
}

void ckpt__op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                   struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_read);
  (void)ino;
  handle_t *h = ckpt__op_handle_of(fi);
  const ckpt_op_kind_t *k = ckpt__op_kind(h->node);
  if (k->read)
    k->read(req, h, size, (uint64_t)off);
  else
    fuse_reply_err(req, EBADF);
}

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

void ckpt__op_write(fuse_req_t req, fuse_ino_t ino, const char *buf,
                     size_t size, off_t off, struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_write);
  (void)ino;
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  ckpt_node_t *n = ckpt__op_handle_of(fi)->node;
  ssize_t rc;
  if (n->kind == CKPT_NODE_COMMIT) {
    ckpt_commit_words_t words;
    rc = ckpt_commit_words_parse(buf, size, &words);
    if (rc) {
      char shown[300];
      ckpt__op_log_text(shown, sizeof(shown), buf, size);
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
    fuse_reply_err(req, ckpt__op_is_committed_kind(n->kind) ? EROFS : EBADF);
    return;
  }
  if ((rc = ckpt__op_staged_change_begin(fs, n->ck)) == 0) {
    rc = ckpt__sfile_write(n->u.sf, buf, size, (uint64_t)off);
    if (rc == -ENOSPC && fs->tier_fd >= 0)
      tier_full_said(fs, n->ck);
    if (rc > 0) {
      ckpt__op_write_kills_suidgid(fs, req, n);
      ckpt__op_touch_data(fs, n);
      atomic_fetch_add_explicit(&fs->metrics.bytes_staged, (uint64_t)rc,
                                memory_order_relaxed);
    }
    ckpt__op_staged_change_end(n->ck);
  }
  if (rc < 0)
    fuse_reply_err(req, (int)-rc);
  else
    fuse_reply_write(req, (size_t)rc);
}

/* A handle whose open reply could not be sent: released here. */
void ckpt__op_drop_handle(fuse_req_t req, handle_t *h) {
  ckpt_fs_t *fs = ckpt__op_fs_of(req);
  pt_release(req, h);
  ckpt__op_put_pins(h);
  pthread_mutex_lock(&fs->lock);
  ckpt__op_untrack_handle(fs, h);
  pthread_mutex_unlock(&fs->lock);
  ckpt__op_free_handle(h);
}

/* SEEK_DATA or SEEK_HOLE from off in committed item n: where the rest of
 * the item is one run of one data file (a blob, a tensor of one chunk),
 * that file's own holes (a sparse file committed stays sparse: cp, tar -S
 * and rsync -S skip its holes); where ckpt_stored_span finds it assembled
 * from several places, data throughout (a valid answer: a filesystem need
 * not report holes). At most CKPT_SEEK_RUNS lookups. */
#define CKPT_SEEK_RUNS 4096
int64_t ckpt__op_seek_committed(ckpt_node_t *n, uint64_t off, int whence) {
  const ckpt_stored_t *s = &n->ck->stored;
  ckpt_item_t it = ckpt__node_item(n);
  uint64_t size = ckpt_stored_size(s, it);
  if (off >= size)
    return -ENXIO;
  for (int runs = 0; off < size && runs < CKPT_SEEK_RUNS; runs++) {
    uint64_t left = size - off;
    size_t want = left > SIZE_MAX ? SIZE_MAX : (size_t)left;
    ckpt_fdref_t ref;
    uint64_t pos;
    size_t len;
    int one = ckpt_stored_span(s, it, want, off, &ref, &pos, &len);
    if (one < 0)
      return one;
    if (one == 0 || len == 0) /* assembled from several places: data */
      return whence == SEEK_DATA ? (int64_t)off : (int64_t)size;
    off_t o = lseek(ref.fd, (off_t)pos, whence);
    int e = errno;
    ckpt_fdref_put(&ref);
    if (o < 0 && e != ENXIO)
      return -e;
    /* within the run: found there (ENXIO: no data left in the file) */
    if (o >= 0 && (uint64_t)o < pos + len)
      return (int64_t)(off + ((uint64_t)o - pos));
    if (whence == SEEK_DATA && o < 0 && len == want)
      return -ENXIO;
    off += len; /* the run is all hole (DATA) or all data (HOLE) */
  }
  return whence == SEEK_DATA ? (off < size ? (int64_t)off : -ENXIO)
                             : (int64_t)size;
}

int64_t ckpt__op_seek_staged(ckpt_node_t *n, uint64_t off, int whence) {
  return ckpt__sfile_seek(n->u.sf, off, whence);
}

/* lseek(2) with SEEK_DATA or SEEK_HOLE (the kernel answers the others
 * itself): the kind's seek (staged files from their segments or backing
 * file, committed items from their data files); other files are data
 * throughout. */
void ckpt__op_lseek(fuse_req_t req, fuse_ino_t ino, off_t off, int whence,
                    struct fuse_file_info *fi) {
  ckpt__metrics_request(req, CKPT_OP_lseek);
  (void)ino;
  handle_t *h = ckpt__op_handle_of(fi);
  ckpt_node_t *n = h->node;
  int64_t r;
  if (off < 0 || (whence != SEEK_DATA && whence != SEEK_HOLE)) {
    r = -EINVAL;
  } else if (ckpt__op_kind(n)->seek) {
    r = ckpt__op_kind(n)->seek(n, (uint64_t)off, whence);
  } else {
    ckpt_fs_t *fs = ckpt__op_fs_of(req);
    struct stat st;
    pthread_mutex_lock(&fs->lock);
    ckpt__op_fill_attr(fs, n, &st);
    pthread_mutex_unlock(&fs->lock);
    r = off >= st.st_size ? -ENXIO : whence == SEEK_DATA ? off : st.st_size;
  }
  if (r < 0)
    fuse_reply_err(req, (int)-r);
  else
    fuse_reply_lseek(req, (off_t)r);
}
