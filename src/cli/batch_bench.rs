//! `ossterm bench --batch 1,2,4,8,16`: what one batched decode step (`Session::forward_batch`, as
//! `ossterm serve` runs it) costs at each batch size, split by phase, against the two bounds a step
//! is held to: the weight bytes it must read at the machine's read bandwidth, and the
//! multiply-adds it must do at the int8 arithmetic peak.
//!
//! Every sequence first holds its own short prompt; each round then runs `steps` decode steps of
//! every batch size (the sizes in turn, their order reversed every other round so a drift of the
//! machine's speed hits all alike) and rewinds the sequences. Steps are timed one by one with the
//! phase counters on; sampling (temperature 1 over the full vocabulary, every row on the pool at
//! once, as the server samples) is timed after each step. Medians over all steps are reported.

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::bench::probe::paired_read_bandwidth;
use crate::bench::stats::Summary;
use crate::engine::{Sampler, SamplerSettings};
use crate::kernels::{Kernels, PROBE_ROUND_MACS};
use crate::model::options::{ActivationFormat, Product};
use crate::model::profile::{Phase, ProfileCounts};
use crate::model::team::{team_stats, TeamStats};
use crate::model::{Model, SequenceStep};

use super::output;

/// Prompt tokens each sequence holds before the decode steps.
const PROMPT_TOKENS: usize = 24;
/// Most sequences in a batch: a decode step's rows fit one forward chunk many times over.
pub const MAX_BATCH: usize = 64;
/// Probe rounds per call of the int8 peak probe (about a millisecond each).
const PROBE_ROUNDS: usize = 1 << 19;

/// One batch size's figures.
struct Row {
    batch: usize,
    step: Vec<f64>,
    sampling: Vec<f64>,
    /// Median share of each phase, in seconds per step (the phase counters' sums over steps).
    phases: [f64; 5],
    /// What the pool's team did over all of this size's steps: parallel regions, regions run on
    /// the leader alone, the leader's waits for a helper's last task.
    team: TeamStats,
}

