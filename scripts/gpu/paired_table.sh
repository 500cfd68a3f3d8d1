#!/usr/bin/env bash
# The adaptive table of docs/gpu.md (hosts 32-35): five engines (more with K0_FULL, K0_TWIN) up together on one GPU, every
# arm on the same prompts in `bench paired`'s balanced order, at 1, 8 and 64 clients.
#
#   bash scripts/gpu/paired_table.sh MODEL RESULTS
#
# Run inside the offline environment (`bash scripts/gpu/runner.sh -- bash scripts/gpu/paired_table.sh ...`)
# or wherever `python3 -m bench` finds vLLM. The engines: plain `vllm serve` (`plain`) and four engine
# hosts with ngram_gpu at K_max 4: adaptive with the mixture prior (`adaptive`, the default),
# adaptive with the pooled prior (`pooled`), static K = 0 and K = 4 (`k0`, `k4`), each with the same
# KV cache (vLLM's memory profiling skipped, so the engines cannot disturb each other's), every
# engine host writing a step trace (RESULTS/steps.csv.<engine-core pid>, xz-compressed at the end).
# Writes RESULTS/c1, c8, c64 (`paired.json`; `python -m bench paired --report FILE [--baseline ARM]`),
# RESULTS/{mixture,pooled,k0}-state-cN.json (the engine hosts' /control/state after each run; with OFF_ARMS also
# mixture-off- and k0-off-),
# RESULTS/start.log and RESULTS/overhead (start-up, first TTFT after warm-up), RESULTS/progress,
# RESULTS/topology.txt (CPUs, NUMA nodes, the GPU's CPU affinity) and RESULTS/DONE at the end. The engines are stopped on exit, whatever happened.
# Environment: KV_BYTES (KV cache per engine, default 6 GiB), GPU_UTIL (0.14), K_MAX (4),
# BUDGET_C1 / BUDGET_C8 / BUDGET_C64 (seconds of rounds per run: 300 / 200 / 250; 0 skips the run). K0_FULL=1 adds a sixth
# engine host, `k0full`: static K = 0 with SPECPILOT_HOOK_LEAN=0 (the hook's full per-step path, as an adaptive
# engine host's steps at K = 0 run it), to tell what the full path costs from what drafting before leaves
# behind. K0_TWIN=1 adds `k0b`, a second static K = 0 engine host like `k0`: an A/A control, what two engine
# processes with the same arguments differ by on this host (their step times and tokens/s). MIX_OLD=1 adds
# `adaptive_old`, an adaptive engine host with the probe schedule and the step-time model of before host 38
# (SPECPILOT_PROBE_PRIOR=0 SPECPILOT_LEAN_STEP_TIMES=0), beside the adaptive one on the same prompts. POOLED=0 leaves out
# the `pooled` engine host (its rounds then go to the others), K4=0 the `k4` one. K0_NOTRACE=1 adds `k0_notrace`, a
# static K = 0 engine host with no step trace (and so without vLLM's `--cudagraph-metrics`): what tracing costs `k0`,
# and, since an untraced hook at a static K = 0 steps aside between state publishes (engine_host/scheduler.py), what
# stepping aside gives. K0_IN=1 adds `k0_in`, the same with SPECPILOT_HOOK_ASIDE=0: the hook on its lean path every step.
# A_IN=1 adds `adaptive_in`, the adaptive engine host with SPECPILOT_HOOK_ASIDE=0 (host 49's tree stood aside in the
# adaptive policy's rests too; since then the adaptive engine host's rests stay on the lean path and the two run alike).
# SPAN8=1 adds `adaptive_span8`, the adaptive engine host with SPECPILOT_REST_SPAN_SCALING=0: its rests at K = 0 on the lean
# path (8 steps under the gate's batch rule, 16 in the policy's own rests) keep their length at every batch size, as on
# host 50's tree, where they now last B // 16 times as long from 32 requests. A_TWIN=1 adds `adaptive_b`, a second
# adaptive engine host like `adaptive`: the adaptive engine host's A/A control (host 51's two alike adaptive engine hosts
# differed by 3-4 % at 8 clients), with its A/A table under each run's table.
# B_OLD=1 adds `adaptive_prev`, the adaptive engine host with B_OLD_ENV (default SPECPILOT_PROBE_BACKOFF=0: the per-request
# gate's probes as before 2026-12-02, no backoff, every burst after a drain explored soon; SPECPILOT_EXPLORE_BY_CLASS=0:
# every exploration at several requests past the gate, as before host 57), beside `adaptive` on the same prompts.
# GEO=1 adds `adaptive_geometric`, an adaptive engine host whose per-request gate prices drafts by the geometric law
# alone (`speculation.adaptive.gain` = geometric), beside `adaptive` and its calibrated gain on the same prompts.
# TRACE=0 writes no step trace (a traced hook never steps aside).
# SERVE_K0=1 adds `vllm_k0`: plain `vllm serve` with the engine hosts' ngram_gpu speculative config at K_max and a
# batch-size table giving K = 0 at every batch size, and no SpecPilot part: what vLLM's own speculative path costs at
# K = 0. PLAIN_TWIN=1 adds `plain_b`, a second plain vLLM like `plain`: the A/A control of plain vLLM (every `serve`
# engine already runs at the engine hosts' --max-model-len 2048, bench/gpu_bench.py). C1_WORKLOADS, C8_WORKLOADS and
# C64_WORKLOADS replace a table's workloads (defaults chat,code,docs,mixed / mixed,code,docs / docs,code,shift): a
# per-cell target resolved at 2 % takes 100-460 rounds on the offline H200 hosts (docs/gpu.md, host 36), so spend
# a run's rounds on the arms and cells it is about. C8_PER_CLIENT and C64_PER_CLIENT (defaults 4 and 2) are the requests
# each client sends per arm in a round of those tables: fewer make shorter rounds, and so more of them in a budget.
# PIN_GPU_NODE=1 runs every process on the CPUs local to the GPU
# (its PCI device's local_cpulist; RESULTS/topology.txt says what was done). With a py-spy executable (PY_SPY, or the payload's in
# $SPECPILOT_SCRATCH/site/bin), after the tables: `bench profile-step --attach` samples the mixture engine host
# and `k0` (and `k0full`) in turn at 64 clients of code, where the adaptive engine host switches K
# (RESULTS/profile-c64-code.md and its folder; with OFF_ARMS `adaptive_off` and `k0_off` too); PROFILE_CELLS
# replaces the cells profiled (CLIENTS:WORKLOAD[:SECONDS] each, default "64:code", 12 s an engine; e.g. "64:code 1:chat:20"
# adds chat at one client, RESULTS/profile-c1-chat.md); PROFILE_ENGINES replaces the engines profiled (their names in
# RESULTS/state.json: plain, a, f0, aoff, f0off, ...; e.g. "plain,f0"); PROFILE=0 leaves the profile out. `bench gpu-clocks` samples the
# GPU's clocks, power and P-state every 100 ms through the run (RESULTS/gpu-clocks.csv; GPU_CLOCKS=0 leaves it out):
# `bench step-trace TRACE --gpu-clocks RESULTS/gpu-clocks.csv` reads each burst's median step against them.
# CORE_CPU (default auto, the engine host's own default on a GPU: each engine host's step loop on a CPU of its own,
# engine_host/cpu_affinity.py) is the engine hosts' --core-cpu; OFF_ARMS=1 adds `adaptive_off` and `k0_off`, the
# adaptive and the static K = 0 engine host with --core-cpu off, beside them. PIN_CPUS=A,B adds `adaptive_pin` and `k0_pin`: the adaptive and the static K = 0 engine host with their engine core's
# step loop on CPU A and B (`--core-cpu`); first `bench cpu-pairs` measures which CPUs slow A and B down (hyperthread
# siblings a hypervisor hides: RESULTS/cpu-pairs.md and .json), and every other process of the run is kept off A, B
# and those (RESULTS/topology.txt says what was kept off). Once the engines are up, `bench cpu-pairs` measures which CPUs
# slow down the CPUs the step loops hold (RESULTS/cpu-pairs-held.md and .json; CPU_PAIRS=0 leaves it out).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
M=${1:?usage: paired_table.sh MODEL RESULTS}
R=${2:?usage: paired_table.sh MODEL RESULTS}
KV_BYTES=${KV_BYTES:-6442450944}
GPU_UTIL=${GPU_UTIL:-0.14}
K_MAX=${K_MAX:-4}
mkdir -p "$R"
[ "${K0_FULL:-}" = 0 ] && K0_FULL=
[ "${K0_TWIN:-}" = 0 ] && K0_TWIN=
[ "${MIX_OLD:-}" = 0 ] && MIX_OLD=
[ "${K0_NOTRACE:-}" = 0 ] && K0_NOTRACE=
[ "${K0_IN:-}" = 0 ] && K0_IN=
[ "${A_IN:-}" = 0 ] && A_IN=
[ "${SPAN8:-}" = 0 ] && SPAN8=
[ "${A_TWIN:-}" = 0 ] && A_TWIN=
[ "${SERVE_K0:-}" = 0 ] && SERVE_K0=
[ "${PLAIN_TWIN:-}" = 0 ] && PLAIN_TWIN=
[ "${GEO:-}" = 0 ] && GEO=
[ "${B_OLD:-}" = 0 ] && B_OLD=
POOLED_ENGINE=1
[ "${POOLED:-1}" = 0 ] && POOLED_ENGINE=
K4_ENGINE=1
[ "${K4:-1}" = 0 ] && K4_ENGINE=
progress() { echo "$(date +%T) $*" | tee -a "$R/progress"; }
# the host's CPUs, NUMA nodes and the GPU's place among them (the step trace's `cpu` column reads against these)
{ lscpu; for n in /sys/devices/system/node/node[0-9]*; do [ -e "$n/cpulist" ] && echo "$(basename "$n") cpus $(cat "$n/cpulist")"; done
  nvidia-smi topo -m; } > "$R/topology.txt" 2>&1
