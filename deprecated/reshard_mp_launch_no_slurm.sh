#!/usr/bin/env bash
# DEPRECATED (removed after release 0.3): reshard every model part's FSDP shards,
# the parts as local background jobs, through deprecated/reshard_mp.py.
#
#   deprecated/reshard_mp_launch_no_slurm.sh <save_prefix> <save_dir> <num_model_parts> <target_ddp_size> [reshard_mp.py options]
#
# Use `python -m metaseq.scripts.reshard_fsdp` once per part instead (see docs/resharding.md).
# PYTHON picks the interpreter (default python3). Exits non-zero, naming the
# parts, when any part fails or writes fewer files than expected.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"

check_launcher() {
    :  # runs locally: nothing to check
}

run_part() {
    "$PYTHON" "$HERE/reshard_mp.py" "$PREFIX" "$SAVE_DIR" \
        --part "$1" --target-ddp-size "$TARGET" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
}

launch_main "$@"
