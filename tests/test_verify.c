/* Unit tests of verify.c (the XXH3-64 of a byte range of a file) and
 * known.c (chunks hashed by a commit). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmocka.h>

#include "store.h"
#include "store_int.h"

/* A temporary file holding n pseudo-random bytes, also copied to *data. */
static int temp_file(size_t n, uint8_t **data) {
  char path[] = "/tmp/ckpt-verify-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  unlink(path);
  uint8_t *d = malloc(n ? n : 1);
  assert_non_null(d);
  uint64_t x = 0x9e3779b97f4a7c15u;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    d[i] = (uint8_t)x;
  }
  assert_int_equal(write(fd, d, n), (ssize_t)n);
  *data = d;
  return fd;
}

static void ranges_match_one_shot_hash(void **state) {
  (void)state;
  size_t n = (3u << 20) + 12345; /* several 1 MiB reads, a ragged end */
  uint8_t *d;
  int fd = temp_file(n, &d);
  const uint64_t ranges[][2] = {
      {0, n}, {0, 0}, {1, 1}, {4095, (1u << 20) + 2}, {n - 7, 7}, {100, n - 100}};
  for (size_t i = 0; i < sizeof(ranges) / sizeof(ranges[0]); i++) {
    uint64_t got = 1;
    assert_int_equal(ckpt__stored_checksum(fd, ranges[i][0], ranges[i][1], &got), 0);
    assert_true(got == XXH3_64bits(d + ranges[i][0], ranges[i][1]));
  }
  free(d);
  close(fd);
}

static void a_range_past_the_end_is_nodata(void **state) {
  (void)state;
  uint8_t *d;
  int fd = temp_file(5000, &d);
  uint64_t got = 7;
  assert_int_equal(ckpt__stored_checksum(fd, 4000, 1001, &got), -ENODATA);
  assert_int_equal(ckpt__stored_checksum(fd, 6000, 1, &got), -ENODATA);
  assert_true(got == 7); /* untouched on failure */
  free(d);
  close(fd);
}

static void a_flipped_bit_changes_the_sum(void **state) {
  (void)state;
  uint8_t *d;
  int fd = temp_file(70000, &d);
  uint64_t before, after;
  assert_int_equal(ckpt__stored_checksum(fd, 0, 70000, &before), 0);
  d[65536] ^= 0x10;
  assert_int_equal(pwrite(fd, d + 65536, 1, 65536), 1);
  assert_int_equal(ckpt__stored_checksum(fd, 0, 70000, &after), 0);
  assert_true(before != after);
  assert_true(after == XXH3_64bits(d, 70000));
  free(d);
  close(fd);
}

static void a_bad_fd_is_an_error(void **state) {
  (void)state;
  uint64_t got;
  assert_int_equal(ckpt__stored_checksum(-1, 0, 10, &got), -EBADF);
}

/* A check ahead of the reader gives up once told to (its checkpoint goes);
 * untold, it is the same sum. */
static void a_stopped_check_gives_up(void **state) {
  (void)state;
  uint8_t *d;
  int fd = temp_file(3 << 20, &d);
  uint64_t got = 0;
  _Atomic bool stop = false;
  assert_int_equal(ckpt__stored_checksum_stop(fd, 0, 3 << 20, &got, &stop), 0);
  assert_true(got == XXH3_64bits(d, 3 << 20));
  atomic_store(&stop, true);
  assert_int_equal(ckpt__stored_checksum_stop(fd, 0, 3 << 20, &got, &stop),
                   -ECANCELED);
  free(d);
  close(fd);
}

/* ckpt__hash_fd adds to a libxxhash state (the AVX2 build where the CPU
 * has it): the same sum as one call over the bytes, in pieces too. */
static void hash_fd_continues_a_libxxhash_state(void **state) {
  (void)state;
  size_t n = (2u << 20) + 777;
  uint8_t *d, buf[4096];
  int fd = temp_file(n, &d);
  XXH3_state_t *st = XXH3_createState();
  assert_non_null(st);
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, d, 100); /* the first bytes from memory */
  assert_int_equal(ckpt__hash_fd(st, fd, 100, 5000, buf, sizeof(buf)), 0);
  assert_int_equal(ckpt__hash_fd(st, fd, 5100, n - 5100, buf, sizeof(buf)), 0);
  assert_true(XXH3_64bits_digest(st) == XXH3_64bits(d, n));
  assert_int_equal(ckpt__hash_fd(st, fd, n - 10, 11, buf, sizeof(buf)),
                   -ENODATA);
  XXH3_freeState(st);
  free(d);
  close(fd);
}

