//! The producer's state machine, sans I/O.
//!
//! A [`TransactionalProducer`](super::TransactionalProducer)'s state is one
//! [`State`], held under its transaction lock with the librdkafka producer
//! it describes. Whatever happens to the producer is an [`Event`], and
//! [`State::next`] is the one place that says what it moves to; the other
//! decisions that need no broker (which states may begin a transaction,
//! what a failed commit or abort leads to, which error a fatal one is
//! reported as) are the functions below. The I/O in the sibling modules
//! asks them and applies their answers.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// The release (see [`Release`](super::Release)) a producer owes before its
/// next transaction. Ordered: a release for cause includes a periodic one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Owed {
    Nothing,
    /// A periodic release, committed by the producer itself.
    InPlace,
    /// A release for cause (the producer connected, the brokers were gone,
    /// a release failed), committed by a twin.
    ByTwin,
}

/// Where a producer stands between two holders of its transaction lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// No transaction open; `owed` commits before the next one.
    Idle { owed: Owed },
    /// A transaction failed before its commit was asked for, and its abort
    /// was put off until its callers had their answer: the next holder of
    /// the lock aborts it before anything else.
    AbortPutOff { owed: Owed },
    /// A release is committing. Until it has, a release stays owed for
    /// cause: one that failed may have left a hanging transaction that only
    /// a twin's markers end.
    Releasing { by_twin: bool },
    /// Fenced by a newer instance, hit by another fatal error, or in a
    /// transaction state nobody knows any more (an abort or a commit that did
    /// not finish, a call that never returned): every call fails, and the
    /// owner must replace the producer (a new `init_transactions` with the
    /// same id fences this one and ends its open transaction).
    Unusable { owed: Owed },
}

/// What happens to a producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// librdkafka reported the brokers gone: a release for cause is owed.
    BrokersGone,
    /// A periodic release was asked for.
    ReleaseAsked,
    /// The release owed begins.
    ReleaseBegins,
    /// The release committed.
    Released,
    /// The release did not commit.
    ReleaseFailed,
    /// A transaction failed before its commit was asked for; its abort is
    /// put off.
    AbortPutOff,
    /// The abort put off is being done now (how it ends is its own event).
    AbortTakenUp,
    /// A fatal error, or the transaction state is no longer known.
    Lost,
    /// A fresh producer, its transactions initialised, took the current
    /// one's place: whatever the coordinator held of the old one ended.
    Replaced,
}

/// Why a state may not begin a transaction now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotNow {
    /// The abort put off goes first.
    AbortFirst,
    /// The release owed goes first.
    ReleaseFirst,
    /// The producer is unusable: every call fails.
    Unusable,
}

impl State {
    /// The state of a producer that just initialised its transactions: with
    /// a release, it owes one for cause before anything else.
    pub(crate) fn connected(releases: bool) -> State {
        State::Idle {
            owed: if releases {
                Owed::ByTwin
            } else {
                Owed::Nothing
            },
        }
    }

    /// The state after `event`. `releases`: the producer has a release at
    /// all; without one, nothing about releases changes its state.
    ///
    /// The events that arrive from outside the transaction lock
    /// (`BrokersGone`, `ReleaseAsked`) are applied just before a release
    /// could begin, never while one commits: during a release they wait, and
    /// make the next one due.
    pub(crate) fn next(self, event: Event, releases: bool) -> State {
        use State::*;
        match event {
            Event::BrokersGone | Event::ReleaseAsked if !releases => self,
            Event::BrokersGone | Event::ReleaseAsked => match self {
                Releasing { .. } => self,
                _ => self.owing(self.owed().max(if event == Event::BrokersGone {
                    Owed::ByTwin
                } else {
                    Owed::InPlace
                })),
            },
            Event::ReleaseBegins => match self {
                Idle { owed } if owed != Owed::Nothing => Releasing {
                    by_twin: owed == Owed::ByTwin,
                },
                // Nothing owed, an abort first, unusable, already releasing.
                other => other,
            },
            Event::Released => match self {
                Releasing { .. } => Idle {
                    owed: Owed::Nothing,
                },
                other => other.owing(Owed::Nothing),
            },
            Event::ReleaseFailed => match self {
                Releasing { .. } => Idle { owed: Owed::ByTwin },
                other => other.owing(Owed::ByTwin),
            },
            Event::AbortPutOff => match self {
                Idle { owed } => AbortPutOff { owed },
                // A release never puts its abort off; were it to, the
                // release would stay owed.
                Releasing { .. } => AbortPutOff { owed: Owed::ByTwin },
                AbortPutOff { .. } | Unusable { .. } => self,
            },
            Event::AbortTakenUp => match self {
                AbortPutOff { owed } => Idle { owed },
                other => other,
            },
            Event::Lost => Unusable { owed: self.owed() },
            Event::Replaced => State::connected(releases),
        }
    }

