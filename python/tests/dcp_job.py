"""One rank of a DCP job over ckptfs rank mounts, started by test_dcp.py
under mpirun (gloo on 127.0.0.1:$MASTER_PORT):

    dcp_job.py SCENARIO MOUNT NAME [ARGS]

Every tensor's content follows from its name (make()), so a loader at any
world size knows what it must read, bit for bit. Each rank writes its
result to $CKPT_RESULT_DIR/rankR.json on success; any mismatch raises
(non-zero exit).
"""

import hashlib
import json
import os
import sys
import traceback
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptfs
import ckptfs.dcp
from restart_kill import die, kill_when

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
WS = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))

# Not path-safe FQNs (user.ckpt.fqn): an empty part, a '/', a 300-byte part,
# a part starting with '.', and a file whose path another FQN needs as a
# directory.
ODD_KEYS = ["a..b", "x/y", "p" * 300, "q..hidden", "dir", "dir.leaf"]


def make(name, shape, dtype=torch.float32):
    """The tensor called name: the same in every process."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        if dtype.is_complex:
            t = torch.complex(t, torch.randn(shape, generator=g, dtype=torch.float64))
        return t.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


# name -> (global shape, dtype, placements on a 1-D mesh)
DTENSORS = {
    "dt.row": ((10, 6), torch.float32, [Shard(0)]),     # uneven at 4 ranks
    "dt.col": ((6, 10), torch.float64, [Shard(1)]),
    "dt.rep": ((4, 4), torch.int64, [Replicate()]),
    "dt.big": ((256, 128), torch.bfloat16, [Shard(1)]),
}
PLAIN = {
    "rep.w": ((8, 6), torch.float32),
    "rep.bf": ((5,), torch.bfloat16),
    "rep.scalar": ((), torch.float64),
    "rep.empty": ((0, 3), torch.float32),
    "rep.flags": ((7,), torch.bool),
}
OBJECTS = {"obj.step": 1234, "obj.cfg": {"lr": 0.25, "name": "run-7", "betas": (0.9, 0.99)}}


class Strided:
    """A tensor of which this rank holds every WS-th block of 2 rows
    (blocks RANK, RANK+WS, ...): several chunks of one FQN on one rank,
    given to DCP through its tensor-like protocol (__create_write_items__,
    __get_tensor_shard__), as sharding schemes beyond DTensor's do."""

    ROWS, COLS, BLOCK = 18, 3, 2  # 9 blocks: ranks hold different counts

    def __init__(self, name):
        self.full = make(name, (self.ROWS, self.COLS), torch.float64)

    def _mine(self):
        return [b * self.BLOCK for b in range(RANK, self.ROWS // self.BLOCK, WS)]

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (
            TensorWriteData, WriteItem, WriteItemType)
        items = []
        for r0 in self._mine():
            off = torch.Size([r0, 0])
            items.append(WriteItem(
                index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off,
                                               sizes=torch.Size([self.BLOCK, self.COLS])),
                    properties=TensorProperties(dtype=torch.float64),
                    size=torch.Size([self.ROWS, self.COLS]))))
        return items

    def __get_tensor_shard__(self, index):
        r0 = index.offset[0]
        return self.full[r0:r0 + self.BLOCK]


class ShardPlanner(dcp.DefaultSavePlanner):
    """DCP's default planner, which also looks chunks of Strided up by
    offset (DCP's own lookup does that for torch.Tensor subclasses only)."""

    def lookup_object(self, index):
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Strided):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


def mesh1():
    return init_device_mesh("cpu", (WS,))