/* ckpt__hash_fd hashes from mappings of the file (4 MiB at a time) and,
 * where it cannot map, through preads: both give the one-shot sum, for
 * ranges that start and end inside pages and span several windows. */
static void hash_fd_mapped_and_read_agree(void **state) {
  (void)state;
  size_t n = (9u << 20) + 4321;
  uint8_t *d, buf[8192];
  int fd = temp_file(n, &d);
  const uint64_t cases[][2] = {{0, n}, {1, n - 1}, {4095, (4u << 20) + 2},
                               {(4u << 20) - 7, (5u << 20) + 11}, {n - 1, 1}};
  assert_int_equal(ckpt_store_hash_mapped_init(), 0);
  for (int reads = 0; reads < 2; reads++) {
    atomic_store(&ckpt__hash_reads_only, reads == 1);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
      uint64_t mapped = atomic_load(&ckpt__hash_mapped_bytes);
      XXH3_state_t *st = XXH3_createState();
      XXH3_64bits_reset(st);
      assert_int_equal(
          ckpt__hash_fd(st, fd, cases[i][0], cases[i][1], buf, sizeof(buf)), 0);
      assert_true(XXH3_64bits_digest(st) ==
                  XXH3_64bits(d + cases[i][0], cases[i][1]));
      /* the mapping is what hashed it (or, told to read, it is not) */
      assert_int_equal(atomic_load(&ckpt__hash_mapped_bytes) - mapped,
                       reads ? 0 : cases[i][1]);
      XXH3_freeState(st);
    }
  }
  atomic_store(&ckpt__hash_reads_only, false);
  free(d);
  close(fd);
}

/* A file that shrinks while it is hashed from a mapping: the load past its
 * end raises SIGBUS, which the guard turns into a jump back (the hash
 * then says -ENODATA). Made deterministic here: a mapping past the end. */
/* Load byte at of mapping m (len bytes) with the guard armed over all of
 * it: 1 when the load faulted and the guard jumped back, 0 when it read. */
static int guarded_load(const volatile uint8_t *m, size_t len, size_t at) {
  sigjmp_buf jb;
  volatile int jumped = 0;
  if (sigsetjmp(jb, 1) == 0) {
    ckpt__bus_guard_arm(&jb, (const void *)m, len);
    (void)m[at];
  } else {
    jumped = 1;
  }
  ckpt__bus_guard_disarm();
  return jumped;
}

static void a_fault_in_a_guarded_range_jumps_back(void **state) {
  (void)state;
  uint8_t *d;
  long page = sysconf(_SC_PAGESIZE);
  int fd = temp_file((size_t)page, &d);
  const volatile uint8_t *m =
      mmap(NULL, (size_t)page * 4, PROT_READ, MAP_SHARED, fd, 0);
  assert_true(m != MAP_FAILED);
  assert_int_equal(ckpt_store_hash_mapped_init(), 0);
  assert_true(ckpt__bus_guard_ready());
  size_t len = (size_t)page * 4;
  assert_int_equal(guarded_load(m, len, 0), 0); /* inside the file: read */
  assert_int_equal(m[0], d[0]);
  assert_int_equal(guarded_load(m, len, (size_t)page * 2), 1); /* past its end */
  /* the signal is not left blocked: the guard works again */
  assert_int_equal(guarded_load(m, len, (size_t)page * 3), 1);
  munmap((void *)m, (size_t)page * 4);
  free(d);
  close(fd);
}

/* A SIGBUS outside a guarded range is not swallowed: with no handler
 * before the guard's, the process dies of it (a child here). */
