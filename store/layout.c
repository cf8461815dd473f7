/*
 * layout.c - the layout of BACKING_DIR (store.h): opens that never follow
 * a symlink, the scan for unfinished saves, removal of a tree.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store.h"

int ckpt_store_open_dir(int backing_fd, const char *name, int flags) {
  if (!ckpt_name_valid(name))
    return -EINVAL;
  int fd = openat(backing_fd, name,
                  flags | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  return fd >= 0 ? fd : -errno;
}

int ckpt_store_open_file(int dirfd, const char *file) {
  /* O_NONBLOCK: a FIFO put there must not hang the opener. */
  int fd = openat(dirfd, file, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return -errno;
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

bool ckpt_store_committed(int backing_fd, const char *name, struct stat *dir) {
  struct stat st, md;
  char path[300];
  if (!ckpt_name_valid(name) ||
      fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW) ||
      !S_ISDIR(st.st_mode))
    return false;
  snprintf(path, sizeof(path), "%s/%s", name, CKPT_METADATA_FILE);
  if (fstatat(backing_fd, path, &md, AT_SYMLINK_NOFOLLOW))
    return false;
  if (dir)
    *dir = st;
  return true;
}

int ckpt__remove_tree(int parent_fd, const char *name) {
  int fd = openat(parent_fd, name,
                  O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOTDIR || errno == ELOOP
               ? (unlinkat(parent_fd, name, 0) ? -errno : 0)
               : -errno;
  DIR *d = fdopendir(fd);
  if (!d) {
    int e = errno;
    close(fd);
    return -e;
  }
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    if (e->d_type == DT_DIR) {
      int r = ckpt__remove_tree(dirfd(d), e->d_name);
      if (r && !rc)
        rc = r;
    } else if (unlinkat(dirfd(d), e->d_name, 0) && errno != ENOENT && !rc) {
      rc = -errno;
    }
  }
  closedir(d);
  if (unlinkat(parent_fd, name, AT_REMOVEDIR) && errno != ENOENT && !rc)
    rc = -errno;
  return rc;
}

void ckpt_store_cleanup(int backing_fd) {
  /* Our own open: a dup of backing_fd would share its position. */
  int fd = openat(backing_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d) {
    if (fd >= 0)
      close(fd);
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!ckpt_name_valid(e->d_name))
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
      /* No writer holds it: an interrupted save. */
      ckpt__log("removing unfinished save %s", e->d_name);
      ckpt__remove_tree(backing_fd, e->d_name);
    }
    close(dfd);
  }
  closedir(d);
  ckpt__remove_tree(backing_fd, CKPT_STAGING_DIR);
}
