#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel times (a --csv log with gpu__time_duration.sum) by kernel name:
a Markdown table of the kernels, largest total first, with their count and share of the time.

    python3 tools/ncu_summary.py ncu.csv [--top N]
"""
import argparse
import collections
import csv
import io
import sys

UNIT_SECONDS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
                "second": 1.0, "s": 1.0}


def kernel_times(text):
    """(kernel name, seconds) for each timed launch; ncu's own ==PROF== lines are skipped."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        yield row["Kernel Name"], value * UNIT_SECONDS[row["Metric Unit"]]


def short_name(name):
    """A kernel's name without its template arguments and parameter list, which can run to pages."""
    for stop in "(<":
        cut = name.find(stop)
        if cut > 0:
            name = name[:cut]
    return name.replace("void ", "")[:90]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.csv, errors="replace") as f:
        launches = list(kernel_times(f.read()))
    if not launches:
        print(f"no gpu__time_duration.sum rows in {args.csv}")
        return 1
    total = collections.Counter()
    count = collections.Counter()
    for name, seconds in launches:
        total[short_name(name)] += seconds
        count[short_name(name)] += 1
    all_seconds = sum(total.values())
    print(f"{len(launches)} launches, {all_seconds * 1e3:.1f} ms of kernel time\n")
    print("| kernel | launches | total ms | share | mean us |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds in total.most_common(args.top):
        print(f"| `{name}` | {count[name]} | {seconds * 1e3:.2f} | {seconds / all_seconds:.1%} "
              f"| {seconds / count[name] * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
