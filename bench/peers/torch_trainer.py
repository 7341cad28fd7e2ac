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

  /usr/bin/python3 bench/peers/torchrun_py311.py --nproc_per_node 2 --standalone \\
      bench/peers/torch_trainer.py --data /usr/share/datasets/fashion-mnist

Rank 0 prints one line (the same keys as `trainer --bench`):

  RESULT trainer impl=torch device=cpu world=2 global_batch=128 model=784-256-128-10 optimizer=adamw steps=300 step_ms=.. samples_per_s=..
"""
import argparse
import gzip
import math
import os
import time

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
    args = parser.parse_args()
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

    train = load(args.data, "train")
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    hidden = [int(h) for h in args.hidden.split(",")]
    model = make_model(hidden).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total = args.warmup + args.steps

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    start = None
    for step in range(total):
        if step == args.warmup:
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
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if rank == 0:
        name = "-".join(["784"] + [str(h) for h in hidden] + ["10"])
        print(f"RESULT trainer impl=torch device={args.device} world={world} global_batch={args.global_batch} model={name} "
              f"optimizer=adamw steps={args.steps} step_ms={1e3 * seconds / args.steps:.3f} "
              f"samples_per_s={args.steps * args.global_batch / seconds:.1f}", flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
