#!/usr/bin/env python3
"""PyTorch peer for bench/collectives_bench: all_reduce(SUM) and broadcast(src 0) of float32
tensors, gloo on the CPU or (--backend nccl) NCCL on cuda:<LOCAL_RANK mod GPUs>, timed the
same way dtrain's collectives_bench times its own (with NCCL a rep ends at
torch.cuda.synchronize()).

Start it with any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT:

    /usr/bin/python3 bench/peers/torchrun_py311.py --nproc_per_node 2 --standalone \\
        bench/peers/torch_allreduce.py --threads 1 --sizes 4K,1M

For every op and size:
  warm-up   max(2, reps // 10) untimed calls (or --warmup);
  reps      200 up to 64 KiB, 50 up to 1 MiB, 15 up to 16 MiB, 7 above (or --reps);
  one rep   barrier, then the timed call (perf_counter around it);
  per rep   the slowest rank's time: after the loop, one all_reduce(MAX) over every
            rank's vector of durations;
  reported  time_us = median of those, min_us = their minimum,
            algbw = bytes / time (GB = 1e9 B), busbw = algbw * 2(n-1)/n for allreduce
            and = algbw for broadcast (the nccl-tests convention).
The allreduce buffer starts at ones and is reset to ones after every 8th timed rep
(outside the timed region) so that repeated sums stay small.

Rank 0 prints, per op and size,
    RESULT allreduce impl=torch-gloo world=2 bytes=4096 reps=200 threads=1 time_us=.. min_us=.. algbw_GBps=.. busbw_GBps=..
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def size_in_bytes(text):
    text = text.strip().upper()
    if text[-1:] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def reps_for(nbytes):
    for limit, reps in ((64 << 10, 200), (1 << 20, 50), (16 << 20, 15)):
        if nbytes <= limit:
            return reps
    return 7


def measure(call, reset, reps, warmup, periodic_reset, finish):
    """Per-rep durations in seconds on this rank (warm-up excluded)."""
    for _ in range(warmup):
        call()
    reset()
    finish()
    durations = []
    for i in range(reps):
        dist.barrier()
        start = time.perf_counter()
        call()
        finish()
        durations.append(time.perf_counter() - start)
        if periodic_reset and i % 8 == 7:
            reset()
            finish()
    return durations


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="message sizes, K/M/G suffixes")
    parser.add_argument("--ops", default="allreduce,broadcast")
    parser.add_argument("--reps", type=int, default=0, help="timed reps per size (0: by size)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up calls per size (0: max(2, reps/10))")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "dtrain"),
                        help="dtrain: dtrain's torch.distributed backend (import dtrain_torch)")
    parser.add_argument("--impl", default="", help="the impl= label (default torch-<backend>)")
    args = parser.parse_args()
    impl = args.impl or f"torch-{args.backend}"

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    finish = lambda: None
    if args.backend == "nccl":
        import os
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        finish = torch.cuda.synchronize
    if args.backend == "dtrain":
        import dtrain_torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend=args.backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    for op in args.ops.split(","):
        if op not in ("allreduce", "broadcast"):
            raise SystemExit(f"torch_allreduce.py: unknown op {op!r}")
        bus_factor = 2.0 * (world - 1) / world if op == "allreduce" else 1.0
        for nbytes in map(size_in_bytes, args.sizes.split(",")):
            tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            if op == "allreduce":
                call = lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            else:
                call = lambda: dist.broadcast(tensor, src=0)
            reps = args.reps or reps_for(nbytes)
            warmup = args.warmup or max(2, reps // 10)
            mine = measure(call, lambda: tensor.fill_(1.0), reps, warmup, op == "allreduce", finish)

            slowest = torch.tensor(mine, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rank == 0:
                per_rep = slowest.cpu().tolist()
                t = statistics.median(per_rep)
                algbw = nbytes / t / 1e9
                print(f"RESULT {op} impl={impl} world={world} bytes={nbytes} reps={reps} "
                      f"threads={args.threads} time_us={t * 1e6:.1f} min_us={min(per_rep) * 1e6:.1f} "
                      f"algbw_GBps={algbw:.3f} busbw_GBps={algbw * bus_factor:.3f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
