"""Medians per size of each variant in a file of alternating rounds (benches/peers/alternate.sh).

The file holds sections headed `== NAME round I ...`; in each, the rows whose first two columns
are a size in bytes and an element count, and whose sixth is a time in microseconds (as `cargo xtask perf`,
torch_allreduce.py and mpi_allreduce.c print them) are that variant's times in that round.
Prints, for every size, each variant's median over its rounds (the mean of the two middle
values for an even count) and how many rounds it had; with `--vs NAME`, also every other
variant's median divided by NAME's (above 1: NAME is faster).

    python3 benches/peers/medians.py FILE [--vs NAME]
"""

import argparse
import re
import statistics
from collections import defaultdict


def read(path):
    """{size: {variant: [times]}}, and the variants in the order they first appear."""
    times = defaultdict(lambda: defaultdict(list))
    order = []
    variant = None
    with open(path) as f:
        for line in f:
            head = re.match(r"== (\S+) round", line)
            if head:
                variant = head.group(1)
                if variant not in order:
                    order.append(variant)
                continue
            cols = line.split()
            if variant is None or len(cols) < 6 or not (cols[0].isdigit() and cols[1].isdigit()):
                continue
            try:
                times[int(cols[0])][variant].append(float(cols[5]))
            except ValueError:
                continue
    return times, order


def cell(us):
    """A time in µs: two decimals under 10 µs, one above."""
    return f"{us:.2f}" if us < 10 else f"{us:,.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--vs", help="the variant every other one is divided by")
    a = p.parse_args()
    times, order = read(a.file)
    if a.vs and a.vs not in order:
        raise SystemExit(f"no variant {a.vs!r} in {a.file} (there: {', '.join(order)})")
    others = [v for v in order if a.vs and v != a.vs]
    print("| " + " | ".join(["bytes", *order, "rounds", *(f"{v} ÷ {a.vs}" for v in others)]) + " |")
    print("| ---: " * (len(order) + 2 + len(others)) + "|")
    for size in sorted(times):
        med = {v: statistics.median(t) for v, t in times[size].items() if t}
        cells = [cell(med[v]) if v in med else "–" for v in order]
        counts = "/".join(str(len(times[size].get(v, []))) for v in order)
        ratios = [
            f"{med[v] / med[a.vs]:.2f}" if v in med and a.vs in med else "–" for v in others
        ]
        print("| " + " | ".join([str(size), *cells, counts, *ratios]) + " |")


if __name__ == "__main__":
    main()
