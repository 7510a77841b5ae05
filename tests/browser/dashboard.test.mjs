// End-to-end test of the dashboard in headless Chromium, against a real
// `intray serve` (with a token file) and real `intray work` workers.
//
// Usage: node dashboard.test.mjs   (scripts/browser-test.sh sets it up)
//   INTRAY_BIN   the intray binary (default ../../target/debug/intray)
//   CHROMIUM     the browser (default /usr/bin/chromium)
//   SCREENSHOTS  where the screenshots go (default ../../docs)
//
// Exits non-zero, naming the failed check, if anything is wrong.

import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync, mkdirSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = dirname(fileURLToPath(import.meta.url));
const BIN = process.env.INTRAY_BIN || resolve(here, '../../target/debug/intray');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const SHOTS = process.env.SCREENSHOTS || resolve(here, '../../docs');
const TOKEN = 'dashboard-test-admin-token-0123456789';
const PRODUCER_TOKEN = 'dashboard-test-producer-token-012345';
const STEP_TIMEOUT = 20_000;

const work = mkdtempSync(join(tmpdir(), 'intray-browser-'));
const children = [];

function check(condition, what) {
  if (!condition) throw new Error('check failed: ' + what);
}

function freePort() {
  return new Promise((ok, bad) => {
    const server = createServer();
    server.on('error', bad);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => ok(port));
    });
  });
}

function start(args, name) {
  const child = spawn(BIN, args, { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, INTRAY_TOKEN: TOKEN } });
  let log = '';
  child.stderr.on('data', (d) => { log = (log + d).slice(-4000); });
  child.on('error', (err) => { console.error(name + ': ' + err.message); });
  children.push({ child, name, log: () => log });
  return child;
}

function stop(child) {
  return new Promise((done) => {
    if (child.exitCode !== null || child.signalCode !== null) return done();
    const kill = setTimeout(() => child.kill('SIGKILL'), 10_000);
    child.once('exit', () => { clearTimeout(kill); done(); });
    child.kill('SIGTERM');
  });
}

