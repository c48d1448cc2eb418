// The chat page `ossterm serve` shows at its root: streams /v1/chat/completions and shows the
// reasoning (analysis channel) apart from the answer. The first part is the protocol (also run
// by tests/webui/chat.test.js under Node); the second wires it to the page. Text from the model
// is only ever set as textContent, never parsed as HTML.
'use strict';

// Splits server-sent events out of a stream of text pieces (which may cut an event anywhere)
// and hands each event's data to `onData`.
function createSseParser(onData) {
  let buffer = '';
  return {
    push(text) {
      buffer += text.replace(/\r\n?/g, '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split('\n')
          .filter((line) => line.startsWith('data:'))
          .map((line) => line.slice(5).replace(/^ /, ''))
          .join('\n');
        if (data) onData(data);
      }
    },
  };
}

function newReply() {
  return { reasoning: '', content: '', finishReason: null, usage: null, timings: null, error: null, done: false };
}

// Folds one `data:` payload of a streamed chat completion into `reply`. The server sends the
// reasoning under both `reasoning_content` and `reasoning` (clients read one or the other):
// take one of them, not both.
function applyData(reply, data) {
  if (data === '[DONE]') {
    reply.done = true;
    return reply;
  }
  let chunk;
  try {
    chunk = JSON.parse(data);
  } catch (_) {
    reply.error = 'the server sent something that is not JSON: ' + data.slice(0, 200);
    return reply;
  }
  if (chunk.error) {
    reply.error = chunk.error.message || String(chunk.error);
    return reply;
  }
  const choice = (chunk.choices || [])[0];
  if (choice) {
    const delta = choice.delta || {};
    const reasoning = delta.reasoning_content !== undefined ? delta.reasoning_content : delta.reasoning;
    if (typeof reasoning === 'string') reply.reasoning += reasoning;
    if (typeof delta.content === 'string') reply.content += delta.content;
    if (choice.finish_reason) reply.finishReason = choice.finish_reason;
  }
  if (chunk.usage) reply.usage = chunk.usage;
  if (chunk.timings) reply.timings = chunk.timings;
  return reply;
}

// The request body for `history` (user and assistant turns) under `settings`.
function requestBody(history, settings) {
  const messages = [];
  if (settings.system && settings.system.trim()) messages.push({ role: 'developer', content: settings.system });
  for (const turn of history) messages.push({ role: turn.role, content: turn.content });
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    reasoning_effort: settings.effort || 'medium',
  };
  if (settings.model) body.model = settings.model;
  const temperature = Number(settings.temperature);
  if (settings.temperature !== '' && Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = Math.floor(Number(settings.maxTokens));
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

function authHeaders(apiKey) {
  return apiKey ? { Authorization: 'Bearer ' + apiKey } : {};
}

// The message of an error reply (OpenAI's `{"error": {"message"}}`), or its status.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const parsed = JSON.parse(text);
    if (parsed.error && parsed.error.message) return parsed.error.message + ' (HTTP ' + response.status + ')';
  } catch (_) { /* not JSON: fall through */ }
  return 'HTTP ' + response.status + (text ? ': ' + text.slice(0, 200) : '');
}