static void a_fault_outside_the_guard_still_kills(void **state) {
  (void)state;
  uint8_t *d;
  long page = sysconf(_SC_PAGESIZE);
  int fd = temp_file((size_t)page, &d);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    signal(SIGBUS, SIG_DFL); /* not cmocka's */
    if (ckpt_store_hash_mapped_init() != 0)
      _exit(3);
    const volatile uint8_t *m =
        mmap(NULL, (size_t)page * 4, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
      _exit(4);
    sigjmp_buf jb;
    if (sigsetjmp(jb, 1) == 0) { /* armed for another range */
      ckpt__bus_guard_arm(&jb, (const void *)(m + page * 8), (size_t)page);
      (void)m[page * 2];
      _exit(5);
    }
    _exit(6);
  }
  int ws;
  assert_int_equal(waitpid(pid, &ws, 0), pid);
  assert_true(WIFSIGNALED(ws));
  assert_int_equal(WTERMSIG(ws), SIGBUS);
  free(d);
  close(fd);
}

/* The file shrinks while it is hashed from its mapping (the hook runs
 * once a window is mapped): to a page boundary inside the window (the
 * load past the end faults: caught), or to inside the last page (the
 * bytes past the end read as zeros: the size checked after). Both
 * -ENODATA, as a read meeting the end; the file is still usable. */
static uint64_t shrink_at, shrink_to;
static void shrink_hook(int fd, uint64_t pos) {
  if (pos == shrink_at)
    assert_int_equal(ftruncate(fd, (off_t)shrink_to), 0);
}

static void a_file_shrinking_under_the_hash_is_nodata(void **state) {
  (void)state;
  size_t n = (9u << 20) + 4321;
  uint8_t *d, buf[4096];
  assert_int_equal(ckpt_store_hash_mapped_init(), 0);
  const uint64_t shrinks[][2] = {{4u << 20, (4u << 20) + 8192},  /* a fault */
                                 {8u << 20, (uint64_t)n - 100}}; /* zeros */
  for (size_t i = 0; i < 2; i++) {
    int fd = temp_file(n, &d);
    shrink_at = shrinks[i][0];
    shrink_to = shrinks[i][1];
    ckpt__hash_mapped_hook = shrink_hook;
    XXH3_state_t *st = XXH3_createState();
    XXH3_64bits_reset(st);
    assert_int_equal(ckpt__hash_fd(st, fd, 0, n, buf, sizeof(buf)), -ENODATA);
    ckpt__hash_mapped_hook = NULL;
    XXH3_64bits_reset(st); /* what is left hashes as it should */
    assert_int_equal(ckpt__hash_fd(st, fd, 0, shrink_to, buf, sizeof(buf)), 0);
    assert_true(XXH3_64bits_digest(st) == XXH3_64bits(d, shrink_to));
    XXH3_freeState(st);
    free(d);
    close(fd);
  }
}

/* A SIGBUS the guard does not take goes to the handler that was there
 * before it: a handler of the process's own (with or without SA_SIGINFO),
 * or the default action when that was SIG_DFL, whatever its flags. */
static void on_bus_exit7(int sig) {
  (void)sig;
  _exit(7);
}

static void other_faults_go_to_the_handler_before(void **state) {
  (void)state;
  uint8_t *d;
  long page = sysconf(_SC_PAGESIZE);
  int fd = temp_file((size_t)page, &d);
  for (int how = 0; how < 2; how++) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      struct sigaction sa = {.sa_flags = how ? SA_SIGINFO : 0};
      sa.sa_handler = how ? SIG_DFL : on_bus_exit7;
      sigemptyset(&sa.sa_mask);
      if (sigaction(SIGBUS, &sa, NULL) != 0 || ckpt_store_hash_mapped_init() != 0)
        _exit(3);
      const volatile uint8_t *m =
          mmap(NULL, (size_t)page * 4, PROT_READ, MAP_SHARED, fd, 0);
      if (m == MAP_FAILED)
        _exit(4);
      (void)m[page * 2]; /* past the end, no guard */
      _exit(5);
    }
    int ws;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    if (how == 0) {
      assert_true(WIFEXITED(ws));
      assert_int_equal(WEXITSTATUS(ws), 7);
    } else {
      assert_true(WIFSIGNALED(ws));
      assert_int_equal(WTERMSIG(ws), SIGBUS);
    }
  }
  free(d);
  close(fd);
}

/* known.c: a chunk remembered with its file's identity is known while the
 * file is unchanged, for that range and sum only; a write forgets it. */
