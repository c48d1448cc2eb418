//! A conversation with one remote server, shared by the app's remote engine and
//! `ossterm run --remote`: picks the model, turns a [`Conversation`] into OpenAI messages, and
//! streams one reply as channel text. Blocking: it owns a small tokio runtime and waits on it,
//! as the engine thread and `run` are plain threads.

use crate::chat::{Channel, Conversation, ReasoningEffort, Role, Tokenizer};
use crate::engine::protocol::SamplingSettings;
use crate::remote::client::{
    ApiMessage, ChatOutcome, ChatParams, RemoteClient, RemoteError, RemoteModel, RemoteTarget,
    ServerMetrics,
};
use crate::remote::reply::ReplyDecoder;

/// The remote session's failures: the server's, or the runtime the client needs.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("cannot start the HTTP runtime: {0}")]
    Runtime(std::io::Error),
}

impl SessionError {
    /// The error with a hint of what to do, for the status line.
    pub fn describe(&self) -> String {
        match self {
            SessionError::Remote(error) => error.describe(),
            other => other.to_string(),
        }
    }

    /// Whether retrying the same request may work.
    pub fn is_transient(&self) -> bool {
        matches!(self, SessionError::Remote(error) if error.is_transient())
    }
}

/// A streamed reply's end, with what the harmony fallback could not read.
pub struct Reply {
    pub outcome: ChatOutcome,
    /// The server sent unparsed harmony text and ossterm's parser read it.
    pub parsed_harmony: bool,
    pub malformed: Vec<String>,
}

pub struct RemoteSession {
    client: RemoteClient,
    runtime: tokio::runtime::Runtime,
    /// `--remote-model`, if given: used as is, even if the server does not list it.
    requested_model: Option<String>,
    model: Option<RemoteModel>,
    /// For replies in raw harmony; `None` if the tokenizer did not load (such text then shows as
    /// it came).
    tokenizer: Option<&'static Tokenizer>,
    /// False once `/metrics` answered without ossterm's figures: it is not asked again.
    metrics_available: bool,
}

impl RemoteSession {
    pub fn new(
        target: RemoteTarget,
        requested_model: Option<String>,
    ) -> Result<RemoteSession, SessionError> {
        let client = RemoteClient::new(target)?;
        // One worker thread runs the connections' own tasks between requests: a stream dropped
        // on Stop is closed at once, so the server cancels, instead of lingering until the next
        // request polls the runtime again.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ossterm-remote-io")
            .enable_io()
            .enable_time()
            .build()
            .map_err(SessionError::Runtime)?;
        Ok(RemoteSession {
            client,
            runtime,
            model: requested_model.clone().map(|id| RemoteModel {
                id,
                context_length: None,
            }),
            requested_model,
            tokenizer: Tokenizer::shared().ok(),
            metrics_available: true,
        })
    }

    pub fn url(&self) -> &str {
        self.client.url()
    }

    /// The model requests go to, once known.
    pub fn model(&self) -> Option<&RemoteModel> {
        self.model.as_ref()
    }

    /// Asks `GET /v1/models` which model to use: the requested one (with the server's context
    /// length when listed) or, without one, the first listed. The text is a notice for the
    /// user: the other models when there are several, or a requested model the server lacks.
    pub fn resolve_model(&mut self) -> Result<(RemoteModel, Option<String>), SessionError> {
        let listed = self.runtime.block_on(self.client.list_models());
        let (model, notice) = match (&self.requested_model, listed) {
            (Some(requested), Ok(models)) => {
                let found = models.iter().find(|model| &model.id == requested).cloned();
                let notice = found.is_none().then(|| {
                    format!(
                        "{} does not list {requested} (it has: {}); asking for it anyway",
                        self.client.url(),
                        ids(&models)
                    )
                });
                let model = found.unwrap_or_else(|| RemoteModel {
                    id: requested.clone(),
                    context_length: None,
                });
                (model, notice)
            }
            // Some servers have no model list; the request itself will tell.
            (Some(requested), Err(error)) => (
                RemoteModel {
                    id: requested.clone(),
                    context_length: None,
                },
                Some(format!("cannot list the models: {}", error.describe())),
            ),
            (None, Ok(models)) => {
                let Some(first) = models.first().cloned() else {
                    return Err(RemoteError::NoModels {
                        url: self.client.url().to_string(),
                    }
                    .into());
                };
                let notice = (models.len() > 1).then(|| {
                    format!(
                        "{} models at {}: {}; using {} (--remote-model picks another)",
                        models.len(),
                        self.client.url(),
                        ids(&models),
                        first.id
                    )
                });
                (first, notice)
            }
            (None, Err(error)) => return Err(error.into()),
        };
        self.model = Some(model.clone());
        Ok((model, notice))
    }

