#!/usr/bin/env bash
# The governor's overhead beside a plain reverse proxy, in one run: wrk
# against a fixed-response upstream (nginx `return 200`) directly, through
# nginx `proxy_pass` (keep-alive to the upstream), through a bare proxy on
# the governor's own stack that does none of its work (the floor of any
# proxy on hyper and one tokio thread: examples/bare_proxy.rs), and
# through `envelope govern` with its defaults (live guard on, latency
# guard on, counting: the model's .gguf with --tokenizer, and the default
# `auto`, which falls back to the local estimate because the upstream has
# no /tokenize). The profile's caps are far above the load, so only the
# governor's own work is measured, not its admission decisions. Prints
# Markdown tables: latency p50/p99 added to the direct path (one
# connection, one request at a time) and requests/s at CONNECTIONS
# connections, each against nginx's; requests/s as each round's ratio to
# nginx's in that round, with each proxy's CPU time a request; then
# latency measured interleaved (the paths in turn request by request,
# scripts/paired-latency.py). Not a timed test: figures vary with what
# else the machine does; compare the columns of one run.
#
#   scripts/govern-vs-nginx.sh [SECONDS] [CONNECTIONS]
#
# Needs nginx and wrk (installed with apt-get when missing) and the
# SmolLM2 GGUF (scripts/fetch-model.sh). ROUNDS (default 3) is how many
# alternating rounds of every path the medians come from; ENVELOPE_BIN
# names the binary to measure (default target/release/envelope, built
# first) and BARE_PROXY_BIN the bare proxy (default: the example, built
# first); GOVERN_ENV adds environment variables to both governors (for
# example GOVERN_ENV=TOKIO_WORKER_THREADS=1). BEFORE_BIN names a second
# binary (an earlier build) run with the defaults as one more path in
# every round: each round's requests/s and CPU a request of this build
# against that one's are printed, with their medians (a change to the
# request path must stay within 10% of before).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}"
conns="${2:-32}"
if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk >/dev/null
fi
bash scripts/fetch-model.sh >/dev/null
if [ -n "${ENVELOPE_BIN:-}" ]; then
  bin=$ENVELOPE_BIN
else
  cargo build --release --locked >&2
  bin=${CARGO_TARGET_DIR:-target}/release/envelope
fi
if [ -n "${BARE_PROXY_BIN:-}" ]; then
  bare=$BARE_PROXY_BIN
else
  cargo build --release --locked -p envelope-governor --example bare_proxy >&2
  bare=${CARGO_TARGET_DIR:-target}/release/examples/bare_proxy
fi
model=models/SmolLM2-135M-Instruct.Q4_1.gguf

work=$(mktemp -d /tmp/envelope-vs-nginx.XXXXXX)
pids=()
pid_files=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for f in "${pid_files[@]}"; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP=$(free_port); PX=$(free_port); G1=$(free_port); G2=$(free_port); BP=$(free_port); G3=$(free_port)

body='{"id":"cmpl-1","object":"text_completion","model":"fixed","choices":[{"index":0,"text":"hello world","finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":2,"total_tokens":10}}'
# The upstream and the nginx proxy are two nginx instances of one worker
# each: in one process the proxy would share its core with the upstream,
# while the governor's upstream runs in a process of its own.
nginx_conf() { # NAME SERVER-BLOCK
  cat > "$work/$1.conf" <<EOF
worker_processes 1;
pid $work/$1.pid;
error_log $work/$1-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  upstream fixed { server 127.0.0.1:$UP; keepalive 256; }
$2
}
EOF
  nginx -c "$work/$1.conf" -p "$work"
  pid_files+=("$work/$1.pid")
}
nginx_conf upstream "  server {
    listen 127.0.0.1:$UP;
    location = /v1/completions { default_type application/json; return 200 '$body'; }
    location = /v1/models { default_type application/json; return 200 '{\"object\":\"list\",\"data\":[{\"id\":\"fixed\"}]}'; }
    location / { return 404; }
  }"
nginx_conf proxy "  server {
    listen 127.0.0.1:$PX;
    location / {
      proxy_pass http://fixed;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
    }
  }"

