//! The kernel benchmark behind `ossterm bench --kernels`: GEMV read bandwidth over a set of expert
//! matrices larger than the caches, and GEMM throughput for growing token counts, per weight format
//! and thread count.

use std::fmt;
use std::time::{Duration, Instant};

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::Serialize;

use super::probe::CpuInfo;
use crate::kernels::{
    tile_mxfp4, AlignedVec, GemmScratch, KernelError, KernelPath, Kernels, Mxfp4Matrix, Q4Matrix,
    Q8Activations, Q8Matrix, ScaleRule, AMX_MIN_ROWS, GROUP_BLOCKS, GROUP_LEN, MAX_GEMV_TOKENS,
    MXFP4_TILE_ROWS, PROBE_ROUND_MACS, TILE_PROBE_ROUND_MACS,
};
use crate::model::options::{ActivationFormat, Product, Split};

/// What to measure.
#[derive(Clone, Debug)]
pub struct KernelBenchConfig {
    /// Matrices streamed by the GEMV measurement (gpt-oss-20b has 32 experts per layer).
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub thread_counts: Vec<usize>,
    /// Token counts M for the GEMM measurement (on one `rows x cols` matrix).
    pub gemm_tokens: Vec<usize>,
    /// Token counts M for the streamed MXFP4 measurement: M tokens against every one of the
    /// `experts` matrices, as a short prompt's experts are multiplied (the GEMV up to
    /// [`MAX_GEMV_TOKENS`], the GEMM beyond), weights read from memory rather than cache.
    pub stream_tokens: Vec<usize>,
    /// Timed runs per measurement; the report gives the best and the median.
    pub repetitions: usize,
    /// Each timed run repeats the kernel until it lasts at least this long.
    pub min_run_time: Duration,
    /// Bytes the plain read-bandwidth probe streams per pass (split over the threads); the GEMVs
    /// are printed as a fraction of its rate.
    pub probe_bytes: usize,
}

impl KernelBenchConfig {
    /// The gpt-oss-20b expert shape: 32 matrices of 2880 x 2880 (about 141 MB of MXFP4).
    pub fn standard() -> Self {
        Self {
            experts: 32,
            rows: 2880,
            cols: 2880,
            thread_counts: vec![1, 2],
            gemm_tokens: vec![1, 4, 8, 16, 32, 64, 128, 256],
            stream_tokens: vec![2, 4, 6, 8, 12, 16, 24, 32],
            repetitions: 5,
            min_run_time: Duration::from_millis(20),
            probe_bytes: super::probe::beyond_l3(1 << 30),
        }
    }

    /// A shape small enough for tests: rows a whole number of tiles, so the tiled rows are
    /// measured too, and a GEMM of 17 tokens, which the `amx` path runs on the matrix unit.
    pub fn quick() -> Self {
        Self {
            experts: 2,
            rows: 48,
            cols: 160,
            thread_counts: vec![1, 2],
            gemm_tokens: vec![1, 5, 17],
            stream_tokens: vec![3, 6],
            repetitions: 2,
            min_run_time: Duration::from_micros(200),
            probe_bytes: 1 << 20,
        }
    }
}

/// One measured kernel configuration.
#[derive(Clone, Debug, Serialize)]
pub struct KernelBenchResult {
    /// e.g. `mxfp4_gemv`, `q8_gemm`.
    pub kernel: String,
    pub threads: usize,
    /// Tokens multiplied at once.
    pub tokens: usize,
    /// Weight bytes read per kernel run.
    pub weight_bytes: usize,
    /// Multiply-accumulates per kernel run.
    pub macs: usize,
    pub best_seconds: f64,
    pub median_seconds: f64,
    /// Weight bytes per second at the best run, in 1e9.
    pub best_gb_per_s: f64,
    /// Multiply-accumulates per second at the best run, in 1e9.
    pub best_gmac_per_s: f64,
    /// GEMMs and streamed products: `best_gmac_per_s` over the int8 peak measured with the same
    /// thread count.
    pub peak_fraction: Option<f64>,
    /// GEMVs and streamed products: `best_gb_per_s` over the plain read bandwidth measured with
    /// the same thread count (what streaming the weights could reach at most).
    pub bandwidth_fraction: Option<f64>,
    /// Tiled MXFP4 and Q8 GEMMs on the `amx` path: `best_gmac_per_s` over the `tdpbssd` tile peak
    /// measured with the same thread count.
    pub tile_fraction: Option<f64>,
}

