"""ckptfs.snapshot - the copy async_save makes before it returns: tensors
into private CPU memory (StagingBuffers: kept from one save to the next),
other values encoded now (pickle or JSON), so that later changes to the
state dict do not reach the checkpoint."""

import json
import pickle
import threading

from .dtypes import Shard, is_tensor, is_torch, numpy_module, torch_module
from .errors import CkptfsError
from .keys import dtensor_as_shard


class Encoded:
    """A bytes item already encoded (by async_save's snapshot)."""
    __slots__ = ("data", "kind")

    def __init__(self, data, kind):
        self.data, self.kind = data, kind


def encode_object(v, objects):
    if isinstance(v, Encoded):
        return v.data, v.kind
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v) if isinstance(v, memoryview) else v, "bytes"
    if objects == "json":
        try:
            return json.dumps(v, allow_nan=True).encode(), "json"
        except (TypeError, ValueError) as e:
            raise CkptfsError(f"cannot store {type(v).__name__} as JSON ({e}); use "
                              "objects='pickle' or bytes") from e
    return pickle.dumps(v, protocol=4), "pickle"


class StagingBuffers:
    """Host memory for async_save's copies, kept from one save to the next.

    Pass the same object to every async_save of a training run:
    async_save(sd, mount, name, buffers=bufs). A save copies each tensor
    into the buffer its key had in an earlier save (same shape and dtype)
    instead of fresh memory, so the caller's stall is a plain copy with no
    page faults; the buffers come back when the save's future is done. A
    key whose buffer is still in use by a save in flight, or whose shape or
    dtype changed, gets fresh memory (which is kept in its place after).
    It holds at most one buffer per key: about one state dict of host
    memory while idle; clear() gives it back."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free = {}

    def _take(self, key, t):
        with self._lock:
            b = self._free.pop(key, None)
        if (b is not None and type(b) is type(t) and b.shape == t.shape
                and b.dtype == t.dtype):
            return b
        return None

    def _give(self, used):
        with self._lock:
            self._free.update(used)

    def clear(self):
        """Drop the kept buffers (their memory is freed when unreferenced).
        A save in flight still gives its buffers back when it ends."""
        with self._lock:
            self._free.clear()

    def __len__(self):
        with self._lock:
            return len(self._free)


def snapshot_tensor(t, key=None, buffers=None, used=None):
    """A private contiguous CPU copy of tensor (or array) t: one copy, into
    buffers' earlier buffer for key when it fits."""
    if is_torch(t):
        t = t.detach()
        out = buffers._take(key, t) if buffers is not None else None
        if out is None:   # (kept buffers are this function's CPU copies)
            out = torch_module().empty(t.shape, dtype=t.dtype, device="cpu")
        out.copy_(t)
    else:
        np = numpy_module()
        out = buffers._take(key, t) if buffers is not None else None
        if out is None:
            out = np.array(t, copy=True, order="C")
        else:
            np.copyto(out, t)
    if used is not None:
        used[key] = out
    return out


def snapshot(obj, objects, buffers=None, used=None, prefix=()):
    """A copy of state dict obj that later changes to obj do not reach:
    tensors (a DTensor as the Shard of its local part) copied into private
    CPU memory (buffers' kept memory when given; each buffer used is put
    in used under its key path), other values encoded now (pickle or
    JSON), dicts rebuilt."""
    out = {}
    for k, v in obj.items():
        key = prefix + (k,)
        if isinstance(v, dict) and v:
            out[k] = snapshot(v, objects, buffers, used, key)
            continue
        v = dtensor_as_shard(v)
        if isinstance(v, Shard):
            out[k] = Shard(snapshot_tensor(v.tensor, key, buffers, used), v.offsets,
                           v.global_shape)
        elif is_tensor(v):
            out[k] = snapshot_tensor(v, key, buffers, used)
        elif isinstance(v, (bytearray, memoryview)):
            out[k] = Encoded(bytes(v), "bytes")   # a copy: they may change
        else:
            out[k] = Encoded(*encode_object(v, objects))
    return out


def give_back(buffers, used):
    """Return the buffers a save used (snapshot's used) to buffers, once
    nothing writes from them any more."""
    if buffers is not None:
        buffers._give(used)
