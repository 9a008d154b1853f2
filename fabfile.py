"""This checkout is a fabtrain project like any other: its tasks come from the package."""
from fabtrain.tasks import *  # noqa: F401,F403
