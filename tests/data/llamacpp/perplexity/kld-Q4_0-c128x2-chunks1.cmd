# candidate pass with --chunks 1 against a 2-chunk reference: the KLD pass takes the chunk count (and n_ctx) from the logits file
# build: llama.cpp 0c1e57098 (llama-cpp-python 0.3.36 sources, cpu x86_64, jbench setup), bin /root/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin
# python: 3.11.7 (the default corpus is derived from its pydoc_data)
# output: stdout and stderr together (2>&1) in kld-Q4_0-c128x2-chunks1.txt
/root/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin/llama-perplexity -m /root/.cache/jbench/models/gemma3_270m/Q4_0.gguf --kl-divergence-base /tmp/jbench-ppl-capture/f16-c128x2.kld -c 128 --chunks 1 -b 128 -ub 128 -ngl 0 -t 2 --kl-divergence -ctk q8_0 -ctv q8_0 -fa on 
