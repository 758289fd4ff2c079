#!/usr/bin/env bash
# Captures the llama-perplexity outputs in this folder (stdout and stderr together, as jbench reads them) with the
# llama.cpp build and model ladder of `jbench setup`, and writes each output's .cmd (the exact command, the build).
# Run from the repository root: bash tests/data/llamacpp/perplexity/capture.sh
# Scratch files (logits, corpora) go to /tmp/jbench-ppl-capture; the captures name those paths verbatim.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python}
BIN=$($PY -c 'from jbench.models.provision import active_build; print(active_build()["bin_dir"])')
BUILD=$($PY -c 'from jbench.models.provision import active_build as a; b = a(); print("llama.cpp %(build_commit)s (llama-cpp-python %(llama_cpp_python)s sources, %(flavor)s %(machine)s, jbench setup), bin %(bin_dir)s" % b)')
M=$($PY -c 'from jbench.core.paths import models_dir; print(models_dir() / "gemma3_270m")')
T=/tmp/jbench-ppl-capture
rm -rf "$T" && mkdir -p "$T"
# The default corpus (jbench.models.corpus.default_corpus), and its first 2000 bytes as a corpus too short for -c 256.
CORPUS=$($PY -c "from pathlib import Path; from jbench.models.corpus import default_corpus; print(default_corpus(Path('$T/cache')).path)")
head -c 2000 "$CORPUS" > "$T/short.txt"
# A logits file of another vocabulary (1000 entries): perplexity.cpp's header and 128 tokens, no log-probs.
$PY -c "import struct, pathlib; pathlib.Path('$T/vocab1000.kld').write_bytes(b'_logits_' + struct.pack('<Iii', 128, 1000, 1) + struct.pack('<128i', *range(2, 130)))"

cap() {  # cap NAME WHAT -- ARGV...
    local name=$1 what=$2; shift 3
    "$@" > "$HERE/$name.txt" 2>&1 || true
    { echo "# $what"
      echo "# build: $BUILD"
      echo "# python: $($PY -c 'import sys; print(sys.version.split()[0])') (the default corpus is derived from its pydoc_data)"
      echo "# output: stdout and stderr together (2>&1) in $name.txt"
      printf '%q ' "$@"; echo; } > "$HERE/$name.cmd"
}
PPL="$BIN/llama-perplexity"
COMMON=(-ngl 0 -t 2)
cap reference-F16-c256 "reference pass, F16, default corpus, -c 256 --chunks 1 (127 scored tokens)" -- \
    "$PPL" -m "$M/F16.gguf" --kl-divergence-base "$T/f16-c256.kld" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    -f "$CORPUS" -ctk f16 -ctv f16
cap kld-Q4_0-c256 "candidate pass, Q4_0 against F16's logits, -c 256 --chunks 1: 127 scored tokens, statistics" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/f16-c256.kld" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv f16
cap reference-F16-c128x2 "reference pass, F16, -c 128 --chunks 2 (2 x 63 scored tokens)" -- \
    "$PPL" -m "$M/F16.gguf" --kl-divergence-base "$T/f16-c128x2.kld" -c 128 --chunks 2 -b 128 -ub 128 "${COMMON[@]}" \
    -f "$CORPUS" -ctk f16 -ctv f16
cap kld-Q4_0-c128x2-chunks1 "candidate pass with --chunks 1 against a 2-chunk reference: the KLD pass takes the chunk count (and n_ctx) from the logits file" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/f16-c128x2.kld" -c 128 --chunks 1 -b 128 -ub 128 "${COMMON[@]}" \
    --kl-divergence -ctk q8_0 -ctv q8_0 -fa on
cap reference-F16-c128 "reference pass, F16, -c 128 --chunks 1 (63 scored tokens)" -- \
    "$PPL" -m "$M/F16.gguf" --kl-divergence-base "$T/f16-c128.kld" -c 128 --chunks 1 -b 128 -ub 128 "${COMMON[@]}" \
    -f "$CORPUS" -ctk f16 -ctv f16
cap kld-Q4_0-c128-few "candidate pass over 63 scored tokens: the per-chunk table but no statistics (fewer than 100)" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/f16-c128.kld" -c 128 --chunks 1 -b 128 -ub 128 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv f16
cap reference-short-corpus "reference pass refused: the first 2000 bytes of the default corpus (441 tokens) for -c 256" -- \
    "$PPL" -m "$M/F16.gguf" --kl-divergence-base "$T/short.kld" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    -f "$T/short.txt" -ctk f16 -ctv f16
cap kld-truncated-logits "candidate pass against the refused reference's logits file (12 bytes: magic and n_ctx only)" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/short.kld" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv f16
cap kld-vocab-mismatch "candidate pass against a logits file of a 1000-token vocabulary (header and tokens only, made by this script)" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/vocab1000.kld" -c 128 --chunks 1 -b 128 -ub 128 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv f16
cap kld-not-logits "candidate pass given a text file as the logits file" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/short.txt" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv f16
cap kld-missing-logits "candidate pass given a logits file that does not exist" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/missing.kld" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv f16
cap kld-bad-argument "candidate pass with a KV type this build does not know (-ctv q3_x)" -- \
    "$PPL" -m "$M/Q4_0.gguf" --kl-divergence-base "$T/f16-c256.kld" -c 256 --chunks 1 -b 256 -ub 256 "${COMMON[@]}" \
    --kl-divergence -ctk f16 -ctv q3_x
ls -l "$T"/*.kld > "$HERE/logits-sizes.txt"
