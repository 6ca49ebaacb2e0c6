//! Producers that are never destroyed on their owner's thread.
//!
//! Dropping a librdkafka producer blocks: rust-rdkafka purges its queues,
//! flushes for up to 500 ms, joins its polling thread, and librdkafka's
//! destroy waits for its own threads. The last handle of a producer can go
//! anywhere (in the group-commit task when the API replaces an unusable
//! producer, under the transaction lock when a twin or a renewal takes the
//! current one's place), and neither an async worker thread nor the lock
//! may wait for that. So every producer quire creates lives in a
//! [`Retiring`] from its first moment, and a `Retiring` is destroyed on a
//! thread of its own.

use std::ops::Deref;

/// The name of the threads that destroy retired producers.
pub(crate) const RETIRE_THREAD: &str = "producer-retire";

/// A value (a librdkafka producer) whose drop runs on a thread of its own,
/// never on the thread that lets it go.
pub(crate) struct Retiring<T: Send + 'static> {
    value: Option<T>,
}

impl<T: Send + 'static> Retiring<T> {
    pub(crate) fn new(value: T) -> Self {
        Retiring { value: Some(value) }
    }
}

impl<T: Send + 'static> Deref for Retiring<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.value
            .as_ref()
            .expect("a retiring value is only taken by its drop")
    }
}

impl<T: Clone + Send + 'static> Clone for Retiring<T> {
    fn clone(&self) -> Self {
        Retiring::new(T::clone(self))
    }
}

impl<T: Send + 'static> Drop for Retiring<T> {
    fn drop(&mut self) {
        let Some(value) = self.value.take() else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name(RETIRE_THREAD.into())
            .spawn(move || drop(value));
        if let Err(error) = spawned {
            // The value went down with the closure, on this thread: the
            // best left to do is say so.
            tracing::warn!(error = %error, "cannot start a thread to close a replaced producer");
        }
    }
}

/// Puts `fresh` in `slot`'s place; the value it held is retired.
pub(crate) fn replace<T: Send + 'static>(slot: &mut Retiring<T>, fresh: Retiring<T>) {
    let replaced = std::mem::replace(slot, fresh);
    drop(replaced);
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread::ThreadId;
    use std::time::Duration;

    use rdkafka::ClientConfig;
    use rdkafka::ClientContext;
    use rdkafka::producer::FutureProducer;

    use super::*;

    /// Where a client was destroyed: the thread's id and name.
    type Destroyed = (ThreadId, Option<String>);

    /// A producer context that tells on which thread its client was
    /// destroyed: rust-rdkafka drops the context right after
    /// `rd_kafka_destroy`, on the same thread.
    struct Probe {
        destroyed: mpsc::Sender<Destroyed>,
    }

    impl ClientContext for Probe {}

    impl Drop for Probe {
        fn drop(&mut self) {
            let here = std::thread::current();
            let _test_may_be_gone = self
                .destroyed
                .send((here.id(), here.name().map(str::to_owned)));
        }
    }

    /// A real librdkafka producer (no broker needed to create or destroy
    /// one) and where its destruction is reported.
    fn probed_producer() -> (Retiring<FutureProducer<Probe>>, mpsc::Receiver<Destroyed>) {
        let (destroyed, reported) = mpsc::channel();
        let producer: FutureProducer<Probe> = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("log_level", "0")
            .create_with_context(Probe { destroyed })
            .expect("a producer needs no broker to be created");
        (Retiring::new(producer), reported)
    }

    fn destroyed_on(reported: &mpsc::Receiver<Destroyed>) -> Destroyed {
        reported
            .recv_timeout(Duration::from_secs(30))
            .expect("the producer is destroyed")
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_producer_let_go_on_an_async_task_is_destroyed_on_a_thread_of_its_own() {
        let (producer, reported) = probed_producer();
        let task_thread = tokio::spawn(async move {
            drop(producer);
            std::thread::current().id()
        })
        .await
        .expect("the task runs");
        let (thread, name) = destroyed_on(&reported);
        assert_ne!(thread, task_thread, "destroyed on the async worker thread");
        assert_eq!(name.as_deref(), Some(RETIRE_THREAD));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_replaced_producer_is_destroyed_on_a_thread_of_its_own() {
        let (mut current, old_reported) = probed_producer();
        let (fresh, fresh_reported) = probed_producer();
        replace(&mut current, fresh);
        let (thread, name) = destroyed_on(&old_reported);
        assert_ne!(thread, std::thread::current().id());
        assert_eq!(name.as_deref(), Some(RETIRE_THREAD));
        // The fresh one is in place, alive.
        assert!(
            fresh_reported.try_recv().is_err(),
            "the fresh producer was destroyed"
        );
        drop(current);
        assert_eq!(
            destroyed_on(&fresh_reported).1.as_deref(),
            Some(RETIRE_THREAD)
        );
    }
}
