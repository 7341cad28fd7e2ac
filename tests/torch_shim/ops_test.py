# PyTorch's distributed test patterns for the ops the dtrain backend supports, run as real
# processes: `dtrun --nproc N /usr/bin/python3 ops_test.py [--init env|dtrain]`. Every check
# compares against values each rank computes itself; any mismatch raises and the rank exits 1.
import argparse
import math
from datetime import timedelta

import torch
import torch.distributed as dist

import dtrain_torch

parser = argparse.ArgumentParser()
parser.add_argument("--init", choices=["env", "dtrain"], default="env")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("dtrain", init_method=f"{args.init}://")
rank, world = dist.get_rank(), dist.get_world_size()
pg = dist.distributed_c10d._get_default_group()
assert dist.get_backend() == "dtrain", dist.get_backend()
assert isinstance(pg, dtrain_torch.ProcessGroupDtrain), type(pg)
if args.init == "dtrain":
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    assert isinstance(store, dtrain_torch.DtrainStore), type(store)

R = dist.ReduceOp
# Every dtype DDP sends (gradients and buffers) and the reductions that apply to each.
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
checks = 0


def expect_equal(name, got, want):
    global checks
    checks += 1
    if got.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    elif got.dtype.is_floating_point:
        ok = torch.allclose(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)
    else:
        ok = torch.equal(got, want.to(got.dtype))
    if not ok:
        raise AssertionError(f"rank {rank}/{world}: {name}: got {got.flatten()[:8].tolist()}, want {want.flatten()[:8].tolist()}")


def reduced(op, values):
    values = [float(v) for v in values]
    if op == R.SUM:
        return sum(values)
    if op == R.PRODUCT:
        return math.prod(values)
    if op == R.MIN:
        return min(values)
    if op == R.MAX:
        return max(values)
    if op == R.AVG:
        return sum(values) / len(values)
    raise ValueError(op)


def value_of(r):
    return r + 1  # rank r's contribution: products stay exact in every dtype up to world 4


# ---- all_reduce: dtypes x reduce ops, in place, on a strided view, async -----------------------
for dtype in FLOATS + INTS:
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX] + ([R.AVG] if dtype.is_floating_point else [])
    for op in ops:
        t = torch.full((5, 3), value_of(rank), dtype=dtype)
        dist.all_reduce(t, op=op)
        expect_equal(f"all_reduce {dtype} {op}", t, torch.full((5, 3), reduced(op, [value_of(r) for r in range(world)])))
for op, want in [(R.MAX, True), (R.MIN, world == 1)]:
    t = torch.tensor([rank == 0, True, False])
    dist.all_reduce(t, op=op)
    expect_equal(f"all_reduce bool {op}", t, torch.tensor([want, True, False]))
base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
view = base.t()  # non-contiguous, written in place through the view
dist.all_reduce(view)
expect_equal("all_reduce strided view", base, torch.arange(24, dtype=torch.float32).reshape(4, 6) * (world * (world + 1) / 2))
z = torch.full((3,), complex(rank, 1), dtype=torch.complex64)  # torch sends it as a float view
dist.all_reduce(z)
expect_equal("all_reduce complex64", torch.view_as_real(z), torch.view_as_real(torch.full((3,), complex(world * (world - 1) / 2, world), dtype=torch.complex64)))
empty = torch.empty(0)
dist.all_reduce(empty)
expect_equal("all_reduce empty", empty, torch.empty(0))

# Async: several ops in flight, waited for in reverse order; futures carry the outputs.
tensors = [torch.full((1000 * (i + 1),), float(value_of(rank) * (i + 1))) for i in range(6)]
works = [dist.all_reduce(t, async_op=True) for t in tensors]
for i in reversed(range(len(works))):
    assert works[i].wait()
    assert works[i].is_completed()
    expect_equal(f"async all_reduce #{i}", tensors[i], torch.full_like(tensors[i], (i + 1) * world * (world + 1) / 2))