    /// Streams the reply to `conversation` (whose last message is the user's): text goes to
    /// `emit` by channel as it arrives; `cancelled` is polled and a yes closes the connection.
    pub fn reply(
        &mut self,
        conversation: &Conversation,
        sampling: &SamplingSettings,
        effort: ReasoningEffort,
        cancelled: &dyn Fn() -> bool,
        emit: &mut dyn FnMut(Channel, &str),
    ) -> Result<Reply, SessionError> {
        let model = match &self.model {
            Some(model) => model.clone(),
            None => self.resolve_model()?.0,
        };
        let params = ChatParams {
            model: model.id,
            reasoning_effort: conversation.system.reasoning.unwrap_or(effort),
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: sampling.top_k,
            min_p: sampling.min_p,
            max_tokens: max_tokens(sampling),
            seed: sampling.seed,
        };
        let messages = api_messages(conversation);
        let mut decoder = ReplyDecoder::new(self.tokenizer);
        let result = self.runtime.block_on(self.client.chat(
            &messages,
            &params,
            cancelled,
            &mut |kind, text| decoder.push(kind, text, &mut |channel, text| emit(channel, text)),
        ));
        // What arrived before a failure is the user's too.
        decoder.finish(&mut |channel, text| emit(channel, text));
        if let Err(RemoteError::Status { status: 404, .. }) = &result {
            // A model picked from the list may have gone; the next request asks again.
            if self.requested_model.is_none() {
                self.model = None;
            }
        }
        Ok(Reply {
            outcome: result?,
            parsed_harmony: decoder.is_harmony(),
            malformed: std::mem::take(&mut decoder.malformed),
        })
    }

    /// An ossterm server's `/metrics`; a server that answers without them is not asked again
    /// (one that did not answer is).
    pub fn server_metrics(&mut self) -> Option<ServerMetrics> {
        if !self.metrics_available {
            return None;
        }
        match self.runtime.block_on(self.client.ossterm_metrics()) {
            Ok(Some(metrics)) => Some(metrics),
            Ok(None) => {
                self.metrics_available = false;
                None
            }
            Err(()) => None,
        }
    }
}

/// The token budget sent: `max_tokens` 0 means none (the server's default).
fn max_tokens(sampling: &SamplingSettings) -> Option<usize> {
    (sampling.max_tokens > 0).then_some(sampling.max_tokens)
}

fn ids(models: &[RemoteModel]) -> String {
    let names: Vec<&str> = models.iter().map(|model| model.id.as_str()).collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// The conversation as OpenAI messages. The developer instructions go first as a `system`
/// message, which gpt-oss servers render as harmony's developer message (the harmony system
/// message, with identity, date and reasoning effort, is the server's). An assistant turn is
/// its final text: earlier turns' reasoning is dropped, as harmony wants, and the server
/// renders the rest.
pub fn api_messages(conversation: &Conversation) -> Vec<ApiMessage> {
    let mut messages = Vec::with_capacity(conversation.messages.len() + 1);
    if let Some(developer) = conversation
        .developer
        .as_ref()
        .filter(|text| !text.is_empty())
    {
        messages.push(ApiMessage {
            role: "system",
            content: developer.clone(),
        });
    }
    for message in &conversation.messages {
        match (message.role, message.channel) {
            (Role::User, _) => messages.push(ApiMessage {
                role: "user",
                content: message.content.clone(),
            }),
            (Role::Assistant, Some(Channel::Analysis)) => {}
            (Role::Assistant, _) => match messages.last_mut() {
                // One turn's pieces (a commentary preamble, the final answer) are one message.
                Some(last) if last.role == "assistant" => last.content.push_str(&message.content),
                _ => messages.push(ApiMessage {
                    role: "assistant",
                    content: message.content.clone(),
                }),
            },
        }
    }
    messages
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatMessage;

    #[test]
    fn messages_carry_developer_text_and_final_answers_only() {
        let conversation = Conversation {
            developer: Some("Be brief.".to_string()),
            messages: vec![
                ChatMessage::user("hi"),
                ChatMessage::assistant(Channel::Analysis, "greeting"),
                ChatMessage::assistant(Channel::Final, "Hello"),
                ChatMessage::user("again"),
            ],
            ..Conversation::default()
        };
        let messages = api_messages(&conversation);
        let shape: Vec<(&str, &str)> = messages
            .iter()
            .map(|message| (message.role, message.content.as_str()))
            .collect();
        assert_eq!(
            shape,
            vec![
                ("system", "Be brief."),
                ("user", "hi"),
                ("assistant", "Hello"),
                ("user", "again")
            ]
        );
    }
}