def mesh2():
    return init_device_mesh("cpu", (2, WS // 2), mesh_dim_names=("dp", "tp"))


def build_state(zero, odd=False, two_d=None):
    """The state dict every rank saves (zero: the same structure with
    zeros, to load into). two_d: add 2-D-mesh DTensors (WS even)."""
    sd = {}
    m = mesh1()
    for name, (shape, dt, pl) in DTENSORS.items():
        full = torch.zeros(shape, dtype=dt) if zero else make(name, shape, dt)
        sd[name] = distribute_tensor(full, m, pl)
    if two_d:
        m2 = mesh2()
        for name, pl in (("dt2.ss", [Shard(0), Shard(1)]), ("dt2.rs", [Replicate(), Shard(0)])):
            full = torch.zeros(8, 12) if zero else make(name, (8, 12))
            sd[name] = distribute_tensor(full, m2, pl)
    for name, (shape, dt) in PLAIN.items():
        sd[name] = torch.zeros(shape, dtype=dt) if zero else make(name, shape, dt)
    for name, v in OBJECTS.items():
        # a loader gives the same structure (DCP flattens nested dicts)
        sd[name] = ({k: None for k in v} if isinstance(v, dict) else None) if zero else v
    if odd:
        for k in ODD_KEYS:
            sd[k] = torch.zeros(3, 5) if zero else make(k, (3, 5))
    return sd


def check_state(sd, odd=False, two_d=None, unique_ranks=()):
    for name, (shape, dt, _pl) in DTENSORS.items():
        t = sd[name]
        assert isinstance(t, DTensor), name
        want = make(name, shape, dt)
        got = t.full_tensor()
        assert got.dtype == dt and torch.equal(got, want), f"{name} differs"
    if two_d:
        for name in ("dt2.ss", "dt2.rs"):
            assert torch.equal(sd[name].full_tensor(), make(name, (8, 12))), name
    for name, (shape, dt) in PLAIN.items():
        assert sd[name].dtype == dt and torch.equal(sd[name], make(name, shape, dt)), name
    for name, v in OBJECTS.items():
        assert sd[name] == v, f"{name}: {sd[name]!r} != {v!r}"
    if odd:
        for k in ODD_KEYS:
            assert torch.equal(sd[k], make(k, (3, 5))), k
    for r in unique_ranks:
        k = f"unique.rank{r}"
        assert torch.equal(sd[k], make(k, (3, 2 + r))), k


def mount_of(spec):
    return ckptfs.dcp.rank_mount(spec, RANK)


def result(**kw):
    """This rank's result, as a JSON file in $CKPT_RESULT_DIR (mpirun may
    interleave the ranks' stdout lines)."""
    kw["rank"] = RANK
    d = os.environ["CKPT_RESULT_DIR"]
    with open(os.path.join(d, f".rank{RANK}.tmp"), "w") as f:
        json.dump(kw, f)
    os.replace(os.path.join(d, f".rank{RANK}.tmp"), os.path.join(d, f"rank{RANK}.json"))


# ---- scenarios -------------------------------------------------------------------

def save(mount, name, *flags):
    odd = "odd" in flags
    two_d = "2d" in flags
    sd = build_state(False, odd=odd, two_d=two_d)
    sd[f"unique.rank{RANK}"] = make(f"unique.rank{RANK}", (3, 2 + RANK))
    sd["strided.w"] = Strided("strided.w")
    t0 = time.monotonic()
    dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount),
             planner=ShardPlanner())
    st = open(os.path.join(mount_of(mount), name, ".status")).read().split("\n")[0]
    assert st == "committed", st
    result(seconds=time.monotonic() - t0)


def client_save(mount, name, *flags):
    """The package's own save (ckptfs.save) of the same DTensors and
    tensors: every rank saves its local shards."""
    two_d = "2d" in flags
    sd = build_state(False, two_d=two_d)
    for k in OBJECTS:
        del sd[k]
    ckptfs.save(sd, mount_of(mount), name, rank=RANK)
    result()


def client_load(mount, name, *flags):
    """ckptfs.load into DTensors of this world size (in place)."""
    two_d = "2d" in flags and WS % 2 == 0
    sd = build_state(True, two_d=two_d)
    for k in OBJECTS:
        del sd[k]
    out = ckptfs.load(sd, mount_of(mount), name)
    for nm, (shape, dt, pl) in DTENSORS.items():
        assert out[nm] is sd[nm]
        want = distribute_tensor(make(nm, shape, dt), mesh1(), pl).to_local()
        assert torch.equal(sd[nm].to_local(), want), f"{nm}: local shard differs"
        assert torch.equal(sd[nm].full_tensor(), make(nm, shape, dt)), nm
    if two_d:
        for nm in ("dt2.ss", "dt2.rs"):
            assert torch.equal(sd[nm].full_tensor(), make(nm, (8, 12))), nm
    for nm, (shape, dt) in PLAIN.items():
        assert torch.equal(sd[nm], make(nm, shape, dt)), nm
    result()


