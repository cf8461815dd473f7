/*
 * cmd_dcp.c - `ckptctl import-dcp DCP_DIR BACKING_DIR NAME` and
 * `ckptctl export BACKING_DIR NAME --dcp DIR`: checkpoints of PyTorch's
 * torch.distributed.checkpoint (DCP) in and out.
 *
 * DCP's directory format is pickled Python objects and torch.save'd
 * tensors, which only torch reads and writes faithfully, so both commands
 * run the ckptfs Python package's converter (python -m ckptfs.dcp, see
 * docs/pytorch.md) with the ckptfs binary installed beside this ckptctl
 * ($CKPTFS_BIN unless set) to mount BACKING_DIR for the duration. ckptctl
 * itself links only the store. The interpreter is $CKPTFS_PYTHON; else the
 * one the package is installed in: pip writes the package's console script
 * ckptfs-dcp with its interpreter's path in the #! line, so the first
 * ckptfs-dcp on PATH names it (a venv's interpreter, which the python3 on
 * PATH often is not); else python3. Only an absolute path to a python*
 * with nothing after it is taken ("#!/usr/bin/env python3" is not), and
 * relative PATH entries (the current directory) are skipped. Root, whose
 * PATH may hold a directory late that python3 never let matter, takes it
 * only when the script, the interpreter and their directories belong to
 * root and no one else may write them.
 *
 * ckptctl often runs as root on directories other users own, so the
 * converter runs as `python -P -s -m ckptfs.dcp` from "/": neither the
 * current directory (a planted ckptfs/ there would run as root) nor the
 * user's site-packages is on its sys.path; the package is found where the
 * interpreter's own paths and PYTHONPATH say. Path arguments are made
 * absolute first, as they were meant from the caller's directory.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ckptctl.h"
#include "json.h"

/* Set CKPTFS_BIN to the ckptfs beside /proc/self/exe, unless set. */
static void find_ckptfs(void) {
  char self[PATH_MAX];
  if (getenv("CKPTFS_BIN"))
    return;
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0)
    return;
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (!slash || (size_t)(slash - self) + sizeof("/ckptfs") > sizeof(self))
    return;
  strcpy(slash, "/ckptfs");
  if (access(self, X_OK) == 0)
    setenv("CKPTFS_BIN", self, 0);
}

/* The interpreter a pip-written console script runs: "#!/abs/python", or,
 * for a path a #! line cannot hold (too long, spaces), "#!/bin/sh" then
 * "'''exec' "/abs/python" "$0" "$@"". Copied into out; false when text is
 * neither or it is not executable. */
static bool script_interpreter(const char *text, char *out, size_t size) {
  static const char sh_exec[] = "\n'''exec' \"";
  if (strncmp(text, "#!", 2) != 0)
    return false;
  const char *p = text + 2 + strspn(text + 2, " \t");
  const char *end = p + strcspn(p, " \t\n");
  if (end - p == 7 && strncmp(p, "/bin/sh", 7) == 0) {
    const char *exec = strstr(text, sh_exec);
    if (!exec)
      return false;
    p = exec + strlen(sh_exec);
    end = p + strcspn(p, "\"\n");
    if (*end != '"')
      return false;
  }
  /* an interpreter alone: "#!/usr/bin/env python3" would run env with
   * python's options, and a named python is what pip writes */
  const char *rest = end + strspn(end, " \t\r");
  const char *base = p;
  for (const char *q = p; q < end; q++)
    if (*q == '/')
      base = q + 1;
  if (p[0] != '/' || (size_t)(end - p) >= size || (*rest && *rest != '\n' && *rest != '"') ||
      strncmp(base, "python", 6) != 0)
    return false;
  memcpy(out, p, (size_t)(end - p));
  out[end - p] = '\0';
  return access(out, X_OK) == 0;
}

/* For root: path (resolved) and its directory belong to root and only root
 * may change them, so that no other user's file picks root's interpreter. */
static bool root_owned(const char *path) {
  char real[PATH_MAX];
  struct stat st;
  if (!realpath(path, real) || stat(real, &st) != 0 || st.st_uid != 0 ||
      (st.st_mode & (S_IWGRP | S_IWOTH)))
    return false;
  char *slash = strrchr(real, '/');
  if (slash == real)
    slash[1] = '\0';
  else
    *slash = '\0';
  return stat(real, &st) == 0 && st.st_uid == 0 &&
         (!(st.st_mode & (S_IWGRP | S_IWOTH)) || (st.st_mode & S_ISVTX));
}

/* The interpreter of the first ckptfs-dcp on PATH (absolute entries only)
 * into out; false when there is none or it names none. */
