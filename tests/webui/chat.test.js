// The chat page's protocol code (src/server/webui/chat.js) under Node's test runner: the SSE
// parser, how chunks fold into a reply, the request body, and, when OSSTERM_TEST_SERVER names a
// running `ossterm serve` (tests/webui.rs starts one), streaming and stopping against it.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const chat = require('../../src/server/webui/chat.js');

function events(text, cuts) {
  const seen = [];
  const parser = chat.createSseParser((data) => seen.push(data));
  let at = 0;
  for (const cut of [...cuts, text.length]) {
    parser.push(text.slice(at, cut));
    at = cut;
  }
  return seen;
}

test('events come out whole wherever the stream is cut', () => {
  const text = 'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: a comment\n\ndata: [DONE]\n\n';
  const whole = events(text, []);
  assert.deepEqual(whole, ['{"a":1}', '{"b":2}', '[DONE]']);
  for (let cut = 1; cut < text.length; cut++) {
    assert.deepEqual(events(text, [cut]), whole, 'cut at ' + cut);
  }
  // Byte by byte.
  assert.deepEqual(events(text, [...Array(text.length).keys()].slice(1)), whole);
  // Several data lines are one event's lines.
  assert.deepEqual(events('data: x\ndata: y\n\n', []), ['x\ny']);
});

test('reasoning sent under both names is counted once; content, finish, usage, timings', () => {
  const reply = chat.newReply();
  const chunk = (delta, extra) => JSON.stringify(Object.assign({ choices: [{ index: 0, delta, finish_reason: null }] }, extra || {}));
  chat.applyData(reply, chunk({ role: 'assistant', content: '' }));
  chat.applyData(reply, chunk({ reasoning_content: 'Think', reasoning: 'Think' }));
  chat.applyData(reply, chunk({ reasoning: 'ing.' }));
  chat.applyData(reply, chunk({ content: 'Hello' }));
  chat.applyData(reply, chunk({ content: ', world' }));
  chat.applyData(reply, JSON.stringify({ choices: [{ index: 0, delta: {}, finish_reason: 'length' }], timings: { predicted_per_second: 12.5 } }));
  chat.applyData(reply, JSON.stringify({ choices: [], usage: { prompt_tokens: 70, completion_tokens: 9, prompt_tokens_details: { cached_tokens: 64 } } }));
  assert.equal(reply.done, false);
  chat.applyData(reply, '[DONE]');
  assert.equal(reply.reasoning, 'Thinking.');
  assert.equal(reply.content, 'Hello, world');
  assert.equal(reply.finishReason, 'length');
  assert.equal(reply.done, true);
  assert.equal(reply.error, null);
  assert.equal(chat.statsLine(reply, 0.25),
    '9 tokens · 12.5 tokens/s · first token after 0.25 s · 70 prompt tokens (64 cached) · cut at the token limit');
  // The server's own time to first token, where its timings carry one, over the page's.
  reply.timings.prompt_ms = 861;
  assert.match(chat.statsLine(reply, 0.25), /first token after 0\.86 s/);
});

test('an error event or a payload that is not JSON becomes the reply error', () => {
  const reply = chat.newReply();
  chat.applyData(reply, JSON.stringify({ error: { message: 'the server is stopping', type: 'server_error' } }));
  assert.equal(reply.error, 'the server is stopping');
  const garbled = chat.newReply();
  chat.applyData(garbled, '{"choices": [');
  assert.match(garbled.error, /not JSON/);
});

// A response whose body yields `pieces`, as fetch would give it.
function fakeFetch(status, pieces) {
  return async () => new Response(new ReadableStream({
    start(controller) {
      for (const piece of pieces) controller.enqueue(new TextEncoder().encode(piece));
      controller.close();
    },
  }), { status, headers: { 'Content-Type': 'text/event-stream' } });
}

test('a stream that ends without [DONE] is an error, the text so far kept', async () => {
  const delta = (content) => 'data: ' + JSON.stringify({ choices: [{ index: 0, delta: { content } }] }) + '\n\n';
  const cut = await chat.streamChat({ baseUrl: 'http://x/', body: {}, fetchImpl: fakeFetch(200, [delta('Hel'), delta('lo')]) });
  assert.equal(cut.content, 'Hello');
  assert.match(cut.error, /closed before the reply ended/);
  // The last event without its blank line still counts.
  const whole = await chat.streamChat({ baseUrl: 'http://x/', body: {}, fetchImpl: fakeFetch(200, [delta('Hi'), 'data: [DONE]']) });
  assert.equal(whole.content, 'Hi');
  assert.equal(whole.error, null);
  // An error status rejects with the server's message.
  const refused = fakeFetch(429, [JSON.stringify({ error: { message: 'all slots are busy' } })]);
  await assert.rejects(chat.streamChat({ baseUrl: 'http://x/', body: {}, fetchImpl: refused }), /all slots are busy \(HTTP 429\)/);
});

test('the request carries the settings and the conversation', () => {
  const history = [{ role: 'user', content: 'hi' }, { role: 'assistant', content: 'hello' }, { role: 'user', content: 'again' }];
  const body = chat.requestBody(history, { system: 'Be brief.', effort: 'high', temperature: '0.5', maxTokens: '64', model: 'm' });
  assert.deepEqual(body.messages[0], { role: 'developer', content: 'Be brief.' });
  assert.deepEqual(body.messages.slice(1), history);
  assert.equal(body.stream, true);
  assert.deepEqual(body.stream_options, { include_usage: true });
  assert.equal(body.reasoning_effort, 'high');
  assert.equal(body.temperature, 0.5);
  assert.equal(body.max_tokens, 64);
  assert.equal(body.model, 'm');
  // Empty or nonsense fields are left to the server's defaults.
  const bare = chat.requestBody(history, { system: '  ', effort: 'low', temperature: '', maxTokens: 'x' });
  assert.equal(bare.messages.length, 3);
  assert.equal('temperature' in bare, false);
  assert.equal('max_tokens' in bare, false);
});

