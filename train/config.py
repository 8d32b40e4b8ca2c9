"""The run configuration moved to memlm.config.run; this name stays for scripts that import it."""

from memlm.config.run import *  # noqa: F403
from memlm.config.run import Config, compose, from_yaml, to_yaml  # noqa: F401
