"""Expert parallelism over ``torch.distributed``: :class:`moe_route.MoELayer` with
``ep_group=`` shards its experts over the ranks of a process group and exchanges tokens with
all-to-all. :mod:`.expert_parallel` holds the exchange and the forward, :mod:`.state` the
checkpoints (:func:`full_state_dict`). See docs/expert_parallelism.md.
"""

from .expert_parallel import ExpertParallel
from .state import full_state_dict

__all__ = ["ExpertParallel", "full_state_dict"]
