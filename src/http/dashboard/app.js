// The intray dashboard: plain JavaScript over the JSON API (/api/v1), no
// build step. Every value from the server is put into the page as text,
// never as HTML.
'use strict';

const API = '/api/v1';
const REFRESH_MS = 3000;
const TERMINAL = ['SUCCEEDED', 'FAILED', 'CANCELLED', 'EXPIRED'];
const $ = (sel) => document.querySelector(sel);

// ---- credentials and calls -------------------------------------------------

function headers(extra) {
  const h = Object.assign({}, extra);
  const token = sessionStorage.getItem('intray.token');
  const tenant = sessionStorage.getItem('intray.tenant');
  if (token) h.Authorization = 'Bearer ' + token;
  if (tenant) h['x-intray-tenant'] = tenant;
  return h;
}

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.message) || ('HTTP ' + status));
    this.status = status;
    this.code = body && body.code;
  }
}

async function call(method, path, body) {
  const init = { method, headers: headers(body ? { 'content-type': 'application/json' } : {}) };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(API + path, init);
  const text = await response.text();
  const data = text ? JSON.parse(text) : {};
  if (!response.ok) {
    if (response.status === 401) {
      showTokenForm('This server needs a bearer token (' + data.message + ').');
      forgetCaller();
      clearViews();
    }
    throw new ApiError(response.status, data);
  }
  return data;
}

// What the caller may call (GET /api/v1/whoami): a set of JobService
// method names, or null while not known, when every act is offered and
// the server's answer decides.
let may = null;
let callerKnown = false;

const allowed = (method) => !may || may.has(method);

function forgetCaller() {
  may = null;
  callerKnown = false;
  $('#who').textContent = '';
}

// Learns the caller once per token; a server without /whoami (404) leaves
// every act offered.
async function learnCaller() {
  if (callerKnown) return;
  try {
    const who = await call('GET', '/whoami');
    may = new Set(who.methods || []);
    $('#who').textContent = who.tenant + ' · ' + (who.roles || []).join(', ');
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 404)) throw err;
    may = null;
  }
  callerKnown = true;
  // Acts the token may not make are not offered (they would fail with 403).
  $('#job-cancel').hidden = !allowed('Cancel');
  $('#job-retry').hidden = !allowed('Retry');
  $('#dead-count').hidden = !allowed('Retry');
  $('#dead-replay').hidden = !allowed('Retry');
}

function say(text, isError) {
  const box = $('#message');
  box.classList.toggle('error', !!isError);
  box.textContent = shown(text);
  viewError = '';
}

function fail(err) {
  say((err.code ? err.code + ': ' : '') + err.message, true);
}

// The message of the last view that failed to load, while it is shown:
// a later load of the view that works takes it away (an action's message
// stays).
let viewError = '';

function failView(err) {
  fail(err);
  viewError = $('#message').textContent;
}

function viewLoaded() {
  if (viewError && $('#message').textContent === viewError) say('');
}

function showTokenForm(reason) {
  const form = $('#token-form');
  if (reason) $('#token-reason').textContent = reason + ' It is kept in this tab only (sessionStorage).';
  form.hidden = false;
  $('#token-button').setAttribute('aria-expanded', 'true');
}

// ---- small helpers ---------------------------------------------------------

const short = (state) => (state || '').replace(/^JOB_STATE_|^JOB_EVENT_TYPE_|^BREAKER_STATE_/, '');
const num = (v) => Number(v || 0);

// Bidirectional controls (U+202A-E, U+2066-9, U+200E-F, U+061C) in a
// payload or a message would reorder the text around them, so that what
// the page shows is not what the job holds: they are shown as escapes.
const BIDI = /[\u061C\u200E\u200F\u202A-\u202E\u2066-\u2069]/g;
const shown = (v) => String(v).replace(BIDI, (c) => '\\u' + c.charCodeAt(0).toString(16).toUpperCase().padStart(4, '0'));

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === 'class') node.className = v;
    else if (k === 'text') node.textContent = shown(v);
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(shown(c)));
  return node;
}

function cell(value, cls, field) {
  return el('td', { class: cls, 'data-field': field, text: value });
}

