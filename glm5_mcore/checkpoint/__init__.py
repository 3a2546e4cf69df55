"""Everything on disk: the checkpoint layout (``checkpoint.layout``), its distributed-checkpoint I/O
(``checkpoint.dist``), HF folders (``checkpoint.hf_io``) and HF weights into a model (``checkpoint.hf_load``).
Only this package's names."""

from glm5_mcore.checkpoint.dist import load_model, save_model
from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from glm5_mcore.checkpoint.hf_load import load_hf_weights
from glm5_mcore.checkpoint.layout import model_dir

__all__ = ["HFCheckpoint", "load_hf_weights", "load_model", "model_dir", "save_model"]
