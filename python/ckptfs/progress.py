"""ckptfs.progress - a load's progress: a callable(done_bytes,
total_bytes) or a tqdm bar, told as items are read (ckptfs.load and
ckptfs.dcp's Reader)."""

import threading

from .errors import CkptfsError


def check_progress(progress):
    """Refuse a progress argument a load cannot use, before anything is
    read; the tqdm class for True or "tqdm", else None."""
    if progress is None or progress is False or callable(progress):
        return None
    if progress is True or progress == "tqdm":
        try:
            from tqdm.auto import tqdm
        except ImportError:
            raise CkptfsError(f"progress={progress!r} shows a tqdm bar, but the "
                              "tqdm package is not installed (pip install tqdm); "
                              "or pass progress=callable(done_bytes, total_bytes)"
                              ) from None
        return tqdm
    raise ValueError(f"progress={progress!r}: pass a callable(done_bytes, "
                     "total_bytes), True or 'tqdm' (a tqdm bar), or None")


class Progress:
    """A load's progress: progress(done_bytes, total_bytes) is called with
    (0, total) first, then each time an item has been read (done grows;
    it ends at total). progress: None or False (none), a callable, or True
    or "tqdm" (a tqdm bar). A context manager (the bar closes at its end);
    add() may be called from several threads."""

    def __init__(self, progress, total, what):
        self.total, self.done, self._bar = total, 0, None
        self._lock = threading.Lock()
        tqdm = check_progress(progress)
        if tqdm is not None:
            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=what)
            self._fn = lambda done, total: self._bar.update(done - self._bar.n)
        else:
            self._fn = progress or None
        if self._fn is not None:
            self._fn(0, total)

    @property
    def active(self):
        return self._fn is not None

    def add(self, nbytes):
        if self._fn is None or nbytes <= 0:
            return
        with self._lock:  # one call at a time, done in order
            self.done += nbytes
            self._fn(self.done, self.total)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()


