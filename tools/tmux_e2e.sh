#!/usr/bin/env bash
# End-to-end run of the interactive app under tmux: start `ossterm --synthetic tiny`, send two turns,
# watch tokens stream and the gauges move, change a setting, cancel a turn, regenerate, save, open the
# help, measure key-to-screen latency while the engine generates, quit, and check that the terminal
# is back to normal (cooked mode with echo, main screen, cursor visible, no mouse reporting). Then
# the same check after a deliberate panic (OSSTERM_TEST_PANIC=1 arms F12 to panic the UI thread),
# after SIGTERM, SIGINT and SIGHUP (also: the chat saved, exit status 128 + signal), `--demo`
# playing its script with the engine view, and a multi-line paste with CR line breaks.
#
# Usage: tools/tmux_e2e.sh [BINARY]   (default: target/release/ossterm, built if missing)
# Exits 0 when every check passes, 1 on the first failure (with the screen printed), and 0 with a
# "skipping" line when tmux is not installed. Needs no TTY: tmux runs its own server on a private
# socket, detached.
set -euo pipefail
script=tmux_e2e
label=e2e
# The screen is matched with patterns holding box-drawing characters (LC_ALL set there).
source "$(dirname "$0")/tmux_common.sh" "$@"

screen() { tmux_ capture-pane -p -t "$session"; }
fail() {
    echo "tmux_e2e: FAIL: $*"
    echo "---- screen ----"
    screen || true
    exit 1
}
wait_for() { # PATTERN SECONDS: an extended regex the screen must show within SECONDS
    local deadline=$((SECONDS + $2))
    while ((SECONDS <= deadline)); do
        if screen | grep -Eq -- "$1"; then return 0; fi
        sleep 0.1
    done
    fail "did not see /$1/ within $2 s"
}
gauge() { screen | grep -o -- "│$1 *[^│]*" | head -1 | sed 's/^│//; s/ *$//' || true; }

