"""Fill a GGUF header (metadata + tensor table of the bundled gemma3 270m F16 file) with random weights of
the same shapes and types, so the quant ladder can be rebuilt on a machine the model file cannot reach.
Decode speed depends on tensor shapes and types, not on the weight values."""
import sys
import numpy as np
import gguf

header, out, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(header, "rb") as f, open(out, "wb") as g:
    g.write(f.read())
    g.truncate(size)
r = gguf.GGUFReader(out, "r+")
rng = np.random.default_rng(0)
for t in r.tensors:
    d = t.data
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        d[...] = 1.0 if "norm" in t.name else rng.standard_normal(d.shape, dtype=np.float32) * 0.02
    else:
        d[...] = (rng.standard_normal(d.shape, dtype=np.float32) * 0.02).astype(np.float16)
r.data.flush()
print("filled", len(r.tensors), "tensors in", out)