    /// The release owed before the next transaction.
    pub(crate) fn owed(self) -> Owed {
        match self {
            State::Idle { owed } | State::AbortPutOff { owed } | State::Unusable { owed } => owed,
            State::Releasing { .. } => Owed::ByTwin,
        }
    }

    /// `self`, owing `owed` instead.
    fn owing(self, owed: Owed) -> State {
        match self {
            State::Idle { .. } => State::Idle { owed },
            State::AbortPutOff { .. } => State::AbortPutOff { owed },
            State::Unusable { .. } => State::Unusable { owed },
            releasing @ State::Releasing { .. } => releasing,
        }
    }

    /// Whether a transaction may begin: between transactions with nothing
    /// owed, or as the release that is committing.
    pub(crate) fn may_begin(self) -> Result<(), NotNow> {
        match self {
            State::Idle {
                owed: Owed::Nothing,
            }
            | State::Releasing { .. } => Ok(()),
            State::Idle { .. } => Err(NotNow::ReleaseFirst),
            State::AbortPutOff { .. } => Err(NotNow::AbortFirst),
            State::Unusable { .. } => Err(NotNow::Unusable),
        }
    }

    pub(crate) fn is_usable(self) -> bool {
        !matches!(self, State::Unusable { .. })
    }
}

/// How a transaction whose commit was never asked for ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Aborted now.
    AbortNow,
    /// Aborted by the next holder of the lock, once the callers have their
    /// answer ([`Event::AbortPutOff`]).
    PutOff,
    /// Not aborted: the producer is fatal, and its replacement's
    /// `init_transactions` ends the transaction.
    LeftToTheReplacement,
}

/// How to end a transaction that failed before its commit was asked for:
/// `fatal`, the error was a fatal one; `defer`, the caller answers others
/// and wants the abort after its answer.
pub(crate) fn ending(fatal: bool, defer: bool) -> Ending {
    match (fatal, defer) {
        (true, _) => Ending::LeftToTheReplacement,
        (false, true) => Ending::PutOff,
        (false, false) => Ending::AbortNow,
    }
}

/// What an abort that librdkafka refused leads to, given the fatal error
/// the client keeps (`kept`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterRefusedAbort {
    /// librdkafka made the abort's INVALID_TXN_STATE answer fatal
    /// (confluentinc/librdkafka#4849: an abort soon after the transaction
    /// began): nobody fenced the producer and nothing of the transaction was
    /// committed, so a fresh producer takes its place at once.
    RenewInPlace,
    /// Unusable: a fencing belongs to a newer instance (taking the id back
    /// would fence it in turn), anything else is a state nobody knows.
    Unusable,
}

pub(crate) fn after_refused_abort(
    state: State,
    kept: Option<RDKafkaErrorCode>,
) -> AfterRefusedAbort {
    if state.is_usable() && kept == Some(RDKafkaErrorCode::InvalidTransactionalState) {
        AfterRefusedAbort::RenewInPlace
    } else {
        AfterRefusedAbort::Unusable
    }
}

/// A failed commit as librdkafka describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CommitFailure {
    /// A transaction error (the flags below mean something).
    pub transactional: bool,
    pub retriable: bool,
    pub requires_abort: bool,
    pub fatal: bool,
}

impl CommitFailure {
    pub(crate) fn of(error: &KafkaError) -> CommitFailure {
        match error {
            KafkaError::Transaction(error) => CommitFailure {
                transactional: true,
                retriable: error.is_retriable(),
                requires_abort: error.txn_requires_abort(),
                fatal: error.is_fatal(),
            },
            _ => CommitFailure {
                transactional: false,
                retriable: false,
                requires_abort: false,
                fatal: false,
            },
        }
    }
}

/// What follows a failed commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterCommitFailure {
    /// Ask again: librdkafka resumes the same commit.
    Retry,
    /// librdkafka says the transaction must be aborted: nothing of it was
    /// committed.
    Aborted,
    /// Anything else (timeouts past the retries, a fatal error in the middle
    /// of it): the coordinator may have written the commit.
    OutcomeUnknown,
}

