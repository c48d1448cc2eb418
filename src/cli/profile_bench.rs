//! `ossterm bench --profile`: what the engine view's counters cost, and what they show. Decodes
//! the same tokens from the same context with the decode phase timers on and off, alternating
//! which goes first in each round, and compares the medians; then prints where a decode step's
//! time went and the step's memory traffic against the machine's read bandwidth; last, a short
//! prompt's prefill on a fresh cache, phase by phase (where a short turn's time to first token
//! goes). With a depth both follow that many tokens of context already in the cache (where a
//! long chat's steps and turns go).

use std::sync::Arc;
use std::time::Instant;

use crate::bench::probe::{median_roofline_share, paired_read_bandwidth};
use crate::bench::stats::Summary;
use crate::model::profile::{boundary_cost_nanos, Phase, ProfileCounts};
use crate::model::Model;

use super::output;

/// Tokens of the prompt every run decodes after, without a depth.
pub const DECODE_PROMPT_TOKENS: usize = 32;

/// What `bench --profile` runs.
#[derive(Debug, Clone, Copy)]
pub struct ProfilePlan {
    /// Tokens each decode run generates.
    pub gen_tokens: usize,
    /// Length of the prompt whose prefill is split by phase.
    pub prompt_tokens: usize,
    /// Tokens of context in the cache before the decode runs and before that prompt (0: a
    /// [`DECODE_PROMPT_TOKENS`] prompt before the decode runs, a fresh cache before the prompt).
    pub depth: usize,
    /// Rounds of the decode runs and of the prefill.
    pub rounds: usize,
}

