#!/usr/bin/env python3
"""torchrun for Debian 12 (torch 1.13.1 on Python 3.11), with one function repaired.

Why: torchrun parses --redirects and --tee (default "0") with Std.from_str, which looks
the number up by iterating the IntFlag Std. From Python 3.11 on, iterating a Flag yields
only its single-bit members (OUT=1, ERR=2), so "0" (NONE) and "3" (ALL) are not found,
from_str returns None, and torchrun stops in elastic/multiprocessing/api.py:to_map with
"AttributeError: 'NoneType' object has no attribute 'get'" before any worker starts.
torch 2.0 fixed it upstream; Debian 12 ships 1.13.

What: replace Std.from_str by one that converts with Std(value), which works for every
value 0..3, then hand over to torch.distributed.run.main. Arguments are torchrun's own
(torch 1.13 spells --nproc_per_node, --no_python, --monitor_interval with underscores):

    /usr/bin/python3 bench/peers/torchrun_py311.py --nproc_per_node 2 --standalone prog.py
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import api

ONE = re.compile(r"[0-3]")
PER_RANK = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


def parse_std(cls, text):
    """'2' -> Std.ERR; '0:3,1:0' -> {0: Std.ALL, 1: Std.NONE}; anything else: ValueError."""
    text = text.strip()
    if ONE.fullmatch(text):
        return cls(int(text))
    if PER_RANK.fullmatch(text):
        table = {}
        for item in text.split(","):
            rank, value = item.split(":")
            table[int(rank)] = cls(int(value))
        return table
    raise ValueError(f"{text!r}: expected one of 0-3 or rank:value pairs like 0:3,1:0")


api.Std.from_str = classmethod(parse_std)


if __name__ == "__main__":
    from torch.distributed import run

    sys.exit(run.main())
