"""A program written for `mpirun`, as PaddlePaddle's cluster-training guide's train.py is:
it reads its place only from OMPI_COMM_WORLD_RANK (and _SIZE) and refuses to start without it.

    python tests/programs/ompi_train.py OUT_DIR     # writes OUT_DIR/ompi-rank-<rank>.json
"""
import json
import os
import sys

if "OMPI_COMM_WORLD_RANK" not in os.environ:
    sys.exit("OMPI_COMM_WORLD_RANK is not set: start me with mpirun")
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
place = {key: int(os.environ[f"OMPI_COMM_WORLD_{key.upper()}"]) for key in ("size", "local_rank", "local_size")}
with open(os.path.join(sys.argv[1], f"ompi-rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, **place, "fabtrain_rank": os.environ.get("FABTRAIN_RANK")}, f)
