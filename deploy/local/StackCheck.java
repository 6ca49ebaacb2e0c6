// Health check and topic set-up for the local stack (deploy/local/stack).
//
// Run as a single-file program against the broker's own jars:
//   java -cp '<kafka-libs>/*' StackCheck.java [--replicas N] <bootstrap> <timeout-seconds> [topic-spec ...]
// topic-spec: name:partitions[:key=value[,key=value...]]
// --replicas N: the cluster has N brokers and every topic N replicas (default 1).
//
// It (1) waits until the cluster answers with N registered brokers, (2)
// creates the given topics unless they exist, with N replicas, and waits until
// every partition has a leader and all N replicas in sync, and (3) proves the
// broker really works for quire's semantics: a transactional produce, commit,
// and a read_committed consume of the same message (this exercises the
// transaction coordinator and its internal topic, which a plain "port is open"
// check would not); then the internal topics that exist must be fully in sync
// too. Exit 0 on success, 1 with one clear line on stderr otherwise. The whole
// run is bounded by the timeout.

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
import org.apache.kafka.clients.admin.ListTopicsOptions;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.Node;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.TopicPartitionInfo;
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

    public static void main(String[] argv) {
        List<String> args = new ArrayList<>(List.of(argv));
        int replicas = 1;
        if (args.size() >= 2 && args.get(0).equals("--replicas")) {
            replicas = Integer.parseInt(args.get(1));
            args.subList(0, 2).clear();
        }
        if (args.size() < 2 || replicas < 1) {
            System.err.println("usage: StackCheck [--replicas N] <bootstrap> <timeout-seconds> [name:partitions[:k=v,...] ...]");
            System.exit(2);
        }
        String bootstrap = args.get(0);
        long timeoutSeconds = Long.parseLong(args.get(1));
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
            for (int i = 2; i < args.size(); i++) {
                topics.add(TopicSpec.parse(args.get(i)));
            }
            topics.add(new TopicSpec(CHECK_TOPIC, 1, Map.of("retention.ms", "3600000")));

            // Clients are closed with a short bound: a plain close() waits for
            // pending requests without limit when the broker is gone.
            Admin admin = Admin.create(adminProps(bootstrap));
            try {
                waitForCluster(admin, bootstrap, replicas, deadlineNanos);
                ensureTopics(admin, topics, replicas);
                List<String> names = topics.stream().map(TopicSpec::name).toList();
                waitForReplicas(admin, names, replicas, deadlineNanos);
                transactionalRoundTrip(bootstrap, deadlineNanos);
                // The round trip made the transaction coordinator create
                // __transaction_state; a crash must not leave it on one copy either.
                List<String> internal = admin.listTopics(new ListTopicsOptions().listInternal(true)).names().get()
                        .stream().filter(name -> name.startsWith("__")).sorted().toList();
                waitForReplicas(admin, internal, replicas, deadlineNanos);
            } finally {
                admin.close(CLOSE_TIMEOUT);
            }
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

    /**
     * A freshly started broker accepts connections before it has a controller; retry until it
     * answers and at least {@code brokers} brokers are registered (a topic with N replicas
     * cannot be created on fewer).
     */
    static void waitForCluster(Admin admin, String bootstrap, int brokers, long deadlineNanos) throws Exception {
        Exception last = null;
        int seen = 0;
        while (remainingMillis(deadlineNanos) > 0) {
            try {
                seen = admin.describeCluster().nodes().get(5, TimeUnit.SECONDS).size();
                if (seen >= brokers) {
                    if (brokers > 1) {
                        System.out.println("stack-check: " + seen + " brokers registered");
                    }
                    return;
                }
            } catch (Exception e) {
                last = e;
            }
            Thread.sleep(500);
        }
        if (seen > 0) {
            throw new IllegalStateException("cluster at " + bootstrap + " has " + seen + " of " + brokers + " brokers registered");
        }
        throw new IllegalStateException("cluster at " + bootstrap + " did not answer" + (last == null ? "" : ": " + last));
    }

    /** Waits until every partition of the topics has a leader and an ISR of {@code replicas}. */
    static void waitForReplicas(Admin admin, List<String> names, int replicas, long deadlineNanos) throws Exception {
        if (names.isEmpty()) {
            return;
        }
        List<String> lagging = List.of();
        while (remainingMillis(deadlineNanos) > 0) {
            lagging = new ArrayList<>();
            int partitions = 0;
            try {
                Map<String, TopicDescription> described = admin.describeTopics(names).allTopicNames().get(5, TimeUnit.SECONDS);
                for (TopicDescription description : described.values()) {
                    for (TopicPartitionInfo info : description.partitions()) {
                        partitions++;
                        Node leader = info.leader();
                        if (leader == null || leader.isEmpty() || info.isr().size() < replicas) {
                            lagging.add(description.name() + "-" + info.partition() + " (leader "
                                    + (leader == null || leader.isEmpty() ? "none" : leader.id()) + ", isr " + info.isr().size() + ")");
                        }
                    }
                }
                if (lagging.isEmpty()) {
                    if (replicas > 1) {
                        System.out.println("stack-check: " + names.size() + " topics, " + partitions
                                + " partitions: each has a leader and " + replicas + " replicas in sync (" + String.join(", ", names) + ")");
                    }
                    return;
                }
            } catch (Exception e) {
                lagging = List.of(e.toString());
            }
            Thread.sleep(500);
        }
        throw new IllegalStateException("partitions without a leader or with fewer than " + replicas + " replicas in sync: "
                + String.join(", ", lagging.subList(0, Math.min(6, lagging.size()))) + (lagging.size() > 6 ? ", ..." : ""));
    }

    static void ensureTopics(Admin admin, List<TopicSpec> topics, int replicas) throws Exception {
        for (TopicSpec topic : topics) {
            NewTopic newTopic = new NewTopic(topic.name(), Optional.of(topic.partitions()), Optional.of((short) replicas))
                    .configs(topic.configs());
            try {
                admin.createTopics(List.of(newTopic)).all().get();
                System.out.println("stack-check: topic " + topic.name() + " created (" + topic.partitions() + " partitions"
                        + (replicas > 1 ? ", " + replicas + " replicas" : "") + ")");
            } catch (ExecutionException e) {
                if (!(e.getCause() instanceof TopicExistsException)) {
                    throw e;
                }
                // Existing topics keep their partition count (changing it would move
                // streams) and their retention (the operator's); their compaction
                // bounds and timestamp type are brought to the spec's, so a stack
                // made by an earlier release gets what the services now check.
                List<AlterConfigOp> ops = new ArrayList<>();
                for (Map.Entry<String, String> entry : topic.configs().entrySet()) {
                    String key = entry.getKey();
                    if (key.startsWith("segment.") || key.contains("compaction") || key.contains("cleanable")
                            || key.equals("message.timestamp.type")) {
                        ops.add(new AlterConfigOp(new ConfigEntry(key, entry.getValue()), AlterConfigOp.OpType.SET));
                    }
                }
                if (!ops.isEmpty()) {
                    admin.incrementalAlterConfigs(Map.of(new ConfigResource(ConfigResource.Type.TOPIC, topic.name()), ops)).all().get();
                    System.out.println("stack-check: topic " + topic.name() + " settings the services check brought up to date");
                }
                TopicDescription description = admin.describeTopics(Set.of(topic.name())).allTopicNames().get().get(topic.name());
                int actual = description.partitions().size();
                if (actual != topic.partitions()) {
                    System.out.println("stack-check: WARNING topic " + topic.name() + " exists with " + actual
                            + " partitions, expected " + topic.partitions() + " (left unchanged)");
                }
                int actualReplicas = description.partitions().get(0).replicas().size();
                if (actualReplicas != replicas) {
                    System.out.println("stack-check: WARNING topic " + topic.name() + " exists with " + actualReplicas
                            + " replicas, expected " + replicas + " (left unchanged)");
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
