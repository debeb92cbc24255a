"""The chat page served at `/`: one self-contained HTML file (no CDN, no build step) that streams
answers from /v1/chat/completions with fetch and parses the server-sent events itself.

The conversation lives in the page: each request sends the whole history, as the API is stateless.
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
<main id="log" aria-live="polite"></main>
<form id="form">
  <textarea id="input" aria-label="Message (Enter sends, Shift+Enter starts a new line)"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
"use strict";
const MODEL = @@MODEL@@;
const AUTH = @@AUTH@@;
const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), send = $("send");
let history = [];
let controller = null;

$("model").textContent = MODEL;
if (AUTH) {
  $("keyfield").hidden = false;
  $("apikey").value = sessionStorage.getItem("kiln-api-key") || "";
  $("apikey").addEventListener("change", () => sessionStorage.setItem("kiln-api-key", $("apikey").value));
}

function bubble(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text;
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

function showError(message) {
  const div = bubble("error", message);
  div.className = "error";
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
  const headers = { "Content-Type": "application/json" };
  if (AUTH && $("apikey").value) headers["Authorization"] = "Bearer " + $("apikey").value;
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers, signal: controller.signal,
      body: JSON.stringify({
        model: MODEL, messages: history, stream: true,
        temperature: numberSetting("temperature", 0.7),
        max_tokens: Math.max(1, Math.round(numberSetting("max_tokens", 256))),
      }),
    });
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try { message = (await response.json()).error.message; } catch (e) {}
      throw new Error(message);
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          reply.textContent = answer;
          log.scrollTop = log.scrollHeight;
        }
        if (choice.finish_reason) reply.dataset.finish = choice.finish_reason;
      }
    }
    history.push({ role: "assistant", content: answer });
  } catch (err) {
    history.pop();  // the question goes unanswered: resending it starts from the same history
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


def chat_page(model_name: str, auth: bool = False) -> str:
    """The page for one served model; auth shows an API-key field whose value is sent as a Bearer token."""
    return _PAGE.replace("@@MODEL@@", _js(model_name)).replace("@@AUTH@@", _js(bool(auth)))
