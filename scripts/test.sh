#!/usr/bin/env bash
# Runs every netblk test on a fresh Debian 12 machine: installs the real NBD clients the
# integration tests drive when they are missing, checks formatting and lints, runs the
# unit, property and integration tests and the bench scripts' tests, builds and runs the C
# copy measurement (bench/copy_alignment.c), then a short run of each fuzz target.
#
#   scripts/test.sh                      # everything
#   NETBLK_FUZZ_SECONDS=0 scripts/test.sh   # skip the fuzz run (the corpus is still
#                                           # replayed by cargo test)
set -euo pipefail
cd "$(dirname "$0")/.."

fuzz_seconds=${NETBLK_FUZZ_SECONDS:-30}

# Debian packages: the clients (qemu-img/qemu-io, nbdinfo/nbdcopy/nbdsh/nbdfuse, python
# libnbd, fio), FUSE, ext4 tools and losetup/mount (package mount) for the file-system test,
# iproute2 (`ss`, which shows the congestion control of the server's sockets; `ip netns`),
# and procps (`kill`, which the tests use to signal servers; minimal images lack it).
packages=(qemu-utils libnbd-bin python3-libnbd fio fuse3 e2fsprogs util-linux mount iproute2 procps)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # qemu 10 (extended headers) comes from bookworm-backports where that is configured.
  if [[ " ${missing[*]} " == *" qemu-utils "* ]] && apt-cache policy qemu-utils | grep -q backports; then
    apt-get install -y -qq -t bookworm-backports qemu-utils
  fi
  apt-get install -y -qq "${missing[@]}"
fi

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy"
cargo clippy --all-targets --release -- -D warnings
test_log=$(mktemp)
bench_log=$(mktemp)
fuzz_scratch=$(mktemp -d)
c_scratch=$(mktemp -d)
trap 'rm -rf "$test_log" "$bench_log" "$fuzz_scratch" "$c_scratch"' EXIT
echo "== cargo test"
CI=${CI:-1} cargo test --release 2>&1 | tee "$test_log"
passed=$(grep -Eo '^test result: .* ([0-9]+) passed' "$test_log" | grep -Eo '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed;' "$test_log" | awk '{s+=$1} END {print s+0}')

# The bench scripts' counting (fio's jobs over their windows, the report's sections): a
# wrong count would put a wrong figure beside a target. Standard library only.
echo "== bench script tests"
(cd bench && /usr/bin/python3 -m unittest discover -p 'test_*.py') 2>&1 | tee "$bench_log"
bench_tests=$(grep -Eo '^Ran [0-9]+ test' "$bench_log" | grep -Eo '[0-9]+')

# The C measurement behind the copy-alignment finding (RESULTS, session 55): it must still
# build without warnings and run both of its modes, or the figures quoted from it could not
# be measured again. A few seconds.
echo "== bench/copy_alignment.c"
cc -O2 -Wall -Wextra -Werror -o "$c_scratch/copy_alignment" bench/copy_alignment.c
"$c_scratch/copy_alignment" copy | tail -n 1
"$c_scratch/copy_alignment" reply 28 2 | tail -n 1

if [ "$fuzz_seconds" -gt 0 ]; then
  if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
    for target in handshake requests peer metrics; do
      echo "== fuzz $target for ${fuzz_seconds}s"
      scratch="$fuzz_scratch/$target"
      mkdir "$scratch"
      # -a: debug assertions, and with them overflow checks, which the release test
      # build lacks: a wrapped offset from the network panics here instead of passing.
      (cd fuzz && cargo +nightly fuzz run -O -a "$target" "$scratch" "corpus/$target" -- \
        -max_total_time="$fuzz_seconds" -rss_limit_mb=4096 -print_final_stats=1 2>&1 | tail -n 12)
    done
  else
    echo "== fuzz: no nightly toolchain here; the committed corpus was replayed by cargo test"
  fi
fi
echo "== all tests passed"
echo "cargo test: $passed passed, $failed failed; bench script tests: ${bench_tests:-0} passed"