// Streams one reply; `onUpdate(reply)` after every event. Resolves with the reply (its `error`
// set when the stream carried one or ended without `[DONE]`); rejects when the request fails or
// `signal` aborts it.
async function streamChat({ baseUrl, apiKey, body, signal, onUpdate, fetchImpl }) {
  const doFetch = fetchImpl || fetch;
  const response = await doFetch(new URL('v1/chat/completions', baseUrl), {
    method: 'POST',
    headers: Object.assign({ 'Content-Type': 'application/json' }, authHeaders(apiKey)),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const reply = newReply();
  const parser = createSseParser((data) => {
    applyData(reply, data);
    if (onUpdate) onUpdate(reply);
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    parser.push(decoder.decode(value, { stream: true }));
  }
  parser.push(decoder.decode() + '\n\n');
  if (!reply.done && !reply.error) reply.error = 'the connection closed before the reply ended';
  return reply;
}

// One line of figures under a reply: tokens, decode speed, time to first token (the server's,
// from its timings, where it sends them: it counts tokens that show no text too; else as seen
// here).
function statsLine(reply, firstTokenSeconds) {
  const parts = [];
  const tokens = reply.usage ? reply.usage.completion_tokens : null;
  if (tokens !== null && tokens !== undefined) parts.push(tokens + ' tokens');
  if (reply.timings && reply.timings.predicted_per_second > 0) {
    parts.push(reply.timings.predicted_per_second.toFixed(1) + ' tokens/s');
  }
  const serverFirst = reply.timings && reply.timings.prompt_ms > 0 ? reply.timings.prompt_ms / 1000 : null;
  const first = serverFirst !== null ? serverFirst : firstTokenSeconds;
  if (first !== null && first !== undefined) parts.push('first token after ' + first.toFixed(2) + ' s');
  const cached = reply.usage && reply.usage.prompt_tokens_details ? reply.usage.prompt_tokens_details.cached_tokens : 0;
  if (reply.usage) parts.push(reply.usage.prompt_tokens + ' prompt tokens (' + (cached || 0) + ' cached)');
  if (reply.finishReason === 'length') parts.push('cut at the token limit');
  return parts.join(' · ');
}

// ---- Markdown, as the model writes it --------------------------------------------------------
// Answers come in Markdown (headings, lists, tables, code). Parsed here into plain blocks and
// spans, which the page turns into elements whose text is set as text: nothing the model writes
// is ever read as HTML. A reply still streaming is parsed as it stands (an open code fence is a
// code block until it closes).

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function tableCells(line) {
  let row = line.trim();
  if (row.startsWith('|')) row = row.slice(1);
  if (row.endsWith('|') && !row.endsWith('\\|')) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, '|'));
}

// Blocks of `text`: {type: 'paragraph' | 'heading' | 'code' | 'list' | 'quote' | 'table' | 'rule'}.
function parseMarkdown(text) {
  const lines = text.split('\n');
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i++;
    } else if ((match = FENCE.exec(line))) {
      const body = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(match[1]) && !lines[i].trim().slice(3).trim())) {
        body.push(lines[i]);
        i++;
      }
      i++;
      blocks.push({ type: 'code', language: match[2], text: body.join('\n') });
    } else if ((match = HEADING.exec(line))) {
      blocks.push({ type: 'heading', level: match[1].length, text: match[2] });
      i++;
    } else if (RULE.test(line)) {
      blocks.push({ type: 'rule' });
      i++;
    } else if (line.includes('|') && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes('-')) {
      const head = tableCells(line);
      const rows = [];
      i += 2;
      while (i < lines.length && lines[i].includes('|') && lines[i].trim()) {
        rows.push(tableCells(lines[i]));
        i++;
      }
      blocks.push({ type: 'table', head, rows });
    } else if (/^\s*>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) {
        quoted.push(lines[i].replace(/^\s*> ?/, ''));
        i++;
      }
      blocks.push({ type: 'quote', blocks: parseMarkdown(quoted.join('\n')) });
    } else if ((match = ITEM.exec(line))) {
      const ordered = /\d/.test(match[2]);
      const items = [];
      while (i < lines.length) {
        const item = ITEM.exec(lines[i]);
        if (item && /\d/.test(item[2]) === ordered) {
          items.push({ level: Math.floor(item[1].replace(/\t/g, '  ').length / 2), text: item[3] });
        } else if (item) {
          // A nested list of the other kind: an item one level in.
          items.push({ level: Math.max(1, Math.floor(item[1].length / 2)), text: item[3] });
        } else if (lines[i].trim() && /^\s+/.test(lines[i]) && items.length) {
          items[items.length - 1].text += '\n' + lines[i].trim();
        } else {
          break;
        }
        i++;
      }
      blocks.push({ type: 'list', ordered, start: ordered ? parseInt(match[2], 10) : 1, items });
    } else {
      const body = [];
      while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
        && !ITEM.test(lines[i]) && !/^\s*>/.test(lines[i]) && !(body.length && RULE.test(lines[i]))) {
        body.push(lines[i]);
        i++;
      }
      blocks.push({ type: 'paragraph', text: body.join('\n') });
    }
  }
  return blocks;
}

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

