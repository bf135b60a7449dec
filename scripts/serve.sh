#!/usr/bin/env bash
# README command 1: set up, make the tiny model, and serve the default config (serve_configs/tiny-cpu.yaml)
# on http://127.0.0.1:8000 until Ctrl-C. Any argument replaces the config file.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${SUMMIT_VENV:-.venv}/bin/activate"
export RAY_AUTH_MODE=disabled                 # loopback dev; cluster configs use token auth
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0    # keep Ray on 127.0.0.1
export SUMMIT_TINY_MODEL=${SUMMIT_TINY_MODEL:-$HOME/.cache/summit/models/tiny-llama}
[ -f "$SUMMIT_TINY_MODEL/model.safetensors" ] || summit make-tiny-model "$SUMMIT_TINY_MODEL"
# The direct path: Serve's HAProxy sends each request to the engine replica (stats/metrics ports on loopback).
eval "$(summit direct-path-env)"
config=${1:-serve_configs/tiny-cpu.yaml}
# `serve run -a local` (a fresh Ray instance for this server, not one found on the machine), a line when the engines
# answer, and Ctrl-C: stopped at once when no request is in flight, after a graceful drain otherwise.
exec summit serve-local "$config"
