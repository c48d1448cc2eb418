use std::time::Duration;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tokens: Vec<usize> = args
        .get(1)
        .map(|s| s.split(',').map(|t| t.parse().unwrap()).collect())
        .unwrap_or(vec![16, 64, 128]);
    let threads: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').map(|t| t.parse().unwrap()).collect())
        .unwrap_or(vec![1, 2]);
    let config = ossterm::bench::kernels::KernelBenchConfig {
        experts: 1,
        rows: 2880,
        cols: 2880,
        thread_counts: threads,
        gemm_tokens: tokens,
        repetitions: 9,
        min_run_time: Duration::from_millis(30),
    };
    let r =
        ossterm::bench::kernels::run_kernel_bench(ossterm::kernels::kernels(), &config).unwrap();
    for p in &r.int8_peak {
        println!("peak {} thr {:.0}", p.threads, p.gmac_per_s);
    }
    for x in r.results.iter() {
        println!(
            "{:<11} {} M={:<4} {:>6.1} GMAC/s {:>4.0}%",
            x.kernel,
            x.threads,
            x.tokens,
            x.best_gmac_per_s,
            100.0 * x.peak_fraction.unwrap_or(0.0)
        );
    }
}
