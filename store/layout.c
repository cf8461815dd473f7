/*
 * layout.c - the layout of BACKING_DIR (store.h): opens that never follow
 * a symlink, the scan for unfinished saves, removal of a tree.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "catalog.h"
#include "store.h"

int ckpt_store_open_dir(int backing_fd, const char *name, int flags) {
  if (!ckpt_name_valid(name))
    return -EINVAL;
  return ckpt_open_beneath(backing_fd, name, flags | O_DIRECTORY, 0);
}

int ckpt_store_open_file(int dirfd, const char *file) {
  /* O_NONBLOCK: a FIFO put there must not hang the opener. */
  int fd = dirfd == AT_FDCWD
               ? openat(dirfd, file, O_RDONLY | O_NOFOLLOW | O_CLOEXEC |
                                         O_NONBLOCK)
               : ckpt_open_beneath(dirfd, file, O_RDONLY | O_NONBLOCK, 0);
  if (fd < 0)
    return dirfd == AT_FDCWD ? -errno : fd;
  struct stat st;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
    int e = S_ISREG(st.st_mode) ? errno : EINVAL;
    close(fd);
    return -e;
  }
  /* Back to blocking reads (a regular file never blocks anyway). */
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0)
    fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

bool ckpt_store_has_metadata(int dirfd) {
  struct stat st;
  return fstatat(dirfd, CKPT_METADATA_FILE, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

ckpt_entry_t ckpt_store_entry(int backing_fd, const char *name,
                              struct stat *dir) {
  struct stat st, md;
  char path[300];
  if (!ckpt_name_valid(name) ||
      fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW))
    return CKPT_ENTRY_NONE;
  if (!S_ISDIR(st.st_mode))
    return CKPT_ENTRY_OTHER;
  snprintf(path, sizeof(path), "%s/%s", name, CKPT_METADATA_FILE);
  if (fstatat(backing_fd, path, &md, AT_SYMLINK_NOFOLLOW))
    return CKPT_ENTRY_UNFINISHED;
  if (dir)
    *dir = st;
  return CKPT_ENTRY_COMMITTED;
}

bool ckpt_store_committed(int backing_fd, const char *name, struct stat *dir) {
  return ckpt_store_entry(backing_fd, name, dir) == CKPT_ENTRY_COMMITTED;
}

/* Open BACKING_DIR/.saves, creating it: fd or -errno. */
static int open_saves(int backing_fd, bool create) {
  if (create && mkdirat(backing_fd, CKPT_SAVES_DIR, 0700) && errno != EEXIST)
    return -errno;
  return ckpt_open_beneath(backing_fd, CKPT_SAVES_DIR, O_RDONLY | O_DIRECTORY,
                           0);
}

int ckpt_store_save_dir_hold(int backing_fd, const char *save_id, bool create,
                             int *out) {
  if (!ckpt_save_id_valid(save_id))
    return -EINVAL;
  /* A starting mount may remove .saves or an unheld save directory
   * between our mkdir and our flock: then start over. */
  for (int attempt = 0; attempt < 10; attempt++) {
    int sfd = open_saves(backing_fd, create);
    if (sfd == -ENOENT && create)
      continue;
    if (sfd < 0)
      return sfd;
    if (create && mkdirat(sfd, save_id, 0700) && errno != EEXIST) {
      int e = errno;
      close(sfd);
      if (e == ENOENT)
        continue;
      return -e;
    }
    int fd = ckpt_open_beneath(sfd, save_id, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0) {
      int e = -fd;
      close(sfd);
      if (e == ENOENT && create)
        continue;
      return -e;
    }
    /* The hold tells a starting mount's cleanup (LOCK_EX|LOCK_NB) that
     * the save is alive, on every node where the filesystem has
     * cluster-wide flock (local filesystems, CephFS, GPFS, Lustre with
     * -o flock, NFSv4 on files). Where a directory cannot be locked at
     * all, the save goes on unheld: the cleanup cannot lock it either,
     * so it never removes it (a crashed save then stays for fsck). */
    if (flock(fd, LOCK_SH) && errno != EBADF && errno != EINVAL &&
        errno != ENOLCK && errno != EOPNOTSUPP && errno != ENOSYS) {
      int e = errno;
      close(fd);
      close(sfd);
      return -e;
    }
    struct stat held, named;
    bool same = fstat(fd, &held) == 0 &&
                fstatat(sfd, save_id, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
                held.st_dev == named.st_dev && held.st_ino == named.st_ino;
    close(sfd);
    if (same) {
      *out = fd;
      return 0;
    }
    close(fd);
  }
  return -EAGAIN;
}

int ckpt_store_publish(int backing_fd, const char *save_id, const char *name) {
  if (!ckpt_save_id_valid(save_id) || !ckpt_name_valid(name))
    return -EINVAL;
  /* From .saves as opened beneath BACKING_DIR: a symlink put in its
   * place must not make the commit rename a directory from elsewhere. */
  int sfd = open_saves(backing_fd, false);
  if (sfd < 0)
    return sfd;
  int rc = renameat2(sfd, save_id, backing_fd, name, RENAME_NOREPLACE);
  if (rc && (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP)) {
    /* No RENAME_NOREPLACE here: rename(2) of a directory replaces only
     * an empty directory or nothing. An empty NAME directory (an
     * interrupted save of an older ckptfs) holds nothing to lose. */
    rc = renameat(sfd, save_id, backing_fd, name);
  }
  int e = errno;
  close(sfd);
  errno = e;
  if (rc == 0) {
    unlinkat(backing_fd, CKPT_SAVES_DIR, AT_REMOVEDIR); /* when empty */
    return 0;
  }
  if (errno == EEXIST || errno == ENOTEMPTY || errno == ENOTDIR ||
      errno == EISDIR)
    return -EEXIST;
  return -errno;
}

static int publish_replace_once(int backing_fd, const char *save_id,
                                const char *name, bool *replaced) {
  *replaced = false;
  if (!ckpt_save_id_valid(save_id) || !ckpt_name_valid(name))
    return -EINVAL;
  struct stat st;
  if (fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW)) {
    if (errno == ENOENT) /* nothing to replace */
      return ckpt_store_publish(backing_fd, save_id, name);
    return -errno;
  }
  if (!S_ISDIR(st.st_mode))
    return -EEXIST; /* a file or a symlink: not a checkpoint, not replaced */
  /* Not in the middle of a removal inside NAME (removal.c): it holds
   * NAME's directory exclusively while it builds and exchanges a new
   * version; the replace waits and replaces whichever version is there.
   * Only a committed checkpoint is replaced: a directory without .metadata
   * is being removed, an unfinished save, or not a checkpoint at all. */
  int nfd = -1;
  for (int attempt = 0; attempt < 100; attempt++) {
    nfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
    if (nfd < 0)
      break;
    flock(nfd, LOCK_EX);
    /* a removal may have exchanged a new version in while we waited:
     * that one is locked next */
    struct stat held, now;
    if (fstat(nfd, &held) == 0 &&
        fstatat(backing_fd, name, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        held.st_dev == now.st_dev && held.st_ino == now.st_ino)
      break;
    close(nfd);
    nfd = -1;
  }
  if (nfd < 0 || !ckpt_store_has_metadata(nfd)) {
    if (nfd >= 0)
      close(nfd);
    return -EEXIST;
  }
  int sfd = open_saves(backing_fd, false);
  if (sfd < 0) {
    if (nfd >= 0)
      close(nfd);
    return sfd;
  }
  int rc = renameat2(sfd, save_id, backing_fd, name, RENAME_EXCHANGE);
  int e = errno;
  close(sfd);
  if (nfd >= 0)
    close(nfd);
  if (rc == 0) {
    *replaced = true;
    return 0;
  }
  if (e == ENOENT) /* removed meanwhile: nothing to replace any more */
    return ckpt_store_publish(backing_fd, save_id, name);
  if (e == EINVAL || e == ENOSYS || e == ENOTSUP)
    return -EOPNOTSUPP;
  return -e;
}

int ckpt_store_publish_replace(int backing_fd, const char *save_id,
                               const char *name, bool *replaced) {
  /* A plain publish where NAME was not there loses to a commit of NAME
   * made meanwhile (EEXIST): then that one is replaced, as asked. */
  int rc = -EEXIST;
  for (int attempt = 0; attempt < 3 && rc == -EEXIST; attempt++) {
    struct stat st;
    bool was_there = fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
    rc = publish_replace_once(backing_fd, save_id, name, replaced);
    if (rc == -EEXIST && was_there)
      break; /* not a committed checkpoint: not replaced */
  }
  return rc;
}

int ckpt_store_unreplace(int backing_fd, const char *save_id,
                         const char *name) {
  int sfd = open_saves(backing_fd, false);
  if (sfd < 0)
    return sfd;
  int rc = renameat2(sfd, save_id, backing_fd, name, RENAME_EXCHANGE) ? -errno
                                                                      : 0;
  close(sfd);
  return rc;
}

int ckpt_store_sync_saves(int backing_fd) {
  int sfd = open_saves(backing_fd, false);
  if (sfd < 0)
    return sfd;
  int rc = fsync(sfd) ? -errno : 0;
  close(sfd);
  return rc;
}

void ckpt_store_save_dir_remove(int backing_fd, const char *save_id) {
  if (!ckpt_save_id_valid(save_id))
    return;
  int sfd = open_saves(backing_fd, false);
  if (sfd < 0)
    return;
  ckpt__remove_tree(sfd, save_id);
  close(sfd);
  unlinkat(backing_fd, CKPT_SAVES_DIR, AT_REMOVEDIR); /* when empty */
}

int ckpt_store_save_dir_remove_unheld(int root_fd, const char *save_id) {
  if (!ckpt_save_id_valid(save_id))
    return -EINVAL;
  int sfd = open_saves(root_fd, false);
  if (sfd < 0)
    return sfd;
  int rc = 0, fd = ckpt_open_beneath(sfd, save_id, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0)
    rc = fd;
  else if (flock(fd, LOCK_EX | LOCK_NB))
    rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
  else
    rc = ckpt__remove_tree(sfd, save_id);
  if (fd >= 0)
    close(fd);
  close(sfd);
  unlinkat(root_fd, CKPT_SAVES_DIR, AT_REMOVEDIR); /* when empty */
  return rc;
}

bool ckpt_store_save_dir_held(int root_fd, const char *save_id) {
  if (!ckpt_save_id_valid(save_id))
    return false;
  int sfd = open_saves(root_fd, false);
  if (sfd < 0)
    return false;
  int fd = ckpt_open_beneath(sfd, save_id, O_RDONLY | O_DIRECTORY, 0);
  bool held = fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) && errno == EWOULDBLOCK;
  if (fd >= 0)
    close(fd);
  close(sfd);
  return held;
}

/* Does a flush record in keep_fd name save id (SAVE_ID, or SAVE_ID.R of
 * rank R)? Unknown (an error): yes. */
static bool kept(int keep_fd, const char *id) {
  DIR *d = ckpt_opendir_at(keep_fd);
  if (!d)
    return true;
  size_t n = strlen(id);
  bool found = false;
  struct dirent *e;
  while (!found && (e = readdir(d)) != NULL)
    found = !strncmp(e->d_name, id, n) &&
            (e->d_name[n] == '\0' || e->d_name[n] == '.');
  closedir(d);
  return found;
}

/* Remove the save directories of .saves that no writer holds. */
static void cleanup_saves(int backing_fd, int keep_fd) {
  int sfd = open_saves(backing_fd, false);
  if (sfd < 0)
    return;
  DIR *d = ckpt_opendir_at(sfd);
  if (!d) {
    close(sfd);
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    if (keep_fd >= 0 && kept(keep_fd, e->d_name))
      continue; /* a flush record names it: resumed, not removed */
    int fd = ckpt_open_beneath(sfd, e->d_name, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0) { /* not a directory: not ours either, but in our space */
      unlinkat(sfd, e->d_name, 0);
      continue;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
      ckpt__log("removing unfinished save %s/%s", CKPT_SAVES_DIR, e->d_name);
      ckpt__remove_tree(sfd, e->d_name);
    }
    close(fd);
  }
  closedir(d);
  close(sfd);
  unlinkat(backing_fd, CKPT_SAVES_DIR, AT_REMOVEDIR); /* when empty */
}

/* Remove every entry of directory dfd (subdirectories whole). 0 or the
 * first -errno. */
static int empty_dir(int dfd) {
  DIR *d = ckpt_opendir_at(dfd);
  if (!d)
    return -errno;
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    int r = e->d_type == DT_DIR ? ckpt__remove_tree(dfd, e->d_name)
            : unlinkat(dfd, e->d_name, 0) && errno != ENOENT ? -errno
                                                               : 0;
    if (r && !rc)
      rc = r;
  }
  closedir(d);
  return rc;
}

