# Postgres for the compose stack, from Debian's packages on the same base as the services (CI
# reaches no image registry; users get the same thing from the public Debian image).
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${BASE_IMAGE}
# A fixed uid, so that Kubernetes can check runAsNonRoot and volumes can be prepared for it.
RUN groupadd -r -g 999 postgres && useradd -r -u 999 -g 999 -d /var/lib/postgresql -s /bin/sh postgres \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data \
 && install -d -o postgres -g postgres /var/run/postgresql
COPY deploy/images/postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
USER 999:999
# Fast shutdown: SIGTERM is Postgres's "smart" one, which waits for every client to disconnect, so a
# `down` or a pod's termination ran out its grace and SIGKILLed it (crash recovery on the next start).
STOPSIGNAL SIGINT
EXPOSE 5432
ENTRYPOINT ["postgres-entrypoint"]
