//! The bench's paired bandwidth probes free their buffer and restart the peak RSS, so the
//! reported peak stays the model's. Alone in its process: other tests' allocations would move
//! the figures.

use ossterm::bench::probe::{peak_rss_bytes, reset_peak_rss};

#[test]
fn a_reset_peak_rss_forgets_a_freed_buffer() {
    const BUFFER: usize = 256 << 20;
    let buffer: Vec<u8> = std::hint::black_box(vec![1u8; BUFFER]);
    std::hint::black_box(buffer.iter().step_by(4096).map(|&b| b as u64).sum::<u64>());
    let with_buffer = peak_rss_bytes();
    assert!(
        with_buffer >= BUFFER as u64,
        "the peak RSS ({with_buffer} bytes) holds the touched buffer"
    );
    drop(buffer);
    // Within the slack of the kernel's per-CPU RSS counters (kilobytes).
    let kept = peak_rss_bytes();
    assert!(
        kept + (1 << 20) >= with_buffer,
        "a peak stays after the free ({kept} against {with_buffer} bytes)"
    );
    assert!(
        reset_peak_rss(),
        "/proc/self/clear_refs takes 5 (Linux 4.0 on)"
    );
    let after = peak_rss_bytes();
    assert!(
        after + (BUFFER as u64) / 2 <= with_buffer,
        "after the reset the peak ({after} bytes) no longer counts the freed buffer (peak with \
         it {with_buffer})"
    );
}
