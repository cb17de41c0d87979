"""What `torch.compile` would gain on the engine's decode step: `LlamaDecodeStep.layers` eager against compiled.

    .venv/bin/python bench/decode_compile.py [--hidden 128,512] [--rows 64,256] [--dynamic]

The decode step of a tiny Llama (heads of 32, MLP twice the width; 4 layers at hidden 128, 8 above), one
token a row, its attention replaced by an elementwise stand-in so that the whole step is one graph: the best
case for a compile (the real attention reads a KV cache of changing segments and widths, which would break
the graph or recompile it), its fused weights made once beforehand. Same weights, same inputs, alternated
timings (medians of 5 runs of 20 steps, one thread); the compile's warm-up and the largest difference of the
hidden states are printed. Figures and the machine: docs/benchmarks.md. `engines/hf/compiled_decode.py`
runs the real step this way, its attention an opaque op in the graph.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from areal_agents.engines.hf.decode_step import LlamaDecodeStep
from areal_agents.models import load_model, save_tiny_model


def stand_in(index: int, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Not attention: ``q * k + v``, as many elementwise ops' worth as a graph would keep."""
    return (q * k + v).reshape(len(q), -1)


def timed(layers, ids: torch.Tensor, positions: torch.Tensor, steps: int = 20) -> float:  # noqa: ANN001
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(steps):
            layers(ids, positions, stand_in)
    return 1000 * (time.perf_counter() - start) / steps


def measure(hidden: int, rows: int, dynamic: bool) -> None:
    layers_n = 4 if hidden <= 128 else 8
    path = save_tiny_model(
        tempfile.mkdtemp(),
        hidden_size=hidden,
        num_layers=layers_n,
        num_heads=hidden // 32,
        intermediate_size=2 * hidden,
    )
    step = LlamaDecodeStep.of(load_model(str(path)))
    body = step.model.model.layers
    fused = [step._weights(i, layer) for i, layer in enumerate(body)]
    step._weights = lambda index, layer: fused[index]  # made once, outside the graph (its checks would break it)
    ids = torch.randint(0, step.model.config.vocab_size, (rows,))
    positions = torch.randint(0, 200, (rows,))
    start = time.perf_counter()
    compiled = torch.compile(step.layers, dynamic=dynamic)
    with torch.inference_mode():
        differ = (compiled(ids, positions, stand_in) - step.layers(ids, positions, stand_in)).abs().max().item()
    warm = time.perf_counter() - start
    eager, compiled_ms = [], []
    for _ in range(5):
        eager.append(timed(step.layers, ids, positions))
        compiled_ms.append(timed(compiled, ids, positions))
    e, c = statistics.median(eager), statistics.median(compiled_ms)
    print(
        f"hidden {hidden} x {layers_n} layers, {rows} rows: eager {e:.2f} ms, compiled {c:.2f} ms a step, "
        f"ratio {e / c:.2f}x (compile {warm:.1f} s; max difference {differ:.1e})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="128,512")
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes (default: static)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    print(f"== bench/decode_compile == torch {torch.__version__}, {'dynamic' if args.dynamic else 'static'} shapes")
    for hidden in (int(h) for h in args.hidden.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            measure(hidden, rows, args.dynamic)


if __name__ == "__main__":
    main()
