//! The interactive app (`ossterm` with no command): command-line flags (derived from the settings
//! table), terminal setup and restore (also on panic and on SIGTERM, SIGINT, SIGHUP), the threads
//! around the UI (terminal input, engine events, engine requests, chat files, signals), and the
//! event loop that feeds their messages to `App::update` and carries out its effects.

use crate::config::{self, AppConfig, ConfigOverrides, ModelSource, SyntheticChoice};
use crate::engine::protocol::{Command, Event};
use crate::engine::worker::{EngineError, EngineHandle};
use crate::settings::{Kind, Setting, Value, SETTINGS};
use crate::tui::chat_file::{ChatSnapshot, GenerateJob};
use crate::tui::clipboard::osc52_sequence;
use crate::tui::store::{ChatStore, StoreOutcome, StoreRequest};
use crate::tui::view::{conversation_viewport, draw};
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
    /// Checkpoint directory, GGUF file or ollama:NAME:TAG (model.path).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Random-weight model when no checkpoint is given: auto, tiny, 20b or 120b (model.synthetic).
    #[arg(long, value_name = "PRESET", value_parser = parse_synthetic)]
    pub synthetic: Option<SyntheticChoice>,
    /// Directory of saved chats (paths.chats_dir).
    #[arg(long, value_name = "DIR")]
    pub chats_dir: Option<PathBuf>,
    /// Directory of KV snapshots (paths.cache_dir; default: the platform cache directory).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Play a scripted session until a key is pressed: a few prompts, then 1 -> 2 threads and
    /// q8 -> q4 -> q8 weights, with the engine view open (try it with --synthetic 20b).
    #[arg(long)]
    pub demo: bool,
    #[command(flatten)]
    pub remote: RemoteArgs,
    #[command(flatten)]
    pub settings: SettingFlags,
}

/// Flags of a remote engine, shared by the app and `ossterm run`.
#[derive(Args, Debug, Clone, Default)]
pub struct RemoteArgs {
    /// Run on an OpenAI-compatible server (vLLM, llama-server, `ossterm serve`, …) instead of a
    /// local model, e.g. http://gpu-box:8000; "" runs locally (remote.url).
    #[arg(long, value_name = "URL", conflicts_with_all = ["model", "synthetic"])]
    pub remote: Option<String>,
    /// The server's API key (default: the variable remote.api_key_env names, OSSTERM_API_KEY).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Model to ask the server for (default: the first of its /v1/models) (remote.model).
    #[arg(long, value_name = "NAME")]
    pub remote_model: Option<String>,
    /// Seconds the server may stay silent mid-request (remote.timeout_secs).
    #[arg(long, value_name = "SECS")]
    pub remote_timeout: Option<u64>,
}

fn parse_synthetic(text: &str) -> Result<SyntheticChoice, String> {
    SyntheticChoice::from_name(text)
        .ok_or_else(|| format!("expected auto, tiny, 20b or 120b, got {text:?}"))
}

/// The flags of every setting that has one in [`SETTINGS`], as given: (config key, value).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettingFlags(pub Vec<(&'static str, Value)>);

/// A flag's text as its setting's value, checked, so clap reports a bad one with its usage.
fn parse_setting_flag(setting: &'static Setting, text: &str) -> Result<Option<Value>, String> {
    let value = setting.parse_text(text)?;
    if let Some(value) = &value {
        setting.check(value)?;
    }
    Ok(value)
}

