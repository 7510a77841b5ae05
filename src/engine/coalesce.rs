//! Coalescing of concurrent calls into shared store transactions.
//!
//! A durable commit is the unit of cost (one WAL flush on PostgreSQL, one
//! fsync on SQLite), so one-job-per-call clients are limited by commits, not
//! by work. A caller hands its call to a [`Coalescer`] and waits; a single
//! task takes whatever calls have queued up while the earlier transactions
//! were in flight, groups them by key, runs one store call per group, and
//! answers each caller only after that call returned, which is after its
//! COMMIT. There is no timer: an idle server flushes a lone call at once, and
//! batches grow with load by themselves. Several transactions may run at
//! once, but a light batch waits for the running one rather than start
//! beside it ([`Sizing::overlap_weight`]): one statement of both sizes costs
//! less than two small ones.
//!
//! A store error that fails a shared call (a statement refusing one bad
//! item fails the whole transaction) must not fail its neighbours, so such a
//! batch is run again one call at a time, and only the offending call gets
//! the error. An unavailable database is answered to everyone at once: there
//! is nothing to isolate, and a second try would only add load.
//!
//! A caller that has gone away (its RPC was cancelled, timed out, or its
//! connection closed) is left out of the next transaction: nobody waits for
//! that answer. A caller that goes away while its transaction runs still has
//! its call committed, and its answer is dropped here; an answer that must
//! act when nobody reads it does so on its own drop, wherever that comes
//! (the lease and complete calls' answers: see `engine::batchers`).

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::store::{StoreError, StoreResult};

/// A future returned by [`Flush::flush`].
pub type FlushFuture<'a, A> = Pin<Box<dyn Future<Output = StoreResult<Vec<A>>> + Send + 'a>>;

/// How one kind of call is run in shared transactions.
pub trait Flush: Send + Sync + 'static {
    /// Calls with equal keys may share a transaction.
    type Key: Eq + Hash + Clone + Send + 'static;
    /// One caller's request.
    type Call: Clone + Send + 'static;
    /// One caller's answer.
    type Answer: Send + 'static;

    /// How much of a batch's budget a call uses (its jobs, for example).
    fn weight(call: &Self::Call) -> usize;

    /// Runs the calls in one transaction; the answers come in call order.
    fn flush(&self, key: Self::Key, calls: Vec<Self::Call>) -> FlushFuture<'_, Self::Answer>;
}

struct Pending<F: Flush> {
    key: F::Key,
    call: F::Call,
    reply: oneshot::Sender<StoreResult<F::Answer>>,
}

/// How a coalescer sizes its shared transactions.
#[derive(Clone, Copy, Debug)]
pub struct Sizing {
    /// Most shared transactions running at once (each takes a database
    /// connection).
    pub in_flight: usize,
    /// A batch stops growing at this weight.
    pub max_weight: usize,
    /// A batch lighter than this does not start beside a running
    /// transaction: it waits for that one to end (taking the calls that
    /// arrive meanwhile), or until it has grown to this weight. A
    /// statement's fixed cost dwarfs a few jobs' work, so two small
    /// statements side by side cost more than one of both sizes; heavy
    /// batches still overlap, so that the database works on one while this
    /// process answers the other.
    pub overlap_weight: usize,
}

/// Hands calls to the coalescing task of one kind of call.
pub struct Coalescer<F: Flush> {
    calls: mpsc::UnboundedSender<Pending<F>>,
}

impl<F: Flush> Coalescer<F> {
    /// Starts the task.
    pub fn start(flush: F, sizing: Sizing) -> Self {
        let (calls, queued) = mpsc::unbounded_channel();
        let sizing = Sizing {
            in_flight: sizing.in_flight.max(1),
            ..sizing
        };
        tokio::spawn(run(Arc::new(flush), queued, sizing));
        Coalescer { calls }
    }

