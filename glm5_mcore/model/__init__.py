"""The network on Megatron-Core specs: ``build_model`` (``model.build``) on the groups ``init_parallel``
(``model.parallel``) makes, ``forward_logits`` for full-vocabulary logits. Only this package's names."""

from glm5_mcore.model.build import build_model, forward_logits
from glm5_mcore.model.parallel import init_parallel

__all__ = ["build_model", "forward_logits", "init_parallel"]
