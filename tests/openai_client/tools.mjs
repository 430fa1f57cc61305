// A tool-call round trip through pdserve's HTTP API as the official
// `openai` client makes it: the model calls a tool (tool_choice
// "required", then a named function, streamed and gathered by the client's
// own stream helper), the caller runs the tool and sends its result back
// with the assistant's call in the history, and the model answers in words.
// Every call's arguments are checked by ajv against the tool's schema. Run
// by tests/cluster/openai_client_test.cc, which sets PDSERVE_URL and
// PDSERVE_KEY.
import assert from 'node:assert/strict';

import Ajv2020 from 'ajv/dist/2020.js';
import OpenAI from 'openai';

const url = process.env.PDSERVE_URL;
const key = process.env.PDSERVE_KEY;
assert.ok(url && key, 'PDSERVE_URL and PDSERVE_KEY must be set');
const client = new OpenAI({ baseURL: url, apiKey: key, maxRetries: 0, timeout: 90_000 });

const addSchema = {
  type: 'object',
  properties: { a: { type: 'integer' }, b: { type: 'integer' } },
  required: ['a', 'b'],
  additionalProperties: false,
};
const tools = [
  { type: 'function', function: { name: 'add', description: 'Adds two integers.', parameters: addSchema } },
];
const validAdd = new Ajv2020({ strict: false }).compile(addSchema);
const question = { role: 'user', content: 'What is 2 plus 3?' };

function checkCall(call, what) {
  assert.equal(call.type, 'function', what);
  assert.equal(call.function.name, 'add', what);
  assert.match(call.id, /^call_/, what);
  const args = JSON.parse(call.function.arguments);
  assert.ok(validAdd(args), `${what}: ${call.function.arguments}: ${JSON.stringify(validAdd.errors)}`);
  return args;
}

// Each seed: the call, the tool's result, the answer.
for (const seed of [1, 2, 3]) {
  const first = await client.chat.completions.create({
    model: 'kjv-tiny', messages: [question], tools, tool_choice: 'required', parallel_tool_calls: false,
    seed, temperature: 0.8, max_tokens: 100,
  });
  const choice = first.choices[0];
  assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(choice));
  assert.equal(choice.message.content, null);
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  const args = checkCall(call, `seed ${seed}`);

  const answer = await client.chat.completions.create({
    model: 'kjv-tiny',
    messages: [question, choice.message, { role: 'tool', tool_call_id: call.id, content: String(args.a + args.b) }],
    tools, seed, temperature: 0.8, max_tokens: 24,
  });
  const a = answer.choices[0];
  assert.ok(['stop', 'length', 'tool_calls'].includes(a.finish_reason), a.finish_reason);
  if (a.finish_reason !== 'tool_calls') assert.ok(a.message.content.length > 0, JSON.stringify(a));
  console.log(`seed ${seed}: add(${call.function.arguments}) = ${args.a + args.b}; answer: ` +
              `${JSON.stringify(a.message.content)} (${a.finish_reason})`);
}

// Streamed, a named function: the client's stream helper gathers the
// deltas (id and name first, then the arguments in pieces) into the call.
for (const seed of [4, 5]) {
  const stream = client.chat.completions.stream({
    model: 'kjv-tiny', messages: [question], tools,
    tool_choice: { type: 'function', function: { name: 'add' } }, seed, temperature: 1.0, max_tokens: 100,
  });
  let pieces = 0;
  stream.on('chunk', (chunk) => {
    for (const c of chunk.choices) pieces += c.delta?.tool_calls?.length ?? 0;
  });
  const done = await stream.finalChatCompletion();
  const choice = done.choices[0];
  assert.equal(choice.finish_reason, 'tool_calls');
  assert.equal(choice.message.tool_calls.length, 1);
  const args = checkCall(choice.message.tool_calls[0], `streamed seed ${seed}`);
  assert.ok(pieces >= 2, `the arguments came in ${pieces} pieces`);
  console.log(`streamed seed ${seed}: add(${JSON.stringify(args)}) in ${pieces} deltas`);
}

// Refused by name: a schema beyond the supported subset, an unknown tool.
for (const [body, param] of [
  [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { x: { type: 'string', pattern: 'a' } } } } }] },
    'tools[0].function.parameters'],
  [{ tools, tool_choice: { type: 'function', function: { name: 'sub' } } }, 'tool_choice.function.name'],
]) {
  await assert.rejects(
    client.chat.completions.create({ model: 'kjv-tiny', messages: [question], max_tokens: 4, ...body }),
    (e) => e.status === 400 && e.param === param, param);
}
console.log('tools: round trips passed');
