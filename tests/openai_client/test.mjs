// pdserve's HTTP API as the official `openai` npm client sees it. Run by
// tests/cluster/openai_client_test.cc, which starts the clusters and sets:
//   PDSERVE_URL            http://127.0.0.1:PORT/v1 (API keys on)
//   PDSERVE_KEY            a valid key for it
//   PDSERVE_ADMISSION_URL  a cluster whose admission queue holds 2 (keys off)
//   PDSERVE_GRPC_TEXT      the gRPC stream's text for GRPC_REQUEST below
import assert from 'node:assert/strict';
import test from 'node:test';

import OpenAI from 'openai';

const url = process.env.PDSERVE_URL;
const key = process.env.PDSERVE_KEY;
assert.ok(url && key, 'PDSERVE_URL and PDSERVE_KEY must be set');
// A request taking over 90 s is stuck (they take milliseconds here): fail
// then, with the cluster's state printed by the wrapper, not at undici's 300 s.
const client = new OpenAI({ baseURL: url, apiKey: key, maxRetries: 0, timeout: 90_000 });
// The client's timeout ends when a reply's headers come; a stream's body is
// bounded by this signal instead (undici's own bound is 300 s). The SDK
// ends an aborted stream's iteration quietly: collectChat asserts that a
// stream ended with its finish.
const STREAM = () => ({ signal: AbortSignal.timeout(90_000) });
const MODEL = 'kjv-tiny';
const CHAT = [{ role: 'user', content: 'Who was the father of Isaac?' }];
// Must match openai_client_test.cc's gRPC request.
const GRPC_REQUEST = { model: MODEL, prompt: 'In the beginning God created', max_tokens: 24, temperature: 0.8, seed: 4242 };

async function collectChat(stream) {
  let content = '';
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    ++chunks;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta?.content) content += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.ok(finish !== null, `the stream ended after ${chunks} chunks without a finish (stuck, then aborted at 90 s?)`);
  return { content, finish, usage, chunks };
}

test('completions, whole: text, finish reason, usage, ids', async () => {
  const r = await client.completions.create({ ...GRPC_REQUEST });
  assert.equal(r.object, 'text_completion');
  assert.match(r.id, /^cmpl-/);
  assert.equal(r.model, MODEL);
  assert.equal(r.choices.length, 1);
  assert.equal(typeof r.choices[0].text, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  assert.ok(r.usage.prompt_tokens > 0);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  assert.equal(typeof r.usage.prompt_tokens_details.cached_tokens, 'number');
});

test('seed reproducibility: same seed, same text, equal to the gRPC stream', async () => {
  const a = await client.completions.create({ ...GRPC_REQUEST });
  const b = await client.completions.create({ ...GRPC_REQUEST });
  assert.equal(a.choices[0].text, b.choices[0].text);
  assert.equal(a.choices[0].text, process.env.PDSERVE_GRPC_TEXT);
  const s = await client.completions.create({ ...GRPC_REQUEST, stream: true }, STREAM());
  let text = '';
  for await (const chunk of s) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, process.env.PDSERVE_GRPC_TEXT);
  const other = await client.completions.create({ ...GRPC_REQUEST, seed: 4243 });
  assert.notEqual(other.choices[0].text, a.choices[0].text);
});

test('completions from token ids', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: [100, 200, 300, 400], max_tokens: 5, ignore_eos: true });
  assert.equal(r.usage.prompt_tokens, 4);
  assert.equal(r.usage.completion_tokens, 5);
  assert.equal(r.choices[0].finish_reason, 'length');
});

test('chat, whole and streamed with usage, agree', async () => {
  const req = { model: MODEL, messages: CHAT, max_tokens: 16, temperature: 0.7, seed: 9 };
  const whole = await client.chat.completions.create(req);
  assert.equal(whole.object, 'chat.completion');
  assert.match(whole.id, /^chatcmpl-/);
  assert.equal(whole.choices[0].message.role, 'assistant');
  const streamed = await collectChat(
    await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } }, STREAM()));
  assert.equal(streamed.content, whole.choices[0].message.content);
  assert.equal(streamed.finish, whole.choices[0].finish_reason);
  assert.ok(streamed.usage, 'the last chunk carries usage');
  assert.equal(streamed.usage.completion_tokens, whole.usage.completion_tokens);
  assert.equal(streamed.usage.prompt_tokens, whole.usage.prompt_tokens);
  assert.ok(streamed.chunks >= 3);
});

test('chat without max_tokens runs to the end of the context or a stop', async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages: CHAT, seed: 3, max_completion_tokens: 7,
                                                   ignore_eos: true });
  assert.equal(r.usage.completion_tokens, 7);
});

