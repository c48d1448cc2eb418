//! App state and the one function that changes it: [`App::update`] takes a [`Msg`] (a key, a mouse
//! event, an engine event, a tick) and returns [`Effect`]s for the loop to carry out (commands for
//! the engine, clipboard text, quit). Rendering is a pure function of this state (`view`).

use crate::engine::protocol::{
    CacheHits, Channel, ChatMessage, Command, Conversation, EngineInfo, Event, GenerateRequest,
    RequestId, RequestKind, Role, Settings, StatsSample, StopReason, SystemSettings,
};
use crate::tui::settings_panel::SettingField;
use crate::tui::store::{date_utc, ChatStore, SavedChat};
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseEvent, MouseEventKind};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};
use tui_textarea::TextArea;

/// Harmony's default knowledge cutoff line.
pub const KNOWLEDGE_CUTOFF: &str = crate::chat::conversation::DEFAULT_KNOWLEDGE_CUTOFF;

/// Decode-rate samples kept for the sparkline.
pub const SPARKLINE_SAMPLES: usize = 120;

/// How often the chat file is rewritten while a reply streams.
const STREAM_SAVE_INTERVAL: Duration = Duration::from_secs(2);

/// Lines one mouse-wheel notch scrolls.
const WHEEL_LINES: usize = 3;

/// Anything that can change the state.
#[derive(Clone, Debug)]
pub enum Msg {
    Key(KeyEvent),
    Mouse(MouseEvent),
    Paste(String),
    Engine(Event),
    /// The conversation pane's height changed (page size for PageUp/PageDown).
    Resize {
        conversation_height: u16,
    },
    /// The engine thread ended without being asked to (it panicked); the text says why.
    EngineStopped(String),
}

/// Work for the loop, outside the state.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    Engine(Command),
    /// Put this text on the clipboard (OSC 52).
    Copy(String),
    /// Repaint every cell of the screen, not only the ones that changed. Terminals disagree with
    /// the layout about the width of some characters (combining marks of some scripts, emoji),
    /// which can leave stale cells behind; a full repaint puts the screen right.
    Redraw,
    Quit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Focus {
    Input,
    Conversation,
    Settings,
}

/// What the engine thread is doing, as far as the UI knows.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineStatus {
    Loading {
        stage: String,
        done: u64,
        total: u64,
    },
    Ready,
    /// No checkpoint at `path`: the screen explains how to get one or run the demo.
    ModelMissing {
        path: PathBuf,
    },
    Failed(String),
}

#[derive(Clone, Debug, PartialEq)]
pub enum ReplyStatus {
    Prefill {
        done: usize,
        total: usize,
        reused: usize,
    },
    Streaming,
    Done(StopReason),
    Failed(String),
}

/// One assistant reply as shown.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub request_id: Option<RequestId>,
    pub reasoning: String,
    pub reasoning_tokens: usize,
    pub reasoning_time: Option<Duration>,
    pub answer: String,
    pub answer_tokens: usize,
    pub status: ReplyStatus,
    /// Reasoning shown in full after the answer started (toggled per turn).
    pub expanded: bool,
    pub hits: Option<CacheHits>,
    started: Option<Instant>,
    first_reasoning_at: Option<Instant>,
}

impl Reply {
    fn pending(request_id: RequestId, now: Instant) -> Reply {
        Reply {
            request_id: Some(request_id),
            reasoning: String::new(),
            reasoning_tokens: 0,
            reasoning_time: None,
            answer: String::new(),
            answer_tokens: 0,
            status: ReplyStatus::Prefill {
                done: 0,
                total: 0,
                reused: 0,
            },
            expanded: false,
            hits: None,
            started: Some(now),
            first_reasoning_at: None,
        }
    }

    /// A finished reply loaded from a file.
    pub fn finished(reasoning: String, answer: String) -> Reply {
        Reply {
            request_id: None,
            reasoning_tokens: 0,
            reasoning,
            reasoning_time: None,
            answer,
            answer_tokens: 0,
            status: ReplyStatus::Done(StopReason::Finished),
            expanded: false,
            hits: None,
            started: None,
            first_reasoning_at: None,
        }
    }

    pub fn is_active(&self) -> bool {
        matches!(
            self.status,
            ReplyStatus::Prefill { .. } | ReplyStatus::Streaming
        )
    }

    /// Reasoning streams live until the answer begins; afterwards it collapses unless expanded.
    pub fn reasoning_visible(&self) -> bool {
        self.expanded || (self.is_active() && self.answer.is_empty())
    }
}

