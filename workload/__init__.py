"""fabtrain's reference training job.

Two ways to train the same models on the same data shards:

* parameter-server mode, after PaddlePaddle v2 cluster training:
  ``python -m workload.pserver`` holds the parameters, ``python -m workload.trainer``
  computes gradients on its shard (sync or async SGD);
* collective mode: ``python -m workload.ddp`` (DDP or FSDP), started once per rank
  with the torch environment, or under ``torchrun``.

The job knows nothing of the orchestrator except the environment it is given
and the metrics file it writes. See docs/workload.md.
"""
import warnings

# torch warns on import when numpy is missing; the workload never uses numpy,
# and the warning would land in every log as if something were wrong.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
