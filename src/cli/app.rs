//! The interactive app (`ossterm` with no command): command-line flags, terminal setup and
//! restore (also on panic), and the event loop that joins keys, engine events and redraws.

use crate::config::{self, AppConfig, ConfigOverrides, ModelSource, SyntheticChoice};
use crate::engine::protocol::{
    ActivationFormat, Event, KvCacheType, ReasoningEffort, WeightFormat,
};
use crate::engine::worker::{EngineError, EngineHandle};
use crate::tui::clipboard::osc52_sequence;
use crate::tui::store::ChatStore;
use crate::tui::view::draw;
use crate::tui::{App, Effect, EngineStatus, Msg};
use anyhow::Context;
use clap::Args;
use crossterm::event::{
    DisableBracketedPaste, DisableMouseCapture, EnableBracketedPaste, EnableMouseCapture,
    KeyboardEnhancementFlags, PopKeyboardEnhancementFlags, PushKeyboardEnhancementFlags,
};
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;
use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Redraw cadence while events stream in: tokens arriving faster are batched into one frame.
const FRAME_INTERVAL: Duration = Duration::from_millis(33);

/// Flags of the interactive app; each overrides the config file's key of the same name.
#[derive(Args, Debug, Clone, Default)]
pub struct AppArgs {
    /// Config file to read instead of the one in the platform config directory.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Checkpoint directory (model.path).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Random-weight model when no checkpoint is given: auto, tiny or 20b (model.synthetic).
    #[arg(long, value_name = "PRESET", value_parser = parse_synthetic)]
    pub synthetic: Option<SyntheticChoice>,
    /// Worker threads (engine.threads).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// native, q8 or q4 (engine.weight_format).
    #[arg(long, value_name = "FORMAT", value_parser = parse_choice::<WeightFormat>)]
    pub weight_format: Option<WeightFormat>,
    /// Int8 inputs of quantized products: q8, mixed or q8x2 (engine.activations).
    #[arg(long, value_name = "FORMAT", value_parser = parse_choice::<ActivationFormat>)]
    pub activations: Option<ActivationFormat>,
    /// f16 or f32 (engine.kv_cache).
    #[arg(long, value_name = "TYPE", value_parser = parse_choice::<KvCacheType>)]
    pub kv_cache: Option<KvCacheType>,
    /// Context limit in tokens (engine.context_limit).
    #[arg(long, value_name = "TOKENS")]
    pub context_limit: Option<usize>,
    /// Sampling temperature, 0 = greedy (sampling.temperature).
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass in (0, 1] (sampling.top_p).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens, 0 = off (sampling.top_k).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Drop tokens below this fraction of the top one's probability, 0 = off (sampling.min_p).
    #[arg(long, value_name = "P")]
    pub min_p: Option<f32>,
    /// Most tokens one reply may generate, reasoning included (sampling.max_tokens).
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<usize>,
    /// Fixed sampling seed (sampling.seed; default: a fresh one every run).
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// low, medium or high (chat.reasoning_effort).
    #[arg(long, value_name = "EFFORT", value_parser = parse_choice::<ReasoningEffort>)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Directory of saved chats (paths.chats_dir).
    #[arg(long, value_name = "DIR")]
    pub chats_dir: Option<PathBuf>,
    /// Directory of KV snapshots (paths.cache_dir; default: the platform cache directory).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
}

fn parse_synthetic(text: &str) -> Result<SyntheticChoice, String> {
    SyntheticChoice::from_name(text)
        .ok_or_else(|| format!("expected auto, tiny or 20b, got {text:?}"))
}

trait NamedChoice: Sized + Copy + 'static {
    const ALL: &'static [Self];
    fn name(self) -> &'static str;
}

macro_rules! named_choice {
    ($($ty:ty),*) => {$(
        impl NamedChoice for $ty {
            const ALL: &'static [Self] = <$ty>::ALL;
            fn name(self) -> &'static str {
                <$ty>::name(self)
            }
        }
    )*};
}
named_choice!(WeightFormat, ActivationFormat, KvCacheType, ReasoningEffort);