int ckpt__remove_held_tree(int parent_fd, const char *name, int dfd) {
  int rc = 0;
  for (int attempt = 0; attempt < 5; attempt++) {
    rc = empty_dir(dfd);
    /* By name, now empty: if the name is another directory by now (a
     * replace exchanged it in), it is not empty and stays. */
    if (unlinkat(parent_fd, name, AT_REMOVEDIR) == 0 || errno == ENOENT)
      return rc;
    if (errno != ENOTEMPTY && errno != EEXIST)
      return rc ? rc : -errno;
    /* Still this directory, written again meanwhile (a protect that saw
     * .metadata just before it went adds its marker): emptied again. */
    struct stat held, named;
    if (fstat(dfd, &held) || fstatat(parent_fd, name, &named,
                                     AT_SYMLINK_NOFOLLOW) ||
        held.st_dev != named.st_dev || held.st_ino != named.st_ino)
      return rc;
  }
  return rc;
}

int ckpt__remove_tree(int parent_fd, const char *name) {
  int fd = ckpt_open_beneath(parent_fd, name, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0)
    return fd == -ENOTDIR || fd == -ELOOP
               ? (unlinkat(parent_fd, name, 0) ? -errno : 0)
               : fd;
  int rc = empty_dir(fd);
  close(fd);
  if (unlinkat(parent_fd, name, AT_REMOVEDIR) && errno != ENOENT && !rc)
    rc = -errno;
  return rc;
}

