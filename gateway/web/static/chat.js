"use strict";
// The chat page's logic: fetch + a ReadableStream SSE reader over POST /v1/chat/completions.
const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "pagoda-api-key";
let turns = [];  // the conversation sent with each request: {role, content}
let controller = null;  // the AbortController of the reply streaming now, if any

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? {Authorization: "Bearer " + key} : {};
}

function setStatus(text) { $("status").textContent = text; }

async function errorMessage(response) {
  try { return (await response.json()).error.message; } catch { return response.statusText; }
}

async function loadModels() {
  try {
    const response = await fetch("/v1/models", {headers: authHeaders()});
    if (!response.ok) { setStatus(`Models: ${response.status} ${await errorMessage(response)}`); return; }
    const select = $("model"), previous = select.value;
    select.replaceChildren(...(await response.json()).data.map((card) => new Option(card.id, card.id)));
    if (previous && [...select.options].some((option) => option.value === previous)) select.value = previous;
    setStatus("");
  } catch (error) {
    setStatus("Models: " + error.message);
  }
}

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = "message " + role;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Assistant";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.hidden = true;  // shown once a reasoning_content delta arrives
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thoughts = document.createElement("div");
  thinking.append(summary, thoughts);
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(who, thinking, content);
  $("messages").append(item);
  item.scrollIntoView({block: "end"});
  return {item, thinking, thoughts, content};
}

// The JSON payloads of the stream's `data:` lines, up to `data: [DONE]`. A network chunk may end
// mid-line, so the last partial line waits in `pending` for the next chunk.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    const lines = (pending + value).split(/\r\n|\r|\n/);
    pending = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;  // blank separators, comments, other fields
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || controller) return;
  $("input").value = "";
  const conversation = turns;  // "New chat" during the stream starts another one
  conversation.push({role: "user", content: text});
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.item.setAttribute("aria-busy", "true");
  const system = $("system").value.trim();
  const body = {
    stream: true,
    messages: system ? [{role: "system", content: system}, ...conversation] : [...conversation],
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("model").value) body.model = $("model").value;  // else the gateway's default model
  controller = new AbortController();
  setBusy(true);
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: controller.signal,
      headers: {"Content-Type": "application/json", ...authHeaders()},
    });
    if (!response.ok) throw new Error(`${response.status} ${await errorMessage(response)}`);
    for await (const chunk of sseData(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);  // an error after the stream began
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (delta.reasoning_content) {
        reply.thinking.hidden = false;
        reply.thoughts.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        answer += delta.content;
        reply.content.textContent = answer;
        reply.item.scrollIntoView({block: "end"});
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") {
      reply.item.classList.add("error");
      setStatus("Reply: " + error.message);
    }
  } finally {
    // What was streamed stays in the conversation, a stopped reply too; a failed turn leaves it.
    if (answer) conversation.push({role: "assistant", content: answer});
    else conversation.pop();
    reply.item.removeAttribute("aria-busy");
    reply.item.dataset.done = "true";
    controller = null;
    setBusy(false);
    $("input").focus();
  }
}

for (const name of ["temperature", "top_p", "max_tokens"]) {
  const show = () => { $(name + "-value").value = $(name).value; };
  $(name).addEventListener("input", show);
  show();
}
$("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
$("api-key").addEventListener("change", () => {
  const key = $("api-key").value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
  loadModels();  // a key may be what /v1/models was refused for
});
$("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  turns = [];
  $("messages").replaceChildren();
  $("input").focus();
});
loadModels();
$("input").focus();