fn parse_choice<T: NamedChoice>(text: &str) -> Result<T, String> {
    T::ALL
        .iter()
        .copied()
        .find(|value| value.name() == text)
        .ok_or_else(|| {
            let names: Vec<&str> = T::ALL.iter().map(|value| value.name()).collect();
            format!("expected one of {}, got {text:?}", names.join(", "))
        })
}

impl AppArgs {
    /// The resolved configuration: defaults < config file < these flags.
    pub fn resolve(&self) -> anyhow::Result<AppConfig> {
        let overrides = ConfigOverrides {
            model_dir: self.model.clone(),
            synthetic: self.synthetic,
            threads: self.threads,
            weight_format: self.weight_format,
            activations: self.activations,
            kv_cache: self.kv_cache,
            context_limit: self.context_limit,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            max_tokens: self.max_tokens,
            seed: self.seed,
            reasoning_effort: self.reasoning_effort,
            chats_dir: self.chats_dir.clone(),
            cache_dir: self.cache_dir.clone(),
        };
        Ok(config::load(self.config.as_deref(), &overrides)?)
    }
}

/// The engine status to start with: a checkpoint directory that does not exist is explained on
/// screen (download command, demo) instead of failing with an error dump.
pub fn initial_engine_status(config: &AppConfig) -> EngineStatus {
    match &config.model {
        ModelSource::Checkpoint(dir) if !dir.join("config.json").is_file() => {
            EngineStatus::ModelMissing { path: dir.clone() }
        }
        _ => EngineStatus::Loading {
            stage: "starting".to_string(),
            done: 0,
            total: 1,
        },
    }
}

/// Environment variable that arms a deliberate panic for the end-to-end test of the terminal
/// restore: with `OSSTERM_TEST_PANIC=1`, F12 panics the UI thread. Without it F12 does nothing, so
/// a user cannot trigger it by accident.
pub const TEST_PANIC_ENV: &str = "OSSTERM_TEST_PANIC";

/// The key that panics when [`TEST_PANIC_ENV`] is set.
pub const TEST_PANIC_KEY: crossterm::event::KeyCode = crossterm::event::KeyCode::F(12);

/// Writes what undoes the app's terminal setup except raw mode (which is not an escape sequence):
/// keyboard enhancement popped, bracketed paste and mouse reporting off, main screen, cursor shown.
pub fn write_terminal_restore(out: &mut impl Write) -> std::io::Result<()> {
    crossterm::queue!(
        out,
        PopKeyboardEnhancementFlags,
        DisableBracketedPaste,
        DisableMouseCapture,
        LeaveAlternateScreen,
        crossterm::cursor::Show
    )?;
    out.flush()
}

/// Puts the terminal back: raw mode off, main screen, mouse and paste reporting off.
fn restore_terminal() {
    let _ = write_terminal_restore(&mut std::io::stdout());
    let _ = disable_raw_mode();
}

/// Panic messages of threads other than the UI's, kept off the screen while the app owns it.
pub type PanicNotes = Arc<Mutex<Vec<String>>>;

/// Installs a panic hook for the app. A panic on the thread that calls this (the UI thread, which
/// owns the terminal) runs `restore` first, so the message lands on the normal screen in cooked
/// mode instead of being lost in the alternate screen. A panic on another thread (the engine)
/// must not take the terminal from a UI that keeps running: its message goes to the returned
/// notes, which the app shows and prints after it restored the terminal.
pub fn install_panic_hook(restore: impl Fn() + Send + Sync + 'static) -> PanicNotes {
    let notes: PanicNotes = Arc::default();
    let hook_notes = Arc::clone(&notes);
    let ui_thread = std::thread::current().id();
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().id() == ui_thread {
            restore();
            previous_hook(info);
        } else {
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("a worker thread");
            let note = format!("{name} panicked: {info}");
            match hook_notes.lock() {
                Ok(mut notes) => notes.push(note),
                Err(_) => previous_hook(info),
            }
        }
    }));
    notes
}

/// The last panic note, for the status line.
fn last_panic_note(notes: &PanicNotes) -> Option<String> {
    notes.lock().ok().and_then(|notes| notes.last().cloned())
}

