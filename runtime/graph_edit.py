"""Graph edits the runtime's rewrites share (needs torch only for the graphs it is handed).

The axes that rewrite the splitter's aten graphs (expert parallelism, :mod:`runtime.experts`;
context parallelism, :mod:`runtime.context_parallel`; tensor parallelism,
:mod:`runtime.tp_rewrites`) often insert a call right after a node that reads the node's value,
and then hand every other user of the node to that call: :func:`redirect_users`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.fx as fx


def redirect_users(node: fx.Node, new: fx.Node) -> None:
    """Make every user of ``node`` use ``new`` instead, except ``new`` itself (which reads ``node``)."""
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
