// A model's answer as Markdown, rendered without ever reading it as HTML: the answer is
// untrusted text. `parse` turns it into a tree of plain objects ({tag, children} or a
// string); `toDom` builds DOM nodes from that tree with createElement and text nodes only,
// so "<img onerror=...>" in an answer stays those characters. Links keep http(s) and mailto
// addresses only. What it reads: fenced code blocks (```lang), headings (#..######), lists
// (-, *, +, 1.), block quotes (>), horizontal rules, paragraphs; inline `code`, **bold**,
// *italic* / _italic_, ~~struck~~ and [text](url). tests/test_webui.py runs it under node.
"use strict";
(function (root) {
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function inline(text) {
    const out = [];
    let rest = text;
    // the earliest of the inline forms, each scanned in order of precedence at its place
    const forms = [
      [/`([^`]+)`/, (m) => ({ tag: "code", children: [m[1]] })],
      [/\*\*(?=\S)([\s\S]*?\S)\*\*/, (m) => ({ tag: "strong", children: inline(m[1]) })],
      [/__(?=\S)([\s\S]*?\S)__/, (m) => ({ tag: "strong", children: inline(m[1]) })],
      [/~~(?=\S)([\s\S]*?\S)~~/, (m) => ({ tag: "del", children: inline(m[1]) })],
      [/\*(?=\S)([^*]*?\S)\*/, (m) => ({ tag: "em", children: inline(m[1]) })],
      [/\b_(?=\S)([^_]*?\S)_\b/, (m) => ({ tag: "em", children: inline(m[1]) })],
      [/\[([^\]]+)\]\(([^)\s]+)\)/, (m) => SAFE_URL.test(m[2])
        ? { tag: "a", href: m[2], children: inline(m[1]) } : m[0]],
    ];
    while (rest) {
      let best = null;
      for (const [re, make] of forms) {
        const m = re.exec(rest);
        if (m && (best === null || m.index < best.m.index)) best = { m, make };
      }
      if (best === null) { out.push(rest); break; }
      if (best.m.index > 0) out.push(rest.slice(0, best.m.index));
      out.push(best.make(best.m));
      rest = rest.slice(best.m.index + best.m[0].length);
    }
    return out;
  }

  function parse(text) {
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    const blocks = [];
    let para = [];
    const flush = () => {
      if (para.length) blocks.push({ tag: "p", children: inline(para.join("\n")) });
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/.exec(line);
      if (fence) {   // a code block, to its closing fence or the end of the answer so far
        flush();
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
        const code = { tag: "code", children: [body.join("\n")] };
        if (fence[2]) code.lang = fence[2];
        blocks.push({ tag: "pre", children: [code] });
        continue;
      }
      const heading = /^(#{1,6})\s+(.*?)\s*#*\s*$/.exec(line);
      if (heading) {
        flush();
        blocks.push({ tag: "h" + heading[1].length, children: inline(heading[2]) });
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); blocks.push({ tag: "hr", children: [] }); continue; }
      const item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      if (item) {
        flush();
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        const list = { tag, children: [] };
        for (; i < lines.length; i++) {
          const m = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(lines[i]);
          if (!m || /\d/.test(m[1]) !== (tag === "ol")) break;
          list.children.push({ tag: "li", children: inline(m[2]) });
        }
        i--;
        blocks.push(list);
        continue;
      }
      const quote = /^\s*>\s?(.*)$/.exec(line);
      if (quote) {
        flush();
        const body = [];
        for (; i < lines.length; i++) {
          const m = /^\s*>\s?(.*)$/.exec(lines[i]);
          if (!m) break;
          body.push(m[1]);
        }
        i--;
        blocks.push({ tag: "blockquote", children: parse(body.join("\n")) });
        continue;
      }
      if (!line.trim()) { flush(); continue; }
      para.push(line);
    }
    flush();
    return blocks;
  }

  function toDom(nodes, doc) {
    const frag = doc.createDocumentFragment();
    for (const node of nodes) {
      if (typeof node === "string") { frag.appendChild(doc.createTextNode(node)); continue; }
      const el = doc.createElement(node.tag);
      if (node.href) { el.href = node.href; el.rel = "noopener noreferrer"; el.target = "_blank"; }
      if (node.lang) el.className = "language-" + node.lang;
      el.appendChild(toDom(node.children, doc));
      frag.appendChild(el);
    }
    return frag;
  }

  const api = { parse, inline, toDom };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.kineticMarkdown = api;
})(typeof window !== "undefined" ? window : this);