def save_commit_async(mount, name):
    """Writer(commit="async"): dcp.save returns once the data is frozen;
    ckptfs.wait follows the commit to its end."""
    sd = build_state(False)
    dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount, commit="async"))
    text = ckptfs.wait(mount_of(mount), name, timeout=300)
    assert text.startswith("committed"), text
    tgt = build_state(True)
    dcp.load(tgt, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(mount))
    check_state(tgt)
    result()


def load_progress(mount, name):
    """Reader(progress=callable): (0, total) first, then done growing as
    this rank's items are read (on 4 threads), ending at total: the bytes
    of this rank's part of each tensor and of the bytes items."""
    sd = {"row": distribute_tensor(make("row", (10, 6)), mesh1(), [Shard(0)]),
          "w": make("w", (4, 4), torch.float64), "b": make("b", (3,), torch.int32),
          "step": 7}
    dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount))
    step_bytes = os.path.getsize(os.path.join(mount_of(mount), name, "step"))
    tgt = {"row": distribute_tensor(torch.zeros(10, 6), mesh1(), [Shard(0)]),
           "w": torch.zeros(4, 4, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.int32),
           "step": 0}
    calls = []
    dcp.load(tgt, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(
        mount, threads=4, progress=lambda d, t: calls.append((d, t))))
    want = tgt["row"].to_local().numel() * 4 + 16 * 8 + 3 * 4 + step_bytes
    assert calls[0] == (0, want) and calls[-1] == (want, want), (calls, want)
    done = [d for d, t in calls]
    assert all(a < b for a, b in zip(done, done[1:])) and len(calls) == 5, calls
    assert torch.equal(tgt["row"].full_tensor(), make("row", (10, 6))) and tgt["step"] == 7
    result(calls=calls)


def cached_plans(mount, name):
    """DCP's plan caching: the second save of an unchanged state dict sends
    empty, unusable local plans; the Writer must still write everything."""
    planner = lambda: dcp.DefaultSavePlanner(enable_plan_caching=True)  # noqa: E731
    for k in range(3):
        sd = build_state(False)
        dcp.save(sd, checkpoint_id=f"{name}{k}", storage_writer=ckptfs.dcp.Writer(mount),
                 planner=planner())
    for k in range(3):
        tgt = build_state(True)
        dcp.load(tgt, checkpoint_id=f"{name}{k}", storage_reader=ckptfs.dcp.Reader(mount))
        check_state(tgt)
    result()


def leftover(mount, name):
    """Rank 1 has a staged checkpoint NAME left by an earlier trainer: the
    save fails on every rank at once; a retry saves."""
    if RANK == 1:
        os.mkdir(os.path.join(mount_of(mount), name))
    dist.barrier()
    sd = build_state(False)
    t0 = time.monotonic()
    try:
        dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount))
        raise AssertionError("dcp.save did not raise")
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException is one)
        if isinstance(e, AssertionError):
            raise
        elapsed, msg = time.monotonic() - t0, str(e)
    dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount))
    result(seconds=elapsed, message=msg)


def replicas(mount, name):
    """A replicated item whose bytes differ between ranks: refused with
    replicas="check" (ckptfs compares them), saved with "dedup"."""
    sd = {"w": make("w", (4, 4)), "tag": f"rank {RANK}", "tags": [RANK]}
    try:
        dcp.save(sd, checkpoint_id=name + "-check", storage_writer=ckptfs.dcp.Writer(mount))
        raise AssertionError("dcp.save did not raise")
    except BaseException as e:  # noqa: B036
        if isinstance(e, AssertionError):
            raise
        msg = str(e)
    dcp.save(sd, checkpoint_id=name + "-dedup",
             storage_writer=ckptfs.dcp.Writer(mount, replicas="dedup"))
    tgt = {"w": torch.zeros(4, 4), "tag": None, "tags": None}
    dcp.load(tgt, checkpoint_id=name + "-dedup", storage_reader=ckptfs.dcp.Reader(mount))
    assert torch.equal(tgt["w"], sd["w"]) and tgt["tag"].startswith("rank "), tgt
    assert tgt["tags"] in ([0], [1]), tgt
    result(message=msg, tag=tgt["tag"])


