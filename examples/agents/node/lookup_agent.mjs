#!/usr/bin/env node
// A tool-using agent written against the plain `openai` npm package, with no rlfabric code: rlfabric trains it
// as it is, under agent.runner command (examples/agents/lookup_node.yaml).
//
// The lookup task (rlfabric.env.lookup): "Look up key q and answer with #### and the number." The number is only
// in the agent's lookup tool, whose table comes with the task. The agent runs its own loop and prints its final
// answer as JSON on its last line; rlfabric's reward service scores it against the row's ground truth, which the
// agent never sees.
//
// rlfabric runs it once per episode with the task as JSON on stdin, and OPENAI_BASE_URL, OPENAI_API_KEY (the
// episode's key: the gateway records every call under it) and OPENAI_MODEL in its environment, which
// `new OpenAI()` reads.
import OpenAI from "openai";

const MAX_TURNS = 3;
const TOOLS = [{
  type: "function",
  function: {
    name: "lookup",
    description: "The number stored under a key.",
    parameters: {
      type: "object",
      properties: { key: { type: "string", description: "The key." } },
      required: ["key"],
    },
  },
}];

/** The tool's data: the row's table (public; the answer's ground truth is not in the task). */
function lookupTable(task) {
  const table = task.extra_info.tools_kwargs.lookup.create_kwargs.table;
  return Object.fromEntries(Object.entries(table).filter(([, value]) => value !== null).map(([k, v]) => [k, String(v)]));
}

function runTool(table, call) {
  let key;
  try {
    key = JSON.parse(call.function.arguments).key ?? "";
  } catch {
    return "error: the arguments are not a JSON object";
  }
  return key in table ? table[key] : `error: no key ${JSON.stringify(key)}`;
}

/** One episode: the model's final answer and how many tool calls it made. */
async function run(task) {
  const client = new OpenAI();
  const model = process.env.OPENAI_MODEL || "policy";
  const table = lookupTable(task);
  const messages = [...task.messages];
  let toolCalls = 0;
  for (let turn = 0; turn < MAX_TURNS; turn++) {
    const reply = await client.chat.completions.create({ model, messages, tools: TOOLS });
    const message = reply.choices[0].message;
    if (!message.tool_calls || message.tool_calls.length === 0) {
      return { answer: message.content ?? "", metrics: { tool_calls: toolCalls } };
    }
    messages.push(message);
    for (const call of message.tool_calls) {
      toolCalls += 1;
      messages.push({ role: "tool", tool_call_id: call.id, content: runTool(table, call) });
    }
  }
  return { answer: "", metrics: { tool_calls: toolCalls } };
}

let input = "";
for await (const chunk of process.stdin) input += chunk;
console.log(JSON.stringify(await run(JSON.parse(input))));
