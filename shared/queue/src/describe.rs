//! What Kafka says a topic *is*: its topic id and its live partition count,
//! and the partition a key lands on.
//!
//! A topic's id is the identity Kafka gives it at creation; a topic deleted
//! and created again under the same name has another id. quire carries it in
//! its watermarks and report ids, so that a recreated log is a new log,
//! never an old one. rust-rdkafka wraps neither librdkafka's DescribeTopics
//! nor its murmur2 partitioner, so both are called here, through the
//! bindings rdkafka re-exports, and nowhere else.

use std::ffi::{CStr, CString};
use std::time::Duration;

use quire_config::KafkaSettings;
use rdkafka::bindings as rd;

use crate::QueueError;

/// A topic as Kafka describes it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicIdentity {
    pub name: String,
    /// Kafka's topic id (base64, as Kafka's own tools print it).
    pub id: String,
    /// The live partition count.
    pub partitions: i32,
}

/// The partition Kafka's default partitioner (Java's, and librdkafka's
/// `murmur2_random` for keyed messages) gives `key` among `partitions`:
/// `(murmur2(key) & 0x7fffffff) % partitions`, computed by librdkafka
/// itself so that quire's explicit routing is byte for byte the mapping
/// every record written before it followed.
pub fn partition_for_key(key: &[u8], partitions: i32) -> i32 {
    assert!(partitions > 0, "a topic has at least one partition");
    // SAFETY: rd_kafka_msg_partitioner_murmur2 reads `keylen` bytes of
    // `key` and ignores its topic and opaque arguments (it only hashes).
    unsafe {
        rd::rd_kafka_msg_partitioner_murmur2(
            std::ptr::null(),
            key.as_ptr().cast(),
            key.len(),
            partitions,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }
}

/// Describes `topic` (DescribeTopics): its id and partition count. Blocks
/// up to `kafka.request_timeout_ms`: call it on the blocking pool.
pub fn describe_topic_blocking(
    settings: &KafkaSettings,
    topic: &str,
) -> Result<TopicIdentity, QueueError> {
    let admin = crate::admin::admin_client(settings)?;
    let timeout = settings.request_timeout.max(Duration::from_millis(1));
    describe_with(admin.inner().native_ptr(), topic, timeout)
}

/// [`describe_topic_blocking`] on tokio's blocking pool.
pub async fn describe_topic(
    settings: &KafkaSettings,
    topic: &str,
) -> Result<TopicIdentity, QueueError> {
    let (settings, topic) = (settings.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || describe_topic_blocking(&settings, &topic)).await?
}

/// Frees what librdkafka allocated for one DescribeTopics call, whatever
/// path the call leaves by.
struct Owned {
    queue: *mut rd::rd_kafka_queue_t,
    topics: *mut rd::rd_kafka_TopicCollection_t,
    options: *mut rd::rd_kafka_AdminOptions_t,
    event: *mut rd::rd_kafka_event_t,
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: each pointer is null or was returned by the matching
        // librdkafka constructor and is destroyed exactly once, here.
        unsafe {
            if !self.event.is_null() {
                rd::rd_kafka_event_destroy(self.event);
            }
            if !self.options.is_null() {
                rd::rd_kafka_AdminOptions_destroy(self.options);
            }
            if !self.topics.is_null() {
                rd::rd_kafka_TopicCollection_destroy(self.topics);
            }
            if !self.queue.is_null() {
                rd::rd_kafka_queue_destroy(self.queue);
            }
        }
    }
}

fn describe_with(
    client: *mut rd::rd_kafka_t,
    topic: &str,
    timeout: Duration,
) -> Result<TopicIdentity, QueueError> {
    let admin = |what: String| QueueError::Admin(format!("describing topic {topic}: {what}"));
    let name = CString::new(topic).map_err(|_| admin("the name holds a NUL byte".into()))?;
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: `client` is a live rd_kafka_t owned by the caller for the
    // whole call; every object created here is owned by `owned` and freed
    // by its Drop; strings read from the result are copied before the
    // event (which owns them) is destroyed.
    unsafe {
        let mut owned = Owned {
            queue: rd::rd_kafka_queue_new(client),
            topics: std::ptr::null_mut(),
            options: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
        };
        let mut names = [name.as_ptr()];
        owned.topics = rd::rd_kafka_TopicCollection_of_topic_names(names.as_mut_ptr(), 1);
        owned.options = rd::rd_kafka_AdminOptions_new(
            client,
            rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS,
        );
        let mut error_text = [0 as std::ffi::c_char; 256];
        let set = rd::rd_kafka_AdminOptions_set_request_timeout(
            owned.options,
            timeout_ms,
            error_text.as_mut_ptr(),
            error_text.len(),
        );
        if set != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(admin(
                CStr::from_ptr(error_text.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
            ));
        }
        rd::rd_kafka_DescribeTopics(client, owned.topics, owned.options, owned.queue);
        // The request's own timeout answers first; the poll's margin only
        // keeps a lost answer from blocking forever.
        owned.event = rd::rd_kafka_queue_poll(owned.queue, timeout_ms.saturating_add(1000));
        if owned.event.is_null() {
            return Err(admin(format!("no answer within {} ms", timeout_ms)));
        }
        let code = rd::rd_kafka_event_error(owned.event);
        if code != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            let text = rd::rd_kafka_event_error_string(owned.event);
            let text = if text.is_null() {
                format!("{code:?}")
            } else {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            };
            return Err(admin(text));
        }
        let result = rd::rd_kafka_event_DescribeTopics_result(owned.event);
        if result.is_null() {
            return Err(admin("the answer is not a DescribeTopics result".into()));
        }
        let mut count = 0usize;
        let described = rd::rd_kafka_DescribeTopics_result_topics(result, &mut count);
        for index in 0..count {
            let description = *described.add(index);
            let found = CStr::from_ptr(rd::rd_kafka_TopicDescription_name(description))
                .to_string_lossy()
                .into_owned();
            if found != topic {
                continue;
            }
            let error = rd::rd_kafka_TopicDescription_error(description);
            if !error.is_null()
                && rd::rd_kafka_error_code(error)
                    != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
            {
                let text = CStr::from_ptr(rd::rd_kafka_error_string(error))
                    .to_string_lossy()
                    .into_owned();
                return Err(QueueError::TopicMismatch(format!(
                    "topic {topic} cannot be described: {text}"
                )));
            }
            let id = rd::rd_kafka_TopicDescription_topic_id(description);
            if id.is_null() {
                return Err(admin("the broker gave no topic id".into()));
            }
            let id = CStr::from_ptr(rd::rd_kafka_Uuid_base64str(id))
                .to_string_lossy()
                .into_owned();
            let mut partitions = 0usize;
            rd::rd_kafka_TopicDescription_partitions(description, &mut partitions);
            return Ok(TopicIdentity {
                name: found,
                id,
                partitions: i32::try_from(partitions).unwrap_or(i32::MAX),
            });
        }
        Err(admin("the answer does not name it".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kafka's own test vectors (`UtilsTest.testMurmur2`), through the
    /// positive mask: what Java producers, librdkafka and quire agree on.
    #[test]
    fn keys_land_where_kafkas_default_partitioner_puts_them() {
        let java = |hash: i32, partitions: i32| (hash & 0x7fff_ffff) % partitions;
        for (key, hash) in [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ] {
            for partitions in [1, 12, 16, 1000] {
                assert_eq!(
                    partition_for_key(key.as_bytes(), partitions),
                    java(hash, partitions),
                    "{key} among {partitions}"
                );
            }
        }
    }
}
