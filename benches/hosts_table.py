"""Tables of benches/hosts-allreduce.sh's output: all_reduce on rate-capped simulated hosts
against the link's bound, dist beside Gloo and Open MPI.

For H hosts joined at rate R (bits/s), a large all_reduce reaches at best
algbw = R/8 · H / (2(H − 1)) bytes/s per rank (each host's link carries 2(H − 1)/H of the data
once). An 8 B all_reduce with one-way delay d between hosts needs at least 2 · log2(H) · d
(recursive doubling across hosts). Every figure is the median over the rounds of each file
(benches/peers/medians.py); "load" is the range of the 1-minute load averages recorded before
each section of the file.

    python3 benches/hosts_table.py OUTDIR
"""

import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from medians import read  # noqa: E402


# The variants of every file, dist first.
PEERS = ("dist", "gloo", "openmpi")


def bits(rate):
    m = re.fullmatch(r"([\d.]+)(bit|kbit|mbit|gbit)", rate)
    return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


def size(b):
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= s and b % s == 0:
            return f"{b // s} {unit}"
    return f"{b} B"


def loads(path):
    ls = [float(x) for x in re.findall(r"load average: ([\d.]+)", path.read_text())]
    return f"{min(ls):.1f}–{max(ls):.1f}" if ls else "–"


def medians(path):
    times, _ = read(str(path))
    out = {}
    for s, by in times.items():
        out[s] = {v: (statistics.median(t), len(t)) for v, t in by.items() if t}
    return out


def bandwidth(out):
    print("| hosts × ranks | rate | bytes | bound MB/s | dist MB/s | dist % of bound | Gloo MB/s | Gloo % of bound | Open MPI MB/s | Open MPI % of bound | Gloo ÷ dist (time) | Open MPI ÷ dist (time) | rounds | load |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    files = sorted(out.glob("bw-H*x*-*.txt"), key=lambda p: (bits(p.stem.split("-")[2]), p.stem))
    for f in files:
        _, layout, rate = f.stem.split("-")
        h, p = (int(x) for x in layout[1:].split("x"))
        bound = bits(rate) / 8 * h / (2 * (h - 1)) / 1e6
        for s, med in sorted(medians(f).items()):
            row = [f"{h} × {p}", rate, size(s), f"{bound:.1f}"]
            for v in PEERS:
                if v in med:
                    bw = s / med[v][0]  # bytes per µs = MB/s
                    row += [f"{bw:.1f}", f"{100 * bw / bound:.0f} %"]
                else:
                    row += ["–", "–"]
            for v in PEERS[1:]:
                ratio = med[v][0] / med["dist"][0] if v in med and "dist" in med else None
                row.append(f"{ratio:.2f}" if ratio else "–")
            row.append("/".join(str(med[v][1]) for v in PEERS if v in med))
            row.append(loads(f))
            print("| " + " | ".join(row) + " |")


def ceiling(out):
    print()
    print("| cap (2 hosts × 1 rank) | bytes | bound MB/s | dist MB/s | % of bound | rounds | load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    files = sorted(out.glob("ceiling-H2x1-*.txt"), key=lambda p: bits(p.stem.split("-")[2]) if p.stem.split("-")[2] != "none" else math.inf)
    for f in files:
        rate = f.stem.split("-")[2]
        for s, med in sorted(medians(f).items()):
            if "dist" not in med:
                continue
            bw = s / med["dist"][0]
            if rate == "none":
                print(f"| none | {size(s)} | – | {bw:.1f} | – | {med['dist'][1]} | {loads(f)} |")
            else:
                bound = bits(rate) / 8 / 1e6
                print(f"| {rate} | {size(s)} | {bound:.1f} | {bw:.1f} | {100 * bw / bound:.0f} % | {med['dist'][1]} | {loads(f)} |")


def latency(out):
    f = out / "latency-H4x1.txt"
    if not f.exists():
        return
    bound = 2 * math.log2(4) * 100  # µs: 2 log2(H) one-way delays of 0.1 ms
    print()
    print("| 8 B, 4 hosts × 1 rank, 0.1 ms one way, 1 Gbit/s | µs | ÷ bound (400 µs) | rounds | load |")
    print("| --- | ---: | ---: | ---: | --- |")
    for s, med in sorted(medians(f).items()):
        for v, name in (("dist", "dist"), ("gloo", "Gloo"), ("openmpi", "Open MPI")):
            if v in med:
                t, k = med[v]
                print(f"| {name} | {t:.1f} | {t / bound:.2f} | {k} | {loads(f)} |")


def main():
    out = Path(sys.argv[1])
    bandwidth(out)
    ceiling(out)
    latency(out)


if __name__ == "__main__":
    main()
