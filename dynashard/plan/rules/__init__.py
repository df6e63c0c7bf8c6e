"""Propagation rules, one module per kind of op; importing this package registers them all.

* ``registry``   -- the op -> rule table and the ``@rule`` decorator
* ``origins``    -- colwise / rowwise linears and vocab-parallel embeddings (where shards come from)
* ``pointwise``  -- ``torch.Tag.pointwise`` ops and dtype / copy ops
* ``views``      -- view, reshape, transpose, permute, (un)squeeze, select, expand: one dim map each
* ``shapes``     -- split, unbind, slice, cat, stack, getitem
* ``reductions`` -- softmax, reductions, layer norm: ops along some dims (scans such as cumsum too)
* ``attention``  -- SDPA kernels and bmm / baddbmm attention on the head dim
* ``flex``       -- flex_attention (a higher-order op) on the head dim, its mods told the global head
* ``loss``       -- loss parallel: log_softmax + nll_loss (cross-entropy) on vocab-sharded logits
* ``inplace``    -- in-place writes the layout can or cannot follow (a KV cache's index_copy_)
* ``quantized``  -- group-quantized linears cut in whole groups (for ``origins`` and the propagation)
"""

from dynashard.plan.rules import attention, flex, inplace, loss, pointwise, reductions, shapes, views  # noqa: F401 - register
from dynashard.plan.rules.registry import lookup

__all__ = ["lookup"]
