//! Responses kept in memory for the Responses API's `previous_response_id`,
//! `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` (`store`, on by default as in
//! OpenAI's API). A stored response keeps the reply object and the conversation it ended: the
//! input items it was given (an earlier response's conversation first, when it continued one)
//! and its own output items, which are valid input items. A request naming it as
//! `previous_response_id` continues that conversation, and renders the same prompt a client
//! sending it all as `input` would, so the KV cache of the earlier turns is reused.
//!
//! Bounded: at most [`MAX_RESPONSES`] responses and [`MAX_BYTES`] of JSON, the oldest forgotten
//! first; nothing survives a restart (vLLM keeps them in memory too).

use std::collections::{HashMap, VecDeque};

use serde_json::Value;

/// Most responses kept.
pub const MAX_RESPONSES: usize = 1024;

/// Most bytes of JSON kept (reply objects and conversations together).
pub const MAX_BYTES: usize = 64 << 20;

struct Stored {
    response: Value,
    conversation: Vec<Value>,
    bytes: usize,
}

/// See the module doc.
#[derive(Default)]
pub struct ResponseStore {
    responses: HashMap<String, Stored>,
    /// Ids, oldest first (removed ones may linger here until they reach the front).
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    /// Keeps `response` (its `id` field names it) and the conversation it ended, forgetting
    /// the oldest responses beyond the bounds. A single response larger than the byte bound is
    /// not kept.
    pub fn insert(&mut self, response: Value, conversation: Vec<Value>) {
        let Some(id) = response["id"].as_str().map(str::to_owned) else {
            return;
        };
        let bytes = json_bytes(&response) + conversation.iter().map(json_bytes).sum::<usize>();
        if bytes > MAX_BYTES {
            return;
        }
        if self.remove(&id) {
            // Its place in the order is the new one's.
            self.order.retain(|kept| kept != &id);
        }
        while self.responses.len() >= MAX_RESPONSES || self.bytes + bytes > MAX_BYTES {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.remove(&oldest);
        }
        self.bytes += bytes;
        self.order.push_back(id.clone());
        self.responses.insert(
            id,
            Stored {
                response,
                conversation,
                bytes,
            },
        );
    }

    /// The reply object of response `id`.
    pub fn response(&self, id: &str) -> Option<&Value> {
        self.responses.get(id).map(|stored| &stored.response)
    }

    /// The conversation response `id` ended: the input items to continue it with.
    pub fn conversation(&self, id: &str) -> Option<&[Value]> {
        self.responses
            .get(id)
            .map(|stored| stored.conversation.as_slice())
    }

    /// Forgets response `id`; whether it was kept.
    pub fn remove(&mut self, id: &str) -> bool {
        match self.responses.remove(id) {
            Some(stored) => {
                self.bytes -= stored.bytes;
                if self.order.len() > 2 * self.responses.len() + 16 {
                    let responses = &self.responses;
                    self.order.retain(|kept| responses.contains_key(kept));
                }
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.responses.len()
    }

    pub fn is_empty(&self) -> bool {
        self.responses.is_empty()
    }
}

/// The size of `value` as compact JSON.
fn json_bytes(value: &Value) -> usize {
    serde_json::to_vec(value).map_or(0, |bytes| bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn response(id: &str, text: &str) -> Value {
        json!({"id": id, "object": "response", "output": [{"type": "message", "content": text}]})
    }

    #[test]
    fn responses_are_kept_retrieved_and_removed_by_id() {
        let mut store = ResponseStore::default();
        let said = vec![json!({"role": "user", "content": "hi"})];
        store.insert(response("resp_1", "hello"), said.clone());
        assert_eq!(store.response("resp_1").unwrap()["id"], "resp_1");
        assert_eq!(store.conversation("resp_1").unwrap(), said.as_slice());
        assert!(store.response("resp_2").is_none());
        assert!(store.remove("resp_1"));
        assert!(!store.remove("resp_1"));
        assert!(store.is_empty() && store.bytes == 0);
    }

    #[test]
    fn the_oldest_responses_go_first_beyond_the_count_and_byte_bounds() {
        let mut store = ResponseStore::default();
        for i in 0..MAX_RESPONSES + 5 {
            store.insert(response(&format!("resp_{i}"), "x"), Vec::new());
        }
        assert_eq!(store.len(), MAX_RESPONSES);
        assert!(store.response("resp_4").is_none());
        assert!(store.response("resp_5").is_some());
        // A few large conversations push out the small responses, oldest first.
        let big = vec![Value::String("y".repeat(MAX_BYTES / 3))];
        for i in 0..3 {
            store.insert(response(&format!("big_{i}"), "z"), big.clone());
        }
        assert!(store.bytes <= MAX_BYTES);
        assert!(
            store.response("big_0").is_none(),
            "the oldest large one went too"
        );
        assert!(store.response("big_2").is_some() && store.response("big_1").is_some());
        // One that could never fit is not kept, and pushes nothing out.
        let before = store.len();
        store.insert(
            response("huge", "w"),
            vec![Value::String("v".repeat(MAX_BYTES))],
        );
        assert!(store.response("huge").is_none());
        assert_eq!(store.len(), before);
    }
}