static void known_chunks_follow_the_file(void **state) {
  (void)state;
  uint8_t *d;
  int fd = temp_file(8192, &d);
  struct stat st;
  assert_int_equal(fstat(fd, &st), 0);
  uint64_t sum = XXH3_64bits(d + 4096, 4096);
  assert_false(ckpt_store_known(fd, 4096, 4096, sum));
  ckpt_store_known_add(&st, 4096, 4096, sum);
  assert_true(ckpt_store_known(fd, 4096, 4096, sum));
  assert_false(ckpt_store_known(fd, 4096, 4096, sum ^ 1)); /* .metadata's */
  assert_false(ckpt_store_known(fd, 0, 4096, sum));
  assert_false(ckpt_store_known(fd, 4096, 4095, sum));
  usleep(25000); /* a coarse clock (100 Hz) still moves ctime */
  assert_int_equal(pwrite(fd, d, 1, 4096), 1); /* the same byte: mtime moves */
  assert_false(ckpt_store_known(fd, 4096, 4096, sum));
  assert_int_equal(fstat(fd, &st), 0);
  ckpt_store_known_add(&st, 4096, 4096, sum);
  assert_true(ckpt_store_known(fd, 4096, 4096, sum));
  ckpt_store_known_forget();
  assert_false(ckpt_store_known(fd, 4096, 4096, sum));
  free(d);
  close(fd);
}

/* This boot's ID, as known.c names its directory. */
static void boot_id(char boot[64]) {
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  assert_non_null(f);
  assert_non_null(fgets(boot, 64, f));
  fclose(f);
  boot[36] = '\0';
}

/* ckpt_store_known_share: what one process knows, another one sharing
 * the directory knows (here: this process, its own memory forgotten), for
 * that file version only; a record file planted by another user is not
 * read, and a directory others can write is refused. */
static void known_chunks_shared_through_a_private_dir(void **state) {
  (void)state;
  char top[] = "/tmp/ckpt-known-XXXXXX";
  assert_non_null(mkdtemp(top));
  char dir[64], *why = NULL;
  snprintf(dir, sizeof(dir), "%s/share", top);
  assert_int_equal(ckpt_store_known_share(dir, &why), 0);
  uint8_t *d;
  int fd = temp_file(8192, &d);
  struct stat st;
  assert_int_equal(fstat(fd, &st), 0);
  uint64_t sum = XXH3_64bits(d, 8192);
  ckpt_store_known_add(&st, 0, 8192, sum);
  ckpt_store_known_forget(); /* as another process */
  assert_true(ckpt_store_known(fd, 0, 8192, sum));
  ckpt_store_known_forget();
  assert_false(ckpt_store_known(fd, 0, 8192, sum ^ 1));
  assert_false(ckpt_store_known(fd, 0, 4096, sum));
  usleep(25000);
  assert_int_equal(pwrite(fd, d, 1, 0), 1); /* another version of the file */
  assert_false(ckpt_store_known(fd, 0, 8192, sum));
  /* a record file of another user's: not read */
  assert_int_equal(fstat(fd, &st), 0);
  ckpt_store_known_add(&st, 0, 8192, sum);
  ckpt_store_known_forget();
  assert_true(ckpt_store_known(fd, 0, 8192, sum)); /* read from the file */
  ckpt_store_known_forget();
  char boot[64], cmd[256];
  boot_id(boot);
  snprintf(cmd, sizeof(cmd), "chown -R 65534 %s/verified-%s/", dir, boot);
  if (geteuid() == 0 && system(cmd) == 0)
    assert_false(ckpt_store_known(fd, 0, 8192, sum));
  /* a shared directory others could write into: refused */
  ckpt_store_known_unshare();
  assert_int_equal(chmod(dir, 0777), 0);
  assert_int_equal(ckpt_store_known_share(dir, &why), -EPERM);
  assert_non_null(why);
  free(why);
  snprintf(cmd, sizeof(cmd), "rm -rf %s", top);
  assert_int_equal(system(cmd), 0);
  free(d);
  close(fd);
}

