//! `ossterm bench`: prefill and decode speed, time to first token on the standard prompts, peak
//! memory, and how close decode comes to this machine's memory-bandwidth roofline.

pub mod attention;
pub mod kernels;
pub mod probe;
pub mod stats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::ThreadPool;

use serde::Serialize;

use crate::chat::{
    render_for_completion, ChatMessage, Conversation, HarmonyParser, RenderOptions, Tokenizer,
};
use crate::engine::{generate, GenerateLimits, Sampler, SamplerSettings};
use crate::model::{Model, Session};
use stats::Summary;

/// The ten standard prompts, short to long.
pub const STANDARD_PROMPTS: &str = include_str!("../../assets/bench_prompts.txt");

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub depth: usize,
    pub repeat: usize,
    pub ttft: bool,
}

/// One repeat's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    prefill_tps: f64,
    decode_tps: f64,
    /// The read bandwidth probed right after this repeat's decode, where the peak RSS could be
    /// kept clear of the probe's buffer.
    read_gbps: Option<f64>,
}

/// The roofline's bandwidth and decode's share of it with every repeat probed: the median of
/// the probes and of each repeat's own share ([`probe::median_roofline_share`]); `None` where a
/// repeat has no probe or a failed one.
fn paired_roofline(samples: &[Sample], bytes_per_token: u64) -> Option<(f64, f64)> {
    if samples.is_empty() || bytes_per_token == 0 {
        return None;
    }
    let probes: Vec<f64> = samples.iter().map(|s| s.read_gbps).collect::<Option<_>>()?;
    if probes.iter().any(|&gbps| gbps <= 0.0) {
        return None;
    }
    let rates: Vec<f64> = samples.iter().map(|s| s.decode_tps).collect();
    Some((
        Summary::of(&probes).median,
        probe::median_roofline_share(&rates, &probes, bytes_per_token),
    ))
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptTtft {
    pub prompt: usize,
    pub tokens: usize,
    pub ttft_ms: Summary,
}

/// The whole report; medians at the top level, as the JSON keys ask.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub decode_tps: f64,
    pub prefill_tps: f64,
    pub ttft_ms: f64,
    pub peak_rss_bytes: u64,
    pub bandwidth_gbps: f64,
    pub bytes_per_token: u64,
    pub roofline_tps: f64,
    pub roofline_efficiency: f64,
    /// Whether the bandwidth was probed right after every decode run (the median of those
    /// probes, and the efficiency the median of each run's own), not once after all of them.
    pub bandwidth_paired: bool,
    pub decode: Summary,
    pub prefill: Summary,
    pub ttft: Vec<PromptTtft>,
    pub settings: BenchSettings,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchSettings {
    pub model: String,
    pub threads: usize,
    pub kernels: String,
    pub weights: String,
    pub kv_cache: String,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub depth: usize,
    pub repeat: usize,
    pub cpu: String,
    /// The CPU's family/model numbers and the SIMD flags that decide the kernels' speed.
    pub cpu_info: probe::CpuInfo,
    /// Seconds from start to a ready model (mapping, conversion).
    pub load_seconds: f64,
    /// Seconds spent converting weights to the chosen format, and the memory they took.
    pub convert_seconds: f64,
    pub converted_bytes: u64,
    /// Seconds spent reordering the experts into the kernels' tile layout, and their bytes
    /// (0 when the experts keep the file's row order).
    pub tile_seconds: f64,
    pub tiled_bytes: u64,
    /// Where the tiles are ("mapped from FILE", "copied into memory", ...), and why the tile
    /// cache was not used if it was meant to be.
    pub tile_source: String,
    pub tile_cache_note: Option<String>,
}

/// Receives progress: (what is running, steps done, steps in all).
pub type Progress<'a> = dyn FnMut(&str, usize, usize) + Send + 'a;

/// Parses `assets/bench_prompts.txt`: leading `#` comment lines, prompts separated by `---`.
pub fn standard_prompts() -> Vec<String> {
    let body: String = STANDARD_PROMPTS
        .lines()
        .skip_while(|line| line.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    body.split("\n---\n")
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

/// Deterministic ordinary-text token ids (no special tokens), as llama-bench uses random tokens.
fn filler_tokens(count: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let ordinary = vocab.min(199_998) as u64;
    let mut state = 0x2545_F491_4F6C_DD1D ^ salt;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % ordinary) as u32
        })
        .collect()
}

