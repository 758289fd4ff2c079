# llama.cpp 0c1e57098 (jbench setup's CPU build, x86_64), gemma-3-270m Q4_K_M from jbench setup's model ladder; stderr of:
llama-bench -m gemma3_270m/Q4_K_M.gguf -p 16 -n 4 -d 0 -r 1 -ngl 99 -ctk f16 -ctv f16 -o jsonl -v --no-warmup
