//! The chat page at the server's root, as llama-server has one: a browser pointed at the base
//! URL can talk to the model with nothing else installed. Two static files compiled into the
//! binary; the page calls the same `/v1/chat/completions` any client does (so the API key, when
//! the server has one, is asked for in the page), and `--no-webui` leaves the root unserved.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("webui/index.html");
const SCRIPT: &str = include_str!("webui/chat.js");

/// Only this server's own script and API: an injected string could neither load nor send
/// anything elsewhere (the page sets model text as text, never as HTML, in the first place).
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            // A new build's page replaces the old one at the next load.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub async fn page() -> Response {
    static_file("text/html; charset=utf-8", PAGE)
}

pub async fn script() -> Response {
    static_file("text/javascript; charset=utf-8", SCRIPT)
}
