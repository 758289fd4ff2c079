# candidate pass over 127 scored tokens that printed its table header and then nothing (exit 0): seen once in CI (a
# `jbench sweep` trial's quality pass, 2026-11-26); jbench runs the trial pass once more on this output
# build: llama.cpp 0c1e57098 (llama-cpp-python 0.3.36 sources, cpu x86_64, jbench setup), bin /tmp/jbench-ci.JRvG9y/jbench/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin
# output: stdout, then stderr (as jbench recorded them: raw/stdout.txt, raw/stderr.txt) in kld-Q4_0-c256-cut-short.txt
/tmp/jbench-ci.JRvG9y/jbench/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin/llama-perplexity -m /tmp/jbench-ci.JRvG9y/jbench/.cache/jbench/models/gemma3_270m/Q4_0.gguf --kl-divergence-base /root/.cache/jbench/quality/ref-060518d14874d604e0995dd5c92c583d.kld -c 256 --chunks 1 -b 256 -ub 256 -ngl 99 -t 1 --kl-divergence -ctk f16 -ctv f16
