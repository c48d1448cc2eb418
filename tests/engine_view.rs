//! The engine view and what feeds it: the forward pass's routing counts and decode phase times,
//! the worker's profile samples, the view's screens (TestBackend snapshots in tests/snapshots, and
//! rewritten with OSSTERM_UPDATE_SNAPSHOTS=1), the `--demo` script driving the app, and the load
//! progress of a real checkpoint.

mod support;

use crossterm::event::KeyCode;
use ossterm::engine::protocol::{
    CacheHits, Command, Event, Phase, ProfileSample, Settings, StatsSample, WeightFormat,
};
use ossterm::model::profile::ProfileCounts;
use ossterm::model::{LoadOptions, LoadStage, Model, Precision, Preset};
use ossterm::tui::{App, Effect, Msg};
use ratatui::backend::TestBackend;
use ratatui::Terminal;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{draw_screen, key, random_engine};

fn buffer_text(terminal: &Terminal<TestBackend>) -> String {
    let buffer = terminal.backend().buffer();
    let mut text = String::new();
    for y in 0..buffer.area.height {
        let mut skip = 0;
        for x in 0..buffer.area.width {
            // A wide symbol covers the next cell, as a terminal's copy of the screen shows it.
            if skip > 0 {
                skip -= 1;
                continue;
            }
            let symbol = buffer[(x, y)].symbol();
            skip = unicode_width(symbol).saturating_sub(1);
            text.push_str(symbol);
        }
        text.push('\n');
    }
    text
}

fn unicode_width(symbol: &str) -> usize {
    ossterm::tui::markdown::text_width(symbol)
}

/// Draws `app` as the loop does, as a terminal's copy of the screen shows it.
fn screen(app: &mut App, width: u16, height: u16) -> String {
    buffer_text(&draw_screen(app, width, height))
}

/// Compares `text` with tests/snapshots/`name`.txt (or writes it there when
/// OSSTERM_UPDATE_SNAPSHOTS=1).
fn assert_snapshot(name: &str, text: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.txt"));
    if std::env::var_os("OSSTERM_UPDATE_SNAPSHOTS").is_some_and(|value| value == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|error| {
        panic!(
            "{}: {error} (write it with OSSTERM_UPDATE_SNAPSHOTS=1)",
            path.display()
        )
    });
    assert_eq!(
        text,
        expected,
        "screen differs from {}; got:\n{text}",
        path.display()
    );
}

/// The app with a 20b on random weights ready, on two threads.
fn ready_app(dir: &Path) -> App {
    let two = Settings {
        threads: 2,
        ..Settings::default()
    };
    let info = random_engine("synthetic 20b (random weights)", "avx512", two.clone());
    support::ready_app(two, dir, info)
}

fn stats() -> StatsSample {
    support::stats_sample()
}

/// A deterministic sample of the 20b's shape: each layer favours a few experts, differently.
fn sample_20b() -> ProfileSample {
    let (layers, experts) = (24, 32);
    let mut routing = vec![0u32; layers * experts];
    for layer in 0..layers {
        for expert in 0..experts {
            let favourite = (expert * 7 + layer * 3) % 32;
            routing[layer * experts + expert] = match favourite {
                0..=3 => 40,
                4..=11 => 12,
                12..=20 => 3,
                _ => 0,
            };
        }
    }
    ProfileSample {
        layers,
        experts,
        experts_per_token: 4,
        routing,
        routed_tokens: 64,
        turn_distinct: (0..layers).map(|layer| 17 + (layer % 5) as u16).collect(),
        decode_steps: 8,
        // Per step: 30 ms attention, 70 experts, 12 unembedding, 6 quantization, 2 rest.
        phase_nanos: [240_000_000, 560_000_000, 96_000_000, 48_000_000, 16_000_000],
        wall_steps: 8,
        decode_wall: Duration::from_millis(1000),
        bytes_per_token: Some(1_300_000_000),
    }
}

fn engine_view_app(dir: &Path) -> App {
    let mut app = ready_app(dir);
    let effects = app.update(key(KeyCode::F(2)), Instant::now());
    assert!(
        effects.contains(&Effect::Engine(Command::MeasureBandwidth)),
        "opening the view asks for the bandwidth: {effects:?}"
    );
    assert!(app.engine_view);
    app.update(Msg::Engine(Event::Stats(stats())), Instant::now());
    app.update(
        Msg::Engine(Event::Bandwidth {
            gigabytes_per_second: 12.5,
            threads: 2,
        }),
        Instant::now(),
    );
    app.update(
        Msg::Engine(Event::Profile(Box::new(sample_20b()))),
        Instant::now(),
    );
    app
}

#[test]
fn engine_view_beside_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = engine_view_app(dir.path());
    let text = screen(&mut app, 160, 44);
    assert!(text.contains("24 layers × 32 experts, top-4"), "{text}");
    assert!(text.contains("decode at 83% of memory bandwidth"), "{text}");
    assert!(text.contains("Conversation"), "{text}");
    assert_snapshot("engine_view_wide", &text);
}

#[test]
fn engine_view_takes_the_conversation_place_on_a_narrow_screen() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = engine_view_app(dir.path());
    let text = screen(&mut app, 100, 44);
    assert!(!text.contains("Conversation"), "{text}");
    assert!(text.contains("L23"), "{text}");
    assert_snapshot("engine_view_replacing", &text);
}

#[test]
fn a_narrow_view_collapses_each_layer_to_a_bar() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = engine_view_app(dir.path());
    let text = screen(&mut app, 40, 44);
    assert!(text.contains("distinct experts this turn"), "{text}");
    assert!(text.contains("L0  [███"), "{text}");
    assert_snapshot("engine_view_bars", &text);
}

