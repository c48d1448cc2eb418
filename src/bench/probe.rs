//! What the machine can do and what the process uses: memory read bandwidth, peak RSS, CPU name.

use std::time::Instant;

use rayon::prelude::*;

/// Bytes streamed by the bandwidth probe: far larger than any cache.
const PROBE_BYTES: usize = 1 << 30;

/// Memory read bandwidth in GB/s with `threads` readers: the median of several passes over a
/// 1 GiB buffer, each thread summing its own contiguous part (the access pattern of a GEMV). The
/// median, not the best: on a shared VM a lucky pass overstates what decode can count on.
pub fn read_bandwidth_gbps(threads: usize) -> f64 {
    let words = PROBE_BYTES / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let pool = match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
    {
        Ok(pool) => pool,
        Err(_) => return 0.0,
    };
    let part = words.div_ceil(threads.max(1));
    let mut seconds = Vec::with_capacity(5);
    for _ in 0..5 {
        let started = Instant::now();
        let total: u64 = pool.install(|| {
            buffer
                .par_chunks(part)
                .map(|chunk| {
                    // Eight independent lanes so the sum is not one dependent chain.
                    let mut lanes = [0u64; 8];
                    for block in chunk.chunks_exact(8) {
                        for (lane, &w) in lanes.iter_mut().zip(block) {
                            *lane = lane.wrapping_add(w);
                        }
                    }
                    lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
                .reduce(|| 0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        seconds.push(started.elapsed().as_secs_f64());
    }
    PROBE_BYTES as f64 / super::stats::Summary::of(&seconds).median / 1e9
}

/// Peak resident set size of this process (VmHWM), in bytes; 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    crate::engine::worker::kib_field_bytes(&status, "VmHWM:").unwrap_or(0)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_memory_is_at_least_the_current() {
        let rss = crate::engine::worker::read_memory_usage()
            .process_bytes
            .unwrap_or(0);
        assert!(rss > 0 && peak_rss_bytes() >= rss);
    }
}
