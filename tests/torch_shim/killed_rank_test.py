# A rank SIGKILLed while the others wait for an all_reduce over the dtrain backend: the
# survivors' pending Work.wait() must raise dtrain's error naming the lost rank, not hang until
# the group's timeout. `python3 killed_rank_test.py` starts WORLD ranks of itself as a torchrun
# worker would be started (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), not under dtrun, whose
# monitor would stop the survivors as soon as the victim died. The victim is the last rank; it
# kills itself once every survivor has issued the all_reduce and is about to wait.
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

WORLD = int(os.environ.get("KILLED_RANK_TEST_WORLD", "3"))
VICTIM = WORLD - 1
DEADLINE_S = 120  # the whole run; the group's own timeout (60 s) is shorter


def worker():
    import torch
    import torch.distributed as dist

    import dtrain_torch

    torch.set_num_threads(1)
    dist.init_process_group("dtrain", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(1 << 18)
    dist.all_reduce(t)  # every rank is in the group before one goes
    if rank == VICTIM:
        store.wait([f"issued/{r}" for r in range(world) if r != VICTIM])
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.all_reduce(t, async_op=True)
    store.set(f"issued/{rank}", "1")
    try:
        work.wait()
    except dtrain_torch.TimeoutError as e:
        print(f"rank {rank}: FAIL: waited out the group's timeout instead of seeing rank {VICTIM} go: {e}", flush=True)
        return 1
    except dtrain_torch.Error as e:
        after_ms = (time.time() - float(store.get("killed_at").decode())) * 1000
        print(f"rank {rank}: wait() raised {type(e).__module__}.{type(e).__name__} {after_ms:.0f} ms after the kill: {e}",
              flush=True)
        return 0 if f"rank {VICTIM}" in str(e).lower() else 1
    print(f"rank {rank}: FAIL: wait() returned although rank {VICTIM} was killed", flush=True)
    return 1


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    failed = []
    deadline = time.monotonic() + DEADLINE_S
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            failed.append(f"rank {rank} still running after {DEADLINE_S} s")
        for line in out.splitlines():
            if "Logging before InitGoogleLogging" not in line and not line.startswith("W2"):
                print(f"[rank {rank}] {line}")
        want = -signal.SIGKILL if rank == VICTIM else 0
        if proc.returncode != want:
            failed.append(f"rank {rank} ended with {proc.returncode}, expected {want}")
    if failed:
        print("killed_rank_test FAILED: " + "; ".join(failed))
        return 1
    print(f"killed_rank_test ok: world {WORLD}, rank {VICTIM} killed, every survivor's wait() raised dtrain's error naming it")
    return 0


if __name__ == "__main__":
    sys.exit(worker() if "--worker" in sys.argv else main())
