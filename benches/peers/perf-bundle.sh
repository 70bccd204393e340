#!/usr/bin/env bash
# The smallest bundle that runs `perf` on a host without a Rust toolchain: this checkout's
# dist-perf and the launcher (xtask), release builds, stripped, in FOLDER (default
# bundle/perf), with `FOLDER/run` as `cargo xtask bundle` writes it, and where mpicc is here,
# benches/peers/mpi_allreduce.c built as FOLDER/mpi_allreduce (built against Open MPI 4.1.4, it
# runs with 4.1.6). Then, there:
#   DIST_PERF="FOLDER/run perf" MPI_BIN=FOLDER/mpi_allreduce benches/peers/compare-vader.sh
#   benches/peers/perf-bundle.sh [FOLDER]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
out="${1:-bundle/perf}"
cargo build --release --quiet -p dist-tools --bin dist-perf
cargo build --release --quiet -p xtask
mkdir -p "$out"
for bin in dist-perf xtask; do
    cp target/release/$bin "$out/$bin"
    strip "$out/$bin" 2>/dev/null || true
done
cat >"$out/run" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled launcher on the bundled binaries.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export DIST_BUNDLE_DIR="$here"
exec "$here/xtask" "$@"
RUN
chmod +x "$out/run"
if command -v mpicc >/dev/null; then
    mpicc -O2 -o "$out/mpi_allreduce" "$here/mpi_allreduce.c"
fi
echo "commit $(git rev-parse HEAD 2>/dev/null || echo '?')" >"$out/MANIFEST"
ls -l "$out" >&2
