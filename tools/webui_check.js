// Drives the chat page in headless Chromium (see tools/webui_check.sh): node webui_check.js
// OPEN_URL KEYED_URL SCREENSHOT. Prints "webui check: passed" at the end; any failed step throws.
'use strict';
const assert = require('node:assert/strict');
const { chromium } = require('playwright-core');

const [openUrl, keyedUrl, screenshot] = process.argv.slice(2);

async function activeSequences(base) {
  const text = await (await fetch(new URL('metrics', base))).text();
  const line = text.split('\n').find((l) => l.startsWith('ossterm_active_sequences '));
  return Number(line.split(' ')[1]);
}

async function main() {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const errors = [];
  try {
    const page = await browser.newPage();
    page.on('pageerror', (error) => errors.push(error.message));
    page.on('console', (message) => { if (message.type() === 'error') errors.push(message.text()); });
    await page.goto(openUrl);
    // The header names the model and its context, read from /v1/models.
    await page.waitForFunction(() => document.getElementById('status').textContent.includes('synthetic-tiny'));
    assert.match(await page.textContent('#status'), /4096 tokens of context/);

    // A question sent with Enter: the user's turn, then the reply's figures once it ends.
    await page.fill('#input', 'Hello there');
    await page.press('#input', 'Enter');
    await page.waitForSelector('.turn.assistant .stats:text-matches("tokens/s")', { timeout: 60000 });
    assert.equal(await page.textContent('.turn.user .text'), 'Hello there');
    const stats = await page.textContent('.turn.assistant .stats');
    assert.match(stats, /^\d+ tokens · [\d.]+ tokens\/s · first token after [\d.]+ s · \d+ prompt tokens \(\d+ cached\)/);
    assert.equal(await page.inputValue('#input'), '');
    assert.equal(await page.textContent('#send'), 'Send');
    // Text, or (random weights) a note that the tokens held none: never an empty reply.
    assert.ok((await page.textContent('.turn.assistant .answer')).length > 0);

    // A long reply (settings: 4,000 tokens) stopped with the button; the server lets it go.
    await page.click('#toggle-settings');
    await page.fill('#max-tokens', '4000');
    await page.dispatchEvent('#max-tokens', 'change');
    await page.fill('#input', 'Tell me a long story');
    await page.click('#send');
    await page.waitForFunction(() => document.getElementById('send').textContent === 'Stop');
    await page.waitForTimeout(300);
    await page.click('#send');
    await page.waitForSelector('.turn.assistant >> nth=1 >> .stats:text-matches("^stopped")');
    assert.equal(await page.textContent('#send'), 'Send');
    for (let i = 0; (await activeSequences(openUrl)) !== 0; i++) {
      assert.ok(i < 50, 'the stopped reply still decodes on the server');
      await page.waitForTimeout(100);
    }
    assert.equal(await page.locator('.turn').count(), 4);
    // The setting and the conversation outlive a reload; New chat forgets the conversation.
    const statsBefore = await page.locator('.turn .stats').allTextContents();
    await page.reload();
    await page.waitForFunction(() => document.getElementById('status').textContent.includes('synthetic-tiny'));
    assert.equal(await page.inputValue('#max-tokens'), '4000');
    assert.equal(await page.locator('.turn').count(), 4);
    assert.deepEqual(await page.locator('.turn.user .text').allTextContents(), ['Hello there', 'Tell me a long story']);
    assert.deepEqual(await page.locator('.turn .stats').allTextContents(), statsBefore);
    await page.click('#new-chat');
    await page.reload();
    await page.waitForFunction(() => document.getElementById('status').textContent.includes('synthetic-tiny'));
    assert.equal(await page.locator('.turn').count(), 0);
    // A saved value that is not a conversation (another version's, a hand edit) is dropped whole.
    for (const bad of ['{not json', '{"role": "user"}', '[{"role": "user", "content": "kept?"}, {"role": "system", "content": 1}]']) {
      await page.evaluate((value) => localStorage.setItem('ossterm.conversation', value), bad);
      await page.reload();
      await page.waitForFunction(() => document.getElementById('status').textContent.includes('synthetic-tiny'));
      assert.equal(await page.locator('.turn').count(), 0, bad);
      assert.equal(await page.evaluate(() => localStorage.getItem('ossterm.conversation')), null, bad);
    }
    assert.equal(await page.isVisible('#settings'), false);
    await page.click('#toggle-settings');
    await page.fill('#max-tokens', '24');
    await page.dispatchEvent('#max-tokens', 'change');

    // A second turn, then a new chat empties the page.
    await page.fill('#input', 'First question');
    await page.press('#input', 'Enter');
    await page.waitForSelector('.turn.assistant .stats:text-matches("tokens/s")', { timeout: 60000 });
    await page.fill('#input', 'And a second one');
    await page.press('#input', 'Enter');
    await page.waitForSelector('.turn.assistant >> nth=1 >> .stats:text-matches("tokens/s")', { timeout: 60000 });
    // The second request carried the first turn (even an answer without visible text, as
    // random weights write): its prompt is longer by both, and reuses the cache.
    const promptOf = async (n) => {
      const line = await page.textContent(`.turn.assistant >> nth=${n} >> .stats`);
      const [, prompt, cached] = line.match(/(\d+) prompt tokens \((\d+) cached\)/);
      return [Number(prompt), Number(cached)];
    };
    const [firstPrompt] = await promptOf(0);
    const [secondPrompt, secondCached] = await promptOf(1);
    assert.ok(secondPrompt >= firstPrompt + 8, `${firstPrompt} then ${secondPrompt} prompt tokens`);
    assert.ok(secondCached > 0);
    assert.equal(await page.inputValue('#input'), '');
    // How a reply is shown, from a canned stream (random weights write no Markdown): the
    // reasoning in its fold, closed once the answer starts; Markdown as elements; markup and
    // script links in the model's text stay text.
    const answerText = [
      '## Result', '', 'Plain <img src=x onerror="window.injected=1"> and **bold** text.', '',
      '| tool | speed |', '|---|---|', '| ossterm | `fast` |', '',
      '```sh', 'ossterm serve --synthetic 20b', '```', '',
      '- [docs](https://example.com/docs)', '- [bad](javascript:window.injected=2)',
    ].join('\n');
    const event = (delta, extra) => 'data: ' + JSON.stringify(Object.assign(
      { choices: [{ index: 0, delta, finish_reason: null }] }, extra || {})) + '\n\n';
    let canned = event({ reasoning_content: 'Thinking it ', reasoning: 'Thinking it ' })
      + event({ reasoning_content: 'over.', reasoning: 'over.' });
    for (let at = 0; at < answerText.length; at += 7) canned += event({ content: answerText.slice(at, at + 7) });
    canned += event({}, { choices: [{ index: 0, delta: {}, finish_reason: 'stop' }], timings: { predicted_per_second: 42 } })
      + 'data: ' + JSON.stringify({ choices: [], usage: { prompt_tokens: 90, completion_tokens: 60, prompt_tokens_details: { cached_tokens: 80 } } })
      + '\n\ndata: [DONE]\n\n';
    await page.route('**/v1/chat/completions', (route) => route.fulfill({
      status: 200, headers: { 'Content-Type': 'text/event-stream' }, body: canned }));
    await page.fill('#input', 'Show me Markdown');
    await page.press('#input', 'Enter');
    const shown = page.locator('.turn.assistant >> nth=2');
    await shown.locator('.stats:text-matches("42.0 tokens/s")').waitFor();
    assert.equal(await shown.locator('.reasoning').isVisible(), true);
    assert.equal(await shown.locator('.reasoning').evaluate((d) => d.open), false);
    assert.equal(await shown.locator('.reasoning div').textContent(), 'Thinking it over.');
    assert.equal(await shown.locator('.answer h4').textContent(), 'Result');
    assert.equal(await shown.locator('.answer strong').textContent(), 'bold');
    assert.deepEqual(await shown.locator('.answer td').allTextContents(), ['ossterm', 'fast']);
    assert.equal(await shown.locator('.answer pre code').textContent(), 'ossterm serve --synthetic 20b');
    assert.equal(await shown.locator('.answer img').count(), 0);
    assert.match(await shown.locator('.answer p').first().textContent(), /<img src=x onerror=/);
    assert.deepEqual(await shown.locator('.answer a').evaluateAll((links) => links.map((a) => a.href)),
      ['https://example.com/docs']);
    assert.match(await shown.locator('.answer li').nth(1).textContent(), /\[bad\]\(javascript:/);
    assert.equal(await page.evaluate(() => window.injected), undefined);
    await page.unroute('**/v1/chat/completions');
    await page.screenshot({ path: screenshot });
    await page.click('#new-chat');
    assert.equal(await page.locator('.turn').count(), 0);
    assert.equal(await page.isVisible('#empty'), true);

    // A server with an API key: the page says so and opens the settings; with the key it works.
    const keyed = await browser.newPage();
    keyed.on('pageerror', (error) => errors.push(error.message));
    await keyed.goto(keyedUrl);
    await keyed.waitForFunction(() => document.getElementById('status').textContent.includes('API key'));
    assert.equal(await keyed.isVisible('#api-key'), true);
    await keyed.fill('#input', 'Without the key');
    await keyed.press('#input', 'Enter');
    await keyed.waitForSelector('.turn.assistant .error');
    assert.match(await keyed.textContent('.turn.assistant .error'), /HTTP 401/);
    // The failed question goes back into the box, not into the conversation.
    assert.equal(await keyed.inputValue('#input'), 'Without the key');
    await keyed.fill('#api-key', 'sk-webui-check');
    await keyed.dispatchEvent('#api-key', 'change');
    await keyed.waitForFunction(() => document.getElementById('status').textContent.includes('synthetic-tiny'));
    await keyed.press('#input', 'Enter');
    await keyed.waitForSelector('.turn.assistant >> nth=1 >> .stats:text-matches("tokens/s")', { timeout: 60000 });
    assert.deepEqual(errors.filter((e) => !e.includes('401')), []);
  } catch (error) {
    for (const open of browser.contexts().flatMap((c) => c.pages())) {
      await open.screenshot({ path: screenshot.replace(/\.png$/, '-failed.png') }).catch(() => {});
    }
    throw error;
  } finally {
    await browser.close();
  }
  console.log('webui check: passed');
}

main().catch((error) => {
  console.error('webui check: FAILED:', error.message);
  process.exit(1);
});
