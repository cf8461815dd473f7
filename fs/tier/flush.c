/*
 * flush.c - the background flush of a node-local tier (-o tier=DIR) to
 * BACKING_DIR.
 *
 * With a tier, a commit publishes into TIER (same layout as BACKING_DIR)
 * and returns; this thread then copies each such checkpoint to BACKING_DIR
 * and publishes it there exactly as a commit without the tier would have,
 * so that every other mount and tool sees the same thing. The ranks of a
 * node share its tier; each rank's mount flushes its own rank's files,
 * and whichever flusher of any node sees the last file linked publishes
 * (leaderless). Partner copies of another node's ranks in this tier are
 * flushed from here only when that node cannot (gone from the world, or
 * late). The tier copy is removed once flushed and no rank of the node
 * still needs it (reads go to BACKING_DIR from then on).
 *
 * The journal: TIER/.flush/SAVE_ID.R ("name NAME\nreplace 0|1\nbacking
 * DIR\n", then "remote\n" in another node's tier than the coordinator's,
 * "partner HOST\n" for partner copies, "publishing\n" from step 4)
 * exists while rank R's files of that save are unflushed (a record
 * "SAVE_ID" of an older mount is rank 0's). Its life, in order:
 *   1. write_step writes and fsyncs it on every rank before its RESULT
 *      (ckpt__flush_record), so that a node whose tier publish never
 *      happened still has its files in TIER/.saves/SAVE_ID, flushable;
 *      the coordinator, then each other node (publish_step, with the
 *      .metadata the OUTCOME carries), publishes TIER/NAME;
 *   2. each data file of rank R in TIER/NAME (or TIER/.saves/SAVE_ID) is
 *      copied into an O_TMPFILE of
 *      BACKING_DIR/.staging under the token bucket of -o flush_rate,
 *      fsynced, every chunk's XXH3 checked in the copy against the
 *      .metadata, and only then linked into BACKING_DIR/.saves/SAVE_ID
 *      (held, so no starting mount removes it; a file already linked
 *      there by an earlier run is complete and kept);
 *   3. .metadata is copied (.metadata.tmp.R, fsync, link: the first
 *      flusher's stays);
 *   4. once every data file the .metadata names is linked in
 *      BACKING_DIR/.saves/SAVE_ID at full size (else the job waits, held,
 *      behind later ones: "flush waiting: rank ... not in the shared store
 *      yet"), the record gets a "publishing" line (fsynced), then the same
 *      no-replace publish as a commit (ckpt__publish_save); ENOENT or
 *      EEXIST with BACKING_DIR/NAME of this save: another flusher did;
 *   5. the record is removed and .flush fsynced; then, under the node's
 *      lock, the tier copy if no record of the save is left in the tier.
 * Partner records (level partner, fs/commit/partner.c): the rank that received
 * owner rank R's files writes TIER/.flush/SAVE_ID.R with a line "partner
 * HOST" (R's host), fsynced before its RESULT. Such a record is the
 * node's lowest rank's (mine) and is flushed only when the owner cannot:
 * at each look it is over, nothing copied, if BACKING_DIR/NAME is the
 * save or all of R's data files are linked in BACKING_DIR/.saves/SAVE_ID
 * at their size (only verified copies are linked: R's node flushed
 * them); else, if no rank of the current world is on HOST or
 * partner_grace seconds have passed since this mount queued it, its
 * files are copied and it goes on exactly like an own record (steps 2-5:
 * the leaderless publish); meanwhile it waits (-EINPROGRESS, later
 * checkpoints go), .status saying so. A copy linked second finds the
 * racing flusher's verified copy: both count (ckpt__tier_link_tmpfile).
 * A crash anywhere leaves the record; the next mount (ckpt__flush_recover)
 * drops it if BACKING_DIR/NAME already has SAVE_ID (crash after 4),
 * neither TIER/NAME nor TIER/.saves/SAVE_ID does (never published), or
 * it says "publishing" and
 * BACKING_DIR/.saves/SAVE_ID is gone (published, then removed by a user
 * before the record went); else the flush resumes. A tier
 * checkpoint without a record is flushed already or was removed by a user
 * from BACKING_DIR: it is removed, never published again. Partner records
 * go through the same checks (their save is the same one: kept while
 * the tier holds it, in the tier's .saves/SAVE_ID on another node than
 * the coordinator's), and the tier's copy stays while any record of its
 * save, own or partner, is left.
 *
 * Workload: one checkpoint at a time, large sequential copies; the thread
 * runs at nice 10 and the idle I/O class, so that training does not wait
 * for it.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "failpoint.h"
#include "tier_int.h"

/* The reader of j's checkpoint reads BACKING_DIR's copy from now on. */
static void rebind_to_shared(ckpt_fs_t *fs, const flush_job_t *j) {
  ckpt_version_t v = {0};
  int dfd = ckpt_store_open_dir(fs->backing_fd, j->name, O_RDONLY);
  struct stat st;
  bool ok = dfd >= 0 && fstat(dfd, &st) == 0 &&
            ckpt_store_save_id(dfd, v.save_id) == 0 &&
            !strcmp(v.save_id, j->save_id);
  if (dfd >= 0)
    close(dfd);
  /* tier_keep keeps the tier's copy: lookups keep finding it there
   * (ckpt__root_of), so the view stays bound to it until it is evicted
   * (retain.c rebinds then) */
  char kept[CKPT_SAVE_ID_LEN + 1] = "";
  if (ok && fs->opts.tier_keep && ckpt__tier_save_id_of(fs->tier_fd, j->name, kept) == 0 &&
      !strcmp(kept, j->save_id))
    ok = false;
  if (ok) {
    v.dev = st.st_dev;
    v.ino = st.st_ino;
    ckpt_store_dir_handle(fs->backing_fd, j->name, &v.handle);
  }
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = ckpt__tier_tree_ckpt(fs, j->name, j->save_id);
  if (ck && ok && ck->has_stored) {
    ckpt_stored_rebind(&ck->stored, &v);
    ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
  }
  if (ck) {
    atomic_store(&ck->tier.flushed, true);
    /* (also when another rank's flush published it first) */
    atomic_store(&ck->tier.done, atomic_load(&ck->tier.total));
    free(ck->tier.why);
    ck->tier.why = NULL;
  }
  pthread_mutex_unlock(&fs->lock);
}