t = torch.ones(16)
fut = dist.all_reduce(t, async_op=True).get_future()
doubled = fut.then(lambda f: f.value()[0] * 2).wait()
assert fut.value()[0] is not None and fut.value()[0].data_ptr() == t.data_ptr(), "the future's value is the reduced tensor itself"
expect_equal("get_future().then", doubled, torch.full((16,), 2.0 * world))
work = dist.all_reduce(torch.ones(8), async_op=True)
while not work.is_completed():  # polling without wait(), as user code may
    pass
work.wait()

# ---- broadcast from every root, dtypes including the bytes of object collectives ----------------
for root in range(world):
    for dtype in FLOATS + INTS + [torch.bool, torch.uint8, torch.int8, torch.int16]:
        want = (torch.arange(10) % 2 == 0) if dtype == torch.bool else (torch.arange(10) + 3 * root).to(dtype)
        t = want.clone() if rank == root else torch.zeros(10, dtype=dtype)
        dist.broadcast(t, src=root)
        expect_equal(f"broadcast root {root} {dtype}", t, want)

# ---- all_gather (list and into one tensor), out of place ----------------------------------------
for dtype in [torch.float32, torch.float16, torch.int64, torch.uint8]:
    mine = torch.full((3, 2), value_of(rank), dtype=dtype)
    outs = [torch.zeros(3, 2, dtype=dtype) for _ in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        expect_equal(f"all_gather {dtype} from {r}", outs[r], torch.full((3, 2), value_of(r)))
    flat = torch.zeros(world * 3, 2, dtype=dtype)
    dist.all_gather_into_tensor(flat, mine)
    expect_equal(f"all_gather_into_tensor {dtype}", flat, torch.cat([torch.full((3, 2), value_of(r)) for r in range(world)]))
assert dist.all_gather(outs, mine, async_op=True).wait()

# ---- reduce_scatter (list and tensor), reduce to every root ------------------------------------
for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.int64]:
    inputs = [torch.full((4,), value_of(rank) * (j + 1), dtype=dtype) for j in range(world)]
    out = torch.zeros(4, dtype=dtype)
    dist.reduce_scatter(out, inputs)
    expect_equal(f"reduce_scatter {dtype}", out, torch.full((4,), (rank + 1) * world * (world + 1) / 2))
    out = torch.zeros(4, dtype=dtype)
    dist.reduce_scatter_tensor(out, torch.cat(inputs))
    expect_equal(f"reduce_scatter_tensor {dtype}", out, torch.full((4,), (rank + 1) * world * (world + 1) / 2))
for root in range(world):
    t = torch.full((7,), float(value_of(rank)))
    dist.reduce(t, dst=root, op=R.MAX)
    if rank == root:
        expect_equal(f"reduce max to {root}", t, torch.full((7,), float(world)))

# ---- gather, scatter -----------------------------------------------------------------------
for root in range(world):
    mine = torch.full((2, 2), float(value_of(rank)))
    outs = [torch.zeros(2, 2) for _ in range(world)] if rank == root else None
    dist.gather(mine, outs, dst=root)
    if rank == root:
        for r in range(world):
            expect_equal(f"gather to {root} from {r}", outs[r], torch.full((2, 2), float(value_of(r))))
    out = torch.zeros(5, dtype=torch.int64)
    pieces = [torch.full((5,), 10 * root + r, dtype=torch.int64) for r in range(world)] if rank == root else None
    dist.scatter(out, pieces, src=root)
    expect_equal(f"scatter from {root}", out, torch.full((5,), 10 * root + rank))

# ---- all_to_all (lists, sizes per peer) and all_to_all_single (equal and uneven splits) ---------
ins = [torch.full((rank + 1,), float(100 * rank + j)) for j in range(world)]
outs = [torch.zeros(r + 1) for r in range(world)]
dist.all_to_all(outs, ins)
for r in range(world):
    expect_equal(f"all_to_all from {r}", outs[r], torch.full((r + 1,), float(100 * r + rank)))
inp = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
out = torch.zeros(world * 2)
dist.all_to_all_single(out, inp)
expect_equal("all_to_all_single equal", out, torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(world)]))
in_splits = [j + 1 for j in range(world)]  # rank sends j+1 rows to rank j
out_splits = [rank + 1] * world
inp = torch.full((sum(in_splits), 3), float(rank))
out = torch.zeros(sum(out_splits), 3)
dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
expect_equal("all_to_all_single uneven", out, torch.cat([torch.full((rank + 1, 3), float(r)) for r in range(world)]))

