#!/usr/bin/env bash
# As the distribution's bin/kafka-broker-api-versions.sh: Kafka's own tool, org.apache.kafka.tools.BrokerApiVersionsCommand.
exec java ${KAFKA_TOOL_HEAP_OPTS:--Xmx256m} -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties \
    -cp '/opt/kafka/libs/*' org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
