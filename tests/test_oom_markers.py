"""One out-of-memory rule for every backend: jbench.backends.base.looks_oom.

The messages are the forms real tools print; where a line is built from a format string the test
fills it in, and the comment names where the format lives in the public source.
"""

from __future__ import annotations

import pytest

from jbench.backends.base import OOM_MARKERS, command_failure, looks_oom
from jbench.device.connection import CommandResult

OOM = [
    # llama.cpp ggml/src/ggml-cuda/ggml-cuda.cu, ggml_backend_cuda_buffer_type_alloc_buffer:
    # "%s: allocating %.2f MiB on device %d: cudaMalloc failed: %s" with cudaGetErrorString
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2306.25 MiB on device 0: cudaMalloc failed: out of memory",
    # llama.cpp ggml/src/ggml-alloc.c, ggml_gallocr_reserve_n: "%s: failed to allocate %s buffer of size %zu"
    "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 2418016256\n"
    "llama_init_from_model: failed to initialize the context: failed to allocate compute pp buffers",
    # llama.cpp src/llama-model.cpp: format("unable to allocate %s buffer", ...), caught by llama_model_load
    "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
    # llama.cpp commit 94bb63e ("opencl : fix buffer alignment"), the ggml-alloc.c abort it quotes
    "ggml-alloc.c:99: not enough space in the buffer\n"
    "ggml_tallocr_alloc: not enough space in the buffer to allocate blk.17.ffn_down.weight (needed 27525120, available 27521024)",
    # ggml-cuda CUDA_CHECK: "CUDA error: %s" with the error string of cudaErrorMemoryAllocation
    "CUDA error: out of memory\n  current device: 0, in function ggml_cuda_pool_alloc at ggml-cuda.cu:376",
    # TensorRT's allocator, as printed on Jetson by TensorRT-based tools
    "[TRT] [E] [defaultAllocator.cpp::allocate::31] Error Code 1: Cuda Runtime (out of memory)",
    "[TRT] [E] [engine.cpp::readEngineFromArchive::1091] Error Code 2: OutOfMemory (Requested size was 5244672 bytes.)",
    # PyTorch (TensorRT-LLM's Python tools)
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.44 GiB",
    "RuntimeError: [TensorRT-LLM][ERROR] CUDA runtime error in cudaMallocAsync: cudaErrorMemoryAllocation",
    # C++ and Python allocation failures
    "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc",
    "Traceback (most recent call last):\n  ...\nMemoryError",
    # strerror(ENOMEM) from llama.cpp's llama-mmap.cpp format("mmap failed: %s", strerror(errno))
    "llama_model_load: error loading model: mmap failed: Cannot allocate memory",
    # Jetson NvMap refusing with ENOMEM before CUDA reports the failure
    "NvMapMemAllocInternalTagged: 1075072515 error 12\nNvMapMemHandleAlloc: error 0",
    "CUBLAS_STATUS_ALLOC_FAILED",
]

NOT_OOM = [
    "error: invalid argument: --flash-attn",
    "llama_model_load: error loading model: failed to open models/x.gguf: No such file or directory",
    "CUDA error: an illegal memory access was encountered",
    "GGML_ASSERT(n_tokens_all <= cparams.n_batch) failed",
    "Segmentation fault (core dumped)",
    "NvMapMemAllocInternalTagged: 1075072515 error 22",
    "",
]


@pytest.mark.parametrize("text", OOM)
def test_real_out_of_memory_messages(text):
    assert looks_oom(text)
    assert looks_oom(text.upper()) and looks_oom(f"llama-bench: loading\n{text}\nexiting"), "case and context"


@pytest.mark.parametrize("text", NOT_OOM)
def test_other_failures_are_not_oom(text):
    assert not looks_oom(text) and not looks_oom(text, 1)


def test_the_oom_killer_is_a_sigkill_with_the_shells_notice():
    # bash reports a foreground child killed by SIGKILL (what the kernel's OOM killer sends) and exits 128 + 9.
    notice = 'bash: line 1: 48213 Killed                  "$@"'
    assert looks_oom(notice, 137) and looks_oom("Killed\n", 137) and looks_oom("Killed", -9)
    assert not looks_oom(notice, 1)  # the word alone, without a SIGKILL status
    assert not looks_oom("", 137)  # SIGKILL without the notice: a timeout or a user's kill -9 as well
    assert not looks_oom("the server killed the connection", 137)  # not the shell's notice


def test_one_list_lower_case():
    assert all(m == m.lower() for m in OOM_MARKERS) and len(set(OOM_MARKERS)) == len(OOM_MARKERS)


def test_failed_commands_are_classified_by_the_shared_rule():
    oom = CommandResult(["llama-bench"], 1, "{}", "load\n" + OOM[0] + "\nmain: error", 1.0)
    err = command_failure("llama-bench", oom)
    assert err.category == "out_of_memory" and str(err).startswith("llama-bench exited with code 1: load")
    assert (err.raw_output, err.raw_stderr) == (oom.stdout, oom.stderr)
    crash = CommandResult(["x"], 139, "", "\n".join(f"line {i}" for i in range(9)), 1.0)
    err = command_failure("engine (speed)", crash, "all output", "all errors")
    assert err.category == "backend_crash" and str(err) == "engine (speed) exited with code 139: " + "\n".join(
        f"line {i}" for i in range(4, 9))
    assert (err.raw_output, err.raw_stderr) == ("all output", "all errors")
    # TensorRT-LLM prints some of its errors on stdout: only looked at when asked.
    trt = CommandResult(["trtllm-build"], 1, "[TensorRT-LLM][ERROR] CUDA runtime error: out of memory", "", 1.0)
    assert command_failure("trtllm-build", trt).category == "backend_crash"
    assert command_failure("trtllm-build", trt, check_stdout=True).category == "out_of_memory"
    killed = CommandResult(["bash"], 137, "", 'bash: line 1: 48213 Killed                  "$@"', 1.0)
    assert command_failure("llama-bench", killed).category == "out_of_memory"


def test_every_backend_uses_the_shared_rule():
    import inspect

    from jbench.backends.engine import backend as engine
    from jbench.backends.llamacpp import backend as llamacpp
    from jbench.backends.serving import process as server  # every serving backend's server process
    from jbench.backends.trtllm import backend as trtllm

    for module in (engine, llamacpp, trtllm):
        src = inspect.getsource(module)
        assert module.command_failure is command_failure and "_looks_oom" not in src, module.__name__
    assert server.looks_oom is looks_oom and "def _looks_oom" not in inspect.getsource(server)
