"""A larger Gemma-3-shaped GGUF with random F16 weights (decode on an H100 should be bandwidth-bound):
the metadata (tokenizer included) of the small model, the dimensions below. Weight values do not change
decode speed; shapes and types do."""
import sys
import numpy as np
import gguf

src, out = sys.argv[1], sys.argv[2]
E, L, FF, H, HKV, D = 2048, 24, 8192, 8, 4, 256
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(out, "gemma3")
dims = {"gemma3.embedding_length": E, "gemma3.block_count": L, "gemma3.feed_forward_length": FF,
        "gemma3.attention.head_count": H, "gemma3.attention.head_count_kv": HKV}
for k, f in r.fields.items():
    if k.startswith("GGUF.") or k == "general.architecture":
        continue
    vtype = f.types[0]
    val = dims.get(k, f.contents())
    w.add_key_value(k, val, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
vocab = [t for t in r.tensors if t.name == "token_embd.weight"][0].shape[1]
pool = (np.random.default_rng(0).standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
def f16(rows, cols):  # numpy shape (rows, cols) = ggml ne (cols, rows)
    return np.resize(pool, (rows, cols))
def ones(n):
    return np.ones(n, dtype=np.float32)
w.add_tensor("token_embd.weight", f16(vocab, E))
for i in range(L):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_q.weight", f16(H * D, E)); w.add_tensor(p + "attn_k.weight", f16(HKV * D, E))
    w.add_tensor(p + "attn_v.weight", f16(HKV * D, E)); w.add_tensor(p + "attn_output.weight", f16(E, H * D))
    w.add_tensor(p + "ffn_gate.weight", f16(FF, E)); w.add_tensor(p + "ffn_up.weight", f16(FF, E))
    w.add_tensor(p + "ffn_down.weight", f16(E, FF))
    for n, size in (("attn_norm", E), ("attn_q_norm", D), ("attn_k_norm", D), ("post_attention_norm", E),
                    ("ffn_norm", E), ("post_ffw_norm", E)):
        w.add_tensor(p + n + ".weight", ones(size))
w.add_tensor("output_norm.weight", ones(E))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file()
w.close()
print("wrote", out)
