"""This project's fabtrain tasks: `fab --list`."""
from fabtrain.tasks import *  # noqa: F401,F403
