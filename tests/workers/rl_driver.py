"""An RL job's driver in a process of its own, as a multi-node job's driver is: ``argv[1]`` is the RL
config as JSON (``rl.config.RLConfig.from_dict``); prints ``{"placement", "history"}`` as one JSON line.
(Run in the pytest process after other Ray jobs, the trainer's first actor was cancelled before it ran.)
The run sits under ``__main__``: the reward pool's workers are started with ``spawn``, which imports the
driver's main module again in every worker (an unguarded ``run`` there re-ran the job and exited 1)."""

import json
import sys

from rl.config import RLConfig
from rl.driver import run

if __name__ == "__main__":
    res = run(RLConfig.from_dict(json.loads(sys.argv[1])))
    print(json.dumps({"placement": res["placement"], "history": res["history"]}))
