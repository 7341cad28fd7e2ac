"""dtrain as a torch.distributed backend.

    import dtrain_torch                      # registers the "dtrain" backend and "dtrain://"
    import torch.distributed as dist
    dist.init_process_group("dtrain")        # under dtrun or torchrun

CPU tensors then go through dtrain's process group (shared memory on one host, Gloo across
hosts, both for several ranks on several hosts). ``init_method="dtrain://"`` also makes
torch.distributed's own store dtrain's (dtrun's TcpStore, or etcd). docs/torch.md has the rest.
"""
from datetime import timedelta

import torch  # noqa: F401  (loads libtorch before the extension that links it)
import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler as _register_rendezvous_handler

from ._C import (  # noqa: F401
    BackendError,
    DesyncError,
    DtrainStore,
    Error,
    InvalidArgument,
    MemberLostError,
    NetworkError,
    NotSupportedError,
    ProcessGroupDtrain,
    TimeoutError,
)

BACKEND = "dtrain"

# Users see (and catch) them as dtrain_torch.<Kind>, not as the extension's.
for _error in (Error, TimeoutError, NetworkError, BackendError, DesyncError, InvalidArgument, NotSupportedError,
               MemberLostError):
    _error.__module__ = __name__


def _create_process_group(options, pg_options=None):
    # torch's extended_api hands one _DistributedBackendOptions: the group's store (a
    # PrefixStore named after the group), rank, size, timeout, name and global ranks.
    if pg_options is not None:
        raise ValueError(f"the dtrain backend takes no pg_options (got {pg_options!r}); "
                         "DT_BACKEND and the other DT_* variables configure it (docs/torch.md)")
    return ProcessGroupDtrain.create(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        str(options.group_id),
        list(options.global_ranks_in_group),
    )


def _dtrain_rendezvous_handler(url, timeout=timedelta(minutes=30), **kwargs):
    # "dtrain://" carries nothing of its own: rank and world size come from init_process_group's
    # arguments (torch puts them in the query) or the launcher's RANK / WORLD_SIZE, the store from
    # dtrun's DT_STORE_ADDR (or etcd, or MASTER_ADDR:MASTER_PORT as env:// would), exactly as
    # dtrain's initProcessGroup finds them.
    import os
    from urllib.parse import parse_qs, urlparse

    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    rank = int(query.get("rank", os.environ.get("RANK", "-1")))
    world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
    if rank < 0 or world_size < 1:
        raise ValueError(
            f"dtrain:// rendezvous: rank {rank} / world size {world_size} unknown: pass rank= and "
            "world_size= to init_process_group or start the program with dtrun or torchrun"
        )
    launcher_store = os.environ.get("DT_STORE_ADDR") or os.environ.get("DT_ETCD_ENDPOINTS")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not launcher_store:
        raise ValueError(
            "dtrain:// rendezvous: torchrun's agent hosts its own store at MASTER_ADDR:MASTER_PORT "
            "(TORCHELASTIC_USE_AGENT_STORE=True), where rank 0 would start dtrain's; use "
            "init_method='env://' (the dtrain backend then starts a store of its own) or start the job with dtrun"
        )
    store = DtrainStore.connect(rank, world_size, timeout)
    yield (store, rank, world_size)
    raise RuntimeError("dtrain:// rendezvous cannot be repeated; create a new process group instead")


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create_process_group, extended_api=True)
    _register_rendezvous_handler("dtrain", _dtrain_rendezvous_handler)
