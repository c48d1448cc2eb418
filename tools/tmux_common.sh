# Sourced by tools/tmux_e2e.sh and tools/tmux_faults.sh (not run alone): skips the caller when tmux
# is missing, builds or takes the binary (`$1`), and starts a private tmux server whose socket and
# temporary directory go away on exit. The caller sets `script` (its name in messages) and `label`
# (part of the socket name) first.
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
