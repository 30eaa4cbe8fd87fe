// The Vercel AI SDK's default OpenAI provider (`openai(model)`: the Responses API) against a
// Laya server: plain text, streamed text, and tools with a typed answer (Output.object).
// Usage: node check.mjs URL MODEL; prints one JSON object.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, Output, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const [url, model] = process.argv.slice(2);
const provider = createOpenAI({ baseURL: `${url}/v1`, apiKey: "unused" });
const out = {};

const plain = await generateText({
  model: provider(model), prompt: "Say hello.", maxOutputTokens: 16, temperature: 0,
});
out.plain = { text: plain.text, finishReason: plain.finishReason,
              inputTokens: plain.usage.inputTokens, outputTokens: plain.usage.outputTokens };

const streamed = streamText({
  model: provider(model), prompt: "Say hello.", maxOutputTokens: 16, temperature: 0,
});
let text = "";
for await (const delta of streamed.textStream) text += delta;
out.streamed = { text, finishReason: await streamed.finishReason };

let calls = 0;
const typed = await generateText({
  model: provider(model),
  prompt: "What is the population of Paris? Use the lookup tool if you need it.",
  tools: {
    lookup: tool({
      description: "Look up a city's population",
      inputSchema: z.object({ city: z.string().max(40) }),
      execute: async ({ city }) => { calls += 1; return { city, population: 2100000 }; },
    }),
  },
  output: Output.object({ schema: z.object({ city: z.string().max(40), population: z.number() }) }),
  // The small model would call the tool at every step: after the first, it answers.
  prepareStep: async ({ stepNumber }) => (stepNumber > 0 ? { toolChoice: "none" } : {}),
  stopWhen: stepCountIs(3),
  maxOutputTokens: 96,
  temperature: 0,
  providerOptions: { openai: { parallelToolCalls: false } },
});
let output = null;
try { output = typed.output; } catch (e) { output = { error: String(e) }; }
out.typed = { output, calls, steps: typed.steps.map((s) => ({
  text: s.text, toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
  finishReason: s.finishReason })) };
console.log(JSON.stringify(out));
