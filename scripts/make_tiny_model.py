"""Build a model of the RL loop (`--preset tiny`: the embedded default; `small`: the results model), warmed up on
multi-digit addition (see trace_rl/warmup.py): `trace-rl make-model`, kept as a script for the container image."""

import sys

from trace_rl.cli import main

if __name__ == "__main__":
    main(["make-model", *sys.argv[1:]])
