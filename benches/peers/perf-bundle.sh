#!/usr/bin/env bash
# The smallest bundle that runs `perf` on a host without a Rust toolchain: this checkout's
# dist-perf and the launcher (xtask), release builds, stripped, in FOLDER (default
# bundle/perf), with `FOLDER/run` as `cargo xtask bundle` writes it. Then, there:
#   DIST_PERF="FOLDER/run perf" benches/peers/compare-vader.sh
#   benches/peers/perf-bundle.sh [FOLDER]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
out="${1:-bundle/perf}"
cargo build --release --quiet -p dist-tools --bin dist-perf -p xtask
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
echo "commit $(git rev-parse HEAD 2>/dev/null || echo '?')" >"$out/MANIFEST"
ls -l "$out" >&2