/// The parts of a chat file the app shows no setting for, kept so a loaded chat is written back
/// with them.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatFileExtras {
    pub knowledge_cutoff: Option<String>,
    pub system: serde_json::Map<String, serde_json::Value>,
    pub conversation: serde_json::Map<String, serde_json::Value>,
}

impl Default for ChatFileExtras {
    fn default() -> Self {
        ChatFileExtras {
            knowledge_cutoff: Some(KNOWLEDGE_CUTOFF.to_string()),
            system: serde_json::Map::new(),
            conversation: serde_json::Map::new(),
        }
    }
}

/// One exchange: what the user sent and the reply to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    pub user: String,
    pub reply: Option<Reply>,
}

/// A modal layer over the main screen.
#[derive(Debug)]
pub enum Overlay {
    Help,
    OpenChat {
        chats: Vec<SavedChat>,
        selected: usize,
    },
    EditSetting {
        field: SettingField,
        editor: Box<TextArea<'static>>,
    },
}

/// Key-to-screen latency, measured by the loop (time from reading a key to finishing the draw).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Latency {
    pub last: Duration,
    pub max: Duration,
    pub samples: u64,
}

pub struct App {
    pub turns: Vec<Turn>,
    pub input: TextArea<'static>,
    pub focus: Focus,
    pub overlay: Option<Overlay>,
    /// The settings as the user chose them.
    pub settings: Settings,
    /// The settings the engine reported as applied.
    pub engine_settings: Option<Settings>,
    pub engine: EngineStatus,
    pub engine_info: Option<EngineInfo>,
    pub stats: Option<StatsSample>,
    pub decode_rates: VecDeque<u64>,
    /// Transient message for the status line (last action's result or a warning).
    pub notice: Option<String>,
    pub settings_progress: Option<(String, u64, u64)>,
    pub settings_cursor: usize,
    pub selected_turn: Option<usize>,
    /// First visible wrapped line; `None` follows the stream.
    pub scroll_top: Option<usize>,
    pub conversation_height: u16,
    /// First line of the last screenful at the last draw (where "scroll up" starts when following).
    last_bottom: usize,
    pub latency: Latency,
    pub store: ChatStore,
    pub chat_path: Option<PathBuf>,
    /// The date in this chat's system message; fixed so the prompt prefix (and its cache) stays
    /// valid. `None` (a loaded chat without one) leaves the line out, as harmony does.
    pub chat_date: Option<String>,
    /// What a loaded chat file holds beyond the settings the app edits (its knowledge cutoff, fields
    /// of other tools), written back unchanged.
    pub chat_file_extras: ChatFileExtras,
    pub max_threads: usize,
    history: Vec<String>,
    history_cursor: Option<usize>,
    active: Option<RequestId>,
    next_request_id: RequestId,
    pending_kind: RequestKind,
    last_stream_save: Option<Instant>,
}

fn new_input() -> TextArea<'static> {
    let mut input = TextArea::default();
    input.set_placeholder_text("Message (Enter sends, Alt-Enter new line, F1 help)");
    input.set_cursor_line_style(ratatui::style::Style::default());
    input
}

impl App {
    pub fn new(settings: Settings, store: ChatStore, engine: EngineStatus) -> App {
        let available = std::thread::available_parallelism().map_or(1, |count| count.get());
        App {
            turns: Vec::new(),
            input: new_input(),
            focus: Focus::Input,
            overlay: None,
            max_threads: available.max(settings.threads),
            settings,
            engine_settings: None,
            engine,
            engine_info: None,
            stats: None,
            decode_rates: VecDeque::with_capacity(SPARKLINE_SAMPLES),
            notice: None,
            settings_progress: None,
            settings_cursor: 0,
            selected_turn: None,
            scroll_top: None,
            conversation_height: 20,
            last_bottom: 0,
            latency: Latency::default(),
            store,
            chat_path: None,
            chat_date: Some(date_utc(SystemTime::now())),
            chat_file_extras: ChatFileExtras::default(),
            history: Vec::new(),
            history_cursor: None,
            active: None,
            next_request_id: 1,
            pending_kind: RequestKind::NewTurn,
            last_stream_save: None,
        }
    }

    /// The request being generated, if any.
    pub fn active_request(&self) -> Option<RequestId> {
        self.active
    }

    pub fn is_generating(&self) -> bool {
        self.active.is_some()
    }

