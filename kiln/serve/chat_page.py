"""The chat page served at `/`: one self-contained HTML file (no CDN, no build step) that streams
answers from /v1/chat/completions with fetch and parses the server-sent events itself.

The conversation lives in the page: each request sends the history, as the API is stateless. Before
each turn the page counts the history's tokens with the server's /tokenize and drops the oldest
exchanges (never the system message or the question) until the reply has room, then caps max_tokens
to what is left of the context: the API itself refuses an over-long request, as OpenAI's does.
Messages are inserted as text nodes, never as HTML, so a reply cannot inject markup.
"""

from __future__ import annotations

import json

_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Kiln chat</title>
<style>
  :root { --fg: #1d1d1f; --muted: #6e6e73; --line: #d8d8dc; --user: #e8f0fe; --bot: #f5f5f7; --accent: #b4461b; }
  * { box-sizing: border-box; }
  [hidden] { display: none !important; }  /* else a rule that sets display (header label) shows it */
  body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
         display: flex; flex-direction: column; height: 100vh; }
  header { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; padding: 10px 16px;
           border-bottom: 1px solid var(--line); }
  header h1 { font-size: 16px; margin: 0 12px 0 0; }
  header label { color: var(--muted); font-size: 13px; display: flex; gap: 6px; align-items: center; }
  header input { width: 80px; padding: 3px 6px; border: 1px solid var(--line); border-radius: 6px; }
  header input#apikey { width: 160px; }
  #log { flex: 1; overflow-y: auto; padding: 16px; display: flex; flex-direction: column; gap: 10px; }
  .msg { max-width: 80ch; padding: 8px 12px; border-radius: 10px; white-space: pre-wrap; word-wrap: break-word; }
  .user { align-self: flex-end; background: var(--user); }
  .assistant { align-self: flex-start; background: var(--bot); }
  .assistant[data-state="streaming"]::after { content: "\258D"; color: var(--accent); }
  .error { align-self: center; color: #a00; font-size: 13px; }
  .msg pre { margin: 4px 0; padding: 6px 8px; background: #eaeaee; border-radius: 6px; overflow-x: auto;
             font: 13px/1.4 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; white-space: pre; }
  #note { padding: 6px 16px; background: #fff4e5; color: #7a4b00; font-size: 13px;
          border-bottom: 1px solid var(--line); }
  form { display: flex; gap: 8px; padding: 12px 16px; border-top: 1px solid var(--line); }
  textarea { flex: 1; resize: none; height: 56px; padding: 8px; font: inherit; border: 1px solid var(--line);
             border-radius: 8px; }
  button { padding: 0 16px; border: 0; border-radius: 8px; background: var(--accent); color: white; font: inherit;
           cursor: pointer; }
  button.secondary { background: none; color: var(--muted); border: 1px solid var(--line); padding: 3px 10px; }
  button:disabled { opacity: 0.5; cursor: default; }
</style>
</head>
<body>
<header>
  <h1>Kiln chat &middot; <span id="model"></span></h1>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7"></label>
  <label>max tokens <input id="max_tokens" type="number" min="1" step="1" value="256"></label>
  <label id="keyfield" hidden>API key <input id="apikey" type="password" autocomplete="off"></label>
  <button id="reset" class="secondary" type="button">New chat</button>
</header>
<div id="note" hidden>This model has had no chat training (no supervised fine-tuning stage): it
continues text and its replies may not answer the question. Train it with <code>kiln sft</code> for a chat model.</div>
<main id="log" aria-live="polite"></main>
<form id="form">
  <textarea id="input" aria-label="Message (Enter sends, Shift+Enter starts a new line)"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
"use strict";
const MODEL = @@MODEL@@;
const AUTH = @@AUTH@@;
const CONTEXT = @@CONTEXT@@;  // the model's context, in tokens
const CHAT_TRAINED = @@CHAT_TRAINED@@;
const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), send = $("send");
let history = [];
let controller = null;

$("model").textContent = MODEL;
$("note").hidden = CHAT_TRAINED;
if (AUTH) {
  $("keyfield").hidden = false;
  $("apikey").value = sessionStorage.getItem("kiln-api-key") || "";
  $("apikey").addEventListener("change", () => sessionStorage.setItem("kiln-api-key", $("apikey").value));
}

