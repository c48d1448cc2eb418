#!/usr/bin/env bash
# The chat page of `ossterm serve` in a real browser: headless Chromium driven by playwright-core
# (installed with npm into target/webui-node, reused) against `ossterm serve --synthetic tiny`.
# Asks a question with Enter, waits for the reply's figures, stops a long reply with the Stop
# button (and checks the server freed its sequence), starts a new chat, and on a server with an
# API key enters the key the page asks for. Leaves a screenshot in target/webui-check.png.
# Skips (exit 0, with a message) without Chromium (Debian's package: /usr/bin/chromium), Node.js
# or npm.
set -euo pipefail
cd "$(dirname "$0")/.."

chromium=${CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$chromium" ]; then
    echo "webui check: chromium not installed ($chromium), skipping"
    exit 0
fi
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "webui check: node or npm not installed, skipping"
    exit 0
fi
modules=target/webui-node
if [ ! -d "$modules/node_modules/playwright-core" ]; then
    mkdir -p "$modules"
    timeout 300 npm install --silent --no-audit --no-fund --prefix "$modules" playwright-core@1 >/dev/null
fi

cargo build --release --quiet
free_port() {
    node -e 'const s = require("net").createServer().listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); })'
}
open_port=$(free_port)
keyed_port=$(free_port)
logs=$(mktemp -d)
target/release/ossterm serve --synthetic tiny --threads 2 --port "$open_port" --parallel 2 \
    --context 4096 >"$logs/open.log" 2>&1 &
open_server=$!
target/release/ossterm serve --synthetic tiny --threads 2 --port "$keyed_port" --parallel 1 \
    --context 1024 --api-key sk-webui-check >"$logs/keyed.log" 2>&1 &
keyed_server=$!
cleanup() { kill "$open_server" "$keyed_server" 2>/dev/null || true; rm -rf "$logs"; }
trap cleanup EXIT
for port in "$open_port" "$keyed_port"; do
    for _ in $(seq 100); do
        node -e 'fetch(process.argv[1]).then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))' \
            "http://127.0.0.1:$port/health" && break
        sleep 0.2
    done
done

NODE_PATH="$modules/node_modules" CHROMIUM="$chromium" timeout 180 node tools/webui_check.js \
    "http://127.0.0.1:$open_port/" "http://127.0.0.1:$keyed_port/" target/webui-check.png \
    || { echo "--- server logs"; cat "$logs"/*.log; exit 1; }