def versioned(k, zero=False):
    """Version k of a small state dict: a sharded DTensor, a plain tensor
    and an object, each different in every version."""
    m = mesh1()
    row = torch.zeros(10, 6) if zero else make(f"v{k}.row", (10, 6))
    return {"dt": {"row": distribute_tensor(row, m, [Shard(0)])},
            "w": torch.zeros(4, 3, dtype=torch.float64) if zero
            else make(f"v{k}.w", (4, 3), torch.float64),
            "step": {"k": None if zero else k}}


def check_version(mount, name, k):
    tgt = versioned(k, zero=True)
    dcp.load(tgt, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(mount))
    assert tgt["step"] == {"k": k}, f"{name}: step {tgt['step']}, version {k} expected"
    assert torch.equal(tgt["dt"]["row"].full_tensor(), make(f"v{k}.row", (10, 6))), name
    assert torch.equal(tgt["w"], make(f"v{k}.w", (4, 3), torch.float64)), name


def staged_names(mount):
    """What this rank's mount lists: NAME alone once a replace is done."""
    return sorted(os.listdir(mount_of(mount)))


def resave(mount, name):
    """dcp.save to one checkpoint_id again and again, as stock DCP allows
    (FileSystemWriter's overwrite=True; the Writer's default): each save
    replaces the last, on every rank; dcp.async_save too; Writer(commit=
    "async") followed by ckptfs.wait; a save with a cached plan (DCP's
    enable_plan_caching); overwrite=False raises as stock DCP does, before
    anything is staged, and leaves the checkpoint as it was."""
    def writer(**kw):
        return ckptfs.dcp.Writer(mount, **kw)
    dcp.save(versioned(1), checkpoint_id=name, storage_writer=writer())
    check_version(mount, name, 1)
    dcp.save(versioned(2), checkpoint_id=name, storage_writer=writer())
    check_version(mount, name, 2)
    assert staged_names(mount) == [name], staged_names(mount)
    dcp.async_save(versioned(3), checkpoint_id=name, storage_writer=writer()).result()
    check_version(mount, name, 3)
    t0 = time.monotonic()
    try:
        dcp.save(versioned(4), checkpoint_id=name, storage_writer=writer(overwrite=False))
        raise AssertionError("overwrite=False replaced a committed checkpoint")
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException is one)
        if isinstance(e, AssertionError):
            raise
        refused, refused_s = str(e), time.monotonic() - t0
    assert "Checkpoint already exists and self.overwrite=False" in refused, refused
    assert staged_names(mount) == [name], staged_names(mount)
    check_version(mount, name, 3)
    dcp.save(versioned(5), checkpoint_id=name, storage_writer=writer(commit="async"))
    text = ckptfs.wait(mount_of(mount), name, timeout=300)
    assert text.startswith("committed"), text
    check_version(mount, name, 5)
    for k in (6, 7):  # the second save of an unchanged plan gets the cached one
        dcp.save(versioned(k), checkpoint_id=name, storage_writer=writer(),
                 planner=dcp.DefaultSavePlanner(enable_plan_caching=True))
        check_version(mount, name, k)
    assert staged_names(mount) == [name], staged_names(mount)
    # a replace that fails on rank 1 while it stages (an object it cannot
    # pickle): every rank raises at once, version 7 stays, nothing is left
    bad = versioned(8)
    bad["step"]["k"] = Unpicklable() if RANK == 1 else 8
    t0 = time.monotonic()
    try:
        dcp.save(bad, checkpoint_id=name, storage_writer=writer())
        raise AssertionError("a save that failed on rank 1 replaced the checkpoint")
    except BaseException as e:  # noqa: B036
        if isinstance(e, AssertionError):
            raise
        failed, failed_s = str(e), time.monotonic() - t0
    check_version(mount, name, 7)
    assert staged_names(mount) == [name], staged_names(mount)
    # a name with a space cannot follow replace=: saved once, then refused
    spaced = f"{name} b"
    dcp.save(versioned(1), checkpoint_id=spaced, storage_writer=writer())
    try:
        dcp.save(versioned(2), checkpoint_id=spaced, storage_writer=writer())
        raise AssertionError(f"{spaced!r} was saved again")
    except BaseException as e:  # noqa: B036
        if isinstance(e, AssertionError):
            raise
        assert "cannot be replaced" in str(e), str(e)
    check_version(mount, spaced, 1)
    assert staged_names(mount) == [name, spaced], staged_names(mount)
    result(refused=refused, refused_seconds=refused_s, failed=failed, failed_seconds=failed_s)


