set -euo pipefail

# --- settings: each an environment variable, most also an option (--help) -------------------------------------
LOG_DIR=${LOG_DIR:-}                       # default ./logs/summit-<job id>: logs, the job's Serve YAML, endpoint.json
STATE_DIR=${STATE_DIR:-}                   # default /tmp/summit-<job id> on each node (short: HAProxy's sockets)
SUMMIT_VENV=${SUMMIT_VENV-.venv}           # empty: use the current environment
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$GPUS_PER_NODE_DEFAULT}}
CPUS_PER_NODE=${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}
NODES_WAIT_S=${NODES_WAIT_S:-600}          # every node's Ray must join within this
START_TRIES=${START_TRIES:-3}              # tries of each node's `ray start` (Ray gives a node 30 s to register)
READY_WAIT_S=${READY_WAIT_S:-3600}         # the app must answer within this (a 405B loads in 6–40 minutes)
DRAIN_WAIT_S=${DRAIN_WAIT_S:-240}          # drain: the longest wait for running requests (the signal comes 300 s ahead)
DRY_RUN=${DRY_RUN:-0}

usage() { sed -n '2,/^#SBATCH/p' "$0" | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --config) SERVE_CONFIG=$2; shift 2 ;;
    --log-dir) LOG_DIR=$2; shift 2 ;;
    --venv) SUMMIT_VENV=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "summit.sbatch: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

JOB_ID=${SLURM_JOB_ID:-local}
LOG_DIR=${LOG_DIR:-$PWD/logs/summit-$JOB_ID}
STATE_DIR=${STATE_DIR:-/tmp/summit-$JOB_ID}
ENDPOINT_FILE=$LOG_DIR/endpoint.json
START_REPORT=$LOG_DIR/start.json            # how `summit wait-ready` ended (merged into endpoint.json on a failure)
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
PIDS=()
NAMES=()
TRIES=()
NODE_LIST=()
LOST=()

say() { printf '%s summit.sbatch: %s\n' "$(date +%H:%M:%S)" "$*"; }

# run CMD...: run it, or print it in dry-run mode.
run() {
  if [ "$DRY_RUN" = 1 ]; then printf '+ %s\n' "$*"; else "$@"; fi
}

# step INDEX NAME LOG CMD...: job step INDEX in the background (its output appended to LOG), remembered by NAME.
step() {
  local index=$1 name=$2 log=$3
  shift 3
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s >> %s 2>&1 &\n' "$*" "$log"
    return 0
  fi
  "$@" >>"$log" 2>&1 &
  PIDS[index]=$!
  NAMES[index]=$name
  TRIES[index]=$((${TRIES[index]:-0} + 1))
}

# A node's `ray start --block` under a shell that, when it ends (scancel, the time limit, a failure), copies the
# node's Ray session logs (replicas, engines, controller, HAProxy) to LOG_DIR/ray-logs/<node>/: the node-local
# STATE_DIR they live in is removed when the job ends. On SIGTERM it copies first (Ray's own stop drains for up to
# 30 s, longer than SLURM's KillWait before its SIGKILL), then stops Ray.
# keep: copy this node's Ray session logs and HAProxy's to LOG_DIR/ray-logs/<node>/ (defined here for the batch
# script's own node, and passed to each node's step shell as text)
# shellcheck disable=SC2016 # expanded where it runs, on its node
KEEP_FN='keep() { local d=$LOG_DIR/ray-logs/${SLURMD_NODENAME:-$(hostname -s)} s; for s in "$STATE_DIR"/ray/session_latest /tmp/ray/session_latest; do if [ -d "$s/logs" ]; then mkdir -p "$d" && cp -rL "$s/logs/." "$d/" 2>/dev/null; break; fi; done; if [ -d "$STATE_DIR/haproxy" ]; then mkdir -p "$d/haproxy" && find "$STATE_DIR/haproxy" -type f \( -name "*.log" -o -name "*.cfg" \) -exec cp {} "$d/haproxy/" \; 2>/dev/null; fi; return 0; }'
eval "$KEEP_FN"
# shellcheck disable=SC2016
KEEP_LOGS="$KEEP_FN"'; trap "trap - TERM INT; keep; kill -TERM \$pid 2>/dev/null; wait \$pid; exit 143" TERM INT; "$@" & pid=$!; wait $pid; rc=$?; keep; exit $rc'
export LOG_DIR STATE_DIR