function when(ts) {
  if (!ts) return '';
  const d = new Date(ts);
  return isNaN(d) ? ts : d.toLocaleString();
}

function age(duration) {
  if (!duration) return '';
  const s = parseFloat(duration);
  if (s < 60) return s.toFixed(1) + ' s';
  if (s < 3600) return (s / 60).toFixed(1) + ' min';
  return (s / 3600).toFixed(1) + ' h';
}

function millis(a, b) {
  const ms = new Date(b) - new Date(a);
  if (!(ms >= 0)) return '';
  return ms < 1000 ? ms + ' ms' : (ms / 1000).toFixed(1) + ' s';
}

function stateCell(state) {
  const s = short(state);
  return el('td', { class: 'state state-' + s, 'data-field': 'state', text: s.toLowerCase() });
}

// Ids are UUIDv7, whose first digits are a timestamp shared by jobs
// submitted together; the random tail tells them apart.
const shortId = (id) => '…' + id.slice(-12);

function jobLink(id) {
  return el('a', { href: '#/job/' + encodeURIComponent(id), class: 'mono', title: id, 'aria-label': 'job ' + id, text: shortId(id) });
}

function replaceRows(table, rows, emptyText) {
  const body = table.tBodies[0];
  body.replaceChildren(...rows);
  if (!rows.length) {
    const cols = table.tHead.rows[0].cells.length;
    body.append(el('tr', {}, el('td', { colspan: cols, class: 'muted', text: emptyText })));
  }
}

// A modal question; resolves true when the user confirms.
function confirmAction(text) {
  const dialog = $('#confirm');
  $('#confirm-text').textContent = text;
  dialog.returnValue = '';
  dialog.showModal();
  $('#confirm-ok').focus();
  return new Promise((resolve) => {
    dialog.addEventListener('close', () => resolve(dialog.returnValue === 'ok'), { once: true });
  });
}

async function act(question, work, done) {
  if (!(await confirmAction(question))) {
    say('Nothing done.');
    return;
  }
  try {
    const result = await work();
    say(done(result));
    // A finished job's stream has ended: read the page again to show the change.
    if (routeParams().path.startsWith('/job/')) stopStream();
    await render();
  } catch (err) {
    fail(err);
  }
}

// ---- queues ----------------------------------------------------------------

function breakerText(breakers) {
  const open = (breakers || []).filter((b) => short(b.state) !== 'CLOSED');
  if (!open.length) return 'closed';
  return open.map((b) => b.kind + ': ' + short(b.state).toLowerCase().replace('_', '-')).join(', ');
}

async function renderQueues(stale) {
  const stats = await call('GET', '/stats');
  if (stale()) return;
  const rows = (stats.queues || []).map((q) => {
    const counts = {};
    for (const c of q.counts || []) counts[short(c.state)] = num(c.count);
    const paused = !!q.paused;
    const toggle = !allowed(paused ? 'ResumeQueue' : 'PauseQueue') ? '' : el('button', {
      type: 'button',
      'aria-label': (paused ? 'Resume queue ' : 'Pause queue ') + q.queue,
      text: paused ? 'Resume' : 'Pause',
      onclick: () => act(
        (paused ? 'Resume' : 'Pause') + ' queue ' + q.queue + '?',
        () => call('POST', '/queues/' + encodeURIComponent(q.queue) + (paused ? ':resume' : ':pause')),
        (r) => 'Queue ' + r.queue + (r.paused ? ' paused.' : ' resumed.')),
    });
    const dead = el('a', { href: '#/dead?queue=' + encodeURIComponent(q.queue), text: String(num(q.dead)) });
    return el('tr', { 'data-queue': q.queue },
      el('th', { scope: 'row', text: q.queue }),
      cell(counts.QUEUED || 0, 'num', 'queued'),
      cell(num(q.running), 'num', 'running'),
      cell(counts.SUCCEEDED || 0, 'num', 'succeeded'),
      el('td', { class: 'num', 'data-field': 'dead' }, dead),
      cell(counts.CANCELLED || 0, 'num', 'cancelled'),
      cell(counts.EXPIRED || 0, 'num', 'expired'),
      cell(age(q.oldestRunnableAge), 'num', 'oldest'),
      cell(paused ? 'paused' : 'no', '', 'paused'),
      cell(breakerText(q.breakers), '', 'breakers'),
      el('td', {}, toggle));
  });
  replaceRows($('#queues'), rows, 'No jobs yet.');
  const workers = (stats.workers || []).map((w) => el('tr', {},
    el('th', { scope: 'row', class: 'mono', text: w.workerId }),
    cell((w.queues || []).join(', ')),
    cell(num(w.leasesHeld), 'num'),
    cell(when(w.lastLeaseAt)),
    cell(when(w.lastHeartbeatAt))));
  replaceRows($('#workers'), workers, 'No worker seen.');
  $('#queues-updated').textContent = 'Updated ' + new Date().toLocaleTimeString();
}