async function until(what, probe, timeout = STEP_TIMEOUT) {
  const started = Date.now();
  let last;
  while (Date.now() - started < timeout) {
    try {
      last = await probe();
      if (last) return last;
    } catch (err) {
      last = err;
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error('timed out waiting for ' + what + ' (last: ' + last + ')');
}

let base;
async function api(method, path, body) {
  const response = await fetch(base + '/api/v1' + path, {
    method,
    headers: { authorization: 'Bearer ' + TOKEN, 'content-type': 'application/json' },
    body: body ? JSON.stringify(body) : undefined,
  });
  const data = await response.json();
  if (!response.ok) throw new Error(method + ' ' + path + ': ' + response.status + ' ' + JSON.stringify(data));
  return data;
}

const jobsIn = async (queue, state) => (await api('GET', `/jobs?queue=${queue}&state=${state}&page_size=1000`)).jobs || [];

async function main() {
  const grpcPort = await freePort();
  const httpPort = await freePort();
  base = `http://127.0.0.1:${httpPort}`;
  const grpc = `http://127.0.0.1:${grpcPort}`;
  writeFileSync(join(work, 'tokens'), `${TOKEN} default admin\n${PRODUCER_TOKEN} default producer\n`);
  start(['serve', '--grpc-addr', `127.0.0.1:${grpcPort}`, '--http-addr', `127.0.0.1:${httpPort}`,
    '--database-url', `sqlite://${join(work, 'intray.db')}`, '--auth-file', join(work, 'tokens'),
    '--fallback-poll', '200ms', '--metrics-refresh', '1s'], 'server');
  await until('the server to answer', async () => (await fetch(base + '/api/v1/openapi.json')).ok);

  // Jobs in several states: succeeded, queued, running, cancelled, failed (two error classes).
  for (let i = 0; i < 3; i++) await api('POST', '/jobs', { queue: 'mail', kind: 'send', payload: { to: `user${i}@example.com` } });
  const mailWorker = start(['work', '--addr', grpc, '--queue', 'mail', '--worker-id', 'mail-worker', '--', 'cat'], 'mail worker');
  await until('3 mail jobs to succeed', async () => (await jobsIn('mail', 'succeeded')).length === 3);
  await stop(mailWorker);
  for (let i = 0; i < 2; i++) await api('POST', '/jobs', { queue: 'mail', kind: 'send', payload: { to: `later${i}@example.com` } });

  for (let i = 0; i < 3; i++) await api('POST', '/jobs', { queue: 'llm', kind: 'summarize', payload: { mode: 'fatal', doc: i }, maxAttempts: 1 });
  for (let i = 0; i < 2; i++) await api('POST', '/jobs', { queue: 'llm', kind: 'summarize', payload: { mode: 'flaky', doc: i }, maxAttempts: 1 });
  const doomed = await api('POST', '/jobs', { queue: 'llm', kind: 'translate', payload: { mode: 'never' }, runAt: new Date(Date.now() + 3600_000).toISOString() });
  await api('POST', `/jobs/${doomed.id}:cancel`, { reason: 'not needed' });
  const llmWorker = start(['work', '--addr', grpc, '--queue', 'llm', '--worker-id', 'llm-worker', '--concurrency', '2', '--',
    'sh', '-c', 'p=$(cat); case "$p" in *flaky*) echo "provider rate limited" >&2; exit 75;; *) echo "cannot parse the document" >&2; exit 3;; esac'], 'llm worker');
  await until('5 llm jobs in the dead set', async () => (await jobsIn('llm', 'failed')).length === 5);
  await stop(llmWorker);

  await api('POST', '/jobs', { queue: 'slow', kind: 'render', payload: { frames: 1000 } });
  start(['work', '--addr', grpc, '--queue', 'slow', '--worker-id', 'slow-worker', '--grace', '1s', '--kill-after', '1s', '--', 'sleep', '600'], 'slow worker');
  await until('the slow job to run', async () => (await jobsIn('slow', 'running')).length === 1);

  mkdirSync(SHOTS, { recursive: true });
  const profile = mkdtempSync(join(tmpdir(), 'intray-chromium-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-quic',
      '--no-first-run', '--disable-component-update', '--disable-sync'],
    viewport: { width: 1280, height: 800 },
  });
  try {
    const page = context.pages()[0] || await context.newPage();
    page.setDefaultTimeout(STEP_TIMEOUT);
    const errors = [];
    page.on('pageerror', (err) => errors.push(err.message));
    const external = [];
    page.on('request', (r) => { if (!r.url().startsWith(base)) external.push(r.url()); });
    // The lists show no payload, so they ask for none (view=basic).
    const lists = [];
    page.on('request', (r) => { if (r.url().includes('/api/v1/jobs?')) lists.push(r.url()); });

    // Without a token the page asks for one, then shows the queues.
    await page.goto(base + '/');
    await page.locator('#token-form').waitFor({ state: 'visible' });
    await page.getByLabel('Bearer token').fill(TOKEN);
    await page.getByRole('button', { name: 'Use token' }).click();
    await page.locator('#queues tr[data-queue="llm"]').waitFor();
    check((await page.locator('#who').textContent()).includes('admin'), 'the header names the role');

    // Queue figures match Stats.
    const stats = await api('GET', '/stats');
    for (const q of stats.queues) {
      const counts = Object.fromEntries((q.counts || []).map((c) => [c.state.replace('JOB_STATE_', '').toLowerCase(), Number(c.count)]));
      const row = page.locator(`#queues tr[data-queue="${q.queue}"]`);
      const figure = async (field) => Number(await row.locator(`[data-field="${field}"]`).textContent());
      const expected = { queued: counts.queued || 0, running: Number(q.running || 0), succeeded: counts.succeeded || 0,
        dead: Number(q.dead || 0), cancelled: counts.cancelled || 0 };
      for (const [field, value] of Object.entries(expected)) {
        check((await figure(field)) === value, `queue ${q.queue} ${field}: page ${await figure(field)}, Stats ${value}`);
      }
    }
    check((await page.locator('#queues tr[data-queue="llm"] [data-field="dead"]').textContent()) === '5', 'llm dead set is 5');
    check((await page.locator('#queues tr[data-queue="slow"] [data-field="running"]').textContent()) === '1', 'slow has one running');
    check((await page.locator('#workers tbody tr').count()) >= 1, 'workers are listed');
    await page.screenshot({ path: join(SHOTS, 'dashboard-queues.png'), fullPage: true });

    // Every form control has a label.
    const unlabelled = await page.evaluate(() => [...document.querySelectorAll('input, select')]
      .filter((e) => e.labels.length === 0 && !e.getAttribute('aria-label')).map((e) => e.name || e.id));
    check(unlabelled.length === 0, 'unlabelled controls: ' + unlabelled.join(', '));

    // Pause and resume a queue, confirming each.
    await page.getByRole('button', { name: 'Pause queue mail' }).click();
    await page.locator('#confirm-ok').click();
    await page.locator('#message', { hasText: 'Queue mail paused.' }).waitFor();
    // The message comes as soon as the call returns; the table follows
    // once the page has read Stats again, so wait for it (bounded).
    const mailPaused = page.locator('#queues tr[data-queue="mail"] [data-field="paused"]');
    await mailPaused.filter({ hasText: 'paused' }).waitFor({ timeout: 5000 }).catch(() => {});
    check((await mailPaused.textContent()) === 'paused', 'mail shows paused');
    await page.getByRole('button', { name: 'Resume queue mail' }).click();
    await page.locator('#confirm-ok').click();
    await page.locator('#message', { hasText: 'Queue mail resumed.' }).waitFor();

    // Cancel a queued job from its page.
    await page.goto(base + '/#/jobs?queue=mail&state=queued');
    await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 2);
    const victim = await page.locator('#jobs tbody tr[data-job]').first().getAttribute('data-job');
    await page.locator('#jobs tbody tr[data-job] a').first().click();
    await page.locator('#timeline li').first().waitFor();
    await page.getByRole('button', { name: 'Cancel job' }).click();
    await page.locator('#confirm-ok').click();
    await page.locator('#message', { hasText: 'is cancelled.' }).waitFor();
    check((await api('GET', '/jobs/' + victim)).state === 'JOB_STATE_CANCELLED', 'the job was cancelled');
    await page.locator('#timeline', { hasText: 'cancelled' }).waitFor();

    // The jobs list, filtered to the dead set of llm.
    await page.goto(base + '/#/jobs?queue=llm&state=failed');
    await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 5);
    await page.screenshot({ path: join(SHOTS, 'dashboard-jobs.png'), fullPage: true });

    // "Next page" shows more rows, and live refresh leaves them be.
    await api('POST', '/jobs:batch', { jobs: Array.from({ length: 60 }, (_, i) => ({ queue: 'paged', kind: 'k', payload: { i } })) });
    await page.goto(base + '/#/jobs?queue=paged');
    await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 50);
    await page.locator('#jobs-more').click();
    await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 60);
    await page.waitForTimeout(4000);
    check((await page.locator('#jobs tbody tr[data-job]').count()) === 60, 'the second page outlives a live refresh');
    check(await page.locator('#jobs-more').isHidden(), 'no next page after the last');
    // A list of exactly one page offers no next page (it offered an empty one).
    await api('POST', '/jobs:batch', { jobs: Array.from({ length: 50 }, (_, i) => ({ queue: 'fifty', kind: 'k', payload: { i } })) });
    await page.goto(base + '/#/jobs?queue=fifty');
    await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 50);
    check(await page.locator('#jobs-more').isHidden(), 'no next page after a list of exactly 50');
    await page.goto(base + '/#/jobs?queue=llm&state=failed');
    await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 5);

    // A failed job's timeline.
    await page.locator('#jobs tbody tr[data-job] a').first().click();
    await page.waitForFunction(() => document.querySelectorAll('#timeline li').length >= 3);
    const timeline = await page.locator('#timeline').textContent();
    for (const word of ['submitted', 'leased', 'failed', 'llm-worker']) check(timeline.includes(word), 'timeline shows ' + word);
    const attempt = await page.locator('#attempts tbody tr').first().textContent();
    check(attempt.includes('failed') && attempt.includes('command_'), 'attempt row shows the failure: ' + attempt);
    check((await page.locator('#job-retry').isEnabled()), 'a failed job can be replayed');
    // Its stream has ended with the job: the badge says so (CSS once overrode `hidden`).
    await page.locator('#timeline-live').waitFor({ state: 'hidden' });
    await page.screenshot({ path: join(SHOTS, 'dashboard-job.png'), fullPage: true });

    // A job due later says when; bidirectional controls in its payload show as escapes.
    const later = await api('POST', '/jobs', { queue: 'later', kind: 'k', payload: { note: 'abc\u202Edef' }, runAt: new Date(Date.now() + 3600_000).toISOString() });
    await page.goto(base + '/#/job/' + later.id);
    await page.locator('#job-fields [data-field="state"]', { hasText: 'queued, due ' }).waitFor();
    const payload = await page.locator('#job-fields [data-field="payload"]').textContent();
    check(payload.includes('abc\\u202Edef'), 'the payload shows its RTL override as an escape: ' + payload);
    // A job that cannot be read leaves nothing of the one shown before.
    await page.goto(base + '/#/job/00000000-0000-7000-8000-000000000000');
    await page.locator('#message', { hasText: 'NOT_FOUND' }).waitFor();
    check((await page.locator('#job-fields dd').count()) === 0, 'no fields of the previous job');
    check(!(await page.locator('#job-retry').isEnabled()), 'nothing to replay');

    // The dead set grouped by error class; count with a dry run, then replay.
    await page.goto(base + '/#/dead?queue=llm');
    await page.locator('#dead-groups tr[data-class="command_failed"]').waitFor();
    check((await page.locator('#dead-groups tr[data-class="command_failed"] [data-field="count"]').textContent()) === '3', 'command_failed group has 3');
    check((await page.locator('#dead-groups tr[data-class="command_tempfail"] [data-field="count"]').textContent()) === '2', 'command_tempfail group has 2');
    await page.screenshot({ path: join(SHOTS, 'dashboard-dead-set.png'), fullPage: true });
    await page.getByRole('button', { name: 'Count matching (dry run)' }).click();
    await page.locator('#message', { hasText: '5 failed jobs match (queue llm)' }).waitFor();
    check((await jobsIn('llm', 'failed')).length === 5, 'the dry run changed nothing');
    await page.getByRole('button', { name: 'Replay matching' }).click();
    await page.locator('#confirm-text', { hasText: 'Replay 5 failed jobs (queue llm)?' }).waitFor();
    await page.locator('#confirm-ok').click();
    await page.locator('#message', { hasText: 'Replayed 5 of 5 matching jobs' }).waitFor();
    await page.locator('#dead-groups', { hasText: 'The dead set is empty.' }).waitFor();

    // The jobs are back to queued, in the API and on the queues page.
    check((await jobsIn('llm', 'queued')).length === 5, 'the 5 replayed jobs are queued');
    check((await jobsIn('llm', 'failed')).length === 0, 'the dead set of llm is empty');
    await page.goto(base + '/#/');
    await page.waitForFunction(() => {
      const row = document.querySelector('#queues tr[data-queue="llm"]');
      return row && row.querySelector('[data-field="queued"]').textContent === '5'
        && row.querySelector('[data-field="dead"]').textContent === '0';
    });

    // A producer's token is not offered the operators' acts (they would be refused).
    await page.getByRole('button', { name: 'Token' }).click();
    await page.getByLabel('Bearer token').fill(PRODUCER_TOKEN);
    await page.getByRole('button', { name: 'Use token' }).click();
    await page.locator('#who', { hasText: 'producer' }).waitFor();
    await page.locator('#queues tr[data-queue="llm"]').waitFor();
    check((await page.locator('#queues button').count()) === 0, 'no pause or resume for a producer');
    await page.goto(base + '/#/dead?queue=llm');
    await page.waitForFunction(() => document.body.dataset.ready === 'dead');
    check(await page.locator('#dead-replay').isHidden() && await page.locator('#dead-count').isHidden(), 'no replay for a producer');
    await page.goto(base + '/#/job/' + later.id);
    await page.locator('#job-fields [data-field="state"]').waitFor();
    check(await page.locator('#job-retry').isHidden(), 'no job replay for a producer');
    check(await page.locator('#job-cancel').isVisible(), 'a producer may cancel');

    // A phone-sized screen.
    await page.setViewportSize({ width: 390, height: 844 });
    await page.goto(base + '/#/');
    await page.waitForFunction(() => document.body.dataset.ready === 'queues');
    await page.screenshot({ path: join(SHOTS, 'dashboard-phone.png'), fullPage: false });

    check(lists.length > 0 && lists.every((u) => u.includes('view=basic')), 'lists ask for no payloads: ' + lists.filter((u) => !u.includes('view=basic')).join(', '));
    check(errors.length === 0, 'no script errors: ' + errors.join('; '));
    check(external.length === 0, 'nothing fetched from elsewhere: ' + external.join(', '));
  } finally {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
  }
}

let failed = false;
try {
  await main();
  console.log('browser test: ok (screenshots in ' + SHOTS + ')');
} catch (err) {
  failed = true;
  console.error('browser test FAILED: ' + err.message);
  for (const { name, log } of children) console.error(`--- ${name} (last stderr) ---\n${log()}`);
} finally {
  await Promise.all(children.map(({ child }) => stop(child)));
  rmSync(work, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
