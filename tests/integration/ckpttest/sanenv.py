"""The sanitizers' environment of every process a test starts from this
build: a daemon (util.Mount, or a test's own subprocess of ckptfs), an
mpirun world (world.World), the mount scripts (ckpt-mount runs mpirun) and
the worlds across simulated nodes (networld). One builder, env(), so that
every build's reports reach the test the same way:

  - UBSan (the ASan+UBSan build): print_stacktrace=1.
  - ThreadSanitizer (build-tsan): every race is reported and the daemon
    goes on (halt_on_error=0), then exits 66 instead of 0, so that the
    test sees both; the suppressions (tsan.supp) only match reports inside
    the uninstrumented Open MPI, libfuse and SQLite.
  - mpi=True, for processes that are Open MPI's ranks (and mpirun): in the
    ASan build, Open MPI's own allocations that it never frees are
    reported by LeakSanitizer at exit. With leak_check (the default; env
    CKPT_MR_LEAK_CHECK=0 turns it off) leaks stay checked, with the
    suppressions of lsan-openmpi.supp, which only match allocations made
    inside Open MPI and its support libraries, and full stack unwinding
    (Open MPI has no frame pointers). Without it, ASAN_OPTIONS gets
    detect_leaks=0 for these processes only. Every other ASan and UBSan
    report is still there. LSAN_OPTIONS is always set (mpirun -x VAR
    passes every variable of VARS).
  - log_path: ASan's and UBSan's reports go to files LOG_PATH.PID (a
    daemonized mount's stderr is /dev/null); the test reads them.

The caller's settings win: an option the environment (or extra) already
sets is kept and only the missing ones are added; detect_leaks=0 and
log_path= replace the caller's.
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
TSAN_SUPP = os.path.join(HERE, "tsan.supp")
LSAN_SUPP = os.path.join(HERE, "lsan-openmpi.supp")
TSAN_DEFAULTS = ("suppressions=" + TSAN_SUPP, "halt_on_error=0", "exitcode=66",
                 "second_deadlock_stack=1")
# what env(mpi=True) always sets: mpirun passes them to every rank (-x)
VARS = ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS", "TSAN_OPTIONS")


def add_options(value, opts, replace=False):
    """A sanitizer's colon-separated options value, with each of opts whose
    key it does not set yet appended (the value's settings win); with
    replace, each of opts replaces the value's setting of its key."""
    parts = [p for p in value.split(":") if p]
    for opt in opts:
        key = opt.split("=", 1)[0]
        if replace:
            parts = [p for p in parts if p.split("=", 1)[0] != key]
        if not any(p.split("=", 1)[0] == key for p in parts):
            parts.append(opt)
    return ":".join(parts)


def leak_check_default():
    """Leaks of mpirun worlds checked (CKPT_MR_LEAK_CHECK=0: not)."""
    return os.environ.get("CKPT_MR_LEAK_CHECK", "1") != "0"


def env(extra=None, *, mpi=False, leak_check=None, log_path=None):
    """os.environ, with extra, and the sanitizers' options (see the
    module's doc) for a daemon (mpi: Open MPI's ranks, and mpirun)."""
    e = dict(os.environ)
    if extra:
        e.update(extra)

    def add(var, *opts, replace=False):
        e[var] = add_options(e.get(var, ""), opts, replace)

    add("UBSAN_OPTIONS", "print_stacktrace=1")
    add("TSAN_OPTIONS", *TSAN_DEFAULTS)
    if mpi:
        if leak_check is None:
            leak_check = leak_check_default()
        if leak_check and os.path.exists(LSAN_SUPP):
            add("ASAN_OPTIONS", "fast_unwind_on_malloc=0")
            add("LSAN_OPTIONS", "suppressions=" + LSAN_SUPP)
        else:
            add("ASAN_OPTIONS", "detect_leaks=0", replace=True)
        e.setdefault("LSAN_OPTIONS", "")
    if log_path:
        add("ASAN_OPTIONS", "log_path=" + log_path, replace=True)
        add("UBSAN_OPTIONS", "log_path=" + log_path, replace=True)
    return e