// ---- jobs ------------------------------------------------------------------

function routeParams() {
  const hash = location.hash.slice(1) || '/';
  const [path, query] = hash.split('?');
  return { path, params: new URLSearchParams(query || '') };
}

function fillForm(form, params) {
  for (const input of form.elements) {
    if (input.name) input.value = params.get(input.name) || '';
  }
}

function formQuery(form) {
  const params = new URLSearchParams();
  for (const input of form.elements) {
    if (input.name && input.value.trim()) params.set(input.name, input.value.trim());
  }
  return params;
}

let nextPage = '';

function jobRow(job) {
  return el('tr', { 'data-job': job.id },
    el('td', {}, jobLink(job.id)),
    cell(job.queue, '', 'queue'),
    cell(job.kind, '', 'kind'),
    stateCell(job.state),
    cell((job.attempt || 0) + '/' + (job.maxAttempts || 0), 'num', 'attempt'),
    cell(job.error ? job.error.class : '', '', 'error'),
    cell(num(job.costCents), 'num', 'cost'),
    cell(when(job.updatedAt)));
}

// Whether the jobs view shows pages past the first ("Next page"): live
// refresh would put it back on the first, so it holds off until the view
// is rendered afresh (a new filter, another view).
let morePages = false;

async function renderJobs(params, append, stale) {
  morePages = append;
  const query = new URLSearchParams(params);
  if (append && nextPage) query.set('page_token', nextPage);
  query.set('page_size', '50');
  // The table shows no payload: lists of large ones stay small.
  query.set('view', 'basic');
  const page = await call('GET', '/jobs?' + query);
  if (stale()) return;
  const rows = (page.jobs || []).map(jobRow);
  if (append) $('#jobs').tBodies[0].append(...rows);
  else replaceRows($('#jobs'), rows, 'No job matches.');
  nextPage = page.nextPageToken || '';
  $('#jobs-more').hidden = !nextPage;
}

// ---- one job ---------------------------------------------------------------

let stream = null; // the open event stream of the job page

function stopStream() {
  if (stream) stream.abort();
  stream = null;
  $('#timeline-live').hidden = true;
}

// A queued job's state says when it is due, if that is still ahead
// (scheduled, or waiting out a retry's backoff).
function stateText(job) {
  const state = short(job.state).toLowerCase();
  const due = job.runAt && new Date(job.runAt);
  if (state === 'queued' && due > new Date()) return 'queued, due ' + when(job.runAt);
  if (state === 'running' && job.cancelRequested) return 'running, cancel requested';
  return state;
}

