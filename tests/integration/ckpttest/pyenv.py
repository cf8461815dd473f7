"""The Python interpreter the torch/numpy parts of the integration tests
run with, and how they run code in it.

scripts/install-deps.sh makes the virtual environment .venv (torch 2.13.0,
numpy, safetensors, transformers, accelerate, lightning; the ckptfs package
from python/ installed editable).
torch_python() tries $CKPT_PYTHON, .venv/bin/python, then
sys.executable. Without one that has torch and numpy, the test fails,
unless the environment sets CKPT_ALLOW_NO_TORCH=1: then it is skipped.
Code run by run_py finds the package (python/) and examples/python on
sys.path, so the tests use this checkout's sources; import_client()
imports that package into the test's own process.
"""

import os
import subprocess
import sys
import unittest

from . import REPO

EXAMPLES = os.path.join(REPO, "examples", "python")
PACKAGE = os.path.join(REPO, "python")
VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
CANDIDATES = tuple(p for p in (os.environ.get("CKPT_PYTHON"), VENV_PYTHON,
                               sys.executable) if p)
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
           "run scripts/install-deps.sh (it makes .venv with torch 2.13.0)")
    if os.environ.get("CKPT_ALLOW_NO_TORCH") == "1":
        raise unittest.SkipTest(why + " (skipped: CKPT_ALLOW_NO_TORCH=1)")
    test.fail(why + "; set CKPT_ALLOW_NO_TORCH=1 to skip instead")


def require_modules(test, *modules):
    """The torch interpreter for test, which must import modules too (the
    writers test_writers.py saves with); fail (or skip, with
    CKPT_ALLOW_NO_TORCH=1) when it does not."""
    py = require_torch(test)
    r = subprocess.run([py, "-c", "import " + ", ".join(modules)], capture_output=True,
                       text=True)
    if r.returncode == 0:
        return py
    why = (f"{py} cannot import {', '.join(modules)} ({r.stderr.strip().splitlines()[-1]}): "
           "run scripts/install-deps.sh (it installs the pinned transformers, accelerate "
           "and lightning into .venv)")
    if os.environ.get("CKPT_ALLOW_NO_TORCH") == "1":
        raise unittest.SkipTest(why + " (skipped: CKPT_ALLOW_NO_TORCH=1)")
    test.fail(why + "; set CKPT_ALLOW_NO_TORCH=1 to skip instead")


def import_client():
    """This checkout's ckptfs package (python/), imported into this
    process (the system python3 has no ckptfs installed); returns it."""
    if PACKAGE not in sys.path:
        sys.path.insert(0, PACKAGE)
    import ckptfs
    return ckptfs


def run_py(test, py, code, *args, timeout=600, env=None):
    """Run code in interpreter py with examples/python on sys.path; fail
    test with its output unless it exits 0; return its stdout."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([PACKAGE, EXAMPLES, e.get("PYTHONPATH", "")])
    e.setdefault("OMP_NUM_THREADS", "1")
    if env:
        e.update(env)
    r = subprocess.run([py, "-c", code] + [str(a) for a in args], capture_output=True,
                       text=True, timeout=timeout, env=e)
    if r.returncode != 0:
        test.fail(f"{py} exited with {r.returncode}\n--- stdout\n{r.stdout[-6000:]}"
                  f"\n--- stderr\n{r.stderr[-6000:]}")
    return r.stdout
