#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets/*.rs) for SECONDS each with cargo-fuzz (libFuzzer) on
# the nightly toolchain, then prints the executions and crashes of each.
#
#   tools/fuzz.sh SECONDS [TARGET...]
#
# Each target starts from its committed seeds (fuzz/seeds/TARGET, read only) plus what earlier runs
# found (fuzz/corpus/TARGET, not committed). A crash leaves its input in fuzz/artifacts/TARGET/ and
# the run fails; reproduce it with `cargo +nightly fuzz run TARGET fuzz/artifacts/TARGET/FILE`.
#
# Environment:
#   FUZZ_SANITIZER  none (default) or address. The parsers are safe Rust, so AddressSanitizer
#                   finds nothing a panic would not, at about half the speed; libFuzzer's own
#                   checks (panics, aborts, timeouts, the RSS limit) and the targets' allocation
#                   bound work either way. Overflow checks and debug assertions are always on.
#   FUZZ_RSS_MB     libFuzzer's -rss_limit_mb (default 1024).
#   FUZZ_RUNS       also stop a target after this many executions (libFuzzer's -runs).
#   FUZZ_INSTALL=1  install cargo-fuzz with `cargo install` when it is missing.
#   FUZZ_JOBS       targets fuzzed at once (default 1: the machine's builds keep priority).
#   FUZZ_LOG_DIR    keep libFuzzer's log of each target there (default: a temporary directory).
#   FUZZ_TARGET_DIR where the instrumented build goes (default fuzz/target); CI points it at a
#                   cache outside the clone so that a machine builds the dependencies once.
#
# Exit status: 0 all targets ran without a crash, 1 a crash or build failure, 3 skipped because
# nightly or cargo-fuzz is missing (the reason is printed).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:?usage: tools/fuzz.sh SECONDS [TARGET...]}
shift
sanitizer=${FUZZ_SANITIZER:-none}
rss_mb=${FUZZ_RSS_MB:-1024}

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: skipped: the nightly toolchain is not installed (cargo-fuzz needs it; rustup toolchain install nightly)"
    exit 3
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    if [[ ${FUZZ_INSTALL:-0} == 1 ]]; then
        echo "fuzz: installing cargo-fuzz"
        if ! nice -n 10 cargo install cargo-fuzz --locked --quiet; then
            echo "fuzz: skipped: cargo-fuzz is not installed and \`cargo install cargo-fuzz\` failed"
            exit 3
        fi
    else
        echo "fuzz: skipped: cargo-fuzz is not installed (cargo install cargo-fuzz, or FUZZ_INSTALL=1)"
        exit 3
    fi
fi

if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    targets=()
    for file in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "$file" .rs)")
    done
fi

# Inputs larger than this teach nothing more and slow every execution; the checkpoint target's raw
# form needs room for a config, an index and shard headers, the GGUF target's for a whole small file
# (its seed `raw_tiny_single_q8_0` is 238 KB).
max_len() {
    case $1 in
        checkpoint) echo 65536 ;;
        gguf) echo 262144 ;;
        conversation_file) echo 8192 ;;
        *) echo 4096 ;;
    esac
}

cd fuzz
target_dir=${FUZZ_TARGET_DIR:-target}
echo "fuzz: building ${#targets[@]} targets (sanitizer $sanitizer)"
nice -n 10 cargo +nightly fuzz build --sanitizer "$sanitizer" --debug-assertions -O \
    --target-dir "$target_dir"

if [[ -n ${FUZZ_LOG_DIR:-} ]]; then
    logs=$FUZZ_LOG_DIR
    mkdir -p "$logs"
else
    logs=$(mktemp -d)
    trap 'rm -rf "$logs"' EXIT
fi

run_target() {
    local target=$1
    mkdir -p "corpus/$target" "artifacts/$target" "seeds/$target"
    # The binary is run directly (cargo fuzz run would rebuild and adds nothing here).
    nice -n 19 "$target_dir/x86_64-unknown-linux-gnu/release/$target" \
        "corpus/$target" "seeds/$target" \
        -artifact_prefix="artifacts/$target/" \
        -max_total_time="$seconds" -rss_limit_mb="$rss_mb" -max_len="$(max_len "$target")" \
        ${FUZZ_RUNS:+-runs="$FUZZ_RUNS"} -timeout=10 -print_final_stats=1 >"$logs/$target.log" 2>&1
}

status=0
passed=0
failed=0
names=()
for target in "${targets[@]}"; do
    while [[ $(jobs -rp | wc -l) -ge ${FUZZ_JOBS:-1} ]]; do
        wait -n || true
    done
    run_target "$target" &
    names+=("$target")
done
wait || true

printf '%-24s %14s %10s %8s %s\n' target executions exec/s corpus result
for target in "${names[@]}"; do
    log="$logs/$target.log"
    execs=$(awk '/stat::number_of_executed_units:/ { print $2 }' "$log" | tail -1)
    rate=$(awk '/stat::average_exec_per_sec:/ { print $2 }' "$log" | tail -1)
    corpus=$(find "corpus/$target" -type f | wc -l)
    if grep -qE '^==[0-9]+== ERROR|^SUMMARY: libFuzzer|deadly signal|panicked at' "$log"; then
        result="CRASH: $(grep -m1 -oE 'Test unit written to .*' "$log" || echo 'see log')"
        echo "---- $target ----"
        grep -m1 -A12 -E 'panicked at|ERROR|allocation limit' "$log" || tail -20 "$log"
        status=1
        failed=$((failed + 1))
    elif [[ -z $execs ]]; then
        result="FAILED to run"
        tail -20 "$log"
        status=1
        failed=$((failed + 1))
    else
        result=ok
        passed=$((passed + 1))
    fi
    printf '%-24s %14s %10s %8s %s\n' "$target" "${execs:-0}" "${rate:-0}" "$corpus" "$result"
done
echo "fuzz: $passed passed, $failed failed"
exit $status
