/*
 * bus_guard.c - hashing a file from a mapping of it survives the file
 * shrinking meanwhile. A load of a mapped page past the file's end raises
 * SIGBUS; inside a range a thread guards (ckpt__bus_guard_arm), the
 * handler jumps back to that thread's sigsetjmp, and the hash ends (the
 * caller tells a shrunk file, -ENODATA, from an I/O error, -EIO). Any
 * other SIGBUS goes to the handler that was there before (a test
 * framework's, a sanitizer's), or takes the default action.
 *
 * The handler is installed once (ckpt_store_hash_mapped_init, at the
 * daemon's start). Where something replaced it since, the hashes read
 * instead (ckpt__bus_guard_ready): taking the signal back could make two
 * handlers that chain to each other call each other without end.
 */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>

#include "store.h"
#include "store_int.h"

/* This thread's guarded range and where its faults jump to (initial-exec
 * TLS of the executable: safe to read in a signal handler). */
static _Thread_local sigjmp_buf *guard_jmp;
static _Thread_local const char *guard_lo, *guard_hi;

_Atomic bool ckpt__hash_reads_only;
void (*ckpt__hash_mapped_hook)(int fd, uint64_t pos);
_Atomic uint64_t ckpt__hash_mapped_bytes;

static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
/* SIGBUS's action when ours was set: written once, under install_lock,
 * before ours is installed; read only by the handler after. */
static struct sigaction before;

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  const char *a = si->si_addr;
  /* a fault of this thread's guarded mapping (si_code > 0: raised by the
   * kernel, not sent by kill(2) or sigqueue(3)) */
  if (si->si_code > 0 && guard_jmp && a >= guard_lo && a < guard_hi) {
    sigjmp_buf *jb = guard_jmp;
    guard_jmp = NULL;
    siglongjmp(*jb, 1);
  }
  if (before.sa_handler == SIG_IGN && si->si_code <= 0)
    return; /* sent, and ignored before ours: still ignored */
  if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
    if (before.sa_flags & SA_SIGINFO)
      before.sa_sigaction(sig, si, uc);
    else
      before.sa_handler(sig);
    return;
  }
  /* The default action (a fault cannot be ignored: it would come back at
   * once): a fault re-raises it on return, a sent one is raised again
   * here (pending until this handler returns). */
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

static bool ours(const struct sigaction *sa) {
  return (sa->sa_flags & SA_SIGINFO) && sa->sa_sigaction == on_sigbus;
}

int ckpt_store_hash_mapped_init(void) {
  pthread_mutex_lock(&install_lock);
  int rc = 0;
  struct sigaction cur, mine = {.sa_sigaction = on_sigbus,
                                .sa_flags = SA_SIGINFO};
  sigemptyset(&mine.sa_mask);
  if (sigaction(SIGBUS, NULL, &cur) != 0)
    rc = -errno;
  else if (!ours(&cur)) {
    before = cur;
    if (sigaction(SIGBUS, &mine, NULL) != 0)
      rc = -errno;
  }
  pthread_mutex_unlock(&install_lock);
  return rc;
}

bool ckpt__bus_guard_ready(void) {
  struct sigaction cur;
  return sigaction(SIGBUS, NULL, &cur) == 0 && ours(&cur);
}

void ckpt__bus_guard_arm(sigjmp_buf *jb, const void *lo, size_t len) {
  guard_lo = lo;
  guard_hi = (const char *)lo + len;
  atomic_signal_fence(memory_order_seq_cst); /* the range before the jump */
  guard_jmp = jb;
  atomic_signal_fence(memory_order_seq_cst);
}

void ckpt__bus_guard_disarm(void) {
  atomic_signal_fence(memory_order_seq_cst);
  guard_jmp = NULL;
  atomic_signal_fence(memory_order_seq_cst);
}