/// Runs the batch benchmark: `sizes` batch sizes, `steps` decode steps each per round, `rounds`
/// rounds.
pub fn run(
    model: &Arc<Model>,
    pool: &Arc<rayon::ThreadPool>,
    sizes: &[usize],
    steps: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    if sizes.is_empty() {
        anyhow::bail!("--batch needs at least one batch size, e.g. --batch 1,2,4,8,16");
    }
    if let Some(&bad) = sizes.iter().find(|&&n| n == 0 || n > MAX_BATCH) {
        anyhow::bail!("--batch sizes must be 1 to {MAX_BATCH}; got {bad}");
    }
    let steps = steps.max(1);
    let largest = sizes.iter().copied().max().unwrap_or(1);
    let context = PROMPT_TOKENS + steps + 1;
    let vocab = model.config.vocab_size;
    let mut session = model.new_session(pool, context);
    if session.chunk_len() < largest {
        anyhow::bail!(
            "this path runs at most {} rows per pass; --batch {largest} is more",
            session.chunk_len()
        );
    }
    session.set_profile_timing(true);
    let profile = session.profile();
    let mut sequences: Vec<_> = (0..largest)
        .map(|_| session.new_sequence(context))
        .collect();
    output::note!("prefilling {largest} sequences of {PROMPT_TOKENS} tokens ...");
    for (s, sequence) in sequences.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..PROMPT_TOKENS)
            .map(|i| ((i * 7919 + s * 104_729 + 13) % vocab) as u32)
            .collect();
        session.forward_batch(&mut [SequenceStep {
            sequence,
            tokens: &prompt,
        }])?;
    }
    let mut samplers: Vec<Sampler> = (0..largest)
        .map(|s| {
            Sampler::new(SamplerSettings {
                seed: Some(s as u64),
                ..SamplerSettings::default()
            })
        })
        .collect::<Result<_, _>>()?;
    let mut rows: Vec<Row> = sizes
        .iter()
        .map(|&batch| Row {
            batch,
            step: Vec::new(),
            sampling: Vec::new(),
            phases: [0.0; 5],
            team: TeamStats::default(),
        })
        .collect();
    let mut phase_steps: Vec<Vec<[f64; 5]>> = vec![Vec::new(); sizes.len()];
    let mut taken = ProfileCounts::default();
    // Drop what the prefill recorded.
    if let Ok(mut counts) = profile.lock() {
        counts.take_into(&mut taken);
    }
    let threads = pool.current_num_threads();
    // The read bandwidth after each round, and the bounds at their median: on a shared host it
    // drifts over minutes, and one probe after all rounds could read a burst none of them saw.
    let mut probes = Vec::with_capacity(rounds);
    let pool_for_runs = Arc::clone(pool);
    pool_for_runs.install(|| -> anyhow::Result<()> {
        for round in 0..rounds {
            output::note!("round {} of {rounds}", round + 1);
            let order: Vec<usize> = if round % 2 == 0 {
                (0..sizes.len()).collect()
            } else {
                (0..sizes.len()).rev().collect()
            };
            for index in order {
                let batch = sizes[index];
                let mut next: Vec<u32> = (0..batch).map(|s| (s * 31 + 7) as u32).collect();
                for _ in 0..steps {
                    let team_before = team_stats();
                    let started = Instant::now();
                    {
                        let mut batch_steps: Vec<SequenceStep<'_>> = sequences[..batch]
                            .iter_mut()
                            .zip(&next)
                            .map(|(sequence, token)| SequenceStep {
                                sequence,
                                tokens: std::slice::from_ref(token),
                            })
                            .collect();
                        session.forward_batch(&mut batch_steps)?;
                    }
                    let stepped = started.elapsed().as_secs_f64();
                    add_team(&mut rows[index].team, &team_stats().since(&team_before));
                    let sampled_at = Instant::now();
                    let session_ref = &session;
                    let drawn: Vec<_> = samplers[..batch]
                        .par_iter_mut()
                        .enumerate()
                        .map(|(row, sampler)| sampler.sample(session_ref.batch_logits(row)))
                        .collect();
                    let sampling = sampled_at.elapsed().as_secs_f64();
                    for (token, drawn) in next.iter_mut().zip(drawn) {
                        *token = drawn?;
                    }
                    rows[index].step.push(stepped);
                    rows[index].sampling.push(sampling);
                    if let Ok(mut counts) = profile.lock() {
                        counts.take_into(&mut taken);
                    }
                    let mut phases = [0.0; 5];
                    if taken.steps > 0 {
                        for (slot, nanos) in phases.iter_mut().zip(taken.nanos) {
                            *slot = nanos as f64 / 1e9 / taken.steps as f64;
                        }
                    }
                    phase_steps[index].push(phases);
                }
                for sequence in &mut sequences[..batch] {
                    sequence.truncate(PROMPT_TOKENS);
                }
            }
            probes.push(paired_read_bandwidth(model, threads));
        }
        Ok(())
    })?;
    for (row, phases) in rows.iter_mut().zip(&phase_steps) {
        for (p, slot) in row.phases.iter_mut().enumerate() {
            let values: Vec<f64> = phases.iter().map(|v| v[p]).collect();
            *slot = Summary::of(&values).median;
        }
    }

    output::note!("probing the int8 peak ...");
    let bandwidth = Summary::of(&probes).median;
    let peak = int8_peak_gmacs(model.kernels, pool);
    let mut out = output::stdout();
    super::bench_cmd::write_run_header(&mut out, model, threads)?;
    writeln!(
        out,
        "batched decode (Session::forward_batch): {steps} steps x {rounds} rounds per size, sizes interleaved, context {PROMPT_TOKENS}+; medians"
    )?;
    writeln!(
        out,
        "bounds: weight bytes at {bandwidth:.1} GB/s read bandwidth (median of a probe after each round), multiply-adds at the {peak:.0} GMAC/s int8 peak ({threads} threads)"
    )?;
    writeln!(
        out,
        "{:>5} {:>9} {:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8}",
        "batch",
        "step ms",
        "tok/s",
        "vs 1",
        "attn",
        "experts",
        "unembed",
        "quant",
        "rest",
        "sample",
        "GB",
        "bytes ms",
        "GMAC",
        "macs ms"
    )?;
    let base = rows
        .iter()
        .find(|r| r.batch == 1)
        .map(|r| 1.0 / Summary::of(&r.step).median);
    let mut bounds = Vec::new();
    for row in &rows {
        let step = Summary::of(&row.step).median;
        let sampling = Summary::of(&row.sampling).median;
        let rate = row.batch as f64 / step;
        let bytes = step_bytes(model, row.batch, PROMPT_TOKENS + steps / 2);
        let macs = row.batch as f64 * macs_per_row(model);
        let bytes_ms = bytes / (bandwidth * 1e9) * 1e3;
        let macs_ms = macs / (peak * 1e9) * 1e3;
        let ratio = base.map_or(String::from("-"), |b| format!("{:.2}x", rate / b));
        let p = |phase: Phase| row.phases[phase as usize] * 1e3;
        writeln!(
            out,
            "{:>5} {:>9.1} {:>8.2} {:>6} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.2} {:>9.1} {:>9.1} {:>8.1}",
            row.batch,
            step * 1e3,
            rate,
            ratio,
            p(Phase::Attention),
            p(Phase::Experts),
            p(Phase::Unembedding),
            p(Phase::Quantization),
            p(Phase::Rest),
            sampling * 1e3,
            bytes / 1e9,
            bytes_ms,
            macs / 1e9,
            macs_ms
        )?;
        bounds.push((row.batch, step, bytes_ms.max(macs_ms), bytes_ms >= macs_ms));
    }
    // Where a step waits between its parallel regions (see `model::team`): per step, the regions,
    // those the leader ran alone (a helper stalled shortly before), and the leader's waits for a
    // helper's last task.
    writeln!(
        out,
        "{:>5} {:>9} {:>9} {:>9} {:>9}",
        "batch", "regions", "solo", "wait ms", "stalls"
    )?;
    for row in &rows {
        let per_step = |count: u64| count as f64 / row.step.len().max(1) as f64;
        writeln!(
            out,
            "{:>5} {:>9.0} {:>9.0} {:>9.2} {:>9.2}",
            row.batch,
            per_step(row.team.regions),
            per_step(row.team.solo_regions),
            per_step(row.team.wait_nanos) / 1e6,
            per_step(row.team.stalls)
        )?;
    }
    for (batch, step, bound, by_bytes) in bounds {
        writeln!(
            out,
            "batch {batch:>2}: step {:.1} ms = {:.1}x its bound of {bound:.1} ms ({})",
            step * 1e3,
            step * 1e3 / bound,
            if by_bytes {
                "weight bytes"
            } else {
                "multiply-adds"
            }
        )?;
    }
    out.flush()?;
    Ok(())
}