/// The plain read bandwidth on some threads (widest loads of the kernel path, no arithmetic).
#[derive(Clone, Debug, Serialize)]
pub struct ReadBandwidthResult {
    pub threads: usize,
    /// All threads together, best and median pass, in GB/s.
    pub best_gb_per_s: f64,
    pub median_gb_per_s: f64,
}

/// The int8 arithmetic peak on some threads ([`Kernels::int8_mac_probe`] on each at once).
#[derive(Clone, Debug, Serialize)]
pub struct PeakResult {
    pub threads: usize,
    /// Multiply-accumulates per second of all threads together at the best run, in 1e9.
    pub gmac_per_s: f64,
}

/// The AMX `tdpbssd` peak on some threads ([`Kernels::tile_mac_probe`] on each at once).
#[derive(Clone, Debug, Serialize)]
pub struct TilePeakResult {
    pub threads: usize,
    /// Multiply-adds per second of all threads together, in 1e9.
    pub gmac_per_s: f64,
}

/// All measurements of one run.
#[derive(Clone, Debug, Serialize)]
pub struct KernelBenchReport {
    pub path: String,
    /// How the MXFP4 GEMV decodes nibbles on this path: `vpermb` (AVX-512 VBMI), `vpshufb`,
    /// or `scalar`.
    pub gemv_decode: String,
    pub cpu: CpuInfo,
    /// The int8 peak per thread count (empty on the scalar path, which has no such instruction).
    pub int8_peak: Vec<PeakResult>,
    /// Why a CPU that has AMX runs this path without it (the OS refused the tile state, say).
    pub amx_refusal: Option<String>,
    /// The AMX matrix unit's peak per thread count (the `amx` path only).
    pub tile_peak: Vec<TilePeakResult>,
    /// The read bandwidth per thread count, which GEMVs are related to.
    pub read_bandwidth: Vec<ReadBandwidthResult>,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// The CPU's level-3 cache (sysfs), where reported.
    pub l3_cache_bytes: Option<u64>,
    pub results: Vec<KernelBenchResult>,
}

impl KernelBenchReport {
    /// Bytes of MXFP4 the GEMV and stream measurements read per pass.
    pub fn streamed_mxfp4_bytes(&self) -> u64 {
        let elements = (self.experts * self.rows * self.cols) as u64;
        elements / 2 + elements / 32
    }

    /// Whether that set could sit in the L3 in good part (under 4 times its size): the GEMVs'
    /// and streams' GB/s may then count reads from the L3, not only from memory.
    pub fn streamed_set_near_l3(&self) -> bool {
        self.l3_cache_bytes
            .is_some_and(|l3| self.streamed_mxfp4_bytes() < 4 * l3)
    }
}

impl fmt::Display for KernelBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "cpu {}", self.cpu)?;
        writeln!(
            f,
            "kernel path {} (MXFP4 GEMV nibble decode: {}); GEMV and stream over {} matrices of \
             {}x{}, GEMM on one",
            self.path, self.gemv_decode, self.experts, self.rows, self.cols
        )?;
        if self.streamed_set_near_l3() {
            writeln!(
                f,
                "note: the GEMV and stream set ({} MB of MXFP4) is under 4x this CPU's L3 ({} \
                 MiB): their GB/s may count reads from the L3, not only from memory",
                self.streamed_mxfp4_bytes() / 1_000_000,
                self.l3_cache_bytes.unwrap_or(0) >> 20
            )?;
        }
        if let Some(reason) = &self.amx_refusal {
            writeln!(f, "AMX refused: {reason}")?;
        }
        for p in &self.int8_peak {
            writeln!(
                f,
                "int8 MAC peak ({}) on {} thread{}: {:.1} GMAC/s ({:.1} per thread)",
                peak_instructions(&self.path),
                p.threads,
                if p.threads == 1 { "" } else { "s" },
                p.gmac_per_s,
                p.gmac_per_s / p.threads.max(1) as f64
            )?;
        }
        if !self.int8_peak.is_empty() {
            writeln!(
                f,
                "% peak: best GMAC/s over the int8 peak above for the same thread count (the \
                 higher of a probe before and one after that thread count's kernels)"
            )?;
        }
        for p in &self.tile_peak {
            writeln!(
                f,
                "AMX tile peak (tdpbssd, 4 sum tiles, operands in registers) on {} thread{}: \
                 {:.1} GMAC/s ({:.1} per thread); % tile: the tiled MXFP4 and Q8 GEMMs over it",
                p.threads,
                if p.threads == 1 { "" } else { "s" },
                p.gmac_per_s,
                p.gmac_per_s / p.threads.max(1) as f64,
            )?;
        }
        for b in &self.read_bandwidth {
            writeln!(
                f,
                "read bandwidth ({} loads) on {} thread{}: {:.1} GB/s best, {:.1} median",
                read_loads(&self.path),
                b.threads,
                if b.threads == 1 { "" } else { "s" },
                b.best_gb_per_s,
                b.median_gb_per_s
            )?;
        }
        writeln!(
            f,
            "{:<12} {:>7} {:>6} {:>11} {:>11} {:>9} {:>9} {:>7} {:>7} {:>7}",
            "kernel",
            "threads",
            "M",
            "best ms",
            "median ms",
            "GB/s",
            "GMAC/s",
            "% peak",
            "% read",
            "% tile"
        )?;
        let percent = |p: Option<f64>| p.map_or(String::new(), |p| format!("{:.0}%", 100.0 * p));
        for r in &self.results {
            writeln!(
                f,
                "{:<12} {:>7} {:>6} {:>11.3} {:>11.3} {:>9.1} {:>9.1} {:>7} {:>7} {:>7}",
                r.kernel,
                r.threads,
                r.tokens,
                r.best_seconds * 1e3,
                r.median_seconds * 1e3,
                r.best_gb_per_s,
                r.best_gmac_per_s,
                percent(r.peak_fraction),
                percent(r.bandwidth_fraction),
                percent(r.tile_fraction)
            )?;
        }
        Ok(())
    }
}