#[test]
fn a_short_view_groups_layers() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = engine_view_app(dir.path());
    let text = screen(&mut app, 160, 26);
    assert!(text.contains("L0+"), "{text}");
    assert!(text.contains("decode at 83%"), "{text}");
}

#[test]
fn f2_hides_the_view_and_time_shares_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = engine_view_app(dir.path());
    let shares = app.insight.shares.expect("shares");
    let total: f64 = shares.iter().map(|(_, share)| share).sum();
    assert!((total - 1.0).abs() < 1e-9, "{shares:?}");
    // 120 ms of the 125 ms step are inside the pass.
    assert!((shares[1].1 - 70.0 / 125.0).abs() < 1e-9, "{shares:?}");
    app.update(key(KeyCode::F(2)), Instant::now());
    assert!(!app.engine_view);
    let text = screen(&mut app, 160, 44);
    assert!(!text.contains("Routing, last"), "{text}");
}

#[test]
fn demo_types_sends_switches_and_stops_on_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let start = Instant::now();
    app.start_demo(start);
    assert!(app.engine_view && app.wants_ticks());
    let mut now = start;
    let mut generated = 0;
    let mut applied = Vec::new();
    for _ in 0..400 {
        now += Duration::from_millis(100);
        for effect in app.update(Msg::Tick, now) {
            match effect {
                Effect::Generate(job) => {
                    generated += 1;
                    // The engine answers at once.
                    app.update(
                        Msg::Engine(Event::TurnDone {
                            id: job.id,
                            reason: ossterm::engine::protocol::StopReason::MaxTokens,
                            hits: CacheHits::default(),
                            generated_tokens: 48,
                        }),
                        now,
                    );
                }
                Effect::Engine(Command::ApplySettings(settings)) => {
                    applied.push((settings.threads, settings.weight_format));
                    let mut serving = stats();
                    serving.weight_format = settings.weight_format;
                    serving.threads = settings.threads;
                    app.update(Msg::Engine(Event::SettingsApplied(settings)), now);
                    app.update(Msg::Engine(Event::Stats(serving)), now);
                }
                _ => {}
            }
        }
        if generated >= 4 {
            break;
        }
    }
    assert_eq!(generated, 4, "the script sends its prompts");
    assert_eq!(
        applied,
        vec![
            (1, WeightFormat::Q8),
            (2, WeightFormat::Q8),
            (2, WeightFormat::Q4)
        ]
    );
    assert!(
        std::fs::read_dir(dir.path()).map_or(0, |entries| entries.count()) == 0,
        "the demo's chats are not saved"
    );
    app.update(key(KeyCode::Char('x')), now);
    assert!(app.demo.is_none(), "a key stops the demo");
    assert!(app.input.is_empty(), "the stopping key is not typed");
}

fn pool() -> Arc<rayon::ThreadPool> {
    ossterm::engine::build_pool(2).expect("a pool of two threads")
}

fn routing_after_prefill_and_decode(precision: Precision) -> (ProfileCounts, usize) {
    let opts = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    let model = Arc::new(Model::synthetic(Preset::Tiny, 3, &opts).unwrap());
    let top_k = model.config.num_experts_per_tok;
    let mut session = model.new_session(&pool(), 64);
    let profile = session.profile();
    session.prefill(&[1, 2, 3, 4, 5]).unwrap();
    for token in [6, 7, 8] {
        session.decode(token).unwrap();
    }
    let mut taken = ProfileCounts::default();
    profile.lock().unwrap().take_into(&mut taken);
    (taken, top_k)
}

#[test]
fn the_passes_count_every_routed_token_and_time_decode_steps() {
    for precision in [Precision::Fast, Precision::Exact] {
        let (taken, top_k) = routing_after_prefill_and_decode(precision);
        assert_eq!(taken.tokens, 8, "{precision:?}");
        assert_eq!(taken.steps, 3, "{precision:?}: decode steps only");
        let layers = taken.routing.len() / taken.experts;
        for (l, layer) in taken.routing.chunks(taken.experts).enumerate() {
            // The fast path's last layer routes only the prompt's last row (whose logits are
            // read) and the decoded tokens; the exact path routes every row everywhere.
            let routed = if precision == Precision::Fast && l + 1 == layers {
                1 + 3
            } else {
                8
            };
            assert_eq!(
                layer.iter().sum::<u32>() as usize,
                routed * top_k,
                "{precision:?}, layer {l}"
            );
        }
        for phase in [Phase::Attention, Phase::Experts, Phase::Unembedding] {
            assert!(
                taken.nanos[phase as usize] > 0,
                "{precision:?}: {phase:?} timed"
            );
        }
    }
}

#[test]
fn decode_steps_untimed_when_timing_is_off() {
    let model = Arc::new(Model::synthetic(Preset::Tiny, 3, &LoadOptions::default()).unwrap());
    let mut session = model.new_session(&pool(), 16);
    session.set_profile_timing(false);
    session.prefill(&[1, 2]).unwrap();
    session.decode(3).unwrap();
    let mut taken = ProfileCounts::default();
    session.profile().lock().unwrap().take_into(&mut taken);
    assert_eq!((taken.steps, taken.nanos), (0, [0; 5]));
    assert_eq!(taken.tokens, 3, "routing is counted either way");
}

#[test]
fn a_real_checkpoint_reports_its_conversion() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_single");
    let mut converting = Vec::new();
    Model::load_with_progress(&dir, &LoadOptions::default(), &mut |stage, done, total| {
        if stage == LoadStage::Converting {
            converting.push((done, total));
        }
    })
    .unwrap();
    let &(done, total) = converting.last().expect("conversion progress");
    assert!(total > 0 && done == total, "{converting:?}");
}