cat > "$work/profile.json" <<EOF
{"schema": "envelope.profile/v1", "created_unix_ms": 1,
 "fingerprint": {"schema": 1, "model": {"kind": "dummy", "preset": "tiny", "seed": 0}, "node": {"gpus": []}},
 "slo": {"ttft_p95_ms": 1000, "itl_p95_ms": null, "e2e_p99_ms": null},
 "configs": [], "selected": "overhead",
 "limits": {"max_context_tokens": 4096, "max_output_tokens": 256,
            "max_concurrent_seqs": 4096, "max_kv_tokens_in_flight": 16000000},
 "probes_total": 0}
EOF
start_gov() {
  local exe=$1 port=$2; shift 2
  # shellcheck disable=SC2086 # GOVERN_ENV is a list of NAME=value words.
  env ${GOVERN_ENV:-} ENVELOPE_LOG=warn "$exe" govern --profile "$work/profile.json" --upstream "http://127.0.0.1:$UP" \
    --listen "127.0.0.1:$port" --on-mismatch ignore "$@" > "$work/gov-$port.out" 2> "$work/gov-$port.log" &
  pids+=($!)
}
start_gov "$bin" "$G1" --tokenizer "$model"
start_gov "$bin" "$G2"
# The floor: a proxy on the governor's stack (hyper, one tokio thread)
# doing none of its work (crates/envelope-governor/examples/bare_proxy.rs).
"$bare" "127.0.0.1:$BP" "127.0.0.1:$UP" > "$work/bare.log" 2>&1 &
pids+=($!)
if [ -n "${BEFORE_BIN:-}" ]; then
  start_gov "$BEFORE_BIN" "$G3"
fi
for port in $UP $PX $G1 $G2 $BP ${BEFORE_BIN:+$G3}; do
  for _ in $(seq 1 100); do
    curl -fsS -o /dev/null "http://127.0.0.1:$port/v1/models" 2>/dev/null && break
    sleep 0.1
  done
done

cat > "$work/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"fixed","prompt":"Say hello to the world in a few words.","max_tokens":16}'
done = function(summary, latency, requests)
  io.write(string.format("RESULT %.1f %.3f %.3f %d %d\n",
    summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.requests))
end
EOF
# Latency: one connection, one request at a time (nothing queues, so what
# a proxy adds is its own work). Throughput: $conns connections, closed
# loop. ROUNDS rounds (default 3) take the four paths in turn, so a slow
# spell of the machine falls on all of them; the table has the medians.
lat() { wrk -t1 -c1 -d"${secs}s" -s "$work/post.lua" "http://127.0.0.1:$1/v1/completions" | awk '/^RESULT/ {print $3, $4}'; }
# The CPU time (user + system, clock ticks) a process has used.
ticks() { [ -n "$1" ] && awk '{print $14 + $15}' "/proc/$1/stat" || echo 0; }
# req/s, errors, requests, and the CPU ticks the proxy (PID $2) used.
tput() {
  local t0 t1 out
  t0=$(ticks "${2:-}")
  out=$(wrk -t2 -c"$conns" -d"${secs}s" -s "$work/post.lua" "http://127.0.0.1:$1/v1/completions" | awk '/^RESULT/ {print $2, $5, $6}')
  t1=$(ticks "${2:-}")
  echo "$out $((t1 - t0))"
}
rounds="${ROUNDS:-3}"
paths=(direct nginx bare tokenizer defaults)
ports=("$UP" "$PX" "$BP" "$G1" "$G2")
# Whose CPU time each path's row reports: nginx's worker, the bare proxy,
# each governor.
proc=("" "$(pgrep -P "$(cat "$work/proxy.pid")" | head -1)" "${pids[2]}" "${pids[0]}" "${pids[1]}")
paired_before=()
if [ -n "${BEFORE_BIN:-}" ]; then
  paths+=(before)
  ports+=("$G3")
  proc+=("${pids[3]}")
  paired_before=("before=127.0.0.1:$G3")
fi
# Warm up each path, then measure them in turn.
for port in "${ports[@]}"; do wrk -t1 -c4 -d1s -s "$work/post.lua" "http://127.0.0.1:$port/v1/completions" >/dev/null; done
for _ in $(seq 1 "$rounds"); do
  for k in "${!paths[@]}"; do lat "${ports[$k]}" >>"$work/lat-${paths[$k]}"; done
  for k in "${!paths[@]}"; do tput "${ports[$k]}" "${proc[$k]}" >>"$work/tput-${paths[$k]}"; done