/// The MXFP4 GEMV's nibble decode on `kernels`, for the report.
fn gemv_decode(kernels: Kernels) -> &'static str {
    match kernels.path() {
        KernelPath::Avx512 | KernelPath::Amx if kernels.uses_vbmi() => "vpermb",
        KernelPath::Avx512 | KernelPath::Amx | KernelPath::Avx2 | KernelPath::Avx2Vnni => "vpshufb",
        KernelPath::Scalar => "scalar",
    }
}

/// What the probe of `path` runs, for the report.
fn peak_instructions(path: &str) -> &'static str {
    match path {
        "avx512" | "amx" => "vpdpbusd, 16 chains",
        "avx2" => "vpmaddubsw + vpmaddwd",
        "avx2-vnni" => "256-bit vpdpbusd",
        _ => "scalar",
    }
}

/// What the read-bandwidth probe of `path` loads with, for the report.
fn read_loads(path: &str) -> &'static str {
    match path {
        "avx512" | "amx" => "512-bit",
        "avx2" | "avx2-vnni" => "256-bit",
        _ => "scalar",
    }
}

/// Probe rounds per call: about a millisecond at the AVX-512 peak, far below the 2^24 rounds
/// at which a lane could overflow.
const PROBE_ROUNDS: usize = 1 << 19;

/// The int8 peak of `kernels` on `pool`: every thread runs the probe at the same time, as the
/// GEMM's threads do.
fn measure_peak(
    kernels: Kernels,
    pool: &rayon::ThreadPool,
    config: &KernelBenchConfig,
) -> Result<PeakResult, KernelError> {
    let threads = pool.current_num_threads();
    // The best of many short runs: on a shared machine a neighbour's burst lowers single runs,
    // and a low peak would overstate every GEMM's ratio to it.
    let (best, _) = time_runs(config.repetitions.max(10), config.min_run_time, || {
        pool.broadcast(|_| std::hint::black_box(kernels.int8_mac_probe(PROBE_ROUNDS)));
        Ok::<(), KernelError>(())
    })?;
    Ok(PeakResult {
        threads,
        gmac_per_s: (threads * PROBE_ROUNDS * PROBE_ROUND_MACS) as f64 / best / 1e9,
    })
}

/// Rounds of a tile probe call: about a millisecond at the tile peak.
const TILE_PROBE_ROUNDS: usize = 1 << 15;

/// The AMX tile peak of `kernels` on `pool` (`None` off the `amx` path).
fn measure_tile_peak(
    kernels: Kernels,
    pool: &rayon::ThreadPool,
    config: &KernelBenchConfig,
) -> Result<Option<TilePeakResult>, KernelError> {
    if kernels.tile_mac_probe(1).is_none() {
        return Ok(None);
    }
    let threads = pool.current_num_threads();
    let (best, _) = time_runs(config.repetitions.max(10), config.min_run_time, || {
        pool.broadcast(|_| std::hint::black_box(kernels.tile_mac_probe(TILE_PROBE_ROUNDS)));
        Ok::<(), KernelError>(())
    })?;
    Ok(Some(TilePeakResult {
        threads,
        gmac_per_s: (threads * TILE_PROBE_ROUNDS * TILE_PROBE_ROUND_MACS) as f64 / best / 1e9,
    }))
}