void ckpt__flush_rebind(ckpt_fs_t *fs, const char *name,
                        const char *save_id) {
  flush_job_t j;
  memset(&j, 0, sizeof(j));
  snprintf(j.name, sizeof(j.name), "%s", name);
  snprintf(j.save_id, sizeof(j.save_id), "%s", save_id);
  rebind_to_shared(fs, &j);
}

/* j's save is flushed: its record goes and then, under the node's lock
 * (the other ranks' flushers and commits), the tier's copy if no record
 * of the save is left in the tier (another rank's files may not be
 * flushed yet: its flusher removes it) and TIER/NAME is still j's save (a
 * replace= commit may have put a newer one there meanwhile, which is not
 * flushed yet); also the save's directory of a node whose tier publish
 * never happened. Under fs->tier_publish too, so that no commit of this
 * mount publishes in between. */
/* Under fs->tier_publish and the node's lock: j's record goes; then, with
 * no record of its save left in the tier, TIER/NAME if it is still j's
 * save (unless keep) and the save's directory. id: TIER/NAME's save key.
 * The records of the save left (0: none, -errno: not known). */
static int drop_record(ckpt_fs_t *fs, const flush_job_t *j, bool keep,
                       char id[CKPT_SAVE_ID_LEN + 1]) {
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs);
  ckpt__journal_remove(fs, j->rec);
  int dfd = ckpt__journal_open(fs, false);
  int left = ckpt__journal_any(dfd, j->save_id);
  if (dfd >= 0)
    close(dfd);
  ckpt__tier_save_id_at(fs->tier_fd, j->name, id);
  if (left == 0 && !keep && !strcmp(id, j->save_id))
    ckpt__checkpoint_remove(fs->tier_fd, j->name, false);
  if (left == 0)
    ckpt_store_save_dir_remove(fs->tier_fd, j->save_id);
  ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
  return left;
}

static void remove_tier_copy(ckpt_fs_t *fs, const flush_job_t *j) {
  char id[CKPT_SAVE_ID_LEN + 1];
  /* tier_keep: the copy stays for restarts; retention picks what goes */
  int left = drop_record(fs, j, fs->opts.tier_keep != 0, id);
  bool ours = !strcmp(id, j->save_id);
  if (left == 0 && ours && fs->opts.tier_keep) {
    ckpt__tier_retain(fs);
    return;
  }
  if (left == 0 && !ours && id[0])
    ckpt__log("tier: %s: flushed; the tier holds a newer save of it now "
              "(%s), kept", j->name, id);
  if (left != 0 || !ours)
    return;
  /* A lookup that saw the tier's copy before it went says nothing against
   * BACKING_DIR's (still_stored ignores presences older than load_gen). */
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = ckpt__tier_tree_ckpt(fs, j->name, j->save_id);
  if (ck)
    ck->load_gen = atomic_fetch_add(&fs->load_gen, 1) + 1;
  pthread_mutex_unlock(&fs->lock);
}

/* Step 4 begins: the record says so (fsynced), so that the next mount
 * tells a save published and then removed by a user (no
 * BACKING_DIR/.saves/SAVE_ID left: the publish renamed it) from one that
 * was never published (it is still there). */
static int mark_publishing(ckpt_fs_t *fs, const flush_job_t *j, char **err) {
  int dfd = ckpt__journal_open(fs, false);
  int fd = dfd < 0 ? dfd
                   : openat(dfd, j->rec,
                            O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW);
  int rc = dfd < 0 ? dfd : fd < 0 ? -errno : 0;
  flush_job_t now;
  if (rc == 0 && (rc = ckpt__tier_read_record(dfd, j->rec, &now)) == 0 &&
      !now.publishing) {
    ssize_t w = write(fd, CKPT_REC_PUBLISHING, strlen(CKPT_REC_PUBLISHING));
    if (w != (ssize_t)strlen(CKPT_REC_PUBLISHING))
      rc = w < 0 ? -errno : -ENOSPC; /* short: the tier is full */
  }
  if (rc == 0 && fsync(fd))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (dfd >= 0)
    close(dfd);
  if (rc)
    *err = ckpt__strdup_printf("marking %s/%s/%s: %s", fs->tier_path,
                               CKPT_FLUSH_DIR, j->rec, strerror(-rc));
  return rc;
}

/* The ranks of world_size set in b: "rank 1, rank 3". */
static void put_ranks(ckpt_buf_t *b, const bool *set, int n) {
  for (int r = 0; r < n; r++)
    if (set[r])
      ckpt_buf_printf(b, "%srank %d", b->len ? ", " : "", r);
}

/* Is every data file that m names linked in held at its full size? 0, or
 * -EINPROGRESS with *why saying whose files are not there yet, or -errno
 * with *why. */