/// Decode rates (tokens/s) of `rounds` runs with the timers on and as many with them off.
pub fn run(
    model: &Arc<Model>,
    pool: &Arc<rayon::ThreadPool>,
    plan: ProfilePlan,
) -> anyhow::Result<()> {
    let ProfilePlan {
        gen_tokens,
        prompt_tokens,
        depth,
        rounds,
    } = plan;
    let decode_context = if depth == 0 {
        DECODE_PROMPT_TOKENS
    } else {
        depth
    };
    let prompt = context_tokens(model, decode_context, 13);
    // One session for both parts: at a depth the split prefill rewinds to the same context the
    // decode runs follow, instead of prefilling it again.
    let capacity = (decode_context + gen_tokens).max(depth + prompt_tokens) + 1;
    let mut session = model.new_session(pool, capacity);
    let profile = session.profile();
    if depth > 0 {
        output::note!("prefilling {depth} tokens of context ...");
    }
    pool.install(|| session.prefill(&prompt))?;
    let mut rates = [Vec::new(), Vec::new()];
    let mut shown = ProfileCounts::default();
    let mut taken = ProfileCounts::default();
    let decode = |session: &mut crate::model::Session, timing: bool| -> anyhow::Result<f64> {
        session.truncate(decode_context);
        session.set_profile_timing(timing);
        let mut token = prompt[decode_context - 1];
        let started = Instant::now();
        for _ in 0..gen_tokens {
            let logits = session.decode(token)?;
            token = crate::engine::sampler::argmax(logits).unwrap_or(0);
        }
        Ok(gen_tokens as f64 / started.elapsed().as_secs_f64())
    };
    let threads = pool.current_num_threads();
    // The read bandwidth after each round: a round's decode is rated against its own moment.
    let mut probes = Vec::with_capacity(rounds);
    let pool_for_runs = Arc::clone(pool);
    let team_before = crate::model::team::team_stats();
    pool_for_runs.install(|| -> anyhow::Result<()> {
        for round in 0..rounds {
            output::note!("round {} of {rounds}", round + 1);
            // Alternating which goes first cancels a drift of the machine's speed within a round.
            let order = if round % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for timing in order {
                let rate = decode(&mut session, timing)?;
                rates[usize::from(timing)].push(rate);
                if let Ok(mut counts) = profile.lock() {
                    counts.take_into(&mut taken);
                }
                if timing {
                    accumulate(&mut shown, &taken);
                }
            }
            probes.push(paired_read_bandwidth(model, threads));
        }
        Ok(())
    })?;
    let team = crate::model::team::team_stats().since(&team_before);
    let off = Summary::of(&rates[0]).median;
    let on = Summary::of(&rates[1]).median;
    let bandwidth = Summary::of(&probes).median;
    let bytes = model.decode_bytes_per_token(decode_context + gen_tokens / 2);
    let share = median_roofline_share(&rates[1], &probes, bytes);
    let mut out = output::stdout();
    super::bench_cmd::write_run_header(&mut out, model, threads)?;
    writeln!(
        out,
        "decode {gen_tokens} tokens after {decode_context} of context x {rounds} rounds, interleaved; median tok/s"
    )?;
    writeln!(
        out,
        "  counters off  {off:8.2} tok/s  {:?}",
        rounded(&rates[0])
    )?;
    writeln!(
        out,
        "  counters on   {on:8.2} tok/s  {:?}",
        rounded(&rates[1])
    )?;
    writeln!(
        out,
        "  overhead      {:+.2}% (positive: slower with the counters)",
        (off / on - 1.0) * 100.0
    )?;
    let steps = shown.steps.max(1) as f64;
    // The same cost counted rather than timed: clock reads per step x what one costs here.
    let per_boundary = boundary_cost_nanos(1_000_000);
    let boundaries = shown.boundaries as f64 / steps;
    let step_nanos = 1e9 / on;
    writeln!(
        out,
        "  counted       {boundaries:.0} clock reads per step x {per_boundary:.1} ns = {:.2} us of a {:.2} ms step ({:.4}%)",
        boundaries * per_boundary / 1e3,
        step_nanos / 1e6,
        boundaries * per_boundary / step_nanos * 100.0
    )?;
    let inside: u64 = shown.nanos.iter().sum();
    // The phase times are totals over every timed step, so they are set against the mean step
    // of the same runs: against the median rate's step, a noisy round made up an "outside" share
    // (5 ms of a 95 ms step on a host whose rounds ranged 9.8-12.7 tok/s) that no code spent.
    let step_ms = mean_step_ms(&rates[1]);
    writeln!(
        out,
        "decode step {step_ms:.2} ms (mean of the timed runs), of which the forward pass {:.2} ms:",
        inside as f64 / steps / 1e6
    )?;
    write_phases(&mut out, &shown, step_ms)?;
    let outside = (step_ms - inside as f64 / steps / 1e6).max(0.0);
    write_share(&mut out, "outside", outside, step_ms)?;
    // Every decoded token of both halves of every round went through the team.
    let tokens = (2 * rounds * gen_tokens).max(1) as f64;
    writeln!(
        out,
        "team: {:.0} parallel regions per step, leader waiting for a helper {:.2} ms per step; \
         {} regions with a stall (each starts a solo period), {:.1}% of regions run alone",
        team.regions as f64 / tokens,
        team.wait_nanos as f64 / tokens / 1e6,
        team.stalls,
        team.solo_regions as f64 / team.regions.max(1) as f64 * 100.0
    )?;
    let used = bytes as f64 * on / 1e9;
    writeln!(
        out,
        "memory: {:.3} GB/token x {on:.2} tok/s = {used:.2} GB/s of {bandwidth:.2} GB/s read bandwidth: decode at {:.0}% \
         (medians of a probe after each round and of each round's own share)",
        bytes as f64 / 1e9,
        share * 100.0
    )?;
    write_prefill_phases(
        &mut out,
        model,
        &mut session,
        (depth, prompt_tokens),
        rounds,
    )?;
    out.flush()?;
    Ok(())
}

/// Token ids of a made-up text of `len` tokens (`salt` tells texts apart).
fn context_tokens(model: &Model, len: usize, salt: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size;
    (0..len)
        .map(|i| ((i * 7919 + salt) % vocab) as u32)
        .collect()
}

