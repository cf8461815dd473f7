"""ckptfs.dtypes - tensors as ckptfs stores them: the dtype tables
(ckptfs dtype -> itemsize, numpy name, torch dtype), torch and numpy told
apart without importing them (the core needs only the standard library),
byte views of their memory, Shard (a block of a larger tensor), and the
shape text of the xattrs and .metadata."""

import sys

from .errors import CkptfsError

# ckptfs dtype -> itemsize
DTYPES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# ckptfs dtype -> numpy dtype name (little-endian); bfloat16 and float8 have none
NUMPY_NAMES = {
    "bool": "bool", "uint8": "u1", "int8": "i1", "int16": "<i2",
    "int32": "<i4", "int64": "<i8", "float16": "<f2", "float32": "<f4",
    "float64": "<f8", "complex64": "<c8", "complex128": "<c16",
}


_TORCH_DTYPES = {}  # ckptfs dtype -> torch dtype, once torch_dtypes() built it


def torch_dtypes():
    """{ckptfs dtype: torch dtype} of the dtypes this torch has (the float8
    ones only where it has them); torch must be imported."""
    if not _TORCH_DTYPES:
        torch = sys.modules["torch"]
        _TORCH_DTYPES.update((n, getattr(torch, n)) for n in DTYPES if hasattr(torch, n))
    return _TORCH_DTYPES


def ckpt_dtype(dt):
    """The ckptfs dtype of torch dtype dt, or None when ckptfs has none."""
    for name, t in torch_dtypes().items():
        if t == dt:
            return name
    return None


def parse_dims(text):
    """A shape or offsets as the xattrs and .metadata give them ("4,8",
    "[4, 8]", bytes or str; "" or "[]" or None: no dimensions) as a tuple."""
    if isinstance(text, bytes):
        text = text.decode()
    s = (text or "").strip().strip("[]")
    return tuple(int(v) for v in s.replace(" ", "").split(",") if v != "")


def check_little_endian(who):
    """Tensors move as raw host bytes, and ckptfs stores little-endian."""
    if sys.byteorder != "little":
        raise CkptfsError(f"{who} moves tensors as raw host bytes, and this host is "
                          "big-endian; ckptfs stores little-endian")


class Shard:
    """A local shard of a larger tensor: `tensor` (torch tensor or numpy
    array) holds the block of the global tensor that starts at `offsets`;
    `global_shape` is the whole tensor's shape. Saved as one chunk; given to
    load(), only its byte ranges are read (resharding)."""

    __slots__ = ("tensor", "offsets", "global_shape")

    def __init__(self, tensor, offsets, global_shape):
        self.tensor = tensor
        self.offsets = tuple(int(o) for o in offsets)
        self.global_shape = tuple(int(s) for s in global_shape)
        shape = tuple(tensor.shape)
        if not (len(self.offsets) == len(self.global_shape) == len(shape)):
            raise ValueError(f"Shard: offsets {self.offsets}, global shape "
                             f"{self.global_shape} and the local shape {shape} "
                             "must have the same number of dimensions")
        for o, s, g in zip(self.offsets, shape, self.global_shape):
            if o < 0 or o + s > g:
                raise ValueError(f"Shard: the block at offsets {self.offsets} "
                                 f"of shape {shape} is outside the global "
                                 f"shape {self.global_shape}")

    def __repr__(self):
        return (f"Shard(shape={tuple(self.tensor.shape)}, offsets={self.offsets}, "
                f"global_shape={self.global_shape})")


def is_torch(x):
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, (np.ndarray, np.generic))


def is_tensor(x):
    return isinstance(x, Shard) or is_torch(x) or is_numpy(x)


def torch_dtype_name(dt):
    name = ckpt_dtype(dt)
    if name is None:
        raise CkptfsError(f"torch dtype {dt} has no ckptfs dtype (ckptfs has: "
                          f"{', '.join(DTYPES)}); convert the tensor first")
    return name


def numpy_dtype_name(dt):
    np = sys.modules["numpy"]
    for name, npname in NUMPY_NAMES.items():
        if np.dtype(npname) == dt.newbyteorder("<") or np.dtype(npname) == dt:
            return name
    raise CkptfsError(f"numpy dtype {dt} has no ckptfs dtype (ckptfs has: "
                      f"{', '.join(NUMPY_NAMES)}); convert the array first, "
                      "or save it as bytes")


def torch_module():
    try:
        import torch
    except ImportError as e:
        raise CkptfsError("this item was saved as a torch tensor (or has a dtype "
                          "only torch has), but torch cannot be imported: "
                          f"{e}") from e
    return torch


def numpy_module():
    try:
        import numpy
    except ImportError as e:
        raise CkptfsError(f"loading tensors needs numpy or torch: {e}") from e
    return numpy


def torch_numpy_view(t):
    """A numpy array sharing t's memory (t on the CPU, contiguous); dtypes
    numpy lacks are viewed as integers of their size. The bytes are the
    host's: ckptfs stores little-endian, hence the check."""
    check_little_endian("ckptfs")
    torch = sys.modules["torch"]
    t = t.detach()
    name = torch_dtype_name(t.dtype)
    if name in NUMPY_NAMES:
        return t.numpy()
    carrier = {1: torch.uint8, 2: torch.int16}[DTYPES[name]]
    return t.view(carrier).numpy()


def tensor_info(x):
    """(ckptfs dtype, shape, byte buffer of the elements in row-major
    little-endian order, kind) of a torch tensor or numpy array."""
    if is_torch(x):
        name = torch_dtype_name(x.dtype)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        arr = torch_numpy_view(t)
        return name, tuple(x.shape), memoryview(arr.reshape(-1)).cast("B"), "torch"
    np = sys.modules["numpy"]
    arr = np.asarray(x)
    name = numpy_dtype_name(arr.dtype)
    shape = tuple(arr.shape)   # ascontiguousarray makes a 0-d array 1-d
    arr = np.ascontiguousarray(arr, dtype=np.dtype(NUMPY_NAMES[name]))
    return name, shape, memoryview(arr.reshape(-1)).cast("B"), "numpy"


def torch_u8(t):
    """A writable uint8 memoryview of contiguous CPU tensor t's bytes
    (little-endian: ckptfs stores little-endian, and moves host bytes)."""
    check_little_endian("ckptfs.dcp")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(sys.modules["torch"].uint8).numpy()).cast("B")
