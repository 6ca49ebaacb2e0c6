//! A growth of the partition layout, as a partition's pipeline sees it in
//! the log (see `quire_log::grow`): a move marker on an old partition, and a
//! handover on a new one. Both are decided by the log like every cut: a
//! replay from any committed point moves the same streams at the same
//! marker and hands each over once (the stream's watermark passes the
//! marker in the transaction that publishes its handover).

use quire_messages::{Handover, PartitionMove, PartitionMoved, StreamName, Trigger, records};
use quire_queue::InMessage;

use super::{Context, DocumentStore, PartitionPipeline};
use crate::WorkerError;
use crate::worker::outbox::{Outbox, on_topic};

impl<S: DocumentStore> PartitionPipeline<S> {
    /// A move marker on this partition: every stream that lives here under
    /// the old count and elsewhere under the new one ends its open document
    /// at the marker (trigger `move`) and is handed over, with its
    /// definition and window progress, to its new partition. Streams this
    /// partition keeps state of from an earlier layout (they live elsewhere
    /// now) are not its to move, and a stream already moved by this marker
    /// (a replay) is skipped.
    pub(super) async fn partition_move(
        &mut self,
        context: &Context<S>,
        message: &InMessage,
        marker: PartitionMove,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let partition = self.state.partition;
        let mut streams: Vec<StreamName> = self
            .state
            .streams
            .keys()
            .chain(self.open.by_stream.keys())
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
            if target == partition || self.state.already_reported(&stream, message.offset) {
                continue;
            }
            if let Some(document) = self.open.remove(&stream) {
                self.complete(
                    context,
                    document,
                    message.offset,
                    message.timestamp_ms,
                    Trigger::Move,
                    outbox,
                )
                .await?;
            }
            let stream_state = self.state.stream(&stream);
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
            self.state.moved_away(&stream, message.offset);
            moved += 1;
            tracing::info!(%stream, from = partition, to = target, offset = message.offset, "stream moved to its partition in the grown layout");
        }
        self.state.record_moved(PartitionMoved {
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
    /// replay applies it once (`decide` skips it below the watermark).
    pub(super) fn handover(&mut self, stream: &StreamName, message: &InMessage, arrived: Handover) {
        if let Some(definition) = arrived.definition {
            self.state
                .change_definition(stream, message.offset, definition);
        }
        let open_first_offset = self.open.first_offset(stream);
        self.state
            .arrived(stream, message.offset, arrived.window, open_first_offset);
        tracing::info!(%stream, partition = self.state.partition, from = arrived.from_partition, offset = message.offset, "stream arrived from its partition in the earlier layout");
    }
}
