/*
 * bus_guard.c - hashing a file from a mapping of it survives the file
 * shrinking meanwhile. A load of a mapped page past the file's end raises
 * SIGBUS; inside a range a thread guards (ckpt__bus_guard_arm), the
 * handler jumps back to that thread's sigsetjmp, and the hash ends with
 * -ENODATA, as a read that met the end would. Any other SIGBUS goes to
 * the handler that was there before (a test framework's, a sanitizer's),
 * or takes the default action.
 */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <errno.h>

#include "store.h"
#include "store_int.h"

/* This thread's guarded range and where its faults jump to (initial-exec
 * TLS of the executable: safe to read in a signal handler). */
static _Thread_local sigjmp_buf *guard_jmp;
static _Thread_local const char *guard_lo, *guard_hi;

_Atomic bool ckpt__hash_reads_only;

static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction before; /* SIGBUS's action when ours was set */

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  const char *a = si->si_addr;
  if (guard_jmp && a >= guard_lo && a < guard_hi) {
    sigjmp_buf *jb = guard_jmp;
    guard_jmp = NULL;
    siglongjmp(*jb, 1);
  }
  if (before.sa_flags & SA_SIGINFO) {
    before.sa_sigaction(sig, si, uc);
    return;
  }
  if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
    before.sa_handler(sig);
    return;
  }
  /* the default action: a fault re-raises it on return, a kill(2) with
   * SIGBUS is raised again here (pending until this handler returns) */
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

int ckpt__bus_guard_init(void) {
  struct sigaction cur;
  if (sigaction(SIGBUS, NULL, &cur) != 0)
    return -errno;
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)
    return 0;
  /* not ours (never set, or replaced since: a test framework restores
   * its own after each test) */
  pthread_mutex_lock(&install_lock);
  int rc = 0;
  struct sigaction ours = {.sa_sigaction = on_sigbus,
                           .sa_flags = SA_SIGINFO};
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGBUS, NULL, &cur) != 0)
    rc = -errno;
  else if (!((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)) {
    before = cur;
    if (sigaction(SIGBUS, &ours, NULL) != 0)
      rc = -errno;
  }
  pthread_mutex_unlock(&install_lock);
  return rc;
}

void ckpt__bus_guard_arm(sigjmp_buf *jb, const void *lo, size_t len) {
  guard_lo = lo;
  guard_hi = (const char *)lo + len;
  guard_jmp = jb;
}

void ckpt__bus_guard_disarm(void) { guard_jmp = NULL; }
