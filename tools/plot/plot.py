"""Plots and tables of docs/benchmarks.md, from the raw files under docs/results/.

Each figure puts dist beside its peer, measured in the same run: bus bandwidth (left) and time
per call (right) against message size, log axes. Each series is read from a raw file as the
run wrote it: the medians per size of a variant's alternating rounds (`== NAME round I`
sections, as benches/peers/alternate.sh writes them), a block of a file with several tables
(`# ...` title lines), the `# per-call` lines of `perf --bare`, or a markdown table written by
benches/peers/compare-openmpi.sh or compare-gloo.sh. Bus bandwidth is worked out from the
median time as nccl-tests does for all_reduce: bytes / time x 2(n-1)/n.

    python3 tools/plot/plot.py [--out docs/plots] [--tables] [--only NAME]

The store's figure (`store`) is of another shape: set + get round trips a second, dist's
TCPStore server beside PyTorch's libuv server, for each number of clients and value size, the
median of the rounds of `crates/dist-store/bench/compare.sh` (its `round I NAME: roundtrips
...` lines).

`cargo xtask plot` runs it. `--tables` prints each figure's markdown tables instead of drawing.
"""

import argparse
import os
import re
import statistics
import sys
from collections import defaultdict

RESULTS = "docs/results"
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\S+\s+\S+\s+-?\d+\s+([\d.]+)\s")
PER_CALL = re.compile(r"# per-call \S+ (\d+) B: .*medians ([\d.]+) vs ([\d.]+) us")


def rounds(path, variant):
    """{size: median µs} of one variant's `== NAME round I` sections."""
    times = defaultdict(list)
    current = None
    with open(path) as f:
        for line in f:
            head = re.match(r"== (\S+) round", line)
            if head:
                current = head.group(1)
                continue
            m = ROW.match(line)
            if m and current == variant:
                times[int(m.group(1))].append(float(m.group(3)))
    if not times:
        raise SystemExit(f"{path}: no rows of variant {variant!r}")
    return {s: statistics.median(t) for s, t in times.items()}


def block(path, index):
    """{size: µs} of the index-th table of a file whose tables start with `# TITLE` lines."""
    out = defaultdict(dict)
    title = -1
    with open(path) as f:
        for line in f:
            words = line.split()
            if line.startswith("# ") and words[1] not in ("size", "(B)", "per-call"):
                title += 1
                continue
            m = ROW.match(line)
            if m:
                out[title][int(m.group(1))] = float(m.group(3))
    tables = [out[t] for t in sorted(out)]
    if index >= len(tables):
        raise SystemExit(f"{path}: no table {index}")
    return tables[index]


def per_call(path, which):
    """{size: µs} from `perf --bare`'s `# per-call` lines: which = 0 for dist, 1 for bare NCCL."""
    out = {}
    with open(path) as f:
        for line in f:
            m = PER_CALL.match(line)
            if m:
                out[int(m.group(1))] = float(m.group(2 + which))
    if not out:
        raise SystemExit(f"{path}: no per-call lines")
    return out


