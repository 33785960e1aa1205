// The Squall console page: renders each snapshot the server streams (server-sent events),
// reads a topic's recent events and publishes a test event through the JSON API, and
// runs operator actions after a confirmation. Every value goes in as text, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (cls) td.className = cls;
  return td;
}

function fill(tableId, items, render) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren();
  for (const item of items || []) render(body.insertRow(), item);
}

function list(id, lines, classOf) {
  const ul = $(id);
  ul.replaceChildren();
  for (const line of lines || []) {
    const li = document.createElement("li");
    li.textContent = typeof line === "string" ? line : line.text;
    if (classOf) li.className = classOf(line);
    ul.appendChild(li);
  }
}

function utc(ms) {
  return new Date(ms).toISOString().replace("T", " ").replace(/\.\d+Z$/, "");
}

function rate(value) {
  return value === null || value === undefined ? "-" : value.toFixed(1);
}

function render(s) {
  $("live").textContent = (s.stale ? "stale " : "live ") + utc(s.at_ms);
  $("live").className = s.stale ? "live stale" : "live";
  $("gateway").textContent = s.gateway ? "gateway " + s.gateway : "";
  const banner = $("banner");
  banner.hidden = !s.error;
  banner.textContent = s.error || "";
  $("master").textContent = s.master_id || "none";
  $("epoch").textContent = s.epoch === undefined ? "?" : s.epoch;
  fill("replicas", s.replicas, (row, r) => {
    row.dataset.node = r.node;
    row.className = r.master ? "master" : (r.state === "unreachable" ? "down" : "");
    cell(row, r.node);
    cell(row, r.coordinator);
    cell(row, r.group.length ? r.group_name + " [" + r.group.join(",") + "]" : r.group_name);
    cell(row, r.role, "role");
    cell(row, r.state, "state");
    cell(row, r.epoch, "num");
    cell(row, r.lsn, "num");
    cell(row, r.catching_up ? r.lag + " (catching up)" : r.lag, "num");
    // Silence past a heartbeat or two: the master cannot reach that replica.
    cell(row, r.heard_ms === null ? "-" :
      (r.heard_ms < 1000 ? "now" : (r.heard_ms / 1000).toFixed(1) + "s ago"), "num");
    cell(row, r.max, "num");
    cell(row, r.quarantine ? r.quarantine.operator + " " + r.quarantine.at + " " +
      r.quarantine.reason : "-");
    cell(row, r.overrides.join("; ") || "-");
    const actions = row.insertCell();
    if (s.actions_enabled) {
      const choices = r.quarantine ? ["unquarantine"] : ["transfer", "quarantine"];
      for (const action of choices) {
        if (action === "transfer" && r.master) continue;
        const button = document.createElement("button");
        button.textContent = action;
        button.dataset.action = action;
        button.addEventListener("click", () => askAction(action, r.node));
        actions.appendChild(button);
      }
    }
  });
  list("notes", s.explain ? s.explain.notes : []);
  list("explain-master", s.explain ? s.explain.master : []);
  list("explain-failed", (s.explain ? s.explain.if_failed : []).map((v) =>
    v.failed + " fails: " + (v.leader ? v.leader + " would lead" : "no master") + " (" + v.why + ")"));
  list("timeline", (s.timeline || []).map((e) => ({text: utc(e.at_ms) + "  " + e.text, kind: e.kind})),
    (e) => e.kind);
  fill("topics", s.topics, (row, t) => {
    const name = cell(row, "");
    const link = document.createElement("a");
    link.href = "#topic-view";
    link.textContent = t.name;
    link.addEventListener("click", () => { $("topic-name").value = t.name; $("topic-from").value = ""; readEvents(); });
    name.appendChild(link);
    cell(row, t.kind);
    cell(row, t.events, "num");
    cell(row, t.first_offset + ".." + t.next_offset, "num");
    cell(row, t.size_bytes === null ? "n/a" : t.size_bytes, "num");
    cell(row, rate(t.publish_rate), "num");
    cell(row, rate(t.consume_rate), "num");
  });
  fill("subscriptions", s.subscriptions, (row, d) => {
    cell(row, d.topic); cell(row, d.name); cell(row, d.cursor, "num"); cell(row, d.backlog, "num");
    cell(row, d.shared ? "yes (" + d.outstanding + " leased, " + d.dead_lettered + " dead-lettered)" : "no");
  });
  fill("push", s.push, (row, p) => {
    cell(row, p.topic); cell(row, p.subscriber_id); cell(row, p.endpoint); cell(row, p.cursor, "num");
    cell(row, p.failures, "num"); cell(row, p.last_error || "-");
  });
  // The open topic view follows the topic's new events while it shows the latest ones.
  if ($("topic-name").value && !$("topic-from").value && !reading) readEvents(true);
}

