#!/usr/bin/env bash
# DEPRECATED (removed after release 0.3): reshard every model part's FSDP shards,
# one Slurm job per part, through deprecated/reshard_mp.py.
#
#   deprecated/reshard_mp_launch.sh <save_prefix> <save_dir> <num_model_parts> <target_ddp_size> [reshard_mp.py options]
#
# Use `python -m metaseq.scripts.reshard_fsdp` once per part instead (see docs/resharding.md).
# SRUN_ARGS adds options to every srun (e.g. SRUN_ARGS="--partition=cpu --mem=0");
# PYTHON picks the interpreter (default python3).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"

check_launcher() {
    if ! command -v srun >/dev/null 2>&1; then
        echo "error: srun is not on PATH; this launcher submits one Slurm job per model part." >&2
        echo "error: without Slurm, run the parts as local jobs: $HERE/reshard_mp_launch_no_slurm.sh $*" >&2
        exit 1
    fi
}

run_part() {
    # SRUN_ARGS is split on spaces on purpose: it holds several options.
    # shellcheck disable=SC2086
    srun --job-name="reshard_mp_part$1" --nodes=1 --ntasks=1 ${SRUN_ARGS:-} \
        "$PYTHON" "$HERE/reshard_mp.py" "$PREFIX" "$SAVE_DIR" \
        --part "$1" --target-ddp-size "$TARGET" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
}

launch_main "$@"