/// Random weights in the three integer formats, built directly (no bf16 round trip) to keep
/// setup fast for hundreds of megabytes.
struct BenchWeights {
    rows: usize,
    cols: usize,
    mxfp4_blocks: AlignedVec<u8>,
    mxfp4_scales: AlignedVec<u8>,
    /// The MXFP4 bytes in the tile layout, when the kernels prefer it (as the model then loads
    /// its experts).
    mxfp4_tiles: Option<(AlignedVec<u8>, AlignedVec<u8>)>,
    q8: Vec<Q8Matrix>,
    /// The Q8 matrices in the tile layout, when the kernels prefer it.
    q8_tiles: Vec<Q8Matrix>,
    q4: Vec<Q4Matrix>,
    /// The Q4 matrices in the tile layout, when the kernels prefer it.
    q4_tiles: Vec<Q4Matrix>,
}

impl BenchWeights {
    fn random(
        rng: &mut ChaCha8Rng,
        experts: usize,
        rows: usize,
        cols: usize,
        kernels: &Kernels,
    ) -> Result<Self, KernelError> {
        // Each tile layout where the kernels prefer it, as the model then converts its weights.
        let tiles = kernels.prefers_tiled_mxfp4();
        let (tile_q8, tile_q4) = (kernels.prefers_tiled_q8(), kernels.prefers_tiled_q4());
        let groups = cols.div_ceil(GROUP_LEN);
        let blocks = cols / 32;
        // In 64-byte aligned buffers on huge pages, as the model holds its weights: over 4 KiB
        // pages the GEMVs would stream what decode never does (see `probe::weight_like_buffer`).
        let mut bytes = |n: usize| -> AlignedVec<u8> {
            let mut v = AlignedVec::filled(n, 0u8);
            rng.fill(&mut v[..]);
            v
        };
        let mxfp4_blocks = bytes(experts * rows * cols / 2);
        let mut mxfp4_scales = bytes(experts * rows * blocks);
        for scale in mxfp4_scales.iter_mut() {
            *scale = 118 + *scale % 12;
        }
        let mxfp4_tiles = if tiles && rows.is_multiple_of(MXFP4_TILE_ROWS) {
            let mut tiled = (
                AlignedVec::filled(mxfp4_blocks.len(), 0u8),
                AlignedVec::filled(mxfp4_scales.len(), 0u8),
            );
            tile_mxfp4(
                experts * rows,
                cols,
                &mxfp4_blocks,
                &mxfp4_scales,
                &mut tiled.0,
                &mut tiled.1,
            )?;
            Some(tiled)
        } else {
            None
        };
        let scales = |rng: &mut ChaCha8Rng| -> Vec<f16> {
            (0..rows * groups * GROUP_BLOCKS)
                .map(|_| f16::from_f32(rng.gen_range(1e-3..1e-2)))
                .collect()
        };
        let mut q8 = Vec::with_capacity(experts);
        let mut q4 = Vec::with_capacity(experts);
        for _ in 0..experts {
            let mut quants = vec![0u8; rows * groups * GROUP_LEN];
            rng.fill(&mut quants[..]);
            let quants: Vec<i8> = quants.into_iter().map(|b| (b as i8).max(-127)).collect();
            q8.push(Q8Matrix::from_parts(rows, cols, &quants, scales(rng))?);
            let mut nibbles = vec![0u8; rows * groups * GROUP_LEN / 2];
            rng.fill(&mut nibbles[..]);
            q4.push(Q4Matrix::from_parts(rows, cols, &nibbles, scales(rng))?);
        }
        let q8_tiles = if tile_q8 && rows.is_multiple_of(MXFP4_TILE_ROWS) {
            q8.iter()
                .map(Q8Matrix::to_tiles)
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let q4_tiles = if tile_q4 && rows.is_multiple_of(MXFP4_TILE_ROWS) {
            q4.iter()
                .map(Q4Matrix::to_tiles)
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(Self {
            rows,
            cols,
            mxfp4_blocks,
            mxfp4_scales,
            mxfp4_tiles,
            q8,
            q8_tiles,
            q4,
            q4_tiles,
        })
    }

    fn mxfp4(&self, expert: usize) -> Result<Mxfp4Matrix<'_>, KernelError> {
        let (block_bytes, scale_bytes) = (self.rows * self.cols / 2, self.rows * self.cols / 32);
        Mxfp4Matrix::new(
            self.rows,
            self.cols,
            &self.mxfp4_blocks[expert * block_bytes..(expert + 1) * block_bytes],
            &self.mxfp4_scales[expert * scale_bytes..(expert + 1) * scale_bytes],
        )
    }

    /// Expert `expert` in the tile layout (the row order if there are no tiles).
    fn mxfp4_tiled(&self, expert: usize) -> Result<Mxfp4Matrix<'_>, KernelError> {
        let Some((blocks, scales)) = &self.mxfp4_tiles else {
            return self.mxfp4(expert);
        };
        let (block_bytes, scale_bytes) = (self.rows * self.cols / 2, self.rows * self.cols / 32);
        Mxfp4Matrix::new_tiled(
            self.rows,
            self.cols,
            &blocks[expert * block_bytes..(expert + 1) * block_bytes],
            &scales[expert * scale_bytes..(expert + 1) * scale_bytes],
        )
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Mxfp4,
    /// MXFP4 in the tile layout.
    Mxfp4Tiles,
    Q8,
    /// Q8 in the tile layout.
    Q8Tiles,
    Q4,
    /// Q4 in the tile layout.
    Q4Tiles,
}

impl Format {
    /// How the model quantizes the inputs of this format's products with the default
    /// activations: Q8 weights are attention's and the unembedding's (dense products), MXFP4's
    /// larger product is the experts' gate_up, and Q4 is the draft unembedding, which takes one
    /// row per sequence whatever the setting.
    fn activation_scales(self) -> ScaleRule {
        let activations = ActivationFormat::default();
        match self {
            Format::Q8 | Format::Q8Tiles => activations.split(Product::Dense),
            Format::Mxfp4 | Format::Mxfp4Tiles => activations.split(Product::ExpertGateUp),
            Format::Q4 | Format::Q4Tiles => Split::Single,
        }
        .scale_rule()
    }

