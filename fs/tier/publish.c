/*
 * publish.c - a complete save directory published as ROOT/NAME, for a
 * commit and for the tier's flush alike, and the words saying why NAME
 * could not be.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "failpoint.h"
#include "tier.h"

/* Why a save of NAME cannot publish in root_fd (root_path): "NAME is
 * already committed elsewhere (save S, world size W, created at T)", as
 * far as its header says. */
char *ckpt__committed_elsewhere(int root_fd, const char *root_path,
                                 const char *name) {
  ckpt_entry_t e = ckpt_store_entry(root_fd, name, NULL);
  if (e == CKPT_ENTRY_OTHER) {
    struct stat st;
    bool link = fstatat(root_fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                S_ISLNK(st.st_mode);
    return ckpt__strdup_printf("%s is taken in %s by something else than a "
                               "checkpoint (%s): not replaced",
                               name, root_path,
                               link ? "a symbolic link" : "a file");
  }
  if (e != CKPT_ENTRY_COMMITTED)
    return ckpt__strdup_printf("%s exists in %s as an unfinished save (no %s):"
                               " not replaced; a starting mount removes it "
                               "when no writer holds it",
                               name, root_path, CKPT_METADATA_FILE);
  /* Who committed it, as far as its header says. */
  ckpt_metadata_t m;
  char *err = NULL, display[300];
  snprintf(display, sizeof(display), "%s/%s", name, CKPT_METADATA_FILE);
  int dfd = ckpt_store_open_dir(root_fd, name, O_RDONLY);
  int rc = dfd < 0 ? dfd : ckpt_metadb_load_header_at(dfd, display, &m, &err);
  if (dfd >= 0)
    close(dfd);
  free(err);
  if (rc)
    return ckpt__strdup_printf("%s is already committed elsewhere", name);
  char when[32];
  time_t t = (time_t)m.created_at;
  struct tm tm;
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&t, &tm));
  char *why = ckpt__strdup_printf("%s is already committed elsewhere (save "
                                  "%s, world size %d, created at %s)",
                                  name, m.save_id, m.world_size, when);
  ckpt_metadata_free(&m);
  return why;
}

/* The publish half of a commit, in root p->root_fd whose .saves/SAVE_ID
 * holds the complete checkpoint with its .metadata:
 *   1. rename it to NAME without replacing anything (or exchange it with
 *      NAME for replace=): the commit point;
 *   2. fsync the root (and .saves when exchanged); if that fails, the
 *      rename is undone, so nothing stays published that is not durable;
 *   3. replaced: the old version, now at .saves/SAVE_ID, is removed.
 * Used by commits (into the tier or BACKING_DIR) and by the flush of a
 * tier (into BACKING_DIR): both publish the same way. 0 or -errno with
 * *err. */
int ckpt__publish_save(ckpt_fs_t *fs, const ckpt_publish_t *p, char **err) {
  bool replaced = false;
  char now[CKPT_SAVE_ID_LEN + 1] = "";
  int rc = p->replaces ? ckpt_store_publish_if(p->root_fd, p->save_id, p->name,
                                               p->replaces, p->commit_ns,
                                               &replaced, now)
           : p->replace ? ckpt_store_publish_replace(p->root_fd, p->save_id,
                                                     p->name, &replaced)
                        : ckpt_store_publish(p->root_fd, p->save_id, p->name);
  if (rc == -ESTALE)
    *err = now[0] ? ckpt__strdup_printf(
                        "%s/%s is save %s, committed after this save (%s) "
                        "through another mount", p->root_path, p->name, now,
                        p->save_id)
                  : ckpt__strdup_printf(
                        "%s/%s was removed after this save (%s) was "
                        "committed", p->root_path, p->name, p->save_id);
  else if (rc == -EEXIST)
    *err = ckpt__committed_elsewhere(p->root_fd, p->root_path, p->name);
  else if (rc == -EOPNOTSUPP)
    *err = ckpt__strdup_printf(
        "replace=%s: the filesystem of %s cannot exchange two directories "
        "in one step (renameat2 RENAME_EXCHANGE), which an atomic replace "
        "needs; save under a new name instead",
        p->name, p->root_path);
  else if (rc)
    *err = ckpt__strdup_printf("publishing %s/%s: %s", p->root_path,
                               p->name, strerror(-rc));
  /* The save protocol's points are a commit's, not the flush's */
  if (rc == 0 && !p->flush)
    ckpt_failpoint("metadata_rename");
  /* Replaced: both directories changed (NAME and .saves, where the old
   * checkpoint is now); if that cannot be made durable, the two go back. */
  if (rc == 0 && replaced && fs->opts.sync_files &&
      (fsync(p->root_fd) || ckpt_store_sync_saves(p->root_fd))) {
    rc = -errno;
    *err = ckpt__strdup_printf("syncing %s: %s", p->root_path,
                               strerror(errno));
    if (ckpt_store_unreplace(p->root_fd, p->save_id, p->name)) {
      /* Cannot be undone (the old version went meanwhile): it is
       * published, only not known to be durable. */
      ckpt__log("%s: replaced, but %s; not undone: the exchange back "
                "failed", p->name, *err);
      free(*err);
      *err = NULL;
      rc = 0;
    }
  }
  /* The NAME entry itself must be durable too; if it cannot be, the
   * commit fails and nothing may stay published: the directory goes back
   * to its own name (the discard removes it), if it is still ours. */
  if (rc == 0 && !replaced && fs->opts.sync_files && fsync(p->root_fd)) {
    rc = -errno;
    *err = ckpt__strdup_printf("syncing %s: %s", p->root_path,
                               strerror(errno));
    struct stat hst, named;
    int sfd = -1;
    if (p->held_fd >= 0 && fstat(p->held_fd, &hst) == 0 &&
        fstatat(p->root_fd, p->name, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
        hst.st_dev == named.st_dev && hst.st_ino == named.st_ino &&
        (mkdirat(p->root_fd, CKPT_SAVES_DIR, 0700) == 0 || errno == EEXIST) &&
        (sfd = ckpt_open_beneath(p->root_fd, CKPT_SAVES_DIR,
                                 O_PATH | O_DIRECTORY, 0)) >= 0)
      renameat(p->root_fd, p->name, sfd, p->save_id);
    if (sfd >= 0)
      close(sfd);
  }
  if (rc == 0 && !p->flush)
    ckpt_failpoint("metadata_synced");
  if (rc == 0 && replaced) {
    /* The old checkpoint, now the save's own directory: removed like an
     * unfinished save (readers that hold its files open keep them). */
    if (!p->flush)
      ckpt_failpoint("replace_remove");
    ckpt_store_save_dir_remove(p->root_fd, p->save_id);
    if (fs->opts.sync_files)
      fsync(p->root_fd);
  }
  return rc;
}
