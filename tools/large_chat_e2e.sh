#!/usr/bin/env bash
# Opens a very large saved chat (90,000 messages, about 30 MB) in the real app under tmux and
# measures key-to-screen time while typing and scrolling in it: from outside (tmux send-keys until
# the character shows) and the app's own key→screen gauge. The target is 50 ms per key whatever
# the chat's size.
#
# Usage: tools/large_chat_e2e.sh [BINARY] [MESSAGES]   (defaults: target/release/ossterm, 90000)
# Exits 1 when the app's own gauge shows a key above 50 ms, or when a step does not happen.
set -euo pipefail
export LC_ALL=C.UTF-8

if ! command -v tmux >/dev/null 2>&1; then
    echo "large_chat_e2e: tmux not found, skipping"
    exit 0
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
binary="${1:-$root/target/release/ossterm}"
messages="${2:-90000}"
[[ -x "$binary" ]] || { echo "large_chat_e2e: FAIL: no executable at $binary"; exit 1; }

work="$(mktemp -d)"
socket="ossterm-large-$$"
session="app"
tmux_() { tmux -L "$socket" -f /dev/null "$@"; }
cleanup() { tmux_ kill-server 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
screen() { tmux_ capture-pane -p -t "$session"; }
fail() {
    echo "large_chat_e2e: FAIL: $*"
    screen || true
    exit 1
}
wait_for() { # PATTERN SECONDS
    local deadline=$((SECONDS + $2))
    while ((SECONDS <= deadline)); do
        if screen | grep -Eq -- "$1"; then return 0; fi
        sleep 0.2
    done
    fail "did not see /$1/ within $2 s"
}
keys() { tmux_ send-keys -t "$session" "$@"; }
gauge() { screen | grep -o -- "│$1 *[^│]*" | head -1 | sed 's/^│//; s/ *$//' || true; }
input_line() { screen | awk '/┌ Message/ { getline; print; exit }'; }

mkdir -p "$work/chats"
python3 - "$work/chats/chat-20250101-000000.json" "$messages" <<'EOF'
import json, sys
path, count = sys.argv[1], int(sys.argv[2])
answer = ("Here is **an answer** with `code`, a list:\n- one item long enough to wrap around the "
          "pane at least once\n- two\n\n```rust\nfn main() {}\n```\nand a closing paragraph. ") * 2
messages = []
for index in range(count):
    if index % 2 == 0:
        messages.append({"role": "user", "content": f"question {index}: what about this? " * 3})
    else:
        messages.append({"role": "assistant", "channel": "final", "content": f"{index} {answer}"})
json.dump({"system": {"reasoning": "medium"}, "messages": messages}, open(path, "w"), indent=1)
EOF
size=$(du -m "$work/chats/chat-20250101-000000.json" | cut -f1)
echo "large_chat_e2e: chat file of $messages messages, $size MB"

tmux_ new-session -d -s "$session" -x 130 -y 42 \
    "env TERM=xterm-256color HOME=$work XDG_CONFIG_HOME=$work/config $binary --synthetic tiny \
     --threads 2 --chats-dir $work/chats; echo EXIT=\$?; sleep 60"
wait_for "Ready" 60
opened_at=$SECONDS
keys C-o
wait_for "Open a saved chat" 60
keys Enter
wait_for "Opened |Resumed [0-9,]+ tokens" 120
echo "large_chat_e2e: listed and opened in $((SECONDS - opened_at)) s"

probe="largechatprobe" samples=()
for ((index = 0; index < ${#probe}; index++)); do
    typed="${probe:0:index+1}"
    sent_ns=$(date +%s%N)
    keys -l "${probe:index:1}"
    deadline=$((SECONDS + 30))
    until input_line | grep -q -- "$typed"; do
        ((SECONDS <= deadline)) || fail "typed '$typed' did not appear within 30 s"
    done
    samples+=($((($(date +%s%N) - sent_ns) / 1000000)))
done
sorted=($(printf '%s\n' "${samples[@]}" | sort -n))
echo "large_chat_e2e: typing, seen from tmux: median ${sorted[${#sorted[@]} / 2]} ms," \
    "max ${sorted[-1]} ms over ${#sorted[@]} keys"
# Scrolling: PageUp ten times, Home, End (Tab focuses the conversation for Home/End).
keys PageUp PageUp PageUp PageUp PageUp PageUp PageUp PageUp PageUp PageUp
wait_for "scrolled" 30
keys Tab Home
wait_for "question 0:" 30
keys End
sleep 0.5
gauge_text="$(gauge 'key→screen')"
echo "large_chat_e2e: the app's own gauge after typing and scrolling: $gauge_text"
max_ms="$(grep -Eo 'max [0-9]+' <<<"$gauge_text" | grep -Eo '[0-9]+')"
[[ -n "$max_ms" ]] || fail "no key→screen figure"
((max_ms <= 50)) || fail "a key took $max_ms ms to reach the screen (target 50 ms)"
keys C-q
wait_for "EXIT=0" 30
echo "large_chat_e2e: ok"
