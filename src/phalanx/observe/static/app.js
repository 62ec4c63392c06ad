"use strict";
// The live page: one event stream from the driver (server-sent events), rendered into fixed elements.
// Every text from the job is set with textContent (never parsed as HTML).
(function () {
  const token = new URLSearchParams(location.search).get("token") || "";
  const $ = (id) => document.getElementById(id);
  let last = null;
  let received = 0;

  function fmt(x, digits) { return x == null ? "–" : Number(x).toFixed(digits); }
  function secs(s) {
    if (s == null) return "–";
    if (s < 60) return s.toFixed(1) + " s";
    const m = Math.floor(s / 60);
    return m < 60 ? m + " min " + Math.floor(s % 60) + " s" : Math.floor(m / 60) + " h " + (m % 60) + " min";
  }
  function bytes(n) {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + u[i];
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }
  function trend(values) {
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("class", "trend");
    svg.setAttribute("viewBox", "0 0 90 18");
    if (values.length > 1) {
      const top = Math.max(...values) || 1;
      const pts = values.map((v, i) => (i * 90 / (values.length - 1)).toFixed(1) + "," +
                             (17 - 16 * v / top).toFixed(1));
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("points", pts.join(" "));
      svg.appendChild(line);
    }
    return svg;
  }
  function lastLine(r) {
    if (r.cause) return r.cause;
    return r.logs.length ? r.logs[r.logs.length - 1][1] : "";
  }

  function renderHeader(s) {
    $("run-id").textContent = s.run_id;
    const status = $("status");
    if (s.end) { status.textContent = s.end.ok ? "succeeded" : "failed"; status.className = "pill " + (s.end.ok ? "ok" : "failed"); }
    else { status.textContent = "running"; status.className = "pill"; }
    $("alive").textContent = s.alive + " / " + s.ranks.length;
    $("uptime").textContent = secs(s.end ? s.end.after_s : s.uptime_s);
    $("latency").textContent = secs(s.start_latency_s);
    $("resets").textContent = s.resets;
    $("straggler").textContent = s.straggler == null ? "none" : "rank " + s.straggler;
  }

  function renderStrip(s) {
    const strip = $("strip");
    strip.replaceChildren(...s.ranks.map((r) => {
      const b = el("span", "s-" + r.state);
      b.title = "rank " + r.rank + ": " + r.state + (r.current ? " (" + r.current + ")" : "");
      return b;
    }));
  }

  function renderRanks(s) {
    const body = $("ranks").tBodies[0];
    body.replaceChildren(...s.ranks.map((r) => {
      const tr = el("tr", "s-" + r.state + (s.straggler === r.rank ? " straggler" : ""));
      tr.dataset.rank = r.rank;
      const bar = el("span", "bar");
      const fill = el("i");
      fill.style.width = Math.round(100 * r.wait_share) + "%";
      bar.appendChild(fill);
      const waiting = el("td", "wait");
      waiting.append(bar, " " + Math.round(100 * r.wait_share) + "% · " + secs(r.wait_s));
      const cells = [
        el("td", "num", String(r.rank)), el("td", "state s-" + r.state, r.state), el("td", "host", r.host || "–"),
        el("td", "num pid", r.pid ? String(r.pid) : "–"), el("td", "num steps", String(r.steps)),
        el("td", "num rate", fmt(r.steps_per_s, 2)), el("td", "trend"),
        el("td", "num", r.step_s ? (1000 * r.step_s).toFixed(1) + " ms" : "–"), waiting,
        el("td", "in", r.current || ""), el("td", "last cause", lastLine(r)),
      ];
      cells[6].appendChild(trend(r.trend));
      tr.append(...cells);
      tr.addEventListener("click", () => { $("log-rank").value = String(r.rank); renderLogs(last); });
      return tr;
    }));
  }

  function renderLogs(s) {
    if (!s) return;
    const select = $("log-rank");
    if (select.options.length !== s.ranks.length + 1) {
      const keep = select.value;
      select.replaceChildren(el("option", null, "every rank"), ...s.ranks.map((r) => el("option", null, "rank " + r.rank)));
      select.options[0].value = "";
      s.ranks.forEach((r, i) => { select.options[i + 1].value = String(r.rank); });
      select.value = keep;
    }
    const want = select.value, needle = $("log-filter").value.toLowerCase(), errOnly = $("log-stderr").checked;
    const out = $("logs");
    const lines = [];
    for (const r of s.ranks) {
      if (want !== "" && String(r.rank) !== want) continue;
      for (const [stream, text] of r.logs) {
        if (errOnly && stream !== 2) continue;
        if (needle && !text.toLowerCase().includes(needle)) continue;
        const line = el("div", stream === 2 ? "err" : null, "[" + r.rank + "]" + (stream === 2 ? "<stderr>" : "<stdout>") + ": " + text);
        lines.push(line);
      }
    }
    out.replaceChildren(...lines);
  }

  function renderSummary(s) {
    $("summary").tBodies[0].replaceChildren(...s.summary.map((k) => {
      const tr = el("tr");
      tr.append(el("td", null, k.kind), el("td", "num", String(k.count)), el("td", "num", secs(k.wait_s)),
                el("td", "num", k.mean_wait_ms.toFixed(2) + " ms"), el("td", "num", bytes(k.bytes)));
      return tr;
    }));
    $("events").replaceChildren(...s.events.map(([t, text]) => el("li", null, secs(t) + ": " + text)));
  }

  function renderEnd(s) {
    const box = $("end");
    if (!s.end) { box.hidden = true; return; }
    box.hidden = false;
    box.className = s.end.ok ? "ok" : "failed";
    $("end-title").textContent = s.end.ok ? "Result" : "Failure report";
    $("end-report").textContent = s.end.report;
  }

  function render(s) {
    last = s;
    if (!s) return;
    renderHeader(s); renderStrip(s); renderRanks(s); renderLogs(s); renderSummary(s); renderEnd(s);
  }

  for (const id of ["log-rank", "log-filter", "log-stderr"]) {
    $(id).addEventListener("input", () => renderLogs(last));
  }
  const source = new EventSource("events?token=" + encodeURIComponent(token));
  source.onmessage = (e) => {
    received++;
    $("conn").textContent = "live · " + new Date().toLocaleTimeString();
    render(JSON.parse(e.data));
  };
  source.onerror = () => {
    $("conn").textContent = received ? "disconnected (the driver exited?); showing the last state" : "cannot reach the driver";
  };
})();
