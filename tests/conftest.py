import pytest
import transformers

from areal_agents.models import load_model, load_tokenizer, save_tiny_model

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A freshly built tiny model + tokenizer, saved as a real checkpoint directory."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, intermediate_size=128)


@pytest.fixture
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture
def model(tiny_dir):
    return load_model(tiny_dir)
