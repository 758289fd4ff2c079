# reference pass, F16, default corpus, -c 256 --chunks 1 (127 scored tokens)
# build: llama.cpp 0c1e57098 (llama-cpp-python 0.3.36 sources, cpu x86_64, jbench setup), bin /root/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin
# python: 3.11.7 (the default corpus is derived from its pydoc_data)
# output: stdout and stderr together (2>&1) in reference-F16-c256.txt
/root/.cache/jbench/llama.cpp/0.3.36-0c1e57098-cpu-x86_64/bin/llama-perplexity -m /root/.cache/jbench/models/gemma3_270m/F16.gguf --kl-divergence-base /tmp/jbench-ppl-capture/f16-c256.kld -c 256 --chunks 1 -b 256 -ub 256 -ngl 0 -t 2 -f /tmp/jbench-ppl-capture/cache/corpus/pydoc-topics-71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee.txt -ctk f16 -ctv f16 