test('stop strings end the text before them', async () => {
  const base = { model: MODEL, prompt: 'And God said', max_tokens: 40, temperature: 0.8, seed: 17, ignore_eos: true };
  const full = (await client.completions.create(base)).choices[0].text;
  const stop = full.slice(12, 15);
  assert.equal(stop.length, 3);
  const cut = await client.completions.create({ ...base, stop: [stop, 'zzzz-never'] });
  assert.equal(cut.choices[0].finish_reason, 'stop');
  assert.equal(cut.choices[0].text, full.slice(0, full.indexOf(stop)));
  const one = await client.completions.create({ ...base, stop });
  assert.equal(one.choices[0].text, cut.choices[0].text);
});

test('logprobs: chat top_logprobs and completions logprobs N', async () => {
  const chat = await client.chat.completions.create({ model: MODEL, messages: CHAT, max_tokens: 6, seed: 1,
                                                      logprobs: true, top_logprobs: 3, ignore_eos: true });
  const content = chat.choices[0].logprobs.content;
  assert.equal(content.length, 6);
  let joined = [];
  for (const t of content) {
    assert.ok(t.logprob <= 0);
    assert.ok(Array.isArray(t.bytes));
    assert.equal(t.top_logprobs.length, 3);
    for (const alt of t.top_logprobs) assert.ok(alt.logprob <= 0 && Array.isArray(alt.bytes));
    assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[2].logprob);
    joined = joined.concat(t.bytes);
  }
  assert.equal(Buffer.from(joined).toString('utf8'), chat.choices[0].message.content);

  const cmpl = await client.completions.create({ model: MODEL, prompt: 'In the beginning', max_tokens: 5, seed: 2,
                                                 logprobs: 2, ignore_eos: true });
  const lp = cmpl.choices[0].logprobs;
  assert.equal(lp.tokens.length, 5);
  assert.equal(lp.token_logprobs.length, 5);
  assert.equal(lp.top_logprobs.length, 5);
  assert.equal(lp.text_offset[0], 0);
  for (const top of lp.top_logprobs) assert.equal(Object.keys(top).length >= 1, true);
});

test('401 without a valid key', async () => {
  const bad = new OpenAI({ baseURL: url, apiKey: 'not-a-key', maxRetries: 0 });
  await assert.rejects(bad.completions.create({ model: MODEL, prompt: 'x', max_tokens: 1 }), (e) => {
    assert.ok(e instanceof OpenAI.AuthenticationError, String(e));
    assert.equal(e.status, 401);
    return true;
  });
  await assert.rejects(bad.models.list(), (e) => e.status === 401);
});

test('models list', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
});

test('400 naming the field; 404 for an unknown model', async () => {
  await assert.rejects(
    client.chat.completions.create({
      model: MODEL, messages: CHAT,
      tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { x: { type: 'string', pattern: 'a' } } } } }],
    }),
    (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, String(e));
      assert.equal(e.param, 'tools[0].function.parameters');
      assert.match(e.message, /'pattern' is not supported/);
      return true;
    });
  await assert.rejects(client.completions.create({ model: MODEL, prompt: 'x', temperature: -1 }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.param, 'temperature');
    return true;
  });
  await assert.rejects(client.completions.create({ model: MODEL, prompt: 'x', n: 2 }), (e) => {
    assert.equal(e.status, 400);
    assert.equal(e.param, 'n');
    return true;
  });
  await assert.rejects(client.completions.create({ model: 'gpt-4o', prompt: 'x' }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, String(e));
    return true;
  });
});

test('64 concurrent streams, each its own seed, each equal to its request run alone', async () => {
  const reqs = Array.from({ length: 64 }, (_, i) => ({ model: MODEL, messages: [{ role: 'user', content: `Tell of ${i}` }],
                                                       max_tokens: 10, temperature: 0.9, seed: 1000 + i }));
  const streamed = await Promise.all(reqs.map(async (r) => collectChat(
    await client.chat.completions.create({ ...r, stream: true, stream_options: { include_usage: true } }, STREAM()))));
  for (const [i, r] of reqs.entries()) {
    const alone = await client.chat.completions.create(r);
    assert.equal(streamed[i].content, alone.choices[0].message.content, `stream ${i}`);
    assert.equal(streamed[i].usage.completion_tokens, alone.usage.completion_tokens, `stream ${i}`);
  }
});

test('429 with Retry-After when admission rejects', async () => {
  const admission = new OpenAI({ baseURL: process.env.PDSERVE_ADMISSION_URL, apiKey: 'none', maxRetries: 0 });
  const results = await Promise.allSettled(Array.from({ length: 6 }, (_, i) => new Promise((r) => setTimeout(r, 50 * i))
    .then(() => admission.completions.create({ model: MODEL, prompt: 'In the beginning', max_tokens: 4 }))));
  const rejected = results.filter((r) => r.status === 'rejected').map((r) => r.reason);
  const served = results.filter((r) => r.status === 'fulfilled');
  assert.equal(served.length, 2, JSON.stringify(rejected.map(String)));
  assert.equal(rejected.length, 4);
  for (const e of rejected) {
    assert.ok(e instanceof OpenAI.RateLimitError, String(e));
    assert.equal(e.status, 429);
    assert.equal(e.headers.get('retry-after'), '1');
    assert.match(e.message, /queue/);
  }
});
