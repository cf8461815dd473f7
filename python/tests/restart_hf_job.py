"""One rank of a Hugging Face Trainer run that crashes and restarts over
ckptfs rank mounts, started by test_restart_frameworks.py under mpirun
(gloo on CPU, 127.0.0.1:$MASTER_PORT):

    restart_hf_job.py ROOT PHASE KILL

ROOT/rankR is this rank's mount (the Trainer's output_dir); PHASE "run"
trains from scratch, "resume" with trainer.train(resume_from_checkpoint=
True) (the Trainer's get_last_checkpoint: CommitCallback discarded a
killed run's leftovers when the Trainer was made); KILL "none" or
"RANKS:WHEN:STEP" (RANKS 0, 1 or all; WHEN before / during / after; STEP
the save of checkpoint-STEP):

    before  in on_step_end of STEP, before the Trainer writes anything
    during  right after this rank's first torch.save into checkpoint-STEP
            (rank 0: model.safetensors and training_args.bin written, not
            the optimizer; rank 1: its rng_state_1.pth), before the commit
    after   in on_save of a callback after CommitCallback: checkpoint-STEP
            committed

A tiny GPT-2 (dropout on, a different RNG stream per rank), 16 samples:
4 steps an epoch at 2 ranks, 8 steps, save_steps=2 (checkpoint-2, -4 at an
epoch's end, -6, -8), every checkpoint kept. Each rank writes
$CKPT_RESULT_DIR/rankR.json: the digest of its final model and Adam state,
the steps it trained, the checkpoint it resumed from, what its mount lists.
"""

import hashlib
import json
import os
import sys

RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])
WS = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.update(RANK=str(RANK), WORLD_SIZE=str(WS), LOCAL_RANK=str(RANK),
                  LOCAL_WORLD_SIZE=str(WS), MASTER_ADDR="127.0.0.1",
                  HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")

import torch  # noqa: E402

import ckptfs  # noqa: E402
from restart_kill import die, kill_when  # noqa: E402
import ckptfs.hf  # noqa: E402

STEPS = 8


def digest(model, opt):
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().reshape(-1).view(torch.uint8)
                 .numpy().tobytes())
    for p, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                h.update(f"{p}.{k}".encode() + v.detach().contiguous().reshape(-1)
                         .view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(root, phase, kill):
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)
    from transformers.trainer_utils import get_last_checkpoint

    mount = os.path.join(root, f"rank{RANK}")

    class Toy(torch.utils.data.Dataset):
        x = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Before(TrainerCallback):
        """First of the callbacks: the per-rank RNG, the steps trained, the
        kills before a save and in the middle of one."""
        steps = []

        def on_train_begin(self, args, state, control, **kw):
            # after set_seed(args.seed), before a checkpoint's RNG state is
            # restored: ranks differ from here on (dropout)
            torch.manual_seed(1000 + RANK)

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(state.global_step)
            when = kill_when(kill, state.global_step) if control.should_save else None
            if when == "before":
                die(f"before checkpoint-{state.global_step}")
            elif when == "during":
                dying_save(os.path.join(mount, f"checkpoint-{state.global_step}"))

    class After(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if kill_when(kill, state.global_step) == "after":
                die(f"after checkpoint-{state.global_step} was committed")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                       n_positions=16))
    args = TrainingArguments(output_dir=mount, save_strategy="steps", max_steps=STEPS,
                             save_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-2, seed=0, use_cpu=True, report_to="none",
                             disable_tqdm=True, logging_strategy="no",
                             dataloader_num_workers=0, ddp_backend="gloo")
    before = Before()
    t = Trainer(model=model, args=args, train_dataset=Toy(),
                callbacks=[before, ckptfs.hf.CommitCallback(), After()])
    assert t.args.world_size == WS and t.args.process_index == RANK
    # what resume_from_checkpoint=True picks (the leftovers discarded by now)
    last = get_last_checkpoint(mount) if phase == "resume" else None
    t.train(resume_from_checkpoint=True if last else None)
    for name in os.listdir(mount):
        st = ckptfs.status(mount, name)[0]
        assert st == "committed", f"{name} is {st} on rank {RANK}"
    result(digest=digest(t.model, t.optimizer), steps=before.steps,
           resumed=os.path.basename(last) if last else None,
           listing=sorted(os.listdir(mount)))


def dying_save(ckdir):
    """The first torch.save into ckdir kills this process once written."""
    real = torch.save

    def save(obj, f, *a, **kw):
        real(obj, f, *a, **kw)
        if isinstance(f, (str, os.PathLike)) and \
                os.path.dirname(os.path.abspath(f)) == os.path.abspath(ckdir):
            die(f"during: after writing {f}")
    torch.save = save


def result(**kw):
    d = os.environ["CKPT_RESULT_DIR"]
    with open(os.path.join(d, f".rank{RANK}.tmp"), "w") as f:
        json.dump(dict(rank=RANK, **kw), f)
    os.replace(os.path.join(d, f".rank{RANK}.tmp"), os.path.join(d, f"rank{RANK}.json"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # leave without the interpreter's teardown once every rank is done
    # (torch's gloo threads abort a process at exit now and then: hf_job.py)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