/// The int8 multiply-add peak of `kernels` on every thread of `pool` at once, in GMAC/s: the
/// best of a few short runs (a neighbour's burst lowers single runs).
fn int8_peak_gmacs(kernels: Kernels, pool: &rayon::ThreadPool) -> f64 {
    let threads = pool.current_num_threads();
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let started = Instant::now();
        pool.broadcast(|_| std::hint::black_box(kernels.int8_mac_probe(PROBE_ROUNDS)));
        best = best.min(started.elapsed().as_secs_f64());
    }
    (threads * PROBE_ROUNDS * PROBE_ROUND_MACS) as f64 / best / 1e9
}

/// Bytes a decode step of `batch` sequences reads: every dense weight and the unembedding once,
/// the experts the rows route to (expected distinct experts of `batch` uniformly routed tokens,
/// which the synthetic weights approximate), and each sequence's visible KV rows at `context`.
pub fn step_bytes(model: &Model, batch: usize, context: usize) -> f64 {
    let c = &model.config;
    let one = model.decode_bytes_per_token(context) as f64;
    let (experts, top_k) = (c.num_local_experts as f64, c.num_experts_per_tok as f64);
    let per_expert: f64 = model
        .weights
        .layers
        .iter()
        .map(|l| (l.gate_up.byte_len() + l.down.byte_len()) as f64 / experts)
        .sum();
    let kv = model.decode_bytes_per_token(context) as f64 - model.decode_bytes_per_token(0) as f64;
    // One token's bytes hold top_k experts per layer and one sequence's KV rows.
    let shared = one - top_k * per_expert - kv;
    let distinct = experts * (1.0 - (1.0 - top_k / experts).powi(batch as i32));
    shared + distinct * per_expert + batch as f64 * kv
}

/// Multiply-adds of one decoded row: every product it goes through, counted twice where the
/// activation format splits the input into two int8 rows (see [`ActivationFormat`]).
pub fn macs_per_row(model: &Model) -> f64 {
    let c = &model.config;
    let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
    let activations = model.activations;
    let rows = |product: Product| split_rows(activations, product);
    let (q, kv) = (c.q_width() as f64, c.kv_width() as f64);
    let dense = match &model.fast {
        Some(fast) if !fast.lm_head.needs_quantized_input() => 1.0,
        _ => rows(Product::Dense),
    };
    let attention = (q + 2.0 * kv) * h + h * q;
    let expert = 2.0 * i * h * rows(Product::ExpertGateUp) + h * i * rows(Product::ExpertDown);
    let router = c.num_local_experts as f64 * h;
    let per_layer = attention * dense + c.num_experts_per_tok as f64 * expert + router;
    // A two-stage unembedding: the draft on one int8 row, its candidates in the session's format.
    let unembedding = match model.fast.as_ref().and_then(|fast| fast.draft.as_ref()) {
        Some(draft) => c.vocab_size as f64 * h + draft.candidates as f64 * h * dense,
        None => c.vocab_size as f64 * h * dense,
    };
    c.num_hidden_layers as f64 * per_layer + unembedding
}

fn add_team(total: &mut TeamStats, step: &TeamStats) {
    total.regions += step.regions;
    total.solo_regions += step.solo_regions;
    total.stalls += step.stalls;
    total.wait_nanos += step.wait_nanos;
}

fn split_rows(activations: ActivationFormat, product: Product) -> f64 {
    activations.split(product).rows_per_token() as f64
}
