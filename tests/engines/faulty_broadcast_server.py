"""serve-model that dies mid-broadcast, for tests: ``python faulty_broadcast_server.py MODEL PORT``.

The second bucket of a weight push it receives kills the process (``os._exit``) after its first tensor: a
server lost in the middle of a broadcast. Everything else is the real server (``serve_model``, a real
`HFEngine`, the real gloo group).
"""

import os
import sys

from areal_agents.engines.model_server import ModelServerConfig, broadcast, serve_model

real_receive = broadcast.receive
buckets = 0


def dying_receive(group, names, dtypes, shapes):  # noqa: ANN001, ANN201
    global buckets
    buckets += 1
    if buckets == 2:
        real_receive(group, names[:1], dtypes[:1], shapes[:1])
        os._exit(1)
    return real_receive(group, names, dtypes, shapes)


broadcast.receive = dying_receive

if __name__ == "__main__":
    serve_model(ModelServerConfig(model_path=sys.argv[1], port=int(sys.argv[2])))