/// Restores the terminal when dropped, so every exit path (error, `?`, panic unwinding) leaves
/// the user's shell usable.
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
    }
}

fn setup_terminal() -> anyhow::Result<(Terminal<CrosstermBackend<std::io::Stdout>>, TerminalGuard)>
{
    enable_raw_mode().context("cannot switch the terminal to raw mode")?;
    let guard = TerminalGuard;
    let mut stdout = std::io::stdout();
    crossterm::execute!(
        stdout,
        EnterAlternateScreen,
        EnableMouseCapture,
        EnableBracketedPaste
    )
    .context("cannot set up the terminal")?;
    // Lets terminals that support it report Shift-Enter apart from Enter.
    if crossterm::terminal::supports_keyboard_enhancement().unwrap_or(false) {
        let _ = crossterm::execute!(
            stdout,
            PushKeyboardEnhancementFlags(KeyboardEnhancementFlags::DISAMBIGUATE_ESCAPE_CODES)
        );
    }
    let terminal = Terminal::new(CrosstermBackend::new(std::io::stdout()))
        .context("cannot start the terminal UI")?;
    Ok((terminal, guard))
}

/// What the loop receives: terminal input and engine events on one channel.
enum Input {
    Terminal(crossterm::event::Event, Instant),
    Engine(Event),
    /// The engine's event channel closed while the app was running.
    EngineGone,
}

/// Runs the app until the user quits. `start_engine` starts the engine thread sending its events
/// to the given sender (the caller chooses the model and chat pieces, see `EngineHandle::spawn`).
pub fn run_app(
    config: AppConfig,
    start_engine: impl FnOnce(&AppConfig, Sender<Event>) -> Result<EngineHandle, EngineError>,
) -> anyhow::Result<()> {
    let chats_dir = config
        .chats_dir
        .clone()
        .or_else(config::default_chats_dir)
        .context("no platform data directory for saved chats; set paths.chats_dir")?;
    let status = initial_engine_status(&config);
    let mut app = App::new(
        config.settings.clone(),
        ChatStore::new(chats_dir),
        status.clone(),
    );

    let panic_notes = install_panic_hook(restore_terminal);
    // Before the input thread starts: setting up asks the terminal about its keyboard protocol and
    // reads the answer, which the input thread would otherwise take (and hold the reader meanwhile).
    let (mut terminal, guard) = setup_terminal()?;
    let (input_sender, inputs) = mpsc::channel();
    let (event_sender, engine_events) = mpsc::channel();
    let engine = match status {
        EngineStatus::ModelMissing { .. } => None,
        _ => Some(start_engine(&config, event_sender)?),
    };
    let forward = input_sender.clone();
    std::thread::Builder::new()
        .name("ossterm-engine-events".to_string())
        .spawn(move || {
            for event in engine_events {
                if forward.send(Input::Engine(event)).is_err() {
                    return;
                }
            }
            let _ = forward.send(Input::EngineGone);
        })?;
    std::thread::Builder::new()
        .name("ossterm-terminal-input".to_string())
        .spawn(move || {
            while let Ok(event) = crossterm::event::read() {
                if input_sender
                    .send(Input::Terminal(event, Instant::now()))
                    .is_err()
                {
                    return;
                }
            }
        })?;

    let test_panic_armed = std::env::var_os(TEST_PANIC_ENV).is_some_and(|value| value == "1");
    let result = event_loop(
        &mut terminal,
        &mut app,
        &inputs,
        engine.as_ref(),
        &LoopHooks {
            panic_notes: &panic_notes,
            test_panic_armed,
        },
    );
    drop(guard);
    if let Ok(notes) = panic_notes.lock() {
        for note in notes.iter() {
            eprintln!("{note}");
        }
    }
    if let Some(engine) = engine {
        engine.shutdown();
    }
    result
}

/// What the event loop needs besides the app and its channels.
struct LoopHooks<'a> {
    panic_notes: &'a PanicNotes,
    /// [`TEST_PANIC_ENV`] is set: [`TEST_PANIC_KEY`] panics.
    test_panic_armed: bool,
}

