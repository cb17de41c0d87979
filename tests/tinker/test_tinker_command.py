"""``areal-agents serve-tinker``'s flags: mistakes are one line naming the flag, before any model loads or any
port opens (in process: the command fails before it would serve)."""

import pytest
import torch

from areal_agents.cli import main


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--base-model", "nodir"], "--base-model: expects NAME=DIR, got 'nodir'"),
        (["--base-model", "m=/no/such/dir"], "--base-model m: /no/such/dir is not a checkpoint directory"),
        ([], "--base-model: expects at least one NAME=DIR (or --tiny-families)"),
        (["--tiny-families", "--nproc-per-node", "0"], "--nproc-per-node: expects an integer >= 1, got 0"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(flags, message, tmp_path, capsys):
    assert main(["serve-tinker", "--checkpoint-root", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines whose torch sees no GPU")
def test_device_cuda_without_a_gpu_is_refused_before_anything_loads(tiny_dir, tmp_path, capsys):
    argv = ["serve-tinker", "--checkpoint-root", str(tmp_path), f"--base-model=t={tiny_dir}", "--device", "cuda"]
    assert main(argv) == 2
    assert "device: cuda asked for, but torch sees no GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing written under the checkpoint root"