function renderJobFields(job) {
  const fields = [
    ['Id', job.id], ['Tenant', job.tenant], ['Queue', job.queue], ['Kind', job.kind], ['State', stateText(job)],
    ['Attempt', (job.attempt || 0) + ' of ' + (job.maxAttempts || 0)],
    ['Progress', job.progress ? Math.round(num(job.progress) * 100) + ' %' : ''],
    ['Error', job.error ? job.error.class + ': ' + (job.error.message || '') : ''],
    ['Cost (¢)', num(job.costCents)], ['Priority', job.priority || 0],
    ['Labels', Object.entries(job.labels || {}).map(([k, v]) => k + '=' + v).join(', ')],
    ['Idempotency key', job.idempotencyKey || ''],
    ['Worker', job.leaseOwner || ''], ['Created', when(job.createdAt)], ['Run at', when(job.runAt)],
    ['Deadline', when(job.deadline)], ['Started', when(job.startedAt)],
    ['Finished', when(job.finishedAt)], ['Payload', JSON.stringify(job.payload)],
    ['Result', job.result === undefined ? '' : JSON.stringify(job.result)],
  ];
  $('#job-fields').replaceChildren(...fields.flatMap(([k, v]) => [el('dt', { text: k }), el('dd', { 'data-field': k.toLowerCase(), text: v })]));
  const state = short(job.state);
  $('#job-cancel').disabled = TERMINAL.includes(state);
  $('#job-retry').disabled = !['FAILED', 'CANCELLED', 'EXPIRED'].includes(state);
  $('#job-title').textContent = 'Job ' + shortId(job.id) + ' (' + state.toLowerCase() + ')';
}

// Attempts are read off the events: LEASED opens one, the next outcome closes it.
function renderAttempts(events) {
  const attempts = [];
  let open = null;
  for (const e of events) {
    const type = short(e.type);
    if (type === 'LEASED') {
      open = { attempt: e.attempt, worker: e.workerId || '', start: e.at, end: null, outcome: 'running', error: '' };
      attempts.push(open);
    } else if (open && ['RETRY_SCHEDULED', 'LEASE_EXPIRED', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'EXPIRED'].includes(type)) {
      open.end = e.at;
      open.outcome = type.toLowerCase();
      const err = e.detail && (e.detail.error || e.detail);
      if (err && (err.class || err.error_class)) open.error = (err.class || err.error_class) + (err.message ? ': ' + err.message : '');
      open = null;
    }
  }
  replaceRows($('#attempts'), attempts.map((a) => el('tr', {},
    cell(a.attempt, 'num'), cell(a.worker, 'mono'), cell(when(a.start)),
    cell(a.end ? millis(a.start, a.end) : 'running'), cell(a.outcome), cell(a.error))), 'Not run yet.');
}

function timelineItem(e) {
  const detail = e.detail && Object.keys(e.detail).length ? el('pre', { text: JSON.stringify(e.detail, null, 1) }) : '';
  return el('li', { 'data-sequence': e.sequence },
    el('strong', { text: short(e.type).toLowerCase().replace(/_/g, ' ') }),
    ' → ', short(e.state).toLowerCase(),
    e.attempt ? ' · attempt ' + e.attempt : '',
    e.workerId ? ' · ' + e.workerId : '',
    ' ', el('span', { class: 'when', text: when(e.at) }),
    detail);
}

// Reads the job's server-sent events with fetch (so that the Authorization
// header goes along), and reconnects from the last id until the terminal event.
async function followEvents(id, onEvent) {
  const controller = new AbortController();
  stream = controller;
  $('#timeline-live').hidden = false;
  let last = 0;
  let finished = false;
  while (!finished && !controller.signal.aborted) {
    try {
      const response = await fetch(API + '/jobs/' + encodeURIComponent(id) + '/events', {
        headers: headers(last ? { 'Last-Event-ID': String(last) } : {}),
        signal: controller.signal,
      });
      if (!response.ok) throw new ApiError(response.status, await response.json());
      // No Content: the job had already ended after the last event we saw.
      if (response.status === 204) break;
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf('\n\n')) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let data = '';
          let kind = 'message';
          for (const line of block.split('\n')) {
            if (line.startsWith('data:')) data += line.slice(5).trim();
            else if (line.startsWith('event:')) kind = line.slice(6).trim();
          }
          if (!data) continue;
          if (kind !== 'message') throw new ApiError(500, JSON.parse(data));
          const event = JSON.parse(data);
          last = num(event.sequence);
          onEvent(event);
          // The latest event decides: a replayed job's history holds
          // earlier terminal events.
          finished = TERMINAL.includes(short(event.type));
        }
      }
      // The server ends the stream after the terminal event (or on shutdown).
      if (!finished) await new Promise((r) => setTimeout(r, 1000));
    } catch (err) {
      if (controller.signal.aborted) return;
      fail(err);
      if (err instanceof ApiError && err.status < 500) break;
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
  if (stream === controller) $('#timeline-live').hidden = true;
}

