//! What the machine can do and what the process uses: memory read bandwidth, peak RSS, CPU name.

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;

/// Bytes streamed by the bandwidth probe: far larger than any cache.
const PROBE_BYTES: usize = 1 << 30;

/// Memory read bandwidth in GB/s with `threads` readers: the median of several passes over a
/// buffer of at least 1 GiB ([`beyond_l3`]), each thread summing its own contiguous part (the
/// access pattern of a GEMV). The median, not the best: on a shared VM a lucky pass overstates
/// what decode can count on.
pub fn read_bandwidth_gbps(threads: usize) -> f64 {
    read_bandwidth_gbps_over(beyond_l3(PROBE_BYTES), threads)
}

/// Bytes of the probe `bench` runs right after each decode measurement, at least: 8 times a 32
/// MiB L3, and a few tens of milliseconds of reading, so it rates the host's bandwidth of that
/// moment. [`paired_probe_bytes`] grows it past a larger L3.
pub const PAIRED_PROBE_BYTES: usize = 256 << 20;

/// Most bytes a probe grows to for a large L3: 2 GiB is read in well under a second.
const MOST_PROBE_BYTES: usize = 2 << 30;

/// `least` bytes, or four times the L3 where that is more (at most [`MOST_PROBE_BYTES`]): a
/// probe the L3 holds in good part reads faster than the weights ever stream. The Xeon guest
/// with AMX reports a 480 MiB L3 (the host's, shared with its other guests); there a plain read
/// over 256 MiB on huge pages ran 31-33 GB/s against 28-29.5 over 2 GiB in the same minutes.
pub fn beyond_l3(least: usize) -> usize {
    beyond(least, l3_cache_bytes())
}

/// [`beyond_l3`] for an L3 of `l3` bytes (`None`: no L3 reported).
fn beyond(least: usize, l3: Option<u64>) -> usize {
    let l3 = l3.map_or(0, |b| usize::try_from(b).unwrap_or(usize::MAX));
    least.max(l3.saturating_mul(4).min(MOST_PROBE_BYTES))
}

/// The probe run after each decode measurement: [`PAIRED_PROBE_BYTES`] beyond the L3.
pub fn paired_probe_bytes() -> usize {
    beyond_l3(PAIRED_PROBE_BYTES)
}

/// The median over runs of each run's share of the read bandwidth probed right after it: run
/// `i` decoded `rates[i]` tokens/s of `bytes_per_token` bytes each against `probes[i]` GB/s. On a
/// shared host both drift over minutes, so a single probe after all runs could read a moment
/// none of them saw; a failed probe (0 GB/s) is left out, not divided by.
pub fn median_roofline_share(rates: &[f64], probes: &[f64], bytes_per_token: u64) -> f64 {
    let shares: Vec<f64> = rates
        .iter()
        .zip(probes)
        .filter(|(_, &gbps)| gbps > 0.0)
        .map(|(&rate, &gbps)| rate * bytes_per_token as f64 / (gbps * 1e9))
        .collect();
    super::stats::Summary::of(&shares).median
}

/// Starts the peak RSS (`VmHWM`) again from the current RSS (`5` to /proc/self/clear_refs,
/// Linux 4.0 on), so a probe's buffer, freed again, does not count as the model's memory.
/// False where the kernel refuses.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// `len` bytes of 1 (every page mapped) in memory backed as the model's weights are: 64-byte aligned, on
/// transparent huge pages where the kernel gives them (advised before the first touch and
/// collapsed after, as the loader does). A probe over 4 KiB pages reads what the weights never
/// see: on the Xeon guest with AMX (a VM, where a TLB miss walks the guest's and the host's
/// page tables) `bench --kernels`'s 512-bit read loop streamed 19.7 / 21.8 GB/s (medians, two
/// threads) over 4 KiB pages against 28.3 / 28.3 over huge pages, builds alternating, so a
/// roofline probed the old way rated decode against about three quarters of the bandwidth its
/// weights had.
fn weight_like_buffer(len: usize) -> crate::kernels::AlignedVec<u8> {
    let buffer = crate::kernels::AlignedVec::filled(len, 1u8);
    buffer.collapse_huge_pages();
    buffer
}