/* Remove what no live daemon holds in .staging: its unnamed files leave
 * nothing there, but the links a failed commit keeps aside for its retry
 * (fs/stage/streams.c) must outlive other mounts' starts. Their daemon holds a
 * shared flock on each for as long as it lives: a file that cannot be
 * locked exclusively is left (also where flock is refused altogether), and
 * so is .staging with it. */
static void cleanup_staging(int backing_fd) {
  int sfd = ckpt_open_beneath(backing_fd, CKPT_STAGING_DIR,
                              O_RDONLY | O_DIRECTORY, 0);
  if (sfd == -ELOOP || sfd == -ENOTDIR) {
    ckpt__log("BACKING_DIR/%s is not a directory (a symbolic link?): "
              "removed, never followed", CKPT_STAGING_DIR);
    unlinkat(backing_fd, CKPT_STAGING_DIR, 0);
    return;
  }
  DIR *d = sfd >= 0 ? ckpt_opendir_at(sfd) : NULL;
  if (!d) {
    if (sfd >= 0)
      close(sfd);
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    struct stat st, opened;
    if (fstatat(sfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW))
      continue;
    if (!S_ISREG(st.st_mode)) { /* never made by a daemon */
      ckpt__remove_tree(sfd, e->d_name);
      continue;
    }
    /* O_NONBLOCK, O_NOCTTY: should the entry change meanwhile (into a
     * FIFO, a terminal), opening it neither hangs nor does anything. */
    int fd = ckpt_open_beneath(sfd, e->d_name,
                               O_RDONLY | O_NONBLOCK | O_NOCTTY, 0);
    if (fd < 0)
      continue;
    if (fstat(fd, &opened) == 0 && S_ISREG(opened.st_mode) &&
        opened.st_ino == st.st_ino && flock(fd, LOCK_EX | LOCK_NB) == 0)
      unlinkat(sfd, e->d_name, 0);
    close(fd);
  }
  closedir(d);
  close(sfd);
  unlinkat(backing_fd, CKPT_STAGING_DIR, AT_REMOVEDIR); /* when empty */
}