function clearJob() {
  $('#job-title').textContent = 'Job';
  $('#job-fields').replaceChildren();
  $('#timeline').replaceChildren();
  replaceRows($('#attempts'), [], '');
  $('#job-cancel').disabled = true;
  $('#job-retry').disabled = true;
}

async function renderJob(id, stale) {
  clearJob();
  const job = await call('GET', '/jobs/' + encodeURIComponent(id));
  if (stale()) return;
  renderJobFields(job);
  $('#timeline').replaceChildren();
  const events = [];
  $('#job-cancel').onclick = () => act('Cancel job ' + id + '?',
    () => call('POST', '/jobs/' + encodeURIComponent(id) + ':cancel', { reason: 'cancelled from the dashboard' }),
    (j) => 'Job ' + shortId(j.id) + ' is ' + short(j.state).toLowerCase() + (j.cancelRequested && short(j.state) === 'RUNNING' ? ' (cancel requested)' : '') + '.');
  $('#job-retry').onclick = () => act('Replay job ' + id + '?',
    () => call('POST', '/jobs:retry', { id }),
    (r) => 'Replayed ' + (r.retried || []).length + ' job.');
  // The fields follow the events with one read in flight at most (a
  // history of hundreds of events is not hundreds of reads), and a read
  // that comes back after the page moved on is dropped.
  let reading = false;
  let again = false;
  const readFields = async () => {
    if (reading) { again = true; return; }
    reading = true;
    do {
      again = false;
      try {
        const job = await call('GET', '/jobs/' + encodeURIComponent(id));
        if (routeParams().path === '/job/' + encodeURIComponent(id)) renderJobFields(job);
      } catch (err) { fail(err); }
    } while (again);
    reading = false;
  };
  followEvents(id, (event) => {
    events.push(event);
    $('#timeline').append(timelineItem(event));
    renderAttempts(events);
    if (event.sequence !== '1' || events.length > 1) readFields();
  });
  renderAttempts(events);
}

// ---- dead set ----------------------------------------------------------------

// Failed jobs listed below the groups: the newest, one page.
const DEAD_LISTED = 200;

function deadFilter(params) {
  const filter = { states: ['JOB_STATE_FAILED'] };
  for (const k of ['queue', 'kind', 'error_class']) if (params.get(k)) filter[k] = params.get(k);
  return filter;
}

// The groups are counted by the server (up to 100,000 jobs), so that the
// failed jobs themselves are not read out on every refresh.
async function renderDead(params, stale) {
  const filters = new URLSearchParams();
  for (const k of ['queue', 'kind', 'error_class']) if (params.get(k)) filters.set(k, params.get(k));
  const listed = new URLSearchParams(filters);
  listed.set('state', 'failed');
  listed.set('page_size', String(DEAD_LISTED));
  listed.set('view', 'basic');
  // Each part shows what it could read; the first failure is then reported.
  const [groupedRead, pageRead] = await Promise.allSettled([
    call('GET', '/dead-set?' + filters),
    call('GET', '/jobs?' + listed),
  ]);
  if (stale()) return;
  const grouped = groupedRead.status === 'fulfilled' ? groupedRead.value : { groups: [] };
  const page = pageRead.status === 'fulfilled' ? pageRead.value : { jobs: [] };
  const groups = new Map();
  for (const row of grouped.groups || []) {
    const cls = row.error_class || '(none)';
    const g = groups.get(cls) || { cls, queues: new Set(), count: 0, cost: 0 };
    g.queues.add(row.queue);
    g.count += num(row.jobs);
    g.cost += num(row.cost_cents);
    groups.set(cls, g);
  }
  const sorted = [...groups.values()].sort((a, b) => b.count - a.count);
  $('#dead-partial').hidden = grouped.complete !== false;
  replaceRows($('#dead-groups'), sorted.map((g) => {
    const filter = Object.assign(deadFilter(params), { error_class: g.cls === '(none)' ? undefined : g.cls });
    return el('tr', { 'data-class': g.cls },
      el('th', { scope: 'row', text: g.cls }),
      cell([...g.queues].join(', ')),
      cell(g.count, 'num', 'count'),
      cell(g.cost, 'num', 'cost'),
      el('td', {}, !allowed('Retry') ? '' : el('button', {
        type: 'button', 'aria-label': 'Replay the ' + g.cls + ' jobs', text: 'Replay',
        onclick: () => replayMatching(filter),
      })));
  }), groupedRead.status === 'fulfilled' ? 'The dead set is empty.' : 'Not loaded.');
  replaceRows($('#dead-jobs'), (page.jobs || []).map((job) => el('tr', { 'data-job': job.id },
    el('td', {}, jobLink(job.id)), cell(job.queue), cell(job.kind),
    cell(job.error ? job.error.class + ': ' + (job.error.message || '') : ''),
    cell(job.attempt || 0, 'num'), cell(num(job.costCents), 'num'), cell(when(job.finishedAt)))),
  pageRead.status === 'fulfilled' ? 'No failed job matches.' : 'Not loaded.');
  for (const read of [groupedRead, pageRead]) if (read.status === 'rejected') throw read.reason;
}

