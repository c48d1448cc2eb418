//! `ossterm bench`: the project's own benchmark.

use std::io::{IsTerminal, Write};

use clap::Args;

use super::output::{self, note};
use super::{limits, ModelArgs};
use crate::bench::{self, BenchPlan, BenchSettings};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens per prefill measurement (pp) [default: 512]; with --profile, of the prompt
    /// whose prefill is split by phase [default: 58, the shortest standard prompt].
    #[arg(long, value_name = "N")]
    pub prompt_tokens: Option<usize>,
    /// Tokens per decode measurement (tg).
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub gen_tokens: usize,
    /// Context already in the cache when prefill and decode are measured (with --profile, before
    /// its decode runs and its split prefill; with --resume, the chat resumed [default there: 4096]).
    #[arg(long, default_value_t = 0, value_name = "D")]
    pub depth: usize,
    /// Repeats of every measurement (min/median/max are reported).
    #[arg(long, default_value_t = 3, value_name = "R")]
    pub repeat: usize,
    /// Skip the time-to-first-token runs over the ten standard prompts.
    #[arg(long)]
    pub no_ttft: bool,
    /// Use the exact f32 reference path.
    #[arg(long)]
    pub exact: bool,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Measure resuming a chat of --depth tokens (default 4096): time to first token of the next
    /// turn cold, from a RAM snapshot and from a disk snapshot (its pages evicted), each split
    /// into render, restore and the turn's prefill, medians of --repeat rounds (at least 3);
    /// snapshot size, compression, write time and the cost of a background write to a decode.
    #[arg(long, conflicts_with_all = ["prompt_tokens", "gen_tokens", "no_ttft", "json", "profile", "batch"])]
    pub resume: bool,
    /// Measure what the engine view's decode counters cost: --gen-tokens decoded with them on and
    /// off, --repeat rounds interleaved (at least 5), medians; then the phase shares and the
    /// decode's share of the memory bandwidth.
    #[arg(long, conflicts_with_all = ["no_ttft", "json", "batch"])]
    pub profile: bool,
    /// Measure the kernels alone (GEMV GB/s, GEMM GMAC/s on the 20b expert shape) instead of a model.
    #[arg(long, conflicts_with_all = KERNEL_BENCH_IGNORES)]
    pub kernels: bool,
    /// Measure batched decode steps (as `ossterm serve` runs them) of these batch sizes, e.g.
    /// 1,2,4,8,16: step time split by phase, sampling, and the bounds of weight bytes and
    /// multiply-adds; --batch-steps steps per size x --repeat rounds, interleaved.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", conflicts_with_all = ["prompt_tokens", "gen_tokens", "depth", "no_ttft", "json"])]
    pub batch: Option<Vec<usize>>,
    /// Decode steps of each batch size per round of --batch (a step of 16 sequences takes most of
    /// a second, so a few are enough).
    #[arg(long, default_value_t = 4, value_name = "N", requires = "batch", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    pub batch_steps: usize,
}

/// What `--kernels` never reads: it measures the kernels on the 20b shapes with threads of its
/// own, no model, so each of these given with it is refused rather than silently dropped.
const KERNEL_BENCH_IGNORES: [&str; 18] = [
    "prompt_tokens",
    "gen_tokens",
    "depth",
    "no_ttft",
    "exact",
    "resume",
    "profile",
    "batch",
    "model",
    "synthetic",
    "synthetic_seed",
    "threads",
    "weights",
    "kv_cache",
    "activations",
    "attention",
    "expert_layout",
    "unembedding",
];

/// Most repeats of a measurement: more tells nothing new, and each one is a full run.
const MAX_REPEAT: usize = 1000;

/// `--prompt-tokens` unless given: llama-bench's pp512.
const BENCH_PROMPT_TOKENS: usize = 512;

