#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# weightbus-bench run, for real: publisher and subscriber processes of every transport this build
# has on the stories260K checkpoint, baselines included, every output checked; then fault
# injection: corrupted versions, a subscriber and a publisher killed mid-run. Each must end in
# "# FAILED: <reason>" with exit status 1, promptly, never hang.
#
#   tests/bench_run_test.sh BENCH [PYTHON]
# BENCH: the weightbus-bench executable; PYTHON: an interpreter with torch for the torch
# baselines (empty: they are left out with --no-torch).
set -euo pipefail
bench=$1
python=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# JSON and SVG checks with the standard library only (any python3).
check() { python3 - "$@"; }

torch_flags=(--no-torch)
[[ -n "$python" ]] && torch_flags=(--python "$python")

echo "== a full quick run: every transport, the baselines, every output"
set +e
"$bench" run --quick --dir "$work" --json "$work/run.json" --csv "$work/run.csv" \
  --trace "$work/trace.json" --plot "$work/plot.svg" "${torch_flags[@]}" > "$work/out.txt" 2>&1
rc=$?
set -e
cat "$work/out.txt"
[[ $rc -eq 0 ]] || fail "run exited with $rc"
[[ "$(tail -n 1 "$work/out.txt")" == "# OK" ]] || fail "the last line is not '# OK'"
# nccl-tests style: every line that is not a data row starts with '#'.
data_rows=$(grep -vc '^#' "$work/out.txt" || true)
check "$work/run.json" "$data_rows" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
rows = int(sys.argv[2])
assert r["ok"] is True and r["failures"] == [], r["failures"]
names = [t["name"] for t in r["transports"]]
assert "disk" in names, names
assert rows == len(r["transports"]) + len(r["baselines"]), (rows, names)
for t in r["transports"]:
    assert t["completed"], t
    assert t["wrong_versions"] == 0, t["name"]
    assert len(t["versions"]) == r["versions"], t["name"]
    for v in t["versions"]:
        assert len(v["replicas"]) == r["subscribers"], t["name"]
        assert all(p["ok"] for p in v["replicas"]), (t["name"], v)
    assert t["last_replica_s"]["median"] >= t["first_replica_s"]["median"] > 0, t["name"]
    assert t["cpu_s"] > 0 and t["peak_rss_bytes"] > 0, t["name"]
    # Wire bytes: the whole model for a plain transport; far fewer for the delta layer.
    if t["name"].startswith("delta+"):
        assert 0 < t["wire_bytes_per_version"] < r["model_bytes"] / 4, t
        assert t["encode_s"] > 0 and t["decode_s"] > 0, t
    else:
        assert t["wire_bytes_per_version"] >= r["model_bytes"], t
base = {b["name"]: b for b in r["baselines"]}
assert base["memcpy"]["ran"] and base["memcpy"]["rate_gbs"] > 0, base["memcpy"]
assert base["write+read"]["ran"] and base["write+read"]["wrong"] == 0, base["write+read"]
print("run.json: %d transports, %d baselines checked" % (len(names), len(base)))
EOF
check "$work/trace.json" <<'EOF'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
complete = [e for e in events if e["ph"] == "X"]
assert complete, "no phases"
assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
names = {e["name"].split()[0] for e in complete}
pids = {e["pid"] for e in complete}
assert len(pids) >= 3, pids  # a publisher and two subscribers at least
print("trace: %d phases in %d processes: %s" % (len(complete), len(pids), sorted(names)))
EOF
head -n 1 "$work/run.csv" | grep -qx 'section,name,version,replica,metric,value,unit' ||
  fail "the CSV header is wrong"
[[ $(wc -l < "$work/run.csv") -gt 100 ]] || fail "the CSV has too few figures"
check "$work/plot.svg" "$work/run.json" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
svg = ET.parse(sys.argv[1]).getroot()
r = json.load(open(sys.argv[2]))
labels = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
for t in r["transports"]:
    assert t["name"] in labels, (t["name"], labels)
bars = [e for e in svg.iter("{http://www.w3.org/2000/svg}rect") if e.find(
    "{http://www.w3.org/2000/svg}title") is not None]
assert len(bars) == len(r["transports"]) + sum(b["ran"] for b in r["baselines"]), len(bars)
print("plot: %d bars" % len(bars))
EOF
[[ -z "$(ls -A "$work" | grep wbbench- || true)" ]] || fail "the run left its directory behind"