# ---- point to point: a ring with isend/irecv, batch_isend_irecv, tags ---------------------------
if world > 1:
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(6)
    reqs = [dist.isend(torch.full((6,), float(rank)), right), dist.irecv(got, left)]
    for req in reqs:
        req.wait()
    expect_equal("isend/irecv ring", got, torch.full((6,), float(left)))
    got2 = torch.zeros(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int64), right),
           dist.P2POp(dist.irecv, got2, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    expect_equal("batch_isend_irecv", got2, torch.full((3,), left))
    a, b = torch.zeros(2), torch.zeros(2)
    if rank == 0:
        dist.send(torch.full((2,), 7.0), 1, tag=2)
        dist.send(torch.full((2,), 5.0), 1, tag=1)
    elif rank == 1:
        w1 = dist.irecv(a, 0, tag=1)
        w2 = dist.irecv(b, 0, tag=2)
        w1.wait()
        w2.wait()
        expect_equal("recv by tag 1", a, torch.full((2,), 5.0))
        expect_equal("recv by tag 2", b, torch.full((2,), 7.0))

# ---- barrier, object collectives (uint8 underneath), subgroups -------------------------------
dist.barrier()
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
assert objs == [{"rank": r, "name": f"r{r}"} for r in range(world)], objs
box = [f"from {rank}", rank] if rank == 0 else [None, None]
dist.broadcast_object_list(box, src=0)
assert box == ["from 0", 0], box
evens = dist.new_group([r for r in range(world) if r % 2 == 0], backend="dtrain")
if rank % 2 == 0:
    t = torch.ones(4)
    dist.all_reduce(t, group=evens)
    expect_equal("subgroup all_reduce", t, torch.full((4,), float(len(range(0, world, 2)))))
gloo = dist.new_group(backend="gloo")  # beside a gloo group in the same job
t = torch.ones(3)
dist.all_reduce(t, group=gloo)
expect_equal("gloo group beside dtrain", t, torch.full((3,), float(world)))

# ---- torch's own store calls on the default group's store -----------------------------------
store = dist.distributed_c10d._get_default_store()
store.set(f"ops_test/{rank}", f"v{rank}")
store.add("ops_test/count", 1)
store.wait([f"ops_test/{r}" for r in range(world)])
assert [store.get(f"ops_test/{r}") for r in range(world)] == [f"v{r}".encode() for r in range(world)]

# ---- what the backend lacks: torch's usual "does not support" error naming the op -------------
def expect_error(name, fn, text, kind=RuntimeError):
    global checks
    try:
        fn()
    except kind as e:
        if text not in str(e):
            raise AssertionError(f"rank {rank}: {name}: error {e!r} lacks {text!r}")
        checks += 1
        return
    raise AssertionError(f"rank {rank}: {name} did not raise")


expect_error("BAND", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.BAND),
             "ProcessGroup dtrain does not support allreduce with reduce op BAND")
expect_error("uint8 reduction", lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint8)),
             "ProcessGroup dtrain does not support allreduce of Byte tensors")
expect_error("recv from any source", lambda: dist.recv(torch.zeros(1)), "does not support recvAnysource")
if world > 1:
    # dtrain's own check, before anything is issued: a shape mismatch names both shapes.
    expect_error("allgather shapes", lambda: dist.all_gather([torch.zeros(2)] * world, torch.zeros(3)), "allgather",
                 dtrain_torch.InvalidArgument)
    # dtrain's who-is-stuck report reaches Python: rank 0 runs an all_reduce the others never join.
    stuck = dist.new_group(backend="dtrain", timeout=timedelta(seconds=2))
    if rank == 0:
        expect_error("who is stuck", lambda: dist.all_reduce(torch.ones(4), group=stuck),
                     "never started #1", dtrain_torch.TimeoutError)
dist.barrier()
print(f"ops ok world={world} init={args.init} checks={checks} backend={pg.dtrain_backend()}", flush=True)
dist.destroy_process_group()