impl clap::FromArgMatches for SettingFlags {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let given = SETTINGS.iter().filter_map(|setting| {
            let flag = setting.flag?;
            let value = matches.get_one::<Option<Value>>(flag)?.clone()?;
            Some((setting.key, value))
        });
        Ok(SettingFlags(given.collect()))
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl clap::Args for SettingFlags {
    fn augment_args(command: clap::Command) -> clap::Command {
        SETTINGS.iter().fold(command, |command, setting| {
            let Some(flag) = setting.flag else {
                return command;
            };
            let values = match setting.kind {
                Kind::Choice { names } => format!(": {}", names.join(", ")),
                _ => String::new(),
            };
            command.arg(
                clap::Arg::new(flag)
                    .long(flag)
                    .value_name(setting.value_name)
                    .help(format!("{}{values} ({})", setting.help, setting.key))
                    .value_parser(move |text: &str| parse_setting_flag(setting, text)),
            )
        })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

impl AppArgs {
    /// The resolved configuration: defaults < config file < these flags.
    pub fn resolve(&self) -> anyhow::Result<AppConfig> {
        let overrides = ConfigOverrides {
            model_dir: self.model.clone(),
            synthetic: self.synthetic,
            chats_dir: self.chats_dir.clone(),
            cache_dir: self.cache_dir.clone(),
            remote_url: self.remote.remote.clone(),
            remote_model: self.remote.remote_model.clone(),
            remote_timeout_secs: self.remote.remote_timeout,
            settings: self.settings.0.clone(),
        };
        Ok(config::load(self.config.as_deref(), &overrides)?)
    }
}

/// The engine status to start with: a checkpoint directory that does not exist is explained on
/// screen (download command, demo) instead of failing with an error dump.
pub fn initial_engine_status(config: &AppConfig) -> EngineStatus {
    if config.remote.url.is_some() {
        return EngineStatus::Loading {
            stage: "starting".to_string(),
            done: 0,
            total: 1,
        };
    }
    match &config.model {
        ModelSource::Checkpoint(dir) if !crate::model::looks_loadable(dir) => {
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

/// What the loop receives: terminal input, engine events and finished file work on one channel.
enum Input {
    Terminal(crossterm::event::Event, Instant),
    Engine(Event),
    /// The engine's event channel closed while the app was running.
    EngineGone,
    Stored(StoreOutcome),
    /// SIGTERM, SIGINT or SIGHUP arrived.
    Signal(i32),
    /// Something a helper thread could not do, for the status line.
    Notice(String),
}

/// The signals that end the app the orderly way: terminal restored, chat saved, exit status
/// 128 + the signal's number as a shell reports a process the signal killed.
pub const EXIT_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGHUP,
];

/// Runs the app until the user quits. `start_engine` starts the engine thread sending its events
/// to the given sender (the caller chooses the model and chat pieces, see `EngineHandle::spawn`).
pub fn run_app(
    config: AppConfig,
    demo: bool,
    start_engine: impl FnOnce(&AppConfig, Sender<Event>) -> Result<EngineHandle, EngineError>,
) -> anyhow::Result<()> {
    let chats_dir = config
        .chats_dir
        .clone()
        .or_else(config::default_chats_dir)
        .context("no platform data directory for saved chats; set paths.chats_dir")?;
    let status = initial_engine_status(&config);
    let store = ChatStore::new(chats_dir);
    let mut app = App::new(config.settings.clone(), store.clone(), status.clone());
    if demo {
        app.start_demo(Instant::now());
    }

    let panic_notes = install_panic_hook(restore_terminal);
    // From here on these signals no longer kill the process: the loop hears of them and ends.
    let mut signals = signal_hook::iterator::Signals::new(EXIT_SIGNALS)
        .context("cannot install the signal handlers")?;
    let signals_handle = signals.handle();
    // Before the input thread starts: setting up asks the terminal about its keyboard protocol and
    // reads the answer, which the input thread would otherwise take (and hold the reader meanwhile).
    let (mut terminal, guard) = setup_terminal()?;
    let (input_sender, inputs) = mpsc::channel();
    let (event_sender, engine_events) = mpsc::channel();
    let engine = match status {
        EngineStatus::ModelMissing { .. } => None,
        _ => Some(Arc::new(start_engine(&config, event_sender)?)),
    };
    // Requests for the engine are built (a copy of the whole chat) and sent here, in order with
    // the other commands, so a long chat never holds up the screen.
    let (engine_work, engine_inbox) = mpsc::channel::<EngineWork>();
    let feeder_engine = engine.clone();
    let feeder_notices = input_sender.clone();
    let feeder = std::thread::Builder::new()
        .name("ossterm-engine-requests".to_string())
        .spawn(move || {
            for work in engine_inbox {
                let command = match work {
                    EngineWork::Command(command) => command,
                    EngineWork::Generate(job) => Command::Generate(Box::new(job.request())),
                    EngineWork::Resume(chat) => Command::Resume(Box::new(chat.conversation())),
                };
                if let Some(engine) = &feeder_engine {
                    if let Err(error) = engine.send(command) {
                        let _ = feeder_notices.send(Input::Notice(error.to_string()));
                    }
                }
            }
        })?;
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
    // File work (saving a chat of any size, listing chats) off the UI thread, in order.
    let (store_requests, store_inbox) = mpsc::channel::<StoreRequest>();
    let stored = input_sender.clone();
    let store_thread = std::thread::Builder::new()
        .name("ossterm-chat-files".to_string())
        .spawn(move || {
            for request in store_inbox {
                let _ = stored.send(Input::Stored(store.perform(request)));
            }
        })?;
    let signalled = input_sender.clone();
    std::thread::Builder::new()
        .name("ossterm-signals".to_string())
        .spawn(move || {
            for signal in signals.forever() {
                if signalled.send(Input::Signal(signal)).is_err() {
                    return;
                }
            }
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
        &LoopHooks {
            engine: engine.as_deref(),
            engine_work: &engine_work,
            store: &store_requests,
            panic_notes: &panic_notes,
            test_panic_armed,
        },
    );
    // Saves already asked for (the last one on a signal) finish before the process ends.
    drop(engine_work);
    let _ = feeder.join();
    drop(store_requests);
    let _ = store_thread.join();
    drop(guard);
    signals_handle.close();
    if let Ok(notes) = panic_notes.lock() {
        for note in notes.iter() {
            eprintln!("{note}");
        }
    }
    if let Ok(Some(signal)) = result {
        // The engine is not waited for: it may be loading for minutes, and the chat is saved.
        std::process::exit(128 + signal);
    }
    if let Some(engine) = engine.and_then(Arc::into_inner) {
        engine.shutdown();
    }
    result.map(|_| ())
}

/// Work for the thread that sends to the engine.
enum EngineWork {
    Command(Command),
    Generate(GenerateJob),
    Resume(Box<ChatSnapshot>),
}

/// What the event loop needs besides the app and its input channel.
struct LoopHooks<'a> {
    engine: Option<&'a EngineHandle>,
    engine_work: &'a Sender<EngineWork>,
    store: &'a Sender<StoreRequest>,
    panic_notes: &'a PanicNotes,
    /// [`TEST_PANIC_ENV`] is set: [`TEST_PANIC_KEY`] panics.
    test_panic_armed: bool,
}

/// Whether the loop goes on after an effect.
enum Flow {
    Continue,
    Quit,
}

/// Carries out one effect of `App::update`; what the app should hear about comes back as messages.
fn perform(
    effect: Effect,
    hooks: &LoopHooks,
    repaint_all: &mut bool,
    replies: &mut Vec<Msg>,
) -> anyhow::Result<Flow> {
    let mut to_engine = |work: EngineWork| {
        if hooks.engine_work.send(work).is_err() {
            replies.push(Msg::Notice("the engine request thread ended".to_string()));
        }
    };
    match effect {
        // At once: the engine's cancel mark stops a request even before its command arrives.
        Effect::Engine(Command::Cancel(id)) => {
            if let Some(engine) = hooks.engine {
                engine.cancel(id);
            }
        }
        Effect::Engine(command) => to_engine(EngineWork::Command(command)),
        Effect::Generate(job) => to_engine(EngineWork::Generate(job)),
        Effect::Resume(chat) => to_engine(EngineWork::Resume(chat)),
        Effect::Store(request) => {
            if hooks.store.send(request).is_err() {
                replies.push(Msg::Notice("the chat file thread ended".to_string()));
            }
        }
        Effect::Copy(text) => {
            let mut stdout = std::io::stdout();
            stdout.write_all(osc52_sequence(&text).as_bytes())?;
            stdout.flush()?;
        }
        Effect::Redraw => *repaint_all = true,
        Effect::Quit => return Ok(Flow::Quit),
    }
    Ok(Flow::Continue)
}

/// Runs until the user quits (`None`) or a signal of [`EXIT_SIGNALS`] arrives (`Some(signal)`,
/// after asking for the chat's last save).
fn event_loop(
    terminal: &mut Terminal<CrosstermBackend<std::io::Stdout>>,
    app: &mut App,
    inputs: &mpsc::Receiver<Input>,
    hooks: &LoopHooks,
) -> anyhow::Result<Option<i32>> {
    let mut dirty = true;
    let mut last_draw = Instant::now() - FRAME_INTERVAL;
    // Keys read since the last frame, timed until that frame is on screen.
    let mut pending_keys: Vec<Instant> = Vec::new();
    let mut repaint_all = false;
    let mut replies: Vec<Msg> = Vec::new();
    let mut last_tick = Instant::now();
    loop {
        if dirty && (last_draw.elapsed() >= FRAME_INTERVAL || !pending_keys.is_empty()) {
            let size = terminal.size()?;
            let (width, height) = conversation_viewport(
                ratatui::layout::Rect::from((ratatui::layout::Position::ORIGIN, size)),
                app,
            );
            app.update(Msg::Layout { width, height }, Instant::now());
            if std::mem::take(&mut repaint_all) {
                terminal.clear()?;
            }
            terminal.draw(|frame| draw(frame, app))?;
            let drawn = Instant::now();
            if !pending_keys.is_empty() {
                let latencies = pending_keys
                    .drain(..)
                    .map(|read_at| drawn.saturating_duration_since(read_at))
                    .collect();
                // Shown with the next frame, as the gauge always lags the frame it measures.
                app.update(Msg::KeysDrawn(latencies), drawn);
            }
            last_draw = drawn;
            dirty = false;
        }
        let mut wait = if dirty {
            FRAME_INTERVAL.saturating_sub(last_draw.elapsed())
        } else {
            Duration::from_secs(1)
        };
        if app.wants_ticks() {
            let due = crate::tui::demo::TICK.saturating_sub(last_tick.elapsed());
            if due.is_zero() {
                last_tick = Instant::now();
                replies.push(Msg::Tick);
                while let Some(message) = replies.pop() {
                    for effect in app.update(message, Instant::now()) {
                        if let Flow::Quit = perform(effect, hooks, &mut repaint_all, &mut replies)?
                        {
                            return Ok(None);
                        }
                    }
                }
                dirty = true;
                continue;
            }
            wait = wait.min(due);
        }
        let first = match inputs.recv_timeout(wait) {
            Ok(input) => input,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
        };
        // Drain everything already queued so a burst of tokens costs one frame.
        for input in std::iter::once(first).chain(inputs.try_iter()) {
            let message = match input {
                Input::Engine(event) => Msg::Engine(event),
                Input::Stored(outcome) => Msg::Stored(outcome),
                Input::Notice(text) => Msg::Notice(text),
                Input::Signal(signal) => {
                    // Everything received so far (a reply as far as it streamed, settings not yet
                    // written) goes to the chat file.
                    if let Some(request) = app.save_request() {
                        let _ = hooks.store.send(request);
                    }
                    return Ok(Some(signal));
                }
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
            replies.push(message);
            while let Some(message) = replies.pop() {
                for effect in app.update(message, Instant::now()) {
                    if let Flow::Quit = perform(effect, hooks, &mut repaint_all, &mut replies)? {
                        return Ok(None);
                    }
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
    let api_key = args.remote.api_key.clone();
    run_app(config, args.demo, move |config, events| {
        Ok(start_engine(config, api_key, events))
    })
}

/// Starts the engine the configuration names: the remote one when `remote.url` is set, the
/// local model otherwise. The UI gets the same protocol from either.
pub fn start_engine(
    config: &AppConfig,
    api_key: Option<String>,
    events: Sender<Event>,
) -> EngineHandle {
    match config.remote.engine_config(api_key) {
        Some(remote) => crate::remote::spawn_remote_engine(remote, config.settings.clone(), events),
        None => start_model_engine(config, events),
    }
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
        SyntheticChoice::Gpt120b => (Preset::Gpt120b, None),
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
        attention: settings.attention,
        unembedding: settings.unembedding,
        ..LoadOptions::default()
    };
    let converting = format!("converting weights to {}", settings.weight_format);
    let (model, label, random_weights) = match source {
        ModelSource::Checkpoint(dir) => {
            let planned = crate::model::memory::Planned::Path(dir);
            let warning =
                crate::model::memory::check_before_load(planned, &options, settings.context_limit)
                    .map_err(model_error)?;
            let model = Model::load_with_progress(dir, &options, &mut |stage, done, total| {
                let what = match stage {
                    LoadStage::Converting => converting.as_str(),
                    _ => "mapping the checkpoint",
                };
                progress(what, done, total)
            })
            .map_err(model_error)?;
            let label = match warning {
                Some(_) => format!("gpt-oss ({}; weights paged from disk)", dir.display()),
                None => format!("gpt-oss ({})", dir.display()),
            };
            (model, label, false)
        }
        ModelSource::Synthetic(choice) => {
            let available = crate::engine::worker::available_memory_bytes();
            let (preset, fallback) = synthetic_preset(*choice, available);
            // Random weights live in memory: a preset that cannot fit (120b on most machines) is
            // refused with the numbers before anything is generated.
            let planned = crate::model::memory::Planned::Synthetic(preset);
            crate::model::memory::check_before_load(planned, &options, settings.context_limit)
                .map_err(model_error)?;
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