/// The greedy choice (a NaN-only row picks token 0, which the benchmark does not care about).
fn argmax(logits: &[f32]) -> u32 {
    crate::engine::sampler::argmax(logits).unwrap_or(0)
}

/// Runs the plan on `model`, computing on `pool`, and returns the report. `settings` describes
/// the run for the record.
pub fn run(
    model: &Arc<Model>,
    pool: &Arc<ThreadPool>,
    plan: &BenchPlan,
    mut settings: BenchSettings,
    progress: &mut Progress<'_>,
) -> anyhow::Result<BenchReport> {
    // Every run loops on the pool, as the app's generation does: decode then uses the pool's
    // team, and no forward call hands its work over from another thread.
    let threads = settings.threads;
    let (samples, ttft, measured_peak) =
        pool.install(|| measure(model, pool, plan, threads, progress))?;
    let decode = Summary::of(&samples.iter().map(|s| s.decode_tps).collect::<Vec<_>>());
    let prefill = Summary::of(&samples.iter().map(|s| s.prefill_tps).collect::<Vec<_>>());
    // Read before any probe after the runs, whose buffer would otherwise count as the model's.
    let peak_rss_bytes = measured_peak.max(probe::peak_rss_bytes());
    // Decode runs at depth `plan.depth`; count the cache it reads at the middle of the run.
    let bytes_per_token = model.decode_bytes_per_token(plan.depth + plan.gen_tokens / 2);
    let paired = paired_roofline(&samples, bytes_per_token);
    let bandwidth_paired = paired.is_some();
    let (bandwidth_gbps, roofline_efficiency) = match paired {
        Some(paired) => paired,
        None => {
            progress("measuring memory bandwidth", 0, 1);
            let gbps = probe::read_bandwidth_gbps(threads);
            let ceiling = gbps * 1e9 / bytes_per_token.max(1) as f64;
            (gbps, decode.median / ceiling)
        }
    };
    let roofline_tps = bandwidth_gbps * 1e9 / bytes_per_token.max(1) as f64;
    let all_ttft: Vec<f64> = ttft.iter().map(|t| t.ttft_ms.median).collect();
    settings.cpu = probe::cpu_name();
    settings.cpu_info = probe::CpuInfo::current();
    Ok(BenchReport {
        decode_tps: decode.median,
        prefill_tps: prefill.median,
        ttft_ms: if all_ttft.is_empty() {
            0.0
        } else {
            Summary::of(&all_ttft).median
        },
        peak_rss_bytes,
        bandwidth_gbps,
        bytes_per_token,
        roofline_tps,
        roofline_efficiency,
        bandwidth_paired,
        decode,
        prefill,
        ttft,
        settings,
    })
}

