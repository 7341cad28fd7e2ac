# PyTorch's DistributedDataParallel over the dtrain backend against the same training over gloo,
# in one job: `dtrun --nproc N /usr/bin/python3 ddp_test.py`. The default group is dtrain's, a
# gloo group beside it carries the reference; both models start from the same parameters, see
# the same batches and take 20 SGD steps. Parameters must agree within float32 reassociation
# (the two backends sum the ranks' gradients in different orders), and every rank must hold the
# same parameters. Cases: plain, find_unused_parameters (a branch only some steps use), and
# comm hooks (PyTorch's allreduce hook, which chains on Work.get_future(), and its fp16
# compression hook, whose float16 all-reduce rounds: a looser bound).
import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import dtrain_torch  # noqa: F401  (registers "dtrain")

torch.set_num_threads(1)
dist.init_process_group("dtrain")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
STEPS = 20


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)  # buffers: float32 running stats, int64 counter
        self.out = torch.nn.Linear(32, 4)
        self.side = torch.nn.Linear(32, 4)  # used on even steps only

    def forward(self, x, use_side):
        h = torch.relu(self.norm(self.inp(x)))
        y = self.out(h)
        return y + self.side(h) if use_side else y


def train(model, group, find_unused, hook):
    ddp = DDP(model, process_group=group, find_unused_parameters=find_unused)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard, same on both runs
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=gen)
        target = torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x, use_side=(step % 2 == 0) if find_unused else True), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat_parameters(model), flat_buffers(model)


def flat_parameters(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def flat_buffers(model):
    # BatchNorm's running statistics are each rank's own after the last forward (DDP broadcasts
    # rank 0's at the start of a forward), so they are compared between backends, not ranks.
    return torch.cat([b.detach().flatten().double() for b in model.buffers()])


def same_on_every_rank(flat, group):
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(gathered[0], g) for g in gathered)


cases = [
    ("plain", False, None, 1e-5),
    ("find_unused_parameters", True, None, 1e-5),
    ("allreduce_hook", False, default_hooks.allreduce_hook, 1e-5),
    ("fp16_compress_hook", False, default_hooks.fp16_compress_hook, 2e-2),
]
for name, find_unused, hook, tolerance in cases:
    torch.manual_seed(0)
    start = Net()
    over_dtrain, buffers_dtrain = train(copy.deepcopy(start), None, find_unused, hook)
    over_gloo, buffers_gloo = train(copy.deepcopy(start), gloo, find_unused, hook)
    diff = (over_dtrain - over_gloo).abs().max().item()
    buffer_diff = (buffers_dtrain - buffers_gloo).abs().max().item()
    moved = (over_dtrain - flat_parameters(start)).abs().max().item()
    print(f"{name}: world={world} max |dtrain - gloo| = {diff:.3g} (buffers {buffer_diff:.3g}) after {STEPS} steps "
          f"(parameters moved up to {moved:.3g})", flush=True)
    if not moved > 1e-3:
        raise AssertionError(f"{name}: training did not move the parameters ({moved})")
    bound = tolerance * max(1.0, over_gloo.abs().max().item())
    if not (diff <= bound and buffer_diff <= tolerance * max(1.0, buffers_gloo.abs().max().item())):
        raise AssertionError(f"rank {rank}: {name}: dtrain and gloo differ by {diff} (buffers {buffer_diff}; bound {bound})")
    if not same_on_every_rank(over_dtrain, None):
        raise AssertionError(f"rank {rank}: {name}: ranks hold different parameters over dtrain")
print(f"ddp ok world={world}", flush=True)
dist.destroy_process_group()