# Step 0 is the Ray head, step i its worker on nodes[i].
start_node() {
  local i=$1 node=${NODE_LIST[$1]}
  if [ "$i" = 0 ]; then
    step 0 "$node" "$LOG_DIR/ray-head.log" srun --nodes=1 --ntasks=1 -w "$node" bash -c "$KEEP_LOGS" keep-logs \
      ray start --head --block --node-ip-address="$HEAD_IP" --port="$RAY_PORT" --temp-dir="$STATE_DIR/ray" \
      --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --num-gpus="$GPUS_PER_NODE" "${CPU_ARGS[@]}"
  else
    step "$i" "$node" "$LOG_DIR/ray-worker-$node.log" srun --nodes=1 --ntasks=1 -w "$node" bash -c "$KEEP_LOGS" \
      keep-logs ray start --block --address="$HEAD_IP:$RAY_PORT" --node-ip-address="$(node_address "$node")" \
      --num-gpus="$GPUS_PER_NODE" "${CPU_ARGS[@]}"
  fi
}

allocation_nodes() {
  if [ -n "${SUMMIT_NODES:-}" ]; then
    # shellcheck disable=SC2086 # word splitting wanted: a list of host names
    printf '%s\n' $SUMMIT_NODES
  elif [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  else
    echo "summit.sbatch: not in a SLURM job; set SUMMIT_NODES=\"host1 host2\"" >&2
    return 1
  fi
}

# A node's address as SLURM knows it (its NodeAddr), else its name resolved.
node_address() {
  local addr=""
  if [ "$DRY_RUN" != 1 ] && command -v scontrol >/dev/null && [ -n "${SLURM_JOB_ID:-}" ]; then
    addr=$(scontrol show node "$1" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  fi
  if [ -z "$addr" ] || [ "$addr" = "$1" ]; then
    addr=$(getent hosts "$1" | awk '{print $1; exit}')
  fi
  echo "${addr:-$1}"
}

alive_nodes() {
  ray list nodes --address "http://127.0.0.1:$DASHBOARD_PORT" --filter "state=ALIVE" --limit 10000 --format json 2>/dev/null \
    | python3 -c 'import json, sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0
}

# wait_for_nodes N: until N Ray nodes are alive, starting again (up to START_TRIES) a node whose `ray start` exited
# (on a loaded head a node can miss the 30 s Ray gives it to register); NODES_WAIT_S is wall-clock time.
wait_for_nodes() {
  local want=$1 deadline=$((SECONDS + NODES_WAIT_S)) i
  [ "$DRY_RUN" = 1 ] && { echo "+ wait until $want Ray nodes are alive"; return 0; }
  until [ "$(alive_nodes)" -ge "$want" ]; do
    for i in "${!PIDS[@]}"; do
      kill -0 "${PIDS[$i]}" 2>/dev/null && continue
      if [ "${TRIES[$i]}" -ge "$START_TRIES" ]; then
        say "ray start on ${NAMES[$i]} exited ${TRIES[$i]} times; see $LOG_DIR/ray-*.log"
        endpoint failed "ray start on ${NAMES[$i]} exited ${TRIES[$i]} times (START_TRIES)"
        return 1
      fi
      say "ray start on ${NAMES[$i]} exited (try ${TRIES[$i]} of $START_TRIES); starting it again"
      wait "${PIDS[$i]}" 2>/dev/null || true
      start_node "$i"
    done
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "only $(alive_nodes) of $want Ray nodes joined after ${NODES_WAIT_S}s; their logs: $LOG_DIR/ray-*.log"
      endpoint failed "only $(alive_nodes) of $want nodes joined"
      return 1
    fi
    sleep 2
  done
}

# `serve deploy`, asked again (3 tries) when it fails: Serve answers 500 while it restarts a proxy it found slow.
deploy() {
  local try
  for try in 1 2 3; do
    run serve deploy "$SUMMIT_JOB_CONFIG" --address "http://127.0.0.1:$DASHBOARD_PORT" && return 0
    say "serve deploy failed (try $try of 3)"
    [ "$try" -lt 3 ] && sleep 10
  done
  endpoint failed "serve deploy failed 3 times (see the job's output)"
  return 1
}

# An offline batch job (`summit sbatch --batch`): `summit batch` of BATCH_INPUT on the allocation's Ray, then the end.
# A line already in BATCH_OUTPUT is skipped: the same script submitted again goes on where a time-out stopped it.
run_batch() {
  export BATCH_INPUT BATCH_OUTPUT
  say "running the batch $BATCH_INPUT on the models of $SERVE_CONFIG; answers in $BATCH_OUTPUT"
  endpoint running "summit batch $BATCH_INPUT"
  # a resubmitted job runs again the lines of its errors file that failed transiently (5xx, 408, 429, no answer)
  if run summit batch "$BATCH_INPUT" -o "$BATCH_OUTPUT" --config "$SUMMIT_JOB_CONFIG" --address "$HEAD_IP:$RAY_PORT" \
      --concurrency "${BATCH_CONCURRENCY:-512}" --retry-errors "${BATCH_RETRY_ERRORS:-transient}"; then
    say "batch done: $BATCH_OUTPUT"
    endpoint finished "answers in $BATCH_OUTPUT"
  else
    say "the batch failed (exit $?); answered lines so far are in $BATCH_OUTPUT, the Ray logs in $LOG_DIR/ray-logs"
    endpoint failed "summit batch failed; submit the script again to go on"
    exit 1
  fi
}

# Serve replicas still alive (a replica that is draining stays alive until its running requests end).
live_replicas() {
  ray list actors --address "http://127.0.0.1:$DASHBOARD_PORT" --filter "state=ALIVE" --limit 10000 --format json 2>/dev/null \
    | python3 -c 'import json, sys; print(sum(a["class_name"].startswith("ServeReplica:") for a in json.load(sys.stdin)))' \
      2>/dev/null || echo 0
}

# endpoint STATE [DETAIL]: write endpoint.json (atomically) for whoever waits for the job: a notebook, a script.
# With REPORT=FILE (summit wait-ready's --report), its reason, fix and the replica's log go in too: the log's path on
# its node, and where the job keeps a copy (LOG_DIR/ray-logs/<node>/, written when the job ends).
endpoint() {
  [ "$DRY_RUN" = 1 ] && { echo "+ endpoint.json: $1"; return 0; }
  STATE=$1 DETAIL=${2:-} LOST_NODES="${LOST[*]:-}" HEAD_IP=$HEAD_IP NODE_ADDRS="$(node_addresses)" \
    python3 - "$ENDPOINT_FILE" <<'PY'
import json, os, sys
e = os.environ
port, head = e["SUMMIT_HTTP_PORT"], e["SUMMIT_HEAD"]
bind = e.get("SUMMIT_HTTP_HOST") or "127.0.0.1"
dash = e["DASHBOARD_PORT"]
loopback = bind in ("127.0.0.1", "localhost", "::1")
doc = {"job_id": e["JOB_ID"], "state": e["STATE"], "detail": e["DETAIL"] or None,
       # `url` works on the head node and, after `tunnel`, on the machine that ran it; bound beyond loopback (the
       # YAML's http_options.host), it is the head's address
       "url": f"http://{'127.0.0.1' if loopback else e['HEAD_IP']}:{port}/v1",
       "host": head, "head": head, "port": int(port),
       "tunnel": f"ssh -N -L {port}:127.0.0.1:{port} {head}" if loopback else None,
       "dashboard_port": int(dash), "dashboard_tunnel": f"ssh -N -L {dash}:127.0.0.1:{dash} {head}",
       # the API key clients send (Authorization: Bearer KEY, or OPENAI_API_KEY): a file only the job's user reads;
       # null where the YAML has its own `auth:`
       "api_key_file": e.get("SUMMIT_API_KEY_FILE") or None,
       "log_dir": e["LOG_DIR"], "lost_nodes": e["LOST_NODES"].split()}
for key in ("BATCH_INPUT", "BATCH_OUTPUT"):
    if e.get(key):
        doc[key.lower()] = e[key]
if e.get("REPORT") and os.path.exists(e["REPORT"]):
    report = json.load(open(e["REPORT"]))
    doc.update({k: report[k] for k in ("reason", "fix", "kind", "model", "last_logged") if report.get(k)})
    if report.get("log"):  # "NODE_IP:PATH, PATH" on the replica's node; the job copies each node's logs when it ends
        ip, _, paths = report["log"].partition(":")
        node = {a: n for n, _, a in (pair.partition("=") for pair in e["NODE_ADDRS"].split())}.get(ip, ip)
        doc["log"] = report["log"]
        doc["log_kept"] = [f"{e['LOG_DIR']}/ray-logs/{node}/{os.path.basename(p.strip())}" for p in paths.split(",")]
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=1)
os.replace(tmp, sys.argv[1])
PY
}

# The job's API key (SUMMIT_API_KEY_FILE, written by `summit job-env` unless the YAML has its own `auth:`), else
# whatever OPENAI_API_KEY the job was given.
api_key() {
  if [ -n "${SUMMIT_API_KEY_FILE:-}" ]; then head -n 1 "$SUMMIT_API_KEY_FILE"; else printf '%s' "${OPENAI_API_KEY:-}"; fi
}

# "node=address ..." of the allocation's nodes (endpoint.json names a replica's node by its address's name).
node_addresses() {
  local node
  for node in "${NODE_LIST[@]}"; do printf '%s=%s ' "$node" "$(node_address "$node")"; done
}

# The token every Ray process and `serve deploy` use; made (private, not printed) when the default file is missing.
ensure_token() {
  if [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "$RAY_AUTH_TOKEN_PATH" ]; then
    return 0
  fi
  if [ "$RAY_AUTH_TOKEN_PATH" != "$HOME/.ray/auth_token" ]; then
    echo "summit.sbatch: RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty; write the cluster's token there" >&2
    return 1
  fi
  run sh -c 'umask 077 && ray get-auth-token --generate >/dev/null'
}

# HAProxy processes of this job on this node beyond the serving one: those a reload replaced, finishing their streams.
replaced_haproxies() {
  local count
  count=$(pgrep -c -f "haproxy.*$STATE_DIR/haproxy/" 2>/dev/null || true)
  echo $((${count:-0} > 1 ? ${count:-0} - 1 : 0))
}

# SLURM's signal ahead of the time limit (#SBATCH --signal=B:USR1@...): stop taking requests, let streams finish.
drain() {
  say "time limit near: draining (running requests finish; new ones are refused)"
  endpoint draining "the job's time limit is near"
  # Deploying the job's YAML without applications deletes them gracefully while Serve's proxies stay up: each replica
  # finishes its running requests (graceful_shutdown_timeout_s) and HAProxy's reload leaves the streams it carries to
  # the replaced process. (`serve shutdown` first would stop the proxies at once, HAProxy with its streams.)
  serve deploy "$SUMMIT_DRAIN_CONFIG" --address "http://127.0.0.1:$DASHBOARD_PORT" >/dev/null || true
  local waited=0 live replaced
  live=$(live_replicas)
  replaced=$(replaced_haproxies)
  while [ $((live + replaced)) -gt 0 ] && [ "$waited" -lt "$DRAIN_WAIT_S" ]; do
    sleep 2
    waited=$((waited + 2))
    live=$(live_replicas)
    replaced=$(replaced_haproxies)
  done
  serve shutdown -y --address "http://127.0.0.1:$DASHBOARD_PORT" >/dev/null || true
  if [ $((live + replaced)) -gt 0 ]; then
    say "drain: $live replica(s) and $replaced replaced HAProxy process(es) still had running requests after ${DRAIN_WAIT_S}s; stopping anyway"
    endpoint stopped "not drained: $live replica(s) and $replaced replaced HAProxy process(es) still had running requests after ${DRAIN_WAIT_S}s (DRAIN_WAIT_S)"
  else
    endpoint stopped "drained before the time limit (${waited}s)"
  fi
  exit 0
}

stop_all() {
  trap - EXIT TERM INT
  if [ "$DRY_RUN" != 1 ] && [ -d "$STATE_DIR/ray/session_latest/logs" ]; then
    # this node's Ray logs first: SLURM kills what is left KillWait (default 30 s) after its SIGTERM
    SLURMD_NODENAME=${SUMMIT_HEAD:-${SLURMD_NODENAME:-}} keep
    say "Ray logs (replicas, engines, controller, HAProxy) kept in $LOG_DIR/ray-logs"
  fi
  if [ "${#PIDS[@]}" -gt 0 ]; then
    kill "${PIDS[@]}" 2>/dev/null || true
    wait "${PIDS[@]}" 2>/dev/null || true
  fi
  [ "$DRY_RUN" = 1 ] || rm -rf "$STATE_DIR"
}

# Watch the job's steps: the head's end ends the job; a worker's end is a lost node (reported; Serve reschedules).
watch_steps() {
  while true; do
    local i
    for i in "${!PIDS[@]}"; do
      if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
        if [ "$i" = 0 ]; then
          say "the Ray head exited; the job ends (see $LOG_DIR/ray-head.log)"
          endpoint stopped "the Ray head exited"
          return 1
        fi
        if [[ " ${LOST[*]:-} " != *" ${NAMES[$i]} "* ]]; then
          LOST+=("${NAMES[$i]}")
          say "node ${NAMES[$i]} left the job (its Ray worker exited; $LOG_DIR/ray-worker-${NAMES[$i]}.log); replicas on it are restarted elsewhere if they fit"
          endpoint ready "node ${NAMES[$i]} lost"
        fi
      fi
    done
    sleep 5 &
    wait $! || true
  done
}

main() {
  trap stop_all EXIT
  trap 'exit 143' TERM INT
  trap drain USR1
  if [ -n "$SUMMIT_VENV" ] && [ -f "$SUMMIT_VENV/bin/activate" ]; then
    # shellcheck disable=SC1091 # the venv is made by scripts/setup.sh or pip
    . "$SUMMIT_VENV/bin/activate"
  fi
  mapfile -t NODE_LIST < <(allocation_nodes)
  if [ "${#NODE_LIST[@]}" -eq 0 ]; then
    echo "summit.sbatch: no nodes (SLURM_JOB_NODELIST or SUMMIT_NODES)" >&2
    exit 1
  fi
  export JOB_ID SUMMIT_HEAD=${NODE_LIST[0]}
  HEAD_IP=$(node_address "$SUMMIT_HEAD")
  run mkdir -p "$LOG_DIR" "$STATE_DIR"
  # this job's own ports and files (two jobs on one node do not collide), the direct path's environment for every
  # Ray process (srun passes the environment on), and the Serve YAML with the job's HTTP port
  if [ "$DRY_RUN" = 1 ]; then
    echo "+ eval \"\$(summit job-env --state-dir $STATE_DIR/haproxy --config $SERVE_CONFIG --config-out $LOG_DIR/serve.yaml)\""
    export SUMMIT_RAY_PORT=6379 SUMMIT_DASHBOARD_PORT=8265 SUMMIT_HTTP_PORT=8000 SUMMIT_JOB_CONFIG=$LOG_DIR/serve.yaml
  else
    eval "$(summit job-env --state-dir "$STATE_DIR/haproxy" --config "$SERVE_CONFIG" --config-out "$LOG_DIR/serve.yaml")"
  fi
  RAY_PORT=$SUMMIT_RAY_PORT
  DASHBOARD_PORT=$SUMMIT_DASHBOARD_PORT
  export DASHBOARD_PORT
  ensure_token
  endpoint starting "Ray starting on ${#NODE_LIST[@]} nodes"
  say "Ray head $SUMMIT_HEAD ($HEAD_IP:$RAY_PORT), ${#NODE_LIST[@]} nodes, logs in $LOG_DIR, HTTP port $SUMMIT_HTTP_PORT"
  CPU_ARGS=()
  [ -n "$CPUS_PER_NODE" ] && CPU_ARGS=(--num-cpus="$CPUS_PER_NODE")
  start_node 0
  wait_for_nodes 1
  local i
  for ((i = 1; i < ${#NODE_LIST[@]}; i++)); do
    start_node "$i"
  done
  wait_for_nodes "${#NODE_LIST[@]}"
  say "all ${#NODE_LIST[@]} nodes joined"
  if [ -n "${BATCH_INPUT:-}" ]; then
    run_batch
    return
  fi
  say "deploying $SERVE_CONFIG"
  endpoint starting "deploying $SERVE_CONFIG"
  deploy
  # ends at once when a replica's engine cannot start (the engine's own words in $START_REPORT, then endpoint.json),
  # else when the app answers or after READY_WAIT_S; a failed start ends the job, and SLURM gets the GPUs back
  OPENAI_API_KEY=$(api_key) run summit wait-ready "$SUMMIT_JOB_CONFIG" --timeout "$READY_WAIT_S" \
    --address "http://127.0.0.1:$DASHBOARD_PORT" --report "$START_REPORT" || {
    say "the application cannot serve (above; $ENDPOINT_FILE has the reason): the job ends"
    REPORT=$START_REPORT endpoint failed "the application did not start"
    exit 1
  }
  [ "$DRY_RUN" = 1 ] && return 0
  endpoint ready
  say "ready: $ENDPOINT_FILE; from a login node: ssh -N -L $SUMMIT_HTTP_PORT:127.0.0.1:$SUMMIT_HTTP_PORT $SUMMIT_HEAD, then OPENAI_BASE_URL=http://127.0.0.1:$SUMMIT_HTTP_PORT/v1${SUMMIT_API_KEY_FILE:+ OPENAI_API_KEY=\$(cat $SUMMIT_API_KEY_FILE)}"
  watch_steps
}

main
