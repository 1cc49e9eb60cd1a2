#!/bin/bash
# Diagnostic (RESULTS, session 67): 4 KiB random writes at QD32 into a cached file whose page
# cache was filled by readahead (large folios: 2 MiB where read_ahead_kb is 8192) or by 4 KiB
# reads under POSIX_FADV_RANDOM (order-0 folios); netblk and nbdkit's file plugin alternating;
# IOPS and the server's CPU per write (utime+stime from /proc over its life). Shows that the
# page cache's cost per write (ext4 walks every buffer head of a folio) sets the file rows'
# write CPU. Root not needed; it holds the benchmark lock, as bench.py does.
#
#   bench/page_cache_folios.sh [IMAGE] [ROUNDS]      # IMAGE: 512 MiB scratch file, made if absent
set -euo pipefail
IMG=${1:-/var/tmp/netblk-folios.img}
ROUNDS=${2:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
NETBLK=${NETBLK_BIN:-${CARGO_TARGET_DIR:-$HERE/../target}/release/netblk}
PORT=${PORT:-$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
RUNTIME=5
# One benchmark at a time (bench.py's lock; see bench/README.md).
LOCK=${NETBLK_BENCH_LOCK:-/tmp/netblk-bench.lock}
{ exec 9<>"$LOCK"; } 2>/dev/null || exec 9<"$LOCK"
flock -n 9 || { echo "another benchmark is running ($(cat "$LOCK"); lock $LOCK): run one at a time" >&2; exit 1; }
# Name the holder where the file can be written (as bench.py does).
{ : > "$LOCK" && echo "page_cache_folios.sh, pid $$" > "$LOCK"; } 2>/dev/null || true
REPORT=$(mktemp)
pid=
trap 'rm -f "$REPORT"; [ -z "$pid" ] || kill $pid 2>/dev/null' EXIT
[ -e "$IMG" ] || head -c 512M /dev/urandom > "$IMG"
settle() {
  /usr/bin/python3 - "$IMG" "$1" <<'PY'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
if sys.argv[2] == "small":
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    while os.read(fd, 4096):
        pass
else:
    while os.read(fd, 1 << 20):
        pass
os.close(fd)
PY
}
for round in $(seq "$ROUNDS"); do
  for state in large small; do
    for server in netblk nbdkit; do
      settle $state
      if [ $server = netblk ]; then
        "$NETBLK" serve --listen 127.0.0.1:$PORT "$IMG" >/dev/null 2>&1 &
      else
        nbdkit -f -p $PORT -i 127.0.0.1 file "$IMG" &
      fi
      pid=$!
      sleep 0.7
      kill -0 $pid 2>/dev/null || { echo "$server did not start (port $PORT taken?)" >&2; exit 1; }
      before=$(awk '{print $14 + $15}' /proc/$pid/stat)
      # fio's nbd engine prints a line on stdout: the report goes to a file.
      fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw=randwrite --bs=4k \
          --iodepth=32 --time_based=1 --runtime=$RUNTIME --output-format=json \
          --output="$REPORT" >/dev/null 2>&1
      ios=$(/usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["jobs"][0]["write"]["total_ios"])' "$REPORT")
      after=$(awk '{print $14 + $15}' /proc/$pid/stat)
      kill $pid
      wait $pid 2>/dev/null || true
      pid=
      ticks=$(getconf CLK_TCK)
      echo "round $round, $state folios, $server: $((ios / RUNTIME)) writes/s," \
           "$(/usr/bin/python3 -c "print(f'{($after - $before) / $ticks / $ios * 1e6:.2f}')") µs server CPU per write"
    done
  done
done
