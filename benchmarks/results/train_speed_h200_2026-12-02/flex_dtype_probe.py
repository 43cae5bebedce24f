"""One-off probe (2026-12-02): the draft layers' flex attention alone at the 16-conversation training shape, its
inputs all in fp32 against all in bf16, without autocast. It tested whether the step's flex attention ran in fp32: q
and k leave fp32-weight norms under bf16 autocast. It did not: autocast casts flex attention's inputs, as it casts
SDPA's, and the step's 13.7 ms per layer is the bf16 time below. A first version, q and k in fp32 with v in bf16
outside autocast, failed to compile (mixed dtypes). Only torch is needed: the training mask comes from
dflash2/data/anchors.py, loaded by path. The bf16 row is labelled "(after)" after a change that was then reverted.

    python benchmarks/results/train_speed_h200_2026-12-02/flex_dtype_probe.py OUT.json
"""

import importlib.util
import json
import sys

import torch
from torch.nn.attention.flex_attention import flex_attention

spec = importlib.util.spec_from_file_location("anchors", "dflash2/data/anchors.py")
anchors_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(anchors_module)

b, length, n, block, heads, kv_heads, d = 16, 3072, 512, 16, 9, 3, 64
gen = torch.Generator().manual_seed(0)
first = length // 8  # the synthetic batch's untrained prompt
anchors = torch.stack(
    [torch.randperm(length - first - block, generator=gen)[:n].sort().values + first for _ in range(b)]
).cuda()
mask = anchors_module.flex_block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), length, block)
attend = torch.compile(flex_attention, dynamic=True)
q0 = torch.randn(b, heads, n * block, d, device="cuda")
k0, v0 = (torch.randn(b, kv_heads, length + n * block, d, device="cuda") for _ in range(2))
rows = []
for name, dtypes in (("q,k,v fp32", (torch.float32,) * 3), ("q,k,v bf16 (after)", (torch.bfloat16,) * 3)):
    q, k, v = (t.to(dt).requires_grad_() for t, dt in zip((q0, k0, v0), dtypes, strict=True))

    def forward(q=q, k=k, v=v):
        return attend(q, k, v, block_mask=mask, enable_gqa=True)

    def both():
        forward().float().sum().backward()

    row = {"inputs": name}
    for label, fn in (("forward_ms", forward), ("forward_backward_ms", both)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        row[label] = sorted(times)[len(times) // 2]
    row["out_dtype"] = str(forward().dtype)
    rows.append(row)
    print(row, flush=True)
json.dump(
    {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": dict(rows=b, context=length, blocks=n, block_size=block, heads=heads, kv_heads=kv_heads, head_dim=d),
        "rows": rows,
    },
    open(sys.argv[1], "w"),
    indent=2,
)
