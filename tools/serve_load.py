#!/usr/bin/env python3
"""Load generator for `ossterm serve` (standard library only): for each concurrency level, that
many streams at once, each a streamed chat completion of a fixed length with its own user message
after a shared system message. Prints per level: aggregate decode tokens/s (all tokens sampled
after each stream's first, over the time from the first first-token to the last token), mean
per-stream decode tokens/s, TTFT p50/p99, and the server's own decode gauge.

    python3 tools/serve_load.py --base http://127.0.0.1:8080 --levels 1,2,4,8,16 --tokens 32
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request


def stream_one(base, index, tokens, results):
    body = json.dumps({
        "model": "any",
        "messages": [
            {"role": "system", "content": "You are a terse assistant. Answer in one line."},
            {"role": "user", "content": f"Question {index}: name a colour and a number."},
        ],
        "max_tokens": tokens, "temperature": 1.0, "seed": index, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    first = last = None
    usage = timings = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            choices = chunk.get("choices") or []
            if choices and (choices[0]["delta"].get("content") or choices[0]["delta"].get("reasoning")
                            or choices[0].get("finish_reason")):
                now = time.monotonic()
                first = first or now
                last = now
    # The server's own timings: the first token may be a header token that sends no text.
    first = sent + timings["prompt_ms"] / 1e3
    last = first + timings["predicted_ms"] / 1e3
    results[index] = {"sent": sent, "first": first, "last": last,
                      "tokens": usage["completion_tokens"] if usage else 0,
                      "cached": usage["prompt_tokens_details"]["cached_tokens"] if usage else 0}


def metric(base, name):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="http://127.0.0.1:8080")
    parser.add_argument("--levels", default="1,2,4,8,16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    offset = 0
    for level in [int(x) for x in args.levels.split(",")]:
        results = {}
        threads = [threading.Thread(target=stream_one, args=(args.base, offset + i, args.tokens, results))
                   for i in range(level)]
        offset += level
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        runs = list(results.values())
        # Decode: the tokens after each stream's first, over the span in which streams decoded.
        decoded = sum(r["tokens"] - 1 for r in runs)
        span = max(r["last"] for r in runs) - min(r["first"] for r in runs)
        per_stream = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in runs if r["last"] > r["first"]]
        ttft = [r["first"] - r["sent"] for r in runs]
        row = {"streams": level, "aggregate_tps": decoded / span if span > 0 else 0.0,
               "per_stream_tps": statistics.mean(per_stream) if per_stream else 0.0,
               "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
               "server_decode_gauge": metric(args.base, "ossterm_decode_tokens_per_second"),
               "cached_prompt_tokens": sum(r["cached"] for r in runs)}
        rows.append(row)
        if not args.json:
            print(f"{level:>3} streams: aggregate {row['aggregate_tps']:7.2f} tok/s, per stream "
                  f"{row['per_stream_tps']:6.2f} tok/s, TTFT p50 {row['ttft_p50_s']:6.2f} s "
                  f"p99 {row['ttft_p99_s']:6.2f} s, cached prompt tokens {row['cached_prompt_tokens']}",
                  flush=True)
    base = rows[0]["aggregate_tps"] if rows else 0
    if not args.json:
        for row in rows:
            print(f"{row['streams']:>3} streams: {row['aggregate_tps'] / base if base else 0:.2f}x single")
        print("stall:", metric(args.base, "ossterm_prefill_stall_max_seconds"), "s max")
    else:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
