"""The identity keys a trial hash was made of when HASH_VERSION 2 began, and the keys added since.

A key added later with a default must not change the hash of a trial recorded before it existed (resume, compare
and the nightly history would split): at the default it had when it was added, such a key is left out of the hash
(jbench.core.identity._digest). A new identity field of jbench's own schemas is therefore registered in
ADDED_DEFAULTS with that default (tests/test_identity.py fails until it is, and says what to add); a changed value
counts as usual. A backend's keys are named `<backend>:backend.<key>` (two backends may share a key name);
plug-in backends' keys are not listed: all of theirs count.
"""

from __future__ import annotations

V2_KEYS = frozenset({
    "device.name",
    "engine:backend.command",
    "engine:backend.context",
    "engine:backend.depth",
    "engine:backend.env",
    "engine:backend.extra_args",
    "engine:backend.kv_type",
    "engine:backend.n_gen",
    "engine:backend.n_prompt",
    "engine:backend.name",
    "engine:backend.repetitions",
    "engine:backend.trace",
    "engine:backend.trace_args",
    "engine:backend.vars",
    "engine:backend.warmup",
    "llamacpp:backend.cache_type_k",
    "llamacpp:backend.cache_type_v",
    "llamacpp:backend.context",
    "llamacpp:backend.depth",
    "llamacpp:backend.extra_args",
    "llamacpp:backend.flash_attn",
    "llamacpp:backend.latency_concurrency",
    "llamacpp:backend.latency_requests",
    "llamacpp:backend.latency_warmup_requests",
    "llamacpp:backend.n_batch",
    "llamacpp:backend.n_gen",
    "llamacpp:backend.n_gpu_layers",
    "llamacpp:backend.n_prompt",
    "llamacpp:backend.n_ubatch",
    "llamacpp:backend.name",
    "llamacpp:backend.repetitions",
    "llamacpp:backend.scenario",
    "llamacpp:backend.server_extra_args",
    "llamacpp:backend.threads",
    "llamacpp:backend.warmup",
    "model.name",
    "model.quant",
    "model.source_quant",
    "model.source_sha256",
    "power.fan",
    "power.jetson_clocks",
    "power.mode",
    "trtllm:backend.batch_size",
    "trtllm:backend.bench_backend",
    "trtllm:backend.benchmark_model",
    "trtllm:backend.build_args",
    "trtllm:backend.concurrency",
    "trtllm:backend.dataset",
    "trtllm:backend.depth",
    "trtllm:backend.enable_cuda_graph",
    "trtllm:backend.extra_args",
    "trtllm:backend.hf_model",
    "trtllm:backend.jetson_program",
    "trtllm:backend.max_input_len",
    "trtllm:backend.max_seq_len",
    "trtllm:backend.mode",
    "trtllm:backend.n_gen",
    "trtllm:backend.n_prompt",
    "trtllm:backend.name",
    "trtllm:backend.num_requests",
    "trtllm:backend.num_runs",
    "trtllm:backend.repetitions",
    "trtllm:backend.streaming",
    "trtllm:backend.trtllm_version",
    "trtllm:backend.variant",
    "trtllm:backend.warmup",
})

# key (as in V2_KEYS) -> canonical default (jbench.core.identity.canonical) at the time the key was added.
ADDED_DEFAULTS: dict[str, str] = {
    # Settled speed (protocol 3): extra timed repetitions in the same context, the cold ones set aside.
    "llamacpp:backend.settle_repetitions": "1",
}
