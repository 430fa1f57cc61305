// Structured outputs through pdserve's HTTP API as the official `openai`
// client sends them, every output checked by ajv (an independent JSON
// Schema validator). Run by tests/cluster/openai_client_test.cc, which sets
//   PDSERVE_URL           https://127.0.0.1:PORT/v1
//   PDSERVE_KEY           a valid key for it
//   PDSERVE_STRUCTURED_N  requests per schema (seeded; every fourth streamed)
// For each schema of tests/fixtures/structured/schemas.json: every reply
// must end with finish_reason "stop", parse as JSON and validate. Prints a
// line per schema; exits 1 on the first schema with a failure.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';

import Ajv2020 from 'ajv/dist/2020.js';
import OpenAI from 'openai';

const url = process.env.PDSERVE_URL;
const key = process.env.PDSERVE_KEY;
const n = Number(process.env.PDSERVE_STRUCTURED_N ?? 200);
assert.ok(url && key, 'PDSERVE_URL and PDSERVE_KEY must be set');
const client = new OpenAI({ baseURL: url, apiKey: key, maxRetries: 0, timeout: 90_000 });
const schemas = JSON.parse(readFileSync(new URL('../fixtures/structured/schemas.json', import.meta.url), 'utf8'));
const TEMPERATURES = [0.7, 1.0, 1.2];
const CONCURRENCY = 8;

async function one(s, i) {
  const body = {
    model: 'kjv-tiny',
    messages: [{ role: 'user', content: s.prompt }],
    response_format: { type: 'json_schema', json_schema: { name: s.name, schema: s.schema, strict: true } },
    temperature: TEMPERATURES[i % TEMPERATURES.length],
    seed: 1000 + i,
    max_tokens: 300,
  };
  if (i % 4 === 3) {
    const stream = await client.chat.completions.create({ ...body, stream: true },
                                                        { signal: AbortSignal.timeout(90_000) });
    let content = '';
    let finish = null;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (c.delta?.content) content += c.delta.content;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    return { content, finish };
  }
  const r = await client.chat.completions.create(body);
  return { content: r.choices[0].message.content, finish: r.choices[0].finish_reason };
}

let failed = false;
for (const s of schemas) {
  const validate = new Ajv2020({ strict: true, allErrors: true }).compile(s.schema);
  const started = Date.now();
  const failures = [];
  let bytes = 0;
  let next = 0;
  async function worker() {
    while (next < n) {
      const i = next++;
      let got;
      try {
        got = await one(s, i);
      } catch (e) {
        failures.push(`request ${i}: ${e.message}`);
        continue;
      }
      bytes += got.content.length;
      if (got.finish !== 'stop') {
        failures.push(`request ${i}: finish_reason ${got.finish}: ${got.content}`);
        continue;
      }
      let doc;
      try {
        doc = JSON.parse(got.content);
      } catch (e) {
        failures.push(`request ${i}: not JSON (${e.message}): ${got.content}`);
        continue;
      }
      if (!validate(doc)) failures.push(`request ${i}: ${JSON.stringify(validate.errors)}: ${got.content}`);
    }
  }
  await Promise.all(Array.from({ length: CONCURRENCY }, worker));
  const seconds = (Date.now() - started) / 1000;
  console.log(`${s.name}: ${n - failures.length}/${n} valid, mean ${(bytes / n).toFixed(1)} bytes, ${seconds.toFixed(1)} s`);
  for (const f of failures.slice(0, 5)) console.log(`  ${f}`);
  if (failures.length > 0) failed = true;
}
process.exit(failed ? 1 : 0);
