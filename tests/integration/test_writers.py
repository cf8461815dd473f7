#!/usr/bin/env python3
"""Any writer, unchanged (issue 24): the files people's tools write, written
by the real packages of .venv (pyenv.torch_python(): torch 2.13.0,
safetensors, transformers, accelerate, lightning, as scripts/install-deps.sh
pins them) into a one-rank mount exactly as they write anywhere else, then
committed with a `sync` write to NAME/.commit (the one thing a tool does not
do by itself) and read back, bit for bit, from the staged files, from the
committed ones and from a second mount of the same BACKING_DIR:

- safetensors.torch.save_file (a dot-named temp file, then a rename), read
  with load_file and safe_open (mmap, slices);
- transformers' save_pretrained of a tiny randomly initialised GPT-2 (a
  config, no download) and from_pretrained;
- torch.save through tempfile.NamedTemporaryFile(dir=..., prefix=".tmp")
  and os.replace, over an older file too;
- the Hugging Face Trainer's tmp-checkpoint-N -> checkpoint-N rename, and
  a real transformers.Trainer saving checkpoint-N directories into a mount,
  resumed from a second mount;
- Lightning's ModelCheckpoint writing epoch=E-step=S.ckpt files into one
  staged checkpoint, and a checkpoint named epoch=0-step=100.

On 630d4ef every test but the ModelCheckpoint one failed: safetensors'
`.tmpXXXX` (save_file, save_pretrained, the Trainer) and tempfile's `.tmp`
names got EPERM, `mkdir epoch=0-step=100` EINVAL. ModelCheckpoint already
worked there: fsspec's temp file lives in /tmp, so the mount only sees a
plain create of each .ckpt file (and unlinks, which a staged checkpoint
always allowed).

Not here, because the stock frameworks cannot do it alone: a Trainer
resumed with its output_dir in the mount saving checkpoint-N again over
the committed one, and Lightning's save_top_k rotation of committed
checkpoints: ckptfs.hf.CommitCallback and ckptfs.lightning.CheckpointIO
do both (python/tests/test_hf.py, test_lightning.py).

A missing package fails the test with the install hint (skip instead with
CKPT_ALLOW_NO_TORCH=1). cp -a of trees with dot-files is test_names.py's.

    python3 tests/integration/test_writers.py --bin build/bin/ckptfs
"""

import os
import sys

from ckpttest.util import CkptfsTestCase, main
from ckpttest.pyenv import require_modules, run_py

# Nothing reaches the network or the user's caches.
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
       "TRANSFORMERS_VERBOSITY": "error"}

# Helpers of the code each test runs in the .venv interpreter.
PRELUDE = r'''
import hashlib, json, os, sys, tempfile
import torch


def commit(d):
    """What the trainer adds to its tool's save: a sync commit of NAME."""
    with open(os.path.join(d, ".commit"), "w") as f:
        f.write("sync\n")
    with open(os.path.join(d, ".status")) as f:
        st = f.read()
    assert st.startswith("committed\n"), f"{d}: {st!r}"
    print(f"{os.path.basename(d)}: committed")


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b, what):
    """Two state dicts hold the same tensors, bit for bit."""
    assert sorted(a) == sorted(b), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, tuple(x.shape)) == (y.dtype, tuple(y.shape)), \
            f"{what}: {k}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}"
        assert torch.equal(bits(x), bits(y)), f"{what}: {k}: values differ"
    print(f"{what}: {len(a)} tensors bit-exact")


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
'''

