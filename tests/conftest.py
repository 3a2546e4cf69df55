import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_share_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_share", index_share=True, seed=1))


@pytest.fixture(scope="session")
def tiny_mtp_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_mtp", mtp=True, seed=2))


@pytest.fixture()
def single_rank():
    from glm5_mcore.config import ParallelConfig
    from glm5_mcore.model.parallel import init_parallel

    init_parallel(ParallelConfig())
    yield
