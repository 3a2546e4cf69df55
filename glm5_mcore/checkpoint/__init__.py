"""Everything on disk: the checkpoint layout (``checkpoint.layout``), its distributed-checkpoint I/O
(``checkpoint.dist``), HF folders (``checkpoint.hf_io``), HF weights into a model (``checkpoint.hf_load``).

Nothing is re-exported here: light modules of this package (``atomic``, ``manifest``, ``layout``) serve
commands that must not import Megatron-Core (``glm5 plot``, ``glm5 data preprocess``), and a package face
would load ``dist`` / ``hf_load`` (and with them Megatron) for any of them."""