static int complete(const ckpt_metadata_t *m, int held, char **why) {
  typedef struct { int32_t rank; uint32_t k; uint64_t end; } need_t;
  uint32_t total = m->n_chunks + m->n_blobs, n = 0;
  need_t *need = calloc(total ? total : 1, sizeof(*need));
  int world = m->world_size > 0 ? m->world_size : 1;
  bool *missing = calloc((size_t)world, sizeof(*missing));
  if (!need || !missing) {
    free(need), free(missing);
    *why = ckpt__strdup_printf("checking that every rank's files are in "
                               "the shared store: %s", strerror(ENOMEM));
    return -ENOMEM;
  }
  for (uint32_t i = 0; i < total; i++) {
    bool chunk = i < m->n_chunks;
    const ckpt_chunk_meta_t *c = chunk ? &m->chunks[i] : NULL;
    const ckpt_blob_meta_t *bl = chunk ? NULL : &m->blobs[i - m->n_chunks];
    need_t x = {chunk ? c->rank : bl->rank, chunk ? c->file : bl->file,
                chunk ? c->file_offset + c->length
                      : bl->file_offset + bl->length};
    uint32_t at = 0;
    while (at < n && (need[at].rank != x.rank || need[at].k != x.k))
      at++;
    if (at == n)
      need[n++] = x;
    else if (x.end > need[at].end)
      need[at].end = x.end;
  }
  bool any = false;
  for (uint32_t i = 0; i < n; i++) {
    char name[64];
    struct stat st;
    ckpt_data_file_name(need[i].rank, need[i].k, name, sizeof(name));
    if (fstatat(held, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode) && (uint64_t)st.st_size >= need[i].end)
      continue;
    if (need[i].rank >= 0 && need[i].rank < world)
      missing[need[i].rank] = any = true;
  }
  int rc = 0;
  if (any) {
    ckpt_buf_t b;
    ckpt_buf_init(&b);
    put_ranks(&b, missing, world);
    *why = ckpt__strdup_printf("%.*s not in the shared store yet",
                               (int)b.len, (const char *)b.data);
    ckpt_buf_free(&b);
    rc = -EINPROGRESS;
  }
  free(need);
  free(missing);
  return rc;
}

/* Is BACKING_DIR/NAME j's save (published, by any flusher)? */
bool ckpt__tier_published(ckpt_fs_t *fs, const flush_job_t *j) {
  char shared[CKPT_SAVE_ID_LEN + 1];
  ckpt__tier_save_id_at(fs->backing_fd, j->name, shared);
  return !strcmp(shared, j->save_id);
}

/* Is TIER/NAME j's save? */
static bool tier_named(ckpt_fs_t *fs, const flush_job_t *j) {
  char id[CKPT_SAVE_ID_LEN + 1];
  ckpt__tier_save_id_at(fs->tier_fd, j->name, id);
  return !strcmp(id, j->save_id);
}

/* The tier's copy of j: TIER/NAME while it is j's save, else the save's
 * directory (this node's publish never happened), held. -ESTALE: neither
 * (superseded or removed). */
static int open_source(ckpt_fs_t *fs, const flush_job_t *j) {
  char id[CKPT_SAVE_ID_LEN + 1];
  int src = ckpt_store_open_dir(fs->tier_fd, j->name, O_RDONLY);
  int rc = src < 0 ? src : ckpt_store_save_id(src, id);
  if (rc == 0 && !strcmp(id, j->save_id))
    return src;
  if (src >= 0)
    close(src);
  rc = ckpt_store_save_dir_hold(fs->tier_fd, j->save_id, false, &src);
  return rc == 0 ? src : rc == -ENOENT ? -ESTALE : rc;
}

/* Is BACKING_DIR/NAME positively no save that j's commit replaced (nor
 * j's own)? Then *err (replacing any) says which save it is now. */
static bool changed_after(ckpt_fs_t *fs, const flush_job_t *j,
                          const ckpt_metadata_t *m, char **err) {
  char now[CKPT_SAVE_ID_LEN + 1] = "";
  int64_t now_ns = 0;
  int dfd = ckpt_store_open_dir(fs->backing_fd, j->name, O_RDONLY);
  int rc = dfd == -ENOENT ? -ENOENT
           : dfd < 0      ? dfd
                          : ckpt_store_save_look(dfd, now, NULL, &now_ns);
  if (dfd >= 0)
    close(dfd);
  if (rc == -ENOENT)
    now[0] = '\0';
  if ((rc && rc != -ENOENT) || !strcmp(now, j->save_id) ||
      ckpt_store_replaces_ok(m->replaces, m->commit_ns, now, now_ns))
    return false;
  free(*err);
  *err = rc ? ckpt__strdup_printf("%s/%s was removed after this save (%s) was "
                                  "committed", fs->backing_path, j->name,
                                  j->save_id)
            : ckpt__strdup_printf("%s/%s is save %s, committed after this save "
                                  "(%s) through another mount",
                                  fs->backing_path, j->name, now, j->save_id);
  return true;
}

/* Step 4, once held is complete: the shared publish, by whichever
 * flusher gets there; under an flock of its .metadata (the same inode
 * for every flusher, wherever its directory is), so that of two flushers
 * of a replace= save only one exchanges. */
static int publish_shared(ckpt_flush_t *f, flush_job_t *j, int held,
                          bool replace, const ckpt_metadata_t *m,
                          char **err) {
  ckpt_fs_t *fs = f->fs;
  int mfd = ckpt_store_open_file(held, CKPT_METADATA_FILE);
  if (mfd >= 0)
    while (flock(mfd, LOCK_EX) && errno == EINTR)
      ;
  int rc = 0;
  if (!ckpt__tier_published(fs, j)) {
    rc = mark_publishing(fs, j, err);
    if (rc == 0)
      ckpt_failpoint("flush_marked");
    if (rc == 0) {
      ckpt_publish_t p = {.root_fd = fs->backing_fd,
                          .root_path = fs->backing_path,
                          .held_fd = held,
                          .save_id = j->save_id,
                          .name = j->name,
                          .replace = replace,
                          .flush = true,
                          .replaces = m ? m->replaces : NULL,
                          .commit_ns = m ? m->commit_ns : 0};
      rc = ckpt__publish_save(fs, &p, err);
      j->superseded = rc == -ESTALE && p.replaces;
    }
    if ((rc == -ENOENT || rc == -EEXIST) && ckpt__tier_published(fs, j)) {
      free(*err); /* another flusher published it meanwhile */
      *err = NULL;
      rc = 0;
    }
    if (rc == 0) {
      ckpt__log("tier: %s published in %s by rank %d's flush (it saw the "
                "last data file linked)", j->name, fs->backing_path,
                fs->rank);
      ckpt_failpoint("flush_published");
    }
  }
  if (mfd >= 0)
    close(mfd);
  return rc;
}

