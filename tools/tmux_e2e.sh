#!/usr/bin/env bash
# End-to-end run of the interactive app under tmux: start `ossterm --synthetic tiny`, send two turns,
# watch tokens stream and the gauges move, cancel one, regenerate, save, quit, and check that the
# terminal is back in cooked mode. Skips (exit 0) when tmux is missing. Usage: tools/tmux_e2e.sh [BINARY]
set -euo pipefail

if ! command -v tmux >/dev/null 2>&1; then
    echo "tmux_e2e: tmux not found, skipping"
    exit 0
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
binary="${1:-$root/target/release/ossterm}"
work="$(mktemp -d)"
session="ossterm-e2e-$$"
trap 'tmux kill-session -t "$session" 2>/dev/null || true; rm -rf "$work"' EXIT

screen() { tmux capture-pane -p -t "$session"; }
fail() { echo "tmux_e2e: FAIL: $*"; echo "---- screen ----"; screen || true; exit 1; }
wait_for() { # PATTERN SECONDS
    local deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        if screen | grep -q -- "$1"; then return 0; fi
        sleep 0.2
    done
    fail "did not see '$1' within $2 s"
}
gauge() { screen | grep -o "$1 *[^│]*" | head -1; }

# The shell prints the terminal mode after ossterm exits, so the check sees what the user would.
tmux new-session -d -s "$session" -x 120 -y 40 \
    "env XDG_CONFIG_HOME=$work/config XDG_DATA_HOME=$work/data HOME=$work \
     $binary --synthetic tiny --max-tokens 64 --threads 2 --chats-dir $work/chats; \
     echo EXIT=\$?; stty -a | grep -o -- '-\?icanon' ; sleep 60"

wait_for "Ready" 60
wait_for "RANDOM WEIGHTS" 1

tmux send-keys -t "$session" "hello there" Enter
wait_for "tokens in" 30
kv_one="$(gauge 'KV cache')"
echo "turn 1: $kv_one"
grep -q "[1-9][0-9]*/8192" <<<"$kv_one" || fail "KV cache gauge did not move"
gauge "decode" | grep -q "tok/s" || fail "no decode rate"

tmux send-keys -t "$session" "and a second question" Enter
wait_for "▌ You.*" 1
sleep 0.5
wait_for "tokens in .*prefix cache [1-9]" 30
echo "turn 2: $(gauge 'cache hit')"

# Settings: raise max tokens to 4096 (Tab Tab focuses settings; max tokens is the 10th row).
tmux send-keys -t "$session" Tab Tab Down Down Down Down Down Down Down Down Down Right Right Right Right Right Right Tab
wait_for "max tokens        4096" 5

tmux send-keys -t "$session" "a long one" Enter
sleep 1.5
tmux send-keys -t "$session" Escape
wait_for "\[stopped\]" 10

tmux send-keys -t "$session" C-r
wait_for "Esc stops" 5
tmux send-keys -t "$session" Escape
wait_for "Stopped:" 10

tmux send-keys -t "$session" C-s
wait_for "Saved " 5
ls "$work"/chats/chat-*.json >/dev/null 2>&1 || fail "no chat file written"

tmux send-keys -t "$session" F1
wait_for "Keys (any key closes)" 5
tmux send-keys -t "$session" x
echo "key to screen: $(gauge 'key→screen')"

tmux send-keys -t "$session" C-q
wait_for "EXIT=0" 10
screen | grep -q -- "-icanon" && fail "terminal left in raw mode"
screen | grep -q "icanon" || fail "could not read the terminal mode"
echo "tmux_e2e: ok"
