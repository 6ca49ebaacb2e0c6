//! A growth of the partition layout, as the worker sees it in the log (see
//! `quire_log::grow`): a move marker on an old partition, and a handover
//! on a new one. Both are decided by the log like every cut: a replay from
//! any committed point moves the same streams at the same marker and hands
//! each over once (the stream's watermark passes the marker in the
//! transaction that publishes its handover).

use quire_messages::{
    Definition, Handover, PartitionMove, PartitionMoved, StreamName, Trigger, records,
};
use quire_queue::InMessage;

use super::{Context, Outbox, complete_document, dead_letter, on_topic};
use crate::WorkerError;
use crate::partition::PartitionState;

/// A move marker on `state`'s partition: every stream that lives here under
/// the old count and elsewhere under the new one ends its open document at
/// the marker (trigger `move`) and is handed over, with its definition and
/// window progress, to its new partition. Streams this partition keeps
/// state of from an earlier layout (they live elsewhere now) are not its to
/// move, and a stream already moved by this marker (a replay) is skipped.
pub(super) async fn partition_move(
    context: &Context,
    state: &mut PartitionState,
    message: &InMessage,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    let payload = message.payload.as_deref().unwrap_or_default();
    let marker = match quire_messages::decode::<PartitionMove>("move marker", payload) {
        Ok(marker) if marker.from > 0 && marker.to > marker.from => marker,
        Ok(marker) => {
            return dead_letter(
                context,
                message,
                &format!(
                    "move marker from {} to {} partitions",
                    marker.from, marker.to
                ),
                outbox,
            );
        }
        Err(error) => {
            return dead_letter(
                context,
                message,
                &format!("invalid move marker: {error}"),
                outbox,
            );
        }
    };
    let partition = state.partition;
    let mut streams: Vec<StreamName> = state
        .streams
        .keys()
        .chain(state.open.keys())
        .cloned()
        .collect();
    streams.sort();
    streams.dedup();
    let mut moved = 0usize;
    for stream in streams {
        if quire_log::partition_of(&stream, marker.from) != partition {
            continue;
        }
        let target = quire_log::partition_of(&stream, marker.to);
        if target == partition || state.already_reported(&stream, message.offset) {
            continue;
        }
        if let Some(document) = state.open.remove(&stream) {
            complete_document(
                context,
                state,
                document,
                message.offset,
                message.timestamp_ms,
                Trigger::Move,
                outbox,
            )
            .await?;
        }
        let stream_state = state.stream(&stream);
        let handover = Handover {
            v: quire_messages::CURRENT_VERSION,
            from_partition: partition,
            from_offset: message.offset,
            definition: Some(stream_state.definition.clone()),
            window: stream_state
                .window
                .as_ref()
                .map(|window| window.progress.clone()),
        };
        outbox.messages.push(on_topic(
            &context.topics.records,
            records::handover(&stream, target, &handover),
        ));
        state.moved_away(&stream, message.offset);
        moved += 1;
        tracing::info!(%stream, from = partition, to = target, offset = message.offset, "stream moved to its partition in the grown layout");
    }
    state.record_moved(PartitionMoved {
        v: quire_messages::CURRENT_VERSION,
        to: marker.to,
        offset: message.offset,
    });
    outbox.moves += 1;
    tracing::info!(
        partition,
        offset = message.offset,
        from = marker.from,
        to = marker.to,
        streams = moved,
        "move marker processed"
    );
    Ok(())
}

/// A stream arriving on its new partition: its definition and window
/// progress apply from here, and its watermark passes the handover so a
/// replay applies it once.
pub(super) fn handover(
    context: &Context,
    state: &mut PartitionState,
    stream: &StreamName,
    message: &InMessage,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    if state.already_reported(stream, message.offset) {
        return Ok(());
    }
    let payload = message.payload.as_deref().unwrap_or_default();
    let arrived = match quire_messages::decode::<Handover>("handover", payload) {
        Ok(arrived) => arrived,
        Err(error) => {
            return dead_letter(
                context,
                message,
                &format!("invalid handover: {error}"),
                outbox,
            );
        }
    };
    if let Some(definition) = arrived.definition {
        if let Err(error) = Definition::validate(&definition) {
            return dead_letter(
                context,
                message,
                &format!("handover with an invalid definition: {error}"),
                outbox,
            );
        }
        state.change_definition(stream, message.offset, definition);
    }
    state.arrived(stream, message.offset, arrived.window);
    tracing::info!(%stream, partition = state.partition, from = arrived.from_partition, offset = message.offset, "stream arrived from its partition in the earlier layout");
    Ok(())
}
