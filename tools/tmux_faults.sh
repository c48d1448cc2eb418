#!/usr/bin/env bash
# Faults in the interactive app, under tmux. A checkpoint shard truncated while the app streams a
# reply (SIGBUS on the mapped pages): the app must stay up, say which file changed on disk, keep
# the conversation on screen, and on Ctrl-Q restore the terminal (cooked mode with echo, main
# screen, cursor visible, no mouse reporting) and exit 0.
#
# Usage: tools/tmux_faults.sh [BINARY]   (default: target/release/ossterm, built if missing)
# Exits 0 when every check passes, 1 on the first failure (with the screen printed), and 0 with a
# "skipping" line when tmux is not installed. Needs no TTY: tmux runs on a private socket.
set -euo pipefail
script=tmux_faults
label=faults
# The screen is matched with patterns holding box-drawing characters (LC_ALL set there).
source "$(dirname "$0")/tmux_common.sh" "$@"

screen() { tmux_ capture-pane -p -J -t "$session"; }
fail() {
    echo "tmux_faults: FAIL: $*"
    echo "---- screen ----"
    screen || true
    exit 1
}
wait_for() { # PATTERN SECONDS
    local deadline=$((SECONDS + $2))
    while ((SECONDS <= deadline)); do
        if screen | grep -Eq -- "$1"; then return 0; fi
        sleep 0.1
    done
    fail "did not see /$1/ within $2 s"
}

"$binary" synth --preset tiny --out "$work/m" >/dev/null 2>&1 || fail "ossterm synth failed"
shard="$work/m/model-00001-of-00001.safetensors"
[[ -f "$shard" ]] || fail "synth wrote no $shard"

tmux_ new-session -d -s "$session" -x 160 -y 42 \
    "env TERM=xterm-256color XDG_CONFIG_HOME=$work/config XDG_DATA_HOME=$work/data HOME=$work \
     $binary --model $work/m --max-tokens 8000 --threads 2 --seed 7 --chats-dir $work/chats; \
     $after_exit"

wait_for "Ready" 60
keys "a long one" Enter
wait_for "(Thinking|Answering)… [0-9]+ tokens" 20
# Cut the shard to a tenth while tokens stream: the next forward pass reads pages past the end.
truncate -s $(($(stat -c %s "$shard") / 10)) "$shard"
echo "tmux_faults: truncated $shard while the reply streamed"
wait_for "changed on disk" 20
screen | grep -q "EXIT=" && fail "the app ended after the fault"
screen | grep -q "a long one" || fail "the conversation is gone from the screen"
echo "tmux_faults: the app reports: $(screen | grep -o 'model-00001-of-00001.safetensors changed on disk[^│]*' | head -1 | sed 's/ *$//')"

keys C-q
wait_for "EXIT=0" 10
check_restored "after the fault"
echo "tmux_faults: ok in $((SECONDS - started)) s"