if [ "${PIN_GPU_NODE:-0}" = 1 ]; then
  # every process of the run (engines, API servers, the client) on the CPUs local to the GPU, inherited from here
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | head -1 | tr 'A-F' 'a-f')
  bus=${bus: -12}  # 00000000:19:00.0 -> 0000:19:00.0, as sysfs names it
  cpus=$(cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null || true)
  if [ -n "$cpus" ] && taskset -cp "$cpus" $$ > /dev/null; then
    echo "pinned to the GPU's local CPUs $cpus (bus ${bus})" >> "$R/topology.txt"
  else
    echo "PIN_GPU_NODE=1: the GPU's local CPUs not found (bus '${bus}'); not pinned" >> "$R/topology.txt"
  fi
fi
PIN_ENGINES=()
if [ -n "${PIN_CPUS:-}" ]; then
  PIN_A=${PIN_CPUS%%,*}
  PIN_B=${PIN_CPUS##*,}
  python3 -m bench cpu-pairs --cpus "$PIN_CPUS" --out "$R/cpu-pairs.json" > "$R/cpu-pairs.md" 2> "$R/cpu-pairs.log"
  # this script, and so every engine it starts, off the pinned CPUs and whatever slows them down
  rest=$(python3 - "$R/cpu-pairs.json" "$PIN_CPUS" <<'PY'
import json, os, sys
pins = {int(c) for c in sys.argv[2].split(",")}
try:
    sib = {int(b) for v in json.load(open(sys.argv[1]))["siblings"].values() for b in v}
except (OSError, ValueError, KeyError):
    sib = set()
keep = sorted(os.sched_getaffinity(0) - pins - sib) or sorted(os.sched_getaffinity(0) - pins)
print(",".join(map(str, keep)))
PY
)
  taskset -cp "$rest" $$ > /dev/null && echo "PIN_CPUS=$PIN_CPUS: the run's other processes on CPUs $rest" >> "$R/topology.txt"
fi
CLOCKS_PID=
if [ "${GPU_CLOCKS:-1}" != 0 ]; then  # the GPU's clocks and power through the run, on the step traces' clock
  python3 -m bench gpu-clocks --out "$R/gpu-clocks.csv" --interval-ms 100 2> "$R/gpu-clocks.log" &
  CLOCKS_PID=$!
fi
trap '[ -n "$CLOCKS_PID" ] && kill "$CLOCKS_PID" 2>/dev/null; stop_engines "$M" "$R/state.json" "$R/stop"; touch "$R/DONE"' EXIT
E="--core-cpu ${CORE_CPU:-auto} --speculative-method ngram_gpu --k-max $K_MAX --speculation-mode fixed --k 0 --no-prefix-caching --max-num-seqs 64"
E="$E --max-model-len 2048 --gpu-memory-utilization $GPU_UTIL --warmup quick -- --kv-cache-memory-bytes $KV_BYTES"
EB=${E#--core-cpu * }  # the same without the step loop's CPU
[ -n "${PIN_CPUS:-}" ] && PIN_ENGINES=(--engine "host:apin:--core-cpu $PIN_A $EB" --engine "host:f0pin:--core-cpu $PIN_B $EB")
[ "${OFF_ARMS:-0}" = 1 ] && PIN_ENGINES+=(--engine "host:aoff:--core-cpu off $EB" --engine "host:f0off:--core-cpu off $EB")
PLAIN="--gpu-memory-utilization $GPU_UTIL --kv-cache-memory-bytes $KV_BYTES --no-enable-prefix-caching --max-num-seqs 64"
# vLLM's own ngram_gpu engine: the engine hosts' speculative config (method, K_max, n-gram lookup), K = 0 at every batch size
SPEC_K0=$(python3 -c 'import json, sys; from engine_host.speculation import SpeculationSpec as S, speculative_config as c
print(json.dumps(c(S(method="ngram_gpu", k_max=int(sys.argv[1]))) | {"num_speculative_tokens_per_batch_size": [[1, 1048576, 0]]}))' "$K_MAX")
TRACE_FILE=$R/steps.csv
[ "${TRACE:-1}" = 0 ] && TRACE_FILE=
SPECPILOT_STEP_TRACE=$TRACE_FILE python3 -m bench host-overhead --model "$M" --parallel-start --keep \
  --state "$R/state.json" --out "$R/overhead" --workloads chat --loads 1 --rounds 1 --duration 3 --warm 2 --ttfts 7 \
  --engine "serve:plain:$PLAIN" ${SERVE_K0:+--engine "serve:vk0:$PLAIN --speculative-config '$SPEC_K0'"} \
  ${PLAIN_TWIN:+--engine "serve:plainb:$PLAIN"} \
  --engine "host:a:$E" ${POOLED_ENGINE:+--engine "host:p:$E"} --engine "host:f0:$E" ${K4_ENGINE:+--engine "host:f4:$E"} \
  ${K0_FULL:+--engine "host:f0x:SPECPILOT_HOOK_LEAN=0 $E"} ${K0_TWIN:+--engine "host:f0b:$E"} \
  ${MIX_OLD:+--engine "host:ao:SPECPILOT_PROBE_PRIOR=0 SPECPILOT_LEAN_STEP_TIMES=0 $E"} \
  ${A_IN:+--engine "host:ain:SPECPILOT_HOOK_ASIDE=0 $E"} \
  ${SPAN8:+--engine "host:as8:SPECPILOT_REST_SPAN_SCALING=0 $E"} ${A_TWIN:+--engine "host:ab:$E"} \
  ${GEO:+--engine "host:ag:$E"} ${B_OLD:+--engine "host:abo:${B_OLD_ENV:-SPECPILOT_PROBE_BACKOFF=0} $E"} \
  ${K0_NOTRACE:+--engine "host:f0nt:SPECPILOT_STEP_TRACE= $E"} \
  ${K0_IN:+--engine "host:f0in:SPECPILOT_STEP_TRACE= SPECPILOT_HOOK_ASIDE=0 $E"} \
  ${PIN_ENGINES[@]+"${PIN_ENGINES[@]}"} > "$R/start.log" 2>&1
rc=$?
progress "engines up (rc $rc)"
[ $rc -eq 0 ] || exit $rc
# the CPUs the engine hosts' step loops took (`auto`: their lock files): which other CPUs slow them down, measured
# while the engines idle (hidden hyperthread siblings; docs/gpu.md, host 42). CPU_PAIRS=0 leaves it out.
HELD=$(python3 -c 'from engine_host import cpu_affinity as c; print(",".join(map(str, sorted(c.held_by_others()))))' 2>/dev/null)
if [ -n "$HELD" ] && [ -z "${PIN_CPUS:-}" ] && [ "${CPU_PAIRS:-1}" != 0 ]; then  # (PIN_CPUS measured its own above)
  python3 -m bench cpu-pairs --cpus "$HELD" --out "$R/cpu-pairs-held.json" > "$R/cpu-pairs-held.md" 2> "$R/cpu-pairs-held.log"
  progress "cpu-pairs of the held CPUs $HELD (rc $?)"
fi
eval "$(engine_vars "$R/state.json")"
[ "${OFF_ARMS:-0}" = 1 ] && export AOFF_TOKEN F0OFF_TOKEN
export A_TOKEN F0_TOKEN ${K0_NOTRACE:+F0NT_TOKEN} ${K0_IN:+F0IN_TOKEN} ${PIN_CPUS:+APIN_TOKEN F0PIN_TOKEN} ${K4_ENGINE:+F4_TOKEN} ${POOLED_ENGINE:+P_TOKEN} ${K0_FULL:+F0X_TOKEN} ${K0_TWIN:+F0B_TOKEN} ${MIX_OLD:+AO_TOKEN} ${A_IN:+AIN_TOKEN} ${SPAN8:+AS8_TOKEN} ${A_TWIN:+AB_TOKEN} ${GEO:+AG_TOKEN} ${B_OLD:+ABO_TOKEN}
ARMS=(--arm "plain=$PLAIN_URL" --arm "adaptive=$A_URL,mode=adaptive,token-env=A_TOKEN")
[ -n "${SERVE_K0:-}" ] && ARMS+=(--arm "vllm_k0=$VK0_URL")
[ -n "${PLAIN_TWIN:-}" ] && ARMS+=(--arm "plain_b=$PLAINB_URL")
[ -n "${MIX_OLD:-}" ] && ARMS+=(--arm "adaptive_old=$AO_URL,mode=adaptive,token-env=AO_TOKEN")
[ -n "$POOLED_ENGINE" ] && ARMS+=(--arm "pooled=$P_URL,mode=adaptive_pooled,token-env=P_TOKEN")
ARMS+=(--arm "k0=$F0_URL,mode=fixed:0,token-env=F0_TOKEN")
[ -n "${K0_NOTRACE:-}" ] && ARMS+=(--arm "k0_notrace=$F0NT_URL,mode=fixed:0,token-env=F0NT_TOKEN")
[ -n "${K0_IN:-}" ] && ARMS+=(--arm "k0_in=$F0IN_URL,mode=fixed:0,token-env=F0IN_TOKEN")
[ -n "${A_IN:-}" ] && ARMS+=(--arm "adaptive_in=$AIN_URL,mode=adaptive,token-env=AIN_TOKEN")
[ -n "${SPAN8:-}" ] && ARMS+=(--arm "adaptive_span8=$AS8_URL,mode=adaptive,token-env=AS8_TOKEN")
[ -n "${B_OLD:-}" ] && ARMS+=(--arm "adaptive_prev=$ABO_URL,mode=adaptive,token-env=ABO_TOKEN")
[ -n "${GEO:-}" ] && ARMS+=(--arm "adaptive_geometric=$AG_URL,mode=adaptive_geometric,token-env=AG_TOKEN")
if [ -n "${PIN_CPUS:-}" ]; then
  ARMS+=(--arm "adaptive_pin=$APIN_URL,mode=adaptive,token-env=APIN_TOKEN" --arm "k0_pin=$F0PIN_URL,mode=fixed:0,token-env=F0PIN_TOKEN")
fi
if [ "${OFF_ARMS:-0}" = 1 ]; then
  ARMS+=(--arm "adaptive_off=$AOFF_URL,mode=adaptive,token-env=AOFF_TOKEN" --arm "k0_off=$F0OFF_URL,mode=fixed:0,token-env=F0OFF_TOKEN")
fi
[ -n "$K4_ENGINE" ] && ARMS+=(--arm "k4=$F4_URL,mode=fixed:4,token-env=F4_TOKEN")
PROFILED=${PROFILE_ENGINES:-a,f0}  # the engines profiled, by their names in the state file (plain, a, f0, ...)
if [ -n "${K0_FULL:-}" ]; then
  ARMS+=(--arm "k0full=$F0X_URL,mode=fixed:0,token-env=F0X_TOKEN")
  PROFILED=${PROFILE_ENGINES:-a,f0,f0x}
fi
TWIN=()
if [ -n "${K0_TWIN:-}" ]; then
  ARMS+=(--arm "k0b=$F0B_URL,mode=fixed:0,token-env=F0B_TOKEN")
  TWIN=(--twin k0=k0b)  # the A/A table under each run's table
fi
if [ -n "${A_TWIN:-}" ]; then
  ARMS+=(--arm "adaptive_b=$AB_URL,mode=adaptive,token-env=AB_TOKEN")
  TWIN+=(--twin adaptive=adaptive_b)  # the adaptive engine host's A/A table
fi
[ -n "${PLAIN_TWIN:-}" ] && TWIN+=(--twin plain=plain_b)  # plain vLLM's A/A table too
PY_SPY=${PY_SPY:-}
SPY=${SPECPILOT_SCRATCH:-/tmp/specpilot-gpu}/site/bin/py-spy
[ -z "$PY_SPY" ] && [ -x "$SPY" ] && PY_SPY=$SPY
states() {
  curl -s -H "Authorization: Bearer $A_TOKEN" "$A_URL/control/state" > "$R/mixture-state-$1.json"
  [ -z "${MIX_OLD:-}" ] || curl -s -H "Authorization: Bearer $AO_TOKEN" "$AO_URL/control/state" > "$R/mixture-old-state-$1.json"
  [ -z "${A_IN:-}" ] || curl -s -H "Authorization: Bearer $AIN_TOKEN" "$AIN_URL/control/state" > "$R/mixture-in-state-$1.json"
  [ -z "${SPAN8:-}" ] || curl -s -H "Authorization: Bearer $AS8_TOKEN" "$AS8_URL/control/state" > "$R/mixture-span8-state-$1.json"
  [ -z "${A_TWIN:-}" ] || curl -s -H "Authorization: Bearer $AB_TOKEN" "$AB_URL/control/state" > "$R/mixture-b-state-$1.json"
  [ -z "${GEO:-}" ] || curl -s -H "Authorization: Bearer $AG_TOKEN" "$AG_URL/control/state" > "$R/geometric-state-$1.json"
  [ -z "${B_OLD:-}" ] || curl -s -H "Authorization: Bearer $ABO_TOKEN" "$ABO_URL/control/state" > "$R/mixture-prev-state-$1.json"
  [ -z "${K0_IN:-}" ] || curl -s -H "Authorization: Bearer $F0IN_TOKEN" "$F0IN_URL/control/state" > "$R/k0-in-state-$1.json"
  [ -z "${PIN_CPUS:-}" ] || curl -s -H "Authorization: Bearer $APIN_TOKEN" "$APIN_URL/control/state" > "$R/mixture-pin-state-$1.json"
  [ -z "$POOLED_ENGINE" ] || curl -s -H "Authorization: Bearer $P_TOKEN" "$P_URL/control/state" > "$R/pooled-state-$1.json"
  curl -s -H "Authorization: Bearer $F0_TOKEN" "$F0_URL/control/state" > "$R/k0-state-$1.json"
  if [ "${OFF_ARMS:-0}" = 1 ]; then  # (engine.core_cpu_threads_moved: what the CPU keeper moved)
    curl -s -H "Authorization: Bearer $AOFF_TOKEN" "$AOFF_URL/control/state" > "$R/mixture-off-state-$1.json"
    curl -s -H "Authorization: Bearer $F0OFF_TOKEN" "$F0OFF_URL/control/state" > "$R/k0-off-state-$1.json"
  fi
}
# table NAME BUDGET WORKLOADS CLIENTS PER-CLIENT: one `bench paired` run (skipped at a budget of 0)
table() {
  if [ "$2" = 0 ]; then progress "$1: skipped (budget 0)"; return; fi
  python3 -m bench paired "${ARMS[@]}" ${TWIN[@]+"${TWIN[@]}"} --workloads "$3" --clients "$4" --per-client "$5" --rounds 400 \
    --time-budget "$2" --out "$R/$1" > "$R/$1.log" 2>&1
  progress "$4 client(s) (rc $?)"
  states "$1"
}
table c1 "${BUDGET_C1:-300}" "${C1_WORKLOADS:-chat,code,docs,mixed}" 1 1
table c8 "${BUDGET_C8:-200}" "${C8_WORKLOADS:-mixed,code,docs}" 8 "${C8_PER_CLIENT:-4}"
table c64 "${BUDGET_C64:-250}" "${C64_WORKLOADS:-docs,code,shift}" 64 "${C64_PER_CLIENT:-2}"
[ "${OFF_ARMS:-0}" = 1 ] && [ -z "${PROFILE_ENGINES:-}" ] && PROFILED=$PROFILED,aoff,f0off
if [ -n "$PY_SPY" ] && [ "${PROFILE:-1}" != 0 ]; then  # PROFILE=0: no profile after the tables
  for cell in ${PROFILE_CELLS:-64:code}; do  # CLIENTS:WORKLOAD[:SECONDS] each, e.g. "64:code 1:chat:20"
    n=${cell%%:*}; rest=${cell#*:}; w=${rest%%:*}; secs=12
    [ "$rest" != "$w" ] && secs=${rest#*:}
    python3 -m bench profile-step --attach "$R/state.json" --engines "$PROFILED" --clients "$n" --workload "$w" \
      --seconds "$secs" --rate 500 --py-spy "$PY_SPY" --out "$R/profile-c$n-$w" > "$R/profile-c$n-$w.md" 2> "$R/profile-c$n-$w.log"
    progress "profile at $n client(s) of $w (rc $?)"
  done
fi
stop_engines "$M" "$R/state.json" "$R/stop"
[ -n "$CLOCKS_PID" ] && kill "$CLOCKS_PID" 2>/dev/null && wait "$CLOCKS_PID"
trap - EXIT
for f in "$R"/steps.csv.* "$R/gpu-clocks.csv"; do [ -e "$f" ] && xz -T4 "$f"; done
grep -o "EngineCore pid=[0-9]*" "$R"/overhead/logs/*.log 2>/dev/null | sort -u > "$R/engine-pids.txt"
progress "done"
touch "$R/DONE"
