import pytest

from lattice_mlx.synthetic import random_checkpoint

CONFIGS = {
    "tied": dict(seed=0),
    "untied": dict(seed=1, tie_word_embeddings=False),
    # Hv = 4 Hk, attention first, and a pattern that is not the 3:1 default.
    "pattern": dict(seed=2, num_hidden_layers=5, linear_num_key_heads=1, linear_num_value_heads=4,
                    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                 "linear_attention"]),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: random_checkpoint(root / name, **kw) for name, kw in CONFIGS.items()}


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def checkpoint(request, checkpoints):
    return checkpoints[request.param]


@pytest.fixture(scope="session")
def no_mtp_checkpoint(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("ckpt") / "nomtp", seed=3, mtp=False)