/// The prefill and decode samples (each with the read bandwidth probed on `threads` right after
/// its decode) and the time-to-first-token runs, on the caller's thread (a thread of `pool`);
/// and the peak RSS of the runs before the probes' buffers.
fn measure(
    model: &Arc<Model>,
    pool: &Arc<ThreadPool>,
    plan: &BenchPlan,
    threads: usize,
    progress: &mut Progress<'_>,
) -> anyhow::Result<(Vec<Sample>, Vec<PromptTtft>, u64)> {
    let vocab = model.config.vocab_size;
    let context = plan.depth + plan.prompt_tokens + plan.gen_tokens + 1;
    let mut session = model.new_session(pool, context);
    let mut samples = Vec::with_capacity(plan.repeat);
    let mut peak_rss = 0;
    for repeat in 0..plan.repeat {
        let label = format!("repeat {}/{}", repeat + 1, plan.repeat);
        let mut sample = measure_once(&mut session, plan, vocab, repeat as u64, &label, progress)?;
        // The peak so far is the runs'; after the reset it restarts below the probe's buffer,
        // which is freed again before the next run. Without a reset no probe runs here.
        peak_rss = peak_rss.max(probe::peak_rss_bytes());
        if probe::reset_peak_rss() {
            progress(&format!("{label}: probing the read bandwidth"), 0, 1);
            sample.read_gbps = Some(probe::paired_read_bandwidth(model, threads));
            probe::reset_peak_rss();
        }
        samples.push(sample);
    }

    let mut ttft = Vec::new();
    if plan.ttft {
        let tokenizer = Tokenizer::shared()?;
        let mut sampler = Sampler::new(SamplerSettings::greedy())?;
        let prompts = standard_prompts();
        for (index, text) in prompts.iter().enumerate() {
            let conversation = Conversation {
                messages: vec![ChatMessage::user(text.clone())],
                ..Conversation::default()
            };
            let ids = render_for_completion(tokenizer, &conversation, &RenderOptions::default())?;
            let mut session = model.new_session(pool, ids.len() + 1);
            let mut times = Vec::with_capacity(plan.repeat);
            for repeat in 0..plan.repeat {
                progress(
                    &format!(
                        "time to first token, prompt {}/{} ({} tokens)",
                        index + 1,
                        prompts.len(),
                        ids.len()
                    ),
                    repeat,
                    plan.repeat,
                );
                // A fresh cache, and the app's own loop: what a first turn waits for.
                session.truncate(0);
                let mut parser = HarmonyParser::after_prompt(tokenizer, "assistant");
                let first = GenerateLimits {
                    max_tokens: Some(1),
                };
                let result = generate(
                    &mut session,
                    &mut parser,
                    &ids,
                    &mut sampler,
                    first,
                    || false,
                    |_| {},
                )?;
                times.push(result.time_to_first_token.as_secs_f64() * 1e3);
            }
            ttft.push(PromptTtft {
                prompt: index + 1,
                tokens: ids.len(),
                ttft_ms: Summary::of(&times),
            });
        }
    }

    Ok((samples, ttft, peak_rss))
}

fn measure_once(
    session: &mut Session,
    plan: &BenchPlan,
    vocab: usize,
    salt: u64,
    label: &str,
    progress: &mut Progress<'_>,
) -> anyhow::Result<Sample> {
    session.truncate(0);
    let chunk = session.chunk_len();
    if plan.depth > 0 {
        let context = filler_tokens(plan.depth, vocab, salt);
        for (i, piece) in context.chunks(chunk).enumerate() {
            progress(
                &format!("{label}: filling context to depth {}", plan.depth),
                i * chunk,
                plan.depth,
            );
            session.prefill(piece)?;
        }
    }
    let prompt = filler_tokens(plan.prompt_tokens, vocab, salt ^ 0xABCD);
    let mut prefill_time = Duration::ZERO;
    for (i, piece) in prompt.chunks(chunk).enumerate() {
        progress(
            &format!("{label}: prefill {} tokens", plan.prompt_tokens),
            i * chunk,
            plan.prompt_tokens,
        );
        let started = Instant::now();
        session.prefill(piece)?;
        prefill_time += started.elapsed();
    }
    // Decode is measured at the requested depth, as llama-bench's tg does: drop the prompt again.
    session.truncate(plan.depth);
    let mut next = *prompt.first().unwrap_or(&0);
    let started = Instant::now();
    for i in 0..plan.gen_tokens {
        if i % 8 == 0 {
            progress(
                &format!("{label}: decode {} tokens", plan.gen_tokens),
                i,
                plan.gen_tokens,
            );
        }
        next = argmax(session.decode(next)?);
    }
    let decode_time = started.elapsed();
    Ok(Sample {
        prefill_tps: per_second(plan.prompt_tokens, prefill_time),
        decode_tps: per_second(plan.gen_tokens, decode_time),
        read_gbps: None,
    })
}

fn per_second(count: usize, time: Duration) -> f64 {
    if count == 0 || time.is_zero() {
        0.0
    } else {
        count as f64 / time.as_secs_f64()
    }
}

