#!/usr/bin/env python3
"""Draws the loss curves of a `gpt --metrics FILE` run (one JSON object a line) to a PNG.

    scripts/plot_metrics.py gpt-metrics.jsonl                 # writes gpt-metrics.png
    scripts/plot_metrics.py gpt-metrics.jsonl -o curves.png --title "4 ranks, fortunes"

Left: training loss (the mean over each logged window of steps) and validation loss against
the step; right: learning rate and gradient norm. Uses Debian's python3-matplotlib (installed
by scripts/setup.sh) with the non-interactive Agg backend, so it runs without a display.
Lines that are not JSON objects are reported and skipped; a file without any is an error.
"""
import argparse
import json
import os
import sys

try:
    import matplotlib
except ModuleNotFoundError:
    # `python3` on PATH may be an interpreter without Debian's packages (pyenv, a venv).
    print(f"plot_metrics.py: matplotlib is missing for {sys.executable}: install it with "
          "'sudo apt-get install python3-matplotlib' and run this script with /usr/bin/python3 "
          "(or 'pip install matplotlib' for this interpreter)", file=sys.stderr)
    sys.exit(2)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)


def read(path):
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                print(f"plot_metrics.py: {path}:{number}: not JSON ({e}); skipped", file=sys.stderr)
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def series(rows, key):
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="the --metrics file of examples/gpt")
    parser.add_argument("-o", "--output", help="PNG to write (default: the metrics file with .png)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    rows = read(args.metrics)
    if not rows:
        sys.exit(f"plot_metrics.py: {args.metrics} holds no metrics lines (run gpt with --metrics FILE)")
    output = args.output or os.path.splitext(args.metrics)[0] + ".png"

    fig, (losses, rates) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("loss", "training loss", "-"), ("val_loss", "validation loss", "o-")):
        x, y = series(rows, key)
        if x:
            losses.plot(x, y, style, label=label, markersize=4)
    losses.set_xlabel("step")
    losses.set_ylabel("cross-entropy (nats per byte)")
    losses.grid(alpha=0.3)
    losses.legend()
    x, y = series(rows, "lr")
    rates.plot(x, y, color="tab:green", label="learning rate")
    rates.set_xlabel("step")
    rates.set_ylabel("learning rate")
    norm = rates.twinx()
    x, y = series([r for r in rows if r.get("step", 0) > 0], "grad_norm")
    norm.plot(x, y, color="tab:red", alpha=0.6, label="gradient norm")
    norm.set_ylabel("gradient norm (before clipping)")
    rates.legend(loc="upper right")
    norm.legend(loc="center right")
    fig.suptitle(args.title or os.path.basename(args.metrics))
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    last = rows[-1]
    print(f"plot_metrics.py: {len(rows)} lines, last step {last['step']}"
          f"{', validation loss %.4f' % last['val_loss'] if last.get('val_loss') is not None else ''}; wrote {output}")


if __name__ == "__main__":
    main()
