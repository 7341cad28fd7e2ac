#!/usr/bin/env python3
"""Medians per configuration, and ratios between two implementations, of RESULT lines.

    summarize.py FILE...                              one line per configuration: medians, runs=
    summarize.py FILE... --ratio dtrain:libtorch      RATIO lines, A / B for every shared metric
    summarize.py FILE... --ratio dtrain:redis --ignore cmd

Input: lines `RESULT <workload> key=value ...`; anything else is skipped.
  metrics     keys ending in a unit: _ns _us _ms _s _mb _GBps _per_s gflops _nats (numeric values);
  ignored     reps, ops, counts of batches (fast_batches, slow_batches), and the keys named by --ignore;
  identity    every other key (impl, world, bytes, op, clients, threads, blas, ...).
Lines with the same workload and identity are repetitions of one configuration; each metric
is summarized by its median over them:
    RESULT <workload> <identity> runs=<count> <metric>=<median> ...
With --ratio A:B, two configurations pair when their identities differ only in impl (A and
B); every metric both have is printed as ratio_<metric> = median(A) / median(B):
    RATIO <workload> a=A b=B <identity without impl> ratio_<metric>=... ...
For times (_ns, _us, _ms, _s), memory (_mb) and losses (_nats) below 1 means A is faster / smaller; for
bandwidth, rates and gflops above 1 means A is faster. --ignore is for keys only one side
prints (cmd= on Redis lines, blas= against a runtime without BLAS) so that the sides pair.
"""
import argparse
import re
import statistics
import sys

UNIT = re.compile(r"(_ns|_us|_ms|_s|_mb|_GBps|_per_s|gflops|_nats)$")
ALWAYS_IGNORED = ("reps", "ops", "fast_batches", "slow_batches")


def read_results(paths, ignored):
    """{(workload, identity tuple): [ {metric: value}, ... one per line ]} in input order."""
    configs = {}
    for path in paths:
        with open(path) as lines:
            for line in lines:
                fields = line.split()
                if len(fields) < 2 or fields[0] != "RESULT":
                    continue
                identity, metrics = [], {}
                for field in fields[2:]:
                    key, eq, value = field.partition("=")
                    if not eq or key in ignored:
                        continue
                    if UNIT.search(key):
                        try:
                            metrics[key] = float(value)
                            continue
                        except ValueError:
                            pass  # e.g. "na": keep it as part of the identity
                    identity.append((key, value))
                configs.setdefault((fields[1], tuple(identity)), []).append(metrics)
    return configs


def median_metrics(runs):
    names = []
    for run in runs:
        names += [name for name in run if name not in names]
    return {name: statistics.median(run[name] for run in runs if name in run) for name in names}


def words(pairs):
    return " ".join(f"{key}={value}" for key, value in pairs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="files with RESULT lines")
    parser.add_argument("--ratio", metavar="A:B", help="pair impl=A with impl=B")
    parser.add_argument("--ignore", default="", help="comma list of keys to leave out of the identity")
    args = parser.parse_args()

    ignored = set(ALWAYS_IGNORED) | {key for key in args.ignore.split(",") if key}
    configs = read_results(args.files, ignored)
    medians = {config: median_metrics(runs) for config, runs in configs.items()}

    if not args.ratio:
        for (workload, identity), values in medians.items():
            metrics = " ".join(f"{name}={value:.6g}" for name, value in values.items())
            print(f"RESULT {workload} {words(identity)} runs={len(configs[(workload, identity)])} {metrics}".rstrip())
        return 0

    impl_a, sep, impl_b = args.ratio.partition(":")
    if not sep or not impl_a or not impl_b:
        parser.error("--ratio takes IMPL_A:IMPL_B")
    by_impl = {}  # (workload, impl, identity without impl) -> medians
    for (workload, identity), values in medians.items():
        impls = [value for key, value in identity if key == "impl"]
        if impls:
            rest = tuple((key, value) for key, value in identity if key != "impl")
            by_impl[(workload, impls[0], rest)] = values
    for (workload, impl, rest), a_values in by_impl.items():
        b_values = by_impl.get((workload, impl_b, rest)) if impl == impl_a else None
        if b_values is None:
            continue
        ratios = " ".join(f"ratio_{name}={value / b_values[name]:.3f}"
                          for name, value in a_values.items() if b_values.get(name))
        print(f"RATIO {workload} a={impl_a} b={impl_b} {words(rest)} {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
