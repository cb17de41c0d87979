"""The config sections: one typed dataclass per YAML section, a help line per key (engine: engine_section.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from areal_agents.config.engine_section import EngineConfig, broadcast_gpu_clash
from areal_agents.config.fields import check_positive, config_field
from areal_agents.config.gateway_section import GatewayConfig


@dataclass
class LoraConfig:
    """A LoRA adapter trained over a frozen base model (PEFT's ``LoraConfig``, the keys users know)."""

    r: int = config_field("rank of the adapter's matrices", default=16)
    alpha: float = config_field("scaling numerator: the update is (alpha / r) B A", default=32.0)
    dropout: float = config_field("dropout on the adapter's input while training", default=0.0)
    target_modules: list[str] = config_field(
        "module names to adapt (q_proj, v_proj, ...), or [all-linear]: every linear layer but the LM head",
        default_factory=lambda: ["all-linear"],
    )

    def __post_init__(self) -> None:
        check_positive(self, "r", "alpha")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expects 0 <= dropout < 1, got {self.dropout}")
        if not self.target_modules:
            raise ValueError("target_modules: expects at least one module name (or all-linear)")


@dataclass
class ModelConfig:
    path: str = config_field("directory of a transformers checkpoint (config, weights, tokenizer)", default="")
    dtype: Literal["float32", "bfloat16", "float16"] = config_field(
        "parameter dtype; float32 on CPU (bf16 is much slower there)", default="float32"
    )
    lora: LoraConfig | None = config_field(
        "train a LoRA adapter over the frozen model (docs/lora.md); unset: train every weight", default=None
    )


@dataclass
class PolicyConfig:
    """One agent's own policy (``policies.AGENT``): its starting model, and its adapter when it trains one."""

    path: str = config_field("its starting model; empty: model.path", default="")
    lora: LoraConfig | None = config_field("train an adapter of its own over the shared base model", default=None)


@dataclass
class EnvConfig:
    id: str = config_field(
        "gymnasium env id (areal_agents/Arithmetic-v0) or module:Class", default="areal_agents/Arithmetic-v0"
    )
    kwargs: dict[str, Any] = config_field("keyword arguments for gymnasium.make", default_factory=dict)
    module: str = config_field("module to import first so that a user env registers itself", default="")
    backend: Literal["local", "server"] = config_field(
        "local: envs in this process; server: through the env-step server (HTTP)", default="local"
    )
    mode: Literal["inline", "thread", "process"] = config_field(
        "how env calls run (locally, or in the launched server): event loop, threads, worker processes",
        default="thread",
    )
    workers: int = config_field("threads or processes running env calls", default=4)
    step_timeout: float = config_field("seconds before a reset/step ends its episode as a timeout", default=60.0)
    server_url: str = config_field("backend server: its URL; empty launches a local server for the run", default="")
    unreachable_timeout_s: float = config_field(
        "backend server: seconds with no env server answering before the run stops (until then, episodes that "
        "cannot reach one fail as env failures and are retried)",
        default=30.0,
    )

    def __post_init__(self) -> None:
        check_positive(self, "workers", "step_timeout", "unreachable_timeout_s")


@dataclass
class RolloutConfig:
    batch_size: int = config_field("prompts per training step", default=16)
    group_size: int = config_field("episodes per prompt (a GRPO group)", default=8)
    max_new_tokens: int = config_field("generation budget per turn", default=32)
    temperature: float = config_field("sampling temperature (the trainer scales logits by the same)", default=1.0)
    top_p: float = config_field("nucleus sampling", default=1.0)
    top_k: int = config_field("top-k sampling; 0 disables", default=0)
    max_concurrent_rollouts: int = config_field(
        "episodes running at once (one frees its place when it ends, though its group runs on); about 1.5x the "
        "engines' running requests keeps them full without a queue",
        default=256,
    )
    max_staleness: int = config_field(
        "batches rollouts may run ahead of training (0 = synchronous; k: samples at most k versions old)", default=0
    )
    dynamic_sampling: bool = config_field("replace groups whose rewards are all equal with new ones", default=False)
    max_retries: int = config_field("retries of an episode that failed by the env or the engine", default=1)
    max_failed_fraction: float = config_field(
        "the run stops (checkpointing its last finished step) when more than this share of the episodes that "
        "ended since the last step failed after their retries; 1 = never",
        default=0.5,
    )
    system_prompt: str = config_field("optional system message placed before the first observation", default="")
    agent: str = config_field(
        "module:Class (an Agent, e.g. a ChatAgent subclass) or module:function (async episode function); "
        "empty = ChatAgent",
        default="",
    )
    agent_kwargs: dict[str, Any] = config_field("keyword arguments of the agent class", default_factory=dict)
    tool_parser: str = config_field(
        "how replies' tool calls are parsed: hermes, mistral, deepseek, harmony, granite, none; auto: from the "
        "tokenizer's chat template",
        default="auto",
    )
    reasoning_parser: str = config_field(
        "how replies' reasoning is split off: think (<think>...</think>), harmony (the analysis channel), none; "
        "auto: from the chat template",
        default="auto",
    )
    chat_template_kwargs: dict[str, Any] = config_field(
        "extra variables of the chat template (e.g. {enable_thinking: false} for Qwen3)", default_factory=dict
    )
    keep_reasoning: bool = config_field(
        "when the template rewrites earlier turns (drops their reasoning): keep the turns as sampled and render "
        "only the new messages, one trajectory per episode; false: start a new segment, as the template renders it",
        default=False,
    )
    source: Literal["env", "gateway"] = config_field(
        "where episodes come from: env (the controller runs agents on env.id) or gateway (live traffic to the "
        "gateway, gateway.*: a step trains batch_size rewarded sessions)",
        default="env",
    )
    dump_trajectories: bool = config_field(
        "write each step's trajectories to run_dir/trajectories/step_N.jsonl and each held-out eval's samples to "
        "run_dir/eval_samples/step_N.jsonl (to inspect what trains: the dashboard's trajectory viewer)",
        default=False,
    )

    def __post_init__(self) -> None:
        check_positive(self, "batch_size", "group_size", "max_new_tokens", "max_concurrent_rollouts")
        check_positive(self, "max_staleness", "max_retries", or_zero=True)
        if not 0 < self.max_failed_fraction <= 1:
            raise ValueError(f"max_failed_fraction: expects a value in (0, 1], got {self.max_failed_fraction!r}")
        if self.max_concurrent_rollouts < self.group_size:
            raise ValueError(
                f"max_concurrent_rollouts: expects at least group_size ({self.group_size}) episodes, a whole group "
                f"at once, got {self.max_concurrent_rollouts}"
            )


@dataclass
class PPOConfig:
    lr: float = config_field("AdamW learning rate", default=1e-4)
    weight_decay: float = config_field("AdamW weight decay", default=0.0)
    warmup_steps: int = config_field("linear learning-rate warm-up, in optimizer steps", default=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = config_field(
        "after warm-up: constant, or decay to 0 over the run (linear or cosine)", default="constant"
    )
    activation_checkpointing: bool = config_field(
        "recompute activations in the backward pass: less memory for long sequences, one more forward of compute",
        default=False,
    )
    max_grad_norm: float = config_field("gradient-norm clip", default=1.0)
    eps_clip: float = config_field("PPO clip range below 1 (and above, unless eps_clip_higher)", default=0.2)
    eps_clip_higher: float | None = config_field("PPO clip range above 1 (DAPO clip-higher)", default=None)
    dual_clip: float | None = config_field("dual-clip bound c > 1 for negative advantages", default=None)
    behav_imp_weight_cap: float | None = config_field(
        "cap on the behavior importance weight exp(logp_prox - logp_behav); null = no cap", default=5.0
    )
    behav_imp_weight_mode: Literal["mask", "clamp"] = config_field(
        "tokens beyond the cap: mask (drop them) or clamp (weight = cap)", default="mask"
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae", "baseline"] = config_field(
        "grpo (group mean/std), dr_grpo (group mean, no std), rloo (leave-one-out), gae (a learned critic), "
        "baseline (reward - the running per-task baseline each trajectory carries: rollout.source=gateway)",
        default="grpo",
    )
    gamma: float = config_field("gae: discount per generated token", default=1.0)
    lam: float = config_field("gae: lambda (bias/variance trade-off)", default=0.95)
    critic_lr: float = config_field("gae: AdamW learning rate of the critic", default=1e-4)
    value_clip: float | None = config_field(
        "gae: clip of the value update around the old values; null = none", default=0.2
    )
    whiten_advantages: bool = config_field("gae: normalise advantages to mean 0, std 1 over the batch", default=True)
    kl_coef: float = config_field("weight of a KL(policy || initial policy) penalty (k3); 0 = none", default=0.0)
    reward_scale: float = config_field("rewards become (r + reward_bias) * reward_scale before advantages", default=1.0)
    reward_bias: float = config_field("added to rewards before scaling", default=0.0)
    reward_clip: float | None = config_field("clip shaped rewards to [-c, c]; null = no clipping", default=None)
    overlong_filtering: bool = config_field(
        "DAPO: truncated trajectories (stop reason length, or out of context) train no loss, yet count in advantages",
        default=False,
    )
    overlong_buffer: int = config_field(
        "DAPO soft overlong punishment: the reward ramps to -overlong_penalty over the last K tokens of rollout."
        "max_new_tokens, by the episode's longest turn (added before reward_bias/scale/clip); 0 = off",
        default=0,
    )
    overlong_penalty: float = config_field("soft overlong punishment: the penalty at max_new_tokens", default=1.0)
    ppo_epochs: int = config_field("passes over each batch", default=1)
    num_minibatches: int = config_field("optimizer steps per epoch", default=1)
    micro_batch_tokens: int = config_field("token budget of one forward/backward micro-batch", default=16384)
    cpu_threads: int = config_field(
        "intra-op CPU threads of the trainer's updates (split among nproc_per_node ranks); 0 = auto: the usable "
        "cores less one for the event loop, less the local engines' when rollouts overlap updates (max_staleness "
        "> 0); at most OMP_NUM_THREADS",
        default=0,
    )
    trainer: Literal["thread", "process"] = config_field(
        "where updates run: a thread of the run's process, or a process of their own (local runs; with "
        "max_staleness > 0 on a small machine, rollouts and updates then stop sharing one GIL)",
        default="thread",
    )
    packing: bool = config_field(
        "pack micro-batches without padding (attention stays within each sequence); false: padded rows", default=True
    )
    share_prompts: bool = config_field(
        "with packing: a row holds each distinct prompt once and its completions attend to it "
        "(a group's prompt is computed once, not group_size times; the same logprobs and gradients)",
        default=True,
    )
    filter_zero_variance_groups: bool = config_field("drop groups whose rewards are all equal", default=True)
    device: Literal["auto", "cpu", "cuda"] = config_field(
        "the trainer's device; auto: cuda when torch sees a GPU, else cpu", default="auto"
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = config_field(
        "forward/backward dtype (weights and optimizer state stay model.dtype); auto: bfloat16 on cuda, float32 on cpu",
        default="auto",
    )
    nproc_per_node: int = config_field(
        "trainer ranks on this machine, FSDP2-sharded (gloo on CPU, NCCL on GPUs), each in a process of its own",
        default=1,
    )
    peak_tflops: float = config_field(
        "the trainer device's dense peak TFLOP/s at compute_dtype, for perf/mfu; 0: the GPU kind's (docs/gpu.md)",
        default=0.0,
    )
    behav_seq_ratio_min: float | None = config_field(
        "sequence-level mismatch mask: leave out a trajectory whose geometric-mean pi_prox/pi_behav is below this",
        default=None,
    )
    behav_seq_ratio_max: float | None = config_field(
        "sequence-level mismatch mask: leave out a trajectory whose geometric-mean pi_prox/pi_behav is above this",
        default=None,
    )
    stream_updates: bool = config_field(
        "with max_staleness > 0, one optimizer step a batch and group advantages (grpo, dr_grpo, rloo), and a "
        "local trainer: start forward/backward on a batch's finished groups while its last still generate (the "
        "same gradient)",
        default=True,
    )

    def __post_init__(self) -> None:
        check_positive(self, "lr", "eps_clip", "ppo_epochs", "num_minibatches", "micro_batch_tokens")
        check_positive(self, "kl_coef", "cpu_threads", "overlong_buffer", "overlong_penalty", or_zero=True)
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip: expects a value > 1, got {self.dual_clip}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: expects a value in [0, 1], got {getattr(self, name)!r}")
        check_positive(self, "critic_lr")
        check_positive(self, "nproc_per_node")
        check_positive(self, "peak_tflops", or_zero=True)
        low, high = self.behav_seq_ratio_min, self.behav_seq_ratio_max
        if low is not None and high is not None and not 0 <= low < 1 < high:
            raise ValueError(f"behav_seq_ratio_min/max: expects 0 <= min < 1 < max, got {low}, {high}")


@dataclass
class EvalConfig:
    num_problems: int = config_field(
        "held-out problems (distinct first observations); sft: 0 = no held-out evaluation", default=200
    )
    seed: int = config_field("seed of the held-out set (fixed across runs)", default=0)
    every: int = config_field("evaluate every N steps; 0 = only before and after training", default=0)
    n_samples: int = config_field("train: episodes per problem; accuracy is avg@n, pass@n is logged too", default=1)
    temperature: float = config_field("train: evaluation sampling temperature (0 = greedy)", default=0.0)
    top_p: float = config_field("train: evaluation nucleus sampling", default=1.0)
    env_kwargs: dict[str, Any] = config_field(
        "overrides of env.kwargs for evaluation (e.g. split: test)", default_factory=dict
    )

    def __post_init__(self) -> None:
        check_positive(self, "num_problems", or_zero=True)
        check_positive(self, "n_samples")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature >= 0 and 0 < top_p <= 1 expected, got {self.temperature}, {self.top_p}")


@dataclass
class RayConfig:
    address: str = config_field(
        "Ray cluster to join ('auto' or 'ray://host:10001'); empty starts a local cluster for the run", default=""
    )
    num_cpus: int = config_field("a local cluster's CPUs; 0 = this machine's cores", default=0)
    env_servers: int = config_field("env-step server actors (replicas behind one RemoteEnvPool)", default=1)
    rollout_workers: int = config_field("rollout worker actors (each runs its share of the episodes)", default=1)
    trainer_ranks: int = config_field("data-parallel trainer ranks (a torch.distributed group of actors)", default=1)
    env_server_cpus: float = config_field("CPUs each env server reserves (fractions are fine)", default=1.0)
    rollout_worker_cpus: float = config_field("CPUs each rollout worker reserves", default=1.0)
    trainer_cpus: float = config_field("CPUs each trainer rank reserves", default=1.0)
    engine_server_cpus: float = config_field("CPUs each model server reserves", default=1.0)
    trainer_gpus: float = config_field("GPUs each trainer rank reserves (NCCL between ranks when > 0)", default=0.0)
    engine_server_gpus: float = config_field("GPUs each model server reserves (sglang: engine.tp)", default=0.0)
    max_restarts: int = config_field("restarts of a dead env server or rollout worker actor", default=3)
    recovery_timeout_s: float = config_field(
        "seconds to wait for a restarting actor before the run fails with the reason", default=120.0
    )

    def __post_init__(self) -> None:
        check_positive(self, "env_servers", "rollout_workers", "trainer_ranks")


@dataclass
class TimelineConfig:
    """The run's timeline, ``RUN/timeline/``: each worker's busy time, the queues, the events (docs/observability)."""

    enabled: bool = config_field(
        "record it (the TensorBoard heatmap, `areal-agents trace`, the dashboard and the bottleneck report read it)",
        default=True,
    )
    bin_ms: float = config_field("bin width in ms: busy time and queue depths per bin", default=100.0)
    max_mib: float = config_field(
        "each process's file: spans stop at half of it (those of steps go on), past it the bins widen", default=64.0
    )
    heatmap_every: int = config_field("a workers x time heatmap to TensorBoard every N steps; 0 = none", default=1)

    def __post_init__(self) -> None:
        check_positive(self, "bin_ms", "max_mib")
        check_positive(self, "heatmap_every", or_zero=True)


@dataclass
class TrainConfig:
    """`areal-agents train`: decoupled-PPO RL on an env."""

    run_dir: str = config_field("where checkpoints, TensorBoard logs and the summary go", default="runs/train")
    seed: int = config_field("seed for torch, sampling and training prompts", default=1)
    steps: int = config_field("training steps (one rollout batch each)", default=100)
    max_train_minutes: float = config_field(
        "also stop once this invocation's training steps (rollout + update; start-up and evals excluded) "
        "took this many minutes: a wall budget; 0 = none (lr schedules still span `steps`)",
        default=0.0,
    )
    save_every: int = config_field("checkpoint every N steps; 0 = only at the end", default=0)
    save_every_minutes: float = config_field(
        "also checkpoint when this many minutes passed since the last; 0 = off", default=0.0
    )
    keep_checkpoints: int = config_field("keep the newest K checkpoints (resume uses the newest); 0 = all", default=3)
    model: ModelConfig = field(default_factory=ModelConfig)
    policies: dict[str, str | PolicyConfig] = config_field(
        "separate policies: agent id -> starting model path (its own copy and engine), or {path, lora} (lora: its "
        "own adapter over one base model and one engine); empty = one policy (model.path) shared by every agent",
        default_factory=dict,
    )
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    launcher: Literal["local", "ray"] = config_field(
        "local: one process (plus servers); ray: the same run on a Ray cluster (see ray.*)", default="local"
    )
    ray: RayConfig = field(default_factory=RayConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        check_positive(self, "steps")
        check_positive(self, "max_train_minutes", or_zero=True)
        if self.eval.num_problems == 0:
            raise ValueError("eval.num_problems: train measures held-out accuracy; expects a value > 0, got 0")
        budget, buffer = self.rollout.max_new_tokens, self.ppo.overlong_buffer
        if buffer > budget:
            raise ValueError(f"ppo.overlong_buffer: expects at most rollout.max_new_tokens ({budget}), got {buffer}")
        if self.engine.weight_sync == "in_process":
            shared = self.rollout.max_staleness == 0 and self.ppo.trainer == "thread" and self.ppo.nproc_per_node == 1
            if not shared or self.engine.own_process or self.launcher == "ray":
                raise ValueError(
                    "engine.weight_sync: in_process shares the trainer's tensors with the engine, so it needs "
                    "rollout.max_staleness=0, ppo.trainer=thread, ppo.nproc_per_node=1, engine.own_process=false "
                    "and launcher=local (or use weight_sync=auto, which copies)"
                )
        if self.ppo.nproc_per_node > 1 and self.launcher == "ray":
            raise ValueError("ppo.nproc_per_node: for local runs; with launcher=ray set ray.trainer_ranks")
        if self.ppo.trainer == "process" and self.launcher == "ray":
            raise ValueError(
                "ppo.trainer: 'process' is for local runs; with launcher=ray the trainer ranks are Ray actors"
            )
        self._check_lora()
        self._check_broadcast()
        self._check_source()

    def _check_source(self) -> None:
        """The gateway serves one policy, and its baseline advantage needs the gateway's running baselines."""
        if self.rollout.source == "gateway":
            if self.policies:
                raise ValueError("rollout.source: the gateway serves one shared policy; leave policies empty")
            if self.launcher != "local":
                raise ValueError("rollout.source: the gateway runs in the run's process (launcher=local)")
        elif self.ppo.advantage == "baseline":
            raise ValueError("ppo.advantage: baseline needs the gateway's running baselines (rollout.source=gateway)")

    def _check_broadcast(self) -> None:
        """A trainer in the run's process on CUDA cannot broadcast to servers on its own GPU (the launcher checks
        ``ppo.device=auto`` once it is resolved: `LocalLauncher`)."""
        in_process = self.launcher == "local" and self.ppo.trainer == "thread" and self.ppo.nproc_per_node == 1
        clash = broadcast_gpu_clash(self.engine)
        if clash is not None and in_process and self.ppo.device == "cuda":
            raise ValueError(f"ppo.device=cuda: {clash}")

    def _check_lora(self) -> None:
        """LoRA policies share one base model, whose engine gets their adapters by their own sync."""
        loras = {name: p for name, p in self.policies.items() if not isinstance(p, str) and p.lora is not None}
        if self.model.lora is None and not loras:
            return
        if self.model.lora is not None and self.policies:
            raise ValueError("model.lora: with separate policies, give each its own (policies.AGENT.lora)")
        where = "model.lora" if self.model.lora is not None else f"policies.{next(iter(loras))}.lora"
        if self.engine.weight_sync not in ("auto", "disk"):
            raise ValueError(f"{where}: adapters reach the engine by their own sync; engine.weight_sync must be auto")
        bases = {p.path or self.model.path for p in loras.values()}
        if len(bases) > 1:
            raise ValueError(f"policies: LoRA policies share one base model, got {sorted(bases)}")


@dataclass
class SFTConfig:
    """`areal-agents sft`: supervised fine-tuning on chat conversations (the RL warm start)."""

    run_dir: str = config_field("where the fine-tuned model, logs and summary go", default="runs/sft")
    seed: int = config_field("seed for torch and data order", default=1)
    data: str = config_field(
        "JSONL file, one {'messages': [{'role', 'content'}, ...], 'tools': optional OpenAI schemas} per line",
        default="",
    )
    chat_template_kwargs: dict[str, Any] = config_field(
        "extra variables of the chat template (e.g. {enable_thinking: false} for Qwen3)", default_factory=dict
    )
    steps: int = config_field("optimizer steps", default=200)
    batch_size: int = config_field("sequences per step (a conversation a template splits gives several)", default=64)
    lr: float = config_field("AdamW learning rate", default=1e-3)
    weight_decay: float = config_field("AdamW weight decay", default=0.0)
    warmup_steps: int = config_field("linear learning-rate warm-up", default=10)
    max_grad_norm: float = config_field("gradient-norm clip", default=1.0)
    micro_batch_tokens: int = config_field("token budget of one forward/backward micro-batch", default=16384)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    max_new_tokens: int = config_field("generation budget per turn during evaluation", default=32)
    device: Literal["auto", "cpu", "cuda"] = config_field(
        "where it trains and evaluates; auto: cuda when torch sees a GPU, else cpu", default="auto"
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = config_field(
        "forward/backward dtype (weights stay model.dtype); auto: bfloat16 on cuda, float32 on cpu", default="auto"
    )

    def __post_init__(self) -> None:
        check_positive(self, "steps", "batch_size", "lr", "micro_batch_tokens")