    /// The conversation in the chat file's shape. Replies still streaming are included as far as
    /// they got, so a crash mid-reply keeps what was received.
    pub fn conversation(&self) -> Conversation {
        let mut messages = Vec::new();
        for turn in &self.turns {
            messages.push(ChatMessage::user(turn.user.clone()));
            if let Some(reply) = &turn.reply {
                if !reply.reasoning.is_empty() {
                    messages.push(ChatMessage::assistant(
                        Channel::Analysis,
                        reply.reasoning.clone(),
                    ));
                }
                if !reply.answer.is_empty() {
                    messages.push(ChatMessage::assistant(Channel::Final, reply.answer.clone()));
                }
            }
        }
        let extras = &self.chat_file_extras;
        let identity = &self.settings.system_prompt;
        Conversation {
            system: SystemSettings {
                // An empty identity leaves harmony's identity line out rather than writing it blank.
                identity: (!identity.trim().is_empty()).then(|| identity.clone()),
                reasoning: Some(self.settings.reasoning_effort),
                date: self.chat_date.clone(),
                knowledge_cutoff: extras.knowledge_cutoff.clone(),
                extra: extras.system.clone(),
            },
            developer: (!self.settings.developer_instructions.trim().is_empty())
                .then(|| self.settings.developer_instructions.clone()),
            messages,
            extra: extras.conversation.clone(),
        }
    }

    /// The conversation for the request that answers the last turn: every turn before it in full,
    /// and the last one's user message only.
    fn request_conversation(&self) -> Conversation {
        let mut conversation = self.conversation();
        if let Some(last) = self.turns.last() {
            if let Some(reply) = &last.reply {
                let reply_messages = usize::from(!reply.reasoning.is_empty())
                    + usize::from(!reply.answer.is_empty());
                conversation
                    .messages
                    .truncate(conversation.messages.len() - reply_messages);
            }
        }
        conversation
    }

    /// Replaces the chat with a loaded conversation; its system and developer text become settings.
    pub fn load_conversation(&mut self, conversation: Conversation, path: PathBuf) -> Vec<Effect> {
        let mut effects = self.cancel_active();
        self.turns.clear();
        for message in conversation.messages {
            match message.role {
                Role::User => self.turns.push(Turn {
                    user: message.content,
                    reply: None,
                }),
                Role::Assistant => {
                    let Some(turn) = self.turns.last_mut() else {
                        continue;
                    };
                    let reply = turn
                        .reply
                        .get_or_insert_with(|| Reply::finished(String::new(), String::new()));
                    match message.channel {
                        Some(Channel::Analysis) => reply.reasoning.push_str(&message.content),
                        _ => reply.answer.push_str(&message.content),
                    }
                }
            }
        }
        let system = conversation.system;
        let mut settings = self.settings.clone();
        settings.system_prompt = system.identity.unwrap_or_default();
        // A file without a reasoning line keeps the current effort (the app always writes one).
        if let Some(effort) = system.reasoning {
            settings.reasoning_effort = effort;
        }
        settings.developer_instructions = conversation.developer.unwrap_or_default();
        self.chat_date = system.date;
        self.chat_file_extras = ChatFileExtras {
            knowledge_cutoff: system.knowledge_cutoff,
            system: system.extra,
            conversation: conversation.extra,
        };
        effects.extend(self.change_settings(settings));
        self.chat_path = Some(path);
        self.scroll_top = None;
        self.selected_turn = None;
        effects
    }

    pub fn update(&mut self, message: Msg, now: Instant) -> Vec<Effect> {
        match message {
            Msg::Key(key) if key.kind != KeyEventKind::Release => self.on_key(key, now),
            Msg::Key(_) => Vec::new(),
            Msg::Mouse(mouse) => {
                match mouse.kind {
                    MouseEventKind::ScrollUp => self.scroll_by(-(WHEEL_LINES as isize)),
                    MouseEventKind::ScrollDown => self.scroll_by(WHEEL_LINES as isize),
                    _ => {}
                }
                Vec::new()
            }
            Msg::Paste(text) => {
                match &mut self.overlay {
                    Some(Overlay::EditSetting { editor, .. }) => {
                        editor.insert_str(text);
                    }
                    _ => {
                        self.focus = Focus::Input;
                        self.input.insert_str(text);
                    }
                }
                Vec::new()
            }
            Msg::Engine(event) => self.on_engine_event(event, now),
            Msg::EngineStopped(reason) => {
                if let Some(id) = self.active.take() {
                    let message = format!("the engine stopped: {reason}");
                    if let Some(reply) = self
                        .turns
                        .last_mut()
                        .and_then(|turn| turn.reply.as_mut())
                        .filter(|reply| reply.request_id == Some(id))
                    {
                        reply.status = ReplyStatus::Failed(message);
                    }
                    self.autosave();
                }
                self.engine = EngineStatus::Failed(format!("The engine stopped: {reason}"));
                self.notice = Some(format!(
                    "The engine stopped ({reason}); the chat is saved, restart ossterm"
                ));
                Vec::new()
            }
            Msg::Resize {
                conversation_height,
            } => {
                self.conversation_height = conversation_height.max(1);
                Vec::new()
            }
        }
    }

