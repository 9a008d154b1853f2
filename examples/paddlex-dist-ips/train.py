"""A PaddleX training script run on every machine of `dist_ips` (see cluster.yaml).

PaddleX's `model.train(...)` starts data-parallel training by itself when the
PADDLE_TRAINER_* variables are set, as fabtrain sets them. Replace the body
with your own PaddleX model; this stand-in only checks the environment.
"""
import os

print(f"trainer {os.environ['PADDLE_TRAINER_ID']} of {os.environ['PADDLE_TRAINERS_NUM']}: "
      f"endpoints {os.environ['PADDLE_TRAINER_ENDPOINTS']}", flush=True)