static bool dcp_script_python(char *out, size_t size) {
  const char *path = getenv("PATH");
  char file[PATH_MAX], head[PATH_MAX + 64];
  while (path && *path) {
    size_t n = strcspn(path, ":");
    if (path[0] == '/' && n + sizeof("/ckptfs-dcp") <= sizeof(file)) {
      snprintf(file, sizeof(file), "%.*s/ckptfs-dcp", (int)n, path);
      FILE *f = access(file, X_OK) == 0 ? fopen(file, "r") : NULL;
      if (f) {
        size_t got = fread(head, 1, sizeof(head) - 1, f);
        fclose(f);
        head[got] = '\0';
        /* root trusts a script and an interpreter only root may change
         * (a user's venv on root's PATH is not one); else python3 */
        return script_interpreter(head, out, size) &&
               (geteuid() != 0 || (root_owned(file) && root_owned(out)));
      }
    }
    path += n + (path[n] == ':');
  }
  return false;
}

/* The converter's exit status when it ran and printed its own error
 * (a refused DCP directory, a missing checkpoint...). */
#define CONVERTER_REFUSED 3

/* path made absolute against the current directory (malloc'd; NULL on
 * failure, reported). */
static char *absolute(const char *what, const char *path) {
  if (path[0] == '/')
    return strdup(path);
  char cwd[PATH_MAX];
  if (!getcwd(cwd, sizeof(cwd))) {
    fail("%s: getcwd: %s", what, strerror(errno));
    return NULL;
  }
  size_t n = strlen(cwd) + 1 + strlen(path) + 1;
  char *out = malloc(n);
  if (out)
    snprintf(out, n, "%s/%s", cwd, path);
  return out;
}

/* Run python -P -s -m ckptfs.dcp ARGS... in "/"; its exit status (EXIT_NO
 * when it cannot be run or fails). quiet: its stdout goes to stderr
 * (--json prints one document of its own). */
static int run_converter(const char *what, char *const args[], int nargs,
                         bool quiet) {
  static char script_py[PATH_MAX];
  const char *py = getenv("CKPTFS_PYTHON");
  if (!py || !*py)
    py = dcp_script_python(script_py, sizeof(script_py)) ? script_py : "python3";
  char *argv[10];
  int k = 0;
  argv[k++] = (char *)py;
  argv[k++] = "-P"; /* no current directory on sys.path (Python >= 3.11) */
  argv[k++] = "-s"; /* nor the user's site-packages */
  argv[k++] = "-m";
  argv[k++] = "ckptfs.dcp";
  for (int i = 0; i < nargs && k < 9; i++)
    argv[k++] = args[i];
  argv[k] = NULL;
  find_ckptfs();
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) {
    fail("%s: fork: %s", what, strerror(errno));
    return EXIT_NO;
  }
  if (pid == 0) {
    if (quiet)
      dup2(STDERR_FILENO, STDOUT_FILENO);
    if (chdir("/") != 0) {
      fprintf(stderr, "%s: %s: chdir /: %s\n", prog, what, strerror(errno));
      _exit(127);
    }
    execvp(py, argv);
    fprintf(stderr, "%s: %s: cannot run %s: %s\n", prog, what, py,
            strerror(errno));
    _exit(127);
  }
  int st;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) {
      fail("%s: waitpid: %s", what, strerror(errno));
      return EXIT_NO;
    }
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
    return 0;
  if (WIFEXITED(st) && WEXITSTATUS(st) == CONVERTER_REFUSED) {
    fail("%s failed (the converter's error above)", what);
    return EXIT_NO;
  }
  fail("%s failed: it needs a Python with the ckptfs package and torch 2.x "
       "(pip install torch ./python from a ckptfs checkout: its ckptfs-dcp "
       "on PATH names the interpreter; or CKPTFS_PYTHON, Python >= 3.11; "
       "now %s)",
       what, py);
  return EXIT_NO;
}

/* {"name", "from", "to", "format": "dcp"} */
static void report_json(const char *name, const char *from, const char *to) {
  json_t j;
  j_begin(&j);
  j_open(&j, '{');
  j_key(&j, "name"), j_str(&j, name);
  j_key(&j, "from"), j_str(&j, from);
  j_key(&j, "to"), j_str(&j, to);
  j_key(&j, "format"), j_str(&j, "dcp");
  j_close(&j, '}');
  j_end(&j);
}

int cmd_import_dcp(const args_t *a, int backing_fd) {
  (void)backing_fd;
  char *from = absolute("import-dcp", a->pos[0]);
  char *to = absolute("import-dcp", a->pos[1]);
  int rc = EXIT_NO;
  if (from && to) {
    char *args[] = {"import", from, to, a->pos[2]};
    rc = run_converter("import-dcp", args, 4, a->json);
  }
  free(from);
  free(to);
  if (rc == 0 && a->json)
    report_json(a->pos[2], a->pos[0], a->pos[1]);
  return rc;
}

int export_dcp(const args_t *a) {
  char *from = absolute("export --dcp", a->pos[0]);
  char *to = absolute("export --dcp", a->dcp);
  int rc = EXIT_NO;
  if (from && to) {
    char *args[] = {"export", from, a->pos[1], to};
    rc = run_converter("export --dcp", args, 4, a->json);
  }
  free(from);
  free(to);
  if (rc == 0 && a->json)
    report_json(a->pos[1], a->pos[0], a->dcp);
  return rc;
}