    /// Runs `call` in a transaction shared with the concurrent calls of the
    /// same key. A caller that goes away before its transaction starts is
    /// left out of it; one that goes away later still has its call
    /// committed, and its answer is dropped unread.
    pub async fn call(&self, key: F::Key, call: F::Call) -> StoreResult<F::Answer> {
        let (reply, answer) = oneshot::channel();
        self.calls
            .send(Pending { key, call, reply })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

fn stopped() -> StoreError {
    StoreError::Internal("the coalescing task stopped".into())
}

/// A batch being gathered, and the call that did not fit in it.
struct Gathered<F: Flush> {
    batch: Vec<Pending<F>>,
    weight: usize,
    carried: Option<Pending<F>>,
}

impl<F: Flush> Gathered<F> {
    fn new(first: Pending<F>) -> Self {
        Gathered {
            weight: F::weight(&first.call),
            batch: vec![first],
            carried: None,
        }
    }

    /// Adds `next`, or keeps it for the next batch when it would pass
    /// `max_weight`; false once the batch is full.
    fn add(&mut self, next: Pending<F>, max_weight: usize) -> bool {
        let w = F::weight(&next.call);
        if self.weight + w > max_weight {
            self.carried = Some(next);
            return false;
        }
        self.weight += w;
        self.batch.push(next);
        self.weight < max_weight
    }
}

async fn run<F: Flush>(
    flush: Arc<F>,
    mut queued: mpsc::UnboundedReceiver<Pending<F>>,
    sizing: Sizing,
) {
    let slots = Arc::new(Semaphore::new(sizing.in_flight));
    let ended = Arc::new(Notify::new());
    let mut carried: Option<Pending<F>> = None;
    loop {
        // A slot first: while every slot is busy, calls keep queuing up and
        // the next batch takes them all.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let first = match carried.take() {
            Some(first) => first,
            None => match queued.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let mut gathered = Gathered::new(first);
        let mut open = gathered.weight < sizing.max_weight;
        while open {
            let Ok(next) = queued.try_recv() else { break };
            open = gathered.add(next, sizing.max_weight);
        }
        // Our own slot is the one not available: any other taken is a
        // transaction still running.
        while open
            && gathered.weight < sizing.overlap_weight
            && slots.available_permits() + 1 < sizing.in_flight
        {
            tokio::select! {
                next = queued.recv() => match next {
                    Some(next) => open = gathered.add(next, sizing.max_weight),
                    None => break,
                },
                // Woken for every ended transaction; the loop checks again.
                () = ended.notified() => {}
            }
        }
        carried = gathered.carried;
        let batch = gathered.batch;
        let flush = Arc::clone(&flush);
        let ending = Ending {
            slot: Some(slot),
            ended: Arc::clone(&ended),
        };
        tokio::spawn(async move {
            run_batch(&*flush, batch).await;
            drop(ending);
        });
    }
}

/// A running batch's slot: freed when the batch ends, even by a panic, and
/// then the gatherer waiting for a running batch to end is woken (woken
/// first, it would find the slot still taken and wait again).
struct Ending {
    slot: Option<OwnedSemaphorePermit>,
    ended: Arc<Notify>,
}

impl Drop for Ending {
    fn drop(&mut self) {
        self.slot.take();
        self.ended.notify_one();
    }
}

/// Groups a batch by key, keeping each group in arrival order, and runs the
/// groups side by side.
async fn run_batch<F: Flush>(flush: &F, batch: Vec<Pending<F>>) {
    let mut order: Vec<F::Key> = Vec::new();
    let mut groups: HashMap<F::Key, Vec<Pending<F>>> = HashMap::new();
    for pending in batch {
        match groups.get_mut(&pending.key) {
            Some(group) => group.push(pending),
            None => {
                order.push(pending.key.clone());
                groups.insert(pending.key.clone(), vec![pending]);
            }
        }
    }
    let runs = order.into_iter().filter_map(|key| {
        let group = groups.remove(&key)?;
        Some(run_group(flush, key, group))
    });
    futures::future::join_all(runs).await;
}

async fn run_group<F: Flush>(flush: &F, key: F::Key, group: Vec<Pending<F>>) {
    let (calls, replies): (Vec<F::Call>, Vec<_>) = group
        .into_iter()
        .filter(|p| !p.reply.is_closed())
        .map(|p| (p.call, p.reply))
        .unzip();
    if calls.is_empty() {
        return;
    }
    if calls.len() == 1 {
        answer_alone(flush, key, calls, replies).await;
        return;
    }
    // Kept for the one-by-one rerun; cheap beside a commit.
    let spare = calls.clone();
    let started = std::time::Instant::now();
    let result = flush.flush(key.clone(), calls).await;
    tracing::trace!(
        kind = std::any::type_name::<F>(),
        calls = spare.len(),
        micros = started.elapsed().as_micros() as u64,
        "shared transaction"
    );
    match result {
        Ok(answers) => answer_all(replies, Ok(answers)),
        Err(err @ StoreError::Unavailable(_)) => answer_all(replies, Err(err)),
        Err(err) => {
            tracing::debug!(error = %err, calls = spare.len(), "shared transaction failed; running its calls one by one");
            for (call, reply) in spare.into_iter().zip(replies) {
                // The failed transaction committed nothing: a caller gone
                // by now is left out, as it is from the first one.
                if reply.is_closed() {
                    continue;
                }
                answer_alone(flush, key.clone(), vec![call], vec![reply]).await;
            }
        }
    }
}

async fn answer_alone<F: Flush>(
    flush: &F,
    key: F::Key,
    calls: Vec<F::Call>,
    replies: Vec<oneshot::Sender<StoreResult<F::Answer>>>,
) {
    let answers = flush.flush(key, calls).await;
    answer_all(replies, answers);
}

fn answer_all<A>(replies: Vec<oneshot::Sender<StoreResult<A>>>, answers: StoreResult<Vec<A>>) {
    match answers {
        Ok(answers) if answers.len() == replies.len() => {
            for (reply, answer) in replies.into_iter().zip(answers) {
                // A caller gone by now drops its answer with the channel.
                let _ = reply.send(Ok(answer));
            }
        }
        Ok(answers) => {
            let message = format!(
                "shared transaction answered {} of {} calls",
                answers.len(),
                replies.len()
            );
            for reply in replies {
                let _ = reply.send(Err(StoreError::Internal(message.clone())));
            }
        }
        Err(err) => {
            for reply in replies {
                let _ = reply.send(Err(err.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// Records each flush and the most flushes seen
    /// running at once; a call of `13` fails any flush it is in, one of
    /// `66` panics it, and a call of 1000 or more weighs 10.
    #[derive(Default)]
    struct Recorder {
        flushes: Mutex<Vec<Vec<u32>>>,
        running: AtomicUsize,
        most_running: AtomicUsize,
    }

    fn sizing(in_flight: usize, max_weight: usize, overlap_weight: usize) -> Sizing {
        Sizing {
            in_flight,
            max_weight,
            overlap_weight,
        }
    }

    impl Flush for Arc<Recorder> {
        type Key = &'static str;
        type Call = u32;
        type Answer = u32;

        fn weight(call: &u32) -> usize {
            if *call >= 1000 { 10 } else { 1 }
        }

        fn flush(&self, _key: &'static str, calls: Vec<u32>) -> FlushFuture<'_, u32> {
            Box::pin(async move {
                let running = self.running.fetch_add(1, Ordering::SeqCst) + 1;
                self.most_running.fetch_max(running, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                self.running.fetch_sub(1, Ordering::SeqCst);
                self.flushes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(calls.clone());
                if calls.contains(&13) {
                    return Err(StoreError::Internal("refused".into()));
                }
                assert!(!calls.contains(&66), "a flush that panics");
                Ok(calls.iter().map(|c| c * 10).collect())
            })
        }
    }

    /// One caller, on a task of its own so that it can be dropped (aborted).
    fn spawn_call(
        coalescer: &Arc<Coalescer<Arc<Recorder>>>,
        call: u32,
    ) -> tokio::task::JoinHandle<StoreResult<u32>> {
        let coalescer = Arc::clone(coalescer);
        tokio::spawn(async move { coalescer.call("k", call).await })
    }

    type Blocked = (
        Arc<Recorder>,
        Arc<Coalescer<Arc<Recorder>>>,
        tokio::task::JoinHandle<StoreResult<u32>>,
    );

    /// A coalescer whose first transaction (of the call `1`) has started
    /// and runs on for about 15 ms: calls made now meet it running.
    async fn blocked(sizing: Sizing) -> Blocked {
        let recorder = Arc::new(Recorder::default());
        let coalescer = Arc::new(Coalescer::start(Arc::clone(&recorder), sizing));
        let blocker = spawn_call(&coalescer, 1);
        tokio::time::sleep(Duration::from_millis(5)).await;
        (recorder, coalescer, blocker)
    }

    /// The answer a caller got, which must be a success.
    async fn answer(call: tokio::task::JoinHandle<StoreResult<u32>>) -> u32 {
        call.await.expect("joined").expect("answered")
    }

    #[tokio::test]
    async fn concurrent_calls_share_flushes_and_get_their_own_answers() {
        let recorder = Arc::new(Recorder::default());
        let coalescer = Arc::new(Coalescer::start(Arc::clone(&recorder), sizing(1, 100, 0)));
        let calls = (100..150u32).map(|i| {
            let coalescer = Arc::clone(&coalescer);
            tokio::spawn(async move { (i, coalescer.call("k", i).await) })
        });
        let answers = futures::future::join_all(calls).await;
        for answer in answers {
            let (i, answer) = answer.expect("joined");
            assert_eq!(answer.expect("answered"), i * 10);
        }
        let flushes = recorder.flushes.lock().expect("lock").len();
        assert!(flushes < 50, "50 calls took {flushes} flushes");
    }

    #[tokio::test]
    async fn a_failing_call_does_not_fail_its_neighbours() {
        // Occupy the only slot so that the next three queue up together.
        let (recorder, coalescer, blocker) = blocked(sizing(1, 100, 0)).await;
        let calls = [12u32, 13, 14].map(|i| spawn_call(&coalescer, i));
        let answers = futures::future::join_all(calls).await;
        assert_eq!(answer(blocker).await, 10);
        let answers: Vec<_> = answers
            .into_iter()
            .map(|a| a.expect("joined").ok())
            .collect();
        assert_eq!(answers, vec![Some(120), None, Some(140)]);
        let flushes = recorder.flushes.lock().expect("lock").clone();
        assert!(
            flushes.contains(&vec![12, 13, 14]),
            "the three shared a flush first: {flushes:?}"
        );
    }

    #[tokio::test]
    async fn a_caller_gone_during_the_one_by_one_rerun_is_left_out() {
        let (recorder, coalescer, blocker) = blocked(sizing(1, 100, 0)).await;
        let calls = [12u32, 13, 14].map(|i| spawn_call(&coalescer, i));
        let [first, failing, gone] = calls;
        // Once the shared flush has failed, 12 and then 13 run alone first.
        let shared = vec![12, 13, 14];
        tokio::time::timeout(Duration::from_secs(2), async {
            while !recorder.flushes.lock().expect("lock").contains(&shared) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the shared flush failed");
        gone.abort();
        assert_eq!(answer(blocker).await, 10);
        assert_eq!(answer(first).await, 120);
        assert!(failing.await.expect("joined").is_err());
        // With one transaction at a time, this one runs after the rerun.
        assert_eq!(answer(spawn_call(&coalescer, 15)).await, 150);
        let flushes = recorder.flushes.lock().expect("lock").clone();
        assert_eq!(flushes, vec![vec![1], shared, vec![12], vec![13], vec![15]]);
    }

    #[tokio::test]
    async fn a_batch_stops_at_its_weight() {
        let recorder = Arc::new(Recorder::default());
        let coalescer = Arc::new(Coalescer::start(Arc::clone(&recorder), sizing(1, 3, 0)));
        let calls = (0..10u32).map(|i| spawn_call(&coalescer, i));
        futures::future::join_all(calls).await;
        let flushes = recorder.flushes.lock().expect("lock").clone();
        assert!(flushes.iter().all(|f| f.len() <= 3), "{flushes:?}");
        assert_eq!(flushes.iter().map(Vec::len).sum::<usize>(), 10);
    }

    #[tokio::test]
    async fn a_caller_gone_before_its_transaction_is_left_out() {
        let (recorder, coalescer, blocker) = blocked(sizing(1, 100, 0)).await;
        let gone = spawn_call(&coalescer, 7);
        let stays = spawn_call(&coalescer, 8);
        tokio::time::sleep(Duration::from_millis(2)).await;
        gone.abort();
        assert_eq!(answer(blocker).await, 10);
        assert_eq!(answer(stays).await, 80);
        let flushes = recorder.flushes.lock().expect("lock").clone();
        assert_eq!(flushes, vec![vec![1], vec![8]]);
    }

    #[tokio::test]
    async fn a_call_whose_caller_left_during_the_transaction_is_still_committed() {
        let recorder = Arc::new(Recorder::default());
        let coalescer = Arc::new(Coalescer::start(Arc::clone(&recorder), sizing(1, 100, 0)));
        let gone = spawn_call(&coalescer, 9);
        tokio::time::sleep(Duration::from_millis(5)).await;
        gone.abort();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(*recorder.flushes.lock().expect("lock"), vec![vec![9]]);
    }

    #[tokio::test]
    async fn light_calls_wait_for_the_running_transaction_instead_of_overlapping_it() {
        let (recorder, coalescer, blocker) = blocked(sizing(2, 100, 10)).await;
        let first = spawn_call(&coalescer, 2);
        tokio::time::sleep(Duration::from_millis(5)).await;
        let second = spawn_call(&coalescer, 3);
        assert_eq!(answer(blocker).await, 10);
        assert_eq!(answer(first).await, 20);
        assert_eq!(answer(second).await, 30);
        let flushes = recorder.flushes.lock().expect("lock").clone();
        assert_eq!(flushes, vec![vec![1], vec![2, 3]]);
        assert_eq!(recorder.most_running.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_call_waiting_for_a_transaction_that_panicked_still_runs() {
        let recorder = Arc::new(Recorder::default());
        let coalescer = Arc::new(Coalescer::start(Arc::clone(&recorder), sizing(2, 100, 10)));
        let panicking = spawn_call(&coalescer, 66);
        tokio::time::sleep(Duration::from_millis(5)).await;
        // Light: it waits for the running transaction to end.
        let waiting = spawn_call(&coalescer, 2);
        let answered = tokio::time::timeout(Duration::from_secs(2), answer(waiting)).await;
        assert_eq!(answered.expect("woken when the panicked batch ended"), 20);
        assert!(panicking.await.expect("joined").is_err());
    }

    #[tokio::test]
    async fn heavy_calls_run_beside_the_running_transaction() {
        let (recorder, coalescer, blocker) = blocked(sizing(2, 100, 10)).await;
        let heavy = spawn_call(&coalescer, 1000);
        assert_eq!(answer(blocker).await, 10);
        assert_eq!(answer(heavy).await, 10_000);
        assert_eq!(recorder.most_running.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn light_calls_overlap_once_they_add_up_to_the_overlap_weight() {
        let (recorder, coalescer, blocker) = blocked(sizing(2, 100, 3)).await;
        let mut calls = Vec::new();
        for i in [2u32, 3, 4] {
            calls.push(spawn_call(&coalescer, i));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        futures::future::join_all(calls).await;
        assert_eq!(answer(blocker).await, 10);
        let flushes = recorder.flushes.lock().expect("lock").clone();
        assert_eq!(flushes, vec![vec![1], vec![2, 3, 4]]);
        assert_eq!(recorder.most_running.load(Ordering::SeqCst), 2);
    }
}