/* Are the owner's data files of partner job j (those in the tier's src)
 * all linked in BACKING_DIR/.saves/SAVE_ID at their size (linked only
 * once verified: its node's flush did it)? */
static bool owner_linked(ckpt_fs_t *fs, const flush_job_t *j, int src) {
  char path[CKPT_SAVE_ID_LEN + 16];
  snprintf(path, sizeof(path), "%s/%s", CKPT_SAVES_DIR, j->save_id);
  int sfd = ckpt_open_beneath(fs->backing_fd, path,
                              O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  DIR *d = sfd < 0 ? NULL : ckpt_opendir_at(src);
  bool all = d != NULL;
  struct dirent *e;
  int32_t rank;
  uint32_t k;
  struct stat here, there;
  while (all && (e = readdir(d)) != NULL)
    if (ckpt__data_file_name(e->d_name, &rank, &k) && rank == j->rank)
      all = fstatat(src, e->d_name, &here, AT_SYMLINK_NOFOLLOW) == 0 &&
            fstatat(sfd, e->d_name, &there, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISREG(there.st_mode) && there.st_size == here.st_size;
  if (d)
    closedir(d);
  if (sfd >= 0)
    close(sfd);
  return all;
}

/* Is a rank of the current world on host? */
static bool host_in_world(const ckpt_fs_t *fs, const char *host) {
  if (!fs->dist) {
    char self[CKPT_DIST_HOST_MAX] = "";
    gethostname(self, sizeof(self) - 1);
    return !strcmp(self, host);
  }
  for (int r = 0; r < fs->world_size; r++)
    if (!strcmp(ckpt_dist_node_name(fs->dist, r), host))
      return true;
  return false;
}

/* Partner job j, not taken yet: 1 when the checkpoint is published
 * (nothing to copy), 0 when this
 * mount is to flush them (the node is not in this world, or
 * partner_grace has passed), -EINPROGRESS with *err while it waits for
 * that node. */
int ckpt__tier_partner_turn(ckpt_flush_t *f, flush_job_t *j, int src,
                        char **err) {
  ckpt_fs_t *fs = f->fs;
  if (ckpt__tier_published(fs, j))
    return 1;
  /* Linked, not published: kept until it is (the owner's node may be lost
   * before the publish, and BACKING_DIR/.saves/SAVE_ID removed by a
   * cleanup once nothing holds it: these copies are then all there is) */
  if (owner_linked(fs, j, src)) {
    *err = ckpt__strdup_printf("partner copies of rank %d kept until the "
                               "checkpoint is published (its node flushed "
                               "them)", j->rank);
    return -EINPROGRESS;
  }
  double waited = ckpt__mono_now() - j->queued_at;
  const char *why = !host_in_world(fs, j->host) ? "is not in this world"
                    : waited >= fs->opts.partner_grace
                        ? "has not flushed them within partner_grace"
                        : NULL;
  if (why) {
    ckpt__log("tier: %s: flushing the partner copies of rank %d from this "
              "tier (rank %d's): its node (%s) %s", j->name, j->rank,
              fs->rank, j->host, why);
    return 0;
  }
  *err = ckpt__strdup_printf("partner copies of rank %d kept until its node "
                             "(%s) flushes them (this tier flushes them "
                             "after %.0f s more)", j->rank, j->host,
                             fs->opts.partner_grace - waited);
  return -EINPROGRESS;
}

/* One look of the flusher at a job: what it holds and where it is. */
typedef struct {
  ckpt_metadata_t m;
  int held;         /* BACKING_DIR/.saves/SAVE_ID, held, or -1 */
  int src;          /* the tier's copy, or -1 */
  const char *step; /* the step under way, for an error that did not say */
  bool staged;      /* a file made in BACKING_DIR/.staging */
} flush_look_t;

/* The tier's copy of j opened into l->src, after the checks that may end
 * the look at once (*done: published by another rank's flusher, or
 * partner copies not this tier's to flush yet). 0 or -errno. */
static int open_for_flush(ckpt_flush_t *f, flush_job_t *j, flush_look_t *l,
                          bool *done, char **err) {
  ckpt_fs_t *fs = f->fs;
  if (ckpt__tier_published(fs, j)) {
    j->dropped = j->partner && !j->taken; /* nothing of it copied here */
    *done = true; /* by another rank's flusher */
    return 0;
  }
  /* checked whole at mount; made writable by others since: flush nothing */
  int rc = ckpt_store_check_private(fs->tier_fd, fs->tier_path, false, err);
  if (rc)
    return rc;
  l->step = "opening the tier's copy";
  l->src = open_source(fs, j);
  if (l->src < 0) {
    rc = l->src;
    if (rc != -ESTALE)
      *err = ckpt__strdup_printf("opening the tier's copy of %s (%s/%s or "
                                 "%s/%s/%s): %s", j->name, fs->tier_path,
                                 j->name, fs->tier_path, CKPT_SAVES_DIR,
                                 j->save_id, strerror(-rc));
    return rc;
  }
  if (!j->partner || j->taken)
    return 0;
  l->step = "deciding whether this tier flushes the partner copies";
  int turn = ckpt__tier_partner_turn(f, j, l->src, err);
  if (turn == 1)
    j->dropped = true;
  if (turn != 0) {
    *done = true;
    return turn < 0 ? turn : 0;
  }
  j->taken = true;
  return 0;
}

/* Marked publishing by an earlier run, and BACKING_DIR/.saves/ID gone
 * since (ckpt__tier_recover_record): published again, by the
 * compare-and-swap when the save recorded what it replaced (a later
 * commit or a removal of NAME stays: the save was published and changed
 * since; NAME still what it replaced: it never was), else without
 * replacing anything, so that nothing committed since is replaced by it. */
static bool published_before(ckpt_fs_t *fs, const flush_job_t *j) {
  flush_job_t rec;
  int rdfd = ckpt__journal_open(fs, false);
  if (rdfd < 0)
    return false;
  bool before = ckpt__tier_read_record(rdfd, j->rec, &rec) == 0 &&
                rec.publishing &&
                !ckpt__tier_saves_dir_exists(fs->backing_fd, j->save_id);
  close(rdfd);
  return before;
}

/* NAME changed on BACKING_DIR after j's commit: it will never be
 * published (other ranks' flushes find the same). */
static bool superseded_now(ckpt_fs_t *fs, flush_job_t *j, flush_look_t *l,
                           char **err) {
  if (!l->m.replaces || !changed_after(fs, j, &l->m, err))
    return false;
  j->superseded = true;
  return true;
}

/* Everything of j in the shared store but its publish: the save's
 * directory held, the .metadata loaded, this rank's files and the
 * .metadata copied, every rank's files there. 0, -EINPROGRESS (other
 * ranks' files missing), -ESTALE (superseded) or -errno. */
static int gather(ckpt_flush_t *f, flush_job_t *j, flush_look_t *l,
                  char **err) {
  ckpt_fs_t *fs = f->fs;
  int rc;
  if (l->held < 0) {
    l->step = "holding the save's directory in the shared store";
    rc = ckpt_store_save_dir_hold(fs->backing_fd, j->save_id, true, &l->held);
    if (rc) {
      *err = ckpt__strdup_printf("creating %s/%s/%s: %s", fs->backing_path,
                                 CKPT_SAVES_DIR, j->save_id, strerror(-rc));
      return rc;
    }
  }
  /* The .metadata: the tier's, or one another node's flusher linked.
   * From TIER/.saves/SAVE_ID (this node never published it), only in
   * another node's tier than the coordinator's: written there from the
   * OUTCOME, it says the save was committed; in the coordinator's, the
   * save was not (its publish there is the commit point). */
  bool named = tier_named(fs, j);
  int from = (named || j->remote) && ckpt_store_has_metadata(l->src)
                 ? l->src
                 : l->held;
  if (!ckpt_store_has_metadata(from)) {
    *err = ckpt__strdup_printf("the .metadata of %s (from the coordinator's "
                               "node) not in the shared store yet",
                               j->name);
    return -EINPROGRESS;
  }
  l->step = "loading the .metadata";
  rc = ckpt_metadb_load_at(from, j->name, &l->m, err);
  if (rc)
    return rc;
  if (superseded_now(fs, j, l, err)) /* nothing to copy */
    return -ESTALE;
  if (!j->copied) {
    l->step = "copying the data files";
    rc = ckpt__tier_copy_data(f, j, &l->m, l->src, l->held, &l->staged, err);
    if (rc == 0 && from != l->held) {
      l->step = "copying the .metadata";
      rc = ckpt__tier_copy_metadata(f, j, l->src, l->held, err);
    }
    if (rc == 0)
      j->copied = true;
  }
  if (rc == 0) {
    l->step = "checking that every rank's files are in the shared store";
    rc = complete(&l->m, l->held, err);
  }
  /* waiting for other ranks while NAME changed after the commit */
  if (rc == -EINPROGRESS && superseded_now(fs, j, l, err))
    return -ESTALE;
  return rc;
}

/* Flush one checkpoint: steps 2-5 of the protocol above. 0, -EINPROGRESS
 * (waiting for other ranks' files: j->held kept) or -errno, with *err
 * naming the step that failed. */
int ckpt__tier_flush_one(ckpt_flush_t *f, flush_job_t *j, char **err) {
  ckpt_fs_t *fs = f->fs;
  flush_look_t l = {.held = j->held, .src = -1,
                    .step = "checking that the tier is private"};
  j->held = -1;
  bool done = false;
  int rc = open_for_flush(f, j, &l, &done, err);
  if (!done) {
    bool recovered = rc == 0 && j->replace && published_before(fs, j);
    if (rc == 0)
      rc = gather(f, j, &l, err);
    if (rc == 0) {
      l.step = "publishing in the shared store";
      /* Compare-and-swap: published only while BACKING_DIR/NAME is what
       * the commit replaced (resolve.c); not so for a save published
       * once already and removed since, which goes back without
       * replacing */
      rc = publish_shared(f, j, l.held, j->replace && !recovered, &l.m, err);
    }
    if (rc == 0 && l.held >= 0) {
      /* Published: NAME's directory now, no unfinished save to hold
       * against a cleanup. Let go before rebind_to_shared takes fs's
       * locks: a commit of NAME holding one waits for NAME's directory
       * exclusively (a replace), and it waited on this hold for good (the
       * history test's long run: three mounts stuck in flock). */
      close(l.held);
      l.held = -1;
    }
    if (rc && !*err) /* a step that did not say why: named here */
      *err = ckpt__strdup_printf("%s of %s (to %s): %s", l.step, j->name,
                                 fs->backing_path, strerror(-rc));
    if (rc == -EINPROGRESS && l.held >= 0) {
      j->held = l.held; /* held while it waits */
      l.held = -1;
    }
  }
  if (rc == 0 && (!j->dropped || ckpt__tier_published(fs, j)))
    rebind_to_shared(fs, j);
  if (rc == 0)
    remove_tier_copy(fs, j);
  /* its copies' directory, if this look made any: every look tidying it
   * (a job waiting for other ranks looks every second) would remove it
   * under the other mounts' ckpt__staging_tmpfile far more often */
  if (l.staged)
    ckpt__staging_tidy(fs->backing_fd);
  ckpt_metadata_free(&l.m);
  if (l.held >= 0)
    close(l.held);
  if (l.src >= 0)
    close(l.src);
  return rc;
}

/* A store that is full, failing or read-only may come back. */
bool ckpt__tier_transient(int rc) {
  return rc == -ENOSPC || rc == -EIO || rc == -EROFS || rc == -EDQUOT ||
         rc == -ETIMEDOUT || rc == -ESTALE || rc == -ENOTCONN ||
         rc == -EHOSTDOWN || rc == -ESHUTDOWN || rc == -EAGAIN ||
         rc == -EINTR || rc == -ENOMEM || rc == -EMFILE || rc == -ENFILE;
}

/* Is TIER/NAME known to be another save than j's, or gone (a replace=
 * commit put a newer one in its place, which has its own flush)? Then
 * j's record goes, and its partial copy in BACKING_DIR/.saves/ID: it is
 * never to be published. An error that proves nothing (EMFILE, EIO) is
 * not that. */
static bool superseded(ckpt_fs_t *fs, const flush_job_t *j) {
  char id[CKPT_SAVE_ID_LEN + 1];
  pthread_mutex_lock(&fs->tier_publish);
  int dfd = ckpt_store_open_dir(fs->tier_fd, j->name, O_RDONLY);
  bool other = dfd == -ENOENT ||
               (dfd >= 0 && ckpt_store_save_id(dfd, id) == 0 &&
                strcmp(id, j->save_id));
  if (dfd >= 0)
    close(dfd);
  /* its files still in the save's directory: this node's publish never
   * happened, the flush goes on from there */
  if (other && ckpt__tier_saves_dir_exists(fs->tier_fd, j->save_id))
    other = false;
  if (other)
    ckpt__journal_remove(fs, j->rec);
  pthread_mutex_unlock(&fs->tier_publish);
  if (!other)
    return false;
  char shared[CKPT_SAVE_ID_LEN + 1];
  ckpt__tier_save_id_at(fs->backing_fd, j->name, shared);
  /* Another rank's flusher may be publishing it (it holds it): then it is
   * theirs, not a partial copy to remove. */
  if (strcmp(shared, j->save_id))
    ckpt_store_save_dir_remove_unheld(fs->backing_fd, j->save_id);
  ckpt__log("tier: %s: save %s superseded in the tier (by a replace=): not "
            "flushed, its record removed (and its partial copy, unless "
            "another rank's flush holds it)", j->name, j->save_id);
  return true;
}

/* j's publish found BACKING_DIR/NAME changed after its commit (why: the
 * CAS's words): the later change stays NAME (resolve.c); j's record, its
 * partial copy in BACKING_DIR/.saves/ID and its tier copy go, and the
 * log and NAME's .status say so. */
static void lost_to_later(ckpt_fs_t *fs, flush_job_t *j, const char *why) {
  char id[CKPT_SAVE_ID_LEN + 1];
  ckpt__log("tier: %s: save %s superseded, not published: %s; its flush "
            "record (and, with the node's last, its tier copy) removed",
            j->name, j->save_id, why ? why : "NAME changed after its commit");
  ckpt__resolve_superseded(fs, j->name, j->save_id, why);
  /* with the node's last record its copy goes, tier_keep or not (it is
   * no save of NAME's any more) */
  drop_record(fs, j, false, id);
  ckpt_store_save_dir_remove_unheld(fs->backing_fd, j->save_id);
  ckpt__tier_set_why(fs, j, NULL);
}

/* Tell .status that j waits (why: "flush waiting: ..."), or failed. */
static void report(ckpt_fs_t *fs, const flush_job_t *j, char *why,
                   bool counted_again, bool failed) {
  ckpt__tier_set_why(fs, j, why);
  pthread_mutex_lock(&fs->lock);
  ckpt_ckpt_t *ck = ckpt__tier_tree_ckpt(fs, j->name, j->save_id);
  if (ck && counted_again && !j->partner) /* counted again from the start */
    atomic_store(&ck->tier.done, 0);
  if (ck && failed) /* not retried by this mount: may be removed */
    atomic_store(&ck->tier.failed, true);
  pthread_mutex_unlock(&fs->lock);
}

/* Waiting for other ranks' files: looked at again after a while, 0.2 s
 * doubling to 1 s (each look a few stats on BACKING_DIR; a rank that waits notices the publish by another within a second); later checkpoints go meanwhile. */
#define WAIT_FIRST 0.2
#define WAIT_MAX 1.0

/* Try to flush j. true when it is over (done, stopped or failed for
 * good); false: j->not_before says when to try again. */
static bool run_job(ckpt_flush_t *f, flush_job_t *j) {
  ckpt_fs_t *fs = f->fs;
  char *err = NULL;
  double t0 = ckpt__mono_now();
  int rc = ckpt__tier_flush_one(f, j, &err);
  if (rc == 0 && j->dropped) {
    ckpt__log("tier: %s: the partner copies of rank %d not flushed from "
              "this tier: its node's flush did (record dropped)", j->name,
              j->rank);
    ckpt__tier_set_why(fs, j, NULL);
    free(err);
    return true;
  }
  if (rc == 0) {
    ckpt__log("tier: %s flushed to %s (rank %d's files%s) in %.2f s", j->name,
              fs->backing_path, j->rank, j->partner ? ", partner copies" : "",
              ckpt__mono_now() - t0);
    free(err);
    /* keep= with a tier: applied once the new checkpoint is on
     * BACKING_DIR (rank 0's job is over only after the shared publish),
     * by one mount: rank 0's own record's, not its partner copy's */
    if (j->rank == 0 && !j->partner &&
        ckpt_keep_policy_active(&fs->opts.keep))
      ckpt__keep_policy(fs, j->name);
    return true;
  }
  if (rc == -ECANCELED) { /* unmount: the record resumes it */
    free(err);
    return true;
  }
  if (rc == -EINPROGRESS) { /* other ranks' files or .metadata */
    char *why = ckpt__strdup_printf("flush waiting: %s",
                                    err ? err : "other ranks");
    if (j->backoff == 0) /* said once, not at every look */
      ckpt__log("tier: %s: %s", j->name, why ? why : "flush waiting");
    free(err);
    report(fs, j, why, false, false);
    j->backoff = j->backoff ? j->backoff * 2 : WAIT_FIRST;
    if (j->backoff > WAIT_MAX)
      j->backoff = WAIT_MAX;
    j->not_before = ckpt__mono_now() + j->backoff;
    return false;
  }
  if (j->held >= 0)
    close(j->held);
  j->held = -1;
  j->copied = false;
  if (j->superseded) {
    lost_to_later(fs, j, err);
    free(err);
    return true;
  }
  if (superseded(fs, j)) {
    free(err);
    return true;
  }
  if (rc == -EAGAIN) {
    /* a race with another mount on BACKING_DIR (its .staging tidied
     * away, a copy linked by another flusher each time): soon again, not
     * at a failing store's pace (a minute later, long after the race) */
    if (j->backoff == 0)
      ckpt__log("tier: %s: flush waiting: %s", j->name,
                err ? err : strerror(EAGAIN));
    free(err);
    j->backoff = j->backoff ? j->backoff * 2 : WAIT_FIRST;
    if (j->backoff > WAIT_MAX)
      j->backoff = WAIT_MAX;
    j->not_before = ckpt__mono_now() + j->backoff;
    return false;
  }
  bool again = ckpt__tier_transient(rc);
  if (j->backoff < BACKOFF_FIRST)
    j->backoff = BACKOFF_FIRST;
  char *why = ckpt__strdup_printf(
      "flush %s: %s%s", again ? "waiting" : "failed",
      err ? err : strerror(-rc),
      again ? "" : " (the tier copy is kept; the next mount retries)");
  if (again) {
    char *more = ckpt__strdup_printf("%s (retry in %.0f s)", why, j->backoff);
    free(why);
    why = more;
  }
  ckpt__log("tier: %s: %s", j->name, why ? why : "flush failed");
  free(err);
  report(fs, j, why, true, !again);
  if (!again)
    return true;
  j->not_before = ckpt__mono_now() + j->backoff;
  j->backoff = j->backoff * 2 > BACKOFF_MAX ? BACKOFF_MAX : j->backoff * 2;
  return false;
}

/* The first job due now, unlinked; else NULL and *next, the time the
 * first one is due. f->lock held. */
static flush_job_t *take_due(ckpt_flush_t *f, double *next) {
  CKPT_HELD(&f->lock);
  double now = ckpt__mono_now();
  *next = INFINITY;
  for (flush_job_t **p = &f->head, *prev = NULL; *p; prev = *p, p = &(*p)->next) {
    flush_job_t *j = *p;
    if (j->not_before > now) {
      if (j->not_before < *next)
        *next = j->not_before;
      continue;
    }
    *p = j->next;
    if (f->tail == j)
      f->tail = prev;
    j->next = NULL;
    return j;
  }
  return NULL;
}

static void append(ckpt_flush_t *f, flush_job_t *j) {
  j->next = NULL;
  if (f->tail)
    f->tail->next = j;
  else
    f->head = j;
  f->tail = j;
}

/* The job is over (or the flush stops). */
static void free_job(flush_job_t *j) {
  if (j->held >= 0)
    close(j->held);
  free(j);
}

static void *flush_main(void *arg) {
  ckpt_flush_t *f = arg;
  pthread_setname_np(pthread_self(), "ckptfs-flush");
  /* Low priority: the training's CPU and I/O first. */
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
  syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, 0,
          3 << 13 /* IOPRIO_CLASS_IDLE */);
  pthread_mutex_lock(&f->lock);
  for (;;) {
    double next = INFINITY;
    flush_job_t *j = NULL;
    while (!f->stop && !(j = take_due(f, &next))) {
      if (next == INFINITY) {
        pthread_cond_wait(&f->cond, &f->lock);
        continue;
      }
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      double wait = next - ckpt__mono_now();
      wait = wait < 0 ? 0 : wait > 1 ? 1 : wait;
      ts.tv_sec += (time_t)wait;
      ts.tv_nsec += (long)((wait - (double)(time_t)wait) * 1e9);
      if (ts.tv_nsec >= 1000000000L)
        ts.tv_sec++, ts.tv_nsec -= 1000000000L;
      pthread_cond_timedwait(&f->cond, &f->lock, &ts);
    }
    if (f->stop) {
      if (j)
        free_job(j);
      break;
    }
    pthread_mutex_unlock(&f->lock);
    bool over = run_job(f, j);
    pthread_mutex_lock(&f->lock);
    if (over)
      free_job(j);
    else
      append(f, j); /* behind later checkpoints */
  }
  pthread_mutex_unlock(&f->lock);
  return NULL;
}

/* ------------------------------------------------------------------------
 * The thread's interface.
 * ---------------------------------------------------------------------- */

static void queue(ckpt_flush_t *f, const flush_job_t *tmpl) {
  flush_job_t *j = malloc(sizeof(*j));
  if (!j) {
    ckpt__log("tier: out of memory: %s is flushed by the next mount",
              tmpl->name);
    return;
  }
  *j = *tmpl;
  j->held = -1;
  j->queued_at = ckpt__mono_now(); /* partner_grace counts from here */
  pthread_mutex_lock(&f->lock);
  append(f, j);
  pthread_cond_signal(&f->cond);
  pthread_mutex_unlock(&f->lock);
}

static void queue_record(ckpt_fs_t *fs, int dfd, const char *id, void *arg) {
  flush_job_t j;
  if (ckpt__tier_read_record(dfd, id, &j) == 0 && ckpt__tier_mine(fs, j.rank, j.partner)) {
    queue(arg, &j);
  }
}

typedef struct {
  ckpt_flush_t *f;
  const char *save_id;
} partners_t;

/* A partner record of p's save that is this mount's: queued. */
static void queue_partner(ckpt_fs_t *fs, int dfd, const char *id,
                          void *arg) {
  partners_t *p = arg;
  flush_job_t j;
  if (ckpt__journal_of(id, p->save_id) && ckpt__tier_read_record(dfd, id, &j) == 0 &&
      j.partner && ckpt__tier_mine(fs, j.rank, true)) {
    queue(p->f, &j);
  }
}

int ckpt__flush_start(ckpt_fs_t *fs, ckpt_flush_t **out) {
  ckpt_flush_t *f = calloc(1, sizeof(*f));
  if (!f)
    return -ENOMEM;
  f->fs = fs;
  pthread_mutex_init(&f->lock, NULL);
  pthread_cond_init(&f->cond, NULL);
  ckpt__tier_each_record(fs, queue_record, f); /* left by earlier mounts */
  int rc = pthread_create(&f->thread, NULL, flush_main, f);
  f->started = rc == 0;
  if (rc) {
    ckpt__flush_stop(f);
    return -rc;
  }
  *out = f;
  return 0;
}

void ckpt__flush_add(ckpt_flush_t *f, const char *name, const char *save_id,
                     int rank) {
  int dfd = ckpt__journal_open(f->fs, false);
  flush_job_t j;
  char rec[CKPT_SAVE_ID_LEN + 16];
  ckpt__journal_name(save_id, rank, rec, sizeof(rec));
  int rc = dfd < 0 ? dfd : ckpt__tier_read_record(dfd, rec, &j);
  if (dfd >= 0)
    close(dfd);
  if (rc == 0 && !strcmp(j.name, name)) {
    queue(f, &j);
    /* the partner copies this node received with the save (their records
     * are all written: before every rank's RESULT) */
    partners_t p = {.f = f, .save_id = save_id};
    ckpt__tier_each_record(f->fs, queue_partner, &p);
    return;
  }
  ckpt__log("tier: %s: no flush record %s (%s): not flushed", name,
            rec, strerror(rc ? -rc : ESTALE));
}

void ckpt__flush_stop(ckpt_flush_t *f) {
  if (!f)
    return;
  pthread_mutex_lock(&f->lock);
  f->stop = true;
  pthread_cond_broadcast(&f->cond);
  pthread_mutex_unlock(&f->lock);
  if (f->started)
    pthread_join(f->thread, NULL);
  for (flush_job_t *j = f->head, *nx; j; j = nx) {
    nx = j->next;
    free_job(j);
  }
  pthread_cond_destroy(&f->cond);
  pthread_mutex_destroy(&f->lock);
  free(f);
}

void ckpt__flush_supersede(ckpt_fs_t *fs, const char *name,
                           const char *save_id) {
  if (fs->tier_fd < 0)
    return;
  char *why = NULL;
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs);
  int dfd = lock < 0 ? lock : ckpt_store_open_dir(fs->tier_fd, name, O_RDONLY);
  char tier[CKPT_SAVE_ID_LEN + 1] = "", shared[CKPT_SAVE_ID_LEN + 1] = "";
  char *replaces = NULL;
  int64_t tier_ns = 0, shared_ns = 0;
  int rc = dfd < 0 ? dfd : ckpt_store_save_look(dfd, tier, &replaces, &tier_ns);
  if (dfd >= 0)
    close(dfd);
  if (rc == 0 && replaces && !strcmp(tier, save_id)) {
    int bfd = ckpt_store_open_dir(fs->backing_fd, name, O_RDONLY);
    int src = bfd == -ENOENT ? -ENOENT
              : bfd < 0      ? bfd
                             : ckpt_store_save_look(bfd, shared, NULL, &shared_ns);
    if (bfd >= 0)
      close(bfd);
    if (src == 0 && strcmp(shared, save_id) &&
        !ckpt_store_replaces_ok(replaces, tier_ns, shared, shared_ns))
      why = ckpt__strdup_printf("%s/%s is save %s, committed after this save "
                                "(%s) through another mount",
                                fs->backing_path, name, shared, save_id);
    else if (src == -ENOENT && !ckpt_store_replaces_has(replaces, ""))
      why = ckpt__strdup_printf("%s/%s was removed after this save (%s) was "
                                "committed", fs->backing_path, name, save_id);
  }
  if (why) {
    /* its records first: no flush of it publishes from now on (a
     * removal of NAME later must not let it come back), then its copy */
    int rdfd = ckpt__journal_open(fs, false);
    DIR *d = rdfd < 0 ? NULL : ckpt_opendir_at(rdfd);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
      if (ckpt__journal_of(e->d_name, save_id))
        unlinkat(rdfd, e->d_name, 0);
    if (d)
      closedir(d);
    if (rdfd >= 0) {
      fsync(rdfd);
      close(rdfd);
    }
    ckpt__checkpoint_remove(fs->tier_fd, name, false);
    ckpt_store_save_dir_remove(fs->tier_fd, save_id);
  }
  if (lock >= 0)
    ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
  free(replaces);
  if (!why)
    return;
  ckpt__log("tier: %s: save %s superseded, not published: %s; its flush "
            "records and tier copy removed", name, save_id, why);
  ckpt__resolve_superseded(fs, name, save_id, why);
  free(why);
}

int ckpt__flush_drop(ckpt_fs_t *fs, const char *name, const char *save_id,
                     int rank) {
  char id[CKPT_SAVE_ID_LEN + 1];
  pthread_mutex_lock(&fs->tier_publish);
  int rc = ckpt__tier_save_id_of(fs->tier_fd, name, id);
  if (rc == 0 && strcmp(id, save_id))
    rc = -ESTALE; /* another save of the name now: not ours to remove */
  int lock = ckpt__tier_lock(fs);
  if (rc == 0)
    rc = ckpt__checkpoint_remove(fs->tier_fd, name, false);
  if (rc == 0 || rc == -ENOENT || rc == -ESTALE)
    ckpt__flush_unrecord(fs, save_id, rank);
  ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
  if (rc == 0)
    ckpt__log("tier: %s: removed from the tier, its flush failed: never "
              "published", name);
  return rc == -ENOENT || rc == -ESTALE ? 0 : rc;
}
