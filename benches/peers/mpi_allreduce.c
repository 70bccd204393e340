/* Peer benchmark: Open MPI's MPI_Allreduce (f32 sum, in place), printing the same columns as
 * `cargo xtask perf`: bytes, count, time per call in microseconds (slowest rank's average),
 * algbw and busbw in GB/s (nccl-tests' definitions). Sizes from -b to -e by factor -f;
 * --iters N timed calls per size (default: by size, 5 to 1000).
 * Built and run by run-openmpi.sh. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    }
    return (size_t)v;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t lo = 8, hi = 64 << 20, factor = 4;
    int fixed_iters = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-b")) lo = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-e")) hi = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-f")) factor = (size_t)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) fixed_iters = atoi(argv[i + 1]);
    }
    float *buf = malloc(hi);
    if (rank == 0) {
        printf("# Open MPI MPI_Allreduce, %d ranks, float sum in place\n", n);
        printf("# %10s %12s %8s %6s %4s %10s %8s %8s %6s\n", "size", "count", "type", "redop",
               "root", "time(us)", "algbw", "busbw", "#wrong");
    }
    for (size_t bytes = lo; bytes <= hi; bytes *= factor) {
        int count = (int)(bytes / sizeof(float));
        if (count < 1) count = 1;
        size_t b = (size_t)count * sizeof(float);
        int iters = (int)((1UL << 30) / (b + (64 << 10)));
        if (iters < 5) iters = 5;
        if (iters > 1000) iters = 1000;
        if (fixed_iters > 0) iters = fixed_iters;
        int warmup = iters / 10 > 2 ? iters / 10 : 2;
        /* Inputs: small integers, so the sum is exact and can be checked. */
        for (int i = 0; i < count; i++) buf[i] = (float)((rank * 3 + i) % 7);
        MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long wrong = 0;
        for (int i = 0; i < count; i++) {
            float want = 0;
            for (int r = 0; r < n; r++) want += (float)((r * 3 + i) % 7);
            if (buf[i] != want) wrong++;
        }
        for (int i = 0; i < warmup; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double per = (MPI_Wtime() - t) / iters, slowest;
        long all_wrong;
        MPI_Reduce(&per, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        MPI_Reduce(&wrong, &all_wrong, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = b / slowest / 1e9;
            printf("%12zu %12d %8s %6s %4s %10.1f %8.3f %8.3f %6ld\n", b, count, "float", "sum",
                   "-1", slowest * 1e6, algbw, algbw * 2.0 * (n - 1) / n, all_wrong);
        }
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