/// The report as a table for people.
pub fn render_table(report: &BenchReport) -> String {
    let s = &report.settings;
    let mut out = String::new();
    let line = |out: &mut String, text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    line(&mut out, format!("model      {}", s.model));
    line(
        &mut out,
        format!(
            "settings   threads {}, kernels {}, weights {}, kv cache {}",
            s.threads, s.kernels, s.weights, s.kv_cache
        ),
    );
    line(&mut out, format!("cpu        {}", s.cpu_info));
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    let tiling = if s.tiled_bytes > 0 {
        format!(
            ", {:.1} s reordering experts into tiles ({:.2} GiB, {}{})",
            s.tile_seconds,
            gib(s.tiled_bytes),
            s.tile_source,
            s.tile_cache_note
                .as_ref()
                .map(|note| format!("; tile cache not used: {note}"))
                .unwrap_or_default()
        )
    } else {
        String::new()
    };
    line(
        &mut out,
        format!(
            "load       {:.1} s, of which {:.1} s converting weights ({:.2} GiB){tiling}",
            s.load_seconds,
            s.convert_seconds,
            gib(s.converted_bytes)
        ),
    );
    line(&mut out, String::new());
    line(
        &mut out,
        format!("{:<28} {:>10} {:>10} {:>10}", "", "min", "median", "max"),
    );
    let row = |out: &mut String, name: String, v: &Summary| {
        line(
            out,
            format!(
                "{:<28} {:>10.2} {:>10.2} {:>10.2}",
                name, v.min, v.median, v.max
            ),
        );
    };
    row(
        &mut out,
        format!("prefill pp{} tokens/s", s.prompt_tokens),
        &report.prefill,
    );
    row(
        &mut out,
        format!("decode tg{} tokens/s", s.gen_tokens),
        &report.decode,
    );
    if s.depth > 0 {
        line(&mut out, format!("(both at context depth {})", s.depth));
    }
    for t in &report.ttft {
        row(
            &mut out,
            format!("ttft ms, prompt {} ({} tok)", t.prompt, t.tokens),
            &t.ttft_ms,
        );
    }
    line(&mut out, String::new());
    line(
        &mut out,
        format!(
            "peak RSS {:.2} GiB",
            report.peak_rss_bytes as f64 / (1u64 << 30) as f64
        ),
    );
    line(
        &mut out,
        format!(
            "roofline {:.2} GB read per decoded token, {:.1} GB/s measured read bandwidth -> {:.1} tokens/s ceiling; decode at {:.0}% of it{}",
            report.bytes_per_token as f64 / 1e9,
            report.bandwidth_gbps,
            report.roofline_tps,
            report.roofline_efficiency * 100.0,
            if report.bandwidth_paired {
                " (medians of a probe after each decode run and of each run's own share)"
            } else {
                ""
            }
        ),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_standard_prompts_from_short_to_long() {
        let prompts = standard_prompts();
        assert_eq!(prompts.len(), 10);
        for pair in prompts.windows(2) {
            assert!(
                pair[0].len() < pair[1].len(),
                "{:?} is not shorter than the next",
                pair[0]
            );
        }
        assert!(prompts.iter().all(|p| !p.contains("\n---")));
    }

    #[test]
    fn the_roofline_rates_each_decode_run_against_the_probe_of_its_moment() {
        let run = |decode_tps: f64, read_gbps: Option<f64>| Sample {
            prefill_tps: 0.0,
            decode_tps,
            read_gbps,
        };
        // 2 GB a token: the runs' own shares are 0.5, 1.2 and 0.93; the median decode over the
        // median probe would say 12 x 2 / 30 = 0.8.
        let samples = [
            run(10.0, Some(40.0)),
            run(12.0, Some(20.0)),
            run(14.0, Some(30.0)),
        ];
        let (gbps, share) = paired_roofline(&samples, 2_000_000_000).expect("all probed");
        assert_eq!(gbps, 30.0);
        assert!((share - 14.0 * 2.0 / 30.0).abs() < 1e-12, "{share}");
        // A repeat without its probe, a failed probe or nothing to rate: the single probe after
        // the runs instead.
        assert!(paired_roofline(&[samples[0], run(11.0, None)], 2_000_000_000).is_none());
        assert!(paired_roofline(&[run(11.0, Some(0.0))], 2_000_000_000).is_none());
        assert!(paired_roofline(&[], 2_000_000_000).is_none());
        assert!(paired_roofline(&samples, 0).is_none());
    }

    #[test]
    fn filler_tokens_are_ordinary_and_repeatable() {
        let a = filler_tokens(1000, 201_088, 7);
        assert_eq!(a, filler_tokens(1000, 201_088, 7));
        assert!(a.iter().all(|&t| t < 199_998));
        assert!(filler_tokens(100, 500, 1).iter().all(|&t| t < 500));
    }
}
