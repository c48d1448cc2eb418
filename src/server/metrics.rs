//! Counters and gauges of the server, written by the scheduler and the HTTP handlers, read by
//! `GET /metrics` in the Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// An f64 in an atomic (its bits).
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    /// Keeps the larger of the current value and `value`.
    pub fn raise(&self, value: f64) {
        if value > self.get() {
            self.set(value);
        }
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    /// Completion requests accepted into the queue.
    pub requests: AtomicU64,
    /// Requests refused (bad input, full queue, unauthorized).
    pub requests_rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens whose KV rows came from the cache (a slot's earlier request or another
    /// sequence's copied prefix).
    pub cached_prompt_tokens: AtomicU64,
    /// Requests that reused at least one cached prompt token.
    pub prefix_cache_hits: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub prefilled_tokens: AtomicU64,
    /// Decode tokens per second of the last steps (all sequences together).
    pub decode_tokens_per_second: Gauge,
    pub prefill_tokens_per_second: Gauge,
    /// Requests waiting for a free sequence slot.
    pub queue_depth: AtomicUsize,
    pub active_sequences: AtomicUsize,
    /// Tokens held by active sequences' KV caches, and the capacity of all slots.
    pub kv_used_tokens: AtomicUsize,
    pub kv_capacity_tokens: AtomicUsize,
    pub kv_capacity_bytes: AtomicU64,
    /// Seconds a step that also prefilled a prompt chunk took beyond a pure decode step: how
    /// long running streams waited for a new request's prefill (last and largest).
    pub prefill_stall_seconds: Gauge,
    pub prefill_stall_max_seconds: Gauge,
    pub time_to_first_token_seconds_sum: Gauge,
    pub time_to_first_token_count: AtomicU64,
}

impl Metrics {
    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let load = |value: &AtomicU64| value.load(Ordering::Relaxed) as f64;
        let load_usize = |value: &AtomicUsize| value.load(Ordering::Relaxed) as f64;
        let series: [(&str, &str, &str, f64); 19] = [
            (
                "ossterm_requests_total",
                "counter",
                "Completion requests accepted.",
                load(&self.requests),
            ),
            (
                "ossterm_requests_rejected_total",
                "counter",
                "Requests refused with an error status.",
                load(&self.requests_rejected),
            ),
            (
                "ossterm_prompt_tokens_total",
                "counter",
                "Prompt tokens of accepted requests.",
                load(&self.prompt_tokens),
            ),
            (
                "ossterm_prompt_tokens_cached_total",
                "counter",
                "Prompt tokens served from the prefix cache.",
                load(&self.cached_prompt_tokens),
            ),
            (
                "ossterm_prefix_cache_hits_total",
                "counter",
                "Requests that reused cached prompt tokens.",
                load(&self.prefix_cache_hits),
            ),
            (
                "ossterm_prefill_tokens_total",
                "counter",
                "Prompt tokens computed.",
                load(&self.prefilled_tokens),
            ),
            (
                "ossterm_tokens_generated_total",
                "counter",
                "Tokens sampled.",
                load(&self.generated_tokens),
            ),
            (
                "ossterm_decode_tokens_per_second",
                "gauge",
                "Decode throughput of all sequences together, recent steps.",
                self.decode_tokens_per_second.get(),
            ),
            (
                "ossterm_prefill_tokens_per_second",
                "gauge",
                "Prefill throughput, recent steps.",
                self.prefill_tokens_per_second.get(),
            ),
            (
                "ossterm_queue_depth",
                "gauge",
                "Requests waiting for a sequence slot.",
                load_usize(&self.queue_depth),
            ),
            (
                "ossterm_active_sequences",
                "gauge",
                "Sequences being prefilled or decoded.",
                load_usize(&self.active_sequences),
            ),
            (
                "ossterm_kv_used_tokens",
                "gauge",
                "Tokens in the KV caches of active sequences.",
                load_usize(&self.kv_used_tokens),
            ),
            (
                "ossterm_kv_capacity_tokens",
                "gauge",
                "Tokens all sequence slots can hold.",
                load_usize(&self.kv_capacity_tokens),
            ),
            (
                "ossterm_kv_capacity_bytes",
                "gauge",
                "Bytes of KV cache reserved for all slots.",
                load(&self.kv_capacity_bytes),
            ),
            (
                "ossterm_kv_use_ratio",
                "gauge",
                "KV tokens in use over capacity.",
                ratio(
                    load_usize(&self.kv_used_tokens),
                    load_usize(&self.kv_capacity_tokens),
                ),
            ),
            (
                "ossterm_prefill_stall_seconds",
                "gauge",
                "Extra time of the last decode step that carried a prefill chunk.",
                self.prefill_stall_seconds.get(),
            ),
            (
                "ossterm_prefill_stall_max_seconds",
                "gauge",
                "Largest extra time of a decode step that carried a prefill chunk.",
                self.prefill_stall_max_seconds.get(),
            ),
            (
                "ossterm_time_to_first_token_seconds_sum",
                "counter",
                "Sum of times from request to first token.",
                self.time_to_first_token_seconds_sum.get(),
            ),
            (
                "ossterm_time_to_first_token_seconds_count",
                "counter",
                "Requests that got a first token.",
                load(&self.time_to_first_token_count),
            ),
        ];
        for (name, kind, help, value) in series {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out
    }
}

fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}
