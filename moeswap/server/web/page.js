// moeswap's web page: chat (or plain completion, for a model without a chat template),
// streamed from /v1/chat/completions or /v1/completions, beside the expert cache polled from
// /v1/moeswap/experts. No libraries and nothing fetched from elsewhere: it works offline.
"use strict";

const $ = (id) => document.getElementById(id);
const RECENT_STEPS = 16;  // a cell's "used" outline fades over this many forward steps
const HISTORY = 120;  // samples kept per chart
const state = { model: null, chat: false, messages: [], abort: null, history: [], last: null,
                cells: [], shape: "", authFailed: false };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function setStatus(text) { $("status").textContent = text; }

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = text;
  $("transcript").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// --- generation ---------------------------------------------------------------------------

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.abort || !state.model) return;
  $("prompt").value = "";
  addTurn("user", text);
  const out = addTurn("assistant", "");
  const body = { model: state.model, stream: true, stream_options: { include_usage: true },
                 max_tokens: Number($("max-tokens").value) || 128,
                 temperature: Number($("temperature").value) };
  let url = "/v1/completions";
  if (state.chat) {
    state.messages.push({ role: "user", content: text });
    body.messages = state.messages;
    url = "/v1/chat/completions";
  } else {
    body.prompt = text;
  }
  state.abort = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const started = performance.now();
  let first = null, usage = null;
  try {
    const response = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                        signal: state.abort.signal });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || response.statusText);
    }
    await readEvents(response, (chunk) => {
      if (chunk.usage) usage = chunk.usage;  // the last chunk: stream_options.include_usage
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const piece = state.chat ? (choice.delta && choice.delta.content) : choice.text;
      if (piece) {
        if (first === null) first = performance.now();
        out.textContent += piece; out.scrollIntoView({ block: "end" });
      }
    });
    showRate(out, usage, started, first, performance.now());
    if (state.chat) state.messages.push({ role: "assistant", content: out.textContent });
  } catch (e) {
    if (e.name !== "AbortError") { out.className = "turn error"; out.textContent = String(e.message || e); }
    if (state.chat && e.name !== "AbortError") state.messages.pop();
    else if (state.chat) state.messages.push({ role: "assistant", content: out.textContent });
  } finally {
    state.abort = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}

// Under a reply: its tokens, decode tokens/s (after the first token, which waits for the
// prompt) and the time to the first token.
function showRate(turn, usage, started, first, ended) {
  if (!usage || first === null) return;
  const n = usage.completion_tokens;
  const rate = n > 1 && ended > first ? (n - 1) / ((ended - first) / 1000) : null;
  const meta = document.createElement("div");
  meta.className = "turn-meta";
  meta.dataset.tokens = n;
  meta.dataset.tokensPerSecond = rate === null ? "" : rate.toFixed(2);
  meta.textContent = n + " tokens" + (rate === null ? "" : ", " + rate.toFixed(1) + " tokens/s") +
                     " (first token after " + ((first - started) / 1000).toFixed(2) + " s)";
  turn.after(meta);
}

// Server-sent events: "data: {json}" blocks separated by a blank line, then "data: [DONE]".
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk);
    }
  }
}

// --- the expert cache -----------------------------------------------------------------------

async function poll() {
  let delay = state.abort ? 100 : 1000;
  if (!state.authFailed) {
    try {
      const response = await fetch("/v1/moeswap/experts", { headers: headers(), cache: "no-store" });
      if (response.status === 401) {
        state.authFailed = true;
        setStatus("This server needs an API key: type it above.");
      } else if (response.ok) {
        show(await response.json());
        setStatus("");
      } else if (response.status === 503 && !state.model) {  // serve answers while it loads
        setStatus("The model is loading; this page fills in once it is ready.");
      } else {
        setStatus("expert cache: HTTP " + response.status);
      }
    } catch (e) {
      setStatus("server unreachable: " + (e.message || e));
      delay = 2000;
    }
  }
  setTimeout(poll, delay);
}

function show(view) {
  if (state.model !== view.model) {
    state.model = view.model;
    state.chat = view.chat;
    $("model").textContent = view.model;
    $("mode").textContent = view.chat ? "chat (the model's template)" : "completion (no chat template)";
  }
  drawGrid(view);
  showHeld(view.tiers);
  showMemory(view.memory);
  const c = view.counters;
  const now = performance.now() / 1000;
  const moved = (c.disk_bytes || 0) + (c.transfer_bytes || 0);
  const hits = c.hit_rate === null ? null : c.hit_rate * c.expert_requests;
  if (state.last) {
    const dt = Math.max(now - state.last.time, 1e-3);
    const asked = (c.expert_requests || 0) - state.last.requests;
    state.history.push({
      tps: (c.generated_tokens - state.last.generated) / dt,
      mibs: (moved - state.last.moved) / dt / 2 ** 20,
      hit: hits === null || asked <= 0 ? null : (hits - state.last.hits) / asked,
    });
    if (state.history.length > HISTORY) state.history.shift();
  }
  state.last = { time: now, generated: c.generated_tokens, moved, hits, requests: c.expert_requests || 0 };
  $("n-step").textContent = view.step === null ? "–" : view.step;
  $("n-batch").textContent = c.batch_size + (c.queue_depth ? " (+" + c.queue_depth + " waiting)" : "");
  $("n-hit").textContent = c.hit_rate === null ? "no store" : (100 * c.hit_rate).toFixed(1) + " %";
  $("n-bytes").textContent = c.disk_bytes === null ? "–" : (moved / 2 ** 20).toFixed(1) + " MiB";
  $("n-tps").textContent = c.tokens_per_second.toFixed(1);
  drawChart($("chart-tps"), state.history.map((h) => h.tps), null);
  drawChart($("chart-bytes"), state.history.map((h) => h.mibs), null);
  drawChart($("chart-hit"), state.history.map((h) => h.hit), 1);
}

