#!/usr/bin/env bash
# TRACE image entrypoint: one role per container, each mapped to an existing entry point (see docs/deploy.md).
#
#   controller [CONFIG] [key=value ...]  scripts/launch_disagg.sh: the RL controller, which starts the Megatron
#                                        trainer (one rank); with `use_ray = true` the rollout workers and the trainer
#                                        are Ray actors on the cluster RAY_ADDRESS names (else a new local one).
#   trainer    [CONFIG] [key=value ...]  the same command as `controller`: the controller starts the trainer in this
#                                        release. Start one of the two per job: a second controller on the same
#                                        out_dir is refused (it names the holder of the run lock).
#   rollout    [SGLANG ARGS ...]         python3 -m sglang.launch_server: the patched SGLang 0.5.15.post1 server,
#                                        TRACE flags --trace-mode, --trace-store, ...; the files named by
#                                        TRACE_API_KEY_FILE / TRACE_ADMIN_API_KEY_FILE give --api-key / --admin-api-key.
#                                        --host 0.0.0.0 without both key files is refused (it would expose weight
#                                        updates and record writing) unless TRACE_ALLOW_OPEN_SERVER=1.
#   ray-head   [RAY START ARGS ...]      ray start --head --block (the node the controller's driver connects to)
#   ray-worker [RAY START ARGS ...]      ray start --address=$RAY_ADDRESS --block (hosts rollout worker actors)
#   check                                scripts/sglang_patches.py check, scripts/megatron_patches.py check: the
#                                        installed SGLang and megatron-core carry their patch stacks
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
}

role=${1:-}
if [ -z "$role" ]; then
    echo "entrypoint: no role given; use one of: controller trainer rollout ray-head ray-worker check" >&2
    usage
    exit 2
fi
shift

case "$role" in
controller)
    exec scripts/launch_disagg.sh "$@"
    ;;
trainer)
    echo "entrypoint: trainer: the controller starts the Megatron trainer in this release;" \
        "starting the controller (scripts/launch_disagg.sh)" >&2
    exec scripts/launch_disagg.sh "$@"
    ;;
rollout)
    keys=()
    if [ -n "${TRACE_API_KEY_FILE:-}" ]; then
        keys+=(--api-key "$(cat "$TRACE_API_KEY_FILE")")
    fi
    if [ -n "${TRACE_ADMIN_API_KEY_FILE:-}" ]; then
        keys+=(--admin-api-key "$(cat "$TRACE_ADMIN_API_KEY_FILE")")
    fi
    if [[ " $* " == *" 0.0.0.0 "* || " $* " == *"--host=0.0.0.0"* ]] && [ ${#keys[@]} -lt 4 ] \
        && [ "${TRACE_ALLOW_OPEN_SERVER:-0}" != 1 ]; then
        echo "entrypoint: rollout: --host 0.0.0.0 needs TRACE_API_KEY_FILE and TRACE_ADMIN_API_KEY_FILE (files holding" \
            "the keys), or TRACE_ALLOW_OPEN_SERVER=1 on a trusted network" >&2
        exit 2
    fi
    exec python3 -m sglang.launch_server "${keys[@]}" "$@"
    ;;
ray-head)
    exec ray start --head --block --port="${RAY_PORT:-6379}" --include-dashboard=false "$@"
    ;;
ray-worker)
    if [ -z "${RAY_ADDRESS:-}" ]; then
        echo "entrypoint: ray-worker needs RAY_ADDRESS=<head host>:<port> (the ray-head container's address)" >&2
        exit 2
    fi
    exec ray start --address="$RAY_ADDRESS" --block "$@"
    ;;
check)
    python3 scripts/sglang_patches.py check && exec python3 scripts/megatron_patches.py check
    ;;
-h | --help | help)
    usage
    ;;
*)
    echo "entrypoint: unknown role '$role'; use one of: controller trainer rollout ray-head ray-worker check" >&2
    usage
    exit 2
    ;;
esac
