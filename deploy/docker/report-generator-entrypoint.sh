#!/bin/sh
# Entrypoint of the report-generator image: gives every replica its own
# QUIRE_WORKER__REPLICA_ID, then runs the worker (arguments such as --drain
# pass through).
#
# The replica id is both the worker's static group member id
# (group.instance.id) and part of its transactional id, so two replicas must
# never share one. `docker compose up --scale report-generator=3` starts
# identical containers with no per-replica variable, so when none is set the
# container's hostname is used: under compose that is the container id, which
# is stable for the life of the container (restarts keep it) and distinct
# between replicas.
#
# Trade-off: a re-created container (new image, changed configuration,
# `docker compose down` then `up`) gets a new id. Its predecessor's static
# membership then lingers until the group's session timeout, and its open
# transaction until the transaction timeout (about 10 s), before their
# partitions move on; no data is lost or doubled, only that delay is paid.
# Where that matters (Kubernetes StatefulSets, systemd units, hand-written
# compose services), set QUIRE_WORKER__REPLICA_ID explicitly: it wins.
set -eu

if [ -z "${QUIRE_WORKER__REPLICA_ID:-}" ]; then
    QUIRE_WORKER__REPLICA_ID=$(uname -n)
fi
export QUIRE_WORKER__REPLICA_ID

exec /usr/local/bin/report-generator "$@"