/* Does directory dfd hold only what a save writes (data files, .metadata
 * and its temporary and journal files, the .protected marker and its
 * temporary file: a protected checkpoint's rm -r interrupted after its
 * .metadata went leaves it)? A directory holding anything else
 * is not an unfinished save: someone else's (lost+found on a dedicated
 * volume, files put there by hand), never removed. NULL when it is one,
 * else the first other name (in buf). */
static const char *foreign_entry(int dfd, char *buf, size_t cap) {
  DIR *d = ckpt_opendir_at(dfd);
  if (!d) {
    snprintf(buf, cap, "(unreadable)");
    return buf;
  }
  const char *found = NULL;
  struct dirent *e;
  int32_t rank;
  uint32_t k;
  while (!found && (e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") ||
        !strncmp(e->d_name, CKPT_METADATA_FILE,
                 strlen(CKPT_METADATA_FILE)) ||
        !strcmp(e->d_name, CKPT_PROTECT_FILE) ||
        !strcmp(e->d_name, CKPT_PROTECT_FILE ".tmp") ||
        ckpt_data_file_parse(e->d_name, &rank, &k) == 0)
      continue;
    snprintf(buf, cap, "%s", e->d_name);
    found = buf;
  }
  closedir(d);
  return found;
}

void ckpt_store_cleanup(int backing_fd, int keep_fd) {
  DIR *d = ckpt_opendir_at(backing_fd);
  if (!d)
    return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!ckpt_name_valid(e->d_name) || !strcmp(e->d_name, "lost+found"))
      continue;
    int dfd = ckpt_store_open_dir(backing_fd, e->d_name, O_RDONLY);
    if (dfd < 0)
      continue; /* not a directory, or a symlink: not ours to touch */
    if (ckpt_store_has_metadata(dfd)) {
      /* A committed (or damaged) checkpoint: only a temporary file can be
       * stale. Damaged ones are reported, never removed. */
      unlinkat(dfd, CKPT_METADATA_TMP, 0);
    } else if (flock(dfd, LOCK_EX | LOCK_NB) == 0 &&
               !ckpt_store_has_metadata(dfd)) {
      char other[256];
      const char *f = foreign_entry(dfd, other, sizeof(other));
      if (f) {
        ckpt__log("not removing %s: not a checkpoint (it holds %s, which no "
                  "save writes)", e->d_name, f);
      } else { /* no writer holds it: an interrupted save */
        ckpt__log("removing unfinished save %s", e->d_name);
        ckpt__remove_held_tree(backing_fd, e->d_name, dfd);
      }
    }
    close(dfd);
  }
  closedir(d);
  cleanup_saves(backing_fd, keep_fd);
  cleanup_staging(backing_fd);
}