    fn on_key(&mut self, key: KeyEvent, now: Instant) -> Vec<Effect> {
        let control = key.modifiers.contains(KeyModifiers::CONTROL);
        if control && matches!(key.code, KeyCode::Char('c') | KeyCode::Char('q')) {
            let mut effects = self.cancel_active();
            effects.push(Effect::Quit);
            return effects;
        }
        if self.overlay.is_some() {
            return self.on_overlay_key(key);
        }
        let input_empty = self.input.lines().iter().all(|line| line.is_empty());
        let question_opens_help =
            key.code == KeyCode::Char('?') && (self.focus != Focus::Input || input_empty);
        if key.code == KeyCode::F(1) || question_opens_help {
            self.overlay = Some(Overlay::Help);
            return Vec::new();
        }
        if control {
            match key.code {
                KeyCode::Char('r') => return self.regenerate(now),
                KeyCode::Char('e') => return self.edit_last_user_message(),
                KeyCode::Char('n') => return self.new_chat(),
                KeyCode::Char('s') => {
                    self.save_now();
                    return Vec::new();
                }
                KeyCode::Char('o') => {
                    self.open_chat_list();
                    return Vec::new();
                }
                KeyCode::Char('y') => return self.copy_last_answer(),
                KeyCode::Char('l') => return vec![Effect::Redraw],
                KeyCode::Char('t') => {
                    self.toggle_reasoning(self.selected_turn.or(self.turns.len().checked_sub(1)));
                    return Vec::new();
                }
                KeyCode::End => {
                    self.scroll_top = None;
                    return Vec::new();
                }
                _ => {}
            }
        }
        match key.code {
            KeyCode::Esc => {
                if self.is_generating() {
                    self.notice = Some("Stopping…".to_string());
                    return self.cancel_active();
                }
                self.focus = Focus::Input;
                return Vec::new();
            }
            KeyCode::Tab => {
                self.focus = match self.focus {
                    Focus::Input => Focus::Conversation,
                    Focus::Conversation => Focus::Settings,
                    Focus::Settings => Focus::Input,
                };
                return Vec::new();
            }
            KeyCode::BackTab => {
                self.focus = match self.focus {
                    Focus::Input => Focus::Settings,
                    Focus::Conversation => Focus::Input,
                    Focus::Settings => Focus::Conversation,
                };
                return Vec::new();
            }
            KeyCode::PageUp => {
                self.scroll_by(-(self.page() as isize));
                return Vec::new();
            }
            KeyCode::PageDown => {
                self.scroll_by(self.page() as isize);
                return Vec::new();
            }
            _ => {}
        }
        match self.focus {
            Focus::Input => self.on_input_key(key, now),
            Focus::Conversation => {
                self.on_conversation_key(key);
                Vec::new()
            }
            Focus::Settings => self.on_settings_key(key),
        }
    }

    fn page(&self) -> usize {
        usize::from(self.conversation_height)
            .saturating_sub(2)
            .max(1)
    }

    fn on_input_key(&mut self, key: KeyEvent, now: Instant) -> Vec<Effect> {
        let newline_modifier = key
            .modifiers
            .intersects(KeyModifiers::ALT | KeyModifiers::SHIFT);
        match key.code {
            KeyCode::Enter if newline_modifier => {
                self.input.insert_newline();
                Vec::new()
            }
            KeyCode::Enter => self.send_input(now),
            KeyCode::Up if self.input.cursor().0 == 0 && !self.history.is_empty() => {
                self.recall_history(-1);
                Vec::new()
            }
            KeyCode::Down
                if self.input.cursor().0 + 1 >= self.input.lines().len()
                    && self.history_cursor.is_some() =>
            {
                self.recall_history(1);
                Vec::new()
            }
            _ => {
                self.input.input(key);
                Vec::new()
            }
        }
    }

    fn recall_history(&mut self, direction: isize) {
        let next = match (self.history_cursor, direction < 0) {
            (None, true) => Some(self.history.len() - 1),
            (None, false) => None,
            (Some(0), true) => Some(0),
            (Some(index), true) => Some(index - 1),
            (Some(index), false) if index + 1 < self.history.len() => Some(index + 1),
            (Some(_), false) => None,
        };
        self.history_cursor = next;
        let text = next.map_or(String::new(), |index| self.history[index].clone());
        self.set_input_text(&text);
    }

