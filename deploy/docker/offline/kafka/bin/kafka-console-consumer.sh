#!/usr/bin/env bash
# As the distribution's bin/kafka-console-consumer.sh: Kafka's own tool, org.apache.kafka.tools.consumer.ConsoleConsumer.
exec java ${KAFKA_TOOL_HEAP_OPTS:--Xmx256m} -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties \
    -cp '/opt/kafka/libs/*' org.apache.kafka.tools.consumer.ConsoleConsumer "$@"