# Types a probe word one key at a time and times each key from `send-keys` until tmux's copy of the
# screen shows it in the input box, then deletes it. This includes the cost of asking tmux for the
# screen (a client round trip per poll), so it is an upper bound; the idle run shows that floor.
input_line() { screen | awk '/┌ Message/ { getline; print; exit }'; }
measure_keys() { # WHAT
    local probe="latencyprobe" samples=() index typed sent_ns deadline
    for ((index = 0; index < ${#probe}; index++)); do
        typed="${probe:0:index+1}"
        sent_ns=$(date +%s%N)
        keys -l "${probe:index:1}"
        deadline=$((SECONDS + 5))
        until input_line | grep -q -- "$typed"; do
            ((SECONDS <= deadline)) || fail "typed '$typed' did not appear within 5 s"
        done
        samples+=($((($(date +%s%N) - sent_ns) / 1000000)))
    done
    local sorted=($(printf '%s\n' "${samples[@]}" | sort -n))
    echo "tmux_e2e: key to screen $1, seen from tmux: median ${sorted[${#sorted[@]} / 2]} ms," \
        "max ${sorted[-1]} ms over ${#sorted[@]} keys"
    ((sorted[-1] < 50)) || echo "tmux_e2e: warning: a key took ${sorted[-1]} ms (target 50 ms)"
    for ((index = 0; index < ${#probe}; index++)); do keys BSpace; done
    wait_for "Message \(" 5
}

# Starts ossterm in a fresh pane. The fixed sampling seed makes the random model's replies the same
# every run (a random reply may end early on a stop token; with this seed the long turn does not). After it exits, the shell prints its exit code and the terminal
# mode (icanon/echo, each with a leading - when off), so the checks see what the user would.
start_app() { # EXTRA_ENV
    tmux_ kill-session -t "$session" 2>/dev/null || true
    tmux_ new-session -d -s "$session" -x 130 -y 42 \
        "env TERM=xterm-256color XDG_CONFIG_HOME=$work/config XDG_DATA_HOME=$work/data HOME=$work $1 \
         $binary --synthetic tiny --max-tokens 64 --threads 2 --seed 7 --chats-dir $work/chats; \
         $after_exit"
    # Killing the only session must not end the server while the next one starts.
    tmux_ set-option -s exit-empty off
}


start_app ""
wait_for "Ready" 60
wait_for "RANDOM WEIGHTS" 1
[[ "$(pane_flag alternate_on)" == 1 ]] || fail "the app is not on the alternate screen"

# Turn one: tokens stream, the gauges move.
keys "hello there" Enter
wait_for "tokens in [0-9.]+ s" 30
kv_one="$(gauge 'KV cache')"
echo "tmux_e2e: turn 1: $kv_one; $(gauge 'decode'); $(gauge 'kernels'); $(gauge 'weights')"
grep -Eq "[1-9][0-9]*/8192" <<<"$kv_one" || fail "the KV cache gauge did not move"
gauge "decode" | grep -q "tok/s" || fail "no decode rate"
gauge "kernels" | grep -Eq "amx|avx512|avx2|scalar" || fail "no kernel path"
gauge "weights" | grep -q "q8" || fail "no weight format"

# Turn two reuses the cached prefix.
keys "and a second question" Enter
wait_for "tokens in [0-9.]+ s, prefix cache [1-9]" 30
kv_two="$(gauge 'KV cache')"
echo "tmux_e2e: turn 2: $kv_two; $(gauge 'cache hit')"
[[ "$kv_two" != "$kv_one" ]] || fail "the KV cache gauge did not change between turns"

measure_keys "with the engine idle"

# Settings: max tokens 64 -> 4096 (Tab Tab focuses settings; max tokens is the 10th row; each Right
# doubles it), then back to the input.
keys Tab Tab Down Down Down Down Down Down Down Down Down Right Right Right Right Right Right Tab
wait_for "max tokens +4096" 5

# A long turn: tokens keep streaming; meanwhile measure key-to-screen time from outside the app:
# from `send-keys` until tmux's copy of the screen shows the typed character in the input box.
keys "a long one" Enter
wait_for "(Thinking|Answering)… [0-9]+ tokens" 10
first_count="$(screen | grep -Eo '(Thinking|Answering)… [0-9]+' | grep -Eo '[0-9]+$' | head -1)"
sleep 0.5
second_count="$(screen | grep -Eo '(Thinking|Answering)… [0-9]+' | grep -Eo '[0-9]+$' | head -1 || true)"
[[ -n "$second_count" && "$second_count" -gt "$first_count" ]] ||
    fail "tokens did not stream ($first_count then ${second_count:-nothing})"
echo "tmux_e2e: streaming: $first_count then $second_count tokens half a second later"

screen | grep -Eq "(Thinking|Answering)… [0-9]+ tokens" || fail "generation ended before the latency probe"
measure_keys "while the engine generates on both cores"
screen | grep -Eq "(Thinking|Answering)… [0-9]+ tokens" || fail "generation ended during the latency probe"
echo "tmux_e2e: the app's own key-to-screen gauge: $(gauge 'key→screen')"

# Esc stops the turn; what was received stays, marked.
keys Escape
wait_for "\[stopped\]" 10

# Ctrl-R regenerates the last answer; Esc stops that too.
keys C-r
wait_for "Esc stops" 5
keys Escape
wait_for "Stopped: [0-9]+ tokens" 10

# Ctrl-S saves, in the chat module's JSON format.
keys C-s
wait_for "Saved .*chat-[0-9-]+\.json" 5
chat_file="$(ls "$work"/chats/chat-*.json 2>/dev/null | head -1)"
[[ -n "$chat_file" ]] || fail "no chat file written"
grep -q '"role": "user"' "$chat_file" && grep -q '"content": "hello there"' "$chat_file" ||
    fail "the chat file lacks the first user message: $(cat "$chat_file")"
grep -q '"reasoning": "medium"' "$chat_file" || fail "the chat file lacks the system settings"

# F1 opens the help overlay; any key closes it.
keys F1
wait_for "Keys \(any key closes\)" 5
keys x
sleep 0.3
screen | grep -q "Keys (any key closes)" && fail "the help overlay did not close"

# F12 does nothing without the test hook.
keys F12
sleep 0.3
screen | grep -q "EXIT=" && fail "F12 ended the app without OSSTERM_TEST_PANIC"

keys C-q
wait_for "EXIT=0" 10
check_restored "after Ctrl-Q"

# A panic in the UI thread restores the terminal before the message is printed.
start_app "OSSTERM_TEST_PANIC=1"
wait_for "Ready" 60
keys "hello" Enter
wait_for "tokens in [0-9.]+ s" 30
keys F12
wait_for "EXIT=101" 10
screen | grep -q "deliberate panic" || fail "the panic message is not on the main screen"
check_restored "after a panic"

# A signal (SIGTERM from `kill`, SIGINT, SIGHUP from a closed terminal) ends the app the orderly
# way: terminal restored, the chat saved with what was not yet on disk, exit status 128 + signal.
# The change of reasoning effort is not autosaved, so only the save on the signal can write it.
app_pid() { ps -o pid= --ppid "$(pane_flag pane_pid)" | tr -d ' '; }
signal_run() { # SIGNAL STATUS
    rm -rf "$work/chats"
    start_app ""
    wait_for "Ready" 60
    keys "hello there" Enter
    wait_for "tokens in [0-9.]+ s" 30
    keys Tab Tab Down Down Down Down Right Tab
    wait_for "reasoning effort +high" 5
    local pid
    pid="$(app_pid)"
    [[ -n "$pid" ]] || fail "no ossterm process in the pane"
    kill "-$1" "$pid"
    wait_for "EXIT=$2" 10
    check_restored "after SIG$1"
    local chat
    chat="$(ls "$work"/chats/chat-*.json 2>/dev/null | head -1)"
    [[ -n "$chat" ]] || fail "SIG$1: no chat file"
    grep -q '"reasoning": "high"' "$chat" || fail "SIG$1: the chat was not saved on the signal: $(cat "$chat")"
    grep -q '"content": "hello there"' "$chat" || fail "SIG$1: the chat file lost the message"
    echo "tmux_e2e: SIG$1: exit status $2, chat saved"
}
signal_run TERM 143
signal_run INT 130
signal_run HUP 129

# `--demo`: the scripted session plays on its own with the engine view open: the routing map
# fills, the roofline bar gets the machine's bandwidth, threads go 1 -> 2 and weights q8 -> q4 -> q8,
# and the first key stops the script; the demo's chats are not saved.
tmux_ kill-session -t "$session" 2>/dev/null || true
tmux_ new-session -d -s "$session" -x 160 -y 46 \
    "env TERM=xterm-256color XDG_CONFIG_HOME=$work/config XDG_DATA_HOME=$work/data HOME=$work \
     $binary --demo --synthetic tiny --seed 7 --chats-dir $work/demo-chats; echo EXIT=\$?; sleep 120"
wait_for "Routing, last ~[0-9]+ tokens" 60
wait_for "│L0 +[·░▒▓█]+ +[0-9]+/[0-9]+ *│" 30
wait_for "decode at [0-9]+% of memory bandwidth" 60
roofline="$(screen | grep -o 'decode at [0-9]*% of memory bandwidth' | head -1)"
wait_for "│threads +2 " 60
wait_for "│weights +q4 " 120
wait_for "│weights +q8 " 120
wait_for "Demo: one thread" 180
echo "tmux_e2e: demo: looped once (threads 1 -> 2, weights q8 -> q4 -> q8); $roofline"
keys x
wait_for "Demo stopped" 10
[[ ! -d "$work/demo-chats" ]] || [[ -z "$(ls -A "$work/demo-chats")" ]] || fail "the demo saved chats"
keys C-q
wait_for "EXIT=0" 10
echo "tmux_e2e: demo: a key stops it, no chats saved, quits cleanly"

# Display width: a corpus of tricky strings (CJK, combining marks, scripts with vowel signs, emoji
# with modifiers, ZWJ and flags, invisible characters, long lines that wrap) pasted into the input
# box, sent, and echoed in the conversation. Every row must keep the layout: the side panel's left
# border where the layout put it (column 92 of 130, counted by the C library's wcwidth as tmux
# counts cells) and the left pane's right border just before it.
check_columns() { # WHAT
    local row rest side
    local -i index=0
    while IFS= read -r row; do
        index+=1
        # The title and status rows have no panes.
        (( index == 1 )) && continue
        [[ "$row" == " "* ]] && continue
        side="${row: -38}"
        rest="${row%"$side"}"
        # The suffix of 38 characters is the side panel only if the row kept its cells.
        [[ "$side" =~ ^[│┌└] ]] || fail "$1: row $index: the side panel does not start where the layout put it: $row"
        [[ "$(printf '%s' "$rest" | wc -L)" == 92 ]] ||
            fail "$1: row $index: the left pane is $(printf '%s' "$rest" | wc -L) cells wide, not 92: $row"
        [[ "$rest" =~ [│┐┘┤]$ ]] || fail "$1: row $index: the left pane lost its right border: $row"
    done < <(screen)
}
start_app ""
wait_for "Ready" 60
tmux_ load-buffer -b corpus "$root/tools/width_corpus.txt"
tmux_ paste-buffer -p -b corpus -t "$session"
wait_for "wrap2: " 5
check_columns "corpus in the input box"
keys Enter
wait_for "tokens in [0-9.]+ s" 30
wait_for "│combining: " 5
check_columns "corpus in the conversation"
keys C-q
wait_for "EXIT=0" 10
echo "tmux_e2e: display width: $(wc -l < "$root/tools/width_corpus.txt") corpus lines keep every border in place"

# A multi-line paste with CR and CRLF line breaks (-r: sent as they are in the buffer): the lines land in
# the box with its border intact, and the message is sent and saved with LF.
start_app ""
wait_for "Ready" 60
tmux_ set-buffer -b crpaste "$(printf 'first pasted\rsecond pasted\r\nthird pasted')"
tmux_ paste-buffer -p -r -b crpaste -t "$session"
wait_for "│third pasted" 5
screen | grep -q "│first pasted" || fail "the paste overwrote the box border"
screen | grep -q "│second pasted" || fail "the paste overwrote the box border"
keys Enter
wait_for "tokens in [0-9.]+ s" 30
keys C-s
wait_for "Saved .*chat-[0-9-]+\.json" 5
chat_file="$(ls -t "$work"/chats/chat-*.json | head -1)"
grep -q 'first pasted\\nsecond pasted\\nthird pasted' "$chat_file" ||
    fail "the pasted message was not saved with LF line breaks: $(cat "$chat_file")"
echo "tmux_e2e: CR paste: box border intact, sent and saved with LF"
keys C-q
wait_for "EXIT=0" 10

# ---- remote engine (issue 13): the same app on `ossterm serve` over HTTP -------------------------
# `ossterm --remote URL` against the synthetic tiny model served on a free loopback port: turns
# stream, the gauges show the server and the network, settings the server decides show "server"
# and do not change, Esc stops, Ctrl-R regenerates, Ctrl-S saves; then the server goes away (the
# error is in the status line, the chat stays), comes back on the same port, and Ctrl-R retries.
server_pid=""
trap '[[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null; cleanup' EXIT
start_server() { # PORT (0: any free one)
    local log="$work/serve.log" deadline=$((SECONDS + 60))
    : >"$log"
    "$binary" serve --synthetic tiny --threads 1 --host 127.0.0.1 --port "$1" 2>"$log" &
    server_pid=$!
    until grep -q "on http://" "$log"; do
        ((SECONDS <= deadline)) || fail "ossterm serve did not start: $(cat "$log")"
        sleep 0.1
    done
    server_url="$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1)"
}
start_server 0
tmux_ kill-session -t "$session" 2>/dev/null || true
tmux_ new-session -d -s "$session" -x 130 -y 42 \
    "env TERM=xterm-256color XDG_CONFIG_HOME=$work/config XDG_DATA_HOME=$work/data HOME=$work \
     $binary --remote $server_url --max-tokens 160 --seed 7 --chats-dir $work/remote-chats; \
     echo EXIT=\$?; echo MODE: \$(stty -a | tr ' ;' '\n\n' | grep -xE -- '-?(icanon|echo)'); \
     sleep 120"
wait_for "Ready" 60
wait_for "synthetic-tiny at $server_url" 1
keys "hello there" Enter
wait_for "tokens in [0-9.]+ s" 60
echo "tmux_e2e: remote turn 1: $(gauge 'decode'); $(gauge 'network'); $(gauge 'usage')"
gauge "server" | grep -qF "$server_url" || fail "remote: no server gauge"
gauge "decode" | grep -q "tok/s" || fail "remote: no decode rate"
gauge "usage" | grep -Eq "[1-9][0-9]* prompt" || fail "remote: no usage from the server"
gauge "server load" | grep -q "queued" || fail "remote: no /metrics of the ossterm server"
[[ -z "$(gauge 'threads')" ]] || fail "remote: a threads gauge, though the server has the threads"
keys "and a second question" Enter
wait_for "tokens in [0-9.]+ s, prefix cache [1-9]" 60

# Threads (first row) is the server's: shown so, and Right does not change it. Max tokens (10th
# row) still changes: 160 doubled five times.
keys Tab Tab
wait_for "threads +server" 5
keys Right
wait_for "Threads is set by the server" 5
keys Down Down Down Down Down Down Down Down Down Right Right Right Right Right Tab
wait_for "max tokens +5120" 5

keys "a long one" Enter
wait_for "(Thinking|Answering)… [0-9]+ tokens" 30
first_count="$(screen | grep -Eo '(Thinking|Answering)… [0-9]+' | grep -Eo '[0-9]+$' | head -1)"
sleep 0.5
second_count="$(screen | grep -Eo '(Thinking|Answering)… [0-9]+' | grep -Eo '[0-9]+$' | head -1 || true)"
[[ -n "$second_count" && "$second_count" -gt "$first_count" ]] ||
    fail "remote: tokens did not stream ($first_count then ${second_count:-nothing})"
keys Escape
wait_for "\[stopped\]" 10
keys C-r
wait_for "Esc stops" 10
keys Escape
wait_for "Stopped: [0-9]+ tokens" 10
keys C-s
wait_for "Saved .*chat-[0-9-]+\.json" 5
chat_file="$(ls "$work"/remote-chats/chat-*.json 2>/dev/null | head -1)"
[[ -n "$chat_file" ]] && grep -q '"content": "hello there"' "$chat_file" ||
    fail "remote: the chat file lacks the first user message"

# The server goes away: the error shows, the chat stays; it comes back: Ctrl-R retries.
server_port="${server_url##*:}"
kill "$server_pid"
wait "$server_pid" 2>/dev/null || true
keys C-r
wait_for "Error: cannot reach" 30
# The latest user message sits just above the error; the first one may have scrolled out of view
# (the random weights' replies differ in length between kernel builds).
screen | grep -q "a long one" || fail "remote: the chat was lost with the server"
start_server "$server_port"
keys C-r
wait_for "(Thinking|Answering)… [0-9]+ tokens" 60
keys Escape
wait_for "Stopped: [0-9]+ tokens" 10
echo "tmux_e2e: remote: server gone -> error in the status line, back on port $server_port -> Ctrl-R works"
keys C-q
wait_for "EXIT=0" 10
check_restored "remote: after Ctrl-Q"
kill "$server_pid" 2>/dev/null || true
wait "$server_pid" 2>/dev/null || true
server_pid=""
# ---- end of the remote engine section ----------------------------------------------------------

echo "tmux_e2e: ok in $((SECONDS - started)) s"
