// Health check and topic set-up for the local stack (deploy/local/stack).
//
// Run as a single-file program against the broker's own jars:
//   java -cp '<kafka-libs>/*' StackCheck.java <bootstrap> <timeout-seconds> [topic-spec ...]
// topic-spec: name:partitions[:key=value[,key=value...]]
//
// It (1) waits until the cluster answers, (2) creates the given topics unless
// they exist, and (3) proves the broker really works for quire's semantics: a
// transactional produce, commit, and a read_committed consume of the same
// message (this exercises the transaction coordinator and its internal topic,
// which a plain "port is open" check would not). Exit 0 on success, 1 with one
// clear line on stderr otherwise. The whole run is bounded by the timeout.

import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Properties;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.AlterConfigOp;
import org.apache.kafka.clients.admin.ConfigEntry;
import org.apache.kafka.common.config.ConfigResource;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.TopicExistsException;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

public class StackCheck {
    static final String CHECK_TOPIC = "quire.stack-check";
    static final Duration CLOSE_TIMEOUT = Duration.ofSeconds(2);

    record TopicSpec(String name, int partitions, Map<String, String> configs) {
        static TopicSpec parse(String spec) {
            String[] parts = spec.split(":", 3);
            if (parts.length < 2) {
                throw new IllegalArgumentException("bad topic spec '" + spec + "' (want name:partitions[:k=v,...])");
            }
            Map<String, String> configs = new HashMap<>();
            if (parts.length == 3 && !parts[2].isEmpty()) {
                for (String kv : parts[2].split(",")) {
                    String[] pair = kv.split("=", 2);
                    if (pair.length != 2) {
                        throw new IllegalArgumentException("bad topic config '" + kv + "' in '" + spec + "'");
                    }
                    configs.put(pair[0], pair[1]);
                }
            }
            return new TopicSpec(parts[0], Integer.parseInt(parts[1]), configs);
        }
    }

    public static void main(String[] args) {
        if (args.length < 2) {
            System.err.println("usage: StackCheck <bootstrap> <timeout-seconds> [name:partitions[:k=v,...] ...]");
            System.exit(2);
        }
        String bootstrap = args[0];
        long timeoutSeconds = Long.parseLong(args[1]);
        long deadlineNanos = System.nanoTime() + TimeUnit.SECONDS.toNanos(timeoutSeconds);

        // A hard bound whatever a client call does (metadata waits can block).
        Thread watchdog = new Thread(() -> {
            try {
                Thread.sleep(TimeUnit.SECONDS.toMillis(timeoutSeconds) + 5_000);
            } catch (InterruptedException e) {
                return;
            }
            System.err.println("stack-check: FAILED: no answer within " + timeoutSeconds + " s from Kafka at " + bootstrap);
            Runtime.getRuntime().halt(1);
        });
        watchdog.setDaemon(true);
        watchdog.start();

        try {
            List<TopicSpec> topics = new ArrayList<>();
            for (int i = 2; i < args.length; i++) {
                topics.add(TopicSpec.parse(args[i]));
            }
            topics.add(new TopicSpec(CHECK_TOPIC, 1, Map.of("retention.ms", "3600000")));

            // Clients are closed with a short bound: a plain close() waits for
            // pending requests without limit when the broker is gone.
            Admin admin = Admin.create(adminProps(bootstrap));
            try {
                waitForCluster(admin, bootstrap, deadlineNanos);
                ensureTopics(admin, topics);
            } finally {
                admin.close(CLOSE_TIMEOUT);
            }
            transactionalRoundTrip(bootstrap, deadlineNanos);
            System.exit(0);
        } catch (Exception e) {
            Throwable cause = e instanceof ExecutionException && e.getCause() != null ? e.getCause() : e;
            System.err.println("stack-check: FAILED: " + cause.getClass().getSimpleName() + ": " + cause.getMessage());
            System.exit(1);
        }
    }