/* ----- a root no other user can write (a tier) ----- */

/* Could a user other than uid (and gid's members) change st, or what it
 * holds? The owner, or a write bit for others or for another group. */
static const char *foreign(const struct stat *st, uid_t uid, gid_t gid) {
  if (st->st_uid != uid)
    return "owned by another user";
  if (S_ISLNK(st->st_mode))
    return NULL; /* never followed; its mode bits mean nothing */
  if (st->st_mode & S_IWOTH)
    return "writable by every user";
  if ((st->st_mode & S_IWGRP) && st->st_gid != gid)
    return "writable by its group";
  return NULL;
}

/* Depth-first over the directory open at fd (path: its name for *why). */
static int check_tree(int fd, const char *path, uid_t uid, gid_t gid,
                      int depth, char **why) {
  if (depth > 64) {
    *why = ckpt__strdup_printf("%s: nested deeper than 64 directories", path);
    return -ELOOP;
  }
  DIR *d = ckpt_opendir_at(fd);
  if (!d)
    return -errno;
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    struct stat st;
    if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW)) {
      if (errno != ENOENT) /* removed meanwhile: nothing to trust */
        rc = -errno;
      continue;
    }
    const char *bad = foreign(&st, uid, gid);
    if (bad) {
      *why = ckpt__strdup_printf("%s/%s is %s (uid %u, mode %04o)", path,
                                 e->d_name, bad, (unsigned)st.st_uid,
                                 (unsigned)(st.st_mode & 07777));
      rc = -EPERM;
    } else if (S_ISDIR(st.st_mode)) {
      int sub = ckpt_open_beneath(fd, e->d_name, O_RDONLY | O_DIRECTORY, 0);
      if (sub == -ENOENT)
        continue;
      if (sub < 0) {
        rc = sub;
        break;
      }
      char *subpath = ckpt__strdup_printf("%s/%s", path, e->d_name);
      rc = subpath ? check_tree(sub, subpath, uid, gid, depth + 1, why)
                   : -ENOMEM;
      free(subpath);
      close(sub);
    }
  }
  closedir(d);
  if (rc && rc != -EPERM && rc != -ELOOP && !*why)
    *why = ckpt__strdup_printf("%s: %s", path, strerror(-rc));
  return rc;
}

int ckpt_store_check_private(int root_fd, const char *path, bool whole,
                             char **why) {
  uid_t uid = geteuid();
  gid_t gid = getegid();
  struct stat st;
  *why = NULL;
  if (fstat(root_fd, &st)) {
    int e = errno;
    *why = ckpt__strdup_printf("%s: %s", path, strerror(e));
    return -e;
  }
  const char *bad = foreign(&st, uid, gid);
  if (bad) {
    *why = ckpt__strdup_printf("%s is %s (uid %u, mode %04o)", path, bad,
                               (unsigned)st.st_uid,
                               (unsigned)(st.st_mode & 07777));
    return -EPERM;
  }
  return whole ? check_tree(root_fd, path, uid, gid, 0, why) : 0;
}