    fn set_input_text(&mut self, text: &str) {
        let mut input = TextArea::new(text.split('\n').map(str::to_string).collect());
        input.set_placeholder_text("Message (Enter sends, Alt-Enter new line, F1 help)");
        input.set_cursor_line_style(ratatui::style::Style::default());
        input.move_cursor(tui_textarea::CursorMove::Bottom);
        input.move_cursor(tui_textarea::CursorMove::End);
        self.input = input;
    }

    fn on_conversation_key(&mut self, key: KeyEvent) {
        let count = self.turns.len();
        match key.code {
            KeyCode::Up if count > 0 => {
                self.selected_turn = Some(
                    self.selected_turn
                        .map_or(count - 1, |index| index.saturating_sub(1)),
                );
            }
            KeyCode::Down if count > 0 => {
                self.selected_turn = Some(
                    self.selected_turn
                        .map_or(count - 1, |index| (index + 1).min(count - 1)),
                );
            }
            KeyCode::Enter | KeyCode::Char(' ') => self.toggle_reasoning(self.selected_turn),
            KeyCode::Home => self.scroll_top = Some(0),
            KeyCode::End => self.scroll_top = None,
            _ => {}
        }
    }

    fn toggle_reasoning(&mut self, turn: Option<usize>) {
        let reply = turn
            .and_then(|index| self.turns.get_mut(index))
            .and_then(|turn| turn.reply.as_mut());
        match reply {
            Some(reply) if !reply.reasoning.is_empty() => reply.expanded = !reply.expanded,
            _ => self.notice = Some("No reasoning to expand in that turn".to_string()),
        }
    }

