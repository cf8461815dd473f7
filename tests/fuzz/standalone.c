/*
 * standalone.c - replay fuzz inputs without libFuzzer.
 *
 *   <target>_replay PATH...
 *
 * Feeds every regular file named, and every regular file directly inside
 * every directory named, to LLVMFuzzerTestOneInput, each in a buffer of
 * exactly its size (so that sanitizers see any overread). Exits 0 when all
 * inputs ran, 1 when a path could not be read (a target that finds a bug
 * aborts).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

/* Run one file; returns 0 or -errno. */
static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  uint8_t *data = NULL;
  size_t cap = 0, len = 0;
  int rc = 0;

  if (f == NULL)
    return -errno;
  for (;;) {
    if (len == cap) {
      cap = cap ? 2 * cap : 4096;
      uint8_t *p = realloc(data, cap);
      if (p == NULL) {
        rc = -ENOMEM;
        goto out;
      }
      data = p;
    }
    size_t n = fread(data + len, 1, cap - len, f);
    len += n;
    if (n == 0)
      break;
  }
  if (ferror(f)) {
    rc = -EIO;
    goto out;
  }
  uint8_t *exact = malloc(len > 0 ? len : 1);
  if (exact == NULL) {
    rc = -ENOMEM;
    goto out;
  }
  memcpy(exact, data, len);
  LLVMFuzzerTestOneInput(exact, len);
  free(exact);
out:
  free(data);
  fclose(f);
  return rc;
}

/* Run a file or the files of a directory; returns the inputs run, or -1. */
static long run_path(const char *path) {
  struct stat st;
  long n = 0;
  if (stat(path, &st) < 0) {
    fprintf(stderr, "%s: %s\n", path, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(st.st_mode)) {
    int rc = run_file(path);
    if (rc < 0)
      fprintf(stderr, "%s: %s\n", path, strerror(-rc));
    return rc < 0 ? -1 : 1;
  }
  DIR *d = opendir(path);
  if (d == NULL) {
    fprintf(stderr, "%s: %s\n", path, strerror(errno));
    return -1;
  }
  struct dirent *e;
  while (n >= 0 && (e = readdir(d)) != NULL) {
    char *p;
    if (asprintf(&p, "%s/%s", path, e->d_name) < 0) {
      n = -1;
      break;
    }
    if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) {
      int rc = run_file(p);
      if (rc < 0) {
        fprintf(stderr, "%s: %s\n", p, strerror(-rc));
        n = -1;
      } else {
        n++;
      }
    }
    free(p);
  }
  closedir(d);
  return n;
}

int main(int argc, char **argv) {
  long total = 0;
  if (argc < 2) {
    fprintf(stderr, "usage: %s PATH...\n", argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; i++) {
    long n = run_path(argv[i]);
    if (n < 0)
      return 1;
    total += n;
  }
  printf("%s: %ld inputs ran\n", argv[0], total);
  return 0;
}