SAFETENSORS_CHECK = r'''
from safetensors import safe_open
from safetensors.torch import load_file, save_file

META = {"format": "pt", "written-by": "test_writers"}


def state_dict():
    torch.manual_seed(0)
    return {"embed.weight": torch.randn(100, 32),
            "layer.0.weight": torch.randn(32, 32).half(),
            "layer.0.bias": torch.randn(32).to(torch.bfloat16),
            "mask": torch.rand(5, 3) > 0.5,
            "step": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0, 4)}


def check(path, sd, what, digest=None):
    """load_file, safe_open (whole tensors, a slice), the file's bytes (the
    staged file's: the order of the header's metadata differs between
    saves of one state dict)."""
    assert_same(sd, load_file(path), what + ", load_file")
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == META, f.metadata()
        assert_same(sd, {k: f.get_tensor(k) for k in f.keys()}, what + ", safe_open")
        rows = f.get_slice("embed.weight")[10:20]
        assert torch.equal(bits(rows), bits(sd["embed.weight"][10:20])), what + ": slice"
    if digest:
        assert sha(path) == digest, what + ": file bytes differ"
'''


class Writers(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.m = self.mount()
        self.ref = os.path.join(self.dir, "ref")  # reference data, off the mount
        os.makedirs(self.ref)

    def py(self, *modules):
        self.interp = require_modules(self, "torch", *modules)

    def run_code(self, code, *args):
        out = run_py(self, self.interp, PRELUDE + code, *args, timeout=300,
                     env=dict(ENV, HF_HOME=os.path.join(self.dir, "hf-home")))
        sys.stderr.write(out)
        return out

    def published(self):
        return sorted(n for n in os.listdir(self.backing) if not n.startswith("."))

    def second_mount(self):
        """A second one-rank mount of the same BACKING_DIR, started after
        the commits: it sees only what was published."""
        return self.mount(mnt=os.path.join(self.dir, "mnt2")).mnt

    def test_safetensors_save_file(self):
        """save_file into a staged checkpoint; load_file and safe_open from
        the staged file, the committed one, a second mount."""
        self.py("safetensors")
        out = self.run_code(SAFETENSORS_CHECK + r'''
mnt, ref = sys.argv[1:]
sd = state_dict()
d = os.path.join(mnt, "hf-1")
os.mkdir(d)
path = os.path.join(d, "model.safetensors")
save_file(sd, path, metadata=META)   # writes .tmpXXXX, renames it
assert os.listdir(d) == ["model.safetensors"], os.listdir(d)
check(path, sd, "staged")
digest = sha(path)
commit(d)
check(path, sd, "committed", digest)
json.dump(digest, open(os.path.join(ref, "sha.json"), "w"))
''', self.mnt, self.ref)
        self.assertIn("committed, safe_open: 6 tensors bit-exact", out)
        mnt2 = self.second_mount()
        out = self.run_code(SAFETENSORS_CHECK + r'''
check(os.path.join(sys.argv[1], "hf-1", "model.safetensors"), state_dict(), "second mount",
      json.load(open(os.path.join(sys.argv[2], "sha.json"))))
''', mnt2, self.ref)
        self.assertIn("second mount, load_file: 6 tensors bit-exact", out)
        self.assertIn("second mount, safe_open: 6 tensors bit-exact", out)

    def test_transformers_save_pretrained(self):
        """save_pretrained of a tiny random GPT-2 (config.json,
        generation_config.json, model.safetensors); from_pretrained on a
        second mount loads every tensor, bit for bit."""
        self.py("transformers")
        self.run_code(r'''
from transformers import GPT2Config, GPT2LMHeadModel
mnt, ref = sys.argv[1:]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                   n_positions=64))
d = os.path.join(mnt, "gpt2-tiny")
model.save_pretrained(d)
files = sorted(os.listdir(d))
print("save_pretrained wrote", files)
assert "model.safetensors" in files and "config.json" in files, files
commit(d)
torch.save(model.state_dict(), os.path.join(ref, "gpt2.pt"))
json.dump(files, open(os.path.join(ref, "files.json"), "w"))
''', self.mnt, self.ref)
        mnt2 = self.second_mount()
        out = self.run_code(r'''
from transformers import GPT2LMHeadModel
mnt, ref = sys.argv[1:]
d = os.path.join(mnt, "gpt2-tiny")
files = json.load(open(os.path.join(ref, "files.json")))
assert sorted(os.listdir(d)) == sorted(files + [".metadata"]), os.listdir(d)
model, info = GPT2LMHeadModel.from_pretrained(d, output_loading_info=True)
assert not info["missing_keys"] and not info["unexpected_keys"], info
assert model.config.n_embd == 32 and model.config.n_layer == 2, model.config
assert_same(torch.load(os.path.join(ref, "gpt2.pt")), model.state_dict(), "from_pretrained")
''', mnt2, self.ref)
        self.assertRegex(out, r"from_pretrained: \d+ tensors bit-exact")

    def test_torch_save_tempfile_os_replace(self):
        """torch.save into a NamedTemporaryFile(prefix=".tmp") beside the
        target, fsync, os.replace (over an older file too); no temp file
        left, the bytes the same after commit and on a second mount."""
        self.py()
        code = r'''
mnt, ref, mode = sys.argv[1:]
d = os.path.join(mnt, "pt-replace")


def state():
    torch.manual_seed(0)
    return {"w": torch.randn(64, 16), "b": torch.randn(16).double(), "step": 3}


def check(sd, back, what):
    assert sd.keys() == back.keys() and sd["step"] == back["step"], (what, back.keys())
    assert_same({k: sd[k] for k in ("w", "b")}, {k: back[k] for k in ("w", "b")}, what)


def atomic_save(obj, path):
    """The usual atomic save: a temp file beside the target, then os.replace."""
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), prefix=".tmp",
                                     delete=False) as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


if mode == "save":
    os.makedirs(os.path.join(d, "sub"))
    torch.save({"old": torch.zeros(3)}, os.path.join(d, "sub", "state.pt"))
    atomic_save(state(), os.path.join(d, "sub", "state.pt"))   # over the older file
    atomic_save({"lr": 0.25}, os.path.join(d, "optim.pt"))
    assert sorted(os.listdir(d)) == ["optim.pt", "sub"], os.listdir(d)
    assert os.listdir(os.path.join(d, "sub")) == ["state.pt"], os.listdir(os.path.join(d, "sub"))
    check(state(), torch.load(os.path.join(d, "sub", "state.pt")), "staged")
    digest = sha(os.path.join(d, "sub", "state.pt"))
    commit(d)
    json.dump(digest, open(os.path.join(ref, "sha.json"), "w"))
assert sha(os.path.join(d, "sub", "state.pt")) == json.load(open(os.path.join(ref, "sha.json")))
check(state(), torch.load(os.path.join(d, "sub", "state.pt")), mode + " torch.load")
assert torch.load(os.path.join(d, "optim.pt")) == {"lr": 0.25}
'''
        out = self.run_code(code, self.mnt, self.ref, "save")
        self.assertIn("save torch.load: 2 tensors bit-exact", out)
        out = self.run_code(code, self.second_mount(), self.ref, "second-mount")
        self.assertIn("second-mount torch.load: 2 tensors bit-exact", out)

    def test_hf_trainer_tmp_checkpoint_rename(self):
        """The files and the rename the Hugging Face Trainer makes when it
        saves into tmp-checkpoint-N (the versions that do)."""
        self.py("safetensors")
        code = SAFETENSORS_CHECK + r'''
mnt, ref, mode = sys.argv[1:]
final = os.path.join(mnt, "checkpoint-5")
if mode == "save":
    tmp = os.path.join(mnt, "tmp-checkpoint-5")
    os.mkdir(tmp)
    save_file(state_dict(), os.path.join(tmp, "model.safetensors"), metadata=META)
    torch.save({"state": {}, "param_groups": [{"lr": 0.5}]}, os.path.join(tmp, "optimizer.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 5}, f)
    os.rename(tmp, final)
    assert os.listdir(mnt) == ["checkpoint-5"], os.listdir(mnt)
    json.dump(sha(os.path.join(final, "model.safetensors")),
              open(os.path.join(ref, "sha.json"), "w"))
    commit(final)
check(os.path.join(final, "model.safetensors"), state_dict(), mode,
      json.load(open(os.path.join(ref, "sha.json"))))
assert torch.load(os.path.join(final, "optimizer.pt"))["param_groups"] == [{"lr": 0.5}]
with open(os.path.join(final, "trainer_state.json")) as f:
    assert json.load(f) == {"global_step": 5}
'''
        out = self.run_code(code, self.mnt, self.ref, "save")
        self.assertIn("save, safe_open: 6 tensors bit-exact", out)
        self.assertEqual(self.published(), ["checkpoint-5"])
        out = self.run_code(code, self.second_mount(), self.ref, "second mount")
        self.assertIn("second mount, safe_open: 6 tensors bit-exact", out)

    def test_hf_trainer(self):
        """A real transformers.Trainer, output_dir in the mount, saving
        checkpoint-2, -4 and -6 (model, optimizer, scheduler, RNG state,
        trainer state) with save_total_limit=2 (it removes the staged
        checkpoint-2 itself); committed after train(). Resumed on a second
        mount from checkpoint-4 (into a model initialised otherwise), it
        trains steps 5-6 only and ends bit-identical to the first run."""
        self.py("transformers", "accelerate")
        code = r'''
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)
from safetensors.torch import load_file


class Toy(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 100, (12, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Steps(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kw):
        self.steps.append(state.global_step)


def trainer(out, init_seed=0):
    torch.manual_seed(init_seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                       n_positions=16))
    args = TrainingArguments(output_dir=out, max_steps=6, save_strategy="steps", save_steps=2,
                             save_total_limit=2, save_only_model=False,
                             per_device_train_batch_size=2, learning_rate=1e-3, seed=0,
                             use_cpu=True, report_to="none", disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0)
    steps = Steps()
    return Trainer(model=model, args=args, train_dataset=Toy(), callbacks=[steps]), steps


mnt, ref, mode = sys.argv[1:]
if mode == "train":
    t, steps = trainer(mnt)
    t.train()
    assert steps.steps == [1, 2, 3, 4, 5, 6], steps.steps
    assert sorted(os.listdir(mnt)) == ["checkpoint-4", "checkpoint-6"], os.listdir(mnt)
    for n in ("checkpoint-4", "checkpoint-6"):
        print(n, sorted(os.listdir(os.path.join(mnt, n))))
        commit(os.path.join(mnt, n))
    torch.save(t.model.state_dict(), os.path.join(ref, "final.pt"))
else:
    final = torch.load(os.path.join(ref, "final.pt"))
    saved = load_file(os.path.join(mnt, "checkpoint-6", "model.safetensors"))
    assert_same({k: final[k] for k in saved}, saved, "checkpoint-6 model.safetensors")
    at4 = load_file(os.path.join(mnt, "checkpoint-4", "model.safetensors"))
    assert any(not torch.equal(at4[k], saved[k]) for k in saved), "steps 5-6 changed nothing"
    t, steps = trainer(os.path.join(ref, "resumed"), init_seed=1)
    t.train(resume_from_checkpoint=os.path.join(mnt, "checkpoint-4"))
    assert steps.steps == [5, 6], steps.steps
    assert_same(final, t.model.state_dict(), "resumed from checkpoint-4")
'''
        out = self.run_code(code, self.mnt, self.ref, "train")
        for n in (4, 6):
            self.assertRegex(out, rf"checkpoint-{n} \[.*'optimizer.pt'.*'rng_state.pth'.*"
                                  rf"'scheduler.pt', 'trainer_state.json', 'training_args.bin'\]")
            self.assertIn(f"checkpoint-{n}: committed", out)
        self.assertEqual(self.published(), ["checkpoint-4", "checkpoint-6"])
        out = self.run_code(code, self.second_mount(), self.ref, "resume")
        self.assertRegex(out, r"resumed from checkpoint-4: \d+ tensors bit-exact")

    def test_lightning_model_checkpoint(self):
        """ModelCheckpoint(save_top_k=-1, save_last=True) writes
        epoch=0-step=N.ckpt files, and last.ckpt over and over, into one
        staged checkpoint (through fsspec's transaction: a temp file in
        /tmp, then a move, which copies); committed, they load on a second
        mount, with Lightning's load_from_checkpoint too. A second
        ModelCheckpoint(save_top_k=2) in another staged checkpoint removes
        epoch=0-step=2.ckpt when step 6 is saved (unlink while staged)."""
        self.py("lightning")
        code = r'''
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 4)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


mnt, ref, mode = sys.argv[1:]
d = os.path.join(mnt, "lightning-run")
top2 = os.path.join(mnt, "lightning-top2")
want = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
if mode == "fit":
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 4)), batch_size=2)
    model = Tiny()
    ckpt = ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True,
                           every_n_train_steps=2)
    best2 = ModelCheckpoint(dirpath=top2, save_top_k=2, monitor="step", mode="max",
                            every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, enable_progress_bar=False,
                        logger=False, enable_model_summary=False, callbacks=[ckpt, best2],
                        default_root_dir=os.path.join(ref, "root"))
    trainer.fit(model, data)
    assert sorted(os.listdir(d)) == want, os.listdir(d)
    digests = {f: sha(os.path.join(d, f)) for f in want}
    assert sorted(os.listdir(top2)) == want[1:3], os.listdir(top2)
    commit(d)
    commit(top2)
    json.dump(digests, open(os.path.join(ref, "digests.json"), "w"))
    torch.save(model.state_dict(), os.path.join(ref, "final.pt"))
else:
    assert sorted(os.listdir(d)) == [".metadata"] + want, os.listdir(d)
    assert sorted(os.listdir(top2)) == [".metadata"] + want[1:3], os.listdir(top2)
    digests = json.load(open(os.path.join(ref, "digests.json")))
    for f in want:
        assert sha(os.path.join(d, f)) == digests[f], f
        ck = torch.load(os.path.join(d, f), weights_only=False)
        step = int(f.split("step=")[1].split(".")[0]) if "step=" in f else 6
        assert ck["global_step"] == step, (f, ck["global_step"])
    for f in ("epoch=0-step=6.ckpt", "last.ckpt"):
        last = Tiny.load_from_checkpoint(os.path.join(d, f))
        assert_same(torch.load(os.path.join(ref, "final.pt")), last.state_dict(),
                    "load_from_checkpoint " + f)
'''
        self.run_code(code, self.mnt, self.ref, "fit")
        out = self.run_code(code, self.second_mount(), self.ref, "load")
        self.assertIn("load_from_checkpoint epoch=0-step=6.ckpt: 2 tensors bit-exact", out)
        self.assertIn("load_from_checkpoint last.ckpt: 2 tensors bit-exact", out)

    def test_lightning_style_checkpoint_name(self):
        """Lightning's names (epoch=0-step=100) as checkpoint NAMEs."""
        self.py()
        code = r'''
mnt, mode = sys.argv[1:]
d = os.path.join(mnt, "epoch=0-step=100")
torch.manual_seed(0)
sd = {"w": torch.randn(8, 4), "b": torch.randn(4)}
if mode == "save":
    os.mkdir(d)
    torch.save({"state_dict": sd, "global_step": 100}, os.path.join(d, "model.ckpt"))
    commit(d)
ck = torch.load(os.path.join(d, "model.ckpt"))
assert ck["global_step"] == 100
assert_same(sd, ck["state_dict"], mode)
'''
        self.run_code(code, self.mnt, "save")
        self.assertEqual(self.published(), ["epoch=0-step=100"])
        out = self.run_code(code, self.second_mount(), "second mount")
        self.assertIn("second mount: 2 tensors bit-exact", out)


if __name__ == "__main__":
    main()