/// `attempt` of `attempts` failed with `failure`; `time_left`: the commit's
/// budget has not run out.
pub(crate) fn after_commit_failure(
    failure: CommitFailure,
    attempt: usize,
    attempts: usize,
    time_left: bool,
) -> AfterCommitFailure {
    if !failure.transactional {
        return AfterCommitFailure::OutcomeUnknown;
    }
    if failure.retriable && attempt < attempts && time_left {
        return AfterCommitFailure::Retry;
    }
    if failure.requires_abort && !failure.fatal {
        return AfterCommitFailure::Aborted;
    }
    AfterCommitFailure::OutcomeUnknown
}

/// Whether librdkafka's error makes the producer fatal.
pub(crate) fn is_fatal(error: &KafkaError) -> bool {
    match error {
        KafkaError::Transaction(transaction_error) => transaction_error.is_fatal(),
        other => other.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal),
    }
}

/// The error a fatal `error` is reported as. librdkafka hands a fatal error
/// to each call as its generic `_FATAL` code and keeps the error that made
/// the producer fatal (`kept`: `_FENCED` for a fencing, an authorization
/// refused...): that cause is what the caller gets, so that a fencing can
/// be told from the rest ([`crate::QueueError::is_fencing`]).
pub(crate) fn reported_cause(error: KafkaError, kept: Option<RDKafkaErrorCode>) -> KafkaError {
    match kept {
        Some(code) if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) => {
            KafkaError::MessageProduction(code)
        }
        _ => error,
    }
}