/// `--prompt-tokens` of `--profile` unless given: the shortest standard prompt's length (the
/// time to first token the speed issue's goal names).
const PROFILE_PROMPT_TOKENS: usize = 58;

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if args.repeat == 0 {
        anyhow::bail!("--repeat must be at least 1");
    }
    if args.repeat > MAX_REPEAT {
        anyhow::bail!(
            "--repeat {} is more than the {MAX_REPEAT} repeats the benchmark runs",
            args.repeat
        );
    }
    if args.kernels {
        return kernel_bench(&args);
    }
    if args.model.model.is_none() && args.model.synthetic.is_none() {
        anyhow::bail!("name a model: --model DIR or --synthetic 20b|tiny");
    }
    let prompt_tokens = args.prompt_tokens.unwrap_or(if args.profile {
        PROFILE_PROMPT_TOKENS
    } else {
        BENCH_PROMPT_TOKENS
    });
    if args.profile && prompt_tokens == 0 {
        anyhow::bail!(
            "--profile splits a prompt's prefill by phase: --prompt-tokens must be at least 1"
        );
    }
    if args.profile && args.gen_tokens == 0 {
        anyhow::bail!("--profile times decoded tokens: --gen-tokens must be at least 1");
    }
    let mut progress = ProgressLine::new();
    progress.show("loading the model", 0, 1);
    let load_started = std::time::Instant::now();
    // Without a depth `--profile`'s decode runs follow a short prompt of their own (the sum
    // below is more than either of its sessions needs, and says what to shorten).
    let (first_name, first) = if args.profile && args.depth == 0 {
        (
            "tokens of the profile's decode prompt",
            super::profile_bench::DECODE_PROMPT_TOKENS,
        )
    } else {
        ("--depth", args.depth)
    };
    // Checked before the model loads, so a typo costs no load: the sum the session is sized for
    // (see bench::run) must not wrap.
    let parts = [
        (first_name, first),
        ("--prompt-tokens", prompt_tokens),
        ("--gen-tokens", args.gen_tokens),
        ("position for the first token", 1),
    ];
    let context = limits::positions(&parts)?;
    // A model file that is partly out of the page cache makes the first repeat read it from disk
    // (decode measured 6.8 against 11 tokens/s so on a 24 GiB machine holding two 20B files):
    // said up front, so a low min column is not taken for the engine's speed.
    if let Some(path) = args.model.model.as_deref() {
        if let Some(share) = crate::bench::probe::model_resident_share(path) {
            if share < 0.9 {
                note!(
                    "{:.0}% of the model's files are in the page cache: the first repeat reads the rest from disk (its figures land in the min column)",
                    share * 100.0
                );
            }
        }
    }
    let model = args.model.load(args.exact)?;
    let pool = args.model.pool()?;
    let load_seconds = load_started.elapsed().as_secs_f64();
    if args.resume {
        progress.show("measuring resume", 0, 1);
        let depth = if args.depth == 0 { 4096 } else { args.depth };
        let plan = super::resume_bench::ResumePlan {
            depth,
            repeat: args.repeat,
        };
        progress.clear();
        return super::resume_bench::run(&model, &pool, plan);
    }
    if let Some(sizes) = &args.batch {
        progress.clear();
        return super::batch_bench::run(&model, &pool, sizes, args.batch_steps, args.repeat);
    }
    limits::check_context(&model, context, &parts)?;
    if args.profile {
        progress.clear();
        let plan = super::profile_bench::ProfilePlan {
            gen_tokens: args.gen_tokens,
            prompt_tokens,
            depth: args.depth,
            rounds: args.repeat.max(5),
        };
        return super::profile_bench::run(&model, &pool, plan);
    }
    let plan = BenchPlan {
        prompt_tokens,
        gen_tokens: args.gen_tokens,
        depth: args.depth,
        repeat: args.repeat,
        ttft: !args.no_ttft,
    };
    let settings = BenchSettings {
        model: model.source.clone(),
        threads: pool.current_num_threads(),
        kernels: match model.precision {
            crate::model::Precision::Exact => "portable (exact)".into(),
            crate::model::Precision::Fast => model.kernels.path().describe(),
        },
        weights: model.weights_description(),
        kv_cache: model.kv_format.name().into(),
        prompt_tokens,
        gen_tokens: args.gen_tokens,
        depth: args.depth,
        repeat: args.repeat,
        cpu: String::new(),
        cpu_info: Default::default(),
        load_seconds,
        convert_seconds: model
            .fast
            .as_ref()
            .map_or(0.0, |f| f.convert_time.as_secs_f64()),
        converted_bytes: model.fast.as_ref().map_or(0, |f| f.owned_bytes as u64),
        tile_seconds: model
            .fast
            .as_ref()
            .map_or(0.0, |f| f.tile_time.as_secs_f64()),
        tiled_bytes: model.fast.as_ref().map_or(0, |f| f.tiled_bytes as u64),
        tile_source: model
            .fast
            .as_ref()
            .map_or_else(String::new, |f| f.tile_source.describe()),
        tile_cache_note: model.fast.as_ref().and_then(|f| f.tile_cache_note.clone()),
    };
    let report = bench::run(&model, &pool, &plan, settings, &mut |what, done, total| {
        progress.show(what, done, total)
    })?;
    progress.clear();
    let mut out = output::stdout();
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        write!(out, "{}", bench::render_table(&report))?;
    }
    out.flush()?;
    Ok(())
}

fn kernel_bench(args: &BenchArgs) -> anyhow::Result<()> {
    let kernels = crate::kernels::Kernels::new(crate::kernels::init_kernel_path()?)?;
    let config = crate::bench::kernels::KernelBenchConfig {
        repetitions: args.repeat.max(3),
        ..crate::bench::kernels::KernelBenchConfig::standard()
    };
    note!("measuring the {} kernels ...", kernels.path());
    let report = crate::bench::kernels::run_kernel_bench(kernels, &config)?;
    let mut out = output::stdout();
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        write!(out, "{report}")?;
    }
    out.flush()?;
    Ok(())
}

/// A one-line progress bar on stderr, redrawn in place; silent when stderr is not a terminal
/// except for a line per new phase.
struct ProgressLine {
    tty: bool,
    last_phase: String,
}

impl ProgressLine {
    fn new() -> Self {
        ProgressLine {
            tty: std::io::stderr().is_terminal(),
            last_phase: String::new(),
        }
    }

    fn show(&mut self, what: &str, done: usize, total: usize) {
        let mut err = std::io::stderr().lock();
        if self.tty {
            let width = 24;
            let filled = (done * width).checked_div(total).unwrap_or(0).min(width);
            let _ = write!(
                err,
                "\r\x1b[2K[{}{}] {what}",
                "#".repeat(filled),
                "-".repeat(width - filled)
            );
        } else if what != self.last_phase {
            let _ = writeln!(err, "{what}");
        }
        let _ = err.flush();
        self.last_phase.clear();
        self.last_phase.push_str(what);
    }

    fn clear(&mut self) {
        if self.tty {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}

/// The first lines of every model bench mode's report: the CPU it ran on, the model, the thread
/// count and the weight formats, so a figure is never read without its setting.
pub(super) fn write_run_header(
    out: &mut output::Out,
    model: &crate::model::Model,
    threads: usize,
) -> Result<(), output::OutputError> {
    writeln!(out, "cpu: {}", crate::bench::probe::CpuInfo::current())?;
    writeln!(
        out,
        "model: {}, {threads} threads, {}",
        model.source,
        model.weights_description()
    )
}