    fn on_settings_key(&mut self, key: KeyEvent) -> Vec<Effect> {
        let field = SettingField::ALL[self.settings_cursor];
        match key.code {
            KeyCode::Up => {
                self.settings_cursor = self.settings_cursor.saturating_sub(1);
                Vec::new()
            }
            KeyCode::Down => {
                self.settings_cursor = (self.settings_cursor + 1).min(SettingField::ALL.len() - 1);
                Vec::new()
            }
            KeyCode::Left | KeyCode::Right | KeyCode::Char('-') | KeyCode::Char('+')
                if !field.is_text() =>
            {
                let direction = if matches!(key.code, KeyCode::Right | KeyCode::Char('+')) {
                    1
                } else {
                    -1
                };
                let mut next = self.settings.clone();
                field.step(&mut next, direction, self.max_threads);
                self.change_settings(next)
            }
            KeyCode::Enter if field.is_text() => {
                let text = field.text(&self.settings).unwrap_or_default();
                let mut editor = TextArea::new(text.split('\n').map(str::to_string).collect());
                editor.set_cursor_line_style(ratatui::style::Style::default());
                self.overlay = Some(Overlay::EditSetting {
                    field,
                    editor: Box::new(editor),
                });
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// Adopts `next` and tells the engine; warns when the change costs a full re-prefill.
    fn change_settings(&mut self, next: Settings) -> Vec<Effect> {
        if next == self.settings {
            return Vec::new();
        }
        let mut notice = settings_change_notice(&self.settings, &next, !self.turns.is_empty());
        if self.is_generating() {
            notice = Some(match notice {
                Some(text) => format!("{text} (after this turn)"),
                None => "Settings apply after this turn".to_string(),
            });
        }
        if notice.is_some() {
            self.notice = notice;
        }
        self.settings = next;
        vec![Effect::Engine(Command::ApplySettings(Box::new(
            self.settings.clone(),
        )))]
    }

    fn on_overlay_key(&mut self, key: KeyEvent) -> Vec<Effect> {
        let Some(overlay) = self.overlay.take() else {
            return Vec::new();
        };
        match overlay {
            Overlay::Help => {
                // Any key closes help; F1 and ? toggle.
                Vec::new()
            }
            Overlay::OpenChat {
                chats,
                mut selected,
            } => match key.code {
                KeyCode::Esc => Vec::new(),
                KeyCode::Up => {
                    selected = selected.saturating_sub(1);
                    self.overlay = Some(Overlay::OpenChat { chats, selected });
                    Vec::new()
                }
                KeyCode::Down => {
                    selected = (selected + 1).min(chats.len().saturating_sub(1));
                    self.overlay = Some(Overlay::OpenChat { chats, selected });
                    Vec::new()
                }
                KeyCode::Enter => match chats.get(selected) {
                    Some(chat) => match self.store.load(&chat.path) {
                        Ok(conversation) => {
                            let effects = self.load_conversation(conversation, chat.path.clone());
                            self.notice = Some(format!("Opened {}", chat.path.display()));
                            effects
                        }
                        Err(error) => {
                            self.notice = Some(error.to_string());
                            Vec::new()
                        }
                    },
                    None => Vec::new(),
                },
                _ => {
                    self.overlay = Some(Overlay::OpenChat { chats, selected });
                    Vec::new()
                }
            },
            Overlay::EditSetting { field, mut editor } => {
                let newline = key
                    .modifiers
                    .intersects(KeyModifiers::ALT | KeyModifiers::SHIFT);
                match key.code {
                    KeyCode::Esc => Vec::new(),
                    KeyCode::Enter if !newline => {
                        let mut next = self.settings.clone();
                        field.set_text(&mut next, editor.lines().join("\n"));
                        self.change_settings(next)
                    }
                    KeyCode::Enter => {
                        editor.insert_newline();
                        self.overlay = Some(Overlay::EditSetting { field, editor });
                        Vec::new()
                    }
                    _ => {
                        editor.input(key);
                        self.overlay = Some(Overlay::EditSetting { field, editor });
                        Vec::new()
                    }
                }
            }
        }
    }

    fn engine_ready(&self) -> bool {
        self.engine == EngineStatus::Ready
    }

    fn send_input(&mut self, now: Instant) -> Vec<Effect> {
        let text = self.input.lines().join("\n");
        if text.trim().is_empty() {
            return Vec::new();
        }
        if self.is_generating() {
            self.notice = Some("Still generating: Esc stops it".to_string());
            return Vec::new();
        }
        if !self.engine_ready() {
            self.notice = Some("The model is not ready yet".to_string());
            return Vec::new();
        }
        self.history.push(text.clone());
        self.history_cursor = None;
        self.input = new_input();
        self.turns.push(Turn {
            user: text,
            reply: None,
        });
        let kind = std::mem::replace(&mut self.pending_kind, RequestKind::NewTurn);
        self.start_request(kind, now)
    }

    fn start_request(&mut self, kind: RequestKind, now: Instant) -> Vec<Effect> {
        let id = self.next_request_id;
        self.next_request_id += 1;
        let conversation = self.request_conversation();
        if let Some(turn) = self.turns.last_mut() {
            turn.reply = Some(Reply::pending(id, now));
        }
        self.active = Some(id);
        self.scroll_top = None;
        self.selected_turn = None;
        self.notice = None;
        self.autosave();
        vec![Effect::Engine(Command::Generate(GenerateRequest {
            id,
            kind,
            conversation,
        }))]
    }

    fn regenerate(&mut self, now: Instant) -> Vec<Effect> {
        if self.is_generating() {
            self.notice = Some("Still generating: Esc stops it first".to_string());
            return Vec::new();
        }
        if !self.engine_ready() {
            self.notice = Some("The model is not ready yet".to_string());
            return Vec::new();
        }
        let Some(last) = self.turns.last_mut() else {
            self.notice = Some("Nothing to regenerate".to_string());
            return Vec::new();
        };
        last.reply = None;
        self.start_request(RequestKind::Regenerate, now)
    }

    fn edit_last_user_message(&mut self) -> Vec<Effect> {
        let effects = self.cancel_active();
        let Some(last) = self.turns.pop() else {
            self.notice = Some("No message to edit".to_string());
            return effects;
        };
        self.set_input_text(&last.user);
        self.focus = Focus::Input;
        self.pending_kind = RequestKind::EditAndResend;
        self.notice = Some("Editing the last message: Enter resends it".to_string());
        self.autosave();
        effects
    }

    fn new_chat(&mut self) -> Vec<Effect> {
        let effects = self.cancel_active();
        self.autosave();
        self.turns.clear();
        self.chat_path = None;
        self.chat_date = Some(date_utc(SystemTime::now()));
        self.chat_file_extras = ChatFileExtras::default();
        self.scroll_top = None;
        self.selected_turn = None;
        self.pending_kind = RequestKind::NewTurn;
        self.notice = Some("New chat".to_string());
        effects
    }

    fn copy_last_answer(&mut self) -> Vec<Effect> {
        let answer = self
            .turns
            .iter()
            .rev()
            .filter_map(|turn| turn.reply.as_ref())
            .find(|reply| !reply.answer.is_empty());
        match answer {
            Some(reply) => {
                let text = reply.answer.clone();
                self.notice = Some(format!(
                    "Copied the last answer ({} characters)",
                    text.chars().count()
                ));
                vec![Effect::Copy(text)]
            }
            None => {
                self.notice = Some("No answer to copy yet".to_string());
                Vec::new()
            }
        }
    }

    /// Cancels the running request, if any; the reply keeps what it received.
    fn cancel_active(&mut self) -> Vec<Effect> {
        match self.active {
            Some(id) => vec![Effect::Engine(Command::Cancel(id))],
            None => Vec::new(),
        }
    }

    fn open_chat_list(&mut self) {
        match self.store.list() {
            Ok((chats, _)) if chats.is_empty() => {
                self.notice = Some(format!("No saved chats in {}", self.store.dir().display()));
            }
            Ok((chats, unreadable)) => {
                if unreadable > 0 {
                    self.notice = Some(format!("{unreadable} unreadable chat files skipped"));
                }
                self.overlay = Some(Overlay::OpenChat { chats, selected: 0 });
            }
            Err(error) => self.notice = Some(error.to_string()),
        }
    }

    /// Ctrl-S: writes the chat file now and says where.
    pub fn save_now(&mut self) {
        if self.turns.is_empty() {
            self.notice = Some("Nothing to save yet".to_string());
            return;
        }
        match self.write_chat_file() {
            Ok(path) => self.notice = Some(format!("Saved {}", path.display())),
            Err(error) => self.notice = Some(error.to_string()),
        }
    }

    fn write_chat_file(&mut self) -> Result<PathBuf, crate::tui::store::StoreError> {
        let path = self
            .chat_path
            .get_or_insert_with(|| self.store.new_chat_path(SystemTime::now()))
            .clone();
        self.store.save(&path, &self.conversation())?;
        Ok(path)
    }

    fn autosave(&mut self) {
        if self.turns.is_empty() {
            return;
        }
        if let Err(error) = self.write_chat_file() {
            self.notice = Some(format!("Autosave failed: {error}"));
        }
    }

    fn active_reply(&mut self, id: RequestId) -> Option<&mut Reply> {
        if self.active != Some(id) {
            return None;
        }
        self.turns
            .last_mut()?
            .reply
            .as_mut()
            .filter(|reply| reply.request_id == Some(id))
    }

    fn on_engine_event(&mut self, event: Event, now: Instant) -> Vec<Effect> {
        match event {
            Event::LoadProgress { stage, done, total } => {
                self.engine = EngineStatus::Loading { stage, done, total }
            }
            Event::Ready(info) => {
                self.engine = EngineStatus::Ready;
                // Show what really runs: the model may not offer the configured formats.
                self.settings.weight_format = info.settings.weight_format;
                self.settings.activations = info.settings.activations;
                self.settings.kv_cache = info.settings.kv_cache;
                self.engine_settings = Some(info.settings.clone());
                self.engine_info = Some(info);
            }
            Event::PrefillProgress {
                id,
                done,
                total,
                reused,
            } => {
                if let Some(reply) = self.active_reply(id) {
                    reply.status = ReplyStatus::Prefill {
                        done,
                        total,
                        reused,
                    };
                }
            }
            Event::Token { id, channel, text } => {
                let Some(reply) = self.active_reply(id) else {
                    return Vec::new();
                };
                reply.status = ReplyStatus::Streaming;
                match channel {
                    Channel::Analysis => {
                        reply.first_reasoning_at.get_or_insert(now);
                        reply.reasoning.push_str(&text);
                        reply.reasoning_tokens += 1;
                    }
                    Channel::Final | Channel::Commentary => {
                        if reply.answer.is_empty() {
                            if let Some(start) = reply.first_reasoning_at {
                                reply.reasoning_time = Some(now.saturating_duration_since(start));
                            }
                        }
                        reply.answer.push_str(&text);
                        reply.answer_tokens += 1;
                    }
                }
                let due = self
                    .last_stream_save
                    .is_none_or(|at| now.saturating_duration_since(at) >= STREAM_SAVE_INTERVAL);
                if due {
                    self.last_stream_save = Some(now);
                    self.autosave();
                }
            }
            Event::Stats(sample) => {
                if self.is_generating() {
                    if let Some(rate) = sample.decode_tokens_per_second {
                        if self.decode_rates.len() == SPARKLINE_SAMPLES {
                            self.decode_rates.pop_front();
                        }
                        self.decode_rates.push_back((rate * 10.0).round() as u64);
                    }
                }
                self.stats = Some(sample);
            }
            Event::TurnDone {
                id,
                reason,
                hits,
                generated_tokens,
            } => {
                let was_active = self.active == Some(id);
                if let Some(reply) = self.active_reply(id) {
                    if reply.reasoning_time.is_none() {
                        if let Some(start) = reply.first_reasoning_at {
                            reply.reasoning_time = Some(now.saturating_duration_since(start));
                        }
                    }
                    reply.status = ReplyStatus::Done(reason);
                    reply.hits = Some(hits);
                    let took = reply
                        .started
                        .map(|start| now.saturating_duration_since(start));
                    let rate = hits.rate().map_or(String::new(), |rate| {
                        format!(", prefix cache {:.0}%", rate * 100.0)
                    });
                    self.notice = Some(format!(
                        "{}: {generated_tokens} tokens in {:.1} s{rate}",
                        capitalize(reason.describe()),
                        took.unwrap_or_default().as_secs_f64()
                    ));
                    self.autosave();
                }
                if was_active {
                    self.active = None;
                    // A streamed reply is the text most likely to have confused the terminal.
                    return vec![Effect::Redraw];
                }
            }
            Event::SettingsProgress { what, done, total } => {
                self.settings_progress = Some((what, done, total))
            }
            Event::SettingsApplied(applied) => {
                if applied.weight_format == self.settings.weight_format {
                    self.settings_progress = None;
                }
                self.engine_settings = Some(*applied);
            }
            Event::Notice(message) => self.notice = Some(message),
            Event::Error {
                id: Some(id),
                message,
            } => {
                if let Some(reply) = self.active_reply(id) {
                    reply.status = ReplyStatus::Failed(message.clone());
                    self.autosave();
                }
                if self.active == Some(id) {
                    self.active = None;
                }
                self.notice = Some(format!("Error: {message}"));
            }
            Event::Error { id: None, message } => {
                if matches!(self.engine, EngineStatus::Loading { .. }) {
                    self.engine = EngineStatus::Failed(message);
                } else {
                    self.settings_progress = None;
                    self.notice = Some(format!("Error: {message}"));
                }
            }
        }
        Vec::new()
    }

    /// Scrolls by `lines` (negative = up). Scrolling to the bottom resumes following the stream.
    /// The view clamps `scroll_top`; here only the intent is recorded.
    pub fn scroll_by(&mut self, lines: isize) {
        let current = self.scroll_top.unwrap_or(self.last_bottom);
        let next = if lines < 0 {
            current.saturating_sub(lines.unsigned_abs())
        } else {
            current.saturating_add(lines as usize)
        };
        self.scroll_top = Some(next);
    }

    /// Called by the view with the laid-out line count, so scroll state stays in range and reaching
    /// the bottom resumes following.
    pub fn settle_scroll(&mut self, total_lines: usize, height: usize) -> usize {
        let bottom = total_lines.saturating_sub(height);
        self.last_bottom = bottom;
        match self.scroll_top {
            Some(top) if top < bottom => top,
            _ => {
                self.scroll_top = None;
                bottom
            }
        }
    }
}

/// What the user should know about going from `previous` to `next`: the costly consequences first
/// (a whole-conversation re-prefill, a background re-quantization, a pool rebuild).
pub fn settings_change_notice(
    previous: &Settings,
    next: &Settings,
    has_turns: bool,
) -> Option<String> {
    const REPREFILL: &str = "the next turn re-prefills the whole conversation";
    let cause = if previous.reasoning_effort != next.reasoning_effort {
        Some(format!(
            "Reasoning effort {} changes the system message",
            next.reasoning_effort
        ))
    } else if previous.system_prompt != next.system_prompt {
        Some("The system prompt changed".to_string())
    } else if previous.developer_instructions != next.developer_instructions {
        Some("The developer instructions changed".to_string())
    } else if previous.activations != next.activations {
        Some(format!(
            "Activations {} keep the weights but need a new cache",
            next.activations
        ))
    } else if previous.kv_cache != next.kv_cache {
        Some(format!("KV cache {} needs a new cache", next.kv_cache))
    } else if previous.context_limit != next.context_limit {
        Some(format!(
            "Context limit {} needs a new cache",
            next.context_limit
        ))
    } else {
        None
    };
    if let Some(cause) = cause {
        return Some(if has_turns {
            format!("{cause}: {REPREFILL}")
        } else {
            cause
        });
    }
    if previous.weight_format != next.weight_format {
        return Some(format!(
            "Re-quantizing to {} in the background; the old weights keep serving",
            next.weight_format
        ));
    }
    if previous.threads != next.threads {
        return Some(format!(
            "Threads {}: the thread pool is rebuilt between turns",
            next.threads
        ));
    }
    None
}

fn capitalize(text: &str) -> String {
    let mut characters = text.chars();
    match characters.next() {
        Some(first) => first.to_uppercase().chain(characters).collect(),
        None => String::new(),
    }
}
