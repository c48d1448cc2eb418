# Sourced by tools/tmux_e2e.sh, tools/tmux_faults.sh and tools/soak.sh (not run alone): skips the
# caller when tmux is missing, builds or takes the binary (`$1`), and starts a private tmux server
# whose socket and temporary directory go away on exit; then the helpers every script uses, among
# them the terminal-restore check. The caller sets `script` (its name in messages) and `label` (part
# of the socket name) first, and defines `screen`, `fail` and `wait_for` before calling
# `check_restored`.
export LC_ALL=C.UTF-8

if ! command -v tmux >/dev/null 2>&1; then
    echo "$script: tmux not found, skipping"
    exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -ge 1 ]]; then
    binary="$1"
else
    binary="$root/target/release/ossterm"
    # A no-op when `cargo test --release` already built it.
    (cd "$root" && cargo build --release --quiet --bin ossterm)
fi
[[ -x "$binary" ]] || { echo "$script: FAIL: no executable at $binary"; exit 1; }

work="$(mktemp -d)"
socket="ossterm-$label-$$"
session="app"
started=$SECONDS
tmux_() { tmux -L "$socket" -f /dev/null "$@"; }
cleanup() { tmux_ kill-server 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

keys() { tmux_ send-keys -t "$session" "$@"; }
pane_flag() { tmux_ display-message -p -t "$session" "#{$1}"; }

# Appended to the pane's command: after ossterm ends, the shell prints its exit code and the
# terminal mode (icanon/echo, each with a leading - when off), so the checks see what the user would.
after_exit="echo EXIT=\$?; echo MODE: \$(stty -a | tr ' ;' '\n\n' | grep -xE -- '-?(icanon|echo)'); sleep 120"

# The terminal after ossterm ended: cooked mode with echo, main screen, cursor shown, no mouse mode.
check_restored() { # WHAT
    wait_for "MODE: " 10
    screen | grep -q -- "MODE: icanon echo" || fail "$1: terminal not in cooked mode with echo"
    [[ "$(pane_flag alternate_on)" == 0 ]] || fail "$1: still on the alternate screen"
    [[ "$(pane_flag cursor_flag)" == 1 ]] || fail "$1: cursor hidden"
    [[ "$(pane_flag mouse_any_flag)$(pane_flag mouse_button_flag)$(pane_flag mouse_standard_flag)" == 000 ]] ||
        fail "$1: mouse reporting left on"
    echo "$script: $1: terminal restored (cooked mode, echo, main screen, cursor visible, no mouse mode)"
}
