"""serve-model with simulated faults, for tests: ``python faulty_serve_model.py MODEL PORT``.

A /generate whose rid is ``kill-the-loop`` makes the decode loop itself fail (an error outside any one
request's prefill or decode); one whose rid is ``hang`` makes the decode thread hang in its step. Everything
else is the real server (``serve_model`` on a real `HFEngine`); `HFEngine.stall_s` is 2 s, so a hung step
shows in /health at once.
"""

import sys
import time

from areal_agents.engines.hf.batch_runner import BatchRunner
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server import ModelServerConfig, serve_model

real_step = BatchRunner.step


def faulty_step(self, batch, incoming, stale, version, adapters=frozenset()):  # noqa: ANN001, ANN201
    rids = {seq.rid for seq in incoming}
    if "kill-the-loop" in rids:
        raise RuntimeError("simulated decode-loop fault")
    if "hang" in rids:
        while True:  # a step that never ends (holds no lock; sleeps, as a stuck kernel would wait)
            time.sleep(1)
    return real_step(self, batch, incoming, stale, version, adapters)


BatchRunner.step = faulty_step
HFEngine.stall_s = 2.0

if __name__ == "__main__":
    args = sys.argv[1:]
    model, port = args[0], int(args[1])
    version = args[args.index("--weight-version") + 1] if "--weight-version" in args else "default"
    serve_model(ModelServerConfig(model_path=model, port=port, weight_version=version))