/// What a call on a producer already unusable answers: the cause the
/// client keeps, or the generic `_FATAL` when quire marked it unusable
/// itself (an abort that did not finish), which no fencing caused.
pub(crate) fn unusable_cause(kept: Option<RDKafkaErrorCode>) -> KafkaError {
    KafkaError::MessageProduction(kept.unwrap_or(RDKafkaErrorCode::Fatal))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_OWED: [Owed; 3] = [Owed::Nothing, Owed::InPlace, Owed::ByTwin];

    fn every_state() -> Vec<State> {
        let mut states = Vec::new();
        for owed in ALL_OWED {
            states.push(State::Idle { owed });
            states.push(State::AbortPutOff { owed });
            states.push(State::Unusable { owed });
        }
        states.push(State::Releasing { by_twin: false });
        states.push(State::Releasing { by_twin: true });
        states
    }

    const EVERY_EVENT: [Event; 9] = [
        Event::BrokersGone,
        Event::ReleaseAsked,
        Event::ReleaseBegins,
        Event::Released,
        Event::ReleaseFailed,
        Event::AbortPutOff,
        Event::AbortTakenUp,
        Event::Lost,
        Event::Replaced,
    ];

    #[test]
    fn a_producer_with_a_release_owes_one_by_a_twin_once_connected() {
        assert_eq!(State::connected(true), State::Idle { owed: Owed::ByTwin });
        assert_eq!(
            State::connected(false),
            State::Idle {
                owed: Owed::Nothing
            }
        );
        assert_eq!(
            State::connected(true).may_begin(),
            Err(NotNow::ReleaseFirst)
        );
        assert_eq!(State::connected(false).may_begin(), Ok(()));
    }

    #[test]
    fn only_an_idle_producer_owing_nothing_or_a_release_may_begin() {
        for state in every_state() {
            let expected = match state {
                State::Idle {
                    owed: Owed::Nothing,
                }
                | State::Releasing { .. } => Ok(()),
                State::Idle { .. } => Err(NotNow::ReleaseFirst),
                State::AbortPutOff { .. } => Err(NotNow::AbortFirst),
                State::Unusable { .. } => Err(NotNow::Unusable),
            };
            assert_eq!(state.may_begin(), expected, "{state:?}");
        }
    }

    #[test]
    fn brokers_gone_owe_a_release_by_a_twin_a_periodic_one_in_place() {
        let idle = State::Idle {
            owed: Owed::Nothing,
        };
        assert_eq!(
            idle.next(Event::BrokersGone, true),
            State::Idle { owed: Owed::ByTwin }
        );
        assert_eq!(
            idle.next(Event::ReleaseAsked, true),
            State::Idle {
                owed: Owed::InPlace
            }
        );
        // A release for cause is not lowered to a periodic one.
        assert_eq!(
            State::Idle { owed: Owed::ByTwin }.next(Event::ReleaseAsked, true),
            State::Idle { owed: Owed::ByTwin }
        );
        // An abort put off stays put off, and still owes the release after.
        assert_eq!(
            State::AbortPutOff {
                owed: Owed::Nothing
            }
            .next(Event::BrokersGone, true),
            State::AbortPutOff { owed: Owed::ByTwin }
        );
    }

    #[test]
    fn without_a_release_nothing_is_ever_owed() {
        for state in [
            State::Idle {
                owed: Owed::Nothing,
            },
            State::AbortPutOff {
                owed: Owed::Nothing,
            },
            State::Unusable {
                owed: Owed::Nothing,
            },
        ] {
            for event in [Event::BrokersGone, Event::ReleaseAsked] {
                assert_eq!(state.next(event, false), state, "{state:?} {event:?}");
            }
        }
        assert_eq!(
            State::Unusable {
                owed: Owed::Nothing
            }
            .next(Event::Replaced, false),
            State::Idle {
                owed: Owed::Nothing
            }
        );
    }

    #[test]
    fn a_release_owes_a_twin_until_it_commits() {
        let in_place = State::Idle {
            owed: Owed::InPlace,
        }
        .next(Event::ReleaseBegins, true);
        assert_eq!(in_place, State::Releasing { by_twin: false });
        assert_eq!(in_place.owed(), Owed::ByTwin);
        assert_eq!(
            in_place.next(Event::ReleaseFailed, true),
            State::Idle { owed: Owed::ByTwin }
        );
        assert_eq!(
            in_place.next(Event::Released, true),
            State::Idle {
                owed: Owed::Nothing
            }
        );
        assert_eq!(
            State::Idle { owed: Owed::ByTwin }.next(Event::ReleaseBegins, true),
            State::Releasing { by_twin: true }
        );
    }

    #[test]
    fn disconnections_during_a_release_wait_for_the_next() {
        let releasing = State::Releasing { by_twin: false };
        assert_eq!(releasing.next(Event::BrokersGone, true), releasing);
        assert_eq!(releasing.next(Event::ReleaseAsked, true), releasing);
    }

    #[test]
    fn a_release_begins_only_when_one_is_owed_and_nothing_comes_first() {
        for state in [
            State::Idle {
                owed: Owed::Nothing,
            },
            State::AbortPutOff { owed: Owed::ByTwin },
            State::Unusable { owed: Owed::ByTwin },
        ] {
            assert_eq!(state.next(Event::ReleaseBegins, true), state, "{state:?}");
        }
    }

    #[test]
    fn a_put_off_abort_is_taken_up_before_anything_else() {
        let failed = State::Idle {
            owed: Owed::Nothing,
        }
        .next(Event::AbortPutOff, true);
        assert_eq!(
            failed,
            State::AbortPutOff {
                owed: Owed::Nothing
            }
        );
        assert_eq!(failed.may_begin(), Err(NotNow::AbortFirst));
        assert_eq!(
            failed.next(Event::AbortTakenUp, true),
            State::Idle {
                owed: Owed::Nothing
            }
        );
    }

    #[test]
    fn a_lost_producer_is_unusable_until_replaced_and_keeps_what_it_owed() {
        for state in every_state() {
            let lost = state.next(Event::Lost, true);
            assert_eq!(lost, State::Unusable { owed: state.owed() }, "{state:?}");
            assert!(!lost.is_usable());
            // Nothing but a replacement makes it usable again.
            for event in EVERY_EVENT {
                let after = lost.next(event, true);
                assert_eq!(after.is_usable(), event == Event::Replaced, "{event:?}");
            }
        }
    }

    #[test]
    fn a_replaced_producer_starts_afresh_owing_a_release_by_a_twin() {
        for state in every_state() {
            assert_eq!(
                state.next(Event::Replaced, true),
                State::Idle { owed: Owed::ByTwin },
                "{state:?}"
            );
        }
    }

    #[test]
    fn a_release_by_a_twin_whose_twin_went_fatal_ends_usable_when_renewed() {
        // The twin's transaction hit a fatal error, the renewal replaced
        // it, and the release failed: usable, still owing a twin.
        let state = State::Idle { owed: Owed::ByTwin }
            .next(Event::ReleaseBegins, true)
            .next(Event::Lost, true)
            .next(Event::Replaced, true)
            .next(Event::ReleaseFailed, true);
        assert_eq!(state, State::Idle { owed: Owed::ByTwin });
        // The renewal failed, the release had committed: unusable, owing
        // nothing.
        let state = State::Idle { owed: Owed::ByTwin }
            .next(Event::ReleaseBegins, true)
            .next(Event::Lost, true)
            .next(Event::Released, true);
        assert_eq!(
            state,
            State::Unusable {
                owed: Owed::Nothing
            }
        );
    }

    #[test]
    fn every_transition_keeps_a_state_that_can_get_back_to_work() {
        // From any state, some sequence of events reaches one that may
        // begin a caller's transaction: nothing is a dead end but through
        // Replaced.
        for state in every_state() {
            let ready = state
                .next(Event::AbortTakenUp, true)
                .next(Event::ReleaseBegins, true)
                .next(Event::Released, true);
            let ready = if ready.is_usable() {
                ready
            } else {
                ready
                    .next(Event::Replaced, true)
                    .next(Event::ReleaseBegins, true)
                    .next(Event::Released, true)
            };
            assert_eq!(ready.may_begin(), Ok(()), "{state:?}");
        }
    }

    #[test]
    fn a_failed_transaction_is_aborted_now_later_or_by_the_replacement() {
        assert_eq!(ending(true, true), Ending::LeftToTheReplacement);
        assert_eq!(ending(true, false), Ending::LeftToTheReplacement);
        assert_eq!(ending(false, true), Ending::PutOff);
        assert_eq!(ending(false, false), Ending::AbortNow);
    }

    #[test]
    fn only_a_refused_abort_of_a_usable_producer_renews_it_in_place() {
        let usable = State::Idle {
            owed: Owed::Nothing,
        };
        assert_eq!(
            after_refused_abort(usable, Some(RDKafkaErrorCode::InvalidTransactionalState)),
            AfterRefusedAbort::RenewInPlace
        );
        for kept in [
            None,
            Some(RDKafkaErrorCode::Fenced),
            Some(RDKafkaErrorCode::ProducerFenced),
            Some(RDKafkaErrorCode::TopicAuthorizationFailed),
        ] {
            assert_eq!(
                after_refused_abort(usable, kept),
                AfterRefusedAbort::Unusable,
                "{kept:?}"
            );
        }
        assert_eq!(
            after_refused_abort(
                State::Unusable {
                    owed: Owed::Nothing
                },
                Some(RDKafkaErrorCode::InvalidTransactionalState)
            ),
            AfterRefusedAbort::Unusable
        );
    }

    #[test]
    fn a_commit_is_aborted_only_when_librdkafka_says_so() {
        let failure = |retriable, requires_abort, fatal| CommitFailure {
            transactional: true,
            retriable,
            requires_abort,
            fatal,
        };
        use AfterCommitFailure::*;
        assert_eq!(
            after_commit_failure(failure(true, false, false), 1, 3, true),
            Retry
        );
        // Out of attempts, or of time: the outcome is unknown.
        assert_eq!(
            after_commit_failure(failure(true, false, false), 3, 3, true),
            OutcomeUnknown
        );
        assert_eq!(
            after_commit_failure(failure(true, false, false), 1, 3, false),
            OutcomeUnknown
        );
        assert_eq!(
            after_commit_failure(failure(false, true, false), 1, 3, true),
            Aborted
        );
        // A fatal error in the middle of a commit proves nothing.
        assert_eq!(
            after_commit_failure(failure(false, true, true), 1, 3, true),
            OutcomeUnknown
        );
        assert_eq!(
            after_commit_failure(failure(false, false, true), 1, 3, true),
            OutcomeUnknown
        );
        let not_transactional = CommitFailure::of(&KafkaError::Canceled);
        assert_eq!(
            after_commit_failure(not_transactional, 1, 3, true),
            OutcomeUnknown
        );
    }

    #[test]
    fn a_fatal_error_is_reported_by_the_cause_the_client_keeps() {
        let generic = KafkaError::MessageProduction(RDKafkaErrorCode::Fatal);
        assert!(is_fatal(&generic));
        assert!(!is_fatal(&KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageTimedOut
        )));
        let fenced = reported_cause(generic.clone(), Some(RDKafkaErrorCode::Fenced));
        assert!(crate::is_fencing_error(&fenced));
        let refused = reported_cause(
            generic.clone(),
            Some(RDKafkaErrorCode::TransactionalIdAuthorizationFailed),
        );
        assert!(!crate::is_fencing_error(&refused));
        // No cause kept: the generic code stays.
        assert_eq!(
            reported_cause(generic.clone(), None).rdkafka_error_code(),
            Some(RDKafkaErrorCode::Fatal)
        );
        // An error that names its cause already keeps it.
        let epoch = KafkaError::MessageProduction(RDKafkaErrorCode::InvalidProducerEpoch);
        assert_eq!(
            reported_cause(epoch, Some(RDKafkaErrorCode::Fenced)).rdkafka_error_code(),
            Some(RDKafkaErrorCode::InvalidProducerEpoch)
        );
        // A producer quire marked unusable itself was fenced by nobody.
        assert!(!crate::is_fencing_error(&unusable_cause(None)));
        assert!(crate::is_fencing_error(&unusable_cause(Some(
            RDKafkaErrorCode::ProducerFenced
        ))));
    }
}
