"""The contract's export example: one scan node, and a scan length left dynamic.

The contract writes it for CUDA; fscan exports it on any device, so this runs on
a GPU when there is one and on the CPU otherwise.

Run: python examples/export_dynamic_length.py
"""

import torch

import fscan


class AssociativeScanModule(torch.nn.Module):
    def forward(self, xs):
        def combine_fn(x, y):
            return x + y

        return fscan.associative_scan(combine_fn, xs, dim=0, combine_mode="pointwise")


device = "cuda" if torch.cuda.is_available() else "cpu"
mod = AssociativeScanModule()
inp = torch.randn(5, 3, device=device)
dim_seq = torch.export.Dim("seq", min=2)
ep = torch.export.export(mod, (inp,), dynamic_shapes={"xs": {0: dim_seq}})

# One node, associative_scan(combine_graph, [xs], ()), whose combine_graph works
# on one element (f32[3]) and whose output keeps the symbolic length (f32[s, 3]).
(scan,) = [n for n in ep.graph.nodes if n.target is torch.ops.higher_order.associative_scan]
combine_graph, xs, additional_inputs = scan.args
element = ep.graph_module.get_submodule(combine_graph.target)
operands = [n.meta["val"] for n in element.graph.nodes if n.op == "placeholder"]
assert [tuple(t.shape) for t in operands] == [(3,), (3,)] and additional_inputs == ()
(out,) = scan.meta["val"]
assert isinstance(out.shape[0], torch.SymInt) and out.shape[1] == 3
print(f"on {device}: {scan.target}, element {tuple(operands[0].shape)}, output {out.shape}")

for n in (2, 3, 7, 64, 1000):
    x = torch.randn(n, 3, device=device)
    torch.testing.assert_close(ep.module()(x), x.cumsum(0))
print("ep.module() matches eager at lengths 2, 3, 7, 64 and 1000")

print("ok")