// The most jobs one bulk replay takes (the server's cap).
const REPLAY_MAX = 10000;

async function countMatching(filter) {
  const answer = await call('POST', '/jobs:retry', { filter, dryRun: true });
  return num(answer.matched);
}

// Select by filter, count with a dry run, confirm with the count, replay.
async function replayMatching(filter) {
  let matched;
  try {
    matched = await countMatching(filter);
  } catch (err) {
    fail(err);
    return;
  }
  if (!matched) {
    say('No failed job matches, nothing to replay.');
    return;
  }
  // The confirmed count is the limit: jobs failing after the count are
  // not replayed without being asked about (the server caps it at 10,000).
  const question = matched > REPLAY_MAX
    ? 'Replay ' + REPLAY_MAX + ' of the ' + matched + ' failed jobs' + describe(filter) + '? One replay takes at most ' + REPLAY_MAX + '; replay again for the rest.'
    : 'Replay ' + matched + ' failed job' + (matched === 1 ? '' : 's') + describe(filter) + '?';
  await act(question,
    () => call('POST', '/jobs:retry', { filter, limit: Math.min(matched, REPLAY_MAX) }),
    (r) => 'Replayed ' + (r.retried || []).length + ' of ' + num(r.matched) + ' matching jobs; they are queued again.');
}

function describe(filter) {
  const parts = ['queue', 'kind', 'error_class'].filter((k) => filter[k]).map((k) => k.replace('_', ' ') + ' ' + filter[k]);
  return parts.length ? ' (' + parts.join(', ') + ')' : '';
}

// ---- routing -----------------------------------------------------------------

let timer = null;
let rendering = false;
// Bumped by each render and by "Next page": an answer that comes back after
// the page moved on (another filter, another view, a page appended) is
// dropped rather than put over what is shown now.
let generation = 0;

function newGeneration() {
  const mine = ++generation;
  return () => mine !== generation;
}

async function render() {
  rendering = true;
  try { await renderView(); } finally { rendering = false; }
}

// Empties every view: what one token was shown is not left for the next.
function clearViews() {
  newGeneration();
  stopStream();
  for (const id of ['#queues', '#workers', '#jobs', '#dead-groups', '#dead-jobs']) replaceRows($(id), [], '');
  $('#jobs-more').hidden = true;
  clearJob();
}