// Text between ``` fences becomes a <pre> block; everything goes in as text nodes, never as HTML.
function render(div, text) {
  const parts = text.split("```");
  const nodes = parts.map((part, i) => {
    if (i % 2 === 0) return document.createTextNode(part);
    const pre = document.createElement("pre");
    pre.textContent = part.replace(/^[\w+-]*\n/, "");  // the fence's language tag is not code
    return pre;
  });
  div.replaceChildren(...nodes);
}

function bubble(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  render(div, text);
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

function showError(message) {
  const div = bubble("error", message);
  div.className = "error";
}

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  if (AUTH && $("apikey").value) headers["Authorization"] = "Bearer " + $("apikey").value;
  return headers;
}

async function errorMessage(response) {
  try { return (await response.json()).error.message; } catch (e) { return response.status + " " + response.statusText; }
}

async function countTokens(messages) {
  const response = await fetch("/tokenize", { method: "POST", headers: authHeaders(), body: JSON.stringify({ messages }) });
  if (!response.ok) throw new Error(await errorMessage(response));
  return (await response.json()).count;
}

// Drop the oldest exchanges (the system message stays, and the question) until a reply of `want`
// tokens fits the context; returns the prompt's token count. As `kiln chat` does.
async function fitHistory(want) {
  const start = history.length && history[0].role === "system" ? 1 : 0;
  for (;;) {
    const count = await countTokens(history);
    if (CONTEXT - count >= want || history.length - start <= 1) {
      if (count >= CONTEXT) throw new Error("the message is too long for the model's context of " + CONTEXT + " tokens");
      return count;
    }
    history.splice(start, history.length - start > 2 ? 2 : 1);
    log.dataset.dropped = String(Number(log.dataset.dropped || 0) + 1);
  }
}

function numberSetting(id, fallback) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : fallback;
}

// Server-sent events: blocks separated by a blank line, each with "data: <json>" lines.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

async function ask(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  reply.dataset.state = "streaming";
  send.disabled = true;
  controller = new AbortController();
  let answer = "";
  try {
    const wanted = Math.max(1, Math.round(numberSetting("max_tokens", 256)));
    const count = await fitHistory(Math.min(wanted, Math.floor(CONTEXT / 4)));
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders(), signal: controller.signal,
      body: JSON.stringify({
        model: MODEL, messages: history, stream: true,
        temperature: numberSetting("temperature", 0.7),
        max_tokens: Math.max(1, Math.min(wanted, CONTEXT - count)),
      }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          render(reply, answer);
          log.scrollTop = log.scrollHeight;
        }
        if (choice.finish_reason) reply.dataset.finish = choice.finish_reason;
      }
    }
    if (!answer) {  // a reply that stopped at once: say so rather than leave an empty bubble
      reply.textContent = "(the model stopped without any text)";
      reply.dataset.empty = "true";
    }
    history.push({ role: "assistant", content: answer });
  } catch (err) {
    history.pop();  // the question goes unanswered: resending it starts from the same history
    if (!answer) reply.remove();  // no empty bubble: the error line says what happened
    if (err.name !== "AbortError") showError(err.message);
  } finally {
    reply.dataset.state = "done";
    send.disabled = false;
    controller = null;
    input.focus();
  }
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text || send.disabled) return;
  input.value = "";
  ask(text);
});
input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
$("reset").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  log.replaceChildren();
  input.focus();
});
input.focus();
</script>
</body>
</html>
"""


def _js(value) -> str:
    # "<" escaped so a name containing "</script>" cannot end the script element.
    return json.dumps(value).replace("<", "\\u003c")


def chat_page(model_name: str, auth: bool = False, context: int = 2048, chat_trained: bool = True) -> str:
    """The page for one served model; auth shows an API-key field whose value is sent as a Bearer token;
    context (the model's, in tokens) bounds the history it sends; chat_trained False shows a note that
    the model has no chat training."""
    values = {"MODEL": model_name, "AUTH": bool(auth), "CONTEXT": int(context), "CHAT_TRAINED": bool(chat_trained)}
    page = _PAGE
    for name, value in values.items():
        page = page.replace(f"@@{name}@@", _js(value))
    return page
