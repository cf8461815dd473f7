"""One rank of a Hugging Face job over ckptfs rank mounts, started by
test_hf.py under mpirun (torch.distributed gloo on CPU, 127.0.0.1:$MASTER_PORT):

    hf_job.py trainer ROOT [RESUME_NAME]   Trainer, output_dir ROOT/rankR, then
                                           save_model into "final" (RESUME_NAME
                                           "last": resume_from_checkpoint=True)
    hf_job.py accelerate ROOT              Accelerator save_state/load_state

CKPT_HF_MODEL_ONLY=1: the Trainer saves with save_only_model=True;
CKPT_HF_NO_COMMIT=1: without CommitCallback (to see what fails without it);
CKPT_HF_MAX_STEPS=N: train to step N (6); CKPT_HF_NO_LIMIT=1: no
save_total_limit (2).
Each rank writes $CKPT_RESULT_DIR/rankR.json: the steps it trained, what its
mount lists, and sha256 digests of the final model and optimizer tensors.
Every rank seeds its RNG differently (as dropout and data noise then differ
between ranks), so a rank resumed with another rank's RNG state, or none,
ends with other weights.
"""

import hashlib
import json
import os
import sys

RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])
WS = int(os.environ["OMPI_COMM_WORLD_SIZE"])
# what torchrun would set; the Trainer and Accelerate read them
os.environ.update(RANK=str(RANK), WORLD_SIZE=str(WS), LOCAL_RANK=str(RANK),
                  LOCAL_WORLD_SIZE=str(WS), MASTER_ADDR="127.0.0.1",
                  HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")

import torch  # noqa: E402

import ckptfs  # noqa: E402
import ckptfs.hf  # noqa: E402


def digests(tensors):
    return {k: hashlib.sha256(v.detach().contiguous().reshape(-1).view(torch.uint8)
                              .numpy().tobytes()).hexdigest()
            for k, v in tensors.items() if isinstance(v, torch.Tensor)}


def optimizer_digests(opt):
    sd = opt.state_dict()
    return digests({f"{p}.{k}": v for p, st in sd["state"].items() for k, v in st.items()})


def result(**kw):
    with open(os.path.join(os.environ["CKPT_RESULT_DIR"], f"rank{RANK}.json"), "w") as f:
        json.dump(dict(rank=RANK, **kw), f)


def trainer_job(root, resume=None):
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)

    class Toy(torch.utils.data.Dataset):
        x = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Probe(TrainerCallback):
        steps = []

        def on_train_begin(self, args, state, control, **kw):
            # after set_seed(args.seed), before the checkpoint's RNG state
            # is restored: ranks differ from here on (dropout)
            torch.manual_seed(1000 + RANK)

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(state.global_step)

    torch.manual_seed(7 if resume else 0)  # a resumed model starts elsewhere
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                       n_positions=16))
    mount = os.path.join(root, f"rank{RANK}")
    args = TrainingArguments(output_dir=mount, save_strategy="steps",
                             max_steps=int(os.environ.get("CKPT_HF_MAX_STEPS", "6")),
                             save_steps=2, per_device_train_batch_size=2,
                             save_total_limit=None if os.environ.get("CKPT_HF_NO_LIMIT") else 2,
                             learning_rate=1e-2, seed=0, use_cpu=True, report_to="none",
                             disable_tqdm=True, logging_strategy="no",
                             dataloader_num_workers=0, ddp_backend="gloo",
                             save_only_model=bool(os.environ.get("CKPT_HF_MODEL_ONLY")))
    probe = Probe()
    callbacks = [probe] if os.environ.get("CKPT_HF_NO_COMMIT") else \
        [probe, ckptfs.hf.CommitCallback()]
    t = Trainer(model=model, args=args, train_dataset=Toy(), callbacks=callbacks)
    assert t.args.world_size == WS and t.args.process_index == RANK, \
        (t.args.world_size, t.args.process_index)
    # "last": the Trainer's get_last_checkpoint picks the checkpoint-N
    t.train(resume_from_checkpoint=True if resume == "last" else
            os.path.join(mount, resume) if resume else None)
    # the final model, written by rank 0 alone (so committed by it alone),
    # published as "final" over the one of an earlier run
    t.save_model(os.path.join(mount, "final.new"))
    if RANK == 0:
        ckptfs.commit(mount, "final.new", solo=True, replace="final")
    result(steps=probe.steps, listing=sorted(os.listdir(mount)),
           model=digests(t.model.state_dict()), optimizer=optimizer_digests(t.optimizer))


def accelerate_job(root):
    from accelerate import Accelerator

    mount = os.path.join(root, f"rank{RANK}")

    def build(seed):
        """A new Accelerator (it saves and loads what it prepared) and model."""
        acc = Accelerator(cpu=True)
        assert acc.num_processes == WS and acc.process_index == RANK
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return (acc, *acc.prepare(model, opt, sched))

    def train(acc, model, opt, sched, steps=3):
        for _ in range(steps):  # data and dropout from this rank's RNG
            acc.backward(model(torch.randn(4, 8)).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        return (digests(acc.unwrap_model(model).state_dict()), optimizer_digests(opt),
                sched.get_last_lr())

    run = build(0)
    torch.manual_seed(1000 + RANK)
    train(*run)
    ckptfs.hf.save_state(run[0], mount, "acc-3")
    uninterrupted = train(*run)

    run = build(5)  # other weights, a fresh optimizer, scheduler and RNG
    ckptfs.hf.load_state(run[0], mount, "acc-3")
    resumed = train(*run)

    run = build(5)  # the control: rank 1 goes on with another RNG state
    ckptfs.hf.load_state(run[0], mount, "acc-3")
    if RANK == 1:
        torch.manual_seed(1)
    control = train(*run)
    listing = sorted(os.listdir(os.path.join(mount, "acc-3")))

    # saved again under the committed name, as a resumed job saves its
    # names again: overwrite=False refuses; the default replaces it, as
    # Accelerate's save_state overwrites its directory (its step recorded)
    try:
        ckptfs.hf.save_state(run[0], mount, "acc-3", overwrite=False)
        refused = None
    except ckptfs.CkptfsError as e:
        refused = str(e)
    ckptfs.hf.save_state(run[0], mount, "acc-3", step=6)
    step = os.getxattr(os.path.join(mount, "acc-3"), "user.ckpt.step").decode()
    run = build(9)
    ckptfs.hf.load_state(run[0], mount, "acc-3")
    replaced = digests(run[0].unwrap_model(run[1]).state_dict())
    result(listing=listing, uninterrupted=uninterrupted, resumed=resumed, control=control,
           refused=refused, replaced=replaced, listing_after=sorted(os.listdir(mount)),
           step=step)


if __name__ == "__main__":
    scenario, root = sys.argv[1:3]
    if scenario == "trainer":
        trainer_job(root, *sys.argv[3:])
    else:
        accelerate_job(root)
    # torch's gloo threads, still up at exit, abort the process now and then
    # ("terminate called without an active exception"), also after
    # destroy_process_group() while a model or mesh still holds the group:
    # leave without the interpreter's teardown once every rank is done
    import torch.distributed as dist
    if dist.is_initialized():   # not at 1 process
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