async function renderView() {
  const stale = newGeneration();
  const { path, params } = routeParams();
  let view = 'queues';
  if (path.startsWith('/jobs')) view = 'jobs';
  else if (path.startsWith('/job/')) view = 'job';
  else if (path.startsWith('/dead')) view = 'dead';
  for (const section of document.querySelectorAll('main > section')) section.hidden = section.id !== 'view-' + view;
  for (const link of document.querySelectorAll('nav a')) {
    if (link.dataset.view === (view === 'job' ? 'jobs' : view)) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  try {
    await learnCaller();
    if (stale()) return;
    if (view === 'queues') await renderQueues(stale);
    else if (view === 'jobs') { fillForm($('#job-filter'), params); await renderJobs(params, false, stale); }
    else if (view === 'dead') { fillForm($('#dead-filter'), params); await renderDead(params, stale); }
    else if (view === 'job' && (!stream || stream.jobId !== path)) {
      stopStream();
      await renderJob(decodeURIComponent(path.slice('/job/'.length)), stale);
      if (stream) stream.jobId = path;
    }
    if (stale()) return;
    viewLoaded();
    document.body.dataset.ready = view;
  } catch (err) {
    if (stale()) return;
    // Rows of another filter or job must not stand under its error.
    if (view === 'jobs') { replaceRows($('#jobs'), [], 'Not loaded.'); $('#jobs-more').hidden = true; }
    failView(err);
  }
}

function schedule() {
  clearInterval(timer);
  timer = null;
  if ($('#live').checked) {
    timer = setInterval(() => {
      const { path } = routeParams();
      // A job page is live through its event stream; forms are not reset while typed in.
      // One render at a time: a slow one is not joined by the next tick's.
      const paging = path.startsWith('/jobs') && morePages;
      const typing = document.activeElement.matches('form input:not([type=checkbox]), form select, form textarea');
      if (!rendering && !paging && !path.startsWith('/job/') && !document.querySelector('dialog[open]') && !typing) render();
    }, REFRESH_MS);
  }
}

function navigate(view, form) {
  const query = formQuery(form).toString();
  location.hash = '#/' + view + (query ? '?' + query : '');
}

document.addEventListener('DOMContentLoaded', () => {
  $('#token').value = sessionStorage.getItem('intray.token') || '';
  $('#tenant').value = sessionStorage.getItem('intray.tenant') || '';
  $('#token-button').addEventListener('click', () => {
    const form = $('#token-form');
    form.hidden = !form.hidden;
    $('#token-button').setAttribute('aria-expanded', String(!form.hidden));
    if (!form.hidden) $('#token').focus();
  });
  $('#token-form').addEventListener('submit', (e) => {
    e.preventDefault();
    const token = $('#token').value.trim();
    const tenant = $('#tenant').value.trim();
    if (token) sessionStorage.setItem('intray.token', token); else sessionStorage.removeItem('intray.token');
    if (tenant) sessionStorage.setItem('intray.tenant', tenant); else sessionStorage.removeItem('intray.tenant');
    $('#token-form').hidden = true;
    $('#token-button').setAttribute('aria-expanded', 'false');
    say('Token saved for this tab.');
    forgetCaller();
    stopStream();
    render();
  });
  $('#token-clear').addEventListener('click', () => {
    sessionStorage.removeItem('intray.token');
    sessionStorage.removeItem('intray.tenant');
    $('#token').value = '';
    $('#tenant').value = '';
    forgetCaller();
    clearViews();
    say('Token forgotten.');
    render();
  });
  $('#job-filter').addEventListener('submit', (e) => { e.preventDefault(); navigate('jobs', e.target); });
  $('#dead-filter').addEventListener('submit', (e) => { e.preventDefault(); navigate('dead', e.target); });
  $('#dead-count').addEventListener('click', async () => {
    const filter = deadFilter(formQuery($('#dead-filter')));
    try {
      const n = await countMatching(filter);
      say(n + ' failed job' + (n === 1 ? '' : 's') + ' match' + (n === 1 ? 'es' : '') + describe(filter) + ' (dry run, nothing changed).');
    } catch (err) { fail(err); }
  });
  $('#dead-replay').addEventListener('click', () => replayMatching(deadFilter(formQuery($('#dead-filter')))));
  $('#jobs-more').addEventListener('click', () => renderJobs(routeParams().params, true, newGeneration()).catch(fail));
  $('#live').addEventListener('change', schedule);
  window.addEventListener('hashchange', () => {
    say('');
    const { path } = routeParams();
    if (!path.startsWith('/job/')) stopStream();
    render();
    $('#main').focus({ preventScroll: true });
  });
  schedule();
  render();
});
