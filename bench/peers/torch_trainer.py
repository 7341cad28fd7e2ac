#!/usr/bin/env python3
"""PyTorch peer of examples/trainer: the same training job, the PyTorch way.

Data     Fashion-MNIST's gzip'd IDX files (read with gzip + numpy), pixels scaled to
         (p / 255 - 0.2860) / 0.3530 and flattened to 784 floats, labels int64: a
         TensorDataset, a DistributedSampler (shuffle, seed 0, set_epoch each epoch) and a
         DataLoader(batch_size = global batch / world, num_workers = --workers).
Model    MLP 784-256-128-10 with ReLU (--hidden), seed 0; DistributedDataParallel over gloo
         (default 25 MB buckets) when launched with RANK set, world 1 included. --device cuda:
         the model on cuda:<LOCAL_RANK mod GPUs>, batches copied there each step, DDP over
         NCCL, as the trainer's --device cuda.
Step     zero_grad(set_to_none=True), forward, cross-entropy, backward (gradients averaged
         by DDP), AdamW(lr 1e-3, weight_decay 1e-4) with the learning rate set per step on a
         cosine schedule, as the trainer does; torch.set_num_threads(1).
Timing   --warmup steps, a barrier, then --steps timed steps (data loading included, as in
         the trainer's loop); samples_per_s = steps x global batch / rank 0's wall time (the
         ranks move in lockstep: every step ends with DDP's allreduce).
Recovery (bench/run_recovery_bench.sh) the torchrun way: --checkpoint-every N --checkpoint-dir D:
         after every N-th step rank 0 saves model, optimizer and step to D/checkpoint.pt
         (written to a temporary file, fsync'd, renamed over the old one); on start every
         rank resumes from it if it exists (the sampler continues at that step's batch).
         --fail-at RANK:STEP: that rank SIGKILLs itself after the forward of step STEP, on
         the first attempt only (TORCHELASTIC_RESTART_COUNT 0); run under torchrun
         --max_restarts 1, which restarts every rank. --step-log FILE: the trainer's
         --step-log lines, "STEP RESTART WORLD NS" from rank 0 per completed step (STEP from 0,
         RESTART = TORCHELASTIC_RESTART_COUNT, NS = CLOCK_REALTIME in ns), "kill STEP RANK NS"
         from the rank that kills itself, and "start RESTART NS" from rank 0 when its
         process began (before importing torch).

  /usr/bin/python3 bench/peers/torchrun_py311.py --nproc_per_node 2 --standalone \\
      bench/peers/torch_trainer.py --data /usr/share/datasets/fashion-mnist

Rank 0 prints one line (the same keys as `trainer --bench`):

  RESULT trainer impl=torch device=cpu world=2 global_batch=128 model=784-256-128-10 optimizer=adamw steps=300 step_ms=.. samples_per_s=..
"""
import time

PROCESS_START_NS = time.time_ns()  # before the imports below: for "start" in --step-log

import argparse
import gzip
import math
import os
import signal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MEAN, STD = 0.2860, 0.3530


def read_idx(path):
    """An unsigned-byte IDX file (gzip'd) as a numpy array of its declared shape."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise SystemExit(f"torch_trainer.py: {path} is not an unsigned-byte IDX file")
    ndims = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndims)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndims)
    if data.size != int(np.prod(dims)):
        raise SystemExit(f"torch_trainer.py: {path} holds {data.size} bytes, its header declares {dims}")
    return data.reshape(dims)


def load(data_dir, prefix):
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(images.reshape(images.shape[0], -1).astype(np.float32) / 255.0)
    x = (x - MEAN) / STD
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose next epoch can start `skip` indices in (a resume mid-epoch)."""

    skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class StepLog:
    """--step-log: lines appended and flushed at once, each ending in CLOCK_REALTIME ns."""

    def __init__(self, path):
        self.file = open(path, "a") if path else None

    def write(self, line, ns=None):
        if self.file:
            self.file.write(f"{line} {time.time_ns() if ns is None else ns}\n")
            self.file.flush()


def save_checkpoint(path, model, opt, step):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def make_model(hidden):
    torch.manual_seed(0)
    layers, width = [], 784
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--hidden", default="256,128")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (default 0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (default 0: none)")
    parser.add_argument("--checkpoint-dir", default="", help="where --checkpoint-every writes and resume reads")
    parser.add_argument("--fail-at", default="", metavar="RANK:STEP", help="that rank SIGKILLs itself in that step (first attempt only)")
    parser.add_argument("--step-log", default="", metavar="FILE", help="append step, kill and start lines (see above)")
    args = parser.parse_args()
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fail_rank, fail_step = (int(v) for v in args.fail_at.split(":")) if args.fail_at else (-1, -1)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group(backend="nccl" if args.device == "cuda" else "gloo", init_method="env://")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if args.global_batch % world:
        raise SystemExit(f"torch_trainer.py: --global-batch {args.global_batch} is not divisible by {world} ranks")

    log = StepLog(args.step_log)
    if rank == 0:
        log.write(f"start {restart}", PROCESS_START_NS)
    train = load(args.data, "train")
    sampler = ResumableSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    hidden = [int(h) for h in args.hidden.split(",")]
    model = make_model(hidden).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total = args.warmup + args.steps
    checkpoint = os.path.join(args.checkpoint_dir, "checkpoint.pt") if args.checkpoint_dir else ""
    start_step = 0
    if checkpoint and rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device)
        (model.module if distributed else model).load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start_step = state["step"]
    start_epoch, sampler.skip = divmod(start_step, len(loader))
    sampler.skip *= args.global_batch // world
    timed_from = max(args.warmup, start_step)

    def batches():
        epoch = start_epoch
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    start = None
    for step in range(start_step, total):
        if step == timed_from:
            if distributed:
                dist.barrier()
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = next(stream)
        x, y = x.to(device), y.to(device)
        for group in opt.param_groups:
            group["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if rank == fail_rank and step == fail_step and restart == 0:
            log.write(f"kill {step} {rank}")
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        if rank == 0:
            log.write(f"{step} {restart} {world}")
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < total:
                save_checkpoint(checkpoint, model.module if distributed else model, opt, step + 1)
    if args.device == "cuda":
        torch.cuda.synchronize()
    if rank == 0 and start is not None:  # None: resumed at the end, nothing timed
        seconds = time.perf_counter() - start
        name = "-".join(["784"] + [str(h) for h in hidden] + ["10"])
        print(f"RESULT trainer impl=torch device={args.device} world={world} global_batch={args.global_batch} model={name} "
              f"optimizer=adamw steps={total - timed_from} step_ms={1e3 * seconds / (total - timed_from):.3f} "
              f"samples_per_s={(total - timed_from) * args.global_batch / seconds:.1f}", flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
