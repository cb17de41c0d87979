import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_agents.errors import ArealAgentsError, ModelLoadError
from areal_agents.models import load_model, load_tokenizer, save_tiny_model


def test_default_tiny_model_is_under_one_million_parameters(tmp_path):
    model = load_model(save_tiny_model(tmp_path))
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000


def test_loads_through_auto_classes(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama"
    assert "Qwen2" not in type(tok).__name__  # the pitfall: a reload that changes splitting
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("text", ["12+34=", "Wrong. Try again:  7*8=\n", "def f(x):\n\treturn {'a': x}", " ~`|\\"])
def test_decode_encode_round_trip_after_reload(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_chatml(tokenizer):
    msgs = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
    ids = tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="model path does not exist: .*missing"):
        load_model(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_tokenizer(tmp_path)


SMALL = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}


def test_saving_onto_a_non_empty_directory_or_a_file_names_the_path(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ArealAgentsError, match=r"tiny model path '.*taken' already exists and is a directory that"):
        save_tiny_model(taken, **SMALL)
    with pytest.raises(ArealAgentsError, match=r"'.*a_file' already exists and is a file: choose a new path"):
        save_tiny_model(a_file, **SMALL)
    assert (taken / "notes.txt").read_text() == "mine" and a_file.read_text() == "mine"  # untouched


def test_overwrite_writes_over_an_existing_model(tmp_path):
    save_tiny_model(tmp_path / "m", seed=0, **SMALL)
    save_tiny_model(tmp_path / "m", seed=1, overwrite=True, **SMALL)
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    assert (save_tiny_model(a_file, overwrite=True, **SMALL) / "config.json").is_file()


def test_cli_tiny_model_onto_an_existing_model_is_one_line_exit_2(tmp_path, capsys):
    from areal_agents.cli import main

    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["tiny-model", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and str(out) in err


def test_qwen3_preset_is_qwen3_06b_decoder_at_04b_parameters():
    """Counted on the meta device (no memory, no init): Qwen3-0.6B's decoder over our 100-token vocabulary."""
    from areal_agents.models.tiny import PRESETS, build_tiny_model

    with torch.device("meta"):
        model = build_tiny_model(100, **PRESETS["qwen3-0.4b"])
    c = model.config
    assert c.model_type == "qwen3" and c.tie_word_embeddings
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (1024, 28, 16, 8)
    # per layer: q 1024x2048, k and v 1024x1024, o 2048x1024, MLP 3 x 1024x3072, norms: 15.73M; x 28 = 440.4M
    assert 0.43e9 < sum(p.numel() for p in model.parameters()) < 0.45e9


def test_small_qwen3_round_trips_with_the_char_tokenizer(tmp_path):
    """A qwen3 checkpoint keeps our tokenizer (a qwen2 one would reload as Qwen2Tokenizer and drop spaces)."""
    path = save_tiny_model(
        tmp_path, preset="qwen3-0.4b", **SMALL, num_kv_heads=1, head_dim=8, max_position_embeddings=64
    )
    tok, model = load_tokenizer(path), load_model(path)
    assert model.config.model_type == "qwen3" and model.config.max_position_embeddings == 64
    assert "Qwen2" not in type(tok).__name__
    assert tok.decode(tok.encode("1 + 2 = 3", add_special_tokens=False)) == "1 + 2 = 3"


def test_unknown_preset_names_the_key_and_a_near_match(tmp_path):
    with pytest.raises(
        ArealAgentsError, match=r"preset: expects one of tiny, qwen3-0.4b, got 'qwen3-04b'.*'qwen3-0.4b'"
    ):
        save_tiny_model(tmp_path, preset="qwen3-04b")
    assert not any(tmp_path.iterdir())  # nothing written


def test_cli_tiny_model_preset(tmp_path, capsys):
    from areal_agents.cli import main

    assert main(["tiny-model", str(tmp_path / "bad"), "--preset", "qwen"]) == 2
    assert "preset: expects one of" in capsys.readouterr().err
    assert main(["tiny-model", str(tmp_path / "m"), "--preset", "tiny", "--context", "64"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 64


def test_default_family_is_char_with_its_eos_as_the_one_stop_token(tiny_dir):
    from transformers import GenerationConfig

    from areal_agents.models import family_of

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert family_of(tok) is None and len(tok) == 101  # 3 ChatML specials, <unk>, 97 characters
    assert (
        GenerationConfig.from_pretrained(tiny_dir).eos_token_id
        == tok.eos_token_id
        == tok.convert_tokens_to_ids("<|im_end|>")
    )