test('markdown blocks: headings, fences, lists, tables, quotes, rules, paragraphs', () => {
  const text = [
    '## Plan', '', 'First line', 'second line', '', '```rust', 'fn main() {', '', '}', '```',
    '- one', '- two', '  more of two', '  1. nested', '', '3. three', '4. four', '',
    '| a | b \\| c |', '|---|:-:|', '| 1 | `x` |', '', '> quoted **bold**', '', '---', 'end',
  ].join('\n');
  const blocks = chat.parseMarkdown(text);
  assert.deepEqual(blocks.map((b) => b.type),
    ['heading', 'paragraph', 'code', 'list', 'list', 'table', 'quote', 'rule', 'paragraph']);
  assert.deepEqual(blocks[0], { type: 'heading', level: 2, text: 'Plan' });
  assert.equal(blocks[1].text, 'First line\nsecond line');
  assert.deepEqual(blocks[2], { type: 'code', language: 'rust', text: 'fn main() {\n\n}' });
  assert.equal(blocks[3].ordered, false);
  assert.deepEqual(blocks[3].items, [{ level: 0, text: 'one' }, { level: 0, text: 'two\nmore of two' }, { level: 1, text: 'nested' }]);
  assert.equal(blocks[4].ordered, true);
  assert.equal(blocks[4].start, 3);
  assert.deepEqual(blocks[5].head, ['a', 'b | c']);
  assert.deepEqual(blocks[5].rows, [['1', '`x`']]);
  assert.deepEqual(blocks[6].blocks, [{ type: 'paragraph', text: 'quoted **bold**' }]);
  // A reply cut inside a code fence (still streaming) shows the code so far as code.
  assert.deepEqual(chat.parseMarkdown('Run:\n```sh\nls -l'), [
    { type: 'paragraph', text: 'Run:' }, { type: 'code', language: 'sh', text: 'ls -l' }]);
  assert.deepEqual(chat.parseMarkdown(''), []);
});

test('markdown spans: code, strong, emphasis, http links only; the rest stays text', () => {
  assert.deepEqual(chat.parseInline('Use `a*b` and **bold** or *it* [docs](https://example.com/x).'), [
    { type: 'text', text: 'Use ' }, { type: 'code', text: 'a*b' }, { type: 'text', text: ' and ' },
    { type: 'strong', text: 'bold' }, { type: 'text', text: ' or ' }, { type: 'em', text: 'it' },
    { type: 'text', text: ' ' }, { type: 'link', text: 'docs', href: 'https://example.com/x' }, { type: 'text', text: '.' },
  ]);
  // Markup-looking text that is not Markdown, and links that are not http(s), stay text.
  for (const plain of ['2 * 3 * 4', '<img src=x onerror=alert(1)>', '[x](javascript:alert(1))', 'a ** b']) {
    assert.deepEqual(chat.parseInline(plain), [{ type: 'text', text: plain }], plain);
  }
});

const server = process.env.OSSTERM_TEST_SERVER;
const apiKey = process.env.OSSTERM_TEST_API_KEY;

// Random weights write no harmony header, so the test continues an open final-channel answer
// (vLLM's continue_final_message): what the model writes is then answer text.
function openAnswer(maxTokens) {
  return {
    messages: [{ role: 'user', content: 'Say something.' }, { role: 'assistant', content: 'Sure:' }],
    continue_final_message: true,
    add_generation_prompt: false,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: maxTokens,
    temperature: 0,
  };
}

test('a reply streams from the server into text, usage and timings', { skip: !server && 'OSSTERM_TEST_SERVER not set' }, async () => {
  let updates = 0;
  const reply = await chat.streamChat({ baseUrl: server, apiKey, body: openAnswer(16), onUpdate: () => updates++ });
  assert.equal(reply.error, null);
  assert.equal(reply.done, true);
  assert.equal(reply.finishReason, 'length');
  assert.equal(reply.usage.completion_tokens, 16);
  assert.ok(reply.content.length > 0, 'no answer text');
  assert.ok(reply.timings.predicted_per_second > 0);
  assert.ok(updates >= 4, 'updates: ' + updates);
  // The same request without streaming gives the same text (greedy).
  const plain = await fetch(new URL('v1/chat/completions', server), {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: 'Bearer ' + apiKey },
    body: JSON.stringify(Object.assign(openAnswer(16), { stream: false, stream_options: undefined })),
  });
  assert.equal(plain.status, 200);
  assert.equal((await plain.json()).choices[0].message.content, reply.content);
});

test('a request the server refuses rejects with its message', { skip: !server && 'OSSTERM_TEST_SERVER not set' }, async () => {
  await assert.rejects(
    chat.streamChat({ baseUrl: server, apiKey: 'wrong', body: openAnswer(4) }),
    /HTTP 401/,
  );
  await assert.rejects(
    chat.streamChat({ baseUrl: server, apiKey, body: { messages: [], stream: true } }),
    (error) => /messages/.test(error.message) && /HTTP 400/.test(error.message),
  );
});

test('stopping a reply ends its stream', { skip: !server && 'OSSTERM_TEST_SERVER not set' }, async () => {
  const controller = new AbortController();
  let seen = '';
  await assert.rejects(
    chat.streamChat({
      baseUrl: server,
      apiKey,
      body: openAnswer(4000),
      signal: controller.signal,
      onUpdate(reply) {
        seen = reply.content;
        if (reply.content.length > 0) controller.abort();
      },
    }),
    { name: 'AbortError' },
  );
  assert.ok(seen.length > 0);
});
