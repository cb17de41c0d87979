"""GPU smoke test of the SGLang path: launch, generate with logprobs, interrupt with a weight update, check.

    bash scripts/gpu_smoke.sh /models/Qwen2.5-0.5B-Instruct [--nccl]

Needs a GPU machine with SGLang installed and a small Qwen checkpoint on local disk. Steps, each
printed as PASS/FAIL:
1. launch ``python -m sglang.launch_server`` through the launcher (engine.backend=sglang), wait for /health;
2. generate 8 requests with logprobs; compare them to a transformers forward pass of the same weights;
3. start 16 long generations, update weights from disk mid-way (a perturbed copy of the checkpoint),
   resume; every response complete, versions non-decreasing and switching once, logprobs after the
   switch matching a forward pass of the new weights;
4. with ``--nccl``: the same update through /init_weights_update_group + /update_weights_from_distributed.
Exit code 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import launch_servers
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.types import GenRequest, SamplingParams

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


@torch.inference_mode()
def forward_logprobs(model, ids: list[int], n_out: int) -> torch.Tensor:
    logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float()
    target = torch.tensor(ids[1:], device=model.device)
    return torch.log_softmax(logits, -1).gather(1, target[:, None]).squeeze(1)[-n_out:].cpu()


def close(ours: list[float], ref: torch.Tensor, tol_mean: float) -> tuple[bool, str]:
    diff = (torch.tensor(ours) - ref).abs()
    return bool(diff.mean() <= tol_mean), f"(mean |dlogprob| {diff.mean():.4f}, max {diff.max():.4f})"


async def main_async(args) -> None:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    reference = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).cuda().eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a long story about the number {i}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(16)
    ]
    start = time.perf_counter()
    servers = launch_servers(EngineConfig(backend="sglang", mem_fraction=0.5), args.model, "bfloat16")
    check("launch", True, f"({time.perf_counter() - start:.0f}s, {servers.addresses[0]})")
    engine = SGLangEngine(servers.addresses, weights_dir=tempfile.mkdtemp(prefix="gpu-smoke-"))
    try:
        responses = await asyncio.gather(
            *(engine.agenerate(GenRequest(f"g{i}/t0", p, SamplingParams(64))) for i, p in enumerate(prompts[:8]))
        )
        check("generate", all(len(r.output_tokens) > 0 for r in responses))
        diffs = [close(r.output_logprobs, forward_logprobs(reference, p + r.output_tokens, len(r.output_tokens)), 0.05)
                 for p, r in zip(prompts, responses)]  # fmt: skip
        check("logprobs vs transformers", all(ok for ok, _ in diffs), diffs[0][1])

        new_dir = Path(tempfile.mkdtemp(prefix="gpu-smoke-new-"))
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        reference.save_pretrained(new_dir)
        tokenizer.save_pretrained(new_dir)
        n = 1024
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(f"u{i}/t0", p, SamplingParams(n, ignore_eos=True))))
            for i, p in enumerate(prompts)
        ]
        await asyncio.sleep(2.0)
        t0 = time.perf_counter()
        await engine.update_weights_from_disk(str(new_dir), version=1)
        check("update_weights_from_disk", True, f"(pause -> load -> continue {time.perf_counter() - t0:.2f}s)")
        responses = await asyncio.gather(*tasks)
        complete = all(len(r.output_tokens) == n for r in responses)
        versions_ok = all(r.output_versions == sorted(r.output_versions) for r in responses)
        switched = [r for r in responses if 0 in r.output_versions and 1 in r.output_versions]
        check("interrupted generations complete", complete and versions_ok, f"({len(switched)}/16 switched mid-way)")
        if switched:
            r, p = switched[0], prompts[responses.index(switched[0])]
            k = r.output_versions.index(1)
            ok, detail = close(r.output_logprobs[k:], forward_logprobs(reference, p + r.output_tokens, n - k), 0.05)
            check("logprobs after the switch vs new weights", ok, detail)

        if args.nccl:
            import torch.distributed as dist  # noqa: PLC0415
            from sglang.srt.utils import init_custom_process_group  # noqa: PLC0415

            port = 29555
            world = 1 + len(servers.addresses)
            group_future = asyncio.to_thread(
                init_custom_process_group,
                backend="nccl",
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=world,
                rank=0,
                group_name="weight_update_group",
            )
            _, group = await asyncio.gather(engine.init_weights_update_group("127.0.0.1", port), group_future)
            named = [(name, p.data) for name, p in reference.named_parameters()]
            broadcast = lambda t: dist.broadcast(t, src=0, group=group)  # noqa: E731
            await engine.update_weights_from_distributed(named, broadcast, version=2)
            r = await engine.agenerate(GenRequest("n/t0", prompts[0], SamplingParams(32)))
            check("NCCL weight update", set(r.output_versions) == {2})
    finally:
        await engine.aclose()
        servers.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local directory of a small Qwen checkpoint")
    parser.add_argument("--nccl", action="store_true", help="also test the NCCL weight-update path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke: no CUDA device here")
    asyncio.run(main_async(args))
    print("gpu_smoke:", "all passed" if not FAILED else f"FAILED: {', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
