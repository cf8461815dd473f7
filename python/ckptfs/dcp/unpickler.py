"""ckptfs.dcp.unpickler - a stock DCP .metadata unpickled admitting only
the globals DCP puts there (MetadataUnpickler): import-dcp runs as root on
directories other users write, and pickle.load of such a file would run
any code it names."""

import collections
import enum
import functools
import pathlib
import pickle

import torch

from ..errors import CkptfsError

# The classes of torch.distributed.checkpoint.metadata a .metadata holds.
_DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                         "StorageMeta", "_MEM_FORMAT_ENCODING")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d",
                   "preserve_format")
_admitted = {}


def _layout_by_name(name):
    """torch.serialization._get_layout for the unpickler: a torch.layout by
    its str(), nothing else."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise pickle.UnpicklingError(f"{name!r} is not a torch.layout")


def _admitted_globals():
    """{(module, name): object}: everything MetadataUnpickler resolves.
    Nothing is imported or looked up by the pickle's names."""
    if _admitted:
        return _admitted
    from torch.distributed.checkpoint import filesystem, metadata
    g = {}
    for n in _DCP_METADATA_CLASSES:
        if hasattr(metadata, n):
            g[("torch.distributed.checkpoint.metadata", n)] = getattr(metadata, n)
    g[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    g[("torch", "Size")] = torch.Size
    for n, v in vars(torch).items():
        if isinstance(v, (torch.dtype, torch.layout)):
            g[("torch", n)] = v
    # A memory_format pickles as the global "torch.NAME" of whichever
    # loaded module pickle found holding `torch` (torch._utils in 2.13).
    for n in _MEMORY_FORMATS:
        g[("torch", n)] = getattr(torch, n)
        for mod in ("torch._utils", "torch.serialization", "torch.distributed.checkpoint.metadata"):
            g[(mod, f"torch.{n}")] = getattr(torch, n)
    g[("torch.serialization", "_get_layout")] = _layout_by_name
    g[("collections", "OrderedDict")] = collections.OrderedDict
    for mod in ("pathlib", "pathlib._local"):  # checkpoint_id as a Path (3.13: _local)
        g[(mod, "PosixPath")] = pathlib.PosixPath
        g[(mod, "PurePosixPath")] = pathlib.PurePosixPath
    g[("builtins", "set")] = set
    g[("builtins", "frozenset")] = frozenset
    # Some Python 3.11 releases (Debian 12's 3.11.2; not 3.11.7) pickle an enum member as
    # getattr(ENUM_CLASS, "NAME"): a lookup of members of admitted enums only
    enums = {v for v in g.values() if isinstance(v, type) and issubclass(v, enum.Enum)}
    g[("builtins", "getattr")] = functools.partial(_enum_member, frozenset(enums))
    _admitted.update(g)
    return _admitted


def _enum_member(enums, cls, name):
    """getattr(cls, name) as an enum's pickle asks for it: cls one of the
    admitted enums, name one of its members' names; else refused."""
    if cls not in enums or not isinstance(name, str) or name not in cls.__members__:
        raise CkptfsError(f"refused getattr({cls!r}, {name!r}) in a DCP .metadata: only "
                          "a member of an admitted enum is looked up; nothing of it was run")
    return cls.__members__[name]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata admitting only the globals DCP puts there
    (torch 2.13's dcp.save, checked with pickletools):

    - torch.distributed.checkpoint.metadata: Metadata, TensorStorageMetadata,
      BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
      MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING (TensorProperties'
      memory format);
    - torch.distributed.checkpoint.filesystem._StorageInfo;
    - torch.Size; torch's dtypes and layouts (torch.float32, torch.strided,
      ...); torch.serialization._get_layout (as a lookup of torch's layouts
      by name only); the memory formats (torch.contiguous_format,
      channels_last, channels_last_3d, preserve_format) as older torch
      pickled them;
    - collections.OrderedDict; pathlib.PosixPath and PurePosixPath (a
      checkpoint_id given as a Path);
    - builtins set and frozenset (dicts, lists, tuples, strings, numbers,
      bytes, True/False/None are pickle opcodes, not globals);
    - builtins.getattr only as a stand-in that looks up a member of an
      admitted enum by name (how Debian 12's Python 3.11.2 pickles enums).

    Any other global, and any persistent id, raises CkptfsError naming it
    before anything is called."""

    def __init__(self, file, where):
        super().__init__(file)
        self.where = where

    def find_class(self, module, name):
        try:
            return _admitted_globals()[(module, name)]
        except KeyError:
            raise CkptfsError(
                f"{self.where}: refused global {module}.{name}: a DCP .metadata may "
                "hold only DCP's metadata classes, torch.Size, torch dtypes, layouts "
                "and memory formats, OrderedDict, PosixPath, set and frozenset "
                "(docs/pytorch.md); nothing of it was run") from None

    def persistent_load(self, pid):
        raise CkptfsError(f"{self.where}: refused persistent id {pid!r}: a DCP "
                          ".metadata has none")