// Spans of a block's text: {type: 'text' | 'code' | 'strong' | 'em' | 'link', text, href}.
function parseInline(text) {
  const spans = [];
  let at = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > at) spans.push({ type: 'text', text: text.slice(at, match.index) });
    if (match[1]) spans.push({ type: 'code', text: match[2].trim() || match[2] });
    else if (match[3] !== undefined || match[4] !== undefined) spans.push({ type: 'strong', text: match[3] !== undefined ? match[3] : match[4] });
    else if (match[5] !== undefined) spans.push({ type: 'em', text: match[5] });
    else spans.push({ type: 'link', text: match[6], href: match[7] });
    at = match.index + match[0].length;
  }
  if (at < text.length) spans.push({ type: 'text', text: text.slice(at) });
  return spans;
}

if (typeof module !== 'undefined' && module.exports) {
  module.exports = {
    createSseParser, newReply, applyData, requestBody, streamChat, statsLine, errorMessage, parseMarkdown, parseInline,
  };
}

// ---- the page ----------------------------------------------------------------------------------

if (typeof document !== 'undefined') {
  const $ = (id) => document.getElementById(id);
  const baseUrl = new URL('.', location.href);
  const fields = { system: $('system'), effort: $('effort'), temperature: $('temperature'), maxTokens: $('max-tokens') };
  const apiKeyField = $('api-key');
  const history = [];
  let running = null;
  let model = null;
  // Bumped by "New chat": a reply still streaming for the old conversation must not join the new.
  let conversation = 0;

  // Settings outlive a reload; the API key only the tab (sessionStorage).
  for (const [name, field] of Object.entries(fields)) {
    const saved = localStorage.getItem('ossterm.' + name);
    if (saved !== null) field.value = saved;
    field.addEventListener('change', () => localStorage.setItem('ossterm.' + name, field.value));
  }
  apiKeyField.value = sessionStorage.getItem('ossterm.apiKey') || '';
  apiKeyField.addEventListener('change', () => {
    sessionStorage.setItem('ossterm.apiKey', apiKeyField.value);
    connect();
  });

  const settingsPanel = $('settings');
  const toggle = $('toggle-settings');
  function showSettings(open) {
    settingsPanel.hidden = !open;
    toggle.setAttribute('aria-expanded', String(open));
  }
  toggle.addEventListener('click', () => showSettings(settingsPanel.hidden));

  function setStatus(text, bad) {
    const status = $('status');
    status.textContent = text;
    status.classList.toggle('bad', Boolean(bad));
  }

  async function connect() {
    try {
      const response = await fetch(new URL('v1/models', baseUrl), { headers: authHeaders(apiKeyField.value) });
      if (response.status === 401) {
        setStatus('this server needs an API key (Settings)', true);
        showSettings(true);
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      const list = await response.json();
      const first = (list.data || [])[0];
      model = first ? first.id : null;
      const context = first && first.max_model_len ? ', ' + first.max_model_len + ' tokens of context' : '';
      setStatus((model || 'model') + context);
    } catch (error) {
      setStatus('cannot reach the server: ' + error.message, true);
    }
  }

  function element(tag, text) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function inline(parent, text) {
    for (const span of parseInline(text)) {
      if (span.type === 'text') {
        parent.appendChild(document.createTextNode(span.text));
      } else if (span.type === 'link') {
        const link = element('a', span.text);
        link.href = span.href;
        link.rel = 'noopener noreferrer';
        link.target = '_blank';
        parent.appendChild(link);
      } else {
        parent.appendChild(element(span.type, span.text));
      }
    }
    return parent;
  }
  // Elements for Markdown blocks (see parseMarkdown); every text set as text.
  function markdownNodes(blocks) {
    return blocks.map((block) => {
      switch (block.type) {
        case 'heading': return inline(element('h' + Math.min(6, block.level + 2)), block.text);
        case 'rule': return element('hr');
        case 'code': {
          const pre = element('pre');
          const code = pre.appendChild(element('code', block.text));
          if (block.language) code.dataset.language = block.language;
          return pre;
        }
        case 'quote': {
          const quote = element('blockquote');
          quote.append(...markdownNodes(block.blocks));
          return quote;
        }
        case 'list': {
          const list = element(block.ordered ? 'ol' : 'ul');
          if (block.ordered && block.start !== 1) list.start = block.start;
          for (const item of block.items) {
            const li = inline(element('li'), item.text);
            if (item.level) li.style.marginLeft = 1.5 * item.level + 'em';
            list.appendChild(li);
          }
          return list;
        }
        case 'table': {
          const wrap = element('div');
          wrap.className = 'table';
          const table = wrap.appendChild(element('table'));
          const head = table.appendChild(element('thead')).appendChild(element('tr'));
          for (const cell of block.head) head.appendChild(inline(element('th'), cell));
          const body = table.appendChild(element('tbody'));
          for (const row of block.rows) {
            const tr = body.appendChild(element('tr'));
            for (const cell of row) tr.appendChild(inline(element('td'), cell));
          }
          return wrap;
        }
        default: return inline(element('p'), block.text);
      }
    });
  }

  const messages = $('messages');
  function addTurn(role) {
    $('empty').hidden = true;
    const turn = document.createElement('div');
    turn.className = 'turn ' + role;
    messages.appendChild(turn);
    return turn;
  }
  function addPart(turn, tag, className, text) {
    const part = document.createElement(tag);
    part.className = className;
    if (text !== undefined) part.textContent = text;
    turn.appendChild(part);
    return part;
  }
  const nearBottom = () => messages.scrollHeight - messages.scrollTop - messages.clientHeight < 80;

  // An assistant turn: the reasoning fold (hidden until it has text), the answer and the line
  // of figures. `show` brings them up to `reply`, adding only the reasoning that is new.
  function addAssistantTurn(statsText) {
    const turn = addTurn('assistant');
    const details = addPart(turn, 'details', 'reasoning');
    addPart(details, 'summary', '', 'Reasoning');
    const reasoningText = addPart(details, 'div', '').appendChild(document.createTextNode(''));
    details.hidden = true;
    const answer = addPart(turn, 'div', 'answer');
    const stats = addPart(turn, 'div', 'stats', statsText);
    let shownAnswer = null;
    function show(reply) {
      if (reply.reasoning.length > reasoningText.length) {
        details.hidden = false;
        reasoningText.appendData(reply.reasoning.slice(reasoningText.length));
      }
      if (reply.content !== shownAnswer) {
        shownAnswer = reply.content;
        answer.replaceChildren(...markdownNodes(parseMarkdown(shownAnswer)));
      }
      // Open while the model thinks, closed once the answer starts.
      if (!details.hidden) details.open = !reply.content;
    }
    return { turn, answer, stats, show };
  }

  const input = $('input');
  const send = $('send');
  function setRunning(controller) {
    running = controller;
    send.textContent = controller ? 'Stop' : 'Send';
    send.classList.toggle('primary', !controller);
  }

  async function submit() {
    const text = input.value;
    if (!text.trim()) return;
    input.value = '';
    history.push({ role: 'user', content: text });
    addPart(addTurn('user'), 'div', 'text', text);
    const { turn, answer, stats, show } = addAssistantTurn('waiting for the first token…');
    const controller = new AbortController();
    const mine = conversation;
    setRunning(controller);
    const started = performance.now();
    let firstToken = null;
    let reply = newReply();
    let frame = 0;
    function render() {
      if (frame) cancelAnimationFrame(frame);
      frame = 0;
      const follow = nearBottom();
      show(reply);
      if (follow) messages.scrollTop = messages.scrollHeight;
    }
    const settings = { model };
    for (const [name, field] of Object.entries(fields)) settings[name] = field.value;
    // Whether the model answered at all: a refused or failed request, or one stopped before
    // its first token, leaves the question out of the conversation and back in the box.
    let answered = false;
    try {
      reply = await streamChat({
        baseUrl,
        apiKey: apiKeyField.value,
        body: requestBody(history, settings),
        signal: controller.signal,
        onUpdate(update) {
          reply = update;
          if (firstToken === null && (update.reasoning || update.content)) {
            firstToken = (performance.now() - started) / 1000;
            stats.textContent = 'generating…';
          }
          // At most one repaint a frame however fast tokens come.
          if (!frame) frame = requestAnimationFrame(render);
        },
      });
      render();
      if (reply.error) {
        addPart(turn, 'div', 'error', reply.error);
        stats.textContent = '';
      } else {
        stats.textContent = statsLine(reply, firstToken);
        if (!reply.content && !reply.reasoning && reply.usage && reply.usage.completion_tokens > 0) {
          // Tokens outside any harmony message (random weights write such): say so, not nothing.
          addPart(answer, 'p', 'note', 'The reply’s tokens held no reasoning or answer text.');
        }
      }
      answered = !reply.error || Boolean(reply.content || reply.reasoning);
    } catch (error) {
      render();
      if (error.name === 'AbortError') {
        stats.textContent = 'stopped' + (reply.usage ? ' · ' + statsLine(reply, firstToken) : '');
      } else {
        addPart(turn, 'div', 'error', error.message);
        stats.textContent = '';
      }
      answered = Boolean(reply.content || reply.reasoning);
    }
    if (mine !== conversation) {
      setRunning(null);
      return;
    }
    if (answered) {
      history.push({ role: 'assistant', content: reply.content, reasoning: reply.reasoning, stats: stats.textContent });
      saveConversation();
    } else {
      history.pop();
      if (!input.value) input.value = text;
    }
    setRunning(null);
    input.focus();
  }

  send.addEventListener('click', () => (running ? running.abort() : submit()));
  input.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!running) submit();
    }
  });
  document.addEventListener('keydown', (event) => {
    if (event.key === 'Escape' && running) running.abort();
  });
  $('new-chat').addEventListener('click', () => {
    if (running) running.abort();
    conversation += 1;
    history.length = 0;
    saveConversation();
    for (const turn of [...messages.querySelectorAll('.turn')]) turn.remove();
    $('empty').hidden = false;
    input.focus();
  });
  // The conversation outlives a reload (in this browser's local storage, until New chat).
  function saveConversation() {
    try {
      if (history.length) localStorage.setItem('ossterm.conversation', JSON.stringify(history));
      else localStorage.removeItem('ossterm.conversation');
    } catch (_) { /* storage full or refused: the page works without it */ }
  }
  // A saved value that is not wholly a conversation (another version's, edited by hand) is
  // dropped whole rather than shown in part.
  function restoreConversation() {
    let saved;
    try {
      saved = JSON.parse(localStorage.getItem('ossterm.conversation') || '[]');
    } catch (_) {
      saved = null;
    }
    const isTurn = (turn) => turn && typeof turn.content === 'string'
      && (turn.role === 'user' || (turn.role === 'assistant'
        && typeof (turn.reasoning || '') === 'string' && typeof (turn.stats || '') === 'string'));
    if (!Array.isArray(saved) || !saved.every(isTurn)) {
      localStorage.removeItem('ossterm.conversation');
      return;
    }
    for (const turn of saved) {
      if (turn.role === 'user') {
        addPart(addTurn('user'), 'div', 'text', turn.content);
      } else {
        addAssistantTurn(turn.stats || '').show({ reasoning: turn.reasoning || '', content: turn.content });
      }
      history.push(turn);
    }
  }
  restoreConversation();
  connect();
  input.focus();
}