    fn name(self) -> &'static str {
        match self {
            Format::Mxfp4 => "mxfp4",
            Format::Mxfp4Tiles => "mxfp4_tiles",
            Format::Q8 => "q8",
            Format::Q8Tiles => "q8_tiles",
            Format::Q4 => "q4",
            Format::Q4Tiles => "q4_tiles",
        }
    }

    fn matrix_bytes(self, w: &BenchWeights) -> usize {
        match self {
            Format::Mxfp4 | Format::Mxfp4Tiles => w.rows * w.cols / 32 * 17,
            Format::Q8 | Format::Q8Tiles => w.q8[0].size_bytes(),
            Format::Q4 => w.q4[0].size_bytes(),
            Format::Q4Tiles => w.q4_tiles[0].size_bytes(),
        }
    }
}

/// Per-thread buffers, allocated before timing.
struct ThreadState {
    rows: std::ops::Range<usize>,
    out: Vec<f32>,
    scratch: GemmScratch,
}

fn split_rows(rows: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    // Split on multiples of 16 rows so every thread keeps whole GEMM tiles.
    let tiles = rows.div_ceil(16);
    (0..threads)
        .map(|t| {
            ((tiles * t / threads) * 16).min(rows)..((tiles * (t + 1) / threads) * 16).min(rows)
        })
        .collect()
}

