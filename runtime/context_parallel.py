"""Context parallelism (the plan's C): each rank holds 1/C of every sequence, attention
all-gathers K and V over the context-parallel group (Llama 3's scheme; needs torch).

``torch.distributed.tensor.experimental.context_parallel`` does not run here: tried on 2 gloo
ranks with torch 2.13.0 (CPU), its SDPA under the context manager raises ``NotImplementedError:
Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered`` (it shards SDPA's flash and efficient CUDA kernels only); and it patches
``F.scaled_dot_product_attention``, which the splitter's aten graphs no longer call.  So the
runtime rewrites the graphs (:class:`ContextParallel`, here):

* **Sequence split, causal load balancing**: rank c holds chunks c and 2C-1-c of the 2C chunks
  of every sequence (:mod:`runtime.context_sequence`); the worker splits the model on examples
  of s/C tokens, so the graphs' shapes are the local ones.
* **Positions**: every ``arange`` of s/C elements in a unit that holds position ids
  (:func:`~runtime.context_sites.position_aranges`) becomes this rank's global positions
  (:class:`~runtime.context_modules.Positions`).
* **Attention**: each attention (:func:`~runtime.context_sites.attention_sites`) gets its K and
  V all-gathered along the sequence (:class:`~runtime.context_modules.Gather`) and the causal
  mask of the global positions, queries on this rank against keys of all ranks
  (:class:`~runtime.context_modules.CausalMask`).

Every other operation is assumed to act position by position (norms, MLPs, the LM loss), which
holds for decoder LMs; the gradients of every parameter are averaged over the D x C ranks like
data parallelism (the mesh folds C into the data axis, ``runtime.mesh.MeshSpec``).  Dropout
draws other masks than the unsplit model's (its streams are per rank). Only public torch APIs.

Where each part lives (every name below stays importable from here): cutting the sequence in
:mod:`runtime.context_sequence` (:func:`sequence_length`, :func:`local_positions`,
:func:`local_sequence`, :func:`check_sequence`); the modules inserted into the graphs in
:mod:`runtime.context_modules`; finding the attentions and positions, and
:func:`context_problems` (why the runtime cannot execute a plan's C), in
:mod:`runtime.context_sites`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from runtime.context_modules import CausalMask, Gather, Positions
from runtime.context_sequence import (
    check_sequence,
    local_positions,
    local_sequence,
    sequence_length,
)
from runtime.context_sites import attention_sites, context_problems, position_aranges
from runtime.graph_edit import redirect_users

__all__ = [
    "ContextParallel",
    "attention_sites",
    "check_sequence",
    "context_problems",
    "local_positions",
    "local_sequence",
    "sequence_length",
]


class ContextParallel:
    """The plan's C on this rank: :meth:`apply` rewrites a stage's units (positions, attention);
    :meth:`local` cuts a batch's sequences.  ``replica``: the rank's index on the folded data axis
    (d * C + c)."""

    def __init__(self, plan: Any, *, replica: int, seq: int, device_type: str = "cpu",
                 fault_from: tuple[list[int], int] | None = None) -> None:  # fmt: skip
        from torch.distributed.device_mesh import DeviceMesh

        k, d, c, t = (plan.pipeline_degree, plan.data_parallel_degree, plan.context_parallel_degree,
                      plan.tensor_parallel_degree)  # fmt: skip
        check_sequence(seq, c)
        mesh = DeviceMesh(device_type, torch.arange(k * d * c * t).view(k, d, c, t), mesh_dim_names=("pp", "dp", "cp", "tp"))
        self.group, self.degree, self.rank, self.seq = mesh["cp"].get_group(), c, replica % c, seq
        self.queries = local_positions(seq, self.rank, c)
        self.keys = torch.cat([local_positions(seq, j, c) for j in range(c)])
        self.mine = torch.arange(self.keys.numel()) // (seq // c) == self.rank  # the gathered keys this rank holds
        self.fault_from = fault_from
        self.layers: list[str] = []

    def skip_gather(self) -> bool:
        """``--inject-fault R:S:no-kv-gather``: from step S on, attend to this rank's K and V only."""
        return self.fault_from is not None and self.fault_from[0][0] >= self.fault_from[1]

    def local(self, t: Any) -> Any:
        return local_sequence(t, self.seq, self.rank, self.degree)

    def apply(self, stage_module: Any) -> None:
        for i, unit in enumerate(stage_module.units):
            changed = self._positions(unit)
            for j, (kind, nodes) in enumerate(attention_sites(unit)):
                self._attention(unit, kind, nodes, j)
                self.layers.append(str(stage_module.names[i]) if hasattr(stage_module, "names") else str(i))
                changed = True
            if changed:
                unit.graph.lint()
                unit.recompile()

    def _positions(self, unit: fx.GraphModule) -> bool:
        nodes = position_aranges(unit, self.seq // self.degree)
        for j, node in enumerate(nodes):
            name = f"pipeplan_cp_positions_{j}"
            unit.add_submodule(name, Positions(self.queries))
            with unit.graph.inserting_after(node):
                pos = unit.graph.call_module(name, (node,))
            redirect_users(node, pos)
        return bool(nodes)

    def _attention(self, unit: fx.GraphModule, kind: str, nodes: tuple[Any, ...], j: int) -> None:
        gather = f"pipeplan_cp_gather_{j}"
        unit.add_submodule(gather, Gather(self.group))
        if kind == "sdpa":
            self._sdpa(unit, nodes[0], gather, f"pipeplan_cp_mask_{j}")
        else:
            self._math_attention(unit, nodes, gather, f"pipeplan_cp_mask_{j}")

    def _sdpa(self, unit: fx.GraphModule, node: fx.Node, gather: str, mask: str) -> None:
        """K and V gathered; ``is_causal`` replaced by the mask of the global positions."""
        graph = unit.graph
        q, k, v = node.args[:3]
        causal = (len(node.args) > 3 and node.args[3] is not None) or bool(node.kwargs.get("is_causal"))
        causal = causal or (len(node.args) > 5 and bool(node.args[5]))
        with graph.inserting_before(node):
            gk, gv = graph.call_module(gather, (k,)), graph.call_module(gather, (v,))
            allowed = None
            if causal:
                unit.add_submodule(mask, CausalMask(self.queries, self.keys, self.mine, self.skip_gather, allowed=True))
                allowed = graph.call_module(mask, (q,))
        rest = tuple(node.args[4:5])  # dropout_p; is_causal is replaced by the mask
        node.args = (q, gk, gv, allowed, *rest)
        node.kwargs = {key: val for key, val in node.kwargs.items() if key != "is_causal"}

    def _math_attention(self, unit: fx.GraphModule, nodes: tuple[Any, ...], gather: str, mask: str) -> None:
        """K gathered before its transpose, V before the product with the probabilities; the
        masked fill (if any) takes the mask of the global positions."""
        graph = unit.graph
        fill, k_t, out = nodes
        with graph.inserting_before(k_t):
            gk = graph.call_module(gather, (k_t.args[0],))
        k_t.args = (gk, *k_t.args[1:])
        with graph.inserting_before(out):
            gv = graph.call_module(gather, (out.args[1],))
        out.args = (out.args[0], gv, *out.args[2:])
        if fill is not None:
            unit.add_submodule(mask, CausalMask(self.queries, self.keys, self.mine, self.skip_gather))
            with graph.inserting_before(fill):
                masked = graph.call_module(mask, (fill.args[0],))
            fill.args = (fill.args[0], masked, *fill.args[2:])