done
# Latency again, interleaved: one connection per path, the four paths taken
# in turn request by request, so every path meets the same spells of a
# noisy machine (runs of a few seconds each, one path after another, put
# the added p50 of one path anywhere from 0.8x to 3.7x the other's here).
python3 scripts/paired-latency.py "$((secs * rounds))" /v1/completions \
  '{"model":"fixed","prompt":"Say hello to the world in a few words.","max_tokens":16}' \
  "direct=127.0.0.1:$UP" "nginx=127.0.0.1:$PX" "bare=127.0.0.1:$BP" "tokenizer=127.0.0.1:$G1" "defaults=127.0.0.1:$G2" \
  "${paired_before[@]}" > "$work/paired"
src1=$(curl -s -D - -o /dev/null -H 'content-type: application/json' -d '{"prompt":"hi","max_tokens":1}' "http://127.0.0.1:$G1/v1/completions" | awk -F': ' 'tolower($1)=="x-envelope-token-count" {print $2}' | tr -d '\r')
src2=$(curl -s -D - -o /dev/null -H 'content-type: application/json' -d '{"prompt":"hi","max_tokens":1}' "http://127.0.0.1:$G2/v1/completions" | awk -F': ' 'tolower($1)=="x-envelope-token-count" {print $2}' | tr -d '\r')

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a); POST /v1/completions to a fixed 200 upstream (nginx return); medians of $rounds alternating rounds of latency (wrk -t1 -c1 -d${secs}s) and req/s (wrk -t2 -c$conns -d${secs}s)"
echo
python3 - "$work" "$src1" "$src2" "$secs" <<'EOF'
import statistics, sys
work, src1, src2, secs = sys.argv[1:]
def cols(kind, path):
    rows = [l.split() for l in open(f"{work}/{kind}-{path}") if l.strip()]
    return [[float(r[i]) for r in rows] for i in range(len(rows[0]))]
def lat(path):
    p50, p99 = cols("lat", path)
    return statistics.median(p50), statistics.median(p99)
def tput(path):
    rps, err = cols("tput", path)[:2]
    return statistics.median(rps), int(sum(err))
def rounds(path):
    # Per round: req/s, and the proxy's CPU time (user + system) a request.
    rps, _, n, ticks = cols("tput", path)
    tick = 1e6 / __import__("os").sysconf("SC_CLK_TCK")
    return rps, [t * tick / max(c, 1) for t, c in zip(ticks, n)]
d50, d99 = lat("direct"); drps, _ = tput("direct")
n50, n99 = lat("nginx"); nrps, nerr = tput("nginx")
b50, b99 = lat("bare"); brps, berr = tput("bare")
t50, t99 = lat("tokenizer"); trps, terr = tput("tokenizer")
g50, g99 = lat("defaults"); grps, gerr = tput("defaults")
add = lambda x, d: max(x - d, 0.0)
nadd50, nadd99 = add(n50, d50), add(n99, d99)
print(f"direct to the upstream: p50 {d50:.3f} ms, p99 {d99:.3f} ms (one connection); {drps:,.0f} req/s")
print()
print("| path | added p50 (ms) | added p99 (ms) | req/s | x nginx: p50 / p99 / req/s | errors |")
print("|---|---|---|---|---|---|")
print(f"| nginx proxy_pass | {nadd50:.3f} | {nadd99:.3f} | {nrps:,.0f} | 1 / 1 / 1 | {nerr} |")
for name, p50, p99, rps, err in [
    ("bare hyper proxy (the stack's floor)", b50, b99, brps, berr),
    (f"envelope govern --tokenizer model.gguf (counts: {src1})", t50, t99, trps, terr),
    (f"envelope govern, defaults (counts: {src2})", g50, g99, grps, gerr),
]:
    r50 = add(p50, d50) / nadd50 if nadd50 > 0 else float("inf")
    r99 = add(p99, d99) / nadd99 if nadd99 > 0 else float("inf")
    print(f"| {name} | {add(p50, d50):.3f} | {add(p99, d99):.3f} | {rps:,.0f} | {r50:.2f} / {r99:.2f} / {rps / nrps:.2f} | {err} |")
