// rollwave's built-in dashboard: polls the API and draws its own charts (no CDN, no libraries).
//   GET v1/metrics/summary -> {t: [unix s...], series: {name: [number|null...]}}  (one canvas per series)
//   GET v1/status          -> cluster status, rendered generically (facts and tables)
//   GET v1/jobs?limit=N    -> the jobs table: the newest page ({jobs, next}; `next` says that more exist)
// With a bearer token (typed in, or given as #token=... in the URL) every call sends it; one saved or removed in
// another tab of the dashboard is used here too.
// While calls fail the polls back off (up to MAX_POLL_MS apart); a refused token stops them until one is saved.
// Every chart canvas carries data-points = the number of points it drew, for headless tests.
"use strict";

(() => {
  const POLL_MS = 2000;
  const MAX_POLL_MS = 60000;
  // a call's limit: above the API's own 503 for a stuck Redis (a try of redis.timeout_s, retried as long: 5 s each by
  // default), which names the Redis
  const FETCH_TIMEOUT_MS = 20000;
  const JOBS_PAGE = 100;
  const TOKEN_KEY = "rollwave.token";
  const JOB_COLUMNS = ["job_id", "name", "kind", "source", "state", "reason", "tasks", "samples", "trained",
                       "reward_mean", "accuracy", "stale_dropped", "dead_lettered", "cancelled", "created"];
  const STATUS_COLUMNS = ["name", "server_id", "alive", "version", "straggler", "last_push", "heartbeat_age_s",
                          "engine_url", "grpc_address"];
  const FORMAT = {
    trainer_idle_fraction: (v) => `${(v * 100).toFixed(1)}%`,
    pause_ms: (v) => `${v.toFixed(1)} ms`,
    generated_tokens_per_s: (v) => `${formatNumber(v)}/s`,
    tool_errors_per_s: (v) => `${v.toFixed(2)}/s`,
  };

  // A link may carry the token as #token=...; it is stored and removed from the address bar (the history entry is
  // replaced: Back does not show it). Taken as it is, percent-escapes decoded: a base64 token's "+" read as a space
  // (URLSearchParams's form decoding), and the link of a token with "+" was refused.
  const linked = /^#token=(.*)$/s.exec(window.location.hash);
  if (linked) {
    let given = linked[1];
    try { given = decodeURIComponent(given); } catch { /* a "%" that starts no escape: the token as it is */ }
    if (given) localStorage.setItem(TOKEN_KEY, given);
    window.history.replaceState(null, "", window.location.pathname + window.location.search);
  }
  let token = localStorage.getItem(TOKEN_KEY) || "";
  let polls = 0;
  let failures = 0;  // polls in a row with a failed call
  let timer = null;
  let running = false;
  let again = false;  // a token was saved while a poll ran: poll again with it

  function formatNumber(v) {
    if (!Number.isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e9) return `${(v / 1e9).toFixed(2)}G`;
    if (a >= 1e6) return `${(v / 1e6).toFixed(2)}M`;
    if (a >= 1e4) return `${(v / 1e3).toFixed(1)}k`;
    if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
    return v.toPrecision(3);
  }

  // A call gets FETCH_TIMEOUT_MS for its whole answer: a frozen API (or a proxy that holds the connection) held the
  // fetch, and so every later poll, for ever, while the page still read "live". An error names the call.
  async function getJSON(path) {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = `Bearer ${token}`;
    let request, reply, text;
    try {
      request = new Request(path, { headers, cache: "no-store", signal: AbortSignal.timeout(FETCH_TIMEOUT_MS) });
    } catch (error) {  // a token no header can carry (a character outside Latin-1, as a pasted "–"): never sent
      throw Object.assign(new Error(`${path}: the token cannot be sent (${error.message}); enter the API token above`),
                          { refused: true });
    }
    try {
      reply = await fetch(request);
      text = await reply.text();
    } catch (error) {  // refused, reset, or not answered in time
      const why = error.name === "TimeoutError" ? `no answer in ${FETCH_TIMEOUT_MS / 1000} s` : error.message;
      throw new Error(`${path}: the API did not answer (${why})`);
    }
    let body;
    try { body = JSON.parse(text); } catch { body = undefined; }
    if (!reply.ok) {  // the API's own words when it gave some (a 503 names the Redis that failed)
      const hint = reply.status === 401 ? " (enter the API token above)" : "";
      const detail = typeof body?.detail === "string" ? `: ${body.detail}` : "";
      throw Object.assign(new Error(`${path}: HTTP ${reply.status}${detail}${hint}`),
                          { refused: reply.status === 401 || reply.status === 403 });
    }
    if (body === undefined) throw new Error(`${path}: HTTP ${reply.status}, but its answer is not JSON`);
    return body;
  }

  // ---- charts -----------------------------------------------------------------------------------

  // Draws ys against ts (unix seconds) as a line; nulls and non-finite values leave gaps.
  // Returns the number of points drawn.
  function drawLineChart(canvas, ts, ys) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 320;
    const height = canvas.clientHeight || 150;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const points = [];
    const n = Math.min(ts.length, ys.length);
    for (let i = 0; i < n; i++) {
      const y = ys[i];
      points.push(y === null || !Number.isFinite(y) || !Number.isFinite(ts[i]) ? null : [ts[i], y]);
    }
    const drawn = points.filter((p) => p !== null);
    const pad = { left: 46, right: 8, top: 8, bottom: 18 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#6b7280";
    if (drawn.length === 0) {
      ctx.textAlign = "center";
      ctx.fillText("no data yet", width / 2, height / 2);
      return 0;
    }

    let [x0, x1] = [drawn[0][0], drawn[drawn.length - 1][0]];
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    const low = Math.min(...drawn.map((p) => p[1]));
    let [y0, y1] = [low, Math.max(...drawn.map((p) => p[1]))];
    if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const margin = (y1 - y0) * 0.08;
    y0 -= margin; y1 += margin;
    if (low >= 0) y0 = Math.max(y0, 0);
    const px = (x) => pad.left + ((x - x0) / (x1 - x0)) * plotW;
    const py = (y) => pad.top + (1 - (y - y0) / (y1 - y0)) * plotH;

    ctx.strokeStyle = "#e3e6eb";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let k = 0; k <= 3; k++) {
      const v = y0 + ((y1 - y0) * k) / 3;
      const y = Math.round(py(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(pad.left, y); ctx.lineTo(width - pad.right, y); ctx.stroke();
      ctx.fillText(formatNumber(v), pad.left - 4, y);
    }
    ctx.textBaseline = "alphabetic";
    ctx.textAlign = "left";
    ctx.fillText(`-${formatDuration(x1 - x0)}`, pad.left, height - 4);
    ctx.textAlign = "right";
    ctx.fillText("now", width - pad.right, height - 4);

    ctx.strokeStyle = "#2563eb";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    for (const p of points) {
      if (p === null) { pen = false; continue; }
      if (pen) ctx.lineTo(px(p[0]), py(p[1])); else ctx.moveTo(px(p[0]), py(p[1]));
      pen = true;
    }
    ctx.stroke();
    ctx.fillStyle = "#2563eb";
    for (const p of points) {
      if (p === null) continue;
      ctx.beginPath(); ctx.arc(px(p[0]), py(p[1]), drawn.length > 60 ? 1 : 2, 0, 2 * Math.PI); ctx.fill();
    }
    return drawn.length;
  }

  function formatDuration(seconds) {
    if (seconds >= 3600) return `${(seconds / 3600).toFixed(1)}h`;
    if (seconds >= 60) return `${Math.round(seconds / 60)}m`;
    return `${Math.round(seconds)}s`;
  }

  function renderCharts(summary) {
    const ts = Array.isArray(summary.t) ? summary.t : [];
    const series = summary.series || {};
    for (const canvas of document.querySelectorAll("canvas[data-series]")) {
      const name = canvas.dataset.series;
      const ys = Array.isArray(series[name]) ? series[name] : [];
      const count = drawLineChart(canvas, ts, ys);
      canvas.dataset.points = String(count);
      const last = [...ys].reverse().find((v) => v !== null && Number.isFinite(v));
      const label = canvas.closest("figure").querySelector(".last");
      label.textContent = last === undefined ? "" : (FORMAT[name] || formatNumber)(last);
    }
  }

  // ---- status and jobs ------------------------------------------------------------------------

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  // A server's last weight push: "v12 ok", or "v12 failed at connect (timeout), serves v9: <error>".
  function formatPush(push) {
    if (push.ok) return `v${push.version} ok`;
    return `v${push.version} failed at ${push.stage} (${push.reason}), serves v${push.serves}: ${push.error}`;
  }

  function formatCell(key, value) {
    if (value === null || value === undefined) return "–";
    if (key === "last_push" && typeof value === "object") return formatPush(value);
    if (typeof value === "number") {
      const isTime = /(heartbeat|started|created|finished|_at|_ts|time)$/.test(key) && value > 1e9;
      return isTime ? `${formatNumber(Date.now() / 1000 - value)} s ago` : formatNumber(value);
    }
    if (Array.isArray(value)) return value.length ? value.map((v) => formatCell(key, v)).join(", ") : "none";
    if (typeof value === "object") {
      return Object.entries(value).map(([k, v]) => `${k}=${formatCell(k, v)}`).join(" ");
    }
    return String(value);
  }

  function table(rows, preferred) {
    const keys = [];
    for (const key of preferred) if (rows.some((r) => key in r)) keys.push(key);
    for (const row of rows) for (const key of Object.keys(row)) if (!keys.includes(key)) keys.push(key);
    const t = el("table");
    const head = t.createTHead().insertRow();
    for (const key of keys) head.appendChild(el("th", key));
    const body = t.createTBody();
    for (const row of rows) {
      const tr = body.insertRow();
      for (const key of keys) tr.insertCell().textContent = formatCell(key, row[key]);
    }
    return t;
  }

  const isPlainObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

  // Scalars and nested objects become "a.b: value" facts; lists of objects, and objects of flat
  // objects (e.g. buffer streams -> {length, pending}), become tables.
  function renderStatus(status) {
    const root = document.getElementById("status-body");
    const facts = el("dl", undefined, "facts");
    const tables = [];
    const walk = (prefix, value) => {
      const entries = isPlainObject(value) ? Object.entries(value) : [];
      if (Array.isArray(value) && value.length && value.every((v) => v && typeof v === "object")) {
        tables.push([prefix, value]);
      } else if (prefix && entries.length > 1 && entries.every(([, v]) => isPlainObject(v)
                 && Object.values(v).every((x) => !isPlainObject(x) && !Array.isArray(x)))) {
        tables.push([prefix, entries.map(([name, v]) => ({ name, ...v }))]);
      } else if (isPlainObject(value)) {
        for (const [k, v] of Object.entries(value)) walk(prefix ? `${prefix}.${k}` : k, v);
      } else {
        facts.append(el("dt", prefix), el("dd", formatCell(prefix, value)));
      }
    };
    walk("", status);
    root.replaceChildren(facts);
    for (const [name, rows] of tables) root.append(el("h3", name), table(rows, STATUS_COLUMNS));
  }

  // One row per job: the spec is summarised (name, task source) and progress counters become columns. A job's
  // reason (why it is stalled) sits beside its state; the column shows only when some job has one.
  function jobRow(job) {
    const { spec, progress, reason, ...row } = job;
    if (reason) row.reason = reason;
    if (spec && typeof spec === "object") {
      if (spec.name) row.name = spec.name;
      if (spec.source && spec.source.kind) row.source = spec.source.kind;
    }
    if (progress && typeof progress === "object") {
      const { submitted, completed, ...counters } = progress;
      if (submitted !== undefined) row.tasks = `${completed ?? 0}/${submitted}`;
      Object.assign(row, counters);
    }
    return row;
  }

  function renderJobs(reply) {
    const jobs = reply.jobs.map(jobRow);
    const root = document.getElementById("jobs-body");
    if (jobs.length === 0) {
      root.replaceChildren(el("p", "no jobs yet", "muted"));
      return;
    }
    const parts = [table(jobs, JOB_COLUMNS)];
    if (reply.next) parts.push(el("p", `the ${JOBS_PAGE} newest jobs; \`rollwave jobs --all\` lists every one`, "muted"));
    root.replaceChildren(...parts);
  }

  // ---- polling --------------------------------------------------------------------------------

  function setConnection(ok, message) {
    const pill = document.getElementById("conn");
    pill.textContent = ok ? `live · ${new Date().toLocaleTimeString()}` : "error";
    pill.className = `pill ${ok ? "ok" : "bad"}`;
    const error = document.getElementById("error");
    error.hidden = ok;
    error.textContent = ok ? "" : message;
    document.body.dataset.state = ok ? "ok" : "error";
  }

  // One poll at a time: the next is scheduled when one ends, POLL_MS later, doubled for each poll in a row that
  // failed (an API without its Redis was asked 90 times a minute by each open page, each refusal logged). A token
  // refused (401, 403), or one that cannot be sent, stops polling until one is saved: every call would fail the same.
  async function poll() {
    clearTimeout(timer);
    running = true;
    const results = await Promise.allSettled([
      getJSON("v1/metrics/summary").then(renderCharts),
      getJSON("v1/status").then(renderStatus),
      getJSON(`v1/jobs?limit=${JOBS_PAGE}`).then(renderJobs),
    ]);
    running = false;
    polls += 1;
    document.body.dataset.polls = String(polls);
    if (again) {
      again = false;
      poll();
      return;
    }
    const failed = results.filter((r) => r.status === "rejected").map((r) => r.reason);
    failures = failed.length ? failures + 1 : 0;
    const refused = failed.some((e) => e.refused);
    const wait = Math.min(POLL_MS * 2 ** failures, MAX_POLL_MS);
    const next = refused ? "polling stopped: save a token to try again" : `next try in ${wait / 1000} s`;
    setConnection(failed.length === 0, failed.length ? `${failed.map((e) => e.message).join("; ")}; ${next}` : "");
    if (!refused) timer = setTimeout(poll, wait);
  }

  // A token saved (or removed) here or in another tab: polls with it now, whether a refused one had stopped them or
  // they were backing off.
  function useToken(value) {
    token = value;
    document.getElementById("token").value = token;
    failures = 0;
    if (running) again = true; else poll();
  }

  // the page's own words for a script that never ran (index.html) give way: this one runs, and has started
  function started() {
    document.getElementById("not-started").remove();
    const pill = document.getElementById("conn");
    pill.textContent = "connecting…";
    pill.className = "pill";
  }

  document.getElementById("token").value = token;
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = document.getElementById("token").value.trim();
    if (value) localStorage.setItem(TOKEN_KEY, value); else localStorage.removeItem(TOKEN_KEY);
    useToken(value);
  });
  // fired in the other tabs of this origin only; key null: the storage was cleared
  window.addEventListener("storage", (event) => {
    if (event.key === TOKEN_KEY || event.key === null) useToken(localStorage.getItem(TOKEN_KEY) || "");
  });
  started();
  poll();
})();