/* The shared record file of the file st describes (known.c's naming). */
static void record_path(const char *dir, const struct stat *st, char *buf,
                        size_t cap) {
  char boot[64];
  boot_id(boot);
  snprintf(buf, cap,
           "%s/verified-%s/%" PRIx64 "-%" PRIx64 "-%" PRIx64 "-%" PRId64
           ".%09ld-%" PRId64 ".%09ld",
           dir, boot, (uint64_t)st->st_dev, (uint64_t)st->st_ino,
           (uint64_t)st->st_size, (int64_t)st->st_mtim.tv_sec,
           st->st_mtim.tv_nsec, (int64_t)st->st_ctim.tv_sec,
           st->st_ctim.tv_nsec);
}

/* Shared records that cannot be trusted or read are not: a record after
 * a short append (shifted), a FIFO in a record's place (no wait), a
 * directory the daemon's group may write (refused); a verified read of a
 * file changed in the last 2 s records nothing, of an older one it does. */
static void shared_records_that_cannot_be_trusted(void **state) {
  (void)state;
  char top[] = "/tmp/ckpt-known-XXXXXX";
  assert_non_null(mkdtemp(top));
  char dir[64], path[256], *why = NULL;
  snprintf(dir, sizeof(dir), "%s/share", top);
  assert_int_equal(ckpt_store_known_share(dir, &why), 0);
  uint8_t *d;
  int fd = temp_file(8192, &d);
  struct stat st;
  assert_int_equal(fstat(fd, &st), 0);
  uint64_t sum = XXH3_64bits(d, 8192);
  record_path(dir, &st, path, sizeof(path));
  int rf = open(path, O_WRONLY | O_CREAT | O_APPEND, 0600);
  assert_true(rf >= 0);
  assert_int_equal(write(rf, "torn", 4), 4); /* a short append */
  close(rf);
  ckpt_store_known_add(&st, 0, 8192, sum);  /* shifted by 4 bytes */
  ckpt_store_known_forget();
  assert_false(ckpt_store_known(fd, 0, 8192, sum));
  /* a FIFO where the record file would be: no thread waits on it */
  usleep(25000);
  assert_int_equal(pwrite(fd, d, 1, 0), 1);
  assert_int_equal(fstat(fd, &st), 0);
  record_path(dir, &st, path, sizeof(path));
  assert_int_equal(mkfifo(path, 0600), 0);
  ckpt_store_known_add(&st, 0, 8192, sum);
  ckpt_store_known_forget();
  assert_false(ckpt_store_known(fd, 0, 8192, sum));
  /* the racy rule: a file changed just now is not recorded by a read */
  usleep(25000);
  assert_int_equal(pwrite(fd, d, 1, 0), 1);
  assert_int_equal(fstat(fd, &st), 0);
  ckpt_store_known_hashed(&st, 0, 8192, sum);
  assert_false(ckpt_store_known(fd, 0, 8192, sum));
  sleep(2);
  usleep(200000);
  ckpt_store_known_hashed(&st, 0, 8192, sum);
  ckpt_store_known_forget();
  assert_true(ckpt_store_known(fd, 0, 8192, sum)); /* from the file */
  /* a directory the group may write: refused */
  ckpt_store_known_unshare();
  assert_int_equal(chmod(dir, 0770), 0);
  assert_int_equal(ckpt_store_known_share(dir, &why), -EPERM);
  assert_non_null(strstr(why, "chmod 0700"));
  free(why);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", top);
  assert_int_equal(system(cmd), 0);
  free(d);
  close(fd);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(ranges_match_one_shot_hash),
      cmocka_unit_test(a_range_past_the_end_is_nodata),
      cmocka_unit_test(a_flipped_bit_changes_the_sum),
      cmocka_unit_test(a_bad_fd_is_an_error),
      cmocka_unit_test(a_stopped_check_gives_up),
      cmocka_unit_test(hash_fd_continues_a_libxxhash_state),
      cmocka_unit_test(hash_fd_mapped_and_read_agree),
      cmocka_unit_test(a_fault_in_a_guarded_range_jumps_back),
      cmocka_unit_test(a_fault_outside_the_guard_still_kills),
      cmocka_unit_test(a_file_shrinking_under_the_hash_is_nodata),
      cmocka_unit_test(other_faults_go_to_the_handler_before),
      cmocka_unit_test(known_chunks_follow_the_file),
      cmocka_unit_test(known_chunks_shared_through_a_private_dir),
      cmocka_unit_test(shared_records_that_cannot_be_trusted),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