function show(id, text, isError) {
  const box = $(id);
  box.hidden = !text;
  box.textContent = text || "";
  box.className = isError ? "message error" : "message";
}

async function api(method, path, body) {
  const options = {method: method, headers: {}, credentials: "same-origin"};
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  let document_ = {};
  try { document_ = await response.json(); } catch (e) { document_ = {error: response.statusText}; }
  if (!response.ok) throw new Error(document_.error || ("HTTP " + response.status));
  return document_;
}

let reading = false;
// Only the newest read may fill the table: an older answer arriving late (a refresh of
// the previous topic) must not overwrite what the person asked for since.
let readSequence = 0;

async function readEvents(quiet) {
  const topic = $("topic-name").value.trim();
  if (!topic) return;
  const params = new URLSearchParams();
  if ($("topic-from").value.trim()) params.set("from", $("topic-from").value.trim());
  if ($("topic-count").value.trim()) params.set("count", $("topic-count").value.trim());
  const mine = ++readSequence;
  reading = true;
  try {
    const d = await api("GET", "/api/topics/" + encodeURIComponent(topic) + "/events?" + params);
    if (mine !== readSequence) return;
    const hex = $("show-hex").checked;
    fill("events", d.events, (row, e) => {
      row.dataset.offset = e.offset;
      cell(row, e.offset, "num");
      cell(row, utc(e.timestamp_ms));
      cell(row, e.publisher_id + (e.sequence ? " #" + e.sequence : ""));
      cell(row, e.key_text !== null ? e.key_text : "0x" + e.key_hex, "payload");
      cell(row, !hex && e.payload_text !== null ? e.payload_text : "0x" + e.payload_hex, "payload");
      cell(row, Object.entries(e.headers).map(([k, v]) => k + "=" + v).join(", ") || "-");
    });
    if (!quiet) show("topic-message", d.note || (d.events.length + " event(s) of " + d.topic +
      " (offsets " + d.first_offset + ".." + d.next_offset + ")"), false);
  } catch (err) {
    if (mine !== readSequence) return;
    fill("events", [], () => {});
    show("topic-message", err.message, true);
  } finally {
    if (mine === readSequence) reading = false;
  }
}

function parseHeaders(text) {
  const headers = {};
  for (const part of text.split(",")) {
    if (!part.trim()) continue;
    const at = part.indexOf("=");
    if (at < 1) throw new Error("headers: write name=value, separated by commas (not " +
      JSON.stringify(part.trim()) + ")");
    headers[part.slice(0, at).trim()] = part.slice(at + 1).trim();
  }
  return headers;
}

async function publish() {
  const topic = $("topic-name").value.trim();
  try {
    if (!topic) throw new Error("name the topic to publish to in the topic field");
    const receipt = await api("POST", "/api/topics/" + encodeURIComponent(topic) + "/publish", {
      payload: $("pub-payload").value,
      encoding: $("pub-encoding").value,
      key: $("pub-key").value,
      headers: parseHeaders($("pub-headers").value),
    });
    show("publish-message", "published to " + receipt.topic + " at offset " + receipt.offset +
      " (LSN " + receipt.lsn + ", epoch " + receipt.epoch + ", master " + receipt.master_id + ")", false);
    $("topic-from").value = "";
    readEvents(true);
  } catch (err) {
    show("publish-message", err.message, true);
  }
}

function askAction(action, node) {
  $("confirm-text").textContent = action + " " + node + "? " + (action === "transfer"
    ? "The master hands its role to " + node + " (no acknowledged write is lost)."
    : action === "quarantine" ? node + " leaves every group until it is unquarantined."
    : node + " may rejoin its group.");
  $("confirm-node").value = "";
  $("confirm-reason").value = "";
  const dialog = $("confirm");
  dialog.onclose = async () => {
    if (dialog.returnValue !== "go") return;
    show("action-message", action + " " + node + "…", false);
    try {
      const result = await api("POST", "/api/actions", {action: action, node: node,
        reason: $("confirm-reason").value, confirm: $("confirm-node").value.trim()});
      show("action-message", result.result, false);
    } catch (err) {
      show("action-message", err.message, true);
    }
  };
  dialog.showModal();
}

$("read-form").addEventListener("submit", (e) => { e.preventDefault(); readEvents(); });
$("publish-form").addEventListener("submit", (e) => { e.preventDefault(); publish(); });
$("show-hex").addEventListener("change", () => readEvents(true));

const stream = new EventSource("/api/stream");
stream.addEventListener("snapshot", (e) => render(JSON.parse(e.data)));
stream.onerror = () => { $("live").textContent = "reconnecting…"; $("live").className = "live stale"; };