/// The read bandwidth `bench` pairs with each decode measurement: [`paired_probe_bytes`] of
/// `model`'s own expert weights read as
/// [`read_bandwidth_gbps_over`] reads its buffer, where the model has that many (else that probe
/// over a [`PAIRED_PROBE_BYTES`] buffer). The weights' own pages are what decode streams, and
/// reading them allocates nothing: a probe buffer of gigabytes, faulted in and
/// freed between runs, left the next runs' prefill slower on the Xeon guest (58-token prefill
/// 12-24% below a build without it in three alternations, likely the kernel's huge page
/// housekeeping after the free).
pub fn paired_read_bandwidth(model: &crate::model::Model, threads: usize) -> f64 {
    let want = paired_probe_bytes();
    let mut regions = Vec::new();
    let mut total = 0;
    for region in model.expert_bytes() {
        if total >= want {
            break;
        }
        let take = region.len().min(want - total);
        regions.push(&region[..take]);
        total += take;
    }
    if total < want {
        // A model this small decodes from the caches: its roofline is nominal, so the probe
        // stays at the least size rather than faulting in gigabytes for it.
        return read_bandwidth_gbps_over(PAIRED_PROBE_BYTES, threads);
    }
    read_bandwidth_of(&regions, threads)
}

/// Read bandwidth in GB/s of `threads` readers over `regions`, each thread summing its own
/// contiguous part of every region: the median of five passes, as [`read_bandwidth_gbps_over`].
fn read_bandwidth_of(regions: &[&[u8]], threads: usize) -> f64 {
    let pool = match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
    {
        Ok(pool) => pool,
        Err(_) => return 0.0,
    };
    // SAFETY: every bit pattern is a valid u64; `align_to` only reinterprets the aligned middle.
    let words: Vec<&[u64]> = regions
        .iter()
        .map(|region| unsafe { region.align_to::<u64>().1 })
        .collect();
    let bytes: usize = words.iter().map(|w| w.len() * 8).sum();
    let mut seconds = Vec::with_capacity(5);
    for _ in 0..5 {
        let started = Instant::now();
        let total: u64 = pool.install(|| {
            words
                .iter()
                .map(|region| {
                    let part = region.len().div_ceil(threads.max(1)).max(1);
                    region
                        .par_chunks(part)
                        .map(sum_words)
                        .reduce(|| 0, u64::wrapping_add)
                })
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        seconds.push(started.elapsed().as_secs_f64());
    }
    bytes as f64 / super::stats::Summary::of(&seconds).median / 1e9
}

/// The sum of `chunk` in eight independent lanes, so it is not one dependent chain.
fn sum_words(chunk: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    for block in chunk.chunks_exact(8) {
        for (lane, &w) in lanes.iter_mut().zip(block) {
            *lane = lane.wrapping_add(w);
        }
    }
    lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// [`read_bandwidth_gbps`] over a buffer of `bytes` (rounded to whole 64-byte lines), for a
/// caller that cannot spare a GiB (the app's engine view).
pub fn read_bandwidth_gbps_over(bytes: usize, threads: usize) -> f64 {
    let buffer = weight_like_buffer((bytes / 64).max(1) * 64);
    read_bandwidth_of(&[&buffer[..]], threads)
}

/// Sums `bytes` (a multiple of 256, 64-byte aligned) with 512-bit loads into four independent
/// accumulators: the plainest way one core can stream memory, which the GEMVs are measured
/// against (`bench --kernels`).
///
/// # Safety
/// The CPU has AVX-512 F; `start..start + bytes` is readable and 64-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_lines_avx512(start: *const u8, bytes: usize) -> u64 {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees the range is readable and aligned, and the CPU's features.
    unsafe {
        let mut acc = [_mm512_setzero_si512(); 4];
        let mut at = 0;
        while at + 256 <= bytes {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_add_epi64(*acc, _mm512_load_si512(start.add(at + 64 * k).cast()));
            }
            at += 256;
        }
        let sum = _mm512_add_epi64(
            _mm512_add_epi64(acc[0], acc[1]),
            _mm512_add_epi64(acc[2], acc[3]),
        );
        _mm512_reduce_add_epi64(sum) as u64
    }
}

/// As [`sum_lines_avx512`] with 256-bit loads, for CPUs without AVX-512.
///
/// # Safety
/// The CPU has AVX2; `start..start + bytes` is readable and 32-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_lines_avx2(start: *const u8, bytes: usize) -> u64 {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees the range is readable and aligned, and the CPU's features.
    unsafe {
        let mut acc = [_mm256_setzero_si256(); 4];
        let mut at = 0;
        while at + 128 <= bytes {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_add_epi64(*acc, _mm256_load_si256(start.add(at + 32 * k).cast()));
            }
            at += 128;
        }
        let mut lanes = [0u64; 4];
        let sum = _mm256_add_epi64(
            _mm256_add_epi64(acc[0], acc[1]),
            _mm256_add_epi64(acc[2], acc[3]),
        );
        _mm256_storeu_si256(lanes.as_mut_ptr().cast(), sum);
        lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
    }
}

