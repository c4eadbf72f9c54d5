# The base model as an image, for the gpu overlay's place-weights Job (it copies /model onto the
# weights volume). Build it where the checkpoint is (a Hugging Face directory: config.json,
# *.safetensors, tokenizer files):
#   podman build -f deploy/images/model.Dockerfile --build-arg MODEL_DIR=path/to/Qwen3-8B -t REGISTRY/spade-model:qwen3-8b .
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG MODEL_DIR
COPY ${MODEL_DIR} /model
USER 10001:10001