/// A prompt of `prompt_tokens` (by default the shortest standard prompt's length) prefilled
/// `rounds` times after the first `depth` tokens of `session`'s cache (none: a fresh cache) with
/// the phase timers on: where the time to first token of a turn goes.
fn write_prefill_phases(
    out: &mut output::Out,
    model: &Arc<Model>,
    session: &mut crate::model::Session,
    (depth, prompt_tokens): (usize, usize),
    rounds: usize,
) -> anyhow::Result<()> {
    let prompt = context_tokens(model, prompt_tokens, 101);
    let profile = session.profile();
    session.set_profile_timing(true);
    session.set_profile_prefill_timing(true);
    let (mut times, mut shown, mut taken) = (
        Vec::new(),
        ProfileCounts::default(),
        ProfileCounts::default(),
    );
    // What the decode runs left in the counters is not the prefill's.
    if let Ok(mut counts) = profile.lock() {
        counts.take_into(&mut taken);
    }
    let pool = Arc::clone(session.pool());
    pool.install(|| -> anyhow::Result<()> {
        for round in 0..rounds {
            output::note!("prefill round {} of {rounds}", round + 1);
            session.truncate(depth);
            let started = Instant::now();
            session.prefill(&prompt)?;
            times.push(started.elapsed().as_secs_f64() * 1e3);
            if let Ok(mut counts) = profile.lock() {
                counts.take_into(&mut taken);
                accumulate(&mut shown, &taken);
            }
        }
        Ok(())
    })?;
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let after = if depth == 0 {
        "on a fresh cache".to_string()
    } else {
        format!("after {depth} tokens of context")
    };
    writeln!(
        out,
        "prefill of a {prompt_tokens}-token prompt {after}, {rounds} rounds: median {:.1} ms, mean {mean:.1} ms, of which:",
        Summary::of(&times).median
    )?;
    write_phases(out, &shown, mean)?;
    Ok(())
}

/// Each phase's mean time per timed pass of `counts`, and its share of a pass of `of_ms`.
fn write_phases(
    out: &mut output::Out,
    counts: &ProfileCounts,
    of_ms: f64,
) -> Result<(), output::OutputError> {
    let steps = counts.steps.max(1) as f64;
    for phase in Phase::ALL {
        let ms = counts.nanos[phase as usize] as f64 / steps / 1e6;
        write_share(out, phase.name(), ms, of_ms)?;
    }
    Ok(())
}

fn write_share(
    out: &mut output::Out,
    name: &str,
    ms: f64,
    of_ms: f64,
) -> Result<(), output::OutputError> {
    writeln!(out, "  {name:<13}{ms:8.2} ms  {:5.1}%", ms / of_ms * 100.0)
}

fn accumulate(total: &mut ProfileCounts, part: &ProfileCounts) {
    for (sum, value) in total.nanos.iter_mut().zip(part.nanos) {
        *sum += value;
    }
    total.steps += part.steps;
    total.boundaries += part.boundaries;
}

fn rounded(rates: &[f64]) -> Vec<f64> {
    rates
        .iter()
        .map(|rate| (rate * 100.0).round() / 100.0)
        .collect()
}

/// The mean decode step in milliseconds of runs that decoded at `rates` tokens/s (each run
/// decoded the same number of tokens, so this is the total time over the total tokens).
fn mean_step_ms(rates: &[f64]) -> f64 {
    if rates.is_empty() {
        return 0.0;
    }
    rates.iter().map(|rate| 1000.0 / rate).sum::<f64>() / rates.len() as f64
}

#[cfg(test)]
mod tests {
    use super::mean_step_ms;

    #[test]
    fn the_mean_step_is_total_time_over_tokens_not_the_median_rate() {
        // Runs of 100 and 50 tokens/s: 10 and 20 ms a step, 15 ms on average, while the
        // step of the mean rate (75 tokens/s) would be 13.3 ms.
        assert!((mean_step_ms(&[100.0, 50.0]) - 15.0).abs() < 1e-9);
        assert_eq!(mean_step_ms(&[]), 0.0);
    }
}
