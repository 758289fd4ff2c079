# Shared set-up of the GPU-host benchmarks of issue 26 (sourced by bench/lean_energy_device.sh and
# bench/nightly_paired_device.sh, bench/settle_device.sh): jbench and its dependencies in $W/site (and the "before" jbench in $W/site-old
# when $GPU_DIR/before has one), the CUDA llama.cpp build in $W/build/bin ($B), the model ladder in $W/ladder.
# Idempotent: a warm machine keeps all of it. Sets ROOT, G, W, B, T0, OUT.
ROOT=$PWD; G=${GPU_DIR:-$ROOT/.gpu26}; W=/root/jb26; mkdir -p $W/ladder $W/site $W/wheels; B=$W/build/bin; T0=$(date +%s)
OUT=${OUT:-$W/out}; mkdir -p $OUT
for f in $ROOT/.whl/*.whl $G/jbench-*.whl; do ln -sf $f $W/wheels/; done
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site $W/wheels/*.whl || return 1
# The "before" jbench: the same dependencies, its own jbench (one jbench distribution per path: entry points).
if ls $G/before/jbench-*.whl > /dev/null 2>&1; then
  rm -rf $W/site-old && cp -a $W/site $W/site-old && rm -rf $W/site-old/jbench $W/site-old/jbench-*.dist-info
  python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site-old $G/before/jbench-*.whl || return 1
fi
export PATH=$W/site/bin:$PATH
(cd $W && PYTHONPATH=$W/site python3 -c "import jbench, pynvml, mlflow; print('lean jbench from', jbench.__file__)") || return 1
# SERVER=1: llama-server and llama-batched-bench too (bench/serving_device.sh).
EXTRA_TARGETS=""; SERVER_FLAG=OFF
if [ "${SERVER:-0}" = 1 ]; then EXTRA_TARGETS="llama-server llama-batched-bench"; SERVER_FLAG=ON; fi
if [ ! -x $B/llama-bench ] || { [ "$SERVER_FLAG" = ON ] && [ ! -x $B/llama-server ]; }; then
  rm -rf $W/src; mkdir -p $W/src && tar -xJf $G/llama.cpp.tar.xz -C $W/src
  cmake -S $W/src/llama.cpp -B $W/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_SERVER=$SERVER_FLAG -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 > $W/cmake.log 2>&1 || { tail -40 $W/cmake.log; return 1; }
  cmake --build $W/build -j 16 --target llama-bench llama-quantize $EXTRA_TARGETS > $W/build.log 2>&1 || { tail -40 $W/build.log; return 1; }
  echo "build done at $(( $(date +%s) - T0 )) s"
fi
if [ ! -f $W/ladder/F16.gguf ]; then
  xz -dc $G/gemma3_270m_F16_header.gguf.xz > $W/hdr.gguf
  PYTHONPATH=$W/site python3 bench/gpu_roofline/fill_model.py $W/hdr.gguf $W/ladder/F16.gguf 542833344 || return 1
fi
for q in Q4_0 Q8_0; do [ -f $W/ladder/$q.gguf ] || $B/llama-quantize $W/ladder/F16.gguf $W/ladder/$q.gguf $q > /dev/null 2>&1 & done; wait
echo "models at $(( $(date +%s) - T0 )) s"
