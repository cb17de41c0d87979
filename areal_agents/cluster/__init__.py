"""Running a training run on a Ray cluster (``launcher: ray``): the same config, the same recipe.

Env-step servers, model servers, rollout workers and data-parallel trainer ranks become Ray actors;
the rollout controller (staleness gate and ledger) and the training loop stay in the driver.
Sits beside ``trainers``: the RL recipe reaches it only when ``launcher=ray``.
"""