def deprecated_api(mount, name):
    """DCP's deprecated save_state_dict / load_state_dict (still in
    torch 2.13) call reset() with no id: the name given to the Writer and
    the Reader is kept, as stock FileSystemWriter keeps its path."""
    sd = build_state(False)
    dcp.save_state_dict(sd, storage_writer=ckptfs.dcp.Writer(mount, checkpoint_id=name))
    st = open(os.path.join(mount_of(mount), name, ".status")).read().split("\n")[0]
    assert st == "committed", st
    back = build_state(True)
    dcp.load_state_dict(back, storage_reader=ckptfs.dcp.Reader(mount, checkpoint_id=name))
    check_state(back)
    result()


def load_version(mount, name, k):
    check_version(mount, name, int(k))
    result()


def load(mount, name, saved_ws, *flags):
    odd = "odd" in flags
    two_d = "2d" in flags and WS % 2 == 0
    sd = build_state(True, odd=odd, two_d=two_d)
    uniques = range(int(saved_ws))
    for r in uniques:
        sd[f"unique.rank{r}"] = torch.zeros(3, 2 + r)
    sd["strided.w"] = torch.zeros(Strided.ROWS, Strided.COLS, dtype=torch.float64)
    dcp.load(sd, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(mount))
    check_state(sd, odd=odd, two_d=two_d, unique_ranks=uniques)
    assert torch.equal(sd["strided.w"], Strided("strided.w").full), "strided.w"
    # each rank's local shards too
    for nm, (shape, dt, pl) in DTENSORS.items():
        want = distribute_tensor(make(nm, shape, dt), mesh1(), pl).to_local()
        assert torch.equal(sd[nm].to_local(), want), f"{nm}: local shard differs"
    result(fqns=len(sd))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8))


def _digest(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optim)
    h = hashlib.sha256()
    for k in sorted(msd):
        v = msd[k]
        v = v.full_tensor() if isinstance(v, DTensor) else v
        h.update(k.encode() + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pk in sorted(osd["state"]):
        for sk in sorted(osd["state"][pk]):
            v = osd["state"][pk][sk]
            v = v.full_tensor() if isinstance(v, DTensor) else v
            if isinstance(v, torch.Tensor):
                h.update(f"{pk}.{sk}".encode()
                         + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fsdp(model):
    """fully_shard the model on a CPU mesh where this torch can; else keep
    it replicated (DDP-like)."""
    try:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh1())
        return "fully_shard"
    except Exception as e:  # noqa: BLE001
        print(f"fully_shard unavailable on CPU: {e!r}", file=sys.stderr)
        return "replicated"


def _step(model, optim, k):
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(4 * WS, 16, generator=g)[RANK * 4:(RANK + 1) * 4]
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def optim_save(mount, name, async_name):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = _model()
    how = _fsdp(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for k in range(3):
        _step(model, optim, k)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=name,
             storage_writer=ckptfs.dcp.Writer(mount))
    digest = _digest(model, optim)
    # async_save, then a training step while it runs
    msd, osd = get_state_dict(model, optim)
    # The save's collectives run in a background thread while the training
    # step runs its own: they need a process group of their own (as DCP's
    # documentation says), else the two interleave on one and deadlock.
    ckpt_pg = dist.new_group(backend="gloo")
    t0 = time.monotonic()
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=async_name,
                         storage_writer=ckptfs.dcp.Writer(mount), process_group=ckpt_pg)
    stall = time.monotonic() - t0
    _step(model, optim, 3)  # overlaps the save; changes every parameter
    overlapped = not fut.done()
    fut.result()
    st = open(os.path.join(mount_of(mount), async_name, ".status")).read().split("\n")[0]
    assert st == "committed", st
    result(how=how, digest=digest, after_step=_digest(model, optim), stall=stall,
           overlapped=overlapped)


