# A torchrun-style PyTorch program: reads only the standard environment
# (init_method="env://"), trains a tiny DDP model for a few steps on gloo, and
# checks that the ranks' parameters agree. Run by dtrun_e2e_test under
# `dtrun --nproc 2 /usr/bin/python3 torch_ddp_script.py`.
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
torch.set_num_threads(1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(100 + rank)
for step in range(5):
    x = torch.randn(4, 8, generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
assert all(torch.equal(gathered[0], g) for g in gathered), "ranks' parameters differ"
print(f"DDP ok world={world} loss={loss.item():.4f}", flush=True)
dist.destroy_process_group()
