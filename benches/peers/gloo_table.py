#!/usr/bin/env python3
"""The table compare-gloo.sh prints: medians per size of ROUNDS rounds of dist's perf output
(DIR/dist.1 ...) and torch_allreduce.py's (DIR/gloo.1 ...), with the ratios and the algorithm
dist used at each size (read from the tuning its perf header prints).

    python3 benches/peers/gloo_table.py DIR ROUNDS RANKS
"""
import os
import re
import statistics
import sys

# Where dist's all_reduce changes algorithm (dist_core::collectives::select).
ALL_REDUCE_RING_MIN = 64 << 10
TWO_RINGS_MIN = 2 << 20
HALVING_MIN_RANKS = 8
TWO_RINGS_MAX_RANKS = 16
RING_SHARE_MIN = 512 << 10
# With shared memory on (DIST_SHM unset or 1), ranks of this one host all_reduce on the host
# arena (dist_core::collectives::host) up to the group's limit (dist-perf's header says it):
# every rank reduces the whole buffer up to HOST_SPLIT_MIN, a share each above; larger buffers
# take the algorithms below, over the shared-memory rings.
HOST_SPLIT_MIN = 32 << 10


def load(d, prefix, rounds):
    rows, head = {}, ""
    for i in range(1, rounds + 1):
        for line in open(f"{d}/{prefix}.{i}"):
            f = line.split()
            if line.startswith("# dist perf"):
                head = line
            if len(f) >= 9 and f[0].isdigit():
                rows.setdefault(int(f[0]), []).append((float(f[5]), float(f[7]), f[8]))
    return rows, head


def main():
    d, rounds, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    (dist, head), (gloo, _) = load(d, "dist", rounds), load(d, "gloo", rounds)
    m = re.search(r"ring pieces of (\d+) KiB, (\d+) lane", head)
    piece, lanes = (int(m.group(1)), int(m.group(2))) if m else (256, 1)
    m = re.search(r"host arena up to (\d+) KiB", head)
    arena_max = int(m.group(1)) << 10 if m else 0

    arena = os.environ.get("DIST_SHM", "1") != "0"

    def algo(b):
        if arena and b <= arena_max:
            return ("host arena, every rank reduces all" if b <= HOST_SPLIT_MIN
                    else "host arena, a share per rank")
        if b <= ALL_REDUCE_RING_MIN or b // 4 < ranks:
            return "recursive doubling"
        two = lanes >= 2 and ranks >= 3 and b >= TWO_RINGS_MIN
        if (ranks >= HALVING_MIN_RANKS and not (two and ranks < TWO_RINGS_MAX_RANKS)
                and b // ranks < RING_SHARE_MIN):
            return "recursive halving and doubling"
        return f"{'two rings (opposite directions)' if two else 'one ring'} RS+AG, {piece} KiB pieces"

    print()
    print("| bytes | dist µs | Gloo µs | time ratio (Gloo/dist) | dist busbw GB/s | Gloo busbw GB/s "
          "| busbw ratio (dist/Gloo) | dist verified | dist algorithm |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for b in sorted(set(dist) & set(gloo)):
        dt = statistics.median(x[0] for x in dist[b])
        gt = statistics.median(x[0] for x in gloo[b])
        db = statistics.median(x[1] for x in dist[b])
        gb = statistics.median(x[1] for x in gloo[b])
        wrong = sum(int(x[2]) for x in dist[b] if x[2].isdigit())
        ratio = f"{db / gb:.2f}" if gb > 0 else "–"
        ok = "yes" if wrong == 0 else f"{wrong} wrong"
        print(f"| {b} | {dt:.1f} | {gt:.1f} | {gt / dt:.2f} | {db:.3f} | {gb:.3f} | {ratio} | {ok} | {algo(b)} |")


if __name__ == "__main__":
    main()
