#!/usr/bin/env bash
# Soak test of the interactive app under tmux: TURNS turns against `--synthetic tiny`, with random
# keys between them (stop mid-stream, regenerate, edit and resend, new chat, open a saved chat,
# settings changes, resize to 20x5 and back). After every turn it checks:
#   - the app is alive (no panic, no exit);
#   - every chat file is valid JSON;
#   - KV accounting: the KV cache gauge's token count equals the tokens of the conversation the
#     turn answered (`ossterm render` of the chat file without its last reply) plus the tokens the
#     turn generated (from the status line) but the last, which was sampled and never run forward;
#   - resident memory (VmRSS), which after the warm-up must stay within RSS_BOUND_MB of the
#     largest value seen during the warm-up.
# At the end: Ctrl-Q, exit status 0, terminal restored (cooked mode with echo, main screen, cursor
# visible, no mouse reporting).
#
# Usage: tools/soak.sh [TURNS] [BINARY]   (defaults: 200, target/release/ossterm)
# Environment: SOAK_SEED (the random sequence, default: random, printed), RSS_BOUND_MB (default 24),
# WARMUP (turns, default: a fifth of TURNS, at least 5).
# Exits 0 when every check passes, 1 on the first failure (with the screen printed), 0 with a
# "skipping" line when tmux is not installed.
set -euo pipefail
script=soak
label=soak
turns="${1:-200}"
# `source FILE` with no further words would hand tmux_common.sh this script's own arguments (the
# turn count as the binary), so the binary, if any, becomes the only positional argument first.
set -- "${@:2}"
source "$(dirname "$0")/tmux_common.sh" "$@"
command -v jq >/dev/null 2>&1 || { echo "soak: jq not found, skipping"; exit 0; }
seed="${SOAK_SEED:-$((RANDOM * 32768 + RANDOM))}"
RANDOM=$seed
rss_bound_mb="${RSS_BOUND_MB:-24}"
warmup="${WARMUP:-$((turns / 5 > 5 ? turns / 5 : 5))}"

screen() { tmux_ capture-pane -p -t "$session"; }
fail() {
    echo "soak: FAIL (seed $seed, turn ${turn:-0}): $*"
    echo "---- screen ----"
    screen || true
    exit 1
}
wait_for() { # PATTERN SECONDS
    local deadline=$((SECONDS + $2))
    while ((SECONDS <= deadline)); do
        if screen | grep -Eq -- "$1"; then return 0; fi
        sleep 0.05
    done
    fail "did not see /$1/ within $2 s"
}
gauge() { screen | grep -o -- "│$1 *[^│]*" | head -1 | sed 's/^│//; s/ *$//' || true; }
status_line() { screen | tail -1; }
alive() {
    screen | grep -q "EXIT=" && fail "the app exited"
    screen | grep -q "panicked" && fail "the app panicked"
    return 0
}

# The KV snapshot tiers are a bounded cache, not a leak: a small RAM budget keeps their growth
# inside the RSS bound (the default of 2048 MB would be filled slowly by a long soak).
mkdir -p "$work/config/ossterm"
printf '[cache]\nmax_ram_mb = 8\n' >"$work/config/ossterm/config.toml"
tmux_ new-session -d -s "$session" -x 130 -y 42 \
    "env TERM=xterm-256color XDG_CONFIG_HOME=$work/config XDG_DATA_HOME=$work/data HOME=$work \
     $binary --synthetic tiny --max-tokens 48 --threads 2 --chats-dir $work/chats; \
     $after_exit"
wait_for "Ready" 60
pid="$(ps -o pid= --ppid "$(pane_flag pane_pid)" | tr -d ' ')"
[[ -n "$pid" ]] || fail "no ossterm process"
echo "soak: $turns turns, seed $seed, pid $pid, warm-up $warmup turns, RSS bound +$rss_bound_mb MB"

