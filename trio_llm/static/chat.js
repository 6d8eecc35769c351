// The trio_llm chat page: one WebSocket to /v1/ws, one generation at a time.
//
// Frames (docs/websocket.md): the page sends {"type": "chat", id, messages, max_tokens,
// temperature} and {"type": "cancel", id}; the server answers with "delta" frames, then one
// "done" (finish_reason "abort" after a cancel) or one "error".
// Model output only ever reaches the page as text (textContent, text nodes), never as HTML.
"use strict";

(() => {
  const KEY_STORAGE = "trio_llm.api_key";
  const MAX_RECONNECT_DELAY_MS = 10000;
  const CLOSE_MEANINGS = {
    1000: "closed",
    1001: "the server is shutting down",
    1003: "the server cannot read what was sent",
    1006: "the connection was lost",
    1007: "the server refused malformed data",
    1008: "refused",
    1009: "a message was too large",
    1011: "the server failed",
  };

  const byId = (id) => document.getElementById(id);
  const ui = {
    status: byId("status"),
    conversation: byId("conversation"),
    empty: byId("empty"),
    prompt: byId("prompt"),
    send: byId("send"),
    stop: byId("stop"),
    maxTokens: byId("max-tokens"),
    temperature: byId("temperature"),
    apiKey: byId("api-key"),
    newChat: byId("new-chat"),
    settings: byId("settings"),
  };

  const history = []; // finished turns; every request sends them all, then the new question
  let socket = null;
  let pending = null; // a chat frame waiting for the socket to open
  let current = null; // the generation in flight (see newGeneration)
  let reconnectTimer = null;
  let reconnectAttempts = 0;
  let keyChanged = false;
  let nextId = 0;

  // ---- small DOM helpers ------------------------------------------------------------------

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function nearBottom() {
    const c = ui.conversation;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  }

  function append(node) {
    const stick = nearBottom();
    ui.empty.hidden = true;
    ui.conversation.append(node);
    if (stick) ui.conversation.scrollTop = ui.conversation.scrollHeight;
  }

  function setStatus(state, text) {
    ui.status.dataset.state = state;
    ui.status.textContent = text;
  }

  function setBusy(busy) {
    ui.send.disabled = busy;
    ui.stop.disabled = !busy;
    ui.newChat.disabled = busy;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  // An OpenAI-style error object as a readable block: the message, then its type/param/code.
  function errorBlock(error) {
    const block = element("div", "error");
    block.dataset.testid = "error";
    block.append(error?.message || "unknown error");
    const detail = [error?.type, error?.param && `param: ${error.param}`, error?.code && `code: ${error.code}`]
      .filter(Boolean)
      .join(" · ");
    if (detail) block.append(element("span", "detail", detail));
    return block;
  }

  function showNotice(error) {
    const note = element("div", "message notice");
    note.append(errorBlock(error));
    append(note);
  }

  function addMessage(role, text) {
    const message = element("div", `message ${role}`);
    message.dataset.testid = `${role}-message`;
    message.append(element("div", "content", text));
    append(message);
    return message;
  }

  // ---- the socket -------------------------------------------------------------------------

  function socketUrl() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = new URL(`${scheme}//${location.host}/v1/ws`);
    const key = ui.apiKey.value.trim();
    if (key) url.searchParams.set("api_key", key);
    return url.href;
  }

  function connect() {
    clearTimeout(reconnectTimer);
    reconnectTimer = null;
    if (socket && socket.readyState <= WebSocket.OPEN) return; // CONNECTING or OPEN
    setStatus("connecting", "connecting…");
    const ws = new WebSocket(socketUrl());
    let opened = false;
    socket = ws;
    ws.onopen = () => {
      opened = true;
      reconnectAttempts = 0;
      setStatus("open", "connected");
      if (pending) {
        const frame = pending;
        pending = null;
        transmit(frame);
      }
    };
    ws.onmessage = (event) => onFrame(event.data);
    // An "error" event is always followed by "close", which does the reporting.
    ws.onclose = (event) => onClose(ws, event, opened);
  }

  // Close the socket on purpose (a new API key) and open a fresh one.
  function reconnectNow() {
    if (socket) {
      const old = socket;
      socket = null; // its close event is then ignored
      old.close(1000, "reconnecting");
    }
    reconnectAttempts = 0;
    connect();
  }

  function closeText(event) {
    const meaning = CLOSE_MEANINGS[event.code] || "closed";
    const reason = event.reason ? `: ${event.reason}` : "";
    return `${meaning}${reason} (code ${event.code})`;
  }

  function onClose(ws, event, opened) {
    if (ws !== socket) return;
    socket = null;
    pending = null;
    const text = closeText(event);
    const error = {
      message: opened ? `The connection closed — ${text}` : `Could not connect to /v1/ws — ${text}`,
    };
    if (current) fail(current, error);
    else if (opened || event.code === 1008) showNotice(error);
    if (event.code === 1008) {
      // Retrying with the same key would only be refused again: wait for a new key or a Send.
      setStatus("closed", `refused (${event.reason || "check the API key"}); set the key, then send`);
      return;
    }
    const delay = Math.min(MAX_RECONNECT_DELAY_MS, 500 * 2 ** reconnectAttempts);
    reconnectAttempts += 1;
    setStatus("closed", `disconnected — ${text}; reconnecting in ${Math.ceil(delay / 1000)} s`);
    reconnectTimer = setTimeout(connect, delay);
  }

  function transmit(frame) {
    if (current && current.id === frame.id) current.sentAt = performance.now();
    socket.send(JSON.stringify(frame));
  }

  // ---- one generation ---------------------------------------------------------------------

  function newGeneration(id, turn, userMessage) {
    const message = element("div", "message assistant streaming");
    message.dataset.testid = "assistant-message";
    message.dataset.state = "streaming";
    const content = element("div", "content");
    content.dataset.testid = "answer";
    const textNode = document.createTextNode("");
    content.append(textNode);
    const stats = element("div", "stats");
    stats.dataset.testid = "stats";
    message.append(content, stats);
    append(message);
    return {
      id,
      turn,
      userMessage,
      message,
      textNode,
      stats,
      text: "",
      sentAt: performance.now(),
      firstAt: null,
      numTokens: 0,
      stopping: false,
    };
  }

  function onFrame(data) {
    let frame;
    try {
      frame = JSON.parse(data);
    } catch {
      showNotice({ message: "The server sent a frame that is not JSON." });
      return;
    }
    const mine = current !== null && frame.id === current.id;
    if (frame.type === "delta" && mine) onDelta(current, frame);
    else if (frame.type === "done" && mine) onDone(current, frame);
    else if (frame.type === "error") {
      // An error without an id (or another id) ends nothing: it is only shown.
      if (mine) fail(current, frame.error);
      else showNotice(frame.error);
    }
  }

  function onDelta(gen, frame) {
    if (frame.index) return; // the page asks for one choice; only index 0 is shown
    if (gen.firstAt === null) gen.firstAt = performance.now();
    gen.numTokens += frame.num_tokens || 0;
    if (!frame.text) return;
    const stick = nearBottom();
    gen.text += frame.text;
    gen.textNode.appendData(frame.text);
    if (stick) ui.conversation.scrollTop = ui.conversation.scrollHeight;
  }

  function statsItem(className, text) {
    const item = element("span", className, text);
    item.dataset.testid = className;
    return item;
  }

  function onDone(gen, frame) {
    const doneAt = performance.now();
    const choice = (frame.choices || []).find((c) => !c.index) || {};
    const tokens = frame.usage?.completion_tokens ?? gen.numTokens;
    const seconds = gen.firstAt === null ? 0 : (doneAt - gen.firstAt) / 1000;
    const stopped = choice.finish_reason === "abort";
    const items = [
      statsItem("ttft", gen.firstAt === null ? "TTFT —" : `TTFT ${Math.round(gen.firstAt - gen.sentAt)} ms`),
      statsItem("tps", seconds > 0 && tokens > 0 ? `${(tokens / seconds).toFixed(1)} tok/s` : "— tok/s"),
      statsItem("tokens", `${tokens} token${tokens === 1 ? "" : "s"}`),
      stopped
        ? statsItem("stopped", "stopped")
        : statsItem("finish", `finish: ${choice.finish_reason ?? "unknown"}`),
    ];
    gen.stats.replaceChildren(...items);
    gen.stats.title = "TTFT: send to first text; tok/s: output tokens / (done − first text)";
    if (gen.text) history.push(gen.turn, { role: "assistant", content: gen.text });
    else gen.userMessage.classList.add("failed"); // nothing to answer with: leave it out
    end(gen, stopped ? "stopped" : "done");
  }

  function fail(gen, error) {
    gen.message.append(errorBlock(error));
    gen.userMessage.classList.add("failed");
    gen.userMessage.title = "not part of the conversation (the answer failed)";
    if (!ui.prompt.value) ui.prompt.value = gen.turn.content; // easy to retry
    end(gen, "error");
  }

  // Ended before it was ever sent (Stop while still connecting).
  function dropUnsent(gen) {
    pending = null;
    gen.stats.replaceChildren(statsItem("stopped", "stopped"));
    gen.userMessage.classList.add("failed");
    end(gen, "stopped");
  }

  function end(gen, state) {
    gen.message.classList.remove("streaming");
    gen.message.dataset.state = state;
    if (current === gen) current = null;
    setBusy(false);
    if (keyChanged) {
      keyChanged = false;
      reconnectNow();
    }
  }

  // ---- user actions -----------------------------------------------------------------------

  // A number field's value as a number; anything else is sent as typed, for the server to judge.
  function readNumber(input) {
    const raw = input.value.trim();
    if (raw === "") return undefined;
    const value = Number(raw);
    return Number.isFinite(value) ? value : raw;
  }

  function send() {
    const text = ui.prompt.value.trim();
    if (!text || current) return;
    ui.prompt.value = "";
    const turn = { role: "user", content: text };
    const userMessage = addMessage("user", text);
    nextId += 1;
    const id = `chat-${nextId}-${Date.now().toString(36)}`;
    const frame = { type: "chat", id, messages: [...history, turn] };
    const maxTokens = readNumber(ui.maxTokens);
    if (maxTokens !== undefined) frame.max_tokens = maxTokens;
    const temperature = readNumber(ui.temperature);
    if (temperature !== undefined) frame.temperature = temperature;
    current = newGeneration(id, turn, userMessage);
    setBusy(true);
    if (socket && socket.readyState === WebSocket.OPEN) transmit(frame);
    else {
      pending = frame;
      connect();
    }
  }

  function stop() {
    if (!current || current.stopping) return;
    current.stopping = true;
    ui.stop.disabled = true;
    if (pending && pending.id === current.id) dropUnsent(current);
    else if (socket && socket.readyState === WebSocket.OPEN) {
      socket.send(JSON.stringify({ type: "cancel", id: current.id }));
    }
    // The answer ends when the server's "done" (finish_reason "abort") arrives.
  }

  function newChat() {
    if (current) return;
    history.length = 0;
    ui.conversation.replaceChildren(ui.empty);
    ui.empty.hidden = false;
    ui.prompt.focus();
  }

  function loadKey() {
    try {
      return localStorage.getItem(KEY_STORAGE) || "";
    } catch {
      return ""; // storage may be disabled
    }
  }

  function saveKey() {
    const key = ui.apiKey.value.trim();
    try {
      if (key) localStorage.setItem(KEY_STORAGE, key);
      else localStorage.removeItem(KEY_STORAGE);
    } catch {
      // storage may be disabled: the key then lasts as long as the page
    }
    if (current) keyChanged = true; // reconnect once the answer is done
    else reconnectNow();
  }

  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  ui.send.addEventListener("click", send);
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);
  ui.apiKey.value = loadKey();
  ui.apiKey.addEventListener("change", saveKey);
  ui.settings.addEventListener("submit", (event) => event.preventDefault()); // Enter in a field

  setBusy(false);
  connect();
  ui.prompt.focus();
})();