/// Sums a 64-byte-aligned slice with the widest loads the kernel path uses.
fn sum_lines(path: crate::kernels::KernelPath, lines: &[u8]) -> u64 {
    use crate::kernels::KernelPath;
    debug_assert!((lines.as_ptr() as usize).is_multiple_of(64) && lines.len().is_multiple_of(256));
    match path {
        // SAFETY: a Kernels value holds AVX-512 or AVX2 only after detecting them (the AVX-512
        // path needs AVX-512 F among its features); the slice is readable, and aligned as the
        // callers in this module make it.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Amx => unsafe {
            sum_lines_avx512(lines.as_ptr(), lines.len())
        },
        // SAFETY: as above, for AVX2.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx2Vnni => unsafe {
            sum_lines_avx2(lines.as_ptr(), lines.len())
        },
        _ => lines
            .chunks_exact(8)
            .fold(0u64, |a, w| a.wrapping_add(w[0] as u64 + w[7] as u64)),
    }
}

/// Memory read bandwidth of `kernels`' widest plain loads on every thread of `pool` at once,
/// each thread reading its own contiguous part of a `bytes` buffer (rounded to whole 256-byte
/// steps per thread): (best, median) GB/s over `repetitions` passes. This is what a GEMV on the
/// same threads can at most stream, so `bench --kernels` prints each GEMV as a fraction of it.
pub fn simd_read_bandwidth_gbps(
    kernels: crate::kernels::Kernels,
    pool: &rayon::ThreadPool,
    bytes: usize,
    repetitions: usize,
) -> (f64, f64) {
    let threads = pool.current_num_threads().max(1);
    let part = (bytes / threads / 256).max(1) * 256;
    let buffer = weight_like_buffer(part * threads);
    let lines = &buffer[..];
    let path = kernels.path();
    let mut seconds = Vec::with_capacity(repetitions.max(1));
    // One untimed pass first: the pages are touched, the threads awake.
    for pass in 0..=repetitions.max(1) {
        let started = Instant::now();
        pool.broadcast(|ctx| {
            let own = &lines[ctx.index() * part..(ctx.index() + 1) * part];
            std::hint::black_box(sum_lines(path, own));
        });
        if pass > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    let summary = super::stats::Summary::of(&seconds);
    let gbps = |s: f64| (part * threads) as f64 / s / 1e9;
    (gbps(summary.min), gbps(summary.median))
}

/// Peak resident set size of this process (VmHWM), in bytes; 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    crate::engine::worker::kib_field_bytes(&status, "VmHWM:").unwrap_or(0)
}

/// CPU flags that decide which kernels run and how fast: the vector and int8/bf16 dot-product
/// extensions and AMX, named as /proc/cpuinfo names them (`avx512vbmi` has no underscore, unlike
/// its successor `avx512_vbmi2`).
pub const RELEVANT_FLAGS: [&str; 16] = [
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx512_bf16",
    "avx512_fp16",
    "gfni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
];