print()
# Requests/s again, as each round's ratio to nginx's in the same round
# (the rounds meet different spells of a shared machine; a ratio within
# one round does not), and what each proxy's process spent a request.
nr, ncpu = rounds("nginx")
print(f"req/s round by round ({len(nr)} rounds, each path {secs}s a round), as a ratio to nginx's in the same round; CPU time (user + system) of the proxy's process a request")
print()
print("| path | req/s x nginx, median (range) | CPU us a request, median | CPU x nginx |")
print("|---|---|---|---|")
print(f"| nginx proxy_pass | 1 | {statistics.median(ncpu):.1f} | 1 |")
for key, name in [("bare", "bare hyper proxy (the stack's floor)"), ("tokenizer", "envelope govern --tokenizer model.gguf"), ("defaults", "envelope govern, defaults")]:
    r, cpu = rounds(key)
    ratios = [a / b for a, b in zip(r, nr)]
    print(f"| {name} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(cpu):.1f} | {statistics.median(cpu) / statistics.median(ncpu):.2f} |")
print()
paired = {l.split()[0]: [float(x) for x in l.split()[1:]] for l in open(f"{work}/paired") if l.strip()}
pd50, pd99 = paired["direct"][:2]
pn50, pn99 = add(paired["nginx"][0], pd50), add(paired["nginx"][1], pd99)
print(f"interleaved (one connection per path, the paths in turn request by request; {int(paired['direct'][2]):,} requests a path; the client's own time is in every path and cancels out): direct p50 {pd50 / 1000:.3f} ms, p99 {pd99 / 1000:.3f} ms")
print()
print("| path | added p50 (ms) | added p99 (ms) | x nginx: p50 / p99 | errors |")
print("|---|---|---|---|---|")
for key, name in [("nginx", "nginx proxy_pass"), ("bare", "bare hyper proxy (the stack's floor)"), ("tokenizer", "envelope govern --tokenizer model.gguf"), ("defaults", "envelope govern, defaults")]:
    p50, p99, n, err = paired[key]
    a50, a99 = add(p50, pd50), add(p99, pd99)
    r50 = a50 / pn50 if pn50 > 0 else float("inf")
    r99 = a99 / pn99 if pn99 > 0 else float("inf")
    print(f"| {name} | {a50 / 1000:.3f} | {a99 / 1000:.3f} | {r50:.2f} / {r99:.2f} | {int(err)} |")
if "before" in paired:
    p50, p99, n, err = paired["before"]
    print(f"| envelope govern, defaults, BEFORE_BIN | {add(p50, pd50) / 1000:.3f} | {add(p99, pd99) / 1000:.3f} | {add(p50, pd50) / pn50 if pn50 > 0 else float('inf'):.2f} / {add(p99, pd99) / pn99 if pn99 > 0 else float('inf'):.2f} | {int(err)} |")
    # This build against the earlier one, round by round: both ran the
    # defaults in the same rounds, so a slow spell falls on both.
    ar, acpu = rounds("defaults")
    br, bcpu = rounds("before")
    print()
    print("this build (defaults) against BEFORE_BIN (defaults), round by round")
    print()
    print("| round | req/s this / before | CPU us a request this / before |")
    print("|---|---|---|")
    rr = [a / b for a, b in zip(ar, br)]
    cr = [a / b for a, b in zip(acpu, bcpu)]
    for i, (r, c) in enumerate(zip(rr, cr), 1):
        print(f"| {i} | {r:.3f} | {c:.3f} |")
    mr, mc = statistics.median(rr), statistics.median(cr)
    print(f"| median | {mr:.3f} | {mc:.3f} |")
    print()
    ok = mr >= 0.9 and mc <= 1.1
    print(f"against before: median req/s x{mr:.3f}, CPU a request x{mc:.3f}: {'within' if ok else 'NOT within'} 10%")
print()
print("targets: added p50 and p99 at most 1.5x nginx's, req/s at least 0.8x nginx's")
EOF
