# Shared by reshard_mp_launch.sh and reshard_mp_launch_no_slurm.sh (sourced, not run).
# DEPRECATED with them: removed after release 0.3.
#
# The sourcing script defines `run_part PART` (runs deprecated/reshard_mp.py for one
# model part) and then calls `launch_main "$@"`.

REMOVED_AFTER=0.3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}

usage() {
    echo "usage: $(basename "$0") <save_prefix> <save_dir> <num_model_parts> <target_ddp_size> [reshard_mp.py options]" >&2
    echo "  e.g. $(basename "$0") ckpts/checkpoint_last out 2 8 --drop-optimizer-state" >&2
}

is_count() {
    [[ $1 =~ ^[0-9]+$ ]] && (( 10#$1 >= 1 ))
}

# Say that this launcher goes away, then each part's replacement command, as
# deprecated/reshard_mp.py itself builds it (so the two never disagree).
warn_deprecated() {
    echo "WARNING: $(basename "$0") is deprecated and will be removed after release $REMOVED_AFTER." >&2
    [ -n "${PREFIX:-}" ] || return 0
    echo "WARNING: run the replacement once per model part instead:" >&2
    local part command
    for (( part = 0; part < NUM_PARTS; part++ )); do
        if ! command=$("$PYTHON" "$HERE/reshard_mp.py" "$PREFIX" "$SAVE_DIR" --part "$part" \
                --target-ddp-size "$TARGET" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} --print-replacement); then
            echo "error: '$PYTHON $HERE/reshard_mp.py' failed (see above); set PYTHON to a python with this project installed" >&2
            exit 2
        fi
        echo "    $command" >&2
    done
}

parse_args() {
    if (( $# < 4 )); then
        warn_deprecated
        usage
        exit 2
    fi
    PREFIX=$1 SAVE_DIR=$2 NUM_PARTS=$3 TARGET=$4
    shift 4
    EXTRA_ARGS=("$@")
    if ! is_count "$NUM_PARTS" || ! is_count "$TARGET"; then
        PREFIX=""
        warn_deprecated
        echo "error: num_model_parts=$NUM_PARTS and target_ddp_size=$TARGET must both be whole numbers of at least 1" >&2
        exit 2
    fi
    NUM_PARTS=$((10#$NUM_PARTS)) TARGET=$((10#$TARGET))
}

# Prefix every line of a part's output (its log, on stderr) so that interleaved logs stay readable.
label_lines() {
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        printf '[part %s] %s\n' "$1" "$line" >&2
    done
}

# Number of this part's expected output files that exist.
count_outputs() {
    local part=$1 i n=0
    for (( i = 0; i < TARGET; i++ )); do
        [ -f "$SAVE_DIR/reshard-model_part-$part-shard$i.pt" ] && n=$((n + 1))
    done
    # One output with optimizer state is named without -shard0, as the old tool named it.
    [ "$TARGET" -eq 1 ] && [ -f "$SAVE_DIR/reshard-model_part-$part.pt" ] && n=1
    echo "$n"
}

# Run every part in the background, wait for all, and report the parts that failed.
run_all_parts() {
    local part pids=() failed=() written
    for (( part = 0; part < NUM_PARTS; part++ )); do
        ( set -o pipefail; run_part "$part" 2>&1 | label_lines "$part" ) &
        pids+=("$!")
    done
    for (( part = 0; part < NUM_PARTS; part++ )); do
        if ! wait "${pids[$part]}"; then
            failed+=("$part")
            continue
        fi
        written=$(count_outputs "$part")
        if (( written != TARGET )); then
            echo "error: part $part exited 0 but wrote $written of $TARGET files $SAVE_DIR/reshard-model_part-$part-shard*.pt" >&2
            failed+=("$part")
        fi
    done
    if (( ${#failed[@]} )); then
        echo "error: model part(s) ${failed[*]} of 0..$((NUM_PARTS - 1)) failed; see their [part N] lines above" >&2
        return 1
    fi
    echo "Done: wrote $TARGET shard(s) for each of $NUM_PARTS model part(s) to $SAVE_DIR"
}

launch_main() {
    parse_args "$@"
    warn_deprecated
    check_launcher "$@"
    run_all_parts
}