/// The CPU a report was measured on: model name, family/model numbers (which tell e.g. Zen 4 from
/// Zen 5 where the name does not) and the relevant flags it has.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CpuInfo {
    pub name: String,
    pub family: Option<u32>,
    pub model: Option<u32>,
    pub flags: Vec<String>,
}

impl CpuInfo {
    /// Parses the first processor of /proc/cpuinfo text.
    pub fn parse(cpuinfo: &str) -> Self {
        let field = |key: &str| {
            cpuinfo
                .lines()
                .find(|line| line.split(':').next().map(str::trim) == Some(key))
                .and_then(|line| line.split_once(':'))
                .map(|(_, value)| value.trim().to_owned())
        };
        let present: Vec<&str> = field("flags")
            .map(|f| f.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .unwrap_or_default()
            .iter()
            .filter_map(|f| RELEVANT_FLAGS.iter().find(|r| **r == f).copied())
            .collect();
        CpuInfo {
            name: field("model name").unwrap_or_else(|| std::env::consts::ARCH.to_owned()),
            family: field("cpu family").and_then(|v| v.parse().ok()),
            model: field("model").and_then(|v| v.parse().ok()),
            // In RELEVANT_FLAGS' order, so reports compare line by line.
            flags: RELEVANT_FLAGS
                .iter()
                .filter(|r| present.contains(r))
                .map(|r| (*r).to_owned())
                .collect(),
        }
    }

    /// This machine's CPU; the architecture name alone where /proc is unavailable.
    pub fn current() -> Self {
        Self::parse(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
    }
}

impl std::fmt::Display for CpuInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)?;
        if let (Some(family), Some(model)) = (self.family, self.model) {
            write!(f, " (family {family} model {model})")?;
        }
        if self.flags.is_empty() {
            write!(f, "; none of the SIMD flags the kernels use")
        } else {
            write!(f, "; {}", self.flags.join(" "))
        }
    }
}

/// Bytes of a cache size as sysfs writes it (`32768K`, `480M`, `1G`, or plain bytes).
pub fn parse_cache_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let scale: u64 = match unit.trim() {
        "" => 1,
        "K" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// The last-level (level 3) cache the first CPU reports in sysfs, in bytes; `None` where there
/// is none or no sysfs.
pub fn l3_cache_bytes() -> Option<u64> {
    let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    caches.flatten().find_map(|entry| {
        let level = std::fs::read_to_string(entry.path().join("level")).ok()?;
        if level.trim() != "3" {
            return None;
        }
        parse_cache_size(&std::fs::read_to_string(entry.path().join("size")).ok()?)
    })
}

/// The CPU's model name, for the record.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

/// The share of `path`'s pages in the page cache (mincore over a mapping of it), `None` when it
/// cannot be asked.
#[cfg(target_os = "linux")]
pub fn resident_share(path: &Path) -> Option<f64> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: read-only private mapping of a file nobody truncates while this runs (a model
    // file or the benchmark's own snapshot); mincore reads no byte of it.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let pages = map.len().div_ceil(page);
    let mut flags = vec![0u8; pages];
    // SAFETY: the range is the mapping, `flags` has one byte per page.
    let code = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            flags.as_mut_ptr(),
        )
    };
    if code != 0 || pages == 0 {
        return None;
    }
    Some(flags.iter().filter(|f| *f & 1 == 1).count() as f64 / pages as f64)
}

#[cfg(not(target_os = "linux"))]
pub fn resident_share(_: &Path) -> Option<f64> {
    None
}

/// The share of a model's weight files that is in the page cache, weighted by their sizes: the
/// `.safetensors` shards of a checkpoint directory, or the one file named (a GGUF). `None` when
/// there is no such file or the system cannot say.
pub fn model_resident_share(path: &Path) -> Option<f64> {
    let files: Vec<std::path::PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .ok()?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    } else if path.is_file() {
        vec![path.to_path_buf()]
    } else {
        return None;
    };
    let (mut resident, mut total) = (0.0, 0.0);
    for file in &files {
        let bytes = std::fs::metadata(file).ok()?.len() as f64;
        resident += resident_share(file)? * bytes;
        total += bytes;
    }
    (total > 0.0).then(|| resident / total)
}

