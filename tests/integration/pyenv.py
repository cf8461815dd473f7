"""The Python interpreter the torch/numpy parts of the integration tests
run with, and how they run code in it.

ctest runs the tests with CMake's Python3_EXECUTABLE, which may lack torch
and numpy (a pyenv Python); Debian's python3-torch and python3-numpy are
installed for /usr/bin/python3. torch_python() tries sys.executable, then
/usr/bin/python3. Without one that has both, the test fails, unless the
environment sets CKPT_ALLOW_NO_TORCH=1: then it is skipped.
"""

import os
import subprocess
import sys
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples", "python")
CANDIDATES = (sys.executable, "/usr/bin/python3")
_found = {}


def torch_python():
    """Path of an interpreter that imports torch and numpy, or None."""
    if "py" not in _found:
        _found["py"] = None
        for py in CANDIDATES:
            if py and os.access(py, os.X_OK) and subprocess.run(
                    [py, "-c", "import torch, numpy"], capture_output=True).returncode == 0:
                _found["py"] = py
                break
    return _found["py"]


def require_torch(test):
    """The torch interpreter for test; fail (or skip, with
    CKPT_ALLOW_NO_TORCH=1) when there is none."""
    py = torch_python()
    if py:
        return py
    why = (f"no Python with torch and numpy (tried {', '.join(CANDIDATES)}): "
           "apt-get install --no-install-recommends python3-torch python3-numpy")
    if os.environ.get("CKPT_ALLOW_NO_TORCH") == "1":
        raise unittest.SkipTest(why + " (skipped: CKPT_ALLOW_NO_TORCH=1)")
    test.fail(why + "; set CKPT_ALLOW_NO_TORCH=1 to skip instead")


def run_py(test, py, code, *args, timeout=600, env=None):
    """Run code in interpreter py with examples/python on sys.path; fail
    test with its output unless it exits 0; return its stdout."""
    e = dict(os.environ)
    e["PYTHONPATH"] = EXAMPLES + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    if env:
        e.update(env)
    r = subprocess.run([py, "-c", code] + [str(a) for a in args], capture_output=True,
                       text=True, timeout=timeout, env=e)
    if r.returncode != 0:
        test.fail(f"{py} exited with {r.returncode}\n--- stdout\n{r.stdout[-6000:]}"
                  f"\n--- stderr\n{r.stderr[-6000:]}")
    return r.stdout
