# Redis for the compose stack, from Debian's packages (see postgres.Dockerfile for why).
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${BASE_IMAGE}
# A fixed uid, so that Kubernetes can check runAsNonRoot and volumes can be prepared for it.
RUN groupadd -r -g 998 redis && useradd -r -u 998 -g 998 -d /var/lib/redis -s /usr/sbin/nologin redis \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o redis -g redis /data
USER 998:998
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/data", "--appendonly", "yes"]