    static Properties adminProps(String bootstrap) {
        Properties props = new Properties();
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "5000");
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "10000");
        return props;
    }

    static long remainingMillis(long deadlineNanos) {
        return Math.max(0, TimeUnit.NANOSECONDS.toMillis(deadlineNanos - System.nanoTime()));
    }

    /** A freshly started broker accepts connections before it has a controller; retry until it answers. */
    static void waitForCluster(Admin admin, String bootstrap, long deadlineNanos) throws Exception {
        Exception last = null;
        while (remainingMillis(deadlineNanos) > 0) {
            try {
                int brokers = admin.describeCluster().nodes().get(5, TimeUnit.SECONDS).size();
                if (brokers > 0) {
                    return;
                }
            } catch (Exception e) {
                last = e;
            }
            Thread.sleep(500);
        }
        throw new IllegalStateException("cluster at " + bootstrap + " did not answer" + (last == null ? "" : ": " + last));
    }

    static void ensureTopics(Admin admin, List<TopicSpec> topics) throws Exception {
        for (TopicSpec topic : topics) {
            NewTopic newTopic = new NewTopic(topic.name(), Optional.of(topic.partitions()), Optional.of((short) 1))
                    .configs(topic.configs());
            try {
                admin.createTopics(List.of(newTopic)).all().get();
                System.out.println("stack-check: topic " + topic.name() + " created (" + topic.partitions() + " partitions)");
            } catch (ExecutionException e) {
                if (!(e.getCause() instanceof TopicExistsException)) {
                    throw e;
                }
                // Existing topics keep their partition count (changing it would move
                // streams) and their retention (the operator's); their compaction
                // bounds are brought to the spec's, so a stack made by an earlier
                // release gets the bounds the services now check.
                List<AlterConfigOp> ops = new ArrayList<>();
                for (Map.Entry<String, String> entry : topic.configs().entrySet()) {
                    String key = entry.getKey();
                    if (key.startsWith("segment.") || key.contains("compaction") || key.contains("cleanable")) {
                        ops.add(new AlterConfigOp(new ConfigEntry(key, entry.getValue()), AlterConfigOp.OpType.SET));
                    }
                }
                if (!ops.isEmpty()) {
                    admin.incrementalAlterConfigs(Map.of(new ConfigResource(ConfigResource.Type.TOPIC, topic.name()), ops)).all().get();
                    System.out.println("stack-check: topic " + topic.name() + " compaction settings brought up to date");
                }
                TopicDescription description = admin.describeTopics(Set.of(topic.name())).allTopicNames().get().get(topic.name());
                int actual = description.partitions().size();
                if (actual != topic.partitions()) {
                    System.out.println("stack-check: WARNING topic " + topic.name() + " exists with " + actual
                            + " partitions, expected " + topic.partitions() + " (left unchanged)");
                }
            }
        }
    }

    /** Produce one message in a transaction, commit, and read it back with read_committed. */
    // KafkaConsumer.close(Duration) is deprecated since 4.1 for close(CloseOptions), which 4.0 lacks.
    @SuppressWarnings("deprecation")
    static void transactionalRoundTrip(String bootstrap, long deadlineNanos) throws Exception {
        String runId = UUID.randomUUID().toString();
        Properties producerProps = new Properties();
        producerProps.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        producerProps.put(ProducerConfig.TRANSACTIONAL_ID_CONFIG, "quire-stack-check-" + runId);
        producerProps.put(ProducerConfig.TRANSACTION_TIMEOUT_CONFIG, "10000");
        producerProps.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, String.valueOf(Math.max(1000, remainingMillis(deadlineNanos))));
        producerProps.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        producerProps.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());

        RecordMetadata written;
        KafkaProducer<String, String> producer = new KafkaProducer<>(producerProps);
        try {
            producer.initTransactions();
            producer.beginTransaction();
            written = producer.send(new ProducerRecord<>(CHECK_TOPIC, 0, "stack-check", runId)).get();
            producer.commitTransaction();
        } finally {
            producer.close(CLOSE_TIMEOUT);
        }

        Properties consumerProps = new Properties();
        consumerProps.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        consumerProps.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        consumerProps.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        consumerProps.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
        consumerProps.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
        TopicPartition partition = new TopicPartition(CHECK_TOPIC, written.partition());
        // assign + seek, no group: the check must not leave consumer groups behind.
        KafkaConsumer<String, String> consumer = new KafkaConsumer<>(consumerProps);
        try {
            consumer.assign(List.of(partition));
            consumer.seek(partition, written.offset());
            while (remainingMillis(deadlineNanos) > 0) {
                for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(500))) {
                    if (record.offset() == written.offset()) {
                        if (!runId.equals(record.value())) {
                            throw new IllegalStateException("read back '" + record.value() + "', wrote '" + runId + "'");
                        }
                        System.out.println("stack-check: transactional produce + read_committed consume OK ("
                                + CHECK_TOPIC + " offset " + written.offset() + ")");
                        return;
                    }
                }
            }
        } finally {
            consumer.close(CLOSE_TIMEOUT);
        }
        throw new IllegalStateException("committed message at " + partition + "@" + written.offset()
                + " not readable with read_committed before the deadline");
    }
}