rss_kb() { awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status"; }
done_pattern='(Finished|Stopped at max tokens|Stopped|Context full): [0-9]+ tokens in [0-9.]+ s'

# Puts a marker notice on the status line, so the end of the next turn is a new notice.
mark() {
    keys C-s
    wait_for "Saved |Nothing to save" 5
}

# Waits for the turn just started to end; echoes the tokens it generated ("" if none started).
finish_turn() {
    local deadline=$((SECONDS + 60)) line
    while ((SECONDS <= deadline)); do
        line="$(status_line)"
        if grep -Eq -- "$done_pattern" <<<"$line"; then
            grep -Eo -- "$done_pattern" <<<"$line" | grep -Eo '[0-9]+ tokens' | grep -Eo '[0-9]+'
            return 0
        fi
        if grep -Eq "Nothing to regenerate|No message to edit|not ready" <<<"$line"; then
            return 0
        fi
        sleep 0.05
    done
    fail "the turn did not end within 60 s"
}

# Tokens of the conversation a turn answered: the chat file without its last reply, rendered.
prompt_tokens() { # CHAT_FILE
    jq 'def drop_reply: if (.messages | length) > 0 and .messages[-1].role == "assistant"
            then .messages |= .[:-1] | drop_reply else . end; drop_reply' "$1" >"$work/request.json"
    "$binary" render --conversation "$work/request.json" | tail -1 | tr "," "\n" | grep -c .

}

check_kv() { # GENERATED
    local chat kv used expected
    # The autosave at the end of the turn runs on the app's file thread: give it a moment.
    sleep 0.2
    chat="$(ls -t "$work"/chats/chat-*.json | head -1)"
    kv="$(gauge 'KV cache')"
    used="$(grep -Eo '[0-9]+/[0-9]+' <<<"$kv" | cut -d/ -f1)"
    # The last token a turn generates is sampled but never run forward: it is not in the cache.
    expected=$(($(prompt_tokens "$chat") + $1 - 1))
    [[ "$used" == "$expected" ]] ||
        fail "KV cache holds $used tokens, the conversation has $expected ($kv; $chat: $(cat "$chat"))"
}

check_files() {
    local file
    for file in "$work"/chats/*.json; do
        [[ -e "$file" ]] || continue
        jq empty "$file" 2>/dev/null || fail "$file is not valid JSON: $(head -c 300 "$file")"
    done
    # The app saves on its store thread after a turn ends, through a temporary file it renames:
    # one may exist for the moment of a save in flight. Left behind means still there 2 s on.
    local deadline=$((SECONDS + 2))
    while ls "$work"/chats/*.tmp >/dev/null 2>&1; do
        ((SECONDS <= deadline)) || fail "a temporary file was left behind"
        sleep 0.05
    done
}

# Steps down the settings panel before a change: from the top these are weight format, KV cache,
# reasoning effort, temperature, top-p, top-k, min-p, seed and activations, but the cursor stays
# where the previous change left it (and stops at the last row), so later changes reach the rows
# below too (unembedding, the text settings, which Left/Right leave alone).
setting_rows=(1 2 4 5 6 7 8 10 12)
change_setting() {
    local row=${setting_rows[RANDOM % ${#setting_rows[@]}]} direction
    direction=$([[ $((RANDOM % 2)) == 0 ]] && echo Right || echo Left)
    local downs=()
    for ((index = 0; index < row; index++)); do downs+=(Down); done
    keys Tab Tab "${downs[@]}" "$direction" Tab
    sleep 0.1
    # A weight-format or unembedding change rebuilds the weights in the background (the weights
    # gauge shows "old → new" meanwhile) and the new ones take over between turns with a new
    # cache: wait for them, so a turn's KV check reads the cache the turn ran on and not one
    # installed just after it.
    local deadline=$((SECONDS + 30))
    while ((SECONDS <= deadline)) && gauge 'weights' | grep -q '→'; do sleep 0.05; done
}

warm_peak=0
peak_after=0
kv_checks=0
counts=""
count() { counts="$counts $1"; }
for ((turn = 1; turn <= turns; turn++)); do
    # Between turns: zero to two random actions that start no turn.
    for ((extra = RANDOM % 3; extra > 0; extra--)); do
        case $((RANDOM % 4)) in
        0) change_setting; count setting ;;
        1)
            tmux_ resize-window -t "$session" -x 20 -y 5
            sleep 0.2
            alive
            tmux_ resize-window -t "$session" -x 130 -y 42
            sleep 0.2
            count resize
            ;;
        2)
            keys C-n
            wait_for "New chat" 5
            count new
            ;;
        3)
            keys C-o
            wait_for "Open a saved chat|No saved chats" 10
            if screen | grep -q "Open a saved chat"; then
                for ((down = RANDOM % 3; down > 0; down--)); do keys Down; done
                keys Enter
                # Opening restores the chat's KV snapshot at once; its notice may replace "Opened".
                wait_for "Opened |Resumed [0-9,]+ tokens" 10
            fi
            count open
            ;;
        esac
    done
    alive
    mark
    # The turn: a new message, a regeneration, an edit, or a new message stopped mid-stream.
    case $((RANDOM % 5)) in
    0) keys C-r; count regenerate ;;
    1)
        keys C-e
        wait_for "Editing the last message|No message to edit" 5
        if screen | grep -q "Editing the last message"; then
            keys -l " (edited)"
            keys Enter
        fi
        count edit
        ;;
    2)
        keys -l "turn $turn, stopped"
        keys Enter
        sleep "0.0$((RANDOM % 10))"
        keys Escape
        count stop
        ;;
    *)
        keys -l "turn $turn: $RANDOM words"
        keys Enter
        count send
        ;;
    esac
    generated="$(finish_turn)"
    alive
    if [[ -n "$generated" && "$generated" -gt 0 ]]; then
        check_kv "$generated"
        kv_checks=$((kv_checks + 1))
    fi
    check_files
    rss=$(rss_kb)
    if ((turn <= warmup)); then
        ((rss > warm_peak)) && warm_peak=$rss
    else
        ((rss > peak_after)) && peak_after=$rss
        ((rss <= warm_peak + rss_bound_mb * 1024)) ||
            fail "RSS $((rss / 1024)) MB, warm-up peak $((warm_peak / 1024)) MB: grew over $rss_bound_mb MB"
    fi
    if ((turn % 25 == 0)); then
        echo "soak: turn $turn: RSS $((rss / 1024)) MB (warm-up peak $((warm_peak / 1024)) MB)"
    fi
done

keys C-q
wait_for "EXIT=0" 10
check_restored "after Ctrl-Q"
check_files
actions="$(tr ' ' '\n' <<<"$counts" | { grep . || true; } | sort | uniq -c | awk '{ printf "%s %s, ", $2, $1 }')"
files=$(find "$work/chats" -maxdepth 1 -name "*.json" 2>/dev/null | wc -l)
echo "soak: actions: ${actions%, }"
echo "soak: RSS after warm-up at most $((peak_after / 1024)) MB, warm-up peak $((warm_peak / 1024)) MB" \
    "(bound +$rss_bound_mb MB); $files chat files, all valid JSON; KV accounting held on" \
    "all $kv_checks turns that generated tokens"
echo "soak: ok: $turns turns in $((SECONDS - started)) s, terminal restored"
