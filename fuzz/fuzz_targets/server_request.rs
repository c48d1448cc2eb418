//! `ossterm serve`'s request bodies, as a client could send them: the first byte picks the
//! endpoint (bit 3 clear: even `/v1/chat/completions` through `parse_chat_request` and
//! `prepare_chat`, odd `/v1/responses` through `continue_previous` and
//! `prepare_responses`; bit 3 set: even `/tokenize`, odd `/detokenize`; bit 4 set:
//! `/v1/completions` through `prepare_completion`) and the context size; the rest is the body.
//! Invariants: no panic; a refusal is a 4xx whose OpenAI-style body names a message; an accepted
//! request's prompt and token budget fit the context.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ossterm::server::api::{
    detokenize, parse_chat_request, parse_json, prepare_chat, tokenize, ApiError, ChatJob,
};
use ossterm::server::completions::{prepare_completion, CompletionRequest};
use ossterm::server::responses::{continue_previous, prepare_responses};
use ossterm_fuzz::{tokenizer, LimitingAllocator};

/// The tokenizer's tables and a few KiB of request.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(256);

/// `echoed`: a completion that echoes its prompt, which may ask for no new tokens (scoring).
fn check(result: Result<ChatJob, ApiError>, context: usize, echoed: bool) {
    match result {
        Ok(job) => {
            assert!(job.prompt.len() < context, "the prompt fills the context");
            assert!(job.max_tokens >= 1 || echoed, "no room to answer");
            assert!(job.prompt.len() + job.max_tokens <= context, "the budget overflows");
        }
        Err(error) => {
            assert!(error.status.is_client_error(), "{error:?}");
            let body = error.body();
            assert!(!body["error"]["message"].as_str().unwrap_or("").is_empty(), "{body}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    // Contexts from tiny (most prompts do not fit) to the server's default.
    let context = [16, 96, 512, 4096][usize::from(selector >> 1) % 4];
    if selector & 16 != 0 {
        match parse_json::<CompletionRequest>(body)
            .and_then(|request| prepare_completion(request, tokenizer(), context))
        {
            Ok(jobs) => {
                assert!(!jobs.is_empty(), "an accepted request has a prompt");
                for (job, echo) in jobs {
                    check(Ok(job), context, echo.is_some());
                }
            }
            Err(error) => check(Err(error), context, false),
        }
        return;
    }
    if selector & 8 != 0 {
        let reply = if selector & 1 == 0 {
            tokenize(body, tokenizer(), context)
        } else {
            detokenize(body, tokenizer())
        };
        if let Err(error) = reply {
            assert!(error.status.is_client_error(), "{error:?}");
        }
        return;
    }
    if selector & 1 == 0 {
        let result = parse_chat_request(body)
            .and_then(|request| prepare_chat(request, tokenizer(), context));
        check(result, context, false);
    } else {
        // Through the store's request rewriting (nothing kept: a previous_response_id is
        // unknown).
        let result = continue_previous(body, |_| None)
            .and_then(|(request, _)| prepare_responses(request, tokenizer(), context))
            .map(|(job, _)| job);
        check(result, context, false);
    }
});