fn event_loop(
    terminal: &mut Terminal<CrosstermBackend<std::io::Stdout>>,
    app: &mut App,
    inputs: &mpsc::Receiver<Input>,
    engine: Option<&EngineHandle>,
    hooks: &LoopHooks,
) -> anyhow::Result<()> {
    let mut dirty = true;
    let mut last_draw = Instant::now() - FRAME_INTERVAL;
    // Keys read since the last frame, timed until that frame is on screen.
    let mut pending_keys: Vec<Instant> = Vec::new();
    let mut repaint_all = false;
    loop {
        if dirty && (last_draw.elapsed() >= FRAME_INTERVAL || !pending_keys.is_empty()) {
            let size = terminal.size()?;
            app.update(
                Msg::Resize {
                    conversation_height: size.height.saturating_sub(6),
                },
                Instant::now(),
            );
            if std::mem::take(&mut repaint_all) {
                terminal.clear()?;
            }
            terminal.draw(|frame| draw(frame, app))?;
            let drawn = Instant::now();
            for read_at in pending_keys.drain(..) {
                let latency = drawn.saturating_duration_since(read_at);
                app.latency.last = latency;
                app.latency.max = app.latency.max.max(latency);
                app.latency.samples += 1;
            }
            last_draw = drawn;
            dirty = false;
        }
        let wait = if dirty {
            FRAME_INTERVAL.saturating_sub(last_draw.elapsed())
        } else {
            Duration::from_secs(1)
        };
        let first = match inputs.recv_timeout(wait) {
            Ok(input) => input,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        // Drain everything already queued so a burst of tokens costs one frame.
        for input in std::iter::once(first).chain(inputs.try_iter()) {
            let now = Instant::now();
            let message = match input {
                Input::Engine(event) => Msg::Engine(event),
                Input::EngineGone => {
                    let failed_to_start = matches!(app.engine, EngineStatus::Failed(_));
                    match last_panic_note(hooks.panic_notes) {
                        Some(note) => Msg::EngineStopped(note),
                        // A load error already said why the engine ended.
                        None if failed_to_start => continue,
                        None => Msg::EngineStopped("its thread ended".to_string()),
                    }
                }
                Input::Terminal(event, read_at) => match event {
                    crossterm::event::Event::Key(key) => {
                        if hooks.test_panic_armed && key.code == TEST_PANIC_KEY {
                            panic!("deliberate panic: {TEST_PANIC_ENV}=1 and F12 was pressed");
                        }
                        pending_keys.push(read_at);
                        Msg::Key(key)
                    }
                    crossterm::event::Event::Mouse(mouse) => Msg::Mouse(mouse),
                    crossterm::event::Event::Paste(text) => Msg::Paste(text),
                    crossterm::event::Event::Resize(..) => {
                        dirty = true;
                        continue;
                    }
                    _ => continue,
                },
            };
            dirty = true;
            for effect in app.update(message, now) {
                match effect {
                    Effect::Engine(command) => {
                        if let Some(engine) = engine {
                            if let Err(error) = engine.send(command) {
                                app.notice = Some(error.to_string());
                            }
                        }
                    }
                    Effect::Copy(text) => {
                        let mut stdout = std::io::stdout();
                        stdout.write_all(osc52_sequence(&text).as_bytes())?;
                        stdout.flush()?;
                    }
                    Effect::Redraw => repaint_all = true,
                    Effect::Quit => return Ok(()),
                }
            }
        }
    }
}

/// `ossterm` with no command: resolve the configuration and run the app over the real model.
pub fn run(args: AppArgs) -> anyhow::Result<()> {
    // A bad OSSTERM_KERNELS is reported here, before the screen is taken over.
    crate::kernels::init_kernel_path()?;
    let config = args.resolve()?;
    run_app(config, |config, events| {
        Ok(start_model_engine(config, events))
    })
}

/// Starts the engine thread over the configured checkpoint or synthetic model, the harmony codec
/// and the sampler; loading happens on that thread while the UI shows progress.
pub fn start_model_engine(config: &AppConfig, events: Sender<Event>) -> EngineHandle {
    use crate::engine::worker::{EngineParts, HarmonyCodec};
    let source = config.model.clone();
    let kv_tiers = config.cache.tiers();
    EngineHandle::spawn(
        config.settings.clone(),
        events,
        move |settings, progress| {
            let loaded = load_model(&source, settings, progress)?;
            progress("loading the tokenizer", 0, 1);
            let codec = HarmonyCodec::new()?;
            let sampler = crate::engine::Sampler::new(settings.sampling.sampler())
                .map_err(|error| EngineError::Chat(Box::new(error)))?;
            Ok(EngineParts {
                model: std::sync::Arc::new(loaded.model),
                codec,
                sampler,
                model_label: loaded.label,
                random_weights: loaded.random_weights,
                kv_tiers,
            })
        },
    )
}

/// A model ready for the engine, with what the title bar says about it.
pub struct LoadedModel {
    pub model: crate::model::Model,
    pub label: String,
    pub random_weights: bool,
}

/// The synthetic preset the app runs for `choice`, and why when `auto` fell back to tiny.
pub fn synthetic_preset(
    choice: SyntheticChoice,
    available_memory_bytes: Option<u64>,
) -> (crate::model::Preset, Option<String>) {
    use crate::model::Preset;
    match choice.resolve(available_memory_bytes) {
        SyntheticChoice::Gpt20b => (Preset::Gpt20b, None),
        SyntheticChoice::Tiny if choice == SyntheticChoice::Auto => {
            let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
            let available = available_memory_bytes.map_or("unknown memory".to_string(), |bytes| {
                format!("{:.1} GiB", gib(bytes))
            });
            let reason = format!(
                "the 20b demo needs {:.0} GiB available, this machine has {available}",
                gib(config::SYNTHETIC_20B_MIN_MEMORY_BYTES)
            );
            (Preset::Tiny, Some(reason))
        }
        SyntheticChoice::Tiny | SyntheticChoice::Auto => (Preset::Tiny, None),
    }
}

/// Loads the configured model, reporting each stage: reading or generating the weights (bytes),
/// then converting attention and unembedding matrices to the weight format (matrices).
pub fn load_model(
    source: &ModelSource,
    settings: &crate::engine::protocol::Settings,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<LoadedModel, EngineError> {
    use crate::model::{LoadOptions, LoadStage, Model, Precision};
    let model_error = |error: crate::model::ModelError| EngineError::Model(Box::new(error));
    let options = LoadOptions {
        precision: Precision::Fast,
        weights: settings.weight_format,
        kv: settings.kv_cache,
        activations: settings.activations,
        ..LoadOptions::default()
    };
    let converting = format!("converting weights to {}", settings.weight_format);
    let (model, label, random_weights) = match source {
        ModelSource::Checkpoint(dir) => {
            let model = Model::load_with_progress(dir, &options, &mut |stage, done, total| {
                let what = match stage {
                    LoadStage::Converting => converting.as_str(),
                    _ => "mapping the checkpoint",
                };
                progress(what, done, total)
            })
            .map_err(model_error)?;
            (model, format!("gpt-oss ({})", dir.display()), false)
        }
        ModelSource::Synthetic(choice) => {
            let available = crate::engine::worker::available_memory_bytes();
            let (preset, fallback) = synthetic_preset(*choice, available);
            let generating = format!("generating random {} weights", preset.name());
            let model =
                Model::synthetic_with_progress(preset, 0, &options, &mut |stage, done, total| {
                    let what = match stage {
                        LoadStage::Converting => converting.as_str(),
                        _ => generating.as_str(),
                    };
                    progress(what, done, total)
                })
                .map_err(model_error)?;
            let label = match fallback {
                Some(reason) => format!("{} ({reason})", model.source),
                None => model.source.clone(),
            };
            (model, label, true)
        }
    };
    Ok(LoadedModel {
        model,
        label,
        random_weights,
    })
}

/// Seed of the app's synthetic weights (the same as `--synthetic-seed`'s default elsewhere).
pub const SYNTHETIC_SEED: u64 = 0;