def optim_load(mount, name):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = _model()
    how = _fsdp(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optim, 99)  # something else, to be overwritten
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(mount))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    result(how=how, digest=_digest(model, optim))


RESTART_STEPS = 8


def train_restart(mount, phase, kill="none"):
    """A training run of RESTART_STEPS steps (FSDP2 where this torch can,
    Adam) that saves step-N with async DCP saves every 2 steps; phase
    "run": from scratch; "resume": from ckptfs.latest() of the mount, with
    the same names saved again. kill: where this rank SIGKILLs itself
    (restart_kill). The result: the digest of the final state."""
    import threading
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = _model()
    how = _fsdp(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    first, resumed = 0, None
    if phase == "resume":
        resumed = ckptfs.latest(mount_of(mount), "step-")
        everyone = [None] * WS
        dist.all_gather_object(everyone, resumed)
        assert len(set(everyone)) == 1, f"ranks resume from different checkpoints: {everyone}"
        if resumed is not None:
            msd, osd = get_state_dict(model, optim)
            sd = {"model": msd, "optim": osd, "step": 0}
            dcp.load(sd, checkpoint_id=resumed, storage_reader=ckptfs.dcp.Reader(mount))
            set_state_dict(model, optim, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
            first = int(sd["step"])
    ckpt_pg = dist.new_group(backend="gloo")
    fut = None
    for k in range(first, RESTART_STEPS):
        _step(model, optim, k)
        step = k + 1
        if step % 2:
            continue
        if fut is not None:
            fut.result()
        when = kill_when(kill, step)
        if when == "before":
            die()
        msd, osd = get_state_dict(model, optim)
        if when == "staging":
            threading.Timer(0.02, die).start()
        fut = dcp.async_save({"model": msd, "optim": osd, "step": step},
                             checkpoint_id=f"step-{step}",
                             storage_writer=ckptfs.dcp.Writer(mount, commit="async"),
                             process_group=ckpt_pg)
        if when == "after":
            die()
    if fut is not None:  # (None: resumed from the last step, committed whole)
        fut.result()
    name = f"step-{RESTART_STEPS}"
    ckptfs.wait(mount_of(mount), name)
    st = open(os.path.join(mount_of(mount), name, ".status")).read().split("\n")[0]
    assert st == "committed", st
    result(how=how, digest=_digest(model, optim), resumed=resumed)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError(f"rank {RANK}: this object refuses to be saved")


def fail_one(mount, name, bad_rank):
    sd = build_state(False)
    if RANK == int(bad_rank):
        sd["obj.bad"] = Unpicklable()
    else:
        sd["obj.bad"] = 1
    t0 = time.monotonic()
    try:
        dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount))
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException is one)
        elapsed = time.monotonic() - t0
        left = os.path.exists(os.path.join(mount_of(mount), name))
        result(raised=type(e).__name__, message=str(e), seconds=elapsed,
               staged_left=left)
        # the same id saves fine afterwards
        sd["obj.bad"] = 1
        dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount))
        return
    raise AssertionError("dcp.save did not raise")


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=RANK, world_size=WS)
    code = 1
    try:
        scenario, args = sys.argv[1], sys.argv[2:]
        globals()[scenario](*args)
        dist.barrier()
        code = 0
    except BaseException:  # noqa: B036
        traceback.print_exc()
    finally:
        # Every rank's result is written (and past the barrier when it
        # passed): the process ends here, without torch's teardown. Its
        # gloo threads once aborted a finished job at exit ("terminate
        # called without an active exception", seen once).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
