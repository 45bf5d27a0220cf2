// kinetic's web page: a chat over /v1/chat/completions, streamed. Served by the server
// itself (kinetic/api/webui.py); it sends requests to the page's own origin only.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const log = $("log"), text = $("text"), key = $("key");
  let messages = [];
  let running = null;   // the AbortController of the answer being streamed

  key.value = localStorage.getItem("kinetic-api-key") || "";
  key.addEventListener("change", () => localStorage.setItem("kinetic-api-key", key.value));

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (key.value) h["Authorization"] = "Bearer " + key.value;
    return h;
  }

  function bubble(role, content) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.textContent = content;
    log.appendChild(div);
    log.scrollTop = log.scrollHeight;
    return div;
  }

  async function showModel() {
    try {
      const r = await fetch("v1/models", { headers: headers() });
      const body = await r.json();
      $("model").textContent = r.ok ? body.data[0].id + " (context " + body.data[0].context_length + ")"
                                    : (body.error && body.error.message) || r.statusText;
    } catch (e) {
      $("model").textContent = "the server cannot be reached: " + e;
    }
  }

  // the events of a server-sent stream: each "data: ..." line's text
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) yield line.slice(6);
        }
      }
    }
  }

  async function send(content) {
    messages.push({ role: "user", content: content });
    bubble("user", content);
    const think = bubble("assistant reasoning", "");
    const answer = bubble("assistant", "");
    think.hidden = true;
    running = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    let reply = "";
    try {
      const r = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), signal: running.signal,
        body: JSON.stringify({ messages: messages, stream: true,
                               temperature: Number($("temp").value),
                               max_tokens: Number($("max").value) }),
      });
      if (!r.ok) {
        const body = await r.json().catch(() => ({}));
        throw new Error((body.error && body.error.message) || r.statusText);
      }
      for await (const data of events(r)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = (chunk.choices[0] || {}).delta || {};
        if (delta.reasoning_content) {
          think.hidden = false;
          think.textContent += delta.reasoning_content;
        }
        if (delta.content) {
          reply += delta.content;
          answer.textContent = reply;
        }
        log.scrollTop = log.scrollHeight;
      }
    } catch (e) {
      if (e.name !== "AbortError") {
        answer.className = "msg error";
        answer.textContent = reply + (reply ? "\n" : "") + "Error: " + e.message;
      }
    } finally {
      messages.push({ role: "assistant", content: reply });
      running = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
  }

  $("ask").addEventListener("submit", (e) => {
    e.preventDefault();
    const content = text.value.trim();
    if (!content || running) return;
    text.value = "";
    send(content);
  });
  text.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("clear").addEventListener("click", () => {
    if (running) running.abort();
    messages = [];
    log.textContent = "";
  });
  showModel();
})();
