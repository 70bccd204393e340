"""Tables of benches/hosts-sealed.sh's output: dist's all_reduce on rate-capped simulated
hosts, sealed against plain (seal-*.txt) and its own choice against the flat ring at two ranks
a host (spread-*.txt), each beside the link's bound.

For H hosts joined at rate R (bits/s), a large all_reduce reaches at best
algbw = R/8 · H / (2(H − 1)) bytes/s per rank. Every figure is the median over the rounds of
each file (benches/peers/medians.py); "load" is the range of the 1-minute load averages
recorded before each section.

    python3 benches/hosts_sealed_table.py OUTDIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosts_table import bits, loads, medians, size  # noqa: E402


def table(out, pattern, a, b, title):
    files = sorted(Path(out).glob(pattern), key=lambda p: (bits(p.stem.split("-")[2]), p.stem))
    if not files:
        return
    print(f"| hosts × ranks | rate | bytes | bound MB/s | {a} MB/s | {a} % of bound | {b} MB/s | {b} % of bound | {title} | rounds | load |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for f in files:
        _, layout, rate = f.stem.split("-")
        h, p = (int(x) for x in layout[1:].split("x"))
        bound = bits(rate) / 8 * h / (2 * (h - 1)) / 1e6
        for s, med in sorted(medians(f).items()):
            row = [f"{h} × {p}", rate, size(s), f"{bound:.1f}"]
            for v in (a, b):
                if v in med:
                    bw = s / med[v][0]
                    row += [f"{bw:.1f}", f"{100 * bw / bound:.0f} %"]
                else:
                    row += ["–", "–"]
            ratio = med[b][0] / med[a][0] if a in med and b in med else None
            row.append(f"{ratio:.3f}" if ratio else "–")
            row.append("/".join(str(med[v][1]) for v in (a, b) if v in med))
            row.append(loads(f))
            print("| " + " | ".join(row) + " |")
    print()


def main():
    out = sys.argv[1]
    table(out, "seal-H*x*-*.txt", "plain", "sealed", "sealed ÷ plain (time)")
    table(out, "spread-H*x*-*.txt", "dist", "ring", "ring ÷ dist (time)")
    table(out, "spread-H*x*-*.txt", "dist", "before", "before ÷ dist (time)")


if __name__ == "__main__":
    main()