/// Time `run` (best and median of `repetitions`, each repeated to `min_run_time`), per call.
pub(crate) fn time_runs<E>(
    repetitions: usize,
    min_run_time: Duration,
    mut run: impl FnMut() -> Result<(), E>,
) -> Result<(f64, f64), E> {
    let start = Instant::now();
    run()?;
    let once = start.elapsed().max(Duration::from_nanos(100));
    let calls = (min_run_time.as_secs_f64() / once.as_secs_f64())
        .ceil()
        .max(1.0) as usize;
    let mut samples = Vec::with_capacity(repetitions.max(1));
    for _ in 0..repetitions.max(1) {
        let start = Instant::now();
        for _ in 0..calls {
            run()?;
        }
        samples.push(start.elapsed().as_secs_f64() / calls as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok((samples[0], samples[samples.len() / 2]))
}

/// Measure the integer kernels of `kernels` as `config` says. Uses its own rayon pools of each
/// requested size; allocates the weights up front (about 560 MB for the standard config).
pub fn run_kernel_bench(
    kernels: Kernels,
    config: &KernelBenchConfig,
) -> Result<KernelBenchReport, KernelError> {
    if config.experts == 0
        || config.rows == 0
        || config.cols == 0
        || !config.cols.is_multiple_of(32)
    {
        return Err(KernelError::BadColumns {
            what: format!(
                "kernel benchmark shape {} experts x {}x{}",
                config.experts, config.rows, config.cols
            ),
            cols: config.cols,
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let weights =
        BenchWeights::random(&mut rng, config.experts, config.rows, config.cols, &kernels)?;
    // Every format, and after each the same weights in its tile layout where they were built.
    let formats: Vec<Format> = [
        (
            Format::Mxfp4,
            Some(Format::Mxfp4Tiles).filter(|_| weights.mxfp4_tiles.is_some()),
        ),
        (
            Format::Q8,
            Some(Format::Q8Tiles).filter(|_| !weights.q8_tiles.is_empty()),
        ),
        (
            Format::Q4,
            Some(Format::Q4Tiles).filter(|_| !weights.q4_tiles.is_empty()),
        ),
    ]
    .into_iter()
    .flat_map(|(plain, tiled)| std::iter::once(plain).chain(tiled))
    .collect();
    let formats = &formats[..];
    let max_tokens = config.gemm_tokens.iter().copied().max().unwrap_or(1).max(1);
    let max_stream = config.stream_tokens.iter().copied().max().unwrap_or(1);
    let activations: Vec<f32> = (0..max_tokens.max(max_stream) * config.cols)
        .map(|_| rng.gen_range(-2.0..2.0))
        .collect();
    let mut results = Vec::new();
    let mut int8_peak = Vec::new();
    let mut tile_peak = Vec::new();
    let mut read_bandwidth = Vec::new();
    for &threads in &config.thread_counts {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .build()
            .map_err(|e| KernelError::ThreadPool(e.to_string()))?;
        let peak = (kernels.path() != KernelPath::Scalar)
            .then(|| measure_peak(kernels, &pool, config))
            .transpose()?;
        let tiles = measure_tile_peak(kernels, &pool, config)?;
        // Best of at least five passes, as the GEMVs are timed: the ratio compares like with like.
        let (best_read, median_read) = super::probe::simd_read_bandwidth_gbps(
            kernels,
            &pool,
            config.probe_bytes,
            config.repetitions.max(5),
        );
        read_bandwidth.push(ReadBandwidthResult {
            threads: pool.current_num_threads(),
            best_gb_per_s: best_read,
            median_gb_per_s: median_read,
        });
        let first_result = results.len();
        let ranges = split_rows(config.rows, threads.max(1));
        for &format in formats {
            let rule = format.activation_scales();
            // GEMV: one token (or a token and its split remainder, as decode with split
            // activations runs) against every expert matrix, each thread on its rows of each.
            for gemv_tokens in 1..=MAX_GEMV_TOKENS.min(max_tokens) {
                let mut x = Q8Activations::with_capacity(gemv_tokens, config.cols);
                kernels.quantize_activation_rows_with(
                    &activations[..gemv_tokens * config.cols],
                    config.cols,
                    rule,
                    true,
                    &mut x,
                )?;
                let mut states = thread_states(&ranges, gemv_tokens, config.cols);
                let (best, median) = time_runs(config.repetitions, config.min_run_time, || {
                    pool.install(|| {
                        states.par_iter_mut().try_for_each(|s| {
                            for e in 0..config.experts {
                                match format {
                                    Format::Mxfp4 => kernels.mxfp4_gemv(
                                        &weights.mxfp4(e)?,
                                        &x,
                                        s.rows.clone(),
                                        &mut s.out,
                                    )?,
                                    Format::Mxfp4Tiles => kernels.mxfp4_gemv(
                                        &weights.mxfp4_tiled(e)?,
                                        &x,
                                        s.rows.clone(),
                                        &mut s.out,
                                    )?,
                                    Format::Q8 => kernels.q8_gemv(
                                        &weights.q8[e],
                                        &x,
                                        s.rows.clone(),
                                        &mut s.out,
                                    )?,
                                    Format::Q8Tiles => kernels.q8_gemv(
                                        &weights.q8_tiles[e],
                                        &x,
                                        s.rows.clone(),
                                        &mut s.out,
                                    )?,
                                    Format::Q4 => kernels.q4_gemv(
                                        &weights.q4[e],
                                        &x,
                                        s.rows.clone(),
                                        &mut s.out,
                                    )?,
                                    Format::Q4Tiles => kernels.q4_gemv(
                                        &weights.q4_tiles[e],
                                        &x,
                                        s.rows.clone(),
                                        &mut s.out,
                                    )?,
                                }
                            }
                            Ok(())
                        })
                    })
                })?;
                let bytes = format.matrix_bytes(&weights) * config.experts;
                results.push(result(
                    format!("{}_gemv", format.name()),
                    threads,
                    gemv_tokens,
                    bytes,
                    config,
                    best,
                    median,
                ));
            }

            // GEMM: M tokens against one matrix.
            for &tokens in &config.gemm_tokens {
                let tokens = tokens.max(1);
                let mut x = Q8Activations::with_capacity(tokens, config.cols);
                kernels.quantize_activation_rows_with(
                    &activations[..tokens * config.cols],
                    config.cols,
                    rule,
                    true,
                    &mut x,
                )?;
                let mut states = thread_states(&ranges, tokens, config.cols);
                let (best, median) = time_runs(config.repetitions, config.min_run_time, || {
                    pool.install(|| {
                        states.par_iter_mut().try_for_each(|s| {
                            let (rows, out, scratch) = (s.rows.clone(), &mut s.out, &mut s.scratch);
                            match format {
                                Format::Mxfp4 => {
                                    kernels.mxfp4_gemm(&weights.mxfp4(0)?, &x, rows, out, scratch)
                                }
                                Format::Mxfp4Tiles => kernels.mxfp4_gemm(
                                    &weights.mxfp4_tiled(0)?,
                                    &x,
                                    rows,
                                    out,
                                    scratch,
                                ),
                                Format::Q8 => {
                                    kernels.q8_gemm(&weights.q8[0], &x, rows, out, scratch)
                                }
                                Format::Q8Tiles => {
                                    kernels.q8_gemm(&weights.q8_tiles[0], &x, rows, out, scratch)
                                }
                                Format::Q4 => {
                                    kernels.q4_gemm(&weights.q4[0], &x, rows, out, scratch)
                                }
                                Format::Q4Tiles => {
                                    kernels.q4_gemm(&weights.q4_tiles[0], &x, rows, out, scratch)
                                }
                            }
                        })
                    })
                })?;
                results.push(result(
                    format!("{}_gemm", format.name()),
                    threads,
                    tokens,
                    format.matrix_bytes(&weights),
                    config,
                    best,
                    median,
                ));
            }
        }
        // Streamed: M tokens against every expert matrix in turn, each thread on its rows of
        // each, through the kernel the forward pass picks for M tokens.
        let stream_layouts: &[bool] = if weights.mxfp4_tiles.is_some() {
            &[false, true]
        } else {
            &[false]
        };
        for (&tokens, &tiled) in config
            .stream_tokens
            .iter()
            .flat_map(|t| stream_layouts.iter().map(move |l| (t, l)))
        {
            let tokens = tokens.max(1);
            let mut x = Q8Activations::with_capacity(tokens, config.cols);
            kernels.quantize_activation_rows(
                &activations[..tokens * config.cols],
                config.cols,
                &mut x,
            )?;
            let mut states = thread_states(&ranges, tokens, config.cols);
            let (best, median) = time_runs(config.repetitions, config.min_run_time, || {
                pool.install(|| {
                    states.par_iter_mut().try_for_each(|s| {
                        let (out, scratch) = (&mut s.out, &mut s.scratch);
                        for e in 0..config.experts {
                            let w = if tiled {
                                weights.mxfp4_tiled(e)?
                            } else {
                                weights.mxfp4(e)?
                            };
                            kernels.mxfp4_product(&w, &x, s.rows.clone(), out, scratch)?;
                        }
                        Ok(())
                    })
                })
            })?;
            results.push(result(
                if tiled {
                    "mxfp4_tiles_stream".to_string()
                } else {
                    "mxfp4_stream".to_string()
                },
                threads,
                tokens,
                Format::Mxfp4.matrix_bytes(&weights) * config.experts,
                config,
                best,
                median,
            ));
        }
        // Measured again after this thread count's kernels, the higher of the two kept: on a
        // shared machine one probe can land in a neighbour's burst, and a low peak would
        // overstate every ratio to it. Each ratio is to the peak of its own thread count.
        let peak = match peak {
            Some(before) => {
                let after = measure_peak(kernels, &pool, config)?;
                Some(if after.gmac_per_s > before.gmac_per_s {
                    after
                } else {
                    before
                })
            }
            None => None,
        };
        for r in &mut results[first_result..] {
            if !r.kernel.ends_with("gemm") && best_read > 0.0 {
                r.bandwidth_fraction = Some(r.best_gb_per_s / best_read);
            }
        }
        if let Some(peak) = peak {
            for r in &mut results[first_result..] {
                if !r.kernel.ends_with("gemv") {
                    r.peak_fraction = Some(r.best_gmac_per_s / peak.gmac_per_s);
                }
            }
            int8_peak.push(peak);
        }
        if let Some(tiles) = tiles {
            for r in &mut results[first_result..] {
                // Fewer rows run on the AVX-512 kernel even on the `amx` path.
                let on_tiles = matches!(r.kernel.as_str(), "mxfp4_tiles_gemm" | "q8_tiles_gemm");
                if on_tiles && r.tokens >= AMX_MIN_ROWS {
                    r.tile_fraction = Some(r.best_gmac_per_s / tiles.gmac_per_s);
                }
            }
            tile_peak.push(tiles);
        }
    }
    Ok(KernelBenchReport {
        path: kernels.path().name().to_string(),
        amx_refusal: kernels.path().refused_amx(),
        gemv_decode: gemv_decode(kernels).to_string(),
        cpu: CpuInfo::current(),
        int8_peak,
        tile_peak,
        read_bandwidth,
        experts: config.experts,
        rows: config.rows,
        cols: config.cols,
        l3_cache_bytes: super::probe::l3_cache_bytes(),
        results,
    })
}

fn thread_states(
    ranges: &[std::ops::Range<usize>],
    tokens: usize,
    cols: usize,
) -> Vec<ThreadState> {
    ranges
        .iter()
        .map(|r| ThreadState {
            rows: r.clone(),
            out: vec![0.0; tokens * r.len()],
            scratch: GemmScratch::new(cols),
        })
        .collect()
}

/// A result for one token; GEMM callers scale the MAC figures by their token count.
fn result(
    kernel: String,
    threads: usize,
    tokens: usize,
    bytes: usize,
    config: &KernelBenchConfig,
    best: f64,
    median: f64,
) -> KernelBenchResult {
    let matrices = if kernel.ends_with("gemv") || kernel.ends_with("stream") {
        config.experts
    } else {
        1
    };
    let macs = matrices * config.rows * config.cols * tokens;
    KernelBenchResult {
        kernel,
        threads,
        tokens,
        weight_bytes: bytes,
        macs,
        best_seconds: best,
        median_seconds: median,
        best_gb_per_s: bytes as f64 / best / 1e9,
        best_gmac_per_s: macs as f64 / best / 1e9,
        peak_fraction: None,
        bandwidth_fraction: None,
        tile_fraction: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(l3_cache_bytes: Option<u64>) -> KernelBenchReport {
        KernelBenchReport {
            path: "avx512".into(),
            gemv_decode: "vpermb".into(),
            cpu: CpuInfo::default(),
            int8_peak: Vec::new(),
            amx_refusal: None,
            tile_peak: Vec::new(),
            read_bandwidth: Vec::new(),
            experts: 32,
            rows: 2880,
            cols: 2880,
            l3_cache_bytes,
            results: Vec::new(),
        }
    }

    #[test]
    fn the_report_warns_where_the_streamed_set_may_sit_in_the_l3() {
        let note = "under 4x this CPU's L3";
        // 32 matrices of 2880 x 2880: 141 MB.
        assert_eq!(report(None).streamed_mxfp4_bytes(), 141_004_800);
        let big_l3 = report(Some(480 << 20)).to_string();
        assert!(
            big_l3.contains("(141 MB of MXFP4) is under 4x this CPU's L3 (480 MiB)"),
            "{big_l3}"
        );
        assert!(!report(Some(32 << 20)).to_string().contains(note));
        assert!(!report(None).to_string().contains(note));
    }

    #[test]
    fn row_splits_cover_every_row_once_on_tile_boundaries() {
        for (rows, threads) in [(2880, 2), (40, 2), (17, 3), (5, 1)] {
            let ranges = split_rows(rows, threads);
            assert_eq!(ranges.len(), threads);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[threads - 1].end, rows);
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
                assert_eq!(pair[0].end % 16, 0);
            }
        }
    }
}