# run_expect_failure NAME REGEX ARGS...: the run must exit 1 within 120 s, its last line a
# "# FAILED: ..." matching REGEX.
run_expect_failure() {
  local name=$1 regex=$2
  shift 2
  echo "== $name"
  set +e
  timeout 120 "$bench" run --quick --no-baselines --dir "$work" --timeout 20 "$@" \
    > "$work/$name.txt" 2>&1
  local rc=$?
  set -e
  cat "$work/$name.txt"
  [[ $rc -eq 1 ]] || fail "$name: exit status $rc, not 1"
  tail -n 1 "$work/$name.txt" | grep -Eq "^# FAILED: .*$regex" ||
    fail "$name: the last line does not say FAILED: ...$regex"
}

# Replicas receive bytes that differ from what was meant: the independent check must see it.
run_expect_failure corrupt 'version 3, replica [01]: tensor ".*" differs from what was published' \
  --corrupt-version 3 --order sequential
# A subscriber dies before fetching its third version (the library's fail point, SIGKILL; fail
# points come only from the environment, which every role of the run inherits).
WEIGHTBUS_FAILPOINTS=core.before_fetch=kill@3 \
  run_expect_failure subscriber-killed 'subscriber [01] ended early \(killed by signal 9\)' \
  --transports disk
# The publisher dies in its third Publish.
WEIGHTBUS_FAILPOINTS=core.before_transport=kill@3 \
  run_expect_failure publisher-killed 'publisher ended early \(killed by signal 9\)' \
  --transports disk

echo "== a sweep of sizes: one run per size, output files named by size"
"$bench" run --min-size 1MiB --max-size 4MiB --factor 4 --versions 2 --no-baselines \
  --transports disk,ucx --dir "$work" --json "$work/sweep.json" > "$work/sweep.txt" 2>&1 ||
  { cat "$work/sweep.txt"; fail "the sweep failed"; }
[[ $(grep -c '^# OK$' "$work/sweep.txt") -eq 2 ]] || fail "the sweep did not end in two '# OK'"
check "$work/sweep-1.0MiB.json" "$work/sweep-4.0MiB.json" <<'EOF'
import json, sys
sizes = []
for path in sys.argv[1:]:
    r = json.load(open(path))
    assert r["ok"], path
    sizes.append(r["model_bytes"])
# Qwen2.5-0.5B's shapes scaled: within 15% above the size asked for (rounded dimensions).
for got, want in zip(sizes, [1 << 20, 4 << 20]):
    assert want <= got <= want * 1.15, sizes
print("sweep: model bytes", sizes)
EOF

echo "== set-up errors: one line, status 2, nothing left behind"
for args in "--set bogus=1" "--store $work/missing" "--timeout 0" "--corrupt-version 9" \
    "--model $work/missing.safetensors"; do
  set +e
  # shellcheck disable=SC2086
  out=$("$bench" run --quick --dir "$work" $args 2>&1)
  rc=$?
  set -e
  echo "$args -> $out"
  [[ $rc -eq 2 && $(wc -l <<< "$out") -eq 1 && "$out" == "weightbus-bench: error: "* ]] ||
    fail "run $args: status $rc, output: $out"
  [[ -z "$(ls "$work" | grep wbbench- || true)" ]] || fail "run $args left its directory behind"
done

echo "== SIGTERM mid-run: workers stopped, the run's directories removed"
"$bench" run --quick --versions 200 --no-baselines --dir "$work" > "$work/term.txt" 2>&1 &
pid=$!
for _ in $(seq 1 100); do
  pgrep -f -- "--parent-pid $pid" > /dev/null && break
  sleep 0.2
done
pgrep -f -- "--parent-pid $pid" > /dev/null || fail "no worker of $pid started"
sleep 1
kill -TERM "$pid"
set +e
wait "$pid"
rc=$?
set -e
[[ $rc -eq 143 ]] || fail "after SIGTERM: status $rc, not 143"
sleep 0.5
if pgrep -f -- "--parent-pid $pid" > /dev/null; then fail "workers of $pid outlived it"; fi
[[ ! -e "$work/wbbench-$pid" && ! -e "/dev/shm/wbbench-$pid" ]] ||
  fail "the run's directories are still there"
echo "bench_run_test: OK"
