#!/usr/bin/env python3
"""PyTorch 1.13 peer of `examples/gpt --sharding zero1`: the GPT job of torch_gpt.py (same model,
data, windows, AdamW groups, schedule and clipping) with the optimizer state sharded by
torch.distributed.optim.ZeroRedundancyOptimizer over DDP on gloo: the only sharded optimizer
PyTorch 1.13 runs on the CPU (its FSDP needs CUDA). ZeroRedundancyOptimizer keeps DDP's
allreduce of the whole gradient, steps AdamW on this rank's share of the parameters, then
broadcasts every rank's share to the others.

  /usr/bin/python3 bench/peers/torchrun_py311.py --nproc_per_node 2 --standalone bench/peers/torch_zero_gpt.py \\
      --layers 12 --width 512 --heads 8 --context 128 --global-batch 8 --steps 6

Rank 0 prints the keys of `gpt --bench` (peak_rss_mb: the largest VmHWM over the ranks, its
peak reset after the model and optimizer were built, as gpt --bench does; fixed_rss_mb: VmRSS
before the model was built):

  RESULT gpt impl=torch-zero world=2 global_batch=8 model=L12-H8-C512-T128 steps=6 step_ms=.. tokens_per_s=.. peak_rss_mb=.. val_loss_nats=.. sharding=zero1 fixed_rss_mb=..
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import torch_gpt as job


def rss_mib(key):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024.0
    return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=job.FORTUNES)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr", type=float, default=2e-4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--bench-warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "RANK" not in os.environ:
        raise SystemExit("torch_zero_gpt.py: run it under torchrun (bench/peers/torchrun_py311.py)")
    dist.init_process_group(backend="gloo", init_method="env://")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.global_batch % world:
        raise SystemExit(f"torch_zero_gpt.py: --global-batch {args.global_batch} is not divisible by {world} ranks")
    per_rank, t = args.global_batch // world, args.context
    train_bytes, val_bytes = job.fortunes_split(args.data)
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8)
    windows = len(train) - t

    fixed = rss_mib("VmRSS:")
    torch.manual_seed(args.seed)
    model = job.Gpt(256, t, args.layers, args.heads, args.width)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(job.decay_groups(model, args.weight_decay), optimizer_class=torch.optim.AdamW,
                                  lr=args.lr, betas=(0.9, 0.95))
    with open("/proc/self/clear_refs", "w") as clear:  # the peak of training from here (as gpt --bench)
        clear.write("5")
    start = None
    for step in range(args.steps):
        if step == args.bench_warmup:
            dist.barrier()
            start = time.perf_counter()
        x, y = job.gather(train, job.window_starts(args.seed, step, args.global_batch, world, rank, per_rank, windows), t)
        for group in opt.param_groups:
            group["lr"] = job.lr_at(step, args.lr, args.warmup, args.steps, args.min_lr)
        opt.zero_grad(set_to_none=True)
        job.lm_loss(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip > 0 else 1e30)
        opt.step()
    seconds = time.perf_counter() - start
    memory = torch.tensor([rss_mib("VmHWM:"), fixed])
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    val_loss = job.validation_loss(model, val, t, args.eval_windows, world, rank)
    if rank == 0:
        timed = args.steps - args.bench_warmup
        print(f"RESULT gpt impl=torch-zero world={world} global_batch={args.global_batch} "
              f"model=L{args.layers}-H{args.heads}-C{args.width}-T{t} steps={args.steps} "
              f"step_ms={1e3 * seconds / timed:.3f} tokens_per_s={timed * args.global_batch * t / seconds:.1f} "
              f"peak_rss_mb={memory[0].item():.1f} val_loss_nats={val_loss:.5f} sharding=zero1 "
              f"fixed_rss_mb={memory[1].item():.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