const mib = (bytes) => (bytes / 2 ** 20).toFixed(1) + " MiB";

// Experts each tier holds against its slots (how many its budget fits).
function showHeld(tiers) {
  const names = Object.keys(tiers || {});
  $("held").textContent = !names.length ? "" : names.includes("mapped")
    ? "experts held: all " + tiers.mapped.held + " in RAM (the mapped file, no --host-mem)"
    : "experts held: " + names.filter((t) => tiers[t].slots)
        .map((t) => t + " " + tiers[t].held + " of " + tiers[t].slots + " slots").join(", ");
}

// A dense model has no expert grid: its weights, KV cache and working memory against the budget.
function showMemory(m) {
  const dense = Boolean(m && m.dense);
  for (const id of ["legend", "held", "axes", "grid"]) $(id).hidden = dense;
  $("memory").hidden = !dense;
  $("cache-title").textContent = dense ? "Memory" : "Expert cache";
  if (!dense) return;
  const weights = m.shared_bytes === null ? null : m.shared_bytes + (m.expert_bytes || 0);
  const used = (weights || 0) + m.kv_bytes + m.working_bytes;
  const whole = Math.max(m.budget_bytes || used, used, 1);
  const parts = $("memory").querySelectorAll(".part");
  [weights || 0, m.kv_bytes, m.working_bytes].forEach((bytes, i) => {
    parts[i].style.width = (100 * bytes / whole).toFixed(2) + "%";
  });
  $("memory-note").textContent = "A dense model: every weight in RAM, no experts to swap.";
  $("m-weights").textContent = weights === null ? "–" : mib(weights);
  $("m-kv").textContent = mib(m.kv_bytes) + " (" + m.contexts + " × " + m.ctx + " positions, " + m.kv_type + ")";
  $("m-working").textContent = mib(m.working_bytes);
  $("m-budget").textContent = m.budget_bytes === null ? "no --host-mem: what RAM holds" : mib(m.budget_bytes);
}

function drawGrid(view) {
  const grid = $("grid");
  const shape = view.layers.join(",") + "x" + view.n_experts;
  if (state.shape !== shape) {  // (re)build: one row per MoE layer, one cell per expert
    state.shape = shape;
    grid.replaceChildren();
    grid.style.gridTemplateColumns = "auto repeat(" + view.n_experts + ", minmax(3px, 1fr))";
    $("expert-axis").textContent = "expert 0 … " + (view.n_experts - 1) + " →";
    state.cells = view.layers.map((layer) => {
      const label = document.createElement("div");
      label.className = "label";
      label.textContent = layer;
      grid.appendChild(label);
      return Array.from({ length: view.n_experts }, (_, e) => {
        const cell = document.createElement("div");
        cell.className = "cell";
        cell.dataset.layer = layer;
        cell.dataset.expert = e;
        grid.appendChild(cell);
        return cell;
      });
    });
  }
  grid.dataset.step = view.step === null ? "" : view.step;
  view.layers.forEach((layer, i) => {
    view.tier[i].forEach((tier, e) => {
      const cell = state.cells[i][e];
      const last = view.last_use[i][e];
      const age = last === null || view.step === null ? null : view.step - last;
      const heat = age === null ? 0 : Math.max(0, 1 - age / RECENT_STEPS);
      cell.className = "cell tier-" + tier;
      cell.dataset.tier = tier;
      cell.dataset.lastUse = last === null ? "" : last;
      cell.style.boxShadow = heat > 0 ? "inset 0 0 0 2px rgba(255, 157, 0, " + heat.toFixed(2) + ")" : "";
      cell.title = "layer " + layer + ", expert " + e + ": " + tier +
                   (last === null ? ", not used yet" : ", last used at step " + last);
    });
  });
}

function drawChart(canvas, values, fixedMax) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth * ratio, height = canvas.clientHeight * ratio;
  if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, width, height);
  const known = values.filter((v) => v !== null && isFinite(v));
  if (!known.length) return;
  const top = fixedMax || Math.max(...known) * 1.1 || 1;
  g.strokeStyle = "#2f6fb3";
  g.lineWidth = 1.5 * ratio;
  g.beginPath();
  let drawing = false;
  values.forEach((v, i) => {  // the newest sample at the right edge
    if (v === null || !isFinite(v)) { drawing = false; return; }
    const x = width - width * (values.length - 1 - i) / (HISTORY - 1);
    const y = height - 2 * ratio - (height - 4 * ratio) * v / top;
    if (drawing) g.lineTo(x, y); else g.moveTo(x, y);
    drawing = true;
  });
  g.stroke();
  g.fillStyle = "#5b6470";
  g.font = 10 * ratio + "px system-ui, sans-serif";
  g.fillText("max " + (fixedMax ? fixedMax : Math.max(...known).toFixed(1)), 4 * ratio, 11 * ratio);
}

// --- wiring -----------------------------------------------------------------------------------

$("key").value = localStorage.getItem("moeswap-key") || "";
$("key").addEventListener("input", () => {
  localStorage.setItem("moeswap-key", $("key").value);
  state.authFailed = false;
});
$("ask").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("reset").addEventListener("click", () => { state.messages = []; $("transcript").replaceChildren(); });
poll();
