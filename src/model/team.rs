//! A team of pool threads that stay awake for one short forward pass.
//!
//! Decoding one token runs about 100 parallel regions (four matrix products per layer, attention,
//! the unembedding), each a fraction of a millisecond long, separated by a few microseconds of
//! serial work (norms, routing, quantizing activations). Through rayon, the other threads go to
//! sleep between regions and are woken for the next one: on this kind of VM that is about one
//! context switch per region, and the woken thread starts late. A team instead borrows the pool's
//! other threads once per forward pass (one `rayon::join` each, no allocation) and keeps them
//! spinning on an atomic word between regions; the leader (the calling thread) publishes each
//! region's tasks there and works on them too. On the synthetic 20b, with tokens alternating
//! between the two ways in one process (so the VM's drifting memory bandwidth hits both alike),
//! every run decoded faster with the team.
//!
//! Protocol: one 64-bit word holds (region number, first unclaimed task, one past the last
//! unclaimed task). A member claims a task by a compare-and-swap that moves one end inward within
//! the same region number, so a member with a stale view can never claim a task of another
//! region. The task closure is read only after
//! a successful claim, and the leader replaces it only after every task of the region has
//! completed, so a claimed task always sees its own region's closure.

use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use rayon::prelude::*;
use rayon::ThreadPool;

/// A region's work: task `i` for every `i` below the count.
type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// Tasks per region a team can publish at once (the count's width in the claim word).
const MAX_TASKS: usize = u16::MAX as usize;

fn pack(region: u32, front: usize, back: usize) -> u64 {
    ((region as u64) << 32) | ((back as u64) << 16) | front as u64
}

/// One past the last unclaimed task.
fn back_of(word: u64) -> usize {
    ((word >> 16) & 0xFFFF) as usize
}

/// The first unclaimed task.
fn front_of(word: u64) -> usize {
    (word & 0xFFFF) as usize
}

fn region_of(word: u64) -> u32 {
    (word >> 32) as u32
}

/// Which end of a region's task range a member claims from: the leader walks up from the first
/// task and the helpers down from the last, so each streams adjacent weight rows (tasks are
/// consecutive row ranges), as rayon's halving split did.
#[derive(Clone, Copy)]
enum End {
    Front,
    Back,
}

/// See the module doc.
pub struct Team {
    claim: AtomicU64,
    completed: AtomicUsize,
    /// The current region's closure, its lifetime erased; valid while a task of the region is
    /// claimed and not completed (see `for_each`).
    task: UnsafeCell<Option<Task<'static>>>,
    /// Set when a task panicked; the leader re-raises the panic once the region is complete.
    panicked: AtomicBool,
    /// Set when the leader's work is done: helpers return to the pool.
    done: AtomicBool,
}

// SAFETY: `task` is written only by the leader, before publishing a region (release store of
// `claim`) and after all its tasks completed (acquire load of `completed`); helpers read it only
// after claiming a task of that region (acquire CAS on `claim`), which the leader's next write
// waits for. Everything else is atomic.
unsafe impl Sync for Team {}

impl Team {
    fn new() -> Self {
        Self {
            claim: AtomicU64::new(0),
            completed: AtomicUsize::new(0),
            task: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            done: AtomicBool::new(false),
        }
    }

    /// Runs `task(i)` for `i` in `0..count` on the team and returns when all have finished.
    /// Called by the leader only (the thread that runs `with_team`'s work).
    pub fn for_each(&self, count: usize, task: &(dyn Fn(usize) + Sync)) {
        let mut first = 0;
        while first < count {
            let batch = (count - first).min(MAX_TASKS);
            if batch == 1 {
                task(first);
            } else {
                let offset = move |i: usize| task(first + i);
                self.region(batch, &offset);
            }
            first += batch;
        }
    }

