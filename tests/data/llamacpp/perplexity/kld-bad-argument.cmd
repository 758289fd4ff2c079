# candidate pass with a KV type this build does not know (-ctv q3_x)
# build: llama.cpp 0c1e57098 (llama-cpp-python 0.3.36 sources, cpu x86_64, jbench setup), bin /root/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin
# python: 3.11.7 (the default corpus is derived from its pydoc_data)
# output: stdout and stderr together (2>&1) in kld-bad-argument.txt
/root/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin/llama-perplexity -m /root/.cache/jbench/models/gemma3_270m/Q4_0.gguf --kl-divergence-base /tmp/jbench-ppl-capture/f16-c256.kld -c 256 --chunks 1 -b 256 -ub 256 -ngl 0 -t 2 --kl-divergence -ctk f16 -ctv q3_x 