#[cfg(test)]
mod tests {
    #[test]
    fn probes_grow_past_a_large_l3_within_bounds() {
        assert_eq!(beyond(256 << 20, None), 256 << 20);
        assert_eq!(beyond(256 << 20, Some(32 << 20)), 256 << 20);
        assert_eq!(beyond(256 << 20, Some(480 << 20)), 1920 << 20);
        assert_eq!(beyond(256 << 20, Some(u64::MAX)), MOST_PROBE_BYTES);
        assert_eq!(beyond(4 << 30, Some(480 << 20)), 4 << 30);
    }

    #[test]
    fn reads_regions_of_any_alignment_and_length() {
        let bytes = vec![3u8; (1 << 20) + 77];
        let regions = [&bytes[5..], &bytes[..0], &bytes[1..2], &bytes[64..4160]];
        for threads in [1, 2, 3] {
            let gbps = read_bandwidth_of(&regions, threads);
            assert!(gbps.is_finite() && gbps > 0.0, "{threads} threads: {gbps}");
        }
        assert_eq!(read_bandwidth_of(&[], 2), 0.0);
    }

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(super::parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(super::parse_cache_size("480M"), Some(480 << 20));
        assert_eq!(super::parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(super::parse_cache_size("4096"), Some(4096));
        assert_eq!(super::parse_cache_size("12X"), None);
        assert_eq!(super::parse_cache_size(""), None);
        assert_eq!(super::parse_cache_size("99999999999999999999K"), None);
    }

    use super::*;

    #[test]
    fn a_file_just_written_is_in_the_page_cache_and_a_missing_one_says_none() {
        let dir = tempfile::tempdir().unwrap();
        let shard = dir.path().join("model-00001-of-00001.safetensors");
        std::fs::write(&shard, vec![7u8; 1 << 20]).unwrap();
        std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
        // Pages written a moment ago are cached (dirty or clean) on any machine not out of memory.
        let share = model_resident_share(dir.path()).expect("linux answers");
        assert!(share > 0.99, "{share}");
        assert_eq!(model_resident_share(&dir.path().join("absent")), None);
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(model_resident_share(empty.path()), None);
    }

    #[test]
    fn each_run_is_rated_against_the_probe_after_it() {
        // 2 GB a token: runs at 10, 12 and 14 tokens/s after probes of 40, 20 and 30 GB/s move
        // 50%, 120% and 93% of them; the median rate over the median probe would say 80%.
        let share = median_roofline_share(&[10.0, 12.0, 14.0], &[40.0, 20.0, 30.0], 2_000_000_000);
        assert!((share - 14.0 * 2.0 / 30.0).abs() < 1e-12, "{share}");
        // A failed probe is left out, not divided by.
        let share = median_roofline_share(&[10.0, 12.0], &[0.0, 24.0], 2_000_000_000);
        assert!((share - 1.0).abs() < 1e-12, "{share}");
    }

    #[test]
    fn cpu_info_keeps_the_relevant_flags_in_a_fixed_order() {
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\
                    model name\t: AMD EPYC\nflags\t\t: fpu avx512_vnni sse avx2 avx512f fma \
                    avx512vbmi\n\nprocessor\t: 1\nmodel name\t: other\n";
        let info = CpuInfo::parse(text);
        assert_eq!(info.name, "AMD EPYC");
        assert_eq!((info.family, info.model), (Some(26), Some(2)));
        assert_eq!(
            info.flags,
            ["avx2", "fma", "avx512f", "avx512_vnni", "avx512vbmi"]
        );
        assert_eq!(
            info.to_string(),
            "AMD EPYC (family 26 model 2); avx2 fma avx512f avx512_vnni avx512vbmi"
        );
        let bare = CpuInfo::parse("");
        assert!(bare.flags.is_empty() && bare.family.is_none());
        assert!(bare.to_string().contains("none of the SIMD flags"));
    }

    #[test]
    fn peak_memory_is_at_least_the_current() {
        let rss = crate::engine::worker::read_memory_usage()
            .process_bytes
            .unwrap_or(0);
        assert!(rss > 0 && peak_rss_bytes() >= rss);
    }
}
