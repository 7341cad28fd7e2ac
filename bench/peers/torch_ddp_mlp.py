#!/usr/bin/env python3
"""PyTorch peer for dtrain's MLP training step, alone and data-parallel (DDP over gloo).

Model    8 x [Linear(1024,1024) + ReLU], then Linear(1024,10): 8,407,050 fp32 parameters,
         the same initial values on every rank (seed 1234).
Data     batch 32 per rank; 4 random batches made up front (seed 1000 + rank) and cycled,
         so that making data is never timed.
Step     zero_grad(set_to_none=True), forward, cross-entropy, backward (plus gradient
         averaging across ranks), SGD(lr=0.01).step(); torch.set_num_threads(1).
Timing   5 warm-up steps, a barrier, 30 timed steps; each step's time is the slowest
         rank's (one all_reduce(MAX) over the per-step vectors at the end); the median is
         step_ms, with min_ms and mean_ms beside it.
Memory   peak_rss_mb = largest VmHWM (this process's peak resident set, /proc/self/status)
         over the ranks when the variant ends, in MiB.

Started directly (no RANK in the environment): the plain model, impl=torch-single.
Under torchrun_py311.py or any launcher that sets RANK/WORLD_SIZE/MASTER_* (world 1
included), one launch runs, one after the other:
  impl=torch-ddp        DistributedDataParallel(bucket_cap_mb=25): each bucket's allreduce
                        starts while backward is still producing the other gradients;
  impl=torch-nooverlap  the plain model; after backward every gradient is flattened into
                        one buffer, allreduced once, divided by the world size and copied
                        back, then the optimizer steps;
  impl=torch-compute    the plain model with no communication at all (each rank steps on
                        its own gradients): what a step would cost if communication were
                        free, with the same number of ranks sharing the machine.
--modes picks which (default ddp,nooverlap); run one per launch to measure each one's
peak memory alone.
After each variant the ranks compare their parameters and rank 0 prints a WARNING line if
they differ. Rank 0 prints one line per variant:

  RESULT ddp_mlp impl=torch-ddp world=2 batch=32 threads=1 blas=openblas steps=30 step_ms=.. min_ms=.. mean_ms=.. samples_per_s=.. peak_rss_mb=..

blas= names the BLAS library mapped into the process (Debian's torch calls whatever
libblas.so.3 resolves to; see README.md).
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BATCH = 32
WIDTH = 1024
HIDDEN_LAYERS = 8
CLASSES = 10
N_BATCHES = 4


def loaded_blas():
    """Name of the BLAS found in /proc/self/maps: openblas, blis, mkl, reference, libblas, unknown."""
    try:
        with open("/proc/self/maps") as maps_file:
            maps = maps_file.read()
    except OSError:
        return "unknown"
    for marker, name in (("openblas", "openblas"), ("libblis", "blis"), ("libmkl", "mkl"),
                         ("/blas/libblas.so", "reference"), ("libblas.so", "libblas")):
        if marker in maps:
            return name
    return "unknown"


def peak_rss_mib():
    """This process's VmHWM in MiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # the value is in kB
    except OSError:
        pass
    return 0.0


def make_model():
    torch.manual_seed(1234)
    layers = []
    for _ in range(HIDDEN_LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        layers.append(nn.ReLU())
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def make_data(rank):
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(N_BATCHES)]
    labels = [torch.randint(0, CLASSES, (BATCH,), generator=gen) for _ in range(N_BATCHES)]
    return inputs, labels


class Runner:
    def __init__(self, args, world, rank):
        self.args, self.world, self.rank = args, world, rank
        self.inputs, self.labels = make_data(rank)

    def train_step(self, model, opt, i, after_backward=None):
        opt.zero_grad(set_to_none=True)
        k = i % N_BATCHES
        F.cross_entropy(model(self.inputs[k]), self.labels[k]).backward()
        if after_backward is not None:
            after_backward()
        opt.step()

    def time_steps(self, step):
        """Durations (s) of the timed steps, each the slowest rank's."""
        warmup, steps = self.args.warmup, self.args.steps
        for i in range(warmup):
            step(i)
        if self.world > 1:
            dist.barrier()
        mine = []
        for i in range(warmup, warmup + steps):
            start = time.perf_counter()
            step(i)
            mine.append(time.perf_counter() - start)
        if self.world == 1:
            return mine
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.tolist()

    def largest_rss(self):
        rss = torch.tensor([peak_rss_mib()], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        return float(rss[0])

    def report(self, impl, durations):
        rss = self.largest_rss()
        if self.rank != 0:
            return
        median = statistics.median(durations)
        if self.args.backend == "dtrain":
            impl = impl.replace("torch-", "dtrain_torch-", 1)  # the same program, dtrain underneath
        print(f"RESULT ddp_mlp impl={impl} world={self.world} batch={BATCH} threads={self.args.threads} "
              f"blas={loaded_blas()} steps={self.args.steps} step_ms={median * 1e3:.2f} "
              f"min_ms={min(durations) * 1e3:.2f} mean_ms={statistics.fmean(durations) * 1e3:.2f} "
              f"samples_per_s={self.world * BATCH / median:.1f} peak_rss_mb={rss:.1f}", flush=True)

    def check_same_parameters(self, model, label):
        total = torch.tensor([sum(p.detach().double().sum().item() for p in model.parameters())],
                             dtype=torch.float64)
        low, high = total.clone(), total.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        gap = float(high[0] - low[0])
        if self.rank == 0 and abs(gap) > 1e-6 * max(1.0, abs(float(high[0]))):
            print(f"WARNING {label}: ranks hold different parameters "
                  f"(sums {float(low[0])} .. {float(high[0])})", flush=True)

    def single(self):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.report("torch-single", self.time_steps(lambda i: self.train_step(model, opt, i)))

    def ddp(self):
        model = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=25)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.report("torch-ddp", self.time_steps(lambda i: self.train_step(model, opt, i)))
        self.check_same_parameters(model.module, "torch-ddp")

    def nooverlap(self):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        params = list(model.parameters())

        def average_gradients():
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat.div_(self.world)
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)

        self.report("torch-nooverlap",
                    self.time_steps(lambda i: self.train_step(model, opt, i, average_gradients)))
        self.check_same_parameters(model, "torch-nooverlap")

    def compute(self):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.report("torch-compute", self.time_steps(lambda i: self.train_step(model, opt, i)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", default="ddp,nooverlap", help="variants at world >= 2 (ddp, nooverlap, compute)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "dtrain"),
                        help="dtrain: dtrain's torch.distributed backend (import dtrain_torch), impl=dtrain_torch-<mode>")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if "RANK" not in os.environ:
        Runner(args, 1, 0).single()
        return

    if args.backend == "dtrain":
        import dtrain_torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend=args.backend, init_method="env://")
    runner = Runner(args, dist.get_world_size(), dist.get_rank())
    for mode in args.modes.split(","):
        if mode not in ("ddp", "nooverlap", "compute"):
            raise SystemExit(f"torch_ddp_mlp.py: unknown mode {mode!r}")
        getattr(runner, mode)()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