    fn region(&self, count: usize, task: Task<'_>) {
        stats::REGIONS.fetch_add(1, Ordering::Relaxed);
        if contention::solo() {
            stats::SOLO_REGIONS.fetch_add(1, Ordering::Relaxed);
            (0..count).for_each(task);
            return;
        }
        // SAFETY: only the lifetime is erased. No helper reads the closure after this region's
        // last task completes, and this function does not return before that (see `Sync`).
        let erased: Task<'static> = unsafe { std::mem::transmute(task) };
        // SAFETY: no task of the previous region is running (it completed before `region`
        // returned), so no helper reads `task` now; see `Sync`.
        unsafe { *self.task.get() = Some(erased) };
        self.completed.store(0, Ordering::Relaxed);
        let region = region_of(self.claim.load(Ordering::Relaxed)).wrapping_add(1);
        let start = Instant::now();
        self.claim.store(pack(region, 0, count), Ordering::Release);
        let mut own = 0u32;
        while let Some(i) = self.claim_task(region, End::Front) {
            self.run_claimed(i);
            own += 1;
        }
        if self.completed.load(Ordering::Acquire) < count {
            // A helper still runs a task. Normally it ends within about one task's time; far
            // longer means its core was taken by another process (see `contention`).
            let waiting = Instant::now();
            let limit = contention::stall_limit(waiting - start, own);
            let mut idle = Idle::default();
            let mut checks = 0u32;
            let mut stalled = false;
            while self.completed.load(Ordering::Acquire) < count {
                idle.wait();
                checks = checks.wrapping_add(1);
                // Once the wait yields the core, each check may come a scheduler slice after the
                // last (a busy machine), so the clock is read on every one: reading it only every
                // 64th check could notice a stall hundreds of milliseconds late, or never.
                if (checks.is_multiple_of(64) || idle.yielding()) && waiting.elapsed() > limit {
                    contention::go_solo();
                    checks = 1;
                    if !stalled {
                        stalled = true;
                        stats::STALLS.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            stats::WAIT_NANOS.fetch_add(waiting.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        if self.panicked.load(Ordering::Relaxed) {
            panic!("a task of the forward pass panicked on a team thread");
        }
    }

    /// Claims the next task of `region` from one end, if one is left.
    fn claim_task(&self, region: u32, end: End) -> Option<usize> {
        let mut word = self.claim.load(Ordering::Acquire);
        loop {
            let (front, back) = (front_of(word), back_of(word));
            if region_of(word) != region || front >= back {
                return None;
            }
            let (claimed, next) = match end {
                End::Front => (front, pack(region, front + 1, back)),
                End::Back => (back - 1, pack(region, front, back - 1)),
            };
            match self
                .claim
                .compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(claimed),
                Err(now) => word = now,
            }
        }
    }

    /// Runs a claimed task; a panic is recorded rather than unwound, so that the region's
    /// closure is not dropped (and helpers are not left spinning) while other tasks still run.
    fn run_claimed(&self, i: usize) {
        // SAFETY: a task of the current region is claimed and not completed, so the closure
        // stays valid until `completed` is incremented below (see `Sync`).
        let task = unsafe { (*self.task.get()).expect("a claimed region has its task") };
        if panic::catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
        self.completed.fetch_add(1, Ordering::Release);
    }

    /// A helper's loop: claim and run tasks of whatever region is published, until the leader
    /// is done.
    fn help(&self) {
        let mut idle = Idle::default();
        while !self.done.load(Ordering::Acquire) {
            let word = self.claim.load(Ordering::Acquire);
            match self.claim_task(region_of(word), End::Back) {
                Some(i) => {
                    self.run_claimed(i);
                    idle = Idle::default();
                }
                // While the leader works alone, sleep rather than compete with whatever took
                // the cores; the sleep is short so the helper is back soon after.
                None if idle.yielding() && contention::solo() => {
                    std::thread::sleep(contention::HELPER_NAP)
                }
                None => idle.wait(),
            }
        }
    }
}

/// Decode on a machine whose cores other processes also want. A region's tasks are claimed as
/// they go, so a helper that is merely slow costs nothing; but a helper descheduled in the middle
/// of a task holds that task for a whole scheduler slice (milliseconds, where a decode region
/// lasts a fraction of one), and the leader waits for it. With one busy neighbour on 2 cores,
/// decode fell from 16.6 to 4.7 tokens/s that way. When the leader sees such a stall, the team
/// works on the leader alone for a while (helpers sleep) and then tries again: one thread
/// reads most of the machine's bandwidth, so this costs far less than the stalls. The state is
/// process-wide because contention is a property of the machine, not of one forward pass.
mod contention {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    /// How long the leader works alone after a stall before it tries the team again: from
    /// `SHORTEST_SOLO`, doubled up to `LONGEST_SOLO` each time a stall follows the end of the
    /// last period within one period (lasting contention: a try costs about one stall, a few
    /// ms, per period), back to the shortest after a quiet while. On a VM whose vCPUs are
    /// merely paused now and then for a few ms, a fixed 250 ms had a fifth to a third of a
    /// decode's regions run alone (`bench --profile`, Zen 4 guest, nothing else running).
    const SHORTEST_SOLO: Duration = Duration::from_millis(16);
    const LONGEST_SOLO: Duration = Duration::from_millis(256);
    /// A helper's sleep while the leader works alone.
    pub(super) const HELPER_NAP: Duration = Duration::from_micros(200);
    /// The least wait that counts as a stall: well above the imbalance of a quiet machine's
    /// regions, well below a scheduler slice.
    pub(super) const MIN_STALL: Duration = Duration::from_micros(400);

    static EPOCH: OnceLock<Instant> = OnceLock::new();
    /// Microseconds since `EPOCH` until which teams work on their leader alone.
    static SOLO_UNTIL: AtomicU64 = AtomicU64::new(0);
    /// The current solo period in microseconds (0 before the first stall).
    static SOLO_PERIOD: AtomicU64 = AtomicU64::new(0);

    pub(super) fn now_micros() -> u64 {
        EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
    }

    /// The end of the current or last solo period, in microseconds since the epoch of
    /// [`now_micros`].
    #[cfg(test)]
    pub(super) fn solo_until_micros() -> u64 {
        SOLO_UNTIL.load(Ordering::Relaxed)
    }

    /// Whether teams currently work on their leader alone.
    pub(super) fn solo() -> bool {
        let until = SOLO_UNTIL.load(Ordering::Relaxed);
        until != 0 && now_micros() < until
    }

    /// Starts (or extends) a period of working alone.
    pub(super) fn go_solo() {
        let now = now_micros();
        let period = next_period(
            now,
            SOLO_UNTIL.load(Ordering::Relaxed),
            SOLO_PERIOD.load(Ordering::Relaxed),
        );
        SOLO_PERIOD.store(period, Ordering::Relaxed);
        SOLO_UNTIL.fetch_max(now + period, Ordering::Relaxed);
    }

    /// The solo period (microseconds) a stall at `now` starts, given the end of the last
    /// period `until` (0: none yet) and its length `period`: the same while it lasts (a long
    /// wait reports its stall more than once), twice as long when the stall comes within one
    /// period of its end, the shortest otherwise.
    pub(super) fn next_period(now: u64, until: u64, period: u64) -> u64 {
        let (shortest, longest) = (
            SHORTEST_SOLO.as_micros() as u64,
            LONGEST_SOLO.as_micros() as u64,
        );
        if until == 0 || period == 0 {
            shortest
        } else if now < until {
            period
        } else if now - until < period {
            (2 * period).min(longest)
        } else {
            shortest
        }
    }

    /// How long the leader may wait for a helper's last task before calling it a stall, given
    /// it ran `own` tasks itself in `busy`: a few of its own tasks' length, at least `MIN_STALL`.
    pub(super) fn stall_limit(busy: Duration, own: u32) -> Duration {
        (busy / own.max(1)) * 4 + MIN_STALL
    }
}

/// Process-wide counts of what teams did, for `bench --profile`: how often the leader waited for
/// a helper's last task, how long, and how often it worked alone (see `contention`).
mod stats {
    use std::sync::atomic::AtomicU64;

    pub(super) static REGIONS: AtomicU64 = AtomicU64::new(0);
    pub(super) static SOLO_REGIONS: AtomicU64 = AtomicU64::new(0);
    pub(super) static STALLS: AtomicU64 = AtomicU64::new(0);
    pub(super) static WAIT_NANOS: AtomicU64 = AtomicU64::new(0);
}

/// Totals of every team in this process since it started: see [`team_stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TeamStats {
    /// Parallel regions published (one per `for_each` batch of more than one task).
    pub regions: u64,
    /// Of those, regions the leader ran alone because a stall had been seen shortly before.
    pub solo_regions: u64,
    /// Regions in which the leader saw a stall (a helper's last task far past the limit); each
    /// started or extended a period of working alone.
    pub stalls: u64,
    /// Time leaders spent waiting for a helper's last task of a region.
    pub wait_nanos: u64,
}

impl TeamStats {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &TeamStats) -> TeamStats {
        TeamStats {
            regions: self.regions - earlier.regions,
            solo_regions: self.solo_regions - earlier.solo_regions,
            stalls: self.stalls - earlier.stalls,
            wait_nanos: self.wait_nanos - earlier.wait_nanos,
        }
    }
}

/// The process's team totals so far (relaxed counters: exact once the teams are idle).
pub fn team_stats() -> TeamStats {
    TeamStats {
        regions: stats::REGIONS.load(Ordering::Relaxed),
        solo_regions: stats::SOLO_REGIONS.load(Ordering::Relaxed),
        stalls: stats::STALLS.load(Ordering::Relaxed),
        wait_nanos: stats::WAIT_NANOS.load(Ordering::Relaxed),
    }
}

/// Waiting without work: spin for the few microseconds between regions, then yield the core on
/// every further check, so that with more threads than cores (`--threads` above the core count)
/// a spinning member does not hold a core its leader or a preempted member needs.
#[derive(Default)]
struct Idle {
    spins: u32,
}

impl Idle {
    const SPINS_BEFORE_YIELDING: u32 = 1 << 12;

    /// Whether the spinning phase is over.
    fn yielding(&self) -> bool {
        self.spins >= Self::SPINS_BEFORE_YIELDING
    }

    fn wait(&mut self) {
        if self.spins < Self::SPINS_BEFORE_YIELDING {
            self.spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Sets `done` when the leader's work ends, by return or by panic.
struct DoneOnDrop<'a>(&'a Team);

impl Drop for DoneOnDrop<'_> {
    fn drop(&mut self) {
        self.0.done.store(true, Ordering::Release);
    }
}

/// Runs `work` on a thread of `pool` with a team made of the pool's other threads, or with `None`
/// when the pool has one thread (then parallel loops go through rayon as usual).
pub fn with_team<R: Send>(pool: &ThreadPool, work: impl FnOnce(Option<&Team>) -> R + Send) -> R {
    pool.install(|| {
        let helpers = pool.current_num_threads().saturating_sub(1);
        if helpers == 0 {
            return work(None);
        }
        let team = Team::new();
        spawn_helpers(&team, helpers, work)
    })
}

fn spawn_helpers<R: Send>(
    team: &Team,
    helpers: usize,
    work: impl FnOnce(Option<&Team>) -> R + Send,
) -> R {
    if helpers == 0 {
        let _done = DoneOnDrop(team);
        return work(Some(team));
    }
    // The helper is pushed to this thread's deque and stolen by an idle pool thread; if none
    // takes it before the work ends, `join` runs it here, where it sees `done` and returns.
    rayon::join(|| spawn_helpers(team, helpers - 1, work), || team.help()).0
}

/// `task(i)` for `i` in `0..count`, on the team if there is one, else on the rayon pool.
pub fn parallel_for(team: Option<&Team>, count: usize, task: &(dyn Fn(usize) + Sync)) {
    match team {
        Some(team) => team.for_each(count, task),
        None => (0..count).into_par_iter().for_each(task),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
    }

    #[test]
    fn every_task_runs_exactly_once_in_every_region() {
        for threads in [1, 2, 3] {
            let hits: Vec<AtomicU32> = (0..70_000).map(|_| AtomicU32::new(0)).collect();
            with_team(&pool(threads), |team| {
                assert_eq!(team.is_some(), threads > 1);
                for count in [0, 1, 2, 7, 64, 1000, 70_000] {
                    parallel_for(team, count, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
            });
            for (i, hit) in hits.iter().enumerate() {
                let expected = [1, 2, 7, 64, 1000, 70_000]
                    .iter()
                    .filter(|&&count| i < count)
                    .count() as u32;
                assert_eq!(
                    hit.load(Ordering::Relaxed),
                    expected,
                    "task {i}, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn regions_see_the_results_of_earlier_regions() {
        let values: Vec<AtomicU32> = (0..256).map(|_| AtomicU32::new(0)).collect();
        with_team(&pool(2), |team| {
            for round in 1..=200u32 {
                parallel_for(team, values.len(), &|i| {
                    let before = values[i].load(Ordering::Relaxed);
                    assert_eq!(before, round - 1, "region {round} ran before {}", round - 1);
                    values[i].store(round, Ordering::Relaxed);
                });
            }
        });
        assert!(values.iter().all(|v| v.load(Ordering::Relaxed) == 200));
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let p = pool(2);
        let caught = panic::catch_unwind(AssertUnwindSafe(|| {
            with_team(&p, |team| {
                parallel_for(team, 64, &|i| {
                    if i == 37 {
                        panic!("task 37");
                    }
                })
            })
        }));
        assert!(caught.is_err());
        let sum = AtomicUsize::new(0);
        with_team(&p, |team| {
            parallel_for(team, 100, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn a_helper_stalled_in_a_task_makes_the_leader_work_alone() {
        use std::sync::atomic::AtomicBool;
        use std::time::Duration;
        let p = pool(2);
        let stalled = with_team(&p, |team| {
            let team = team.expect("two threads make a team");
            let leader = std::thread::current().id();
            // Task 0 (the leader's) waits until the helper holds task 1, which then sleeps far
            // past the stall limit, as a helper whose core was taken would. If the helper never
            // comes (a busy machine), the leader runs both and the round is tried again.
            for _ in 0..50 {
                let helper_in = AtomicBool::new(false);
                team.for_each(2, &|i| {
                    if std::thread::current().id() != leader {
                        helper_in.store(true, Ordering::Release);
                        std::thread::sleep(Duration::from_millis(30));
                    } else if i == 0 {
                        let until = Instant::now() + Duration::from_millis(100);
                        while !helper_in.load(Ordering::Acquire) && Instant::now() < until {
                            std::hint::spin_loop();
                        }
                    }
                });
                if helper_in.load(Ordering::Acquire) {
                    // Right after the stall the leader works alone: tasks long enough that a
                    // spinning helper would claim some of them otherwise.
                    let until = contention::solo_until_micros();
                    let first_off_leader = AtomicU64::new(u64::MAX);
                    team.for_each(16, &|_| {
                        if std::thread::current().id() != leader {
                            first_off_leader.fetch_min(contention::now_micros(), Ordering::Relaxed);
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    });
                    let first_off_leader = first_off_leader.load(Ordering::Relaxed);
                    // A region decides once, at its start, whether it runs alone: a helper task
                    // after the period's end means the leader itself was descheduled past it (a
                    // busy machine), not that the period was ignored; that round is tried again.
                    if first_off_leader == u64::MAX || first_off_leader < until {
                        return Some(first_off_leader);
                    }
                }
            }
            None
        });
        if let Some(first_off_leader) = stalled {
            assert_eq!(
                first_off_leader,
                u64::MAX,
                "a task ran on a helper during the solo period"
            );
        }
        assert!(contention::stall_limit(Duration::from_micros(100), 4) >= contention::MIN_STALL);
    }

    #[test]
    fn solo_periods_double_under_lasting_contention_and_reset_after_a_quiet_while() {
        use contention::next_period;
        let ms = 1000;
        assert_eq!(next_period(5 * ms, 0, 0), 16 * ms, "the first stall");
        // A stall during a period keeps its length.
        assert_eq!(next_period(10 * ms, 21 * ms, 16 * ms), 16 * ms);
        // Stalls right after each period: 16, 32, 64, 128, 256, then no longer.
        let (mut now, mut period) = (100 * ms, 16 * ms);
        for want in [32, 64, 128, 256, 256] {
            let until = now + period;
            now = until + ms;
            period = next_period(now, until, period);
            assert_eq!(period, want * ms);
        }
        // A stall more than one period after the last ended starts from the shortest.
        assert_eq!(next_period(1000 * ms, 700 * ms, 256 * ms), 16 * ms);
        assert_eq!(next_period(100 * ms, 80 * ms, 16 * ms), 16 * ms);
    }

    #[test]
    fn the_work_runs_on_the_pool_it_is_given() {
        let p = pool(3);
        let outside = rayon::current_num_threads();
        let seen = with_team(&p, |_| {
            (rayon::current_num_threads(), p.current_thread_index())
        });
        assert_eq!(seen.0, 3, "the global pool has {outside}");
        assert!(seen.1.is_some(), "the leader is a thread of the pool");
    }
}
