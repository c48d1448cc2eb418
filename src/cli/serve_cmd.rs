//! `ossterm serve`: the OpenAI-compatible server.

use anyhow::Context;
use clap::Args;

use super::ModelArgs;
use crate::server::scheduler::SchedulerOptions;
use crate::server::{check_exposure, ServeOptions};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on; anything but loopback needs an API key.
    #[arg(long, default_value = "127.0.0.1", value_name = "HOST")]
    pub host: String,
    #[arg(long, default_value_t = 8080, value_name = "PORT")]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (default: the OSSTERM_API_KEY environment variable).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Sequences decoded together in one forward pass (each gets a KV slot of --context tokens).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub parallel: usize,
    /// Tokens each sequence holds, prompt and reply.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub context: usize,
    /// Requests that may wait for a free slot; more get 503.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub queue: usize,
    /// Prompt tokens prefilled per step while other sequences decode (bounds their stall).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub prefill_chunk: usize,
    /// On SIGTERM or Ctrl-C, seconds running requests get to finish before they are cancelled
    /// (a second signal cancels them at once).
    /// At most a day: a longer grace would only keep a stopping server from stopping.
    #[arg(long, default_value_t = 30, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub drain_seconds: u64,
    /// Compute with the exact reference path (slow; for checks).
    #[arg(long)]
    pub exact: bool,
    /// An origin (`https://app.example.com`) whose browser pages may call the API, besides
    /// pages on this machine (localhost); `*` for every origin. Repeatable.
    #[arg(long = "cors-origin", value_name = "ORIGIN", value_parser = parse_origin)]
    pub cors_origins: Vec<String>,
    /// Do not serve the chat page at the root URL (the API only).
    #[arg(long)]
    pub no_webui: bool,
}

/// `*`, or a scheme and host with an optional port (what a browser sends as `Origin`).
fn parse_origin(text: &str) -> Result<String, String> {
    let origin = text.trim_end_matches('/');
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    match rest {
        _ if origin == "*" => Ok(origin.to_owned()),
        Some(host) if !host.is_empty() && !host.contains(['/', '?', '#', ' ']) => {
            Ok(origin.to_owned())
        }
        _ => Err(format!(
            "{text:?} is not an origin: give scheme and host (and port), e.g. https://app.example.com, or *"
        )),
    }
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("OSSTERM_API_KEY").ok())
        .filter(|key| !key.is_empty());
    check_exposure(&args.host, api_key.as_deref())?;
    if args.parallel == 0 || args.context < 2 {
        anyhow::bail!("--parallel must be at least 1 and --context at least 2");
    }
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    // Every slot's KV cache is allocated at start: refuse what cannot fit before loading.
    let model = args
        .model
        .load_for_sequences(args.exact, args.parallel, args.context)?;
    let max_context = model.config.max_position_embeddings;
    if args.context > max_context {
        anyhow::bail!(
            "--context {} is longer than the model's {max_context} positions",
            args.context
        );
    }
    let pool = args.model.pool()?;
    let model_id = match (&args.model.model, args.model.synthetic) {
        (Some(dir), _) => dir
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| "gpt-oss".into()),
        (None, Some(preset)) => format!("synthetic-{}", preset.name()),
        (None, None) => "gpt-oss".into(),
    };
    let session = model.new_session(&pool, 1);
    let kv_bytes = (args.parallel.saturating_mul(args.context)).saturating_mul(
        crate::model::kv::KvShape::of(&model.config).bytes_per_position(session.kv_format()),
    );
    let options = ServeOptions {
        scheduler: SchedulerOptions {
            parallel: args.parallel,
            context: args.context,
            queue: args.queue,
            prefill_chunk: args.prefill_chunk,
        },
        api_key,
        model_id: model_id.clone(),
        max_body_bytes: crate::server::MAX_BODY_BYTES,
        handle_signals: true,
        drain_grace: std::time::Duration::from_secs(args.drain_seconds),
        cors_origins: args.cors_origins.clone(),
        web_ui: !args.no_webui,
    };
    let server = crate::server::start(session, options, listener)?;
    eprintln!(
        "ossterm serve: {model_id} ({}) on http://{}/v1 — {} sequences x {} tokens, KV {}{}",
        model.source,
        server.addr,
        args.parallel,
        args.context,
        super::model_cmds::human_bytes(kv_bytes as u64),
        if args.no_webui {
            String::new()
        } else {
            format!("; chat page at http://{}/", server.addr)
        }
    );
    server.wait()?;
    eprintln!("ossterm serve: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_origin;

    #[test]
    fn origins_are_scheme_and_host() {
        assert_eq!(parse_origin("*").unwrap(), "*");
        assert_eq!(
            parse_origin("https://app.example.com/").unwrap(),
            "https://app.example.com"
        );
        assert_eq!(
            parse_origin("http://10.0.0.2:3000").unwrap(),
            "http://10.0.0.2:3000"
        );
        for bad in [
            "app.example.com",
            "https://",
            "https://a.com/path",
            "ftp://a.com",
            "",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad}");
        }
    }
}