def table(path, column):
    """{size: µs} of a column of a markdown table whose first column is the size in bytes."""
    out = {}
    head = None
    with open(path) as f:
        for line in f:
            if not line.startswith("|"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if head is None:
                head = cells
                if column not in head:
                    raise SystemExit(f"{path}: no column {column!r} (there: {head})")
                continue
            if cells[0].replace(",", "").isdigit():
                out[int(cells[0].replace(",", ""))] = float(cells[head.index(column)].replace(",", ""))
    return out


def read(source):
    """A series' {size: µs} from its source: (kind, file under docs/results, argument)."""
    kind, path, arg = source
    path = os.path.join(RESULTS, path)
    return {"rounds": rounds, "block": block, "per_call": per_call, "table": table}[kind](path, arg)


# Each figure: a title, the ranks (for bus bandwidth) and pairs of (label, source) for dist and
# its peer, both from the same run. A pair's `ranks` overrides the figure's.
FIGURES = [
    {
        "name": "gpu-nccl",
        "title": "all_reduce on 2 x H200 (NVLink), f32 sum, one process per GPU",
        "ranks": 2,
        "pairs": [
            {
                "run": "2026-11-30, 8d446df",
                "dist": ("dist-nccl", ("block", "2026-11-30-2xH200-8c8398a/8d446df-allreduce-vs-torch.txt", 0)),
                "peer": ("PyTorch 2.11 (NCCL)", ("block", "2026-11-30-2xH200-8c8398a/8d446df-allreduce-vs-torch.txt", 1)),
            },
            {
                "run": "2026-11-30, 0091f25",
                "dist": ("dist-nccl", ("per_call", "2026-11-30-2xH200-efd5e41/0091f25-perf-allreduce.txt", 0)),
                "peer": ("bare ncclAllReduce loop", ("per_call", "2026-11-30-2xH200-efd5e41/0091f25-perf-allreduce.txt", 1)),
            },
            {
                "run": "2026-11-29, reference, not side by side",
                "peer": ("nccl-tests 2.19.6", ("block", "2026-11-29-2xH200-bc21b00/nccl-tests-all_reduce-2xH200.txt", 0)),
            },
        ],
    },
    {
        "name": "openmpi-tcp",
        "title": "all_reduce beside Open MPI 4.1.4 over TCP (loopback), 4 ranks on 2 cores (AMD EPYC)",
        "ranks": 4,
        "pairs": [
            {
                "run": "2026-12-02, 75cc19f, dist over TCP",
                "dist": ("dist, DIST_SHM=0", ("table", "2026-12-02-2core-75cc19f/openmpi-tcp4-shm0.txt", "dist µs")),
                "peer": ("Open MPI, TCP", ("table", "2026-12-02-2core-75cc19f/openmpi-tcp4-shm0.txt", "Open MPI µs")),
            },
            {
                "run": "2026-12-02, 75cc19f, dist's defaults",
                "dist": ("dist, defaults (shared memory)", ("table", "2026-12-02-2core-75cc19f/openmpi-tcp4-defaults.txt", "dist µs")),
                "peer": ("Open MPI, TCP", ("table", "2026-12-02-2core-75cc19f/openmpi-tcp4-defaults.txt", "Open MPI µs")),
            },
        ],
    },
    {
        "name": "openmpi-shm",
        "title": "all_reduce beside Open MPI's shared memory (vader), 4 ranks on 2 cores",
        "ranks": 4,
        "pairs": [
            {
                "run": "2026-12-02, 0d995dd, AMD EPYC, Open MPI 4.1.4",
                "dist": ("dist", ("rounds", "2026-12-02-2core-0d995dd/final-vader.txt", "dist")),
                "peer": ("vader", ("rounds", "2026-12-02-2core-0d995dd/final-vader.txt", "vader")),
            },
            {
                "run": "2026-12-02, d3ca466, Xeon bound to 2 cores, Open MPI 4.1.6",
                "dist": ("dist", ("rounds", "2026-12-02-1xH200-4249335/pinned.txt", "new")),
                "peer": ("vader", ("rounds", "2026-12-02-1xH200-4249335/pinned.txt", "vader")),
            },
            {
                "run": "2026-12-02, bf6f62e, AMD EPYC, every size",
                "dist": ("dist, DIST_DIRECT=0", ("rounds", "2026-12-02-2core-75cc19f/vader4.txt", "copies")),
                "peer": ("vader", ("rounds", "2026-12-02-2core-75cc19f/vader4.txt", "vader")),
            },
        ],
    },
    {
        "name": "gloo",
        "title": "all_reduce beside PyTorch 2.11's Gloo on one host's CPUs",
        "pairs": [
            {
                "run": "4 ranks, 2026-12-02, 4249335, 16-core Xeon",
                "ranks": 4,
                "dist": ("dist", ("rounds", "2026-12-02-1xH200-4249335/cmp4.txt", "new")),
                "peer": ("Gloo", ("rounds", "2026-12-02-1xH200-4249335/cmp4.txt", "gloo")),
            },
            {
                "run": "8 ranks, same run",
                "ranks": 8,
                "dist": ("dist", ("rounds", "2026-12-02-1xH200-4249335/cmp8.txt", "new")),
                "peer": ("Gloo", ("rounds", "2026-12-02-1xH200-4249335/cmp8.txt", "gloo")),
            },
            {
                "run": "16 ranks, same host and day",
                "ranks": 16,
                "dist": ("dist", ("rounds", "2026-12-02-1xH200-4249335/cmp16-committed.txt", "new")),
                "peer": ("Gloo", ("rounds", "2026-12-02-1xH200-4249335/cmp16-committed.txt", "gloo")),
            },
            {
                "run": "16 ranks, 2026-11-30, ca855ca, 32-core Xeon, every size",
                "ranks": 16,
                "dist": ("dist", ("rounds", "2026-11-30-2xH200-ca855ca/ca855ca-gloo16-shm.txt", "dist")),
                "peer": ("Gloo", ("rounds", "2026-11-30-2xH200-ca855ca/ca855ca-gloo16-shm.txt", "gloo")),
            },
        ],
    },
    {
        "name": "many-ranks",
        "title": "all_reduce, 64 ranks on 2 cores (AMD EPYC), beside Open MPI 4.1.4 over TCP",
        "ranks": 64,
        "pairs": [
            {
                "run": "2026-12-01, d39cb9d, dist over TCP",
                "dist": ("dist, DIST_SHM=0", ("table", "2026-12-01-2core-d39cb9d/openmpi64-tcp/table.md", "dist µs")),
                "peer": ("Open MPI, TCP", ("table", "2026-12-01-2core-d39cb9d/openmpi64-tcp/table.md", "Open MPI µs")),
            },
            {
                "run": "2026-12-01, 99ff264, dist's defaults",
                "dist": ("dist, defaults (shared memory)", ("table", "2026-12-01-2core-99ff264/openmpi64-defaults/table.md", "dist µs")),
                "peer": ("Open MPI, TCP", ("table", "2026-12-01-2core-99ff264/openmpi64-defaults/table.md", "Open MPI µs")),
            },
        ],
    },
]


# The store's figure: round trips a second of each server, from one run of compare.sh.
STORE = {
    "name": "store",
    "title": "TCPStore set + get round trips a second, dist's server beside PyTorch 2.15's libuv "
    "server (dist's client, 2 cores)",
    "run": "2026-12-07, a976c45",
    "file": "2026-12-07-2core-a976c45/compare.txt",
    "servers": [("dist", "dist's server"), ("libuv", "PyTorch libuv")],
}
ROUNDTRIP = re.compile(
    r"^round \d+ (\S+):\s+roundtrips clients=(\d+) value_bytes=(\d+) .*set\+get_pairs_per_s=(\d+)"
)


def store_rates(path):
    """{(clients, value bytes): {server: median pairs a second}} of compare.sh's rounds."""
    seen = defaultdict(lambda: defaultdict(list))
    with open(os.path.join(RESULTS, path)) as f:
        for line in f:
            m = ROUNDTRIP.match(line)
            if m:
                seen[(int(m.group(2)), int(m.group(3)))][m.group(1)].append(int(m.group(4)))
    return {k: {s: statistics.median(v) for s, v in by.items()} for k, by in seen.items()}


def store_table():
    rates = store_rates(STORE["file"])
    names = STORE["servers"]
    print(f"\nstore: {STORE['run']} ({STORE['file']})\n")
    print("| clients | value | " + " | ".join(label for _, label in names) + " | dist ÷ libuv |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in names) + " | ---: |")
    for (clients, value), by in sorted(rates.items()):
        cells = " | ".join(f"{by[key]:,.0f}" for key, _ in names)
        print(f"| {clients} | {human(value)} | {cells} | {by['dist'] / by['libuv']:.2f} |")


def store_draw(out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = store_rates(STORE["file"])
    keys = sorted(rates)
    f, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.38
    for i, ((key, label), color) in enumerate(zip(STORE["servers"], ["#1f77b4", "#7f7f7f"])):
        xs = [j + (i - 0.5) * width for j in range(len(keys))]
        ax.bar(xs, [rates[k][key] for k in keys], width, label=f"{label} ({STORE['run']})",
               color=color)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{c} client{'s' if c > 1 else ''}, {human(v)}" for c, v in keys])
    ax.set_yscale("log")
    ax.set_ylabel("set + get pairs a second (log)")
    ax.grid(True, axis="y", alpha=0.35)
    ax.legend(fontsize=9, frameon=False)
    ax.set_title(STORE["title"] + "\nmedians of alternating rounds", fontsize=10)
    f.tight_layout()
    path = os.path.join(out, STORE["name"] + ".png")
    f.savefig(path, dpi=110)
    plt.close(f)
    print(f"wrote {path}")


def busbw(size, us, ranks):
    """All_reduce bus bandwidth in GB/s, as nccl-tests: bytes / time x 2(n-1)/n."""
    return size / (us * 1e3) * 2 * (ranks - 1) / ranks


def human(size):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def gbs(v):
    """A bandwidth in GB/s to three significant figures, without exponents."""
    if v < 0.001:
        return "< 0.001"
    return f"{v:.3g}" if v >= 1 else f"{v:.3f}"


def cell(us):
    return f"{us:.2f}" if us < 10 else f"{us:,.1f}"


def tables(fig):
    """Each pair as a markdown table: times, the peer's time over dist's, both bus bandwidths."""
    for pair in fig["pairs"]:
        if "dist" not in pair:
            continue
        n = pair.get("ranks", fig.get("ranks"))
        dl, ds = pair["dist"]
        pl, ps = pair["peer"]
        d, p = read(ds), read(ps)
        print(f"\n{fig['name']}: {pair['run']} ({n} ranks; {ds[1]})\n")
        print(f"| bytes | {dl} µs | {pl} µs | {pl} ÷ dist (time) | {dl} busbw GB/s | {pl} busbw GB/s |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for s in sorted(set(d) & set(p)):
            print(
                f"| {human(s)} | {cell(d[s])} | {cell(p[s])} | {p[s] / d[s]:.2f} | "
                f"{gbs(busbw(s, d[s], n))} | {gbs(busbw(s, p[s], n))} |"
            )


def draw(fig, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    every = set()
    f, (bw, tm) = plt.subplots(1, 2, figsize=(13, 5.2))
    for i, pair in enumerate(fig["pairs"]):
        n = pair.get("ranks", fig.get("ranks"))
        color = colors[i % len(colors)] if "dist" in pair else "#7f7f7f"
        for role, style, marker in (("dist", "-", "o"), ("peer", "--", "s")):
            if role not in pair:
                continue
            label, source = pair[role]
            series = read(source)
            sizes = sorted(series)
            every.update(sizes)
            kw = dict(color=color, linestyle=style if "dist" in pair else ":", marker=marker,
                      markersize=5, linewidth=1.8 if role == "dist" else 1.4)
            name = f"{label} ({pair['run']})"
            # A line joins sizes the run stepped between; a gap over 4 times the run's smallest
            # step stays open (markers only), so that no line stands for sizes it skipped.
            step = min((b / a for a, b in zip(sizes, sizes[1:])), default=1)
            xs, bws, tms = [], [], []
            for prev, s in zip([None] + sizes, sizes):
                if prev is not None and s > 4 * step * prev:
                    xs.append(float("nan")), bws.append(float("nan")), tms.append(float("nan"))
                xs.append(s), bws.append(busbw(s, series[s], n)), tms.append(series[s])
            bw.plot(xs, bws, label=name, **kw)
            tm.plot(xs, tms, label=name, **kw)
    size_fmt = FuncFormatter(lambda v, _: human(int(v)) if v >= 1 and int(v) == v else "")
    lo, hi = min(every).bit_length() - 1, max(every).bit_length() - 1
    step = max(1, -(-(hi - lo) // 9))
    ticks = [2**e for e in range(lo, hi + 1, step)]
    for ax, ylabel in ((bw, "bus bandwidth, GB/s (log)"), (tm, "time per call, µs (log)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(size_fmt)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("message size (log)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.1)
        for label in ax.get_xticklabels():
            label.set_rotation(45)
    handles, labels = tm.get_legend_handles_labels()
    f.legend(handles, labels, loc="lower center", ncol=2, fontsize=8.5, frameon=False)
    f.suptitle(
        fig["title"] + "\nsolid: dist; dashed: its peer in the same run; no line across sizes a run skipped",
        fontsize=11,
    )
    rows = (len(labels) + 1) // 2
    f.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    path = os.path.join(out, fig["name"] + ".png")
    f.savefig(path, dpi=110)
    plt.close(f)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/plots", help="folder for the PNG files")
    p.add_argument("--tables", action="store_true", help="print markdown tables, draw nothing")
    p.add_argument("--only", help="one figure by name")
    a = p.parse_args()
    figs = [f for f in FIGURES if not a.only or f["name"] == a.only]
    store = not a.only or a.only == STORE["name"]
    if not figs and not store:
        names = [f["name"] for f in FIGURES] + [STORE["name"]]
        raise SystemExit(f"no figure {a.only!r} (there: {', '.join(names)})")
    if a.tables:
        for fig in figs:
            tables(fig)
        if store:
            store_table()
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit(
            "matplotlib is missing: python3 -m venv ~/plot-venv && "
            "~/plot-venv/bin/pip install matplotlib, then "
            "cargo xtask plot --python ~/plot-venv/bin/python"
        )
    os.makedirs(a.out, exist_ok=True)
    for fig in figs:
        draw(fig, a.out)
    if store:
        store_draw(a.out)


if __name__ == "__main__":
    main()
