// kinetic's web page: a chat over /v1/chat/completions, streamed. Served by the server
// itself (kinetic/api/webui.py); it sends requests to the page's own origin only. Answers
// are shown as Markdown by markdown.js, which never reads them as HTML.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const log = $("log"), text = $("text"), key = $("key");
  let messages = [];
  let running = null;   // the AbortController of the answer being streamed

  const md = window.kineticMarkdown;
  key.value = localStorage.getItem("kinetic-api-key") || "";
  key.addEventListener("change", () => {
    localStorage.setItem("kinetic-api-key", key.value);
    showModel();   // a key error in the header is cleared (or shown) at once
  });

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

  // The model: one server's, named in the header; a router's (`kinetic serve` with no
  // model: each entry has a status), picked in a list and named in each request.
  const picker = $("models");
  picker.addEventListener("change", () => {
    localStorage.setItem("kinetic-model", picker.value);
    showModel();
  });

  function statusOf(m) {
    const s = m.status || {};
    return s.error ? "failed: " + s.error : s.value;
  }

  let asked = 0;   // showModel's calls: only the latest one's answer is shown

  async function showModel() {
    const shown = $("model"), mine = ++asked;
    try {
      const r = await fetch("v1/models", { headers: headers() });
      const body = await r.json();
      if (mine !== asked) return;
      if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
      const list = body.data || [];
      if (list.length && list[0].status) {   // a router
        const want = picker.value || localStorage.getItem("kinetic-model");
        picker.replaceChildren(...list.map((m) => {
          const option = document.createElement("option");
          option.value = m.id;
          option.textContent = m.id + " (" + statusOf(m) + ")";
          return option;
        }));
        const loaded = list.find((m) => m.status.value === "loaded");
        picker.value = list.some((m) => m.id === want) ? want : (loaded || list[0]).id;
        picker.hidden = false;
        const chosen = list.find((m) => m.id === picker.value);
        shown.textContent = chosen.status.value === "loaded" ? ""
          : "loaded when a message asks for it";
      } else if (list.length) {
        picker.hidden = true;
        shown.textContent = list[0].id + " (context " + list[0].context_length + ")";
      } else {
        throw new Error("the server lists no model");
      }
      shown.className = "";
    } catch (e) {
      if (mine !== asked) return;
      shown.textContent = e instanceof TypeError ? "the server cannot be reached: " + e
                                                 : e.message;
      shown.className = "bad";
    }
  }

  function render(div, text) {
    div.replaceChildren(md.toDom(md.parse(text), document));
  }

  // "12 tokens, 34.5 tokens/s" under an answer: the usage chunk's count and llama-server's
  // timings (the generation's own rate), else the rate seen here since the first token
  function stats(div, tokens, timings, firstAt) {
    if (!tokens) return;
    let rate = timings && timings.predicted_per_second;
    if (!rate && firstAt) rate = tokens / Math.max((performance.now() - firstAt) / 1000, 1e-3);
    div.textContent = tokens + (tokens === 1 ? " token" : " tokens") +
      (rate ? ", " + rate.toFixed(1) + " tokens/s" : "");
    div.hidden = false;
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
    const answer = bubble("assistant md", "");
    const figures = bubble("figures", "");
    think.hidden = true;
    figures.hidden = true;
    running = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    let reply = "", tokens = 0, timings = null, firstAt = 0, failed = false;
    try {
      const r = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), signal: running.signal,
        body: JSON.stringify({ messages: messages, stream: true,
                               stream_options: { include_usage: true },
                               temperature: Number($("temp").value),
                               max_tokens: Number($("max").value),
                               ...(picker.hidden ? {} : { model: picker.value }) }),
      });
      if (!r.ok) {
        const body = await r.json().catch(() => ({}));
        throw new Error((body.error && body.error.message) || r.statusText);
      }
      for await (const data of events(r)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        if (chunk.timings) timings = chunk.timings;
        const delta = (chunk.choices[0] || {}).delta || {};
        if (!firstAt && (delta.content || delta.reasoning_content)) firstAt = performance.now();
        if (delta.reasoning_content) {
          think.hidden = false;
          think.textContent += delta.reasoning_content;
        }
        if (delta.content) {
          reply += delta.content;
          render(answer, reply);
        }
        log.scrollTop = log.scrollHeight;
      }
      stats(figures, tokens, timings, firstAt);
    } catch (e) {
      failed = true;
      if (e.name !== "AbortError") {
        answer.className = "msg error";
        answer.textContent = reply + (reply ? "\n" : "") + "Error: " + e.message;
      }
    } finally {
      messages.push({ role: "assistant", content: reply });
      running = null;
      $("send").disabled = false;
      $("stop").disabled = true;
      // the key works now, or a router's model has loaded
      if (!failed && ($("model").className === "bad" || !picker.hidden)) showModel();
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
