//! What a document's rendered XML goes through on its way to the writer:
//! nothing, or a compressor (`quire_xml::compress`, gzip or Zstandard)
//! whose memory is counted in the worker's pool while it lives (it cannot
//! spill, so other documents' bytes do).

use std::sync::Arc;

use quire_messages::Definition;
use quire_messages::compression::Compression;
use quire_s3::{MemoryPool, MultipartWriter};
use quire_xml::compress::{Compressor, state_bytes};

use crate::WorkerError;

/// Between the renderer and the writer: plain, or compressed.
pub(super) enum Encoding {
    Plain,
    Compressed(CompressedStage),
}

/// A compressor writing into a buffer that is handed to the writer as soon
/// as it emits anything (a block at a time).
pub(super) struct CompressedStage {
    compression: Compression,
    compressor: Compressor,
    /// The compressor's memory, in the pool's count while the stage lives.
    _counted: CountedMemory,
}

/// Memory counted in a pool for as long as this lives.
struct CountedMemory {
    pool: Arc<MemoryPool>,
    bytes: u64,
}

impl CountedMemory {
    fn new(pool: Arc<MemoryPool>, bytes: u64) -> Self {
        pool.force_reserve_buffer(bytes);
        CountedMemory { pool, bytes }
    }
}

impl Drop for CountedMemory {
    fn drop(&mut self) {
        self.pool.release_buffer(self.bytes);
    }
}

impl Encoding {
    /// The encoding of a document of `definition`, at its start.
    pub(super) fn for_definition(
        definition: &Definition,
        pool: &Arc<MemoryPool>,
        key: &str,
    ) -> Result<Self, WorkerError> {
        let Some(compression) = definition.compression() else {
            return Ok(Encoding::Plain);
        };
        let compressor =
            Compressor::new(compression).map_err(|error| compression_failed(key, &error))?;
        Ok(Encoding::Compressed(CompressedStage {
            compression,
            compressor,
            _counted: CountedMemory::new(pool.clone(), state_bytes(compression)),
        }))
    }

    /// Memory the compressor holds (none for plain XML).
    pub(super) fn held_bytes(&self) -> u64 {
        match self {
            Encoding::Plain => 0,
            Encoding::Compressed(stage) => state_bytes(stage.compression),
        }
    }

    pub(super) fn is_compressed(&self) -> bool {
        matches!(self, Encoding::Compressed(_))
    }

    /// Appends rendered XML to the writer, through the encoding.
    pub(super) async fn write(
        &mut self,
        writer: &mut MultipartWriter,
        xml: &[u8],
    ) -> Result<(), WorkerError> {
        match self {
            Encoding::Plain => writer.append(xml).await?,
            Encoding::Compressed(stage) => {
                let compressed = stage
                    .compressor
                    .compress(xml)
                    .map_err(|error| compression_failed(writer.key(), &error))?;
                if !compressed.is_empty() {
                    writer.append(compressed).await?;
                }
            }
        }
        Ok(())
    }

    /// Ends the document: appends the compressor's last bytes and returns
    /// the head (`head`, written last before the first part) as it is
    /// stored, and the XML bytes the document holds under compression.
    pub(super) async fn finish(
        self,
        writer: &mut MultipartWriter,
        head: Vec<u8>,
    ) -> Result<(Vec<u8>, Option<u64>), WorkerError> {
        let head_xml = head.len() as u64;
        match self {
            Encoding::Plain => Ok((head, None)),
            Encoding::Compressed(stage) => {
                let (trailer, uncompressed) = stage
                    .compressor
                    .finish()
                    .map_err(|error| compression_failed(writer.key(), &error))?;
                writer.append(&trailer).await?;
                let head = if head.is_empty() {
                    head
                } else {
                    // Its own member or frame, ahead of the records' one:
                    // readers of either format read them one after the
                    // other as one text.
                    Compressor::whole(stage.compression, &head)
                        .map_err(|error| compression_failed(writer.key(), &error))?
                };
                Ok((head, Some(uncompressed + head_xml)))
            }
        }
    }
}

/// Compressing into memory does not fail in practice (the sink is a Vec);
/// should it, the document is abandoned like one whose upload failed.
fn compression_failed(key: &str, error: &std::io::Error) -> WorkerError {
    WorkerError::S3(format!("compression of {key} failed: {error}"))
}
